"""Triton's own Python-backend QA (triton-inference-server/server `qa/`, vendored under
tests/python/triton_qa with its licence): the models laid out as the QA scripts lay them out,
served unchanged by wasmtron, and checked by Triton's own unittests where they run against a
server alone (response senders in default and decoupled mode, response parameters), and here
where Triton's tests read its log files (error codes, `triton_grpc_error`, cooperative
cancellation, argument checks, model folders with several modules, the logger's levels)."""
import os
import queue
import shutil
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import Server

HERE = os.path.dirname(os.path.abspath(__file__))
QA = os.path.join(HERE, "triton_qa")
MODELS = os.path.join(QA, "python_models")


def place(repo, name, source, model_file="model.py", extra="", models=MODELS):
    """Model `name` from QA model `source`: its .py files in `1/` (`model_file` as model.py),
    its config with `name` set and `extra` appended, as the QA scripts' cp/sed/echo do."""
    folder = os.path.join(repo, name)
    os.makedirs(os.path.join(folder, "1"))
    src = os.path.join(models, source)
    for f in os.listdir(src):
        if f.endswith(".py") and f not in ("model.py", "model_async.py"):
            shutil.copy(os.path.join(src, f), os.path.join(folder, "1", f))
    shutil.copy(os.path.join(src, model_file), os.path.join(folder, "1", "model.py"))
    config = os.path.join(src, "config.pbtxt")
    if os.path.exists(config):
        with open(config) as f:
            lines = [ln for ln in f.read().splitlines() if not ln.startswith("name:")]
        with open(os.path.join(folder, "config.pbtxt"), "w") as f:
            f.write('name: "%s"\n' % name + "\n".join(lines) + "\n" + extra)


DECOUPLED = "model_transaction_policy { decoupled: True }\n"
BATCHING = "dynamic_batching { max_queue_delay_microseconds: 500000 }\n"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = str(tmp_path_factory.mktemp("triton_qa"))
    # qa/L0_backend_python/response_sender/test.sh
    for suffix, model_file, extra in [
        ("", "model.py", ""),
        ("_decoupled", "model.py", DECOUPLED),
        ("_async", "model_async.py", ""),
        ("_decoupled_async", "model_async.py", DECOUPLED),
        ("_batching", "model.py", BATCHING),
        ("_decoupled_batching", "model.py", DECOUPLED + BATCHING),
        ("_async_batching", "model_async.py", BATCHING),
        ("_decoupled_async_batching", "model_async.py", DECOUPLED + BATCHING),
    ]:
        place(repo, "response_sender" + suffix, "response_sender", model_file, extra)
    place(repo, "response_sender_complete_final", "response_sender_complete_final")
    # qa/L0_backend_python/parameters/test.sh
    for name in ("response_parameters", "response_parameters_decoupled",
                 "response_parameters_bls"):
        place(repo, name, name)
    # qa/L0_backend_python/lifecycle/test.sh, argument_validation, the main test.sh
    for name in ("error_code", "execute_cancel", "execute_grpc_error", "argument_validation",
                 "identity_fp32_logging", "bls_parameters", "dlpack_identity"):
        place(repo, name, name)
    place(repo, "multi_file", "multi_file")
    shutil.copy(os.path.join(MODELS, "identity_fp32", "config.pbtxt"),
                os.path.join(repo, "multi_file", "config.pbtxt"))
    with open(os.path.join(repo, "multi_file", "config.pbtxt")) as f:
        text = f.read().replace('name: "identity_fp32"', 'name: "multi_file"')
    with open(os.path.join(repo, "multi_file", "config.pbtxt"), "w") as f:
        f.write(text)
    # Triton's tests read the server's log file (SERVER_LOG); so do the checks here.
    log_file = os.path.join(str(tmp_path_factory.mktemp("triton_qa_log")), "server.log")
    s = Server(repo, "--log-file", log_file, "--log-verbose", "1")
    s.log_file = log_file
    yield s
    s.stop()


