"""The cell's mount namespace, built in the child from a closed set of operations.

The policy compiler turns a role into an ordered list of ``MountOp``; this
module is the only code that executes them, and it accepts nothing else
(bubblewrap's rule: a fixed set of operation kinds, each re-checked, any
failure aborts and the payload never runs).

The recipe, in order:
  clone    detached copies (open_tree OPEN_TREE_CLONE) of what the cell
           keeps: the cell's temp dir, the worktree (read-only for roles that
           may not write it), each made private. Taken first, while their
           mounts are still read-write, and before /tmp is covered.
  idclone  a clone id-mapped through the cells' user namespace (mount_setattr
           MOUNT_ATTR_IDMAP): what a mapped cell writes (the worktree, the
           package caches). On-disk uid 0 is the cell's uid 0 (host BASE), and
           what the cell creates is owned by uid 0 on disk.
  tmpcopy  a normal user's cell: a fresh tmpfs of points[0] bytes filled with a
           copy of the staged temp dir (path), kept like a clone for the /tmp
           attach (a root controller makes it itself: process.leader.make_tmp).
  root     everything read-only and private, recursively, in one
           mount_setattr(2): on systemd hosts / is shared and a bare unshare
           leaks mounts back to the host; read-only covers /sys/fs/cgroup, so
           a cell cannot write any cgroup.procs.
  dev      the cell's own minimal /dev (bubblewrap's --dev, Docker's /dev):
           a read-only tmpfs holding binds of the host's null, zero, full,
           random, urandom, tty (and the role's filesystem.devices), a new
           devpts instance, a capped /dev/shm and the fd links. The host's
           disks, loop devices, /dev/mem and its other terminals are not
           there (a uid-0 cell could read a raw disk around every mask).
  hide     a home (every one) under an empty tmpfs (its host owner, mode 0755:
           it holds only mount points), the mount points of what is attached beneath it made
           inside, then the tmpfs sealed read-only: all in one step, before
           anything is stacked on it.
  empty    an empty tmpfs of the cell's own on a host directory (/run: every
           host socket under it, present or created later, out of reach), the
           mount points of what comes back into it made inside, then sealed
           read-only, as for hide; its owner is the namespace's root (the
           host's root of /run is not mapped in a user namespace).
  attach   the clones go back at their targets, outermost first (the
           compiler orders hides and attaches by depth: the temp dir at /tmp
           before a worktree under /tmp, a hidden home before the runtime
           and worktree re-exposed inside it).
  overlay  a cell that captures its changes (agnsup/changes.py, docs/architecture.md "Reversible
           cells"): an overlayfs made with fsopen/fsconfig/fsmount (lowerdir = the worktree as
           attached just before: a mapped cell's is the id-mapped view; upperdir and workdir in the
           cell's layer directory under the state root; redirect_dir nofollow (no redirect is made,
           none in the worktree is followed: the only value userxattr allows), index, metacopy and
           xino off; volatile: no syncfs of the state root's whole file system when the
           overlay goes, 10-20 ms here, a live cell's writes are not synced either; userxattr
           inside a normal user's user namespace), moved onto the worktree right
           after its attach, before protect and mask (the layer directory is cloned with the
           others, while its mount is read-write, and attached on a scratch point in the cell's
           /tmp for the moment the overlay is made: 6.12 takes no layer from a detached mount).
           What a mapped cell writes lands in the upper as host ids BASE+n; the commit shifts
           them back (id_shift), so the worktree ends as if the cell had written it through its
           id map. (An id-mapped layer would do that in the kernel, and 6.18 takes one whose map
           also holds the overlay's creator, host root; it costs a user namespace, a fork, per
           controller process.) An overlay that comes up read-only is an error; one the kernel
           refuses runs the cell live.
  protect  a path inside the attached worktree bound onto itself (a clone of
           the cell's own view of it): read-only for the files tools run on
           their own, read-write for a git directory, which only becomes a
           mount point (rename and rmdir then fail with EBUSY); gone by now:
           nothing to do (agnsup/protect.py). After the worktree's attach.
  mask     deny paths and the state root disappear under an empty read-only
           tmpfs (directories) or /dev/null (files); last, so they also cover
           what lies inside a re-attached worktree.
"""
from __future__ import annotations

