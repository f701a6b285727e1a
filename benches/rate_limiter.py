#!/usr/bin/env python3
"""The rate limiter's ratio (issue 42): two models, each with two instances whose executions take
about 20 ms (Triton Python-backend models that sleep), loaded together at 8 requests in flight
per model. With `--rate-limit=execution_count --rate-limit-resource=R:1` and every instance
needing one R, both together may run only one execution at a time: at most ~50 executions/s in
all, where without the limiter their four instances run ~4x that. A third run gives one model
priority 1 and the other priority 2: under contention the first should get about twice the
turns. Alternating rounds, medians, one release binary.

    .venv/bin/python benches/rate_limiter.py          # about a minute on 2 cores
    ROUNDS=5 .venv/bin/python benches/rate_limiter.py

Needs `make build-release` and the Python backend's runtime (`make python-runtime`). Loopback
only, bounded in requests.
"""
import os
import shutil
import statistics
import tempfile
import threading
import time

import numpy as np
import tritonclient.http as httpclient

from loopback import ROOT, start_server  # benches/loopback.py, beside this script

BINARY = os.path.join(ROOT, "target", "release", "wasmtron")
ROUNDS = int(os.environ.get("ROUNDS", "3"))
SECONDS = float(os.environ.get("SECONDS_PER_RUN", "6"))
IN_FLIGHT = 8

CONFIG = """backend: "python"
max_batch_size: 0
input [ { name: "X", data_type: TYPE_FP32, dims: [ 1 ] } ]
output [ { name: "Y", data_type: TYPE_FP32, dims: [ 1 ] } ]
instance_group [ { count: 2, kind: KIND_CPU,
                   rate_limiter { resources [ { name: "R", count: 1 } ] priority: PRIORITY } } ]
"""
MODEL = '''
import time
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        time.sleep(0.02)
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy())]) for r in requests]
'''


def repository(priorities):
    repo = tempfile.mkdtemp(prefix="rate_limiter_")
    for name, priority in zip(("a", "b"), priorities):
        os.makedirs(os.path.join(repo, name, "1"))
        with open(os.path.join(repo, name, "config.pbtxt"), "w") as f:
            f.write(CONFIG.replace("PRIORITY", str(priority)))
        with open(os.path.join(repo, name, "1", "model.py"), "w") as f:
            f.write(MODEL)
    return repo


def load(http, seconds):
    """Executions per second per model with IN_FLIGHT requests each, for `seconds`."""
    done = {"a": 0, "b": 0}
    stop = time.monotonic() + seconds
    lock = threading.Lock()

    def worker(model):
        client = httpclient.InferenceServerClient(http, network_timeout=120)
        x = httpclient.InferInput("X", [1], "FP32")
        x.set_data_from_numpy(np.ones(1, np.float32))
        while time.monotonic() < stop:
            client.infer(model, [x])
            with lock:
                done[model] += 1

    threads = [threading.Thread(target=worker, args=(m,)) for m in ("a", "b")
               for _ in range(IN_FLIGHT)]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    took = time.monotonic() - started
    return done["a"] / took, done["b"] / took


def run(priorities, *flags):
    repo = repository(priorities)
    proc, http, _ = start_server(BINARY, repo, *flags)
    try:
        load(http, 1.0)  # warm up
        return load(http, SECONDS)
    finally:
        proc.terminate()
        proc.wait(60)
        shutil.rmtree(repo, ignore_errors=True)


def main():
    limited = ("--rate-limit=execution_count", "--rate-limit-resource=R:1")
    results = {"off": [], "R:1": [], "R:1, priorities 1 and 2": []}
    for _ in range(ROUNDS):
        results["off"].append(run((1, 1)))
        results["R:1"].append(run((1, 1), *limited))
        results["R:1, priorities 1 and 2"].append(run((1, 2), *limited))
    print(f"| rate limiter | a exec/s | b exec/s | together | a:b |  ({ROUNDS} rounds, medians)")
    print("|---|---|---|---|---|")
    for name, runs in results.items():
        a = statistics.median(r[0] for r in runs)
        b = statistics.median(r[1] for r in runs)
        print(f"| {name} | {a:.1f} | {b:.1f} | {a + b:.1f} | {a / b:.2f} |")


if __name__ == "__main__":
    main()
