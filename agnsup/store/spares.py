"""Spare inodes: a controller of many cells makes the empty directories and files its next cells need on the state
root's disk ahead of time, on a thread of its own, and a cell claims one by rename(2) into place (issue 29).

Why: on a busy ext4 (this project's hosts: no journal, docs/hosts.md) a new inode waits for the recently deleted
ones (`find_inode_bit`): 60-300 us a mkdir under /var/tmp here, depending on the other deletions of the last ~30 s,
against ~35 us a rename. A Supervisor cell of a worktree-writing role made ~11 of them on its path; claimed now:
its directory with tmp/ and the files its own path opens in it (stdout, stderr, protect-start.json, the receipt's
reserve: one rename for all, those it does not open unlinked, `trim`), the change layer's run directory, its cell
directory with upper/ and work/, and its pending marker. Not claimed: the worktree lock (a claim into locks/ measured
slower than the create it replaced, +0.06-0.10 ms), and what the kernel makes in the layer's work/ at the overlay's
mount (work/work, incompat/volatile and its `dirty`: the overlay empties and makes its work directory itself).

    <state>/spares/<controller id>/<kind>.<n>     empty; removed at the controller's close, or by the janitor
                                                  once that controller is dead (janitor._sweep_spares)

A spare holds nothing of a cell before it is claimed: empty directories and files, made by the controller's process
with the modes the cell's own path uses (so: the same owner, and the umask of the moment it was made). A claim is
renameat2 with RENAME_NOREPLACE: it never replaces what is there (a directory's rename would replace an empty one),
and any failure (none ready, the target's parent missing: the first cell of a run, another file system) leaves the
caller to make the inode as before; a claimed directory whose subdirectories went missing has them made again.
`agnsup run` (one cell) has no maker: every claim says no at once.
"""
from __future__ import annotations

import collections
import os
import threading
import time
from contextlib import suppress

DIR = "spares"
# kind -> (mode, children: None for a file, else (name, mode, is a directory) each), as the cell's own path makes them
KINDS = {
    # cells/<run>/<cell>/ with its tmp/ (home.make: os.makedirs), and the files the cell's own path opens in it
    # (Maker(cell_files)): what the cell does not use is unlinked at its claim (trim)
    "cell": (0o777, (("tmp", 0o777, True),)),
    "layer": (0o700, (("upper", 0o700, True), ("work", 0o700, True))),  # changes/<run>/<cell>/ (changes.prepare)
    "dir": (0o700, ()),              # changes/<run>/ (changes.prepare)
    "f600": (0o600, None),           # the change layer's pending marker (changes)
}
# how many of each are kept ready: two cells' worth (a third concurrent cell makes its own, as before)
WANT = {"cell": 2, "layer": 2, "dir": 2, "f600": 2}
QUIET = 0.004  # s without a claim before the maker makes a spare (Maker._quiet)
_AT_FDCWD = -100
_RENAME_NOREPLACE = 1

_makers: dict[str, "Maker"] = {}  # spare area -> the live makers of this process (a Supervisor's)
_renameat2 = None


def area(state_root: str, controller_id: str) -> str:
    return os.path.join(state_root, DIR, controller_id)


def _rename_noreplace(src: str, dst: str) -> bool:
    assert _renameat2 is not None  # set by start, before any maker exists
    return _renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE) == 0


def claim(kind: str, target: str) -> bool:
    """Put a ready spare of `kind` at `target` (which must not exist; its parent must); False when none was put
    there, and the caller makes it as before."""
    for m in _makers.values():  # one in a Supervisor
        if target.startswith(m.root_slash):
            return m.claim(kind, target)
    return False


def trim(cell_dir: str, names) -> None:
    """Unlink the files of a claimed cell spare that this cell does not use (each is made by the cell's own path
    when it does: a cell that does not capture has no stdout file, a read-only one no protect-start.json)."""
    for name in names:
        with suppress(FileNotFoundError):
            os.unlink(os.path.join(cell_dir, name))


def start(state_root: str, controller_id: str, cell_files: dict[str, int] | None = None) -> "Maker | None":
    """A controller of many cells: its maker (None where renameat2 is missing: then nothing changes).
    `cell_files`: name -> mode of the empty files a cell spare holds (the controller's cells open them)."""
    global _renameat2
    if _renameat2 is None:
        import ctypes
        try:
            fn = ctypes.CDLL(None, use_errno=True).renameat2
        except AttributeError:  # glibc before 2.28
            return None
        fn.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)
        fn.restype = ctypes.c_int
        _renameat2 = fn
    m = Maker(state_root, controller_id, cell_files or {})
    _makers[m.dir] = m
    m.thread.start()
    return m


