"""Tenants (`--config wasmtron.toml`) with the stock tritonclient over HTTP and gRPC: API keys
in the Authorization header / metadata, and every route refusing what a tenant may not do
(infer, see, load, unload, admin APIs) with 401/403 and UNAUTHENTICATED/PERMISSION_DENIED,
while the health probes stay open."""
import json
import os
import shutil
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import BINARY, ROOT, Server, copy_models
from conftest import simple_inputs as conftest_simple_inputs

RANGE = np.arange(16, dtype=np.int32).reshape(1, 16)

KEYS = {"alpha": "alpha-key-1", "beta": "beta-key-1", "gamma": "gamma-key-1", "ops": "ops-key-1"}


def digest(key):
    out = subprocess.run([BINARY, "hash-key"], input=key, capture_output=True, text=True, check=True)
    return out.stdout.strip()


def config_text():
    return f"""
[[tenant]]
name = "alpha"
api_keys = [{digest(KEYS["alpha"])}]
infer = ["simple", "probe_bls"]
see = ["identity_fp32"]

[[tenant]]
name = "beta"
api_keys = [{digest(KEYS["beta"])}]
infer = ["identity_*"]
load = ["identity_*"]

[[tenant]]
name = "gamma"
api_keys = [{digest(KEYS["gamma"])}]
infer = ["probe_bls"]

[[tenant]]
name = "ops"
api_keys = [{digest(KEYS["ops"])}]
admin = true
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("tenancy")
    copy_models(str(repo), ["simple", "identity_fp32", "identity_bytes"])
    probe_copy(repo, "probe_bls", "bls")
    config = repo / "wasmtron.toml"
    config.write_text(config_text())
    s = Server(str(repo), "--config", str(config), "--model-control-mode", "explicit",
               "--load-model", "*", "--allow-client-shm=true")
    yield s
    s.stop()


def probe_copy(repo, name, mode, extra=""):
    """tests/models/probe as `name`, in `mode` (the bls mode calls `simple`)."""
    shutil.copytree(os.path.join(ROOT, "tests", "models", "probe"), repo / name)
    cfg = repo / name / "config.pbtxt"
    cfg.write_text(cfg.read_text().replace(
        'parameters [ { key: "mode", value: { string_value: "echo" } } ]',
        f'parameters [ {{ key: "mode", value: {{ string_value: "{mode}" }} }}{extra} ]'))


def bearer(tenant):
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


def http(server):
    return httpclient.InferenceServerClient(server.http, network_timeout=120)


def grpc(server):
    return grpcclient.InferenceServerClient(server.grpc)


def grpc_headers(tenant):
    return {"authorization": f"Bearer {KEYS[tenant]}"}


def simple_inputs(mod):
    return conftest_simple_inputs(mod, RANGE, RANGE)


def fp32_input(mod):
    t = mod.InferInput("INPUT0", [2, 2], "FP32")
    t.set_data_from_numpy(np.ones((2, 2), dtype=np.float32))
    return [t]


def raw(server, method, path, tenant=None, body=None):
    """(status, JSON body, headers) of a plain HTTP request."""
    req = urllib.request.Request(f"http://{server.http}{path}", method=method,
                                 data=None if body is None else json.dumps(body).encode())
    if tenant:
        req.add_header("Authorization", f"Bearer {KEYS[tenant]}")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            text = r.read().decode()
            return r.status, json.loads(text) if text else None, r.headers
    except urllib.error.HTTPError as e:
        text = e.read().decode()
        return e.code, json.loads(text) if text else None, e.headers


def refused(call, code):
    with pytest.raises(InferenceServerException) as e:
        call()
    text = str(e.value)
    assert code in text, text
    return text


def test_health_probes_need_no_key(server):
    assert raw(server, "GET", "/v2/health/live")[0] == 200
    assert raw(server, "GET", "/v2/health/ready")[0] == 200
    assert grpc(server).is_server_live() and grpc(server).is_server_ready()


@pytest.mark.parametrize("path", ["/v2", "/v2/models/simple", "/v2/models/simple/config",
                                  "/v2/models/stats", "/v2/models/no_such_model"])
def test_http_without_a_key_is_401(server, path):
    status, body, headers = raw(server, "GET", path)
    assert status == 401 and "Authorization: Bearer" in body["error"], body
    assert headers["WWW-Authenticate"] == "Bearer"


def test_wrong_and_missing_keys_are_refused_everywhere(server):
    wrong_http = {"Authorization": "Bearer not-a-key"}
    text = refused(lambda: http(server).infer("simple", simple_inputs(httpclient), headers=wrong_http), "401")
    assert "not valid" in text
    refused(lambda: http(server).get_model_repository_index(), "401")
    refused(lambda: grpc(server).infer("simple", simple_inputs(grpcclient)), "UNAUTHENTICATED")
    refused(lambda: grpc(server).get_server_metadata(headers={"authorization": "Bearer nope"}),
            "UNAUTHENTICATED")
    refused(lambda: grpc(server).get_model_repository_index(headers={"authorization": "nope"}),
            "UNAUTHENTICATED")


def test_a_tenant_infers_with_its_models_only(server):
    r = http(server).infer("simple", simple_inputs(httpclient), headers=bearer("alpha"))
    assert r.as_numpy("OUTPUT0").tolist() == [list(range(0, 32, 2))]
    r = grpc(server).infer("simple", simple_inputs(grpcclient), headers=grpc_headers("alpha"))
    assert r.as_numpy("OUTPUT1").tolist() == [[0] * 16]
    text = refused(lambda: http(server).infer("identity_fp32", fp32_input(httpclient), headers=bearer("alpha")), "403")
    assert "tenant 'alpha' may not infer with model 'identity_fp32'" in text
    refused(lambda: grpc(server).infer("identity_fp32", fp32_input(grpcclient), headers=grpc_headers("alpha")),
            "PERMISSION_DENIED")
    # The same answer whether or not the model exists: nothing leaks about other tenants.
    text = refused(lambda: http(server).infer("beta_secret", fp32_input(httpclient), headers=bearer("alpha")), "403")
    assert "model 'beta_secret'" in text
    # beta's patterns: identity_* only.
    r = grpc(server).infer("identity_fp32", fp32_input(grpcclient), headers=grpc_headers("beta"))
    assert r.as_numpy("OUTPUT0").tolist() == [[1.0, 1.0], [1.0, 1.0]]
    refused(lambda: grpc(server).infer("simple", simple_inputs(grpcclient), headers=grpc_headers("beta")),
            "PERMISSION_DENIED")


def test_a_stage_calls_other_models_only_within_its_callers_permissions(server):
    def probe(tenant):
        t = httpclient.InferInput("INPUT0", [1, 16], "FP32")
        t.set_data_from_numpy(np.arange(16, dtype=np.float32).reshape(1, 16))
        return http(server).infer("probe_bls", [t], headers=bearer(tenant))

    # alpha may infer with probe_bls and with the model it calls (simple).
    assert probe("alpha").as_numpy("OUTPUT0").tolist() == [list(map(float, range(0, 32, 2)))]
    # gamma may run the stage, but not reach simple through it: the refusal is the answer
    # (403), whatever the stage makes of the failed call.
    text = refused(lambda: probe("gamma"), "403")
    assert "tenant 'gamma' may not infer with model 'simple'" in text


def test_a_stream_refuses_other_tenants_models_in_band(server):
    c = grpc(server)
    results = []
    c.start_stream(callback=lambda result, error: results.append((result, error)),
                   headers=grpc_headers("alpha"))
    c.async_stream_infer("simple", simple_inputs(grpcclient), request_id="mine")
    c.async_stream_infer("identity_fp32", fp32_input(grpcclient), request_id="theirs")
    c.stop_stream()
    assert len(results) == 2
    # Requests on one stream run at once: the refusal may come first.
    (ok, none), = [(r, e) for r, e in results if e is None]
    (nothing, error), = [(r, e) for r, e in results if e is not None]
    assert ok.get_response().id == "mine"
    assert nothing is None and "tenant 'alpha' may not infer with model 'identity_fp32'" in str(error)


def test_a_tenant_sees_only_what_it_may(server):
    h = http(server)
    assert h.get_model_metadata("identity_fp32", headers=bearer("alpha"))["name"] == "identity_fp32"
    assert h.get_model_config("simple", headers=bearer("alpha"))["name"] == "simple"
    assert h.is_model_ready("simple", headers=bearer("alpha"))
    for call in (lambda: h.get_model_metadata("identity_bytes", headers=bearer("alpha")),
                 lambda: h.get_model_config("identity_bytes", headers=bearer("alpha")),
                 lambda: h.get_inference_statistics("identity_bytes", headers=bearer("alpha"))):
        refused(call, "403")
    status, body, _ = raw(server, "GET", "/v2/models/identity_bytes/ready", "alpha")
    assert status == 403, body
    names = sorted(m["name"] for m in h.get_model_repository_index(headers=bearer("alpha")))
    assert names == ["identity_fp32", "probe_bls", "simple"]
    stats = h.get_inference_statistics(headers=bearer("alpha"))["model_stats"]
    assert sorted(s["name"] for s in stats) == ["identity_fp32", "probe_bls", "simple"]
    g = grpc(server)
    index = g.get_model_repository_index(headers=grpc_headers("beta"), as_json=True)["models"]
    assert sorted(m["name"] for m in index) == ["identity_bytes", "identity_fp32"]
    stats = g.get_inference_statistics(headers=grpc_headers("beta"), as_json=True)["model_stats"]
    assert sorted(s["name"] for s in stats) == ["identity_bytes", "identity_fp32"]
    for call in (lambda: g.get_model_metadata("simple", headers=grpc_headers("beta")),
                 lambda: g.get_model_config("simple", headers=grpc_headers("beta")),
                 lambda: g.get_inference_statistics("simple", headers=grpc_headers("beta")),
                 lambda: g.is_model_ready("simple", headers=grpc_headers("beta"))):
        refused(call, "PERMISSION_DENIED")
    everything = sorted(m["name"] for m in h.get_model_repository_index(headers=bearer("ops")))
    assert everything == ["identity_bytes", "identity_fp32", "probe_bls", "simple"]


def test_load_and_unload_follow_the_load_patterns(server):
    h, g = http(server), grpc(server)
    refused(lambda: h.unload_model("simple", headers=bearer("alpha")), "403")
    refused(lambda: g.unload_model("simple", headers=grpc_headers("beta")), "PERMISSION_DENIED")
    refused(lambda: h.load_model("simple", headers=bearer("beta")), "403")
    h.unload_model("identity_bytes", headers=bearer("beta"))
    assert not h.is_model_ready("identity_bytes", headers=bearer("beta"))
    g.load_model("identity_bytes", headers=grpc_headers("beta"))
    assert g.is_model_ready("identity_bytes", headers=grpc_headers("beta"))
    # A configuration (or files) in the load request, and unload_dependents: administrators'.
    config = json.dumps({"backend": "onnxruntime", "max_batch_size": 0})
    text = refused(lambda: h.load_model("identity_bytes", config=config, headers=bearer("beta")), "403")
    assert "load with a configuration or files" in text
    refused(lambda: h.unload_model("identity_bytes", unload_dependents=True, headers=bearer("beta")), "403")
    h.unload_model("simple", headers=bearer("ops"))
    h.load_model("simple", headers=bearer("ops"))
    assert h.is_model_ready("simple", headers=bearer("alpha"))


def test_log_and_trace_settings_are_for_administrators(server):
    status, body, _ = raw(server, "GET", "/v2/logging", "alpha")
    assert status == 403 and "for administrators" in body["error"], body
    status, body, _ = raw(server, "GET", "/v2/trace/setting", "beta")
    assert status == 403, body
    status, body, _ = raw(server, "GET", "/v2/logging", "ops")
    assert status == 200 and "log_verbose_level" in body, body
    # A tenant may not turn the log off either.
    status, body, _ = raw(server, "POST", "/v2/logging", "alpha", {"log_error": False})
    assert status == 403 and "for administrators" in body["error"], body
    assert raw(server, "GET", "/v2/logging", "ops")[1]["log_error"] is True
    refused(lambda: grpc(server).get_log_settings(headers=grpc_headers("alpha")), "PERMISSION_DENIED")
    settings = grpc(server).get_log_settings(headers=grpc_headers("ops"), as_json=True)
    assert "log_info" in settings["settings"], settings


def test_system_shared_memory_is_for_administrators(server):
    # Registering makes the server open a /dev/shm object by name: a tenant could otherwise
    # read shared memory that another tenant's client created.
    body = {"key": "/anything", "byte_size": 8}
    status, reply, _ = raw(server, "POST", "/v2/systemsharedmemory/region/r/register", "alpha",
                           body)
    assert status == 403 and "system shared memory" in reply["error"], reply
    refused(lambda: grpc(server).register_system_shared_memory(
        "r", "/anything", 8, headers=grpc_headers("beta")), "PERMISSION_DENIED")
    # An administrator may (and sees only its own regions).
    assert raw(server, "GET", "/v2/systemsharedmemory/status", "ops")[:2] == (200, [])
    status, reply, _ = raw(server, "POST", "/v2/systemsharedmemory/region/r/register", "ops",
                           body)
    assert status == 400 and "'/anything'" in reply["error"], reply


def test_a_bad_config_file_stops_the_server_with_a_clear_message(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[[tenant]]\nname = "alpha"\napi_keys = ["plain-text-key"]\n')
    proc = subprocess.run([BINARY, "--model-repository", str(tmp_path), "--config", str(bad),
                           "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "tenant[0] ('alpha').api_keys" in proc.stderr and "hash-key" in proc.stderr, proc.stderr


def test_sighup_reloads_keys_revoking_removed_ones(tmp_path):
    """Key rotation without a restart: after SIGHUP the removed key is refused (401, "revoked")
    over HTTP and gRPC, the new one works, and a broken file keeps the tenants as they were."""
    copy_models(str(tmp_path), ["simple"])
    config = tmp_path / "wasmtron.toml"
    tenant = '[[tenant]]\nname = "alpha"\napi_keys = [{}]\ninfer = ["simple"]\n'
    config.write_text(tenant.format(digest("old-key")))
    s = Server(str(tmp_path), "--config", str(config))
    try:
        def infer_http(key):
            return http(s).infer("simple", simple_inputs(httpclient),
                                 headers={"Authorization": f"Bearer {key}"})

        def infer_grpc(key):
            return grpc(s).infer("simple", simple_inputs(grpcclient),
                                 headers={"authorization": f"Bearer {key}"})

        def reloads():
            return sum("reloaded the server config file" in line for line in s.log)

        infer_http("old-key")
        infer_grpc("old-key")
        refused(lambda: infer_http("new-key"), "401")

        config.write_text(tenant.format(digest("new-key")))
        s.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 60
        while reloads() < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert reloads() == 1, "".join(s.log)
        assert "revoked_keys=1" in "".join(s.log)
        assert "revoked" in refused(lambda: infer_http("old-key"), "401")
        refused(lambda: infer_grpc("old-key"), "UNAUTHENTICATED")
        infer_http("new-key")
        infer_grpc("new-key")

        # A mistake in the file is reported and changes nothing.
        config.write_text('[[tenant]]\nname = "alpha"\napi_keys = ["plain-text-key"]\n')
        s.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 60
        while not any("stay as they were" in line for line in s.log) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert any("stay as they were" in line and "api_keys" in line for line in s.log), "".join(s.log)
        infer_http("new-key")
        assert s.proc.poll() is None
    finally:
        s.stop()


def test_tenant_wasm_limits_bound_the_stages_it_may_load(tmp_path):
    """`[tenant.wasm]`: the default deadline and memory of the stages a tenant may load; a
    stage's config may lower them but a higher value fails the load, naming the tenant."""
    probe_copy(tmp_path, "alpha_loop", "loop")
    probe_copy(tmp_path, "alpha_greedy", "echo",
               ', { key: "memory_limit_mb", value: { string_value: "1024" } }')
    probe_copy(tmp_path, "other_loop", "loop",
               ', { key: "execution_timeout_ms", value: { string_value: "1500" } }')
    config = tmp_path / "wasmtron.toml"
    config.write_text(f"""
[[tenant]]
name = "alpha"
api_keys = [{digest("alpha-wasm-key")}]
infer = ["alpha_*", "other_loop"]
load = ["alpha_*"]
[tenant.wasm]
execution_timeout_ms = 300
memory_limit_mb = 64
""")
    s = Server(str(tmp_path), "--config", str(config))
    try:
        headers = {"Authorization": "Bearer alpha-wasm-key"}
        index = {m["name"]: m for m in http(s).get_model_repository_index(headers=headers)}
        assert index["alpha_loop"]["state"] == "READY"
        assert index["alpha_greedy"]["state"] == "UNAVAILABLE"
        reason = index["alpha_greedy"]["reason"]
        assert "'memory_limit_mb' is 1024 but tenant 'alpha'" in reason, reason
        assert "at most 64" in reason, reason

        t = httpclient.InferInput("INPUT0", [1, 1], "FP32")
        t.set_data_from_numpy(np.ones((1, 1), dtype=np.float32))
        text = refused(lambda: http(s).infer("alpha_loop", [t], headers=headers), "")
        assert "deadline of 300 ms" in text, text
        # A stage alpha may only use, not load, keeps its own limits.
        text = refused(lambda: http(s).infer("other_loop", [t], headers=headers), "")
        assert "deadline of 1500 ms" in text, text
    finally:
        s.stop()