@pytest.fixture(scope="module")
def decoupled_server(tmp_path_factory):
    """qa/L0_backend_python/decoupled/test.sh's repository (less the two models that need
    PyTorch); its log is `decoupled_server.log` in the folder Triton's test runs in."""
    repo = str(tmp_path_factory.mktemp("triton_qa_decoupled"))
    for name in os.listdir(os.path.join(QA, "decoupled_models")):
        place(repo, name, name, models=os.path.join(QA, "decoupled_models"))
    place(repo, "identity_fp32", "identity_fp32")
    place(repo, "execute_cancel", "execute_cancel", extra=DECOUPLED)
    place(repo, "response_sender_until_cancelled", "response_sender_until_cancelled")
    examples = os.path.join(HERE, "triton_python_backend_examples", "examples", "decoupled")
    os.makedirs(os.path.join(repo, "square_int32", "1"))
    shutil.copy(os.path.join(examples, "square_model.py"),
                os.path.join(repo, "square_int32", "1", "model.py"))
    shutil.copy(os.path.join(examples, "square_config.pbtxt"),
                os.path.join(repo, "square_int32", "config.pbtxt"))
    run_in = str(tmp_path_factory.mktemp("triton_qa_decoupled_run"))
    log_file = os.path.join(run_in, "decoupled_server.log")
    s = Server(repo, "--log-file", log_file, "--log-verbose", "1")
    s.log_file = log_file
    s.run_in = run_in
    yield s
    s.stop()