class Maker:
    def __init__(self, state_root: str, controller_id: str, cell_files: dict[str, int]):
        self.root = os.path.abspath(state_root)
        self.root_slash = self.root + "/"
        self.dir = area(self.root, controller_id)
        self.kinds = dict(KINDS)
        mode, children = KINDS["cell"]
        self.kinds["cell"] = (mode, (*(children or ()), *((n, m, False) for n, m in cell_files.items())))
        self.ready: dict[str, collections.deque] = {k: collections.deque() for k in KINDS}
        self._n = 0
        self._last = 0.0  # time.monotonic() of the last claim
        self._idle = False  # the maker waits for a claim (all kinds full)
        self.claimed = 0  # how many were put in place (tests, profiles)
        self._wake = threading.Condition()
        self._stop = False
        self.thread = threading.Thread(target=self._run, name="agnsup-spares", daemon=True)

    def claim(self, kind: str, target: str) -> bool:
        self._last = time.monotonic()
        try:
            src = self.ready[kind].popleft()
        except IndexError:
            return False
        try:
            ok = _rename_noreplace(src, target)
        except (TypeError, ValueError):  # a path with a NUL: the caller's own call refuses it
            ok = False
        if ok:
            self.claimed += 1
        elif os.path.lexists(src):
            self.ready[kind].appendleft(src)  # still a good spare: kept
        return ok

    def refill(self) -> None:
        """Wake the maker: called after a cell's result (supervisor), not at the claims: a thread woken amid a
        cell's place took the GIL from it (+0.08-0.15 ms a cell in a quiet moment, measured)."""
        if self._idle:  # the maker, woken, waits for the quiet itself
            self._idle = False
            with self._wake:
                self._wake.notify()

    def _run(self) -> None:
        try:
            for d in (os.path.dirname(self.dir), self.dir):  # 0700, as the state root's other folders
                with suppress(FileExistsError):
                    os.mkdir(d, 0o700)
        except OSError:
            return  # no spares: every claim says no
        from ..linux import fs
        fs.spread(self.dir)  # each spare (a cell's, a layer's) in a block group of its own: linux/fs.spread
        while True:
            with self._wake:
                while not self._stop and all(len(self.ready[k]) >= WANT[k] for k in KINDS):
                    self._idle = True
                    self._wake.wait()
                self._idle = False
                if self._stop:
                    return
            for kind, (mode, children) in self.kinds.items():
                while len(self.ready[kind]) < WANT[kind] and not self._stop:
                    self._quiet()
                    path = os.path.join(self.dir, f"{kind}.{self._n}")
                    self._n += 1
                    try:
                        _make(path, mode, children)
                    except OSError:
                        return  # a full or read-only disk: the cells make their own, as before
                    if kind == "dir":  # a run's change-layer directory: its layers spread, as changes.prepare's
                        fs.spread(path)
                    self.ready[kind].append(path)

    def _quiet(self) -> None:
        """Wait until no claim came for QUIET s: a cell's claims come in a burst (its place, stdio, the receipt's
        reserve), and a spare made meanwhile would contend with them (the spare area's directory lock that each
        claim's rename takes, the GIL); after the burst the cell runs and ends, and the disk is the maker's."""
        while not self._stop:
            left = self._last + QUIET - time.monotonic()
            if left <= 0:
                return
            with self._wake:
                self._wake.wait(left)

    def close(self) -> None:
        """Stop making, then remove what is left (a crash before the end leaves it to the janitor's sweep)."""
        _makers.pop(self.dir, None)  # first: no claim starts from here while its folder goes
        with self._wake:
            self._stop = True
            self._wake.notify()
        self.thread.join(5)
        remove(self.dir)


def _make(path: str, mode: int, children) -> None:
    if children is None:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, mode))
        return
    os.mkdir(path, mode)
    for name, m, is_dir in children:
        if is_dir:
            os.mkdir(os.path.join(path, name), m)
        else:
            _make(os.path.join(path, name), m, None)


def remove(folder: str) -> None:
    """A controller's spare area, best effort (empty files and directories two levels deep)."""
    from ..linux import fs
    with suppress(OSError):
        fs.rmtree(folder)


def controller_name(name: str) -> bool:
    """Is `name` a controller's id (broker.Controller: "ctl-" and hex), the only names a spare area has?"""
    return name.startswith("ctl-") and len(name) > 4 and all(c in "0123456789abcdef" for c in name[4:])


def sweep(state_root: str, controller_id: str) -> bool:
    """The janitor's: a dead controller's spare area removed (nothing in it is a cell's). True if there was one."""
    if not controller_name(controller_id):
        return False
    folder = area(state_root, controller_id)
    if not os.path.lexists(folder):
        return False
    remove(folder)
    return True