import os
import stat as stat_mod
from collections import namedtuple

from . import sys as lsys

KINDS = ("clone", "idclone", "tmpcopy", "root", "hide", "mask", "attach", "dev", "protect", "empty", "overlay")
# overlay: the file in the layer directory that says the kernel refused the overlay and the cell ran live (why)
LAYER_LIVE = "ran_live"


# kind:     one of KINDS
# path:     source for clone, target otherwise
# key:      names a clone for a later attach; dev: the size of /dev/shm in bytes
# readonly: root: read-only (else only private); clone: a read-only copy
# points:   hide, empty: (path, is_dir) mount points to make inside the tmpfs; dev: the role's host devices;
#           overlay: its options, each a tuple: ("userxattr",), ("shift", uid_shift, gid_shift), ("live_ok",)
# (overlay: path = the worktree, key = the clone of the layer directory holding upper/ and work/)
# (collections.namedtuple, not typing.NamedTuple: `typing` costs ~5 ms per start)
MountOp = namedtuple("MountOp", ("kind", "path", "key", "readonly", "points"), defaults=("", True, ()))


def apply(ops: list, userns_fd: int | None = None, premade: dict | None = None) -> None:
    """Run in the child after unshare(CLONE_NEWNS); raises OSError naming the step.
    `userns_fd`: the cells' user namespace, for idclone; `premade`: {key: detached mount fd} the
    controller made (the cell's /tmp tmpfs, attached like a clone; and under AHEAD names, what a dev, hide,
    empty or mask step would mount, made ahead: make_ahead)."""
    clones: dict[str, int] = dict(premade or {})
    for op in ops:
        op = MountOp(*op)
        if op.kind not in KINDS:
            raise ValueError(f"unknown mount operation {op.kind!r}")
        try:
            if op.kind in ("clone", "idclone"):
                if op.kind == "idclone" and userns_fd is None:
                    raise OSError(22, "no user namespace to id-map through")
                fd = lsys.open_tree(op.path, lsys.OPEN_TREE_CLONE | lsys.OPEN_TREE_CLOEXEC | lsys.AT_RECURSIVE)
                clones[op.key] = fd
                # private: a clone of a shared mount (systemd's /) is a peer of the host's, and what
                # is later mounted on it (caches, masks, a worktree under /tmp) would reach the host
                idmap = lsys.MOUNT_ATTR_IDMAP if op.kind == "idclone" else 0
                lsys.mount_setattr(op.path, attr_set=(lsys.MOUNT_ATTR_RDONLY if op.readonly else 0) | idmap,
                                   propagation=lsys.MS_PRIVATE, fd=fd, userns_fd=userns_fd if idmap else 0)
            elif op.kind == "tmpcopy":
                fd = lsys.fsmount_new("tmpfs", {"size": str(op.points[0]), "mode": "1777"},
                                      lsys.MOUNT_ATTR_NOSUID | lsys.MOUNT_ATTR_NODEV)
                clones[op.key] = fd
                copy_tree(op.path, fd)
            elif op.kind == "root":
                lsys.mount_setattr("/", attr_set=lsys.MOUNT_ATTR_RDONLY if op.readonly else 0,
                                   propagation=lsys.MS_PRIVATE)
            elif op.kind == "dev":
                _dev(int(op.key), op.points, userns_fd, clones.pop(AHEAD + "dev", None))
            elif op.kind == "hide":
                _hide(op.path, op.points, premade=clones)
            elif op.kind == "empty":
                _hide(op.path, op.points, keep_owner=False, premade=clones)
            elif op.kind == "mask":
                _mask(op.path, clones.pop(f"{AHEAD}mask:{op.path}", None))
            elif op.kind == "protect":
                _protect(op.path, op.readonly)
            elif op.kind == "overlay":
                overlay(op.path, clones.pop(op.key), op.points)
            elif op.kind == "attach":
                _attach(clones.pop(op.key), op.path)
        except OSError as e:
            raise OSError(e.errno, f"mount step {op.kind} {op.path}: {e.strerror}") from None
    for fd in clones.values():
        os.close(fd)


