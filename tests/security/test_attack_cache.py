"""The response cache cannot be made to hold more than its size, to answer with a model's old
files, or to serve what the model does not answer. An answer's parameters count against the
cache's size (120 answers carrying 1 MiB each grow a 1 MiB cache by nothing); a model loaded
again from other files answers from them at once, in memory and in Redis; a value planted in
Redis with an output the model does not have, a wrong type, an absurd shape or an injected
parameter is a miss (the model runs and answers), while a well-formed planted value is served
(Redis is trusted by design: the control that shows the planting works)."""
import base64
import json
import os
import socket
import struct
import sys
import time

import numpy as np
import onnx
import pytest
import tritonclient.http as httpclient
from onnx import TensorProto, helper, numpy_helper

from attack import ROOT, Server, error_text, raw

sys.path.insert(0, os.path.join(ROOT, "tests", "python"))
from test_redis_cache import redis  # noqa: E402,F401  (the redis-server fixture)

CACHED_ANSWER = """backend: "onnxruntime"
max_batch_size: 0
input [ { name: "x", data_type: TYPE_INT32, dims: [ 1 ] } ]
output [ { name: "y", data_type: TYPE_INT32, dims: [ 1 ] } ]
response_cache { enable: true }
"""


def constant_model(value):
    """y = x * 0 + value: a model whose answer tells which files it was loaded from."""
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "zero"], ["zeroed"]),
         helper.make_node("Add", ["zeroed", "c"], ["y"])], "constant",
        [helper.make_tensor_value_info("x", TensorProto.INT32, [1])],
        [helper.make_tensor_value_info("y", TensorProto.INT32, [1])],
        [numpy_helper.from_array(np.array([0], np.int32), "zero"),
         numpy_helper.from_array(np.array([value], np.int32), "c")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)],
                             ir_version=8).SerializeToString()


def answer(server, x=7, model="answer"):
    t = httpclient.InferInput("x", [1], "INT32")
    t.set_data_from_numpy(np.array([x], np.int32))
    r = httpclient.InferenceServerClient(server.http).infer(model, [t])
    assert r.get_response().get("parameters") in (None, {}), r.get_response()
    return int(r.as_numpy("y")[0])


def cache_counts(server, model="answer"):
    c = httpclient.InferenceServerClient(server.http)
    i = c.get_inference_statistics(model)["model_stats"][0]["inference_stats"]
    return i["cache_hit"]["count"], i["cache_miss"]["count"]


def load_answering(server, value, model="answer"):
    config = {"name": model, "backend": "onnxruntime", "max_batch_size": 0,
              "input": [{"name": "x", "data_type": "TYPE_INT32", "dims": [1]}],
              "output": [{"name": "y", "data_type": "TYPE_INT32", "dims": [1]}],
              "response_cache": {"enable": True}}
    status, body = raw(server.http, "POST", f"/v2/repository/models/{model}/load",
                       {"parameters": {"config": json.dumps(config),
                                       "file:1/model.onnx":
                                       base64.b64encode(constant_model(value)).decode()}})
    assert status == 200, body


def rss_mib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


PARAM_MODEL = """backend: "python"
max_batch_size: 0
input [ { name: "x", data_type: TYPE_INT32, dims: [ 1 ] },
        { name: "size", data_type: TYPE_INT32, dims: [ 1 ] } ]
output [ { name: "y", data_type: TYPE_INT32, dims: [ 1 ] } ]
response_cache { enable: true }
"""

PARAM_MODEL_PY = '''import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "x").as_numpy()
            size = int(pb_utils.get_input_tensor_by_name(r, "size").as_numpy()[0])
            out.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("y", x)], parameters={"blob": "p" * size}))
        return out
'''


