"""A Triton-shaped repository moves over unchanged: every `config.pbtxt` field is honoured, refused
at load naming the field, file and line, or — only where Triton ignores it too — logged as having
no effect. ONNX models saved with external data load in both of Triton's layouts, and ONNX
Runtime's session settings (`optimization.graph.level`, `execution_mode`, the memory arena and
pattern, arena shrinkage) are taken as Triton's ONNX Runtime backend takes them."""
import hashlib
import json
import os
import re
import shutil
import urllib.request

import numpy as np
import onnx
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from onnx import TensorProto, helper, numpy_helper
from tritonclient.utils import InferenceServerException

from conftest import ROOT, Server

WEIGHTS = np.arange(1, 1025, dtype=np.float32)  # 4 KiB: over onnx's external-data threshold
ADD_CONFIG = """backend: "onnxruntime"
max_batch_size: 4
input [ { name: "x", data_type: TYPE_FP32, dims: [ 1024 ] } ]
output [ { name: "y", data_type: TYPE_FP32, dims: [ 1024 ] } ]
"""


def add_model():
    """y = x + W, with W an initializer (the part stored as external data)."""
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "W"], ["y"])], "add_weights",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 1024])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 1024])],
        [numpy_helper.from_array(WEIGHTS, "W")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)


def write_model(repo, name, config, layout="file"):
    """`layout`: "file" (model.onnx with its weights inside), "side" (model.onnx plus a side
    file of weights) or "directory" (a model.onnx directory holding model.onnx and its data)."""
    version = repo / name / "1"
    version.mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(config)
    model = add_model()
    if layout == "file":
        onnx.save(model, str(version / "model.onnx"))
        return
    folder = version / "model.onnx" if layout == "directory" else version
    folder.mkdir(exist_ok=True)
    onnx.save_model(model, str(folder / "model.onnx"), save_as_external_data=True,
                    all_tensors_to_one_file=True, location="weights.bin", size_threshold=1024)
    assert (folder / "weights.bin").stat().st_size == WEIGHTS.nbytes


def infer(client, name):
    x = np.linspace(-1, 1, 2 * 1024, dtype=np.float32).reshape(2, 1024)
    given = httpclient.InferInput("x", [2, 1024], "FP32")
    given.set_data_from_numpy(x)
    y = client.infer(name, [given]).as_numpy("y")
    np.testing.assert_allclose(y, x + WEIGHTS, rtol=1e-6)


def load_error(client, name):
    with pytest.raises(InferenceServerException) as refused:
        client.load_model(name)
    return str(refused.value)


def test_onnx_models_with_external_data_load_in_both_layouts(tmp_path):
    repo = tmp_path / "repo"
    write_model(repo, "beside", ADD_CONFIG, layout="side")
    write_model(repo, "inside", ADD_CONFIG, layout="directory")
    s = Server(str(repo))
    try:
        client = httpclient.InferenceServerClient(s.http)
        for name in ("beside", "inside"):
            assert client.is_model_ready(name), "".join(s.log)
            infer(client, name)
    finally:
        s.stop()


def test_refused_fields_name_the_field_file_and_line_and_the_server_keeps_serving(tmp_path):
    repo = tmp_path / "repo"
    write_model(repo, "plain", ADD_CONFIG)
    ragged = ADD_CONFIG.replace('dims: [ 1024 ] } ]\noutput',
                                'dims: [ 1024 ]\n          allow_ragged_batch: true } ]\noutput')
    write_model(repo, "ragged", ragged)
    write_model(repo, "custom_ops", ADD_CONFIG + 'model_operations { op_library_filename: "libops.so" }\n')
    write_model(repo, "passive_only", ADD_CONFIG +
                "instance_group [ { count: 2, kind: KIND_CPU, passive: true } ]\n")
    write_model(repo, "bad_mode", ADD_CONFIG +
                'parameters { key: "execution_mode" value { string_value: "2" } }\n')
    write_model(repo, "no_arena", ADD_CONFIG + """parameters [
  { key: "enable_mem_arena", value: { string_value: "0" } },
  { key: "memory.enable_memory_arena_shrinkage", value: { string_value: "cpu:0" } }
]
""")
    s = Server(str(repo), "--model-control-mode=explicit")
    try:
        client = httpclient.InferenceServerClient(s.http)
        e = load_error(client, "ragged")
        assert "input 'x' has allow_ragged_batch: true, so the ONNX model must take it with " \
               "shape [-1]" in e, e
        e = load_error(client, "custom_ops")
        assert "field 'model_operations.op_library_filename': custom operator libraries are " \
               "native code" in e and "--allow-custom-op-libraries" in e, e
        e = load_error(client, "passive_only")
        assert "every instance_group is passive" in e, e
        e = load_error(client, "bad_mode")
        assert "parameter 'execution_mode' must be 0 (sequential) or 1 (parallel)" in e, e
        e = load_error(client, "no_arena")
        assert "shrinks the CPU arena (\"cpu:0\"), but 'enable_mem_arena' turns that arena off" \
            in e, e
        client.load_model("plain")
        infer(client, "plain")
    finally:
        s.stop()