# Made ahead (issue 29, seventh round): what a dev, hide, empty or mask step mounts does not depend on the cell, so a
# controller of many cells (the Supervisor: process.leader.MountSpare) makes it after an earlier cell's result, off
# the request's path, as a detached mount of its own, and the leader only attaches it (move_mount: ~0.4 ms of /dev's
# ~25 system calls and ~15 us of a tmpfs's making each, a cell). Every such mount is new and goes to one cell: no
# tmpfs, devpts or /dev/shm is ever another cell's. The leader takes one only where it would have mounted the same
# (the same op of its plan; a hide's owner as its own stat sees it now); anything else, or a move_mount that fails,
# and the step mounts as it always did.
AHEAD = "ahead:"  # apply's `premade` names of made-ahead mounts (a clone's keys never hold a colon)


def ahead_key(op) -> tuple | None:
    """What the step `op` would mount, when that can be made ahead (make_ahead): a /dev without a role's devices,
    a hide, an empty, a mask; None for every other step."""
    op = MountOp(*op)
    if op.kind == "dev" and not op.points:
        return ("dev", op.key)
    if op.kind in ("hide", "empty"):
        return (op.kind, op.path, tuple(op.points))
    if op.kind == "mask":
        return ("mask", op.path)
    return None


def make_ahead(key: tuple) -> tuple[str, int] | None:
    """In a root controller: the detached mount the step of `key` (ahead_key) would make in a cell, and the name
    apply takes it under; None when there is nothing to make now (the path is not there). Raises OSError where
    the kernel cannot (before 6.15 no mount goes inside a detached one: /dev is then made in the leader)."""
    kind, path = key[0], key[1]
    if kind == "dev":
        return AHEAD + "dev", _dev_ahead(int(path))
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return None
    if kind == "mask":
        return f"{AHEAD}mask:{path}", _mask_ahead(stat_mod.S_ISDIR(st.st_mode))
    if not stat_mod.S_ISDIR(st.st_mode):
        return None
    ids = (st.st_uid, st.st_gid) if kind == "hide" else None
    return _ahead_name(kind, path, ids), _hide_ahead(path, key[2], ids)


def _ahead_name(kind: str, path: str, ids: tuple | None) -> str:
    return f"{AHEAD}{kind}:{ids[0]}:{ids[1]}:{path}" if ids else f"{AHEAD}{kind}::{path}"


def _take_ahead(fd: int, path: str, gone_ok: bool = True) -> bool:
    """Attach the made-ahead mount `fd` at `path` (consumed): True when done, or (`gone_ok`) when `path` is not
    there (nothing to hide or mask, as the step's own stat would find); False: the step mounts it itself."""
    try:
        lsys.move_mount_fd(fd, path, follow=True)  # mount(2) follows a symlink at the target: so does this
        return True
    except FileNotFoundError:
        return gone_ok
    except OSError:
        return False  # another kind of file there now (a directory's mask on a file: EINVAL), ...
    finally:
        os.close(fd)


_HIDE_ATTRS = lsys.MOUNT_ATTR_NOSUID | lsys.MOUNT_ATTR_NODEV | lsys.MOUNT_ATTR_NOEXEC


