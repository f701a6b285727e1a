#!/usr/bin/env python3
"""Soak: steady traffic for a fixed time while models are reloaded and switch versions every
few seconds, then SIGTERM with traffic still flowing. Reports every request that failed
although the server had accepted it (the number that must be 0), the reloads done, the
server's RSS over time, and its exit status.

    .venv/bin/python benches/soak.py                     # 10 minutes
    DURATION=60 RELOAD_EVERY=2 .venv/bin/python benches/soak.py

Traffic: CLIENTS threads, each looping over `simple` (ONNX) and `add_sub` (Wasm) over HTTP and
gRPC. Every RELOAD_EVERY seconds one of: reload `add_sub` (same files), add `simple` version 2
and load it (the new latest serves), or remove version 2 and load again (back to version 1).
Loopback only; bounded in time.
"""
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import urllib.request

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from geventhttpclient.response import HTTPConnectionClosed
from tritonclient.utils import InferenceServerException

from loopback import start_server  # benches/loopback.py, beside this script

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
BINARY = os.environ.get("WASMTRON_BIN", os.path.join(ROOT, "target", "release", "wasmtron"))
DURATION = float(os.environ.get("DURATION", "600"))
RELOAD_EVERY = float(os.environ.get("RELOAD_EVERY", "3"))
CLIENTS = int(os.environ.get("CLIENTS", "4"))


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def inputs(mod, model):
    if model == "simple":
        names, dtype, shape = ("INPUT0", "INPUT1"), np.int32, (1, 16)
    else:
        names, dtype, shape = ("INPUT0", "INPUT1"), np.float32, (4,)
    out = []
    for name in names:
        t = mod.InferInput(name, list(shape), "INT32" if dtype == np.int32 else "FP32")
        t.set_data_from_numpy(np.ones(shape, dtype=dtype))
        out.append(t)
    return out


class Tally:
    def __init__(self):
        self.lock = threading.Lock()
        self.ok = 0
        self.refused_at_shutdown = 0
        self.failed = []

    def add(self, ok=False, shutdown=False, error=None):
        with self.lock:
            if ok:
                self.ok += 1
            elif shutdown:
                self.refused_at_shutdown += 1
            else:
                self.failed.append(error)


def client(index, http, grpc, stop, stopping, tally):
    h = httpclient.InferenceServerClient(http, network_timeout=120)
    g = grpcclient.InferenceServerClient(grpc)
    k = 0
    while not stop.is_set():
        model = ("simple", "add_sub")[k % 2]
        mod, c = ((httpclient, h), (grpcclient, g))[(k // 2 + index) % 2]
        k += 1
        try:
            r = c.infer(model, inputs(mod, model))
            assert r.as_numpy("OUTPUT0") is not None
            tally.add(ok=True)
        except (InferenceServerException, ConnectionError, OSError, HTTPConnectionClosed) as e:
            text = str(e)
            # After SIGTERM: 503 "shutting down", an idle keep-alive connection closed by the
            # draining server before it read the request, or no listener — never accepted.
            if stopping.is_set() and ("shutting down" in text or "503" in text or "UNAVAILABLE" in text
                                      or "onnect" in text or isinstance(e, HTTPConnectionClosed)):
                tally.add(shutdown=True)
            else:
                tally.add(error=f"{model}: {text[:200]}")


def post(url):
    req = urllib.request.Request(url, method="POST", data=b"{}")
    with urllib.request.urlopen(req, timeout=120) as r:
        return r.status


def main():
    tmp = tempfile.mkdtemp(prefix="soak-")
    repo = os.path.join(tmp, "repo")
    os.makedirs(repo)
    for m in ("simple", "add_sub"):
        shutil.copytree(os.path.join(ROOT, "model_repository", m), os.path.join(repo, m))
    proc, http, grpc = start_server(BINARY, repo, "--model-control-mode", "explicit",
                                    "--load-model", "*", "--exit-timeout-secs", "30")
    stop, stopping, tally = threading.Event(), threading.Event(), Tally()
    threads = [threading.Thread(target=client, args=(i, http, grpc, stop, stopping, tally))
               for i in range(CLIENTS)]
    for t in threads:
        t.start()
    started = time.monotonic()
    reloads, rss = 0, []
    next_rss = started
    v2 = os.path.join(repo, "simple", "2")
    while time.monotonic() - started < DURATION:
        time.sleep(RELOAD_EVERY)
        action = reloads % 3
        if action == 0:
            post(f"http://{http}/v2/repository/models/add_sub/load")
        elif action == 1:
            shutil.copytree(os.path.join(repo, "simple", "1"), v2)
            post(f"http://{http}/v2/repository/models/simple/load")
        else:
            shutil.rmtree(v2)
            post(f"http://{http}/v2/repository/models/simple/load")
        reloads += 1
        if time.monotonic() >= next_rss:
            rss.append((round(time.monotonic() - started), rss_kib(proc.pid) // 1024))
            next_rss += max(DURATION / 10, 1)
    rss.append((round(time.monotonic() - started), rss_kib(proc.pid) // 1024))
    # SIGTERM with the clients still sending.
    stopping.set()
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(120)
    stop.set()
    for t in threads:
        t.join(120)
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"{DURATION:g} s, {CLIENTS} clients, a reload or version switch every {RELOAD_EVERY:g} s\n")
    print(f"requests answered: {tally.ok}")
    print(f"reloads and version switches: {reloads}")
    print(f"refused after SIGTERM (never accepted): {tally.refused_at_shutdown}")
    print(f"failed although accepted: {len(tally.failed)}")
    for e in tally.failed[:10]:
        print(f"  {e}")
    print("RSS (s: MiB): " + ", ".join(f"{t}: {m}" for t, m in rss))
    print(f"exit status after SIGTERM: {code}")
    sys.exit(1 if tally.failed or code != 0 else 0)


if __name__ == "__main__":
    main()
