"""Runs wasmtron in Ray Serve end to end on this machine and prints one JSON line.

The subprocess adapter: a local Ray cluster, `Wasmtron` with two replicas behind Serve's HTTP
proxy, inference through the proxy with tritonclient, a replica's server killed and replaced,
the latency of the extra hop (requests straight to a replica's server and through Serve), and
shutdown with no server left behind.

In-process (`wasmtron_inprocess.py`, given a third argument: a repository that holds
`simple`, `embed_text` and its models, and `identity_bytes`, such as model_repository/): `WasmtronModels` called through a deployment handle,
`TextApp`'s `/embed` and `/identity` through Serve's proxy (checked against the `embed_text`
ensemble run in this process), and the latency of `simple` at 1 and 8 concurrent callers: the
in-process call in this process (the floor), a handle to a deployment that does nothing (Ray's
own cost), a handle to `WasmtronModels`, and the adapter through Serve's proxy. Ray rewrites loopback addresses to the machine's outward address, so run it
in a network namespace that has only `lo` (tests/python/test_ray_serve.py does):

    ip netns add ray && ip netns exec ray ip link set lo up
    ip netns exec ray .venv/bin/python deploy/ray/smoke.py target/debug/wasmtron REPOSITORY \
        model_repository
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
from wasmtron_inprocess import TextApp, WasmtronModels  # noqa: E402
from text_to_image import TritonDeployment  # noqa: E402

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


def timed(call, n, callers=1, errors=None):
    """Latencies in ms of `n` calls, spread over `callers` threads calling back to back. A
    failed call is not timed; its error is appended to `errors` (or raised without a list)."""
    from concurrent.futures import ThreadPoolExecutor

    def run(count):
        times = []
        for _ in range(count):
            start = time.perf_counter()
            try:
                call()
            except Exception as e:
                if errors is None:
                    raise
                errors.append(f"{type(e).__name__}: {e}"[:300])
                continue
            times.append((time.perf_counter() - start) * 1000)
        return times

    with ThreadPoolExecutor(callers) as pool:
        parts = pool.map(run, [n // callers] * callers)
        return [t for part in parts for t in part]


@serve.deployment(ray_actor_options={"num_cpus": 0})
class Nothing:
    """Ray's own cost: a handle call that carries the same arrays and does no work."""

    async def infer(self, model, inputs):
        return inputs