def _hide_ahead(path: str, points: tuple, ids: tuple | None) -> int:
    """_hide's tmpfs, detached: its mount points made inside (modes as _hide's umask 022 gives them), then sealed."""
    opts = {"source": "tmpfs", "size": "64k", "nr_inodes": "4096", "mode": "755"}
    if ids:
        opts.update(uid=str(ids[0]), gid=str(ids[1]))
    if not points:
        opts["ro"] = None  # a read-only file system, as _hide's one mount(MS_RDONLY) makes it
    fd = lsys.fsmount_new("tmpfs", opts, _HIDE_ATTRS | (0 if points else lsys.MOUNT_ATTR_RDONLY))
    try:
        for p, is_dir in points:
            rel = os.path.relpath(p, path)
            if rel.startswith("..") or os.path.isabs(rel):
                raise ValueError(f"mount point {p} is not under {path}")
            _dirs_ahead(fd, rel if is_dir else os.path.dirname(rel))
            if not is_dir:
                f = os.open(rel, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=fd)
                try:
                    os.fchmod(f, 0o644)
                finally:
                    os.close(f)
        if points:
            lsys.mount_setattr(path, attr_set=lsys.MOUNT_ATTR_RDONLY, recursive=False, fd=fd)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _dirs_ahead(fd: int, rel: str) -> None:
    """os.makedirs(rel) under the umask 022, inside the detached tree `fd` (whatever the controller's umask)."""
    at = ""
    for part in rel.split("/") if rel not in ("", ".") else ():
        at = os.path.join(at, part)
        try:
            os.mkdir(at, 0o755, dir_fd=fd)
        except FileExistsError:
            continue
        os.chmod(at, 0o755, dir_fd=fd)  # made just now: a directory


def _mask_ahead(is_dir: bool) -> int:
    """_mask's mount, detached: an empty read-only tmpfs for a directory, /dev/null (read-only) for anything else."""
    if is_dir:
        return lsys.fsmount_new("tmpfs", {"source": "tmpfs", "size": "4k", "mode": "000", "ro": None},
                                _HIDE_ATTRS | lsys.MOUNT_ATTR_RDONLY)
    fd = lsys.open_tree("/dev/null", lsys.OPEN_TREE_CLONE | lsys.OPEN_TREE_CLOEXEC)
    try:  # private: a clone of the host's (shared) /dev mount is a peer of it; read-only, as the cell's /dev is
        lsys.mount_setattr("/dev/null", attr_set=lsys.MOUNT_ATTR_RDONLY, propagation=lsys.MS_PRIVATE, fd=fd)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _attach(fd: int, path: str) -> None:
    """The detached tree `fd` at `path`; a directory point missing there is made first (a file clone lands
    on an existing file point). Tried first, the point made only at ENOENT: most points exist already."""
    try:
        lsys.move_mount_fd(fd, path)
    except FileNotFoundError:
        os.makedirs(path, exist_ok=True)
        lsys.move_mount_fd(fd, path)


def _hide(path: str, points: tuple, keep_owner: bool = True, premade: dict | None = None) -> None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return  # not there in this namespace (e.g. under the private /tmp): nothing to read
    if not stat_mod.S_ISDIR(st.st_mode):
        raise OSError(20, "not a directory")
    flags = lsys.MS_NOSUID | lsys.MS_NODEV | lsys.MS_NOEXEC
    # 0755: any uid may pass through to what is attached below (a mapped cell owns nothing on the host,
    # and /root is 0700) and list it: it holds only those mount points. The host owner where we may
    # name it (host root); in a normal user's namespace only that user is mapped, and the tmpfs is theirs.
    ids = (st.st_uid, st.st_gid) if keep_owner and os.geteuid() == 0 else None
    if premade:  # the same tmpfs made ahead: taken only if made for the owner this stat sees now
        fd = premade.pop(_ahead_name("hide" if keep_owner else "empty", path, ids), None)
        if fd is not None and _take_ahead(fd, path):
            return
    owner = f",uid={ids[0]},gid={ids[1]}" if ids else ""
    data = f"size=64k,nr_inodes=4096,mode=755{owner}"
    try:
        if not points:
            # nothing to make inside: mounted read-only at once (as a mask is), one call instead of two
            lsys.mount("tmpfs", path, "tmpfs", flags | lsys.MS_RDONLY, data)
            return
        lsys.mount("tmpfs", path, "tmpfs", flags, data)
    except FileNotFoundError:
        return  # removed since the stat (a user deleted meanwhile: `userdel -r`): nothing left to read
    old = os.umask(0o022)  # points readable as on any host directory, whatever the controller's umask
    try:
        for p, is_dir in points:
            if is_dir:
                os.makedirs(p, exist_ok=True)
            else:
                os.makedirs(os.path.dirname(p), exist_ok=True)
                os.close(os.open(p, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644))
    finally:
        os.umask(old)
    # Per-mount read-only: nothing is stacked on the tmpfs yet, so the path names it.
    lsys.mount(None, path, None, lsys.MS_REMOUNT | lsys.MS_BIND | lsys.MS_RDONLY | flags)


