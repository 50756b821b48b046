"""Worktree isolation locks and controller liveness locks: flock(2) on files.

The kernel drops a flock when the last descriptor of its open file goes,
however the process dies, so a lock that can be taken belongs to nobody
alive. Descriptors are close-on-exec (Python's default) and the supervisor
closes every inherited fd in the child before exec, so no cell inherits one.

Lock files are unlinked on release. The classic race (a waiter locks the old
inode after we unlinked it) is closed by checking, after each acquisition,
that the path still names the inode we locked, and retrying if not.

Worktree locks keep different agents apart; an agent's own cells coordinate
among themselves. Each cell holds a lock file of its own,
`<state>/locks/<tree digest>-<cell digest>.lock` (exclusive: nobody else ever
takes it), that says its tree, its mode (w: it may write, r: it reads) and its
agent (run/agent). Under one mutex (a flock on the directory) a cell takes its
file, writes that, and looks at the other held files: one on an overlapping
tree (repo/ and repo/sub share files) of another agent, where either side
writes, is in the way. A holder without an agent (`agnsup undo`: the tree's
old single lock file, `<tree digest>.lock`) is in everyone's way, as a writer.
"""
from __future__ import annotations

import errno
import fcntl
import os
import sys
import time
from contextlib import contextmanager

from .util import backoff
from .util.digest import sha256
from .errors import LockTimeout


_KEYS: dict = {}  # a worktree's real path -> its digest's first 24 hex digits


def worktree_key(worktree: str, run_id: str | None = None, cell_id: str | None = None) -> str:
    """The worktree's digest (its cache's and its agentless lock's name); with a cell, the
    name of that cell's own worktree lock file (state.worktree_lock adds ".lock")."""
    from .linux.host import realpath  # within a cell's prepare: its walk, not another
    real = realpath(worktree)
    key = _KEYS.get(real)
    if key is None:  # a pure function of the real path
        if len(_KEYS) >= 256:
            _KEYS.clear()
        key = _KEYS[real] = sha256(real.encode()).hexdigest()[:24]
    if cell_id is None:
        return key
    return key + "-" + sha256(f"{run_id}/{cell_id}".encode()).hexdigest()[:16]


def agent_of(run_id: str, agent_id: str) -> str:
    """An agent as a worktree lock names it: run and agent id (neither may hold a '/')."""
    return f"{run_id}/{agent_id}"


def owner_of(run_id: str, agent_id: str, cell_id: str) -> str:
    return f"cell {cell_id} of run {run_id}, agent {agent_id}"


def wait_bound(lock_timeout: float | None, timeout: float | None) -> tuple[float | None, str]:
    """How long a cell's start may wait for a lock, and what set it: a call's `timeout`
    bounds every wait of the call (a wall clock the caller chose), `lock_timeout` the
    lock's alone; the smaller one wins. (None, ""): no bound."""
    if timeout is not None and (lock_timeout is None or timeout < lock_timeout):
        return float(timeout), "timeout"
    return lock_timeout, ("lock_timeout" if lock_timeout is not None else "")


