"""deploy/bentoml: `bentoml serve` of the service that runs wasmtron in-process (the replacement
for `bentoml.triton.Runner`), on loopback, called with BentoML's own client, with its
repository in a folder and in S3 (moto's server): embeddings equal the `embed_text` ensemble
run in-process here, /infer reaches any loaded model, bad requests get wasmtron's message with
BentoML's 400/404, and SIGTERM stops the service cleanly. `bentoml build` packs the service
from bentofile.yaml with no package index. BentoML lives in its own venv (`make bentoml-deps`;
BENTO_PYTHON names its interpreter)."""
import json
import os
import signal
import socket
import subprocess
import time
import urllib.request

import numpy as np
import pytest

import wasmtron
from conftest import ROOT, copy_models
from test_remote_repository import CREDENTIALS, s3, upload  # noqa: F401  (s3 is a fixture)

BENTO_PYTHON = os.environ.get("BENTO_PYTHON", os.path.join(ROOT, ".venv-bentoml", "bin", "python"))
SERVICE_DIR = os.path.join(ROOT, "deploy", "bentoml")
MODELS = ["embed_text", "bert_tokenizer", "minilm", "mean_pool", "simple"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ready(url):
    try:
        with urllib.request.urlopen(url + "/readyz", timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


def bentoml_cli():
    if not os.path.exists(BENTO_PYTHON):
        pytest.skip("BentoML's venv is missing (make bentoml-deps)")
    return os.path.join(os.path.dirname(BENTO_PYTHON), "bentoml")


def test_bentoml_build_packs_the_service_offline(tmp_path):
    bentoml = bentoml_cli()
    env = dict(os.environ, BENTOML_HOME=str(tmp_path / "home"), BENTOML_DO_NOT_TRACK="true",
               PIP_NO_INDEX="1", PIP_INDEX_URL="http://127.0.0.1:9/none")
    out = subprocess.run([bentoml, "build", "--output", "tag"], cwd=SERVICE_DIR, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    tag = out.stdout.strip().splitlines()[-1].removeprefix("__tag__:")
    name, version = tag.split(":")
    assert name == "wasmtron-embeddings"
    bento = tmp_path / "home" / "bentos" / name / version
    manifest = (bento / "bento.yaml").read_text()
    assert "service: service:Embeddings" in manifest and "/embed" in manifest
    assert (bento / "src" / "service.py").exists()
    wheels = os.listdir(bento / "env" / "python" / "wheels")
    assert [w for w in wheels if w.startswith("wasmtron-")], wheels


@pytest.mark.parametrize("store", ["folder", "s3"])
def test_bentoml_serves_a_pipeline_in_process(tmp_path, store, request):
    bentoml = bentoml_cli()
    repo = tmp_path / "repo"
    repo.mkdir()
    copy_models(str(repo), MODELS)
    location = str(repo)
    if store == "s3":
        port, client = request.getfixturevalue("s3")
        for model in MODELS:
            upload(client, model, prefix="bento")
        location = f"s3://127.0.0.1:{port}/models/bento"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "bentoml.log", "w+")
    env = dict(os.environ, **CREDENTIALS, WASMTRON_MODEL_REPOSITORY=location,
               WASMTRON_LOAD_MODELS="embed_text,simple", BENTOML_HOME=str(tmp_path / "home"),
               BENTOML_DO_NOT_TRACK="true")
    proc = subprocess.Popen([bentoml, "serve", "service:Embeddings", "--host", "127.0.0.1",
                             "--port", str(port)], cwd=SERVICE_DIR, env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 240
        while not ready(url):
            assert proc.poll() is None and time.time() < deadline, \
                (log.seek(0), log.read()[-4000:])[1]
            time.sleep(0.5)
        out = subprocess.run([BENTO_PYTHON, os.path.join(SERVICE_DIR, "client.py"), url],
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
        result = json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            code = None
        log.seek(0)
        logs = log.read()
        log.close()
    assert result["ready"], result
    texts = ["wasmtron serves this in process", "BentoML calls it", ""]
    with wasmtron.Server(model_repository=str(repo), model_control_mode="explicit",
                         startup_models=["embed_text"]) as local:
        (response,) = local.model("embed_text").infer(
            inputs={"TEXT": np.array([[t.encode()] for t in texts], dtype=object)})
        reference = np.from_dlpack(response.outputs["EMBEDDING"])
    got = np.array(result["embeddings"], dtype=np.float32)
    assert got.shape == (3, 384)
    np.testing.assert_allclose(got, reference, atol=1e-6)
    assert result["simple"] == {"OUTPUT1": [[i - 1 for i in range(16)]]}
    assert result["bad_request"]["status"] == 400, result
    assert "INPUT1" in result["bad_request"]["message"], result
    assert result["unknown_model"]["status"] == 404, result
    assert "ghost" in result["unknown_model"]["message"], result
    print("bentoml:", {k: v for k, v in result.items() if k != "embeddings"}, "exit", code)
    assert code == 0, logs[-3000:]  # SIGTERM: BentoML shuts down, the server drains