def test_a_tenant_whose_requests_crash_a_stage_is_held_back_alone(tmp_path):
    """Five requests in a row that crash a stage hold that tenant's requests to it back (503 /
    UNAVAILABLE, saying why) instead of running them; another tenant's requests to the very
    same model keep being served."""
    probe_copy(tmp_path, "probe_trap", "trap_on_negative")
    config = tmp_path / "wasmtron.toml"
    config.write_text("".join(
        f'[[tenant]]\nname = "{name}"\napi_keys = [{digest(name + "-key")}]\ninfer = ["probe_trap"]\n'
        # A long first hold-back, so that the checks below fall inside it on a slow machine.
        '[tenant.quotas]\nbackoff_after_failures = 5\nbackoff_ms = 120000\n'
        for name in ("alpha", "beta")))
    s = Server(str(tmp_path), "--config", str(config))
    try:
        def infer(tenant, value, mod=httpclient, client=None):
            t = mod.InferInput("INPUT0", [1, 1], "FP32")
            t.set_data_from_numpy(np.full((1, 1), value, dtype=np.float32))
            header = "Authorization" if mod is httpclient else "authorization"
            c = client or (http(s) if mod is httpclient else grpc(s))
            return c.infer("probe_trap", [t], headers={header: f"Bearer {tenant}-key"})

        for _ in range(5):
            assert "trapped" in refused(lambda: infer("alpha", -1.0), "500")
        text = refused(lambda: infer("alpha", -1.0), "503")
        assert "last 5 requests to model 'probe_trap' failed" in text and "held back" in text, text
        # Even a request that would succeed waits out the hold-back...
        refused(lambda: infer("alpha", 1.0, grpcclient), "UNAVAILABLE")
        # ...also on a stream, where the refusal comes in band.
        c, results = grpc(s), []
        c.start_stream(callback=lambda result, error: results.append((result, error)),
                       headers={"authorization": "Bearer alpha-key"})
        t = grpcclient.InferInput("INPUT0", [1, 1], "FP32")
        t.set_data_from_numpy(np.ones((1, 1), dtype=np.float32))
        c.async_stream_infer("probe_trap", [t])
        c.stop_stream()
        assert len(results) == 1 and results[0][0] is None, results
        assert "held back" in str(results[0][1]), results
        # ...while the other tenant uses the same model as before.
        for mod in (httpclient, grpcclient):
            assert infer("beta", 2.0, mod).as_numpy("OUTPUT0").tolist() == [[2.0]]
        assert s.proc.poll() is None
    finally:
        s.stop()


