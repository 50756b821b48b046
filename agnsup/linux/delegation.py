"""Is this cgroup2 directory delegated to us? (backend/delegated.py, backend/systemd.py).

cgroup-v2.rst, "Delegation Containment": a subtree is delegated to a user by chowning its directory and
its cgroup.procs, cgroup.threads and cgroup.subtree_control files (what systemd does for a unit with
Delegate=yes, and `user@UID.service`). The user may then make child cgroups, set their limits (the files
of a child it made are its own), write cgroup.kill there and move processes between them, but a
migration also needs write access to the cgroup.procs of the common ancestor of the source and the
destination: a process outside the subtree cannot move itself in. Whoever delegates (systemd, or root
on a host without it) must start the user's process inside. Layout detection today asks for write
access to the cgroup2 mount point itself, which no normal user has; this check is what replaces it for
a base named by AGNSUP_CGROUP_BASE or found in /proc/self/cgroup.
"""
from __future__ import annotations

import os

from . import proc

DELEGATED_FILES = ("cgroup.procs", "cgroup.subtree_control", "cgroup.threads")


def own_dir(mount: str) -> str | None:
    """This process's cgroup2 directory under the cgroup2 mount `mount`, or None on a v1-only host."""
    rel = proc.own_cgroup()
    return os.path.join(mount, rel.lstrip("/")) if rel is not None else None


def check(directory: str, uid: int | None = None, inside: str | None = None) -> list[str]:
    """Why `directory` is not a subtree delegated to `uid` (default: the caller) in which cells can be
    made; [] when it is. `inside`: the caller's own cgroup directory, which must be in the subtree."""
    uid = os.geteuid() if uid is None else uid
    why = []
    try:
        st = os.stat(directory)
    except OSError as e:
        return [f"{directory}: {e.strerror}"]
    if uid != 0 and st.st_uid != uid:
        why.append(f"{directory} is owned by uid {st.st_uid}, not {uid} (Delegate=yes chowns it)")
    for name in DELEGATED_FILES:
        p = os.path.join(directory, name)
        try:
            owner = os.stat(p).st_uid
        except OSError as e:
            why.append(f"{p}: {e.strerror}")
            continue
        if uid != 0 and owner != uid:
            why.append(f"{p} is owned by uid {owner}, not {uid}")
    if inside is not None:
        d, i = os.path.realpath(directory), os.path.realpath(inside)
        if i != d and not i.startswith(d + "/"):
            why.append(f"this process is in {inside}, outside {directory}: it cannot move itself in "
                       "(cgroup-v2.rst, Delegation Containment); start it inside")
    return why


def controllers(directory: str) -> tuple[list[str], list[str]]:
    """(controllers this subtree can hand to its children, those already enabled for them)."""
    def words(name):
        try:
            with open(os.path.join(directory, name)) as f:
                return f.read().split()
        except OSError:
            return []
    return words("cgroup.controllers"), words("cgroup.subtree_control")
