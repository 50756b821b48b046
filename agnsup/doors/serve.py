"""`agnsup serve`: a Supervisor behind a Unix socket, and the client `agnsup spawn` uses.

The socket lives in the state root (<state>/agnsup.sock, mode 0600: whoever
can use it can start cells as this user). The protocol is JSON lines: one
request object per line, one response object per line, in order, on one
connection. Every request has "op":

    ping                                  -> {"ok": true, "controller": ..., "pid": ...}
    spawn  {argv, role, run_id, ...}      -> {"ok": true, cell_id, run_id, agent_id, pid, cgroup, state}
                                             (state "waiting", pid null: queued behind a held worktree lock)
    run    {same as spawn}                -> {"ok": true, ...result of run_process}
    wait   {run_id, cell_id, timeout}     -> {"ok": true, ...result} (or "pending": true)
    cancel {cell_id|run_id|agent_id|all, grace} -> {"ok": true, cancelled, cells}
    cleanup {run_id}                      -> {"ok": true, cleaned, items}
    ps     {run_id, all}                  -> {"ok": true, cells: [...]}
    output {run_id, cell_id, since, timeout, max_bytes}
                                          -> {"ok": true, chunks: [{seq, stream, data_b64}], next, ended}
    stdin  {run_id, cell_id, data_b64, eof} -> {"ok": true}
    signal {run_id, cell_id, sig}         -> {"ok": true}   (sig: INT | TERM | KILL)
    resize {run_id, cell_id, cols, rows}  -> {"ok": true}
    publish_port {run_id, agent_id, port, host_port, host}
                                          -> {"ok": true, run_id, agent_id, pod_port, host_port, address, ...}
    list_ports {run_id, agent_id}         -> {"ok": true, ports: [...]}
    close_port {run_id, agent_id, port}   -> {"ok": true, closed: [...]}
    shutdown                              -> {"ok": true}; cancels this controller's cells, exits
    run_attached {argv, options, host_env, workdir, code, umask, limits, agnsup_env} + the caller's fds 0-2
                 (SCM_RIGHTS, on the request's first byte)
                                          -> {"started": cell_id}, then {"ok": true, ...result, "said": [lines]};
                                             the connection ends with it

run_attached is `agnsup run` handing its call over (doors/handoff.py): the cell
gets the caller's descriptors as its stdio, decided on as the in-process run's
(io/wiring.py), with entry "cli"; "said" are the stderr lines the in-process
run prints after its cell. While the cell runs, the client may send
{"signal": N} lines (SIGINT, SIGTERM, SIGHUP: delivered as an in-process run
delivers the signals it gets), and the connection is watched: its end before
the result (the caller was killed) kills the cell as a dead controller's
(receipt reason controller_died), unless on_controller_death = keep (it runs
on; a `caller_gone` event says so). A request from another install (`code`),
with another umask, other resource limits or another AGNSUP_* environment than
this serve's, or with a terminal among its descriptors is answered
{"ok": false, "declined": why}:
nothing ran, and the client runs the cell in-process.

Live I/O (docs/streaming.md): spawn with "stdin", "pty" {cols, rows} or
"stream"; bytes travel as base64 in "data_b64".

Errors: {"ok": false, "error": one line, "exit_code": the CLI's exit code}.
Before a response may come {"note": line} lines (e.g. waiting for a worktree
lock); the client prints them on stderr.

Who may connect (docs/isolation.md "Doors: control sockets"): the socket is
0600 and lives only where no cell can reach it (`socket_place`: inside the
state root, under /run or /tmp, which every cell has its own of), and each
connection's peer is checked before a request is read (linux/peer.py): a
process of any agnsup cell gets one error line (exit_code 126), journaled as a
refusal, and the connection is closed. The remaining peers, processes of the
server's own uid (or root) that are not cells, are its trusted callers: for
them, and only them, a request's host-side options are honoured as given:
`receipt_file` (written by the server, as its uid), `host_env` (the
environment the role's passthrough keys and `env:` secret sources are taken
from), `role` and `secrets` (agnsup/secrets.py: references, resolved in this
server). MCP and sandboxd never take receipt_file, host_env or secrets from
their clients.
"""
from __future__ import annotations

import base64
import json
import os
import signal
import socket
import struct
import sys
import threading
from contextlib import suppress

