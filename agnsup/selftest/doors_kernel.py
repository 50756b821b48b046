"""Selftest gates for issue 25's kernel doors: host IPC, keyrings, socket families, system calls,
PID 1's argv, the proxy and the host's own addresses (docs/isolation.md, "Doors: kernel").

Each gate plays a hostile cell through the selftest Harness (isolation.py): the host side sets the bait
(a 0600 SysV segment, a message queue, a semaphore set and a POSIX queue with a marker; a key in the
caller's user keyring; a listener on the host's own address), the probe, a Python program in a real
cell, tries to reach it and exits 77 when it did, 0 when every attempt was refused *by the mechanism
that should refuse it* (seccomp's EPERM / EAFNOSUPPORT, the IPC namespace's ENOENT), 3 when something
else answered (the door may be shut by chance, not by agnsup). The host side judges too: the segment's
marker unchanged, no key planted, no connection at the listener. tests/test_doors_kernel.py runs the
same probes and host helpers in every role, as root, as uid 65534 and as a normal user.
"""
from __future__ import annotations

import ctypes
import errno
import os
import secrets
import socket
import threading

from .isolation import _gate
from .probes import ESCAPED

# ------------------------------------------------------------------ probes (run in the cell)

# argv: shm_key shm_id msg_key sem_key mq_name marker
# every probe's ending: 77 when a forbidden thing worked, 3 when a call reached the kernel (an odd
# answer: not seccomp's), 0 when all were refused
_VERDICT = r'''
for w in worked:
    print("WORKED", w)
for o in odd:
    print("ODD", o)
sys.exit(77 if worked else 3 if odd else 0)
'''

P_HOST_IPC = r'''
import ctypes, errno, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
shm_key, shm_id, msg_key, sem_key = (int(x) for x in sys.argv[1:5])
mq_name, marker = sys.argv[5].encode(), sys.argv[6].encode()
worked, odd = [], []
def refused(what, ret, want):
    e = ctypes.get_errno()
    if ret >= 0:
        worked.append(what)
        return False
    if e not in want:
        odd.append(f"{what}: {errno.errorcode.get(e, e)}")
    print("refused", what, errno.errorcode.get(e, e))
    return True
refused("shmget(the host's key)", libc.shmget(shm_key, 0, 0), (errno.ENOENT,))
addr = libc.shmat(shm_id, None, 0)
if addr not in (None, ctypes.c_void_p(-1).value):
    seen = ctypes.string_at(addr, len(marker))
    worked.append(f"shmat(the host's shmid) read {seen!r}")
    ctypes.memmove(addr, b"X" * len(marker), len(marker))
    worked.append("and overwrote it")
else:
    refused("shmat(the host's shmid)", -1, (errno.EINVAL, errno.EIDRM))
buf = ctypes.create_string_buffer(256)
refused("shmctl(IPC_STAT, the host's shmid)", libc.shmctl(shm_id, 2, buf), (errno.EINVAL, errno.EIDRM))
refused("msgget(the host's key)", libc.msgget(msg_key, 0), (errno.ENOENT,))
refused("semget(the host's key)", libc.semget(sem_key, 0, 0), (errno.ENOENT,))
refused("mq_open(the host's queue)", libc.mq_open(mq_name, os.O_RDWR), (errno.ENOENT,))
with open("/proc/sysvipc/shm") as f:
    listed = [line.split()[0] for line in f.readlines()[1:]]
if str(shm_key) in listed:
    worked.append("/proc/sysvipc/shm lists the host's segment")
print("sysvipc/shm keys:", listed)
''' + _VERDICT

