"""What Triton's Python backend does, checked with our own models (tests/python/parity_models)
and the stock tritonclient. Each test names the Triton QA test (triton-inference-server/server
`qa/L0_backend_python/...`) or python_backend example whose behaviour it covers; none of their
code is used. The response sender in default and decoupled mode, plain and `async def`, with
and without batching; response and BLS parameters; error codes and in-band errors;
cancellation seen by a model and by a BLS stream; argument checks; logging; a model's own
`is_ready()`; request rescheduling; background `async def execute`; auto-completed and
decoupled examples; custom metrics."""
import json
import os
import queue
import shutil
import sys
import tarfile
import threading
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import Server

HERE = os.path.dirname(os.path.abspath(__file__))
MODELS = os.path.join(HERE, "parity_models")

DECOUPLED = "model_transaction_policy { decoupled: true }\n"
BATCHING = "dynamic_batching { max_queue_delay_microseconds: 200000 }\n"

# The response sender's variants, as qa/L0_backend_python/response_sender/test.sh lays them out.
SENDERS = {
    "sender": ("model.py", ""),
    "sender_decoupled": ("model.py", DECOUPLED),
    "sender_async": ("model_async.py", ""),
    "sender_decoupled_async": ("model_async.py", DECOUPLED),
    "sender_batching": ("model.py", BATCHING),
    "sender_decoupled_batching": ("model.py", DECOUPLED + BATCHING),
}


def place(repo, name, source, model_file="model.py", extra=""):
    """Model `name` made of parity model `source`: its version folder with `model_file` as
    model.py (the other model files left out), its config with `extra` appended."""
    src = os.path.join(MODELS, source)
    shutil.copytree(src, os.path.join(repo, name),
                    ignore=shutil.ignore_patterns("model*.py", "__pycache__"))
    shutil.copy(os.path.join(src, "1", model_file), os.path.join(repo, name, "1", "model.py"))
    if extra:
        with open(os.path.join(repo, name, "config.pbtxt"), "a") as f:
            f.write(extra)


PARTIAL_ENSEMBLE = """platform: "ensemble"
max_batch_size: 0
input [ { name: "X" data_type: TYPE_INT32 dims: [ 4 ] } ]
output [ { name: "DOUBLED" data_type: TYPE_INT32 dims: [ 4 ] },
         { name: "LEFT_OUT" data_type: TYPE_INT32 dims: [ 4 ] } ]
ensemble_scheduling { step [ { model_name: "partial_outputs" model_version: -1
  input_map { key: "INPUT0" value: "X" }
  output_map { key: "OUTPUT0" value: "DOUBLED" }
  output_map { key: "OUTPUT1" value: "LEFT_OUT" } } ] }
"""


def pack_environments(repo):
    """packages_env's environment as conda-pack packs one (idna, a pure-Python package from
    PyPI, under lib/python3.X/site-packages, beside the rest of an environment), and
    native_env: an unpacked environment whose package holds a native extension module (a
    real one, PyYAML's, under another package's name)."""
    import idna
    import yaml
    site = "lib/python3.11/site-packages"
    with tarfile.open(os.path.join(repo, "packages_env", "env.tar.gz"), "w:gz") as tar:
        tar.add(os.path.dirname(idna.__file__), arcname=f"{site}/idna")
        tar.add(sys.executable, arcname="bin/python")
    package = os.path.join(repo, "native_env", "env", site, "fastthing")
    os.makedirs(package)
    open(os.path.join(package, "__init__.py"), "w").close()
    native = next(f for f in os.listdir(os.path.dirname(yaml.__file__))
                  if f.startswith("_yaml.") and f.endswith(".so"))
    shutil.copy(os.path.join(os.path.dirname(yaml.__file__), native),
                os.path.join(package, "_speedups" + native[len("_yaml"):]))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = str(tmp_path_factory.mktemp("parity"))
    for name, (model_file, extra) in SENDERS.items():
        place(repo, name, "sender", model_file, extra)
    place(repo, "params_decoupled", "params", extra=DECOUPLED)
    for name in os.listdir(MODELS):
        if name not in ("sender", "readiness"):
            place(repo, name, name)
    pack_environments(repo)
    # An ensemble over a step that leaves one of its outputs out.
    os.makedirs(os.path.join(repo, "partial_ensemble", "1"))
    with open(os.path.join(repo, "partial_ensemble", "config.pbtxt"), "w") as f:
        f.write(PARTIAL_ENSEMBLE)
    log_file = os.path.join(str(tmp_path_factory.mktemp("parity_log")), "server.log")
    s = Server(repo, "--log-file", log_file, "--log-verbose", "1")
    s.log_file = log_file
    s.repo = repo
    yield s
    s.stop()


def log_of(server):
    with open(server.log_file, encoding="utf-8", errors="replace") as f:
        return f.read()