def _escape_layer(path: str) -> str:
    """A path as one overlayfs lowerdir entry: ':' separates layers there, '\\' escapes."""
    return path.replace("\\", "\\\\").replace(":", "\\:")


def _overlay_fs(lower: str, layer: str, userxattr: bool) -> int:
    """A detached overlay mount of `lower` with `layer`/upper and `layer`/work; OSError(EROFS) when
    the kernel made it read-only (it does so, with only a kernel log line, when it cannot use the
    work directory: an id-mapped layer whose map lacks the overlay's creator answers EOVERFLOW)."""
    opts = {"lowerdir": _escape_layer(lower), "upperdir": os.path.join(layer, "upper"),
            "workdir": os.path.join(layer, "work"), "redirect_dir": "nofollow", "index": "off", "metacopy": "off",
            "xino": "off"}
    if userxattr:
        opts["userxattr"] = None
    # volatile: no syncfs of the state root's whole file system when the overlay goes (10-20 ms of every
    # capturing cell here); the kernel then leaves work/work/incompat/volatile (mode 000: changes opens it)
    opts["volatile"] = None
    fd = lsys.fsmount_new("overlay", opts)
    if os.fstatvfs(fd).f_flag & os.ST_RDONLY:
        os.close(fd)
        raise OSError(30, "the overlay came up read-only (the kernel could not use its work directory)")
    return fd


def overlay(target: str, layer_fd: int, options: tuple) -> None:
    """Cover `target` (the worktree just attached) with an overlay whose lower layer is that
    attached worktree and whose upper and work directories are in the layer directory cloned as
    `layer_fd` (taken with the other clones, while its mount was still read-write; consumed here).

    ("shift", uid_shift, gid_shift) in `options` (a mapped cell, uid 0 of the cells' namespace =
    host uid_shift): what the cell writes lands in the upper as host ids shift+n, so the upper's own
    root (the overlay's root directory: its owner is what the cell sees its worktree root as) gets
    the worktree root's owner shifted the same way; the commit shifts every owner back
    (changes.commit id_shift, noted by changes.prepare): on disk the worktree ends as if the cell
    had written it through its id map.

    ("live_ok",): where the kernel refuses the overlay itself (a worktree's file system it will not
    take as a lower layer, ...), the cell runs on the plain worktree, live, and LAYER_LIVE in the
    layer directory says why (the receipt then does); without it (isolation.require "reversible")
    the refusal fails the cell's setup."""
    flags = {o[0]: o[1:] for o in options}
    # The layer goes in attached, not as its detached clone: before 6.15 overlayfs cannot take a layer
    # from a detached mount ("failed to clone upperpath": the Debian 12 and Ubuntu 24.04 kernels). It is
    # attached for the moment of the overlay's creation on a scratch point in the cell's own /tmp (a
    # tmpfs of its own by now; /tmp itself is never a worktree), then detached: the overlay keeps its
    # private copy of the mount.
    layer = f"/tmp/.agnsup-layer-{os.getpid()}"
    os.mkdir(layer, 0o700)
    try:
        lsys.move_mount_fd(layer_fd, layer)
    except BaseException:
        os.rmdir(layer)
        os.close(layer_fd)
        raise
    try:
        shift = flags.get("shift")
        if shift is not None:
            upper = os.path.join(layer, "upper")
            st = os.lstat(upper)
            os.chown(upper, st.st_uid + shift[0], st.st_gid + shift[1])
        try:
            ov = _overlay_fs(target, layer, "userxattr" in flags)
        except OSError as e:
            if "live_ok" not in flags:
                raise
            _note(layer, LAYER_LIVE, str(e.strerror or e))
            return
        try:
            lsys.move_mount_fd(ov, target)
        finally:
            os.close(ov)
    finally:
        os.close(layer_fd)
        lsys.umount(layer)
        os.rmdir(layer)


