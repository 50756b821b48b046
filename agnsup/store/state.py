"""The state root: where it is, and its layout.

    <state>/journal.db                  SQLite, WAL
    <state>/controllers/<id>.lock       flock held by a live controller instance
    <state>/cells/<run>/<cell>/         temp dir (tmp/), receipt.json
    <state>/locks/<digest>[-<cell>].lock worktree isolation locks (locks.py)
    <state>/caches/<scope>/             persistent package caches (filesystem.cache)
    <state>/cache/                      validated policies
    <state>/agnsup.sock                 the serve controller's socket
"""
from __future__ import annotations

import contextlib
import os
import stat
import time
from contextlib import suppress

from ..errors import NoPermission, StateError, UsageError
from .root import default_root  # noqa: F401 - its home; callers import it from here

_ID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")




def registry_dir() -> str:
    """Where agnsup notes every state root it used on this host (one symlink per root),
    so that each cell can be kept from all of them, not only from its own: sticky and
    world-writable like /var/tmp, so every user's roots are hidden from every cell."""
    return os.environ.get("AGNSUP_ROOTS_REGISTRY") or "/var/tmp/agnsup-roots"


DEFAULT_ROOTS = ("/var/lib/agnsup",)  # hidden whenever they exist, registered or not

# registry dir -> ((dev, ino, mtime_ns) of it, [(entry, target, real path of target)]): the registry as last
# listed, so a controller of many cells reads its ~50 links and resolves their targets once, not per cell
# (StateRoot.other_roots). Used only while the directory is unchanged, and only for a listing made over a
# second after its last change (a change within the same timestamp tick would not move the mtime).
_LISTED: dict = {}


def _registered(reg: str) -> list[tuple[str, str, str]]:
    try:
        st = os.stat(reg)
    except OSError:
        return []
    key = (st.st_dev, st.st_ino, st.st_mtime_ns)
    hit = _LISTED.get(reg)
    if hit is not None and hit[0] == key:
        return hit[1]
    try:
        names = os.listdir(reg)
    except OSError:
        names = []
    out = []
    for n in names:
        entry = os.path.join(reg, n)
        try:
            target = os.readlink(entry)
        except OSError:
            continue
        out.append((entry, target, os.path.realpath(target)))
    if time.time_ns() - st.st_mtime_ns > 1_000_000_000:
        _LISTED[reg] = (key, out)
    return out


