"""Python functions bound as models (`Server.bind`, PyTriton's shape), served in-process and to
tritonclient over HTTP and gRPC, batched by the dynamic batcher; failures of the function fail
only its requests, with the traceback; a wrong output is named."""
import threading
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

import wasmtron
from wasmtron import DynamicBatcher, ModelConfig, TensorSpec as Tensor


def infer(model, inputs):
    """The one response's outputs as arrays (the tritonserver API's iterator of responses)."""
    (response,) = model.infer(inputs=inputs)
    return {name: t.to_bytes_array() if t.data_type == wasmtron.DataType.BYTES
            else np.from_dlpack(t) for name, t in response.outputs.items()}


def wait_for(check, timeout=60):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if check():
            return True
        time.sleep(0.02)
    return False


def pending(server, model):
    for line in server.metrics().splitlines():
        if line.startswith(f'nv_inference_pending_request_count{{model="{model}"'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.fixture(scope="module")
def server():
    s = wasmtron.Server().start(http_port=0, grpc_port=0)
    yield s
    assert s.stop() is True
    with pytest.raises(wasmtron.InvalidArgumentError, match="not started"):
        s.model("scale")


def test_a_bound_function_serves_remote_and_in_process_callers(server):
    def scale(x, factor):
        return {"y": x * factor[:, :1], "label": np.array([[b"scaled"]] * len(x), dtype=object)}

    model = server.bind("scale", scale,
                        inputs=[Tensor("x", np.float32, (-1,)), Tensor("factor", np.float32, (1,))],
                        outputs=[Tensor("y", np.float32, (-1,)), Tensor("label", np.bytes_, (1,))],
                        config=ModelConfig(max_batch_size=4))
    x = np.array([[1, 2, 3]], np.float32)
    f = np.array([[3]], np.float32)
    out = infer(model, {"x": x, "factor": f})
    np.testing.assert_array_equal(out["y"], x * 3)
    assert out["label"].tolist() == [[b"scaled"]]

    http = httpclient.InferenceServerClient(server.addresses["http"])
    assert http.is_model_ready("scale")
    config = http.get_model_config("scale")
    assert config["max_batch_size"] == 4 and config["input"][0]["data_type"] == "TYPE_FP32"
    inputs = [httpclient.InferInput("x", [1, 3], "FP32"), httpclient.InferInput("factor", [1, 1], "FP32")]
    inputs[0].set_data_from_numpy(x)
    inputs[1].set_data_from_numpy(f)
    np.testing.assert_array_equal(http.infer("scale", inputs).as_numpy("y"), x * 3)
    # The server checks remote requests against the declared tensors before the function runs.
    wrong = [httpclient.InferInput("x", [1, 3], "INT32"), inputs[1]]
    wrong[0].set_data_from_numpy(x.astype(np.int32))
    with pytest.raises(InferenceServerException, match="'x'"):
        http.infer("scale", wrong)
    http.close()

    grpc = grpcclient.InferenceServerClient(server.addresses["grpc"])
    ginputs = [grpcclient.InferInput("x", [1, 3], "FP32"), grpcclient.InferInput("factor", [1, 1], "FP32")]
    ginputs[0].set_data_from_numpy(x)
    ginputs[1].set_data_from_numpy(f)
    result = grpc.infer("scale", ginputs)
    np.testing.assert_array_equal(result.as_numpy("y"), x * 3)
    assert result.as_numpy("label").tolist() == [[b"scaled"]]
    grpc.close()


def test_requests_are_batched_by_the_dynamic_batcher(server):
    release = threading.Event()
    batches = []

    def add_one(x):
        batches.append(len(x))
        release.wait(60)  # the first execution holds the instance until the rest queue up
        return {"y": x + 1}

    model = server.bind("add_one", add_one, inputs=[Tensor("x", np.int64, (2,))],
                        outputs=[Tensor("y", np.int64, (2,))],
                        config=ModelConfig(max_batch_size=8,
                                           batcher=DynamicBatcher(max_queue_delay_microseconds=100)))
    results = {}

    def call(k):
        results[k] = infer(model, {"x": np.array([[k, -k]], np.int64)})["y"]

    threads = [threading.Thread(target=call, args=(k,)) for k in range(7)]
    threads[0].start()
    assert wait_for(lambda: batches == [1])
    for t in threads[1:]:
        t.start()
    assert wait_for(lambda: pending(server, "add_one") == 6), server.metrics()
    release.set()
    for t in threads:
        t.join(60)
    assert {k: v.tolist() for k, v in results.items()} == {k: [[k + 1, 1 - k]] for k in range(7)}
    assert batches == [1, 6]
    stats = model.statistics()["model_stats"][0]
    assert stats["inference_count"] == 7 and stats["execution_count"] == 2


def test_a_raising_function_fails_only_its_request(server):
    def picky(x):
        if (x < 0).any():
            raise ValueError(f"negative input {x.tolist()}")
        if (x == 0).all():
            raise wasmtron.InvalidArgumentError("x must not be all zeros")
        return {"y": np.sqrt(x)}

    model = server.bind("picky", picky, inputs=[Tensor("x", np.float64, (2,))],
                        outputs=[Tensor("y", np.float64, (2,))])
    with pytest.raises(wasmtron.InternalError) as failed:
        infer(model, {"x": np.array([-1.0, 4.0])})
    message = str(failed.value)
    assert "model 'picky'" in message and "Traceback" in message
    assert "ValueError: negative input [-1.0, 4.0]" in message and "in picky" in message
    np.testing.assert_array_equal(infer(model, {"x": np.array([9.0, 4.0])})["y"], [3.0, 2.0])

    http = httpclient.InferenceServerClient(server.addresses["http"])
    inputs = [httpclient.InferInput("x", [2], "FP64")]
    inputs[0].set_data_from_numpy(np.zeros(2))
    with pytest.raises(InferenceServerException, match="must not be all zeros") as bad:
        http.infer("picky", inputs)
    assert bad.value.status() == "400"
    inputs[0].set_data_from_numpy(np.array([1.0, 16.0]))
    np.testing.assert_array_equal(http.infer("picky", inputs).as_numpy("y"), [1.0, 4.0])
    http.close()


def test_wrong_outputs_and_bad_bindings_are_named(server):
    model = server.bind("sloppy", lambda x: {"y": x.astype(np.float64)},
                        inputs=[Tensor("x", np.float32, (1,))], outputs=[Tensor("y", np.float32, (1,))])
    with pytest.raises(wasmtron.InternalError, match="output 'y' as FP64, but the model declares FP32"):
        infer(model, {"x": np.ones(1, np.float32)})
    server.bind("forgetful", lambda x: {"z": x}, inputs=[Tensor("x", np.float32, (1,))],
                outputs=[Tensor("y", np.float32, (1,))])
    with pytest.raises(wasmtron.InternalError, match="returned no output 'y'"):
        infer(server.model("forgetful"), {"x": np.ones(1, np.float32)})
    with pytest.raises(wasmtron.AlreadyExistsError, match="'sloppy'"):
        server.bind("sloppy", lambda x: {"y": x}, inputs=[Tensor("x", np.float32, (1,))],
                    outputs=[Tensor("y", np.float32, (1,))])
    with pytest.raises(wasmtron.InvalidArgumentError, match="callable"):
        server.bind("nothing", None, inputs=[], outputs=[])
    with pytest.raises(wasmtron.InvalidArgumentError, match="dtype complex64"):
        server.bind("odd", lambda x: {"y": x}, inputs=[Tensor("x", np.complex64, (1,))],
                    outputs=[Tensor("y", np.float32, (1,))])
    # The server keeps serving the models bound before.
    assert model.ready() and server.ready()


def test_an_interpreter_that_exits_finishes_what_it_accepted(tmp_path):
    """A script that leaves while a bound function still runs for callers: the server drains
    (the calls answer) and the process exits 0 instead of hanging or crashing."""
    import subprocess
    import sys
    import textwrap

    script = tmp_path / "leave.py"
    script.write_text(textwrap.dedent("""
        import sys, threading, time
        import numpy as np
        import wasmtron
        from wasmtron import TensorSpec

        started = threading.Event()
        def slow(x):
            started.set()
            time.sleep(0.5)
            return {"y": x + 1}

        server = wasmtron.Server().start()
        model = server.bind("slow", [slow, slow], inputs=[TensorSpec("x", np.int32, (1,))],
                            outputs=[TensorSpec("y", np.int32, (1,))])
        answers = []
        def call(k):
            (response,) = model.infer(inputs={"x": np.array([k], np.int32)})
            answers.append(int(np.from_dlpack(response.outputs["y"])[0]))
            # One write per line: two threads' prints may otherwise interleave their parts.
            sys.stdout.write(f"answered {k}\\n")
            sys.stdout.flush()
        for k in range(2):
            threading.Thread(target=call, args=(k,), daemon=False).start()
        started.wait(30)
        print("leaving", flush=True)
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0] == "leaving" and sorted(lines[1:]) == ["answered 0", "answered 1"], out.stdout
