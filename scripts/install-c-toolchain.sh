#!/usr/bin/env bash
# Installs what C stages need from Debian's archive when it is missing: clang-19 and lld-19
# (compile and link for wasm32), wasi-libc (the preview1 sysroot) and the wasm32 compiler-rt.
# The bindings and the component step come from tools/componentize-c (built by cargo), so no
# `cargo install` of wit-bindgen-cli / wasm-tools is needed. Idempotent.
set -euo pipefail
PACKAGES="clang-19 lld-19 wasi-libc libclang-rt-19-dev-wasm32"
if command -v clang-19 >/dev/null && command -v wasm-ld-19 >/dev/null \
   && [ -d /usr/lib/wasm32-wasi ] && ls /usr/lib/llvm-19/lib/clang/19/lib/wasi/*.a >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
echo "installing the C stage toolchain: $PACKAGES"
# shellcheck disable=SC2086
$SUDO apt-get install -y -q $PACKAGES >/dev/null 2>&1 \
  || { $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q $PACKAGES >/dev/null; }
