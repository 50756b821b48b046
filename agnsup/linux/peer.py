"""Who is at the other end of a control socket: is it a process of an agnsup cell?

(Unix sockets: `check`; loopback TCP, sandboxd and `mcp --http 127.0.0.1:PORT`: `check_tcp`, below.)

Every agnsup control endpoint that listens on a Unix socket (serve, `mcp --http
unix:PATH`) asks `check(conn)` before it reads a request, and refuses a peer that
is a process of ANY agnsup cell, of any state root: a cell that can start cells
outside its own confinement is out of it (issue 25, door 1). The kernel names the
peer (SO_PEERCRED: its pid, uid and gid at connect time), and where it can
(SO_PEERPIDFD, Linux 6.5+) pins that very process, so the evidence read from
/proc/PID below cannot be a later process's that took the pid over.

Evidence, strongest first; any one refuses:
- cgroup: the process is in `.../agnsup-<digest>/run-R/agent-A/cell-C` (every
  backend names a cell so, the systemd scope `agnsup-<digest>.scope` included),
  and a cell cannot move itself out: its /sys/fs/cgroup is read-only;
- token: AGNSUP_CELL_TOKEN in its environment (spec.py sets it in every cell; a
  process can drop it, so it only adds to the cgroup, for hosts without cgroups);
- uid: a uid that is not the server's own and not root (the socket is 0600, so
  such a peer got in by a file descriptor handed out, or is a cell's `process.user`);
- is_cell_uid: the uids root cells run as (userns.cell_range: uid 0 of a user namespace
  mapped to an unprivileged host range);
- invisible: a peer whose process this server cannot look at (pid 0: another
  PID namespace than ours or a descendant, or it is gone) is refused: fail closed.
"""
from __future__ import annotations

import errno
import ipaddress
import os
import re
import select
import socket
import struct
import sys

from . import proc
from .userns import is_cell_uid
from .session import TOKEN_VAR

SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)  # socket(7), Linux 6.5
# a cell's cgroup, whatever sits above agnsup's own directory (a delegated base, a systemd scope)
_CELL_CGROUP = re.compile(r"/agnsup-[0-9a-f]{12}/run-[^/]+/agent-[^/]+/cell-[^/]+(/|$)")


class Peer:
    __slots__ = ("pid", "uid", "gid", "evidence")

    def __init__(self, pid: int, uid: int, gid: int, evidence: list[str]):
        self.pid, self.uid, self.gid, self.evidence = pid, uid, gid, evidence

    @property
    def is_cell(self) -> bool:
        return bool(self.evidence)

    def as_dict(self) -> dict:
        return {"pid": self.pid, "uid": self.uid, "gid": self.gid, "evidence": self.evidence}


def check(conn: socket.socket) -> Peer:
    """The peer of the connected Unix socket `conn`, with the evidence that it is a
    cell's process (empty: it is not)."""
    pid, uid, gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    pidfd = None
    if pid > 0:
        try:
            pidfd = conn.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD)
        except OSError:
            pidfd = None  # before Linux 6.5: /proc/PID alone (a reuse within this check is not excluded)
    try:
        evidence = _evidence(pid, uid)
        if pidfd is not None and _exited(pidfd):
            evidence = evidence or [f"pid {pid} ended during the check (its /proc entry may be another's)"]
    finally:
        if pidfd is not None:
            os.close(pidfd)
    return Peer(pid, uid, gid, evidence)


def _evidence(pid: int, uid: int) -> list[str]:
    if pid <= 0:
        return ["its process is not visible from here (pid 0: another PID namespace)"]
    out = []
    lines = proc.cgroup_lines(pid)
    if lines is None:
        return [f"pid {pid} is gone"]
    for line in lines:
        path = line.split(":", 2)[-1]
        if _CELL_CGROUP.search(path):
            out.append(f"cgroup {path}")
            break
    env = proc.environ(pid)
    if env is not None and TOKEN_VAR in env:
        out.append(f"{TOKEN_VAR} in its environment")
    me = os.geteuid()
    if uid != me and uid != 0:
        out.append(f"uid {uid} is neither this server's ({me}) nor root")
    if is_cell_uid(uid):
        out.append(f"uid {uid} is in the cell uid range")
    return out


def _exited(pidfd: int) -> bool:
    """A pidfd polls readable once its process exited (pidfd_open(2))."""
    p = select.poll()
    p.register(pidfd, select.POLLIN)
    return bool(p.poll(0))


