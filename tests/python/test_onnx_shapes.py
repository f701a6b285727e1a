"""ONNX models whose tensors the configuration declares differently from the graph, served as
Triton's ONNX Runtime backend serves them. Each case names the Triton QA folder it covers:
a scalar tensor declared with dims of 1s (L0_scalar_io), an initializer that is also an input
and may be left out (L0_initializer_as_input), and `reshape` with variable dimensions
(L0_infer_reshape). The models are made here with onnx's helpers; one server loads them."""
import numpy as np
import onnx
import pytest
import tritonclient.http as httpclient
from onnx import TensorProto, helper, numpy_helper
from tritonclient.utils import InferenceServerException

from conftest import Server


def save(repo, name, config, graph):
    version = repo / name / "1"
    version.mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(config)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    onnx.save(model, str(version / "model.onnx"))


def identity(shape):
    """OUTPUT = INPUT, FP32, both of `shape` (None: no shape at all, a scalar to ONNX Runtime)."""
    return helper.make_graph(
        [helper.make_node("Identity", ["INPUT"], ["OUTPUT"])], "identity",
        [helper.make_tensor_value_info("INPUT", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("OUTPUT", TensorProto.FLOAT, shape)])


def io(dims, extra=""):
    return (f'input [ {{ name: "INPUT", data_type: TYPE_FP32, dims: {dims} {extra} }} ]\n'
            f'output [ {{ name: "OUTPUT", data_type: TYPE_FP32, dims: {dims} {extra} }} ]\n')


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("shapes")
    for name, dims in (("scalar_1dim", "[ 1 ]"), ("scalar_2dim", "[ 1, 1 ]"),
                       ("scalar_wrong", "[ 2 ]")):
        save(repo, name, 'platform: "onnxruntime_onnx"\nmax_batch_size: 0\n' + io(dims),
             identity(None))
    ones = numpy_helper.from_array(np.ones((5, 5), np.float32), "INITIALIZER")
    added = helper.make_graph(
        [helper.make_node("Add", ["INPUT", "INITIALIZER"], ["OUTPUT"])], "init_input",
        [helper.make_tensor_value_info("INPUT", TensorProto.FLOAT, [5, 5]),
         helper.make_tensor_value_info("INITIALIZER", TensorProto.FLOAT, [5, 5])],
        [helper.make_tensor_value_info("OUTPUT", TensorProto.FLOAT, [5, 5])], [ones])
    save(repo, "initializer_declared",
         'platform: "onnxruntime_onnx"\nmax_batch_size: 0\n'
         'input [ { name: "INPUT", data_type: TYPE_FP32, dims: [ 5, 5 ] },\n'
         '        { name: "INITIALIZER", data_type: TYPE_FP32, dims: [ 5, 5 ], optional: true } ]\n'
         'output [ { name: "OUTPUT", data_type: TYPE_FP32, dims: [ 5, 5 ] } ]\n', added)
    # A configuration need not name the initializer (nor does auto-complete ask for it).
    save(repo, "initializer_undeclared", 'platform: "onnxruntime_onnx"\nmax_batch_size: 0\n',
         added)
    # The model takes [batch, -1, 2]; clients send [batch, 2, -1].
    save(repo, "reshaped",
         'platform: "onnxruntime_onnx"\nmax_batch_size: 8\n'
         + io("[ 2, -1 ]", "reshape: { shape: [ -1, 2 ] }"),
         identity(["batch", "n", 2]))
    # An ensemble's parameter on a model that is not one: refused by name, never ignored.
    save(repo, "default_outside",
         'platform: "onnxruntime_onnx"\nmax_batch_size: 0\n' + io("[ 1 ]")
         + 'parameters { key: "input_default:INPUT" value { string_value: "1" } }\n',
         identity(None))
    s = Server(str(repo), "--model-control-mode=explicit", "--load-model=*")
    try:
        yield s
    finally:
        s.stop()


def infer(s, model, inputs):
    client = httpclient.InferenceServerClient(s.http)
    given = []
    for name, value in inputs.items():
        given.append(httpclient.InferInput(name, list(value.shape), "FP32"))
        given[-1].set_data_from_numpy(value)
    return client.infer(model, given).as_numpy("OUTPUT")


def test_a_scalar_tensor_is_declared_with_dims_of_ones(server):
    """L0_scalar_io: the request's [1] (or [1, 1]) reaches the model as a scalar and the
    answer comes back in the declared dims; other dims are refused at load in Triton's words."""
    one = infer(server, "scalar_1dim", {"INPUT": np.array([7], np.float32)})
    assert one.shape == (1,) and one[0] == 7
    two = infer(server, "scalar_2dim", {"INPUT": np.array([[3]], np.float32)})
    assert two.shape == (1, 1) and two[0, 0] == 3
    client = httpclient.InferenceServerClient(server.http)
    with pytest.raises(InferenceServerException) as e:
        client.load_model("scalar_wrong")
    assert ("scalar tensor 'INPUT', should only provide 1 in the model configuration when "
            "the model doesn't support batching. Model configuration provided: [2].") \
        in e.value.message()
    assert client.is_model_ready("scalar_1dim")
    with pytest.raises(InferenceServerException) as e:
        client.load_model("default_outside")
    assert "parameter 'input_default:INPUT'" in e.value.message()
    assert "not an ensemble" in e.value.message()


@pytest.mark.parametrize("model", ["initializer_declared", "initializer_undeclared"])
def test_an_initializer_that_is_an_input_may_be_given_or_left_out(server, model):
    """L0_initializer_as_input: left out, the model's stored initializer (ones) is used;
    given (where the configuration declares it), the request's value is."""
    x = np.arange(25, dtype=np.float32).reshape(5, 5)
    np.testing.assert_array_equal(infer(server, model, {"INPUT": x}), x + 1)
    if model == "initializer_declared":
        np.testing.assert_array_equal(
            infer(server, model, {"INPUT": x, "INITIALIZER": x}), x + x)


def test_reshape_carries_variable_dimensions(server):
    """L0_infer_reshape (variable-size cases): dims [2, -1] reshaped to [-1, 2] hand the
    model [rows, 5, 2] for a request of [rows, 2, 5] and give its answer back as [rows, 2, 5]."""
    for rows, n in ((1, 5), (3, 4)):
        x = np.arange(rows * 2 * n, dtype=np.float32).reshape(rows, 2, n)
        y = infer(server, "reshaped", {"INPUT": x})
        assert y.shape == (rows, 2, n)
        np.testing.assert_array_equal(y, x)
