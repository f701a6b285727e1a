"""Ragged batching as Triton does it (`allow_ragged_batch`, `batch_input`, `batch_output`):
requests whose ragged input differs in length run as one batch. The ONNX model gets the 1-D
concatenation of every request's elements plus the batch inputs the server makes, and each
request gets back its own part; a Python-backend model batches the same requests and sees each
one's own tensors. Driven with the stock tritonclient."""
import numpy as np
import onnx
import pytest
import tritonclient.http as httpclient
from onnx import TensorProto, helper, numpy_helper
from tritonclient.utils import InferenceServerException

from conftest import Server

LENGTHS = [3, 1, 5, 2]  # one batch: the preferred size, within a long queue delay

RAGGED_ONNX_CONFIG = """backend: "onnxruntime"
max_batch_size: 8
dynamic_batching { preferred_batch_size: [ 4 ] max_queue_delay_microseconds: 20000000 }
instance_group [ { count: 1, kind: KIND_CPU } ]
input [ { name: "INPUT", data_type: TYPE_FP32, dims: [ -1 ], allow_ragged_batch: true } ]
batch_input [
  { kind: BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO, target_name: "ACC",
    data_type: TYPE_INT32, source_input: "INPUT" },
  { kind: BATCH_ITEM_SHAPE, target_name: "ITEM", data_type: TYPE_INT32, source_input: "INPUT" },
  { kind: BATCH_ELEMENT_COUNT, target_name: "COUNT", data_type: TYPE_FP32, source_input: "INPUT" }
]
output [
  { name: "SUM", data_type: TYPE_FP32, dims: [ 1 ] },
  { name: "DOUBLED", data_type: TYPE_FP32, dims: [ -1 ] },
  { name: "ITEM_OUT", data_type: TYPE_INT32, dims: [ 1 ] },
  { name: "COUNT_OUT", data_type: TYPE_FP32, dims: [ 1 ] }
]
batch_output [
  { target_name: "DOUBLED", kind: BATCH_SCATTER_WITH_INPUT_SHAPE, source_input: "INPUT" }
]
"""


def ragged_model():
    """Per request, from the concatenated INPUT and the batch inputs: the sum of its elements
    (cumulative sums read at ACC's offsets), its elements doubled (one 1-D output the server
    scatters), and its item shape and element count passed through."""
    i64 = lambda name, values: numpy_helper.from_array(np.array(values, dtype=np.int64), name)
    nodes = [
        helper.make_node("Concat", ["ZERO", "INPUT"], ["PADDED"], axis=0),
        helper.make_node("CumSum", ["PADDED", "AXIS0"], ["CS"]),
        helper.make_node("Gather", ["CS", "ACC"], ["AT"], axis=0),
        helper.make_node("Slice", ["AT", "ONE", "BIG", "AXIS0"], ["HI"]),
        helper.make_node("Slice", ["AT", "AXIS0", "MINUS1", "AXIS0"], ["LO"]),
        helper.make_node("Sub", ["HI", "LO"], ["SUMS"]),
        helper.make_node("Unsqueeze", ["SUMS", "ONE"], ["SUM"]),
        helper.make_node("Mul", ["INPUT", "TWO"], ["DOUBLED"]),
        helper.make_node("Identity", ["ITEM"], ["ITEM_OUT"]),
        helper.make_node("Unsqueeze", ["COUNT", "ONE"], ["COUNT_OUT"]),
    ]
    graph = helper.make_graph(
        nodes, "ragged",
        [helper.make_tensor_value_info("INPUT", TensorProto.FLOAT, [-1]),
         helper.make_tensor_value_info("ACC", TensorProto.INT32, [-1]),
         helper.make_tensor_value_info("ITEM", TensorProto.INT32, [-1, 1]),
         helper.make_tensor_value_info("COUNT", TensorProto.FLOAT, [-1])],
        [helper.make_tensor_value_info("SUM", TensorProto.FLOAT, [-1, 1]),
         helper.make_tensor_value_info("DOUBLED", TensorProto.FLOAT, [-1]),
         helper.make_tensor_value_info("ITEM_OUT", TensorProto.INT32, [-1, 1]),
         helper.make_tensor_value_info("COUNT_OUT", TensorProto.FLOAT, [-1, 1])],
        [numpy_helper.from_array(np.zeros(1, np.float32), "ZERO"),
         numpy_helper.from_array(np.full(1, 2, np.float32), "TWO"),
         i64("AXIS0", [0]), i64("ONE", [1]), i64("MINUS1", [-1]), i64("BIG", [1 << 30])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)


PYTHON_CONFIG = """backend: "python"
max_batch_size: 8
dynamic_batching { preferred_batch_size: [ 4 ] max_queue_delay_microseconds: 20000000 }
instance_group [ { count: 1, kind: KIND_CPU } ]
input [ { name: "INPUT", data_type: TYPE_FP32, dims: [ -1 ], allow_ragged_batch: true } ]
output [
  { name: "SUM", data_type: TYPE_FP32, dims: [ 1 ] },
  { name: "BATCH", data_type: TYPE_INT32, dims: [ 1 ] }
]
batch_input [
  { kind: BATCH_ELEMENT_COUNT, target_name: "COUNT", data_type: TYPE_INT32, source_input: "INPUT" }
]
"""

PYTHON_MODEL = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT").as_numpy()
            out.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("SUM", x.sum(axis=1, keepdims=True).astype(np.float32)),
                pb_utils.Tensor("BATCH", np.full((x.shape[0], 1), len(requests), np.int32)),
            ]))
        return out
