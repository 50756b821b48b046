#!/bin/sh
# agnsup's container entrypoint (docs/hosts.md "Containers", docs/sandboxd.md): `entrypoint.sh agnsup
# sandboxd ...`, `... agnsup serve` or any command. It gives agnsup a cgroup tree it can use, says what
# the container gives (agnsup doctor, on stderr), then execs the command.
#
# With its own cgroup namespace the container's init sits in the root of its cgroup tree, and a cgroup
# with processes in it cannot enable controllers for its children ("no internal processes",
# Documentation/admin-guide/cgroup-v2.rst): this shell moves to a leaf of its own first
# (/sys/fs/cgroup/init), then enables what the container was given, so cells get memory, pids and cpu
# limits; agnsup makes its own subtree beside that leaf. What it was not given, doctor and every
# receipt name. Without a writable cgroup2 mount (an unprivileged pod), cells run without cgroups
# (AGNSUP_CGROUP_LAYOUT=none: session + token tracking) and doctor names what is lost.
set -eu
case "${AGNSUP_ENTRYPOINT_DOCTOR:-probe}" in
  probe|no-probe|off) ;;
  *) echo "agnsup-entrypoint: AGNSUP_ENTRYPOINT_DOCTOR=${AGNSUP_ENTRYPOINT_DOCTOR}: one of probe, no-probe, off" >&2; exit 125 ;;
esac
cg=/sys/fs/cgroup
if [ "$(stat -f -c %T "$cg" 2>/dev/null)" = cgroup2fs ] && [ ! -w "$cg/cgroup.procs" ] && [ "$(id -u)" = 0 ]; then
  mount -o remount,rw "$cg" 2>/dev/null || true   # Docker's read-only mount of the container's own tree
fi
if [ "$(stat -f -c %T "$cg" 2>/dev/null)" = cgroup2fs ] && [ -w "$cg/cgroup.procs" ]; then
  mkdir -p "$cg/init"
  echo $$ > "$cg/init/cgroup.procs"
  want=""
  for c in memory pids cpu; do
    case " $(cat "$cg/cgroup.controllers") " in *" $c "*) want="$want +$c";; esac
  done
  [ -z "$want" ] || echo "$want" > "$cg/cgroup.subtree_control" || true
elif [ -z "${AGNSUP_CGROUP_LAYOUT:-}" ]; then
  echo "agnsup-entrypoint: $cg is not a writable cgroup2 mount: cells run without cgroups" \
       "(no limits, no atomic tree kill; give the container its own cgroup namespace on a pure cgroup v2" \
       "host with CAP_SYS_ADMIN: --cgroupns=private --cap-add SYS_ADMIN; docs/hosts.md)" >&2
  export AGNSUP_CGROUP_LAYOUT=none
fi
# AGNSUP_ENTRYPOINT_DOCTOR: probe (default: doctor starts a cell per role and says which run, about a second),
# no-probe (the host checks only), off
case "${AGNSUP_ENTRYPOINT_DOCTOR:-probe}" in
  probe) agnsup doctor >&2 || true ;;
  no-probe) agnsup doctor --no-probe >&2 || true ;;
  off) ;;
esac
exec "$@"
