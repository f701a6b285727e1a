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
    # (A leading '/' names a file in the model folder, as on Triton: `/etc/x` is `etc/x` there,
    # so the climbing forms are what is left to refuse.)
    for key in ["../escape/model.onnx", "/../etc/x", f"1/../../../../..{victim}/keep.txt", "1//x"]:
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


def pytriton(**config):
    from wasmtron.pytriton.triton import Triton, TritonConfig
    return Triton(config=TritonConfig(http_port=0, grpc_port=0, metrics_port=0, **config))


def status_of(address, path, headers=None):
    import http.client
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", path, body=b"{}", headers=headers or {})
    response = conn.getresponse()
    response.read()
    return response.status


def test_pytriton_listens_on_loopback_with_its_admin_apis_behind_a_token():
    # PyTriton's tritonserver listens on 0.0.0.0; the drop-in binds loopback unless told, and
    # protects the admin APIs with a token as PyTriton 0.7 does.
    with pytriton() as triton:
        addresses = triton.addresses
        assert {a.rsplit(":", 1)[0] for a in addresses.values()} == {"127.0.0.1"}, addresses
        token = triton.get_access_token()
        assert token
        assert status_of(addresses["http"], "/v2/repository/index") == 403
        assert status_of(addresses["http"], "/v2/repository/index",
                         {"triton-access-token": "wrong"}) == 403
        assert status_of(addresses["http"], "/v2/repository/index",
                         {"triton-access-token": token}) == 200


def test_pytriton_security_config_is_honoured():
    from wasmtron.pytriton.exceptions import PyTritonValidationError
    from wasmtron.pytriton.triton import Triton, TritonConfig, TritonSecurityConfig
    config = TritonConfig(http_port=0, grpc_port=0, metrics_port=0)
    with Triton(config=config, security_config=TritonSecurityConfig(restricted_endpoints=[])) as t:
        assert status_of(t.addresses["http"], "/v2/repository/index") == 200
    secured = TritonSecurityConfig(access_token="s3cret", restricted_endpoints=["inference"])
    with Triton(config=config, security_config=secured) as t:
        assert status_of(t.addresses["http"], "/v2/models/none/infer") == 403
        assert status_of(t.addresses["http"], "/v2/repository/index") == 200
    with pytest.raises(PyTritonValidationError, match="Invalid endpoint names: bogus"):
        TritonSecurityConfig(restricted_endpoints=["bogus"])


@pytest.mark.parametrize("field,value,says", [
    ("grpc_use_ssl", True, "TLS is not served"),
    ("grpc_server_cert", "/tmp/cert.pem", "TLS is not served"),
    ("allow_sagemaker", True, "SageMaker endpoint is not served"),
    ("http_header_forward_pattern", ".*", "not forwarded to models"),
])
def test_pytriton_security_options_it_does_not_serve_are_refused_by_name(field, value, says):
    from wasmtron.pytriton.exceptions import PyTritonBadParameterError
    with pytest.raises(PyTritonBadParameterError, match=f"TritonConfig.{field} is set.*{says}"):
        pytriton(**{field: value})
