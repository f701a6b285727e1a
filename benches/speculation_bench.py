#!/usr/bin/env python3
"""N-gram (prompt-lookup) speculation against plain decoding, one stream, greedy: the same
decoder served twice from one server (`smol_plain`, and `smol_spec` with vLLM's
`speculative_config`), each prompt asked of both in alternation, rounds x prompts; output
tokens/s per prompt kind, the draft tokens greedy decoding confirmed, and whether the answers
are the same token for token.

Usage: benches/speculation_bench.py [--decoder FILE] [--tokens 128] [--rounds 3]
       [--spec '{"method": "ngram", "num_speculative_tokens": 4, ...}']
(after `make build-release models`; the release binary).
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import tokenizers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "python"))
from conftest import Server  # noqa: E402
import test_generation  # noqa: E402
from test_generation import SMOL, chat, link_model, metric, without_speculation  # noqa: E402

CODE = '''def load(path):
    with open(path) as f:
        rows = [line.strip().split(",") for line in f]
    header, body = rows[0], rows[1:]
    return [dict(zip(header, row)) for row in body]


def total(rows, column):
    return sum(float(row[column]) for row in rows)


def average(rows, column):
    return total(rows, column) / len(rows)
'''
ARTICLE = ("The city council met on Tuesday to discuss the new bus routes. Council member Ana "
           "Lopez said the routes would connect the north side to the hospital and the college. "
           "The routes start in March. Buses will run every fifteen minutes during the day and "
           "every thirty minutes at night. Tickets stay at two dollars.")
PROMPTS = {
    "code edit": f"Rename the function total to column_sum everywhere in this code and print the whole code:\n{CODE}",
    "quoting summary": f"Summarise this article, quoting its key sentences word for word:\n{ARTICLE}",
    "copy": f"Repeat this text exactly: {ARTICLE}",
    "open question": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}


def generate(server, model, ids, max_tokens):
    """(tokens, seconds) of one streamed request."""
    start = time.perf_counter()
    tokens = test_generation.generate(server, model, ids, max_tokens=max_tokens)[0]
    return tokens, time.perf_counter() - start


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--decoder", default=None, help="ONNX file served instead of the repository's model.onnx")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--spec", default=json.dumps({"method": "ngram", "num_speculative_tokens": 4,
                                                  "prompt_lookup_max": 4, "prompt_lookup_min": 2}))
    ap.add_argument("--binary", default=os.path.join(ROOT, "target", "release", "wasmtron"))
    args = ap.parse_args()
    tokenizer = tokenizers.Tokenizer.from_file(os.path.join(SMOL, "1", "tokenizer.json"))
    with tempfile.TemporaryDirectory() as repo:
        extra = ('parameters { key: "prefix_cache_max_tokens" value { string_value: "0" } }\n')
        link_model(repo, SMOL, "smol_plain", lambda t: without_speculation(t) + extra)
        link_model(repo, SMOL, "smol_spec", lambda t: without_speculation(t) + extra + (
            f'parameters {{ key: "speculative_config" value {{ string_value: {json.dumps(args.spec)} }} }}\n'))
        if args.decoder:
            for model in ("smol_plain", "smol_spec"):
                os.remove(os.path.join(repo, model, "1", "model.onnx"))
                os.symlink(os.path.abspath(args.decoder), os.path.join(repo, model, "1", "model.onnx"))
        server = Server(repo, binary=args.binary)
        try:
            warm = tokenizer.encode(chat("Hello")).ids
            generate(server, "smol_plain", warm, 8)
            generate(server, "smol_spec", warm, 8)
            print(f"speculative_config {args.spec}, {args.tokens} tokens, {args.rounds} rounds, one stream")
            print("| prompt | plain tok/s | ngram tok/s | speed-up | accepted / draft tokens | same tokens |")
            print("|---|---|---|---|---|---|")
            for kind, prompt in PROMPTS.items():
                ids = tokenizer.encode(chat(prompt)).ids
                rates = {"smol_plain": [], "smol_spec": []}
                answers = {}
                drafted = metric(server, "vllm:spec_decode_num_draft_tokens_total", "smol_spec")
                accepted = metric(server, "vllm:spec_decode_num_accepted_tokens_total", "smol_spec")
                for _ in range(args.rounds):
                    for model in rates:
                        tokens, elapsed = generate(server, model, ids, args.tokens)
                        rates[model].append(len(tokens) / elapsed)
                        answers.setdefault(model, tokens)
                drafted = metric(server, "vllm:spec_decode_num_draft_tokens_total", "smol_spec") - drafted
                accepted = metric(server, "vllm:spec_decode_num_accepted_tokens_total", "smol_spec") - accepted
                plain, spec = (statistics.median(rates[m]) for m in ("smol_plain", "smol_spec"))
                same = answers["smol_plain"] == answers["smol_spec"]
                print(f"| {kind} ({len(ids)} prompt tokens, {len(answers['smol_plain'])} answered) | {plain:.0f} | "
                      f"{spec:.0f} | {spec / plain:.2f}x | {accepted:.0f} / {drafted:.0f} | {'yes' if same else 'NO'} |",
                      flush=True)
        finally:
            server.stop()


if __name__ == "__main__":
    main()
