"""Triton's endpoint restriction with the stock tritonclient: `--http-restricted-api` and
`--grpc-restricted-protocol` put API groups behind a shared-secret header, the rest stays
open, and a bad flag stops the server with a message naming it."""
import subprocess

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import BINARY, serving, simple_inputs

ADMIN = {"admin-key": "s3cret"}
GRPC_ADMIN = {"triton-grpc-protocol-admin-key": "s3cret"}
ONES = np.ones((1, 16), dtype=np.int32)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from serving(
        tmp_path_factory, "restricted", ["simple"],
        "--model-control-mode", "explicit", "--load-model", "simple",
        "--http-restricted-api", "model-repository,statistics:admin-key=s3cret",
        "--http-restricted-api", "model-config:other-key=other",
        "--grpc-restricted-protocol", "model-repository,statistics:admin-key=s3cret")


def refused(call):
    with pytest.raises(InferenceServerException) as e:
        call()
    return str(e.value)


def test_http_restricted_groups_need_their_header(server):
    c = httpclient.InferenceServerClient(server.http, network_timeout=120)
    text = refused(c.get_model_repository_index)
    assert "403" in text and "model-repository API is restricted" in text and "'admin-key'" in text
    assert "403" in refused(lambda: c.get_inference_statistics("simple"))
    assert "403" in refused(lambda: c.get_inference_statistics("simple", headers={"admin-key": "no"}))
    assert "403" in refused(lambda: c.unload_model("simple", headers={"other-key": "other"}))
    # Each group has its own header.
    assert "'other-key'" in refused(lambda: c.get_model_config("simple", headers=ADMIN))
    assert c.get_model_config("simple", headers={"other-key": "other"})["name"] == "simple"
    assert [m["name"] for m in c.get_model_repository_index(headers=ADMIN)] == ["simple"]
    assert c.get_inference_statistics("simple", headers=ADMIN)["model_stats"]
    # What is not restricted stays open.
    assert c.is_server_live() and c.is_model_ready("simple")
    assert c.infer("simple", simple_inputs(httpclient, ONES, ONES)).as_numpy("OUTPUT0").tolist() == [[2] * 16]


def test_grpc_restricted_protocols_need_their_header(server):
    c = grpcclient.InferenceServerClient(server.grpc)
    text = refused(c.get_model_repository_index)
    assert "PERMISSION_DENIED" in text and "'triton-grpc-protocol-admin-key'" in text, text
    assert "PERMISSION_DENIED" in refused(lambda: c.get_inference_statistics("simple"))
    # The HTTP header name does not open the gRPC group.
    assert "PERMISSION_DENIED" in refused(
        lambda: c.get_model_repository_index(headers=ADMIN))
    assert c.get_model_repository_index(headers=GRPC_ADMIN).models[0].name == "simple"
    c.unload_model("simple", headers=GRPC_ADMIN)
    c.load_model("simple", headers=GRPC_ADMIN)
    assert c.get_model_config("simple").config.name == "simple"
    assert c.infer("simple", simple_inputs(grpcclient, ONES, ONES)).as_numpy("OUTPUT0").tolist() == [[2] * 16]


@pytest.mark.parametrize("flag, message", [
    ("bogus:k=v", "unknown API 'bogus'"),
    ("health", "must read <api>,<api>,...:<header>=<value>"),
])
def test_bad_restriction_flags_stop_the_server(tmp_path, flag, message):
    proc = subprocess.run([BINARY, "--model-repository", str(tmp_path), "--http-restricted-api",
                           flag, "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "--http-restricted-api" in proc.stderr and message in proc.stderr, proc.stderr
