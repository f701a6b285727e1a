#!/usr/bin/env python3
"""Milliseconds per decode step of an exported decoder, ONNX Runtime called directly (2 threads):
`rows` identical 134-token prompts prefilled, then 40 steps of one token each, the cache fed
back (growing layout) or written in place through IO binding (shared-buffer layout).

Usage: benches/decode_step.py MODEL.onnx [MODEL.onnx ...] [--rows 1,8,32]
e.g. the cache layouts of the 8-bit SmolLM2 decoder:
    scripts/llm_export.py GGUF /tmp/growing --eight-bit --accuracy-level 4
    scripts/llm_export.py GGUF /tmp/shared --eight-bit --accuracy-level 4 --shared-cache
    scripts/llm_export.py GGUF /tmp/half --eight-bit --accuracy-level 4 --shared-cache --fp16-cache
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))
import decoder_loop  # noqa: E402

PROMPT, STEPS = 134, 40


def per_step_ms(path, rows):
    loop = decoder_loop.DecoderLoop(path, threads=2)
    prompt = [100 + (i * 37) % 900 for i in range(PROMPT)]
    times = []
    loop.greedy([prompt] * rows, STEPS + 1, on_step=lambda _: times.append(time.perf_counter()))
    return (times[-1] - times[0]) / STEPS * 1000


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="+")
    ap.add_argument("--rows", default="1,8,32")
    args = ap.parse_args()
    for path in args.models:
        figures = [f"{per_step_ms(path, int(r)):.1f}" for r in args.rows.split(",")]
        print(f"{path}: ms per step at {args.rows} rows: {' / '.join(figures)}", flush=True)


if __name__ == "__main__":
    main()
