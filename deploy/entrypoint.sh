#!/bin/sh
# agnsup sandboxd's container entrypoint: give agnsup a cgroup tree it can use, say
# what the host gives (agnsup doctor), then exec the command (agnsup sandboxd ...).
#
# With a writable cgroup2 mount (a privileged pod: the container's own cgroup
# namespace, mounted read-write), this process first moves itself into a leaf of
# its own, /sys/fs/cgroup/sandboxd: cgroup v2 lets a cgroup enable controllers for
# its children (memory, pids, cpu limits of the cells) only while no process sits
# in it ("no internal processes", Documentation/admin-guide/cgroup-v2.rst), and the
# container's processes start in its root. agnsup then makes its own subtree,
# /sys/fs/cgroup/agnsup-<digest>, beside that leaf.
#
# With a read-only one (an unprivileged pod), agnsup runs without cgroups
# (AGNSUP_CGROUP_LAYOUT=none): doctor names what is lost.
set -eu
CG=/sys/fs/cgroup
if [ -f "$CG/cgroup.controllers" ] && [ -w "$CG/cgroup.procs" ]; then
  mkdir -p "$CG/sandboxd"
  echo $$ > "$CG/sandboxd/cgroup.procs"
  for c in $(cat "$CG/cgroup.controllers"); do
    case "$c" in memory|pids|cpu) echo "+$c" > "$CG/cgroup.subtree_control" 2>/dev/null || true ;; esac
  done
elif [ -z "${AGNSUP_CGROUP_LAYOUT:-}" ]; then
  echo "agnsup-entrypoint: $CG is not a writable cgroup2 mount: cells run without cgroups" \
       "(no limits, no atomic tree kill; run the pod privileged to get them)" >&2
  export AGNSUP_CGROUP_LAYOUT=none
fi
agnsup doctor >&2 || true
exec "$@"