# Quotas: a second server whose tenants each have one limit.
QUOTA_KEYS = {"small": "small-key", "bursty": "bursty-key", "single": "single-key"}


@pytest.fixture(scope="module")
def quota_server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("quotas")
    copy_models(str(repo), ["simple", "identity_fp32"])
    # A stage that spins until its 8 s deadline: one request held in flight.
    probe_copy(repo, "probe_loop", "loop",
               ', { key: "execution_timeout_ms", value: { string_value: "8000" } }')
    config = repo / "wasmtron.toml"
    config.write_text(f"""
[[tenant]]
name = "small"
api_keys = [{digest(QUOTA_KEYS["small"])}]
infer = ["*"]
[tenant.quotas]
max_request_bytes = 2000

[[tenant]]
name = "bursty"
api_keys = [{digest(QUOTA_KEYS["bursty"])}]
infer = ["*"]
[tenant.quotas]
requests_per_second = 0.001
burst = 3

[[tenant]]
name = "single"
api_keys = [{digest(QUOTA_KEYS["single"])}]
infer = ["*"]
[tenant.quotas]
max_concurrent_requests = 1
""")
    s = Server(str(repo), "--config", str(config))
    yield s
    s.stop()


def quota_headers(tenant):
    return {"Authorization": f"Bearer {QUOTA_KEYS[tenant]}"}


