"""System shared memory with the stock clients: tritonclient's shm utilities create POSIX
shared memory, the client registers it, and inputs and outputs travel through it instead of the
request and response bodies, over HTTP and gRPC, as in Triton's simple_*_shm_client examples."""
import base64
import os
import shutil
import threading
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from conftest import Server, copy_models

BYTES = 16 * 4  # one [1, 16] INT32 tensor


# `simple` holding each request until a second one comes (up to two minutes).
PAIRS = "dynamic_batching { preferred_batch_size: [ 2 ] max_queue_delay_microseconds: 120000000 }\n"


@pytest.fixture(scope="module")
def shm_server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("shm")
    copy_models(str(repo), ["simple"])
    shutil.copytree(repo / "simple", repo / "simple_pairs")
    config = repo / "simple_pairs" / "config.pbtxt"
    config.write_text(config.read_text().replace('name: "simple"', 'name: "simple_pairs"') + PAIRS)
    s = Server(str(repo), "--allow-client-shm=true")
    yield s
    s.stop()


@pytest.fixture(params=["http", "grpc"])
def client(request, shm_server):
    mod = httpclient if request.param == "http" else grpcclient
    address = shm_server.http if request.param == "http" else shm_server.grpc
    c = mod.InferenceServerClient(address)
    c.unregister_system_shared_memory()
    yield mod, c
    c.unregister_system_shared_memory()


@pytest.fixture
def regions(request):
    """An input region holding INPUT0 and INPUT1 and an output region for both outputs, under
    keys unique to this test and process."""
    tag = f"{os.getpid()}_{request.node.name}".replace("[", "_").replace("]", "")
    inputs = shm.create_shared_memory_region("input_data", f"/wt_in_{tag}", 2 * BYTES)
    outputs = shm.create_shared_memory_region("output_data", f"/wt_out_{tag}", 2 * BYTES)
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    b = np.full((1, 16), 3, dtype=np.int32)
    shm.set_shared_memory_region(inputs, [a, b])
    yield {"in": (f"/wt_in_{tag}", inputs), "out": (f"/wt_out_{tag}", outputs), "a": a, "b": b}
    shm.destroy_shared_memory_region(inputs)
    shm.destroy_shared_memory_region(outputs)


def shm_inputs(mod):
    x = mod.InferInput("INPUT0", [1, 16], "INT32")
    x.set_shared_memory("input_data", BYTES)
    y = mod.InferInput("INPUT1", [1, 16], "INT32")
    y.set_shared_memory("input_data", BYTES, offset=BYTES)
    return [x, y]


def shm_outputs(mod, size=BYTES):
    outs = []
    for i, name in enumerate(["OUTPUT0", "OUTPUT1"]):
        o = mod.InferRequestedOutput(name, binary_data=True) if mod is httpclient \
            else mod.InferRequestedOutput(name)
        o.set_shared_memory("output_data", size, offset=i * BYTES)
        outs.append(o)
    return outs


def status_names(mod, c):
    status = c.get_system_shared_memory_status()
    if mod is httpclient:
        return {r["name"]: (r["key"], int(r["byte_size"])) for r in status}
    return {n: (r.key, r.byte_size) for n, r in status.regions.items()}


def test_inputs_and_outputs_travel_through_shared_memory(client, regions):
    mod, c = client
    (in_key, _), (out_key, out_handle) = regions["in"], regions["out"]
    c.register_system_shared_memory("input_data", in_key, 2 * BYTES)
    c.register_system_shared_memory("output_data", out_key, 2 * BYTES)
    assert status_names(mod, c) == {"input_data": (in_key, 2 * BYTES),
                                    "output_data": (out_key, 2 * BYTES)}

    result = c.infer("simple", shm_inputs(mod), outputs=shm_outputs(mod))
    a, b = regions["a"], regions["b"]
    for i, (name, expected) in enumerate([("OUTPUT0", a + b), ("OUTPUT1", a - b)]):
        out = result.get_output(name)
        datatype = out["datatype"] if mod is httpclient else out.datatype
        shape = out["shape"] if mod is httpclient else list(out.shape)
        assert (datatype, shape) == ("INT32", [1, 16])
        got = shm.get_contents_as_numpy(out_handle, np.int32, shape, offset=i * BYTES)
        assert (got == expected).all(), (name, got)

    # New data in the same regions, no new registration: the next request sees it.
    shm.set_shared_memory_region(regions["in"][1], [a * 10, b])
    c.infer("simple", shm_inputs(mod), outputs=shm_outputs(mod))
    got = shm.get_contents_as_numpy(out_handle, np.int32, [1, 16])
    assert (got == a * 10 + b).all()

    c.unregister_system_shared_memory("input_data")
    assert set(status_names(mod, c)) == {"output_data"}
    c.unregister_system_shared_memory()
    assert status_names(mod, c) == {}