# argv: key_id ("-": none) description plant_description marker
P_KEYRING = r'''
import ctypes, errno, os, sys
libc = ctypes.CDLL(None, use_errno=True)
nr = {"x86_64": (250, 248, 249), "aarch64": (219, 217, 218)}[os.uname().machine]  # keyctl add_key request_key
KEYCTL_DESCRIBE, KEYCTL_READ, USER, SESSION = 6, 11, -4, -3
key_id, desc, plant, marker = sys.argv[1], sys.argv[2].encode(), sys.argv[3].encode(), sys.argv[4].encode()
worked, odd = [], []
def refused(what, ret):
    e = ctypes.get_errno()
    if ret >= 0:
        worked.append(what)
        return False
    if e != errno.EPERM:  # seccomp answers EPERM; anything else means the call reached the kernel
        odd.append(f"{what}: {errno.errorcode.get(e, e)} (reached the kernel)")
    print("refused", what, errno.errorcode.get(e, e))
    return True
buf = ctypes.create_string_buffer(4096)
ids = []
if key_id != "-":
    ids.append(int(key_id))
found = libc.syscall(nr[2], b"user", desc, None, 0)
if not refused("request_key(the host's key)", found):
    ids.append(found)
for k in ids:
    n = libc.syscall(nr[0], KEYCTL_DESCRIBE, k, buf, 4096)
    if not refused(f"keyctl(DESCRIBE {k})", n):
        worked[-1] += f": {buf.value[:80]!r}"
    n = libc.syscall(nr[0], KEYCTL_READ, k, buf, 4096)
    if not refused(f"keyctl(READ {k})", n):
        worked[-1] += f": {buf.raw[:n][:80]!r}" + (" (the host's marker)" if marker in buf.raw[:n] else "")
for ring, name in ((USER, "user"), (SESSION, "session")):
    refused(f"add_key into the {name} keyring", libc.syscall(nr[1], b"user", plant, b"planted", 7, ring))
''' + _VERDICT

# no argv: families that must be refused with EAFNOSUPPORT, and the everyday ones that must work
P_SOCKET_FAMILIES = r'''
import errno, socket, sys, threading
worked, odd, broke = [], [], []
for name, fam, typ, proto in (("AF_VSOCK", 40, socket.SOCK_STREAM, 0), ("AF_PACKET", 17, socket.SOCK_DGRAM, 0),
                              ("AF_ALG", 38, socket.SOCK_SEQPACKET, 0), ("AF_KEY", 15, socket.SOCK_RAW, 2),
                              ("AF_NETLINK+AF_VSOCK socketpair", 40, socket.SOCK_STREAM, -1)):
    try:
        s = socket.socketpair(fam, typ) if proto == -1 else socket.socket(fam, typ, proto)
    except OSError as e:
        print("refused", name, errno.errorcode.get(e.errno, e.errno))
        if e.errno != errno.EAFNOSUPPORT:
            odd.append(f"{name}: {errno.errorcode.get(e.errno, e.errno)} (not the filter's EAFNOSUPPORT)")
        continue
    worked.append(f"socket({name})")
    for x in (s if isinstance(s, tuple) else (s,)):
        x.close()
# everyday families still work
try:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a.sendall(b"ping"); assert b.recv(4) == b"ping"
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM); srv.bind(("127.0.0.1", 0)); srv.listen(1)
    threading.Thread(target=lambda: srv.accept()[0].sendall(b"pong"), daemon=True).start()
    c = socket.create_connection(srv.getsockname(), timeout=5); assert c.recv(4) == b"pong"
    socket.socket(socket.AF_INET6, socket.SOCK_STREAM).close()
    socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0).close()
    socket.getaddrinfo("localhost", 80)
    print("unix, tcp over loopback, inet6, netlink route: work")
except Exception as e:
    broke.append(f"an everyday socket broke: {type(e).__name__}: {e}")
for w in worked:
    print("WORKED", w)
for o in odd + broke:
    print("ODD", o)
sys.exit(77 if worked else 3 if odd or broke else 0)
'''

