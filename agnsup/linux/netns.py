"""The cell's network namespace: only loopback, brought up in the child.

unshare(CLONE_NEWNET) gives a namespace whose only link, lo, is down. One
SIOCSIFFLAGS ioctl brings it up: the same netlink request pyroute2 would
send, without a 150 ms import on every cell. The namespace is anonymous: it dies with the last
process in it, so nothing is left to clean up after a crash.
"""
from __future__ import annotations

import fcntl
import os
import struct

from . import sys as lsys

SIOCGIFFLAGS = 0x8913
SIOCSIFFLAGS = 0x8914
IFF_UP = 0x1


def loopback_up() -> None:
    fd = lsys.inet_dgram_socket()
    try:
        ifreq = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(fd, SIOCGIFFLAGS, ifreq))[1]
        fcntl.ioctl(fd, SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | IFF_UP))
    finally:
        os.close(fd)
