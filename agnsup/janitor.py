"""The janitor: crash recovery, at every controller start and on demand.

For each controller instance that is dead (its liveness flock can be taken)
or from another boot, and each of its cells not yet in a terminal state:

1. collect candidates from /proc, on evidence only, never a PID alone:
   - membership of the cell's cgroup, and only when that directory's inode is
     the journaled one (a recreated directory is not the cell's);
   - the journaled leader's exact identity (pidfd inode, start time) on this boot;
   - outside the cgroup, a process on which two pieces agree: the cell's
     ownership token in its environment AND a start time inside the cell's life;
     or the cell's session (sid == the leader's pid, a number the kernel cannot
     reuse while the session has members, and not held now by another process)
     AND a start time inside the cell's life (linux/session.py: the only
     evidence besides the token where the cell has no cgroup, layout `none`);
2. journal the plan (event `recovery.kill`), kill (the tree through its cgroup,
   single processes through a checked pidfd: SIGSTOP all, then SIGKILL), verify;
   scan again until a scan finds none;
3. release through the one reap path (cgroup dirs, temp dir), remove the
   worktree lock file if nobody holds it;
4. in one transaction: the cell -> `recovered`, its run -> `recovered` when no
   other cell of it lives, a `recovery` receipt row; the receipt file is
   <state>/recovery/<janitor id>.json.

Every cell of every dead controller goes through these steps together: one
/proc scan per kill round serves all cells, one transaction journals a round's
plans, one the outcome (scripts/bench janitor: 100 cells of 10 processes).

A cell from another boot gets no signal at all: only records and files converge.
A live controller's cells are never touched. The controller row is marked
ended only once all its cells are terminal. A janitor killed halfway leaves
cells non-terminal, so the next one redoes the (idempotent) work and finishes;
its receipt carries the plans the earlier attempt journaled. Two janitors do
not race: <state>/janitor.lock.

`on_start(state)` is the controller-start hook: one indexed SELECT and a flock
probe per open controller when there is nothing to do.
"""
from __future__ import annotations

import json
import os
import secrets
import sqlite3
import sys
import time

from . import locks
from .journal import TERMINAL_CELL, TERMINAL_RUN
from .linux import proc

# Must stay textually identical to the partial index in journal/0002_janitor.sql.
LIVE_CELL = "state NOT IN (" + ",".join(f"'{s}'" for s in TERMINAL_CELL) + ")"
OPEN_SQL = ("SELECT id, boot_id, lock_path FROM controllers WHERE ended_at IS NULL "
            "UNION SELECT c.id, c.boot_id, c.lock_path FROM cells x JOIN controllers c ON c.id = x.controller_id "
            "WHERE x." + LIVE_CELL)
TOKEN_VAR = "AGNSUP_CELL_TOKEN"
LOCK_TIMEOUT = 120.0
COMPACT_RECEIPT = 200  # processes; a larger recovery receipt is written on one line
KILL_ROUNDS = 50  # without a cgroup a tree may fork between scan and kill: scan again


def _is_dead(boot: str, cboot: str, lock_path: str) -> bool:
    return cboot != boot or locks.is_free(lock_path)


def on_start(state) -> dict | None:
    """Run at every controller start: recover only when some controller instance is dead."""
    path = os.path.join(state.path, "journal.db")
    if not os.path.exists(path):
        return None
    try:
        db = sqlite3.connect(path, timeout=30)
        try:
            rows = db.execute(OPEN_SQL).fetchall()
        finally:
            db.close()
    except sqlite3.Error:
        return None  # the controller opens (and checks) the journal properly right after
    boot = proc.boot_id()
    if not any(_is_dead(boot, cboot, lock) for _, cboot, lock in rows):
        return None
    from .errors import AgnsupError
    try:
        report = run_janitor(state)
    except (AgnsupError, OSError, sqlite3.Error) as e:
        print(f"agnsup: janitor: recovery failed, continuing: {e}", file=sys.stderr, flush=True)
        return None
    if report["recovered"]:
        print(f"agnsup: janitor recovered {len(report['recovered'])} cell(s) of dead controller(s) "
              f"{', '.join(c['id'] for c in report['controllers'])} (agnsup receipts --recovery)",
              file=sys.stderr, flush=True)
    return report