def test_the_checksum_agent_refuses_a_model_whose_file_changed(tmp_path):
    repo = tmp_path / "repo"
    agent = """model_repository_agents {{
  agents [ {{ name: "checksum", parameters {{ key: "MD5:1/model.onnx", value: "{}" }} }} ]
}}
"""
    write_model(repo, "checked", ADD_CONFIG + agent.format("0" * 32))
    write_model(repo, "intact", ADD_CONFIG)
    digest = hashlib.md5((repo / "intact" / "1" / "model.onnx").read_bytes()).hexdigest()
    (repo / "intact" / "config.pbtxt").write_text(ADD_CONFIG + agent.format(digest))
    assert hashlib.md5((repo / "checked" / "1" / "model.onnx").read_bytes()).hexdigest() == digest
    s = Server(str(repo), "--model-control-mode=explicit")
    try:
        client = httpclient.InferenceServerClient(s.http)
        client.load_model("intact")
        infer(client, "intact")
        e = load_error(client, "checked")
        assert f"mismatched MD5 hash for file 1/model.onnx, expect: {'0' * 32}, got: {digest}" \
            in e, e
        assert not client.is_model_ready("checked")
    finally:
        s.stop()


def test_classification_reads_the_label_file_over_both_protocols(tmp_path):
    repo = tmp_path / "repo"
    labeled = ADD_CONFIG.replace(
        'output [ { name: "y", data_type: TYPE_FP32, dims: [ 1024 ] } ]',
        'output [ { name: "y", data_type: TYPE_FP32, dims: [ 1024 ], label_filename: "classes.txt" } ]')
    write_model(repo, "labeled", labeled)
    (repo / "labeled" / "classes.txt").write_text("\n".join(f"class{i}" for i in range(1024)))
    s = Server(str(repo))
    try:
        x = np.zeros((2, 1024), dtype=np.float32)  # y = W = 1..1024 on each row
        want = [[b"1024.000000:1023:class1023", b"1023.000000:1022:class1022"]] * 2
        for mod, url in ((httpclient, s.http), (grpcclient, s.grpc)):
            client = mod.InferenceServerClient(url)
            given = mod.InferInput("x", [2, 1024], "FP32")
            given.set_data_from_numpy(x)
            asked = mod.InferRequestedOutput("y", class_count=2)
            classes = client.infer("labeled", [given], outputs=[asked]).as_numpy("y")
            assert classes.tolist() == want, (mod.__name__, classes)
    finally:
        s.stop()


def test_metric_tags_label_the_models_metrics(tmp_path):
    repo = tmp_path / "repo"
    write_model(repo, "tagged", ADD_CONFIG + """metric_tags [
  { key: "team", value: "vision" },
  { key: "tier", value: "gold" }
]
""")
    write_model(repo, "digits", ADD_CONFIG + 'metric_tags { key: "9lives" value: "x" }\n')
    write_model(repo, "badly_tagged", ADD_CONFIG + 'metric_tags { key: "a-b" value: "x" }\n')
    s = Server(str(repo))
    try:
        client = httpclient.InferenceServerClient(s.http)
        infer(client, "tagged")
        text = s.metrics_text()
        line = next(l for l in text.splitlines() if l.startswith("nv_inference_count{")
                    and 'model="tagged"' in l)
        labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
        # Triton's reporter prefixes each tag with '_'.
        assert labels == {"model": "tagged", "version": "1", "_team": "vision",
                          "_tier": "gold"}, line
        assert client.is_model_ready("digits")
        infer(client, "digits")
        assert any('_9lives="x"' in l and 'model="digits"' in l
                   for l in s.metrics_text().splitlines()), "a digit-led tag is a valid label"
        assert line.endswith(" 2"), line  # two rows
        assert not client.is_model_ready("badly_tagged")
        with urllib.request.urlopen(f"http://{s.http}/v2/repository/index", data=b"{}") as r:
            index = {m["name"]: m for m in json.loads(r.read())}
        reason = index["badly_tagged"]["reason"]
        assert "field 'metric_tags': 'a-b' cannot name a metric label" in reason, reason
    finally:
        s.stop()


