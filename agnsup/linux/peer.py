"""Who is at the other end of a control socket: is it a process of an agnsup cell?

Every agnsup control endpoint that listens on a Unix socket (serve, `mcp --http
unix:PATH`) asks `check(conn)` before it reads a request, and refuses a peer that
is a process of ANY agnsup cell, of any state root: a cell that can start cells
outside its own confinement is out of it (issue 25, door 1). The kernel names the
peer (SO_PEERCRED: its pid, uid and gid at connect time), and where it can
(SO_PEERPIDFD, Linux 6.5+) pins that very process, so the evidence read from
/proc/PID below cannot be a later process's that took the pid over.

Evidence, strongest first; any one refuses:
- cgroup: the process is in `.../agnsup-<digest>/run-R/agent-A/cell-C` (every
  backend names a cell so, the systemd scope `agnsup-<digest>.scope` included),
  and a cell cannot move itself out: its /sys/fs/cgroup is read-only;
- token: AGNSUP_CELL_TOKEN in its environment (spec.py sets it in every cell; a
  process can drop it, so it only adds to the cgroup, for hosts without cgroups);
- uid: a uid that is not the server's own and not root (the socket is 0600, so
  such a peer got in by a file descriptor handed out, or is a cell's `process.user`);
- in_cell_uid_range: the uids root cells run as (userns.cell_range: uid 0 of a user namespace
  mapped to an unprivileged host range);
- invisible: a peer whose process this server cannot look at (pid 0: another
  PID namespace than ours or a descendant, or it is gone) is refused: fail closed.
"""
from __future__ import annotations

import os
import re
import select
import socket
import struct

from . import proc
from .session import TOKEN_VAR

SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)  # socket(7), Linux 6.5
# a cell's cgroup, whatever sits above agnsup's own directory (a delegated base, a systemd scope)
_CELL_CGROUP = re.compile(r"/agnsup-[0-9a-f]{12}/run-[^/]+/agent-[^/]+/cell-[^/]+(/|$)")


class Peer:
    __slots__ = ("pid", "uid", "gid", "evidence")

    def __init__(self, pid: int, uid: int, gid: int, evidence: list[str]):
        self.pid, self.uid, self.gid, self.evidence = pid, uid, gid, evidence

    @property
    def is_cell(self) -> bool:
        return bool(self.evidence)

    def as_dict(self) -> dict:
        return {"pid": self.pid, "uid": self.uid, "gid": self.gid, "evidence": self.evidence}


def in_cell_uid_range(uid: int) -> bool:
    """Whether `uid` is one a root controller runs its cells as (docs/isolation.md, "Doors: identity")."""
    from .userns import is_cell_uid
    return is_cell_uid(uid)


def check(conn: socket.socket) -> Peer:
    """The peer of the connected Unix socket `conn`, with the evidence that it is a
    cell's process (empty: it is not)."""
    pid, uid, gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    pidfd = None
    if pid > 0:
        try:
            pidfd = conn.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD)
        except OSError:
            pidfd = None  # before Linux 6.5: /proc/PID alone (a reuse within this check is not excluded)
    try:
        evidence = _evidence(pid, uid)
        if pidfd is not None and _exited(pidfd):
            evidence = evidence or [f"pid {pid} ended during the check (its /proc entry may be another's)"]
    finally:
        if pidfd is not None:
            os.close(pidfd)
    return Peer(pid, uid, gid, evidence)


def _evidence(pid: int, uid: int) -> list[str]:
    if pid <= 0:
        return ["its process is not visible from here (pid 0: another PID namespace)"]
    out = []
    lines = proc.cgroup_lines(pid)
    if lines is None:
        return [f"pid {pid} is gone"]
    for line in lines:
        path = line.split(":", 2)[-1]
        if _CELL_CGROUP.search(path):
            out.append(f"cgroup {path}")
            break
    env = proc.environ(pid)
    if env is not None and TOKEN_VAR in env:
        out.append(f"{TOKEN_VAR} in its environment")
    me = os.geteuid()
    if uid != me and uid != 0:
        out.append(f"uid {uid} is neither this server's ({me}) nor root")
    if in_cell_uid_range(uid):
        out.append(f"uid {uid} is in the cell uid range")
    return out


def _exited(pidfd: int) -> bool:
    """A pidfd polls readable once its process exited (pidfd_open(2))."""
    p = select.poll()
    p.register(pidfd, select.POLLIN)
    return bool(p.poll(0))


def refusal_line(peer: Peer, what: str) -> str:
    """The one line a refused peer gets back (and the journal keeps)."""
    return (f"{what}: refused: the connecting process (pid {peer.pid}, uid {peer.uid}) is a process of an agnsup "
            f"cell ({'; '.join(peer.evidence)}); cells never reach a control socket")