def test_an_answers_parameters_count_against_the_cache_size(tmp_path):
    repo = tmp_path / "repo"
    (repo / "blob" / "1").mkdir(parents=True)
    (repo / "blob" / "config.pbtxt").write_text(PARAM_MODEL)
    (repo / "blob" / "1" / "model.py").write_text(PARAM_MODEL_PY)
    s = Server(str(repo), "--cache-config", f"local,size={1 << 20}")
    try:
        client = httpclient.InferenceServerClient(s.http, network_timeout=120)

        def ask(x, size):
            ins = []
            for name, value in (("x", x), ("size", size)):
                t = httpclient.InferInput(name, [1], "INT32")
                t.set_data_from_numpy(np.array([value], np.int32))
                ins.append(t)
            r = client.infer("blob", ins)
            assert int(r.as_numpy("y")[0]) == x
            return r.get_response().get("parameters", {})

        # A small parameter is kept with its answer and served again: the cache works.
        assert ask(-1, 10) == {"blob": "p" * 10}
        assert ask(-1, 10) == {"blob": "p" * 10}
        assert cache_counts(s, "blob")[0] == 1
        before = rss_mib(s.proc.pid)
        for x in range(120):
            assert len(ask(x, 1 << 20)["blob"]) == 1 << 20
        grown = rss_mib(s.proc.pid) - before
        # Each answer is over the cache's 1 MiB: none is kept, the first is not a hit.
        ask(0, 1 << 20)
        assert cache_counts(s, "blob")[0] == 1
        assert grown < 48, f"the server grew by {grown:.0f} MiB for a 1 MiB cache"
    finally:
        s.stop()


@pytest.mark.parametrize("store", ["local", "redis"])
def test_a_model_loaded_again_answers_from_its_new_files(tmp_path, redis, store):  # noqa: F811
    _, port = redis
    repo = tmp_path / "repo"
    repo.mkdir()
    flags = (["--cache-config", f"local,size={16 << 20}"] if store == "local" else
             ["--cache-config", "redis,host=127.0.0.1", "--cache-config", f"redis,port={port}"])
    s = Server(str(repo), "--model-control-mode=explicit", *flags)
    try:
        load_answering(s, 1000)
        assert answer(s) == 1000
        assert answer(s) == 1000  # a hit
        assert cache_counts(s)[0] == 1
        load_answering(s, 2000)
        assert answer(s) == 2000, "an answer of the model's old files was served"
        status, body = raw(s.http, "POST", "/v2/repository/models/answer/unload", {})
        assert status == 200, body
        load_answering(s, 3000)
        assert answer(s) == 3000
    finally:
        s.stop()


def resp(port, *args):
    """One Redis command over RESP, its reply parsed (bulk strings as bytes)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        out = b"*%d\r\n" % len(args)
        for a in args:
            a = a if isinstance(a, bytes) else str(a).encode()
            out += b"$%d\r\n%s\r\n" % (len(a), a)
        sock.sendall(out)
        reader = sock.makefile("rb")

        def read():
            line = reader.readline()
            kind, rest = line[:1], line[1:-2]
            if kind == b"*":
                return [read() for _ in range(int(rest))]
            if kind == b"$":
                n = int(rest)
                return None if n < 0 else reader.read(n + 2)[:-2]
            if kind == b"-":
                raise AssertionError(rest.decode())
            return rest
        return read()


def stored(outputs, parameters=()):
    """A value in the server's Redis format: WTR1, parameters, outputs."""
    def text(b):
        b = b if isinstance(b, bytes) else b.encode()
        return struct.pack("<Q", len(b)) + b
    out = b"WTR1" + struct.pack("<Q", len(parameters))
    for name, value in parameters:
        out += text(name) + b"\x04" + text(value)
    out += struct.pack("<Q", len(outputs))
    for name, datatype, shape, data in outputs:
        out += text(name) + text(datatype) + struct.pack("<Q", len(shape))
        out += b"".join(struct.pack("<q", d) for d in shape) + text(data)
    return out


