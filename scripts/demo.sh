#!/usr/bin/env bash
# Install agnsup into .venv and run one demo cell (the README's first command).
# As root here; a normal user with user namespaces (and a delegated cgroup for limits) works too: README "Host support".
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv 2>/dev/null || { apt-get update -qq && apt-get install -y -qq python3-venv >/dev/null && "$PY" -m venv .venv; }
fi
.venv/bin/pip install -q --disable-pip-version-check . 2>&1 | grep -v '^WARNING: Location' || true
echo "== agnsup doctor"
.venv/bin/agnsup doctor || true
echo "== a demo cell: a daemon left behind by its command is gone when the cell ends"
.venv/bin/agnsup run --role executor -- sh -c 'echo "hello from cell $AGNSUP_CELL_ID"; echo "PATH=$PATH"; cat /proc/self/cgroup | grep -E "^0::|memory"; (setsid sleep 600 &); echo "left a daemon behind"'
echo "== its receipt"
.venv/bin/agnsup receipts | tail -n 1
