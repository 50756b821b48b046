"""The pod: one private network namespace shared by an agent's cells (issue 28; docs/isolation.md "Pods").

A pod is keyed by (run_id, agent_id). It is a network namespace with only lo up, anchored by a keeper process
(process/keeper.py: it does nothing but keep the namespace alive) that lives in the pod's own cgroup place,
`run-R/pod-A` beside the agent's cells (backend_place), so tearing it down is one kill of that place, never
a pid alone. Its state is a directory:

    <state>/pods/<run_id>/<agent_id>/pod.json   the keeper (pid, start time, pidfd inode, boot id), the
                                                netns inode, the place's directories, the user namespace's
    <state>/pods/<run_id>/<agent_id>/pod.lock   membership: a shared flock per member cell (and per lingering
                                                controller, below)
    <state>/pods/<run_id>/<agent_id>/cells.lock member cells only: a shared flock per member cell (what a
                                                cell published closes when none holds it: ports.py)
    <state>/pods/<run_id>/<agent_id>/keeper.sock where the keeper hands out its namespaces (keeper.ask: no
                                                /proc/KEEPER/ns/*, which a root without CAP_SYS_PTRACE may
                                                not open once the keeper's euid changed)

Membership is the lock (flock(2): the kernel drops a dead holder's lock however it died). Each cell of the pod
holds a shared lock on pod.lock for its life (its controller's descriptor, close-on-exec). Joining takes the
shared lock first and then checks the pod is alive; when it is not, the joiner takes the lock exclusive (no
member is alive then), makes a fresh keeper, writes pod.json, and goes back to shared. Leaving releases the
shared lock, then tries the exclusive one without waiting: got it, no member is alive, and the leaver tears
the pod down (kills the place, removes the directory) while it holds it. A controller killed with SIGKILL
drops its locks with it: the janitor (and `agnsup cleanup`) sweep every pod whose lock can be taken exclusive.

A controller of many cells (serve, the API's Supervisor, MCP, sandboxd: `Linger`) keeps the last member's
shared lock on pod.lock as a hold of its own for LINGER seconds after that member left, so the agent's next
cell reuses the pod (no new keeper: 13-17 ms of a cell); then it lets go and tears the pod down if it is free.
Its close lets go of every hold at once; its death drops them with it (the janitor's sweep, as above). What the
cells published (ports.py) does not linger: it closes when the last member *cell* ends, which cells.lock tells.
A one-cell controller (`agnsup run`) keeps nothing: its cell's end is the pod's when it was the last.

What a pod shares, among one agent's cells only: the network namespace, so loopback ports and abstract Unix
sockets. Each cell still has its own mount, IPC and PID namespaces, cgroup, Landlock domain and seccomp
filter. Which cells join one: compiler (plan.network_pod).

API other modules use: find(state, run_id, agent_id) -> Pod | None; Pod.dir, Pod.netns_fd(), Pod.enter(),
Pod.place; join/leave (the broker), sweep (the janitor, cleanup).
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import threading
import time
from contextlib import suppress

from . import locks
from .backend.base import Place
from .linux import cgroup, pidfd, proc
from .linux import sys as lsys
from .util.record import Record

JOIN_TIMEOUT = 10.0  # how long a join waits for a creator or a teardown holding the lock exclusive
# what a teardown removes from a pod's directory
STATE_FILES = ("pod.json", "pod.json.tmp", "ports.json", "keeper.sock", "cells.lock")
CELLS_LOCK = "cells.lock"


def root(state) -> str:
    return os.path.join(getattr(state, "path", state), "pods")


def pod_dir(state, run_id: str, agent_id: str) -> str:
    return os.path.join(root(state), run_id, agent_id)


def backend_place(backend, run_id: str, agent_id: str) -> Place:
    """The pod's cgroup place: `run-R/pod-A`, beside the agent's directory, not in it (an agent's or a run's
    cancel then still finds only cells below `agent-A`, reaper._covers); none without a tree."""
    if not backend.trees:
        return Place()
    node = backend.scope(run_id).node.child(f"pod-{agent_id}")
    h, path = node.primary  # membership and the kill only: no limit, so no other hierarchy
    return Place(node=cgroup.Node({h: path}))


class Pod(Record):
    run_id: str
    agent_id: str
    dir: str
    keeper: dict            # {"pid", "starttime", "pidfd_ino", "boot_id"}
    netns: int              # the inode of its network namespace
    place: Place            # where the keeper lives (and what must die with the pod: the ports forwarder)
    userns: int | None = None  # a normal user's pod: the inode of the user namespace that owns the netns
    created_at: float = 0.0

    @property
    def key(self) -> str:
        return f"{self.run_id}/{self.agent_id}"

    def alive(self, keep: bool = False) -> bool:
        """The keeper is the recorded process, on this boot, not a zombie, and hands out the recorded netns.
        `keep`: the namespaces' descriptors it handed out for this proof are kept for ns_fds() (a joining cell's:
        one ask of the keeper a cell, not two); drop_held() closes them when the caller does not use them."""
        if self.keeper.get("boot_id") != proc.boot_id():
            return False
        try:
            net, us = self._ns_fds()
        except OSError:
            return False
        ok = not proc.is_zombie(self.keeper["pid"])
        if ok and keep:
            self.drop_held()
            object.__setattr__(self, "_held", (net, us))
            return True
        for fd in (net, us):
            if fd is not None:
                os.close(fd)
        return ok

    def drop_held(self) -> None:
        """Close the descriptors alive(keep=True) kept, if any are left."""
        held = self.__dict__.pop("_held", None)
        for fd in held or ():
            if fd is not None:
                os.close(fd)

    def ns_fds(self) -> tuple[int, int | None]:
        """(network namespace, user namespace or None): those alive(keep=True) kept when it proved the pod
        alive, else asked of the keeper now (_ns_fds). Each descriptor pins its namespace: one the keeper
        handed out a moment earlier is the pod's as much as a fresh one."""
        held = self.__dict__.pop("_held", None)
        return held if held is not None else self._ns_fds()

    def _ns_fds(self) -> tuple[int, int | None]:
        """Open descriptors of the pod's network namespace and (a normal user's pod) user namespace, which
        the keeper hands out (process.keeper.ask), proven to be the pod's: the keeper's identity before the
        ask and after it (a pid reused meanwhile has another start time), the namespaces' inodes."""
        from .process import keeper
        k = self.keeper
        fd = pidfd.open(k["pid"])
        if fd is None:
            raise ProcessLookupError(errno.ESRCH, f"pod {self.key}: its keeper {k['pid']} is gone")
        try:
            ok, why = pidfd.matches(fd, k["pid"], k.get("pidfd_ino"), k.get("starttime"))
            if not ok:
                raise ProcessLookupError(errno.ESRCH, f"pod {self.key}: {why}")
            try:
                net, us = keeper.ask(self.dir, k["pid"])
            except ProcessLookupError as e:
                raise ProcessLookupError(errno.ESRCH, f"pod {self.key}: {e.strerror}") from None
            if self.userns is None and us is not None:  # a root netns owner's: the cells join only the netns
                os.close(us)
                us = None
            ok, _ = pidfd.matches(fd, k["pid"], k.get("pidfd_ino"), k.get("starttime"))
            if (not ok or os.fstat(net).st_ino != self.netns or
                    (self.userns is not None and (us is None or os.fstat(us).st_ino != self.userns))):
                for ns in (net, us):
                    if ns is not None:
                        os.close(ns)
                raise ProcessLookupError(errno.ESRCH, f"pod {self.key}: its keeper {k['pid']} ended")
            return net, us
        finally:
            os.close(fd)

    def netns_fd(self) -> int:
        """An open (close-on-exec) descriptor of the pod's network namespace, for setns(2)."""
        net, us = self._ns_fds()
        if us is not None:
            os.close(us)
        return net

    def userns_fd(self) -> int | None:
        """A normal user's pod: the user namespace that owns its netns (a cell joins it first); else None."""
        if self.userns is None:
            return None
        net, us = self._ns_fds()
        os.close(net)
        return us

    def enter(self) -> None:
        """This process (single-threaded: setns(CLONE_NEWUSER) refuses a threaded caller) joins the pod:
        its user namespace when it has one, then its network namespace (the ports forwarder)."""
        net, us = self._ns_fds()
        try:
            if us is not None:
                lsys.setns(us, lsys.CLONE_NEWUSER)
            lsys.setns(net, lsys.CLONE_NEWNET)
        finally:
            os.close(net)
            if us is not None:
                os.close(us)

    def as_dict(self) -> dict:
        return {"run_id": self.run_id, "agent_id": self.agent_id, "keeper": self.keeper, "netns": self.netns,
                "userns": self.userns, "place": self.place.paths(), "created_at": self.created_at}


