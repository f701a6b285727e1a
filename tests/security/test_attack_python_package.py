"""The in-process Python API goes through the same name check as HTTP and gRPC: a load, an unload
or a bound function under a name that is not one folder name is refused with
InvalidArgumentError naming it, nothing outside the repository is touched, and the server keeps
serving."""
import numpy as np
import pytest

import wasmtron
from wasmtron import TensorSpec as Tensor

from attack import copy_models, plant_victim

NAMES = ["..", ".", "x/../../victim", "/etc", "a\\b", "a\x00b", ""]


@pytest.fixture
def server(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    copy_models(str(repo), ["simple"])
    with wasmtron.Server(model_repository=str(repo), model_control_mode="explicit",
                         startup_models=["simple"]) as s:
        yield s


def test_loads_and_unloads_under_hostile_names_are_refused(server, tmp_path):
    victim, untouched = plant_victim(tmp_path)
    for name in NAMES + [f"x/../../../../../../..{victim}"]:
        with pytest.raises(wasmtron.InvalidArgumentError, match="invalid model name"):
            server.load(name)
        with pytest.raises(wasmtron.InvalidArgumentError, match="invalid model name"):
            server.unload(name)
    # The files of load(parameters=...) go through the load API's file-key check.
    for key in ["../escape/model.onnx", "/etc/x", f"1/../../../../..{victim}/keep.txt", "1//x"]:
        with pytest.raises(wasmtron.InvalidArgumentError, match="load parameter 'file:"):
            server.load("uploaded", parameters={"config": '{"backend": "onnxruntime"}',
                                                f"file:{key}": b"x"})
    untouched()
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    (response,) = server.model("simple").infer(inputs={"INPUT0": a, "INPUT1": a})
    np.testing.assert_array_equal(np.from_dlpack(response.outputs["OUTPUT0"]), a + a)


def test_a_bound_function_needs_a_plain_name(server):
    for name in ["../x", "a/b", ".."]:
        with pytest.raises(wasmtron.InvalidArgumentError, match="invalid model name"):
            server.bind(name, lambda x: {"y": x}, inputs=[Tensor("x", np.float32, (1,))],
                        outputs=[Tensor("y", np.float32, (1,))])
