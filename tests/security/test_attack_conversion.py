"""A client's bytes never run as native code on the host. PyTorch and TensorFlow files sent with
a load request (HTTP, gRPC, or a sandboxed model.py's `load_model`) are not converted unless the
operator starts the server with --convert-uploaded-models; with it, torch's loaders refuse
pickles (a pickle that would write a file is refused with the framework's reason, and the file
is never written). Whatever the converter runs is confined: an interpreter that attacks first
cannot read a secret, write outside its scratch folder, connect anywhere, or take more memory
than its limit, while the same attacks succeed with --converter-sandbox=none (so the test can
fail). Configurations sent with a load request cannot climb out of the model folder or name
native libraries, and a model's repository calls can be switched off."""
import base64
import json
import os
import shutil
import socket
import subprocess

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from attack import ROOT, Server, copy_models, error_text, plant_victim, raw, still_serves

HERE = os.path.dirname(os.path.abspath(__file__))
CONVERTER = os.environ.get("CONVERTER_PYTHON",
                           os.path.join(ROOT, ".venv-convert", "bin", "python"))
PT2_CONFIG = {
    "name": "uploaded", "platform": "torch_aoti", "max_batch_size": 0,
    "input": [{"name": "INPUT__0", "data_type": "TYPE_FP32", "dims": [2, 4]}],
    "output": [{"name": "OUTPUT__0", "data_type": "TYPE_FP32", "dims": [2, 2]}],
}


@pytest.fixture(scope="module")
def pt2(tmp_path_factory):
    """(good.pt2 bytes, evil.pt2 bytes, the marker file evil.pt2 writes when unpickled)."""
    if not os.path.exists(CONVERTER):
        pytest.fail("the converter environment is missing: run `make convert-env`")
    out = tmp_path_factory.mktemp("pt2")
    marker = out / "pickle-ran"
    subprocess.run([CONVERTER, os.path.join(HERE, "pickled_models.py"), str(out), str(marker)],
                   check=True, capture_output=True, timeout=600)
    return (out / "good.pt2").read_bytes(), (out / "evil.pt2").read_bytes(), marker


def start(tmp_path_factory, name, *extra):
    repo = tmp_path_factory.mktemp(name)
    copy_models(str(repo), ["simple"])
    shutil.copytree(os.path.join(HERE, "models", "loader"), repo / "loader")
    # The default cache: it holds the compiled Python interpreter (good.pt2 is new each run,
    # so its conversion is never found there).
    return Server(str(repo), "--model-control-mode=explicit", "--load-model", "simple",
                  "--load-model", "loader", "--converter-python", CONVERTER, *extra)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = start(tmp_path_factory, "uploads")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def converting_uploads(tmp_path_factory):
    s = start(tmp_path_factory, "uploads-converted", "--convert-uploaded-models")
    yield s
    s.stop()


def http_load(server, model, config, files):
    parameters = {"config": json.dumps(config)}
    for key, content in files.items():
        parameters[key] = base64.b64encode(content).decode()
    return raw(server.http, "POST", f"/v2/repository/models/{model}/load",
               {"parameters": parameters}, timeout=600)


def load_from_sandbox(server, model, config, key, content):
    """What the `loader` model.py answers when it loads `model` for the client."""
    inputs = []
    for name, value in (("NAME", model.encode()), ("CONFIG", json.dumps(config).encode()),
                        ("FILE_KEY", key.encode()), ("FILE", content)):
        t = httpclient.InferInput(name, [1], "BYTES")
        t.set_data_from_numpy(np.array([value], dtype=np.object_))
        inputs.append(t)
    c = httpclient.InferenceServerClient(server.http, network_timeout=600)
    return c.infer("loader", inputs).as_numpy("ANSWER")[0].decode()


def test_an_uploaded_pytorch_file_is_not_converted(server, pt2, tmp_path):
    _, evil, marker = pt2
    victim, untouched = plant_victim(tmp_path)
    status, body = http_load(server, "uploaded", PT2_CONFIG, {"file:1/model.pt2": evil})
    assert status == 400, body
    assert "--convert-uploaded-models" in error_text(body) and "uploaded" in error_text(body)
    g = grpcclient.InferenceServerClient(server.grpc)
    with pytest.raises(InferenceServerException) as e:
        g.load_model("uploaded", config=json.dumps(PT2_CONFIG), files={"file:1/model.pt2": evil})
    assert "--convert-uploaded-models" in str(e.value)
    g.close()
    assert not marker.exists(), "the pickle ran"
    untouched()
    still_serves(server)


