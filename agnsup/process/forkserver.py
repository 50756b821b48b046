"""The fork server: the one process a Supervisor's cells are born from (issue 29, fourth round).

A Supervisor (serve, MCP, sandboxd, the Python API) is a threaded controller of ~40-60 MB. Forking it for each
cell cost ~4.5 ms in page tables and copy-on-write faults (the leader's, the command's, and ~1,300 a cell in the
controller itself, which writes to pages the leader shares), and a threaded process may not use the raw clone3,
so every leader joined its cgroup2 directory by a cgroup.procs write (the kernel's global lock and its RCU grace
period; a primer, removed with this, partly hid it). Instead the Supervisor starts this small, single-threaded
process once (a fresh interpreter that imports only what the leader's steps need, ~12 MB) and hands it each
cell's spawn:

- the request: steps.Setup as data (the plan, the backend and place for the cgroup step, pickled) and its fds by
  SCM_RIGHTS (stdio, the barrier and report pipes, the namespaces, the /tmp tmpfs, the Landlock ruleset; the
  seccomp filter is rebuilt here from its groups), with one end of a socketpair of the cell's own (its reap);
- the server: clone.new (clone3 CLONE_INTO_CGROUP, born in its v2 directory: it is single-threaded), the
  leader runs steps.STEPS exactly as a leader forked in-process does; the answer: the leader's pid and pidfd;
- the reap: the leader is the server's child, so only the server can wait for it. It never reaps one unasked
  (the leader's pid, the cell's session id, stays reserved until the controller has stopped the rest of the
  tree); the controller asks on the cell's socketpair once the leader exited (its pidfd polls readable for any
  process) and gets its waitid status back. A socketpair the controller closed unasked (an abandoned cell in a
  dead thread): the server reaps the leader whenever it exits.

The dead-man switch: the server's PR_SET_PDEATHSIG (SIGKILL) follows the Supervisor's forker thread, set before
its exec and checked against getppid() after; each leader's follows the server's one thread, checked against the
server's pidfd right after (steps: "pdeathsig"); the server also exits at the socketpair's EOF (the Supervisor
closed). So a SIGKILLed controller kills the server, which kills every leader that dies with its controller; a
SIGKILLed server alone kills its cells too, and the controller reports them (their reap answers nothing: EOF).

A server that cannot start or died: the next spawn starts a new one from the forker thread; a spawn the server did
not answer fails with SetupError at step "fork_server" (journaled as any failed start). There is no in-process
fallback: one way a Supervisor forks (a threaded controller's in-process fork was the slow path this replaces).
"""
from __future__ import annotations

import errno
import os
import signal

from collections import namedtuple

from ..linux import sys as lsys
from .helpers import _umask
from .steps import PLAN_FIELDS, SPEC_FIELDS

READY_WAIT = 30.0  # seconds a starting server gets to import what it needs and say "ready"
STOP_WAIT = 2.0  # seconds the server gets to exit at our socket's EOF before we SIGKILL it
INLINE = 1 << 16  # bytes of a spawn request (the pickled Setup) sent in its message; a larger one (a big
# environment) goes in a memfd sent with it: a SOCK_SEQPACKET message is at most the socket's buffer (~208 KiB)
MAX_FDS = 64  # descriptors one spawn request may carry (stdio, pipes, namespaces, the ruleset, a memfd: ~15)
_FD_FIELDS = ("barrier_r", "err_w", "status_w", "netns_fd", "pod_userns", "netns_watch", "userns_fd")

# the plan as a request carries it: only the fields steps.STEPS reads (collections.namedtuple: small to pickle)
LeaderPlan = namedtuple("LeaderPlan", PLAN_FIELDS)
LeaderSpec = namedtuple("LeaderSpec", SPEC_FIELDS)


class ServerGone(OSError):
    """The fork server did not answer (it could not start, or died)."""


