"""Reversible cells: what a cell changed in its worktree, kept so it can be seen and undone (issue 26).

A cell that writes its worktree runs over an overlayfs whose upper layer is
`<state>/changes/<run>/<cell>/upper`; when the cell's tree is dead, `commit`
moves the upper into the real worktree and each changed path's pre-cell
version into the record's `before/`. `undo` is the same operation the other
way round (a record of kind "undo": undo of an undo is a redo).

    <state>/changes/<run_id>/<record_id>/
        upper/ work/      while the cell runs (removed after commit)
        plan.json         while applying (written before the first step; removed after)
        before/<rel>      the pre-image of every changed path that existed before
        record.json       written atomically, last: the record (the truth; the journal indexes it)
    <state>/changes/pending/<run_id>+<record_id>
                          a layer or an undo whose journal row may be missing: finish_all (the
                          janitor) finishes what is in flight, inserts the row, drops the marker.
                          For a layer it holds what prepare() was told (JSON: worktree, agent,
                          id shift, the worktree root's mode and owner), so that the janitor can
                          commit a dead controller's cell: one file per cell, not two

Crash safety: a plan is a list of operations on disjoint paths, each applied by
`_put`/`_meta` in a way that decides from what is on disk which of its steps
already happened, so applying the same plan again (the next commit attempt, the
janitor) finishes it: the worktree ends as the cell left it, never half-merged.
A "put" of path P: (1) save the worktree's P into before/P (rename on the same
file system; else copy to before/P.part, rename, remove), (2) install the new
version (rename; else copy to a temporary name beside P, rename it to a second
name, remove the source, rename into P). While the source exists, (2) has not
finished and before/P tells whether (1) did.

The overlay is mounted with redirect_dir=off, index=off, metacopy=off (issue26.md):
the upper layer then holds only whole files, whole new directories (opaque when
they replace something), merged directories and whiteouts (character device 0/0).
Renames show as deleted + created (the kernel does not say).

Limits (documented, not hidden): a hard link the cell made between two names becomes two files;
across file systems (state root and worktree apart) xattrs are not copied and a bound socket's name
is not carried; a tree copied across file systems holds one descriptor pair per level (a chain
deeper than RLIMIT_NOFILE/2 fails the commit, and stays in the layer, nothing lost); overlayfs's own
xattrs (origin, impure) are stripped from each moved path's top only.
"""
from __future__ import annotations

import errno
import json
import os
import stat as S
import sys
import time
from contextlib import suppress

from .store import spares
from .linux import fs
from .util import crashpoints
from .errors import AmbiguousId, ChangeConflict, NotReversible, StateError, UnknownId

__all__ = ["Layer", "layer_dir", "prepare", "prepare_cell", "unsupported", "fs_type", "land", "at_end", "ran_live",
           "commit", "finish_all", "diff", "undo", "select", "prune", "prune_after", "free_run", "drop_paths",
           "drop_quarantined", "reindex", "settled", "summary_row", "UnsafePath", "ChangeConflict", "NotReversible"]

VERSION = 1
# journal.TERMINAL_CELL, spelled here: importing the journal module would load SQLite into every cell child
TERMINAL_CELL = ("exited", "failed", "timeout", "cancelled", "killed", "recovered")
PATHS_SHOWN = 50          # paths in a receipt's `changes` section and a journal row
DIFF_MAX = 1 << 20        # text diffs of files up to this size; bigger ones get sizes
OPAQUE = ("trusted.overlay.opaque", "user.overlay.opaque")
# id-mapped cells: host ids BASE..BASE+RANGE-1 (userns.py maps 65536 ids)
ID_RANGE = 65536

# test hook: called with the name of each step of apply(); a test raises from it to crash there
_step_hook = None  # Callable[[str], None] | None


class Layer(tuple):
    """(dir, upper, work): <state>/changes/<run>/<cell>, the overlay's upperdir and workdir.
    A tuple with names (typing.NamedTuple costs ~2 ms of imports on every `agnsup run`)."""
    __slots__ = ()

    def __new__(cls, dir: str, upper: str, work: str):
        return tuple.__new__(cls, (dir, upper, work))

    dir = property(lambda self: self[0])
    upper = property(lambda self: self[1])
    work = property(lambda self: self[2])

    def __repr__(self) -> str:
        return f"Layer(dir={self[0]!r}, upper={self[1]!r}, work={self[2]!r})"


def _root(state) -> str:
    return getattr(state, "path", None) or str(state)


def layer_dir(state_root: str, run_id: str, record_id: str) -> str:
    """<state>/changes/<run_id>/<record_id>."""
    return os.path.join(_root(state_root), "changes", run_id, record_id)


def _pending(state_root: str, run_id: str, record_id: str) -> str:
    # '+' is not an id character (state.check_id): the name splits back unambiguously
    return os.path.join(_root(state_root), "changes", "pending", f"{run_id}+{record_id}")


def _mark_pending(state_root: str, run_id: str, record_id: str, meta: dict | None = None,
                  owner: tuple[int, int] | None = None) -> None:
    p = _pending(state_root, run_id, record_id)
    if owner is None:  # a controller of many cells' spare file (store/spares.py): then the open finds it
        spares.claim("f600", p)
    try:
        fd = fs.open_empty(p, 0o600)  # no flush at its close (its content matters after a controller's crash)
    except FileNotFoundError:
        os.makedirs(os.path.dirname(p), mode=0o700, exist_ok=True)
        if owner is not None:
            os.chown(os.path.dirname(p), *owner)
        fd = fs.open_empty(p, 0o600)
    try:
        if meta:  # not fsynced: it matters after a crash of the controller, not of the machine
            os.write(fd, json.dumps(meta, separators=(",", ":")).encode())
    finally:
        os.close(fd)


def _pending_meta(state_root: str, run_id: str, record_id: str) -> dict:
    try:
        meta = _read_json(_pending(state_root, run_id, record_id))
    except (OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}


def _unmark_pending(state_root: str, run_id: str, record_id: str) -> None:
    with suppress(FileNotFoundError):
        os.unlink(_pending(state_root, run_id, record_id))


def prepare(state_root: str, run_id: str, cell_id: str, owner: tuple[int, int] | None = None, *,
            worktree: str | None = None, agent_id: str | None = None, id_shift: int | None = None) -> Layer:
    """Make the cell's layer dirs (0700; owned by `owner` = (uid, gid) for a normal user's
    state root) before the child starts. With `worktree`, upper/ takes the worktree root's
    mode and owner (the overlay's root shows the upper directory's attributes: without it the
    cell would see its worktree root as a 0700 directory of the state root's owner), and
    `worktree`, `agent_id`, `id_shift` are noted in the pending marker so that a janitor can
    commit what a dead controller's cell left. Cost: three mkdir and one small file."""
    d = layer_dir(state_root, run_id, cell_id)
    top = os.path.join(_root(state_root), "changes")
    for attempt in range(3):
        try:
            for p in (top, os.path.dirname(d), d):
                # the run's directory and the layer (with upper/ and work/): a controller of many cells' spares
                # (store/spares.py), the state root's owner's as these are; else made here
                if owner is None and p != top and spares.claim("layer" if p == d else "dir", p):
                    continue
                try:
                    os.mkdir(p, 0o700)
                except FileExistsError:
                    continue
                if owner is not None:
                    os.chown(p, *owner)
                if p != top and p != d:  # the run's layers each in a block group of their own (linux/fs.spread;
                    fs.spread(p)         # a spare "dir" is made so)
            break
        except FileNotFoundError:  # a neighbour cell of the run that changed nothing took the run's directory
            if attempt == 2:       # as empty (_drop_layer) between two mkdir: it is made again
                raise
    layer = Layer(d, os.path.join(d, "upper"), os.path.join(d, "work"))
    for p in (layer.upper, layer.work):  # a spare's are there: two failed mkdir (no new inode), never missing
        os.makedirs(p, mode=0o700, exist_ok=True)
        if owner is not None:
            os.chown(p, *owner)
    meta = {"run_id": run_id, "cell_id": cell_id, "agent_id": agent_id, "worktree": worktree, "id_shift": id_shift}
    if worktree is not None:
        st = os.stat(worktree)
        with suppress(PermissionError):  # a normal user's state root, another user's worktree: keep the mode only
            os.chown(layer.upper, st.st_uid, st.st_gid)
        os.chmod(layer.upper, S.S_IMODE(st.st_mode))
        meta["root"] = {"mode": S.S_IMODE(st.st_mode), "uid": st.st_uid, "gid": st.st_gid}
        meta["worktree_id"] = [st.st_dev, st.st_ino]
    _mark_pending(state_root, run_id, cell_id, meta, owner)
    return layer