def wait_for_log(server, text, seconds=120):
    deadline = time.time() + seconds
    while text not in log_of(server):
        assert time.time() < deadline, "%r not logged:\n%s" % (text, log_of(server)[-3000:])
        time.sleep(0.1)


def tensor(name, array, datatype, mod=grpcclient):
    t = mod.InferInput(name, list(array.shape), datatype)
    t.set_data_from_numpy(array)
    return t


def stream(server, model, inputs, count=1, headers=None, errors_end=True):
    """Sends `count` requests of `inputs` on one gRPC stream and collects (result, error)
    pairs until each request's final response (or, with `errors_end`, an error ends it: a
    decoupled model may also send errors among its responses)."""
    got = queue.Queue()
    c = grpcclient.InferenceServerClient(server.grpc)
    c.start_stream(lambda result, error: got.put((result, error)), headers=headers)
    for k in range(count):
        c.async_stream_infer(model, inputs, request_id=str(k),
                             enable_empty_final_response=True)
    seen, finals = [], 0
    while finals < count:
        result, error = got.get(timeout=120)
        if error is not None:
            seen.append((None, error))
            finals += errors_end
            continue
        response = result.get_response()
        final = response.parameters.get("triton_final_response")
        if response.outputs:
            seen.append((result, None))
        if final is not None and final.bool_param:
            finals += 1
    c.stop_stream()
    c.close()
    return seen


# --- the response sender: qa/L0_backend_python/response_sender (response_sender_test.py) ---

def sender_inputs(before=0, final_before=0, on_return=0, after=0, final_after=0,
                  mod=grpcclient):
    values = dict(BEFORE=before, FINAL_BEFORE=final_before, RETURN=on_return, AFTER=after,
                  FINAL_AFTER=final_after)
    return [tensor(k, np.array([[v]], np.int32), "INT32", mod) for k, v in values.items()]


def steps(seen):
    assert all(e is None for _, e in seen), seen
    return sorted(int(r.as_numpy("STEP").flat[0]) for r, _ in seen)


@pytest.mark.parametrize("model", ["sender_decoupled", "sender_decoupled_async",
                                   "sender_decoupled_batching"])
@pytest.mark.parametrize("before,final_before,after,final_after", [
    (0, 1, 0, 0), (0, 0, 0, 1), (1, 1, 0, 0), (0, 0, 1, 1), (2, 1, 0, 0), (0, 0, 2, 1),
    (1, 0, 1, 1)])
def test_a_decoupled_model_sends_what_it_sends_before_and_after_returning(
        server, model, before, final_before, after, final_after):
    """test_decoupled_{zero,one,two}_response_{pre,post}_return,
    test_decoupled_response_pre_and_post_return."""
    seen = stream(server, model, sender_inputs(before, final_before, 0, after, final_after))
    assert steps(seen) == list(range(100, 100 + before)) + list(range(300, 300 + after))


@pytest.mark.parametrize("model", ["sender", "sender_async", "sender_batching"])
@pytest.mark.parametrize("plan,step", [
    (dict(on_return=1), 200), (dict(before=1, final_before=1), 100),
    (dict(after=1, final_after=1), 300)])
def test_a_default_mode_model_answers_once_through_its_sender_or_by_returning(
        server, model, plan, step):
    """test_non_decoupled_one_response_{on,pre,post}_return."""
    seen = stream(server, model, sender_inputs(**plan))
    assert steps(seen) == [step]
    with httpclient.InferenceServerClient(server.http) as c:
        inputs = sender_inputs(**plan, mod=httpclient)
        assert c.infer(model, inputs).as_numpy("STEP").tolist() == [[step]]


def test_several_requests_of_one_execution_each_get_their_own_answers(server):
    """test_decoupled_multiple_requests, test_non_decoupled_multiple_requests: a batch of
    requests (the batching variants wait 200 ms to gather them)."""
    for model, plan, want in [
        ("sender_decoupled_batching", dict(before=2, final_before=1), [100, 101]),
        ("sender_batching", dict(on_return=1), [200]),
    ]:
        seen = stream(server, model, sender_inputs(**plan), count=3)
        assert steps(seen) == sorted(want * 3), (model, seen)


def test_a_decoupled_model_that_returns_a_response_is_told_to_return_none(server):
    """test_decoupled_one_response_on_return, ..._on_and_post_return."""
    seen = stream(server, "sender_decoupled", sender_inputs(on_return=1))
    assert len(seen) == 1 and seen[0][1] is not None, seen
    assert "using the decoupled mode and the execute function must return None" in \
        seen[0][1].message()
    # Sent before returning, then returned: the sender was closed, the client sees the one.
    assert steps(stream(server, "sender_decoupled",
                        sender_inputs(before=1, final_before=1, on_return=1))) == [100]


