"""The `wasmtron` Python package (python/, built and installed by `make python-package`): the
server in-process with the API of Triton's `tritonserver` package, with no network hop.
Outputs are checked against what the models compute; errors against the messages the HTTP API
gives."""
import asyncio
import gc
import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import wasmtron
from conftest import copy_models


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    root = tmp_path_factory.mktemp("inprocess")
    copy_models(str(root), ["simple", "identity_bytes", "add_sub", "words"])
    return str(root)


@pytest.fixture(scope="module")
def server(repo):
    with wasmtron.Server(model_repository=repo) as s:
        yield s


def arrays(response):
    """A response's outputs as NumPy arrays, the documented ways: DLPack, to_bytes_array."""
    return {name: t.to_bytes_array() if t.data_type == wasmtron.DataType.BYTES
            else np.from_dlpack(t) for name, t in response.outputs.items()}


def infer(model, inputs, **kwargs):
    """The one response of a model that answers once."""
    (response,) = list(model.infer(inputs=inputs, **kwargs))
    assert response.final and response.error is None
    return arrays(response)


class DLPackOnly:
    """A tensor known only through DLPack, not NumPy's type (as a CPU torch tensor is)."""

    def __init__(self, array):
        self._array = array

    def __dlpack__(self, **kwargs):
        return self._array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._array.__dlpack_device__()


def pair(k):
    a = np.arange(16, dtype=np.int32).reshape(1, 16) + 100 * k
    b = np.full((1, 16), k, dtype=np.int32)
    return a, b


def test_infer_yields_responses_whose_tensors_numpy_reads(server):
    assert server.ready() and server.live()
    assert server.model("simple").ready()
    a, b = pair(3)
    responses = list(server.model("simple").infer(inputs={"INPUT0": a, "INPUT1": b},
                                                  request_id="req-3"))
    assert len(responses) == 1 and responses[0].final and responses[0].error is None
    response = responses[0]
    assert response.request_id == "req-3"
    assert (response.model.name, response.model.version) == ("simple", 1)
    out = response.outputs["OUTPUT0"]
    assert isinstance(out, wasmtron.Tensor)
    assert out.data_type == wasmtron.DataType.INT32 and list(out.shape) == [1, 16]
    assert out.memory_type == wasmtron.MemoryType.CPU and out.size == a.nbytes
    assert out.__dlpack_device__() == (wasmtron.DLDeviceType.kDLCPU, 0)
    np.testing.assert_array_equal(np.from_dlpack(out), a + b)
    np.testing.assert_array_equal(np.from_dlpack(response.outputs["OUTPUT1"]), a - b)
    only = infer(server.model("simple"), {"INPUT0": a, "INPUT1": b}, output_names=["OUTPUT1"])
    assert list(only) == ["OUTPUT1"]
    # A request object, as Triton's create_request makes it; tensors as inputs too.
    request = server.model("simple").create_request(
        inputs={"INPUT0": wasmtron.Tensor.from_dlpack(a), "INPUT1": b.tolist()})
    (again,) = server.model("simple").infer(request)
    np.testing.assert_array_equal(np.from_dlpack(again.outputs["OUTPUT0"]), a + b)
    # Any DLPack producer in host memory is an input (as a CPU torch tensor is).
    (foreign,) = server.model("simple").infer(inputs={"INPUT0": DLPackOnly(a),
                                                      "INPUT1": DLPackOnly(b)})
    np.testing.assert_array_equal(np.from_dlpack(foreign.outputs["OUTPUT1"]), a - b)
    assert list(wasmtron.Tensor.from_dlpack(DLPackOnly(a)).shape) == [1, 16]
    index = server.models()
    assert index[("simple", 1)].state == "READY"
    assert index["simple"].name == "simple"
    assert server.models(exclude_not_ready=True).keys() <= index.keys()
    meta = server.model("simple").metadata()
    assert meta["name"] == "simple" and [i["name"] for i in meta["inputs"]] == ["INPUT0", "INPUT1"]
    assert server.model("simple").batch_properties() == wasmtron.ModelBatchFlag.FIRST_DIM
    assert server.metadata()["name"] == "triton"


