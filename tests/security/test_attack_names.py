"""Names from requests never walk the filesystem: model names, LoRA adapters' names and `file:`
keys of the load API (HTTP and gRPC), versions and requested outputs are parsed strictly, and a
failed load leaves nothing behind. Each attack gets a 4xx naming the field, the planted victims stay as they were,
and the server still answers real requests."""
import base64
import json
import os
import shutil
import sys

import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from attack import (ROOT, RANGE, Server, copy_models, error_text, index_names, plant_victim, raw,
                    simple_inputs, still_serves)

CONFIG = json.dumps({"backend": "onnxruntime"})
MODEL = open(os.path.join(ROOT, "model_repository", "simple", "1", "model.onnx"), "rb").read()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("names")
    copy_models(str(repo), ["simple", "identity_fp32"])
    s = Server(str(repo), "--model-control-mode", "explicit", "--load-model", "simple")
    s.repo = repo
    yield s
    s.stop()


def quoted(name):
    """A model name as a path segment: '/' and everything unusual percent-encoded."""
    return "".join(c if c.isalnum() or c in "-_." else "".join(f"%{b:02X}" for b in c.encode())
                   for c in name)


def load_body(files):
    params = {"config": CONFIG}
    params.update({f"file:{k}": base64.b64encode(v).decode() for k, v in files.items()})
    return {"parameters": params}


def hostile_names(server, victim):
    return [
        # Climbs from the staging folder to the victim; loading used to delete it.
        "x/../../../../../../.." + str(victim),
        "x/../" + str(victim),
        "/etc",
        f"../{os.path.basename(server.repo)}/simple",
        "simple/../simple",
        "..",
        ".",
        "a\\..\\b",
        "a\x00b",
        "a\nb",
        "",
        "m" * 300,
    ]


def test_model_names_that_climb_out_are_refused_over_http(server, tmp_path):
    victim, untouched = plant_victim(tmp_path)
    before = index_names(server)
    for name in hostile_names(server, victim):
        path = f"/v2/repository/models/{quoted(name)}/load"
        status, body = raw(server.http, "POST", path, load_body({"1/model.onnx": MODEL}))
        if name == "":
            assert status in (400, 404, 405), (name, status, body)  # no such route
            continue
        assert status == 400, (name, status, body)
        assert "invalid model name" in error_text(body), (name, body)
        status, body = raw(server.http, "POST", f"/v2/repository/models/{quoted(name)}/unload", {})
        assert status == 400, (name, status, body)
    untouched()
    assert index_names(server) == before
    still_serves(server)


def test_model_names_that_climb_out_are_refused_over_grpc(server, tmp_path):
    victim, untouched = plant_victim(tmp_path)
    client = grpcclient.InferenceServerClient(server.grpc)
    before = index_names(server)
    for name in hostile_names(server, victim):
        if "\x00" in name:
            continue  # gRPC metadata-free string field: tested over HTTP
        with pytest.raises(InferenceServerException) as e:
            client.load_model(name, config=CONFIG, files={"file:1/model.onnx": MODEL})
        assert e.value.status() == "StatusCode.INVALID_ARGUMENT", (name, e.value)
        assert "invalid model name" in e.value.message(), (name, e.value)
    client.close()
    untouched()
    assert index_names(server) == before
    still_serves(server)


@pytest.mark.parametrize("key", [
    # A leading '/' names a file in the model folder, as on Triton: what follows it is checked.
    "1/./model.onnx", "1//model.onnx", "", "/../escape/model.onnx", "//1/../../escape", "1/",
    "../escape/model.onnx",
    "1/../../escape", "1/model\x00.onnx", "1\\..\\..\\escape", "a/b/c/d/e/f/g/h/i/model.onnx",
])
def test_file_keys_that_are_not_plain_relative_paths_are_refused(server, key):
    status, body = raw(server.http, "POST", "/v2/repository/models/uploaded/load",
                       load_body({key: MODEL}))
    assert status == 400, (key, status, body)
    assert "load parameter 'file:" in error_text(body), (key, body)
    client = grpcclient.InferenceServerClient(server.grpc)
    with pytest.raises(InferenceServerException) as e:
        client.load_model("uploaded", config=CONFIG, files={f"file:{key}": MODEL})
    assert "load parameter 'file:" in e.value.message(), (key, e.value)
    client.close()
    assert "uploaded" not in index_names(server)


