"""A PyTriton client as its examples write one: ModelClient(url, name) with infer_batch and
infer_sample; prints the answers as JSON for the test to compare."""
import json
import sys

import numpy as np

from pytriton.client import ModelClient

url = sys.argv[1]
batch = np.arange(12, dtype=np.float32).reshape(3, 4)
answers = {}
with ModelClient(url, "Linear", init_timeout_s=120) as client:
    answers["linear_batch"] = client.infer_batch(batch)["OUTPUT_1"].tolist()
    answers["linear_sample"] = client.infer_sample(batch[1])["OUTPUT_1"].tolist()
with ModelClient(url, "Scaled", init_timeout_s=120) as client:
    scale = np.full((3, 1), 0.5, dtype=np.float32)
    answers["scaled"] = client.infer_batch(data=batch, scale=scale)["scaled"].tolist()
with ModelClient(url, "Texts", init_timeout_s=120) as client:
    text = np.array([[b"Hello", b"World"], [b"MiXeD", b"case"]], dtype=object)
    mode = np.array([[b"upper"], [b"lower"]], dtype=object)
    answers["texts"] = [[t.decode() for t in row] for row in client.infer_batch(text=text, mode=mode)["out"]]
print(json.dumps(answers))