def test_bytes_round_trip_as_string_and_bytes_arrays(server):
    words = np.array([[b"alpha", "b\u00e9ta".encode(), b""]], dtype=np.object_)
    (response,) = server.model("identity_bytes").infer(inputs={"INPUT0": words})
    out = response.outputs["OUTPUT0"]
    assert out.data_type == wasmtron.DataType.BYTES
    assert out.to_bytes_array().tolist() == words.tolist()
    assert out.to_string_array().tolist() == [["alpha", "b\u00e9ta", ""]]
    with pytest.raises(wasmtron.UnsupportedError, match="to_bytes_array"):
        np.from_dlpack(out)
    # Nested lists of str, as Triton's example sends a prompt: [[prompt]].
    as_str = infer(server.model("identity_bytes"), {"INPUT0": [["x", "yz"]]})
    assert as_str["OUTPUT0"].tolist() == [[b"x", b"yz"]]
    tensor = wasmtron.Tensor.from_string_array([["a", "bc"]])
    assert infer(server.model("identity_bytes"), {"INPUT0": tensor})["OUTPUT0"].tolist() == \
        [[b"a", b"bc"]]


def test_a_wasm_stage_runs_in_process(server):
    # add_sub does not batch: its inputs are [4].
    x = np.array([1.5, 2.0, -3.0, 4.25], dtype=np.float32)
    y = np.array([0.5, 1.0, 1.0, 0.25], dtype=np.float32)
    out = infer(server.model("add_sub"), {"INPUT0": x, "INPUT1": y})
    np.testing.assert_array_equal(out["OUTPUT0"], x + y)
    np.testing.assert_array_equal(out["OUTPUT1"], x - y)


def test_threads_and_asyncio_infer_concurrently(server):
    simple = server.model("simple")

    def one(k):
        a, b = pair(k)
        return k, infer(simple, {"INPUT0": a, "INPUT1": b})["OUTPUT0"]

    with ThreadPoolExecutor(8) as pool:
        for k, got in pool.map(one, range(32)):
            a, b = pair(k)
            np.testing.assert_array_equal(got, a + b)

    async def one_async(k):
        return [arrays(r) async for r in
                simple.async_infer(inputs=dict(zip(("INPUT0", "INPUT1"), pair(k))))]

    async def many():
        return await asyncio.gather(*[one_async(k) for k in range(8)])

    for k, responses in enumerate(asyncio.run(many())):
        a, b = pair(k)
        assert len(responses) == 1
        np.testing.assert_array_equal(responses[0]["OUTPUT0"], a + b)


def test_mistakes_raise_the_servers_errors_and_it_keeps_serving(server):
    a, b = pair(1)
    with pytest.raises(wasmtron.InvalidArgumentError, match=r"Expected \[4\], got \[1,4\]"):
        infer(server.model("add_sub"), {"INPUT0": np.zeros((1, 4), np.float32),
                                        "INPUT1": np.zeros((1, 4), np.float32)})
    with pytest.raises(wasmtron.NotFoundError, match="'ghost'"):
        infer(server.model("ghost"), {"INPUT0": a})
    with pytest.raises(wasmtron.InvalidArgumentError, match="INPUT0") as wrong:
        infer(server.model("simple"), {"INPUT0": a.astype(np.float32), "INPUT1": b})
    assert isinstance(wrong.value, wasmtron.WasmtronError)
    assert isinstance(wrong.value, wasmtron.TritonError)
    with pytest.raises(wasmtron.InvalidArgumentError, match="INPUT1"):
        infer(server.model("simple"), {"INPUT0": a})
    with pytest.raises(wasmtron.InvalidArgumentError, match="INPUT0"):
        infer(server.model("simple"), {"INPUT0": np.zeros((1, 15), np.int32), "INPUT1": b})
    with pytest.raises(wasmtron.NotFoundError, match="version 7"):
        infer(server.model("simple", 7), {"INPUT0": a, "INPUT1": b})
    with pytest.raises(wasmtron.InvalidArgumentError, match="parameter 'p'"):
        infer(server.model("simple"), {"INPUT0": a, "INPUT1": b}, parameters={"p": [1]})
    with pytest.raises(wasmtron.UnsupportedError, match="output_memory_type"):
        infer(server.model("simple"), {"INPUT0": a, "INPUT1": b},
              output_memory_type=wasmtron.MemoryType.GPU)
    with pytest.raises(wasmtron.InvalidArgumentError, match="InferenceRequest or keywords"):
        server.model("simple").infer({"INPUT0": a, "INPUT1": b})
    # Triton's code (UNAVAILABLE) and words outside explicit mode.
    with pytest.raises(wasmtron.UnavailableError, match="not allowed if polling is enabled"):
        server.load("simple")
    # Without raise_on_error the error is the final response's.
    (failed,) = server.model("simple").infer(inputs={"INPUT0": a}, raise_on_error=False)
    assert failed.final and isinstance(failed.error, wasmtron.InvalidArgumentError)
    assert failed.outputs == {}
    out = infer(server.model("simple"), {"INPUT0": a, "INPUT1": b})
    np.testing.assert_array_equal(out["OUTPUT0"], a + b)
    assert 'nv_inference_request_success{model="simple",version="1"}' in server.metrics()


