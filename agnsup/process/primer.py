"""The cgroup lock's grace period, waited for while the controller prepares the cell (issue 29).

Every cgroup migration (a `cgroup.procs` write, v1 or v2) takes the kernel's one global
cgroup_threadgroup_rwsem for writing, and the first writer after an idle spell waits for an RCU grace period
(rcu_sync_enter -> synchronize_rcu: 6-16 ms on this project's hosts, docs/performance.md); a writer within a
grace period or two of the last one does not wait. A threaded controller's leader (serve, MCP, sandboxd, the
Python API: process.clone's fork path) joins its cgroups itself after fork, so each cell waited a whole grace
period there, after everything else the controller had done for it.

Primer.prime() starts that wait once the cell's cgroup directories exist (broker.Controller._make_place; not
before them: the kernel waits the grace period holding its cgroup_mutex, which every mkdir takes): on a thread of
the controller's own (supervisor._Forker's agnsup-primer, never the forker: no fork waits behind it), it writes the
pid of a zombie of its own (a `true` it spawned after the last fork and has not reaped yet: an exited process,
which the kernel does not move; the write takes the lock all the same)
into the cgroup.procs of agnsup's own directory (the backend's base, made by the first cell; the kernel's
lock is the same for every directory and hierarchy). The grace period then elapses while the request's
thread finishes the place and the leader is forked; the leader's own v2 write after fork finds the lock fast
(its v1 joins write `tasks`, which takes no such lock: backend.cgroups.CgroupBackend.attach).
Nothing moves and nothing is judged by it: any failure (no base directory yet, no `true`, a kernel that
refuses the write or takes no lock for it) only leaves the cost where it was.
"""
from __future__ import annotations

import errno
import os

TRUE = ("/bin/true", "/usr/bin/true")


class Primer:
    """A zombie of ours and the cgroup.procs it is written to. Every call on one thread of the controller (in
    order; any thread of ours may wait for our child): prime() once the cell's cgroup directories exist (the grace
    period waited there, beside the request's thread), touch() just before the fork (the lock's fast state kept
    a grace period or two longer, so the leader's write right after lands in it), renew() after the fork, off
    the request's path: the next request's zombie, spawned now so that it has exited long before it is
    written (on a loaded host a new process may wait many milliseconds for a CPU: never on a request's path).
    Between requests the controller has that one exited, unreaped `true` as its child; reap() at its close."""

    def __init__(self, backend):
        self.backend = backend
        self.pid: int | None = None
        self.procs_file: str | None = None
        self.refused: int | None = None  # the errno of the last write the kernel refused (touch)

    def prime(self) -> bool:
        self.procs_file = target(self.backend)
        if self.pid is None:  # the first request (or a zombie someone else reaped): ready for the next one
            self.pid = _spawn()
        return self.touch()

    def touch(self) -> bool:
        """One write of the zombie's pid, if it is one (exited, still ours: its number cannot be reused and the
        kernel moves nothing): True if the write reached the kernel's migration (`refused`: the errno it
        answered, None when it took it). The kernel takes its lock before it looks up the pid or checks the
        directory, so a refusal still starts the grace period: on a pure-v2 host agnsup's base has controllers
        in its subtree_control and refuses every process (the no-internal-process rule)."""
        if self.procs_file is None or not self._exited():
            return False
        try:
            fd = os.open(self.procs_file, os.O_WRONLY | os.O_CLOEXEC)
        except OSError:
            return False
        try:
            os.write(fd, str(self.pid).encode())
            self.refused = None
        except OSError as e:
            if e.errno == errno.ENODEV:  # the directory is being removed: refused before the lock
                return False
            self.refused = e.errno
        finally:
            os.close(fd)
        return True

    def _exited(self) -> bool:
        """Is our child self.pid a zombie now? False while it still runs (a write would move it) or when
        there is none; one that is not our child any more (reaped elsewhere: its number may be anyone's) is
        forgotten."""
        if self.pid is None:
            return False
        try:
            info = os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOWAIT | os.WNOHANG)
        except ChildProcessError:
            self.pid = None
            return False
        return info is not None and info.si_pid == self.pid

    def renew(self) -> None:
        """After a fork: the used zombie reaped, the next one spawned (not waited for)."""
        self.reap()
        self.pid = _spawn()

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


def _spawn() -> int | None:
    """A `true` child of ours, not waited for (Primer: written once it has exited), or None."""
    for exe in TRUE:
        try:
            return os.posix_spawn(exe, [exe], {})  # vfork + exec: no copy of this process's memory
        except OSError:
            continue
    return None
