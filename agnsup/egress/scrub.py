"""issue 32: a secret's value that reached a cell's output is not kept in its capture files.

When a cell that had secrets ends, before its receipt is written, the broker overwrites every secret value
(and the Basic credential the proxy made of it) in the files of its cell directory (`stdout`, `stderr`, a pty's
capture) in place, by as many `*`: same length, so an offset a reader holds stays valid. Streamed: blocks of
BLOCK bytes with an overlap window of the longest value - 1, never the whole file in memory. The values are
the controller's memory only: a controller that died leaves its capture files unscrubbed (docs/isolation.md).
"""
from __future__ import annotations

import os

BLOCK = 1 << 20


def scrub_file(path: str, values: list[bytes]) -> dict[bytes, int]:
    """Overwrite each value in `path` by `*` x len; {value: how many} (values found at least once)."""
    values = sorted({v for v in values if v}, key=len, reverse=True)
    counts: dict[bytes, int] = {}
    if not values:
        return counts
    keep = max(len(v) for v in values) - 1
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        pos, tail = 0, b""  # tail: the last `keep` bytes before pos (already scrubbed where they matched)
        while True:
            block = os.pread(fd, BLOCK, pos)
            if not block:
                return counts
            buf = tail + block
            start = pos - len(tail)
            changed = buf
            for v in values:
                i = changed.find(v)
                while i >= 0:
                    counts[v] = counts.get(v, 0) + 1
                    changed = changed[:i] + b"*" * len(v) + changed[i + len(v):]
                    i = changed.find(v, i + len(v))
            if changed != buf:
                os.pwrite(fd, changed, start)
            pos += len(block)
            tail = changed[-keep:] if keep else b""
    finally:
        os.close(fd)


def scrub_cell(cell_dir: str, secrets) -> dict[str, int]:
    """Every regular file of the cell directory scrubbed of each secret's forms; {name: count} per secret."""
    from .intercept import _forms
    forms = {s.ref.name: _forms(s) for s in secrets}
    owner = {v: name for name, vs in forms.items() for v in vs}
    out = {name: 0 for name in forms}
    try:
        names = sorted(os.listdir(cell_dir))
    except OSError:
        return out
    for n in names:
        p = os.path.join(cell_dir, n)
        if n == "receipt.json" or not os.path.isfile(p) or os.path.islink(p):
            continue
        try:
            found = scrub_file(p, list(owner))
        except OSError:
            continue
        for v, k in found.items():
            out[owner[v]] += k
    return out
