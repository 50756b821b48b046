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

from . import proc
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


# --- what the cell tried: the kernel's own counters of its network namespace (the network hint) ----------
# A packet that would leave a namespace with only lo up finds no route, and the kernel counts it, per
# namespace: `Ip: OutNoRoutes` in /proc/net/snmp, `Ip6OutNoRoutes` in /proc/net/snmp6 (proc(5); /proc/PID/net
# is the namespace of PID). A connect() to a public address counts one; a DNS lookup counts one per query,
# since a cell without network names an unreachable server in its resolv.conf (compiler._offline_resolver).
# Counters the kernel keeps anyway: nothing is traced, and they are read only when a cell failed.
NS_GET_USERNS = 0xB701  # ioctl_ns(2): _IO(0xb7, 0x1), the user namespace that owns a namespace


def parse_counters(snmp: str, snmp6: str) -> dict[str, int]:
    """{"ipv4_no_route", "ipv6_no_route"} from the text of /proc/net/snmp and /proc/net/snmp6 (a pair of
    lines per protocol, names then values; one "name value" line per counter)."""
    out = {"ipv4_no_route": 0, "ipv6_no_route": 0}
    lines = snmp.splitlines()
    for names, values in zip(lines[::2], lines[1::2]):
        names, values = names.split(), values.split()
        if names[:1] == ["Ip:"] and "OutNoRoutes" in names:
            out["ipv4_no_route"] = int(values[names.index("OutNoRoutes")])
    for line in snmp6.splitlines():
        name, _, value = line.partition(" ")
        if name == "Ip6OutNoRoutes":
            out["ipv6_no_route"] = int(value.strip())
    return out


def counters_here() -> dict[str, int]:
    """The counters of the calling thread's network namespace."""
    return parse_counters(proc.net_text("snmp"), proc.net_text("snmp6"))


def raw_here() -> bytes:
    """The two files counters_here parses, as they are, for from_raw to parse elsewhere: a cell's leader sends
    these (steps "netns_watch") and the controller parses them after the command's exec. Parsing in the leader
    (~60 new strings, a dict, the encoding) cost ~35 copy-on-write faults of its pages (issue 29, sixth round)."""
    return proc.net_bytes("snmp") + b"\0" + proc.net_bytes("snmp6")


def from_raw(data: bytes) -> dict[str, int]:
    """raw_here's counters."""
    snmp, _, snmp6 = data.partition(b"\0")
    return parse_counters(snmp.decode(errors="replace"), snmp6.decode(errors="replace"))


def counters_in(fd: int) -> dict[str, int]:
    """The counters of the network namespace `fd` names, read on this thread (setns(2) there and back).
    Needs CAP_SYS_ADMIN over the namespace's owner and in our own user namespace: a root controller.
    A normal user's cell namespace is owned by the cell's user namespace: a throwaway helper enters that
    first (enter_owner), then reads here."""
    own = proc.ns("net", "thread-self")
    try:
        lsys.setns(fd, lsys.CLONE_NEWNET)
        try:
            return counters_here()
        finally:
            lsys.setns(own, lsys.CLONE_NEWNET)  # back home, whatever the read did
    finally:
        os.close(own)


def enter_owner(fd: int) -> None:
    """In a single-threaded throwaway helper: into the user namespace that owns the network namespace `fd`
    (its owner's euid holds every capability there, user_namespaces(7)), so that setns into it is allowed."""
    userns_fd = fcntl.ioctl(fd, NS_GET_USERNS)
    try:
        lsys.setns(userns_fd, lsys.CLONE_NEWUSER)
    finally:
        os.close(userns_fd)


def tried(now: dict, base: dict | None) -> dict[str, int]:
    """What the cell's life added: the counters at its end minus those at its start (a fresh namespace: 0)."""
    base = base or {}
    out = {k: max(0, now.get(k, 0) - base.get(k, 0)) for k in ("ipv4_no_route", "ipv6_no_route")}
    out["no_route"] = out["ipv4_no_route"] + out["ipv6_no_route"]
    return out


def encode(counters: dict) -> bytes:
    return " ".join(f"{k}={v}" for k, v in counters.items()).encode()


def decode(data: bytes) -> dict[str, int]:
    out = {}
    for word in data.decode(errors="replace").split():
        k, _, v = word.partition("=")
        if v.isdigit():
            out[k] = int(v)
    return out
