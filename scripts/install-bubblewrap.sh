#!/usr/bin/env bash
# Installs bubblewrap (bwrap) from Debian's archive when it is missing: the model converter runs
# inside it (no network, no file outside its scratch folder, user nobody; see
# docs/tenants-and-security.md). util-linux's setpriv, which drops to nobody, is part of Debian.
# Idempotent.
set -euo pipefail
if command -v bwrap >/dev/null && command -v setpriv >/dev/null; then
  exit 0
fi
if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
echo "installing bubblewrap"
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends bubblewrap util-linux >/dev/null 2>&1 \
  || { $SUDO apt-get update -q >/dev/null \
       && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends bubblewrap util-linux >/dev/null; }
command -v bwrap >/dev/null && command -v setpriv >/dev/null