def test_a_sandboxed_model_cannot_have_the_host_convert_its_bytes(server, pt2):
    _, evil, marker = pt2
    answer = load_from_sandbox(server, "uploaded", PT2_CONFIG, "file:1/model.pt2", evil)
    assert answer.startswith("refused") and "--convert-uploaded-models" in answer, answer
    assert not marker.exists(), "the pickle ran"
    still_serves(server)


def test_with_the_flag_a_pickle_is_refused_and_a_plain_archive_is_served(converting_uploads, pt2):
    good, evil, marker = pt2
    status, body = http_load(converting_uploads, "uploaded", PT2_CONFIG,
                             {"file:1/model.pt2": evil})
    assert status == 400, body
    assert "cannot read model.pt2" in error_text(body), body
    assert "Weights only load failed" in error_text(body) or "weights_only" in error_text(body)
    assert not marker.exists(), "the pickle ran"
    status, body = http_load(converting_uploads, "uploaded", PT2_CONFIG,
                             {"file:1/model.pt2": good})
    assert status == 200, body
    t = httpclient.InferInput("INPUT__0", [2, 4], "FP32")
    t.set_data_from_numpy(np.ones((2, 4), np.float32))
    y = httpclient.InferenceServerClient(converting_uploads.http).infer("uploaded", [t])
    assert y.as_numpy("OUTPUT__0").shape == (2, 2)
    still_serves(converting_uploads)


ATTACKER = '''#!{python}
"""Answers the server's question about its paths as the real interpreter would, then, run as
the converter, tries what a pickle would try and reports each outcome as its refusal."""
import json, os, socket, sys

if len(sys.argv) > 2 and "sys.prefix" in sys.argv[2]:
    exec(sys.argv[2])
    sys.exit(0)


def attempt(f):
    try:
        return "done " + str(f())
    except BaseException as e:
        return "denied " + type(e).__name__


outcome = {{
    "read": attempt(lambda: open({secret!r}).read()),
    "write": attempt(lambda: open({victim!r} + "/written.txt", "w").write("x")),
    "connect": attempt(lambda: socket.create_connection(("127.0.0.1", {port}), timeout=5)),
    "memory": attempt(lambda: len(bytearray(3 << 30))),
    "uid": os.getuid(),
}}
print(json.dumps({{"ok": False, "reason": "attacks " + json.dumps(outcome), "hint": ""}}))
'''


def attack_outcome(tmp_path, sandbox):
    """Loads a repository TorchScript model with an attacking converter and returns what each
    attack did, with the listener's count of connections and the victim's check."""
    victim, untouched = plant_victim(tmp_path)
    secret = tmp_path / "secret.txt"
    secret.write_text("the-secret-value")
    secret.chmod(0o644)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(0.1)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    python = bin_dir / "python"
    python.write_text(ATTACKER.format(python=os.path.realpath(CONVERTER), secret=str(secret),
                                      victim=str(victim), port=listener.getsockname()[1]))
    python.chmod(0o755)
    repo = tmp_path / "repo"
    (repo / "scripted" / "1").mkdir(parents=True)
    (repo / "scripted" / "1" / "model.pt").write_bytes(b"any bytes")
    (repo / "scripted" / "config.pbtxt").write_text(
        'platform: "pytorch_libtorch"\nmax_batch_size: 0\n'
        'input [ { name: "INPUT__0", data_type: TYPE_FP32, dims: [ 4 ] } ]\n'
        'output [ { name: "OUTPUT__0", data_type: TYPE_FP32, dims: [ 4 ] } ]\n')
    env = dict(os.environ, WASMTRON_CACHE_DIR=str(tmp_path / "cache"))
    s = Server(str(repo), "--model-control-mode=explicit", "--converter-python", str(python),
               "--converter-sandbox", sandbox, "--converter-memory-mb", "2048", env=env)
    try:
        status, body = raw(s.http, "POST", "/v2/repository/models/scripted/load", {},
                           timeout=600)
        assert status == 400, body
        text = error_text(body)
        assert "attacks " in text, text
        outcome = json.loads(text.split("attacks ", 1)[1].split("}", 1)[0] + "}")
        connections = 0
        try:
            while True:
                listener.accept()[0].close()
                connections += 1
        except socket.timeout:
            pass
        return outcome, connections, untouched, s
    finally:
        s.stop()
        listener.close()


def test_the_converter_is_confined(tmp_path):
    outcome, connections, untouched, _ = attack_outcome(tmp_path, "bwrap")
    assert outcome["read"].startswith("denied"), outcome
    assert outcome["write"].startswith("denied"), outcome
    assert outcome["connect"].startswith("denied") and connections == 0, outcome
    assert outcome["memory"] == "denied MemoryError", outcome
    if os.geteuid() == 0:
        assert outcome["uid"] == 65534, outcome
    untouched()


