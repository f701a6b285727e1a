#!/usr/bin/env python3
"""Per-call latency of `simple` and of the `embed_text` ensemble (one sentence) from Python:
wasmtron in-process (the `wasmtron` package, `make python-package`) against tritonclient over
gRPC and HTTP to the wasmtron binary serving the same repository on loopback, side by side in
one run, at 1 and 8 concurrent callers. The Rust floor (the same calls to `Server::infer` with
no Python) is `cargo bench -p wasmtron --bench server_inprocess`.

    .venv/bin/python benches/python_inprocess.py [calls per caller, default 2000]
"""
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

import wasmtron

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(ROOT, "tests", "python"))
from conftest import Server as BinaryServer  # noqa: E402  (starts the built binary)

CALLS = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
A = np.arange(16, dtype=np.int32).reshape(1, 16)
B = np.ones((1, 16), dtype=np.int32)
TEXT = np.array([[b"wasmtron serves this sentence in process"]], dtype=object)
# model -> its inputs: (name, array, Triton datatype)
MODELS = {"simple": [("INPUT0", A, "INT32"), ("INPUT1", B, "INT32")],
          "embed_text": [("TEXT", TEXT, "BYTES")]}


def measure(make_call, callers):
    """p50 and p99 in microseconds and calls per second of `callers` threads, each making
    CALLS calls with its own client."""
    def run(_):
        call = make_call()
        for _ in range(50):
            call()
        times = []
        for _ in range(CALLS):
            t = time.perf_counter()
            call()
            times.append(time.perf_counter() - t)
        return times

    start = time.perf_counter()
    with ThreadPoolExecutor(callers) as pool:
        times = [t for ts in pool.map(run, range(callers)) for t in ts]
    took = time.perf_counter() - start
    times.sort()
    return (1e6 * statistics.median(times), 1e6 * times[int(len(times) * 0.99)],
            len(times) / took)


def main():
    repo = tempfile.mkdtemp(prefix="inprocess-bench-")
    for name in ("simple", "embed_text", "bert_tokenizer", "minilm", "mean_pool"):
        shutil.copytree(os.path.join(ROOT, "model_repository", name), os.path.join(repo, name))
    local = wasmtron.Server(model_repository=repo).start()
    remote = BinaryServer(repo)
    try:
        def in_process(model):
            handle = local.model(model)
            inputs = {name: data for name, data, _ in MODELS[model]}
            return lambda: lambda: list(handle.infer(inputs=inputs))

        def over(mod, url, model):
            def make():
                client = mod.InferenceServerClient(url)
                inputs = []
                for name, data, datatype in MODELS[model]:
                    t = mod.InferInput(name, list(data.shape), datatype)
                    t.set_data_from_numpy(data)
                    inputs.append(t)
                return lambda: client.infer(model, inputs)
            return make

        print(f"{CALLS} calls per caller; simple (INT32 [1,16] add/sub), embed_text (one sentence)\n")
        print("| model | path | callers | p50 µs | p99 µs | calls/s |")
        print("|---|---|---|---|---|---|")
        for model in MODELS:
            runs = [("in-process (wasmtron package)", in_process(model)),
                    ("tritonclient gRPC -> wasmtron", over(grpcclient, remote.grpc, model)),
                    ("tritonclient HTTP -> wasmtron", over(httpclient, remote.http, model))]
            for callers in (1, 8):
                for name, make in runs:
                    p50, p99, rate = measure(make, callers)
                    print(f"| {model} | {name} | {callers} | {p50:.0f} | {p99:.0f} | {rate:.0f} |",
                          flush=True)
    finally:
        local.stop()
        remote.stop()
        shutil.rmtree(repo, ignore_errors=True)


if __name__ == "__main__":
    main()