def run_triton_tests(server, tests, *args, cwd=None):
    """Runs Triton's unittest module `tests` unchanged against `server`."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.join(QA, "stubs") + os.pathsep + env.get("PYTHONPATH", "")
    env["SERVER_LOG"] = server.log_file
    done = subprocess.run(
        [sys.executable, os.path.join(HERE, "run_example_client.py"), server.http, server.grpc,
         server.metrics, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "--confcutdir", os.path.join(QA, "tests"), os.path.join(QA, "tests", tests), *args],
        capture_output=True, text=True, timeout=600, env=env,
        cwd=cwd or os.path.join(QA, "tests"))
    out = done.stdout[-4000:] + done.stderr[-2000:]
    assert done.returncode == 0, out + log_of(server)[-3000:]
    assert " passed" in done.stdout and " failed" not in done.stdout, out
    return done.stdout


def log_of(server):
    with open(server.log_file, encoding="utf-8", errors="replace") as f:
        return f.read()


@pytest.mark.parametrize("tests", [
    "response_sender_test.py",
    "response_sender_complete_final_test.py",
    "response_parameters_test.py",
    "bls_parameters_test.py",
])
def test_triton_unittests_pass_unchanged(server, tests):
    run_triton_tests(server, tests)


def test_triton_decoupled_unittests_pass_unchanged(decoupled_server):
    """decoupled_test.py: errors among a decoupled model's responses, returning from a
    decoupled execute, sending after the final flag, cooperative cancellation, and BLS into
    decoupled models read as they stream (`cancel()` reaching the called model, or ignored by
    it). Left out: test_decoupled_bls (its model needs PyTorch) and
    test_decoupled_execute_error: it expects the responses of two requests of one stream, sent
    by one execution a moment apart, to arrive in that order, and a stream's requests answer
    independently here (their requests do reach the batcher in the order sent)."""
    said = run_triton_tests(
        decoupled_server, "decoupled_test.py",
        "-k", "not (test_decoupled_bls and not _cancel and not _stream) "
              "and not test_decoupled_execute_error",
        cwd=decoupled_server.run_in)
    assert "9 passed" in said, said


def test_error_codes_become_the_grpc_status_triton_gives(server):
    """lifecycle_test.py test_error_code: each TritonError code as its gRPC status."""
    expected = [("UNKNOWN", "UNKNOWN"), ("INTERNAL", "INTERNAL"), ("NOT_FOUND", "NOT_FOUND"),
                ("INVALID_ARG", "INVALID_ARGUMENT"), ("UNAVAILABLE", "UNAVAILABLE"),
                ("UNSUPPORTED", "UNIMPLEMENTED"), ("ALREADY_EXISTS", "ALREADY_EXISTS"),
                ("CANCELLED", "CANCELLED")]
    with grpcclient.InferenceServerClient(server.grpc) as c:
        for code, status in expected + [("(default)", "INTERNAL")]:
            data = np.array([[code]], dtype=np.object_)
            inp = grpcclient.InferInput("ERROR_CODE", [1, 1], "BYTES")
            inp.set_data_from_numpy(data)
            with pytest.raises(InferenceServerException) as e:
                c.infer("error_code", [inp])
            said = "error code: " if code != "(default)" else "unrecognized error code: "
            assert str(e.value) == "[StatusCode.%s] %s%s" % (status, said, code)


def _answers(server, headers=None, n=4):
    """Sends `n` requests to execute_grpc_error on one stream, each after the previous one's
    answer (as Triton's test does); returns what came back, up to the stream's end."""
    c = grpcclient.InferenceServerClient(server.grpc)
    results = queue.Queue()
    c.start_stream(callback=lambda result, error: results.put(error or result), headers=headers)
    seen = []
    for _ in range(n):
        inp = grpcclient.InferInput("IN", [2, 2], "FP32")
        inp.set_data_from_numpy(np.random.randn(2, 2).astype(np.float32))
        try:
            c.async_stream_infer("execute_grpc_error", [inp])
        except InferenceServerException:
            break  # the stream has ended
        seen.append(results.get(timeout=60))
        if isinstance(seen[-1], InferenceServerException) and seen[-1].status():
            break
    c.stop_stream()
    return seen


def test_triton_grpc_error_ends_the_stream_with_the_status(server):
    """With the `triton_grpc_error: true` header the model's error (every second request)
    ends the stream with gRPC status INTERNAL; without it errors stay in-band and the stream
    goes on."""
    seen = _answers(server, {"triton_grpc_error": "true"})
    errors = [r for r in seen if isinstance(r, InferenceServerException)]
    assert len(errors) == 1 and errors[0].status() == "StatusCode.INTERNAL", seen
    assert "An error occurred during execution" in errors[0].message()
    seen = _answers(server)
    errors = [r for r in seen if isinstance(r, InferenceServerException)]
    assert len(seen) == 4 and len(errors) == 2, seen
    assert all(e.status() is None for e in errors), seen


def test_a_cancelled_request_is_seen_by_the_model(server):
    """lifecycle_test.py test_execute_cancel: the client cancels while execute runs; the
    model's `request.is_cancelled()` turns true and it answers with its own CANCELLED."""
    answered = threading.Event()
    with grpcclient.InferenceServerClient(server.grpc) as c:
        inp = grpcclient.InferInput("EXECUTE_DELAY", [1, 1], "FP32")
        inp.set_data_from_numpy(np.array([[6.0]], dtype=np.float32))
        future = c.async_infer("execute_cancel", [inp], lambda result, error: answered.set())
        deadline = time.time() + 60
        while "Request not cancelled at 1.0 s" not in log_of(server):
            assert time.time() < deadline, log_of(server)[-3000:]
            time.sleep(0.1)
        future.cancel()
    deadline = time.time() + 60
    while "[execute_cancel] Request cancelled at " not in log_of(server):
        assert time.time() < deadline, log_of(server)[-3000:]
        time.sleep(0.1)
    assert answered.wait(60)


def test_triton_argument_checks_hold(server):
    """argument_validation: the model runs Triton's unittest of pb_utils' argument checks
    (wrong types refused with TypeError or TritonModelException) and answers 1 if it passed."""
    c = httpclient.InferenceServerClient(server.http)
    result = c.infer("argument_validation", [], timeout=240)
    assert result.as_numpy("OUTPUT0").tolist() == [1], log_of(server)[-6000:]


def test_an_input_passes_through_dlpack_unchanged(server):
    """dlpack_identity: `Tensor.from_dlpack(name, input.to_dlpack())`, Triton's zero-copy
    idiom, on the server's (read-only) input tensors."""
    data = np.arange(12, dtype=np.float32).reshape(2, 6)
    with httpclient.InferenceServerClient(server.http) as c:
        inp = httpclient.InferInput("INPUT0", list(data.shape), "FP32")
        inp.set_data_from_numpy(data)
        np.testing.assert_array_equal(
            c.infer("dlpack_identity", [inp]).as_numpy("OUTPUT0"), data)


def test_a_model_imports_the_modules_beside_it(server):
    """multi_file: `import file1` and `from . import file2` both find modules in the version
    folder (Triton imports model.py as `<version>.model`)."""
    assert httpclient.InferenceServerClient(server.http).is_model_ready("multi_file")


def test_the_logger_takes_triton_levels(server):
    """identity_fp32_logging: `Logger.log(msg, Logger.INFO)` and the log_* helpers."""
    c = httpclient.InferenceServerClient(server.http)
    inp = httpclient.InferInput("INPUT0", [1, 1], "FP32")
    inp.set_data_from_numpy(np.array([[2.5]], dtype=np.float32))
    assert c.infer("identity_fp32_logging", [inp]).as_numpy("OUTPUT0").tolist() == [[2.5]]
    log = log_of(server)
    for line in ("Initialize-Specific Msg!", "Execute-Warning Msg!", "Execute-Error Msg!"):
        assert line in log


READINESS = os.path.join(QA, "readiness_models")


@pytest.fixture(scope="module")
def readiness_server(tmp_path_factory):
    """qa/L0_backend_python/model_readiness/test.sh's second server: identity models whose
    `is_ready()` returns True, False, raises, returns a string, sleeps 8 s or is a coroutine,
    and a decoupled one."""
    repo = str(tmp_path_factory.mktemp("triton_qa_readiness"))
    with open(os.path.join(MODELS, "identity_fp32", "config.pbtxt")) as f:
        identity = [ln for ln in f.read().splitlines() if not ln.startswith("name:")]
    for name, value, delay in [
        ("is_ready_fn_returns_true", "true", "0.1"),
        ("is_ready_fn_returns_false", "false", "0.1"),
        ("is_ready_fn_raises_error", "exception", "0.1"),
        ("is_ready_fn_returns_non_boolean", "non_boolean", "0.1"),
        ("is_ready_fn_timeout", "true", "8"),
        ("is_ready_fn_coroutine_returns_true", "coroutine", "0.1"),
    ]:
        os.makedirs(os.path.join(repo, name, "1"))
        source = ("readiness_coroutine_model.py" if "coroutine" in name
                  else "readiness_model.py")
        shutil.copy(os.path.join(READINESS, source), os.path.join(repo, name, "1", "model.py"))
        with open(os.path.join(repo, name, "config.pbtxt"), "w") as f:
            f.write('name: "%s"\n' % name + "\n".join(identity) + "\n" +
                    'parameters: { key: "READINESS_FN_RETURN_VALUE" value: { string_value: '
                    '"%s" } }\nparameters: { key: "READINESS_FN_DELAY_SECS" value: { '
                    'string_value: "%s" } }\n' % (value, delay))
    shutil.copytree(os.path.join(READINESS, "is_ready_fn_returns_true_decoupled"),
                    os.path.join(repo, "is_ready_fn_returns_true_decoupled", "1"))
    shutil.move(os.path.join(repo, "is_ready_fn_returns_true_decoupled", "1", "config.pbtxt"),
                os.path.join(repo, "is_ready_fn_returns_true_decoupled", "config.pbtxt"))
    log_file = os.path.join(str(tmp_path_factory.mktemp("triton_qa_readiness_log")),
                            "server.log")
    s = Server(repo, "--log-file", log_file, "--log-verbose", "1", "--strict-readiness=false")
    s.log_file = log_file
    yield s
    s.stop()


def test_triton_model_readiness_unittests_pass_unchanged(readiness_server):
    """test_model_readiness.py TestUserDefinedModelReadinessFunction: a model's own
    `is_ready()` (plain or `async def`) answers the model readiness endpoints over HTTP and
    gRPC: False, an exception or a value that is not a bool is "not ready", inference is
    unaffected, and readiness checks run alongside inference, decoupled too. Left out:
    test_is_ready_takes_long_time (ten 13-second rounds; one round is checked below)."""
    said = run_triton_tests(
        readiness_server, "test_model_readiness.py", "-k",
        "TestUserDefinedModelReadinessFunction and not test_is_ready_takes_long_time")
    assert "7 passed" in said, said


def test_a_readiness_check_past_its_timeout_is_not_ready_and_its_late_answer_is_kept(
        readiness_server):
    """One round of Triton's test_is_ready_takes_long_time: `is_ready()` sleeps 8 s; the
    check gives up after 5 s (not ready) while the model goes on; the next readiness request
    gets the answer the model gave late instead of starting another 8-second check."""
    name = "is_ready_fn_timeout"
    data = np.ones((1, 8), dtype=np.float32)
    with httpclient.InferenceServerClient(readiness_server.http) as h, \
            grpcclient.InferenceServerClient(readiness_server.grpc) as g:
        assert not h.is_model_ready(name)
        inp = httpclient.InferInput("INPUT0", [1, 8], "FP32")
        inp.set_data_from_numpy(data)
        np.testing.assert_array_equal(h.infer(name, [inp]).as_numpy("OUTPUT0"), data)
        assert g.is_model_ready(name)
        # The server itself stays ready throughout.
        assert h.is_server_ready()


@pytest.fixture(scope="module")
def rescheduling_server(tmp_path_factory):
    """qa/L0_backend_python/request_rescheduling/test.sh's repository and flags (explicit
    model control, every model loaded), less the BLS model that drives Triton's leak probe."""
    repo = str(tmp_path_factory.mktemp("triton_qa_rescheduling"))
    for name in ("iterative_sequence", "request_rescheduling_addsub", "wrong_return_type"):
        place(repo, name, name)
    # The same model without iterative sequences configured.
    place(repo, "addsub_not_iterative", "request_rescheduling_addsub")
    config = os.path.join(repo, "addsub_not_iterative", "config.pbtxt")
    with open(config) as f:
        text = f.read()
    start = text.index("sequence_batching")
    with open(config, "w") as f:
        f.write(text[:start] + text[text.index("}", start) + 1:])
    log_file = os.path.join(str(tmp_path_factory.mktemp("triton_qa_rescheduling_log")),
                            "server.log")
    s = Server(repo, "--log-file", log_file, "--log-verbose", "1",
               "--model-control-mode=explicit", "--load-model=*")
    s.log_file = log_file
    yield s
    s.stop()


def test_triton_request_rescheduling_unittests_pass_unchanged(rescheduling_server):
    """grpc_endpoint_test.py: a model that releases a request with
    TRITONSERVER_REQUEST_RELEASE_RESCHEDULE gets it again in a later batch — a decoupled
    iterative sequence answers 3, 2, 1 over one stream, a default-mode model answers once
    on its second execution."""
    said = run_triton_tests(rescheduling_server, "grpc_endpoint_test.py")
    assert "2 passed" in said, said


def test_a_rescheduled_request_must_not_be_answered(rescheduling_server):
    """Triton's check (bls_request_rescheduling's test_wrong_return_type): returning a
    response for a request released for rescheduling fails the batch with Triton's words."""
    with httpclient.InferenceServerClient(rescheduling_server.http) as c:
        inp = httpclient.InferInput("INPUT0", [4], "FP32")
        inp.set_data_from_numpy(np.ones(4, dtype=np.float32))
        with pytest.raises(InferenceServerException) as e:
            c.infer("wrong_return_type", [inp])
    assert "Expected a None object in the execute function return list for reschduled " \
           "request" in str(e.value), e.value


def test_rescheduling_needs_iterative_sequences_configured(rescheduling_server):
    with httpclient.InferenceServerClient(rescheduling_server.http) as c:
        inputs = []
        for name in ("INPUT0", "INPUT1"):
            inp = httpclient.InferInput(name, [16], "FP32")
            inp.set_data_from_numpy(np.ones(16, dtype=np.float32))
            inputs.append(inp)
        with pytest.raises(InferenceServerException) as e:
            c.infer("addsub_not_iterative", inputs)
        assert "iterative_sequence: true" in str(e.value), e.value
        # The model serves on: its next request is answered.
        result = c.infer("addsub_not_iterative", inputs)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), np.full(16, 2.0))