def test_the_tritonserver_examples_calls_run_unchanged(repo, tmp_path):
    """The deployment code of Triton's Ray Serve example, as written for `tritonserver`."""
    import wasmtron as tritonserver

    log = tmp_path / "server.log"
    server = tritonserver.Server(model_repository=[repo],
                                 model_control_mode=tritonserver.ModelControlMode.EXPLICIT,
                                 log_info=True, log_file=str(log))
    server.start(wait_until_ready=True)
    assert server.metadata()["extensions"]
    assert not server.model("identity_bytes").ready()
    model = server.load("identity_bytes")
    assert isinstance(model, tritonserver.Model) and model.ready()
    output = []
    for response in model.infer(inputs={"INPUT0": [["hello"]]}):
        output.append(response.outputs["OUTPUT0"].to_string_array()[0][0])
    assert output == ["hello"]
    assert ("identity_bytes", 1) in server.models()
    server.unload(model, wait_until_unloaded=True)
    assert not server.model("identity_bytes").ready()
    server.stop()
    # The load was logged (log_info), to the file asked for; a second server's options do not
    # change where the first one installed the log.
    assert "identity_bytes" in log.read_text()
    # Options as an object, with the control mode by name.
    options = tritonserver.Options(model_repository=repo, model_control_mode="explicit",
                                   startup_models=["simple"])
    with tritonserver.Server(options) as s:
        assert s.model("simple").ready() and not s.model("words").ready()
        # A configuration given with the load, as the repository extension's "config".
        config = json.dumps({
            "backend": "wasm", "max_batch_size": 0,
            "input": [{"name": "TEXT", "data_type": "TYPE_STRING", "dims": [1]}],
            "output": [{"name": "WORD", "data_type": "TYPE_STRING", "dims": [1]},
                       {"name": "POSITION", "data_type": "TYPE_INT64", "dims": [1]}],
            "model_transaction_policy": {"decoupled": True},
            "parameters": {"max_words": {"string_value": "2"}}})
        s.load("words", parameters={"config": config})
        # The configuration given is the one served: two words, then the final response.
        assert len(list(s.model("words").infer(inputs={"TEXT": ["a b c d"]}))) == 3
        assert s.model("words").config()["parameters"]["max_words"]["string_value"] == "2"
        with pytest.raises(tritonserver.InvalidArgumentError, match="'weights'"):
            s.load("words", parameters={"weights": "x"})
        with pytest.raises(tritonserver.InvalidArgumentError, match="Server already started"):
            s.start()


def test_explicit_control_and_lifecycle(repo):
    s = wasmtron.Server(model_repository=repo, model_control_mode="explicit",
                        startup_models=["simple"])
    with pytest.raises(wasmtron.InvalidArgumentError, match="not started"):
        s.model("simple")
    s.start()
    a, b = pair(2)
    assert infer(s.model("simple"), {"INPUT0": a, "INPUT1": b})["OUTPUT0"].sum() > 0
    assert not s.model("identity_bytes").ready()
    s.load("identity_bytes")
    assert s.model("identity_bytes").ready()
    s.unload("simple")
    with pytest.raises(wasmtron.NotFoundError, match="simple"):
        infer(s.model("simple"), {"INPUT0": a, "INPUT1": b})
    # A second server in the same process serves the same repository side by side.
    with wasmtron.Server(model_repository=repo) as other:
        out = infer(other.model("identity_bytes"), {"INPUT0": np.array([[b"two"]], dtype=object)})
        assert out["OUTPUT0"].tolist() == [[b"two"]]
    model = s.model("identity_bytes")
    assert s.stop() is True
    with pytest.raises(wasmtron.InvalidArgumentError, match="not started"):
        infer(model, {"INPUT0": np.array([[b"x"]], dtype=object)})
    # Stopped, it starts again.
    s.start(wait_until_ready=True)
    assert s.model("simple").ready()
    s.stop()
    with pytest.raises(wasmtron.InvalidArgumentError, match="model_control_mode 'sometimes'"):
        wasmtron.Server(model_repository=repo, model_control_mode="sometimes").start()
    with pytest.raises(wasmtron.InvalidArgumentError, match="not a directory"):
        wasmtron.Server(model_repository=repo + "/nope").start()


