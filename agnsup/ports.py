"""Published ports: one of a pod's ports on the host's loopback, by a person's (or the runtime's) request.

A pod (agnsup/pod.py) is an agent's private network: nothing on the host reaches a server one of its cells
started. `publish` opens one way in: a **forwarder** listening on 127.0.0.1:HOST_PORT on the host that relays
each connection to 127.0.0.1:POD_PORT inside the pod. It binds the host socket first (so a taken port is a
refusal before anything starts), then enters the pod (Pod.enter: its user namespace, when it has one, then
its network namespace) and relays single-threaded with selectors (`forward_main`). It is started detached
(process/forwarder.py) in the pod's place, so the pod's teardown (the backend's kill of that place) ends it.

    <state>/pods/<run>/<agent>/ports.json   the published ports of the pod, one record each (its directory
                                            flocked: one publish or close of the pod at a time)

The forwarder also holds a pidfd of the pod's keeper and ends when the keeper does: the pod's end closes its
ports on a host without cgroups too (pod._kill then kills the keeper alone).

A port is a cell's: it closes when the pod's last member *cell* ends, also while a controller of many cells
keeps the pod itself a moment longer (pod.Linger: only the namespace and its keeper linger). pod.close_ports
stops every forwarder then (pod.py is below this module: it reads these records itself, under the same lock); a
publish to a pod no member cell holds any more is refused as to no pod.

Only loopback: the host address is 127.0.0.1 and nothing else (a request for 0.0.0.0 or any other address is
refused, and the forwarder checks its socket again before it serves). Each publish and close is a journal
event (`port.publish`, `port.close`). Every front door comes here: `agnsup ports`, Supervisor.publish_port /
list_ports / close_port, serve's publish_port / list_ports / close_port, MCP's publish_port / list_ports.
"""
from __future__ import annotations

import errno
import json
import os
import time

from .errors import AgnsupError, SetupError, UnknownId, UsageError
from .linux import pidfd

LOOPBACK = "127.0.0.1"
PORTS_FILE = "ports.json"
BUFFER = 64 * 1024        # bytes held per direction of a connection before its reader is paused
MAX_CONNECTIONS = 512     # open connections of one forwarder; more are accepted and closed at once
CLOSE_GRACE = 2.0         # seconds a closed forwarder has to end after SIGTERM before SIGKILL


# -- checks (every front door's input) ---------------------------------------------------------------------
def check_port(what: str, value, zero_ok: bool = False) -> int:
    """A TCP port number (1..65535; 0 too where the kernel may pick), else a UsageError naming `what`."""
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    low = 0 if zero_ok else 1
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= 65535:
        raise UsageError(f"{what}: must be a port number from {low} to 65535, not {value!r}")
    return value


def check_host(host) -> str:
    """The host address a forwarder may listen on: the loopback's, and only it. A published port is a way
    into an agent's private network; it is offered to the host's own processes, never to the network."""
    if host in (None, "", LOOPBACK, "localhost"):
        return LOOPBACK
    raise UsageError(f"host: a published port listens on the host's loopback ({LOOPBACK}) only, not {host!r}: "
                     "a pod is never reachable from the network")


def _check_ids(run_id, agent_id) -> None:
    from .store.state import check_id
    if not run_id or not agent_id:
        raise UsageError("a published port belongs to an agent's pod: give --run R and --agent A")
    check_id("run", run_id)
    check_id("agent", agent_id)


# -- where the records live ---------------------------------------------------------------------------------
def pod_dir(state, run_id: str, agent_id: str) -> str:
    """The pod's directory under the state root (pod.py's: <state>/pods/<run>/<agent>/)."""
    from .pod import pod_dir as of
    return of(state, run_id, agent_id)


def _read(d: str) -> list[dict]:
    try:
        with open(os.path.join(d, PORTS_FILE)) as f:
            got = json.load(f)
    except (OSError, ValueError):
        return []
    return [r for r in got if isinstance(r, dict)] if isinstance(got, list) else []