def in_process(result, full_repository, adapter_port):
    import wasmtron

    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    inputs = {"INPUT0": a, "INPUT1": a}
    models = serve.run(WasmtronModels.bind(full_repository, model_control_mode="explicit",
                                           startup_models=["simple"]), name="models", route_prefix=None)
    out = models.infer.remote("simple", inputs).result()
    result["inprocess_handle_infer"] = bool((out["OUTPUT0"] == 2 * a).all())
    try:
        models.infer.remote("simple", {"INPUT0": a}).result()
        result["inprocess_handle_error"] = None
    except Exception as e:  # Serve wraps the replica's exception
        result["inprocess_handle_error"] = "INPUT1" in str(e) and "InvalidArgumentError" in str(e)
    nothing = serve.run(Nothing.bind(), name="nothing", route_prefix=None)

    port = free_port_of_serve()
    serve.run(TextApp.bind(full_repository), name="text", route_prefix="/text")
    import urllib.request
    texts = ["the server answers in process", "Ray Serve calls it"]
    request = urllib.request.Request(f"http://127.0.0.1:{port}/text/embed",
                                     data=json.dumps({"texts": texts}).encode(),
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as r:
        embeddings = np.array(json.loads(r.read())["embeddings"], dtype=np.float32)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/text/identity?string=h%C3%A9", timeout=60) as r:
        result["text_identity"] = json.loads(r.read())

    local = wasmtron.Server(model_repository=full_repository, model_control_mode="explicit",
                            startup_models=["simple", "embed_text"]).start(wait_until_ready=True)
    (response,) = local.model("embed_text").infer(inputs={"TEXT": [[t] for t in texts]})
    reference = np.from_dlpack(response.outputs["EMBEDDING"])
    result["text_embed_max_diff"] = float(np.abs(embeddings - reference).max())
    result["text_embed_shape"] = list(embeddings.shape)
    text_to_image(result, full_repository, port, local)

    simple_local = local.model("simple")
    import threading
    clients = threading.local()  # tritonclient.http (gevent) stays on the thread that made it

    def adapter():
        if not hasattr(clients, "http"):
            clients.http = httpclient.InferenceServerClient(f"127.0.0.1:{adapter_port}",
                                                            network_timeout=120)
        return clients.http
    http_inputs = [httpclient.InferInput("INPUT0", [1, 16], "INT32"),
                   httpclient.InferInput("INPUT1", [1, 16], "INT32")]
    for t in http_inputs:
        t.set_data_from_numpy(a)
    paths = {
        "inprocess_call": lambda: list(simple_local.infer(inputs=inputs)),
        "handle_nothing": lambda: nothing.infer.remote("simple", inputs).result(),
        "handle_inprocess": lambda: models.infer.remote("simple", inputs).result(),
        "adapter_through_serve": lambda: adapter().infer("simple", http_inputs),
    }
    latency, failures = {}, {}
    for callers in (1, 8):
        for name, call in paths.items():
            errors = []
            timed(call, 8 * callers, errors=errors)  # warm
            times = timed(call, REQUESTS, callers, errors=errors)
            latency[f"{name}@{callers}"] = percentiles(times) if times else None
            if errors:
                failures[f"{name}@{callers}"] = {"count": len(errors), "first": errors[0]}
    result["inprocess_latency_ms"] = latency
    # Timing runs do not stop at a failed call; the test decides which failures matter.
    result["latency_failures"] = failures
    local.stop()
    for name in ("models", "nothing", "text", "image"):
        serve.delete(name)


def text_to_image(result, full_repository, port, local):
    """Triton's Ray Serve text-to-image deployment (text_to_image.py): GET /generate answers
    a JPEG of the stable_diffusion stage's image, the same as the model gives in process."""
    import io
    import tempfile
    import urllib.error
    import urllib.request

    from PIL import Image

    image_dir = tempfile.mkdtemp(prefix="wtimages")
    env = {"WASMTRON_MODEL_REPOSITORY": full_repository, "WASMTRON_IMAGE_DIR": image_dir}
    serve.run(TritonDeployment.options(ray_actor_options={
        "num_cpus": 1, "runtime_env": {"env_vars": env}}).bind(),
        name="image", route_prefix="/image")

    def get(query):
        url = f"http://127.0.0.1:{port}/image/generate?{query}"
        try:
            with urllib.request.urlopen(url, timeout=300) as r:
                return r.status, r.headers.get("content-type"), r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.headers.get("content-type"), e.read()

    status, kind, jpeg = get("prompt=a%20castle%20on%20a%20hill&seed=3&steps=8")
    result["image_status"] = status
    result["image_type"] = kind
    image = np.asarray(Image.open(io.BytesIO(jpeg)).convert("RGB"))
    result["image_shape"] = list(image.shape)
    result["image_repeatable"] = get("prompt=a%20castle%20on%20a%20hill&seed=3&steps=8")[2] == jpeg
    local.load("stable_diffusion")
    (response,) = local.model("stable_diffusion").infer(inputs={
        "prompt": [["a castle on a hill"]], "seed": np.array([[3]]),
        "steps": np.array([[8]], np.int32)})
    direct = np.from_dlpack(response.outputs["generated_image"]).squeeze()
    png = get("prompt=a%20castle%20on%20a%20hill&seed=3&steps=8&format=png")[2]
    exact = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))
    result["image_png_equals_in_process"] = bool((exact == direct).all())
    saved = get("prompt=a%20tree&seed=1&steps=4&filename=tree.jpg")[0]
    result["image_saved"] = saved == 200 and os.path.exists(os.path.join(image_dir, "tree.jpg"))
    escape = get("prompt=a%20tree&steps=4&filename=..%2F..%2Fescaped.jpg")
    result["image_escape_status"] = escape[0]
    result["image_escaped_file"] = os.path.exists(os.path.join(os.path.dirname(image_dir),
                                                               "escaped.jpg"))
    bad = get("prompt=a%20tree&steps=0")
    result["image_bad_steps"] = [bad[0], "'steps'" in bad[2].decode(errors="replace")]


SERVE_PORT = {}


def free_port_of_serve():
    return SERVE_PORT["port"]


def give_up(*_):
    """A deployment that cannot start makes serve.run wait for ever: fail, saying where."""
    raise TimeoutError("gave up waiting; Serve says: " + repr(serve.status()))


def main():
    signal.signal(signal.SIGALRM, give_up)
    signal.alarm(int(os.environ.get("SMOKE_TIMEOUT_S", "600")))
    binary, repository = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
    full_repository = os.path.abspath(sys.argv[3]) if len(sys.argv) > 3 else None
    result = {}
    before = servers(binary)
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False,
             _temp_dir=os.environ.get("RAY_TMP", "/tmp/ray-wasmtron"))
    port = free_port()
    SERVE_PORT["port"] = port
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

    if full_repository:
        in_process(result, full_repository, port)

    serve.delete("wasmtron")
    serve.shutdown()
    ray.shutdown()
    result["orphans"] = len([p for p in servers(binary) if p not in before]) if wait(
        lambda: not [p for p in servers(binary) if p not in before], 60) is False else 0
    print(json.dumps(result))


if __name__ == "__main__":
    main()
