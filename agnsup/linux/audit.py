"""Landlock denials of one cell, from the audit subsystem (Landlock ABI 7, Linux 6.15+), read-only.

Since ABI 7 the kernel logs each Landlock denial as audit records
(Documentation/admin-guide/LSM/landlock.rst):

    type 1423 AUDIT_LANDLOCK_ACCESS  domain=1a2b3c blockers=fs.make_reg path="/etc" dev=... ino=...
    type 1424 AUDIT_LANDLOCK_DOMAIN  domain=1a2b3c status=allocated mode=enforcing pid=.. comm="..."
                                     domain=1a2b3c status=deallocated denials=3

Three conditions, all checked on a 6.18 host: the host's audit is enabled (auditd, or `auditctl
-e 1`: agnsup never switches a host-wide facility on); the domain is created with
LANDLOCK_RESTRICT_SELF_LOG_NEW_EXEC_ON (by default nothing is logged after an execve, and a
cell's command always runs after one); and a reader is subscribed before the denials happen.

The reader is a NETLINK_AUDIT socket bound to the read-only multicast group
(AUDIT_NLGRP_READLOG, CAP_AUDIT_READ): it displaces no audit daemon and changes no setting. Each
cell's domain is told from the others' by its creator's comm, set to a random tag just before
landlock_restrict_self (the tag lives until the execve: the allocation record keeps it). The
count is what the cell's own domain refused; a process of the cell that nests a domain of its own
may log under its own terms, so it is a lower bound, and records the socket dropped (ENOBUFS)
make it one too: both are said.

Only for a root controller on a host where audit looks enabled (an auditd pid file: no system
call on the run path of hosts without audit); the socket, its import and one AUDIT_GET are then
the cost of a cell.
"""
from __future__ import annotations

import os
from contextlib import suppress

NETLINK_AUDIT = 9
AUDIT_GET = 1000
AUDIT_NLGRP_READLOG = 1
AUDIT_LANDLOCK_ACCESS = 1423
AUDIT_LANDLOCK_DOMAIN = 1424
AUDITD_PID = "/run/auditd.pid"
RCVBUF = 4 << 20
SETTLE = 0.3  # seconds to wait, for a cell that had denials, for its domain's deallocation record
PATHS_SHOWN = 20


def wanted() -> bool:
    """Whether to try: root (CAP_AUDIT_READ) and a running audit daemon. AGNSUP_TEST_AUDIT=1: a
    test that enabled audit itself (no auditd on the test host)."""
    return os.geteuid() == 0 and (os.environ.get("AGNSUP_TEST_AUDIT") == "1" or os.path.exists(AUDITD_PID))


def subscribe(plan) -> tuple[Reader | None, dict | None]:
    """A Landlock ABI 7 cell's (the broker imports this module for those only): on a host that audits, (a Reader
    subscribed to the audit log before the cell exists, None), the plan naming its domain (landlock_log_tag), or
    (None, {"why": ...}); elsewhere (None, None), nothing called."""
    if not wanted():
        return None, None
    reader, why = Reader.open()
    if reader is None:
        return None, {"why": why}
    plan.landlock_log_tag = reader.tag
    return reader, None