def _write(d: str, records: list[dict]) -> None:
    path = os.path.join(d, PORTS_FILE)
    if not records:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        return
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(records, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, path)


class _Locked:
    """The pod's directory, flocked exclusive: one publish or close at a time (the records and the check that a
    port is not published yet). The directory itself, not a file in it: a pod's teardown removes the files it
    knows and then the directory (pod.STATE_FILES), and pod.py's own lock is pod.lock, never the directory."""

    def __init__(self, d: str, gone: str):
        self.path, self.gone = d, gone

    def __enter__(self):
        import fcntl
        try:
            self.fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:  # the pod's teardown removed it meanwhile
            raise UnknownId(self.gone) from None
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        os.close(self.fd)  # the lock goes with the fd


def _public(r: dict) -> dict:
    """What a caller sees of a record (the identity fields stay in the file)."""
    keys = ("run_id", "agent_id", "pod_port", "host", "host_port", "address", "url", "pid", "published_at", "by")
    return {k: r.get(k) for k in keys}


# -- the verbs -----------------------------------------------------------------------------------------------
def find_pod(state, run_id: str, agent_id: str):
    """The agent's live pod, or UnknownId naming the agent and when it has one."""
    from . import pod as podmod
    p = podmod.find(state, run_id, agent_id)
    if p is None:
        raise UnknownId(f"no pod for agent {agent_id!r} of run {run_id!r}: an agent has a pod while one of its cells "
                        "lives (a spawned server, say) whose role gives it a private network (network.mode deny or "
                        "loopback)")
    return p


def publish(state, run_id: str, agent_id: str, port, host_port=0, host=None, journal=None, backend=None,
            by: str | None = None) -> dict:
    """Publish port `port` of the agent's pod on 127.0.0.1:`host_port` (0: the kernel picks one): its record
    ({run_id, agent_id, pod_port, host, host_port, address, url, pid, published_at, by}). Refusals (nothing
    started, nothing left): UsageError (a bad port or address, the pod port already published, the host port
    taken), UnknownId (no live pod for the agent), SetupError (the forwarder could not enter the pod)."""
    import socket
    port = check_port("port", port)
    host_port = check_port("host_port", 0 if host_port is None else host_port, zero_ok=True)
    host = check_host(host)
    _check_ids(run_id, agent_id)
    pod = find_pod(state, run_id, agent_id)
    d = pod.dir
    with _Locked(d, f"the pod of agent {agent_id!r} of run {run_id!r} ended meanwhile: nothing was published"):
        from .pod import cells_held
        if not cells_held(d):  # its last cell ended: the pod only lingers (pod.Linger), a port would outlive it
            raise UnknownId(f"no pod for agent {agent_id!r} of run {run_id!r}: its last cell ended")
        records = [r for r in _read(d) if pidfd.still(r)]
        for r in records:
            if r.get("pod_port") == port:
                raise UsageError(f"port {port} of agent {agent_id}'s pod (run {run_id}) is already published at "
                                 f"{r.get('address')} (agnsup ports close {port} --run {run_id} --agent {agent_id})")
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closed forwarder's TIME_WAIT only
            try:
                sock.bind((host, host_port))
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise UsageError(f"host port {host_port} on {host} is taken (something listens there): give "
                                     "another host port, or 0 for a free one") from None
                raise UsageError(f"host port {host_port} on {host}: {e.strerror}") from None
            sock.listen(128)
            bound = sock.getsockname()[1]
            rec = _start(state, pod, sock, port, backend)
        finally:
            sock.close()  # the forwarder has its own copy
        rec.update(run_id=run_id, agent_id=agent_id, pod_port=port, host=host, host_port=bound,
                   address=f"{host}:{bound}", url=f"http://{host}:{bound}/", published_at=time.time(),
                   by=by or f"pid {os.getpid()}")
        try:
            _write(d, records + [rec])
            _journal(state, journal, "publish", rec)
        except BaseException as e:
            _stop(rec, 0.0)
            if isinstance(e, FileNotFoundError):  # the pod's teardown removed its directory meanwhile
                raise UnknownId(f"the pod of agent {agent_id!r} of run {run_id!r} ended meanwhile (its last cell "
                                "ended): nothing was published") from None
            _write(d, records)
            raise
    return _public(rec)