P_SYSCALLS = r'''
import ctypes, errno, os, sys
libc = ctypes.CDLL(None, use_errno=True)
NR = {"x86_64": {"userfaultfd": 323, "perf_event_open": 298, "open_by_handle_at": 304, "personality": 135},
      "aarch64": {"userfaultfd": 282, "perf_event_open": 241, "open_by_handle_at": 265, "personality": 92}}
nr = NR[os.uname().machine]
worked, odd = [], []
def refused(what, ret, undo=None):
    e = ctypes.get_errno()
    if ret >= 0:
        worked.append(what)
        if undo:
            undo(ret)
        return
    print("refused", what, errno.errorcode.get(e, e))
    if e != errno.EPERM:
        odd.append(f"{what}: {errno.errorcode.get(e, e)} (reached the kernel, not the filter's EPERM)")
# UFFD_USER_MODE_ONLY: what the kernel gives any process even with vm.unprivileged_userfaultfd = 0
refused("userfaultfd(UFFD_USER_MODE_ONLY)", libc.syscall(nr["userfaultfd"], os.O_CLOEXEC | 1), os.close)
class Attr(ctypes.Structure):
    _fields_ = [("type", ctypes.c_uint32), ("size", ctypes.c_uint32), ("config", ctypes.c_uint64),
                ("period", ctypes.c_uint64), ("sample_type", ctypes.c_uint64), ("read_format", ctypes.c_uint64),
                ("flags", ctypes.c_uint64), ("rest", ctypes.c_uint8 * 64)]
attr = Attr(type=1, size=64, config=1, flags=1 | 32 | 64)  # task-clock, disabled, exclude kernel and hv
refused("perf_event_open(task-clock of itself)", libc.syscall(nr["perf_event_open"], ctypes.byref(attr), 0, -1, -1, 0),
        os.close)
# the query as a 64-bit 0xffffffff: a bare int goes as a C int, sign-extended to 0xffffffffffffffff, which the
# default seccomp profiles of Docker and containerd (Kubernetes' RuntimeDefault) refuse: they allow personality
# only for 0, 8, 0x20000, 0x20008 and 0xffffffff, compared on 64 bits (seen in a pod: a false "refused")
QUERY = ctypes.c_ulong(0xFFFFFFFF)
for flag, name in ((0x0400000, "READ_IMPLIES_EXEC"), (0x0040000, "ADDR_NO_RANDOMIZE")):
    if libc.syscall(nr["personality"], flag) < 0:
        refused(f"personality({name})", -1)
        continue
    now = libc.syscall(nr["personality"], QUERY)  # the query answers the persona in force
    libc.syscall(nr["personality"], 0)
    if now & flag:
        worked.append(f"personality({name})")
    else:
        odd.append(f"personality({name}) answered but did not take")
# a bad mount fd and an empty handle: the kernel answers EBADF or EINVAL, so EPERM can only be the filter's
handle = ctypes.create_string_buffer(136)
refused("open_by_handle_at", libc.syscall(nr["open_by_handle_at"], -1, handle, os.O_RDONLY), os.close)
if libc.syscall(nr["personality"], QUERY) < 0 or libc.syscall(nr["personality"], 0) < 0:
    odd.append("personality(query) or personality(PER_LINUX) refused: everyday programs use them")
''' + _VERDICT

# argv: pieces of strings that must not appear in PID 1's files (each given as two halves, joined here)
P_PID1_ARGV = r'''
import os, sys
args = sys.argv[1:]
forbidden = [a + b for a, b in zip(args[::2], args[1::2])]
leaks, seen = [], {}
for path in ("/proc/1/cmdline", "/proc/1/task/1/cmdline", "/proc/1/environ", "/proc/1/comm"):
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        print(path, "unreadable:", e.strerror)
        continue
    seen[path] = data
    print(path, repr(data[:120]))
    leaks += [f"{path} holds {s!r}" for s in forbidden if s.encode() in data]
argv = [a for a in seen.get("/proc/1/cmdline", b"").split(b"\0") if a]
if argv != [b"agnsup-init"]:
    leaks.append(f"/proc/1/cmdline is {argv[:6]!r}, not the init's own name")
if seen.get("/proc/1/environ"):
    leaks.append("/proc/1/environ is readable and not empty")
for link in ("cwd", "root", "exe"):
    try:
        leaks.append(f"/proc/1/{link} -> {os.readlink('/proc/1/' + link)}")
    except OSError as e:
        print(f"/proc/1/{link}", "unreadable:", e.strerror)
for l in leaks:
    print("WORKED", l)
sys.exit(77 if leaks else 0)
'''

