"""A fake backend: the kernel's part of a host (cgroup directories, processes,
signals, the /proc view) in memory, behind the same interface as the real
backends, so the layers above them are unit-tested without root or processes;
and a fake process layer (FakeProcesses) in place of the supervisor's spawn,
release, abandon and collect, so the broker and supervisor.Supervisor are too.

tests/unit holds pure logic over this fake: no root, no cgroups, no cell
processes; `pytest tests/unit` runs in seconds anywhere."""
from __future__ import annotations

import os
import signal

from agnsup.backend.base import Backend, Place
from agnsup.linux import cgroup, session

# The host's facts as the compiler reads them (linux/host.protections): everything in force, Landlock ABI 6
# (no audit reader is opened), as root; "mapped_uid" set: no id-mapped mount is probed.
HOST = {"seccomp": None, "landlock": None, "landlock_scopes": None, "no_new_privs": None, "pid_namespace": None,
        "capabilities": None, "mapped_uid": "not in unit tests", "_abi": 6, "_root": True, "_cap_last": 40}


class FakeProc:
    def __init__(self, pid, start, sid, dir=None, token=None, ignores_term=False, unkillable=False, comm="sh"):
        self.pid, self.starttime, self.sid, self.dir, self.token = pid, start, sid, dir, token
        self.ignores_term, self.unkillable, self.comm = ignores_term, unkillable, comm
        self.alive, self.stopped = True, False
        self.signals: list[int] = []
        self.status: int | None = None   # its exit status once it exited by itself (exit)
        self.pidfd_w: int | None = None  # FakeProcesses: the write end of the pipe standing in for its pidfd
        self.stdio: tuple = ()  # FakeProcesses: its fds 0-2 as it got them (copies, closed when it ends)

    def exit(self, status: int | None = None) -> None:
        """It ends (by itself with `status`, or by its last signal): its pidfd becomes readable."""
        self.alive, self.status = False, status
        for fd in {*self.stdio} - {None}:
            os.close(fd)
        self.stdio = ()
        if self.pidfd_w is not None:
            os.close(self.pidfd_w)
            self.pidfd_w = None


class FakeKernel:
    def __init__(self):
        self.procs: dict[int, FakeProc] = {}
        self.dirs: dict[str, int] = {}   # cgroup directory -> inode
        self._ino = 1000

    def spawn(self, pid, start=100, sid=None, dir=None, **kw) -> FakeProc:
        p = FakeProc(pid, start, sid if sid is not None else pid, dir, **kw)
        self.procs[pid] = p
        return p

    def mkdir(self, path: str) -> int:
        self._ino += 1
        self.dirs[path] = self._ino
        return self._ino

    def deliver(self, pid: int, sig: int) -> bool:
        p = self.procs.get(pid)
        if p is None or not p.alive:
            return False
        p.signals.append(sig)
        if sig == signal.SIGSTOP:
            p.stopped = True
        elif (sig == signal.SIGKILL or (sig == signal.SIGTERM and not p.ignores_term)) and not p.unkillable:
            p.exit()
        return True

    def live(self) -> list[FakeProc]:
        return [p for p in self.procs.values() if p.alive]


class FakeBackend(Backend):
    kind = "fake"

    def __init__(self, kernel: FakeKernel, trees: bool = True):
        self.k, self.trees = kernel, trees
        self.tracking = "fake" if trees else "session+token"
        self.env_blocked = () if trees else ("ENV_BLOCKED: cgroup",)
        self.kills: list[str] = []

    def place(self, run_id, agent_id, cell_id, limits) -> Place:
        if not self.trees:
            return Place()
        return Place(node=cgroup.Node({"v2": f"/fake/run-{run_id}/agent-{agent_id}/cell-{cell_id}"}))

    def create(self, place, limits) -> Place:
        return Place(node=place.node, inode=self.k.mkdir(place.dir), limits={"pids": "v2:" + place.dir})

    def from_journal(self, paths, inode):
        if not paths:
            return None, "no cgroup journaled for the cell", []
        d = paths["v2"]
        if d not in self.k.dirs:
            return None, f"cgroup {d} does not exist", []
        if self.k.dirs[d] != inode:
            return None, f"cgroup {d} was recreated", self._in(d)
        return Place(node=cgroup.Node(paths), inode=inode), "", []

    def scope(self, run_id, agent_id=None) -> Place:
        d = f"/fake/run-{run_id}" + (f"/agent-{agent_id}" if agent_id else "")
        return Place(node=cgroup.Node({"v2": d}))

    def cells_under(self, scope) -> set[str]:
        return {d for d in self.k.dirs if d.startswith(scope.dir + "/") and "/cell-" in d}

    def _in(self, d: str) -> list[int]:
        return [p.pid for p in self.k.live() if p.dir and (p.dir == d or p.dir.startswith(d + "/"))]

    def members(self, place) -> list[int]:
        return self._in(place.dir) if place.dir else []

    def populated(self, place) -> bool:
        return bool(self.members(place))

    def signal(self, place, sig) -> int:
        return sum(self.k.deliver(pid, sig) for pid in self.members(place))

    def kill(self, place) -> str:
        self.kills.append(place.dir)
        for pid in self.members(place):
            self.k.deliver(pid, signal.SIGKILL)
        return "fake.kill"

    def wait_empty(self, place, timeout) -> bool:
        return not self.populated(place)

    def remove(self, place) -> list[str]:
        gone = sorted((d for d in self.k.dirs if d == place.dir or d.startswith(place.dir + "/")), reverse=True)
        for d in gone:
            del self.k.dirs[d]
        return gone

    # -- the process evidence ---------------------------------------------
    def snapshot(self, exclude=()):
        return session.Snapshot({p.pid: session.Proc(p.pid, p.comm, "T" if p.stopped else "S", p.sid, p.sid,
                                                     p.starttime, p.token)
                                 for p in self.k.live() if p.pid not in exclude})

    def signal_checked(self, cand, sig, recheck):
        ok, why = recheck(None, cand)
        return (self.k.deliver(cand["pid"], sig), why) if ok else (False, why)

    def dead(self, pid, starttime) -> bool:
        p = self.k.procs.get(pid)
        return p is None or not p.alive or p.starttime != starttime

    def leader_matches(self, pid, pidfd_ino, starttime):
        p = self.k.procs.get(pid)
        if p is None or not p.alive:
            return None, f"pid {pid} is gone"
        if p.starttime != starttime:
            return False, f"pid {pid} start time {p.starttime} differs from the journaled {starttime}: reused"
        return True, "start time matches"

    def recheck(self, fd, cand, leader, evidence):
        p = self.k.procs.get(cand["pid"])
        if p is None or not p.alive or p.starttime != cand["starttime"]:
            return False, "changed between the scan and the signal"
        if "leader" in cand["recheck"]:
            return True, "leader"
        if ("session" in cand["recheck"] and p.sid == evidence.leader) or \
                ("token" in cand["recheck"] and p.token == evidence.token):
            return True, "evidence holds"
        return False, "evidence gone"