def test_colliding_file_keys_are_the_requests_fault(server):
    status, body = raw(server.http, "POST", "/v2/repository/models/uploaded/load",
                       load_body({"1": b"x", "1/model.onnx": MODEL}))
    assert status == 400, (status, body)
    assert "file:1/model.onnx" in error_text(body), body


def test_a_loaded_upload_serves_from_a_private_folder_it_keeps(server):
    status, body = raw(server.http, "POST", "/v2/repository/models/uploaded/load",
                       load_body({"1/model.onnx": MODEL}))
    assert status == 200, body
    # The staging folder is not at a name another user could predict and plant.
    tmp = os.environ.get("TMPDIR", "/tmp")
    assert not [n for n in os.listdir(tmp) if n.startswith("wasmtron-load-") and "uploaded" in n]
    still_serves(server, "uploaded")
    assert raw(server.http, "POST", "/v2/repository/models/uploaded/unload", {})[0] == 200


def test_failed_loads_of_unknown_names_leave_no_trace_in_the_index(server):
    before = index_names(server)
    for i in range(300):
        status, body = raw(server.http, "POST", f"/v2/repository/models/ghost{i}/load", {})
        assert status in (400, 404), (status, body)
        assert f"ghost{i}" in error_text(body), body
    client = grpcclient.InferenceServerClient(server.grpc)
    for i in range(20):
        with pytest.raises(InferenceServerException):
            client.load_model(f"grpc_ghost{i}")
    client.close()
    assert index_names(server) == before
    # A model of the repository that fails keeps its entry with the reason.
    still_serves(server)


@pytest.mark.parametrize("version", ["+1", "01", "-1", "1.0", "%201", "1%20", "0x1", "1e0",
                                     "99999999999999999999"])
def test_versions_are_decimal_digits_only(server, version):
    for suffix, method in (("infer", "POST"), ("ready", "GET"), ("config", "GET"), ("stats", "GET"),
                           ("", "GET")):
        path = f"/v2/models/simple/versions/{version}" + (f"/{suffix}" if suffix else "")
        body = {"inputs": []} if method == "POST" else None
        status, answer = raw(server.http, method, path, body)
        assert status == 400, (path, status, answer)
        assert "invalid version" in error_text(answer), (path, answer)
    client = grpcclient.InferenceServerClient(server.grpc)
    plain = version.replace("%20", " ")
    with pytest.raises(InferenceServerException) as e:
        client.infer("simple", simple_inputs(grpcclient, RANGE, RANGE), model_version=plain)
    assert "invalid version" in e.value.message(), e.value
    with pytest.raises(InferenceServerException) as e:
        client.get_model_metadata("simple", model_version=plain)
    assert "invalid version" in e.value.message(), e.value
    client.close()


def test_version_one_still_works(server):
    client = httpclient.InferenceServerClient(server.http)
    r = client.infer("simple", simple_inputs(httpclient, RANGE, RANGE), model_version="1")
    assert (r.as_numpy("OUTPUT0") == RANGE + RANGE).all()


def test_an_output_requested_twice_is_named(server):
    body = {
        "inputs": [{"name": n, "shape": [1, 16], "datatype": "INT32", "data": list(range(16))}
                   for n in ("INPUT0", "INPUT1")],
        "outputs": [{"name": "OUTPUT0"}, {"name": "OUTPUT0"}],
    }
    status, answer = raw(server.http, "POST", "/v2/models/simple/infer", body)
    assert status == 400, (status, answer)
    assert "requested output 'OUTPUT0' appears more than once" in error_text(answer), answer
    client = grpcclient.InferenceServerClient(server.grpc)
    outputs = [grpcclient.InferRequestedOutput("OUTPUT1"), grpcclient.InferRequestedOutput("OUTPUT1")]
    with pytest.raises(InferenceServerException) as e:
        client.infer("simple", simple_inputs(grpcclient, RANGE, RANGE), outputs=outputs)
    assert "requested output 'OUTPUT1' appears more than once" in e.value.message(), e.value
    client.close()
    still_serves(server)


def test_models_a_stage_says_it_calls_go_through_the_name_check(server, tmp_path):
    """`composing_models` (the models a stage loads with it) comes from a configuration a load
    request may send: each name is checked as a load request's name is, the victim stays, and
    nothing of the attack is loaded."""
    victim, untouched = plant_victim(tmp_path)
    for hostile in [f"x/../../../../../../..{victim}", "..", "/etc", "a\nb"]:
        config = json.dumps({"backend": "onnxruntime", "parameters": {
            "composing_models": {"string_value": f"identity_fp32, {hostile}"}}})
        params = {"config": config, "file:1/model.onnx": base64.b64encode(MODEL).decode()}
        status, body = raw(server.http, "POST", "/v2/repository/models/caller/load",
                           {"parameters": params})
        assert status == 400, (hostile, status, body)
        assert "invalid model name" in error_text(body), (hostile, body)
        assert raw(server.http, "GET", "/v2/models/caller/ready")[0] != 200
    untouched()
    still_serves(server)


