#!/usr/bin/env python3
"""Text generation side by side: streams of ~128-token prompts each generating exactly 128
tokens (no end token), at 1 / 8 / 32 concurrent streams, over Triton's generate_stream (SSE):

  A  Triton 2.51's python backend: benches/triton/model_repository/llm_generate, a
     per-request generate loop in onnxruntime (what a Triton user writes without TensorRT-LLM);
  B  wasmtron: the `smollm2` ensemble (Wasm tokenizer -> generation backend with in-flight
     batching -> Wasm detokenizer);
  L  the limit: the same ONNX decoder called in-process by onnxruntime, a batched greedy
     decode loop at the same batch sizes (prefill, then one run per step for all sequences);
  C  llama.cpp's server on the same model's Q4_1 GGUF and the same cores, over its OpenAI
     /v1/completions stream (`--llama-server PATH` for llama.cpp's own `llama-server` with as
     many parallel slots as streams, else llama-cpp-python's server from `--llama-python`);
  O  wasmtron over the same /v1/completions stream, for C to be compared with;
  P  prefix caching: pairs of chat requests sharing a ~1,000-token system prompt (a new one per
     pair), each answered 16 tokens; the time to first token of the second against the first;
  J  wasmtron as B, each request constrained to a JSON schema (guided decoding: a list of at
     least 40 {name, city, age} objects, so that all 128 tokens are under the grammar), run on
     the same server right after B at each level: J/B is what constrained decoding costs.

Reports output tokens/s, time to first token p50/p99 and inter-token latency p50/p99 per
level, wasmtron's RSS at the end of its highest level and its peak (VmHWM), and writes benches/results/llm.json.

Usage: benches/llm_bench.py [--levels 1,8,32] [--tokens 128] [--only A,B,L,J,P]
Needs `make build-release models stages triton`.
"""
import argparse
import http.client
import itertools
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import numpy as np

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
REPO = os.path.join(ROOT, "model_repository")
DECODER = os.path.join(REPO, "smollm2_decoder", "1", "model.onnx")
TOKENIZER = os.path.join(REPO, "smollm2_decoder", "1", "tokenizer.json")
SENTENCE = "The river runs past the old mill, through the meadow and under the stone bridge. "
PEOPLE = {
    "type": "object",
    "properties": {"people": {"type": "array", "minItems": 40, "items": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "city": {"type": "string"},
                       "age": {"type": "integer"}},
        "required": ["name", "city", "age"], "additionalProperties": False}}},
    "required": ["people"], "additionalProperties": False,
}


def prompt_text(tokens):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(TOKENIZER)
    body = ""
    while True:
        text = f"<|im_start|>user\nSummarise this: {body}<|im_end|>\n<|im_start|>assistant\n"
        if len(tok.encode(text).ids) >= tokens:
            return text, len(tok.encode(text).ids)
        body += SENTENCE


def free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    found = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return found