def flock_file(path: str, mode: int, deadline: float | None = None, give_up=None, follow: bool = True,
               waited_for: str = "") -> int | None:
    """flock `path` (made if missing) in `mode`; the locked fd, or None: when it is held and `deadline` is
    None or `give_up()` says so while it waits. A lock file is unlinked by its last holder, so the lock taken
    may be on an inode the path no longer names: `follow` takes the file the path names now, else None (the
    caller reloads what that file guarded: pod.join). Past `deadline` (monotonic): TimeoutError."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            while True:
                try:
                    fcntl.flock(fd, mode | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if deadline is None or (give_up is not None and give_up()):
                        os.close(fd)
                        return None
                    if time.monotonic() > deadline:
                        raise TimeoutError(errno.ETIMEDOUT, f"{path} stayed locked{waited_for}") from None
                    time.sleep(0.002)
            try:
                same = os.fstat(fd).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                same = False
        except BaseException:
            os.close(fd)
            raise
        if same:
            return fd
        os.close(fd)  # unlinked by the previous holder after we opened it
        if not follow:
            return None


_try = flock_file  # one attempt, no wait: the worktree locks' primitive


def holder(path: str) -> str:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return "another cell"
    # a worktree lock holds "TREE\n[mode=M agent=RUN/AGENT\n]OWNER" (an agentless one's owner
    # only while held exclusively)
    lines = text.splitlines()
    return (lines[-1] if lines and not lines[-1].startswith(("/", "mode=")) else "") or "another cell"


def _read_tree_lock(path: str) -> tuple[str | None, str | None, str | None]:
    """(tree, mode, agent) a worktree lock file says: mode "w"/"r" and the agent for a
    cell's own file, (tree, None, None) for an agentless one, (None, ...) for none."""
    try:
        with open(path, errors="replace") as f:
            first, second = f.readline().rstrip("\n"), f.readline().rstrip("\n")
    except OSError:
        return None, None, None
    if not first.startswith("/"):
        return None, None, None
    fields = dict(w.split("=", 1) for w in second.split() if "=" in w) if second.startswith("mode=") else {}
    return first, fields.get("mode"), fields.get("agent")


def _tree_of(path: str) -> str | None:
    return _read_tree_lock(path)[0]


def overlaps(a: str, b: str) -> bool:
    """The same tree, or one inside the other: repo/ and repo/sub share files."""
    a, b = a.rstrip("/") + "/", b.rstrip("/") + "/"
    return a.startswith(b) or b.startswith(a)


def _in_way(other: str, tree: str, exclusive: bool, agent: str | None) -> bool:
    """Is the held lock file `other` in the way of `agent` on `tree` (writing when
    `exclusive`)? Another agent's (or an agentless) holder of an overlapping tree,
    where either side writes. An agent's own cells never are."""
    t, mode, theirs = _read_tree_lock(other)
    if t is None or not overlaps(t, tree):
        return False
    if theirs is None:  # agentless (`agnsup undo`): the flock's mode says whether it writes
        return not is_free(other, exclusive)
    if agent is not None and theirs == agent:
        return False
    return (exclusive or mode != "r") and not is_free(other)


def _clash(path: str, tree: str, exclusive: bool, agent: str | None = None) -> str | None:
    """Another worktree lock in this directory on an overlapping tree, held in a way
    that conflicts with ours (_in_way)."""
    lockdir = os.path.dirname(path)
    for name in os.listdir(lockdir):
        other = os.path.join(lockdir, name)
        if not name.endswith(".lock") or other == path:
            continue
        if _in_way(other, tree, exclusive, agent):
            return other
    return None


def _try_tree(path: str, mode: int, tree: str, agent: str | None = None, owner: str = "") -> tuple[int | None, str]:
    """One attempt at a worktree lock: (fd or None, the lock file that is in the way).
    Taking ours and looking for overlapping holders happen under one mutex, so two
    cells on repo/ and repo/sub can never both pass. A cell's own file (`agent`) is
    held exclusively and says its mode and agent before anyone else can read it."""
    mutex = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # flock on the directory
    try:
        fcntl.flock(mutex, fcntl.LOCK_EX)
        fd = _try(path, fcntl.LOCK_EX if agent is not None else mode)
        if fd is None:
            return None, path
        if agent is None:
            _own(fd, "", tree)  # the tree alone, what _clash reads: shared holders all write the same bytes
        else:
            _own(fd, owner, f"{tree}\nmode={'w' if mode == fcntl.LOCK_EX else 'r'} agent={agent}")
        clash = _clash(path, tree, mode == fcntl.LOCK_EX, agent)
        if clash is not None:
            if agent is not None:
                release(path, fd)  # a file of its own: not left behind while it waits (or gives up)
            else:
                os.close(fd)
            return None, clash
        return fd, ""
    finally:
        os.close(mutex)


