"""Cancel and cleanup: stop a cell, an agent, a run (or everything) from any
process that can open the state root; reclaim what a run's ended cells left.

The journal and the kernel objects are the authority, not some controller's
memory, so `agnsup cancel` works whichever controller started the cells:

1. record: one transaction sets each live cell's cancel reason (first reason
   wins, like a trio cancel scope) and, for a run, marks the run `cancelled`
   so it refuses new cells; a cell still setting up sees the reason at its
   identity commit and never runs its command; one past that commit but not yet
   `running` (its forked leader may not be in its cgroups yet: nothing to find
   below) sees it when it is marked running, and its controller stops it;
2. stop (the reaper): SIGTERM every process of the scope (each through a pidfd,
   membership rechecked), the grace period, then the kill through the scope's
   cgroup directory (run/agent/cell directories mirror the hierarchy, so one
   write reaches the whole scope; per cell when the scope directory also holds
   cells that are not being cancelled), verified empty;
3. wait for each cell's controller to write its receipt (state `cancelled`); a
   controller that died meanwhile is left to the janitor, which runs right here.

A cell's tree is touched only through backend.from_journal: a directory
recreated at the same path (another inode) is not the cell's.
"""
from __future__ import annotations

import os
import time

from .errors import AgnsupError, AmbiguousId, CellsStillRunning, StateError, UnknownId, UsageError
from .store.journal import TERMINAL_CELL
from .util.record import Record

DEFAULT_GRACE = 3.0       # for a cell journaled before its grace was (schema 2)
CONCLUDE_TIMEOUT = 15.0   # how long the cells' controllers get to write their receipts
CONCLUDE_FAST = 0.5       # s of looking every millisecond for their receipts (then every 10 ms)


class Scope(Record, frozen=True):
    kind: str                  # cell | agent | run | all
    run_id: str | None = None
    agent_id: str | None = None
    cell_id: str | None = None

    def label(self) -> str:
        return {"cell": f"cell {self.cell_id} of run {self.run_id}",
                "agent": f"agent {self.agent_id} of run {self.run_id}",
                "run": f"run {self.run_id}", "all": "every live cell"}[self.kind]


def resolve(journal, cell: str | None = None, run: str | None = None, agent: str | None = None,
            everything: bool = False) -> Scope:
    """The scope the options name, checked against the journal (UnknownId, AmbiguousId)."""
    if everything:
        if cell is not None or run is not None or agent is not None:
            raise UsageError("--all stands alone: do not combine it with --cell, --run or --agent")
        return Scope("all")
    if cell is not None and agent is not None:
        raise UsageError("give --cell C [--run R], or --run R --agent A, or --run R, or --all")
    if cell is None and run is None:
        raise UsageError("say what to cancel: --cell C [--run R], --run R --agent A, --run R, or --all"
                         if agent is None else "--agent needs --run: agent ids are scoped by run")
    if cell is not None:
        if run is not None:
            if journal.cell(run, cell) is None:
                raise UnknownId(f"no cell {cell!r} in run {run!r} in the journal")
            return Scope("cell", run, None, cell)
        runs = journal.cell_runs(cell)
        if not runs:
            raise UnknownId(f"no cell {cell!r} in the journal")
        if len(runs) > 1:
            raise AmbiguousId(f"cell id {cell!r} names cells in {len(runs)} runs ({', '.join(runs)}): add --run R")
        return Scope("cell", runs[0], None, cell)
    if journal.run(run) is None:
        raise UnknownId(f"no run {run!r} in the journal")
    if agent is not None:
        if not journal.has_agent(run, agent):
            raise UnknownId(f"no agent {agent!r} in run {run!r} in the journal")
        return Scope("agent", run, agent)
    return Scope("run", run)