# argv: address port (CONNECT through the cell's proxy, whose address HTTP_PROXY gives)
P_PROXY_HOST = r'''
import os, socket, sys
addr, port = sys.argv[1], sys.argv[2]
proxy = os.environ.get("HTTP_PROXY", "").rpartition("/")[2]
host, _, pport = proxy.rpartition(":")
s = socket.create_connection((host, int(pport)), timeout=20)
target = f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"
s.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
status = s.recv(4096).split(b"\r\n", 1)[0].decode(errors="replace")
print("proxy answered:", status)
sys.exit(77 if " 200" in status else 0)
'''


# ------------------------------------------------------------------ the host's bait

_libc = ctypes.CDLL(None, use_errno=True)
_libc.shmat.restype = ctypes.c_void_p
IPC_CREAT, IPC_EXCL, IPC_RMID, IPC_NOWAIT = 0o1000, 0o2000, 0, 0o4000
_NR_KEYS = {"x86_64": (250, 248), "aarch64": (219, 217)}  # keyctl, add_key
KEYCTL_INVALIDATE, KEYCTL_SEARCH, KEY_SPEC_USER_KEYRING = 21, 10, -4


def _ok(ret: int, what: str) -> int:
    if ret < 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")
    return ret


class HostIpc:
    """A 0600 SysV shared-memory segment holding a marker, a message queue with a message, a semaphore
    set and a POSIX message queue, made by the host (as `uid`, when given: in a child that drops to it)
    and removed by `close`."""

    def __init__(self, uid: int | None = None):
        self.key = secrets.randbelow(1 << 30) + 1
        self.marker = "agnsup-ipc-" + secrets.token_hex(6)
        self.mq = "/agnsup-door-" + secrets.token_hex(4)
        self.shm_id = self.msg_id = self.sem_id = None
        from ..process.helpers import probe  # the only package that creates processes

        def make() -> None:  # the objects carry their maker's uid: made as the user the cell runs as
            if uid is not None:
                os.setresuid(uid, uid, uid)
            self._make()
        made, why = probe(make)
        # found again by key (the caller is root, or their maker)
        self.shm_id, self.msg_id, self.sem_id = (x if x >= 0 else None for x in (
            _libc.shmget(self.key, 0, 0), _libc.msgget(self.key + 1, 0), _libc.semget(self.key + 2, 0, 0)))
        if not made or None in (self.shm_id, self.msg_id, self.sem_id):
            self.close()
            raise OSError(errno.EIO, f"could not make the host's IPC objects: {why}")

    def _make(self) -> None:
        shm = _ok(_libc.shmget(self.key, 4096, IPC_CREAT | IPC_EXCL | 0o600), "shmget")
        addr = _libc.shmat(shm, None, 0)
        ctypes.memmove(addr, self.marker.encode(), len(self.marker))
        _libc.shmdt(ctypes.c_void_p(addr))
        msg = _ok(_libc.msgget(self.key + 1, IPC_CREAT | IPC_EXCL | 0o600), "msgget")
        body = ctypes.create_string_buffer(b"\x01\x00\x00\x00\x00\x00\x00\x00" + self.marker.encode())
        _ok(_libc.msgsnd(msg, body, len(self.marker), IPC_NOWAIT), "msgsnd")
        _ok(_libc.semget(self.key + 2, 1, IPC_CREAT | IPC_EXCL | 0o600), "semget")
        fd = _ok(_libc.mq_open(self.mq.encode(), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600, None), "mq_open")
        os.close(fd)

    def probe_args(self) -> list[str]:
        return [str(self.key), str(self.shm_id), str(self.key + 1), str(self.key + 2), self.mq, self.marker]

    def segment(self) -> bytes:
        """What the segment holds now (read by the host)."""
        addr = _libc.shmat(self.shm_id, None, 0o10000)  # SHM_RDONLY
        try:
            return ctypes.string_at(addr, len(self.marker))
        finally:
            _libc.shmdt(ctypes.c_void_p(addr))

    def close(self) -> None:
        if self.shm_id is not None:
            _libc.shmctl(self.shm_id, IPC_RMID, None)
        if self.msg_id is not None:
            _libc.msgctl(self.msg_id, IPC_RMID, None)
        if self.sem_id is not None:
            _libc.semctl(self.sem_id, 0, IPC_RMID)
        _libc.mq_unlink(self.mq.encode())
        self.shm_id = self.msg_id = self.sem_id = None


