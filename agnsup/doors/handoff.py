"""`agnsup run` handing its call to a live `agnsup serve` (issue 29): the client side.

A process per call pays the interpreter, ~140 imports and a cold controller
(~6x `python -c pass`). When a serve of this user listens on the state root's
default socket (<state>/agnsup.sock), `agnsup run` sends it the call instead:
argv, the parsed options, its environment, its working directory and its own
fds 0, 1 and 2 (SCM_RIGHTS). The serve runs the cell with those descriptors as
the caller's stdio (io/wiring.py decides as for an in-process run), watches the
connection while the cell runs (EOF: the caller was killed, so the cell is
killed, as a dead controller's is, unless --on-controller-death keep), and
answers with one result line. For the caller nothing differs: the same output
on the same descriptors, the same stderr lines, the same exit status.

The hand-off is tried only when none of fds 0-2 is a terminal (at a terminal
run keeps its in-process pty path), AGNSUP_HANDOFF is not "0", the socket's
listener runs as our euid (SO_PEERCRED), and the serve runs this very install
with our umask, resource limits and AGNSUP_* environment (else it declines and run goes
in-process).
No socket (ENOENT), a stale one (ECONNREFUSED), a serve that declines or does
not know the op: the in-process path, as before; nothing ran.

The serve's side is serve.py's `run_attached` op. This module imports nothing
of agnsup's controller and no `socket`, `json` or `contextlib` (the C parts of
each only): its cost is the point of it (tests/test_startup_cost.py).
"""
from __future__ import annotations

import os
import sys

OP = "run_attached"
OPT_OUT = "AGNSUP_HANDOFF"  # "0": never hand off (docs/cli.md)
DECLINED = "declined"       # the key of a serve's answer that sends the call back in-process
SIGNALS = (2, 15, 1)        # SIGINT, SIGTERM, SIGHUP: what an in-process run forwards (tool._supervise)
CONTROLLER_FAILED = 125     # cli.md: agnsup itself failed
CONNECT_TIMEOUT = 1.0       # seconds


def wanted() -> bool:
    """Hand off at all: fds 0-2 none a terminal, and not opted out."""
    if os.environ.get(OPT_OUT) == "0":
        return False
    for fd in (0, 1, 2):
        try:
            if os.isatty(fd):
                return False
        except OSError:
            return False
    return True


def code_key() -> str:
    """This install's identity: a serve hands cells only to clients of the same code (an upgrade in place, another
    venv: another key; the serve's is read when it starts)."""
    path = os.path.realpath(__file__)
    st = os.stat(path)
    from .. import __version__
    return f"{__version__}:{path}:{st.st_ino}:{st.st_mtime_ns}"


# what names the caller's socket or this hand-off, not how a controller behaves
NOT_CONTROLLER_ENV = ("AGNSUP_STATE_DIR", OPT_OUT)


def process_traits() -> dict:
    """What a cell or its controller takes from the controller's process beyond the request: the umask, the
    resource limits, and the environment agnsup itself reads (AGNSUP_POLICY_DIR, AGNSUP_CGROUP_BASE, ...;
    XDG_RUNTIME_DIR: systemd's bus). A serve whose own differ declines (the cell would differ from an
    in-process run's)."""
    import resource  # a C module: no /proc read (only linux/proc.py reads /proc), nothing imported with it
    mask = os.umask(0o022)
    os.umask(mask)
    limits = {n: list(resource.getrlimit(getattr(resource, n)))
              for n in sorted(dir(resource)) if n.startswith("RLIMIT_")}
    env = {k: v for k, v in os.environ.items()
           if (k.startswith("AGNSUP_") and k not in NOT_CONTROLLER_ENV) or k == "XDG_RUNTIME_DIR"}
    return {"umask": mask, "limits": limits, "agnsup_env": env}


SOCKET_NAME = "agnsup.sock"  # a serve's default socket in its state root (serve.default_socket)


def socket_path(state_dir: str | None) -> str:
    from ..store.root import default_root
    return os.path.join(os.path.abspath(state_dir or default_root()), SOCKET_NAME)


def unix_address(path: str) -> tuple[str, int | None]:
    """A connectable name for the Unix socket `path`, and the descriptor it holds open (close it after the connect)
    or None: sun_path holds 107 bytes, pytest's tmp paths can be longer, so long paths go through an O_PATH fd of
    their directory. Here, not in serve.py, so that a handed-over run imports no `socket`."""
    if len(path.encode()) < 100:
        return path, None
    fd = os.open(os.path.dirname(path) or ".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    return f"/proc/self/fd/{fd}/{os.path.basename(path)}", fd


def _connect(path: str):
    """A connected socket to `path` whose listener is our euid, or None (no serve, a stale socket, another
    user's)."""
    import _socket
    s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM | _socket.SOCK_CLOEXEC)
    fd = None
    try:
        addr, fd = unix_address(path)
        s.settimeout(CONNECT_TIMEOUT)  # a wedged serve whose backlog is full: in-process, not a hang
        s.connect(addr)
        s.settimeout(None)
        cred = s.getsockopt(_socket.SOL_SOCKET, _socket.SO_PEERCRED, 12)  # struct ucred {pid, uid, gid}
        if int.from_bytes(cred[4:8], sys.byteorder) != os.geteuid():
            s.close()
            return None
        return s
    except OSError:
        s.close()
        return None
    finally:
        if fd is not None:
            os.close(fd)