def test_request_size_quota(quota_server):
    h = http(quota_server)
    h.infer("simple", simple_inputs(httpclient), headers=quota_headers("small"))
    big = httpclient.InferInput("INPUT0", [1, 1000], "FP32")
    big.set_data_from_numpy(np.ones((1, 1000), dtype=np.float32))
    text = refused(lambda: h.infer("identity_fp32", [big], headers=quota_headers("small")), "429")
    assert "tenant 'small'" in text and "quotas.max_request_bytes = 2000" in text
    g = grpc(quota_server)
    big = grpcclient.InferInput("INPUT0", [1, 1000], "FP32")
    big.set_data_from_numpy(np.ones((1, 1000), dtype=np.float32))
    refused(lambda: g.infer("identity_fp32", [big], headers={"authorization": f"Bearer {QUOTA_KEYS['small']}"}),
            "RESOURCE_EXHAUSTED")


def test_rate_quota_allows_its_burst_then_refuses(quota_server):
    h, g = http(quota_server), grpc(quota_server)
    grpc_auth = {"authorization": f"Bearer {QUOTA_KEYS['bursty']}"}
    h.infer("simple", simple_inputs(httpclient), headers=quota_headers("bursty"))
    g.infer("simple", simple_inputs(grpcclient), headers=grpc_auth)
    h.infer("simple", simple_inputs(httpclient), headers=quota_headers("bursty"))
    text = refused(lambda: h.infer("simple", simple_inputs(httpclient), headers=quota_headers("bursty")), "429")
    assert "tenant 'bursty' is over its quota" in text and "requests per second" in text
    refused(lambda: g.infer("simple", simple_inputs(grpcclient), headers=grpc_auth), "RESOURCE_EXHAUSTED")
    # Other tenants are not affected.
    h.infer("simple", simple_inputs(httpclient), headers=quota_headers("small"))


