#!/usr/bin/env bash
# The tests in tiers (tests/conftest.py marks them: PURE paths, SMOKE list):
#   scripts/test.sh fast [ARGS]     no root, about half a minute: tests/unit, the gate's judgement, netpolicy,
#                                   redaction, the architecture (scripts/check first, where it exists)
#   scripts/test.sh smoke [ARGS]    one kernel test per seam (cells, cancel, janitor, serve, mcp, ...), as root
#   scripts/test.sh kernel [ARGS]   every test that is not fast (CI's second stage), as root
#   scripts/test.sh [all] [ARGS]    the whole suite (the README's second command)
# ARGS go to pytest (`scripts/test.sh -q` is `all -q`). The root tiers install the test dependencies (apt + pip)
# first; every tier makes .venv and installs agnsup with its test extra when pyproject.toml changed.
# V2LANE=1 adds the pure cgroup-v2 lane after kernel or all (see the end).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
tier=all
case "${1:-}" in fast|smoke|kernel|all) tier=$1; shift ;; esac
# pytest options of the tiers that start cells (kernel, all): spread over TEST_WORKERS processes (pytest-xdist,
# default 2, the CI machine's cores; 0 runs in one process): tests/_workers.py keeps them apart, the tests
# marked serial run alone and the container lane's on one worker (--dist loadgroup)
kernel_args=(-n "${TEST_WORKERS:-2}" --dist loadgroup)
export DEBIAN_FRONTEND=noninteractive
need=()
# docker.io (with containerd and runc) and debootstrap: the container lane (tests/test_docker.py,
# tests/containers.py), which starts a Docker daemon of its own with no networking of its own
for pkg in bubblewrap hyperfine redis-server memcached make netcat-openbsd socat gawk busybox curl wget git util-linux iproute2 \
           tmux openssh-client gnupg e2fsprogs xfsprogs btrfs-progs docker.io containerd runc debootstrap; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
done
[ "$tier" != fast ] || need=()  # the fast tier runs no host tool but git and python
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
[ -x .venv/bin/python ] \
  || "$PY" -m venv .venv 2>/dev/null || { apt-get install -y -qq python3-venv >/dev/null && "$PY" -m venv .venv; }
# installed again only when pyproject.toml changed since (a stamp in .venv) or agnsup is no longer this
# checkout's editable install (scripts/demo.sh installs a copy): the fast tier answers in seconds
stamp=$(sha256sum pyproject.toml | cut -c1-16)
if [ "$(cat .venv/.agnsup-test-extra 2>/dev/null)" != "$stamp" ] \
   || ! compgen -G '.venv/lib/python3*/site-packages/__editable__*agnsup*' >/dev/null; then
  pip_rc=0
  .venv/bin/pip install -q --disable-pip-version-check -e '.[test]' > .venv/pip.log 2>&1 || pip_rc=$?
  grep -v '^WARNING: Location' .venv/pip.log || true
  [ "$pip_rc" != 0 ] || echo "$stamp" > .venv/.agnsup-test-extra
fi
case "$tier" in
  fast)
    if [ -f scripts/check ]; then PATH="$PWD/.venv/bin:$PATH" bash scripts/check; fi
    exec .venv/bin/python -m pytest -m "not kernel" "$@" ;;
  smoke) exec .venv/bin/python -m pytest -m smoke "$@" ;;
  kernel) pytest=(.venv/bin/python -m pytest -m kernel "${kernel_args[@]}" "$@") ;;
  all) pytest=(.venv/bin/python -m pytest "${kernel_args[@]}" "$@") ;;
esac
# V2LANE=1: after the host suite, the pure cgroup-v2 lane in a guest kernel under QEMU (scripts/v2lane;
# docs/hosts.md "Lanes"), with V2LANE_ARGS as its options (e.g. "-k 6.1", "--systemd").
[ "${V2LANE:-0}" != 0 ] || exec "${pytest[@]}"
rc=0
"${pytest[@]}" || rc=$?
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