@pytest.fixture(scope="module")
def async_execute_server(tmp_path_factory):
    """qa/L0_backend_python/async_execute/test.sh's repository: decoupled models whose
    `async def execute` awaits (asyncio.sleep, a BLS call into a decoupled model)."""
    repo = str(tmp_path_factory.mktemp("triton_qa_async_execute"))
    for name in ("async_execute_decouple", "async_execute_decouple_bls"):
        place(repo, name, name)
    log_file = os.path.join(str(tmp_path_factory.mktemp("triton_qa_async_log")),
                            "concurrency_test.server.log")
    s = Server(repo, "--log-file", log_file, "--log-verbose", "1")
    s.log_file = log_file
    yield s
    s.stop()


def test_triton_async_execute_unittests_pass_unchanged(async_execute_server):
    """concurrency_test.py: a decoupled model's `async def execute` runs in the background as
    on Triton — four 4-second executes (or one batch of four, or the same through a BLS
    model awaiting `async_exec(decoupled=True)`) all answer within 8 seconds on one instance,
    a 2-second request sent after a 10-second one is answered first, and an exception a
    coroutine raises reaches the log."""
    said = run_triton_tests(async_execute_server, "concurrency_test.py")
    assert "6 passed" in said, said


def test_background_executes_overlap_and_each_stream_ends_after_its_answer(
        async_execute_server):
    """Eight requests on one instance, each awaiting 1 to 3 seconds: every one is answered
    once, with its own batch size, and its stream then ends (the client's stream closes
    cleanly); the server stays ready."""
    answers = queue.Queue()
    with grpcclient.InferenceServerClient(async_execute_server.grpc) as c:
        c.start_stream(lambda result, error: answers.put((result, error)))
        for i in range(8):
            shape = [1 + i % 4, 1]
            inp = grpcclient.InferInput("WAIT_SECONDS", shape, "FP32")
            inp.set_data_from_numpy(np.full(shape, 1 + i % 3, dtype=np.float32))
            c.async_stream_infer("async_execute_decouple", [inp], request_id=str(i))
        got = {}
        for _ in range(8):
            result, error = answers.get(timeout=120)
            assert error is None, error
            got[result.get_response().id] = result.as_numpy("DUMMY_OUT").shape[0]
        c.stop_stream()
    assert got == {str(i): 1 + i % 4 for i in range(8)}
    assert answers.empty()
    with httpclient.InferenceServerClient(async_execute_server.http) as h:
        assert h.is_model_ready("async_execute_decouple")


