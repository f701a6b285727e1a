#!/usr/bin/env python3
"""Reloads under steady traffic, per kind of model: a Triton `model.py` (add_sub_python), an
ONNX model (simple) and a Wasm stage (add_sub), each reloaded RELOADS times back to back
(the load API, same files: a new version replaces the serving one) while CLIENTS gRPC clients
send to it without pause. Reports, per model, the requests that failed (the number that must
be 0), p50 / p99 latency before the reloads and during them, and the server's RSS after the
first reload and after the last.

    .venv/bin/python benches/reloads.py                  # 100 reloads each
    RELOADS=20 CLIENTS=2 .venv/bin/python benches/reloads.py

Release build, explicit model control, loopback only; bounded by RELOADS and BASELINE.
"""
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
BINARY = os.environ.get("WASMTRON_BIN", os.path.join(ROOT, "target", "release", "wasmtron"))
RELOADS = int(os.environ.get("RELOADS", "100"))
CLIENTS = int(os.environ.get("CLIENTS", "4"))
BASELINE = float(os.environ.get("BASELINE", "10"))
MODELS = {"add_sub_python": "model.py", "simple": "ONNX", "add_sub": "Wasm stage"}


def inputs(model):
    dtype, shape, kind = ((np.int32, (1, 16), "INT32") if model == "simple"
                          else (np.float32, (4,), "FP32"))
    out = []
    for name in ("INPUT0", "INPUT1"):
        t = grpcclient.InferInput(name, list(shape), kind)
        t.set_data_from_numpy(np.ones(shape, dtype=dtype))
        out.append(t)
    return out


def rss_mib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def start(repo):
    log = []
    proc = subprocess.Popen(
        [BINARY, "--model-repository", repo, "--model-control-mode=explicit",
         *(f"--load-model={m}" for m in MODELS), "--http-port", "0", "--grpc-port", "0",
         "--metrics-port", "0", "--http-address", "127.0.0.1", "--grpc-address", "127.0.0.1",
         "--metrics-address", "127.0.0.1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    threading.Thread(target=lambda: [log.append(line) for line in proc.stderr],
                     daemon=True).start()
    deadline = time.monotonic() + 600
    while not any("Started GRPCInferenceService" in line for line in log):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("server did not start:\n" + "".join(log))
        time.sleep(0.1)
    address = next(l for l in log if "Started GRPCInferenceService" in l).rsplit(" at ", 1)[1]
    return proc, address.strip()


def measure(address, model, pid):
    """Baseline traffic, then RELOADS reloads under the same traffic."""
    phase = {"name": "baseline"}
    latencies = {"baseline": [], "reloads": []}
    failures = []
    stop = threading.Event()

    def client():
        c = grpcclient.InferenceServerClient(address)
        work = inputs(model)
        while not stop.is_set():
            started = time.perf_counter()
            try:
                c.infer(model, work)
                latencies[phase["name"]].append(time.perf_counter() - started)
            except InferenceServerException as e:
                failures.append(str(e))

    threads = [threading.Thread(target=client, daemon=True) for _ in range(CLIENTS)]
    [t.start() for t in threads]
    time.sleep(BASELINE)
    phase["name"] = "reloads"
    admin = grpcclient.InferenceServerClient(address)
    rss = []
    for i in range(RELOADS):
        admin.load_model(model)
        if i in (0, RELOADS - 1):
            time.sleep(1)  # the replaced version's memory given back before reading RSS
            rss.append(rss_mib(pid))
    stop.set()
    [t.join() for t in threads]
    pct = lambda xs, q: statistics.quantiles(xs, n=100)[q - 1] * 1000 if len(xs) > 1 else 0.0
    base, during = latencies["baseline"], latencies["reloads"]
    return {
        "requests": len(base) + len(during), "failed": len(failures),
        "first_failure": failures[0] if failures else "",
        "p50": (pct(base, 50), pct(during, 50)), "p99": (pct(base, 99), pct(during, 99)),
        "rss": tuple(rss),
    }


def main():
    repo = tempfile.mkdtemp(prefix="reloads-")
    try:
        for model in MODELS:
            shutil.copytree(os.path.join(ROOT, "model_repository", model),
                            os.path.join(repo, model))
        proc, address = start(repo)
        try:
            rows = {}
            for model in MODELS:
                rows[model] = measure(address, model, proc.pid)
                print(f"{model}: {rows[model]}", file=sys.stderr)
        finally:
            proc.terminate()
            proc.wait(60)
    finally:
        shutil.rmtree(repo, ignore_errors=True)
    print(f"\n{RELOADS} reloads per model under {CLIENTS} gRPC clients "
          f"(baseline {BASELINE:.0f} s before)\n")
    print("| model | requests | failed | p50 ms before → during | p99 ms before → during "
          "| p99 ratio | RSS MiB after reload 1 → last |")
    print("|---|---|---|---|---|---|---|")
    for model, r in rows.items():
        (b50, d50), (b99, d99), (r1, rn) = r["p50"], r["p99"], r["rss"]
        print(f"| {model} ({MODELS[model]}) | {r['requests']} | {r['failed']} "
              f"| {b50:.2f} → {d50:.2f} | {b99:.2f} → {d99:.2f} | {d99 / b99:.2f} "
              f"| {r1:.0f} → {rn:.0f} |")
    if any(r["failed"] for r in rows.values()):
        print("\nfirst failures: " + "; ".join(
            f"{m}: {r['first_failure']}" for m, r in rows.items() if r["failed"]))
        sys.exit(1)


if __name__ == "__main__":
    main()
