"""LoRA adapters in PEFT's format on the generation backend, several in one batch.

A tiny decoder exported to take adapters on its q and v projections (`llm_export.py --lora`)
is served; adapters made by PEFT itself (random, `init_lora_weights=False`) are loaded and
unloaded through the repository API (the files in the load request, or the model's
`adapters/<name>/` folder, which is also loaded with the model), and each sequence's greedy tokens must be those of ONNX Runtime on
PEFT's `merge_and_unload` weights, while sequences of other adapters and of the base model run
in the same batch. Adapters the decoder cannot take are refused by name. Then the served
SmolLM2 ensemble with the official OpenAI client: `smollm2:<adapter>` as the model name, listed
under /v1/models with its parent.
"""
import base64
import json
import os
import shutil
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import numpy as np
import onnx
import openai
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from conftest import ROOT, Server

sys.path.insert(0, os.path.join(ROOT, "scripts"))
import decoder_loop  # noqa: E402
import llm_export  # noqa: E402

CONVERTER = os.environ.get("CONVERTER_PYTHON", os.path.join(ROOT, ".venv-convert", "bin", "python"))
REFERENCE = os.path.join(os.path.dirname(__file__), "lora_reference.py")
TARGETS = ("q_proj", "v_proj")
PROMPTS = [[5, 6, 7, 8], [40, 41, 42, 43, 44, 45, 46], [200, 17, 9]]
TOKENS = 12
TINY_CONFIG = """backend: "generation"
max_batch_size: 8
model_transaction_policy { decoupled: true }
parameters { key: "max_sequence_length" value { string_value: "64" } }
parameters { key: "max_lora_rank" value { string_value: "8" } }
"""


def peft_adapter(work, name, hp, weights=None, **spec):
    """An adapter PEFT makes (and, from `weights`, its merged weights): (adapter folder,
    merged weights or None)."""
    out = os.path.join(work, name)
    spec = {"hp": hp, "out": out, **spec}
    if weights is not None:
        spec["weights"] = weights
    path = os.path.join(work, f"{name}.json")
    with open(path, "w") as f:
        json.dump(spec, f)
    subprocess.run([CONVERTER, REFERENCE, path], check=True, capture_output=True, timeout=600)
    merged = dict(np.load(os.path.join(out, "merged.npz"))) if weights is not None else None
    return os.path.join(out, "adapter"), merged


def reference_tokens(path, prompts):
    return decoder_loop.DecoderLoop(path).greedy(prompts, TOKENS)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    work = str(tmp_path_factory.mktemp("lora"))
    repo = os.path.join(work, "repo")
    model_dir = os.path.join(repo, "tiny_lora")
    os.makedirs(os.path.join(model_dir, "1"))
    model, w, hp = llm_export.tiny(shared_cache=True, lora=TARGETS)
    onnx.save(model, os.path.join(model_dir, "1", "model.onnx"))
    with open(os.path.join(model_dir, "1", "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": 3, "pad_token_id": 0, "max_position_embeddings": 256}, f)
    with open(os.path.join(model_dir, "config.pbtxt"), "w") as f:
        f.write(TINY_CONFIG)
    base = os.path.join(work, "base.npz")
    np.savez(base, **w)
    # Rank 4 on q and v; rank 8 on q only with rsLoRA's scaling; one on k_proj.
    terse, terse_w = peft_adapter(work, "terse", hp, base, targets=list(TARGETS), r=4, alpha=8, seed=1)
    verbose, verbose_w = peft_adapter(work, "verbose", hp, base, targets=["q_proj"], r=8, alpha=4,
                                      seed=2, rslora=True)
    keys, _ = peft_adapter(work, "keys", hp, targets=["k_proj"], r=4, alpha=8, seed=3)
    # The second adapter is kept in the repository, as `adapters/verbose/`.
    shutil.copytree(verbose, os.path.join(model_dir, "adapters", "verbose"))
    references = {}
    for name, weights in (("terse", terse_w), ("verbose", verbose_w)):
        path = os.path.join(work, f"{name}_merged.onnx")
        onnx.save(llm_export.decoder(weights, hp, shared_cache=True), path)
        references[name] = reference_tokens(path, PROMPTS)
    # The base model: the same decoder with no adapter bound (one column of zeros).
    references[None] = reference_tokens(os.path.join(model_dir, "1", "model.onnx"), PROMPTS)
    server = Server(repo, "--model-control-mode", "explicit", "--load-model", "tiny_lora")
    server.terse, server.keys, server.references = terse, keys, references
    yield server
    server.stop()


def files_of(adapter):
    with open(os.path.join(adapter, "adapter_config.json"), "rb") as f:
        config = f.read()
    with open(os.path.join(adapter, "adapter_model.safetensors"), "rb") as f:
        weights = f.read()
    return {"file:adapter_config.json": config, "file:adapter_model.safetensors": weights}


