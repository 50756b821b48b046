"""Cancel and cleanup: stop a cell, an agent, a run (or everything) from any
process that can open the state root; reclaim what a run's ended cells left.

The journal and the kernel objects are the authority, not some controller's
memory, so `agnsup cancel` works whichever controller started the cells:

1. record: one transaction sets each live cell's cancel reason (first reason
   wins, like a trio cancel scope) and, for a run, marks the run `cancelled`
   so it refuses new cells; a cell still setting up sees the reason at its
   identity commit and never runs its command;
2. SIGTERM every process of the scope (each through a pidfd, membership
   rechecked), wait the grace period;
3. kill through the scope's cgroup directory: run/agent/cell directories
   mirror the hierarchy, so one write reaches the whole scope; per cell when
   the scope directory also holds cells that are not being cancelled;
4. verify every cell's cgroup empty, then wait for each cell's controller to
   write its receipt (state `cancelled`); a controller that died meanwhile is
   left to the janitor, which runs right here.

Every cgroup is checked against its journaled directory inode before a signal:
a recreated directory at the same path is not the cell's.
"""
from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass

from . import crashpoints
from .errors import AmbiguousId, CellsStillRunning, UnknownId, UsageError
from .journal import TERMINAL_CELL

LIVE = "state NOT IN (" + ",".join(f"'{s}'" for s in TERMINAL_CELL) + ")"
DEFAULT_GRACE = 3.0
CONCLUDE_TIMEOUT = 15.0  # how long the cells' controllers get to write their receipts


@dataclass(frozen=True)
class Scope:
    kind: str                  # cell | agent | run | all
    run_id: str | None = None
    agent_id: str | None = None
    cell_id: str | None = None

    def label(self) -> str:
        return {"cell": f"cell {self.cell_id} of run {self.run_id}",
                "agent": f"agent {self.agent_id} of run {self.run_id}",
                "run": f"run {self.run_id}", "all": "every live cell"}[self.kind]

    def where(self) -> tuple[str, tuple]:
        if self.kind == "cell":
            return "run_id=? AND cell_id=?", (self.run_id, self.cell_id)
        if self.kind == "agent":
            return "run_id=? AND agent_id=?", (self.run_id, self.agent_id)
        if self.kind == "run":
            return "run_id=?", (self.run_id,)
        return "1=1", ()


def resolve(journal, cell: str | None = None, run: str | None = None, agent: str | None = None,
            everything: bool = False) -> Scope:
    """The scope the options name, checked against the journal (UnknownId, AmbiguousId)."""
    db = journal.db
    if everything:
        if cell is not None or run is not None or agent is not None:
            raise UsageError("--all stands alone: do not combine it with --cell, --run or --agent")
    elif cell is not None and agent is not None:
        raise UsageError("give --cell C [--run R], or --run R --agent A, or --run R, or --all")
    elif cell is None and run is None:
        raise UsageError("say what to cancel: --cell C [--run R], --run R --agent A, --run R, or --all"
                         if agent is None else "--agent needs --run: agent ids are scoped by run")
    if everything:
        return Scope("all")
    if cell is not None:
        if run is not None:
            if db.execute("SELECT 1 FROM cells WHERE run_id=? AND cell_id=?", (run, cell)).fetchone() is None:
                raise UnknownId(f"no cell {cell!r} in run {run!r} in the journal")
            return Scope("cell", run, None, cell)
        runs = [r[0] for r in db.execute("SELECT run_id FROM cells WHERE cell_id=? ORDER BY run_id", (cell,))]
        if not runs:
            raise UnknownId(f"no cell {cell!r} in the journal")
        if len(runs) > 1:
            raise AmbiguousId(f"cell id {cell!r} names cells in {len(runs)} runs ({', '.join(runs)}): "
                              "add --run R")
        return Scope("cell", runs[0], None, cell)
    if db.execute("SELECT 1 FROM runs WHERE run_id=?", (run,)).fetchone() is None:
        raise UnknownId(f"no run {run!r} in the journal")
    if agent is not None:
        if db.execute("SELECT 1 FROM cells WHERE run_id=? AND agent_id=? LIMIT 1", (run, agent)).fetchone() is None:
            raise UnknownId(f"no agent {agent!r} in run {run!r} in the journal")
        return Scope("agent", run, agent)
    return Scope("run", run)