def cancel(state, scope: Scope, grace: float | None = None, by: str | None = None, backend=None,
           journal=None) -> dict:
    """Stop every live cell of `scope`; return {"cancelled": N, "cells": [...], ...}.
    `journal`: the caller's open Journal of `state` (it stays open), instead of a connection of our own.

    Idempotent: what already ended is not counted, so a repeat reports 0."""
    from . import backend as backends, janitor, reaper
    t0 = time.monotonic()
    reason = f"cancelled by {scope.label()} ({by or f'agnsup cancel (pid {os.getpid()})'})"
    backend = backend if backend is not None else backends.choose(state.path)
    j = journal if journal is not None else state.journal()
    try:
        janitor.on_start(state, j)  # a dead controller's cells are the janitor's, not ours to cancel
        try:
            rows = j.record_cancel(scope.kind, scope.run_id, scope.agent_id, scope.cell_id, reason)
        except StateError as e:  # read-only or full: kill first, then report what was not journaled
            return cancel_unjournaled(state, scope, grace, e, journal=j, backend=backend)
        if grace is None:
            grace = max((r["grace"] if r["grace"] is not None else DEFAULT_GRACE for r in rows), default=0.0)
        cells, targets = _targets(backend, rows)
        scope_place = backend.scope(scope.run_id, scope.agent_id) \
            if backend.trees and scope.kind in ("agent", "run") else None
        if scope_place is not None:  # a live Supervisor's spare cell of the scope (process/cellspare.py): killed too
            backend.drop_unjournaled(scope.run_id, lambda run, cell: j.cell(run, cell) is not None, scope.agent_id)
        if grace > 0:
            done = reaper.stop(backend, [t for _, t in targets], term=True, grace=grace, scope=scope_place,
                               list_left=False)
        else:
            # no grace period: only the leader's answer to SIGTERM counts (it is the cell's exit status: 143 when
            # the command obeyed it, cli.md); the rest of the tree is killed at once, not first sent SIGTERM one
            # pidfd at a time (~1,000 processes: 10-70 ms of a cancel, issue 29)
            termed = [reaper.term_leader(backend, t) for _, t in targets]
            done = reaper.stop(backend, [t for _, t in targets], scope=scope_place, list_left=False)
            for r, n in zip(done, termed):
                r.signalled += n
        for (c, _), r in zip(targets, done):
            c.update(signalled=r.signalled, kill=r.kill_note(), empty=r.empty)
            if r.error:
                c["notes"].append(r.error)
        states = _conclude(state, j, [(c["run_id"], c["cell_id"]) for c in cells])
        for c in cells:
            c["state"] = states.get((c["run_id"], c["cell_id"]), c["state"])
    finally:
        if journal is None:
            j.close()
    return {"cancelled": len(cells), "cells": cells, "scope": scope.label(), "reason": reason, "grace": grace,
            "duration": round(time.monotonic() - t0, 6)}


def _targets(backend, rows) -> tuple[list[dict], list]:
    """The result entry of each live cell row, and (entry, reaper target) for those with processes."""
    from . import reaper
    cells, targets = [], []
    for r in rows:
        c = {"run_id": r["run_id"], "agent_id": r["agent_id"], "cell_id": r["cell_id"], "state": r["state"],
             "notes": [], "kill": None, "empty": True, "signalled": 0}
        t, note, _ = reaper.from_row(backend, r)
        if note:
            c["notes"].append(note)
        if t.has_tree or (not backend.trees and t.leader):
            if not backend.trees:
                c["notes"].append("no cgroup (ENV_BLOCKED: cgroup): found by session + token + start time")
            targets.append((c, t))
        elif not t.leader:
            c["notes"].append("no process yet: the cell stops at its identity commit")
        cells.append(c)
    return cells, targets


def cancel_unjournaled(state, scope: Scope, grace: float | None, error, journal=None, backend=None) -> dict:
    """The kill switch when the journal cannot record the cancel (issue 12 items 3, 5):
    kill first, then say what could not be journaled. With a journal that still
    reads (a read-only or full state root), the scope's live cells are stopped on
    their journaled evidence as `cancel` would; with none (damaged, lost), only
    `--all` can act: every process under this state root's own cgroup root."""
    from . import backend as backends, reaper
    t0 = time.monotonic()
    backend = backend if backend is not None else backends.choose(state.path)
    grace = DEFAULT_GRACE if grace is None else grace
    out = {"cancelled": 0, "cells": [], "scope": scope.label(), "grace": grace, "journaled": False,
           "not_journaled": error.message}
    rows = None
    if journal is not None:
        try:
            rows = journal.cells(live_only=True, scope=(scope.kind, scope.run_id, scope.agent_id, scope.cell_id))
        except AgnsupError:
            rows = None
    if rows is not None:
        out["cells"], targets = _targets(backend, rows)
        for (c, _), r in zip(targets, reaper.stop(backend, [t for _, t in targets], term=True, grace=grace)):
            c.update(signalled=r.signalled, kill=r.kill_note(), empty=r.empty)
        out["cancelled"] = len(out["cells"])
    elif scope.kind == "all":
        out["evidence"] = "the kernel's: this state root's cgroup tree (no journal to read)"
        out["root"] = reaper.kill_root(backend, grace)
        out["cancelled"] = out["root"]["processes"]
    else:
        out["note"] = "without a readable journal only --all can act (every process under this state root's cgroups)"
    out["duration"] = round(time.monotonic() - t0, 6)
    return out