def test_concurrency_quota(quota_server):
    h = http(quota_server)
    ended = []

    def hold():
        try:
            http(quota_server).infer("probe_loop", [probe_input()], headers=quota_headers("single"))
        except InferenceServerException as e:
            ended.append(str(e))

    held = threading.Thread(target=hold)
    held.start()
    # Wait (the metrics need no key) until the held request is in the server; it stays 8 s.
    gauge = 'wasmtron_tenant_requests_in_flight{tenant="single"} 1'
    while held.is_alive() and gauge not in quota_server.metrics_text():
        time.sleep(0.02)
    assert held.is_alive(), ended
    text = refused(lambda: h.infer("simple", simple_inputs(httpclient), headers=quota_headers("single")), "429")
    assert "tenant 'single' is over its quota: 1 concurrent requests" in text
    held.join(120)
    assert ended and "execution deadline" in ended[0], ended
    # The slot came back when the held request ended.
    h.infer("simple", simple_inputs(httpclient), headers=quota_headers("single"))


def probe_input():
    t = httpclient.InferInput("INPUT0", [1, 2], "FP32")
    t.set_data_from_numpy(np.ones((1, 2), dtype=np.float32))
    return t


def metric(text, name, **want):
    """The value of the sample `name{want}` in a Prometheus text page (0 when absent)."""
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        body, value = line.rsplit(" ", 1)
        found = dict(part.split("=", 1) for part in body[len(name) + 1:-1].split(","))
        if {k: v.strip('"') for k, v in found.items()} == want:
            return float(value)
    return 0.0


