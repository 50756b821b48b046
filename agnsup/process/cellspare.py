"""A Supervisor's spare cells (issue 29, seventh round): the next cell of an agent made ahead, its cgroup included.

A leader born by clone3(CLONE_INTO_CGROUP) joins its cgroup2 directory for free; one that joins later by a
cgroup.procs write waits the kernel's RCU grace period (~8 ms here, docs/performance.md). A cell's cgroup is named
by its id (run-R/agent-A/cell-C, and cgroup2 refuses renames), so a leader made ahead needs its cell's id chosen
ahead. After a cell of run R / agent A concluded (its thread, off the request's path, beside leader.TmpSpare), the
controller picks the id the next request of R/A that names none would get (spec.new_cell_id), makes that cell's
cgroup directories with the last plan's limits (backend.create), and has the fork server clone a leader into them
(forkserver.Client.park), which runs the steps that need no plan (steps.park) and waits on its socketpair.

A request of R/A that names no cell id is given the spare's id (Supervisor._start, before the gate); the broker
takes the spare when the cell's key is the spare's and its leader is alive (take): the intent and inode
transactions as for any cell (the inode is the made-ahead directory's), then the Setup is sent to the parked leader
(forkserver.bind), which runs the rest of steps.STEPS up to its barrier. No mkdir, no limit write, no fork
server round trip on the path. Anything else (another key, the leader gone: a cancel of its agent killed it, its
server died) discards it: its socketpair closed, the leader exits without exec, its directories removed, and the
cell is made as without a spare.

What a spare carries of another cell: nothing. Its directories are new (never a cell's), its leader closed every
fd of the server's before it waits (steps.park), and its key holds everything the made-ahead parts were made from
(the clone's flags, the seccomp filter's groups, the limits, the hierarchies). A dead controller's spare is an
empty cell directory no journal row names (its leader died with the fork server: PR_SET_PDEATHSIG), which the
janitor's sweep removes (backend.sweep_ancestors); a live one's holds its leader, and rmdir(2) refuses it.
"""
from __future__ import annotations

import os
import select
import threading
from contextlib import suppress

from ..util.record import replace
from .helpers import shelve


def key_of(plan, paths: dict) -> tuple | None:
    """What a spare is made from and a cell must have to take it; None: no spare for such a plan. Only a leader that
    dies with its controller (it parks with the parent-death signal set) and needs no user namespace (no clone
    flag of the user's, no pod's user namespace to join) in a cgroup2 directory it can be born in."""
    if not plan.dies_with_controller or plan.user_namespace or "v2" not in paths:
        return None
    return (plan.dies_with_controller, bool(plan.pid_namespace), plan.seccomp_refuse,
            tuple(sorted((k, repr(v)) for k, v in plan.limits.items())), tuple(sorted(paths)))


class Spare:
    """One spare cell: its ids, its made place (backend.create's Place), and its parked leader."""

    def __init__(self, run_id: str, agent_id: str, cell_id: str, place, key: tuple, backend):
        self.run_id, self.agent_id, self.cell_id = run_id, agent_id, cell_id
        self.place, self.key, self.backend = place, key, backend
        self.pid: int | None = None
        self.pidfd: int | None = None
        self.chan: int | None = None   # its reap channel (the fork server's child, as any leader)
        self.lead: int | None = None   # our end of its socketpair: its Setup, or EOF
        self.born = False
        self._ending = threading.Lock()  # discard, from a cell's thread, the forker's or the Supervisor's close

    def fits(self, plan, place) -> bool:
        """The cell of `plan`, whose place the broker planned at its intent, may take this spare: the same key and
        directories, and the leader alive (a readable pidfd: it exited)."""
        if place.node is None or place.node.paths != self.place.node.paths:
            return False
        if key_of(plan, place.node.paths) != self.key:
            return False
        return self.pidfd is not None and not select.select([self.pidfd], [], [], 0)[0]

    def bound(self) -> tuple[int, int, bool, int]:
        """The leader's (pid, pidfd, born, reap channel), handed over to the cell (leader.spawn): no longer ours."""
        out = (self.pid, self.pidfd, self.born, self.chan)
        self.pidfd = self.chan = self.lead = self.place = None
        return out

    def discard(self, keep_place: bool = False) -> None:
        """Its leader told to exit (EOF on its socketpair) and reaped by its server; its directories removed (unless
        `keep_place`: a cell took them, and its end removes them). Idempotent, best effort."""
        with self._ending:
            self._discard(keep_place)

    def _discard(self, keep_place: bool) -> None:
        from . import forkserver
        if self.lead is not None:
            os.close(self.lead)
            self.lead = None
        if self.chan is not None:
            chan, self.chan = self.chan, None
            forkserver.reap(chan)  # answered once it exited (at once: EOF); None when the server is gone
        if self.pidfd is not None:
            # its exit before its directories go (rmdir: EBUSY while it is in them); a server gone killed it already
            select.select([self.pidfd], [], [], 5.0)
            os.close(self.pidfd)
            self.pidfd = None
        place, self.place = self.place, None
        if place is not None and not keep_place:
            with suppress(OSError):
                self.backend.remove(place)
            if place.oom_fd is not None:
                os.close(place.oom_fd)


MAKING_WAIT = 2.0  # seconds a request naming the id of a spare being made waits for it (its mkdir, its clone: ~ms)