FOUR = struct.pack("<i", 4242)
PLANTED = {
    "an output the model does not have": stored([("EVIL", "BYTES", [1], b"\x04\0\0\0evil")]),
    "an output of another type": stored([("y", "FP64", [1], struct.pack("<d", 4242.0))]),
    "an absurd shape": stored([("y", "INT32", [0, 1 << 62], b"")]),
    "an injected parameter": stored([("y", "INT32", [1], FOUR)], [("injected", "x" * 64)]),
    "two outputs": stored([("y", "INT32", [1], FOUR), ("y", "INT32", [1], FOUR)]),
}


def test_redis_values_that_do_not_fit_the_model_are_misses(tmp_path, redis):  # noqa: F811
    _, port = redis
    repo = tmp_path / "repo"
    (repo / "answer" / "1").mkdir(parents=True)
    (repo / "answer" / "config.pbtxt").write_text(CACHED_ANSWER)
    (repo / "answer" / "1" / "model.onnx").write_bytes(constant_model(1000))
    s = Server(str(repo), "--cache-config", "redis,host=127.0.0.1",
               "--cache-config", f"redis,port={port}")
    try:
        assert answer(s) == 1000
        deadline = time.monotonic() + 60
        while not resp(port, "KEYS", "wasmtron:response:*") and time.monotonic() < deadline:
            time.sleep(0.1)
        [key] = resp(port, "KEYS", "wasmtron:response:*")
        # The control: a planted value that fits is served, so the planting reaches the server.
        resp(port, "SET", key, stored([("y", "INT32", [1], FOUR)]))
        assert answer(s) == 4242
        for what, value in PLANTED.items():
            resp(port, "SET", key, value)
            assert answer(s) == 1000, what
        assert any("does not fit the model's configuration" in line for line in s.log), \
            "the first misfit is logged"
        assert sum("does not fit" in line for line in s.log) == 1, "logged once"
    finally:
        s.stop()


def test_trace_settings_exist_only_for_models_that_exist(tmp_path):
    repo = tmp_path / "repo"
    (repo / "answer" / "1").mkdir(parents=True)
    (repo / "answer" / "config.pbtxt").write_text(CACHED_ANSWER)
    (repo / "answer" / "1" / "model.onnx").write_bytes(constant_model(1000))
    s = Server(str(repo))
    try:
        setting = {"trace_level": ["TIMESTAMPS"], "trace_rate": "1"}
        status, body = raw(s.http, "POST", "/v2/models/nothing/trace/setting", setting)
        assert status == 404 and "nothing" in error_text(body), body
        status, body = raw(s.http, "POST", "/v2/models/" + "n" * 1000 + "/trace/setting",
                           setting)
        assert status == 400, body
        status, body = raw(s.http, "GET", "/v2/models/nothing/trace/setting")
        assert status == 404, body
        before = rss_mib(s.proc.pid)
        for i in range(300):
            status, _ = raw(s.http, "POST", f"/v2/models/{'m' * 8000}{i}/trace/setting", setting)
            assert status == 400
        assert rss_mib(s.proc.pid) - before < 16
        status, body = raw(s.http, "POST", "/v2/models/answer/trace/setting", setting)
        assert status == 200 and body["trace_rate"] == "1", body
        import tritonclient.grpc as grpcclient
        from tritonclient.utils import InferenceServerException
        g = grpcclient.InferenceServerClient(s.grpc)
        with pytest.raises(InferenceServerException) as e:
            g.update_trace_settings(model_name="nothing", settings={"trace_rate": "1"})
        assert "StatusCode.NOT_FOUND" in str(e.value.status()), e.value
        with pytest.raises(InferenceServerException) as e:
            g.get_trace_settings(model_name="../x")
        assert "StatusCode.INVALID_ARGUMENT" in str(e.value.status()), e.value
        assert g.get_trace_settings(model_name="answer").settings["trace_rate"].value == ["1"]
        g.close()
        assert answer(s) == 1000
    finally:
        s.stop()