def test_a_background_batch_whose_client_left_is_stopped(async_execute_server):
    """A client that cancels its stream while its execute awaits a minute: the model sees the
    request cancelled, and 5 s later the batch's coroutine is cancelled (logged) instead of
    holding the instance's slot for the minute; the instance serves other clients meanwhile."""
    said = "a background batch whose requests were all cancelled 5 s ago was stopped"
    before = log_of(async_execute_server).count(said)
    slow = grpcclient.InferInput("WAIT_SECONDS", [1, 1], "FP32")
    slow.set_data_from_numpy(np.full([1, 1], 60, dtype=np.float32))
    with grpcclient.InferenceServerClient(async_execute_server.grpc) as c:
        c.start_stream(lambda result, error: None)
        c.async_stream_infer("async_execute_decouple", [slow], request_id="left")
        time.sleep(1)
        c.stop_stream(cancel_requests=True)
    answers = queue.Queue()
    with grpcclient.InferenceServerClient(async_execute_server.grpc) as c:
        c.start_stream(lambda result, error: answers.put((result, error)))
        quick = grpcclient.InferInput("WAIT_SECONDS", [2, 1], "FP32")
        quick.set_data_from_numpy(np.full([2, 1], 0.1, dtype=np.float32))
        c.async_stream_infer("async_execute_decouple", [quick], request_id="quick")
        result, error = answers.get(timeout=60)
        assert error is None, error
        assert result.as_numpy("DUMMY_OUT").shape[0] == 2
        c.stop_stream()
    for _ in range(120):
        if log_of(async_execute_server).count(said) > before:
            break
        time.sleep(0.5)
    assert log_of(async_execute_server).count(said) == before + 1
