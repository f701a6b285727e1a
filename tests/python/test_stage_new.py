"""What docs/stages.md's stage guides tell a new stage author to do, for each language: `wasmtron
stage new demo --lang L`, `wasmtron stage build demo`, `wasmtron stage run` on the test input,
then copy config.pbtxt and the version folder into a repository and serve it.

The toolchains are the ones `make deps` installs (componentize-py in .venv, componentize-js in
examples/js/node_modules, clang-19 and componentize-c); the test puts them on PATH as a user's
install would. The Rust stage resolves its crates from crates.io, as a new project does."""
import json
import os
import shutil
import subprocess

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import BINARY, ROOT, Server

TOOL_PATHS = [os.path.join(ROOT, ".venv", "bin"), os.path.join(ROOT, "examples", "js", "node_modules", ".bin")]


def wasmtron(*args, cwd, check=True):
    env = dict(os.environ, PATH=os.pathsep.join(TOOL_PATHS + [os.environ.get("PATH", "")]))
    # A stage's cargo build must not reuse the suite's target folder or feature settings.
    for key in ("CARGO_TARGET_DIR", "RUSTFLAGS"):
        env.pop(key, None)
    proc = subprocess.run([BINARY, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    if check:
        assert proc.returncode == 0, f"wasmtron {' '.join(args)}:\n{proc.stdout}\n{proc.stderr}"
    return proc


def softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@pytest.mark.parametrize("lang", ["python", "js", "c", "rust"])
def test_a_new_stage_builds_runs_and_serves(tmp_path, lang):
    out = wasmtron("stage", "new", "demo", "--lang", lang, cwd=tmp_path).stdout
    assert "wasmtron stage build demo" in out
    built = wasmtron("stage", "build", "demo", cwd=tmp_path).stdout
    component = tmp_path / "demo" / "1" / "model.wasm"
    assert f"built {component}" in built and component.stat().st_size > 0
    ran = wasmtron("stage", "run", "demo/1/model.wasm", "--input", "INPUT0=demo/input.json", cwd=tmp_path)
    result = json.loads(ran.stdout)["outputs"][0]
    np.testing.assert_allclose(result["data"], softmax(np.array([1.0, 2.0, 3.0, 4.0])), rtol=1e-6)

    repo = tmp_path / "repo" / "demo"
    repo.mkdir(parents=True)
    shutil.copy(tmp_path / "demo" / "config.pbtxt", repo)
    shutil.copytree(tmp_path / "demo" / "1", repo / "1")
    server = Server(str(tmp_path / "repo"), "--model-control-mode", "explicit", "--load-model", "demo")
    try:
        client = httpclient.InferenceServerClient(server.http, network_timeout=120)
        x = np.array([[0.5, -1.0, 2.0], [3.0, 3.0, 3.0]], np.float32)
        t = httpclient.InferInput("INPUT0", list(x.shape), "FP32")
        t.set_data_from_numpy(x)
        np.testing.assert_allclose(client.infer("demo", [t]).as_numpy("OUTPUT0"), softmax(x), rtol=1e-5)
        # The template's parameter check answers a bad reload with its message.

        with pytest.raises(InferenceServerException) as e:
            client.load_model("demo", config=json.dumps({
                "backend": "wasm", "max_batch_size": 8,
                "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [-1]}],
                "output": [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [-1]}],
                "parameters": {"temperature": {"string_value": "-2"}}}))
        assert "temperature" in e.value.message()
    finally:
        server.stop()


def test_stage_new_and_build_explain_mistakes(tmp_path):
    bad = wasmtron("stage", "new", "2fast", "--lang", "python", cwd=tmp_path, check=False)
    assert bad.returncode != 0 and "use a letter first" in bad.stderr
    wasmtron("stage", "new", "demo", "--lang", "python", cwd=tmp_path)
    again = wasmtron("stage", "new", "demo", "--lang", "js", cwd=tmp_path, check=False)
    assert again.returncode != 0 and "exists and is not empty" in again.stderr
    (tmp_path / "empty").mkdir()
    none = wasmtron("stage", "build", "empty", cwd=tmp_path, check=False)
    assert none.returncode != 0 and "holds no stage" in none.stderr
    # A Python syntax error surfaces from componentize-py, and the build says it failed.
    (tmp_path / "demo" / "src" / "app.py").write_text("def broken(:\n")
    broken = wasmtron("stage", "build", "demo", cwd=tmp_path, check=False)
    assert broken.returncode != 0 and "componentize-py failed" in broken.stderr