def _start(state, pod, sock, port: int, backend) -> dict:
    """The forwarder, started in the pod's place: its identity for the record."""
    from .linux import proc
    from .process import forwarder
    if backend is None:
        from . import backend as backends
        backend = backends.choose(state.path)
    place = getattr(pod, "place", None)

    def attach(pid: int) -> None:
        if place is not None and getattr(place, "node", None) is not None:
            backend.attach(place, pid)
    watch = _keeper_fd(pod)
    try:
        args = ["--pod-port", str(port)] + (["--watch-fd", str(watch)] if watch is not None else [])
        pid, fd = forwarder.start(sock.fileno(), pod.enter, attach, args,
                                  keep_fds=(watch,) if watch is not None else ())
    except OSError as e:
        raise SetupError(f"the forwarder of port {port} could not start in the pod: {e.strerror or e}") from None
    finally:
        if watch is not None:
            os.close(watch)
    try:
        st = proc.stat(pid)
        return {"pid": pid, "starttime": st.starttime if st else None, "boot_id": proc.boot_id(),
                "pidfd_ino": pidfd.inode(fd) if pidfd.has_pidfs() else None}
    finally:
        os.close(fd)


def _keeper_fd(pod) -> int | None:
    """A pidfd of the pod's keeper, proven to be it (pod.json's identity): readable once the keeper ended."""
    k = getattr(pod, "keeper", None) or {}
    fd = pidfd.open(k["pid"]) if k.get("pid") else None
    if fd is None:
        return None
    ok, _ = pidfd.matches(fd, k["pid"], k.get("pidfd_ino"), k.get("starttime"))
    if not ok:
        os.close(fd)
        raise SetupError(f"the pod of agent {pod.agent_id} ended meanwhile")
    return fd


def _journal(state, journal, op: str, rec: dict, **extra) -> None:
    own = journal is None
    if own:
        journal = state.journal()
    try:
        journal.record_port(rec["run_id"], op, agent_id=rec["agent_id"], pod_port=rec["pod_port"],
                            host=rec["host"], host_port=rec["host_port"], pid=rec["pid"], by=rec.get("by"), **extra)
    finally:
        if own:
            journal.close()


def _stop(rec: dict, grace: float) -> bool:
    """SIGTERM the forwarder of `rec` (its identity checked through a pidfd), up to `grace` s, then SIGKILL;
    whether it is gone."""
    import select
    import signal
    fd = pidfd.open(int(rec.get("pid") or 0)) if rec.get("pid") else None
    if fd is None:
        return True
    try:
        ok, _ = pidfd.matches(fd, rec["pid"], rec.get("pidfd_ino"), rec.get("starttime"))
        if not ok:
            return True  # the number is another process's now: ours is gone
        if grace > 0 and pidfd.send(fd, signal.SIGTERM) and select.select([fd], [], [], grace)[0]:
            return True
        if not pidfd.send(fd, signal.SIGKILL):
            return True
        return bool(select.select([fd], [], [], 5.0)[0])
    finally:
        os.close(fd)


def listing(state, run_id: str | None = None, agent_id: str | None = None) -> list[dict]:
    """The published ports whose forwarder lives, of every pod (or one run's, one agent's)."""
    from .store.state import check_id
    for kind, value in (("run", run_id), ("agent", agent_id)):
        if value is not None:
            check_id(kind, value)
    top = os.path.join(state.path, "pods")
    out = []
    try:
        runs = sorted(os.listdir(top)) if run_id is None else [run_id]
    except OSError:
        return []
    for r in runs:
        try:
            agents = sorted(os.listdir(os.path.join(top, r))) if agent_id is None else [agent_id]
        except OSError:
            continue
        for a in agents:
            out += [_public(rec) for rec in _read(os.path.join(top, r, a)) if pidfd.still(rec)]
    return sorted(out, key=lambda x: (x["run_id"], x["agent_id"], x["pod_port"]))


