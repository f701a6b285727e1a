#!/usr/bin/env python3
"""GPU serving against its limit, side by side in one run (issue 23).

Exports ResNet-50 and a MiniLM-shaped encoder (6 layers, 384 wide, 12 heads) with torch at
run time (random weights, fp32, dynamic batch), then measures:

* the limit: ONNX Runtime called in-process on the same device at fixed batch 1, 8 and 32
  (inputs made beforehand, outputs copied back every call, as a server must);
* wasmtron serving the same file (`KIND_GPU` x instances, `dynamic_batching` with the queue
  delay below, the shape buckets a GPU model gets by default) through perf_analyzer over gRPC
  at each concurrency;

and prints one Markdown table with the targets of issue 23: throughput at concurrency 32 and
64 at least 0.9 of in-process batch 32, latency at concurrency 1 within 1.2x of in-process
batch 1 plus the queue delay, and p99 within 2x p50 once READY (no cold shapes).

On a GPU host (see ../../../shared/tools/gpu-parts.sh for carrying ONNX Runtime's CUDA build
and the GPU build of the server; carry .cache/perf_analyzer as well):

    PYTHONPATH=/root/ort python3 benches/gpu/bench.py --wasmtron $S/wasmtron \\
        --perf-analyzer .cache/perf_analyzer/bin/perf_analyzer \\
        --ort-lib /root/ort/onnxruntime/capi/libonnxruntime.so.1.31.1 --out $OUT

`--device cpu` runs the same steps on the CPU provider (a dry run of the script; the figures
mean nothing there), `--onnx-dir` takes models exported beforehand (<dir>/<model>.onnx) instead
of exporting with torch.
"""
import argparse
import csv
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

import numpy as np

SEQ = 128  # the encoder's sequence length


def export_resnet50(path):
    import torch
    from torch import nn

    class Bottleneck(nn.Module):
        def __init__(self, cin, width, stride):
            super().__init__()
            cout = width * 4
            self.body = nn.Sequential(
                nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
                nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
                nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout))
            self.skip = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                         if stride != 1 or cin != cout else nn.Identity())

        def forward(self, x):
            return torch.relu(self.body(x) + self.skip(x))

    layers, cin = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
                   nn.MaxPool2d(3, 2, 1)], 64
    for width, blocks, stride in [(64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)]:
        for b in range(blocks):
            layers.append(Bottleneck(cin, width, stride if b == 0 else 1))
            cin = width * 4
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2048, 1000)]
    model = nn.Sequential(*layers).eval()
    torch.onnx.export(model, torch.randn(1, 3, 224, 224), path, input_names=["input"],
                      output_names=["output"], dynamic_axes={"input": {0: "batch"}, "output": {0: "batch"}},
                      opset_version=17, dynamo=False)


def export_encoder(path):
    import torch
    from torch import nn

    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.tokens = nn.Embedding(30522, 384)
            self.positions = nn.Embedding(512, 384)
            layer = nn.TransformerEncoderLayer(384, 12, 1536, batch_first=True, activation="gelu")
            self.layers = nn.TransformerEncoder(layer, 6, enable_nested_tensor=False)

        def forward(self, input_ids, attention_mask):
            at = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
            h = self.tokens(input_ids) + self.positions(at)
            return self.layers(h, src_key_padding_mask=attention_mask == 0)

    ids = torch.ones(1, SEQ, dtype=torch.int64)
    torch.onnx.export(Encoder().eval(), (ids, ids), path, input_names=["input_ids", "attention_mask"],
                      output_names=["last_hidden_state"],
                      dynamic_axes={"input_ids": {0: "batch"}, "attention_mask": {0: "batch"},
                                    "last_hidden_state": {0: "batch"}},
                      opset_version=17, dynamo=False)


MODELS = {
    "resnet50": {"export": export_resnet50, "unit": "img"},
    "encoder": {"export": export_encoder, "unit": "seq"},
}


def inputs_for(session, batch, rng):
    """One batch of inputs for every input of `session` (ids are small, masks all ones)."""
    feed = {}
    for i in session.get_inputs():
        # Dynamic dimensions: the batch first, then the sequence.
        shape = [d if isinstance(d, int) and d > 0 else (batch if k == 0 else SEQ) for k, d in enumerate(i.shape)]
        if "int64" in i.type:
            feed[i.name] = (np.ones(shape, np.int64) if "mask" in i.name
                            else rng.integers(0, 50, size=shape, dtype=np.int64))
        else:
            feed[i.name] = rng.standard_normal(shape).astype(np.float32)
    return feed