def run_janitor(state_root, journal=None) -> dict:
    """Recover every dead controller instance's cells now. Returns the report
    {"recovered", "killed", "skipped", "receipt", "controllers"}."""
    from .state import StateRoot
    state = state_root if isinstance(state_root, StateRoot) else StateRoot(str(state_root))
    state.ensure()
    own = journal is None
    j = state.journal() if own else journal
    lock_path = os.path.join(state.path, "janitor.lock")
    fd = locks.acquire(lock_path, True, LOCK_TIMEOUT, "janitor", f"janitor pid {os.getpid()}")
    try:
        return _Janitor(state, j).run()
    finally:
        locks.release(lock_path, fd)
        if own:
            j.close()


class _Cell:
    """One cell under recovery: its journal row, its receipt entry, its evidence."""
    __slots__ = ("cid", "row", "entry", "node", "signals", "error", "seen_spared")

    def __init__(self, cid: str, row, entry: dict, signals: bool):
        self.cid, self.row, self.entry, self.signals = cid, row, entry, signals
        self.node = None
        self.error: str | None = None
        self.seen_spared: set[tuple] = set()


class _Janitor:
    def __init__(self, state, journal):
        from .linux import cgroup
        self.state, self.j = state, journal
        self.id = "jan-" + secrets.token_hex(6)
        self.boot = proc.boot_id()
        self.base = cgroup.base_node(cgroup.detect_layout(), state.path)
        self.receipt_path = os.path.join(state.path, "recovery", self.id + ".json")
        self.receipt: dict | None = None

    # -- the pass ---------------------------------------------------------
    def run(self) -> dict:
        t0 = time.time()
        report = {"recovered": [], "killed": [], "skipped": [], "receipt": None, "controllers": []}
        rows = self.j.db.execute(OPEN_SQL).fetchall()
        dead: list[tuple[dict, str]] = []
        cells: list[_Cell] = []
        for cid, cboot, lock in rows:
            if not _is_dead(self.boot, cboot, lock):
                for c in self._live_cells(cid):
                    report["skipped"].append({"run_id": c["run_id"], "cell_id": c["cell_id"], "controller": cid,
                                              "reason": f"controller {cid} is alive (holds {lock}): never touched"})
                continue
            if self.receipt is None:
                self.receipt = {"kind": "recovery", "version": 1, "janitor": self.id, "pid": os.getpid(),
                                "boot_id": self.boot, "started_at": t0, "controllers": []}
            ctl, its = self._controller(cid, cboot, lock)
            self.receipt["controllers"].append(ctl)
            dead.append((ctl, lock))
            cells.extend(its)
        if cells:
            # every cell of every dead controller at once: one /proc scan per kill round, one journal
            # transaction for the plans of a round and one for the outcome
            self._recover(cells)
        self._end_controllers(dead)
        for ctl, _ in dead:
            report["controllers"].append({"id": ctl["id"], "ended": ctl["ended"], "why_dead": ctl["why_dead"]})
            for c in ctl["cells"]:
                if c["final_state"] == "recovered":
                    report["recovered"].append(c["cell_id"])
                else:
                    report["skipped"].append({"run_id": c["run_id"], "cell_id": c["cell_id"], "controller": ctl["id"],
                                              "reason": c.get("error", "not recovered")})
                for k in c["killed"]:
                    report["killed"].append({"cell_id": c["cell_id"], **k})
                for s in c["spared"]:
                    report["skipped"].append({"cell_id": c["cell_id"], **s})
        if self.receipt is not None:
            self._write_file(t0)
            report["receipt"] = self.receipt
        return report

    def _live_cells(self, cid: str) -> list:
        return self.j.db.execute(f"SELECT run_id, cell_id FROM cells WHERE controller_id=? AND {LIVE_CELL}",
                                 (cid,)).fetchall()

    def _write_file(self, t0: float) -> None:
        from . import receipts
        self.receipt["ended_at"] = time.time()
        self.receipt["duration"] = round(self.receipt["ended_at"] - t0, 6)
        self.receipt["path"] = self.receipt_path
        big = sum(len(c["killed"]) + len(c["spared"]) for ctl in self.receipt["controllers"] for c in ctl["cells"])
        receipts.write(self.receipt_path, self.receipt, compact=big > COMPACT_RECEIPT)

    # -- one dead controller instance ------------------------------------
    def _controller(self, cid: str, cboot: str, lock: str) -> tuple[dict, list[_Cell]]:
        row = self.j.db.execute("SELECT * FROM controllers WHERE id=?", (cid,)).fetchone()
        same_boot = cboot == self.boot
        if same_boot:
            why = f"its liveness lock {lock} is free: no live process holds it"
            ident = _identity_note(row["pid"], row["pidfd_ino"], row["starttime"])
            if ident:
                why += f"; {ident}"
        else:
            why = f"it ran on boot {cboot}, this is boot {self.boot}: every process it had is gone"
        ctl = {"id": cid, "kind": row["kind"], "pid": row["pid"], "boot_id": cboot, "same_boot": same_boot,
               "why_dead": why, "cells": [], "ended": False}
        rows = self.j.db.execute(f"SELECT * FROM cells WHERE controller_id=? AND {LIVE_CELL} ORDER BY created_at",
                                 (cid,)).fetchall()
        cells = []
        for r in rows:
            c = _Cell(cid, r, self._entry(r), same_boot and r["boot_id"] == self.boot)
            ctl["cells"].append(c.entry)
            cells.append(c)
        return ctl, cells

    def _end_controllers(self, dead: list[tuple[dict, str]]) -> None:
        """A controller is marked ended only once all its cells are terminal; one transaction for all."""
        from .reap import release_lock_file
        ended = [(ctl, lock) for ctl, lock in dead if not self._live_cells(ctl["id"])]
        if not ended:
            return
        with self.j.tx() as db:
            for ctl, _ in ended:
                db.execute("UPDATE controllers SET ended_at=? WHERE id=? AND ended_at IS NULL",
                           (time.time(), ctl["id"]))
                self.j.event(db, "recovery.controller_ended", controller=ctl["id"], janitor=self.id)
        for ctl, lock in ended:
            ctl["ended"] = True
            rel = release_lock_file(lock)
            if rel:
                ctl["lock_released"] = rel

    def _entry(self, row) -> dict:
        """The cell's part of the receipt, before anything is done."""
        entry = {"run_id": row["run_id"], "agent_id": row["agent_id"], "cell_id": row["cell_id"],
                 "state_before": row["state"], "final_state": row["state"], "argv": json.loads(row["argv"]),
                 "leader": {"pid": row["pid"], "pidfd_ino": row["pidfd_ino"], "starttime": row["starttime"],
                            "pgid": row["pgid"]},
                 "cgroup": json.loads(row["cgroup"]) if row["cgroup"] else None, "cgroup_inode": row["cgroup_ino"],
                 "killed": [], "spared": [], "released": [], "notes": []}
        earlier = [json.loads(d or "{}") for (d,) in self.j.db.execute(
            "SELECT data FROM events WHERE run_id=? AND cell_id=? AND kind='recovery.kill' ORDER BY id",
            (row["run_id"], row["cell_id"]))]
        if earlier:
            entry["earlier_attempts"] = earlier
            entry["notes"].append(f"{len(earlier)} earlier janitor attempt(s) on this cell did not finish; "
                                  "this one redid the kill and finished")
        return entry

    # -- the cells ---------------------------------------------------------
    def _recover(self, cells: list[_Cell]) -> None:
        from .linux import cgroup, session
        from .reap import release_cell_resources, release_lock_file
        from . import crashpoints
        t0 = time.time()
        live = [c for c in cells if c.signals]
        for c in live:
            c.node = cgroup.Node(json.loads(c.row["cgroup"])) if c.row["cgroup"] else None
            try:
                c.node = self._verify_node(c.node, c.row["cgroup_ino"], c.entry)
            except OSError as e:
                c.error = str(e)
            if not json.loads(c.row["cgroup"] or "{}"):  # the cell never had a cgroup (layout none)
                c.entry["tracking"] = session.TRACKING
                c.entry["notes"].append(f"{session.BLOCKED} for this cell: its processes are found by session "
                                        "and token + start time evidence only (weaker than a cgroup)")
        self._kill_rounds([c for c in live if c.error is None])
        if any(c.entry["killed"] for c in live):
            crashpoints.hit("janitor_after_kill")
        for c in cells:
            if c.error is not None:
                continue
            try:
                if c.signals:
                    alive = [k["pid"] for k in c.entry["killed"] if not k["verified_dead"]]
                    if alive:
                        raise OSError(f"processes {alive} of cell {c.row['cell_id']} still alive after the kill")
                    c.entry["released"] = release_cell_resources(c.node, c.row["tmpdir"], self.base)
                else:
                    c.entry["notes"].append(f"cell ran on boot {c.row['boot_id']}, this is boot {self.boot}: no "
                                            "process of it can be alive; no signal sent, only records and files "
                                            "converge")
                    node = cgroup.Node(json.loads(c.row["cgroup"])) if c.row["cgroup"] else None
                    if node is not None and node.primary and os.path.exists(node.primary[1]):
                        c.entry["notes"].append(f"a cgroup exists at {node.primary[1]} but belongs to this boot, "
                                                "not to the cell: not touched")
                    c.entry["released"] = release_cell_resources(None, c.row["tmpdir"])
                rel = release_lock_file(c.row["lock_path"])
                if rel:
                    c.entry["released"].append({**rel, "kind": "worktree_lock"})
            except OSError as e:  # leave it for the next janitor; never mark what is not converged
                c.error = str(e)
        now = time.time()
        done = [c for c in cells if c.error is None]
        for c in cells:
            if c.error is not None:
                c.entry["error"] = c.error
        if done:
            self._conclude(done, now, t0)

    def _conclude(self, cells: list[_Cell], now: float, t0: float) -> None:
        """One transaction: every recovered cell terminal, its run too when no other cell of it lives."""
        with self.j.tx() as db:
            for c in cells:
                run_id, cell_id, entry = c.row["run_id"], c.row["cell_id"], c.entry
                entry["final_state"] = "recovered"
                entry["duration"] = round(now - t0, 6)
                self.j.update_cell(db, run_id, cell_id, state="recovered", reason="recovered", ended_at=now,
                                   receipt_path=self.receipt_path)
                self.j.event(db, "state.recovered", run_id, cell_id, janitor=self.id, controller=c.cid)
            for c in cells:
                run_id, cell_id, entry = c.row["run_id"], c.row["cell_id"], c.entry
                other = db.execute(f"SELECT 1 FROM cells WHERE run_id=? AND {LIVE_CELL} LIMIT 1", (run_id,)).fetchone()
                if other is None:
                    cur = db.execute("UPDATE runs SET state='recovered', ended_at=? WHERE run_id=? AND state NOT IN "
                                     f"({','.join('?' * len(TERMINAL_RUN))})", (now, run_id, *TERMINAL_RUN))
                    entry["run_state"] = "recovered" if cur.rowcount else \
                        db.execute("SELECT state FROM runs WHERE run_id=?", (run_id,)).fetchone()[0]
                else:
                    entry["run_state"] = "active"
                    entry["notes"].append(f"run {run_id} has other live cells: it stays active")
                self.j.add_receipt(db, "recovery", run_id, cell_id, {
                    "kind": "recovery", "version": 1, "janitor": self.id, "boot_id": self.boot,
                    "controller": c.cid, "cell": entry, "t": now, "path": self.receipt_path})

    def _verify_node(self, node, ino, entry: dict):
        """The cell's cgroup, or None when it is gone or not provably the cell's."""
        from .linux import cgroup
        if node is None or node.primary is None:
            entry["notes"].append("no cgroup journaled for the cell")
            return None
        h, path = node.primary
        try:
            st = os.stat(path)
        except FileNotFoundError:
            entry["notes"].append(f"cgroup {path} no longer exists")
            # the other hierarchies may remain (e.g. a crash between two rmdirs): empty ones are still ours to remove
            return node
        if ino is None:
            if cgroup.populated(node):
                for pid in cgroup.procs(path):
                    entry["spared"].append(_spared(pid, f"in {path}, but the cell's cgroup inode was never journaled:"
                                                        " membership proves nothing, spared"))
                entry["notes"].append(f"cgroup {path} has no journaled inode and is populated: not touched")
                return None
            entry["notes"].append(f"cgroup {path} has no journaled inode (crash before it was recorded) and is "
                                  "empty: removed")
            return node
        if st.st_ino != ino:
            for pid in cgroup.procs(path):
                entry["spared"].append(_spared(pid, f"in {path}, but that directory's inode {st.st_ino} differs from "
                                                    f"the journaled {ino}: a recreated cgroup, not the cell's; spared"))
            entry["notes"].append(f"cgroup {path} was recreated (inode {st.st_ino}, journaled {ino}): not touched")
            return None
        return node

    # -- the kill ---------------------------------------------------------
    def _kill_rounds(self, cells: list[_Cell]) -> None:
        """Scan, journal the plans, kill, verify; again until a scan finds nothing (or KILL_ROUNDS)."""
        from .linux import session
        pending = cells
        for _ in range(KILL_ROUNDS):
            if not pending:
                return
            snap = session.Snapshot.take(exclude=(os.getpid(),))
            plans: list[tuple[_Cell, dict]] = []
            for c in pending:
                try:
                    found, spared = self._candidates(c, snap)
                except OSError as e:
                    c.error = str(e)
                    continue
                for s in spared:
                    if (s["pid"], s["reason"]) not in c.seen_spared:
                        c.seen_spared.add((s["pid"], s["reason"]))
                        c.entry["spared"].append(s)
                if found:
                    plans.append((c, found))
            if not plans:
                return
            with self.j.tx() as db:  # the plans survive us: a next janitor reports them
                for c, found in plans:
                    self.j.event(db, "recovery.kill", c.row["run_id"], c.row["cell_id"], janitor=self.id,
                                 controller=c.cid, candidates=[_public(k) for k in found.values()])
            self._kill(plans)
            pending = [c for c, _ in plans if c.error is None]

    def _candidates(self, c: _Cell, snap) -> tuple[dict, list]:
        from .linux import cgroup, pidfd, session
        row, node = c.row, c.node
        found: dict[int, dict] = {}
        spared: list[dict] = []

        def add(pid: int, why: str, kind: str, recheck: str) -> None:
            st = snap.procs.get(pid) or proc.stat(pid)
            if st is None or st.state in ("Z", "X"):
                return
            k = found.setdefault(pid, {"pid": pid, "comm": st.comm, "starttime": st.starttime, "evidence": [],
                                       "via": kind, "recheck": []})
            if kind == "cgroup":
                k["via"] = "cgroup"
            k["evidence"].append(why)
            k["recheck"].append(recheck)

        prim = node.primary if node is not None else None
        if prim and os.path.isdir(prim[1]):
            for pid in cgroup.procs(prim[1]):
                add(pid, f"member of the cell's cgroup {prim[1]} (directory inode {row['cgroup_ino']} matches the "
                         "journal)", "cgroup", "cgroup")
        lpid, leader_ok, leader_why = row["pid"], None, ""
        if lpid:
            try:
                fd = pidfd.open(lpid)
            except OSError:  # EINVAL: the number is a thread's now, so not the leader's
                fd, leader_ok, leader_why = None, False, f"pid {lpid} is a thread of another process"
            if fd is not None:
                try:
                    leader_ok, leader_why = pidfd.matches(fd, lpid, row["pidfd_ino"], row["starttime"])
                finally:
                    os.close(fd)
                if leader_ok:
                    add(lpid, f"journaled leader: boot id matches, {leader_why}", "single", "leader")
                elif lpid not in found and not proc.is_zombie(lpid):
                    spared.append(_spared(lpid, f"the journaled leader pid {lpid} is another process now: {leader_why}; spared"))
        lo = row["starttime"]
        if lo is None:  # no identity committed yet: the cell's life began at its intent row
            lo = _wall_to_ticks(row["created_at"] - 1.0)
        ev = session.Evidence(lpid, leader_ok, row["token"], lo, leader_why)
        more, why_spared = ev.find(snap)
        for pid, k in more.items():
            for why, recheck in zip(k["evidence"], k["recheck"]):
                add(pid, why, "single", recheck)
        spared.extend(s for s in why_spared if s["pid"] not in found)
        return found, spared

    def _kill(self, plans: list[tuple[_Cell, dict]]) -> None:
        """Trees through their cgroups first (one write each), then every single
        process of every cell: SIGSTOP, then SIGKILL, each through a checked pidfd."""
        from .linux import cgroup, pidfd, session
        methods: dict[int, str] = {}
        for i, (c, found) in enumerate(plans):
            if any(k["via"] == "cgroup" for k in found.values()):
                try:
                    methods[i] = cgroup.kill(c.node)
                except OSError as e:
                    c.error = f"cannot kill the cgroup of cell {c.row['cell_id']}: {e}"
        singles, owner = [], {}
        for i, (c, found) in enumerate(plans):
            ev = session.Evidence(c.row["pid"], None, c.row["token"], 0)
            for k in found.values():
                if k["via"] != "cgroup":
                    singles.append(k)
                    owner[id(k)] = (c, ev)

        def check(fd, k):
            c, ev = owner[id(k)]
            if "leader" in k["recheck"]:
                return pidfd.matches(fd, k["pid"], c.row["pidfd_ino"], c.row["starttime"])
            return ev.recheck(k["pid"], k)

        sent = session.stop_and_kill(singles, check) if singles else {}
        for i, (c, found) in enumerate(plans):
            if i in methods:
                cgroup.wait_empty(c.node, 10.0)
            for k in found.values():
                pub = _public(k)
                if k["via"] == "cgroup":
                    # wait, not a glance: a PID-namespace init leaves its cgroup before it
                    # has finished dying (it first reaps its namespace, pid_namespaces(7))
                    c.entry["killed"].append({**pub, "method": methods.get(i, "none"),
                                              "verified_dead": session.wait_dead(k["pid"], k["starttime"], 5.0)})
                else:
                    ok, why = sent[k["pid"]]
                    c.entry["killed"].append({**pub, "method": "pidfd_send_signal" if ok else "none",
                                              "signal_note": why,
                                              "verified_dead": session.wait_dead(k["pid"], k["starttime"], 5.0)})


