#!/usr/bin/env python3
"""Tenant isolation, measured: tenant B sends a modest fixed rate of requests to `preprocess`
(the Wasm image stage) alone, then while tenant A floods the server open loop, far above
capacity: the same model, its own copy of that model, then its own stages that trap, spin
until their deadline, or exhaust their memory cap on every request. Prints B's latency
against its latency alone and what became of A's requests.

    .venv/bin/python benches/isolation.py                 # 10 s per scenario, about 1.5 min
    DURATION=30 RATE_B=20 RATE_A=2000 .venv/bin/python benches/isolation.py
    SERVER_ARGS="--execution-slots 0" .venv/bin/python benches/isolation.py  # without the share
    A_NICE=19 .venv/bin/python benches/isolation.py  # A's client yields the CPU to the rest
    A_IDLE=1 .venv/bin/python benches/isolation.py   # A's client only on CPU time nobody wants
    IDENTITY=1 .venv/bin/python benches/isolation.py # clients ask for uncompressed answers
    SERVER_CPUS=0 CLIENT_CPUS=1 .venv/bin/python benches/isolation.py  # apart, on one core each
    B_CLIENT=perf_analyzer .venv/bin/python benches/isolation.py  # B measured by perf_analyzer

Needs `make build-release stages models` (and `make perf-analyzer` for B_CLIENT=perf_analyzer).
Loopback only; every load is bounded in time and in requests in flight.
"""
import asyncio
import base64
import csv
import json
import multiprocessing
import os
import shlex
import shutil
import statistics
import struct
import subprocess
import tempfile
import time
import urllib.request

import aiohttp

from loopback import start_server  # benches/loopback.py, beside this script

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
BINARY = os.environ.get("WASMTRON_BIN", os.path.join(ROOT, "target", "release", "wasmtron"))
DURATION = float(os.environ.get("DURATION", "10"))
RATE_B = float(os.environ.get("RATE_B", "20"))
RATE_A = float(os.environ.get("RATE_A", "2000"))
# The flood client keeps at most this many requests open (a real flood would keep more; the
# server's answer to each is the same).
A_IN_FLIGHT = int(os.environ.get("A_IN_FLIGHT", "256"))
# Extra server flags, e.g. "--execution-slots 0" to compare without the execution share.
SERVER_ARGS = shlex.split(os.environ.get("SERVER_ARGS", ""))
# Nice level of A's client process (0: as B's).
A_NICE = int(os.environ.get("A_NICE", "0"))
# A_IDLE=1: A's client runs under SCHED_IDLE, on CPU time nothing else wants.
A_IDLE = os.environ.get("A_IDLE", "0") == "1"
# IDENTITY=1: the clients ask for uncompressed answers (aiohttp offers gzip by default, and
# the server compresses when asked, as Triton does).
IDENTITY = os.environ.get("IDENTITY", "0") == "1"
# SERVER_CPUS / CLIENT_CPUS (e.g. "0" and "1"): the CPUs the server and the clients may run
# on, so that the clients' own work does not take the server's cores (as on machines of
# their own). Empty: any CPU.
SERVER_CPUS = {int(c) for c in os.environ.get("SERVER_CPUS", "").split(",") if c}
CLIENT_CPUS = {int(c) for c in os.environ.get("CLIENT_CPUS", "").split(",") if c}
# B_CLIENT=perf_analyzer: B's requests are sent and timed by perf_analyzer (C++, synchronous
# HTTP, constant request rate) instead of this script's asyncio client.
B_CLIENT = os.environ.get("B_CLIENT", "python")
PERF_ANALYZER = os.path.join(ROOT, ".cache", "perf_analyzer", "bin", "perf_analyzer")
KEYS = {"A": "tenant-a-key", "A1": "tenant-a1-key", "B": "tenant-b-key"}
PROBE_MODES = {"trap": "panic", "spin": "loop", "memory": "alloc"}


def digest(key):
    out = subprocess.run([BINARY, "hash-key", key], capture_output=True, text=True, check=True)
    return out.stdout.strip()


def repository(tmp):
    repo = os.path.join(tmp, "repo")
    os.makedirs(repo)
    shutil.copytree(os.path.join(ROOT, "model_repository", "preprocess"), os.path.join(repo, "preprocess"))
    # A's own copy: a flood of A's own model shares only the cores with B.
    shutil.copytree(os.path.join(ROOT, "model_repository", "preprocess"), os.path.join(repo, "a_preprocess"))
    probe = os.path.join(ROOT, "tests", "models", "probe")
    for name, mode in PROBE_MODES.items():
        dest = os.path.join(repo, f"a_{name}")
        shutil.copytree(probe, dest)
        cfg = os.path.join(dest, "config.pbtxt")
        text = open(cfg).read().replace(
            'parameters [ { key: "mode", value: { string_value: "echo" } } ]',
            f'parameters [ {{ key: "mode", value: {{ string_value: "{mode}" }} }},'
            ' { key: "execution_timeout_ms", value: { string_value: "200" } },'
            ' { key: "memory_limit_mb", value: { string_value: "64" } } ]')
        open(cfg, "w").write(text)
    config = os.path.join(tmp, "wasmtron.toml")
    with open(config, "w") as f:
        f.write(f"""
[[tenant]]
name = "A"
api_keys = [{digest(KEYS["A"])}]
infer = ["preprocess", "a_*"]
[tenant.quotas]
max_queued_requests = 32

[[tenant]]
name = "A1"
api_keys = [{digest(KEYS["A1"])}]
infer = ["preprocess"]
[tenant.quotas]
max_concurrent_requests = 1

[[tenant]]
name = "B"
api_keys = [{digest(KEYS["B"])}]
infer = ["preprocess"]
""")
    return repo, config