# -- can this state root hold an upper layer? ------------------------------------------------------
# statfs(2) f_type values (linux/magic.h) of file systems overlayfs refuses as an upper layer, or
# on which agnsup will not put one (no whiteouts / xattrs / RENAME_WHITEOUT, or remote)
_REFUSED_FS = {
    0x794C7630: "overlayfs", 0x6969: "NFS", 0x65735546: "FUSE", 0x01021997: "9p", 0xFF534D42: "CIFS",
    0xFE534D42: "SMB2", 0x517B: "SMB", 0x5346414F: "AFS", 0x00C36400: "Ceph", 0x0BD00BD0: "Lustre",
    0xF15F: "eCryptfs", 0x73717368: "squashfs (read-only)", 0x28CD3D45: "cramfs (read-only)",
    0x9660: "ISO 9660 (read-only)", 0x858458F6: "ramfs (no xattrs)", 0x47504653: "GPFS",
}
_UNSUPPORTED_CACHE: dict[tuple[str, int], str | None] = {}


def prepare_cell(state_root: str, plan) -> Layer:
    """A capturing cell's layer (prepare, with the worktree: the overlay's root shows its owner and mode).
    A mapped cell writes it as host ids BASE+n (mounts.overlay "shift"): the commit's id_shift."""
    spec = plan.spec
    return prepare(state_root, spec.run_id, spec.cell_id, None, worktree=spec.worktree, agent_id=spec.agent_id,
                   id_shift=plan.mapped["uid"] if plan.mapped else None)


def fs_type(path: str) -> int | None:
    """statfs(2) f_type of the file system holding `path` (os.statvfs does not give it)."""
    import ctypes
    import struct
    libc = ctypes.CDLL(None, use_errno=True)
    buf = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on 64-bit Linux
    if libc.statfs(os.fsencode(path), buf) != 0:
        return None
    return struct.unpack_from("l", buf.raw, 0)[0] & 0xFFFFFFFF


def unsupported(state_root: str, worktree: str) -> str | None:
    """One line saying why this state root cannot hold an overlay upper layer for this
    worktree (overlayfs, NFS, FUSE, 9p, ... or no trusted.*/user.* xattrs), or None.
    No helper process: statfs f_type plus an xattr probe, cached per state root (in the
    process, and on disk: the probe file keeps its xattr, so a later process reads it back)."""
    root = _root(state_root)
    key = (root, os.geteuid())
    if key in _UNSUPPORTED_CACHE:
        why = _UNSUPPORTED_CACHE[key]
    else:
        why = _UNSUPPORTED_CACHE[key] = _probe(root)
    if why is None and worktree and not os.path.isdir(worktree):
        return f"the worktree {worktree} is not a directory"
    return why


def _probe(root: str) -> str | None:
    top = os.path.join(root, "changes")
    try:
        os.makedirs(top, mode=0o700, exist_ok=True)
        dev = os.stat(top).st_dev
    except OSError as e:
        return f"cannot make {top}: {e.strerror}"
    # the overlay keeps whiteouts and opaque directories in xattrs: trusted.overlay.* when mounted
    # by root, user.overlay.* (userxattr) in a normal user's namespace (overlayfs.rst, "User xattr")
    name = "trusted.agnsup.probe" if os.geteuid() == 0 else "user.agnsup.probe"
    probe = os.path.join(top, ".xattr-probe")
    stamp = str(dev).encode()
    with suppress(OSError):  # a probe that passed on this same file system (st_dev) before: one getxattr, no statfs
        if os.getxattr(probe, name, follow_symlinks=False) == stamp:
            return None
    t = fs_type(top)
    if t in _REFUSED_FS:
        return f"the state root {root} is on {_REFUSED_FS[t]}, which cannot hold an overlay upper layer"
    if os.statvfs(top).f_flag & os.ST_RDONLY:
        return f"the state root {root} is on a read-only file system"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600))
        os.setxattr(probe, name, stamp, follow_symlinks=False)
    except OSError as e:
        return (f"the state root {root} cannot hold {name.split('.')[0]}.* xattrs ({e.strerror}): "
                "an overlay upper layer needs them")
    return None


# -- small file-system helpers -------------------------------------------------------------------------
def _write_json(path: str, data, sync: bool = False) -> None:
    """Atomically (a temporary name, then rename); fsynced (file and directory) when `sync`. The plan
    and the record are not: the page cache outlives any death of the controller (SIGKILL, OOM), which
    is what they guard against; a power loss is the machine's, as for the volatile overlay and every
    write a live cell makes (each fsync waited 5-15 ms here behind the file system's other dirty data)."""
    tmp = path + ".tmp"
    text = json.dumps(data, sort_keys=True, separators=(",", ":"))  # dumps: the C encoder (dump streams in Python)
    with open(tmp, "w") as f:
        f.write(text)
        if sync:
            f.flush()
            os.fsync(f.fileno())
    os.rename(tmp, path)
    if sync:
        fd = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _read_json(path: str):
    return json.loads(fs.read_bytes(path))  # 3 system calls where open() makes 9 (the janitor reads one a cell)


def _lstat(path: str, dir_fd: int | None = None):
    """os.lstat, or None where nothing is (or a parent is a file now)."""
    try:
        return os.lstat(path, dir_fd=dir_fd)
    except (FileNotFoundError, NotADirectoryError):
        return None


def _type(st) -> str:
    if st is None:
        return "absent"
    m = st.st_mode
    return "file" if S.S_ISREG(m) else "dir" if S.S_ISDIR(m) else "symlink" if S.S_ISLNK(m) else "other"


def _info(path: str, st=None, full: bool = False) -> dict:
    """What the record says of one path: type, mode, size, owner, link target; with `full`
    also mtime_ns and ino (an entry's `after`, what undo compares with)."""
    st = st if st is not None else _lstat(path)
    t = _type(st)
    if t == "absent":
        return {"type": "absent"}
    out = {"type": t, "mode": S.S_IMODE(st.st_mode), "size": st.st_size if t != "dir" else 0,
           "uid": st.st_uid, "gid": st.st_gid, "mtime_ns": st.st_mtime_ns}
    if t == "symlink":
        out["target"] = os.readlink(path)
    if full:
        out["ino"] = st.st_ino
    return out


def _same_content(a: str, wt: str, rel: str, size: int) -> bool:
    """File `a` (ours: the upper, a before/) holds what the worktree's `rel` holds."""
    if size == 0:
        return True
    try:
        fb = _open_in(wt, rel)
    except OSError:
        return False
    with open(a, "rb") as fa, open(fb, "rb") as fb:
        while True:
            x, y = fa.read(1 << 20), fb.read(1 << 20)
            if x != y:
                return False
            if not x:
                return True


def _whiteout(st) -> bool:
    return S.S_ISCHR(st.st_mode) and st.st_rdev == 0


def _opaque(path: str) -> bool:
    for name in OPAQUE:
        with suppress(OSError):
            if os.getxattr(path, name, follow_symlinks=False) in (b"y", b"x"):
                return True
    return False


def _strip_overlay_xattrs(path: str) -> None:
    """overlayfs's own xattrs (opaque, origin, ...) do not follow a path into the worktree."""
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError:
        return
    for n in names:
        if n.startswith(("trusted.overlay.", "user.overlay.")):
            with suppress(OSError):
                os.removexattr(path, n, follow_symlinks=False)


def _rm(path: str) -> None:
    """Remove a file or a whole tree, or raise (a removal that stopped halfway must not pass for
    done: apply decides what happened from what exists)."""
    fs.rmtree(path, strict=True)


# -- the worktree is reached one component at a time, never through a symlink ------------------------------
# The controller commits (as root, often) into a directory an agent writes: a live cell of the same
# agent could swap a directory of the worktree for a symlink to /etc between the scan and a rename.
# Every operation under the worktree therefore goes through a directory file descriptor opened with
# O_NOFOLLOW per component (openat(2)); a swapped component fails with ELOOP/ENOTDIR instead.
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_NOFOLLOW_DIR = _DIR | os.O_NOFOLLOW


class UnsafePath(OSError):
    """A component of a worktree path is no longer a directory (a symlink, a file)."""