def close(state, run_id: str, agent_id: str, port, journal=None, by: str | None = None) -> dict:
    """Stop the forwarder of the pod's port `port`: {"closed": [its record]}. UnknownId when that port is
    not published (any more: the pod's end closed it)."""
    port = check_port("port", port)
    _check_ids(run_id, agent_id)
    d = pod_dir(state, run_id, agent_id)
    with _Locked(d, f"port {port} of agent {agent_id!r} of run {run_id!r} is not published (no pod)"):
        records = _read(d)
        mine = [r for r in records if r.get("pod_port") == port]
        if not mine or not pidfd.still(mine[0]):
            _write(d, [r for r in records if r.get("pod_port") != port and pidfd.still(r)])
            raise UnknownId(f"port {port} of agent {agent_id!r} of run {run_id!r} is not published "
                            f"(agnsup ports --run {run_id} --agent {agent_id})")
        rec = mine[0]
        if not _stop(rec, CLOSE_GRACE):
            raise AgnsupError(f"the forwarder of port {port} (pid {rec['pid']}) did not end")
        _write(d, [r for r in records if r.get("pod_port") != port])
        _journal(state, journal, "close", {**rec, "by": by or f"pid {os.getpid()}"})
    return {"closed": [_public(rec)]}


# -- the forwarder: a fresh interpreter in the pod's network namespace ---------------------------------------
def forward_main(argv: list[str] | None = None) -> None:
    """`python -c 'from agnsup.ports import forward_main; forward_main()' --listen-fd N --status-fd M
    --pod-port P`, as process/forwarder.py starts it, inside the pod: checks its listening socket is on the
    host's loopback (it was bound there before the pod was entered), says ready, relays until killed."""
    import socket
    import sys
    from .linux import sys as lsys
    # Non-dumpable: it runs outside every cell's mount namespace, Landlock domain and seccomp filter, in the
    # pod's network (and a normal user's pod's user) namespace: nothing of the pod may ptrace it or open its
    # /proc/PID/mem (the cells' own seccomp filter and Landlock scope already refuse that; this holds without)
    lsys.prctl(lsys.PR_SET_DUMPABLE, 0)
    args = sys.argv[1:] if argv is None else argv
    opts = dict(zip(args[::2], args[1::2]))
    status = int(opts["--status-fd"])
    listener = socket.socket(fileno=int(opts["--listen-fd"]))
    name = listener.getsockname()
    if listener.family != socket.AF_INET or name[0] != LOOPBACK:  # the backend re-checks what the front decided
        os.write(status, f"{errno.EADDRNOTAVAIL}\0refused to serve on {name!r}: only {LOOPBACK}".encode())
        os._exit(2)
    os.write(status, b"ready")
    os.close(status)
    watch = int(opts["--watch-fd"]) if "--watch-fd" in opts else None
    Relay(listener, int(opts["--pod-port"]), watch).serve()


class _Conn:
    """One relayed connection: the host side `a`, the pod side `b`, a bounded buffer each way."""

    def __init__(self, a, b, targets):
        self.a, self.b, self.targets = a, b, targets
        self.connected = False
        self.ab, self.ba = bytearray(), bytearray()  # host -> pod, pod -> host
        self.a_eof = self.b_eof = False              # read end of file from a / b
        self.a_shut = self.b_shut = False            # shut down writing to a / b