def in_process(path, device, batches, seconds):
    """Rows per second and ms per call of ONNX Runtime at each fixed batch size."""
    import onnxruntime as ort

    providers = ["CUDAExecutionProvider"] if device == "cuda" else ["CPUExecutionProvider"]
    session = ort.InferenceSession(path, providers=providers)
    if device == "cuda" and "CUDAExecutionProvider" not in session.get_providers():
        sys.exit("ONNX Runtime did not take the CUDA provider (is PYTHONPATH the GPU build?)")
    rng = np.random.default_rng(0)
    out = {}
    for batch in batches:
        feed = inputs_for(session, batch, rng)
        for _ in range(10):
            session.run(None, feed)
        calls, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            session.run(None, feed)
            calls += 1
        took = time.perf_counter() - start
        out[batch] = (batch * calls / took, 1e3 * took / calls)
    return out


def write_repository(repo, models, onnx_dir, device, instances, delay_us, max_batch):
    kind = "KIND_GPU" if device == "cuda" else "KIND_CPU"
    for name in models:
        os.makedirs(os.path.join(repo, name, "1"), exist_ok=True)
        shutil.copy(os.path.join(onnx_dir, name + ".onnx"), os.path.join(repo, name, "1", "model.onnx"))
        # Inputs and outputs come from the model (auto-complete); shape buckets are on by
        # default for GPU instances (powers of two up to max_batch_size).
        config = (f'backend: "onnxruntime"\nmax_batch_size: {max_batch}\n'
                  f"instance_group [ {{ count: {instances}, kind: {kind} }} ]\n"
                  f"dynamic_batching {{ max_queue_delay_microseconds: {delay_us} }}\n")
        with open(os.path.join(repo, name, "config.pbtxt"), "w") as f:
            f.write(config)


def start_server(binary, repo, ort_lib, log_path):
    args = [binary, "--model-repository", repo, "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0",
            "--http-address", "127.0.0.1", "--grpc-address", "127.0.0.1", "--metrics-address", "127.0.0.1"]
    if ort_lib:
        args += ["--onnxruntime-library", ort_lib]
    log = open(log_path, "w")
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 900
    while time.time() < deadline:
        text = open(log_path).read()
        if "Started Metrics Service" in text:
            grpc = re.search(r"Started GRPCInferenceService at (\S+)", text).group(1)
            http = re.search(r"Started HTTPService at (\S+)", text).group(1)
            return proc, grpc, http
        if proc.poll() is not None:
            sys.exit(f"wasmtron exited:\n{text}")
        time.sleep(0.5)
    proc.kill()
    sys.exit("wasmtron did not start in 15 minutes")


def perf(pa, name, grpc, concurrency, interval_ms, out_dir, extra):
    csv_path = os.path.join(out_dir, f"{name}-c{concurrency}.csv")
    args = [pa, "-m", name, "-i", "grpc", "-u", grpc, "--concurrency-range", f"{concurrency}:{concurrency}",
            "-s", "50", "--max-trials", "10", "-p", str(interval_ms), "--verbose-csv", "-f", csv_path] + extra
    env = dict(os.environ)
    cuda_rt = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(pa))), "cuda/nvidia/cuda_runtime/lib")
    env["LD_LIBRARY_PATH"] = cuda_rt + ":" + env.get("LD_LIBRARY_PATH", "")
    done = subprocess.run(args, capture_output=True, text=True, env=env)
    if done.returncode != 0 or not os.path.exists(csv_path):
        sys.exit(f"perf_analyzer failed for {name} at concurrency {concurrency}:\n{done.stdout}\n{done.stderr}")
    rows = list(csv.DictReader(open(csv_path)))
    if not rows:
        sys.exit(f"perf_analyzer did not stabilise for {name} at concurrency {concurrency}")
    row = rows[-1]
    return float(row["Inferences/Second"]), float(row["p50 latency"]) / 1e3, float(row["p99 latency"]) / 1e3