def test_metrics_count_each_tenants_requests(server):
    before = server.metrics_text()
    grpc(server).infer("identity_fp32", fp32_input(grpcclient), headers=grpc_headers("beta"))
    refused(lambda: http(server).infer("simple", simple_inputs(httpclient), headers=bearer("beta")), "403")
    after = server.metrics_text()
    ok = dict(name="wasmtron_tenant_request_success", tenant="beta", model="identity_fp32")
    assert metric(after, **ok) == metric(before, **ok) + 1
    denied = dict(name="wasmtron_tenant_request_failure", tenant="beta", model="", reason="PERMISSION_DENIED")
    assert metric(after, **denied) == metric(before, **denied) + 1
    assert metric(after, "wasmtron_tenant_request_duration_us", tenant="beta", model="identity_fp32") > 0
    # Nothing in flight once answered; the model's own metrics are still there.
    assert 'wasmtron_tenant_requests_in_flight{tenant="beta"} 0' in after
    assert 'nv_inference_request_success{model="identity_fp32",version="1"}' in after


# Fair queueing: one slow model (one instance, one request at a time) shared by tenants.
FAIR_KEYS = {"flood": "flood-key", "light": "light-key", "capped": "capped-key"}


@pytest.fixture(scope="module")
def fair_server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("fair")
    shutil.copytree(os.path.join(ROOT, "tests", "models", "slow"), repo / "slow")
    config = repo / "wasmtron.toml"
    config.write_text(f"""
[[tenant]]
name = "flood"
api_keys = [{digest(FAIR_KEYS["flood"])}]
infer = ["slow"]

[[tenant]]
name = "light"
api_keys = [{digest(FAIR_KEYS["light"])}]
infer = ["slow"]

[[tenant]]
name = "capped"
api_keys = [{digest(FAIR_KEYS["capped"])}]
infer = ["slow"]
[tenant.quotas]
max_queued_requests = 2
""")
    # One request per execution: the queue's fairness is what these tests watch. Auto-complete
    # would give the model Triton's dynamic batcher (max_batch_size > 1, no scheduler named),
    # and a batch's requests all finish together.
    s = Server(str(repo), "--config", str(config), "--disable-auto-complete-config")
    yield s
    s.stop()


