"""PyTriton in one script, as its examples also write it: an inference callable over the
request list (no decorator), `triton.run()`, a client in the same process, `triton.stop()`.
Strings in and out; ports from PYTRITON_TRITON_CONFIG_* variables. Prints JSON answers."""
import json
import os

import numpy as np

from pytriton.client import ModelClient
from pytriton.model_config import ModelConfig, Tensor
from pytriton.triton import Triton, TritonConfig


def greet(requests):
    answers = []
    for request in requests:
        names = np.char.decode(request["name"].astype(np.bytes_), "utf-8")
        greeting = np.char.add("Hello, ", names)
        answers.append({"greeting": np.char.encode(greeting, "utf-8"),
                        "length": np.char.str_len(names).astype(np.int32)})
    return answers


port = int(os.environ["PYTRITON_TRITON_CONFIG_HTTP_PORT"])
triton = Triton(config=TritonConfig(http_port=port))
triton.bind(
    model_name="Greeter",
    infer_func=greet,
    inputs=[Tensor(name="name", dtype=bytes, shape=(1,))],
    outputs=[Tensor(name="greeting", dtype=bytes, shape=(1,)),
             Tensor(name="length", dtype=np.int32, shape=(1,))],
    config=ModelConfig(max_batch_size=4),
)
triton.run()
answers = {}
with ModelClient(f"http://127.0.0.1:{port}", "Greeter", init_timeout_s=120) as client:
    names = np.char.encode(np.array([["Ada"], ["Grace"]]), "utf-8")
    result = client.infer_batch(names)
    answers["greeting"] = [g.decode() for g in result["greeting"].reshape(-1)]
    answers["length"] = result["length"].reshape(-1).tolist()
    answers["sample"] = client.infer_sample(np.array([b"Linus"]))["greeting"][0].decode()
triton.stop()
print(json.dumps(answers))