def test_session_settings_load_and_fields_triton_ignores_are_logged_once(tmp_path):
    repo = tmp_path / "repo"
    tuned = ADD_CONFIG + """optimization {
  graph { level: 2 }
  cuda { graphs: true busy_wait_events: true }
  priority: PRIORITY_MAX
}
instance_group [
  { count: 1, kind: KIND_CPU },
  { count: 3, kind: KIND_CPU, passive: true, profile: [ "0" ] }
]
parameters [
  { key: "execution_mode", value: { string_value: "1" } },
  { key: "inter_op_thread_count", value: { string_value: "2" } },
  { key: "enable_mem_arena", value: { string_value: "on" } },
  { key: "enable_mem_pattern", value: { string_value: "false" } },
  { key: "memory.enable_memory_arena_shrinkage", value: { string_value: "cpu:0" } },
  { key: "EXECUTION_ENV_PATH", value: { string_value: "$TRITON_MODEL_DIRECTORY/env.tar.gz" } }
]
"""
    write_model(repo, "tuned", tuned)
    s = Server(str(repo))
    try:
        client = httpclient.InferenceServerClient(s.http)
        assert client.is_model_ready("tuned"), "".join(s.log)
        for _ in range(3):
            infer(client, "tuned")
        config = client.get_model_config("tuned")
        assert config["optimization"]["graph"]["level"] == 2, config
        log = "".join(s.log)
        for field, line in (("optimization.cuda.graphs", 7), ("optimization.cuda.busy_wait_events", 7),
                            ("optimization.priority", 8), ("instance_group.profile", 12)):
            said = f"tuned/config.pbtxt:{line}: field '{field}' has no effect here"
            assert log.count(said) == 1, (said, log)
        assert "parameter 'EXECUTION_ENV_PATH' has no effect on ONNX Runtime models" in log, log
        # Honoured fields and known parameters are not reported.
        assert "'optimization.graph.level' has no effect" not in log
        assert "parameter 'execution_mode' has no effect" not in log
    finally:
        s.stop()


CUSTOM_OPS_LIB = os.environ.get(
    "CUSTOM_OPS_LIB", os.path.join(ROOT, "target", "debug", "libwasmtron_test_custom_ops.so"))


def test_custom_operator_libraries_load_only_when_the_server_allows_them(tmp_path):
    """model_operations as Triton's ONNX Runtime backend reads it: the library (here
    tests/custom_ops, built by make: wasmtron.test::Double, y = 2x) is registered with every
    session of the model, from an absolute path or a path in the model's folder."""
    repo = tmp_path / "repo"
    graph = helper.make_graph(
        [helper.make_node("Double", ["x"], ["y"], domain="wasmtron.test")], "custom",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])])
    model = helper.make_model(graph, ir_version=8, opset_imports=[
        helper.make_opsetid("", 13), helper.make_opsetid("wasmtron.test", 1)])
    config = """max_batch_size: 4
input [ { name: "x", data_type: TYPE_FP32, dims: [ 4 ] } ]
output [ { name: "y", data_type: TYPE_FP32, dims: [ 4 ] } ]
model_operations { op_library_filename: "LIB" }
"""
    for name, lib in (("absolute", CUSTOM_OPS_LIB), ("beside", "ops/libdouble.so")):
        (repo / name / "1").mkdir(parents=True)
        onnx.save(model, str(repo / name / "1" / "model.onnx"))
        (repo / name / "config.pbtxt").write_text(config.replace("LIB", lib))
    (repo / "beside" / "ops").mkdir()
    shutil.copy(CUSTOM_OPS_LIB, repo / "beside" / "ops" / "libdouble.so")
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    s = Server(str(repo))
    try:
        client = httpclient.InferenceServerClient(s.http)
        assert not client.is_model_ready("absolute")
        assert "--allow-custom-op-libraries" in "".join(s.log)
    finally:
        s.stop()
    s = Server(str(repo), "--allow-custom-op-libraries")
    try:
        client = httpclient.InferenceServerClient(s.http)
        for name in ("absolute", "beside"):
            assert client.is_model_ready(name), "".join(s.log)[-3000:]
            given = httpclient.InferInput("x", [2, 4], "FP32")
            given.set_data_from_numpy(x)
            np.testing.assert_array_equal(client.infer(name, [given]).as_numpy("y"), 2 * x)
    finally:
        s.stop()
