#!/usr/bin/env python3
"""What LoRA adapters cost the served SmolLM2 decoder (8-bit, adapter inputs on q_proj and
v_proj), side by side in one run:

  L  the limit: ms per decode step with ONNX Runtime called directly (2 threads, 134-token
     prompts, 40 steps) at 1 / 8 / 32 rows, for the export without adapter inputs, the served
     export with no adapter bound (one column of zeros), one rank-8 adapter on every row, and
     four rank-8 adapters spread over the rows (32 columns); medians of 3 rounds in turn;
  S  the server: output tokens/s of 128-token generate_stream answers at 1 / 8 / 32 streams
     (n-gram speculation off, so that how much an answer repeats itself does not decide), one
     server serving both exports (`smollm2_plain`: the export without adapter inputs), in turn:
     the plain export, the served export with every stream on the base model, every stream on
     one adapter, and the streams cycling through four adapters (`lora` request parameter) in
     one batch; means of 2 rounds.

Adapters are random (rank 8, alpha 16) in PEFT's file format, kept in the decoder's
`adapters/` folder of a copy of the repository. Writes benches/results/lora.json.

Usage: benches/lora_bench.py [--levels 1,8,32] [--only L,S]
Needs `make build-release models stages`.
"""
import argparse
import json
import os
import shutil
import struct
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))
import decoder_loop  # noqa: E402
import llm_bench  # noqa: E402

ROOT = llm_bench.ROOT
DECODER_DIR = os.path.join(ROOT, "model_repository", "smollm2_decoder")
SERVED = os.path.join(DECODER_DIR, "1", "model_q8.onnx")
LAYERS, HIDDEN, KV = 30, 576, 192
RANK, ADAPTERS = 8, 4
PROMPT, STEPS = 134, 40


def random_adapter(seed):
    """{(layer, module): (A [r, in], B [out, r])} as PEFT stores them."""
    rng = np.random.default_rng(seed)
    return {(i, m): (rng.uniform(-0.04, 0.04, (RANK, HIDDEN)).astype(np.float32),
                     rng.uniform(-0.3, 0.3, (out, RANK)).astype(np.float32))
            for i in range(LAYERS) for m, out in (("q_proj", HIDDEN), ("v_proj", KV))}


def write_peft(adapter, folder):
    """PEFT's adapter_config.json and adapter_model.safetensors (the format's header: its
    length, then JSON naming each tensor's type, shape and byte range)."""
    os.makedirs(folder, exist_ok=True)
    header, blobs, at = {}, [], 0
    for (i, m), (a, b) in sorted(adapter.items()):
        for side, t in (("A", a), ("B", b)):
            data = np.ascontiguousarray(t).tobytes()
            header[f"base_model.model.model.layers.{i}.self_attn.{m}.lora_{side}.weight"] = {
                "dtype": "F32", "shape": list(t.shape), "data_offsets": [at, at + len(data)]}
            blobs.append(data)
            at += len(data)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    with open(os.path.join(folder, "adapter_model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head + b"".join(blobs))
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": RANK, "lora_alpha": 2 * RANK,
                   "target_modules": ["q_proj", "v_proj"], "bias": "none"}, f)


def stacked(adapters):
    """The decoder's lora.{i}.{p}.a|b inputs for `adapters` side by side (B scaled)."""
    feeds = {}
    for i in range(LAYERS):
        for m in ("q_proj", "v_proj"):
            feeds[f"lora.{i}.{m}.a"] = np.concatenate([a[(i, m)][0].T for a in adapters], axis=1)
            feeds[f"lora.{i}.{m}.b"] = np.concatenate([a[(i, m)][1].T * 2.0 for a in adapters], axis=0)
    return feeds


def step_ms(path, rows, lora=None):
    loop = decoder_loop.DecoderLoop(path, threads=2, lora=lora)
    prompt = [100 + (i * 37) % 900 for i in range(PROMPT)]
    times = []
    loop.greedy([prompt] * rows, STEPS + 1, on_step=lambda _: times.append(time.perf_counter()))
    return (times[-1] - times[0]) / STEPS * 1000