# -- the controller's side ---------------------------------------------------------------------------------------
class Client:
    """The Supervisor's handle on its fork server. `start` on the forker thread only (the server's
    PR_SET_PDEATHSIG follows the thread that forked it); `spawn` from any thread (one at a time)."""

    def __init__(self, preload: tuple[str, ...] = ()):
        import threading
        self.preload = preload  # modules the server imports at its start: those of what a request carries
        self.sock: int | None = None
        self.pid: int | None = None
        self.pidfd: int | None = None
        self.lock = threading.Lock()
        self.why: str | None = None  # why the last start failed

    def alive(self) -> bool:
        """Started (it said "ready": spawns may talk to it) and not exited."""
        if self.sock is None or self.pidfd is None:
            return False
        import select
        return not select.select([self.pidfd], [], [], 0)[0]

    def start(self) -> None:
        """Fork and exec the server (a fresh interpreter: `python -I -S`, agnsup's directory first on its path)
        and wait for its "ready". Raises ServerGone saying why it did not start."""
        import sys
        self.stop()
        ours, theirs = lsys.seqpacket_pair()
        parent = os.getpid()
        top = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        # -I ignores PYTHONDONTWRITEBYTECODE: the controller's choice is passed on as -B
        argv = [sys.executable, "-I", "-S", *(("-B",) if sys.dont_write_bytecode else ()), "-c", _BOOT, top,
                str(parent), *self.preload]
        pid = os.fork()
        if pid == 0:  # the controller's copy, for as long as execve takes
            out = theirs
            try:
                os.close(ours)
                lsys.prctl(lsys.PR_SET_PDEATHSIG, signal.SIGKILL)  # follows this (the forker) thread
                if os.getppid() != parent:
                    os._exit(1)  # it died already: nothing to serve
                # a process group of its own: a terminal's ^C, ^\ and hangup go to the controller's group, whose
                # own handling (serve: its shutdown) decides about the cells; the server follows the controller
                os.setpgid(0, 0)
                if theirs != 3:
                    out = os.dup2(theirs, 3)
                os.set_inheritable(3, True)
                os.closerange(4, os.sysconf("SC_OPEN_MAX"))  # the controller's stdio stays (a leader's default)
                os.execve(sys.executable, argv, os.environ)
            except BaseException as e:  # noqa: BLE001 - said to the controller, never raised here
                try:
                    os.write(out, f"refused {getattr(e, 'errno', 0) or 0} {e}".encode())
                finally:
                    os._exit(127)
        os.close(theirs)
        self.pid, self.pidfd = pid, os.pidfd_open(pid)
        import select
        # its "ready" (or why not), or its exit; a server stuck in its imports (a hung file system) is no server
        if select.select([ours], [], [], READY_WAIT)[0]:
            said, _ = lsys.recv_fds(ours)
        else:
            said = f"refused {errno.ETIMEDOUT} it did not say ready within {READY_WAIT:.0f} s".encode()
        if said == b"ready":
            self.sock = ours  # from now on spawns use it (alive): never before its "ready", which is ours to read
        else:
            os.close(ours)
            why = said.decode(errors="replace") if said else "it exited before it was ready"
            if why.startswith("refused "):  # "refused ERRNO WHY" (its exec, or its imports)
                why = why.split(" ", 2)[2]
            self.stop()
            self.why = f"the fork server could not start ({sys.executable}): {why}"
            raise ServerGone(errno.ECHILD, self.why)
        self.why = None

    def stop(self) -> None:
        """Close our end (the server exits at EOF) and reap it."""
        with self.lock:  # not under a spawn's exchange
            if self.sock is not None:
                os.close(self.sock)
                self.sock = None
        if self.pid is not None:
            import select
            if self.pidfd is not None and not select.select([self.pidfd], [], [], STOP_WAIT)[0]:
                # our end has a copy somewhere (a child forked without closing it): no EOF; ours to end
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
            try:
                os.waitpid(self.pid, 0)
            except ChildProcessError:
                pass
            self.pid = None
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None

    def spawn(self, s, path: str | None) -> tuple[int, int, bool, int]:
        """(pid, pidfd, born in `path`, the cell's reap channel) of a new leader running steps.STEPS with
        `s` (steps.Setup). Raises the clone's OSError as the in-process clone would, ServerGone if the
        server did not answer."""
        blob, fds = pack(s)
        ours, theirs = lsys.seqpacket_pair()
        fds.append(theirs)
        data = b""
        try:
            data = _outgoing((blob, path, len(fds) - 1), fds)
            pid, pidfd, born = self._ask(data, fds)
        except BaseException:
            os.close(ours)
            raise
        finally:
            os.close(theirs)
            if data == b"M":
                os.close(fds[-1])
        return pid, pidfd, born, ours


    def park(self, early: dict, path: str) -> tuple[int, int, bool, int, int]:
        """A spare leader (process/cellspare.py): cloned now into the cgroup2 directory `path`, it runs the steps
        that need no plan (steps.park) and waits for its Setup on a socketpair of its own. `early`: what those
        steps and the clone need ({"pid_namespace", "place", "backend", "filter": the seccomp groups, built here
        before the clone}). (pid, pidfd, born, the cell's reap channel, our end of the leader's socketpair: `bind`
        sends the Setup there; closed unsent, the leader exits without exec). Raises as spawn does."""
        lead, lead_theirs = lsys.seqpacket_pair()
        ours, theirs = lsys.seqpacket_pair()
        fds = [lead_theirs, theirs]
        data = b""
        try:
            data = _outgoing(("park", early, path), fds)
            pid, pidfd, born = self._ask(data, fds)
        except BaseException:
            os.close(ours)
            os.close(lead)
            raise
        finally:
            os.close(theirs)
            os.close(lead_theirs)
            if data == b"M":
                os.close(fds[-1])
        return pid, pidfd, born, ours, lead

    def _ask(self, data: bytes, fds: list[int]) -> tuple[int, int, bool]:
        """One request (spawn's, park's) and the server's answer: (the leader's pid, its pidfd, born in its cgroup2
        directory). ServerGone when the server did not answer; the clone's OSError when it failed."""
        with self.lock:
            if self.sock is None:
                raise ServerGone(errno.ECHILD, self.why or "the fork server is not running")
            try:
                lsys.send_fds(self.sock, data, fds)
                said, got = lsys.recv_fds(self.sock, 256, 1)
            except (BrokenPipeError, ConnectionResetError):
                said, got = b"", []
        if not said:
            raise ServerGone(errno.ECHILD, "the fork server died")
        word, *rest = said.decode().split(" ", 2)
        if word != "ok":
            for fd in got:
                os.close(fd)
            raise OSError(int(rest[0]), rest[1] if len(rest) > 1 else os.strerror(int(rest[0])))
        return int(rest[0]), got[0], rest[1] == "1"


