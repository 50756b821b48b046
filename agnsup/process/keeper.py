"""A pod's keeper (agnsup/pod.py): a process that does nothing but keep the pod's network namespace (and, for
a normal user's pod, the user namespace that owns it) alive, from its own cgroup place, and hand them out.

It hands them out itself (ask): a Unix socket in the pod's directory (SOCKET, mode 0600, bound before any
euid change) answers each connection of a process of its own uid (SO_PEERCRED) with descriptors of its own
/proc/self/ns/net (and ns/user, when it has one; SCM_RIGHTS). One path on every host: nobody opens
/proc/KEEPER/ns/*, which a root controller without CAP_SYS_PTRACE (Docker's recipe) may not do once the
keeper's euid is the netns owner's (process.namespaces.cell_netns: the same trap).

Forked twice, so it is nobody's child here: the middle child forks it and exits at once; whoever tears the pod
down (any controller, the janitor, `agnsup cleanup`) kills it through the place, and init (or the nearest
subreaper) reaps it. It also ends by itself once no member holds the pod (its controllers died without leaving:
SIGKILL, a crashed API script): every PROBE seconds it tries pod.lock exclusive without waiting, and on the second
success in a row it exits holding it (a joiner waiting for its shared lock then finds the keeper dead and makes a
new pod, as after any keeper's death; the directory and the emptied place are the janitor's to sweep). So a
crashed controller leaves no process of a pod behind, only files. Before anything else it closes every descriptor
it inherited but its report pipe: a copy of a controller's liveness lock or of a pod lock held here would keep
that lock taken for the keeper's life (the pod.lock it probes is a description of its own, opened afterwards).
"""
from __future__ import annotations

import errno
import os
import signal

from ..linux import netns, proc, userns
from ..linux import sys as lsys
from .helpers import read_all

_MAXFD = os.sysconf("SC_OPEN_MAX")
SOCKET = "keeper.sock"  # in the pod's directory: where the keeper hands out its namespaces (ask)
ASK_TIMEOUT = 5.0       # s: a keeper that neither answers nor refuses (stopped, frozen) is no keeper
PROBE = 5.0             # s between the keeper's tries of pod.lock (it ends on the second free one in a row)
LOCK = "pod.lock"       # in the pod's directory: the members' shared locks (agnsup/pod.py)


def start(backend, place, where: str, own_userns: bool, netns_owner: int | None) -> int:
    """Start a keeper in `place` (a backend Place; no node: no tree here) and return its pid once its
    namespaces exist, lo is up and its socket in the directory `where` answers. `own_userns`: a normal user's
    pod, whose network namespace a user namespace of its own owns (uid and gid mapped to themselves, as a
    normal user's cell maps them). `netns_owner`: a root controller without CAP_NET_ADMIN
    (process.namespaces.cell_netns): the network namespace is owned by a user namespace of that uid. Raises
    the cell's own line (process.namespaces.keeper_refusal) when the host refuses the namespaces, else OSError
    with the keeper's own errno."""
    path = backend.clone_dir(place) if place.node is not None else None
    cgfd = os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC) if path else None
    r, w = os.pipe()
    try:
        middle = os.fork()
        if middle == 0:
            try:
                born = _born_in(cgfd)
                if born == 0:
                    _keeper(r, w, backend, None if _BORN else place, where, own_userns, netns_owner)
            finally:
                os._exit(0)
    finally:
        os.close(w)
        if cgfd is not None:
            os.close(cgfd)
    try:
        os.waitpid(middle, 0)
        answer = read_all(r).decode(errors="replace")  # EOF: the keeper reported, or died
    except BaseException:
        os.close(r)
        raise
    kind, _, rest = answer.partition("\0")
    if kind == "ok" and rest.isdigit():
        return int(rest)
    code, _, said = rest.partition("\0")
    step, _, msg = said.partition("\0")
    code = int(code) if code.isdigit() else 0
    from .namespaces import keeper_refusal
    refused = keeper_refusal(step, code, msg, own_userns, netns_owner)
    if refused is not None:
        raise refused
    raise OSError(code, f"the pod's keeper: {step}: {msg}" if step else "the pod's keeper: it exited without a word")


_BORN: list = []  # in the keeper: it was born in its place's cgroup2 directory (clone3)


def _born_in(cgfd: int | None) -> int:
    """In the middle child (single-threaded, as the raw clone3 needs): the keeper born in its cgroup2 directory
    by clone3(CLONE_INTO_CGROUP), which takes only the read side of the lock a cgroup.procs write takes for
    writing (an RCU grace period, 6-16 ms here: linux/sys.py); fork where the kernel refuses it (the keeper
    then joins by writing cgroup.procs). 0 in the keeper, its pid here."""
    if cgfd is not None:
        try:
            pid, _ = lsys.clone3_into_cgroup(cgfd, 0)
            if pid == 0:
                _BORN.append(True)
            return pid
        except OSError:
            pass
    return os.fork()