def test_the_same_attacks_succeed_unconfined(tmp_path):
    """The control: without the sandbox the attacker reads, writes and connects, so the test
    above fails if the confinement goes."""
    outcome, connections, untouched, _ = attack_outcome(tmp_path, "none")
    assert outcome["read"] == "done the-secret-value", outcome
    assert outcome["write"].startswith("done"), outcome
    assert outcome["connect"].startswith("done") and connections == 1, outcome
    with pytest.raises(AssertionError):
        untouched()


def test_a_sent_configuration_stays_in_the_model_folder(server):
    onnx_bytes = onnx_of_simple()
    config = {"name": "climber", "backend": "onnxruntime",
              "default_model_filename": "../../../../../../etc/passwd"}
    status, body = http_load(server, "climber", config, {"file:1/model.onnx": onnx_bytes})
    assert status == 400, body
    assert "default_model_filename" in error_text(body), body
    config = {"name": "native", "backend": "onnxruntime",
              "model_operations": {"op_library_filename": ["/usr/lib/x86_64-linux-gnu/libc.so.6"]}}
    status, body = http_load(server, "native", config, {"file:1/model.onnx": onnx_bytes})
    assert status == 400, body
    assert "op_library_filename" in error_text(body), body
    still_serves(server)


def test_custom_op_libraries_never_come_with_a_load_request(tmp_path):
    """Even where the operator allows custom operator libraries, a load request's configuration
    does not name one."""
    repo = tmp_path / "repo"
    copy_models(str(repo), ["simple"])
    s = Server(str(repo), "--model-control-mode=explicit", "--load-model", "simple",
               "--allow-custom-op-libraries")
    try:
        onnx_bytes = onnx_of_simple()
        config = {"name": "native", "backend": "onnxruntime",
                  "model_operations": {"op_library_filename": ["1/evil.so"]}}
        status, body = http_load(s, "native", config,
                                 {"file:1/model.onnx": onnx_bytes, "file:1/evil.so": b"\x7fELF"})
        assert status == 400, body
        assert "never name one" in error_text(body), body
        still_serves(s)
    finally:
        s.stop()


def onnx_of_simple():
    with open(os.path.join(ROOT, "model_repository", "simple", "1", "model.onnx"), "rb") as f:
        return f.read()


SIMPLE_COPY = {"name": "simple_copy", "backend": "onnxruntime", "max_batch_size": 8,
               "input": [{"name": "INPUT0", "data_type": "TYPE_INT32", "dims": [16]},
                         {"name": "INPUT1", "data_type": "TYPE_INT32", "dims": [16]}],
               "output": [{"name": "OUTPUT0", "data_type": "TYPE_INT32", "dims": [16]},
                          {"name": "OUTPUT1", "data_type": "TYPE_INT32", "dims": [16]}]}


def test_repository_calls_are_on_by_default_and_switch_off(server, tmp_path_factory):
    answer = load_from_sandbox(server, "simple_copy", SIMPLE_COPY, "file:1/model.onnx",
                               onnx_of_simple())
    assert answer == "loaded", answer
    off = start(tmp_path_factory, "calls-off", "--allow-model-repository-calls=false")
    try:
        answer = load_from_sandbox(off, "simple_copy", SIMPLE_COPY, "file:1/model.onnx",
                                   onnx_of_simple())
        assert answer.startswith("refused") and "--allow-model-repository-calls" in answer
        status, _ = raw(off.http, "GET", "/v2/models/simple_copy/ready")
        assert status != 200
        still_serves(off)
    finally:
        off.stop()


def test_a_model_of_its_own_may_have_its_repository_calls_off(tmp_path):
    repo = tmp_path / "repo"
    copy_models(str(repo), ["simple"])
    loader = repo / "loader"
    (loader / "1").mkdir(parents=True)
    with open(os.path.join(HERE, "models", "loader", "1", "model.py")) as f:
        (loader / "1" / "model.py").write_text(f.read())
    with open(os.path.join(HERE, "models", "loader", "config.pbtxt")) as f:
        config = f.read()
    assert "parameters [ {" in config
    (loader / "config.pbtxt").write_text(config.replace(
        "parameters [ {", 'parameters [ { key: "repository_calls", '
                          'value: { string_value: "off" } }, {', 1))
    s = Server(str(repo), "--model-control-mode=explicit", "--load-model", "simple",
               "--load-model", "loader")
    try:
        answer = load_from_sandbox(s, "simple_copy", SIMPLE_COPY, "file:1/model.onnx",
                                   onnx_of_simple())
        assert answer.startswith("refused") and "repository_calls" in answer, answer
        still_serves(s)
    finally:
        s.stop()