def start(repo, config):
    everywhere = os.sched_getaffinity(0)
    if SERVER_CPUS:
        os.sched_setaffinity(0, SERVER_CPUS)  # the server inherits it
    try:
        proc, http, _ = start_server(BINARY, repo, "--config", config, *SERVER_ARGS)
    finally:
        os.sched_setaffinity(0, everywhere)
    return proc, f"http://{http}"


def image_element():
    """The test PNG as one serialized BYTES element: length prefix, then the bytes."""
    png = open(os.path.join(ROOT, "tests", "fixtures", "lines_down.png"), "rb").read()
    return struct.pack("<I", len(png)) + png


def body(model):
    """An HTTP binary-tensor request: the PNG for preprocess, four floats for the probes."""
    if model in ("preprocess", "a_preprocess"):
        raw = image_element()
        header = (f'{{"parameters":{{"binary_data_output":true}},"inputs":[{{"name":"IMAGE","shape":[1,1],'
                  f'"datatype":"BYTES","parameters":{{"binary_data_size":{len(raw)}}}}}]}}')
    else:
        raw = struct.pack("<4f", 1, 2, 3, 4)
        header = '{"inputs":[{"name":"INPUT0","shape":[1,4],"datatype":"FP32","parameters":{"binary_data_size":16}}]}'
    return header.encode() + raw, len(header)


async def open_loop(session, url, tenant, model, rate, duration, limit):
    """Sends `rate` requests a second for `duration` seconds without waiting for answers
    (at most `limit` open); returns (latencies of successes in ms, status counts)."""
    data, json_len = body(model)
    headers = {"Authorization": f"Bearer {KEYS[tenant]}", "Inference-Header-Content-Length": str(json_len)}
    if IDENTITY:
        headers["Accept-Encoding"] = "identity"
    latencies, statuses, tasks = [], {}, []
    gate = asyncio.Semaphore(limit)

    async def one():
        async with gate:
            started = time.perf_counter()
            try:
                async with session.post(f"{url}/v2/models/{model}/infer", data=data, headers=headers) as r:
                    await r.read()
                    status = r.status
            except aiohttp.ClientError as e:
                status = type(e).__name__
            if status == 200:
                latencies.append((time.perf_counter() - started) * 1000)
            statuses[status] = statuses.get(status, 0) + 1

    begin = time.perf_counter()
    sent = 0
    while (now := time.perf_counter() - begin) < duration:
        due = int(now * rate) + 1
        while sent < due:
            if gate.locked():
                statuses["not sent (client limit)"] = statuses.get("not sent (client limit)", 0) + 1
            else:
                tasks.append(asyncio.create_task(one()))
            sent += 1
        await asyncio.sleep(min(0.001, 1 / rate))
    await asyncio.gather(*tasks)
    return latencies, statuses


def pct(values, q):
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def load(url, tenant, model, rate, limit, duration=None):
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        return await open_loop(session, url, tenant, model, rate, duration or DURATION, limit)


def run_load(args):
    if CLIENT_CPUS:
        os.sched_setaffinity(0, CLIENT_CPUS)
    return asyncio.run(load(*args))