def _keeper(r: int, w: int, backend, place, where: str, own_userns: bool, netns_owner: int | None) -> None:
    """In the keeper: never returns. `place` None: born in it already. Its report names the step that failed:
    "user_namespace", "network_namespace" (the unshare, or netns_owner's own user and network namespace) and
    "loopback" are what process.namespaces.keeper_refusal knows."""
    import _socket  # not `socket`: a socket, SO_PEERCRED and SCM_RIGHTS
    step = "fds"
    try:
        os.closerange(3, min(r, w))
        os.closerange(min(r, w) + 1, max(r, w))
        os.closerange(max(r, w) + 1, _MAXFD)
        os.close(r)
        step = "setsid"
        os.setsid()  # out of the controller's session: a terminal's ^C or hang-up never reaches it
        for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGPIPE):
            signal.signal(sig, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        step = "cgroup"
        if place is not None and place.node is not None:
            backend.attach(place, 0)
        step = "socket"  # bound as who started us, before any euid change: the file is the controller's user's
        srv = _socket.socket(_socket.AF_UNIX, _socket.SOCK_SEQPACKET)
        os.chdir(where)  # a relative name: a state directory's path may be longer than sun_path takes
        umask = os.umask(0o177)
        try:
            srv.bind(SOCKET)
        finally:
            os.umask(umask)
            os.chdir("/")  # the controller's cwd (a worktree's mount) is not kept busy
        wfd = os.open(where, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        srv.listen(64)
        # the members' lock, opened as who started us (before any euid change): a description of our own, so
        # holding nothing until we probe it (_serve)
        members = os.open(LOCK, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW, dir_fd=wfd)
        if own_userns:
            step = "user_namespace"
            uid, gid = os.getuid(), os.getgid()
            lsys.unshare(lsys.CLONE_NEWUSER)
            userns.write_id_maps("self", uid, gid, uid, gid)
            step = "network_namespace"
            lsys.unshare(lsys.CLONE_NEWNET)
            step = "loopback"
            netns.loopback_up()
        elif netns_owner is not None:
            step = "network_namespace"
            netns.own_user_and_net_namespace(netns_owner)
        else:
            step = "network_namespace"
            lsys.unshare(lsys.CLONE_NEWNET)
            step = "loopback"
            netns.loopback_up()
        step = "namespaces"
        fds = [proc.ns("net")] + ([proc.ns("user")] if own_userns or netns_owner is not None else [])
        me = os.getuid()  # as SO_PEERCRED shows a peer's uid: both seen from the user namespace we are in now
        os.close(wfd)
        os.write(w, f"ok\0{os.getpid()}".encode())
        os.close(w)
    except BaseException as e:  # noqa: BLE001 - a report, never a return into the controller's code
        try:
            os.write(w, f"err\0{getattr(e, 'errno', 0) or 0}\0{step}\0{getattr(e, 'strerror', None) or e}"
                     .encode(errors="replace"))
        finally:
            os._exit(1)
    _serve(srv, fds, me, members)


def _serve(srv, fds: list[int], me: int, members: int) -> None:
    """In the keeper, until no member holds the pod (`members`: pod.lock, _unheld): each connection of a
    process of uid `me` gets `fds`; any other, nothing."""
    import _socket
    import fcntl
    import select
    import struct
    import time
    creds = struct.calcsize("3i")
    free = 0  # pod.lock found free this many probes in a row
    while True:
        if not select.select([srv], [], [], PROBE)[0]:
            try:
                fcntl.flock(members, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                free = 0  # a member holds it (or a joiner, a teardown, the janitor's sweep): we serve on
                continue
            free += 1
            if free >= 2:
                os._exit(0)  # no member for a whole PROBE: released with our exit; the pod is dead from now
            fcntl.flock(members, fcntl.LOCK_UN)
            continue
        try:
            fd, _ = srv._accept()
        except OSError:
            time.sleep(0.01)  # a transient refusal (EMFILE, ENOBUFS): never a hot loop
            continue
        conn = _socket.socket(fileno=fd)
        try:
            _pid, uid, _gid = struct.unpack("3i", conn.getsockopt(_socket.SOL_SOCKET, _socket.SO_PEERCRED, creds))
            if uid == me:
                lsys.send_fds(conn, str(len(fds)).encode(), fds)
        except OSError:
            pass  # the asker went away: nothing to tell it
        finally:
            conn.close()


def ask(where: str, pid: int) -> tuple[int, int | None]:
    """The namespaces of the keeper `pid` whose directory is `where`: (its netns, its user namespace or None),
    close-on-exec descriptors it sent us over its socket. Raises ProcessLookupError when nothing answers
    there, or something other than `pid` does (its socket is bound by the keeper itself: SO_PEERCRED names
    the process that listens). The caller proves the namespaces are the pod's (their inodes)."""
    import _socket
    import struct
    import time
    dfd = os.open(where, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_SEQPACKET)
    fds: list[int] = []
    answer = b""
    try:
        s.settimeout(ASK_TIMEOUT)
        path = f"/proc/self/fd/{dfd}/{SOCKET}"  # short whatever `where` is (sun_path: 108 bytes)
        deadline = time.monotonic() + ASK_TIMEOUT
        while True:
            try:
                s.connect(path)
                break
            except BlockingIOError:  # its backlog is full: asked by many at once
                if time.monotonic() > deadline:
                    raise TimeoutError(errno.ETIMEDOUT, "it does not accept") from None
                time.sleep(0.002)
        peer, _uid, _gid = struct.unpack("3i", s.getsockopt(_socket.SOL_SOCKET, _socket.SO_PEERCRED,
                                                            struct.calcsize("3i")))
        answer, fds = lsys.recv_fds(s, 16, max_fds=2)
    except OSError as e:
        for fd in fds:
            os.close(fd)
        raise ProcessLookupError(errno.ESRCH, f"its keeper {pid} does not answer on {os.path.join(where, SOCKET)}: "
                                 f"{e.strerror or e}") from None
    finally:
        s.close()
        os.close(dfd)
    if peer != pid or answer != str(len(fds)).encode() or len(fds) not in (1, 2):
        for fd in fds:
            os.close(fd)
        why = f"process {peer} answers there" if peer != pid else "it refused us"
        raise ProcessLookupError(errno.ESRCH, f"its keeper {pid} did not hand out its namespaces: {why}")
    return fds[0], (fds[1] if len(fds) == 2 else None)