def _public(k: dict) -> dict:
    return {key: v for key, v in k.items() if key != "recheck"}


def _spared(pid: int, reason: str) -> dict:
    st = proc.stat(pid)
    return {"pid": pid, "comm": st.comm if st else None, "starttime": st.starttime if st else None, "reason": reason}


def _wall_to_ticks(t: float) -> int:
    with open("/proc/uptime") as f:
        up = float(f.read().split()[0])
    boot_wall = time.time() - up
    return max(0, int((t - boot_wall) * proc.clock_ticks()))


def _identity_note(pid, pidfd_ino, starttime) -> str | None:
    from .linux import pidfd
    if not pid:
        return None
    fd = pidfd.open(pid)
    if fd is None:
        return f"its pid {pid} is gone"
    try:
        ok, why = pidfd.matches(fd, pid, pidfd_ino, starttime)
    finally:
        os.close(fd)
    return f"its pid {pid} is still that process but no longer holds the lock" if ok else why


def format_text(report: dict) -> str:
    if not report["controllers"]:
        lines = ["nothing to recover"]
    else:
        lines = [f"controller {c['id']}: dead ({c['why_dead']}){'' if c['ended'] else '; not finished'}"
                 for c in report["controllers"]]
        lines.append(f"recovered {len(report['recovered'])} cell(s): {' '.join(report['recovered']) or '-'}")
        lines.append(f"killed {len(report['killed'])} process(es)")
        for k in report["killed"]:
            lines.append(f"  pid {k['pid']} ({k['comm']}) of {k['cell_id']}: {'; '.join(k['evidence'])}")
    for s in report["skipped"]:
        lines.append(f"  skipped {('pid ' + str(s['pid'])) if 'pid' in s else s.get('cell_id')}: {s['reason']}")
    if report["receipt"]:
        lines.append(f"receipt: {report['receipt']['path']}")
    return "\n".join(lines)
