"""The one reap path: stop what is left of a cell, verify, release its resources.

The normal end of a cell, cancel, cleanup and the janitor all come through
here, so "recovery said clean" and "the tree is gone" cannot disagree.
Idempotent: whatever is already gone is skipped, not an error.
"""
from __future__ import annotations

import os
import stat

from . import crashpoints
from .linux import cgroup


def release_cell_resources(node, tmpdir: str | None, base=None) -> list[dict]:
    """Kill anything left in the cell's cgroup, verify it empty, remove its
    directories (and now-empty agent/run directories), remove its temp dir."""
    released: list[dict] = []
    if node is not None and node.paths:
        if cgroup.populated(node):
            method = cgroup.kill(node)
            released.append({"kind": "kill", "method": method})
            if not cgroup.wait_empty(node, 10.0):
                raise OSError(f"cgroup {node.primary[1]} still populated after kill")
        crashpoints.hit("cleanup_before_rmdir")
        for d in cgroup.remove(node):
            released.append({"kind": "cgroup", "path": d})
        for p in node.paths.values():  # the agent, run and base directories, if now empty
            up = p
            for _ in range(3):
                up = os.path.dirname(up)
                if not cgroup.remove_if_empty(up):
                    break
    if tmpdir and os.path.lexists(tmpdir):
        _remove_tree(tmpdir)
        released.append({"kind": "tmpdir", "path": tmpdir})
    return released


def _remove_tree(path: str) -> None:
    if crashpoints.enabled("cleanup_tmp_half"):
        # remove one entry, then die: the next reap must finish the job
        for name in os.listdir(path):
            p = os.path.join(path, name)
            rmtree(p) if os.path.isdir(p) else os.unlink(p)
            break
        crashpoints.hit("cleanup_tmp_half")
    rmtree(path)


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def rmtree(path: str) -> None:
    """Remove `path` and everything below it; errors are ignored (what is left, the next reap removes).

    shutil.rmtree costs ~9 ms of imports on every cell. This does the same as
    its fd-based variant: every directory is opened relative to its parent
    with O_NOFOLLOW, so a symlink the cell planted in its /tmp is unlinked,
    never followed out of the tree."""
    try:
        st = os.lstat(path)
    except OSError:
        return
    if not stat.S_ISDIR(st.st_mode):
        try:
            os.unlink(path)
        except OSError:
            pass
        return
    try:
        fd = os.open(path, _DIR_FLAGS)
    except OSError:
        return
    try:
        _empty_dir(fd)
    finally:
        os.close(fd)
    try:
        os.rmdir(path)
    except OSError:
        pass


def _empty_dir(top: int) -> None:
    """Empty the directory open as `top`, depth first, without recursion (a cell
    can nest directories deeper than Python's recursion limit)."""
    stack = [(top, _entries(top), "")]  # (dir fd, its entries left, its name in the parent)
    try:
        _drain(stack)
    finally:
        for fd, _, _ in stack[1:]:
            os.close(fd)


def _drain(stack: list) -> None:
    while stack:
        fd, entries, name = stack[-1]
        entry = next(entries, None)
        if entry is None:
            stack.pop()
            if stack:
                os.close(fd)
                try:
                    os.rmdir(name, dir_fd=stack[-1][0])
                except OSError:
                    pass
            continue
        try:
            is_dir = entry.is_dir(follow_symlinks=False)
        except OSError:
            is_dir = False
        if not is_dir:
            try:
                os.unlink(entry.name, dir_fd=fd)
            except OSError:
                pass
            continue
        try:
            sub = os.open(entry.name, _DIR_FLAGS, dir_fd=fd)
        except OSError:
            continue  # e.g. out of fds at a great depth: left for the next reap
        stack.append((sub, _entries(sub), entry.name))


def _entries(fd: int):
    try:
        with os.scandir(fd) as it:
            return iter(list(it))
    except OSError:
        return iter(())


def release_lock_file(path: str | None) -> dict | None:
    """Remove a lock file nobody holds any more (a dead controller's worktree or
    liveness lock). A lock some live process still holds is left alone: it is
    theirs too. Returns what was released, or None."""
    import fcntl
    if not path:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return {"kind": "lock", "path": path, "left": "held by a live process"}
        try:
            if os.fstat(fd).st_ino != os.stat(path).st_ino:
                return None  # already unlinked and recreated by someone else: not ours
        except FileNotFoundError:
            return None
        os.unlink(path)
        return {"kind": "lock", "path": path}
    finally:
        os.close(fd)
