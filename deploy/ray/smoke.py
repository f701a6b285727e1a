"""Runs the Ray Serve adapter end to end on this machine and prints one JSON line: a local Ray
cluster, `Wasmtron` with two replicas behind Serve's HTTP proxy, inference through the proxy
with tritonclient, a replica's server killed and replaced, the latency of the extra hop
(sequential requests straight to a replica's server and through Serve), and shutdown with no
server left behind. Ray rewrites loopback addresses to the machine's outward address, so run it
in a network namespace that has only `lo` (tests/python/test_ray_serve.py does):

    ip netns add ray && ip netns exec ray ip link set lo up
    ip netns exec ray .venv/bin/python deploy/ray/smoke.py target/debug/wasmtron REPOSITORY
"""
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time

import numpy as np
import ray
import tritonclient.http as httpclient
from ray import serve

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from wasmtron_ray import Wasmtron  # noqa: E402

REQUESTS = int(os.environ.get("REQUESTS", "300"))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def servers(binary):
    """PIDs of running wasmtron processes started from `binary`."""
    out = subprocess.run(["pgrep", "-f", f"^{binary} --model-repository"], capture_output=True,
                         text=True)
    return sorted(int(p) for p in out.stdout.split())


def simple(client, n=1):
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    inputs = [httpclient.InferInput("INPUT0", [1, 16], "INT32"),
              httpclient.InferInput("INPUT1", [1, 16], "INT32")]
    for t in inputs:
        t.set_data_from_numpy(a)
    ok = True
    times = []
    for _ in range(n):
        start = time.perf_counter()
        r = client.infer("simple", inputs)
        times.append((time.perf_counter() - start) * 1000)
        ok = ok and bool((r.as_numpy("OUTPUT0") == 2 * a).all())
    return ok, times


def percentiles(times):
    times = sorted(times)
    return {"p50": round(statistics.median(times), 3),
            "p90": round(times[int(len(times) * 0.9)], 3),
            "p99": round(times[int(len(times) * 0.99)], 3)}


def wait(check, timeout=180):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if check():
                return True
        except Exception:
            pass
        time.sleep(0.5)
    return False


def main():
    binary, repository = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
    result = {}
    before = servers(binary)
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             _temp_dir=os.environ.get("RAY_TMP", "/tmp/ray-wasmtron"))
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    started = time.time()
    serve.run(Wasmtron.options(num_replicas=2).bind(repository, binary=binary),
              name="wasmtron", route_prefix="/")
    result["deploy_s"] = round(time.time() - started, 1)
    running = [p for p in servers(binary) if p not in before]
    result["servers_started"] = len(running)

    via_serve = httpclient.InferenceServerClient(f"127.0.0.1:{port}", network_timeout=120)
    result["ready_through_serve"] = via_serve.is_server_ready()
    ok, _ = simple(via_serve, 10)
    result["infer_through_serve"] = ok
    result["model_metadata_through_serve"] = via_serve.get_model_metadata("simple")["name"]

    # The hop's cost: the same requests straight to one replica's server, then through Serve.
    replica = serve.get_app_handle("wasmtron").server.remote().result()
    assert replica["pid"] in running, (replica, running)
    direct_port = replica["HTTPService"]
    direct = httpclient.InferenceServerClient(direct_port)
    simple(direct, 20)
    simple(via_serve, 20)
    _, d = simple(direct, REQUESTS)
    _, s = simple(via_serve, REQUESTS)
    result["latency_ms"] = {"direct": percentiles(d), "through_serve": percentiles(s)}

    # A replica's server dies: Serve's health check fails and the replica is replaced.
    victim = replica["pid"]
    os.kill(victim, signal.SIGKILL)
    result["replaced_after_kill"] = wait(
        lambda: len([p for p in servers(binary) if p not in before and p != victim]) >= 2
        and serve.status().applications["wasmtron"].status == "RUNNING"
        and simple(via_serve)[0])
    result["infer_after_replacement"] = simple(via_serve, 5)[0]

    serve.delete("wasmtron")
    serve.shutdown()
    ray.shutdown()
    result["orphans"] = len([p for p in servers(binary) if p not in before]) if wait(
        lambda: not [p for p in servers(binary) if p not in before], 60) is False else 0
    print(json.dumps(result))


if __name__ == "__main__":
    main()