def server_figures(http, name):
    stats = json.load(urllib.request.urlopen(f"http://{http}/v2/models/{name}/stats"))["model_stats"][0]
    return stats.get("warmup", {}), stats["inference_count"], stats["execution_count"]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--wasmtron", required=True)
    p.add_argument("--perf-analyzer", required=True)
    p.add_argument("--ort-lib", help="libonnxruntime.so for the server (the GPU build on a GPU host)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--models", default="resnet50,encoder")
    p.add_argument("--onnx-dir", help="models exported beforehand as <dir>/<model>.onnx")
    p.add_argument("--out", default=None)
    p.add_argument("--concurrency", default="1,8,32,64")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--instances", type=int, default=2)
    p.add_argument("--queue-delay-us", type=int, default=2000)
    p.add_argument("--interval-ms", type=int, default=5000)
    p.add_argument("--seconds", type=float, default=5.0, help="per in-process batch size")
    a = p.parse_args()
    models = a.models.split(",")
    batches = [int(b) for b in a.batches.split(",")]
    levels = [int(c) for c in a.concurrency.split(",")]
    out = a.out or tempfile.mkdtemp(prefix="gpu-bench-")
    os.makedirs(out, exist_ok=True)
    onnx_dir = a.onnx_dir or os.path.join(out, "onnx")
    os.makedirs(onnx_dir, exist_ok=True)
    for name in models:
        path = os.path.join(onnx_dir, name + ".onnx")
        if not os.path.exists(path):
            print(f"exporting {name} with torch ...", flush=True)
            MODELS[name]["export"](path)

    limit = {}
    for name in models:
        print(f"in-process {name} on {a.device} ...", flush=True)
        limit[name] = in_process(os.path.join(onnx_dir, name + ".onnx"), a.device, batches, a.seconds)

    repo = os.path.join(out, "repository")
    write_repository(repo, models, onnx_dir, a.device, a.instances, a.queue_delay_us, max(batches))
    started = time.time()
    proc, grpc, http = start_server(a.wasmtron, repo, a.ort_lib, os.path.join(out, "server.log"))
    ready_s = time.time() - started
    served = {}
    try:
        for name in models:
            extra = ["--input-data", "zero"] if name == "encoder" else []
            extra += [f"--shape={i}:{SEQ}" for i in ("input_ids", "attention_mask")] if name == "encoder" else []
            for c in levels:
                print(f"wasmtron {name} at concurrency {c} ...", flush=True)
                served[(name, c)] = perf(a.perf_analyzer, name, grpc, c, a.interval_ms, out, extra)
            served[name] = server_figures(http, name)
    finally:
        proc.terminate()
        proc.wait(timeout=60)

    lines = [f"device: {a.device}, {a.instances} instances, max_queue_delay {a.queue_delay_us} us, "
             f"server ready in {ready_s:.1f} s (load and warm-up of every model)", ""]
    lines += ["| model | run | rows/s | ms per call (p50) | p99 ms | vs in-process b32 |", "|---|---|---|---|---|---|"]
    verdicts = []
    for name in models:
        unit = MODELS[name]["unit"]
        top = limit[name][max(batches)][0]
        for b in batches:
            rate, ms = limit[name][b]
            lines.append(f"| {name} | in-process batch {b} | {rate:,.0f} {unit}/s | {ms:.2f} | | {rate / top:.2f} |")
        for c in levels:
            rate, p50, p99 = served[(name, c)]
            lines.append(f"| {name} | wasmtron concurrency {c} | {rate:,.0f} {unit}/s | {p50:.2f} | {p99:.2f} | {rate / top:.2f} |")
            if c >= 32:
                verdicts.append((f"{name} c{c} throughput >= 0.9 of in-process b32", rate >= 0.9 * top))
            verdicts.append((f"{name} c{c} p99 <= 2x p50", p99 <= 2 * p50))
        if 1 in levels and 1 in limit[name]:
            bound = 1.2 * (limit[name][1][1] + a.queue_delay_us / 1e3)
            verdicts.append((f"{name} c1 p50 <= 1.2x (in-process b1 + queue delay) = {bound:.2f} ms",
                             served[(name, 1)][1] <= bound))
        warm, count, execs = served[name]
        lines.append(f"| {name} | server statistics | {count:,} rows in {execs:,} executions "
                     f"(mean batch {count / max(execs, 1):.1f}); warm-up {warm.get('count', 0)} runs, "
                     f"{warm.get('ns', 0) / 1e9:.1f} s | | | |")
    lines += [""] + [f"- {'PASS' if ok else 'FAIL'}: {what}" for what, ok in verdicts]
    report = "\n".join(lines)
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(report + "\n")
    print("\n" + report + f"\n\nresults in {out}")


if __name__ == "__main__":
    main()