def bind(lead: int, s) -> None:
    """The Setup `s` (steps.Setup) to a parked leader (Client.park), on its socketpair, which is closed: the leader
    runs the rest of steps.STEPS with it. Its seccomp filter was built before its clone, from the same groups (the
    spare's key: process/cellspare.py). Raises OSError when the leader is gone."""
    blob, fds = pack(s)
    blob["filter"] = None
    data = b""
    try:
        data = _outgoing(blob, fds)
        try:
            lsys.send_fds(lead, data, fds)
        except OSError as e:  # it exited since the broker took it (a cancel of its agent killed it)
            raise ServerGone(e.errno or errno.ECHILD, f"the cell's spare leader is gone: {e.strerror or e}") from None
    finally:
        if data == b"M":
            os.close(fds[-1])
        os.close(lead)


def _outgoing(obj, fds: list[int]) -> bytes:
    """`obj` pickled for one message: itself, or over INLINE bytes b"M" with a memfd holding it appended to `fds`
    (the sender closes it once sent); _incoming reads either."""
    import pickle
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    if len(data) <= INLINE:
        return data
    fds.append(os.memfd_create("agnsup-spawn", os.MFD_CLOEXEC))
    os.write(fds[-1], data)  # a memfd takes it whole
    return b"M"


def _incoming(data: bytes, fds: list[int]):
    """_outgoing's inverse, on the receiving side: the object (a memfd sent last is taken from `fds` and closed)."""
    import pickle
    if data == b"M":
        big = fds.pop()
        try:
            data = os.pread(big, os.fstat(big).st_size, 0)
        finally:
            os.close(big)
    return pickle.loads(data)


