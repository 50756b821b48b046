"""A pod's keeper (agnsup/pod.py): a process that does nothing but keep the pod's network namespace (and, for
a normal user's pod, the user namespace that owns it) alive, from its own cgroup place.

Forked twice, so it is nobody's child here: the middle child forks it and exits at once; whoever tears the pod
down (any controller, the janitor, `agnsup cleanup`) kills it through the place, and init (or the nearest
subreaper) reaps it. Before anything else it closes every descriptor it inherited but its report pipe: a copy
of a controller's liveness lock or of a pod lock held here would keep that lock taken for the keeper's life.
"""
from __future__ import annotations

import os
import signal

from ..linux import netns, userns
from ..linux import sys as lsys
from .helpers import read_all

_MAXFD = os.sysconf("SC_OPEN_MAX")


def start(backend, place, own_userns: bool, netns_owner: int | None) -> int:
    """Start a keeper in `place` (a backend Place; no node: no tree here) and return its pid once its
    namespaces exist and lo is up. `own_userns`: a normal user's pod, whose network namespace a user namespace
    of its own owns (uid and gid mapped to themselves, as a normal user's cell maps them). `netns_owner`: a
    root controller without CAP_NET_ADMIN (process.namespaces.cell_netns): the network namespace is owned by
    a user namespace of that uid. Raises OSError with the keeper's own errno when it could not."""
    path = backend.clone_dir(place) if place.node is not None else None
    cgfd = os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC) if path else None
    r, w = os.pipe()
    try:
        middle = os.fork()
        if middle == 0:
            try:
                born = _born_in(cgfd)
                if born == 0:
                    _keeper(r, w, backend, None if _BORN else place,
                            own_userns, netns_owner)
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
    code, _, msg = rest.partition("\0")
    raise OSError(int(code) if code.isdigit() else 0, f"the pod's keeper: {msg or 'it exited without a word'}")


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


def _keeper(r: int, w: int, backend, place, own_userns: bool, netns_owner: int | None) -> None:
    """In the keeper: never returns. `place` None: born in it already."""
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
        step = "namespaces"
        if own_userns:
            uid, gid = os.getuid(), os.getgid()
            lsys.unshare(lsys.CLONE_NEWUSER)
            userns.write_id_maps("self", uid, gid, uid, gid)
            lsys.unshare(lsys.CLONE_NEWNET)
            netns.loopback_up()
        elif netns_owner is not None:
            netns.own_user_and_net_namespace(netns_owner)
        else:
            lsys.unshare(lsys.CLONE_NEWNET)
            netns.loopback_up()
        os.write(w, f"ok\0{os.getpid()}".encode())
        os.close(w)
    except BaseException as e:  # noqa: BLE001 - a report, never a return into the controller's code
        try:
            os.write(w, f"err\0{getattr(e, 'errno', 0) or 0}\0{step}: {getattr(e, 'strerror', None) or e}"
                     .encode(errors="replace"))
        finally:
            os._exit(1)
    while True:
        signal.pause()