class Relay:
    """The forwarder's loop: accept on the host socket, connect inside the pod, copy both ways, single-threaded."""

    def __init__(self, listener, port: int, watch: int | None = None):
        import selectors
        self.listener, self.port = listener, port
        self.sel = selectors.DefaultSelector()
        self.conns: set[_Conn] = set()
        listener.setblocking(False)
        self.sel.register(listener, selectors.EVENT_READ, None)
        if watch is not None:  # the pod's keeper: its pidfd turns readable when it exits
            self.sel.register(watch, selectors.EVENT_READ, "pod")

    def serve(self) -> None:
        while True:
            for key, events in self.sel.select():
                if key.data == "pod":
                    return  # the pod ended: so does the way into it (the process exits, every socket with it)
                if key.data is None:
                    self._accept()
                else:
                    self._step(key.data, key.fileobj, events)

    def _accept(self) -> None:
        import socket
        while True:
            try:
                a, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # EMFILE, ECONNABORTED...: this one is lost, the forwarder goes on
                print(f"agnsup forwarder: accept: {e}", file=__import__("sys").stderr, flush=True)
                return
            if len(self.conns) >= MAX_CONNECTIONS:
                a.close()
                continue
            a.setblocking(False)
            c = _Conn(a, None, [(socket.AF_INET, LOOPBACK), (socket.AF_INET6, "::1")])
            self.conns.add(c)
            self._connect(c)

    def _connect(self, c: _Conn) -> None:
        """The next address of the pod's loopback to try (127.0.0.1, then ::1 for a server on IPv6 only)."""
        import socket
        if c.b is not None:
            try:
                self.sel.unregister(c.b)
            except (KeyError, ValueError):
                pass
            c.b.close()
            c.b = None
        if not c.targets:
            return self._drop(c)
        family, addr = c.targets.pop(0)
        c.b = socket.socket(family, socket.SOCK_STREAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
        err = c.b.connect_ex((addr, self.port))
        if err not in (0, errno.EINPROGRESS):
            return self._connect(c)
        self._interest(c)

    def _interest(self, c: _Conn) -> None:
        import selectors
        R, W = selectors.EVENT_READ, selectors.EVENT_WRITE
        want_a = (R if c.connected and not c.a_eof and len(c.ab) < BUFFER else 0) | (W if c.ba else 0)
        want_b = W if not c.connected else ((R if not c.b_eof and len(c.ba) < BUFFER else 0) | (W if c.ab else 0))
        for s, want in ((c.a, want_a), (c.b, want_b)):
            if s is None:
                continue
            try:
                key = self.sel.get_key(s)
            except KeyError:
                key = None
            if want and key is None:
                self.sel.register(s, want, c)
            elif want and key.events != want:
                self.sel.modify(s, want, c)
            elif not want and key is not None:
                self.sel.unregister(s)

    def _step(self, c: _Conn, s, events) -> None:
        import selectors
        import socket
        try:
            if s is c.b and not c.connected:
                err = c.b.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if err:
                    return self._connect(c)  # refused there: the next address, or the host side closed
                c.connected = True
            elif events & selectors.EVENT_READ:
                buf, eof = (c.ab, "a_eof") if s is c.a else (c.ba, "b_eof")
                data = s.recv(BUFFER - len(buf))
                if data:
                    buf += data
                else:
                    setattr(c, eof, True)
            if events & selectors.EVENT_WRITE and c.connected:
                buf = c.ba if s is c.a else c.ab
                if buf:
                    del buf[:s.send(buf)]
            if c.a_eof and not c.ab and not c.b_shut:
                c.b.shutdown(socket.SHUT_WR)
                c.b_shut = True
            if c.b_eof and not c.ba and not c.a_shut:
                c.a.shutdown(socket.SHUT_WR)
                c.a_shut = True
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:  # reset, broken pipe: both ends go
            return self._drop(c)
        if c.a_shut and c.b_shut:
            return self._drop(c)
        self._interest(c)

    def _drop(self, c: _Conn) -> None:
        for s in (c.a, c.b):
            if s is None:
                continue
            try:
                self.sel.unregister(s)
            except (KeyError, ValueError):
                pass
            s.close()
        self.conns.discard(c)