def _wt_parent(wt: str, rel: str, create: bool = False) -> int:
    """A descriptor of the worktree directory that holds `rel` ('' and top-level: the worktree)."""
    fd = os.open(wt, _DIR)
    try:
        for part in rel.split("/")[:-1]:
            try:
                nfd = os.open(part, _NOFOLLOW_DIR, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                os.mkdir(part, 0o755, dir_fd=fd)
                nfd = os.open(part, _NOFOLLOW_DIR, dir_fd=fd)
            os.close(fd)
            fd = nfd
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UnsafePath(e.errno, f"a directory of the worktree became a symlink or a file: {rel}") from None
        raise
    return fd


def _open_in(wt: str, rel: str) -> int:
    """The worktree file `rel`, opened for reading without following a symlink anywhere."""
    fd = _wt_parent(wt, rel)
    try:
        return os.open(os.path.basename(rel), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
    finally:
        os.close(fd)


def _set_meta_at(dfd: int | None, name: str, uid: int, gid: int, mode: int | None, mtime=None) -> None:
    """Owner, mode (not a symlink's) and times of `name`, following no symlink: the mode through an
    O_PATH descriptor's /proc link, as chmod(2) has no working AT_SYMLINK_NOFOLLOW on Linux."""
    os.chown(name, uid, gid, dir_fd=dfd, follow_symlinks=False)
    if mode is not None:
        pfd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
        try:
            if not S.S_ISLNK(os.fstat(pfd).st_mode):
                os.chmod(f"/proc/self/fd/{pfd}", mode)
        finally:
            os.close(pfd)
    if mtime is not None:
        os.utime(name, ns=mtime, dir_fd=dfd, follow_symlinks=False)


def _copy_at(sfd: int | None, src: str, dfd: int | None, dst: str) -> None:
    """Copy a file, symlink, special file or whole tree across file systems, keeping owner, mode and
    times (xattrs are not kept: issue26.md), reading and writing through directory descriptors."""
    st = os.lstat(src, dir_fd=sfd)
    m = st.st_mode
    if S.S_ISDIR(m):
        os.mkdir(dst, 0o700, dir_fd=dfd)
        s2 = os.open(src, _NOFOLLOW_DIR, dir_fd=sfd)
        try:
            d2 = os.open(dst, _NOFOLLOW_DIR, dir_fd=dfd)
            try:
                for name in sorted(os.listdir(s2)):
                    _copy_at(s2, name, d2, name)
            finally:
                os.close(d2)
        finally:
            os.close(s2)
    elif S.S_ISLNK(m):
        os.symlink(os.readlink(src, dir_fd=sfd), dst, dir_fd=dfd)
    elif S.S_ISREG(m):
        fi = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=sfd)
        try:
            fo = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
            try:
                _copy_data(fi, fo, st.st_size)
            finally:
                os.close(fo)
        finally:
            os.close(fi)
    elif S.S_ISFIFO(m):
        os.mkfifo(dst, 0o600, dir_fd=dfd)
    elif S.S_ISCHR(m) or S.S_ISBLK(m):
        os.mknod(dst, S.S_IFMT(m) | 0o600, st.st_rdev, dir_fd=dfd)
    else:  # a socket: its name means something only to the process that bound it
        return
    _set_meta_at(dfd, dst, st.st_uid, st.st_gid, None if S.S_ISLNK(m) else S.S_IMODE(m),
                 (st.st_atime_ns, st.st_mtime_ns))


def _copy_data(fi: int, fo: int, size: int) -> None:
    left = size
    try:
        while left > 0:
            n = os.copy_file_range(fi, fo, min(left, 1 << 30))
            if n == 0:
                break
            left -= n
        if left <= 0:
            return
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
            raise
    while True:  # whatever copy_file_range did not (a file that grew, a kernel that refuses it)
        b = os.read(fi, 1 << 20)
        if not b:
            return
        os.write(fo, b)


def _dev(path: str) -> int:
    """st_dev of the directory that holds (or would hold) `path`."""
    p = path
    while True:
        p = os.path.dirname(p)
        st = _lstat(p)
        if st is not None:
            return st.st_dev


def _step(name: str) -> None:
    if _step_hook is not None:
        _step_hook(name)


# -- applying a plan (commit and undo share it) ---------------------------------------------------------
# A plan: {"record", "run_id", ..., "worktree", "ops": [op]}; an op:
#   {"op": "put", "path": rel, "src": abs | None, "strip": bool}   save worktree/rel into before/rel,
#                                                                   then move src into worktree/rel
#   {"op": "meta", "path": rel, "before": info, "to": {mode, uid, gid, mtime_ns?}}
def _put(wt: str, rec: str, i: int, op: dict) -> None:
    rel, src = op["path"], op["src"]
    b = os.path.join(rec, "before", rel)
    wfd = _wt_parent(wt, rel, create=src is not None)
    try:
        _put_at(wfd, os.path.basename(rel), b, src, f".agnsup-{os.path.basename(rec)}-{i}", op.get("strip"))
    finally:
        os.close(wfd)


def _put_at(wfd: int, name: str, b: str, src: str | None, tmp: str, strip: bool) -> None:
    """One put, `name` in the worktree directory `wfd`; `tmp`: the name of a cross-fs copy beside it."""
    if src is not None and _lstat(src) is None:  # installed, or copied and its source removed
        if _lstat(tmp, wfd) is not None:
            os.rename(tmp, name, src_dir_fd=wfd, dst_dir_fd=wfd)
        return
    if src is not None and _lstat(tmp, wfd) is not None:  # a complete cross-fs copy: finish it
        _rm(src)
        _step("put.src_removed")
        os.rename(tmp, name, src_dir_fd=wfd, dst_dir_fd=wfd)
        return
    # (1) save the worktree's version
    if _lstat(b) is not None:
        fs.rmtree(name, wfd, strict=True)  # a cross-fs save that had not finished removing the original
    elif _lstat(name, wfd) is not None:
        os.makedirs(os.path.dirname(b), mode=0o700, exist_ok=True)
        if os.fstat(wfd).st_dev == _dev(b):
            os.rename(name, b, src_dir_fd=wfd)
        else:
            part = b + ".agnsup-part"
            _rm(part)
            _copy_at(wfd, name, None, part)
            if _lstat(part) is not None:  # else a socket: nothing a copy could keep
                os.rename(part, b)
            _step("put.saved_copy")
            fs.rmtree(name, wfd, strict=True)
    _step("put.saved")
    if src is None:
        return
    # (2) install the new version
    if strip:
        _strip_overlay_xattrs(src)
    if os.lstat(src).st_dev == os.fstat(wfd).st_dev:
        os.rename(src, name, dst_dir_fd=wfd)
    else:
        part = tmp + ".part"
        fs.rmtree(part, wfd, strict=True)
        _copy_at(None, src, wfd, part)
        if _lstat(part, wfd) is None:  # a socket the cell left bound: its name cannot be copied
            _rm(src)
            return
        os.rename(part, tmp, src_dir_fd=wfd, dst_dir_fd=wfd)
        _step("put.copied")
        _rm(src)
        _step("put.src_removed")
        os.rename(tmp, name, src_dir_fd=wfd, dst_dir_fd=wfd)
    _step("put.installed")


def _meta(wt: str, op: dict) -> None:
    rel, to = op["path"], op["to"]
    if rel == "":  # the worktree root itself (agnsup's own path, not the agent's)
        os.chown(wt, to["uid"], to["gid"])
        os.chmod(wt, to["mode"])
        _step("meta")
        return
    try:
        wfd = _wt_parent(wt, rel)
    except FileNotFoundError:
        return
    try:
        name = os.path.basename(rel)
        st = _lstat(name, wfd)
        if st is None:
            return
        mtime = (st.st_atime_ns, to["mtime_ns"]) if to.get("mtime_ns") is not None else None
        _set_meta_at(wfd, name, to["uid"], to["gid"], None if S.S_ISLNK(st.st_mode) else to["mode"], mtime)
    finally:
        os.close(wfd)
    _step("meta")


def _apply(state_root: str, rec: str, plan: dict) -> dict:
    """Run every op of the plan (each idempotent), then write record.json (entries from what is now
    on disk), then remove plan.json and the layer. Returns the record."""
    wt = plan["worktree"]
    for i, op in enumerate(plan["ops"]):
        if op["op"] == "put":
            _put(wt, rec, i, op)
        else:
            _meta(wt, op)
        if i == 0:
            crashpoints.hit("changes_mid_commit")
    record = _read_json(os.path.join(rec, "record.json")) if os.path.exists(os.path.join(rec, "record.json")) else None
    if record is None:
        crashpoints.hit("changes_before_record")
        _step("before_record")
        record = _make_record(rec, plan)
        _write_json(os.path.join(rec, "record.json"), record)
    _step("record_written")
    for p in ("upper", "work"):
        _rm(os.path.join(rec, p))
    for p in ("plan.json",):
        with suppress(FileNotFoundError):
            os.unlink(os.path.join(rec, p))
    return record


def _walk(root: str, rel: str, out: dict) -> None:
    """out[rel] = lstat of root/rel and of everything under it, parents first (iterative: a tree
    deeper than Python's recursion limit is still recorded)."""
    stack = [rel]
    while stack:
        r = stack.pop()
        st = _lstat(os.path.join(root, r))
        if st is None:
            continue
        out[r] = st
        if S.S_ISDIR(st.st_mode):
            stack.extend(f"{r}/{n}" if r else n for n in sorted(os.listdir(os.path.join(root, r)), reverse=True))


def _make_record(rec: str, plan: dict) -> dict:
    wt = plan["worktree"]
    before_dir = os.path.join(rec, "before")
    entries: list[dict] = []
    for op in plan["ops"]:
        rel = op["path"]
        if op["op"] == "meta":
            entries.append({"path": rel, "change": "mode", "before": op["before"],
                            "after": _info(os.path.join(wt, rel), full=True)})
            continue
        old: dict = {}
        new: dict = {}
        _walk(before_dir, rel, old)
        _walk(wt, rel, new)
        for p in sorted(set(old) | set(new)):
            o, n = old.get(p), new.get(p)
            bi = _info(os.path.join(before_dir, p), o) if o is not None else {"type": "absent"}
            ai = _info(os.path.join(wt, p), n, full=True) if n is not None else {"type": "absent"}
            if o is None:
                change = "created"
            elif n is None:
                change = "deleted"
            elif bi["type"] != ai["type"] or (p == rel and bi["type"] == "dir"):
                change = "replaced"
            elif bi["type"] == "dir":
                if (bi["mode"], bi["uid"], bi["gid"]) == (ai["mode"], ai["uid"], ai["gid"]):
                    continue  # a directory of a replaced tree, the same in both
                change = "mode"
            elif bi["type"] == "file" and bi["size"] == ai["size"] and _same_content(
                    os.path.join(before_dir, p), wt, p, bi["size"]):
                change = "mode"
                if all(bi[k] == ai[k] for k in ("mode", "uid", "gid", "mtime_ns")):
                    change = "modified" if p == rel else None
                if change is None:
                    continue
            elif bi["type"] == "symlink" and bi.get("target") == ai.get("target"):
                change = "mode"
            else:
                change = "modified"
            entries.append({"path": p, "change": change, "before": bi, "after": ai})
    counts, nbytes = _counts(entries)
    return {"version": VERSION, "record": plan["record"], "run_id": plan["run_id"], "agent_id": plan["agent_id"],
            "cell_id": plan["cell_id"], "kind": plan["kind"], "undoes": plan["undoes"], "worktree": wt,
            "worktree_id": plan["worktree_id"], "created_at": plan["created_at"], "entries": entries,
            "ops": plan["ops_summary"], "counts": counts, "bytes": nbytes}


def _counts(entries: list[dict]) -> tuple[dict, dict]:
    counts = {"created": 0, "modified": 0, "deleted": 0, "replaced": 0, "mode": 0, "symlink": 0, "dir": 0}
    written = saved = 0
    for e in entries:
        counts[e["change"]] += 1
        types = (e["before"]["type"], e["after"]["type"])
        counts["symlink"] += "symlink" in types
        counts["dir"] += "dir" in types
        if e["after"]["type"] == "file" and e["change"] != "mode":
            written += e["after"]["size"]
        if e["before"]["type"] == "file" and e["change"] != "mode":
            saved += e["before"]["size"]
    return counts, {"written": written, "saved": saved}


def _summary(record: dict | None, mode: str = "at_exit") -> dict:
    if record is None:
        return {"mode": mode, "files": 0, "created": 0, "modified": 0, "deleted": 0, "bytes": 0, "paths": [],
                "more": 0}
    es = record["entries"]
    c = record["counts"]
    paths = [e["path"] for e in es[:PATHS_SHOWN]]
    return {"mode": mode, "record": f"{record['run_id']}/{record['record']}", "worktree": record["worktree"],
            "kind": record["kind"], "undoes": record["undoes"], "agent_id": record["agent_id"],
            "cell_id": record["cell_id"], "created_at": record["created_at"],
            "created": c["created"], "modified": c["modified"] + c["replaced"] + c["mode"], "deleted": c["deleted"],
            "files": len(es), "bytes": record["bytes"]["written"], "bytes_saved": record["bytes"]["saved"],
            "paths": paths, "more": max(0, len(es) - len(paths))}


# -- commit -------------------------------------------------------------------------------------------
def _unshift(ident: int, base: int | None) -> int:
    """A host id BASE+n of a mapped cell's upper as n (the id the cell saw); any other id as it is."""
    return ident - base if base and base <= ident < base + ID_RANGE else ident


def _shift_ids(upper: str, base: int) -> None:
    """Owners BASE+n in the upper become n (idempotent: an id already shifted is below BASE)."""
    def fix(p: str) -> None:
        st = os.lstat(p)
        uid, gid = st.st_uid, st.st_gid
        nu, ng = _unshift(uid, base), _unshift(gid, base)
        if (nu, ng) != (uid, gid):
            mode = S.S_IMODE(st.st_mode)
            os.lchown(p, nu, ng)
            if not S.S_ISLNK(st.st_mode) and mode & 0o6000:  # chown clears set-id bits
                os.chmod(p, mode)
    fix(upper)  # its root too: the worktree root's owner as the mapped cell saw it
    for dirpath, dirs, files in os.walk(upper):
        for n in dirs + files:
            fix(os.path.join(dirpath, n))


def _scan(upper: str, wt: str, rel: str, ops: list, metas: list) -> None:
    """The upper layer's changes against the worktree as it is now (the cell's lower)."""
    base = os.path.join(upper, rel) if rel else upper
    with os.scandir(base) as it:
        names = sorted(it, key=lambda e: e.name)
    for e in names:
        r = f"{rel}/{e.name}" if rel else e.name
        u = e.stat(follow_symlinks=False)
        lo = _lstat(os.path.join(wt, r))
        if _whiteout(u):
            if lo is not None:
                ops.append({"op": "put", "path": r, "src": None})
            continue
        src = os.path.join(upper, r)
        if S.S_ISDIR(u.st_mode):
            if lo is not None and S.S_ISDIR(lo.st_mode) and not _opaque(src):
                _scan(upper, wt, r, ops, metas)  # a merged directory: only what changed in it
                if (S.S_IMODE(u.st_mode), u.st_uid, u.st_gid) != (S.S_IMODE(lo.st_mode), lo.st_uid, lo.st_gid):
                    metas.append({"op": "meta", "path": r, "before": _info(os.path.join(wt, r), lo),
                                  "to": {"mode": S.S_IMODE(u.st_mode), "uid": u.st_uid, "gid": u.st_gid}})
            else:
                ops.append({"op": "put", "path": r, "src": src, "strip": True})
            continue
        if lo is not None and S.S_IFMT(lo.st_mode) == S.S_IFMT(u.st_mode):
            same = False
            if S.S_ISREG(u.st_mode):
                same = u.st_size == lo.st_size and _same_content(src, wt, r, u.st_size)
            elif S.S_ISLNK(u.st_mode):
                same = os.readlink(src) == os.readlink(os.path.join(wt, r))
            if same:
                # a copy-up with the same content: at most the mode, owner or times changed
                if (u.st_mode, u.st_uid, u.st_gid, u.st_mtime_ns) != (lo.st_mode, lo.st_uid, lo.st_gid, lo.st_mtime_ns):
                    ops.append({"op": "meta", "path": r, "before": _info(os.path.join(wt, r), lo),
                                "to": {"mode": S.S_IMODE(u.st_mode), "uid": u.st_uid, "gid": u.st_gid,
                                       "mtime_ns": u.st_mtime_ns}})
                continue
        ops.append({"op": "put", "path": r, "src": src, "strip": True})


def _worktree_id(wt: str) -> list[int] | None:
    st = _lstat(wt)
    return [st.st_dev, st.st_ino] if st is not None else None


def _empty_layer(d: str, worktree: str, id_shift: int | None = None) -> bool:
    """Nothing in the upper, and its root as the worktree's (else the cell may have changed the
    root's own mode or owner: the slow path reads the pending marker to tell). A mapped cell's
    upper root holds the worktree root's owner shifted by `id_shift` (mounts.overlay): compared
    as _shift_ids would leave it."""
    upper = os.path.join(d, "upper")
    try:
        if os.listdir(upper):
            return False
        u, w = os.stat(upper), os.stat(worktree)
    except FileNotFoundError:
        return False
    return (u.st_mode, _unshift(u.st_uid, id_shift), _unshift(u.st_gid, id_shift)) == (w.st_mode, w.st_uid, w.st_gid)


def _drop_layer(state_root: str, run_id: str, record_id: str) -> None:
    """The layer of a cell that changed nothing: a handful of rmdir calls, no record. Best effort:
    a state root that went read-only (the kill switch's case) does not turn "nothing changed" into
    an error; what is left, the janitor removes (finish_all: an empty upper again)."""
    d = layer_dir(state_root, run_id, record_id)
    try:
        # work/work: the kernel's, mode 000, empty; a `volatile` mount leaves incompat/volatile/dirty in it
        # (overlayfs.rst, "Volatile mount"); a normal user (no CAP_DAC_OVERRIDE) opens it up first
        if os.geteuid() != 0:
            with suppress(FileNotFoundError):
                os.chmod(os.path.join(d, "work/work"), 0o700)
        with suppress(FileNotFoundError):
            os.unlink(os.path.join(d, "work/work/incompat/volatile/dirty"))
        for p in ("work/work/incompat/volatile", "work/work/incompat", "work/work", "work", "upper"):
            with suppress(FileNotFoundError):
                os.rmdir(os.path.join(d, p))
        os.rmdir(d)
    except OSError:
        try:
            _rm(d)
        except OSError:  # a read-only or full state root: nothing changed, the janitor removes it later
            return
    with suppress(OSError):
        os.rmdir(os.path.dirname(d))  # the run's directory, when this was its only record
    with suppress(OSError):
        _unmark_pending(state_root, run_id, record_id)


def land(state_root: str, run_id: str, cell_id: str, worktree: str, *, agent_id: str,
         id_shift: int | None = None) -> dict:
    """A capturing cell's tree is dead (its controller's end, or the janitor's for a dead controller):
    commit what it left and return the receipt's `changes` section. Where the kernel refused the overlay
    (mounts.LAYER_LIVE: it ran live) the section says so; a commit that fails stays in flight for the
    janitor (finish_all) and the section names the error: the cell's end is recorded all the same.
    `id_shift`: a mapped cell's (else the one prepare() noted)."""
    live = ran_live(layer_dir(state_root, run_id, cell_id))
    if id_shift is None:
        id_shift = _pending_meta(state_root, run_id, cell_id).get("id_shift")
    try:
        summary = commit(state_root, run_id, cell_id, worktree, agent_id=agent_id, id_shift=id_shift)
    except Exception as e:  # noqa: BLE001 - the cell has ended whatever the commit did
        return {"mode": "at_exit", "files": None, "error": f"the commit did not finish: {e}; the janitor "
                "finishes it (agnsup janitor)", "pending": f"{run_id}/{cell_id}"}
    return summary if live is None else {"mode": "live", "why": live}


def at_end(state_root: str, plan, captured: bool) -> dict | None:
    """The receipt's `changes` section once the cell's tree is dead (None: it gets none). A capturing
    cell (`captured`: its layer exists) lands what it wrote (land); a cell that runs live (or has a
    read-only worktree) gets the section that says so."""
    if captured:
        spec = plan.spec
        return land(state_root, spec.run_id, spec.cell_id, spec.worktree, agent_id=spec.agent_id,
                    id_shift=plan.mapped["uid"] if plan.mapped else None)
    if plan is None or not plan.changes or plan.changes.get("mode") == "at_exit":
        return None
    return {"mode": plan.changes["mode"], "why": plan.changes.get("why")}


def unchanged(state_root: str, plan) -> bool:
    """At a capturing cell's end, its tree dead: would `at_end` find nothing to land and only remove the layer?
    (No plan or record in flight, the overlay not refused, an empty upper whose root is the worktree's.) Then the
    receipt's section is nothing_changed() and the layer's removal (drop_unchanged) may wait until after the cell's
    result: a crash meanwhile leaves the layer with its pending marker, and the janitor's finish_all finds an empty
    upper of an ended cell and drops it ("empty"), as it would have been dropped here."""
    spec = plan.spec
    d = layer_dir(state_root, spec.run_id, spec.cell_id)
    if ran_live(d) is not None or any(os.path.lexists(os.path.join(d, n)) for n in ("plan.json", "record.json")):
        return False
    return _empty_layer(d, spec.worktree, plan.mapped["uid"] if plan.mapped else None)


def nothing_changed() -> dict:
    """The receipt's `changes` section of a capturing cell that changed nothing."""
    return _summary(None)


def drop_unchanged(state_root: str, plan) -> None:
    """The layer `unchanged` found empty, removed (its pending marker last)."""
    _drop_layer(state_root, plan.spec.run_id, plan.spec.cell_id)


def ran_live(layer: str) -> str | None:
    """Why the kernel refused a capturing cell's overlay, which then ran live (mounts.LAYER_LIVE), else None."""
    from .linux.mounts import LAYER_LIVE
    try:
        with open(os.path.join(layer, LAYER_LIVE)) as f:
            return f"the kernel refused the worktree's overlay here ({f.read().strip()}): the cell ran live"
    except OSError:
        return None


def commit(state_root: str, run_id: str, cell_id: str, worktree: str, *, agent_id: str,
           id_shift: int | None = None) -> dict:
    """The cell's tree is dead: its upper layer into the worktree, pre-images into before/,
    record.json last. Idempotent and resumable (a second call after a crash finishes the job).
    `id_shift` = BASE: owners BASE+n in the upper become n (a mapped cell whose upper could
    not be id-mapped). Returns the receipt's `changes` section:
    {"mode": "at_exit", "record": "<run>/<cell>", "worktree", "created", "modified", "deleted",
    "files", "bytes", "paths": [<=50], "more": n}; with files 0 and no "record" when nothing
    changed (no record kept, the layer dirs removed)."""
    rec = layer_dir(state_root, run_id, cell_id)
    rj, pj = os.path.join(rec, "record.json"), os.path.join(rec, "plan.json")
    if os.path.exists(pj):
        return _summary(_apply(state_root, rec, _read_json(pj)))
    if os.path.exists(rj):  # committed before; at most the layer's leftovers to remove
        return _summary(_apply(state_root, rec, {"worktree": worktree, "ops": []}))
    if not os.path.isdir(rec):
        raise UnknownId(f"no change layer for cell {cell_id} of run {run_id}")
    if _empty_layer(rec, worktree, id_shift):
        _drop_layer(state_root, run_id, cell_id)
        return nothing_changed()
    upper = os.path.join(rec, "upper")
    meta = _pending_meta(state_root, run_id, cell_id)
    if id_shift:
        _shift_ids(upper, id_shift)
    ops: list = []
    metas: list = []
    _scan(upper, worktree, "", ops, metas)
    root_was = meta.get("root")
    if root_was is not None:  # the cell changed the worktree root's own mode or owner
        u = os.lstat(upper)
        now = (S.S_IMODE(u.st_mode), u.st_uid, u.st_gid)
        if now != (root_was["mode"], root_was["uid"], root_was["gid"]):
            metas.append({"op": "meta", "path": "", "before": _info(worktree),
                          "to": {"mode": now[0], "uid": now[1], "gid": now[2]}})
    metas.sort(key=lambda m: -m["path"].count("/") if m["path"] else 1)  # deepest first, the root last
    ops += metas
    if not ops:  # copied up, nothing different (a file opened for writing and left as it was)
        _drop_layer(state_root, run_id, cell_id)
        return _summary(None)
    plan = {"version": VERSION, "record": cell_id, "run_id": run_id, "agent_id": agent_id, "cell_id": cell_id,
            "kind": "cell", "undoes": None, "worktree": worktree, "worktree_id": _worktree_id(worktree),
            "created_at": time.time(), "ops": ops,
            "ops_summary": [{"op": o["op"], "path": o["path"], **({"before": o["before"], "to": o["to"]}
                                                                  if o["op"] == "meta" else {})} for o in ops]}
    _write_json(pj, plan)
    _step("plan_written")
    return _summary(_apply(state_root, rec, plan))


# -- reading records --------------------------------------------------------------------------------
def _load(state_root: str, run_id: str, record_id: str) -> dict:
    p = os.path.join(layer_dir(state_root, run_id, record_id), "record.json")
    try:
        return _read_json(p)
    except FileNotFoundError:
        raise NotReversible(f"record {run_id}/{record_id} is not on disk (dropped or removed)") from None
    except ValueError as e:
        raise NotReversible(f"record {run_id}/{record_id} is unreadable: {e}") from None


def _resolve(state_root: str, journal, record_id: str, run_id: str | None = None):
    """The journal row of a record named "run/record", or a record (cell) id with an optional run."""
    if run_id is None and "/" in record_id:
        run_id, record_id = record_id.split("/", 1)
    rows = journal.change_rows(run_id=run_id, record_id=record_id)
    if not rows:
        _explain_missing(state_root, journal, record_id, run_id)
    if len(rows) > 1:
        raise AmbiguousId(f"record {record_id} is in several runs ({', '.join(r['run_id'] for r in rows)}): "
                          "say which with --run")
    return rows[0]


def _explain_missing(state_root: str, journal, record_id: str, run_id: str | None):
    """A record the journal does not index: say why in one line."""
    runs = [run_id] if run_id else journal.cell_runs(record_id)
    for r in runs:
        cell = journal.cell(r, record_id)
        if cell is None:
            continue
        rcpts = journal.receipts(kind="cell", run_id=r, cell_id=record_id)
        ch = (rcpts[-1].get("changes") if rcpts else None) or {}
        if ch.get("mode") == "live":
            why = ch.get("why")
            raise NotReversible(f"cell {record_id} ran live: its writes went straight to the worktree and were not "
                                f"recorded{' (' + why + ')' if why else ''}; nothing to undo")
        if cell["state"] not in TERMINAL_CELL:
            raise NotReversible(f"cell {record_id} of run {r} is still {cell['state']}: its changes land when it ends")
        d = layer_dir(state_root, r, record_id)
        # its receipt says it changed nothing (nothing_changed): a layer still on disk is only its empty one, which
        # its controller removes after the cell's result (drop_unchanged), not a commit in flight
        unchanged = ch.get("files") == 0 and "record" not in ch and not ch.get("error")
        if not unchanged and any(os.path.lexists(os.path.join(d, n)) for n in ("plan.json", "upper", "record.json")):
            raise NotReversible(f"the changes of cell {record_id} of run {r} are not committed yet"
                                f"{' (' + str(ch['error']) + ')' if ch.get('error') else ''}: the janitor finishes "
                                "the commit (agnsup janitor)")
        if rcpts and not ch:
            raise NotReversible(f"cell {record_id} of run {r} has no change record (it could not write the "
                                "worktree, or ran before agnsup recorded changes)")
        raise NotReversible(f"cell {record_id} of run {r} changed nothing in the worktree")
    if run_id and os.path.isdir(layer_dir(state_root, run_id, record_id)):
        raise NotReversible(f"record {run_id}/{record_id} is still being committed (the janitor finishes it)")
    raise UnknownId(f"no cell or change record {record_id!r}" + (f" in run {run_id}" if run_id else ""))


# -- undo -------------------------------------------------------------------------------------------------
def _under(p: str, q: str) -> bool:
    """p is q or lies under q ('' is the worktree root)."""
    return q == "" or p == q or p.startswith(q + "/")


def _matches(cur: dict, want: dict, strict: bool = True) -> bool:
    if cur["type"] != want["type"]:
        return False
    if want["type"] == "absent":
        return True
    keys = ("mode", "uid", "gid") + (() if want["type"] == "dir" else ("size", "mtime_ns", "target"))
    if strict and want["type"] != "dir" and "ino" in want:
        keys += ("ino",)
    return all(cur.get(k) == want.get(k) for k in keys)


def _git_index(path: str) -> bool:
    """git's index (of the worktree or a linked one): a stat cache `git status` refreshes on the host
    after every cell, which would otherwise make each undo a "changed outside agnsup" refusal."""
    return path == ".git/index" or path.endswith("/.git/index") or \
        (path.startswith(".git/worktrees/") and path.endswith("/index"))


def _drift(record: dict, rec_dir: str) -> list[str]:
    """Paths where the worktree is no longer as the record left it: a different type, mode, owner,
    size, time or inode, or a path under a directory the record put in place that it did not make."""
    wt = record["worktree"]
    known = {e["path"] for e in record["entries"]}
    bad = []
    for e in record["entries"]:
        if _git_index(e["path"]):
            continue  # a cache every host `git status` rewrites: undo replaces it (the undo record keeps it)
        p = os.path.join(wt, e["path"]) if e["path"] else wt
        if not _matches(_info(p, full=True), e["after"]):
            bad.append(e["path"])
    for op in record.get("ops", []):  # a directory on the way swapped for a symlink or a file
        if "/" in op["path"]:
            try:
                os.close(_wt_parent(wt, op["path"]))
            except UnsafePath:
                bad.append(op["path"])
            except OSError:
                pass
    # a path that appeared under a tree the record put in place (undo would take it away): neither an
    # entry nor in before/ (an unchanged part of a replaced tree is in both the worktree and before/)
    before = os.path.join(rec_dir, "before")
    for op in record.get("ops", []):
        if op["op"] != "put":
            continue
        extra: dict = {}
        _walk(wt, op["path"], extra)
        bad.extend(p for p in extra if p not in known and _lstat(os.path.join(before, p)) is None)
    return sorted(set(bad))


def _later_touching(state_root: str, journal, row, paths: list[str]) -> list[str]:
    """The records after `row` on the same worktree that touched one of `paths` (or a tree above
    or below one), by cell (an undo record by its id)."""
    names = []
    for r in journal.change_rows(worktree=row["worktree"], after=row["created_at"], state="committed"):
        if (r["run_id"], r["record_id"]) == (row["run_id"], row["record_id"]):
            continue
        try:
            other = _load(state_root, r["run_id"], r["record_id"])
        except NotReversible:
            continue
        theirs = [e["path"] for e in other["entries"]]
        if any(_under(p, q) or _under(q, p) for p in paths for q in theirs):
            names.append(r["cell_id"] or r["record_id"])
    return names


def _check_undoable(state_root: str, journal, row) -> dict:
    where = f"{row['run_id']}/{row['record_id']}"
    if row["state"] == "dropped":
        raise NotReversible(f"record {where} was dropped (retention: filesystem.changes_keep / changes_keep_bytes): "
                            "nothing left to restore")
    if row["state"] == "undone":
        raise NotReversible(f"record {where} was already undone by {row['undone_by']} "
                            f"(`agnsup undo {row['undone_by']} --run {row['run_id']}` redoes it)")
    record = _load(state_root, row["run_id"], row["record_id"])
    wt = record["worktree"]
    if _worktree_id(wt) != record["worktree_id"]:
        raise NotReversible(f"the worktree {wt} of record {where} moved or is gone (not the same directory): "
                            "nothing changed")
    return record


def chain(row, lookup) -> list:
    """`row` and the records that undid it in turn (its undo, that undo's redo, ...), as far as the
    journal goes; `lookup(run_id, record_id)` gives a row or None."""
    out = [row]
    while out[-1]["state"] == "undone" and out[-1]["undone_by"] and len(out) < 1000:
        nxt = lookup(out[-1]["run_id"], out[-1]["undone_by"])
        if nxt is None:
            break
        out.append(nxt)
    return out


def record_state(row, lookup) -> tuple[str, str | None]:
    """(kept | undone | redone | dropped, the undo record now in force or None) of a record's journal
    row, the chain followed (the row's own state says only "undone" once an undo touched it)."""
    c = chain(row, lookup)
    if len(c) == 1:
        return {"committed": "kept"}.get(row["state"], row["state"]), None
    return ("undone" if len(c) % 2 == 0 else "redone"), c[-1]["record_id"]


def _in_force(journal, row):
    """A record undone and then redone is in force as its redo record: `undo CELL` after
    `undo CELL; undo undo-X` undoes the redo (the cell's own pre-images went back with the first undo).
    A record whose last undo is in force is itself (undo then refuses it as already undone)."""
    c = chain(row, journal.change_row)
    return c[-1] if len(c) % 2 == 1 else c[-2]


def undo(state, journal, record_ids, force: bool = False) -> dict:
    """Undo records (ids "run/record", or (run, record) pairs), newest first. Refuses, with nothing
    changed on disk: ChangeConflict (exit 75) when a later record touched the same paths or the
    worktree changed outside agnsup since (unless `force`); NotReversible for a record already
    undone or dropped, a live cell's, a worktree that moved. Returns {"undone": [...], "records": [...]}
    (the new undo records; undo of an undo record is a redo)."""
    root = _root(state)
    rows = []
    for rid in ([record_ids] if isinstance(record_ids, (str, tuple)) else list(record_ids)):
        row = _resolve(root, journal, *reversed(rid)) if isinstance(rid, tuple) else _resolve(root, journal, rid)
        row = _in_force(journal, row)
        if (row["run_id"], row["record_id"]) not in {(r["run_id"], r["record_id"]) for r in rows}:
            rows.append(row)
    if not rows:
        raise NotReversible("nothing to undo")
    rows.sort(key=lambda r: (r["created_at"], r["seq"]), reverse=True)
    records = [(row, _check_undoable(root, journal, row)) for row in rows]
    if not force:
        newer_paths: list[tuple[dict, dict]] = []  # records of this undo, newer than the one checked
        for row, rec in records:
            mine = {p for p in _drift(rec, layer_dir(root, row["run_id"], row["record_id"]))
                    if not any(_under(p, q) or _under(q, p) for _, n in newer_paths for q in
                               (e["path"] for e in n["entries"]))}
            # where a newer record of the same undo took over a path, its pre-image must be this
            # record's after: else something changed in between, outside agnsup
            for _, n in newer_paths:
                theirs = {e["path"]: e for e in n["entries"]}
                for e in rec["entries"]:
                    t = theirs.get(e["path"])
                    if t is not None and not _matches(t["before"], e["after"], strict=False):
                        mine.add(e["path"])
            if mine:
                later = _later_touching(root, journal, row, sorted(mine))
                later = [n for n in later if n not in {r2["cell_id"] or r2["record_id"] for r2, _ in records}]
                first = sorted(mine)[0]
                if later:
                    raise ChangeConflict(f"undo of {row['run_id']}/{row['record_id']} would overwrite later "
                                         f"changes by cell(s) {', '.join(later)} ({first}"
                                         f"{f' and {len(mine) - 1} more' if len(mine) > 1 else ''}); "
                                         "undo those first, or --force")
                raise ChangeConflict(f"undo of {row['run_id']}/{row['record_id']}: changed outside agnsup since: "
                                     f"{first or '.'}{f' (and {len(mine) - 1} more)' if len(mine) > 1 else ''}; "
                                     "--force overwrites")
            newer_paths.append((row, rec))
    out = {"undone": [], "records": []}
    for row, rec in records:
        try:
            out["records"].append(_undo_one(root, journal, row, rec))
        except OSError as e:
            raise StateError(f"undo of {row['run_id']}/{row['record_id']} stopped: {e.strerror or e}"
                             f"{': ' + e.filename if getattr(e, 'filename', None) else ''}; what it began is finished "
                             "by the janitor (agnsup janitor)") from None
        out["undone"].append(f"{row['run_id']}/{row['record_id']}")
    return out


def _undo_one(root: str, journal, row, rec: dict) -> dict:
    uid = "undo-" + os.urandom(6).hex()
    run_id = row["run_id"]
    d = layer_dir(root, run_id, uid)
    src_dir = os.path.join(layer_dir(root, run_id, row["record_id"]), "before")
    ops = []
    for op in reversed(rec.get("ops", [])):
        if op["op"] == "meta":
            b = op["before"]
            to = {"mode": b["mode"], "uid": b["uid"], "gid": b["gid"]}
            if "mtime_ns" in op["to"]:
                to["mtime_ns"] = b.get("mtime_ns")
            cur = _info(os.path.join(rec["worktree"], op["path"]) if op["path"] else rec["worktree"])
            ops.append({"op": "meta", "path": op["path"], "before": cur, "to": to})
        else:
            src = os.path.join(src_dir, op["path"])
            ops.append({"op": "put", "path": op["path"], "src": src if _lstat(src) is not None else None})
    _mark_pending(root, run_id, uid)
    os.makedirs(d, mode=0o700)
    plan = {"version": VERSION, "record": uid, "run_id": run_id, "agent_id": rec["agent_id"], "cell_id": None,
            "kind": "undo", "undoes": row["record_id"], "worktree": rec["worktree"],
            "worktree_id": rec["worktree_id"], "created_at": time.time(), "ops": ops,
            "ops_summary": [{"op": o["op"], "path": o["path"], **({"before": o["before"], "to": o["to"]}
                                                                  if o["op"] == "meta" else {})} for o in ops]}
    _write_json(os.path.join(d, "plan.json"), plan)
    new = _apply(root, d, plan)
    _index(root, journal, new)
    return _summary(new, mode="undo")


def _row_of(record: dict) -> dict:
    s = _summary(record)
    return {"run_id": record["run_id"], "record_id": record["record"], "agent_id": record["agent_id"],
            "cell_id": record["cell_id"], "kind": record["kind"], "undoes": record["undoes"],
            "worktree": record["worktree"], "created_at": record["created_at"], "files": s["files"],
            "bytes_saved": record["bytes"]["saved"], "paths": s["paths"]}


def _index(root: str, journal, record: dict) -> None:
    """The journal row of a record on disk (and, for an undo, its target marked undone), then the
    pending marker goes."""
    journal.add_change(_row_of(record))
    _unmark_pending(root, record["run_id"], record["record"])


def settled(state_root: str, run_id: str, record_id: str) -> None:
    """The record's journal row is in (journal.conclude_cell): the janitor need not look at it again."""
    _unmark_pending(state_root, run_id, record_id)


def summary_row(summary: dict) -> dict | None:
    """The journal row a cell receipt's `changes` section stands for (journal.conclude_cell)."""
    if not summary or not summary.get("record"):
        return None
    run_id, record_id = summary["record"].split("/", 1)
    return {"run_id": run_id, "record_id": record_id, "agent_id": summary.get("agent_id"),
            "cell_id": summary.get("cell_id", record_id), "kind": summary.get("kind", "cell"),
            "undoes": summary.get("undoes"), "worktree": summary.get("worktree"),
            "created_at": summary.get("created_at") or time.time(), "files": summary.get("files", 0),
            "bytes_saved": summary.get("bytes_saved", 0), "paths": summary.get("paths", [])}


# -- the janitor -------------------------------------------------------------------------------------------
def finish_all(state_root: str, journal) -> list[dict]:
    """The janitor: every layer, plan or record left in flight (pending/ markers) finished:
    a dead cell's upper committed, an interrupted commit or undo completed, a missing journal
    row inserted. A cell the journal says still runs is left alone. Returns one dict per item:
    {"run_id", "record_id", "cell_id", "action": "committed"|"finished"|"indexed"|"empty", "changes"}.
    Cheap when nothing is in flight: one listdir of <state>/changes/pending."""
    root = _root(state_root)
    try:
        names = sorted(os.listdir(os.path.join(root, "changes", "pending")))
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        run_id, _, rid = name.partition("+")
        if not rid:
            continue
        d = layer_dir(root, run_id, rid)
        row = journal.change_row(run_id, rid)
        if row is not None:  # indexed by the cell's conclude; the marker was only left over
            _unmark_pending(root, run_id, rid)
            continue
        cell = journal.cell(run_id, rid) if not rid.startswith("undo-") else None
        item = {"run_id": run_id, "record_id": rid, "cell_id": None if rid.startswith("undo-") else rid}
        try:
            # a plan exists only once the cell's tree was dead (commit) or for an undo: finish it whatever
            # the journal says; an upper alone is committed only for a cell the journal says ended (a
            # layer whose cell row is missing or live may belong to a controller that is alive)
            if os.path.exists(os.path.join(d, "plan.json")):
                plan = _read_json(os.path.join(d, "plan.json"))
                record = _apply(root, d, plan)
                item["action"] = "finished"
            elif os.path.exists(os.path.join(d, "record.json")):
                record = _apply(root, d, {"worktree": None, "ops": []})
                item["action"] = "indexed"
            elif os.path.isdir(os.path.join(d, "upper")):
                if cell is None or cell["state"] not in TERMINAL_CELL:
                    continue
                meta = _pending_meta(root, run_id, rid)
                wt = meta.get("worktree") or (cell["worktree"] if cell is not None else None)
                if not wt or (meta.get("worktree_id") and _worktree_id(wt) != meta["worktree_id"]):
                    item.update(action="kept", error=f"the worktree {wt} moved or is gone: the layer is kept in {d}")
                    out.append(item)
                    continue
                s = commit(root, run_id, rid, wt, agent_id=meta.get("agent_id") or
                           (cell["agent_id"] if cell is not None else "default"), id_shift=meta.get("id_shift"))
                if not s.get("record"):
                    item.update(action="empty", changes=s)
                    out.append(item)
                    continue
                record = _load(root, run_id, rid)
                item["action"] = "committed"
            else:  # an undo that died before its plan was written: nothing of it happened
                if rid.startswith("undo-"):
                    _rm(d)
                _unmark_pending(root, run_id, rid)
                continue
        except OSError as e:
            item.update(action="failed", error=f"{e.strerror or e}: {getattr(e, 'filename', '')}")
            out.append(item)
            continue
        _index(root, journal, record)
        item["changes"] = _summary(record, mode="undo" if record["kind"] == "undo" else "at_exit")
        out.append(item)
    return out


def reindex(state_root: str, journal) -> list[str]:
    """A rebuilt journal (agnsup journal repair) indexes the records on disk again: every complete
    record.json, oldest first, so that an undo record marks the record it undid. Returns "run/record"
    ids added (a record whose row exists is left as it is)."""
    root = _root(state_root)
    top = os.path.join(root, "changes")
    found = []
    try:
        runs = [r for r in os.listdir(top) if r != "pending" and not r.startswith(".")]
    except FileNotFoundError:
        return []
    for run_id in runs:
        try:
            rids = os.listdir(os.path.join(top, run_id))
        except (NotADirectoryError, FileNotFoundError):
            continue
        for rid in rids:
            d = layer_dir(root, run_id, rid)
            if os.path.exists(os.path.join(d, "plan.json")):
                continue  # in flight: finish_all's
            with suppress(OSError, ValueError):
                found.append(_read_json(os.path.join(d, "record.json")))
    added = []
    for rec in sorted(found, key=lambda r: r["created_at"]):
        if journal.change_row(rec["run_id"], rec["record"]) is None:
            journal.add_change(_row_of(rec))
            added.append(f"{rec['run_id']}/{rec['record']}")
    return added


# -- diff -------------------------------------------------------------------------------------------------
def _content_at(root: str, later: list, row, record: dict, rel: str, want: dict, own_before: bool):
    """A path of `want`'s version: (the file holding it, or None; why not). Looked for in the record's
    before/ (when `own_before`), the worktree, then the before/ of later records of the same worktree."""
    if want["type"] != "file":
        return None, ""
    cands = []
    if own_before:
        cands.append(os.path.join(layer_dir(root, row["run_id"], row["record_id"]), "before", rel))
    cands.append((record["worktree"], rel))
    cands.extend(os.path.join(layer_dir(root, r["run_id"], r["record_id"]), "before", rel) for r in later)
    for c in cands:
        if _matches(_info(os.path.join(*c) if isinstance(c, tuple) else c), want, strict=False):
            return c, ""
    return None, "changed since (no copy of this version is kept)"


def _read_text(path, size: int) -> tuple[list[str] | None, bool]:
    """(lines, is_text); lines None when there is nothing to read. `path`: ours, or (worktree, rel)
    (opened following no symlink)."""
    if path is None:
        return [], True
    if size > DIFF_MAX:
        return None, False
    try:
        with open(_open_in(*path) if isinstance(path, tuple) else path, "rb") as f:
            data = f.read(DIFF_MAX + 1)
    except OSError:
        return None, False
    if b"\0" in data[:8192]:
        return None, False
    try:
        return data.decode("utf-8").splitlines(keepends=True), True
    except UnicodeDecodeError:
        return None, False


def diff(state, journal, record_id: str, run_id: str | None = None, stat: bool = False) -> dict:
    """What a record changed: {"record", "kind", "state", "counts", "entries": [...]}; each entry
    gets "diff" (unified text) for text files, "sizes" for binary ones; with `stat`, "added" and
    "removed" line counts instead of the text."""
    import difflib
    root = _root(state)
    row = _resolve(root, journal, record_id, run_id)
    where = f"{row['run_id']}/{row['record_id']}"
    if row["state"] == "dropped":
        raise NotReversible(f"record {where} was dropped (retention): its pre-images are gone")
    record = _load(root, row["run_id"], row["record_id"])
    out = {"record": where, "kind": record["kind"], "undoes": record["undoes"], "state": row["state"],
           "undone_by": row["undone_by"], "worktree": record["worktree"], "counts": record["counts"],
           "bytes": record["bytes"], "entries": []}
    own_before = row["state"] != "undone"  # an undo moved the pre-images back into the worktree
    later = [r for r in journal.change_rows(worktree=row["worktree"], after=row["created_at"])
             if r["state"] != "dropped"]  # where a later record keeps a version this one made
    for e in record["entries"]:
        b, a = e["before"], e["after"]
        item = {"path": e["path"], "change": e["change"], "before": b, "after": a}
        if "file" in (b["type"], a["type"]) and e["change"] != "mode":
            bp, bwhy = _content_at(root, later, row, record, e["path"], b, own_before) if b["type"] == "file" \
                else (None, "")
            ap, awhy = _content_at(root, later, row, record, e["path"], a, False) if a["type"] == "file" \
                else (None, "")
            if bwhy or awhy:
                item["note"] = bwhy or awhy
                item["sizes"] = [b.get("size", 0), a.get("size", 0)]
            else:
                bl, bt = _read_text(bp, b.get("size", 0))
                al, at = _read_text(ap, a.get("size", 0))
                if bt and at and bl is not None and al is not None:
                    lines = list(difflib.unified_diff(bl, al, "/dev/null" if bp is None else f"a/{e['path']}",
                                                      "/dev/null" if ap is None else f"b/{e['path']}"))
                    item["added"] = sum(1 for x in lines if x.startswith("+") and not x.startswith("+++"))
                    item["removed"] = sum(1 for x in lines if x.startswith("-") and not x.startswith("---"))
                    if not stat:
                        item["diff"] = "".join(x if x.endswith("\n") else x + "\n\\ No newline at end of file\n"
                                               for x in lines)
                else:
                    item["binary"] = True
                    item["sizes"] = [b.get("size", 0), a.get("size", 0)]
        out["entries"].append(item)
    return out


# -- selection, retention, quarantine -------------------------------------------------------------------
def select(journal, run_id: str | None = None, agent_id: str | None = None, cell_id: str | None = None) -> list:
    """The journal rows of records in force (committed) for --run / --agent / a cell, newest first.
    For a run or an agent: the records whose effect is forward (a cell's, or a redo: an undo of an
    undo), so that `undo --run R` takes the run back to before it, never redoes an undone cell."""
    rows = journal.change_rows(run_id=run_id, agent_id=agent_id, cell_id=cell_id, state="committed")
    by_id = {(r["run_id"], r["record_id"]): r for r in journal.change_rows(run_id=run_id)} if run_id else None

    def forward(r) -> bool:
        depth, cur = 0, r
        while cur is not None and cur["kind"] == "undo":
            depth += 1
            key = (cur["run_id"], cur["undoes"])
            cur = by_id.get(key) if by_id is not None else journal.change_row(*key)
        return depth % 2 == 0
    return sorted((r for r in rows if forward(r)), key=lambda r: (r["created_at"], r["seq"]), reverse=True)


def prune(state, journal, keep: int, keep_bytes: int) -> list[str]:
    """Drop records past `keep` records or `keep_bytes` bytes of pre-images, oldest first:
    the directory freed, the journal row's state 'dropped'. Returns the dropped "run/record" ids."""
    root = _root(state)
    rows = journal.change_rows(states=("committed", "undone"))  # oldest first
    n, total = len(rows), sum(r["bytes_saved"] or 0 for r in rows)
    dropped = []
    for r in rows:  # a row exists only once its record is complete (conclude_cell, _index)
        if n <= keep and total <= keep_bytes:
            break
        _unmark_pending(root, r["run_id"], r["record_id"])
        d = layer_dir(root, r["run_id"], r["record_id"])
        journal.set_change_state([(r["run_id"], r["record_id"])], "dropped")
        _rm(d)
        with suppress(OSError):
            os.rmdir(os.path.dirname(d))
        n -= 1
        total -= r["bytes_saved"] or 0
        dropped.append(f"{r['run_id']}/{r['record_id']}")
    return dropped


def prune_after(state, journal, summary: dict | None, policy: dict) -> None:
    """Retention after a cell's commit that kept a record (`summary`): the oldest records past the role's
    filesystem.changes_keep / changes_keep_bytes (`policy`, the plan's) are dropped (prune)."""
    if not summary or not summary.get("record") or not summary.get("files"):
        return
    try:
        prune(state, journal, policy["keep"], policy["keep_bytes"])
    except Exception as e:  # noqa: BLE001 - retention never fails a cell that ended
        print(f"agnsup: changes retention failed, continuing: {e}", file=sys.stderr, flush=True)


def free_run(state, journal, run_id: str) -> list[str]:
    """`cleanup --run R`: every record of the run dropped and its space freed."""
    root = _root(state)
    rows = [r for r in journal.change_rows(run_id=run_id) if r["state"] != "dropped"]
    journal.set_change_state([(r["run_id"], r["record_id"]) for r in rows], "dropped")
    # a layer whose commit has not happened yet (a read-only state root, a swapped path) holds a
    # cell's only copy of its work: it stays for the janitor, and so does the run's directory
    run_dir = os.path.join(root, "changes", run_id)
    for path in [layer_dir(root, run_id, r["record_id"]) for r in rows] + [run_dir]:
        try:
            if path == run_dir:
                os.rmdir(path)
            else:
                _rm(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            if e.errno != errno.ENOTEMPTY:
                raise StateError(f"could not free the change records of run {run_id} under {root}: "
                                 f"{e.strerror or e}") from None
    for r in rows:
        _unmark_pending(root, run_id, r["record_id"])
    return [f"{run_id}/{r['record_id']}" for r in rows]


def drop_paths(state_root: str, run_id: str, record_id: str, paths: list[str]) -> None:
    """protect.settle moved these worktree paths to quarantine after the commit: the record's
    entries for them now say what the worktree holds (absent), or go when nothing is left to undo."""
    if not paths:
        return
    d = layer_dir(state_root, run_id, record_id)
    rj = os.path.join(d, "record.json")
    try:
        record = _read_json(rj)
    except FileNotFoundError:
        return
    wt = record["worktree"]
    keep = []
    for e in record["entries"]:
        if any(_under(e["path"], q) for q in paths):
            e["after"] = _info(os.path.join(wt, e["path"]), full=True)
            if e["before"]["type"] == "absent" and e["after"]["type"] == "absent":
                continue
            if e["after"]["type"] == "absent":
                e["change"] = "deleted"
        keep.append(e)
    record["entries"] = keep
    record["counts"], record["bytes"] = _counts(keep)
    record["quarantined"] = sorted(set(record.get("quarantined", [])) | set(paths))
    _write_json(rj, record)


def drop_quarantined(state_root: str, run_id: str, cell_id: str, summary: dict | None, quarantined: list) -> None:
    """protect.settle moved paths the cell planted out of the worktree after its commit (`summary`):
    its record stops claiming them (drop_paths)."""
    if not summary or not summary.get("record"):
        return
    try:
        drop_paths(state_root, run_id, cell_id, [q["path"] for q in quarantined])
    except Exception as e:  # noqa: BLE001 - the quarantine is done; the record keeps what it said
        print(f"agnsup: changes: quarantined paths not dropped from the record: {e}", file=sys.stderr, flush=True)
