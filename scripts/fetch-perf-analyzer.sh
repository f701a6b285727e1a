#!/usr/bin/env bash
# Fetches perf_analyzer 2.51 (the binary inside the tritonclient 2.51.0 manylinux1 wheel; newer
# ones need a newer glibc) and its runtime needs: Debian's libb64 and the CUDA runtime library
# from PyPI (it links libcudart even for CPU-only runs). Prints nothing when already present.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dest="$root/.cache/perf_analyzer"
PY="${PYTHON:-python3}"
if [ ! -x "$dest/bin/perf_analyzer" ]; then
  mkdir -p "$dest/wheel" "$dest/bin"
  "$PY" -m pip download -q --no-deps --only-binary=:all: --platform manylinux1_x86_64 \
    --python-version 3.11 -d "$dest/wheel" tritonclient==2.51.0
  "$PY" - "$dest" <<'PY'
import sys, zipfile, glob, os
dest = sys.argv[1]
wheel = glob.glob(os.path.join(dest, "wheel", "tritonclient-2.51.0-*.whl"))[0]
with zipfile.ZipFile(wheel) as z:
    data = z.read("tritonclient-2.51.0.data/data/bin/perf_analyzer")
path = os.path.join(dest, "bin", "perf_analyzer")
with open(path, "wb") as f:
    f.write(data)
os.chmod(path, 0o755)
PY
  rm -rf "$dest/wheel"
fi
if [ ! -d "$dest/cuda/nvidia" ]; then
  "$PY" -m pip install -q --no-deps --target "$dest/cuda" "nvidia-cuda-runtime-cu12==12.4.127"
fi
if ! ldconfig -p | grep -q 'libb64.so.0d'; then
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get install -y -q libb64-0d >/dev/null 2>&1 || { $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q libb64-0d >/dev/null; }
fi