def test_a_default_mode_model_that_sends_only_the_final_flag_fails_the_request(server):
    """test_non_decoupled_zero_response_pre_return."""
    for model in ("sender", "sender_async"):
        seen = stream(server, model, sender_inputs(final_before=1))
        assert len(seen) == 1 and seen[0][1] is not None, seen
        assert "Non-decoupled model cannot send complete final before sending a response" in \
            seen[0][1].message()


@pytest.mark.parametrize("plan", [dict(before=2, final_before=1), dict(after=2, final_after=1),
                                  dict(before=1, final_before=1, on_return=1),
                                  dict(on_return=1, after=1, final_after=1)])
def test_a_default_mode_model_that_answers_twice_delivers_the_first_answer(server, plan):
    """test_non_decoupled_two_response_{pre,post}_return,
    test_non_decoupled_one_response_{pre_and_on,on_and_post}_return."""
    seen = stream(server, "sender", sender_inputs(**plan))
    assert len(steps(seen)) == 1, seen
    # The instance serves on.
    assert steps(stream(server, "sender", sender_inputs(on_return=1))) == [200]


# --- parameters: qa/L0_backend_python/parameters, bls_parameters ---

def params_request(params):
    return [tensor("PARAMS", np.array([json.dumps(params).encode()], dtype=np.object_),
                   "BYTES")]


@pytest.mark.parametrize("model", ["params", "params_decoupled"])
def test_response_parameters_reach_the_client(server, model):
    """response_parameters_test.py test_setting_empty/valid/invalid_response_parameters and
    their decoupled twins."""
    for params in ({}, {"bool": True, "int": 7, "str": "seven"}):
        seen = stream(server, model, params_request(params))
        assert len(seen) == 1 and seen[0][1] is None, seen
        got = seen[0][0].get_response().parameters
        values = {k: getattr(v, v.WhichOneof("parameter_choice")) for k, v in got.items()
                  if k != "triton_final_response"}
        assert values == params
    for bad in ({"float": 1.5}, {"nested": {"a": 1}}):
        seen = stream(server, model, params_request(bad))
        assert len(seen) == 1 and seen[0][1] is not None, seen
        assert "Expect parameters values to have type bool/int/str" in seen[0][1].message()


def test_parameters_pass_through_bls_both_ways(server):
    """bls_parameters_test.py and response_parameters_bls: a BLS request carries the
    caller's parameters to the model it calls; the response it gets back carries that
    model's response parameters."""
    params = {"bool": False, "int": 3, "str": "x"}
    with grpcclient.InferenceServerClient(server.grpc) as c:
        r = c.infer("bls_params", params_request(params), parameters=params)
    assert json.loads(r.as_numpy("SEEN")[0]) == params
    assert json.loads(r.as_numpy("GOT")[0]) == params


# --- errors: qa/L0_backend_python/lifecycle, decoupled ---

def test_error_codes_become_the_grpc_status_triton_gives(server):
    """lifecycle_test.py test_error_code."""
    expected = [("UNKNOWN", "UNKNOWN"), ("INTERNAL", "INTERNAL"), ("NOT_FOUND", "NOT_FOUND"),
                ("INVALID_ARG", "INVALID_ARGUMENT"), ("UNAVAILABLE", "UNAVAILABLE"),
                ("UNSUPPORTED", "UNIMPLEMENTED"), ("ALREADY_EXISTS", "ALREADY_EXISTS"),
                ("CANCELLED", "CANCELLED"), ("NONE_OF_THEM", "INTERNAL")]
    with grpcclient.InferenceServerClient(server.grpc) as c:
        for code, status in expected:
            with pytest.raises(InferenceServerException) as e:
                c.infer("error_codes", [tensor("CODE", np.array([code.encode()],
                                                               dtype=np.object_), "BYTES")])
            assert e.value.status() == "StatusCode." + status, (code, e.value)
            said = "failed with " + code if code != "NONE_OF_THEM" else "failed without a code"
            assert said in e.value.message()


def test_triton_grpc_error_ends_the_stream_with_the_status(server):
    """lifecycle_test.py test_triton_grpc_error_error_on/off: with the `triton_grpc_error`
    header a model's error ends the stream with its gRPC status; without it errors stay
    in-band and the stream goes on."""
    def answers(headers):
        got = queue.Queue()
        c = grpcclient.InferenceServerClient(server.grpc)
        c.start_stream(lambda result, error: got.put(error or result), headers=headers)
        seen = []
        for _ in range(4):
            try:
                c.async_stream_infer("grpc_error", [tensor("X", np.ones(3, np.float32), "FP32")])
            except InferenceServerException:
                break  # the stream has ended
            seen.append(got.get(timeout=60))
            if isinstance(seen[-1], InferenceServerException) and seen[-1].status():
                break
        c.stop_stream()
        return seen

    seen = answers({"triton_grpc_error": "true"})
    errors = [r for r in seen if isinstance(r, InferenceServerException)]
    assert len(errors) == 1 and errors[0].status() == "StatusCode.INTERNAL", seen
    assert "fails on purpose" in errors[0].message()
    seen = answers(None)
    errors = [r for r in seen if isinstance(r, InferenceServerException)]
    assert len(seen) == 4 and len(errors) == 2, seen
    assert all(e.status() is None for e in errors), seen