@pytest.fixture(scope="module")
def adapter_server(tmp_path_factory):
    """A generation model that takes LoRA adapters (`model:adapter` names, adapters/ folder)."""
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import llm_export
    import onnx

    repo = tmp_path_factory.mktemp("adapters")
    copy_models(str(repo), ["simple"])
    model = repo / "tiny_lora"
    (model / "1").mkdir(parents=True)
    onnx.save(llm_export.tiny(shared_cache=True, lora=("q_proj", "v_proj"))[0], str(model / "1" / "model.onnx"))
    (model / "1" / "generation_config.json").write_text('{"eos_token_id": 3, "pad_token_id": 0}')
    (model / "config.pbtxt").write_text(
        'backend: "generation"\nmax_batch_size: 2\n'
        'parameters { key: "max_sequence_length" value { string_value: "64" } }\n')
    s = Server(str(repo), "--model-control-mode", "explicit", "--load-model", "tiny_lora",
               "--load-model", "simple")
    yield s
    s.stop()


def test_adapter_names_never_name_a_folder_outside(adapter_server, tmp_path):
    """`model:adapter` loads read `<model>/adapters/<adapter>/`: an adapter's name is a plain
    folder name (or the whole name is refused as a model name), `file:` keys are checked as for
    models, and the `lora` request parameter is only ever looked up, never opened."""
    server = adapter_server
    victim, untouched = plant_victim(tmp_path)
    # The victim looks like an adapter: loading it would mean reading outside the repository.
    (victim / "adapter_config.json").write_text('{"r": 1, "lora_alpha": 1}')
    untouched_files = sorted(p.name for p in victim.iterdir())
    for adapter in ["..", ".", ".hidden", "a b", "x" * 200, "a:b"]:
        path = f"/v2/repository/models/{quoted('tiny_lora:' + adapter)}/load"
        status, body = raw(server.http, "POST", path, {})
        assert status == 400 and "invalid adapter name" in error_text(body), (adapter, status, body)
    for adapter in [f"../../../../../..{victim}", "../../simple", "..\\..\\x", "a\x00b"]:
        path = f"/v2/repository/models/{quoted('tiny_lora:' + adapter)}/load"
        status, body = raw(server.http, "POST", path, {})
        assert status == 400, (adapter, status, body)
        assert "invalid model name" in error_text(body) or "invalid adapter name" in error_text(body), body
    for key in ["../adapter_config.json", "/etc/passwd", "adapters/../../x"]:
        body = {"parameters": {f"file:{key}": base64.b64encode(b"{}").decode()}}
        status, answer = raw(server.http, "POST", "/v2/repository/models/tiny_lora:x/load", body)
        assert status == 400 and "load parameter 'file:" in error_text(answer), (key, answer)
    for name in [str(victim), "../" * 8 + str(victim)[1:], "victim"]:
        status, answer = raw(server.http, "POST", "/v2/models/tiny_lora/generate",
                             {"input_ids": [5, 6], "max_tokens": 2, "lora": name})
        assert status == 404 and "no adapter" in error_text(answer), (name, answer)
    assert sorted(p.name for p in victim.iterdir()) == untouched_files
    (victim / "adapter_config.json").unlink()
    untouched()
    still_serves(server)


MALFORMED = ["..", "m" * 300, "a\x00b", "a\nb", "."]


def test_every_path_naming_a_model_refuses_a_malformed_name(server):
    """Statistics, configuration, metadata, readiness, inference and trace settings: a name that
    cannot be a model folder is a 400 naming the problem, an unknown one a 404."""
    for name in MALFORMED:
        segment = quoted(name)
        for method, path in [("GET", f"/v2/models/{segment}/stats"),
                             ("GET", f"/v2/models/{segment}/config"),
                             ("GET", f"/v2/models/{segment}"),
                             ("GET", f"/v2/models/{segment}/versions/1/stats"),
                             ("POST", f"/v2/models/{segment}/infer"),
                             ("POST", f"/v2/models/{segment}/trace/setting")]:
            status, body = raw(server.http, method, path, {} if method == "POST" else None)
            assert status == 400, (name, path, status, body)
            assert "invalid model name" in error_text(body), (name, path, body)
    for path in ["/v2/models/ghost/stats", "/v2/models/ghost/config", "/v2/models/ghost"]:
        status, body = raw(server.http, "GET", path)
        assert status == 404 and "ghost" in error_text(body), (path, body)
    client = grpcclient.InferenceServerClient(server.grpc)
    for call in (lambda: client.get_model_metadata("m" * 300),
                 lambda: client.get_inference_statistics("m" * 300),
                 lambda: client.get_model_config("..")):
        with pytest.raises(InferenceServerException) as e:
            call()
        assert e.value.status() == "StatusCode.INVALID_ARGUMENT", e.value
    client.close()
    still_serves(server)