def ask_reap(channel: int) -> bool:
    """Ask the server to reap the leader (it answers once the leader exited); `reap` then reads the answer. False:
    the server is gone (reap says so too)."""
    try:
        os.write(channel, b"reap")
    except OSError:
        return False
    return True


def reap(channel: int, asked: bool = False) -> tuple[int, int] | None:
    """(si_code, si_status) of a leader the server forked, once it exited; None if the server is gone (it
    died: the leader had PR_SET_PDEATHSIG and got SIGKILL, or exited unreaped by us). Closes `channel`.
    `asked`: ask_reap did the asking already."""
    try:
        if not asked:
            os.write(channel, b"reap")
        said = os.read(channel, 64)
    except OSError:
        said = b""
    finally:
        os.close(channel)
    if not said:
        return None
    code, status = said.split()
    return int(code), int(status)


def pack(s) -> tuple[dict, list[int]]:
    """steps.Setup as plain data and the fds it names (each field's fd replaced by its index in the list)."""
    fds: list[int] = []

    def ref(fd):
        if fd is None:
            return None
        fds.append(fd)
        return len(fds) - 1
    d = {n: getattr(s, n) for n in ("backend", "place", "ids", "netns_shared", "controller", "in_userns")}
    d["plan"] = None if s.plan is None else LeaderPlan._make(
        LeaderSpec._make(getattr(s.plan.spec, f) for f in LeaderSpec._fields) if f == "spec" else getattr(s.plan, f)
        for f in LeaderPlan._fields)
    if s.place is not None and getattr(s.place, "oom_fd", None) is not None:
        from ..util.record import replace
        d["place"] = replace(s.place, oom_fd=None)  # the controller's eventfd: nothing the child uses
    for n in _FD_FIELDS:
        d[n] = ref(getattr(s, n))
    d["stdio"] = tuple(ref(fd) for fd in s.stdio) if s.stdio is not None else None
    d["premade"] = {k: ref(fd) for k, fd in s.premade.items()} if s.premade else s.premade
    d["ruleset"] = (s.ruleset.version, s.ruleset.log_tag, s.ruleset.handled, s.ruleset.scoped,
                    ref(s.ruleset.fd)) if s.ruleset else None
    d["filter"] = s.filter.groups if s.filter else None
    d["egress"] = (s.egress.port, ref(s.egress.child_fd())) if s.egress else None
    d["ctty"] = bool(s.ctty)
    d["umask"] = _umask()  # the controller's now, as a leader forked here would have it
    return d, fds


# -- the server's side ---------------------------------------------------------------------------------------------
_BOOT = """import os, sys
try:
    sys.path.insert(0, sys.argv[1])
    from agnsup.process.forkserver import serve
except BaseException as e:
    os.write(3, f"refused 0 cannot import agnsup from {sys.argv[1]}: {e!r}".encode())
    os._exit(1)
serve(3, int(sys.argv[2]), sys.argv[3:])"""