def mixed(mode, n):
    return [tensor("MODE", np.array([mode.encode()], dtype=np.object_), "BYTES"),
            tensor("N", np.array([n], np.int32), "INT32")]


def test_errors_among_a_decoupled_models_responses_stay_in_the_stream(server):
    """decoupled_test.py test_decoupled_return_response_error, test_decoupled_raise_exception."""
    seen = stream(server, "decoupled_mixed", mixed("errors", 4), errors_end=False)
    assert [e is None for _, e in seen] == [True, False, True, False], seen
    assert "response 1 is an error" in seen[1][1].message()
    assert [int(r.as_numpy("I")[0]) for r, e in seen if e is None] == [0, 2]
    seen = stream(server, "decoupled_mixed", mixed("raise", 1))
    assert len(seen) == 1 and "decoupled_mixed raised on purpose" in seen[0][1].message()


def test_a_response_sent_with_the_final_flag_is_the_streams_final_one(server):
    """grpc stream_infer_handler.cc as decoupled_test.py reads it: a response a decoupled model
    sends with COMPLETE_FINAL says triton_final_response true and no empty response follows
    (even when asked for); the flag sent alone comes as the empty final response."""
    got = queue.Queue()
    c = grpcclient.InferenceServerClient(server.grpc)
    c.start_stream(lambda result, error: got.put((result, error)))
    try:
        seen = []

        def until(request_id):
            while not any(i == request_id and final for i, _, final in seen):
                result, error = got.get(timeout=120)
                assert error is None, error
                response = result.get_response()
                final = response.parameters["triton_final_response"].bool_param
                seen.append((response.id, len(response.outputs), final))

        c.async_stream_infer("decoupled_mixed", mixed("after_final", 1), request_id="together",
                             enable_empty_final_response=True)
        until("together")
        # Sent after: an empty final response of the first would come before its answers.
        c.async_stream_infer("decoupled_mixed", mixed("errors", 1), request_id="alone",
                             enable_empty_final_response=True)
        until("alone")
        assert [s for s in seen if s[0] == "together"] == [("together", 1, True)], seen
        assert [s for s in seen if s[0] == "alone"] == [("alone", 1, False), ("alone", 0, True)]
    finally:
        c.stop_stream()
        c.close()


def test_sending_after_the_final_flag_raises_in_the_model(server):
    """decoupled_test.py test_decoupled_send_after_close_error."""
    seen = stream(server, "decoupled_mixed", mixed("after_final", 1))
    assert [int(r.as_numpy("I")[0]) for r, _ in seen] == [0]
    wait_for_log(server, "decoupled_mixed: refused after final")
    assert "decoupled_mixed: sent after the final flag" not in log_of(server)


def test_a_cancelled_request_is_seen_by_the_model(server):
    """lifecycle_test.py test_execute_cancel."""
    answered = threading.Event()
    with grpcclient.InferenceServerClient(server.grpc) as c:
        before = log_of(server).count("[cancel_watch] waiting")
        future = c.async_infer("cancel_watch", [tensor("SECONDS", np.array([60], np.float32),
                                                       "FP32")],
                               lambda result, error: answered.set())
        deadline = time.time() + 60
        while log_of(server).count("[cancel_watch] waiting") == before:
            assert time.time() < deadline
            time.sleep(0.1)
        future.cancel()
    wait_for_log(server, "[cancel_watch] saw the cancellation")
    assert answered.wait(60)


def test_a_bls_stream_can_be_cancelled_by_its_caller(server):
    """decoupled_test.py test_decoupled_bls_cancel: cancelling the responses of a decoupled
    BLS call reaches the called model, which stops early."""
    with httpclient.InferenceServerClient(server.http) as c:
        inputs = []
        for name, value in (("N", 3000), ("CANCEL_AT", 5)):
            t = httpclient.InferInput(name, [1], "INT32")
            t.set_data_from_numpy(np.array([value], np.int32))
            inputs.append(t)
        got = int(c.infer("bls_cancel", inputs, timeout=300).as_numpy("GOT")[0])
    assert 5 <= got < 3000, got
    wait_for_log(server, "cancelled: True")


# --- pb_utils itself: qa/L0_backend_python/argument_validation, logging, multi-file ---