def slow_request(server, tenant, rows=64):
    x = grpcclient.InferInput("INPUT0", [rows, 512], "FP32")
    x.set_data_from_numpy(np.ones((rows, 512), dtype=np.float32))
    grpc(server).infer("slow", [x], headers={"authorization": f"Bearer {FAIR_KEYS[tenant]}"},
                       client_timeout=300)


def pending(server):
    return metric(server.metrics_text(), "nv_inference_pending_request_count", model="slow", version="1")


def flood(server, tenant, count, done, errors):
    def one(i):
        try:
            slow_request(server, tenant)
            done.append((tenant, i))
        except InferenceServerException as e:
            errors.append(str(e))
    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    return threads


def test_a_flooding_tenant_does_not_make_another_wait_behind_it(fair_server):
    done, errors = [], []
    threads = flood(fair_server, "flood", 24, done, errors)
    # Until most of the flood waits in the model's queue (one request runs at a time).
    while pending(fair_server) < 16 and any(t.is_alive() for t in threads):
        time.sleep(0.02)
    assert pending(fair_server) >= 16, \
        f"the flood was answered before it queued up: {len(done)} done, errors {errors[:3]}"
    slow_request(fair_server, "light", rows=4)
    flood_done_before_light = len(done)
    for t in threads:
        t.join(300)
    assert not errors, errors
    # Fair queueing put the light tenant's request next to the front, not behind 16 others.
    assert flood_done_before_light <= 4, flood_done_before_light
    assert len(done) == 24


