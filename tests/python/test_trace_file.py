"""Triton's trace files (`--trace-config triton,file=…`, `level=TIMESTAMPS`, `rate=`,
`triton,log-frequency=`, and the older `--trace-file` / `--trace-level` / `--trace-rate`): each
traced request is written as Triton's JSON trace — one object with its id, model, version and
request id, then one object per timestamp — read here the way Triton's `trace_summary.py` reads
it (grouped by id, kept when its root has a frontend timestamp, spans from start to end
timestamps that must not run backwards). An ensemble's steps are traces of their own with the
ensemble's id as `parent_id`."""
import json

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import Server, copy_models, simple_inputs
from test_config_fields import ADD_CONFIG, write_model
from test_response_cache import ENSEMBLE

HTTP_ORDER = ["HTTP_RECV_START", "HTTP_RECV_END", "REQUEST_START", "QUEUE_START",
              "COMPUTE_START", "COMPUTE_INPUT_END", "COMPUTE_OUTPUT_START", "COMPUTE_END",
              "REQUEST_END", "HTTP_SEND_START", "HTTP_SEND_END"]
GRPC_ORDER = ["GRPC_WAITREAD_START", "GRPC_WAITREAD_END", "REQUEST_START", "QUEUE_START",
              "COMPUTE_START", "COMPUTE_INPUT_END", "COMPUTE_OUTPUT_START", "COMPUTE_END",
              "REQUEST_END", "GRPC_SEND_START", "GRPC_SEND_END"]


def by_id(objects):
    """Trace objects grouped by id, as trace_summary.py groups them: the head's fields and
    every timestamp of that id, by name."""
    traces = {}
    for o in objects:
        t = traces.setdefault(o["id"], {"timestamps": {}})
        for key in ("model_name", "model_version", "request_id", "parent_id"):
            if key in o:
                t[key] = o[key]
        for ts in o.get("timestamps", []):
            t["timestamps"][ts["name"]] = ts["ns"]
    return traces


def in_order(trace, order):
    ts = trace["timestamps"]
    assert list(ts) and all(name in ts for name in order), (order, ts)
    times = [ts[name] for name in order]
    assert times == sorted(times), list(zip(order, times))