class _Ctx:  # what _json's C scanner reads of json.JSONDecoder
    strict = True
    object_hook = object_pairs_hook = None
    parse_float, parse_int = float, int

    @staticmethod
    def parse_constant(name: str):
        return {"NaN": float("nan"), "Infinity": float("inf"), "-Infinity": float("-inf")}[name]


def _codec():
    """(dumps, loads) from the C halves of json (the package costs ~2 ms of imports, `re` among them)."""
    try:
        import _json
        enc = _json.make_encoder(None, None, _json.encode_basestring_ascii, None, ": ", ", ", False, False, True)
        scan = _json.make_scanner(_Ctx)
    except (ImportError, AttributeError, TypeError):
        import json
        return json.dumps, json.loads
    return (lambda obj: "".join(enc(obj, 0))), (lambda text: scan(text, 0)[0])


def request(command: list[str], opts: dict) -> dict:
    """The run_attached request: serve.spawn_request's fields (cwd, environment, an absolute receipt file)."""
    req = {"op": OP, **opts, "argv": command, "env": list(opts.get("env") or []),
           "secrets": list(opts.get("secrets") or []), "host_env": dict(os.environ),
           "workdir": os.path.realpath(opts.get("workdir") or os.getcwd()), "code": code_key(), **process_traits()}
    if opts.get("receipt_file"):
        req["receipt_file"] = os.path.abspath(opts["receipt_file"])
    return req


def run(state_dir: str | None, opts: dict, command: list[str]) -> None:
    """Hand the call to a live serve and exit with its cell's status; return (nothing ran) when there is none,
    it is another user's, or it declines: the caller then runs the cell in-process."""
    path = socket_path(state_dir)
    s = _connect(path)
    if s is None:
        return
    import _signal as signal  # not `signal`: its enums cost ~1 ms of imports
    dumps, loads = _codec()
    try:
        data = dumps(request(command, opts)).encode() + b"\n"
    except (OSError, ValueError, TypeError):
        s.close()
        return  # e.g. a cwd that is gone: the in-process path says so
    rights = b"".join(fd.to_bytes(4, sys.byteorder) for fd in (0, 1, 2))
    import _socket
    old, sent, caught, cell = {}, False, [], None

    def forward(n, _frame):  # as tool._supervise: the cell gets the signal the controller got
        caught.append(n)
        if sent:  # after the request (never inside it): a line of its own
            _signals(s, caught)
    try:
        for n in SIGNALS:
            old[n] = signal.signal(n, forward)
        n = s.sendmsg([data], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, rights)])
        if n < len(data):
            s.sendall(data[n:])
        sent = True
        _signals(s, caught)
        buf = b""
        while True:
            while b"\n" not in buf:
                chunk = s.recv(65536)
                if not chunk:
                    _gone(path, cell)
                buf += chunk
            line, _, buf = buf.partition(b"\n")
            resp = loads(line.decode())
            if "note" in resp:
                sys.stderr.write(resp["note"] + "\n")
                sys.stderr.flush()
            elif "started" in resp:
                cell = resp["started"]
            else:
                break
    except (OSError, ValueError):  # the connection broke, or an answer that is not one
        if not sent:  # nothing reached it: in-process
            _back(s, old, caught)
            return
        _gone(path, cell)
    if resp.get(DECLINED) or (not resp.get("ok") and str(resp.get("error", "")).startswith(f"unknown op {OP!r}")):
        _back(s, old, caught)
        return  # it declined (another install, other limits) or predates the op: nothing ran
    if not resp.get("ok"):
        _leave([f"agnsup: {resp.get('error') or 'request failed'}"], resp.get("exit_code") or CONTROLLER_FAILED)
    _leave(resp.get("said") or [], resp["exit_code"])


def _back(s, old: dict, caught: list) -> None:
    """Nothing ran: our handlers undone, and a signal that came meanwhile raised again for the in-process path."""
    import _signal as signal  # not `signal`: its enums cost ~1 ms of imports
    s.close()
    for n, h in old.items():
        signal.signal(n, h)
    for n in caught:
        signal.raise_signal(n)


def _signals(s, caught: list) -> None:
    while caught:
        try:
            s.send(b'{"signal": %d}\n' % caught.pop(0))
        except OSError:
            return


def _gone(path: str, cell: str | None) -> None:
    what = f"cell {cell}" if cell else "the cell"
    _leave([f"agnsup: the serve controller at {path} went away before {what} ended: its cells end with it "
            f"(on_controller_death = keep: they run on until the janitor concludes them; `agnsup receipts"
            f"{' --cell ' + cell if cell else ''}` tells)"], CONTROLLER_FAILED)


def _leave(lines: list[str], code: int) -> None:
    for line in lines:
        sys.stderr.write(line + "\n")
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    os._exit(code)
