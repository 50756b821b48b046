"""Pathname Unix sockets bound on this host, from /proc/net/unix (unix(7)).

A pathname socket is a file-system object: no network namespace covers it, a
read-only mount does not stop connect(2) (the kernel checks write permission
on the socket inode, never the mount's flags), and Landlock (ABI 7) has no
right for it. The compiler masks each one a cell would see (docs/isolation.md
"Doors: control sockets and host Unix sockets"); this module only lists them.

/proc/net/unix lists every socket of the reader's network namespace with the
name it was bound to, in the binder's mount namespace and relative to its cwd:
abstract names start with "@" (Landlock's scope refuses those), relative
names cannot be placed, and a listed path may since have been unlinked or
replaced; callers lstat what they keep.
"""
from __future__ import annotations

import os
import re
import stat

from . import proc

_PATH = rb" (/.*)"  # "." stops at the newline (re caches the compiled form: no compile at import)


def bound_paths() -> set[str]:
    """The absolute names of bound pathname sockets in /proc/net/unix (listeners,
    bound datagram sockets and their accepted connections, deduplicated)."""
    data = proc.read("net/unix") or b""
    # Num RefCount Protocol Flags Type St Inode Path: the fields before the path are hex and
    # decimal numbers, so a line's first " /" starts an absolute path, which runs to the line's
    # end (one regex pass: a busy host lists thousands of sockets, most of them under /run)
    return {os.fsdecode(p) for p in set(re.findall(_PATH, data))}


def is_socket(path: str) -> bool:
    """`path` itself (not a link's target) is a socket right now."""
    try:
        return stat.S_ISSOCK(os.lstat(path).st_mode)
    except OSError:
        return False
