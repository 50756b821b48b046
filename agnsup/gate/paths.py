"""Path words -> absolute paths, and what kind of place a path is.

Shared by hardline (textual intent: no symlink resolution, the words say what
the command means to hit) and sandbox (real scope: symlinks resolved).
"""

from __future__ import annotations

import functools
import os
import re


class LazyRe:
    """A regex compiled on first use: keeps `import agnsup.gate` cheap for `agnsup run`."""

    def __init__(self, pattern: str, flags: int = 0):
        self._args = (pattern, flags)
        self._re = None

    def __getattr__(self, name):
        if self._re is None:
            self._re = re.compile(*self._args)
        return getattr(self._re, name)


_VAR = LazyRe(r"^\$(?:\{(\w+)(?::?[-=]([^}]*))?\}|(\w+))")
GLOB_CHARS = frozenset("*?[")
UNKNOWN_CWD = "\0unknown"

# Top-level directories whose recursive deletion, at any depth below, breaks the host.
SYSTEM_DEEP = ("/etc", "/boot", "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/sys", "/proc",
               "/dev", "/root", "/snap", "/System", "/Library", "/Applications", "/private/etc")
# Scratch space: deleting inside is normal.
TEMP_ROOTS = ("/tmp", "/var/tmp", "/var/folders", "/dev/shm", "/private/tmp", "/private/var/folders", "/run/user")
HOME_PARENTS = ("/home", "/Users")
# Files whose overwrite, removal or permission change hands over the host.
SYSTEM_FILES = LazyRe(
    r"^/etc/(passwd|shadow|group|gshadow|sudoers|fstab|crypttab|ld\.so\.preload|login\.defs|securetty)(-|\.new)?$"
    r"|^/etc/(sudoers\.d|pam\.d|security)(/|$)|^/boot(/|$)|(^|/)\.ssh/(authorized_keys\d?|id_[a-z0-9_]+)$"
    r"|^/root/\.ssh(/|$)")
BLOCK_DEVICE = LazyRe(
    r"^/dev/(sd[a-z]|hd[a-z]|vd[a-z]|xvd[a-z]|nvme\d|mmcblk\d|dm-\d|md\d|loop\d|sr\d|nbd\d|rbd\d|"
    r"disk/|mapper/|mem$|kmem$|port$|root$)")
HARMLESS_DEVICES = LazyRe(r"^/dev/(null|zero|full|random|urandom|stdout|stderr|stdin|tty|fd/\d+|pts/\d+)$"
                              r"|^/proc/self/fd/\d+$")


def home_of(home: str | None) -> str:
    return os.path.normpath(home) if home else os.path.expanduser("~")


@functools.lru_cache(maxsize=64)
def real(p: str) -> str:
    return os.path.realpath(p)


def expand(word: str, *, home: str, base: str) -> tuple[str | None, bool]:
    """Absolute, normalised path for a word, and whether it ended in a glob.

    Knows `~`, `~user`, `$HOME`, `$TMPDIR` (=> /tmp), `$PWD` and `${VAR:-default}`;
    any other variable makes the path unknown (None). A glob keeps the part
    before the first glob component, flagged, so `/usr/*` means "inside /usr".
    """
    w = word
    if not w:
        return None, False
    if w.startswith("~"):
        head, sep, rest = w.partition("/")
        if head == "~":
            w = home + sep + rest
        else:
            w = "/home/" + head[1:] + sep + rest
    while "$" in w:
        i = w.index("$")
        m = _VAR.match(w[i:])
        if not m:
            return None, False
        name = m.group(1) or m.group(3)
        default = m.group(2)
        if name == "HOME":
            val = home
        elif name in ("TMPDIR", "TMP", "TEMP"):
            val = "/tmp"
        elif name == "PWD":
            val = base
        elif default:
            val = default
        else:
            return None, False
        w = w[:i] + val + w[i + m.end():]
    glob = False
    if any(c in w for c in GLOB_CHARS):
        parts = w.split("/")
        for k, part in enumerate(parts):
            if any(c in part for c in GLOB_CHARS):
                w = "/".join(parts[:k]) or ("/" if w.startswith("/") else ".")
                glob = True
                break
    if not w.startswith("/"):
        if base == UNKNOWN_CWD:
            return None, glob
        w = os.path.join(base, w)
    return os.path.normpath(w).replace("//", "/"), glob


def within(p: str, root: str) -> bool:
    return p == root or p.startswith(root.rstrip("/") + "/")


def catastrophic_target(p: str, *, home: str, worktree: str | None = None) -> str:
    """Why deleting everything at `p` would be a disaster, or "" if it would not.

    Returns a rule suffix: "rm_root", "rm_home", "rm_system", "rm_worktree".
    """
    if p == "/":
        return "rm_root"
    if any(within(p, t) for t in TEMP_ROOTS):
        return ""
    if p == home or within(home, p) or p in HOME_PARENTS or os.path.dirname(p) in HOME_PARENTS:
        return "rm_home"
    if worktree and (p == worktree or within(worktree, p)):
        return "rm_worktree"
    if p.count("/") == 1:
        return "rm_system"  # any top-level directory other than scratch
    if any(within(p, s) for s in SYSTEM_DEEP):
        return "rm_system"
    if p.startswith("/var/"):
        depth = p.count("/")
        if depth == 2 or (depth == 3 and p.startswith(("/var/lib/", "/var/log/"))):
            return "rm_system"
    return ""


def system_file(p: str) -> bool:
    return bool(SYSTEM_FILES.search(p))


def system_write_target(p: str) -> bool:
    """A file whose overwrite damages the host (dd of=, truncate)."""
    return system_file(p) or any(within(p, s) for s in ("/etc", "/boot", "/usr", "/bin", "/sbin", "/lib", "/lib64",
                                                        "/var/log", "/var/lib"))