def test_pb_utils_refuses_arguments_of_the_wrong_type(server):
    """argument_validation."""
    with httpclient.InferenceServerClient(server.http) as c:
        t = httpclient.InferInput("X", [1], "FP32")
        t.set_data_from_numpy(np.zeros(1, np.float32))
        wrong = c.infer("arguments", [t]).as_numpy("WRONG")[0]
    assert wrong in (b"", ""), wrong


def test_the_logger_takes_triton_levels(server):
    """qa/L0_backend_python/logging (identity_fp32_logging)."""
    with httpclient.InferenceServerClient(server.http) as c:
        t = httpclient.InferInput("X", [1], "FP32")
        t.set_data_from_numpy(np.array([2.5], np.float32))
        assert c.infer("logs", [t]).as_numpy("Y").tolist() == [2.5]
    for line in ("logs: initialize at INFO", "logs: execute at INFO", "logs: execute at WARNING",
                 "logs: execute at ERROR", "logs: execute at VERBOSE",
                 "logs: execute at ERROR by level"):
        wait_for_log(server, line)


def test_a_model_imports_the_modules_beside_it(server):
    """qa/L0_backend_python multi_file: `import x` and `from . import x` both find a module
    in the version folder (sender's model.py and model_async.py)."""
    with httpclient.InferenceServerClient(server.http) as c:
        assert c.is_model_ready("sender") and c.is_model_ready("sender_async")


# --- request rescheduling: qa/L0_backend_python/request_rescheduling ---

def test_a_decoupled_iterative_sequence_answers_once_per_execution(server):
    """grpc_endpoint_test.py test_grpc_decoupled."""
    seen = stream(server, "countdown", [tensor("N", np.array([3], np.int32), "INT32")])
    assert [int(r.as_numpy("LEFT")[0]) for r, _ in seen] == [3, 2, 1]


def test_a_rescheduled_default_mode_request_is_answered_on_its_second_run(server):
    """grpc_endpoint_test.py test_grpc_non_decoupled."""
    with grpcclient.InferenceServerClient(server.grpc) as c:
        r = c.infer("reschedule_once", [tensor("X", np.ones(4, np.float32), "FP32")],
                    request_id="once")
    np.testing.assert_array_equal(r.as_numpy("Y"), np.full(4, 2.0))
    assert r.as_numpy("RUNS").tolist() == [2]


def test_a_rescheduled_request_must_not_be_answered(server):
    """bls_request_rescheduling test_wrong_return_type."""
    with httpclient.InferenceServerClient(server.http) as c:
        t = httpclient.InferInput("X", [4], "FP32")
        t.set_data_from_numpy(np.ones(4, np.float32))
        with pytest.raises(InferenceServerException) as e:
            c.infer("reschedule_answered", [t])
    assert "Expected a None object in the execute function return list for reschduled " \
           "request" in str(e.value), e.value


# --- async def execute: qa/L0_backend_python/async_execute (concurrency_test.py) ---

def test_background_executes_overlap_on_one_instance(server):
    """test_concurrent_execute, test_decoupled_bls_async_execute: four 2-second executes
    of one instance run at once (the model saw four running), each answered once; through a
    BLS model awaiting `async_exec(decoupled=True)` too."""
    answers = queue.Queue()
    with grpcclient.InferenceServerClient(server.grpc) as c:
        c.start_stream(lambda result, error: answers.put((result, error)))
        for i in range(4):
            c.async_stream_infer("async_sleep", [tensor("WAIT_SECONDS",
                                                         np.full([1, 1], 2, np.float32),
                                                         "FP32")], request_id=str(i))
        got = {}
        for _ in range(4):
            result, error = answers.get(timeout=120)
            assert error is None, error
            got[result.get_response().id] = int(result.as_numpy("PEAK")[0])
        c.stop_stream()
    assert sorted(got) == ["0", "1", "2", "3"] and max(got.values()) == 4, got
    with httpclient.InferenceServerClient(server.http) as c:
        t = httpclient.InferInput("WAIT_SECONDS", [1, 1], "FP32")
        t.set_data_from_numpy(np.full([1, 1], 0.1, np.float32))
        assert c.infer("async_bls", [t]).as_numpy("ANSWERS").tolist() == [1]


def test_an_exception_in_a_coroutine_reaches_the_log(server):
    """concurrency_test.py test_async_execute_error."""
    stream(server, "async_sleep", [tensor("WAIT_SECONDS", np.full([1, 1], -1, np.float32),
                                          "FP32")])
    wait_for_log(server, "async_sleep: a negative wait")


