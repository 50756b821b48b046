"""Removing a tree a cell wrote, without following anything it planted (reaper: a cell's temp dir;
changes: a record, a worktree entry)."""
from __future__ import annotations

import errno
import os
import stat
from contextlib import nullcontext, suppress

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def read_bytes(path: str) -> bytes:
    """A whole small file by os.open/read/close: 3 system calls where open() makes 9, and none of the io module's
    objects (a copy-on-write page each in a freshly forked leader)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks = []
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks)


def open_empty(path: str, mode: int, flags: int = 0) -> int:
    """`path` opened for writing from its start, made if missing, emptied only if it is not empty. Not O_TRUNC:
    ext4 marks a file truncated to size 0 and, at its last close, allocates its blocks and starts its writeback
    (auto_da_alloc, for files replaced by truncation), ~20-30 us at that close here against ~1 us. The files a
    cell's controller fills (its receipt, its protected paths' baseline, its pending marker) are new or empty
    spares (store/spares.py); none is fsynced either way. `flags`: more of open(2)'s (O_NOFOLLOW)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | flags, mode)
    try:
        if os.fstat(fd).st_size:
            os.ftruncate(fd, 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


# chattr +T (ioctl_iflags(2)): "the top of directory hierarchies" for ext2/3/4's Orlov allocator
_FS_IOC_GETFLAGS = 0x80086601
_FS_IOC_SETFLAGS = 0x40086602
FS_TOPDIR_FL = 0x00020000


def spread(path: str) -> None:
    """Mark the directory `path` as the top of unrelated hierarchies (FS_TOPDIR_FL, `chattr +T`): ext4's Orlov
    allocator then places each new subdirectory in a block group of its own choosing (more free inodes than
    average, few directories), not in the parent's, and what is made inside that subdirectory follows it there.
    For the parents of per-cell directories (a run's change layers, the spare area): without it every cell's
    layer lands in the one group where this state root's (and its neighbours') recent deletions are, and on an
    ext4 without a journal each new inode there scans past every inode freed in the last minutes
    (`find_inode_bit`, `recently_deleted`): the overlay's ~7 new inodes at its mount (work/work, its probes,
    `volatile`'s marker) took 6.5-7 ms a cell on this host's busy /var/tmp against 0.3 ms in a spread layer
    (issue 29, sixth round). Best effort: other file systems have no such flag (ENOTTY, EOPNOTSUPP) and lose
    nothing; it changes where inodes lie, never what a directory holds or who may use it."""
    try:
        fd = os.open(path, _DIR_FLAGS)
    except OSError:
        return
    try:
        import fcntl
        import struct
        flags = struct.unpack("i", fcntl.ioctl(fd, _FS_IOC_GETFLAGS, bytes(8))[:4])[0]
        if not flags & FS_TOPDIR_FL:
            fcntl.ioctl(fd, _FS_IOC_SETFLAGS, struct.pack("i", flags | FS_TOPDIR_FL) + bytes(4))
    except OSError:
        pass
    finally:
        os.close(fd)


def topdir(path: str) -> bool | None:
    """Does `path` carry FS_TOPDIR_FL (None: its file system has no such flags)?"""
    import fcntl
    import struct
    fd = os.open(path, _DIR_FLAGS)
    try:
        return bool(struct.unpack("i", fcntl.ioctl(fd, _FS_IOC_GETFLAGS, bytes(8))[:4])[0] & FS_TOPDIR_FL)
    except OSError:
        return None
    finally:
        os.close(fd)


def rmtree(path: str, dir_fd: int | None = None, strict: bool = False) -> None:
    """Remove `path` (relative to `dir_fd`, if given) and everything below it. Errors are ignored (what is
    left, the next reap removes); with `strict` raised: a removal that stopped halfway must not pass for
    done (changes decides what happened from what exists).

    shutil.rmtree costs ~9 ms of imports on every cell. This does the same as
    its fd-based variant: every directory is opened relative to its parent
    with O_NOFOLLOW, so a symlink the cell planted in its /tmp is unlinked,
    never followed out of the tree. A directory that refuses to be read (mode 000: a cell's, or a
    normal user's overlay work/work) is opened up first."""
    try:
        st = os.lstat(path, dir_fd=dir_fd)
    except OSError as e:
        if strict and not isinstance(e, (FileNotFoundError, NotADirectoryError)):
            raise
        return
    quiet = nullcontext() if strict else suppress(OSError)
    if not stat.S_ISDIR(st.st_mode):
        with quiet:
            os.unlink(path, dir_fd=dir_fd)
        return
    try:
        fd = open_dir(path, dir_fd)
    except OSError:
        if strict:
            raise
        return
    try:
        _empty_dir(fd, strict)
    finally:
        os.close(fd)
    with quiet:
        os.rmdir(path, dir_fd=dir_fd)


def open_dir(name: str, dir_fd: int | None) -> int:
    """The directory `name`, never through a symlink; one of mode 000 is opened up first."""
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except PermissionError:
        open_up(name, dir_fd)
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)


