"""`wasmtron.pytriton`, the drop-in for PyTriton: scripts written for PyTriton run with only
`pytriton` replaced by `wasmtron.pytriton` in their import lines, give the answers the real
PyTriton gives (when it is installed: PYTRITON_PYTHON, `make test` provides it), and PyTriton's
own ModelClient works against our server."""
import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import threading
import sys
import time
import urllib.request

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLES = os.path.join(HERE, "pytriton_examples")
PYTRITON_PYTHON = os.environ.get("PYTRITON_PYTHON")


def free_ports(n):
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def ported(source, tmp_path, name):
    """The script with its import lines changed, as a user would change them."""
    with open(os.path.join(EXAMPLES, source)) as f:
        text = f.read()
    text = re.sub(r"^from pytriton\.", "from wasmtron.pytriton.", text, flags=re.M)
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def wait_ready(port, process, output, timeout=240):
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert process.poll() is None, output()
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise AssertionError("the server did not get ready")


class Serving:
    def __init__(self, python, script):
        self.http, self.grpc, self.metrics = free_ports(3)
        env = dict(os.environ,
                   PYTRITON_TRITON_CONFIG_HTTP_PORT=str(self.http),
                   PYTRITON_TRITON_CONFIG_GRPC_PORT=str(self.grpc),
                   PYTRITON_TRITON_CONFIG_METRICS_PORT=str(self.metrics),
                   PYTRITON_TRITON_CONFIG_HTTP_ADDRESS="127.0.0.1",
                   PYTRITON_TRITON_CONFIG_GRPC_ADDRESS="127.0.0.1")
        # SIGINT as Ctrl-C delivers it, even when this suite runs as a background job (which
        # starts with SIGINT ignored, and a Python child would then never see its
        # KeyboardInterrupt).
        self.process = subprocess.Popen(
            [python, script], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        # Drained all along: a server whose log fills the pipe would block writing it and
        # never get ready or stop.
        self.output = bytearray()
        threading.Thread(target=lambda: [self.output.extend(line) for line in self.process.stdout],
                         daemon=True).start()
        try:
            self.wait(lambda: self.output.decode(errors="replace"))
        except BaseException:
            self.stop()
            raise

    def wait(self, output):
        wait_ready(self.http, self.process, output)
        # Bound models load after the listeners: wait until the last one answers ready
        # (minutes on a loaded 2-core machine: the real Triton starts a stub process per model).
        deadline = time.time() + 300
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.http}/v2/models/Texts/ready",
                                            timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.time() < deadline, ("the models did not get ready; the output ends:\n"
                                            + self.output.decode(errors="replace")[-4000:])
            time.sleep(0.3)

    def stop(self):
        self.process.send_signal(2)  # SIGINT, as Ctrl-C stops serve()
        try:
            return self.process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            raise AssertionError("the server did not stop; its output ends:\n"
                                 + self.output.decode(errors="replace")[-4000:]) from None
        finally:
            if self.process.poll() is None:
                self.process.kill()