class HostKey:
    """A "user" key holding a marker in the caller's user keyring; `planted()` finds a key a cell added
    there; `close` invalidates both."""

    def __init__(self):
        self.keyctl, add_key = _NR_KEYS[os.uname().machine]
        self.desc = "agnsup-door-" + secrets.token_hex(6)
        self.plant = self.desc + "-planted"
        self.marker = "agnsup-key-" + secrets.token_hex(6)
        self.id = _ok(_libc.syscall(add_key, b"user", self.desc.encode(), self.marker.encode(), len(self.marker),
                                    KEY_SPEC_USER_KEYRING), "add_key")

    def probe_args(self) -> list[str]:
        return [str(self.id), self.desc, self.plant, self.marker]

    def planted(self) -> int | None:
        found = _libc.syscall(self.keyctl, KEYCTL_SEARCH, KEY_SPEC_USER_KEYRING, b"user", self.plant.encode(), 0)
        return found if found >= 0 else None

    def close(self) -> None:
        for k in (self.id, self.planted()):
            if k is not None:
                _libc.syscall(self.keyctl, KEYCTL_INVALIDATE, k)


def host_address() -> str | None:
    """A non-loopback address of this host's own interfaces (IPv4 first), or None."""
    from ..linux import hostaddrs
    addrs = sorted((a for a in hostaddrs.local_addresses() if not a.is_loopback and not a.is_link_local),
                   key=lambda a: (a.version, int(a)))
    return str(addrs[0]) if addrs else None


class Listener:
    """A TCP listener on `addr` that records every connection it accepts (from any thread)."""

    def __init__(self, addr: str):
        self.sock = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind((addr, 0))
        self.sock.listen(8)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.accepted: list = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._done.is_set():
            try:
                c, peer = self.sock.accept()
            except (socket.timeout, OSError):
                continue
            self.accepted.append(peer)
            c.close()

    def close(self) -> None:
        self._done.set()
        self._thread.join(5)
        self.sock.close()


# ------------------------------------------------------------------ gates

def _verdict(name: str, res: dict, what: str, host_says: str = "") -> dict:
    """PASS when the probe says refused (0) and the host saw nothing; FAIL otherwise."""
    if "error" in res:
        why = "the governance gate refused the probe before it ran, so the kernel was not tested" \
            if res.get("denied") else "the probe could not run"
        return _gate(name, "FAIL", f"{why}: {res['error']}")
    out = "; ".join((res.get("stdout", "") + res.get("stderr", "")).strip().splitlines())
    if host_says:
        return _gate(name, "FAIL", f"{what}: {host_says}. {out}")
    if res["exit_code"] == 0:
        return _gate(name, "PASS", f"{what}: refused. {out}")
    if res["exit_code"] == ESCAPED:
        return _gate(name, "FAIL", f"{what}: it worked. {out}")
    return _gate(name, "FAIL", f"{what}: probe ended {res.get('state')} ({res.get('reason')}), exit "
                 f"{res['exit_code']}: {out}")