def refusal_line(peer: Peer, what: str) -> str:
    """The one line a refused peer gets back (and the journal keeps)."""
    if isinstance(peer, TcpPeer):  # a socket whose holder may be gone already: counted as a cell's
        uid = "unknown" if peer.uid is None else peer.uid
        return (f"{what}: refused: the connecting socket ({peer.address}, uid {uid}) is taken for an agnsup "
                f"cell's ({'; '.join(peer.evidence)}); cells never reach a control socket")
    return (f"{what}: refused: the connecting process (pid {peer.pid}, uid {peer.uid}) is a process of an agnsup "
            f"cell ({'; '.join(peer.evidence)}); cells never reach a control socket")


# -- loopback TCP: sandboxd's ports, `mcp --http 127.0.0.1:PORT` -----------------------------------------------
#
# TCP has no SO_PEERCRED: the kernel's socket table names the client socket's owner instead. Both ends of a
# connection between two sockets of this network namespace are rows of /proc/net/tcp (tcp6 for AF_INET6 ones,
# IPv4-mapped included): the client's row has local = the client's endpoint and remote = the server's. Its
# `uid` column is the uid the socket was made with (a process cannot change it later), its `inode` the socket's
# inode, 0 once no process holds it (closed: an orphan or TIME_WAIT row, whose uid reads 0, so it must not pass).

class TcpSocket:
    __slots__ = ("local", "remote", "state", "uid", "inode")

    def __init__(self, local: tuple, remote: tuple, state: int, uid: int, inode: int):
        self.local, self.remote, self.state, self.uid, self.inode = local, remote, state, uid, inode


class TcpPeer(Peer):
    """A loopback TCP client: uid (and socket inode) from the socket table; pid only when it was looked
    for (the server's own uid) and found."""
    __slots__ = ("address", "inode")

    def __init__(self, address: str, uid: int | None, inode: int | None, evidence: list[str], pid: int = 0):
        super().__init__(pid, uid, -1, evidence)
        self.address, self.inode = address, inode

    def as_dict(self) -> dict:
        return {"address": self.address, "uid": self.uid, "inode": self.inode, "pid": self.pid or None,
                "evidence": self.evidence}


def parse_tcp_endpoint(text: str) -> tuple:
    """`0100007F:1F90` -> (IPv4Address('127.0.0.1'), 8080). The kernel prints the address as 32-bit words,
    each in this machine's byte order (little-endian on x86: 127.0.0.1 is 0100007F), the port as plain hex.
    An IPv4-mapped IPv6 address stays IPv6 here (`_plain` makes it comparable)."""
    addr, _, port = text.partition(":")
    words = [int(addr[i:i + 8], 16).to_bytes(4, sys.byteorder) for i in range(0, len(addr), 8)]
    return ipaddress.ip_address(b"".join(words)), int(port, 16)


def parse_tcp_line(line: str) -> TcpSocket | None:
    """One row of /proc/net/tcp or tcp6 (proc(5)); None for the header or a line that is not a row."""
    f = line.split()
    if len(f) < 10 or not f[0].endswith(":") or not f[0][:-1].isdigit():
        return None
    return TcpSocket(parse_tcp_endpoint(f[1]), parse_tcp_endpoint(f[2]), int(f[3], 16), int(f[7]), int(f[9]))


def _plain(ip):
    """127.0.0.1 for ::ffff:127.0.0.1: the same endpoint seen from an AF_INET6 socket."""
    return getattr(ip, "ipv4_mapped", None) or ip


def _hex_forms(ip) -> list[str]:
    """How `ip` is printed in the tables: IPv4 in tcp (8 digits) and, mapped, in tcp6 (32 digits)."""
    ip = _plain(ip)
    forms = [ip.packed] if ip.version == 6 else [ip.packed, b"\0" * 10 + b"\xff\xff" + ip.packed]
    return ["".join(f"{int.from_bytes(p[i:i + 4], sys.byteorder):08X}" for i in range(0, len(p), 4)) for p in forms]


