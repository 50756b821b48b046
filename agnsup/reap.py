"""The one reap path: stop what is left of a cell, verify, release its resources.

The normal end of a cell, cancel, cleanup and the janitor all come through
here, so "recovery said clean" and "the tree is gone" cannot disagree.
Idempotent: whatever is already gone is skipped, not an error.
"""
from __future__ import annotations

import os
import shutil

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
            shutil.rmtree(p, ignore_errors=True) if os.path.isdir(p) else os.unlink(p)
            break
        crashpoints.hit("cleanup_tmp_half")
    shutil.rmtree(path, ignore_errors=True)


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
