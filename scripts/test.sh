#!/usr/bin/env bash
# Install the test dependencies and run the whole test suite (the README's second command; CI runs it).
# V2LANE=1 adds the pure cgroup-v2 lane afterwards (see the end).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export DEBIAN_FRONTEND=noninteractive
need=()
for pkg in bubblewrap hyperfine redis-server memcached make netcat-openbsd socat gawk busybox curl wget git util-linux iproute2 \
           tmux openssh-client gnupg e2fsprogs xfsprogs btrfs-progs; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
done
if [ ${#need[@]} -gt 0 ]; then
  apt-get update -qq && apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv 2>/dev/null || { apt-get install -y -qq python3-venv >/dev/null && "$PY" -m venv .venv; }
fi
.venv/bin/pip install -q --disable-pip-version-check -e '.[test]' 2>&1 | grep -v '^WARNING: Location' || true
# V2LANE=1: after the host suite, the pure cgroup-v2 lane in a guest kernel under QEMU (scripts/v2lane;
# docs/hosts.md "Lanes"), with V2LANE_ARGS as its options (e.g. "-k 6.1", "--systemd").
if [ "${V2LANE:-0}" = 0 ]; then
  exec .venv/bin/python -m pytest "$@"
fi
rc=0
.venv/bin/python -m pytest "$@" || rc=$?
# CI_DEADLINE (epoch seconds, .ci/run sets it): the lane gets what is left as its --budget, and a lane
# with under 5 minutes left does not start (named, not passed)
budget=()
if [ -n "${CI_DEADLINE:-}" ]; then
  left=$(( CI_DEADLINE - $(date +%s) ))
  if [ "$left" -lt 300 ]; then
    echo "test.sh: BUDGET: the pure cgroup-v2 lane did not run: ${left} s left of CI's time budget (CI_DEADLINE); the host suite's result stands" >&2
    exit "$rc"
  fi
  budget=(--budget "$left")
fi
# shellcheck disable=SC2086 # V2LANE_ARGS is a list of options
lane=0
bash scripts/v2lane ${V2LANE_ARGS:-} "${budget[@]}" || lane=$?
# 77: no v2guest tool on this machine: named (v2lane's ENV_BLOCKED line), not a failure of the code
if [ "$lane" = 77 ]; then
  echo "test.sh: ENV_BLOCKED: the pure cgroup-v2 lane did not run here (no v2guest tool); the host suite's result stands" >&2
elif [ "$lane" != 0 ]; then
  rc=$lane
fi
exit "$rc"