def cancel(state, scope: Scope, grace: float | None = None, by: str | None = None) -> dict:
    """Stop every live cell of `scope`; return {"cancelled": N, "cells": [...], ...}.

    Idempotent: what already ended is not counted, so a repeat reports 0."""
    from . import janitor
    janitor.on_start(state)  # a dead controller's cells are the janitor's, not ours to cancel
    j = state.journal()
    try:
        return _Cancel(state, j, scope, grace, by).run()
    finally:
        j.close()


class _Cancel:
    def __init__(self, state, journal, scope: Scope, grace: float | None, by: str | None):
        from .linux import cgroup
        self.state, self.j, self.scope = state, journal, scope
        self.by = by or f"agnsup cancel (pid {os.getpid()})"
        self.reason = f"cancelled by {scope.label()} ({self.by})"
        self.grace = grace
        self.base = cgroup.base_node(cgroup.detect_layout(), state.path)

    def run(self) -> dict:
        t0 = time.monotonic()
        cells = self._record()
        grace = self.grace if self.grace is not None else self._policy_grace(cells)
        targets = [c for c in cells if c["node"] is not None]
        loose = [c for c in cells if c["node"] is None and c.get("session") is not None]
        for c in cells:
            if c["node"] is None and c.get("session") is None:
                c["notes"].append(c.pop("why_untouched"))
        sent = self._term(targets)
        sent.update(self._term_sessions(loose))
        crashpoints.hit("cancel_grace")
        self._wait_empty(targets, grace, loose)
        self._kill(targets)
        self._kill_sessions(loose)
        from .linux import cgroup
        for c in targets:
            c["empty"] = cgroup.wait_empty(c["node"], 10.0)
        concluded = self._conclude(cells)
        out_cells = []
        for c in cells:
            out_cells.append({"run_id": c["run_id"], "agent_id": c["agent_id"], "cell_id": c["cell_id"],
                              "state": concluded.get((c["run_id"], c["cell_id"]), c["state"]),
                              "signalled": sent.get((c["run_id"], c["cell_id"]), 0),
                              "kill": c.get("kill"), "empty": c.get("empty", True), "notes": c["notes"]})
        return {"cancelled": len(cells), "cells": out_cells, "scope": self.scope.label(), "reason": self.reason,
                "grace": grace, "duration": round(time.monotonic() - t0, 6)}

    # 1. record ---------------------------------------------------------------
    def _record(self) -> list[dict]:
        from .linux import cgroup
        where, args = self.scope.where()
        now = time.time()
        with self.j.tx() as db:
            rows = db.execute(f"SELECT * FROM cells WHERE {where} AND {LIVE} ORDER BY created_at", args).fetchall()
            for r in rows:
                db.execute("UPDATE cells SET cancel_reason=? WHERE run_id=? AND cell_id=? AND cancel_reason IS NULL",
                           (self.reason, r["run_id"], r["cell_id"]))
            if self.scope.kind == "run":
                db.execute("UPDATE runs SET state='cancelled', ended_at=?, cancel_reason=COALESCE(cancel_reason, ?) "
                           "WHERE run_id=? AND state='active'", (now, self.reason, self.scope.run_id))
            self.j.event(db, "cancel", self.scope.run_id, self.scope.cell_id, scope=self.scope.kind,
                         agent_id=self.scope.agent_id, reason=self.reason,
                         cells=[[r["run_id"], r["cell_id"]] for r in rows])
        cells = []
        for r in rows:
            c = {"run_id": r["run_id"], "agent_id": r["agent_id"], "cell_id": r["cell_id"], "state": r["state"],
                 "role": r["role"], "pid": r["pid"], "pidfd_ino": r["pidfd_ino"], "starttime": r["starttime"],
                 "node": None, "notes": []}
            node = cgroup.Node(json.loads(r["cgroup"])) if r["cgroup"] else None
            prim = node.primary if node is not None else None
            if prim is None and r["pid"]:
                c["session"] = _session_evidence(r)
                c["notes"].append("no cgroup (ENV_BLOCKED: cgroup): found by session + token + start time")
            elif prim is None:
                c["why_untouched"] = "no cgroup and no process yet: the cell stops at its identity commit"
            elif r["cgroup_ino"] is None:
                c["why_untouched"] = "cgroup not yet created or not yet journaled: the cell stops at its identity commit"
            elif (ino := _dir_inode(prim[1])) == r["cgroup_ino"]:
                c["node"] = node
            else:
                c["why_untouched"] = (f"cgroup {prim[1]} is gone or recreated (inode {ino}, journaled "
                                      f"{r['cgroup_ino']}): nothing of the cell can be in it; not touched")
            cells.append(c)
        return cells

    def _policy_grace(self, cells: list[dict]) -> float:
        from . import policy
        from .errors import AgnsupError
        grace = 0.0
        for role in {c["role"] for c in cells}:
            try:
                grace = max(grace, float(policy.load(role, self.state.path)["limits"].get("grace", DEFAULT_GRACE)))
            except (AgnsupError, KeyError, TypeError, ValueError):
                grace = max(grace, DEFAULT_GRACE)
        return grace

    # 2. SIGTERM, grace -------------------------------------------------------
    def _term(self, cells: list[dict]) -> dict:
        from .linux import cgroup
        return {(c["run_id"], c["cell_id"]): cgroup.signal_all(c["node"], signal.SIGTERM) for c in cells}

    def _term_sessions(self, cells: list[dict]) -> dict:
        from .linux import session
        return {(c["run_id"], c["cell_id"]): len(session.signal_cell(c["session"], signal.SIGTERM)) for c in cells}

    def _kill_sessions(self, cells: list[dict]) -> None:
        from .linux import session
        for c in cells:
            killed = session.kill_cell(c["session"])
            c["kill"] = f"pidfd SIGSTOP+SIGKILL of {len(killed)} process(es) on session + token evidence"
            c["empty"] = all(k["verified_dead"] for k in killed)

    def _wait_empty(self, cells: list[dict], grace: float, loose: list[dict] = ()) -> None:
        from .linux import cgroup, session
        deadline = time.monotonic() + grace
        pending = list(cells) + list(loose)
        delay = 0.002
        while pending and time.monotonic() < deadline:
            snap = session.Snapshot.take(exclude=(os.getpid(),)) if any("session" in c for c in pending) else None
            pending = [c for c in pending if (cgroup.populated(c["node"]) if c["node"] is not None
                                             else bool(c["session"].find(snap)[0]))]
            if pending:
                time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
                delay = min(delay * 2, 0.05)

    # 3. kill -----------------------------------------------------------------
    def _kill(self, cells: list[dict]) -> None:
        from .linux import cgroup
        live = [c for c in cells if cgroup.populated(c["node"])]
        if not live:
            return
        crashpoints.hit("cancel_frozen")
        scope_node = self._scope_node(cells)
        if scope_node is not None:
            method = cgroup.kill(scope_node)
            for c in live:
                c["kill"] = f"{method} on {scope_node.primary[1]}"
            return
        for c in live:
            c["kill"] = cgroup.kill(c["node"])

    def _scope_node(self, cells: list[dict]):
        """The agent or run directory, when every cell under it is one we cancel
        (then one write kills the scope); else None (kill cell by cell)."""
        from .linux import cgroup
        s = self.scope
        if s.kind not in ("agent", "run") or self.base.primary is None:
            return None
        node = cgroup.scope_node(self.base, s.run_id, s.agent_id)
        prim = node.primary[1]
        ours = {os.path.realpath(c["node"].primary[1]) for c in cells}
        depth = 1 if s.kind == "agent" else 2
        found = set()
        for d in cgroup._walk(prim):
            rel = os.path.relpath(d, prim)
            if rel != "." and rel.count("/") == depth - 1:
                found.add(os.path.realpath(d))
        return node if found and found <= ours else None

    # 4. conclude -------------------------------------------------------------
    def _conclude(self, cells: list[dict]) -> dict:
        """Wait until each cell's controller wrote its receipt; recover the cells of
        controllers that died meanwhile. Returns {(run, cell): final state}."""
        from . import janitor
        keys = [(c["run_id"], c["cell_id"]) for c in cells]
        deadline = time.monotonic() + CONCLUDE_TIMEOUT
        states: dict = {}
        ran_janitor = False
        while True:
            for k in keys:
                row = self.j.db.execute("SELECT state FROM cells WHERE run_id=? AND cell_id=?", k).fetchone()
                states[k] = row[0]
            pending = [k for k in keys if states[k] not in TERMINAL_CELL]
            if not pending or time.monotonic() >= deadline:
                return states
            if not ran_janitor and time.monotonic() > deadline - CONCLUDE_TIMEOUT / 2:
                janitor.on_start(self.state)  # a controller that died mid-cancel leaves its cells to us
                ran_janitor = True
            time.sleep(0.01)