def _load(d: str) -> Pod | None:
    try:
        with open(os.path.join(d, "pod.json")) as f:
            data = json.load(f)
        return Pod(run_id=data["run_id"], agent_id=data["agent_id"], dir=d, keeper=data["keeper"],
                   netns=data["netns"], userns=data.get("userns"), created_at=data.get("created_at", 0.0),
                   place=Place(node=cgroup.Node(data["place"])) if data.get("place") else Place())
    except (OSError, ValueError, KeyError, TypeError):
        return None


def find(state, run_id: str, agent_id: str) -> Pod | None:
    """The agent's pod if it is alive: its lock file exists and its keeper is proven alive; else None."""
    d = pod_dir(state, run_id, agent_id)
    if not os.path.exists(os.path.join(d, "pod.lock")):
        return None
    pod = _load(d)
    return pod if pod is not None and pod.alive() else None


# -- membership ----------------------------------------------------------------------------------------------
class Membership(Record):
    """One cell's hold on its pod: the shared lock's descriptor."""
    pod: Pod
    fd: int
    created: bool = False   # this cell's join made the pod
    cells: int | None = None  # its shared lock on cells.lock: a member cell (not a controller's linger)
    reused: bool = False    # taken over from its controller's linger (Linger.take): no lock taken, no keeper made


