"""Small host files a controller of many cells reads at every cell, read once while they keep their identity.

Issue 29, sixth round: the user's ~/.gitconfig, pip.conf and .npmrc (toolconfig) and /etc/nsswitch.conf (the
offline resolver of compiler.py) were opened and read at every cell's prepare. Now each is one stat(2) a cell:
its text is kept with the identity of what was read, (device, inode, size, mtime, ctime) of the file the path
leads to now, and read again when any of them differs (an edit in place moves ctime, a replacement or a symlink
pointed elsewhere the inode). Nothing is kept until the file has been still for SETTLED ns before the read: a
write in the clock tick of the read could leave all five as they were (policy.py's MEMO_SETTLED, the same rule).
"""
from __future__ import annotations

import os
import time

SETTLED = 1_000_000_000
_KEPT: dict = {}  # path -> (identity, text)


def identity(st: os.stat_result) -> tuple:
    """What a file's identity is here: (device, inode, size, mtime, ctime)."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def settled(st: os.stat_result | tuple, now: int | None = None, wait: int | None = None) -> bool:
    """Unchanged for over `wait` ns (SETTLED; a stat result or an identity): safe to keep against its identity."""
    wait = SETTLED if wait is None else wait
    mtime, ctime = (st.st_mtime_ns, st.st_ctime_ns) if isinstance(st, os.stat_result) else st[3:5]
    return (time.time_ns() if now is None else now) - max(mtime, ctime) > wait


def read_text(path: str) -> str | None:
    """open(path, errors="replace").read(), or None when it cannot be read, remembered as said above."""
    try:
        st = os.stat(path)
    except OSError:
        _KEPT.pop(path, None)
        return None
    kept = _KEPT.get(path)
    if kept is not None and kept[0] == identity(st):
        return kept[1]
    try:
        with open(path, errors="replace") as f:
            st = os.fstat(f.fileno())  # the identity of what is read, not of what the path led to a moment ago
            text = f.read()
    except OSError:
        _KEPT.pop(path, None)
        return None
    if settled(st):
        _KEPT[path] = (identity(st), text)
    else:
        _KEPT.pop(path, None)
    return text
