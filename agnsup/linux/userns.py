"""User namespaces for the cells of an unprivileged caller (issue 14 phase B: supervisor.py).

A normal user gets mount and network namespaces only inside a user namespace of its own
(user_namespaces(7)): the cell's child calls unshare(CLONE_NEWUSER) first, then someone writes its
id maps, then it unshares the mount and network namespaces, which the new user namespace then owns, so
the child may mount in them. docs/hosts.md has the whole recipe and its order.

The maps an unprivileged writer may write (user_namespaces(7), "Defining user and group ID mappings"):
one line, mapping its own effective uid (gid) to one id inside; for gid_map, only after "deny" was
written to /proc/PID/setgroups (since Linux 3.19: otherwise a process could drop a supplementary group
that a file's permissions deny it). The writer is the child itself (as `unshare -r` does) or a process
in the parent namespace with the same euid: the controller, which then knows the maps are in place
before it releases the child's barrier. No newuidmap(1) (the uidmap package, a setuid helper) is needed
for one id, and a cell needs no more than one.

Nothing here creates a process (only the supervisor does); the tests fork their own.
"""
from __future__ import annotations

import os

# The sysctls that switch unprivileged user namespaces off, and what to tell the user for each.
# - kernel.unprivileged_userns_clone: Debian's patch (Debian 10 and older default to 0; gone upstream)
# - user.max_user_namespaces: 0 disables them for everyone (some hardened hosts and containers)
# - kernel.apparmor_restrict_unprivileged_userns: Ubuntu 23.10+ (1 by default on 24.04): only programs
#   with an AppArmor profile granting `userns` may create one
SYSCTLS = (
    ("kernel/unprivileged_userns_clone", lambda v: v == "0",
     "kernel.unprivileged_userns_clone = 0 (sysctl -w kernel.unprivileged_userns_clone=1)"),
    ("user/max_user_namespaces", lambda v: v == "0",
     "user.max_user_namespaces = 0 (sysctl -w user.max_user_namespaces=15000)"),
    ("kernel/apparmor_restrict_unprivileged_userns", lambda v: v == "1",
     "kernel.apparmor_restrict_unprivileged_userns = 1: AppArmor allows user namespaces only to programs "
     "whose profile grants `userns` (add a profile for this Python interpreter, or "
     "sysctl -w kernel.apparmor_restrict_unprivileged_userns=0)"),
)


def blocked_by_sysctl(proc_sys: str = "/proc/sys") -> list[str]:
    """What in /proc/sys refuses unprivileged user namespaces here, each with its fix; [] when nothing
    does (a seccomp filter or an LSM can still refuse: only unshare(CLONE_NEWUSER) in a child tells)."""
    out = []
    for rel, refuses, why in SYSCTLS:
        try:
            with open(os.path.join(proc_sys, rel)) as f:
                value = f.read().strip()
        except OSError:
            continue  # this kernel has no such switch
        if refuses(value):
            out.append(why)
    return out


def id_map(inside: int, outside: int) -> bytes:
    """One line of uid_map/gid_map: `inside` in the namespace is `outside` in its parent, one id long."""
    if inside < 0 or outside < 0:
        raise ValueError("ids are not negative")
    return f"{inside} {outside} 1\n".encode()


def write_id_maps(pid: int | str, uid_inside: int, gid_inside: int, uid_outside: int | None = None,
                  gid_outside: int | None = None) -> None:
    """Map the caller's own uid and gid (or the ones given) into the user namespace of `pid` ("self" for
    the caller's own). Order matters: setgroups "deny" before gid_map, or an unprivileged writer gets
    EPERM; each file takes one write(2) of the whole map, and can be written once."""
    uo = os.geteuid() if uid_outside is None else uid_outside
    go = os.getegid() if gid_outside is None else gid_outside
    base = f"/proc/{pid}"
    _write_once(f"{base}/setgroups", b"deny")
    _write_once(f"{base}/uid_map", id_map(uid_inside, uo))
    _write_once(f"{base}/gid_map", id_map(gid_inside, go))


def _write_once(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        if os.write(fd, data) != len(data):
            raise OSError(f"short write to {path}")
    finally:
        os.close(fd)