def _note(layer: str, name: str, text: str) -> None:
    """A small file in the layer directory, whole or not at all."""
    tmp = os.path.join(layer, name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text + "\n")
    os.replace(tmp, os.path.join(layer, name))


def _protect(path: str, readonly: bool) -> None:
    try:
        fd = lsys.open_tree(path, lsys.OPEN_TREE_CLONE | lsys.OPEN_TREE_CLOEXEC | lsys.AT_RECURSIVE)
    except FileNotFoundError:
        return  # removed since the plan was made: the controller judges it after the cell
    try:
        lsys.mount_setattr(path, attr_set=lsys.MOUNT_ATTR_RDONLY if readonly else 0, propagation=lsys.MS_PRIVATE,
                           fd=fd)
        lsys.move_mount_fd(fd, path)
    finally:
        os.close(fd)


def _mask(path: str, premade: int | None = None) -> None:
    if premade is not None and _take_ahead(premade, path):
        return  # the same mask made ahead: a directory's tmpfs, a file's /dev/null (else: made below, as it is now)
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return  # nothing there, or nothing this cell's uid could reach anyway
    try:
        if stat_mod.S_ISDIR(st.st_mode):
            lsys.mount("tmpfs", path, "tmpfs", lsys.MS_RDONLY | lsys.MS_NOSUID | lsys.MS_NODEV | lsys.MS_NOEXEC,
                       "size=4k,mode=000")
        else:
            lsys.mount("/dev/null", path, None, lsys.MS_BIND)
    except (FileNotFoundError, NotADirectoryError):
        return  # removed since the stat (another state root being deleted as this cell starts): nothing to mask
        # Read-only by mount_setattr, which changes that one flag: a remount (MS_REMOUNT|MS_BIND) sets
        # every per-mount flag anew, and where the kernel locked the source's nosuid, nodev or noexec (a
        # container's nosuid /dev seen from a normal user's own user namespace: mount_namespaces(7)) one
        # that drops it is refused with EPERM.
        lsys.mount_setattr(path, attr_set=lsys.MOUNT_ATTR_RDONLY, recursive=False)


# The host nodes every cell keeps: harmless to any uid (0666 on every host), and what
# programs expect to open. /dev/tty is the process's own controlling terminal.
DEV_NODES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom", "/dev/tty")
DEV_LINKS = (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
             ("stderr", "/proc/self/fd/2"), ("ptmx", "pts/ptmx"))
_DEV_FLAGS = lsys.MS_NOSUID | lsys.MS_NOEXEC
_TTY_GID = 5  # the "tty" group of Debian, Fedora, Arch, Alpine: devpts gives new ptys this group


