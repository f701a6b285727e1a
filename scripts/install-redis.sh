#!/usr/bin/env bash
# Installs redis-server from Debian's archive when it is missing: the response cache's Redis
# tests start their own (on a free loopback port, nothing saved to disk). Idempotent.
set -euo pipefail
if command -v redis-server >/dev/null; then
  exit 0
fi
if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
echo "installing redis-server"
# The package's own service is not wanted: the tests start redis-server themselves.
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends redis-server >/dev/null 2>&1 \
  || { $SUDO apt-get update -q >/dev/null \
       && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends redis-server >/dev/null; }
command -v redis-server >/dev/null