from ..errors import AgnsupError, NoServer, UsageError, as_value, from_value
from . import handoff  # os and sys only: the client half of run_attached, and the socket's name and address

MAX_REQUEST = 8 << 20


def default_socket(state_path: str) -> str:
    return os.path.join(state_path, handoff.SOCKET_NAME)


def _connect(path: str, timeout: float | None = 5.0) -> socket.socket:
    addr, fd = handoff.unix_address(path)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        s.settimeout(timeout)
        s.connect(addr)
        s.settimeout(None)
        return s
    except OSError:
        s.close()
        raise
    finally:
        if fd is not None:
            os.close(fd)


# Where a control socket may live: places every cell has its own of, or never sees.
SOCKET_DIRS = ("/run", "/var/run", "/tmp")


def socket_place(path: str, state_path: str, given: str) -> str:
    """`path` (absolute) if a control socket may live there: inside the state root, under
    /run or under /tmp (its directory's real path, so a link cannot lead elsewhere); a
    UsageError naming the allowed places otherwise (`given`: the option as written). A cell
    sees none of these: every cell masks the state roots, and has a /run and a /tmp of its own."""
    where = os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))
    state_real = os.path.realpath(state_path)
    for top in (state_real, *SOCKET_DIRS):
        if where.startswith(top.rstrip("/") + "/"):
            return path
    raise UsageError(f"{given}: a control socket must live where no cell can reach it: inside the state "
                     f"root ({state_real}), under /run or under /tmp")


def peer_refusal(conn: socket.socket, journal, what: str) -> str | None:
    """The check every control endpoint makes of a new connection's peer (linux/peer.py):
    None for a trusted caller; for a process of an agnsup cell the one refusal line,
    journaled (a `refused` event with the peer's pid, uid and the evidence)."""
    from ..linux import peer
    return _refused(peer.check(conn), journal, what)


def tcp_peer_refusal(client: tuple[str, int], server: tuple[str | None, int], journal, what: str,
                     others_refused: bool = True) -> str | None:
    """The same for a loopback TCP endpoint (sandboxd, `mcp --http 127.0.0.1:PORT`): `client` is the
    peer's (address, port), `server` this end's (address, or None when it is not known, and port);
    `others_refused`: see peer.check_tcp (False where a token authenticates the caller)."""
    from ..linux import peer
    return _refused(peer.check_tcp(client, server[1], server[0], others_refused=others_refused), journal, what)


def _refused(p, journal, what: str) -> str | None:
    from ..linux import peer
    if not p.is_cell:
        return None
    line = peer.refusal_line(p, what)
    with suppress(AgnsupError):  # refused all the same; the journal's own error is reported by the next command
        journal.record_refused(None, None, error=line, error_type="Denied", exit_code=126, entry=what,
                               peer=p.as_dict())
    return line


DRAIN_SECONDS = 1.0   # how long a refused peer's request is read (and dropped) after its answer
DRAIN_BYTES = 65536
_drainers = threading.BoundedSemaphore(16)  # refused peers drained at once; past that, closed at once


def refuse(conn: socket.socket, answer: bytes) -> None:
    """Answer a refused peer and close its connection without losing the answer: the peer may write its request
    after we answered (it cannot know it is refused), and a write to a closed socket fails with EPIPE (Unix) or
    makes the kernel reset the connection, unread answer and all (TCP). So our write side is shut, and what the
    peer sends is read and dropped for up to DRAIN_SECONDS (DRAIN_BYTES) on a thread of a bounded few, then closed.
    Never blocks its caller (mcp refuses on its event loop's accept)."""
    try:
        conn.sendall(answer)
        conn.shutdown(socket.SHUT_WR)
    except OSError:
        conn.close()
        return
    if not _drainers.acquire(blocking=False):
        conn.close()
        return

    def drain() -> None:
        import time
        try:
            deadline, left = time.monotonic() + DRAIN_SECONDS, DRAIN_BYTES
            while left > 0 and (wait := deadline - time.monotonic()) > 0:
                conn.settimeout(wait)
                data = conn.recv(min(left, 4096))
                if not data:
                    break
                left -= len(data)
        except OSError:
            pass
        finally:
            conn.close()
            _drainers.release()
    threading.Thread(target=drain, name="agnsup-refused", daemon=True).start()


