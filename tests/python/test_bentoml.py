"""deploy/bentoml: `bentoml serve` of the service that runs wasmtron in-process (the replacement
for `bentoml.triton.Runner`), on loopback, called with BentoML's own client: embeddings equal
the `embed_text` ensemble run in-process here, /infer reaches any loaded model, bad requests get
wasmtron's message with BentoML's 400/404, and SIGTERM stops the service cleanly. BentoML lives
in its own venv (`make bentoml-deps`; BENTO_PYTHON names its interpreter)."""
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


def test_bentoml_serves_a_pipeline_in_process(tmp_path):
    if not os.path.exists(BENTO_PYTHON):
        pytest.skip("BentoML's venv is missing (make bentoml-deps)")
    repo = tmp_path / "repo"
    repo.mkdir()
    copy_models(str(repo), MODELS)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "bentoml.log", "w+")
    env = dict(os.environ, WASMTRON_MODEL_REPOSITORY=str(repo),
               WASMTRON_LOAD_MODELS="embed_text,simple", BENTOML_HOME=str(tmp_path / "home"),
               BENTOML_DO_NOT_TRACK="true")
    bentoml = os.path.join(os.path.dirname(BENTO_PYTHON), "bentoml")
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
                         load_models=["embed_text"]) as local:
        reference = local.model("embed_text").infer(
            {"TEXT": np.array([[t.encode()] for t in texts], dtype=object)})["EMBEDDING"]
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
