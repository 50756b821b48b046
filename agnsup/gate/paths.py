"""Path words -> absolute paths, and what kind of place a path is.

Shared by hardline (textual intent: no symlink resolution, the words say what
the command means to hit) and sandbox (real scope: symlinks resolved).
"""

from __future__ import annotations

import functools
import os
import re

from ..linux.host import realpath


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


# /proc/PID/root/X is X as process PID sees it (proc(5)): the gate judges it as /X.
# /proc/self and /proc/thread-self name whoever opens them: the cell, not the gate.
_PROC_ROOT = LazyRe(r"^/proc/(?:\d+|self|thread-self)(?:/task/\d+)?/root(?=/|$)")
_PROC_SELF = ("/proc/self/", "/proc/thread-self/")


def proc_alias(p: str, base: str | None = None) -> str:
    """`/proc/1/root/etc` -> `/etc`; `/proc/self/cwd/x` -> `<base>/x` (lexically)."""
    if not p.startswith("/proc/"):
        return p
    m = _PROC_ROOT.match(p)
    if m:
        return "/" + p[m.end():].lstrip("/")
    if base and base.startswith("/") and p.startswith(("/proc/self/cwd", "/proc/thread-self/cwd")):
        rest = p.split("/cwd", 1)[1]
        if rest in ("", "/") or rest.startswith("/"):
            return os.path.normpath(base + rest)
    return p


def resolve(p: str) -> str:
    """os.path.realpath that never raises and never shows the gate's own pid.

    realpath raises PermissionError on `/proc/1/root` (ptrace access mode,
    proc(5)) and would turn `/proc/self/...` into `/proc/<the gate's pid>/...`:
    such paths are judged lexically after proc_alias()."""
    p = proc_alias(p)
    if p.startswith(_PROC_SELF) or p in ("/proc/self", "/proc/thread-self"):
        return p
    try:
        return realpath(p)  # os.path.realpath; within a cell's prepare, its walk (linux/host.one_look)
    except (OSError, ValueError, RuntimeError):
        return p


@functools.lru_cache(maxsize=64)
def real(p: str) -> str:
    return resolve(p)


def expand(word: str, *, home: str, base: str) -> tuple[str | None, bool]:
    """Absolute, normalised path for a word, and whether it ended in a glob.

    Knows `~`, `~user`, `$HOME`, `$TMPDIR` (=> /tmp), `$PWD` and `${VAR:-default}`;
    any other variable makes the path unknown (None). A glob keeps the part
    before the first glob component, flagged, so `/usr/*` means "inside /usr".
    """
    w = word
    if not w:
        return None, False
    if "`" in w or "$(" in w or "<(" in w or ">(" in w:
        return None, False  # command or process substitution: known only at run time
    if w.startswith("~"):
        head, sep, rest = w.partition("/")
        w = (home if head == "~" else "/home/" + head[1:]) + sep + rest
    while "$" in w:
        i = w.index("$")
        m = _VAR.match(w[i:])
        if not m:
            return None, False
        name = m.group(1) or m.group(3)
        # an unknown variable counts only with a non-empty default (${VAR:-/x})
        val = {"HOME": home, "TMPDIR": "/tmp", "TMP": "/tmp", "TEMP": "/tmp", "PWD": base}.get(name, m.group(2) or None)
        if val is None:
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
    return proc_alias(os.path.normpath(w).replace("//", "/"), base), glob


def within(p: str, root: str) -> bool:
    return p == root or p.startswith(root.rstrip("/") + "/")


def catastrophic_target(p: str, *, home: str, worktree: str | None = None) -> str:
    """Why deleting everything at `p` would be a disaster, or "" if it would not.

    Returns a rule suffix: "rm_root", "rm_home", "rm_system", "rm_worktree".
    """
    if p == "/":
        return "rm_root"
    if p == home or within(home, p) or p in HOME_PARENTS or os.path.dirname(p) in HOME_PARENTS:
        return "rm_home"
    if worktree and worktree != "/":
        # Before the scratch roots: a CI checkout under /tmp is still the worktree.
        if p == worktree or within(worktree, p):
            return "rm_worktree"
        if within(p, worktree):
            return ""  # inside the worktree: the agent's own files, wherever the worktree lies (/root/src, /usr/src)
    if any(within(p, t) for t in TEMP_ROOTS):
        return ""
    if home != "/" and within(p, home):
        return ""  # inside the user's home (also /root, when root runs agnsup)
    if p.count("/") == 1:
        return "rm_system"  # any top-level directory other than scratch
    if any(within(p, s) for s in SYSTEM_DEEP):
        return "rm_system"
    if p.startswith("/var/"):
        depth = p.count("/")
        if depth == 2 or (depth == 3 and p.startswith(("/var/lib/", "/var/log/"))):
            return "rm_system"
    return ""


# Recursive chmod/chown/chgrp/setfacl: the places whose owners and modes the host depends on
# (setuid binaries, sudo/ssh/PAM configuration, the package database). Other top-level
# directories (/opt, /srv, /data, /directory), /var/lib/<service>, /var/www and other
# users' homes are a service's or a user's own: fixing their owner is routine.
PERMISSION_ROOTS = frozenset({"/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/libx32", "/proc",
                              "/sbin", "/sys", "/usr", "/var", "/snap", "/System", "/Library", "/Applications",
                              "/private", "/private/etc", "/private/var", "/var/lib", "/var/log", "/var/spool",
                              "/var/cache", "/var/run", "/var/mail", "/var/backups", "/var/lib/dpkg", "/var/lib/apt",
                              "/var/lib/rpm", "/run"})
PERMISSION_DEEP = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/boot", "/usr/bin", "/usr/sbin", "/usr/lib",
                   "/usr/lib32", "/usr/lib64", "/usr/libexec", "/etc/ssh", "/etc/sudoers.d", "/etc/pam.d",
                   "/etc/security", "/etc/ssl", "/etc/systemd", "/System")


def permission_target(p: str, *, home: str) -> str:
    """Why a recursive owner/mode change at `p` breaks the host, or "" if it would not.

    Same suffixes as catastrophic_target ("rm_root", "rm_home", "rm_system")."""
    if p == "/":
        return "rm_root"
    if p == home:
        return ""  # `chown -R me ~` repairs a home
    if p in HOME_PARENTS or (p == "/root" and home != "/root"):
        return "rm_home"
    if p in PERMISSION_ROOTS or any(within(p, d) for d in PERMISSION_DEEP):
        return "rm_system"
    if p.startswith("/usr/") and p.count("/") == 2 and p not in ("/usr/local", "/usr/src", "/usr/games"):
        return "rm_system"  # /usr/share, /usr/include, ...; deeper (/usr/share/nginx/html) is a package's own
    return ""


def system_file(p: str) -> bool:
    return bool(SYSTEM_FILES.search(p))


def system_write_target(p: str) -> bool:
    """A file whose overwrite damages the host (dd of=, truncate)."""
    return system_file(p) or any(within(p, s) for s in ("/etc", "/boot", "/usr", "/bin", "/sbin", "/lib", "/lib64",
                                                        "/var/log", "/var/lib"))

