#!/usr/bin/env bash
# Fetches the pinned ONNX Runtime shared library from the PyPI `onnxruntime` wheel (the only
# source reachable offline-from-the-internet here) into .cache/onnxruntime/lib, with the
# libonnxruntime.so / .so.1 names the loader expects. Idempotent.
set -euo pipefail
VERSION="${ORT_VERSION:-1.31.1}"
root="$(cd "$(dirname "$0")/.." && pwd)"
dest="$root/.cache/onnxruntime"
lib="$dest/lib/libonnxruntime.so.$VERSION"
if [ -f "$lib" ]; then exit 0; fi
mkdir -p "$dest/wheel" "$dest/lib"
PY="${PYTHON:-python3}"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 \
  --platform manylinux_2_28_x86_64 -d "$dest/wheel" "onnxruntime==$VERSION"
wheel=$(ls "$dest"/wheel/onnxruntime-"$VERSION"-*.whl | head -n1)
"$PY" - "$wheel" "$dest/lib" "$VERSION" <<'PY'
import sys, zipfile, os
wheel, out, version = sys.argv[1:]
name = f"onnxruntime/capi/libonnxruntime.so.{version}"
with zipfile.ZipFile(wheel) as z, open(os.path.join(out, os.path.basename(name)), "wb") as f:
    f.write(z.read(name))
PY
ln -sf "libonnxruntime.so.$VERSION" "$dest/lib/libonnxruntime.so.1"
ln -sf "libonnxruntime.so.$VERSION" "$dest/lib/libonnxruntime.so"
rm -rf "$dest/wheel"
echo "ONNX Runtime $VERSION -> $dest/lib"
