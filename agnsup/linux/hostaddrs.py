"""The addresses of this host's own interfaces, for the egress proxy (issue 25).

The proxy runs in the controller, in the host's network namespace: a cell
that asks it for one of the host's own addresses (eth0's, a docker bridge's,
a VPN's) reaches services that listen on the host, whatever class the
address is in. So the proxy refuses every address of the host, not only by
class. Read from the kernel's own tables without netlink (cheap, no socket):

  IPv4  /proc/net/fib_trie: the leaves marked "/32 host LOCAL" (the local
        routing table holds one per address of every interface)
  IPv6  /proc/net/if_inet6: one line per interface address

Addresses change (DHCP, a VPN coming up), so the set is re-read at most once
per REFRESH seconds instead of once per process.
"""
from __future__ import annotations

import ipaddress
import threading
import time

from . import proc

REFRESH = 1.0  # seconds a read set is trusted

_lock = threading.Lock()
_cached: tuple[float, frozenset] = (float("-inf"), frozenset())


def parse_fib_trie(text: str) -> set:
    """IPv4 addresses of the local interfaces: each `|-- A.B.C.D` followed by `/32 host LOCAL`."""
    out = set()
    last = None
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("|--"):
            last = s[3:].strip()
        elif last is not None and s.startswith("/32 host LOCAL"):
            out.add(ipaddress.IPv4Address(last))
        else:
            last = None if not s.startswith("/") else last
    return out


def parse_if_inet6(text: str) -> set:
    """IPv6 addresses of the local interfaces (32 hex digits, then index, prefix, scope, flags, name)."""
    out = set()
    for line in text.splitlines():
        word = line.split(maxsplit=1)[0] if line.strip() else ""
        if len(word) == 32:
            out.add(ipaddress.IPv6Address(int(word, 16)))
    return out


def local_addresses(now: float | None = None) -> frozenset:
    """Every address of every interface of this network namespace (loopback included)."""
    global _cached
    now = time.monotonic() if now is None else now
    with _lock:
        if now - _cached[0] < REFRESH:
            return _cached[1]
        addrs = frozenset(parse_fib_trie(proc.net("fib_trie")) | parse_if_inet6(proc.net("if_inet6")))
        _cached = (now, addrs)
        return addrs