# -- cleanup -------------------------------------------------------------------
def cleanup(state, run_id: str) -> dict:
    """Reclaim what the run's ended cells left: cgroup directories, temp dirs,
    worktree lock files; then the run's own cgroup directories. Returns
    {"cleaned": N, "items": [...]}; a second call reports 0. Cells still
    running are not touched: CellsStillRunning names them (after the rest is clean)."""
    from . import janitor
    from .linux import cgroup
    from .reap import release_cell_resources, release_lock_file
    janitor.on_start(state)
    j = state.journal()
    try:
        run = j.run(run_id)
        if run is None:
            raise UnknownId(f"no run {run_id!r} in the journal")
        base = cgroup.base_node(cgroup.detect_layout(), state.path)
        items: list[dict] = []
        running = []
        for r in j.db.execute("SELECT * FROM cells WHERE run_id=? ORDER BY created_at", (run_id,)).fetchall():
            if r["state"] not in TERMINAL_CELL:
                running.append(r["cell_id"])
                continue
            node = _own_node(r)
            for it in release_cell_resources(node, r["tmpdir"]):
                items.append({**it, "cell_id": r["cell_id"]})
            rel = release_lock_file(r["lock_path"])
            if rel and "left" not in rel:
                items.append({**rel, "kind": "worktree_lock", "cell_id": r["cell_id"]})
        if not running:
            run_node = cgroup.scope_node(base, run_id)
            for h, p in run_node.paths.items():
                for d in cgroup._walk(p):  # empty agent directories, then the run's
                    if cgroup.remove_if_empty(d):
                        items.append({"kind": "cgroup", "path": d})
            for p in base.paths.values():
                cgroup.remove_if_empty(p)
        with j.tx() as db:
            if not running:
                db.execute("UPDATE runs SET state='finished', ended_at=? WHERE run_id=? AND state='active'",
                           (time.time(), run_id))
            if items:
                j.event(db, "cleanup", run_id, None, items=items)
        out = {"cleaned": len(items), "items": items, "run_id": run_id,
               "run_state": j.run(run_id)["state"], "running": running}
    finally:
        j.close()
    if running:
        raise CellsStillRunning(f"run {run_id} has {len(running)} cell(s) still running ({', '.join(running)}): "
                                f"not touched; cancel them first (agnsup cancel --run {run_id})", result=out)
    return out


