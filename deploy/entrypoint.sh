#!/bin/sh
# Container entrypoint for agnsup (docs/hosts.md, "Containers"): `entrypoint.sh agnsup serve` (or any
# agnsup command). With its own cgroup namespace the container's init sits in the root of its cgroup
# tree, and a cgroup with processes in it cannot enable controllers for its children ("no internal
# processes", cgroup-v2.rst): move this shell to a leaf of its own first, then enable what the
# container was given, so agnsup's cells get memory, pids and cpu limits. What it was not given,
# doctor and every receipt name. Nothing is done when /sys/fs/cgroup is not a writable cgroup2 mount.
set -eu
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
fi
exec "$@"