class FakeChild:
    """What the process layer hands the broker for a leader it started (the fields of
    process.leader.Child the layers above read)."""

    def __init__(self, pid: int, pidfd: int, identity: dict):
        self.pid, self.pidfd, self.identity = pid, pidfd, identity
        self.cgroup_join, self.egress_listener, self.tmp_used = "fake", None, None


class FakeProcesses:
    """The process layer the broker calls (spawn, release, abandon, collect) over a FakeKernel:
    a cell's leader is a FakeProc in its place's directory, its pidfd the read end of a pipe that
    becomes readable when the FakeProc ends (so the real Waiter waits for it). `calls` records
    what was done in order; `fail` = {"spawn" | "release": error} raises there, as a child whose
    setup failed does; `on_release(child)` runs just before the command would exec."""

    def __init__(self, kernel: FakeKernel):
        self.k = kernel
        self.calls: list[tuple[str, int | None]] = []
        self.fail: dict[str, Exception] = {}
        self.on_release = None
        self._pid = 5000

    def spawn(self, plan, backend, place, stdio=None, forker=None, ctty=False, netns_fd=None,
              tmp_spare=None, mount_spare=None, spare=None) -> FakeChild:
        def fork():
            if "spawn" in self.fail:
                raise self.fail["spawn"]
            self._pid += 1
            r, w = os.pipe2(os.O_CLOEXEC)
            p = self.k.spawn(self._pid, start=self._pid * 10, dir=place.dir, token=plan.spec.token)
            p.pidfd_w = w
            p.stdio = tuple(None if fd is None else os.dup(fd) for fd in stdio or ())
            return FakeChild(p.pid, r, {"pid": p.pid, "pidfd_ino": None, "starttime": p.starttime, "pgid": p.pid,
                                        "boot_id": "fake-boot"})
        self.calls.append(("spawn", None))
        return fork()  # a Supervisor's would be born in its fork server (process/forkserver.py): none here

    def release(self, plan, child) -> None:
        self.calls.append(("release", child.pid))
        if self.on_release is not None:
            self.on_release(child)
        if "release" in self.fail:  # its setup failed: it left, reaped by release
            self.k.procs[child.pid].exit(127)
            os.close(child.pidfd)
            raise self.fail["release"]

    def abandon(self, child, read_report: bool = False) -> bytes:
        self.calls.append(("abandon", child.pid))
        self.k.procs[child.pid].exit(None)  # it sees EOF at the barrier and leaves without exec
        os.close(child.pidfd)
        return b""

    def collect(self, child) -> tuple[int | None, int | None]:
        self.calls.append(("collect", child.pid))
        os.close(child.pidfd)
        p = self.k.procs[child.pid]
        assert not p.alive, "collect of a leader that did not end"
        return (p.status, None) if p.status is not None else (None, p.signals[-1] if p.signals else signal.SIGKILL)

    def netns_tries(self, child, read: bool) -> dict | None:
        return None  # a fake leader has no network namespace to count in

    def ask_reap(self, child) -> None:
        pass  # no fork server: collect reaps at once

    def install(self, monkeypatch) -> "FakeProcesses":
        """In place of the real process layer, where the broker calls it (the one line to change when it moves)."""
        from agnsup.process import leader
        for name in ("spawn", "release", "abandon", "collect", "netns_tries", "ask_reap"):
            monkeypatch.setattr(leader, name, getattr(self, name))
        from agnsup import broker  # nor the keeper of a network pod (agnsup/pod.py): a cell here joins none
        monkeypatch.setattr(broker.Controller, "_join_pod", lambda ctl, cell: None)
        return self


class FakeHost:
    """What the tests of the broker and the layers above start from: a worktree, a FakeKernel with its
    FakeBackend, FakeProcesses in place of the process layer, and the host's facts fixed (HOST)."""

    def __init__(self, tmp_path, monkeypatch):
        from agnsup.linux import host
        monkeypatch.setattr(host, "protections", lambda: HOST)
        self.wt = str(tmp_path / "wt")
        os.mkdir(self.wt)
        self.state_dir = str(tmp_path / "state")
        self.k = FakeKernel()
        self.backend = FakeBackend(self.k)
        self.procs = FakeProcesses(self.k).install(monkeypatch)