def serve(sock: int, controller: int, preload: list[str]) -> None:
    """The server's loop: spawn requests on `sock`, reaps on each cell's channel; returns at EOF."""
    if os.getppid() != controller:  # the forker thread ended before our PR_SET_PDEATHSIG could
        os._exit(1)
    try:
        import importlib
        import select
        # what each spawn uses (_spawn, unpack), loaded now: an import that fails is said at once, not per spawn
        import pickle  # noqa: F401
        from . import clone, steps  # noqa: F401
        from ..linux import landlock, pidinit, seccomp  # noqa: F401
        for name in preload:  # what a request unpickles (the Supervisor names the modules), before the first one
            importlib.import_module(name)
    except BaseException as e:  # noqa: BLE001 - said to the controller, which raises it at the spawn
        os.write(sock, f"refused 0 {e!r}".encode())
        os._exit(1)
    os.set_inheritable(sock, False)
    me = os.pidfd_open(os.getpid())  # each leader polls it after its PR_SET_PDEATHSIG (steps: "pdeathsig")
    os.set_inheritable(me, False)
    lsys.send_fds(sock, b"ready", [])
    children: dict[int, tuple[int, int]] = {}  # channel -> (pid, pidfd): a leader not yet reaped
    asked: dict[int, int] = {}   # pidfd -> channel: asked to reap, not exited yet
    orphans: dict[int, int] = {}  # pidfd -> pid: its channel closed unasked; reaped when it exits
    poller = select.poll()
    poller.register(sock, select.POLLIN)

    def reap_now(pidfd: int):
        info = os.waitid(os.P_PIDFD, pidfd, os.WEXITED | os.WNOHANG)
        return None if info is None or info.si_pid == 0 else info

    while True:
        for fd, _ev in poller.poll():
            if fd == sock:
                try:
                    data, fds = lsys.recv_fds(sock, INLINE + 4096, MAX_FDS)
                except ConnectionResetError:
                    data, fds = b"", []
                if not data:
                    os._exit(0)  # the Supervisor closed: its cells were cancelled first, or die with us now
                answer, sent, chan = _spawn(data, fds, me)
                lsys.send_fds(sock, answer, sent) if sent else os.write(sock, answer)
                if sent:
                    children[chan] = (int(answer.split()[1]), sent[0])
                    poller.register(chan, select.POLLIN)
            elif fd in children:
                pid, pidfd = children.pop(fd)
                poller.unregister(fd)
                try:
                    word = os.read(fd, 16)
                except OSError:
                    word = b""
                if word == b"reap":
                    info = reap_now(pidfd)
                    if info is None:  # not exited yet (abandon): answered when it is
                        asked[pidfd] = fd
                        poller.register(pidfd, select.POLLIN)
                        continue
                    _answer(fd, info)
                else:
                    os.close(fd)
                    orphans[pidfd] = pid
                    poller.register(pidfd, select.POLLIN)
                    continue
                os.close(pidfd)
            elif fd in asked or fd in orphans:
                info = reap_now(fd)
                if info is None:
                    continue
                poller.unregister(fd)
                if fd in asked:
                    _answer(asked.pop(fd), info)
                else:
                    orphans.pop(fd)
                os.close(fd)


def _answer(chan: int, info) -> None:
    try:
        os.write(chan, f"{info.si_code} {info.si_status}".encode())
    except OSError:
        pass
    os.close(chan)