def run_perf_analyzer(url, tenant, model, rate):
    """B's load through perf_analyzer: three windows of a third of DURATION each at `rate`
    requests a second; returns (statuses, (p50, p99) in ms) — perf_analyzer reports
    percentiles, not each latency, and stops at the first failed request."""
    with tempfile.TemporaryDirectory() as tmp:
        data, out = os.path.join(tmp, "input.json"), os.path.join(tmp, "out.csv")
        # BYTES content for perf_analyzer is the serialized tensor.
        element = base64.b64encode(image_element()).decode()
        with open(data, "w") as f:
            json.dump({"data": [{"IMAGE": {"content": {"b64": element}, "shape": [1]}}]}, f)
        window_ms = max(1000, int(DURATION * 1000 / 3))
        cuda = os.path.join(ROOT, ".cache", "perf_analyzer", "cuda", "nvidia", "cuda_runtime", "lib")
        env = dict(os.environ, LD_LIBRARY_PATH=cuda)
        cmd = [PERF_ANALYZER, "-m", model, "-u", url.removeprefix("http://"), "-i", "http",
               "-H", f"Authorization: Bearer {KEYS[tenant]}", "--input-data", data, "-b", "1",
               "--request-rate-range", f"{rate:g}", "--request-distribution", "constant",
               "--measurement-mode", "time_windows", "-p", str(window_ms),
               "--stability-percentage", "999", "--max-trials", "3", "--percentile", "99", "-f", out]
        if CLIENT_CPUS:
            os.sched_setaffinity(0, CLIENT_CPUS)
        run = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if run.returncode != 0:
            nan = float("nan")
            return {"perf_analyzer failed: " + run.stdout[-300:].strip(): 1}, (nan, nan)
        row = next(csv.DictReader(open(out)))
        answered = int(float(row["Inferences/Second"]) * 3 * window_ms / 1000)
        return {200: answered}, (int(row["p50 latency"]) / 1000, int(row["p99 latency"]) / 1000)


def run_b(args):
    """B's load by B_CLIENT: (statuses, (p50, p99) in ms)."""
    if B_CLIENT == "perf_analyzer":
        url, tenant, model, rate, _ = args
        return run_perf_analyzer(url, tenant, model, rate)
    latencies, statuses = run_load(args)
    return statuses, (pct(latencies, 0.5), pct(latencies, 0.99))


def run_flood(args):
    """A's flood, at nice level A_NICE: on a machine that also runs the server, a positive
    level stands in for a client on a machine of its own (the flood's requests still reach
    the server as fast as it takes them; only the client's own CPU time yields to others)."""
    if A_NICE:
        os.nice(A_NICE)
    if A_IDLE:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    if B_CLIENT == "perf_analyzer":
        # perf_analyzer takes a moment to start and to end its windows: the flood outlasts it.
        args = (*args, DURATION + 5)
    return run_load(args)


def scenario(url, flood_model, flooder="A"):
    """B's load, and A's flood in a process of its own (a client's event loop busy with the
    flood would delay B's measurements, not the server)."""
    b_args = (url, "B", "preprocess", RATE_B, 64)
    if flood_model is None:
        return run_b(b_args), None
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        a = pool.apply_async(run_flood, ((url, flooder, flood_model, RATE_A, A_IN_FLIGHT),))
        b = pool.apply_async(run_b, (b_args,))
        return b.get(DURATION + 300), a.get(DURATION + 300)


def main():
    tmp = tempfile.mkdtemp(prefix="isolation-")
    repo, config = repository(tmp)
    proc, url = start(repo, config)
    try:
        # Warm-up: compile caches, connections, the first instances.
        scenario(url, None)
        rows = []
        alone = None
        for label, flood, flooder in [
                ("B alone", None, "A"),
                ("A floods a model it may not use (refused at the door: the flood's own cost)", "forbidden", "A"),
                ("A floods the same model", "preprocess", "A"),
                ("A floods the same model with max_concurrent_requests = 1", "preprocess", "A1"),
                ("A floods its own copy of the model", "a_preprocess", "A"),
                ("A's stage traps on every request", "a_trap", "A"),
                ("A's stage spins until its deadline", "a_spin", "A"),
                ("A's stage exhausts its memory cap", "a_memory", "A")]:
            (b_status, (p50, p99)), a = scenario(url, flood, flooder)
            b_errors = sum(n for s, n in b_status.items() if s != 200)
            answered = b_status.get(200, 0)
            alone = alone or p99
            a_text = "" if a is None else ", ".join(f"{s}: {n}" for s, n in sorted(a[1].items(), key=str))
            rows.append((label, answered, b_errors, p50, p99, p99 / alone, a_text))
        print(f"B: {RATE_B:g} req/s to preprocess; A: {RATE_A:g} req/s open loop (at most {A_IN_FLIGHT} open); "
              f"{DURATION:g} s per scenario; server flags: {' '.join(SERVER_ARGS) or 'none'}; "
              f"A's client at nice {A_NICE}{' under SCHED_IDLE' if A_IDLE else ''}; "
              f"answers {'uncompressed' if IDENTITY else 'gzip'}; "
              f"server CPUs {sorted(SERVER_CPUS) or 'any'}, client CPUs {sorted(CLIENT_CPUS) or 'any'}; "
              f"B's client: {B_CLIENT}\n")
        print("| scenario | B answered | B errors | B p50 ms | B p99 ms | B p99 / alone | A's requests |")
        print("|---|---|---|---|---|---|---|")
        for label, n, errors, p50, p99, ratio, a_text in rows:
            print(f"| {label} | {n} | {errors} | {p50:.1f} | {p99:.1f} | {ratio:.2f} | {a_text} |")
        alive = proc.poll() is None
        print(f"\nserver still running after the floods: {alive}")
    finally:
        proc.terminate()
        proc.wait(60)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