def tcp_client_sockets(tables: list[str], client: tuple, server_port: int, server_ip=None) -> list[TcpSocket]:
    """The rows of `tables` (the texts of /proc/net/tcp and tcp6) that are the client end of a connection
    from `client` (ip, port) to `server_port` (at `server_ip`, when the server knows which of its addresses
    was connected to). Only lines holding the client's endpoint are parsed."""
    ip, port = _plain(client[0]), client[1]
    want_server = None if server_ip is None else _plain(server_ip)
    out = []
    for form in _hex_forms(ip):
        needle = f" {form}:{port:04X} "
        for text in tables:
            at = text.find(needle)
            while at >= 0:
                start = text.rfind("\n", 0, at) + 1
                end = text.find("\n", at)
                row = parse_tcp_line(text[start:end if end >= 0 else len(text)])
                if row is not None and _plain(row.local[0]) == ip and row.local[1] == port \
                        and row.remote[1] == server_port \
                        and (want_server is None or _plain(row.remote[0]) == want_server):
                    out.append(row)
                at = text.find(needle, at + 1)
    return out


def _read_tables() -> list[str]:
    return [proc.net("tcp"), proc.net("tcp6")]  # tcp6 is "" in a kernel without IPv6


def is_this_hosts(ip) -> bool:
    """A loopback address, or an address of one of this network namespace's interfaces: a client at it
    is a process of this host (of this network namespace), so its socket is in this namespace's table."""
    from . import hostaddrs
    ip = _plain(ip)
    return ip.is_loopback or ip in hostaddrs.local_addresses()


# Socket inodes whose holder the /proc scan found to be no cell: a connection's later calls skip the scan.
# An inode names one socket for the kernel's life (sockfs numbers count up), so a hit is that connection.
_trusted_inodes: dict[int, int] = {}
_TRUSTED_MAX = 4096


def check_tcp(client: tuple[str, int], server_port: int, server_ip: str | None = None,
              tables: list[str] | None = None, others_refused: bool = True) -> TcpPeer:
    """The client of a TCP connection to this server, with the evidence that it is a cell's socket (empty:
    it is not, or it is not of this host). `client`: the peer's (address, port) as accept() or gRPC gave it.

    A client at an address of this host must be found in the table, else fail closed. Its uid judged as
    for a Unix peer: the cell uid range, or neither the server's nor root, refuses. A socket of the server's
    own uid is traced to its process (a /proc scan of that uid's processes) and judged by its cgroup and
    token like a Unix peer, so a normal user's cells, which run as that user, and a root controller's cells
    that are not mapped are refused too. A client at another address (a pod's network) is beyond this
    check: the network is the boundary there.

    `others_refused`: the rule "neither the server's uid nor root" stands in for authentication where an
    endpoint has none (sandboxd). An endpoint with its own (mcp's bearer token) passes False: another
    uid's socket is then traced to its process like the server's own where this server may look (root),
    and left to the token where it may not."""
    ip = ipaddress.ip_address(client[0])
    ip = _plain(ip)
    address = f"[{ip}]:{client[1]}" if ip.version == 6 else f"{ip}:{client[1]}"
    try:
        server = None if server_ip is None else ipaddress.ip_address(server_ip.partition("%")[0])
    except ValueError:
        server = None  # a name (localhost): the tables find the client by its own end
    rows = _client_sockets((ip, client[1]), server_port, server, tables)
    if not rows:
        if not is_this_hosts(ip):
            return TcpPeer(address, None, None, [])
        return TcpPeer(address, None, None, [f"no socket of this network namespace is the client end of "
                                             f"{address} (closed before the check?)"])
    me = os.geteuid()
    evidence: list[str] = []
    pid = 0
    for row in rows:  # one, unless the table is mid-change: any of them refuses
        if row.inode == 0:
            evidence.append(f"no process holds the client socket any more (state {row.state:02X}): closed "
                            "before the check")
            continue
        if is_cell_uid(row.uid):
            evidence.append(f"uid {row.uid} is in the cell uid range")
        if row.uid != me and row.uid != 0 and others_refused:
            evidence.append(f"uid {row.uid} is neither this server's ({me}) nor root")
        if row.uid == me or (me == 0 and not others_refused and not evidence):
            if _trusted_inodes.get(row.inode) == row.uid:
                continue  # this connection's holder was judged before (gRPC asks on every call)
            holders = proc.holders(f"socket:[{row.inode}]", row.uid)  # a /proc scan: only when the uid cannot tell
            if not holders:
                evidence.append(f"no process of uid {row.uid} holds socket inode {row.inode} (gone, or not "
                                "visible from here)")
            for h in holders:
                pid = pid or h
                evidence += [e for e in _evidence(h, row.uid) if not e.startswith("uid ")]
    last = rows[-1]
    if not evidence and len(rows) == 1 and (last.uid == me or me == 0):
        if len(_trusted_inodes) >= _TRUSTED_MAX:
            _trusted_inodes.clear()
        _trusted_inodes[last.inode] = last.uid
    return TcpPeer(address, last.uid, last.inode, evidence, pid)