def _own_node(row):
    """The cell's cgroup node if its directory is provably the cell's (journaled
    inode), else None: a recreated directory at the same path is not ours."""
    from .linux import cgroup
    if not row["cgroup"]:
        return None
    node = cgroup.Node(json.loads(row["cgroup"]))
    prim = node.primary
    if prim is None:
        return None
    ino = _dir_inode(prim[1])
    if ino is None:
        # the primary is gone; leftovers in other hierarchies (a crash between
        # two rmdirs) are empty directories of ours
        rest = {h: p for h, p in node.paths.items() if h != prim[0] and os.path.isdir(p)}
        return cgroup.Node(rest) if rest else None
    return node if ino == row["cgroup_ino"] else None


def _dir_inode(path: str) -> int | None:
    """The inode of a cgroup directory now (None if gone): compared with the journaled one."""
    try:
        return os.stat(path).st_ino
    except FileNotFoundError:
        return None


def _session_evidence(row):
    """A cell without a cgroup: its session (the leader's pid, if the leader is
    still the journaled process), its token and its start (linux/session.py)."""
    from .linux import pidfd, session
    ok, why = None, ""
    fd = pidfd.open(row["pid"])
    if fd is not None:
        try:
            ok, why = pidfd.matches(fd, row["pid"], row["pidfd_ino"], row["starttime"])
        finally:
            os.close(fd)
    return session.Evidence(row["pid"], ok, row["token"], row["starttime"] or 0, why)