def limit(levels, adapters, plain, rounds=3):
    one = stacked(adapters[:1])
    four = stacked(adapters)
    cases = {
        "no adapter inputs": (plain, None),
        "no adapter bound": (SERVED, None),
        "one adapter, every row": (SERVED, (one, lambda rows: np.ones((rows, 1, RANK), np.float32))),
        "four adapters, rows spread": (SERVED, (four, lambda rows: np.stack(
            [np.eye(ADAPTERS, dtype=np.float32)[r % ADAPTERS].repeat(RANK)[None] for r in range(rows)]))),
    }
    runs = {name: {r: [] for r in levels} for name in cases}
    for _ in range(rounds):
        for name, (path, lora) in cases.items():
            for r in levels:
                runs[name][r].append(step_ms(path, r, lora))
    out = {name: {r: float(np.median(v)) for r, v in per.items()} for name, per in runs.items()}
    for name, per in out.items():
        print("L", name, {r: f"{v:.1f}" for r, v in per.items()}, flush=True)
    return out


def server(levels, binary, repo, kinds, rounds=2):
    text, _ = llm_bench.prompt_text(128)
    body = {"text_input": text, "max_tokens": 128, "end_id": -1}
    proc, port = llm_bench.start(binary, repo)
    runs = {kind: {c: [] for c in levels} for kind in kinds}
    try:
        counter = iter(range(1 << 30))

        def call(kind):
            def one(port, model, b):
                n = next(counter)
                if kind == "no adapter inputs":
                    model = "smollm2_plain"
                if kind == "one adapter":
                    b = dict(b, lora="a0")
                elif kind == "four adapters":
                    b = dict(b, lora=f"a{n % ADAPTERS}")
                return llm_bench.one_stream(port, model, b)
            return one

        for kind in kinds:
            call(kind)(port, "smollm2", body)  # warm-up
        for c in levels:
            for _ in range(rounds):
                for kind in kinds:
                    runs[kind][c].append(llm_bench.load(port, "smollm2", body, c, call=call(kind))["tokens_per_s"])
            for kind in kinds:
                print("S", kind, c, f"{np.mean(runs[kind][c]):.1f} tok/s", runs[kind][c], flush=True)
    finally:
        llm_bench.stop(proc)
    return {kind: {c: float(np.mean(v)) for c, v in per.items()} for kind, per in runs.items()}


def repository(tmp, adapters, plain):
    """The smollm2 ensemble and its decoder (speculation off) with `adapters` in its adapters/
    folder, and the same as `smollm2_plain` with `plain` as its 8-bit file."""
    repo = os.path.join(tmp, "repo")
    for model in ("smollm2", "llm_preprocessing", "llm_postprocessing", "smollm2_decoder"):
        shutil.copytree(os.path.join(ROOT, "model_repository", model), os.path.join(repo, model),
                        ignore=shutil.ignore_patterns("model.onnx"))
    config = os.path.join(repo, "smollm2_decoder", "config.pbtxt")
    with open(config) as f:
        text = "".join(line for line in f if "speculative_config" not in line)
    with open(config, "w") as f:
        f.write(text)
    shutil.copytree(os.path.join(repo, "smollm2_decoder"), os.path.join(repo, "smollm2_plain_decoder"))
    shutil.copy(plain, os.path.join(repo, "smollm2_plain_decoder", "1", "model_q8.onnx"))
    shutil.copytree(os.path.join(repo, "smollm2"), os.path.join(repo, "smollm2_plain"))
    with open(os.path.join(repo, "smollm2", "config.pbtxt")) as f:
        ensemble = f.read().replace('model_name: "smollm2_decoder"', 'model_name: "smollm2_plain_decoder"')
    with open(os.path.join(repo, "smollm2_plain", "config.pbtxt"), "w") as f:
        f.write(ensemble)
    for k, adapter in enumerate(adapters):
        write_peft(adapter, os.path.join(repo, "smollm2_decoder", "adapters", f"a{k}"))
    return repo


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--levels", default="1,8,32")
    ap.add_argument("--only", default="L,S")
    ap.add_argument("--binary", default=os.path.join(ROOT, "target", "release", "wasmtron"))
    args = ap.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    adapters = [random_adapter(seed) for seed in range(ADAPTERS)]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        import gen_models
        import llm_export

        # The same 8-bit export without adapter inputs.
        plain = os.path.join(tmp, "plain")
        llm_export.from_gguf(gen_models.gguf_file(*gen_models.SMOLLM2), plain, accuracy_level=4,
                             eight_bit=True, shared_cache=True)
        plain = os.path.join(plain, "model.onnx")
        if "L" in args.only:
            results["L"] = limit(levels, adapters, plain)
        if "S" in args.only:
            results["S"] = server(levels, args.binary, repository(tmp, adapters, plain),
                                  ["no adapter inputs", "base", "one adapter", "four adapters"])
    os.makedirs(os.path.join(ROOT, "benches", "results"), exist_ok=True)
    with open(os.path.join(ROOT, "benches", "results", "lora.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