def _spawn(data, fds, me):
    """One request: (the answer, the fds it carries, the cell's channel). The leader never returns from here."""
    from . import clone, steps
    from ..linux import pidinit
    chan = s = None
    try:
        request = _incoming(data, fds)
        if request[0] == "park":  # a spare leader (Client.park): its socketpair, then its reap channel
            chan = fds[1]
            return _park(request[1], request[2], fds[0], me) + (chan,)
        blob, path, chan_at = request
        chan = fds[chan_at]
        s = unpack(blob, fds)
        umask = blob["umask"]
        s.parent_fd = me
        if s.plan.pid_namespace:
            s.init_name = pidinit.own_name_plan()  # where *our* argv lies: the leader is a copy of us
        pid, pidfd, s.born = clone.new(path, s.plan.pid_namespace, s.in_userns, s.pod_userns)
        born = s.born
        if pid == 0:
            os.umask(umask)
            steps.child(s)  # never returns
        if pidfd is None:
            pidfd = os.pidfd_open(pid)
        os.set_inheritable(pidfd, False)
        return f"ok {pid} {int(born)}".encode(), [pidfd], chan
    except BaseException as e:  # noqa: BLE001 - the controller raises it, as an in-process clone would
        if chan is not None:
            os.close(chan)
            chan = None
        return f"err {getattr(e, 'errno', None) or errno.EINVAL} {getattr(e, 'strerror', None) or e}".encode(), \
            [], None
    finally:
        if s is not None and s.egress is not None:
            s.egress.theirs.detach()  # its fd is closed below, with the others: the leader has its copy
        for fd in fds:
            if fd != chan:
                try:
                    os.close(fd)
                except OSError:
                    pass


def _park(early: dict, path: str, lead: int, me: int) -> tuple[bytes, list[int]]:
    """A spare leader cloned into `path`: (the answer, [its pidfd]) here; in the leader, steps.park, then its Setup
    (or EOF: it exits without exec), then the rest of steps.STEPS. Never returns in the leader."""
    from . import clone, steps
    from ..linux import pidinit, seccomp
    init_name = pidinit.own_name_plan() if early["pid_namespace"] else ()  # where *our* argv lies, as _spawn's
    flt = seccomp.build(early["filter"]) if early["filter"] is not None else None
    pid, pidfd, born = clone.new(path, early["pid_namespace"], False)
    if pid == 0:
        code = 125
        try:
            s = steps.Setup(parent_fd=me, place=early["place"], backend=early["backend"], born=born)
            steps.park(s, lead)
            data, got = lsys.recv_fds(lead, INLINE + 4096, MAX_FDS)
            if not data:
                code = 0
                raise EOFError  # discarded: never a command
            d = _incoming(data, got)
            os.umask(d["umask"])
            s = unpack(d, got)
            s.parent_fd, s.born, s.init_name, s.filter = me, born, init_name, flt
        except BaseException:  # noqa: BLE001 - a spare that cannot become its cell never runs anything
            os._exit(code)
        steps.child(s, done=steps.PARKED)  # never returns
    if pidfd is None:
        pidfd = os.pidfd_open(pid)
    os.set_inheritable(pidfd, False)
    return f"ok {pid} {int(born)}".encode(), [pidfd]


def unpack(d: dict, fds: list[int]):
    """pack's inverse, in the server: a steps.Setup whose fds are the received copies."""
    from ..linux import landlock, seccomp
    from .steps import Setup
    at = lambda i: None if i is None else fds[i]  # noqa: E731
    s = Setup(plan=d["plan"], backend=d["backend"], place=d["place"], ids=d["ids"], netns_shared=d["netns_shared"],
              controller=d["controller"], in_userns=d["in_userns"], ctty=d["ctty"])
    for n in _FD_FIELDS:
        setattr(s, n, at(d[n]))
    s.stdio = tuple(at(i) for i in d["stdio"]) if d["stdio"] is not None else None
    s.premade = {k: at(i) for k, i in d["premade"].items()} if d["premade"] else d["premade"]
    if d["ruleset"] is not None:
        rs = landlock.Ruleset.__new__(landlock.Ruleset)
        rs.version, rs.log_tag, rs.handled, rs.scoped, i = d["ruleset"]
        rs.fd = fds[i]
        s.ruleset = rs
    if d["filter"] is not None:
        s.filter = seccomp.build(d["filter"])
    if d["egress"] is not None:
        from ..egress.handoff import Handoff
        h = Handoff.__new__(Handoff)
        import socket
        h.port, h.ours, h.theirs = d["egress"][0], None, socket.socket(fileno=fds[d["egress"][1]])
        s.egress = h
    return s