def _still_real(target: str, real: str) -> bool:
    """Is `real` (the real path of `target` when the registry was listed) still the directory `target` names:
    a directory, no symlink, the same inode? Else the caller resolves `target` again."""
    try:
        a, b = os.stat(target), os.lstat(real)
    except OSError:
        return False
    return stat.S_ISDIR(b.st_mode) and (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def named_run(run_id: str) -> bool:
    """Did the call name its run? Only then is its agent one that lasts across calls: its cells share the
    agent's pod (compiler.network_pod) and never block each other on a worktree (broker._agent). The run
    "default" is every call that names none (unrelated commands at a shell): each cell an agent of its own."""
    return run_id != "default"


def check_id(kind: str, value: str) -> str:
    # ^[A-Za-z0-9][A-Za-z0-9._-]{0,63}\Z without compiling a regex on every start (the
    # regex this replaces ended in `$`, which also let a trailing newline through)
    if not value or len(value) > 64 or value[0] in "._-" or not _ID_CHARS.issuperset(value):
        raise UsageError(f"invalid {kind} id {value!r}: use 1-64 letters, digits, '.', '_' or '-', "
                         "starting with a letter or digit")
    return value


class StateRoot:
    def __init__(self, path: str | None = None):
        self.path = os.path.abspath(path or default_root())

    def ensure(self) -> "StateRoot":
        """Create the layout (mode 0700); a clear StateError if we cannot."""
        repo = _worktree_above(self.path)
        if repo is not None:
            raise StateError(f"state root {self.path} is inside the worktree {repo}: a command run there (git clean "
                             "-fdx, rm -rf) would take the journal and the receipts with it; use a state root "
                             "outside any worktree (--state-dir)")
        try:
            os.makedirs(self.path, mode=0o700, exist_ok=True)
            for sub in ("controllers", "cells", "locks"):
                os.makedirs(os.path.join(self.path, sub), mode=0o700, exist_ok=True)
        except OSError as e:
            raise self.unusable(e) from None
        if not os.access(self.path, os.W_OK):
            raise StateError(f"state root {self.path} is not writable")
        self.register()
        return self

    def register(self) -> None:
        """Note this root in the host's registry (registry_dir); best effort, one lstat when known."""
        from ..util.digest import sha256
        reg = registry_dir()
        entry = os.path.join(reg, sha256(self.path.encode()).hexdigest()[:24])
        if os.path.lexists(entry):
            return
        with suppress(OSError):  # a read-only /var/tmp: this root is hidden from its own cells all the same
            if not os.path.isdir(reg):
                os.makedirs(reg, exist_ok=True)
                os.chmod(reg, 0o1777)  # anyone adds their roots; the sticky bit keeps each user's own
            os.symlink(self.path, entry)

    def other_roots(self) -> list[str]:
        """Every other state root known on this host that still holds a journal (a cell
        sees none of them), as real paths; entries whose root is gone are dropped."""
        out = []
        for entry, target, real in _registered(registry_dir()):
            if os.path.exists(os.path.join(target, "journal.db")):
                out.append(real if _still_real(target, real) else os.path.realpath(target))
            elif not os.path.exists(target):
                with contextlib.suppress(OSError):
                    os.unlink(entry)
        out += [os.path.realpath(p) for p in DEFAULT_ROOTS if os.path.isdir(p)]
        own = os.path.realpath(self.path)
        return sorted(set(out) - {own})

    def unusable(self, e: OSError) -> StateError:
        """What is wrong with the state root, in words (not "File exists")."""
        import errno
        path = e.filename or self.path
        if e.errno in (errno.EEXIST, errno.ENOTDIR):
            # it, or a directory on its way, is something else than a directory
            bad = next((p for p in _ancestors(path) if os.path.lexists(p) and not os.path.isdir(p)), path)
            return StateError(f"state root {self.path} is unusable: {bad} is not a directory "
                              f"(it is a {_kind(bad)}); give another --state-dir or move it away")
        if e.errno in (errno.EACCES, errno.EPERM):
            return NoPermission(f"state root {self.path}: permission denied on {path}{_owner(path)}; "
                              "use a state root of your own (--state-dir) or run as its owner")
        if e.errno == errno.EROFS:
            return StateError(f"state root {self.path} is on a read-only file system ({path})")
        return StateError(f"state root {self.path} is unusable: {path}: {e.strerror}")

    def exists(self) -> bool:
        """Whether a journal is there; a state root we may not look into is an error,
        not "nothing was ever run" (another user's, root's /var/lib/agnsup)."""
        try:
            os.stat(os.path.join(self.path, "journal.db"))
            return True
        except FileNotFoundError:
            return False
        except NotADirectoryError as e:
            raise self.unusable(e) from None
        except PermissionError as e:
            e.filename = self.path
            raise self.unusable(e) from None

    def journal(self):
        from .journal import open_journal
        return open_journal(self.path)

    def cell_dir(self, run_id: str, cell_id: str) -> str:
        return os.path.join(self.path, "cells", run_id, cell_id)

    def controller_lock(self, cid: str) -> str:
        return os.path.join(self.path, "controllers", cid + ".lock")

    @property
    def ca_dir(self) -> str:
        return os.path.join(self.path, "ca")

    def ca_cert(self, cid: str) -> str:
        """Controller `cid`'s CA certificate (egress/ca.py Authority.write_cert; public, its key only ever in
        that controller's memory): written at its first cell with secrets, removed at its close or by the
        janitor."""
        return os.path.join(self.ca_dir, cid + ".pem")

    def worktree_lock(self, digest: str) -> str:
        return os.path.join(self.path, "locks", digest + ".lock")


def _ancestors(path: str) -> list[str]:
    """`path` and the directories above it, the top one first."""
    out = []
    p = os.path.abspath(path)
    while True:
        out.append(p)
        up = os.path.dirname(p)
        if up == p:
            return out[::-1]
        p = up


def _kind(path: str) -> str:
    try:
        m = os.lstat(path).st_mode
    except OSError:
        return "missing entry"
    return ("symbolic link" if stat.S_ISLNK(m) else "regular file" if stat.S_ISREG(m) else
            "socket" if stat.S_ISSOCK(m) else "fifo" if stat.S_ISFIFO(m) else "device" if
            stat.S_ISCHR(m) or stat.S_ISBLK(m) else "file")


def _owner(path: str) -> str:
    """ " (owned by uid N, mode 0700)" of the nearest part of `path` we can stat."""
    for p in reversed(_ancestors(path)):
        try:
            st = os.stat(p)
        except OSError:
            continue
        return f" ({p} is owned by uid {st.st_uid}, mode {st.st_mode & 0o7777:04o}; you are uid {os.geteuid()})"
    return ""


def _worktree_above(path: str) -> str | None:
    """The nearest directory at or above `path` that is a git worktree (has .git), if any."""
    return next((p for p in reversed(_ancestors(path)) if os.path.lexists(os.path.join(p, ".git"))), None)