class Reader:
    """Subscribed to the audit log; `tag` names the cell's Landlock domain (its creator's comm)."""

    def __init__(self, sock):
        self.sock = sock
        self.tag = "agnsup-" + os.urandom(4).hex()  # 15 bytes: TASK_COMM_LEN - 1
        self.lost = False
        self.domains: dict[str, dict] = {}  # domain id -> {"ours", "denials" (dealloc count), "access": [...]}

    @classmethod
    def open(cls) -> tuple[Reader | None, str]:
        """(reader, "") or (None, why not)."""
        import _socket
        import struct
        try:
            s = _socket.socket(_socket.AF_NETLINK, _socket.SOCK_RAW | _socket.SOCK_CLOEXEC, NETLINK_AUDIT)
        except OSError as e:
            return None, f"no audit netlink socket ({e.strerror})"
        try:
            with suppress(OSError):
                s.setsockopt(_socket.SOL_SOCKET, 33, RCVBUF)  # SO_RCVBUFFORCE (root)
            s.bind((0, 1 << (AUDIT_NLGRP_READLOG - 1)))
            s.send(struct.pack("=IHHII", 16, AUDIT_GET, 1, 1, 0))  # NLM_F_REQUEST
            s.settimeout(1.0)
            while True:
                d = s.recv(65536)
                typ = struct.unpack_from("=H", d, 4)[0]
                if typ == AUDIT_GET:
                    enabled = struct.unpack_from("=I", d, 20)[0]
                    break
                if typ == 2 and struct.unpack_from("=i", d, 16)[0] != 0:  # NLMSG_ERROR
                    raise OSError(-struct.unpack_from("=i", d, 16)[0], "AUDIT_GET refused")
        except OSError as e:
            s.close()
            return None, f"the audit status could not be read ({e.strerror or e})"
        if not enabled:
            s.close()
            return None, "the host's audit is disabled"
        s.setblocking(False)
        return cls(s), ""

    def _drain(self) -> None:
        import struct
        while True:
            try:
                d = self.sock.recv(65536)
            except BlockingIOError:
                return
            except OSError:  # ENOBUFS: the kernel dropped records for us
                self.lost = True
                continue
            off = 0
            while off + 16 <= len(d):
                length, typ = struct.unpack_from("=IH", d, off)
                if length < 16:
                    break
                if typ in (AUDIT_LANDLOCK_ACCESS, AUDIT_LANDLOCK_DOMAIN):
                    self._record(typ, d[off + 16:off + length].decode(errors="replace"))
                off += (length + 3) & ~3

    def _record(self, typ: int, text: str) -> None:
        fields = _fields(text)
        dom = self.domains.setdefault(fields.get("domain", "?"), {"ours": False, "denials": None, "access": []})
        if typ == AUDIT_LANDLOCK_ACCESS:
            dom["access"].append((fields.get("blockers", "?"), fields.get("path")))
        elif fields.get("status") == "allocated":
            dom["ours"] = fields.get("comm") == self.tag
        elif fields.get("status") == "deallocated" and fields.get("denials", "").isdigit():
            dom["denials"] = int(fields["denials"])

    def collect(self) -> dict:
        """The cell's denials, once its tree is dead (its domain ends with its last process)."""
        import select
        import time
        self._drain()
        deadline = time.monotonic() + SETTLE
        while any(d["ours"] and d["denials"] is None for d in self.domains.values()):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.sock], [], [], left)[0]:
                break
            self._drain()
        ours = [d for d in self.domains.values() if d["ours"]]
        by_class: dict[str, int] = {}
        paths: dict[str, int] = {}
        for d in ours:
            for blockers, path in d["access"]:
                for b in blockers.split(","):
                    by_class[b] = by_class.get(b, 0) + 1
                if path:
                    paths[path] = paths.get(path, 0) + 1
        seen = sum(len(d["access"]) for d in ours)
        kernel = [d["denials"] for d in ours]
        out = {"denials": seen, "by_class": dict(sorted(by_class.items())),
               "paths": [{"path": p, "count": c} for p, c in sorted(paths.items(), key=lambda x: -x[1])[:PATHS_SHOWN]],
               "kernel_count": sum(kernel) if kernel and None not in kernel else None,
               "lower_bound": True}
        if self.lost:
            out["lost"] = True
        return out

    def conclude(self) -> dict:
        """collect, then close: once the cell's tree is dead (its Landlock domain has ended, or ends now)."""
        try:
            return self.collect()
        finally:
            self.close()

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


def _fields(text: str) -> dict[str, str]:
    """key=value pairs of an audit record's text (values quoted or not; hex-encoded paths kept as is)."""
    out: dict[str, str] = {}
    for part in text.split(" "):
        k, sep, v = part.partition("=")
        if sep:
            out[k] = v[1:-1] if len(v) >= 2 and v[0] == v[-1] == '"' else v
    return out