def test_a_dropped_server_drains_and_stops(repo):
    s = wasmtron.Server(model_repository=repo).start()
    simple = s.model("simple")
    a, b = pair(5)
    with ThreadPoolExecutor(4) as pool:
        answers = [pool.submit(infer, simple, {"INPUT0": a, "INPUT1": b}) for _ in range(16)]
        results = [f.result() for f in answers]
    assert all((r["OUTPUT0"] == a + b).all() for r in results)
    del s, simple
    gc.collect()  # drops the core: drains, unloads, stops its runtime, without hanging


def test_a_decoupled_model_streams_its_responses(server):
    import queue

    words = server.model("words")
    assert words.transaction_properties() == wasmtron.ModelTxnPropertyFlag.DECOUPLED
    text = np.array(["the quick brown fox"], dtype=object)
    responses = list(words.infer(inputs={"TEXT": text}))
    got = [(r.outputs["WORD"].to_bytes_array().tolist(),
            np.from_dlpack(r.outputs["POSITION"]).tolist()) for r in responses[:-1]]
    assert got == [([b"the"], [0]), ([b"quick"], [1]), ([b"brown"], [2]), ([b"fox"], [3])]
    # As Triton's iterator: the last is an empty final response.
    assert [r.final for r in responses] == [False] * 4 + [True]
    assert responses[-1].outputs == {}
    # Leaving early is fine (cancel stops waiting).
    iterator = words.infer(inputs={"TEXT": text})
    first = next(iterator)
    iterator.cancel()
    assert first.outputs["WORD"].to_bytes_array().tolist() == [b"the"]
    assert list(iterator) == []
    # A response_queue receives every response too.
    fed = queue.SimpleQueue()
    assert len(list(words.infer(inputs={"TEXT": text}, response_queue=fed))) == 5
    assert fed.qsize() == 5
    with pytest.raises(wasmtron.NotFoundError, match="'ghost'"):
        list(server.model("ghost").infer(inputs={"TEXT": text}))


def test_statistics_count_what_ran(repo):
    with wasmtron.Server(model_repository=repo) as s:
        a, b = pair(1)
        for _ in range(3):
            infer(s.model("simple"), {"INPUT0": a, "INPUT1": b})
        stats = s.model("simple").statistics()["model_stats"][0]
        assert (stats["name"], stats["version"], stats["inference_count"]) == ("simple", "1", 3)
        assert stats["inference_stats"]["success"]["count"] == 3
        every = {m["name"] for m in s.statistics()["model_stats"]}
        assert {"simple", "identity_bytes", "add_sub", "words"} <= every


