"""The cgroup lock's grace period, waited for while the controller prepares the cell (issue 29).

Every cgroup migration (a `cgroup.procs` write, v1 or v2) takes the kernel's one global
cgroup_threadgroup_rwsem for writing, and the first writer after an idle spell waits for an RCU grace period
(rcu_sync_enter -> synchronize_rcu: 6-16 ms on this project's hosts, docs/performance.md); a writer within a
grace period or two of the last one does not wait. A threaded controller's leader (serve, MCP, sandboxd, the
Python API: process.clone's fork path) joins its cgroups itself after fork, so each cell waited a whole grace
period there, after everything else the controller had done for it.

Primer.prime() starts that wait when a request arrives, before its prepare: on the controller's forker thread (idle
until the fork, which queues behind it), it writes the pid of a zombie of its own (a `true` it spawned and has
not reaped yet: an exited process, which the kernel does not move; the write takes the lock all the same)
into the cgroup.procs of agnsup's own directory (the backend's base, made by the first cell; the kernel's
lock is the same for every directory and hierarchy). The grace period then elapses while the request's
thread prepares, journals and places the cell; the leader's own writes after fork find the lock fast.
Nothing moves and nothing is judged by it: any failure (no base directory yet, no `true`, a kernel that
refuses the write or takes no lock for it) only leaves the cost where it was.
"""
from __future__ import annotations

import os

TRUE = ("/bin/true", "/usr/bin/true")


class Primer:
    """A zombie of ours and the cgroup.procs it is written to. Every call on the controller's forker thread:
    prime() at a request's arrival (the grace period waited there, ahead of the fork queued behind it),
    touch() just before the fork (the lock's fast state kept a grace period or two longer, so the leader's
    writes right after land in it, however long the request took to prepare), reap() after the fork."""

    def __init__(self, backend):
        self.backend = backend
        self.pid: int | None = None
        self.procs_file: str | None = None

    def prime(self) -> bool:
        self.reap()  # a request that never forked (queued, refused) left its zombie
        self.procs_file = target(self.backend)
        if self.procs_file is None:
            return False
        self.pid = _zombie()
        return self.touch()

    def touch(self) -> bool:
        """One write of the zombie's pid: True if the kernel took it."""
        if self.pid is None or self.procs_file is None:
            return False
        try:
            fd = os.open(self.procs_file, os.O_WRONLY | os.O_CLOEXEC)
            try:
                os.write(fd, str(self.pid).encode())
                return True
            finally:
                os.close(fd)
        except OSError:
            return False

    def reap(self) -> None:
        pid, self.pid = self.pid, None
        if pid is not None:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass


def target(backend) -> str | None:
    """The cgroup.procs file a prime writes: agnsup's own directory of the backend (the v2 one where there
    is one), if it exists; None for a backend without cgroups."""
    paths = getattr(getattr(backend, "base", None), "paths", None)
    if not paths:
        return None
    path = os.path.join(paths.get("v2") or next(iter(paths.values())), "cgroup.procs")
    return path if os.path.exists(path) else None


def _zombie() -> int | None:
    """The pid of a child of ours that has exited and is not reaped yet (the caller reaps it), or None."""
    for exe in TRUE:
        try:
            pid = os.posix_spawn(exe, [exe], {})  # vfork + exec: no copy of this process's memory
            break
        except OSError:
            continue
    else:
        return None
    try:
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)  # exited, still ours: a zombie, its pid not reusable
    except ChildProcessError:  # reaped by the kernel (SIGCHLD ignored): no zombie to write
        return None
    return pid