def _dev(shm_size: int, devices: tuple, userns_fd: int | None = None, premade: int | None = None) -> None:
    """Cover /dev with the cell's own (after "root": every mount is private and read-only by then,
    and read-only does not stop a device node from being written). `userns_fd`: a mapped cell's
    user namespace: the role's devices are then nodes of their own here, of the same type and
    numbers, owned by the cell's root (a 0660 root:kvm node could not be opened by a uid the host
    does not map, and devtmpfs refuses id-mapped mounts); the host's other nodes stay out of reach.
    `premade`: the same /dev made ahead for this cell alone (_dev_ahead), taken unless the cell holds a
    terminal (its /dev/console is made here) or has a role's devices."""
    terminal = _stdio_terminal()
    if premade is not None:
        if terminal is None and not devices:
            if _take_ahead(premade, "/dev", gone_ok=False):
                return
        else:
            os.close(premade)
    # a role's devices: checked by the compiler; a mapped cell's are made anew (below)
    made = [(p, os.stat(p)) for p in devices] if userns_fd is not None else []
    keep = [p for p in DEV_NODES if os.path.exists(p)] + ([] if made else list(devices))
    clones = []
    try:
        # Not recursive (no AT_RECURSIVE): a node and nothing mounted beneath it.
        clones.extend((p, lsys.open_tree(p, lsys.OPEN_TREE_CLONE | lsys.OPEN_TREE_CLOEXEC)) for p in keep)
        if terminal is not None:
            # the terminal the cell already holds as stdio lives on the host's devpts, which the cell no
            # longer sees: bound at /dev/console (as bubblewrap does), ttyname() finds it there
            clones.append(("/dev/console", lsys.open_tree(terminal, lsys.OPEN_TREE_CLONE | lsys.OPEN_TREE_CLOEXEC)))
        lsys.mount("tmpfs", "/dev", "tmpfs", _DEV_FLAGS, "size=64k,nr_inodes=256,mode=755")
        old = os.umask(0)
        try:
            for p, fd in clones:
                if os.path.dirname(p) != "/dev":  # the tmpfs's root exists: only a role's /dev/dri/renderD128
                    os.makedirs(os.path.dirname(p), 0o755, exist_ok=True)
                os.close(os.open(p, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o666))
                lsys.move_mount_fd(fd, p)
            if made:
                from .userns import cell_range
                uid, gid, _ = cell_range()
                for p, st in made:
                    if os.path.dirname(p) != "/dev":
                        os.makedirs(os.path.dirname(p), 0o755, exist_ok=True)
                    os.mknod(p, st.st_mode, st.st_rdev)
                    os.chown(p, uid, gid)
            os.mkdir("/dev/pts", 0o755)
            _devpts("/dev/pts")
            os.mkdir("/dev/shm", 0o1777)
            lsys.mount("tmpfs", "/dev/shm", "tmpfs", lsys.MS_NOSUID | lsys.MS_NODEV,
                       f"mode=1777,size={shm_size}")
            for name, target in DEV_LINKS:
                os.symlink(target, os.path.join("/dev", name))
        finally:
            os.umask(old)
    finally:
        for _, fd in clones:
            os.close(fd)
    # The nodes, pts and shm are mounts of their own; the tmpfs under them becomes read-only,
    # so the cell cannot add a node, a link or a file there.
    lsys.mount(None, "/dev", None, lsys.MS_REMOUNT | lsys.MS_BIND | lsys.MS_RDONLY | _DEV_FLAGS)


def _dev_ahead(shm_size: int) -> int:
    """_dev's /dev (without a terminal or a role's devices), detached, for one cell: a new tmpfs holding read-only
    private binds of the host's nodes, a new devpts instance, a new /dev/shm, the links; sealed read-only."""
    fd = lsys.fsmount_new("tmpfs", {"source": "tmpfs", "size": "64k", "nr_inodes": "256", "mode": "755"},
                          lsys.MOUNT_ATTR_NOSUID | lsys.MOUNT_ATTR_NOEXEC)
    try:
        for p in DEV_NODES:
            if not os.path.exists(p):
                continue
            name = os.path.basename(p)
            f = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666, dir_fd=fd)
            try:
                os.fchmod(f, 0o666)
            finally:
                os.close(f)
            node = lsys.open_tree(p, lsys.OPEN_TREE_CLONE | lsys.OPEN_TREE_CLOEXEC)
            try:  # read-only and private, as a clone taken in the cell after "root" is
                lsys.mount_setattr(p, attr_set=lsys.MOUNT_ATTR_RDONLY, propagation=lsys.MS_PRIVATE, fd=node)
                lsys.move_mount_fd(node, name, dfd=fd)
            finally:
                os.close(node)
        for name, mode in (("pts", 0o755), ("shm", 0o1777)):
            os.mkdir(name, mode, dir_fd=fd)
            os.chmod(name, mode, dir_fd=fd)
        sub = _devpts_fs()
        try:
            lsys.move_mount_fd(sub, "pts", dfd=fd)
        finally:
            os.close(sub)
        sub = lsys.fsmount_new("tmpfs", {"source": "tmpfs", "mode": "1777", "size": str(shm_size)},
                               lsys.MOUNT_ATTR_NOSUID | lsys.MOUNT_ATTR_NODEV)
        try:
            lsys.move_mount_fd(sub, "shm", dfd=fd)
        finally:
            os.close(sub)
        for name, target in DEV_LINKS:
            os.symlink(target, name, dir_fd=fd)
        lsys.mount_setattr("/dev", attr_set=lsys.MOUNT_ATTR_RDONLY, recursive=False, fd=fd)  # not pts, not shm
    except BaseException:
        os.close(fd)
        raise
    return fd


