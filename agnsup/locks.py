"""Worktree isolation locks and controller liveness locks: flock(2) on files.

The kernel drops a flock when the last descriptor of its open file goes,
however the process dies, so a lock that can be taken belongs to nobody
alive. Descriptors are close-on-exec (Python's default) and the supervisor
closes every inherited fd in the child before exec, so no cell inherits one.

Lock files are unlinked on release. The classic race (a waiter locks the old
inode after we unlinked it) is closed by checking, after each acquisition,
that the path still names the inode we locked, and retrying if not.
"""
from __future__ import annotations

import fcntl
import os
import sys
import time

from .digest import sha256
from .errors import LockTimeout


def worktree_key(worktree: str) -> str:
    return sha256(os.path.realpath(worktree).encode()).hexdigest()[:24]


def _try(path: str, mode: int) -> int | None:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    try:
        same = os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        same = False
    if not same:  # unlinked by the previous holder after we opened it
        os.close(fd)
        return _try(path, mode)
    return fd


def holder(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip() or "another cell"
    except OSError:
        return "another cell"


def acquire(path: str, exclusive: bool, timeout: float | None, what: str, owner: str, notify=None) -> int:
    """Take the lock, waiting up to `timeout` seconds (None: forever) and saying
    so in one line: on stderr, or through `notify(line)` (serve tells its client)."""
    mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
    fd = _try(path, mode)
    if fd is None:
        line = f"agnsup: waiting for the {what} lock (held by {holder(path)})"
        if notify is not None:
            notify(line)
        else:
            print(line, file=sys.stderr, flush=True)
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.01
        while fd is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise LockTimeout(f"the {what} lock is held by {holder(path)}; gave up after {timeout:g} s "
                                  "(--lock-timeout)")
            time.sleep(delay)
            delay = min(delay * 2, 0.2)
            fd = _try(path, mode)
    if exclusive:
        # Write, then cut to length: truncating to 0 first would make ext4
        # flush the file on close (auto_da_alloc, ~4 ms a lock) for a file
        # that is unlinked right after anyway.
        data = owner.encode()
        os.pwrite(fd, data, 0)
        os.ftruncate(fd, len(data))
    return fd


def release(path: str, fd: int) -> bool:
    """Drop the lock; unlink the file if nobody else holds it. True if unlinked."""
    unlinked = False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.unlink(path)
        unlinked = True
    except (BlockingIOError, FileNotFoundError):
        pass
    except OSError:
        pass  # a read-only or full state root: the lock is dropped (close) all the same; the file stays
    finally:
        os.close(fd)
    return unlinked


def is_free(path: str) -> bool:
    """True when no live process holds the lock at `path` (or it does not exist)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