def _as_cell(m: Membership) -> Membership:
    """The member's shared lock on cells.lock too (taken while it holds pod.lock shared: no teardown between,
    so the file is the pod's own)."""
    try:
        fd = os.open(os.path.join(m.pod.dir, CELLS_LOCK), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except BaseException:
        m.pod.drop_held()
        os.close(m.fd)
        raise
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # waits only for a check of cells_held() (an instant)
    except BaseException:
        os.close(fd)
        m.pod.drop_held()
        os.close(m.fd)
        raise
    m.cells = fd
    return m


def cells_held(d: str) -> bool:
    """Whether a member cell of the pod in `d` lives (holds cells.lock). A controller's linger is no member
    cell. The caller holds the pod directory's flock (ports._Locked): one look at a time."""
    try:
        fd = os.open(os.path.join(d, CELLS_LOCK), os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # the lock goes with it


def _lock(path: str, mode: int, deadline: float | None, give_up=None) -> int | None:
    """The pod's lock in `mode`: None when held (and `deadline` is None, or `give_up()`), or when a teardown
    unlinked it meanwhile (the caller starts again). locks.flock_file, the worktree locks' primitive."""
    return locks.flock_file(path, mode, deadline, give_up, follow=False, waited_for=f" for {JOIN_TIMEOUT:g} s")


def join(state, backend, run_id: str, agent_id: str, own_userns: bool = False,
         netns_owner: int | None = None, linger: "Linger | None" = None) -> Membership:
    """The cell's membership of its agent's pod, made when none is alive. Raises OSError when no keeper could
    be made (the broker fails the cell with it). `linger`: its controller's (a hold on the pod it keeps after
    its last member left becomes this cell's membership when the pod is alive)."""
    d = pod_dir(state, run_id, agent_id)
    path = os.path.join(d, "pod.lock")
    held = linger.take(d) if linger is not None else None
    if held is not None:  # a shared lock of ours: no teardown since, so pod.json is this pod's
        pod = _load(d)
        if pod is not None and (linger.proven(pod) or pod.alive(keep=True)):
            linger.remember(pod)
            return _as_cell(Membership(pod=pod, fd=held, reused=True))
        os.close(held)  # its keeper died meanwhile: join like anyone (a new one is made)
    m = _join(d, path, backend, run_id, agent_id, own_userns, netns_owner)
    if linger is not None:
        linger.remember(m.pod)
    return _as_cell(m)


def _join(d: str, path: str, backend, run_id: str, agent_id: str, own_userns: bool,
          netns_owner: int | None) -> Membership:
    deadline = time.monotonic() + JOIN_TIMEOUT
    while True:
        try:
            os.makedirs(d, mode=0o700, exist_ok=True)
            fd = _lock(path, fcntl.LOCK_SH, deadline)
        except FileNotFoundError:  # a teardown removed the directories between: make them again
            fd = None
        if fd is None:
            continue  # torn down under us: its directory goes, a new one is made
        pod = _load(d)
        if pod is not None and pod.alive(keep=True):
            return Membership(pod=pod, fd=fd)
        os.close(fd)  # none alive: make one, alone (exclusive), then be a member like any other

        def made_meanwhile() -> bool:  # another joiner made it and holds it shared now: join that one
            p = _load(d)
            return p is not None and p.alive()
        try:
            fd = _lock(path, fcntl.LOCK_EX, deadline, made_meanwhile)
        except FileNotFoundError:
            fd = None
        except TimeoutError:
            raise OSError(errno.ETIMEDOUT, f"its keeper is gone while cells of the agent still hold the pod "
                          f"({path}): a new pod is made once they end") from None
        if fd is None:
            continue
        try:
            pod = _load(d)
            created = not (pod is not None and pod.alive())
            if created:
                try:
                    pod = _create(d, backend, run_id, agent_id, stale=pod, own_userns=own_userns,
                                  netns_owner=netns_owner)
                except BaseException:
                    with suppress(OSError):
                        teardown(backend, d)  # under our exclusive lock: nothing of a pod that never was stays
                    raise
            # exclusive -> shared is not atomic (flock(2)): a sweep may take it between; checked again below
            fcntl.flock(fd, fcntl.LOCK_SH)
        except BaseException:
            os.close(fd)
            raise
        if pod.alive(keep=True) and os.path.exists(path) and os.fstat(fd).st_ino == os.stat(path).st_ino:
            return Membership(pod=pod, fd=fd, created=created)
        pod.drop_held()
        os.close(fd)


def _create(d: str, backend, run_id: str, agent_id: str, stale: Pod | None, own_userns: bool,
            netns_owner: int | None) -> Pod:
    """Under the exclusive lock: what a dead pod left goes, a keeper is made, pod.json written."""
    from .process import keeper
    if stale is not None:
        _kill(backend, stale)
    with suppress(FileNotFoundError):
        os.unlink(os.path.join(d, keeper.SOCKET))  # a dead keeper's: the new one binds its own
    place = backend_place(backend, run_id, agent_id)
    if place.node is not None:
        _kill(backend, Pod(run_id=run_id, agent_id=agent_id, dir=d, keeper={}, netns=0, place=place))
        place = backend.create(place, {})
    try:
        pid = keeper.start(backend, place, d, own_userns, netns_owner)
        fd = os.pidfd_open(pid)
        try:
            ident = {"pid": pid, "pidfd_ino": pidfd.inode(fd) if pidfd.has_pidfs() else None,
                     "starttime": proc.stat(pid).starttime, "boot_id": proc.boot_id()}
        finally:
            os.close(fd)
        net, us = keeper.ask(d, pid)
        try:
            inodes = os.fstat(net).st_ino, (os.fstat(us).st_ino if own_userns and us is not None else None)
        finally:
            for ns in (net, us):
                if ns is not None:
                    os.close(ns)
        pod = Pod(run_id=run_id, agent_id=agent_id, dir=d, keeper=ident, place=place, created_at=time.time(),
                  netns=inodes[0], userns=inodes[1])
        tmp = os.path.join(d, "pod.json.tmp")
        with open(tmp, "w") as f:
            json.dump(pod.as_dict(), f)
        os.replace(tmp, os.path.join(d, "pod.json"))
    except BaseException:
        _kill(backend, Pod(run_id=run_id, agent_id=agent_id, dir=d, keeper={}, netns=0, place=place))
        raise
    return pod


RETRY_AFTER = 0.5  # s: a controller of many cells tries once more to tear down a pod its leave found held
# How long a controller of many cells keeps a pod after its last member cell left (Linger). An agent's calls come one
# after the other: its next call, after the model's turn, is usually within a second or two (and an agent
# that thinks longer pays one keeper, 13-17 ms, not one per call). Short, so an idle agent's pod (a keeper
# process, a cgroup place) does not stay for long after it stopped, and a test polls it away in seconds.
LINGER = 2.0


def leave(state, backend, m: Membership | None, forks: bool = False, linger: "Linger | None" = None) -> list[dict]:
    """The cell has ended: release its shared locks; the last member out tears the pod down, or (`linger`, a
    controller of many cells) its controller keeps a hold on it for LINGER s (Linger). Either way what the
    cells published closes when no member cell is left (close_ports). Returns what the teardown
    removed ([] while other members live, or while it lingers).

    `forks`: this process forks other cells meanwhile (serve, the API's Supervisor). A child between its
    fork and the step that closes what it inherited (steps._stdio) holds a copy of every member descriptor
    of this process, so the exclusive lock may be refused for that instant although no member is alive:
    one more try a moment later (a timer thread) finds it free. A one-cell controller forks nothing then."""
    if m is None:
        return []
    if m.cells is not None:
        os.close(m.cells)
        m.cells = None
    d = m.pod.dir
    if linger is not None and linger.keep(d, m.fd):  # the pod lingers: its published ports do not
        if not _close_ports(state, d) and forks:
            linger.retry_ports(d)
        return []
    if linger is not None:
        linger.forget(d)
    os.close(m.fd)
    done = _teardown_if_free(backend, d)
    if not done:  # members live, or another controller's linger holds it: only its ports may close now
        _close_ports(state, d)
        if forks:  # as before: a fork's copy may have refused it (the retry closes the ports too)
            t = threading.Timer(RETRY_AFTER, _teardown_quietly, (backend, d, state))
            t.daemon = True
            t.start()
    return done


def _close_ports(state, d: str) -> bool:
    try:
        return close_ports(d)
    except OSError:
        return True  # the forwarders die with the pod's teardown all the same (linger's end, the janitor)


def close_ports(d: str) -> bool:
    """The pod in `d` has no member cell left: every forwarder of its published ports (ports.py's records,
    ports.json) stopped through a checked pidfd and the records gone, under the pod directory's flock
    (ports._Locked: one publish or close at a time, and a publish checks cells_held under it too). False when
    a member cell holds cells.lock (nothing closed); True when done or nothing was published. No journal
    event, as when the teardown kills them with the pod's place."""
    try:
        dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return True  # torn down: they went with its place
    try:
        fcntl.flock(dfd, fcntl.LOCK_EX)
        path = os.path.join(d, "ports.json")
        try:
            with open(path) as f:
                records = json.load(f)
        except FileNotFoundError:
            return True
        except ValueError:
            records = []
        if cells_held(d):
            return False
        for rec in records if isinstance(records, list) else []:
            if isinstance(rec, dict):
                _stop_forwarder(rec)
        with suppress(FileNotFoundError):
            os.unlink(path)
        return True
    finally:
        os.close(dfd)


def _stop_forwarder(rec: dict) -> None:
    """SIGKILL a published port's forwarder, proven to be it (boot, pidfd inode, start time), and wait for it."""
    import select
    import signal
    pid = rec.get("pid")
    if not isinstance(pid, int) or rec.get("boot_id") != proc.boot_id():
        return
    fd = pidfd.open(pid)
    if fd is None:
        return
    try:
        ok, _ = pidfd.matches(fd, pid, rec.get("pidfd_ino"), rec.get("starttime"))
        if ok and pidfd.send(fd, signal.SIGKILL):
            select.select([fd], [], [], 5.0)
    finally:
        os.close(fd)


def _teardown_quietly(backend, d: str, state=None) -> None:
    try:
        if not _teardown_if_free(backend, d) and state is not None:
            _close_ports(state, d)
    except OSError:
        pass  # left to the janitor's sweep


class _Proof(Record):
    """What proved a pod alive to a controller (Linger.remember): the keeper's record and pidfd, the namespaces'
    inodes and copies of their descriptors as the keeper handed them out."""
    keeper: dict
    netns: int
    userns: int | None
    pidfd: int
    net: int
    us: int | None

    def of(self, pod: Pod) -> bool:
        return self.keeper == pod.keeper and self.netns == pod.netns and self.userns == pod.userns

    def close(self) -> None:
        for fd in (self.pidfd, self.net, self.us):
            if fd is not None:
                with suppress(OSError):
                    os.close(fd)


class Linger:
    """A controller of many cells' holds on pods whose last member cell left: at most one per pod (the last
    member's shared lock on pod.lock, close-on-exec, kept), let go LINGER s after it was taken and the pod
    torn down when free; a pod whose published ports could not be closed retries them every RETRY_AFTER s while
    it lingers. One timer thread for all of them (util/deadlines.py)."""

    def __init__(self, backend, state=None):
        from .util.deadlines import Deadlines
        self.backend, self.state = backend, state
        # ("linger", pod dir) -> the hold's fd; ("ports", pod dir) -> None: its ports' next retry
        self._due = Deadlines(self._fire, "agnsup-pod-linger")
        # pod dir -> _Proof: what the keeper handed out when this controller last proved the pod alive (remember)
        self._proofs: dict[str, _Proof] = {}
        self._guard = threading.Lock()

    def remember(self, pod: Pod) -> None:
        """Keep what proved `pod` alive (its keeper's pidfd, checked against its identity, and copies of the
        namespace descriptors the keeper handed out for the proof, which the joining cell takes: Pod.ns_fds), so
        that this controller's next cell of the pod is proven without asking the keeper again (proven). Best
        effort: nothing kept when the keeper's identity cannot be checked, or no proof is held."""
        held = pod.__dict__.get("_held")
        if held is None:
            return
        with self._guard:
            old = self._proofs.get(pod.dir)
            if old is not None and old.of(pod):
                return
        k = pod.keeper
        fd = pidfd.open(k["pid"])
        if fd is None:
            return
        ok, _ = pidfd.matches(fd, k["pid"], k.get("pidfd_ino"), k.get("starttime"))
        if not ok:
            os.close(fd)
            return
        net, us = held
        proof = _Proof(keeper=dict(k), netns=pod.netns, userns=pod.userns, pidfd=fd,
                       net=os.dup(net), us=os.dup(us) if us is not None else None)
        with self._guard:
            old, self._proofs[pod.dir] = self._proofs.get(pod.dir), proof
            if old is not None:
                old.close()

    def proven(self, pod: Pod) -> bool:
        """`pod` (pod.json as read now) is the one this controller proved alive (remember) and its keeper has not
        exited since (its pidfd, a reference to that very process, is not readable): the pod is alive, and the
        namespaces the keeper handed out then are its own (a keeper never changes them). Then the joining cell gets
        copies of those (Pod.ns_fds), as the keeper's own answer would be: one ask of the keeper per pod and
        controller, not one per cell. False (the caller asks the keeper: Pod.alive) for anything else: another
        keeper or netns in pod.json, another boot, a keeper that exited."""
        if pod.keeper.get("boot_id") != proc.boot_id():
            return False
        import select
        with self._guard:  # forget closes them under it: never a copy of a number reused meanwhile
            proof = self._proofs.get(pod.dir)
            if proof is None or not proof.of(pod):
                return False
            p = select.poll()  # (not select(): a descriptor past 1023)
            p.register(proof.pidfd, select.POLLIN)
            if p.poll(0):  # it exited
                del self._proofs[pod.dir]
                proof.close()
                return False
            try:
                net = os.dup(proof.net)
            except OSError:
                return False  # out of descriptors: asked of the keeper, which says the same
            try:
                us = os.dup(proof.us) if proof.us is not None else None
            except OSError:
                os.close(net)
                return False
        pod.drop_held()
        object.__setattr__(pod, "_held", (net, us))
        return True

    def forget(self, d: str) -> None:
        """The pod in `d` is no longer this controller's to prove from memory (its hold let go, torn down)."""
        with self._guard:
            proof = self._proofs.pop(d, None)
            if proof is not None:
                proof.close()

    def keep(self, d: str, fd: int) -> bool:
        """Keep `fd` (a shared lock on the pod's pod.lock) as the hold on the pod in `d`; False (the caller
        closes it) when this controller is closing or LINGER is 0. A second hold on the same pod is closed."""
        if LINGER <= 0:
            return False
        self._due.pop(("ports", d))
        return self._due.put(("linger", d), LINGER, lambda old: (old is not None and os.close(old)) or fd)

    def take(self, d: str) -> int | None:
        """The hold on the pod in `d`, no longer lingering (a cell of it joins), or None."""
        self._due.pop(("ports", d))
        return self._due.pop(("linger", d))

    def retry_ports(self, d: str) -> None:
        if self._due.has(("linger", d)):
            self._due.put(("ports", d), RETRY_AFTER, lambda _: None)

    def lingering(self) -> list[str]:
        return sorted(d for kind, d in self._due.keys() if kind == "linger")

    def close(self) -> list[dict]:
        """Let go of every hold at once and tear each pod down that is free (the controller's close)."""
        items: list[dict] = []
        with self._guard:
            for proof in self._proofs.values():
                proof.close()
            self._proofs = {}
        for (kind, d), fd in self._due.close().items():
            if kind == "linger":
                os.close(fd)
                with suppress(OSError):
                    items += _teardown_if_free(self.backend, d)
        return items

    def _fire(self, key: tuple[str, str], fd) -> None:
        kind, d = key
        if kind == "ports":
            if self.state is not None and not _close_ports(self.state, d):
                self.retry_ports(d)
            return
        self._due.pop(("ports", d))
        self.forget(d)
        os.close(fd)
        _teardown_quietly(self.backend, d, self.state)
        if os.path.isdir(d):  # a fork's copy of the hold, for an instant: once more (leave's retry)
            t = threading.Timer(RETRY_AFTER, _teardown_quietly, (self.backend, d, self.state))
            t.daemon = True
            t.start()


def _teardown_if_free(backend, d: str) -> list[dict]:
    """Tear the pod in `d` down when no member holds its lock (taken exclusive, without waiting)."""
    path = os.path.join(d, "pod.lock")
    try:
        fd = _lock(path, fcntl.LOCK_EX, None)
    except FileNotFoundError:
        fd = None
    if fd is None:
        if not os.path.exists(path) and os.path.isdir(d):  # no lock file at all: a crash mid-create or -teardown
            return teardown(backend, d)
        return []
    try:
        return teardown(backend, d)
    finally:
        os.close(fd)


def teardown(backend, d: str) -> list[dict]:
    """Kill the pod's place (or its keeper, checked, without a tree), remove its directory. The caller holds
    the exclusive lock, or there is no lock file. Idempotent; returns what went."""
    items: list[dict] = []
    pod = _load(d)
    if pod is None:
        run_id, agent_id = os.path.basename(os.path.dirname(d)), os.path.basename(d)
        pod = Pod(run_id=run_id, agent_id=agent_id, dir=d, keeper={}, netns=0,
                  place=backend_place(backend, run_id, agent_id))
    items += _kill(backend, pod)
    # the lock file last: a joiner that opened it before waits for our exclusive lock and then finds the path
    # gone (it starts again); one that made a new lock file meanwhile keeps it (and the directory: rmdir fails)
    for name in (*STATE_FILES, "pod.lock"):
        with suppress(FileNotFoundError):
            os.unlink(os.path.join(d, name))
    with suppress(OSError):
        os.rmdir(d)
        items.append({"kind": "pod", "path": d, "pod": pod.key})
    with suppress(OSError):
        os.rmdir(os.path.dirname(d))  # the run's pods directory, when this was its last
    return items


def _kill(backend, pod: Pod) -> list[dict]:
    """Everything in the pod's place (the keeper, a forwarder), verified gone, and the place removed; without a
    tree, the keeper alone through a checked pidfd."""
    import signal
    items = []
    place = pod.place
    if place.node is not None:
        if place.dir and os.path.isdir(place.dir):
            method, empty = backend.kill_place(place)
            removed = backend.remove(place) if empty else []
            items += [{"kind": "cgroup", "path": p} for p in removed]
            if not empty:
                items.append({"kind": "pod_place", "path": place.dir, "left": "still populated after the kill"})
        return items
    k = pod.keeper
    if k.get("pid") and k.get("boot_id") == proc.boot_id():
        ok, _ = pidfd.signal_if(k["pid"], signal.SIGKILL,
                                lambda fd: pidfd.matches(fd, k["pid"], k.get("pidfd_ino"), k.get("starttime")))
        if ok:
            items.append({"kind": "pod_keeper", "pid": k["pid"]})
    return items


def sweep(state, backend, run_id: str | None = None) -> list[dict]:
    """Every pod (of `run_id`, or all) no live cell holds: torn down. A member's lock keeps its pod."""
    items: list[dict] = []
    top = root(state)
    runs = [run_id] if run_id is not None else _listdir(top)
    for run in runs:
        for agent in _listdir(os.path.join(top, run)):
            items += _teardown_if_free(backend, os.path.join(top, run, agent))
    return items


def _listdir(d: str) -> list[str]:
    try:
        return sorted(os.listdir(d))
    except OSError:
        return []
