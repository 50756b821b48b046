"""Selftest gate for issue 25's door 4: the cell's /dev is its own, not the host's.

HOST_DEVICES: a uid-0 cell with the host's /dev could read a raw disk (or a loop
device, /dev/mem, the kernel log) around every mask: the state root, ~/.ssh,
/etc/shadow are all on that disk. The probe lists /dev, walks it, and tries to
open every block device it sees and the host's root block device by its host
path; any block device there, any read, or a host device node beyond the
minimal set (null, zero, full, random, urandom, tty, the stdio terminal at
console, its own devpts) is FAIL.
"""
from __future__ import annotations

import os
from contextlib import suppress

from .isolation import _judge

# The nodes a cell's /dev may hold (linux/mounts.py DEV_NODES, plus the stdio terminal bound at console
# and the cell's own devpts); a role's filesystem.devices would add to it, the selftest roles list none.
MINIMAL = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom", "/dev/tty", "/dev/console")

# argv: the minimal set joined by ":", then host paths to try, each in two pieces (the text gate
# refuses some device paths on sight; joined here)
P_HOST_DEVICES = r'''
import os, stat, sys
minimal = set(sys.argv[1].split(":"))
args = sys.argv[2:]
tried = {a + b for a, b in zip(args[::2], args[1::2])}
found = set(tried)
for root, dirs, files in os.walk("/dev"):  # links (fd, stdin, ptmx) lead into /proc and pts: not followed
    found.update(os.path.join(root, n) for n in dirs + files)
worked, extra = [], []
for p in sorted(found):
    try:
        st = os.stat(p) if p in tried else os.lstat(p)
    except OSError:
        continue
    if stat.S_ISCHR(st.st_mode) and p not in minimal and not p.startswith("/dev/pts/"):
        extra.append(f"{p} (c {os.major(st.st_rdev)}:{os.minor(st.st_rdev)})")
    if not stat.S_ISBLK(st.st_mode):
        continue
    extra.append(f"{p} (b {os.major(st.st_rdev)}:{os.minor(st.st_rdev)})")
    try:
        with open(p, "rb") as f:
            worked.append(f"read {len(f.read(512))} bytes of {p}")
    except OSError as e:
        print("refused", p, e.strerror)
for w in worked:
    print(w)
if extra:
    print("host device nodes in the cell:", ", ".join(extra))
print("/dev holds", sorted(os.listdir("/dev")))
sys.exit(77 if worked or extra else 0)
'''


def root_block_device() -> str | None:
    """The host path of the block device holding / (e.g. /dev/vda), from its device number."""
    dev = os.stat("/").st_dev
    try:
        name = os.path.basename(os.readlink(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"))
    except OSError:
        return None  # / is not on a block device here (overlay, tmpfs, a virtual fs)
    return f"/dev/{name}"


def host_block_devices() -> list[str]:
    """Every block device node in the host's /dev (top level): what the cell must not see."""
    import stat
    out = []
    for n in os.listdir("/dev"):
        p = os.path.join("/dev", n)
        with suppress(OSError):
            if stat.S_ISBLK(os.lstat(p).st_mode):
                out.append(p)
    return sorted(out)


def gate_host_devices(h) -> dict:
    name = "HOST_DEVICES"
    root = root_block_device()
    paths = ([root] if root else []) + [p for p in host_block_devices() if p != root][:32]
    args = [x for p in paths for x in (p[:5], p[5:])]
    g = _judge(name, h.probe(P_HOST_DEVICES, ":".join(MINIMAL), *args),
               "seeing or reading the host's device nodes")
    g["evidence"] += (f" (host root device: {root or 'none: / is not on a block device'}; host block devices "
                      f"tried: {len(paths)})")
    return g


RUNNERS = {"HOST_DEVICES": gate_host_devices}