def test_mistakes_are_named_and_the_server_keeps_serving(client, regions):
    mod, c = client
    (in_key, _), (out_key, _) = regions["in"], regions["out"]

    def refused(call, *words):
        with pytest.raises(InferenceServerException) as e:
            call()
        for w in words:
            assert w in str(e.value), str(e.value)

    refused(lambda: c.register_system_shared_memory("r", "/wt_no_such_key", 8),
            "'/wt_no_such_key'", "'r'")
    refused(lambda: c.register_system_shared_memory("r", in_key, 4 * BYTES), "do not fit")
    refused(lambda: c.register_system_shared_memory("r", "/../etc/passwd", 8),
            "not a POSIX shared memory name")
    c.register_system_shared_memory("input_data", in_key, 2 * BYTES)
    refused(lambda: c.register_system_shared_memory("input_data", in_key, 8),
            "shared memory region 'input_data' already in manager")
    # An output region is needed and not registered yet.
    refused(lambda: c.infer("simple", shm_inputs(mod), outputs=shm_outputs(mod)),
            "'output_data'")
    c.register_system_shared_memory("output_data", out_key, 2 * BYTES)
    refused(lambda: c.infer("simple", shm_inputs(mod), outputs=shm_outputs(mod, size=8)),
            "output 'OUTPUT0'", "too small")
    past = shm_inputs(mod)
    past[1].set_shared_memory("input_data", BYTES, offset=BYTES + 4)
    refused(lambda: c.infer("simple", past), "input 'INPUT1'",
            "Invalid offset + byte size for shared memory region: 'input_data'")
    past[1].set_shared_memory("input_data", BYTES, offset=2 * BYTES)
    refused(lambda: c.infer("simple", past),
            "Invalid offset for shared memory region: 'input_data'")
    refused(lambda: c.get_system_shared_memory_status("nope"),
            "Unable to find system shared memory region: 'nope'")
    # Triton's checks of a key (L0_shared_memory test_register_reserved_names,
    # test_register_invalid_shm_key): slashes alone, or the Python backend's reserved prefix.
    for bad in ("/", "///"):
        refused(lambda: c.register_system_shared_memory("k", bad, 8),
                f"cannot register shared memory region 'k' - invalid shm key '{bad}'")
    for bad in ("triton_python_backend_shm_region_x", "///triton_python_backend_shm_region_x"):
        refused(lambda: c.register_system_shared_memory("k", bad, 8),
                f"cannot register shared memory region 'k' with key '{bad}' as the key "
                "contains the reserved prefix 'triton_python_backend_shm_region_'")

    # Still serving, from the request body as well as from shared memory.
    a = np.ones((1, 16), dtype=np.int32)
    body = [mod.InferInput("INPUT0", [1, 16], "INT32"), mod.InferInput("INPUT1", [1, 16], "INT32")]
    for t in body:
        t.set_data_from_numpy(a)
    assert (c.infer("simple", body).as_numpy("OUTPUT0") == 2).all()
    c.infer("simple", shm_inputs(mod), outputs=shm_outputs(mod))


def pending(server, model):
    for line in server.metrics_text().splitlines():
        if line.startswith("nv_inference_pending_request_count{") and f'model="{model}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_region_unregistered_during_inference_goes_when_its_last_request_ends(
        client, regions, shm_server):
    """L0_shared_memory test_unregister_shm_during_inference_{single,multiple}_req: unregistering
    regions a request is using only marks them; they stay listed and usable (a second request
    may use them) until the last request using them is answered, then they are gone."""
    mod, c = client
    (in_key, _), (out_key, out_handle) = regions["in"], regions["out"]
    c.register_system_shared_memory("input_data", in_key, 2 * BYTES)
    c.register_system_shared_memory("output_data", out_key, 2 * BYTES)
    address = shm_server.http if mod is httpclient else shm_server.grpc
    answers = []
    first = threading.Thread(target=lambda: answers.append(
        mod.InferenceServerClient(address).infer("simple_pairs", shm_inputs(mod),
                                                 outputs=shm_outputs(mod))))
    first.start()
    deadline = time.time() + 120
    while pending(shm_server, "simple_pairs") < 1:
        assert time.time() < deadline, "the first request never queued"
        time.sleep(0.1)
    c.unregister_system_shared_memory()
    assert set(status_names(mod, c)) == {"input_data", "output_data"}
    answers.append(mod.InferenceServerClient(address).infer("simple_pairs", shm_inputs(mod), outputs=shm_outputs(mod)))
    first.join(120)
    assert len(answers) == 2
    got = shm.get_contents_as_numpy(out_handle, np.int32, [1, 16])
    assert (got == regions["a"] + regions["b"]).all()
    assert status_names(mod, c) == {}


def test_the_server_lists_the_extension(shm_server):
    c = httpclient.InferenceServerClient(shm_server.http)
    assert "system_shared_memory" in c.get_server_metadata()["extensions"]
    # CUDA shared memory needs a GPU build and a GPU; the default build says so.
    assert c.get_cuda_shared_memory_status() == []
    with pytest.raises(InferenceServerException) as e:
        c.register_cuda_shared_memory("g", base64.b64encode(bytes(64)), 0, 64)
    assert "CUDA shared memory is not available" in str(e.value), str(e.value)
    assert "--features cuda" in str(e.value), str(e.value)
