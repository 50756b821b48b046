"""A fake backend: the kernel's part of a host (cgroup directories, processes,
signals, the /proc view) in memory, behind the same interface as the real
backends, so the layers above them are unit-tested without root or processes.

tests/unit holds pure logic over this fake: no root, no cgroups, no cell
processes; `pytest tests/unit` runs in seconds anywhere."""
from __future__ import annotations

import signal

from agnsup.backend.base import Backend, Place
from agnsup.linux import cgroup, session


class FakeProc:
    def __init__(self, pid, start, sid, dir=None, token=None, ignores_term=False, unkillable=False, comm="sh"):
        self.pid, self.starttime, self.sid, self.dir, self.token = pid, start, sid, dir, token
        self.ignores_term, self.unkillable, self.comm = ignores_term, unkillable, comm
        self.alive, self.stopped = True, False
        self.signals: list[int] = []


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
        elif sig == signal.SIGKILL or (sig == signal.SIGTERM and not p.ignores_term):
            p.alive = p.unkillable
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
