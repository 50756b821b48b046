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

from . import proc

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
        value = proc.sysctl(rel, proc_sys)
        if value is not None and refuses(value):  # None: this kernel has no such switch
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


# -- the cells of a root controller: uid 0 of a user namespace, an unprivileged range on the host ------------
#
# A root controller's cell runs as uid 0 of a user namespace that maps 0..COUNT-1 inside to BASE..BASE+COUNT-1
# on the host (docs/isolation.md, "Doors: identity"): root of a namespace that owns no mount, network or PID
# namespace, and, on the host, a uid that owns nothing. BASE is the `agnsup` entry of /etc/subuid (/etc/subgid)
# when it holds at least COUNT ids, else DEFAULT_BASE: 0x7F000000, inside the range systemd's UIDS-GIDS.md leaves
# unassigned (above the nspawn container range 524288..1879048191, below the foreign range 0x7FFE0000.. and 2^31)
# and far above the 100000.. ranges useradd hands out in /etc/subuid.
COUNT = 65536
DEFAULT_BASE = 0x7F000000
SUBID_NAME = "agnsup"
_range: dict = {}


def _subid_base(path: str) -> int | None:
    """The start of the `agnsup` entry in a subordinate id file (subuid(5)) holding >= COUNT ids."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.strip().split(":")
        if len(parts) == 3 and parts[0] == SUBID_NAME and parts[1].isdigit() and parts[2].isdigit() \
                and int(parts[2]) >= COUNT:
            return int(parts[1])
    return None


def cell_range(subuid: str = "/etc/subuid", subgid: str = "/etc/subgid") -> tuple[int, int, int]:
    """(host uid BASE, host gid BASE, COUNT) of a root controller's cells; read once per process."""
    key = (subuid, subgid)
    if key not in _range:
        uid = _subid_base(subuid)
        gid = _subid_base(subgid)
        _range[key] = (DEFAULT_BASE if uid is None else uid, DEFAULT_BASE if gid is None else gid, COUNT)
    return _range[key]


def is_cell_uid(uid: int) -> bool:
    """Is this host uid one a root controller's cell runs as (or creates files as)? For peer checks: a
    process with such a uid is a cell, never the controller or a user."""
    base, _, count = cell_range()
    return base <= uid < base + count


def cell_map_lines() -> tuple[bytes, bytes]:
    """(uid_map, gid_map) of the cells' user namespace: 0..COUNT-1 inside, the range outside."""
    uid, gid, count = cell_range()
    return f"0 {uid} {count}\n".encode(), f"0 {gid} {count}\n".encode()


def write_cell_maps(pid: int) -> None:
    """Written by the root controller into the namespace of its throwaway child `pid` (supervisor.cell_userns).
    setgroups stays "allow": the cell calls setgroups([]) as root of the namespace."""
    uid_map, gid_map = cell_map_lines()
    _write_once(f"/proc/{pid}/uid_map", uid_map)
    _write_once(f"/proc/{pid}/gid_map", gid_map)


def netns_owner() -> int:
    """The host uid that owns the user namespaces made for a root controller's cells' network namespaces
    when the controller lacks CAP_NET_ADMIN (linux/netns.py): the last id of the cells' range, which no
    process runs as in the controller's user namespace (a mapped cell runs as BASE+n inside the cells'
    user namespace, where ownership gives it nothing), so none holds capabilities there by ownership."""
    uid, _, count = cell_range()
    return uid + count - 1
