"""Wasmtron on a Ray cluster, losing a node under load: a head and two worker nodes (on one
machine with `ray.cluster_utils.Cluster`; on a real cluster, `ray start` on each machine),
`WasmtronModels` (deploy/ray/wasmtron_inprocess.py, saying its node) with two replicas on
distinct nodes
(`max_replicas_per_node=1`) over one shared repository, a bounded load through a handle, and a
worker node removed midway (a third joins, as an autoscaler would bring one). Prints one JSON
line: where the replicas ran, how long Serve took to be back to two healthy replicas, the
requests answered (each retried at most once), and Ray's `serve_deployment_replica_healthy`
gauge as the head's metrics agent exported it over time.

    python deploy/ray/multinode.py <repository> [requests]

Run by tests/python/test_ray_serve.py in a network namespace that has only loopback.
"""
import json
import os
import re
import socket
import sys
import threading
import time
import urllib.request

import numpy as np
import ray
from ray import serve
from ray.cluster_utils import Cluster

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from wasmtron_inprocess import WasmtronModels  # noqa: E402

SLOT = "wasmtron_slot"


@serve.deployment(ray_actor_options={"num_cpus": 0}, health_check_period_s=1)
class WasmtronReplica(WasmtronModels.func_or_class):
    """`WasmtronModels`, saying which node it runs on."""

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy_replicas(port):
    """Ray's replica-health gauge summed over replicas, from the head's metrics agent."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return None
    values = [float(v) for v in re.findall(
        r'^ray_serve_deployment_replica_healthy\{[^}]*deployment="WasmtronReplica"[^}]*\} (\S+)$',
        text, re.M)]
    return sum(values) if values else None


def s3_repository(local):
    """`local` uploaded to an S3 stand-in (moto's server, on loopback) that every node
    reads: the repository as `s3://host:port/bucket/path`, with the AWS variables set for the
    nodes started after this."""
    import subprocess

    import boto3

    port = free_port()
    moto = os.path.join(os.path.dirname(sys.executable), "moto_server")
    subprocess.Popen([moto, "-H", "127.0.0.1", "-p", str(port)],
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.environ.update({"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1"})
    client = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}")
    for _ in range(300):
        try:
            client.create_bucket(Bucket="models")
            break
        except Exception:
            time.sleep(0.2)
    for dirpath, _, files in os.walk(local):
        for f in files:
            path = os.path.join(dirpath, f)
            key = "repo/" + os.path.relpath(path, local).replace(os.sep, "/")
            client.upload_file(os.path.realpath(path), "models", key)
    return f"s3://127.0.0.1:{port}/models/repo"


def running_replicas():
    app = serve.status().applications.get("models")
    if app is None or "WasmtronReplica" not in app.deployments:
        return 0
    return app.deployments["WasmtronReplica"].replica_states.get("RUNNING", 0)


def main():
    repo = sys.argv[1]
    total = int(sys.argv[2]) if len(sys.argv) > 2 else 2000
    if os.environ.get("MULTINODE_S3") == "1":
        repo = s3_repository(repo)
    metrics_port = free_port()
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "metrics_export_port": metrics_port, "include_dashboard": False})
    workers = [cluster.add_node(num_cpus=1, resources={SLOT: 1}) for _ in range(2)]
    ray.init(address=cluster.address)
    serve.start(http_options={"host": "127.0.0.1", "port": free_port()})
    started = time.monotonic()
    handle = serve.run(
        WasmtronReplica.options(
            num_replicas=2, max_replicas_per_node=1, health_check_period_s=1,
            health_check_timeout_s=10,
            ray_actor_options={"num_cpus": 0, "resources": {SLOT: 0.5}}).bind(repo),
        name="models", route_prefix=None)
    deployed_s = time.monotonic() - started

    nodes = set()
    for _ in range(200):
        nodes.add(handle.node.remote().result(timeout_s=60))
        if len(nodes) == 2:
            break

    # The embed_text pipeline (a Wasm tokenizer, the MiniLM encoder, Wasm mean pooling):
    # every answer must equal the first replica's for the same text.
    texts = [b"a lighthouse on a cliff", b"the bakery opens at seven", b"rye and sourdough"]
    reference = {}
    for text in texts:
        out = handle.infer.remote("embed_text", {"TEXT": np.array([[text]], dtype=object)},
                                  output_names=["EMBEDDING"]).result(timeout_s=120)
        reference[text] = out["EMBEDDING"]
    done = {"ok": 0, "retried": 0, "failed": 0, "wrong": 0}
    lock = threading.Lock()
    counter = iter(range(total))

    def one(i):
        text = texts[i % len(texts)]
        out = handle.infer.remote("embed_text", {"TEXT": np.array([[text]], dtype=object)},
                                  output_names=["EMBEDDING"]).result(timeout_s=60)
        return np.allclose(out["EMBEDDING"], reference[text], atol=1e-5)

    def client():
        while True:
            with lock:
                i = next(counter, None)
            if i is None:
                return
            try:
                good = one(i)
                key = "ok"
            except Exception:  # the replica's node went: one retry
                try:
                    good = one(i)
                    key = "retried"
                except Exception:
                    good, key = True, "failed"
            with lock:
                done[key] += 1
                if not good:
                    done["wrong"] += 1

    samples = []  # (seconds since the load began, replicas RUNNING, healthy gauge)
    stop_sampling = threading.Event()
    load_began = time.monotonic()

    def sample():
        while not stop_sampling.is_set():
            samples.append((round(time.monotonic() - load_began, 1), running_replicas(),
                            healthy_replicas(metrics_port)))
            stop_sampling.wait(0.5)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    clients = [threading.Thread(target=client) for _ in range(4)]
    for c in clients:
        c.start()
    while sum(done.values()) - done["wrong"] < total // 3:
        time.sleep(0.05)

    # A worker node that holds a replica goes; a fresh node joins.
    victim = next(w for w in workers if w.node_id in nodes)
    removed_at = time.monotonic()
    cluster.remove_node(victim, allow_graceful=False)
    cluster.add_node(num_cpus=1, resources={SLOT: 1})
    # Serve notices the replica is gone, then starts another: timed from the removal.
    noticed_s = recovered_s = None
    while time.monotonic() - removed_at < 240:
        running = running_replicas()
        if noticed_s is None and running < 2:
            noticed_s = round(time.monotonic() - removed_at, 1)
        if noticed_s is not None and running == 2:
            recovered_s = round(time.monotonic() - removed_at, 1)
            break
        time.sleep(0.2)
    for c in clients:
        c.join()
    # The gauge is exported every few seconds: keep sampling until it shows two again.
    until = time.monotonic() + 60
    while time.monotonic() < until and (samples[-1][2] or 0) < 2:
        time.sleep(1)
    stop_sampling.set()
    sampler.join()
    nodes_after = set()
    for _ in range(200):
        nodes_after.add(handle.node.remote().result(timeout_s=60))
        if len(nodes_after) == 2:
            break
    print(json.dumps({
        "deployed_s": round(deployed_s, 1),
        "replica_nodes": len(nodes),
        "replica_nodes_after": len(nodes_after),
        "victim_held_a_replica": victim.node_id in nodes,
        "noticed_s": noticed_s,
        "recovered_s": recovered_s,
        "requests": done,
        "samples": samples,
    }))
    serve.shutdown()
    ray.shutdown()
    cluster.shutdown()


if __name__ == "__main__":
    main()