def run_client(python, script, url):
    out = subprocess.run([python, script, url], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def expected():
    batch = np.arange(12, dtype=np.float32).reshape(3, 4)
    return {"linear_batch": (batch * -2 + 1).tolist(), "linear_sample": (batch[1] * -2 + 1).tolist(),
            "scaled": (batch * 0.5).tolist(), "texts": [["HELLO", "WORLD"], ["mixed", "case"]]}


@pytest.fixture(scope="module")
def ours(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pytriton")
    serving = Serving(sys.executable, ported("linear_server.py", tmp, "server.py"))
    serving.client = ported("linear_client.py", tmp, "client.py")
    yield serving
    assert serving.stop() == 0


def test_pytriton_scripts_run_with_only_the_import_changed(ours):
    assert run_client(sys.executable, ours.client, f"127.0.0.1:{ours.http}") == expected()
    assert run_client(sys.executable, ours.client, f"grpc://127.0.0.1:{ours.grpc}") == expected()


def test_default_names_batching_and_instances_as_pytriton_documents(ours):
    with urllib.request.urlopen(f"http://127.0.0.1:{ours.http}/v2/models/Linear/config") as r:
        config = json.loads(r.read())
    assert [i["name"] for i in config["input"]] == ["INPUT_1"]
    assert [o["name"] for o in config["output"]] == ["OUTPUT_1"]
    # ModelConfig(max_batch_size=8) batches by default, with a dynamic batcher.
    assert config["max_batch_size"] == 8 and "dynamic_batching" in config
    assert config["instance_group"][0]["count"] == 2
    from wasmtron.pytriton.client import ModelClient
    with ModelClient(f"grpc://127.0.0.1:{ours.grpc}", "Scaled") as client:
        spec = client.model_config
        assert [(t.name, t.shape, t.dtype) for t in spec.inputs] == \
            [("data", (-1,), np.float32), ("scale", (1,), np.float32)]
        assert spec.max_batch_size == 16 and not spec.decoupled


def test_the_async_and_futures_clients(ours):
    from wasmtron.pytriton.client import AsyncioModelClient, FuturesModelClient

    x = np.ones((2, 3), dtype=np.float32)

    async def go():
        async with AsyncioModelClient(f"127.0.0.1:{ours.http}", "Linear") as client:
            return await asyncio.gather(*(client.infer_batch(x * i) for i in range(4)))
    answers = asyncio.run(go())
    assert [a["OUTPUT_1"].tolist() for a in answers] == [(x * i * -2 + 1).tolist() for i in range(4)]
    with FuturesModelClient(f"127.0.0.1:{ours.http}", "Linear") as client:
        futures = [client.infer_sample(np.full(5, i, dtype=np.float32)) for i in range(6)]
        assert [f.result()["OUTPUT_1"][0] for f in futures] == [i * -2 + 1 for i in range(6)]


def test_errors_name_what_was_wrong(ours):
    from wasmtron.pytriton.client import ModelClient
    from wasmtron.pytriton.exceptions import PyTritonClientInferenceServerError

    with ModelClient(f"127.0.0.1:{ours.http}", "Linear") as client:
        with pytest.raises(PyTritonClientInferenceServerError) as e:
            client.infer_batch(np.ones((2, 3), dtype=np.int64))
        assert "INPUT_1" in str(e.value) and "FP32" in str(e.value)
        # The model still serves.
        assert client.infer_sample(np.zeros(2, dtype=np.float32))["OUTPUT_1"].tolist() == [1.0, 1.0]


def test_in_process_bind_checks_and_decorators(tmp_path):
    from wasmtron.pytriton.decorators import batch, fill_optionals, sample
    from wasmtron.pytriton.exceptions import (PyTritonBadParameterError,
                                              PyTritonClientModelDoesntSupportBatchingError)
    from wasmtron.pytriton.model_config import ModelConfig, Tensor
    from wasmtron.pytriton.triton import Triton, TritonConfig
    from wasmtron.pytriton.client import ModelClient

    http, = free_ports(1)
    config = TritonConfig(http_port=http, http_address="127.0.0.1", allow_grpc=False,
                          allow_metrics=False)

    @fill_optionals(bias=np.array([10.0], dtype=np.float32))
    @batch
    def add(x, bias):
        return {"y": x + bias}

    @sample
    def whole(INPUT_1):
        return [INPUT_1.sum(keepdims=True).astype(np.float64)]  # cast to the declared FP32

    @batch
    def wrong(x):
        return {"y": x.astype(np.int32)}

    with Triton(config=config) as triton:
        triton.bind("Add", add, [Tensor(name="x", dtype=np.float32, shape=(-1,)),
                                 Tensor(name="bias", dtype=np.float32, shape=(1,), optional=True)],
                    [Tensor(name="y", dtype=np.float32, shape=(-1,))])
        triton.bind("Whole", whole, [Tensor(dtype=np.float32, shape=(-1,))],
                    [Tensor(dtype=np.float32, shape=(1,))], config=ModelConfig(batching=False))
        triton.bind("Strict", wrong, [Tensor(name="x", dtype=np.float32, shape=(-1,))],
                    [Tensor(name="y", dtype=np.float32, shape=(-1,))], strict=True)
        with pytest.raises(PyTritonBadParameterError, match="decoupled"):
            triton.bind("Gen", add, [Tensor(dtype=np.float32, shape=(-1,))],
                        [Tensor(dtype=np.float32, shape=(-1,))], config=ModelConfig(decoupled=True))
        url = f"127.0.0.1:{http}"
        with ModelClient(url, "Add") as client:
            assert client.infer_sample(x=np.array([1.0, 2.0], dtype=np.float32))["y"].tolist() == [11.0, 12.0]
        with ModelClient(url, "Whole") as client:
            assert client.infer_sample(np.array([1.0, 2.0, 3.0], dtype=np.float32))["OUTPUT_1"].tolist() == [6.0]
            with pytest.raises(PyTritonClientModelDoesntSupportBatchingError):
                client.infer_batch(np.ones((2, 3), dtype=np.float32))
        with ModelClient(url, "Strict") as client:
            with pytest.raises(Exception, match="Output 'y' has dtype int32"):
                client.infer_sample(x=np.ones(2, dtype=np.float32))


def run_script(python, script):
    """A script that serves and calls itself; its ports from the environment."""
    http, grpc, metrics = free_ports(3)
    env = dict(os.environ, PYTRITON_TRITON_CONFIG_HTTP_PORT=str(http),
               PYTRITON_TRITON_CONFIG_GRPC_PORT=str(grpc),
               PYTRITON_TRITON_CONFIG_METRICS_PORT=str(metrics),
               PYTRITON_TRITON_CONFIG_HTTP_ADDRESS="127.0.0.1",
               PYTRITON_TRITON_CONFIG_GRPC_ADDRESS="127.0.0.1")
    out = subprocess.run([python, script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


RUN_AND_CALL = {"greeting": ["Hello, Ada", "Hello, Grace"], "length": [3, 5],
                "sample": "Hello, Linus"}


def test_a_script_that_runs_and_calls_itself(tmp_path):
    assert run_script(sys.executable, ported("run_and_call.py", tmp_path, "run.py")) == RUN_AND_CALL


@pytest.mark.skipif(not PYTRITON_PYTHON, reason="the real PyTriton is not installed (PYTRITON_PYTHON)")
def test_the_real_pytriton_runs_and_calls_the_same():
    assert run_script(PYTRITON_PYTHON, os.path.join(EXAMPLES, "run_and_call.py")) == RUN_AND_CALL


@pytest.mark.skipif(not PYTRITON_PYTHON, reason="the real PyTriton is not installed (PYTRITON_PYTHON)")
def test_pytritons_own_client_against_our_server(ours, tmp_path):
    script = os.path.join(EXAMPLES, "linear_client.py")
    assert run_client(PYTRITON_PYTHON, script, f"127.0.0.1:{ours.http}") == expected()
    assert run_client(PYTRITON_PYTHON, script, f"grpc://127.0.0.1:{ours.grpc}") == expected()


@pytest.mark.skipif(not PYTRITON_PYTHON, reason="the real PyTriton is not installed (PYTRITON_PYTHON)")
def test_the_real_pytriton_gives_the_same_answers():
    # The reference, not the server under test: on a loaded machine real PyTriton's model
    # once failed to load (its Python backend stub's handshake socket refused the connection,
    # a race inside PyTriton); it gets a second start.
    try:
        real = Serving(PYTRITON_PYTHON, os.path.join(EXAMPLES, "linear_server.py"))
    except Exception:  # noqa: BLE001 - any failure of the reference's first start
        real = Serving(PYTRITON_PYTHON, os.path.join(EXAMPLES, "linear_server.py"))
    try:
        assert run_client(PYTRITON_PYTHON, os.path.join(EXAMPLES, "linear_client.py"),
                          f"127.0.0.1:{real.http}") == expected()
    finally:
        real.stop()


def test_the_decoupled_client_streams_a_generation_model(tmp_path):
    """DecoupledModelClient over the gRPC stream against a decoupled model (the smollm2
    ensemble): one answer per generated token, in order, as PyTriton's client yields them."""
    from conftest import ROOT, Server
    from test_generation import link_model
    from wasmtron.pytriton.client import DecoupledModelClient

    for name in ("smollm2", "smollm2_decoder", "llm_preprocessing", "llm_postprocessing"):
        link_model(str(tmp_path), os.path.join(ROOT, "model_repository", name))
    server = Server(str(tmp_path))
    try:
        with DecoupledModelClient(f"grpc://{server.grpc}", "smollm2") as client:
            parts = list(client.infer_sample(text_input=np.array([b"The capital of France is"]),
                                             max_tokens=np.array([4], np.int32),
                                             temperature=np.array([0.0], np.float32),
                                             stream=np.array([True])))
        assert len(parts) == 4
        text = b"".join(p["text_output"][0] for p in parts).decode()
        assert text.startswith(" Paris")
        assert [int(p["generated_tokens"][0]) for p in parts] == [1, 2, 3, 4]
    finally:
        server.stop()