def test_a_background_batch_whose_client_left_is_stopped(server):
    """A client that cancels its stream while its execute awaits a minute: 5 s later the
    batch's coroutine is cancelled (logged) instead of holding the instance for the minute;
    the instance serves other clients meanwhile."""
    said = "a background batch whose requests were all cancelled 5 s ago was stopped"
    before = log_of(server).count(said)
    with grpcclient.InferenceServerClient(server.grpc) as c:
        c.start_stream(lambda result, error: None)
        c.async_stream_infer("async_sleep", [tensor("WAIT_SECONDS",
                                                     np.full([1, 1], 60, np.float32), "FP32")])
        time.sleep(1)
        c.stop_stream(cancel_requests=True)
    seen = stream(server, "async_sleep", [tensor("WAIT_SECONDS", np.full([2, 1], 0.1,
                                                                         np.float32), "FP32")])
    assert len(seen) == 1 and seen[0][0].as_numpy("DUMMY_OUT").shape == (2, 1), seen
    deadline = time.time() + 60
    while log_of(server).count(said) == before:
        assert time.time() < deadline, log_of(server)[-3000:]
        time.sleep(0.5)


# --- python_backend examples: decoupled square, auto_complete, custom_metrics ---

@pytest.mark.parametrize("n", [0, 1, 3])
def test_a_decoupled_model_may_answer_n_times_or_only_with_the_final_flag(server, n):
    """examples/decoupled square_client.py."""
    seen = stream(server, "square", [tensor("IN", np.array([n], np.int32), "INT32")])
    assert [int(r.as_numpy("OUT")[0]) for r, _ in seen] == [n] * n


def test_a_model_without_config_completes_its_own(server):
    """examples/auto_complete."""
    with httpclient.InferenceServerClient(server.http) as c:
        config = c.get_model_config("auto_complete")
        assert config["backend"] == "python" and config["max_batch_size"] == 4, config
        assert "dynamic_batching" in config
        assert [i["name"] for i in config["input"]] == ["A", "B"]
        inputs = []
        for name, value in (("A", 2.0), ("B", 3.0)):
            t = httpclient.InferInput(name, [2, 3], "FP32")
            t.set_data_from_numpy(np.full([2, 3], value, np.float32))
            inputs.append(t)
        np.testing.assert_array_equal(c.infer("auto_complete", inputs).as_numpy("Y"),
                                      np.full([2, 3], 6.0))


def test_custom_metrics_are_shared_by_instances_and_go_with_the_model(tmp_path):
    """examples/custom_metrics: three instances register the same family and labels and
    share one series; unloading the model removes the family."""
    place(str(tmp_path), "custom_metrics", "custom_metrics")
    s = Server(str(tmp_path), "--model-control-mode", "explicit",
               "--load-model", "custom_metrics")
    try:
        with httpclient.InferenceServerClient(s.http) as c:
            for rows in (1, 2, 3, 4, 5, 6):
                t = httpclient.InferInput("X", [rows, 2], "FP32")
                t.set_data_from_numpy(np.ones([rows, 2], np.float32))
                c.infer("custom_metrics", [t])
            series = [line for line in s.metrics_text().splitlines()
                      if line.startswith("parity_rows_served{")]
            assert series == ['parity_rows_served{model="custom_metrics",version="1"} 21'], \
                series
            assert "parity_busy_ns{" in s.metrics_text()
            c.unload_model("custom_metrics")
            for _ in range(600):
                if "parity_rows_served" not in s.metrics_text():
                    break
                time.sleep(0.1)
            assert "parity_rows_served" not in s.metrics_text()
    finally:
        s.stop()


# --- a model's own is_ready(): qa/L0_backend_python/model_readiness ---

READY = 'parameters [ { key: "READY" value: { string_value: "%s" } },' \
        ' { key: "READY_DELAY" value: { string_value: "%s" } } ]\n'


@pytest.fixture(scope="module")
def readiness_server(tmp_path_factory):
    repo = str(tmp_path_factory.mktemp("parity_readiness"))
    for name, value, delay in [("ready_true", "true", "0"), ("ready_false", "false", "0"),
                               ("ready_raises", "raise", "0"), ("ready_text", "text", "0"),
                               ("ready_async", "async", "0.1"), ("ready_slow", "true", "8")]:
        place(repo, name, "readiness", extra=READY % (value, delay))
    place(repo, "ready_decoupled", "readiness", extra=READY % ("true", "0") + DECOUPLED)
    s = Server(repo, "--strict-readiness=false")
    yield s
    s.stop()


@pytest.mark.parametrize("model,ready", [
    ("ready_true", True), ("ready_false", False), ("ready_raises", False),
    ("ready_text", False), ("ready_async", True), ("ready_decoupled", True)])
