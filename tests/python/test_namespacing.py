"""Model namespacing (`--model-namespacing=true`): two repositories holding models of the same
name, each an ensemble calling its own repository's model; plain names resolved or refused as
ambiguous, loads and unloads of a plain name, and poll mode linking an ensemble again when the
model of its own repository goes and comes back.

Covers what Triton's L0_model_namespacing checks (test_no_duplication, test_duplication,
test_ensemble_duplication, test_dynamic_resolution, in poll and explicit mode), with models of
our own."""
import os
import shutil
import time

import numpy as np
import onnx
import pytest
import tritonclient.http as httpclient
from onnx import TensorProto, helper, numpy_helper
from tritonclient.utils import InferenceServerException

from conftest import Server

WAIT_SECONDS = 120


def add_model(repo, name, amount):
    """`name`: OUTPUT = INPUT + amount, [4] FP32, no batching."""
    const = numpy_helper.from_array(np.full([4], amount, np.float32), "AMOUNT")
    graph = helper.make_graph(
        [helper.make_node("Add", ["INPUT", "AMOUNT"], ["OUTPUT"])], name,
        [helper.make_tensor_value_info("INPUT", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("OUTPUT", TensorProto.FLOAT, [4])], [const])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    os.makedirs(os.path.join(repo, name, "1"))
    onnx.save(model, os.path.join(repo, name, "1", "model.onnx"))
    with open(os.path.join(repo, name, "config.pbtxt"), "w") as f:
        f.write(f'name: "{name}"\nplatform: "onnxruntime_onnx"\nmax_batch_size: 0\n'
                'input [ { name: "INPUT", data_type: TYPE_FP32, dims: [ 4 ] } ]\n'
                'output [ { name: "OUTPUT", data_type: TYPE_FP32, dims: [ 4 ] } ]\n')


def ensemble(repo, name, step_model):
    os.makedirs(os.path.join(repo, name, "1"))
    with open(os.path.join(repo, name, "config.pbtxt"), "w") as f:
        f.write(f'name: "{name}"\nplatform: "ensemble"\nmax_batch_size: 0\n'
                'input [ { name: "IN", data_type: TYPE_FP32, dims: [ 4 ] } ]\n'
                'output [ { name: "OUT", data_type: TYPE_FP32, dims: [ 4 ] } ]\n'
                'ensemble_scheduling { step [ { model_name: "' + step_model + '" '
                'model_version: -1 input_map { key: "INPUT" value: "IN" } '
                'output_map { key: "OUTPUT" value: "OUT" } } ] }\n')


def repositories(tmp_path):
    """Repository 1: `composing` adds 1, `only_one` adds 10, `pipeline` calls `composing`;
    repository 2: `composing` subtracts 1, `only_two` adds 20, `pipeline` calls `composing`."""
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    add_model(one, "composing", 1.0)
    add_model(one, "only_one", 10.0)
    ensemble(one, "pipeline", "composing")
    add_model(two, "composing", -1.0)
    add_model(two, "only_two", 20.0)
    ensemble(two, "pipeline", "composing")
    return one, two


def infer(client, model, tensor="INPUT"):
    t = httpclient.InferInput(tensor, [4], "FP32")
    t.set_data_from_numpy(np.zeros(4, np.float32))
    out = "OUT" if tensor == "IN" else "OUTPUT"
    return float(client.infer(model, [t]).as_numpy(out)[0])


def ambiguous(client, model, tensor="INPUT"):
    with pytest.raises(InferenceServerException) as e:
        infer(client, model, tensor)
    assert "ambiguity" in e.value.message(), e.value.message()
    assert f"{model}@1" in e.value.message() and f"{model}@2" in e.value.message()


def wait_for(check, what):
    """Polls `check` until it holds: poll mode sees a change within a few intervals."""
    deadline = time.monotonic() + WAIT_SECONDS
    while True:
        try:
            if check():
                return
        except InferenceServerException:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {WAIT_SECONDS} s: {what}")
        time.sleep(0.5)


def test_poll_mode_resolves_names_and_relinks_ensembles(tmp_path):
    one, two = repositories(tmp_path)
    s = Server(None, "--model-repository", one, "--model-repository", two,
               "--model-namespacing=true", "--model-control-mode=POLL",
               "--repository-poll-secs=1")
    try:
        c = httpclient.InferenceServerClient(s.http)
        assert c.is_server_ready()
        # Names held by one repository only answer by their plain name (and their key).
        assert infer(c, "only_one") == 10.0 and infer(c, "only_two") == 20.0
        assert infer(c, "only_two@2") == 20.0
        # Each ensemble calls its own repository's model; the plain names are ambiguous.
        assert infer(c, "pipeline@1", "IN") == 1.0
        assert infer(c, "pipeline@2", "IN") == -1.0
        ambiguous(c, "pipeline", "IN")
        ambiguous(c, "composing")
        index = {m["name"] for m in c.get_model_repository_index()}
        assert {"composing@1", "composing@2", "pipeline@1", "pipeline@2",
                "only_one@1", "only_two@2"} <= index, index
        # Repository 1's `composing` goes: both ensembles call repository 2's.
        shutil.move(os.path.join(one, "composing"), str(tmp_path / "aside"))
        wait_for(lambda: infer(c, "pipeline@1", "IN") == -1.0, "pipeline@1 calls composing@2")
        assert infer(c, "composing") == -1.0
        assert infer(c, "pipeline@2", "IN") == -1.0
        # It comes back: repository 1's ensemble calls its own again.
        shutil.move(str(tmp_path / "aside"), os.path.join(one, "composing"))
        wait_for(lambda: infer(c, "pipeline@1", "IN") == 1.0, "pipeline@1 calls composing@1")
        assert infer(c, "pipeline@2", "IN") == -1.0
        ambiguous(c, "composing")
    finally:
        s.stop()


def test_explicit_mode_loads_and_unloads_every_model_of_a_name(tmp_path):
    one, two = repositories(tmp_path)
    s = Server(None, "--model-repository", one, "--model-repository", two,
               "--model-namespacing=true", "--model-control-mode=EXPLICIT")
    try:
        c = httpclient.InferenceServerClient(s.http)
        # A plain name loads both repositories' ensembles, each with its own composing model.
        c.load_model("pipeline")
        assert infer(c, "pipeline@1", "IN") == 1.0
        assert infer(c, "pipeline@2", "IN") == -1.0
        assert c.is_model_ready("composing@1") and c.is_model_ready("composing@2")
        ambiguous(c, "pipeline", "IN")
        # With repository 1's `composing` gone, a load links its ensemble to repository 2's.
        c.unload_model("pipeline", unload_dependents=True)
        assert not c.is_model_ready("pipeline@1") and not c.is_model_ready("composing@2")
        shutil.move(os.path.join(one, "composing"), str(tmp_path / "aside"))
        c.load_model("pipeline@1")
        assert infer(c, "pipeline@1", "IN") == -1.0
        assert infer(c, "composing") == -1.0
        # A model no repository holds is refused by its plain name.
        with pytest.raises(InferenceServerException, match="not in any model repository"):
            c.load_model("missing")
    finally:
        s.stop()


def test_without_namespacing_a_name_in_two_repositories_is_refused(tmp_path):
    one, two = repositories(tmp_path)
    s = Server(None, "--model-repository", one, "--model-repository", two,
               "--model-control-mode=explicit")
    try:
        c = httpclient.InferenceServerClient(s.http)
        with pytest.raises(InferenceServerException, match="more than one repository"):
            c.load_model("composing")
        c.load_model("only_two")
        assert infer(c, "only_two") == 20.0
    finally:
        s.stop()