def listen_unix(path: str, what: str) -> socket.socket:
    """A listening Unix socket at `path`, mode 0600 from birth (whoever can connect can
    start cells as this user); a dead server's socket file is replaced, a live one's is
    a UsageError naming `what` listens there."""
    if os.path.lexists(path):
        try:
            _connect(path, 1.0).close()
        except OSError:
            os.unlink(path)  # a dead server's socket
        else:
            raise UsageError(f"another {what} already listens at {path}")
    addr, fd = handoff.unix_address(path)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    old = os.umask(0o177)  # the socket file is born 0600
    try:
        s.bind(addr)
    finally:
        os.umask(old)
        if fd is not None:
            os.close(fd)
    os.chmod(path, 0o600)
    s.listen(64)
    return s


# -- client --------------------------------------------------------------------
class Client:
    """One connection to a serve controller."""

    def __init__(self, path: str):
        self.path = path
        try:
            self.sock = _connect(path)
        except (FileNotFoundError, ConnectionRefusedError) as e:
            raise NoServer(f"no serve controller listens at {path} ({e.strerror}); start one with "
                           "`agnsup serve`") from None
        except OSError as e:
            raise NoServer(f"cannot connect to {path}: {e.strerror or e}") from None
        self.file = self.sock.makefile("rwb")

    def call(self, op: str, **args) -> dict:
        """Send one request; return the response, or raise the AgnsupError it carries."""
        self.file.write(json.dumps({"op": op, **args}).encode() + b"\n")
        self.file.flush()
        while True:
            line = self.file.readline()
            if not line:
                raise NoServer(f"the serve controller at {self.path} closed the connection")
            resp = json.loads(line)
            if "note" not in resp:
                break
            print(resp["note"], file=sys.stderr, flush=True)
        if not resp.pop("ok", False):
            raise from_value(resp)
        return resp

    def close(self) -> None:
        self.file.close()
        self.sock.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# -- server --------------------------------------------------------------------