class CellSpares:
    """A Supervisor's spares, one per (run, agent) for at most SLOTS of them. `server`: its fork server
    (forkserver.Client); `new_id()`: a fresh cell id; `taken(run_id, cell_id)`: that cell id is in use (its state
    directory exists); `later(fn)`: runs fn off the caller's path (a discard: a reap and a few rmdirs)."""

    SLOTS = 4

    def __init__(self, backend, server, new_id, taken, later):
        self.backend, self.server, self.new_id, self.taken, self.later = backend, server, new_id, taken, later
        self._guard = threading.Lock()
        self._ready: dict[tuple[str, str], Spare] = {}
        self._given: dict[tuple[str, str], Spare] = {}  # (run, cell id) -> a spare given to a request, not yet taken
        self._namers: dict[tuple[str, str], object] = {}  # (run, agent) -> the id its next cell will name (name)
        self._making: dict[tuple[str, str], str] = {}  # (run, agent) -> the id of its spare being made now
        self._made = threading.Condition(self._guard)
        self.closed = False

    NAMERS = 64  # (run, agent) pairs whose doors name their cells, kept (the oldest let go)

    def name(self, run_id: str, agent_id: str, next_id) -> None:
        """A door that names its cells (sandboxd's p-N) says which id the next cell of run_id/agent_id will name:
        `next_id()`, asked when that agent's spare is made, is the id it is made under (else spec.new_cell_id)."""
        with self._guard:
            self._namers.pop((run_id, agent_id), None)
            self._namers[(run_id, agent_id)] = next_id
            while len(self._namers) > self.NAMERS:
                self._namers.pop(next(iter(self._namers)))

    def offer(self, run_id: str, agent_id: str, cell_id: str | None = None) -> str | None:
        """The cell id for a request of run_id/agent_id, when a spare is ready for them and the request names no
        cell id or the very id the spare was made under: the spare is then the request's (take, or give_back when
        its cell never reaches the broker). A request naming another id leaves the spare ready, unless its door names
        the agent's cells (name): then the spare's id is one it will not ask for (another request took that number
        first), and the spare is discarded, off the path, so that the next is made under the right one."""
        with self._guard:
            slot = (run_id, agent_id)
            if cell_id is not None and self._making.get(slot) == cell_id:
                # its spare is being made under this very id (its directories may exist already): taken once made
                self._made.wait_for(lambda: slot not in self._making, MAKING_WAIT)
            sp = self._ready.get(slot)
            if sp is None or (cell_id not in (None, sp.cell_id) and slot not in self._namers):
                return None
            del self._ready[slot]
            if cell_id in (None, sp.cell_id):
                self._given[(run_id, sp.cell_id)] = sp
                return sp.cell_id
        self.later(sp.discard)  # stale: its door names another id now
        return None

    def give_back(self, run_id: str, cell_id: str, now: bool = False) -> None:
        """A request given a spare's id whose cell did not take it at once: discarded (its id was used: never again).
        Off the path (`later`) when the request ended (refused, denied); `now` when its cell lives on with the id
        (queued behind a worktree lock): the directories go before its own are made."""
        with self._guard:
            sp = self._given.pop((run_id, cell_id), None)
        if sp is not None:
            sp.discard() if now or self.closed else self.later(sp.discard)

    def take(self, plan, place) -> Spare | None:
        """The spare given to this cell (plan.spec's run and cell id), if it fits the cell's plan and place; None:
        made without one. A spare that does not fit is discarded now: the cell has its id, so its directories are
        the cell's paths, made again by the cell (rare: a role or a limit changed, or its leader was killed)."""
        spec = plan.spec
        with self._guard:
            sp = self._given.pop((spec.run_id, spec.cell_id), None)
        if sp is None:
            return None
        if sp.fits(plan, place):
            return sp
        sp.discard()
        return None

    def refill(self, plan) -> None:
        """A spare for the next cell of plan's run and agent, with plan's key, unless one is ready. Best effort: what
        fails makes none."""
        spec = plan.spec
        slot = (spec.run_id, spec.agent_id)
        with self._guard:
            if self.closed or slot in self._ready or slot in self._making or not self.server.alive():
                return
            namer = self._namers.get(slot)
            cell_id = (namer() if namer is not None else None) or self.new_id()
            self._making[slot] = cell_id  # a request naming this id meanwhile waits for it (offer)
        try:
            self._refill(plan, slot, cell_id)
        finally:
            with self._guard:
                del self._making[slot]
                self._made.notify_all()

    def _refill(self, plan, slot: tuple[str, str], cell_id: str) -> None:
        spec = plan.spec
        if self.taken(spec.run_id, cell_id):
            return
        place = self.backend.place(spec.run_id, spec.agent_id, cell_id, plan.limits)
        key = key_of(plan, place.node.paths) if place.node is not None else None
        if key is None:
            return
        try:
            place = self.backend.create(place, plan.limits)
        except Exception:  # noqa: BLE001 - best effort: what fails makes none, and the cell's own path is as before
            return
        sp = Spare(spec.run_id, spec.agent_id, cell_id, place, key, self.backend)
        try:
            early = {"pid_namespace": bool(plan.pid_namespace), "backend": self.backend,
                     "place": replace(place, oom_fd=None) if place.oom_fd is not None else place,
                     "filter": plan.seccomp_refuse}
            sp.pid, sp.pidfd, sp.born, sp.chan, sp.lead = self.server.park(early, self.backend.clone_dir(place))
        except Exception:  # noqa: BLE001 - best effort (a backend a test patched may not even pickle)
            sp.discard()
            return
        with self._guard:
            drop = shelve(self._ready, slot, sp, self.SLOTS, self.closed)
        for old in drop:
            old.discard()

    def close(self) -> None:
        """Every spare discarded now (the Supervisor's close, before its fork server stops)."""
        with self._guard:
            self.closed = True
            left = [*self._ready.values(), *self._given.values()]
            self._ready, self._given = {}, {}
        for sp in left:
            sp.discard()