'''


def write_repo(repo):
    onnx_dir = repo / "ragged" / "1"
    onnx_dir.mkdir(parents=True)
    (repo / "ragged" / "config.pbtxt").write_text(RAGGED_ONNX_CONFIG)
    onnx.save(ragged_model(), str(onnx_dir / "model.onnx"))
    py_dir = repo / "ragged_py" / "1"
    py_dir.mkdir(parents=True)
    (repo / "ragged_py" / "config.pbtxt").write_text(PYTHON_CONFIG)
    (py_dir / "model.py").write_text(PYTHON_MODEL)
    # Ragged input the model cannot take (2-D), and a batch input that is not a model input.
    bad = repo / "ragged_2d" / "1"
    bad.mkdir(parents=True)
    (repo / "ragged_2d" / "config.pbtxt").write_text("""max_batch_size: 8
input [ { name: "INPUT", data_type: TYPE_FP32, dims: [ -1 ], allow_ragged_batch: true } ]
output [ { name: "OUT", data_type: TYPE_FP32, dims: [ -1 ] } ]
""")
    graph = helper.make_graph(
        [helper.make_node("Identity", ["INPUT"], ["OUT"])], "rows",
        [helper.make_tensor_value_info("INPUT", TensorProto.FLOAT, [-1, -1])],
        [helper.make_tensor_value_info("OUT", TensorProto.FLOAT, [-1, -1])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8),
              str(bad / "model.onnx"))
    wrong = repo / "ragged_target" / "1"
    wrong.mkdir(parents=True)
    (repo / "ragged_target" / "config.pbtxt").write_text(
        RAGGED_ONNX_CONFIG.replace('target_name: "COUNT"', 'target_name: "COUNTS"'))
    onnx.save(ragged_model(), str(wrong / "model.onnx"))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("ragged")
    write_repo(repo)
    s = Server(str(repo), "--model-control-mode=explicit", "--load-model=ragged",
               "--load-model=ragged_py")
    yield s
    s.stop()


def send_all(client, model, inputs, outputs):
    """Sends every request at once (so they meet in the batcher) and waits for all answers."""
    pending = []
    for x in inputs:
        given = httpclient.InferInput("INPUT", list(x.shape), "FP32")
        given.set_data_from_numpy(x)
        wanted = [httpclient.InferRequestedOutput(o) for o in outputs]
        pending.append(client.async_infer(model, [given], outputs=wanted))
    return [p.get_result() for p in pending]


def executions(client, model):
    stats = client.get_inference_statistics(model)["model_stats"][0]
    return stats["inference_count"], stats["execution_count"]


def test_onnx_ragged_requests_batch_and_each_gets_its_own_answer(server):
    client = httpclient.InferenceServerClient(server.http, concurrency=len(LENGTHS),
                                              network_timeout=120)
    inputs = [np.arange(1, n + 1, dtype=np.float32).reshape(1, n) * (i + 1)
              for i, n in enumerate(LENGTHS)]
    before = executions(client, "ragged")
    answers = send_all(client, "ragged", inputs, ["SUM", "DOUBLED", "ITEM_OUT", "COUNT_OUT"])
    for x, answer in zip(inputs, answers):
        n = x.shape[1]
        np.testing.assert_allclose(answer.as_numpy("SUM"), [[x.sum()]])
        # The batch output comes back in the shape of the request's own input.
        np.testing.assert_array_equal(answer.as_numpy("DOUBLED"), x * 2)
        np.testing.assert_array_equal(answer.as_numpy("ITEM_OUT"), [[n]])
        np.testing.assert_array_equal(answer.as_numpy("COUNT_OUT"), [[n]])
    after = executions(client, "ragged")
    # Four requests of four lengths: one execution.
    assert (after[0] - before[0], after[1] - before[1]) == (4, 1), (before, after)


def test_python_model_batches_ragged_requests_and_sees_each_ones_tensors(server):
    client = httpclient.InferenceServerClient(server.http, concurrency=len(LENGTHS),
                                              network_timeout=120)
    inputs = [np.ones((1, n), np.float32) * n for n in LENGTHS]
    answers = send_all(client, "ragged_py", inputs, ["SUM", "BATCH"])
    for x, answer in zip(inputs, answers):
        np.testing.assert_allclose(answer.as_numpy("SUM"), [[x.sum()]])
        np.testing.assert_array_equal(answer.as_numpy("BATCH"), [[len(LENGTHS)]])
    # Batch inputs mean nothing to a stage: accepted with one line saying so, as Triton's Python
    # backend ignores them.
    log = "".join(server.log)
    assert "ragged_py/config.pbtxt:10: field 'batch_input' has no effect here: a stage receives each " \
           "request's own tensors" in log, log[-3000:]


def test_ragged_configs_the_model_cannot_take_are_refused_by_name(server):
    client = httpclient.InferenceServerClient(server.http, network_timeout=120)
    with pytest.raises(InferenceServerException) as refused:
        client.load_model("ragged_2d")
    assert "input 'INPUT' has allow_ragged_batch: true, so the ONNX model must take it with " \
           "shape [-1]" in str(refused.value), str(refused.value)
    with pytest.raises(InferenceServerException) as refused:
        client.load_model("ragged_target")
    assert "input 'COUNTS' (a batch_input target) is not an input of the ONNX model" \
        in str(refused.value), str(refused.value)
    assert client.is_model_ready("ragged")