@pytest.mark.parametrize("env", ["/etc", "$$TRITON_MODEL_DIRECTORY/../../../../../etc",
                                 "$TRITON_MODEL_DIRECTORY/1/../..", "1/./../.."])
def test_a_python_models_environment_never_names_a_folder_outside(server, env):
    """EXECUTION_ENV_PATH in an uploaded configuration: the environment the sandbox would see
    (read-only) must be inside the model's own folder, of plain parts (a link there that leads
    out is not followed either: packages.rs's unit test); the load is refused naming the
    parameter."""
    config = json.dumps({"backend": "python", "max_batch_size": 0,
                         "input": [{"name": "X", "data_type": "TYPE_INT32", "dims": [1]}],
                         "output": [{"name": "Y", "data_type": "TYPE_INT32", "dims": [1]}],
                         "parameters": {"EXECUTION_ENV_PATH": {"string_value": env}}})
    model = b"class TritonPythonModel:\n    def execute(self, requests):\n        return []\n"
    files = {"file:1/model.py": base64.b64encode(model).decode()}
    status, body = raw(server.http, "POST", "/v2/repository/models/with_env/load",
                       {"parameters": {"config": config, **files}})
    assert status == 400, (env, status, body)
    assert "parameter 'EXECUTION_ENV_PATH'" in error_text(body), (env, body)
    still_serves(server, "simple")


@pytest.fixture(scope="module")
def namespaced(tmp_path_factory):
    """Two repositories as namespaces (`--model-namespacing=true`): `simple` in the first, and
    in the second `identity_fp32` beside a folder whose name holds the mark."""
    one, two = tmp_path_factory.mktemp("ns_one"), tmp_path_factory.mktemp("ns_two")
    copy_models(str(one), ["simple"])
    copy_models(str(two), ["identity_fp32"])
    shutil.copytree(two / "identity_fp32", two / "identity_fp32@1")
    s = Server(None, "--model-repository", str(one), "--model-repository", str(two),
               "--model-namespacing=true", "--model-control-mode", "explicit",
               "--load-model", "simple")
    s.repo = one
    yield s
    s.stop()


def test_namespaced_keys_name_only_a_repositorys_own_folders(namespaced, tmp_path):
    """With namespacing a model is also named `name@n`: a key names a folder of repository n
    and nothing else — no position outside 1..N, no climbing, no folder whose own name holds
    the mark (it is skipped: it would read as another repository's model)."""
    victim, untouched = plant_victim(tmp_path)
    before = index_names(namespaced)
    assert "simple@1" in before and not any("identity_fp32@1" == n for n in before), before
    # Keys of no folder: not found (an upload under one would add a model there, as intended).
    for name in [f"{victim.name}@1", "identity_fp32@1", "simple@2"]:
        status, body = raw(namespaced.http, "POST", f"/v2/repository/models/{quoted(name)}/load",
                           {})
        assert status in (400, 404), (name, status, body)
    # Names holding the mark that are no key: refused by name, with or without files.
    for name in ["simple@0", "simple@3", "simple@01", "simple@+1", "@1", "simple@", "simple@1@1",
                 "..@1", ".@2", ".hidden@1", "simple@18446744073709551617",
                 "identity_fp32@1@2"]:
        for body in ({}, load_body({"1/model.onnx": MODEL})):
            status, answer = raw(namespaced.http, "POST",
                                 f"/v2/repository/models/{quoted(name)}/load", body)
            assert status == 400, (name, status, answer)
            assert "invalid model name" in error_text(answer), (name, answer)
    untouched()
    after = index_names(namespaced)
    assert after == before, (before, after)
    still_serves(namespaced)
    # The plain name is the one loaded model; the qualified one the same.
    still_serves(namespaced, "simple@1")