def _attempt(path: str, exclusive: bool, tree: str | None, agent: str | None = None,
             owner: str = "") -> tuple[int | None, str]:
    mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
    return (_try(path, mode), path) if tree is None else _try_tree(path, mode, tree, agent, owner)


def take(path: str, exclusive: bool, owner: str, tree: str | None = None,
         agent: str | None = None) -> tuple[int | None, str]:
    """The lock if it is free now, else (None, who is in the way: a holder's name, and the
    overlapping tree it holds when that is not ours). `agent` (with `tree`): the cell's own
    worktree lock file; the agent's other cells are never in its way (agent_of)."""
    fd, in_way = _attempt(path, exclusive, tree, agent, owner)
    if fd is None:
        return None, _named(path, in_way, tree)
    if exclusive and agent is None:
        _own(fd, owner, tree)
    return fd, ""


def try_acquire(path: str, exclusive: bool, owner: str, tree: str | None = None,
                agent: str | None = None) -> int | None:
    """The lock if it is free now, else None (spawn queues the cell instead of waiting)."""
    return take(path, exclusive, owner, tree, agent)[0]


def _named(path: str, in_way: str, tree: str | None) -> str:
    """The holder of `in_way`, and the tree it holds when that is not ours (repo/ for repo/sub)."""
    theirs = None if in_way == path else _tree_of(in_way)
    same = theirs is None or (tree is not None and theirs.rstrip("/") == tree.rstrip("/"))
    return holder(in_way) + ("" if same else f", overlapping {theirs}")


# what set a lock wait's bound, as the error names it (wait_bound's second value)
_BOUND_BY = {"timeout": "the call's timeout bounds its lock wait", "lock_timeout": "--lock-timeout"}


def acquire(path: str, exclusive: bool, timeout: float | None, what: str, owner: str, notify=None,
            tree: str | None = None, poll=None, agent: str | None = None, bound_by: str = "lock_timeout") -> int:
    """Take the lock, waiting up to `timeout` seconds (None: forever) and saying
    so in one line: on stderr, or through `notify(line)` (serve tells its client;
    False: say nothing). With `tree` (a worktree lock), a holder of an overlapping
    tree's lock in the same directory is in the way too (repo/ and repo/sub are one
    lock); with `agent` too, the cell's own file, which the agent's other cells'
    never are in the way of. `poll()` is called between attempts and may raise to
    give up. LockTimeout names the holder, the time waited and what bounded it
    (`bound_by`: wait_bound's "timeout" or "lock_timeout")."""
    fd, in_way = _attempt(path, exclusive, tree, agent, owner)
    if fd is None:
        held_by = _named(path, in_way, tree)
        line = f"agnsup: waiting for the {what} lock (held by {held_by})"
        if notify is None:
            print(line, file=sys.stderr, flush=True)
        elif notify is not False:
            notify(line)
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        for delay in backoff.delays(0.01, 0.2):
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise LockTimeout(f"the {what} lock is held by {held_by}; gave up after {timeout:g} s "
                                  f"({_BOUND_BY.get(bound_by, bound_by)})", holder=held_by,
                                  waited=round(now - start, 3))
            if poll is not None:
                poll()
            time.sleep(delay if deadline is None else max(0.0, min(delay, deadline - now)))
            fd, in_way = _attempt(path, exclusive, tree, agent, owner)
            if fd is not None:
                break
            held_by = _named(path, in_way, tree)
    if exclusive and agent is None:
        _own(fd, owner, tree)
    return fd


@contextmanager
def commit_mutex(run_changes_dir: str):
    """One capturing cell's commit of a run at a time: an agent's cells share the worktree lock,
    and two commits interleaving their steps over one path would record a pre-image that was
    never there (changes.commit). A flock on the run's changes directory (only one agent writes
    a worktree at a time, and an agent is of one run): no file to leave behind, and it cannot
    be removed while a contender's layer is in it. Short: held while one commit runs."""
    try:
        fd = os.open(run_changes_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:  # no layer there after all: nothing to order
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


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