def post(server, path, body):
    """(status, JSON answer) of a POST to the HTTP endpoint."""
    request = urllib.request.Request(f"http://{server.http}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=300) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def load_with_files(server, name, adapter):
    files = {k: base64.b64encode(v).decode() for k, v in files_of(adapter).items()}
    return post(server, f"/v2/repository/models/{name}/load", {"parameters": files})


def generate(server, ids, adapter=None):
    body = {"input_ids": ids, "max_tokens": TOKENS, "end_id": -1}
    if adapter is not None:
        body["lora"] = adapter
    status, answer = post(server, "/v2/models/tiny_lora/generate", body)
    if status != 200:
        return status, answer.get("error", "")
    return status, list(answer["output_ids"])


def test_adapters_answer_as_peft_merged_weights_several_in_one_batch(tiny):
    references = tiny.references
    # The repository's adapters/verbose/ was loaded with the model; loading it again (over
    # gRPC) reads the folder again.
    assert generate(tiny, PROMPTS[0], "verbose") == (200, references["verbose"][0])
    grpcclient.InferenceServerClient(tiny.grpc).load_model("tiny_lora:verbose")
    assert load_with_files(tiny, "tiny_lora:terse", tiny.terse) == (200, {})
    assert references["terse"] != references[None], "the adapter must change the answers"
    assert references["verbose"] != references[None]
    # Every prompt with every adapter and without, all at once: they share the batch.
    jobs = [(i, a) for a in (None, "terse", "verbose") for i in range(len(PROMPTS))] * 2
    results = [None] * len(jobs)

    def one(k):
        i, a = jobs[k]
        results[k] = generate(tiny, PROMPTS[i], a)

    threads = [threading.Thread(target=one, args=(k,)) for k in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    for (i, a), result in zip(jobs, results):
        assert result == (200, references[a][i]), f"prompt {i}, adapter {a}"


def test_an_unloaded_adapter_is_refused_by_name_and_the_others_keep_serving(tiny):
    assert load_with_files(tiny, "tiny_lora:terse", tiny.terse)[0] == 200
    assert load_with_files(tiny, "tiny_lora:gone", tiny.terse)[0] == 200
    h = httpclient.InferenceServerClient(tiny.http)
    # A loaded adapter is ready under its model's name, and listed in the repository index.
    assert h.is_model_ready("tiny_lora:gone")
    assert grpcclient.InferenceServerClient(tiny.grpc).is_model_ready("tiny_lora:gone")
    index = {m["name"]: m for m in h.get_model_repository_index()}
    assert index["tiny_lora:gone"]["state"] == "READY", index
    assert "tiny_lora:verbose" in index and "tiny_lora:terse" in index, index
    assert post(tiny, "/v2/repository/models/tiny_lora:gone/unload", {}) == (200, {})
    assert not h.is_model_ready("tiny_lora:gone")
    assert "tiny_lora:gone" not in {m["name"] for m in h.get_model_repository_index()}
    status, error = generate(tiny, PROMPTS[0], "gone")
    assert status == 404 and "'gone'" in error and "terse" in error, error
    assert generate(tiny, PROMPTS[0], "terse") == (200, tiny.references["terse"][0])
    assert generate(tiny, PROMPTS[0]) == (200, tiny.references[None][0])
    # Unloading it again says it is not there; the model itself stays loaded.
    status, answer = post(tiny, "/v2/repository/models/tiny_lora:gone/unload", {})
    assert status == 404 and "'gone'" in answer["error"]
    assert httpclient.InferenceServerClient(tiny.http).is_model_ready("tiny_lora")


def test_adapters_sent_to_the_server_survive_a_reload_of_their_model(tiny):
    """Re-applied: the reloaded model's new versions get the adapters clients loaded from
    files before they serve; one unloaded before the reload stays unloaded."""
    assert load_with_files(tiny, "tiny_lora:terse", tiny.terse)[0] == 200
    assert load_with_files(tiny, "tiny_lora:dropped", tiny.terse)[0] == 200
    assert post(tiny, "/v2/repository/models/tiny_lora:dropped/unload", {}) == (200, {})
    assert post(tiny, "/v2/repository/models/tiny_lora/load", {}) == (200, {})
    assert generate(tiny, PROMPTS[0], "terse") == (200, tiny.references["terse"][0])
    assert generate(tiny, PROMPTS[0], "verbose") == (200, tiny.references["verbose"][0])
    assert httpclient.InferenceServerClient(tiny.http).is_model_ready("tiny_lora:terse")
    status, error = generate(tiny, PROMPTS[0], "dropped")
    assert status == 404 and "'dropped'" in error, error


def test_adapters_the_decoder_cannot_take_are_refused_by_name(tiny):
    status, answer = load_with_files(tiny, "tiny_lora:keys", tiny.keys)
    assert status == 400 and "k_proj" in answer["error"] and "q_proj, v_proj" in answer["error"], answer
    files = files_of(tiny.terse)
    config = json.loads(files["file:adapter_config.json"])
    for field, value in (("use_dora", True), ("peft_type", "IA3"), ("modules_to_save", ["lm_head"]),
                         ("lora_bias", True)):
        changed = dict(config, **{field: value})
        body = {"parameters": {
            "file:adapter_config.json": base64.b64encode(json.dumps(changed).encode()).decode(),
            "file:adapter_model.safetensors": base64.b64encode(files["file:adapter_model.safetensors"]).decode()}}
        status, answer = post(tiny, "/v2/repository/models/tiny_lora:odd/load", body)
        assert status == 400 and field in answer["error"], answer
    # Weights that are not a safetensors file (a header claiming more than the file holds).
    for junk in (b"junk", (1 << 40).to_bytes(8, "little") + b"{}"):
        body = {"parameters": {
            "file:adapter_config.json": base64.b64encode(files["file:adapter_config.json"]).decode(),
            "file:adapter_model.safetensors": base64.b64encode(junk).decode()}}
        status, answer = post(tiny, "/v2/repository/models/tiny_lora:odd/load", body)
        assert status == 400 and "adapter_model.safetensors" in answer["error"], answer
    # The request parameter must name an adapter.
    status, answer = post(tiny, "/v2/models/tiny_lora/generate", {"input_ids": PROMPTS[0], "lora": 7})
    assert status == 400 and "'lora'" in answer["error"], answer
    # A file that is not an adapter's, a bad name, a model without adapter inputs.
    body = {"parameters": {"file:1/model.onnx": base64.b64encode(b"x").decode()}}
    status, answer = post(tiny, "/v2/repository/models/tiny_lora:odd/load", body)
    assert status == 400 and "file:1/model.onnx" in answer["error"], answer
    status, answer = post(tiny, "/v2/repository/models/tiny_lora:..odd/load", {})
    assert status == 400 and "adapter name" in answer["error"], answer
    status, error = generate(tiny, PROMPTS[0], "../etc")
    assert status == 404 and "no adapter" in error, error
    # An adapter that is in neither the request nor the repository.
    status, answer = post(tiny, "/v2/repository/models/tiny_lora:absent/load", {})
    assert status == 404 and "adapter_config.json" in answer["error"], answer
    # The server serves on.
    assert generate(tiny, PROMPTS[1]) == (200, tiny.references[None][1])


SMOL_HP = {"layers": 30, "heads": 9, "kv_heads": 3, "head_dim": 64, "hidden": 576, "ffn": 1536,
           "vocab": 49152, "rope_base": 100000.0, "eps": 1e-5, "context": 8192}


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    from test_generation import link_model  # noqa: E402

    work = str(tmp_path_factory.mktemp("smol_lora"))
    repo = os.path.join(work, "repo")
    os.makedirs(repo)
    # The FP32 export (whose greedy answers do not depend on the batch or the prefix cache).
    link_model(repo, os.path.join(ROOT, "model_repository", "smollm2_decoder"))
    for name in ("smollm2", "llm_preprocessing", "llm_postprocessing"):
        link_model(repo, os.path.join(ROOT, "model_repository", name))
    adapter, _ = peft_adapter(work, "sql", SMOL_HP, targets=list(TARGETS), r=8, alpha=16, seed=4)
    server = Server(repo, "--model-control-mode", "explicit", "--load-model", "smollm2")
    server.adapter = adapter
    yield server
    server.stop()


def test_the_openai_client_chats_with_an_adapter_by_its_model_name(smol):
    client = openai.OpenAI(base_url=f"http://{smol.http}/v1", api_key="none")
    triton = httpclient.InferenceServerClient(smol.http)
    triton.load_model("smollm2:sql", files=files_of(smol.adapter))
    listed = {m.id: m for m in client.models.list().data}
    assert listed["smollm2:sql"].parent == "smollm2"
    assert list(listed)[:2] == ["smollm2", "smollm2:sql"]

    def ask(model):
        answer = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Name a colour."}],
            max_tokens=12, temperature=0)
        return answer.model, answer.choices[0].message.content

    # While a sequence runs with the adapter, vLLM's gauge names it (what the Gateway API
    # Inference Extension routes adapters by), read early in an answer of 200 tokens.
    stream = client.chat.completions.create(
        model="smollm2:sql", messages=[{"role": "user", "content": "Count."}], max_tokens=200,
        temperature=0, stream=True, extra_body={"ignore_eos": True})
    # The third chunk holding text: the first comes from the prefill, before the sequence joins
    # the batch; the third from the second decode step, after the first step's report.
    texts = (c for c in stream if c.choices and c.choices[0].delta.content)
    for _ in range(3):
        next(texts)
    info = [line for line in smol.metrics_text().splitlines()
            if line.startswith('vllm:lora_requests_info{model="smollm2_decoder"')]
    stream.close()
    assert len(info) == 1 and 'running_lora_adapters="sql"' in info[0] and 'max_lora="16"' in info[0], info
    base = ask("smollm2")
    adapted = ask("smollm2:sql")
    assert adapted[0] == "smollm2:sql"
    assert adapted[1] != base[1], "the adapter must change the answer"
    assert ask("smollm2:sql") == adapted, "greedy answers repeat"
    with pytest.raises(openai.NotFoundError) as e:
        ask("smollm2:nope")
    assert "nope" in str(e.value)
    triton.unload_model("smollm2:sql")
    assert "smollm2:sql" not in {m.id for m in client.models.list().data}
    with pytest.raises(openai.NotFoundError):
        ask("smollm2:sql")
    assert ask("smollm2") == base
