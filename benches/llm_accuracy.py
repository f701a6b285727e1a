#!/usr/bin/env python3
"""Greedy answers of the SmolLM2 decoders on 12 chat prompts, token for token: the served ONNX
exports (FP32, and 8-bit MatMulNBits with int8 compute) against each other and, when
llama-cpp-python is installed (`.venv-llama`, see benches/README.md), against llama.cpp on the
same Q4_1 GGUF. Prints, per prompt, whether the token lists are equal and where they part.

Usage: benches/llm_accuracy.py [--tokens 64] [--onnx name=path ...] [--llama .venv-llama/bin/python]
"""
import argparse
import json
import os
import subprocess
import sys

import numpy as np

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
GGUF = os.path.join(ROOT, ".cache", "gguf", "SmolLM2-135M-Instruct.Q4_1.gguf")
TOKENIZER = os.path.join(ROOT, "model_repository", "smollm2_decoder", "1", "tokenizer.json")
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain photosynthesis in one sentence.",
    "What is 12 times 7?",
    "Give me a name for a pet turtle.",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue?",
    "Write a short poem about autumn leaves.",
    "What does a compiler do?",
    "Name two planets with rings.",
    "How do I boil an egg?",
]
END = 2


def chat(text):
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def onnx_greedy(path, ids, count):
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import decoder_loop

    return decoder_loop.greedy(path, ids, count, end_ids=(END,))


LLAMA = r"""
import json, sys
from llama_cpp import Llama
prompts, count, gguf = json.loads(sys.stdin.read())
llm = Llama(model_path=gguf, n_ctx=1024, n_threads=2, verbose=False, logits_all=False)
answers = []
for ids in prompts:
    llm.reset()
    out = []
    for token in llm.generate(ids, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
        if token == llm.token_eos() or len(out) == count:
            break
        out.append(token)
    answers.append(out)
print(json.dumps(answers))
"""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--onnx", nargs="*", default=[
        "fp32=" + os.path.join(ROOT, "model_repository", "smollm2_decoder", "1", "model.onnx")])
    ap.add_argument("--llama", help="a python with llama_cpp (llama-cpp-python)")
    args = ap.parse_args()
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(TOKENIZER)
    prompts = [tok.encode(chat(p)).ids for p in PROMPTS]
    answers = {}
    for spec in args.onnx:
        name, path = spec.split("=", 1)
        answers[name] = [onnx_greedy(path, ids, args.tokens) for ids in prompts]
    if args.llama:
        out = subprocess.run([args.llama, "-c", LLAMA], input=json.dumps([prompts, args.tokens, GGUF]),
                             capture_output=True, text=True, check=True)
        answers["llama.cpp"] = json.loads(out.stdout.strip().splitlines()[-1])
    names = list(answers)
    base = names[0]
    for other in names[1:]:
        same = 0
        for i, (a, b) in enumerate(zip(answers[base], answers[other])):
            if a == b:
                same += 1
                continue
            part = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            print(f"{base} vs {other}, prompt {i}: parts at token {part}: "
                  f"{tok.decode(a[part:part + 8])!r} / {tok.decode(b[part:part + 8])!r}")
        print(f"{base} vs {other}: {same}/{len(prompts)} prompts token for token "
              f"({args.tokens} tokens or the end)")
    if len(names) > 2:
        for i, a in enumerate(names[1:]):
            for b in names[2 + i:]:
                same = sum(x == y for x, y in zip(answers[a], answers[b]))
                print(f"{a} vs {b}: {same}/{len(prompts)}")


if __name__ == "__main__":
    sys.exit(main())
