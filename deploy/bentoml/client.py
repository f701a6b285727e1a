"""Calls the service with BentoML's own client and prints one JSON line (used by
tests/python/test_bentoml.py; also an example):

    python deploy/bentoml/client.py http://127.0.0.1:3000
"""
import json
import sys

import bentoml
import numpy as np


def main(url):
    result = {}
    with bentoml.SyncHTTPClient(url, timeout=120) as client:
        result["ready"] = client.is_ready(timeout=60)
        texts = ["wasmtron serves this in process", "BentoML calls it", ""]
        embeddings = np.asarray(client.embed(texts=texts))
        result["embeddings"] = embeddings.tolist()
        result["simple"] = client.infer(model="simple", inputs={
            "INPUT0": [list(range(16))], "INPUT1": [[1] * 16]}, outputs=["OUTPUT1"])
        try:
            client.infer(model="simple", inputs={"INPUT0": [list(range(16))]})
            result["bad_request"] = None
        except bentoml.exceptions.BentoMLException as e:
            result["bad_request"] = {"status": int(getattr(e, "error_code", 0)), "message": str(e)}
        try:
            client.infer(model="ghost", inputs={})
            result["unknown_model"] = None
        except bentoml.exceptions.BentoMLException as e:
            result["unknown_model"] = {"status": int(getattr(e, "error_code", 0)), "message": str(e)}
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1])