def test_a_models_own_is_ready_answers_its_readiness(readiness_server, model, ready):
    """test_model_readiness.py TestUserDefinedModelReadinessFunction: over HTTP and gRPC;
    inference is not affected by the answer."""
    with httpclient.InferenceServerClient(readiness_server.http) as h, \
            grpcclient.InferenceServerClient(readiness_server.grpc) as g:
        assert h.is_model_ready(model) is ready
        assert g.is_model_ready(model) is ready
        if model != "ready_decoupled":
            t = httpclient.InferInput("X", [2], "FP32")
            t.set_data_from_numpy(np.array([1, 2], np.float32))
            assert h.infer(model, [t]).as_numpy("Y").tolist() == [1, 2]
        assert h.is_server_ready()


def test_readiness_checks_run_alongside_inference(readiness_server):
    """test_model_readiness.py test_is_ready_concurrent_with_inference."""
    errors = []

    def infer():
        try:
            with httpclient.InferenceServerClient(readiness_server.http) as h:
                for _ in range(10):
                    t = httpclient.InferInput("X", [1], "FP32")
                    t.set_data_from_numpy(np.array([3], np.float32))
                    assert h.infer("ready_true", [t]).as_numpy("Y").tolist() == [3]
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=infer) for _ in range(2)]
    for t in threads:
        t.start()
    with grpcclient.InferenceServerClient(readiness_server.grpc) as g:
        for _ in range(10):
            assert g.is_model_ready("ready_true")
    for t in threads:
        t.join(120)
    assert not errors, errors


def test_a_readiness_check_past_its_timeout_is_not_ready_and_its_late_answer_is_kept(
        readiness_server):
    """test_model_readiness.py test_is_ready_takes_long_time, one round: `is_ready()`
    sleeps 8 s; the check gives up after 5 s (not ready) while the model goes on; the next
    readiness request gets the answer the model gave late."""
    with httpclient.InferenceServerClient(readiness_server.http) as h, \
            grpcclient.InferenceServerClient(readiness_server.grpc) as g:
        assert not h.is_model_ready("ready_slow")
        t = httpclient.InferInput("X", [1], "FP32")
        t.set_data_from_numpy(np.array([1], np.float32))
        assert h.infer("ready_slow", [t]).as_numpy("Y").tolist() == [1]
        assert g.is_model_ready("ready_slow")
        assert h.is_server_ready()


def test_bytes_that_are_not_utf8_are_exact_or_refused_never_changed(server):
    """L0_string_io (string_client_test.py with the string_identity model): bytes that are not
    UTF-8 come back unchanged as binary data (gRPC, or HTTP binary outputs); asked for as JSON
    they cannot be written without changing them, so the answer is an error naming the output,
    never altered bytes. UTF-8 text comes back as JSON unchanged."""
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException
    raw = np.array([b"\xfa\x03\x94ok", b"\n\x01a\x00\xff"], dtype=np.object_)
    h = httpclient.InferenceServerClient(server.http)
    g = grpcclient.InferenceServerClient(server.grpc)
    for mod, c in ((grpcclient, g), (httpclient, h)):
        given = tensor("INPUT0", raw, "BYTES", mod)
        np.testing.assert_array_equal(c.infer("bytes_identity", [given]).as_numpy("OUTPUT0"), raw)
    as_json = httpclient.InferRequestedOutput("OUTPUT0", binary_data=False)
    with pytest.raises(InferenceServerException) as e:
        h.infer("bytes_identity", [tensor("INPUT0", raw, "BYTES", httpclient)], outputs=[as_json])
    assert "output 'OUTPUT0': element 0 is not valid UTF-8" in e.value.message()
    assert e.value.status() == "400"
    text = np.array(["naïve", "plain"], dtype=np.object_)
    answer = h.infer("bytes_identity", [tensor("INPUT0", text, "BYTES", httpclient)],
                     outputs=[as_json]).as_numpy("OUTPUT0")
    assert [v.decode() if isinstance(v, bytes) else v for v in answer] == ["naïve", "plain"]


def test_a_model_written_for_numpy_1_runs_unchanged(server):
    """L0_nan_inf (its nan_inf_output model answers np.NaN, np.PINF and np.NINF): the names
    NumPy 2 removed are there, each as what replaced it."""
    c = grpcclient.InferenceServerClient(server.grpc)
    r = c.infer("numpy1_names", [tensor("X", np.array([1, 2, 3], np.float32), "FP32")])
    special = r.as_numpy("SPECIAL")
    assert np.isnan(special[0]) and special[1:].tolist() == [np.inf, -np.inf, np.inf]
    assert r.as_numpy("PRODUCT").tolist() == [6.0]
    assert r.as_numpy("FOUND").tolist() == [True, False]