def test_requests_are_written_as_tritons_traces(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    copy_models(str(repo), ["simple"])
    write_model(repo, "plain", ADD_CONFIG)
    (repo / "ens" / "1").mkdir(parents=True)
    (repo / "ens" / "config.pbtxt").write_text(ENSEMBLE.replace("response_cache { enable: true }\n", ""))
    trace_file = tmp_path / "trace.json"
    s = Server(str(repo), f"--trace-config=triton,file={trace_file}",
               "--trace-config=level=TIMESTAMPS", "--trace-config=rate=1")
    try:
        h = httpclient.InferenceServerClient(s.http)
        zeros = np.zeros((1, 16), np.int32)
        for _ in range(2):
            h.infer("simple", simple_inputs(httpclient, zeros, zeros), request_id="from-http")
        g = grpcclient.InferenceServerClient(s.grpc)
        g.infer("simple", simple_inputs(grpcclient, zeros, zeros), request_id="from-grpc")
        x = httpclient.InferInput("X", [1, 1024], "FP32")
        x.set_data_from_numpy(np.ones((1, 1024), np.float32))
        h.infer("ens", [x])
        settings = h.get_trace_settings()
        assert settings["trace_file"] == str(trace_file), settings
        assert settings["trace_mode"] == "triton"
    finally:
        s.stop()
    # The array is closed when the server exits.
    traces = by_id(json.loads(trace_file.read_text()))
    simple = [t for t in traces.values() if t.get("model_name") == "simple"]
    assert len(simple) == 3, traces
    http = [t for t in simple if t.get("request_id") == "from-http"]
    grpc = [t for t in simple if t.get("request_id") == "from-grpc"]
    assert len(http) == 2 and len(grpc) == 1
    for t in http:
        assert t["model_version"] == 1
        in_order(t, HTTP_ORDER)
    in_order(grpc[0], GRPC_ORDER)
    ensemble = [(i, t) for i, t in traces.items() if t.get("model_name") == "ens"]
    assert len(ensemble) == 1
    ens_id, ens = ensemble[0]
    assert "HTTP_RECV_START" in ens["timestamps"] and "REQUEST_END" in ens["timestamps"]
    steps = [t for t in traces.values() if t.get("parent_id") == ens_id]
    assert [t["model_name"] for t in steps] == ["plain"], traces
    step = steps[0]["timestamps"]
    # The step ran inside the ensemble's request.
    assert ens["timestamps"]["REQUEST_START"] <= step["REQUEST_START"]
    assert step["COMPUTE_END"] <= step["REQUEST_END"] <= ens["timestamps"]["REQUEST_END"]


def test_a_log_frequency_writes_indexed_files_with_the_older_flags(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    copy_models(str(repo), ["simple"])
    trace_file = tmp_path / "t.json"
    s = Server(str(repo), f"--trace-file={trace_file}", "--trace-level=TIMESTAMPS",
               "--trace-rate=1", "--trace-log-frequency=2")
    try:
        h = httpclient.InferenceServerClient(s.http)
        zeros = np.zeros((1, 16), np.int32)
        for _ in range(3):
            h.infer("simple", simple_inputs(httpclient, zeros, zeros))
        # Two traces make a file at once (bounded wait: the second trace's span may still be
        # closing as the answer arrives).
        import time
        deadline = time.monotonic() + 30
        first = tmp_path / "t.json.0"
        while not first.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(by_id(json.loads(first.read_text()))) == 2
    finally:
        s.stop()
    assert len(by_id(json.loads((tmp_path / "t.json.1").read_text()))) == 1
    assert not trace_file.exists()


def wait_for(path, timeout=30):
    """The file once it exists (a trace is written as its request's span closes, which may
    be just after the answer arrives)."""
    import time
    deadline = time.monotonic() + timeout
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return json.loads(path.read_text())


def test_trace_settings_change_while_the_server_runs_as_on_triton(tmp_path):
    """Triton's L0_trace (trace_endpoint_test.py and its test.sh checks), written here: a
    model's own log_frequency cuts its traces into indexed files, the TENSORS level writes each
    request's tensors, a trace_count that runs out writes its traces to the next indexed file
    and reads 0, a cleared field falls back (a model's to the global setting, the global one
    to the command line), and the refusals carry Triton's words."""
    repo = tmp_path / "repo"
    repo.mkdir()
    copy_models(str(repo), ["simple"])
    trace_file = tmp_path / "t.json"
    s = Server(str(repo), f"--trace-config=triton,file={trace_file}",
               "--trace-config=level=OFF", "--trace-config=rate=1")
    try:
        h = httpclient.InferenceServerClient(s.http)
        ones = np.ones((1, 16), np.int32)
        counting = np.arange(16, dtype=np.int32).reshape(1, 16)

        def send(n):
            for _ in range(n):
                h.infer("simple", simple_inputs(httpclient, counting, ones))

        started = {"trace_file": str(trace_file), "trace_level": ["OFF"], "trace_rate": "1",
                   "trace_count": "-1", "log_frequency": "0", "trace_mode": "triton"}
        assert h.get_trace_settings(model_name="simple") == started
        with pytest.raises(InferenceServerException) as e:
            h.get_trace_settings(model_name="nope")
        assert "Request for unknown model : nope" in e.value.message()
        with pytest.raises(InferenceServerException) as e:
            h.update_trace_settings(model_name="simple", settings={"trace_file": "x.json"})
        assert e.value.message() == \
            "trace file location can not be updated through network protocol"
        with pytest.raises(InferenceServerException) as e:
            h.update_trace_settings(settings={"trace_level": ["OFF", "TIMESTAMPS"]})
        assert "Expect only one trace level 'OFF' is specified" in e.value.message()

        own = h.update_trace_settings(model_name="simple", settings={
            "log_frequency": "2", "trace_level": ["TIMESTAMPS", "TENSORS"]})
        assert own == {**started, "log_frequency": "2", "trace_level": ["TIMESTAMPS", "TENSORS"]}
        assert h.get_trace_settings() == started, "the global setting is untouched"
        send(3)
        first = wait_for(tmp_path / "t.json.0")
        assert len(by_id(first)) == 2
        tensors = [o for o in first if "tensor" in o]
        activities = {o["activity"] for o in tensors}
        assert activities == {"TENSOR_QUEUE_INPUT", "TENSOR_BACKEND_INPUT",
                              "TENSOR_BACKEND_OUTPUT"}, tensors
        queued = [o["tensor"] for o in tensors if o["activity"] == "TENSOR_QUEUE_INPUT"
                  and o["tensor"]["name"] == "INPUT0"][0]
        assert queued == {"name": "INPUT0", "data": ",".join(map(str, range(16))),
                          "shape": "1,16", "dtype": "INT32"}
        summed = [o["tensor"] for o in tensors if o["tensor"]["name"] == "OUTPUT0"][0]
        assert summed["data"] == ",".join(str(i + 1) for i in range(16))

        # A global count; the model's own fields cleared: it follows the global setting. The
        # model's third trace, still held, is written when its setting goes.
        h.update_trace_settings(settings={"trace_count": "2", "trace_level": ["TIMESTAMPS"]})
        followed = h.update_trace_settings(model_name="simple", settings={
            "log_frequency": None, "trace_level": None})
        assert followed == {**started, "trace_level": ["TIMESTAMPS"], "trace_count": "2"}
        assert len(by_id(wait_for(tmp_path / "t.json.1"))) == 1
        send(3)
        counted = by_id(wait_for(tmp_path / "t.json.2"))
        assert len(counted) == 2
        assert h.get_trace_settings()["trace_count"] == "0"
        assert not any("tensor" in o for o in json.loads((tmp_path / "t.json.2").read_text()))
        back = h.update_trace_settings(settings={"trace_count": None, "trace_level": None})
        assert back == started, "cleared global fields return to the command line's"
    finally:
        s.stop()
    assert not (tmp_path / "t.json.3").exists()
    assert not trace_file.exists(), "no trace was left for the one file"
