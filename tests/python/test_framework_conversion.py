"""A Triton repository's PyTorch and TensorFlow models load unchanged: converted to ONNX once
with the converter environment (--converter-python), checked against the framework, cached,
and served by ONNX Runtime with the tensor names Triton's backends give them; a second server
without any framework loads them from the cache; what cannot be converted is refused with the
exporter's reason."""
import glob
import json
import os
import shutil
import subprocess

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from conftest import ROOT, Server

CONVERTER = os.environ.get("CONVERTER_PYTHON",
                           os.path.join(ROOT, ".venv-convert", "bin", "python"))
CONVERTED = ["resnet18_ts", "mix_ts", "dict_ts", "heads_ep", "keras_tf"]
REFUSED = {
    "corrupt_ts": ["model.pt", "torch.jit.load cannot read"],
    "compiled_aoti": ["AOTInductor-compiled package", "torch.export.save"],
    "svd_ts": ["aten::linalg_svdvals", "Wasm stage"],
    "strings_ts": ["input 'INPUT0' has type BYTES"],
}


@pytest.fixture(scope="module")
def repository(tmp_path_factory):
    if not os.path.exists(CONVERTER):
        pytest.fail("the converter environment is missing: run `make convert-env`")
    root = tmp_path_factory.mktemp("frameworks")
    repo, refs = str(root / "repo"), str(root / "references")
    subprocess.run([CONVERTER, os.path.join(ROOT, "tests", "python", "framework_models.py"),
                    repo, refs], check=True, capture_output=True, timeout=900)
    return repo, refs, str(root / "cache")


@pytest.fixture(scope="module")
def converting(repository):
    repo, _, cache = repository
    env = dict(os.environ, WASMTRON_CACHE_DIR=cache)
    server = Server(repo, "--converter-python", CONVERTER, env=env)
    yield server
    server.stop()


def index_of(server):
    with httpclient.InferenceServerClient(server.http) as c:
        return {m["name"]: m for m in c.get_model_repository_index()}


def answers_as_the_framework_did(server, refs, model):
    ref = np.load(os.path.join(refs, model + ".npz"))
    inputs = {k[3:]: ref[k] for k in ref.files if k.startswith("in:")}
    outputs = {k[4:]: ref[k] for k in ref.files if k.startswith("out:")}
    with grpcclient.InferenceServerClient(server.grpc) as c:
        meta = c.get_model_metadata(model, as_json=True)
        served = {t["name"] for t in meta["inputs"]}
        assert served == set(inputs), meta
        sent = []
        for name, value in inputs.items():
            t = grpcclient.InferInput(name, list(value.shape),
                                      "INT64" if value.dtype == np.int64 else "FP32")
            t.set_data_from_numpy(value)
            sent.append(t)
        result = c.infer(model, sent, outputs=[grpcclient.InferRequestedOutput(n)
                                               for n in outputs])
    for name, want in outputs.items():
        got = result.as_numpy(name)
        assert got is not None, f"{model}: no output {name}"
        assert got.shape == want.shape, (model, name, got.shape, want.shape)
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4, err_msg=f"{model}.{name}")


def test_pytorch_and_tensorflow_models_answer_as_their_framework(converting, repository):
    """TorchScript (traced resnet18 by INPUT__0/OUTPUT__0; a scripted model by forward()'s
    argument names and out-of-order <name>__<index> outputs, named `backend: "pytorch"`; one
    taking a Dict(str, Tensor) keyed by the config's input names), an
    ExportedProgram by torch_aoti's ARGS/KWARGS/RESULT names, and a Keras SavedModel whose
    config names only the platform: each served through tritonclient within 1e-4 + 1e-3·|x| of
    what the framework answered on the same input."""
    _, refs, _ = repository
    index = index_of(converting)
    for model in CONVERTED:
        assert index[model]["state"] == "READY", index[model]
        # The version's status says what was converted and how it was checked.
        assert "checked against the framework" in index[model]["reason"], index[model]
        answers_as_the_framework_did(converting, refs, model)
    with httpclient.InferenceServerClient(converting.http) as c:
        config = c.get_model_config("keras_tf")
        # Filled from the SavedModel's signature, as Triton's TensorFlow backend does.
        assert [i["name"] for i in config["input"]] == ["features"], config
        assert config["max_batch_size"] == 8
        # The platform stays the one the user wrote.
        assert c.get_model_config("resnet18_ts")["platform"] == "pytorch_libtorch"
        # A PyTorch backend tuning parameter is kept in the config and said to have no
        # effect, by name.
        assert "INFERENCE_MODE" in c.get_model_config("mix_ts")["parameters"]
    assert "parameter 'INFERENCE_MODE' tunes Triton's pytorch backend and has no effect" \
        in "".join(converting.log)


