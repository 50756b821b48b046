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

from .util import backoff
from .util.digest import sha256
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
            text = f.read().strip()
    except OSError:
        return "another cell"
    # a worktree lock holds "TREE\nOWNER" (the owner only while held exclusively)
    lines = text.splitlines()
    return (lines[-1] if lines and not lines[-1].startswith("/") else "") or "another cell"


def _tree_of(path: str) -> str | None:
    try:
        with open(path, errors="replace") as f:
            first = f.readline().rstrip("\n")
    except OSError:
        return None
    return first if first.startswith("/") else None


def overlaps(a: str, b: str) -> bool:
    """The same tree, or one inside the other: repo/ and repo/sub share files."""
    a, b = a.rstrip("/") + "/", b.rstrip("/") + "/"
    return a.startswith(b) or b.startswith(a)


def _clash(path: str, tree: str, exclusive: bool) -> str | None:
    """Another worktree lock in this directory on an overlapping tree, held in a mode
    that conflicts with ours (any holder when we write; a writer when we read)."""
    lockdir = os.path.dirname(path)
    for name in os.listdir(lockdir):
        other = os.path.join(lockdir, name)
        if not name.endswith(".lock") or other == path:
            continue
        t = _tree_of(other)
        if t is not None and overlaps(t, tree) and not is_free(other, exclusive):
            return other
    return None


def _try_tree(path: str, mode: int, tree: str) -> tuple[int | None, str]:
    """One attempt at a worktree lock: (fd or None, the lock file that is in the way).
    Taking ours and looking for overlapping holders happen under one mutex, so two
    cells on repo/ and repo/sub can never both pass."""
    mutex = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # flock on the directory
    try:
        fcntl.flock(mutex, fcntl.LOCK_EX)
        fd = _try(path, mode)
        if fd is None:
            return None, path
        _own(fd, "", tree)  # the tree alone, what _clash reads: shared holders all write the same bytes
        clash = _clash(path, tree, mode == fcntl.LOCK_EX)
        if clash is not None:
            os.close(fd)
            return None, clash
        return fd, ""
    finally:
        os.close(mutex)


def _attempt(path: str, exclusive: bool, tree: str | None) -> tuple[int | None, str]:
    mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
    return (_try(path, mode), path) if tree is None else _try_tree(path, mode, tree)


def try_acquire(path: str, exclusive: bool, owner: str, tree: str | None = None) -> int | None:
    """The lock if it is free now, else None (spawn queues the cell instead of waiting)."""
    fd, _ = _attempt(path, exclusive, tree)
    if fd is not None and exclusive:
        _own(fd, owner, tree)
    return fd


def acquire(path: str, exclusive: bool, timeout: float | None, what: str, owner: str, notify=None,
            tree: str | None = None, poll=None) -> int:
    """Take the lock, waiting up to `timeout` seconds (None: forever) and saying
    so in one line: on stderr, or through `notify(line)` (serve tells its client;
    False: say nothing). With `tree` (a worktree lock), a holder of an overlapping
    tree's lock in the same directory is in the way too (repo/ and repo/sub are one
    lock). `poll()` is called between attempts and may raise to give up."""
    fd, in_way = _attempt(path, exclusive, tree)
    if fd is None:
        also = "" if in_way == path else f", overlapping {_tree_of(in_way)}"
        line = f"agnsup: waiting for the {what} lock (held by {holder(in_way)}{also})"
        if notify is None:
            print(line, file=sys.stderr, flush=True)
        elif notify is not False:
            notify(line)
        deadline = None if timeout is None else time.monotonic() + timeout
        for delay in backoff.delays(0.01, 0.2):
            if deadline is not None and time.monotonic() >= deadline:
                raise LockTimeout(f"the {what} lock is held by {holder(in_way)}; gave up after {timeout:g} s "
                                  "(--lock-timeout)")
            if poll is not None:
                poll()
            time.sleep(delay)
            fd, in_way = _attempt(path, exclusive, tree)
            if fd is not None:
                break
    if exclusive:
        _own(fd, owner, tree)
    return fd


def _own(fd: int, owner: str, tree: str | None) -> None:
    """Say who holds the lock: its tree (a worktree lock), then its owner (when exclusive).
    Write, then cut to length: truncating to 0 first would make ext4 flush the file on
    close (auto_da_alloc, ~4 ms a lock) for a file that is unlinked right after anyway."""
    data = ((tree + "\n") if tree else "").encode() + owner.encode()
    os.pwrite(fd, data, 0)
    os.ftruncate(fd, len(data))


def release(path: str, fd: int) -> bool:
    """Drop the lock; unlink the file if nobody else holds it. True if unlinked."""
    unlinked = False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.unlink(path)
        unlinked = True
    except OSError:
        # held by another or already gone; or a read-only or full state root: the lock is
        # dropped (close) all the same, the file stays
        pass
    finally:
        os.close(fd)
    return unlinked


def is_free(path: str, exclusive: bool = True) -> bool:
    """True when no live process holds the lock at `path` (or it does not exist); with
    `exclusive` False, when none holds it exclusively (a reader may take it too)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return True
    try:
        fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def remove_if_free(path: str | None) -> dict | None:
    """Remove a lock file nobody holds any more (a dead controller's worktree or
    liveness lock). A lock some live process still holds is left alone: it is
    theirs too. Returns what was released, or None."""
    if not path:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.fstat(fd).st_ino != os.stat(path).st_ino:
                return None  # already unlinked and recreated by someone else: not ours
        except BlockingIOError:
            return {"kind": "lock", "path": path, "left": "held by a live process"}
        except FileNotFoundError:
            return None
        try:
            os.unlink(path)
        except OSError as e:  # read-only state root: the lock is free, its file stays
            return {"kind": "lock", "path": path, "left": f"not removed: {e.strerror}"}
        return {"kind": "lock", "path": path}
    finally:
        os.close(fd)