def test_a_tenant_over_its_queue_quota_is_refused(fair_server):
    done, errors = [], []
    threads = flood(fair_server, "capped", 10, done, errors)
    for t in threads:
        t.join(300)
    # One request runs and two wait; with ten at once some find the queue quota full.
    assert errors and all("quotas.max_queued_requests" in e and "tenant 'capped'" in e for e in errors), errors
    assert len(done) + len(errors) == 10 and len(done) >= 3


def test_a_flooding_tenant_runs_only_its_part_of_the_executions(tmp_path):
    """Two tenants active on --execution-slots 2: each may run one execution at a time, so the
    busy tenant's second request waits although its model has a free instance."""
    probe_copy(tmp_path, "spin", "loop",
               ', { key: "execution_timeout_ms", value: { string_value: "8000" } }')
    with open(tmp_path / "spin" / "config.pbtxt", "a") as f:
        f.write("instance_group [ { count: 2 } ]\n")
    probe_copy(tmp_path, "echo", "echo")
    keys = {"busy": "busy-key", "light": "light-key"}
    (tmp_path / "wasmtron.toml").write_text(f"""
[[tenant]]
name = "busy"
api_keys = [{digest(keys["busy"])}]
infer = ["spin"]

[[tenant]]
name = "light"
api_keys = [{digest(keys["light"])}]
infer = ["echo"]
""")
    s = Server(str(tmp_path), "--config", str(tmp_path / "wasmtron.toml"), "--execution-slots", "2")
    try:
        stop, light_answers, busy_errors = threading.Event(), [], []

        def light():  # active: a request every 100 ms
            while not stop.is_set():
                light_answers.append(http(s).infer("echo", [probe_input()], headers={
                    "Authorization": f"Bearer {keys['light']}"}))
                time.sleep(0.1)

        def busy():  # spins until its 8 s deadline, then fails
            try:
                http(s).infer("spin", [probe_input()], headers={"Authorization": f"Bearer {keys['busy']}"})
            except InferenceServerException as e:
                busy_errors.append(str(e))

        pinger = threading.Thread(target=light)
        pinger.start()
        while not light_answers and pinger.is_alive():
            time.sleep(0.02)
        spinners = [threading.Thread(target=busy) for _ in range(2)]
        for t in spinners:
            t.start()
        time.sleep(2)
        queued = metric(s.metrics_text(), "nv_inference_pending_request_count", model="spin", version="1")
        stop.set()
        pinger.join(120)
        for t in spinners:
            t.join(120)
        # One spins, the other waits for busy's part; without the share both would spin.
        assert queued == 1, queued
        assert len(busy_errors) == 2 and all("deadline" in e or "time" in e for e in busy_errors), busy_errors
    finally:
        s.stop()