class Server:
    def __init__(self, state_dir: str | None, socket_path: str | None, backend=None):
        from ..supervisor import Supervisor
        from ..store.state import StateRoot
        if socket_path:  # before anything starts: a refused place leaves nothing behind
            socket_place(os.path.abspath(socket_path), StateRoot(state_dir).path, f"--socket {socket_path}")
        self.sup = Supervisor(state_dir, kind="serve", backend=backend)
        self.handoff = (handoff.code_key(), handoff.process_traits())
        self.path = os.path.abspath(socket_path or default_socket(self.sup.state.path))
        try:
            self.listener = listen_unix(self.path, "serve controller")
        except UsageError:
            self.sup.close()
            raise
        self.stop = threading.Event()

    def serve_forever(self) -> int:
        r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        old_wake = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        handlers = {sig: signal.signal(sig, lambda *_: self.stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
        print(json.dumps({"ready": True, "socket": self.path, "controller": self.sup.controller_id,
                          "pid": os.getpid()}), flush=True)
        import select
        try:
            while not self.stop.is_set():
                ready, _, _ = select.select([self.listener, r], [], [])
                if self.listener in ready:
                    conn, _ = self.listener.accept()
                    threading.Thread(target=self._handle, args=(conn,), daemon=True).start()
                if r in ready:
                    with suppress(BlockingIOError):
                        os.read(r, 64)
        finally:
            signal.set_wakeup_fd(old_wake)
            for sig, h in handlers.items():
                signal.signal(sig, h)
            os.close(r)
            os.close(w)
            self.shutdown()
        return 0

    def shutdown(self) -> None:
        try:
            self.listener.close()
            if os.path.lexists(self.path):
                os.unlink(self.path)
        finally:
            self.sup.close()

    def _handle(self, conn: socket.socket) -> None:
        f = conn.makefile("wb")
        fds: list[int] = []
        try:
            refused = peer_refusal(conn, self.sup.ctl.journal, "serve")
            if refused is not None:
                f.close()
                refuse(conn, json.dumps({"ok": False, "error": refused, "error_type": "Denied",
                                         "exit_code": 126}).encode() + b"\n")
                conn = None
                return
            lines = _Lines(conn)
            while True:
                line, fds = lines.readline(MAX_REQUEST)
                if not line:
                    return
                def note(text: str) -> None:
                    f.write(json.dumps({"note": text}).encode() + b"\n")
                    f.flush()
                if line.startswith(b'{"op": "run_attached"'):  # handoff.request's first key
                    f.write(json.dumps(self._run_attached(conn, line, fds, note)).encode() + b"\n")
                    f.flush()
                    return  # the caller's call, and its connection, end with its cell
                _close_all(fds)
                f.write(json.dumps(self._dispatch(line, note)).encode() + b"\n")
                f.flush()
        except (OSError, ValueError):
            return
        finally:
            _close_all(fds)
            with suppress(OSError):  # an answer its caller did not live to read
                f.close()
            if conn is not None:
                conn.close()

    def _run_attached(self, conn: socket.socket, line: bytes, fds: list[int], note) -> dict:
        """A handed-over `agnsup run` (doors/handoff.py): its cell, with its fds 0-2 as the caller's stdio, watched
        through its connection. Closes `fds` (and empties the list) once the cell ended."""
        from ..tool import network_lines
        try:
            req = json.loads(line)
            req.pop("op", None)
            why = self._declines(req, fds)
            if why is not None:
                return {"ok": False, handoff.DECLINED: why}
            pid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
            caller = Caller(conn, tuple(fds), pid, self.sup)

            def started(cell_id: str) -> None:
                note_line = json.dumps({"started": cell_id}).encode() + b"\n"
                with suppress(OSError):  # a caller already gone: its connection's end is the wait loop's news
                    conn.sendall(note_line)
            req.pop("entry", None)
            live = sorted(k for k in ("stdin", "pty", "stream", "capture") if k in req)
            if live:  # `agnsup run` asks none of these: its stdio is the caller's descriptors
                raise UsageError(f"run_attached: {', '.join(live)}: not a `run`'s option")
            result, said = self.sup.run_attached(req.pop("argv", None), caller, notify=note, started=started,
                                                 entry="cli", capture=False, **req)
            return {"ok": True, **result, "said": said + network_lines(result)}
        except AgnsupError as e:
            return {"ok": False, **as_value(e)}
        except (ValueError, TypeError, KeyError) as e:
            return {"ok": False, **as_value(UsageError(f"bad request: {e}"))}
        except OSError as e:  # as entry.main says it of an in-process run
            return {"ok": False, "error": f"{e.strerror or e}{': ' + str(e.filename) if e.filename else ''}",
                    "error_type": "OSError", "exit_code": 125}
        finally:
            _close_all(fds)

    def _declines(self, req: dict, fds: list[int]) -> str | None:
        """Why this serve does not take a handed-over run (its client then runs it in-process), or None."""
        code, traits = self.handoff
        if req.pop("code", None) != code:
            return f"this serve runs another agnsup install ({code})"
        if req.pop("umask", None) != traits["umask"] or req.pop("limits", None) != traits["limits"]:
            return "the caller's umask or resource limits are not this serve's"
        if req.pop("agnsup_env", None) != traits["agnsup_env"]:
            return "the caller's AGNSUP_* environment is not this serve's"
        if len(fds) != 3:
            return f"{len(fds)} descriptors came with the request, not the caller's 0, 1 and 2"
        if any(os.isatty(fd) for fd in fds):
            return "a terminal: at a terminal `agnsup run` runs its cell in-process (its pty)"
        return None

    def _dispatch(self, line: bytes, note) -> dict:
        """One request -> its response; `note(text)` sends a {"note"} line first (spawn, run: lock waits)."""
        try:
            req = json.loads(line)
            if not isinstance(req, dict):
                raise ValueError("a request is a JSON object")
            op = req.pop("op", None)
            fn = getattr(self, "op_" + str(op), None)
            if fn is None:
                raise UsageError(f"unknown op {op!r}")
            return {"ok": True, **fn(req, note)}
        except AgnsupError as e:
            return {"ok": False, **as_value(e)}
        except (ValueError, TypeError, KeyError) as e:
            return {"ok": False, **as_value(UsageError(f"bad request: {e}"))}
        except OSError as e:
            return {"ok": False, **as_value(AgnsupError(f"serve: {e}"))}

    # ops
    def op_ping(self, req: dict, note) -> dict:
        return {"controller": self.sup.controller_id, "pid": os.getpid()}

    def op_spawn(self, req: dict, note) -> dict:
        """The request's keys are request.CellRequest's (argv and its options), checked there."""
        req.pop("entry", None)  # which front door asked is the server's to say
        return self.sup.spawn(req.pop("argv", None), entry="serve", notify=note, **req)

    def op_run(self, req: dict, note) -> dict:
        req.pop("entry", None)  # as op_spawn; waited for on this request's thread (Supervisor.run)
        return self.sup.run(req.pop("argv", None), entry="serve", notify=note, **req)

    def op_wait(self, req: dict, note) -> dict:
        res = self.sup.wait(req["run_id"], req["cell_id"], req.get("timeout"))
        return res if res is not None else {"pending": True}

    def op_cancel(self, req: dict, note) -> dict:
        return self.sup.cancel(req.get("cell_id"), req.get("run_id"), req.get("agent_id"),
                               bool(req.get("all")), req.get("grace"))

    def op_cleanup(self, req: dict, note) -> dict:
        return self.sup.cleanup(req["run_id"])

    def op_ps(self, req: dict, note) -> dict:
        return {"cells": self.sup.list(req.get("run_id"), bool(req.get("all")))}

    def op_output(self, req: dict, note) -> dict:
        out = self.sup.read_output(req["run_id"], req["cell_id"], req.get("since", 0), req.get("timeout"),
                                   req.get("max_bytes"))
        out["chunks"] = [{"seq": c["seq"], "stream": c["stream"], "data_b64": base64.b64encode(c["data"]).decode()}
                         for c in out["chunks"]]
        return out

    def op_stdin(self, req: dict, note) -> dict:
        data = base64.b64decode(req.get("data_b64") or "", validate=True)  # binascii.Error is a ValueError
        self.sup.write_stdin(req["run_id"], req["cell_id"], data, bool(req.get("eof")))
        return {}

    def op_signal(self, req: dict, note) -> dict:
        self.sup.signal(req["run_id"], req["cell_id"], req["sig"])
        return {}

    def op_resize(self, req: dict, note) -> dict:
        self.sup.resize(req["run_id"], req["cell_id"], req["cols"], req["rows"])
        return {}

    def op_publish_port(self, req: dict, note) -> dict:
        return self.sup.publish_port(req["run_id"], req["agent_id"], req["port"], req.get("host_port"),
                                     req.get("host"))

    def op_list_ports(self, req: dict, note) -> dict:
        return {"ports": self.sup.list_ports(req.get("run_id"), req.get("agent_id"))}

    def op_close_port(self, req: dict, note) -> dict:
        return self.sup.close_port(req["run_id"], req["agent_id"], req["port"])

    def op_run_attached(self, req: dict, note) -> dict:
        raise UsageError("run_attached: the request's first key is its op, and the caller's fds 0-2 come with it "
                         "(doors/handoff.py)")

    def op_shutdown(self, req: dict, note) -> dict:
        self.stop.set()
        os.kill(os.getpid(), signal.SIGTERM)  # wakes the accept loop
        return {}


class _Lines:
    """A connection's requests, one line at a time, with the descriptors that came with them (SCM_RIGHTS):
    a buffered file would drop those."""
    MAX_FDS = 8

    def __init__(self, conn: socket.socket):
        self.conn, self.buf, self.fds = conn, bytearray(), []

    def readline(self, limit: int) -> tuple[bytes, list[int]]:
        """(the next line, at most `limit` bytes; b"" at the end, the fds that came with it)."""
        while b"\n" not in self.buf and len(self.buf) < limit:
            # recvmsg itself: socket.recv_fds drops its flags (3.11), and these must be close-on-exec
            data, anc, _, _ = self.conn.recvmsg(65536, socket.CMSG_SPACE(self.MAX_FDS * 4), socket.MSG_CMSG_CLOEXEC)
            for level, kind, blob in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    self.fds += [int.from_bytes(blob[i:i + 4], sys.byteorder, signed=True)
                                 for i in range(0, len(blob) - len(blob) % 4, 4)]
            if not data:
                break
            self.buf += data
        i = self.buf.find(b"\n")
        end = min(i + 1 if i >= 0 else len(self.buf), limit)
        line = bytes(self.buf[:end])
        del self.buf[:end]
        fds, self.fds = self.fds, []
        return line, fds


def _close_all(fds: list[int]) -> None:
    while fds:
        with suppress(OSError):
            os.close(fds.pop())


class Caller:
    """The `agnsup run` process a run_attached cell belongs to (Supervisor.run_attached): its fds 0-2, and its
    connection, read while the cell waits for its lock (`poll`) and while it runs (`on_wake`): {"signal": N}
    lines, and the connection's end."""

    def __init__(self, conn: socket.socket, stdio: tuple, pid: int, sup):
        self.conn, self.stdio, self.pid, self.sup = conn, stdio, pid, sup
        self.fd = conn.fileno()
        self.cell_id: str | None = None  # set before the cell starts (Supervisor._start)
        self.buf = b""

    def _read(self) -> tuple[bool, list[int]]:
        """(the connection ended, the signals it sent since the last read)."""
        try:
            data = self.conn.recv(4096, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return False, []
        except OSError:  # ECONNRESET: the caller died with our answer unread
            data = b""
        self.buf += data
        sigs = []
        while b"\n" in self.buf:
            line, _, self.buf = self.buf.partition(b"\n")
            with suppress(ValueError, TypeError, KeyError, AttributeError):
                n = int(json.loads(line)["signal"])
                if n in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                    sigs.append(n)
        return not data, sigs

    def poll(self) -> None:
        """While the cell waits for its worktree lock: a signal, or the caller's end, and it never starts (as
        tool._supervise's `interrupted`)."""
        from ..errors import CancelledBeforeStart
        gone, sigs = self._read()
        if sigs:
            raise CancelledBeforeStart(
                f"cell {self.cell_id} cancelled by signal {signal.Signals(sigs[0]).name} to the controller (pid "
                f"{self.pid}) while it waited for the worktree lock; it never started")
        if gone:
            raise CancelledBeforeStart(f"cell {self.cell_id}: its caller, `agnsup run` (pid {self.pid}), went away "
                                       "while it waited for the worktree lock; it never started")

    def on_wake(self, waiter, cell) -> bool | None:
        """The connection is readable while the cell runs: its signals delivered as tool._supervise delivers an
        in-process run's; its end (the caller was killed: the dead-man switch) kills the cell as its controller's
        death would, unless on_controller_death = keep. False: watch it no more."""
        gone, sigs = self._read()
        for n in sigs:
            waiter.request_stop("cancelled", f"signal {signal.Signals(n).name} to the controller (pid {self.pid})",
                                sig=n)
        if not gone:
            return None
        spec = cell.spec
        if spec.on_controller_death == "keep":
            with suppress(AgnsupError):
                self.sup.ctl.journal.add_event("caller_gone", spec.run_id, spec.cell_id, pid=self.pid,
                                               on_controller_death="keep", by=f"serve {self.sup.ctl.id}")
            return False
        waiter.stop_now("controller_died", f"its controller, `agnsup run` (pid {self.pid}) handed to serve "
                        f"{self.sup.ctl.id}, went away (on_controller_death = kill)")
        return False


def serve(state_dir: str | None, socket_path: str | None) -> int:
    server = Server(state_dir, socket_path)
    try:
        return server.serve_forever()
    except BaseException:
        if not server.stop.is_set():
            server.shutdown()
        raise


def spawn_request(argv: list[str], options: dict) -> dict:
    """The spawn request for `agnsup spawn`: the client's cwd, and its environment
    (the serve process is not the caller; the spec builder picks what the role
    passes, and `--env KEY` takes the caller's value)."""
    req = {**options, "argv": argv, "env": list(options.get("env") or []), "host_env": dict(os.environ),
           "workdir": os.path.realpath(options.get("workdir") or os.getcwd())}
    if options.get("receipt_file"):
        req["receipt_file"] = os.path.abspath(options["receipt_file"])
    return req


def main_spawn(state_dir: str | None, socket_path: str | None, argv: list[str], options: dict) -> dict:
    from ..store.state import StateRoot
    path = socket_path or default_socket(StateRoot(state_dir).path)
    with Client(path) as c:
        return c.call("spawn", **spawn_request(argv, options))


def main_follow(state_dir: str | None, socket_path: str | None, argv: list[str], options: dict) -> int:
    """`agnsup spawn --follow`: spawn a streamed cell, print its output as it comes (stdout and
    tty to stdout, stderr to stderr), return its exit code. The handle goes to stderr as one
    JSON line. ^C (SIGINT here) is sent on to the cell's process group; the cell decides.

    At a terminal (as `agnsup run` there): the cell gets a pty of the terminal's size and
    stdin; our terminal goes raw and its keys go to the cell (^C too, as a byte its pty
    turns into SIGINT), a resize here resizes the cell's pty; our modes come back at the end."""
    from ..io.pump import at_a_terminal
    from ..store.state import StateRoot
    path = socket_path or default_socket(StateRoot(state_dir).path)
    interactive = at_a_terminal() and os.isatty(1)
    if interactive:
        options = {**options, "stdin": True, "pty": _size_of_terminal()}
    with Client(path) as c:
        h = c.call("spawn", **spawn_request(argv, {**options, "stream": True}))
        print(json.dumps(h), file=sys.stderr, flush=True)
        ids = {"run_id": h["run_id"], "cell_id": h["cell_id"]}

        def side_call(op: str, **args) -> None:
            # from a signal handler or the keyboard thread: a connection of its own (the
            # main loop's may hold half an answer); the read it interrupted resumes (PEP 475)
            with suppress(AgnsupError):  # the cell ended meanwhile
                with Client(path) as side:
                    side.call(op, **ids, **args)
        handlers = {signal.SIGINT: lambda *_: side_call("signal", sig="INT")}
        if interactive:
            handlers[signal.SIGWINCH] = lambda *_: side_call("resize", **_size_of_terminal())
        old = {n: signal.signal(n, fn) for n, fn in handlers.items()}
        term = _keyboard_to(path, ids) if interactive else None
        try:
            res = _follow(c, ids)
        finally:
            if term is not None:
                term.restore()  # our modes back (a terminal hung up meanwhile: nothing to restore)
            for n, fn in old.items():
                signal.signal(n, fn)
        c.close()
        _say_why_stopped(res.get("receipt"))
        return res["exit_code"]


def _size_of_terminal() -> dict:
    """Our terminal's size; a pty nobody sized (0x0: pty.fork, many CI runners) as 80x24."""
    size = os.get_terminal_size(0)
    return {"cols": size.columns or 80, "rows": size.lines or 24}


def _follow(c: "Client", ids: dict) -> dict:
    """Print the cell's output until it ended; its result."""
    sinks = {"stdout": sys.stdout.buffer, "tty": sys.stdout.buffer, "stderr": sys.stderr.buffer}
    since = 0
    while True:
        out = c.call("output", **ids, since=since, timeout=1.0)
        for chunk in out["chunks"]:
            sink = sinks[chunk["stream"]]
            sink.write(base64.b64decode(chunk["data_b64"]))
            sink.flush()
        since = out["next"]
        if out["ended"]:
            return c.call("wait", **ids)


def _keyboard_to(path: str, ids: dict):
    """Our terminal raw, and a thread sending what is typed to the cell's stdin; the UserTerminal."""
    from ..io.pump import UserTerminal
    term = UserTerminal(0, None)  # raw; what it held before, each end of input sent as one (pump.end_of_input)

    def keys() -> None:
        with suppress(AgnsupError, OSError):  # the cell ended (its stdin is closed), or our terminal went away
            with Client(path) as side:
                for data, ended in term.ahead:
                    side.call("stdin", **ids, data_b64=base64.b64encode(data).decode(), eof=ended)
                while True:
                    data = os.read(0, 4096)
                    side.call("stdin", **ids, data_b64=base64.b64encode(data).decode(), eof=not data)
                    if not data:
                        return
    threading.Thread(target=keys, name="agnsup-keys", daemon=True).start()
    return term


def _say_why_stopped(receipt_path: str | None) -> None:
    """As `agnsup run` does: one stderr line when a limit stopped the cell (its receipt says which), and the
    network's lines (the hint, the proxy's refusals)."""
    from ..tool import network_lines, network_said, stopped_line
    try:
        with open(receipt_path) as f:
            receipt = json.load(f)
    except (OSError, TypeError, ValueError):
        return
    for line in (stopped_line(receipt), *network_lines({"cell_id": receipt.get("cell_id"), **network_said(receipt)})):
        if line:
            print(line, file=sys.stderr, flush=True)