def open_up(name: str, dir_fd: int | None) -> None:
    """Mode 0700 on the directory `name`, never through a symlink: what a normal user needs to read,
    rename or empty a directory of mode 000 it owns (overlayfs's work/work)."""
    pfd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        os.chmod(f"/proc/self/fd/{pfd}", 0o700)
    finally:
        os.close(pfd)


# Directory fds held at once below the top, whatever the depth: systemd services and the kernel's PID 1
# start with a soft RLIMIT_NOFILE of 1024 (getrlimit(2)), and a serve controller needs its fds for cells.
_OPEN_DIRS = 16


def _empty_dir(top: int, strict: bool) -> None:
    """Empty the directory open as `top`, depth first, without recursion (a cell
    can nest directories deeper than Python's recursion limit) and with at most
    _OPEN_DIRS fds, however deep the tree: a level further up than that is closed
    and, on the way back, re-opened as '..' of its child, checked by inode."""
    stack = [[top, _entries(top, strict), "", None]]  # [dir fd or None, its entries left, its name, its (dev, ino)]
    try:
        _drain(stack, strict)
    finally:
        for fd, _, _, _ in stack[1:]:
            if fd is not None:
                os.close(fd)


def _drain(stack: list, strict: bool) -> None:
    quiet = nullcontext() if strict else suppress(OSError)
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
            if parent[0] is None:  # the tree moved under the walk: what is left, the next reap removes
                if strict:
                    raise OSError(errno.ESTALE, f"a directory moved out of the tree being removed: {name}")
                return
            with quiet:
                os.rmdir(name, dir_fd=parent[0])
            continue
        entry_name, is_dir = entry
        if not is_dir:
            with quiet:
                os.unlink(entry_name, dir_fd=fd)
            continue
        try:
            sub = open_dir(entry_name, fd)
        except OSError:
            if strict:
                raise
            continue  # e.g. not readable: left for the next reap
        stack.append([sub, None, entry_name, None])
        stack[-1][1] = _entries(sub, strict)  # (sub on the stack first: closed should this raise)
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


def _entries(fd: int, strict: bool):
    """(name, is a directory) of each entry of the directory open as `fd`. Listed through its
    /proc/self/fd link, the very directory the descriptor holds (a magic link, proc(5)): opendir's
    open, fstat, getdents and close, where os.scandir(fd) costs three calls more a directory (it
    duplicates the descriptor, sets its flags, and rewinds it before closing). The type is taken
    now, while `fd` is that directory (d_type; an lstat only where the file system leaves it out).
    Without /proc (or where the link refuses what the descriptor allows), through the descriptor."""
    try:
        try:
            it = os.scandir(f"/proc/self/fd/{fd}")
        except (FileNotFoundError, PermissionError):  # no /proc here; a mode changed since the open
            it = os.scandir(fd)
        with it:
            return iter([(e.name, _is_dir(e)) for e in it])
    except OSError:
        if strict:
            raise
        return iter(())


def _is_dir(entry) -> bool:
    try:
        return entry.is_dir(follow_symlinks=False)
    except OSError:
        return False
