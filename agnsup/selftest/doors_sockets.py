"""Selftest gates for issue 25's doors 1 and 2: host Unix sockets and agnsup's control sockets.

HOST_UNIX_SOCKET: the selftest makes listeners of its own under /run and /var/tmp (a
directory each, removed at the end); a cell of the selftest role tries to connect to
both. CONTROL_SOCKET: the selftest starts a serve Server of its own (its own state
root, its socket under /run) and a cell whose role lists that socket on purpose, so
that only the peer check (linux/peer.py) stands between the cell and a controller.
A probe exits 77 when it was served or connected, 0 when refused (isolation.py's
convention). Wired into `agnsup selftest --isolation` by the lead (RUNNERS).
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
import threading
from contextlib import suppress

from .isolation import _gate
from .probes import ESCAPED

# argv: socket paths; 77 when any connect() worked (it says so to the listener, which the tests ask too)
P_CONNECT = r'''
import socket, sys
reached = []
for p in sys.argv[1:]:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(p)
        s.sendall(b"a cell was here\n")
        reached.append(p)
    except OSError as e:
        print("refused", p, e.strerror)
    finally:
        s.close()
for p in reached:
    print("REACHED", p)
sys.exit(77 if reached else 0)
'''

# argv: socket path, request JSON (default: a ping). Prints the server's first answer; 77 when it was ok.
P_ASK = r'''
import json, socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    s.connect(sys.argv[1])
except OSError as e:
    print("connect refused:", e.strerror)
    sys.exit(0)
try:
    s.sendall((sys.argv[2] if len(sys.argv) > 2 else '{"op": "ping"}').encode() + b"\n")
except OSError as e:  # a server that refused at once may have closed already: its answer is still there
    print("send:", e.strerror)
answer = s.makefile("rb").readline()
print("ANSWER", answer.decode().strip())
sys.exit(77 if json.loads(answer or b"{}").get("ok") else 0)
'''


class HostListener:
    """A listener of the host's at `path`, mode 0777 so that only the sandbox stops a cell of any uid;
    `accepted` holds what each connection it accepted sent first (tests/test_doors_sockets.py uses it too)."""

    def __init__(self, path: str):
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        os.chmod(path, 0o777)
        self.sock.listen(8)
        self.accepted: list[bytes] = []
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            c.settimeout(2)
            try:
                self.accepted.append(c.recv(64))
            except OSError:
                self.accepted.append(b"")
            c.close()

    def close(self) -> None:
        with suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self.thread.join(5)
        if os.path.lexists(self.path):
            os.unlink(self.path)


def _own_dir(top: str) -> str | None:
    try:
        d = tempfile.mkdtemp(prefix="agnsup-selftest-sock-", dir=top)
    except OSError:
        return None
    os.chmod(d, 0o755)
    return d


def _refused_before_running(res: dict, name: str) -> dict | None:
    if "error" in res:
        status = "ENV_BLOCKED: the probe cell did not start" if not res.get("denied") else \
            "ENV_BLOCKED: governance refused the probe (nothing about the kernel was tested)"
        return _gate(name, f"{status}: {res['error']}", res["error"])
    return None


def _run_dir() -> str | None:
    """A directory of the selftest's own under /run: /run itself as root, else the user's runtime
    directory (/run/user/UID, where a session manager made one)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    tops = ["/run"] + ([runtime] if runtime.startswith("/run/") and os.path.isdir(runtime) else [])
    return next((d for d in map(_own_dir, tops) if d is not None), None)


def gate_host_unix_socket(h) -> dict:
    name = "HOST_UNIX_SOCKET"
    run, elsewhere = _run_dir(), _own_dir("/var/tmp")
    dirs = [d for d in (run, elsewhere) if d is not None]
    if elsewhere is None:
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)
        return _gate(name, "ENV_BLOCKED: a directory of the selftest's own under /var/tmp", "")
    untried = "" if run else " (not tried under /run: no directory of ours there, as a normal user without " \
                             "a runtime directory)"
    listeners = []
    try:
        listeners = [HostListener(os.path.join(d, "host.sock")) for d in dirs]
        res = h.probe(P_CONNECT, *(lst.path for lst in listeners))
        early = _refused_before_running(res, name)
        if early is not None:
            return early
        heard = sum(len(lst.accepted) for lst in listeners)
        out = (res.get("stdout") or "").strip()
        if res["exit_code"] == ESCAPED or heard:
            return _gate(name, "FAIL", f"the cell connected to a host listener ({heard} accepted): {out}")
        if res["exit_code"] != 0:
            return _gate(name, "FAIL", f"the probe failed (exit {res['exit_code']}): {out} {res.get('stderr', '')}")
        return _gate(name, "PASS", f"connect() refused for {', '.join(lst.path for lst in listeners)}{untried}: "
                                   f"{out}")
    finally:
        for lst in listeners:
            lst.close()
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)


def gate_control_socket(h) -> dict:
    name = "CONTROL_SOCKET"
    d = _run_dir()
    if d is None:  # serve's socket belongs in the state root (masked in every cell), /run or /tmp (private)
        return _gate(name, "ENV_BLOCKED: a directory of the selftest's own under /run (a normal user without a "
                           "runtime directory /run/user/UID); tests/test_doors_sockets.py checks it as a normal user",
                     "")
    from ..doors.serve import Server
    sock = os.path.join(d, "serve.sock")
    state = os.path.join(h.root, "control-state")
    server = None
    try:
        server = Server(state, sock)
        os.chmod(sock, 0o777)  # open to the cell's uid whatever it is: only the peer check stands
        # serve_forever installs signal handlers, which only the main thread may: run its loop by hand
        thread = threading.Thread(target=_accept_loop, args=(server,), daemon=True)
        thread.start()
        role = h.role("selftest-reach-control", ("filesystem", "unix_sockets", json.dumps([sock])))
        res = h.probe(P_ASK, sock, role=role)
        early = _refused_before_running(res, name)
        if early is not None:
            return early
        out = (res.get("stdout") or "").strip()
        refused = [r for r in server.sup.ctl.journal.refusals() if r.get("entry") == "serve"]
        if res["exit_code"] == ESCAPED:
            return _gate(name, "FAIL", f"a cell reached serve's socket and was served: {out}")
        if res["exit_code"] != 0 or not refused:
            return _gate(name, "FAIL", f"no refusal journaled (exit {res['exit_code']}): {out}")
        return _gate(name, "PASS", f"serve refused the cell's process and journaled it "
                                   f"(evidence: {'; '.join(refused[-1]['peer']['evidence'])})")
    except Exception as e:  # noqa: BLE001 - a gate reports, never raises
        return _gate(name, "FAIL", f"the gate itself failed: {type(e).__name__}: {e}")
    finally:
        if server is not None:
            server.stop.set()
            server.shutdown()
        shutil.rmtree(d, ignore_errors=True)
        from .isolation import remove_state
        remove_state(state)


def _accept_loop(server) -> None:
    """Server.serve_forever without its signal handling: accept until the listener closes."""
    while not server.stop.is_set():
        try:
            conn, _ = server.listener.accept()
        except OSError:
            return
        threading.Thread(target=server._handle, args=(conn,), daemon=True).start()


RUNNERS = {"HOST_UNIX_SOCKET": gate_host_unix_socket, "CONTROL_SOCKET": gate_control_socket}