# sock_diag(7): one exact lookup of a TCP socket by its four-tuple, O(1) in the kernel, where reading
# /proc/net/tcp walks the whole established hash (~1.5 ms here for 5 rows). The answer has the same uid and
# inode columns. /proc/net/tcp stays the fallback (no inet_diag in the kernel, or a wildcard listener whose
# local address the server does not know).
_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST = 1
_NLMSG_ERROR = 2
_NOCOOKIE = 0xFFFFFFFF
_TCP_LISTEN = 10
_ALL_STATES = 0xFFFFFFFF
_NLMSG = struct.Struct("=IHHII")          # nlmsghdr
_DIAG_REQ = struct.Struct("=BBBBI")       # inet_diag_req_v2 up to its inet_diag_sockid
_SOCKID = struct.Struct("!HH16s16s") # inet_diag_sockid: ports and addresses, network order
_SOCKID_TAIL = struct.Struct("=III")      # idiag_if, idiag_cookie[2]
_DIAG_MSG = struct.Struct("=BBBB")        # inet_diag_msg up to its sockid
_DIAG_MSG_TAIL = struct.Struct("=IIIII")  # expires, rqueue, wqueue, uid, inode


def diag_lookup(client: tuple, server: tuple) -> TcpSocket | None:
    """The socket whose local end is `client` (ip, port) and remote end `server` (ip, port), by
    SOCK_DIAG_BY_FAMILY; None when there is none. OSError when this kernel cannot answer."""
    cip, sip = _plain(client[0]), _plain(server[0])
    if cip.version != sip.version:
        return None
    family = socket.AF_INET if cip.version == 4 else socket.AF_INET6
    req = (_DIAG_REQ.pack(family, socket.IPPROTO_TCP, 0, 0, _ALL_STATES)
           + _SOCKID.pack(client[1], server[1], cip.packed.ljust(16, b"\0"), sip.packed.ljust(16, b"\0"))
           + _SOCKID_TAIL.pack(0, _NOCOOKIE, _NOCOOKIE))
    msg = _NLMSG.pack(_NLMSG.size + len(req), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST, 1, 0) + req
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC, _NETLINK_SOCK_DIAG) as nl:
        nl.sendto(msg, (0, 0))
        data = nl.recv(8192)
    _length, kind, _flags, _seq, _pid = _NLMSG.unpack_from(data)
    body = data[_NLMSG.size:]
    if kind == _NLMSG_ERROR:
        err = -struct.unpack_from("=i", body)[0]
        if err in (errno.ENOENT, 0):
            return None
        raise OSError(err, os.strerror(err))
    fam, state, _timer, _retrans = _DIAG_MSG.unpack_from(body)
    sport, dport, src, dst = _SOCKID.unpack_from(body, _DIAG_MSG.size)
    off = _DIAG_MSG.size + _SOCKID.size + _SOCKID_TAIL.size
    _expires, _rq, _wq, uid, inode = _DIAG_MSG_TAIL.unpack_from(body, off)
    if state == _TCP_LISTEN or dport != server[1] or sport != client[1]:
        return None  # the lookup fell back to a listener on the client's port: not the client's socket
    return TcpSocket((cip, sport), (sip, dport), state, uid, inode)


def _client_sockets(client: tuple, server_port: int, server_ip, tables: list[str] | None) -> list[TcpSocket]:
    """The client end of the connection: one sock_diag lookup when the server's address is known (or, for a
    wildcard listener, a loopback client's own address is the likely one), else the /proc tables."""
    if tables is None:
        guess = server_ip if server_ip is not None and not _plain(server_ip).is_unspecified else \
            client[0] if client[0].is_loopback else None
        if guess is not None:
            try:
                row = diag_lookup(client, (guess, server_port))
            except OSError:
                row = None  # no inet_diag here: the tables answer
            if row is not None:
                return [row]
            # not found: also what a kernel without tcp_diag loaded answers (ENOENT: a container, a
            # guest that cannot load modules), so the tables decide, never the missing module
        tables = _read_tables()
    return tcp_client_sockets(tables, client, server_port,
                              None if server_ip is None or _plain(server_ip).is_unspecified else server_ip)
