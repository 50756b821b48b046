"""Removing a tree a cell wrote, without following anything it planted (reaper: a cell's temp dir)."""
from __future__ import annotations

import os
import stat
from contextlib import suppress

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
        with suppress(OSError):
            os.unlink(path)
        return
    try:
        fd = os.open(path, _DIR_FLAGS)
    except OSError:
        return
    try:
        _empty_dir(fd)
    finally:
        os.close(fd)
    with suppress(OSError):
        os.rmdir(path)


# Directory fds held at once below the top, whatever the depth: systemd services and the kernel's PID 1
# start with a soft RLIMIT_NOFILE of 1024 (getrlimit(2)), and a serve controller needs its fds for cells.
_OPEN_DIRS = 16


def _empty_dir(top: int) -> None:
    """Empty the directory open as `top`, depth first, without recursion (a cell
    can nest directories deeper than Python's recursion limit) and with at most
    _OPEN_DIRS fds, however deep the tree: a level further up than that is closed
    and, on the way back, re-opened as '..' of its child, checked by inode."""
    stack = [[top, _entries(top), "", None]]  # [dir fd or None, its entries left, its name, its (dev, ino)]
    try:
        _drain(stack)
    finally:
        for fd, _, _, _ in stack[1:]:
            if fd is not None:
                os.close(fd)


def _drain(stack: list) -> None:
    while stack:
        fd, entries, name, _ = stack[-1]
        entry = next(entries, None)
        if entry is None:
            stack.pop()
            if not stack:
                break
            parent = stack[-1]
            if parent[0] is None:
                parent[0] = _reopen_parent(fd, parent[3])
            os.close(fd)
            if parent[0] is None:
                return  # the tree moved under the walk: what is left, the next reap removes
            with suppress(OSError):
                os.rmdir(name, dir_fd=parent[0])
            continue
        try:
            is_dir = entry.is_dir(follow_symlinks=False)
        except OSError:
            is_dir = False
        if not is_dir:
            with suppress(OSError):
                os.unlink(entry.name, dir_fd=fd)
            continue
        try:
            sub = os.open(entry.name, _DIR_FLAGS, dir_fd=fd)
        except OSError:
            continue  # e.g. not readable: left for the next reap
        stack.append([sub, _entries(sub), entry.name, None])
        if len(stack) > _OPEN_DIRS + 1:
            far = stack[-_OPEN_DIRS - 1]  # never stack[0]: the caller owns that fd
            if far[0] is not None:
                st = os.fstat(far[0])
                far[3] = (st.st_dev, st.st_ino)
                os.close(far[0])
                far[0] = None


def _reopen_parent(child: int, ident: tuple) -> int | None:
    """The directory '..' of the open directory `child`, if it is still the one
    with `ident` (dev, ino); None if it moved (then nothing there is touched)."""
    try:
        fd = os.open("..", _DIR_FLAGS, dir_fd=child)
    except OSError:
        return None
    st = os.fstat(fd)
    if (st.st_dev, st.st_ino) != ident:
        os.close(fd)
        return None
    return fd


def _entries(fd: int):
    try:
        with os.scandir(fd) as it:
            return iter(list(it))
    except OSError:
        return iter(())