def test_the_same_server_answers_remote_callers_on_its_listeners(repo):
    import socket
    import urllib.request

    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    s = wasmtron.Server(model_repository=repo).start(http_port=0, grpc_port=0, metrics_port=0)
    urls = s.addresses
    assert set(urls) == {"http", "grpc", "metrics"}
    a, b = pair(6)
    # A remote call over each protocol, then one in-process: the statistics count all three.
    http = httpclient.InferenceServerClient(urls["http"])
    assert http.is_server_ready() and http.is_model_ready("simple")
    inputs = [httpclient.InferInput("INPUT0", [1, 16], "INT32"),
              httpclient.InferInput("INPUT1", [1, 16], "INT32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    np.testing.assert_array_equal(http.infer("simple", inputs).as_numpy("OUTPUT0"), a + b)
    grpc = grpcclient.InferenceServerClient(urls["grpc"])
    ginputs = [grpcclient.InferInput("INPUT0", [1, 16], "INT32"),
               grpcclient.InferInput("INPUT1", [1, 16], "INT32")]
    ginputs[0].set_data_from_numpy(a)
    ginputs[1].set_data_from_numpy(b)
    np.testing.assert_array_equal(grpc.infer("simple", ginputs).as_numpy("OUTPUT1"), a - b)
    infer(s.model("simple"), {"INPUT0": a, "INPUT1": b})
    assert s.model("simple").statistics()["model_stats"][0]["inference_count"] == 3
    metrics = urllib.request.urlopen(f"http://{urls['metrics']}/metrics", timeout=30).read().decode()
    assert 'nv_inference_request_success{model="simple",version="1"} 3' in metrics
    grpc.close()
    http.close()
    # A port in use fails the start, naming the listener; the first server is untouched.
    with pytest.raises(wasmtron.UnavailableError, match="cannot listen on .* for http"):
        wasmtron.Server(model_repository=repo).start(http_port=int(urls["http"].rsplit(":", 1)[1]))
    assert s.stop() is True
    assert s.addresses == {}
    host, port = urls["http"].rsplit(":", 1)
    with pytest.raises(OSError):
        socket.create_connection((host, int(port)), timeout=5).close()


def test_outputs_lend_the_servers_memory_and_outlive_the_server(repo):
    s = wasmtron.Server(model_repository=repo).start()
    a, b = pair(7)
    (response,) = s.model("simple").infer(inputs={"INPUT0": a, "INPUT1": b})
    tensor = response.outputs["OUTPUT0"]
    out = np.from_dlpack(tensor)
    owner = tensor.memory_buffer.owner
    assert tensor.data_ptr == out.ctypes.data  # DLPack lends the same memory
    while isinstance(owner, (np.ndarray, memoryview)):
        owner = owner.base if isinstance(owner, np.ndarray) else owner.obj
    # No copy into a Python bytes object: the array reads the server's own output memory.
    assert type(owner).__name__ == "TensorBuffer" and len(owner) == a.nbytes
    assert not out.flags.writeable
    with pytest.raises(ValueError):
        out[0, 0] = 1
    assert memoryview(owner).readonly
    s.stop()
    del s, response, tensor
    gc.collect()
    np.testing.assert_array_equal(out, a + b)  # still valid: the array owns its memory
    words = wasmtron.Server(model_repository=repo).start()
    text = infer(words.model("identity_bytes"), {"INPUT0": np.array([[b"kept"]], dtype=object)})
    words.stop()
    assert text["OUTPUT0"].tolist() == [[b"kept"]]


def test_a_server_config_file_guards_the_listeners_not_in_process_calls(repo, tmp_path):
    import subprocess

    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    from conftest import BINARY

    key = "py-tenant-key-123"
    hashed = subprocess.run([BINARY, "hash-key"], input=key, capture_output=True, text=True,
                            check=True).stdout.strip()
    config = tmp_path / "wasmtron.toml"
    config.write_text(f'[[tenant]]\nname = "team"\napi_keys = [{hashed}]\ninfer = ["simple"]\n')
    with pytest.raises(wasmtron.InvalidArgumentError, match="nope.toml"):
        wasmtron.Server(model_repository=repo, config=str(tmp_path / "nope.toml")).start()
    s = wasmtron.Server(model_repository=repo, config=str(config)).start(http_port=0)
    try:
        a, b = pair(8)
        np.testing.assert_array_equal(
            infer(s.model("simple"), {"INPUT0": a, "INPUT1": b})["OUTPUT0"], a + b)
        inputs = [httpclient.InferInput("INPUT0", [1, 16], "INT32"),
                  httpclient.InferInput("INPUT1", [1, 16], "INT32")]
        inputs[0].set_data_from_numpy(a)
        inputs[1].set_data_from_numpy(b)
        client = httpclient.InferenceServerClient(s.addresses["http"])
        with pytest.raises(InferenceServerException) as refused:
            client.infer("simple", inputs)
        assert refused.value.status() == "401"
        out = client.infer("simple", inputs, headers={"authorization": f"Bearer {key}"})
        np.testing.assert_array_equal(out.as_numpy("OUTPUT0"), a + b)
        words = httpclient.InferInput("INPUT0", [1, 1], "BYTES")
        words.set_data_from_numpy(np.array([[b"x"]], dtype=object))
        with pytest.raises(InferenceServerException) as other_model:
            client.infer("identity_bytes", [words], headers={"authorization": f"Bearer {key}"})
        assert other_model.value.status() in ("403", "404")
        client.close()
    finally:
        s.stop()


def test_the_manuals_python_snippets_run(monkeypatch):
    """docs/python.md's snippets, as a user copies them (fixed ports swapped for free ones)."""
    import os
    import re

    from conftest import ROOT

    text = open(os.path.join(ROOT, "docs", "python.md"), encoding="utf-8").read()
    section = text[text.index("## From Python, in-process"):]
    snippets = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(snippets) >= 2, "docs/python.md's in-process section lost its snippets"
    monkeypatch.chdir(ROOT)
    for code in snippets:
        code = re.sub(r"(http|grpc|metrics)_port=\d+", r"\1_port=0", code)
        scope = {}
        exec(compile(code, "docs/python.md", "exec"), scope)
        server = scope.get("server")
        if isinstance(server, wasmtron.Server):
            server.stop()
