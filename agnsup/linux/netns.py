"""The cell's network namespace: only loopback, brought up in the child.

unshare(CLONE_NEWNET) gives a namespace whose only link, lo, is down. One
SIOCSIFFLAGS ioctl brings it up: the same netlink request pyroute2 would
send, without a 150 ms import on every cell. The namespace is anonymous: it dies with the last
process in it, so nothing is left to clean up after a crash.

Bringing lo up takes CAP_NET_ADMIN over the user namespace that owns the network namespace. A root
controller that lacks it (a container given CAP_SYS_ADMIN only, Docker's recipe) gives each cell a network
namespace owned by a user namespace of the cell's own (process.namespaces.cell_netns): a throwaway helper makes both
in one unshare (the new user namespace owns the new network namespace, and its creator holds every
capability there), brings lo up, and the cell's child joins the network namespace by setns; the child
itself stays in the controller's user namespace, so its mounts, ids and files are as before. The owner of
that user namespace is userns.netns_owner(), not root: a process whose euid is the owner's holds every capability
in it (user_namespaces(7)), and a cell that runs as host root must not gain CAP_NET_ADMIN over its
namespace that way; with another owner, what it holds there is what it holds in the controller's.
"""
from __future__ import annotations

import fcntl
import os
import struct

from . import sys as lsys

SIOCGIFFLAGS = 0x8913
SIOCSIFFLAGS = 0x8914
IFF_UP = 0x1
CAP_SYS_ADMIN = 21


def loopback_up() -> None:
    fd = lsys.inet_dgram_socket()
    try:
        ifreq = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(fd, SIOCGIFFLAGS, ifreq))[1]
        fcntl.ioctl(fd, SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | IFF_UP))
    finally:
        os.close(fd)


def own_user_and_net_namespace(owner: int) -> None:
    """In a throwaway helper of a root controller: a user namespace whose owner is `owner` (our euid
    when it is made), owning a new network namespace, whose lo is brought up. CAP_SYS_ADMIN is kept
    effective across the euid change (capset raises it again from the permitted set, which a
    saved-set uid of 0 keeps), so the kernel counts the unshare as a privileged one."""
    os.seteuid(owner)  # effective capabilities are cleared (capabilities(7)); permitted stay (ruid 0)
    lsys.set_caps([CAP_SYS_ADMIN])
    lsys.unshare(lsys.CLONE_NEWUSER | lsys.CLONE_NEWNET)
    loopback_up()
