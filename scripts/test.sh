#!/usr/bin/env bash
# Install the test dependencies and run the whole test suite (the README's second command; CI runs it).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export DEBIAN_FRONTEND=noninteractive
need=()
for pkg in bubblewrap hyperfine redis-server memcached make netcat-openbsd socat gawk busybox; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
done
if [ ${#need[@]} -gt 0 ]; then
  apt-get update -qq && apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv 2>/dev/null || { apt-get install -y -qq python3-venv >/dev/null && "$PY" -m venv .venv; }
fi
.venv/bin/pip install -q --disable-pip-version-check -e '.[test]' 2>&1 | grep -v '^WARNING: Location' || true
exec .venv/bin/python -m pytest "$@"
