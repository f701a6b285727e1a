#!/usr/bin/env bash
# Installs Triton Inference Server 2.51 as the side-by-side baseline for benches/: the real
# tritonserver binary and python backend shipped in the PyPI `nvidia-pytriton` wheel (unpacked
# into .cache/triton, not installed: only the binary is used), and a virtual environment for
# its python-backend models with what Triton users put there (numpy < 2, as the backend's
# stub requires, Pillow, Hugging Face tokenizers, rapidocr-onnxruntime, and the same ONNX
# Runtime version wasmtron loads). Idempotent; a changed package list is installed into the
# existing venv.
#
# Run a model repository with `.cache/triton/run ARGS...` (tritonserver with its environment).
set -euo pipefail
PYTRITON_VERSION=0.7.0
ORT_VERSION="${ORT_VERSION:-1.31.1}"
root="$(cd "$(dirname "$0")/.." && pwd)"
dest="$root/.cache/triton"
packages="numpy==1.26.4 pillow==11.3.0 onnxruntime==$ORT_VERSION tokenizers==0.22.2
  opencv-python-headless==4.10.0.84 shapely==2.0.7 pyclipper==1.4.0 PyYAML==6.0.3 six==1.17.0"
# rapidocr-onnxruntime without its dependencies (it asks for opencv-python, which needs libGL).
no_deps="rapidocr-onnxruntime==1.4.4"
if [ -x "$dest/run" ] && [ "$(cat "$dest/venv/.packages" 2>/dev/null)" = "$packages" ]; then exit 0; fi
PY="${PYTHON:-python3}"
if [ -x "$dest/run" ]; then
  # shellcheck disable=SC2086
  "$dest/venv/bin/pip" install -q $packages && "$dest/venv/bin/pip" install -q --no-deps $no_deps &&
    echo "$packages" >"$dest/venv/.packages"
  exit 0
fi
mkdir -p "$dest/wheel"
"$PY" -m pip download -q --no-deps -d "$dest/wheel" "nvidia-pytriton==$PYTRITON_VERSION"
rm -rf "$dest/server"
"$PY" -m zipfile -e "$dest"/wheel/nvidia_pytriton-"$PYTRITON_VERSION"-*.whl "$dest/server"
rm -rf "$dest/wheel"
server="$dest/server/pytriton/tritonserver"
chmod +x "$server/bin/tritonserver" "$server"/python_backend_stubs/*/triton_python_backend_stub
# The python backend runs models in a stub process built for one Python version: ours.
pyver=$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
cp "$server/python_backend_stubs/$pyver/triton_python_backend_stub" "$server/backends/python/"
"$PY" -m venv "$dest/venv"
# shellcheck disable=SC2086
"$dest/venv/bin/pip" install -q $packages && "$dest/venv/bin/pip" install -q --no-deps $no_deps &&
  echo "$packages" >"$dest/venv/.packages"
pylib=$("$PY" -c 'import sysconfig; print(sysconfig.get_config_var("LIBDIR"))')
cat >"$dest/run" <<RUN
#!/usr/bin/env bash
# tritonserver with the python backend's environment: the venv first on PATH (the stub runs
# its python), libpython on the loader path.
export PATH="$dest/venv/bin:\$PATH"
export LD_LIBRARY_PATH="$pylib:\${LD_LIBRARY_PATH:-}"
exec "$server/bin/tritonserver" --backend-directory "$server/backends" "\$@"
RUN
chmod +x "$dest/run"
echo "Triton (nvidia-pytriton $PYTRITON_VERSION) -> $dest/run"
