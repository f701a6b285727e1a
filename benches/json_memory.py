#!/usr/bin/env python3
"""Peak server memory for one large JSON inference request: starts wasmtron on
`identity_fp32`, sends N FP32 elements as JSON (`"data": [1,1,...]`), and prints the server's
VmHWM before and after, and the request's time.

    .venv/bin/python benches/json_memory.py                       # target/release/wasmtron
    N=8000000 WASMTRON_BIN=/tmp/wasmtron-old .venv/bin/python benches/json_memory.py

Loopback only; one request.
"""
import os
import shutil
import tempfile
import time
import urllib.request

from loopback import start_server  # benches/loopback.py, beside this script

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
BINARY = os.environ.get("WASMTRON_BIN", os.path.join(ROOT, "target", "release", "wasmtron"))
N = int(os.environ.get("N", "8000000"))


def main():
    repo = tempfile.mkdtemp(prefix="json-memory-")
    shutil.copytree(os.path.join(ROOT, "model_repository", "identity_fp32"),
                    os.path.join(repo, "identity_fp32"))
    proc, http, _ = start_server(BINARY, repo)
    try:
        def hwm_mib():
            with open(f"/proc/{proc.pid}/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) // 1024
            return 0

        body = (f'{{"inputs":[{{"name":"INPUT0","shape":[1,{N}],"datatype":"FP32","data":['
                + ",".join(["1"] * N)
                + ']}],"outputs":[{"name":"OUTPUT0","parameters":{"binary_data":true}}]}').encode()
        before = hwm_mib()
        started = time.monotonic()
        req = urllib.request.Request(f"http://{http}/v2/models/identity_fp32/infer",
                                     data=body, method="POST")
        with urllib.request.urlopen(req, timeout=300) as r:
            r.read()
            status = r.status
        print(f"{N} elements, body {len(body) >> 20} MiB: status {status}, "
              f"server peak RSS {before} -> {hwm_mib()} MiB, {time.monotonic() - started:.2f} s")
    finally:
        proc.terminate()
        proc.wait(60)
        shutil.rmtree(repo, ignore_errors=True)


if __name__ == "__main__":
    main()
