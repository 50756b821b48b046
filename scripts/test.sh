#!/usr/bin/env bash
# Install the test dependencies and run the whole test suite (the README's second command; CI runs it).
# V2LANE=1 adds the pure cgroup-v2 lane afterwards (see the end).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export DEBIAN_FRONTEND=noninteractive
need=()
# docker.io (with containerd and runc) and debootstrap: the container lane (tests/test_docker.py,
# tests/containers.py), which starts a Docker daemon of its own with no networking of its own
for pkg in bubblewrap hyperfine redis-server memcached make netcat-openbsd socat gawk busybox curl wget git util-linux iproute2 \
           tmux openssh-client gnupg e2fsprogs xfsprogs btrfs-progs docker.io containerd runc debootstrap; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
done
if [ ${#need[@]} -gt 0 ]; then
  # docker.io and containerd start their system daemons when installed, and a system dockerd makes a bridge
  # and iptables rules: a policy-rc.d that refuses every start (exit 101, invoke-rc.d(8); deb-systemd-invoke
  # honours it too) keeps them stopped. Written only where there is none, and removed after.
  rcd=""
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\n# scripts/test.sh: no daemon starts while it installs packages\nexit 101\n' > /usr/sbin/policy-rc.d
    chmod 0755 /usr/sbin/policy-rc.d
    rcd=/usr/sbin/policy-rc.d
  fi
  apt_rc=0
  { apt-get update -qq && apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null; } || apt_rc=$?
  [ -z "$rcd" ] || rm -f "$rcd"
  [ "$apt_rc" = 0 ] || exit "$apt_rc"
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