def _devpts_fs() -> int:
    """_devpts's instance, detached."""
    opts = {"source": "devpts", "newinstance": None, "ptmxmode": "0666", "mode": "0620"}
    attrs = lsys.MOUNT_ATTR_NOSUID | lsys.MOUNT_ATTR_NOEXEC
    try:
        return lsys.fsmount_new("devpts", {**opts, "gid": str(_TTY_GID)}, attrs)
    except OSError as e:
        if e.errno != 22:  # EINVAL
            raise
        return lsys.fsmount_new("devpts", opts, attrs)


def _devpts(path: str) -> None:
    """A new devpts instance (devpts(5) newinstance): the cell sees only the ptys made in it,
    never the host's terminals. gid=5 only where that gid is mapped (a user namespace of one
    gid, an unprivileged agnsup's cell, has no group 5: EINVAL; ptys then get the creator's gid)."""
    opts = "newinstance,ptmxmode=0666,mode=0620"
    flags = lsys.MS_NOSUID | lsys.MS_NOEXEC
    try:
        lsys.mount("devpts", path, "devpts", flags, f"{opts},gid={_TTY_GID}")
    except OSError as e:
        if e.errno != 22:  # EINVAL
            raise
        lsys.mount("devpts", path, "devpts", flags, opts)


def _stdio_terminal() -> str | None:
    """The host path of the terminal on fd 0, 1 or 2, if the cell was given one."""
    for fd in (0, 1, 2):
        try:
            path = os.ttyname(fd)
            st, held = os.stat(path), os.fstat(fd)
        except OSError:
            continue
        if (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino):
            return path
    return None


def copy_tree(src: str, dst_fd: int, merge: bool = False) -> None:
    """Copy directories, files and symlinks below `src` into the directory `dst_fd`, with their owners
    and modes (a handful of small entries: the broker's staging). `merge`: `dst_fd` already holds some of
    them (a root cell's /tmp written by process.leader.make_tmp): a directory there is descended into and
    keeps its mode and owner, any other entry there is kept as it is."""
    with os.scandir(src) as entries:
        found = list(entries)
    for e in found:
        st = e.stat(follow_symlinks=False)
        mode = stat_mod.S_IMODE(st.st_mode)
        if stat_mod.S_ISDIR(st.st_mode):
            try:
                os.mkdir(e.name, 0o700, dir_fd=dst_fd)
                made = True
            except FileExistsError:
                if not merge:
                    raise
                made = False
            sub = os.open(e.name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dst_fd)
            try:
                copy_tree(e.path, sub, merge)
                if made:
                    os.fchmod(sub, mode)
            finally:
                os.close(sub)
            if not made:
                continue
        elif merge and _exists(e.name, dst_fd):
            continue
        elif stat_mod.S_ISLNK(st.st_mode):
            os.symlink(os.readlink(e.path), e.name, dir_fd=dst_fd)
        elif stat_mod.S_ISREG(st.st_mode):
            out = os.open(e.name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                          dir_fd=dst_fd)
            try:
                with open(e.path, "rb") as f:
                    os.write(out, f.read())
                os.fchmod(out, mode)
            finally:
                os.close(out)
        else:
            continue
        os.chown(e.name, st.st_uid, st.st_gid, dir_fd=dst_fd, follow_symlinks=False)


def _exists(name: str, dir_fd: int) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True