def gate_host_ipc(h) -> dict:
    try:
        ipc = HostIpc(uid=h.user)
    except OSError as e:
        return _gate("HOST_IPC", f"ENV_BLOCKED: SysV IPC or POSIX message queues on this host ({e})", "")
    try:
        res = h.probe(P_HOST_IPC, *ipc.probe_args())
        now = ipc.segment()
    finally:
        ipc.close()
    changed = f"the host's segment now holds {now!r}" if now != ipc.marker.encode() else ""
    return _verdict("HOST_IPC", res, "reaching the host's SysV shm/msg/sem and POSIX queue", changed)


def gate_keyring(h) -> dict:
    try:
        key = HostKey()
    except OSError as e:
        return _gate("KEYRING", f"ENV_BLOCKED: a key in the caller's user keyring ({e.strerror})", "")
    try:
        res = h.probe(P_KEYRING, *key.probe_args())
        planted = key.planted()
    finally:
        key.close()
    return _verdict("KEYRING", res, "reading the host's key, planting one",
                    f"key {planted} appeared in the host's user keyring" if planted else "")


def gate_socket_families(h) -> dict:
    return _verdict("SOCKET_FAMILIES", h.probe(P_SOCKET_FAMILIES), "socket(AF_VSOCK / AF_PACKET / AF_ALG / AF_KEY)")


def gate_syscalls(h) -> dict:
    return _verdict("SYSCALLS", h.probe(P_SYSCALLS),
                    "userfaultfd, perf_event_open, personality(READ_IMPLIES_EXEC), open_by_handle_at")


def gate_pid1_argv(h) -> dict:
    import sys
    leaks = [h.state, sys.executable, os.path.realpath(sys.argv[0]) if sys.argv and sys.argv[0] else h.root]
    args = [p for s in leaks if s for p in (s[:len(s) // 2], s[len(s) // 2:])]
    res = h.probe(P_PID1_ARGV, *args, role="selftest-pidns")
    if "error" not in res and not res["receipt_data"]["isolation"].get("pid_namespace"):
        return _gate("PID1_ARGV", "ENV_BLOCKED: a PID namespace for the cell", "")
    return _verdict("PID1_ARGV", res, "reading the controller's argv, environment and paths from PID 1")


def gate_proxy_host_address(h) -> dict:
    import json as _json
    addr = host_address()
    if addr is None:
        return _gate("PROXY_HOST_ADDRESS", "ENV_BLOCKED: an address of this host beyond loopback", "")
    role = h.role("selftest-proxy-host", ("network", "mode", '"allowlist"'), ("network", "allow", '["*:*"]'),
                  ("network", "allow_private", "true"))
    lst = Listener(addr)
    try:
        res = h.probe(P_PROXY_HOST, addr, str(lst.port), role=role)
    finally:
        lst.close()
    conns = [] if "error" in res else (res["receipt_data"].get("network") or {}).get("connections", [])
    rules = [c.get("rule") for c in conns]
    g = _verdict("PROXY_HOST_ADDRESS", res, f"reaching the host's own {addr} through the proxy (allow_private)",
                 f"the host listener on {addr} was reached: {lst.accepted}" if lst.accepted else "")
    if g["status"] == "PASS" and "address:host" not in rules:
        return _gate("PROXY_HOST_ADDRESS", "FAIL", f"refused, but not as the host's address: {_json.dumps(rules)}")
    return g


RUNNERS = {"HOST_IPC": gate_host_ipc, "KEYRING": gate_keyring, "SOCKET_FAMILIES": gate_socket_families,
           "SYSCALLS": gate_syscalls, "PID1_ARGV": gate_pid1_argv, "PROXY_HOST_ADDRESS": gate_proxy_host_address}