def test_what_cannot_be_converted_is_refused_with_the_reason(converting):
    index = index_of(converting)
    for model, said in REFUSED.items():
        entry = index[model]
        assert entry["state"] == "UNAVAILABLE", entry
        for words in said + [f"model '{model}'", "cannot convert"]:
            assert words in entry["reason"], entry
    # The others keep serving.
    assert all(index[m]["state"] == "READY" for m in CONVERTED)


def test_conversions_are_cached_and_a_server_without_frameworks_serves_them(converting,
                                                                            repository):
    repo, refs, cache = repository
    manifests = [json.load(open(m)) for m in glob.glob(os.path.join(cache, "converted", "*",
                                                                    "manifest.json"))]
    by_source = {(m["platform"], m["source"]) for m in manifests}
    assert ("tensorflow_savedmodel", "model.savedmodel") in by_source, manifests
    assert ("torch_aoti", "model.pt2") in by_source, manifests
    for m in manifests:
        assert len(m["source_sha256"]) == 64 and m["opset"] == 17, m
        assert m["checks"] and all(c["ok"] for c in m["checks"]), m
    # No converter, and no framework on the PATH: the cache serves them.
    env = dict(os.environ, WASMTRON_CACHE_DIR=cache, PATH="/usr/bin:/bin")
    second = Server(repo, "--converter-python", "none", env=env)
    try:
        index = index_of(second)
        for model in CONVERTED:
            assert index[model]["state"] == "READY", index[model]
        answers_as_the_framework_did(second, refs, "resnet18_ts")
        assert "from the conversion cache" in "".join(second.log)
        # A model with no cached conversion says how to get one.
        assert "--converter-python" in index["svd_ts"]["reason"], index["svd_ts"]
    finally:
        second.stop()


def test_a_changed_model_file_is_converted_again(repository, tmp_path):
    """The cache follows the file's contents: a model replaced in place is not served from
    the old conversion."""
    repo, _, cache = repository
    copy = tmp_path / "repo"
    shutil.copytree(os.path.join(repo, "mix_ts"), copy / "mix_ts")
    # The same config over a different network (the resnet's file): no cached conversion
    # matches it, and without a converter it is refused rather than served stale.
    shutil.copy(os.path.join(repo, "resnet18_ts", "1", "model.pt"),
                copy / "mix_ts" / "1" / "model.pt")
    env = dict(os.environ, WASMTRON_CACHE_DIR=cache)
    server = Server(str(copy), "--converter-python", "none", env=env)
    try:
        entry = index_of(server)["mix_ts"]
        assert entry["state"] == "UNAVAILABLE" and "no conversion of this file is cached" \
            in entry["reason"], entry
    finally:
        server.stop()


def test_wasmtron_convert_fills_the_cache_ahead_of_time(repository, tmp_path):
    repo, _, _ = repository
    only = tmp_path / "repo"
    shutil.copytree(os.path.join(repo, "mix_ts"), only / "mix_ts")
    shutil.copytree(os.path.join(repo, "svd_ts"), only / "svd_ts")
    cache = str(tmp_path / "cache")
    binary = os.environ.get("WASMTRON_BIN", os.path.join(ROOT, "target", "debug", "wasmtron"))
    run = subprocess.run([binary, "convert", str(only), "--converter-python", CONVERTER,
                          "--wasm-cache-dir", cache], capture_output=True, text=True,
                         timeout=900)
    # One model converted, one refused: the command says which and fails.
    assert run.returncode != 0, run.stdout + run.stderr
    assert "mix_ts (version 1): converted from model.pt" in run.stdout, run.stdout
    assert "svd_ts (version 1): model 'svd_ts': cannot convert" in run.stdout, run.stdout
    again = subprocess.run([binary, "convert", str(only / ".." / "repo"), "--converter-python",
                            CONVERTER, "--wasm-cache-dir", cache], capture_output=True,
                           text=True, timeout=900)
    assert "already in the cache" in again.stdout, again.stdout
    server = Server(str(only), "--wasm-cache-dir", cache, "--converter-python", "none")
    try:
        assert index_of(server)["mix_ts"]["state"] == "READY"
    finally:
        server.stop()


def test_the_converter_environment_make_installs_is_the_default(repository, tmp_path):
    """Without --converter-python the server converts with WASMTRON_CONVERTER_PYTHON (else the
    .venv-convert that `make convert-env` made)."""
    repo, refs, _ = repository
    only = tmp_path / "repo"
    shutil.copytree(os.path.join(repo, "dict_ts"), only / "dict_ts")
    env = dict(os.environ, WASMTRON_CACHE_DIR=str(tmp_path / "cache"),
               WASMTRON_CONVERTER_PYTHON=CONVERTER)
    server = Server(str(only), env=env)
    try:
        assert index_of(server)["dict_ts"]["state"] == "READY"
        answers_as_the_framework_did(server, refs, "dict_ts")
    finally:
        server.stop()