def test_a_model_imports_pure_python_packages_from_its_own_environment(server):
    """Triton's EXECUTION_ENV_PATH (a conda-pack archive in the model's folder): the packages
    the sandbox lacks are importable; one holding a native extension module fails the load
    naming the module and its file."""
    c = grpcclient.InferenceServerClient(server.grpc)
    name = np.array(["bücher.example".encode()], dtype=np.object_)
    r = c.infer("packages_env", [tensor("NAME", name, "BYTES")])
    assert r.as_numpy("ASCII").tolist() == [b"xn--bcher-kva.example"]
    with httpclient.InferenceServerClient(server.http) as h:
        index = {m["name"]: m for m in h.get_model_repository_index()}
    native = index["native_env"]
    assert native["state"] == "UNAVAILABLE", native
    assert "native extension module 'fastthing._speedups" in native["reason"], native
    assert "fastthing/_speedups." in native["reason"] and ".so" in native["reason"], native


def test_a_crashed_instance_makes_the_model_not_ready_until_its_replacement_is_up(server):
    """What Triton misses with a dead stub (its health endpoint answers 200): an instance whose
    interpreter exits makes the model not ready (readiness, the repository index, the health
    metric) until its replacement is up; the replacement starts at once, without traffic."""
    folder = os.path.join(server.repo, "crash_restart")
    mode = lambda m: [tensor("MODE", np.array([m.encode()], dtype=np.object_), "BYTES")]
    c = grpcclient.InferenceServerClient(server.grpc)
    assert c.infer("crash_restart", mode("ok")).as_numpy("OK").tolist() == [1]
    assert c.is_model_ready("crash_restart")
    open(os.path.join(folder, "hold"), "w").close()  # the replacement waits for "go"
    try:
        with pytest.raises(InferenceServerException):
            c.infer("crash_restart", mode("exit"))
        assert not c.is_model_ready("crash_restart")
        with httpclient.InferenceServerClient(server.http) as h:
            entry = [m for m in h.get_model_repository_index() if m["name"] == "crash_restart"]
        assert entry[0]["state"] == "UNAVAILABLE", entry
        assert "crashed and their replacement is starting" in entry[0]["reason"], entry
        assert 'wasmtron_model_healthy{model="crash_restart",version="1"} 0' in \
            server.metrics_text()
    finally:
        open(os.path.join(folder, "go"), "w").close()
    deadline = time.time() + 120
    while not c.is_model_ready("crash_restart"):  # with no request sent meanwhile
        assert time.time() < deadline, log_of(server)[-3000:]
        time.sleep(0.1)
    assert c.infer("crash_restart", mode("ok")).as_numpy("OK").tolist() == [1]


def test_a_model_may_leave_an_output_out_and_an_ensemble_answers_without_it(server):
    """L0_simple_ensemble test_ensemble_partial_add_sub (its partial_add_sub model): a
    model.py that returns one of two requested outputs answers with that one (Triton's Python
    backend does not refuse it), and an ensemble over it answers the outputs its steps gave,
    saying in the verbose log which one was missing, in Triton's words."""
    x = np.arange(4, dtype=np.int32)
    c = grpcclient.InferenceServerClient(server.grpc)
    both = [grpcclient.InferRequestedOutput(n) for n in ("OUTPUT0", "OUTPUT1")]
    direct = c.infer("partial_outputs", [tensor("INPUT0", x, "INT32")], outputs=both)
    np.testing.assert_array_equal(direct.as_numpy("OUTPUT0"), x * 2)
    assert direct.as_numpy("OUTPUT1") is None
    asked = [grpcclient.InferRequestedOutput(n) for n in ("DOUBLED", "LEFT_OUT")]
    answer = c.infer("partial_ensemble", [tensor("X", x, "INT32")], outputs=asked)
    np.testing.assert_array_equal(answer.as_numpy("DOUBLED"), x * 2)
    assert answer.as_numpy("LEFT_OUT") is None
    wait_for_log(server, "Composing models did not output tensor LEFT_OUT")


def test_responses_of_requests_on_one_stream_arrive_in_the_order_produced(server):
    """decoupled_test.py test_decoupled_execute_error: a decoupled model answers the requests
    of one batch interleaved (an error first); on one gRPC stream the client gets every
    response in the order the model produced it, not grouped by request."""
    rounds = 3
    for attempt in range(3):
        seen = stream(server, "interleaved",
                      [tensor("ROUNDS", np.array([[rounds]], np.int32), "INT32")],
                      count=6, errors_end=False)
        assert len(seen) == 6 * rounds, seen
        assert seen[0][0] is None and "order 0" in seen[0][1].message(), seen[0]
        order = [int(r.as_numpy("ORDER").flat[0]) for r, e in seen[1:]]
        assert order == list(range(1, 6 * rounds)), (attempt, order)
        # Request by request, interleaved last first (the error went to request 5).
        requests = [int(r.as_numpy("REQUEST").flat[0]) for r, e in seen[1:]]
        assert requests == ([4, 3, 2, 1, 0] + [5, 4, 3, 2, 1, 0] * (rounds - 1)), requests
