#!/usr/bin/env bash
# The server's CPU per request, and its context switches per request, model by model: one
# release server on a repository, perf_analyzer at a fixed concurrency on each model in turn,
# the server's task clock and context switches (`perf stat -p`) over a 6 s window against the
# model's success count over the same window. Compares the runtime's own cost per request
# between kinds of models (a model.py against the same logic as a Rust stage), which latency
# alone hides on a machine whose client shares the cores. Loopback only.
#
#   REPO=/tmp/abrepo MODELS="add_sub add_sub_rs" CONCURRENCY=1 benches/server_cpu.sh
#
# Environment: REPO (a model repository), MODELS (models of it), CONCURRENCY (1), BIN (the
# release build), PORT (HTTP port; gRPC and metrics use the next two, default 18000).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
BIN="${BIN:-$root/target/release/wasmtron}"
REPO="${REPO:?a model repository}"
MODELS="${MODELS:?models of REPO}"
CONCURRENCY="${CONCURRENCY:-1}"
PORT="${PORT:-18000}"
PA="${PERF_ANALYZER:-$root/.cache/perf_analyzer/bin/perf_analyzer}"
export LD_LIBRARY_PATH="$root/.cache/perf_analyzer/cuda/nvidia/cuda_runtime/lib:${LD_LIBRARY_PATH:-}"
work="$(mktemp -d)"
"$BIN" --model-repository "$REPO" --http-address 127.0.0.1 --grpc-address 127.0.0.1 \
  --metrics-address 127.0.0.1 --http-port "$PORT" --grpc-port $((PORT + 1)) \
  --metrics-port $((PORT + 2)) >"$work/server.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null; rm -rf "$work"' EXIT
for _ in $(seq 120); do curl -sf "localhost:$PORT/v2/health/ready" >/dev/null && break; sleep 1; done
count() {
  curl -s "localhost:$PORT/v2/models/$1/stats" | python3 -c \
    'import json, sys; print(json.load(sys.stdin)["model_stats"][0]["inference_stats"]["success"]["count"])'
}
printf '%-16s %5s %10s %14s %12s %10s\n' model c "infer/s" "CPU us/req" "cs/req" "p50 us"
for m in $MODELS; do
  "$PA" -m "$m" -u "localhost:$((PORT + 1))" -i grpc --concurrency-range "$CONCURRENCY" \
    -p 12000 >"$work/pa_$m.log" 2>&1 &
  pa=$!
  sleep 3
  n0=$(count "$m")
  perf stat -x, -e context-switches,task-clock -p "$server" -o "$work/stat_$m" -- sleep 6
  n1=$(count "$m")
  wait $pa
  cs=$(awk -F, '/context-switches/ {print $1}' "$work/stat_$m")
  ms=$(awk -F, '/task-clock/ {print $1}' "$work/stat_$m")
  p50=$(awk '/p50 latency/ {print $3; exit}' "$work/pa_$m.log")
  python3 -c "n = $n1 - $n0; print('%-16s %5s %10.0f %14.1f %12.2f %10s' % ('$m', '$CONCURRENCY', n / 6, $ms * 1000 / n, $cs / n, '$p50'))"
done
