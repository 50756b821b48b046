"""How a cell's leader is born: clone3(CLONE_INTO_CGROUP) in its cgroup2 directory where the kernel and a
single-threaded controller allow it; else clone3 from a forked child (a threaded controller whose cell needs
a user namespace of its own in the same call); else fork, the child joining its cgroups itself."""
from __future__ import annotations

import errno
import os

from ..linux import proc
from ..linux import sys as lsys
from .helpers import read_all

# how a leader entered its cgroups (the receipt's isolation.cgroup_join); a v1 hierarchy's join is the child's own
# write of `tasks` where it can (backend.cgroups.CgroupBackend.attach, alone: no global lock, no grace period)
JOIN_CLONE3 = "clone3(CLONE_INTO_CGROUP) for v2, tasks by the child for v1"
JOIN_CLONE3_USERNS = "clone3(CLONE_INTO_CGROUP) for v2, cgroup.procs by the controller for v1"
JOIN_FORK = "fork, cgroup.procs (v1: tasks) by the child"

# clone3 failures that mean "not here" (old kernel, seccomp of a container,
# no cgroup2 delegation): fork and write cgroup.procs instead.
_CLONE3_UNAVAILABLE = (errno.ENOSYS, errno.EPERM, errno.EINVAL, errno.E2BIG, errno.EOPNOTSUPP, errno.EBUSY,
                       errno.EACCES)


def new(path: str | None, pid_namespace: bool, own_userns: bool, join_userns: int | None = None) \
        -> tuple[int, int | None, bool]:
    """(pid, pidfd or None, born in `path`: None, not at all) of a new leader; (0, None, born) in it. `own_userns`:
    a normal user's PID namespace, which only a user namespace of its own made in the same clone3 lets it have
    (the controller cannot unshare(CLONE_NEWPID) for it); EPERM then: no user namespace for us. `join_userns`:
    instead of a user namespace of its own, the one open as this fd (a normal user's pod, agnsup/pod.py): the
    leader is cloned from a throwaway child that joined it first, so its PID namespace is that one's."""
    if join_userns is not None and own_userns:
        return _clone3_from_a_forked_child(lsys.CLONE_NEWPID if pid_namespace else 0, join_userns), None, False
    flags = (lsys.CLONE_NEWPID if pid_namespace else 0) | (lsys.CLONE_NEWUSER if own_userns else 0)
    pid, fd = _clone_into_cgroup(path, flags) if path is not None else (None, None)
    born = pid is not None
    if pid is None and own_userns:
        if _single_threaded():
            pid, fd = lsys.clone3_into_cgroup(None, flags)
            fd = fd if pid else None
        else:
            pid, fd = _clone3_from_a_forked_child(flags), None
    elif pid is None:
        pid = _fork_into_new_pid_namespace() if pid_namespace else os.fork()
    return pid, fd, born


def _single_threaded() -> bool:
    """The raw clone3 skips glibc's fork handlers (linux/sys.py): only a single-threaded process may use it."""
    return proc.threads() == 1


def _clone_into_cgroup(path: str, flags: int) -> tuple[int | None, int | None]:
    """(pid, pidfd) of a child born in the cgroup2 directory `path` with the namespaces `flags` asks for,
    (0, None) in that child, or (None, None) when clone3 cannot be used here and the caller must fork."""
    if not _single_threaded():
        return None, None
    cgfd = os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        pid, pidfd = lsys.clone3_into_cgroup(cgfd, flags)
    except OSError as e:
        if e.errno in _CLONE3_UNAVAILABLE:
            return None, None
        raise
    finally:
        os.close(cgfd)
    return pid, (pidfd if pid else None)


def _clone3_from_a_forked_child(flags: int, join_userns: int | None = None) -> int:
    """clone3(flags | CLONE_PARENT) from a throwaway child of ours, for a threaded controller (serve):
    the raw clone3 is safe only in a single-threaded process, and fork() makes one. CLONE_PARENT makes
    the new process our child, as if we had cloned it (we wait for it, its exit signal is ours, its
    PR_SET_PDEATHSIG follows our forking thread); the throwaway child writes its pid back and exits.
    Returns the pid here and 0 in the new process; raises the clone3 error here."""
    r, w = os.pipe()
    middle = os.fork()
    if middle == 0:
        os.close(r)
        try:
            if join_userns is not None:  # single-threaded here, as setns(CLONE_NEWUSER) requires
                lsys.setns(join_userns, lsys.CLONE_NEWUSER)
            # exit_signal 0: with CLONE_PARENT the kernel takes ours (SIGCHLD), and refuses any other
            pid, _ = lsys.clone3_into_cgroup(None, flags | lsys.CLONE_PARENT, exit_signal=0)
        except OSError as e:
            os.write(w, f"-{e.errno}".encode())
            os._exit(1)
        if pid == 0:
            os.close(w)
            return 0
        os.write(w, str(pid).encode())
        os._exit(0)
    os.close(w)
    try:
        answer = read_all(r)  # closes r
    finally:
        os.waitpid(middle, 0)
    n = int(answer or -errno.ECHILD)
    if n < 0:
        raise OSError(-n, f"clone3: {os.strerror(-n)}")
    return n


def _fork_into_new_pid_namespace() -> int:
    """fork(), the child becoming PID 1 of a new PID namespace.

    unshare(CLONE_NEWPID) only changes where the caller's *next* child goes
    (pid_namespaces(7)); setns back to our own namespace right after the fork
    keeps every later fork of this controller where it was."""
    own = proc.ns("pid")
    try:
        lsys.unshare(lsys.CLONE_NEWPID)
        try:
            pid = os.fork()
        except BaseException:
            lsys.setns(own, lsys.CLONE_NEWPID)
            raise
    except BaseException:
        os.close(own)
        raise
    if pid == 0:
        os.close(own)
        return 0
    try:
        lsys.setns(own, lsys.CLONE_NEWPID)
    finally:
        os.close(own)
    return pid
