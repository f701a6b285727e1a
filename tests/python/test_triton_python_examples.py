"""Triton's own Python-backend examples (triton-inference-server/python_backend, vendored under
tests/python/triton_python_backend_examples with their licence) laid out as each example's README
says, served unchanged by wasmtron, and checked by each example's own client script: add_sub,
BLS (sync and async), decoupled (repeat and square), BLS calling a decoupled model, auto-complete
(folders with no config.pbtxt) and custom metrics."""
import os
import shutil
import subprocess
import sys

import onnx
import pytest
from onnx import TensorProto, helper

from conftest import Server

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLES = os.path.join(HERE, "triton_python_backend_examples", "examples")

# (model folder, model file, config file) as the examples' READMEs copy them.
LAYOUT = [
    ("add_sub", "add_sub/model.py", "add_sub/config.pbtxt"),
    ("bls_sync", "bls/sync_model.py", "bls/sync_config.pbtxt"),
    ("bls_async", "bls/async_model.py", "bls/async_config.pbtxt"),
    ("repeat_int32", "decoupled/repeat_model.py", "decoupled/repeat_config.pbtxt"),
    ("square_int32", "decoupled/square_model.py", "decoupled/square_config.pbtxt"),
    ("bls_decoupled_sync", "bls_decoupled/sync_model.py", "bls_decoupled/sync_config.pbtxt"),
    ("bls_decoupled_async", "bls_decoupled/async_model.py", "bls_decoupled/async_config.pbtxt"),
    ("nobatch_auto_complete", "auto_complete/nobatch_model.py", None),
    ("batch_auto_complete", "auto_complete/batch_model.py", None),
    ("custom_metrics", "custom_metrics/model.py", "custom_metrics/config.pbtxt"),
]

CLIENTS = [
    "add_sub/client.py",
    "bls/sync_client.py",
    "bls/async_client.py",
    "decoupled/repeat_client.py",
    "decoupled/square_client.py",
    "bls_decoupled/sync_client.py",
    "bls_decoupled/async_client.py",
    "auto_complete/client.py",
    "custom_metrics/client.py",
]


def pytorch_stand_in(folder):
    """The examples' `pytorch` model (add and subtract in PyTorch) as an ONNX model of the same
    interface: INPUT0, INPUT1 FP32 [4] -> OUTPUT0 = sum, OUTPUT1 = difference."""
    ins = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [4]) for n in ("INPUT0", "INPUT1")]
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [4]) for n in ("OUTPUT0", "OUTPUT1")]
    graph = helper.make_graph(
        [helper.make_node("Add", ["INPUT0", "INPUT1"], ["OUTPUT0"]),
         helper.make_node("Sub", ["INPUT0", "INPUT1"], ["OUTPUT1"])],
        "pytorch", ins, outs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    os.makedirs(os.path.join(folder, "1"))
    onnx.save(model, os.path.join(folder, "1", "model.onnx"))
    with open(os.path.join(folder, "config.pbtxt"), "w") as f:
        f.write('name: "pytorch"\nplatform: "onnxruntime_onnx"\n'
                'input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 4 ] },\n'
                '        { name: "INPUT1", data_type: TYPE_FP32, dims: [ 4 ] } ]\n'
                'output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 4 ] },\n'
                '         { name: "OUTPUT1", data_type: TYPE_FP32, dims: [ 4 ] } ]\n'
                'instance_group [ { kind: KIND_CPU, count: 1 } ]\n')


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("triton_examples")
    for folder, model, config in LAYOUT:
        os.makedirs(repo / folder / "1")
        shutil.copy(os.path.join(EXAMPLES, model), repo / folder / "1" / "model.py")
        if config:
            shutil.copy(os.path.join(EXAMPLES, config), repo / folder / "config.pbtxt")
    pytorch_stand_in(str(repo / "pytorch"))
    s = Server(str(repo))
    yield s
    s.stop()


@pytest.mark.parametrize("client", CLIENTS)
def test_the_example_passes_its_own_client(server, client):
    done = subprocess.run(
        [sys.executable, os.path.join(HERE, "run_example_client.py"), server.http, server.grpc,
         server.metrics, os.path.join(EXAMPLES, client)],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:] + "".join(server.log[-40:])
    assert "PASS" in done.stdout, done.stdout[-3000:]


def test_the_auto_completed_models_report_the_python_backend(server):
    import tritonclient.http as httpclient
    c = httpclient.InferenceServerClient(server.http)
    for name in ("nobatch_auto_complete", "batch_auto_complete"):
        config = c.get_model_config(name)
        assert config["backend"] == "python", config
    assert "dynamic_batching" in c.get_model_config("batch_auto_complete")