def _conclude(state, journal, keys: list[tuple[str, str]]) -> dict:
    """Wait until each cell's controller wrote its receipt; recover the cells of
    controllers that died meanwhile. Returns {(run, cell): final state}."""
    from . import janitor
    now = time.monotonic()
    deadline, fast_until = now + CONCLUDE_TIMEOUT, now + CONCLUDE_FAST
    ran_janitor = False
    states: dict = {}
    while True:
        pending = [k for k in keys if states.get(k) not in TERMINAL_CELL]
        states.update({k: journal.cell_state(*k) for k in pending})
        if all(s in TERMINAL_CELL for s in states.values()) or time.monotonic() >= deadline:
            return states
        if not ran_janitor and time.monotonic() > deadline - CONCLUDE_TIMEOUT / 2:
            janitor.on_start(state)  # a controller that died mid-cancel leaves its cells to us
            ran_janitor = True
        # the controllers conclude ~5-30 ms after the kill (pod, change layer, rmdirs, receipt): a look every
        # millisecond a cell (a read of the journal's WAL index, ~50 us) sees the end as it lands, where a
        # back-off's growing sleeps outlast it by up to half their last step; after CONCLUDE_FAST, every 10 ms
        live = sum(s not in TERMINAL_CELL for s in states.values())
        time.sleep(min(0.01, 0.001 * live) if time.monotonic() < fast_until else 0.01)


# -- cleanup -------------------------------------------------------------------
def cleanup(state, run_id: str) -> dict:
    """Reclaim what the run's ended cells left: cgroup directories, temp dirs,
    worktree lock files; then the run's own cgroup directories. Returns
    {"cleaned": N, "items": [...]}; a second call reports 0. Cells still
    running are not touched: CellsStillRunning names them (after the rest is clean)."""
    from . import backend as backends, janitor, reaper
    janitor.on_start(state)
    backend = backends.choose(state.path)
    j = state.journal()
    try:
        if j.run(run_id) is None:
            raise UnknownId(f"no run {run_id!r} in the journal")
        items: list[dict] = []
        running = []
        for r in j.cells(run_id):
            if r["state"] not in TERMINAL_CELL:
                running.append(r["cell_id"])
                continue
            done = reaper.reap(backend, reaper.from_row(backend, r)[0])
            items += [{**it, "cell_id": r["cell_id"]} for it in done.released]
        from . import pod  # the run's network pods no live cell holds (a killed controller's)
        items += pod.sweep(state, backend, run_id)
        if not running and backend.trees:
            # a live Supervisor's spare cell of the run (process/cellspare.py) first: its leader holds its directory
            items += [{"kind": "cgroup", "path": d} for d in
                      backend.drop_unjournaled(run_id, lambda run, cell: j.cell(run, cell) is not None)]
            items += [{"kind": "cgroup", "path": d} for d in backend.prune(backend.scope(run_id))]
        if not running:  # the run's change records (issue 26): their space freed, no longer undoable
            from . import changes
            items += [{"kind": "changes", "path": rec} for rec in changes.free_run(state, j, run_id)]
        j.finish_run(run_id, items)
        out = {"cleaned": len(items), "items": items, "run_id": run_id, "run_state": j.run(run_id)["state"],
               "running": running}
    finally:
        j.close()
    if running:
        raise CellsStillRunning(f"run {run_id} has {len(running)} cell(s) still running ({', '.join(running)}): "
                                f"not touched; cancel them first (agnsup cancel --run {run_id})", result=out)
    return out


def cleanup_older_than(state, before: float) -> dict:
    """`cleanup` of every run whose cells all ended before `before` (and that was not cleaned up
    yet); a run with a cell still live is left alone whatever its age (`skipped`). Returns
    {"cleaned": N, "items": [...], "runs": [{"run_id", "cleaned", "run_state"}], "skipped": [run ids]}."""
    from . import janitor
    janitor.on_start(state)  # a dead controller's cells are concluded first: their runs may be old now
    j = state.journal()
    try:
        old, busy = j.runs_ended_before(before)
    finally:
        j.close()
    out: dict = {"cleaned": 0, "items": [], "runs": [], "skipped": busy}
    for run_id in old:
        try:
            r = cleanup(state, run_id)
        except CellsStillRunning as e:  # a cell started in it meanwhile: cleaned but for that cell
            r = e.details["result"]
            out["skipped"].append(run_id)
        out["items"] += [{**it, "run_id": run_id} for it in r["items"]]
        out["runs"].append({"run_id": run_id, "cleaned": r["cleaned"], "run_state": r["run_state"]})
    out["cleaned"] = len(out["items"])
    return out
