"""A Python-backend model is untrusted code: its model.py may bypass triton_python_backend_utils
and send the host's door (`_host.call`) anything. Every malformed frame gets an answer (an
error, or nothing), the server serves on, and a model cannot shadow the server's own metrics or
grow them without bound."""
import os
import shutil

import numpy as np
import pytest
import tritonclient.http as httpclient

from attack import ROOT, Server

HERE = os.path.dirname(os.path.abspath(__file__))
ATTACKS = ["empty", "unknown_op", "short_header", "bad_json", "tensor_past_end", "bad_datatype",
           "huge_shape", "send_elsewhere", "wait_unknown", "cancelled_unknown",
           "stream_next_unknown", "stream_cancel_junk", "stream_flood", "metric_shadow",
           "metric_junk", "metric_buckets", "log_flood", "repository_junk", "repository_unknown",
           "repository_bad_version", "repository_traversal", "repository_bad_base64",
           "repository_self"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("door")
    shutil.copytree(os.path.join(HERE, "models", "door_abuse"), repo / "door_abuse")
    shutil.copytree(os.path.join(ROOT, "benches", "triton", "model_repository", "add_sub"),
                    repo / "add_sub")
    s = Server(str(repo))
    yield s
    s.stop()


def ask(server, how):
    t = httpclient.InferInput("HOW", [1], "BYTES")
    t.set_data_from_numpy(np.array([how.encode()], dtype=np.object_))
    c = httpclient.InferenceServerClient(server.http, network_timeout=120)
    return c.infer("door_abuse", [t]).as_numpy("ANSWER")[0].decode()


def add_sub_works(server):
    a = np.ones(4, np.float32)
    ins = []
    for name in ("INPUT0", "INPUT1"):
        t = httpclient.InferInput(name, [4], "FP32")
        t.set_data_from_numpy(a)
        ins.append(t)
    r = httpclient.InferenceServerClient(server.http).infer("add_sub", ins)
    assert r.as_numpy("OUTPUT0").tolist() == [2.0] * 4


@pytest.mark.parametrize("how", ATTACKS)
def test_a_malformed_frame_is_answered_and_the_server_serves_on(server, how):
    answer = ask(server, how)
    assert answer.startswith(("answered", "raised")), answer
    add_sub_works(server)
    assert server.proc.poll() is None


def test_decoupled_calls_a_model_opens_are_bounded(server):
    flood = ask(server, "stream_flood")
    assert "reads 64 decoupled calls already" in flood, flood


def test_a_model_cannot_shadow_or_flood_the_servers_metrics(server):
    shadow = ask(server, "metric_shadow")
    assert "INVALID_ARG" in shadow and "nv_inference_count" in shadow and "own" in shadow, shadow
    flood = ask(server, "metric_buckets")
    assert "INVALID_ARG" in flood and "1000 buckets" in flood, flood
    text = server.metrics_text()
    assert text.count("# TYPE nv_inference_count ") == 1
    assert "abuse_hist" not in text


def test_the_model_loading_api_stays_inside_the_repository(tmp_path):
    """In explicit mode a model may load models, but a file key that climbs out of the model's
    folder is refused naming it, nothing is written outside, and a model cannot unload itself."""
    shutil.copytree(os.path.join(HERE, "models", "door_abuse"), tmp_path / "door_abuse")
    shutil.copytree(os.path.join(ROOT, "benches", "triton", "model_repository", "add_sub"),
                    tmp_path / "add_sub")
    s = Server(str(tmp_path), "--model-control-mode=explicit", "--load-model=door_abuse",
               "--load-model=add_sub")
    try:
        traversal = ask(s, "repository_traversal")
        assert traversal.startswith("answered") and "../" in traversal, traversal
        assert not os.path.exists("/tmp/planted")
        assert "cannot unload itself" in ask(s, "repository_self")
        assert "base64" in ask(s, "repository_bad_base64")
        add_sub_works(s)
        assert s.proc.poll() is None
    finally:
        s.stop()
