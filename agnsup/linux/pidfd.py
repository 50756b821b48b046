"""Process identity and single-process signals through pidfds.

A PID can be reused the moment its process is reaped, and (pid, start time)
can be reproduced by a forced reuse within one clock tick, so agnsup names a
process by the boot id plus the inode of its pidfd: on kernels with pidfs
(6.9+) every process gets a unique inode for its whole life. On older kernels
all pidfds share one anonymous inode; `has_pidfs()` says which, and callers
fall back to the start time.

Every signal to a single process goes: pidfd_open -> check identity and that
it is not a zombie -> pidfd_send_signal. Once the fd is open the kernel pins
that exact process, so the check and the signal cannot race a reuse.
"""
from __future__ import annotations

import os
import signal

from . import proc

_has_pidfs: bool | None = None


def has_pidfs() -> bool:
    """True when pidfds carry a per-process inode (pidfs, Linux 6.9+)."""
    global _has_pidfs
    if _has_pidfs is None:
        try:
            a = os.pidfd_open(os.getpid())
            b = os.pidfd_open(os.getppid() or 1)
        except OSError:
            _has_pidfs = False
        else:
            try:
                _has_pidfs = os.fstat(a).st_ino != os.fstat(b).st_ino
            finally:
                os.close(a)
                os.close(b)
    return _has_pidfs


def open(pid: int) -> int | None:  # noqa: A001 - mirrors os.pidfd_open
    """A pidfd for `pid`, or None if no such process."""
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        return None


def inode(fd: int) -> int:
    return os.fstat(fd).st_ino




# pidfs's PIDFD_GET_INFO (linux/pidfd.h, Linux 6.15+): _IOWR(0xFF, 11, struct pidfd_info), whose first 64 bytes
# (PIDFD_INFO_SIZE_VER0) are mask, cgroupid, pid, tgid, ppid, ruid, rgid, euid, egid, suid, sgid, fsuid, fsgid,
# exit_code; PIDFD_INFO_EXIT asks for exit_code, a wait status, set once the process was reaped by anyone
_PIDFD_GET_INFO = (3 << 30) | (64 << 16) | (0xFF << 8) | 11
_PIDFD_INFO_EXIT = 1 << 3


def exit_status(fd: int) -> int | None:
    """The wait status (waitpid(2)'s) of the process behind `fd` once it was reaped, by whichever parent it
    had; None where the kernel cannot say (before 6.15, or not reaped yet)."""
    import fcntl
    import struct
    buf = bytearray(struct.pack("=Q", _PIDFD_INFO_EXIT) + bytes(56))
    try:
        fcntl.ioctl(fd, _PIDFD_GET_INFO, buf, True)
    except OSError:
        return None
    mask, = struct.unpack_from("=Q", buf, 0)
    if not mask & _PIDFD_INFO_EXIT:
        return None
    return struct.unpack_from("=i", buf, 60)[0]


def matches(fd: int, pid: int, pidfd_ino: int | None, starttime: int | None) -> tuple[bool, str]:
    """Does the process behind `fd` have the journaled identity? (answer, why)."""
    if pidfd_ino is not None and has_pidfs():
        ino = inode(fd)
        if ino != pidfd_ino:
            return False, (f"pid {pid} matches the journaled pid but its pidfd inode {ino} differs from "
                           f"{pidfd_ino}: reused")
    st = proc.stat(pid)
    if st is None:
        return False, f"pid {pid} is gone"
    if starttime is not None and st.starttime != starttime:
        return False, f"pid {pid} start time {st.starttime} differs from the journaled {starttime}: reused"
    return True, "pidfd inode and start time match" if pidfd_ino is not None else "start time matches"


def still(ident: dict) -> bool:
    """Is the process a record names ({"pid", "pidfd_ino", "starttime", "boot_id"}: a pod's keeper, a port's
    forwarder) alive and still itself: this boot, the same pidfd inode and start time, not a zombie?"""
    pid = ident.get("pid")
    if not pid or ident.get("boot_id") != proc.boot_id():
        return False
    fd = open(int(pid))
    if fd is None:
        return False
    try:
        return matches(fd, pid, ident.get("pidfd_ino"), ident.get("starttime"))[0] and not proc.is_zombie(pid)
    finally:
        os.close(fd)


def send(fd: int, sig: int) -> bool:
    """Signal the exact process behind `fd`; False if it already exited."""
    try:
        signal.pidfd_send_signal(fd, sig)
        return True
    except ProcessLookupError:
        return False


def signal_if(pid: int, sig: int, check) -> tuple[bool, str]:
    """Open a pidfd, let `check(fd)` decide (returns (ok, why)), skip zombies, signal.

    Returns (signalled, why)."""
    fd = open(pid)
    if fd is None:
        return False, f"pid {pid} is gone"
    try:
        ok, why = check(fd)
        if not ok:
            return False, why
        if proc.is_zombie(pid):
            return False, f"pid {pid} is a zombie (already dead)"
        return send(fd, sig), why
    finally:
        os.close(fd)