def start(binary, repo, env=None):
    http_port, grpc, metrics = free_ports(3)
    proc = subprocess.Popen([binary, "--model-repository", repo, "--http-port", str(http_port),
                             "--grpc-port", str(grpc), "--metrics-port", str(metrics),
                             "--http-address", "127.0.0.1", "--grpc-address", "127.0.0.1",
                             "--metrics-address", "127.0.0.1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    deadline = time.time() + 600
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v2/health/ready", timeout=5) as r:
                if r.status == 200:
                    return proc, http_port
        except OSError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"{binary} not ready within 600 s")


def stop(proc):
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


REQUESTS = itertools.count()


def post(port, path, body):
    """(connection, response, when it was sent) of a POST of `body` as JSON; a status other
    than 200 raises with the answer."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    started = time.perf_counter()
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(resp.read().decode())
    return conn, resp, started


def one_stream(port, model, body, fresh=True):
    """(time to first token, gaps between tokens, tokens) of one generate_stream call. A fresh
    prompt starts with the request's number, so that no request reuses another's prefill
    (prompt caches off, as for every server compared)."""
    if fresh and "text_input" in body:
        body = dict(body, text_input=f"{next(REQUESTS)}. {body['text_input']}")
    conn, resp, started = post(port, f"/v2/models/{model}/generate_stream", body)
    times = []
    for line in resp:
        if line.startswith(b"data: "):
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"])
            # One event per generated token (the last may only carry the finish reason).
            if event.get("text_output", "") != "" or not event.get("finish_reason"):
                times.append(time.perf_counter())
    conn.close()
    return times[0] - started, [b - a for a, b in zip(times, times[1:])], len(times)


def one_openai_stream(port, model, body, fresh=True):
    """(time to first token, gaps, tokens) of one streamed /v1/completions call."""
    if fresh:
        body = dict(body, prompt=f"{next(REQUESTS)}. {body['prompt']}")
    conn, resp, started = post(port, "/v1/completions", dict(body, model=model, stream=True))
    times = []
    for line in resp:
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
            continue
        event = json.loads(line[6:])
        if "error" in event:
            raise RuntimeError(event["error"])
        if any(c.get("text") for c in event.get("choices", [])):
            times.append(time.perf_counter())
    conn.close()
    return times[0] - started, [b - a for a, b in zip(times, times[1:])], len(times)


def load(port, model, body, streams, rounds=2, call=None):
    """Every stream sends `rounds` requests back to back; returns the level's figures."""
    ttfts, gaps, tokens = [], [], 0
    errors = []
    lock = threading.Lock()

    def worker():
        nonlocal tokens
        for _ in range(rounds):
            try:
                ttft, g, n = (call or one_stream)(port, model, body)
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(str(e))
                return
            with lock:
                ttfts.append(ttft)
                gaps.extend(g)
                tokens += n

    started = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - started
    if errors:
        raise SystemExit(f"{model}: {errors[0]}")
    return figures(tokens / elapsed, ttfts, gaps)


def pct(values, p):
    return float(np.percentile(values, p)) * 1000 if values else float("nan")


def figures(rate, ttfts, gaps):
    return {"tokens_per_s": rate, "ttft_p50_ms": pct(ttfts, 50), "ttft_p99_ms": pct(ttfts, 99),
            "itl_p50_ms": pct(gaps, 50), "itl_p99_ms": pct(gaps, 99)}


def in_process(prompt_tokens, tokens, streams):
    """The batched decode loop, in-process: prefill `streams` prompts, then `tokens` steps."""
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import decoder_loop
    from tokenizers import Tokenizer

    loop = decoder_loop.DecoderLoop(DECODER)
    ids = Tokenizer.from_file(TOKENIZER).encode(prompt_tokens).ids
    times = []
    started = time.perf_counter()
    loop.greedy([ids] * streams, tokens, on_step=lambda _: times.append(time.perf_counter()))
    gaps = [b - a for a, b in zip(times, times[1:])]
    return figures(streams * tokens / (times[-1] - started), [times[0] - started], gaps)


def prefix_pairs(port, pairs=5):
    """TTFTs (ms) of first and second requests on a shared ~1,000-token system prompt."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(TOKENIZER)
    firsts, seconds = [], []
    for pair in range(pairs):
        system = f"Notes, set {pair}. "
        while len(tok.encode(system).ids) < 1000:
            system += SENTENCE
        for i, question in enumerate(("Summarise the notes.", "What runs under the bridge?")):
            messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
            body = {"messages": json.dumps(messages), "max_tokens": 16, "temperature": 0}
            ttft, _, _ = one_stream(port, "smollm2", body, fresh=False)
            (firsts if i == 0 else seconds).append(ttft * 1000)
    return {"first_ttft_ms": statistics.median(firsts), "second_ttft_ms": statistics.median(seconds),
            "prompt_tokens": len(tok.encode(system).ids)}


def rss_mib(pid, field="VmRSS"):
    """The process's resident size now (VmRSS), or at its peak so far (VmHWM), in MiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--levels", default="1,8,32")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--only", default="A,B,L")
    ap.add_argument("--max-prefill-tokens", type=int, help="the decoder's max_prefill_tokens for B")
    ap.add_argument("--decoder", help="another model.onnx for B/O/J (e.g. the 8-bit export)")
    ap.add_argument("--no-prefix-cache", action="store_true",
                    help="prefix_cache_max_tokens 0 for wasmtron, and llama.cpp's prompt cache off "
                    "(without it: both servers' defaults)")
    ap.add_argument("--speculative-config", help="vLLM's speculative_config JSON for wasmtron's decoder (B/O/J), "
                    "instead of the repository's")
    ap.add_argument("--no-speculation", action="store_true",
                    help="wasmtron's decoder without the repository's n-gram speculation")
    ap.add_argument("--llama-server", help="llama.cpp's llama-server binary for C")
    ap.add_argument("--llama-python", default=os.path.join(ROOT, ".venv-llama", "bin", "python"),
                    help="a python with llama-cpp-python[server] for C")
    ap.add_argument("--binary", default=os.path.join(ROOT, "target", "release", "wasmtron"),
                    help="the wasmtron binary for B/J/O/P (e.g. another commit's, side by side)")
    args = ap.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    only = set(args.only.split(","))
    text, prompt_len = prompt_text(args.prompt_tokens)
    print(f"prompt: {prompt_len} tokens; {args.tokens} generated per request", flush=True)
    results = {"prompt_tokens": prompt_len, "generated_tokens": args.tokens, "levels": levels}
    tmp = tempfile.mkdtemp()
    try:
        if only & {"B", "J", "P", "O"}:
            repo = os.path.join(tmp, "wasmtron")
            os.makedirs(repo)
            for m in ("smollm2", "llm_preprocessing", "llm_postprocessing", "smollm2_decoder"):
                shutil.copytree(os.path.join(REPO, m), os.path.join(repo, m))
            decoder_config = os.path.join(repo, "smollm2_decoder", "config.pbtxt")
            if args.decoder:
                # Served as model.onnx, instead of the file the repository names.
                with open(decoder_config) as f:
                    config = re.sub(r'(?m)^default_model_filename:.*\n', "", f.read())
                with open(decoder_config, "w") as f:
                    f.write(config)
                os.remove(os.path.join(repo, "smollm2_decoder", "1", "model.onnx"))
                shutil.copy(args.decoder, os.path.join(repo, "smollm2_decoder", "1", "model.onnx"))
            if args.no_speculation or args.speculative_config:
                with open(decoder_config) as f:
                    config = re.sub(r'(?m)^parameters \{ key: "speculative_config".*\n', "", f.read())
                with open(decoder_config, "w") as f:
                    f.write(config)
            if args.speculative_config:
                with open(os.path.join(repo, "smollm2_decoder", "config.pbtxt"), "a") as f:
                    f.write(f'parameters {{ key: "speculative_config" value {{ string_value: '
                            f'{json.dumps(args.speculative_config)} }} }}\n')
            if args.no_prefix_cache:
                with open(os.path.join(repo, "smollm2_decoder", "config.pbtxt"), "a") as f:
                    f.write('parameters { key: "prefix_cache_max_tokens" value { string_value: "0" } }\n')
            if args.max_prefill_tokens:
                with open(os.path.join(repo, "smollm2_decoder", "config.pbtxt"), "a") as f:
                    f.write('parameters { key: "max_prefill_tokens" value { string_value: "%d" } }\n'
                            % args.max_prefill_tokens)
            proc, port = start(args.binary, repo)
            body = {"text_input": text, "max_tokens": args.tokens, "end_id": -1}
            guided = dict(body, guided_decoding_guide_type="json_schema",
                          guided_decoding_guide=json.dumps(PEOPLE))
            # The same requests as C's: no end token (a -100 bias), greedy.
            openai_body = {"prompt": text, "max_tokens": args.tokens, "temperature": 0,
                           "logit_bias": {"2": -100}}
            if "O" in only:
                one_openai_stream(port, "smollm2", openai_body)
                results["O"] = {}
                for c in levels:
                    results["O"][c] = load(port, "smollm2", openai_body, c, call=one_openai_stream)
                    print("O", c, results["O"][c], flush=True)
            for key, b in (("B", body), ("J", guided)):
                if key in only:
                    one_stream(port, "smollm2", b)  # warm-up
                    results[key] = {}
            for c in levels:
                for key, b in (("B", body), ("J", guided)):
                    if key in only:
                        results[key][c] = load(port, "smollm2", b, c)
                        print(key, c, results[key][c], flush=True)
            if "P" in only:
                results["P"] = prefix_pairs(port)
                p = results["P"]
                print(f"prefix caching: TTFT first {p['first_ttft_ms']:.0f} ms, second "
                      f"{p['second_ttft_ms']:.0f} ms ({p['second_ttft_ms'] / p['first_ttft_ms']:.2f}x), "
                      f"~{p['prompt_tokens']}-token system prompt", flush=True)
            results["B_rss_mib"] = rss_mib(proc.pid)
            results["B_peak_rss_mib"] = rss_mib(proc.pid, "VmHWM")
            print(f"wasmtron RSS after {levels[-1]} streams: {results['B_rss_mib']:.0f} MiB, peak "
                  f"{results['B_peak_rss_mib']:.0f} MiB", flush=True)
            stop(proc)
        if "A" in only:
            repo = os.path.join(tmp, "triton")
            shutil.copytree(os.path.join(ROOT, "benches", "triton", "model_repository", "llm_generate"),
                            os.path.join(repo, "llm_generate"))
            os.symlink(DECODER, os.path.join(repo, "llm_generate", "1", "model.onnx"))
            shutil.copy(TOKENIZER, os.path.join(repo, "llm_generate", "1", "tokenizer.json"))
            shutil.copy(os.path.join(ROOT, "scripts", "decoder_loop.py"), os.path.join(repo, "llm_generate", "1"))
            proc, port = start(os.path.join(ROOT, ".cache", "triton", "run"), repo)
            body = {"text_input": text, "max_tokens": args.tokens}
            one_stream(port, "llm_generate", body)
            results["A"] = {}
            for c in levels:
                results["A"][c] = load(port, "llm_generate", body, c, rounds=1)
                print("A", c, results["A"][c], flush=True)
            stop(proc)
        if "C" in only:
            http_port = free_ports(1)[0]
            gguf = os.path.join(ROOT, ".cache", "gguf", "SmolLM2-135M-Instruct.Q4_1.gguf")
            body = {"prompt": text, "max_tokens": args.tokens, "temperature": 0,
                    "logit_bias": {"2": -100}}
            if args.no_prefix_cache:
                body["cache_prompt"] = False
            results["C"] = {}
            for c in levels:
                # Prompt caching off; one slot per stream, each with room for its request.
                if args.llama_server:
                    cmd = [args.llama_server, "-m", gguf, "-t", "2", "-np", str(c), "-c",
                           str(c * 512), "--host", "127.0.0.1", "--port", str(http_port)]
                    if args.no_prefix_cache:
                        cmd += ["--cache-reuse", "0", "--no-cache-prompt"]
                else:
                    cmd = [args.llama_python, "-m", "llama_cpp.server", "--model", gguf,
                           "--n_threads", "2", "--n_ctx", "1024", "--host", "127.0.0.1",
                           "--port", str(http_port)]
                proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                deadline = time.time() + 300
                while True:
                    try:
                        one_openai_stream(http_port, "smollm2", dict(body, max_tokens=2))
                        break
                    except (OSError, RuntimeError):
                        if time.time() > deadline or proc.poll() is not None:
                            raise SystemExit(f"llama.cpp did not start: {cmd}")
                        time.sleep(0.5)
                results["C"][c] = load(http_port, "smollm2", body, c, rounds=1 if c > 1 else 2,
                                       call=one_openai_stream)
                results["C"][c]["rss_mib"] = rss_mib(proc.pid)
                results["C"][c]["peak_rss_mib"] = rss_mib(proc.pid, "VmHWM")
                print("C", c, results["C"][c], flush=True)
                stop(proc)
        if "L" in only:
            results["L"] = {}
            for c in levels:
                results["L"][c] = in_process(text, args.tokens, c)
                print("L", c, results["L"][c], flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(os.path.join(ROOT, "benches", "results"), exist_ok=True)
    with open(os.path.join(ROOT, "benches", "results", "llm.json"), "w") as f:
        json.dump(results, f, indent=1)
    print("\n| streams | server | output tok/s | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) |")
    print("|---|---|---|---|---|")
    for c in levels:
        for key, name in (("A", "Triton python backend"), ("B", "wasmtron"),
                          ("J", "wasmtron, JSON schema"), ("O", "wasmtron, /v1/completions"),
                          ("C", "llama.cpp, /v1/completions"), ("L", "ORT in-process, batched")):
            if key in results:
                r = results[key][c]
                print(f"| {c} | {name} | {r['tokens_per_s']:.0f} | {r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f} "
                      f"| {r['itl_p50_ms']:.1f} / {r['itl_p99_ms']:.1f} |")
    for c in levels:
        line = f"streams {c}:"
        if "A" in results and "B" in results:
            line += f" B/A = {results['B'][c]['tokens_per_s'] / results['A'][c]['tokens_per_s']:.2f}x"
        if "L" in results and "B" in results:
            line += f" B/L = {results['B'][c]['tokens_per_s'] / results['L'][c]['tokens_per_s']:.2f}"
        if "O" in results and "C" in results:
            line += f" O/C = {results['O'][c]['tokens_per_s'] / results['C'][c]['tokens_per_s']:.2f}x"
        if "J" in results and "B" in results:
            line += f" J/B = {results['J'][c]['tokens_per_s'] / results['B'][c]['tokens_per_s']:.2f}"
        print(line)


if __name__ == "__main__":
    sys.exit(main())
