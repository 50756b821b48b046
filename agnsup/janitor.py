"""The janitor: crash recovery, at every controller start and on demand.

For each controller instance that is dead (its liveness flock can be taken)
or from another boot, and each of its cells not yet in a terminal state:

1. collect candidates from /proc, on evidence only, never a PID alone:
   - membership of the cell's cgroup, and only when that directory's inode is
     the journaled one (a recreated directory is not the cell's);
   - the journaled leader's exact identity (pidfd inode, start time) on this boot;
   - outside the cgroup, a process on which two pieces agree: the cell's
     ownership token in its environment AND a start time inside the cell's life;
2. journal the plan (event `recovery.kill`), kill (the tree through its cgroup,
   single processes through a checked pidfd), verify;
3. release through the one reap path (cgroup dirs, temp dir), remove the
   worktree lock file if nobody holds it;
4. in one transaction: the cell -> `recovered`, its run -> `recovered` when no
   other cell of it lives, a `recovery` receipt row; the receipt file is
   <state>/recovery/<janitor id>.json.

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
import signal
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
KILL_ROUNDS = 5


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
        for cid, cboot, lock in rows:
            if not _is_dead(self.boot, cboot, lock):
                for c in self._live_cells(cid):
                    report["skipped"].append({"run_id": c["run_id"], "cell_id": c["cell_id"], "controller": cid,
                                              "reason": f"controller {cid} is alive (holds {lock}): never touched"})
                continue
            if self.receipt is None:
                self.receipt = {"kind": "recovery", "version": 1, "janitor": self.id, "pid": os.getpid(),
                                "boot_id": self.boot, "started_at": t0, "controllers": []}
            ctl = self._controller(cid, cboot, lock)
            self.receipt["controllers"].append(ctl)
            report["controllers"].append({"id": cid, "ended": ctl["ended"], "why_dead": ctl["why_dead"]})
            for c in ctl["cells"]:
                if c["final_state"] == "recovered":
                    report["recovered"].append(c["cell_id"])
                else:
                    report["skipped"].append({"run_id": c["run_id"], "cell_id": c["cell_id"], "controller": cid,
                                              "reason": c.get("error", "not recovered")})
                for k in c["killed"]:
                    report["killed"].append({"cell_id": c["cell_id"], **k})
                for s in c["spared"]:
                    report["skipped"].append({"cell_id": c["cell_id"], **s})
            self._write_file(t0)
        if self.receipt is not None:
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
        receipts.write(self.receipt_path, self.receipt)

    # -- one dead controller instance ------------------------------------
    def _controller(self, cid: str, cboot: str, lock: str) -> dict:
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
        cells = self.j.db.execute(f"SELECT * FROM cells WHERE controller_id=? AND {LIVE_CELL} ORDER BY created_at",
                                  (cid,)).fetchall()
        for c in cells:
            try:
                ctl["cells"].append(self._cell(cid, c, same_boot))
            except OSError as e:  # leave it for the next janitor; never mark what is not converged
                ctl["cells"].append({"run_id": c["run_id"], "agent_id": c["agent_id"], "cell_id": c["cell_id"],
                                     "final_state": c["state"], "error": str(e), "killed": [], "spared": []})
        if not self._live_cells(cid):
            with self.j.tx() as db:
                db.execute("UPDATE controllers SET ended_at=? WHERE id=? AND ended_at IS NULL", (time.time(), cid))
                self.j.event(db, "recovery.controller_ended", controller=cid, janitor=self.id)
            ctl["ended"] = True
            from .reap import release_lock_file
            rel = release_lock_file(lock)
            if rel:
                ctl["lock_released"] = rel
        return ctl

    # -- one cell ---------------------------------------------------------
    def _cell(self, cid: str, row, same_boot: bool) -> dict:
        from .linux import cgroup
        from .reap import release_cell_resources, release_lock_file
        from . import crashpoints
        t0 = time.time()
        run_id, cell_id = row["run_id"], row["cell_id"]
        entry = {"run_id": run_id, "agent_id": row["agent_id"], "cell_id": cell_id, "state_before": row["state"],
                 "argv": json.loads(row["argv"]), "leader": {"pid": row["pid"], "pidfd_ino": row["pidfd_ino"],
                                                             "starttime": row["starttime"], "pgid": row["pgid"]},
                 "cgroup": json.loads(row["cgroup"]) if row["cgroup"] else None, "cgroup_inode": row["cgroup_ino"],
                 "killed": [], "spared": [], "released": [], "notes": []}
        earlier = [json.loads(e["data"] or "{}") for e in self.j.events(run_id, cell_id) if e["kind"] == "recovery.kill"]
        if earlier:
            entry["earlier_attempts"] = earlier
            entry["notes"].append(f"{len(earlier)} earlier janitor attempt(s) on this cell did not finish; "
                                  "this one redid the kill and finished")
        node = cgroup.Node(json.loads(row["cgroup"])) if row["cgroup"] else None
        if same_boot and row["boot_id"] == self.boot:
            node = self._verify_node(node, row["cgroup_ino"], entry)
            rounds = 0
            seen_spared: set[tuple] = set()
            while rounds < KILL_ROUNDS:
                rounds += 1
                found, spared = self._candidates(row, node)
                for s in spared:
                    if (s["pid"], s["reason"]) not in seen_spared:
                        seen_spared.add((s["pid"], s["reason"]))
                        entry["spared"].append(s)
                if not found:
                    break
                with self.j.tx() as db:  # the plan survives us: a next janitor reports it
                    self.j.event(db, "recovery.kill", run_id, cell_id, janitor=self.id, controller=cid,
                                 candidates=list(found.values()))
                entry["killed"].extend(self._kill(row, node, found))
            if entry["killed"]:
                crashpoints.hit("janitor_after_kill")
            alive = [k["pid"] for k in entry["killed"] if not k["verified_dead"]]
            if alive:
                raise OSError(f"processes {alive} of cell {cell_id} still alive after the kill")
            entry["released"] = release_cell_resources(node, row["tmpdir"], self.base)
        else:
            entry["notes"].append(f"cell ran on boot {row['boot_id']}, this is boot {self.boot}: no process of it "
                                  "can be alive; no signal sent, only records and files converge")
            if node is not None and node.primary and os.path.exists(node.primary[1]):
                entry["notes"].append(f"a cgroup exists at {node.primary[1]} but belongs to this boot, not to the "
                                      "cell: not touched")
            entry["released"] = release_cell_resources(None, row["tmpdir"])
        rel = release_lock_file(row["lock_path"])
        if rel:
            entry["released"].append({**rel, "kind": "worktree_lock"})
        now = time.time()
        entry["final_state"] = "recovered"
        entry["duration"] = round(now - t0, 6)
        with self.j.tx() as db:
            self.j.update_cell(db, run_id, cell_id, state="recovered", reason="recovered", ended_at=now,
                               receipt_path=self.receipt_path)
            self.j.event(db, "state.recovered", run_id, cell_id, janitor=self.id, controller=cid)
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
                "controller": cid, "cell": entry, "t": now, "path": self.receipt_path})
        return entry

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

    def _candidates(self, row, node) -> tuple[dict, list]:
        from .linux import cgroup, pidfd
        found: dict[int, dict] = {}
        spared: list[dict] = []
        me = os.getpid()

        def add(pid: int, why: str, st=None, kind: str = "single") -> None:
            st = st or proc.stat(pid)
            if st is None or st.state in ("Z", "X"):
                return
            c = found.setdefault(pid, {"pid": pid, "comm": st.comm, "starttime": st.starttime, "evidence": [],
                                       "via": kind})
            if kind == "cgroup":
                c["via"] = "cgroup"
            c["evidence"].append(why)

        prim = node.primary if node is not None else None
        if prim and os.path.isdir(prim[1]):
            for pid in cgroup.procs(prim[1]):
                add(pid, f"member of the cell's cgroup {prim[1]} (directory inode {row['cgroup_ino']} matches the "
                         "journal)", kind="cgroup")
        lpid = row["pid"]
        if lpid:
            fd = pidfd.open(lpid)
            if fd is not None:
                try:
                    ok, why = pidfd.matches(fd, lpid, row["pidfd_ino"], row["starttime"])
                finally:
                    os.close(fd)
                if ok:
                    add(lpid, f"journaled leader: boot id matches, {why}")
                elif lpid not in found and not proc.is_zombie(lpid):
                    spared.append(_spared(lpid, f"pid {lpid} is the journaled leader pid but {why}; spared"))
        lo = row["starttime"]
        if lo is None:  # no identity committed yet: the cell's life began at its intent row
            lo = _wall_to_ticks(row["created_at"] - 1.0)
        for pid in proc.pids():
            if pid == me or pid in found:
                continue
            env = proc.environ(pid)
            if not env or env.get(TOKEN_VAR) != row["token"]:
                continue
            st = proc.stat(pid)
            if st is None or st.state in ("Z", "X"):
                continue
            if st.starttime >= lo:
                add(pid, f"ownership token matches and start time {st.starttime} is inside the cell's life "
                         f"(>= {lo}, this boot)", st)
            else:
                spared.append(_spared(pid, f"ownership token matches but start time {st.starttime} is before the "
                                           f"cell began ({lo}): one piece of evidence is not enough, spared"))
        return found, spared

    def _kill(self, row, node, found: dict) -> list[dict]:
        from .linux import cgroup, pidfd
        out = []
        tree = [c for c in found.values() if c["via"] == "cgroup"]
        if tree:
            method = cgroup.kill(node)
            cgroup.wait_empty(node, 10.0)
            for c in tree:
                # wait, not a glance: a PID-namespace init leaves its cgroup before it
                # has finished dying (it first reaps its namespace, pid_namespaces(7))
                out.append({**c, "method": method, "verified_dead": _wait_dead(c["pid"], c["starttime"], 5.0)})
        for c in found.values():
            if c["via"] == "cgroup":
                continue
            pid, start = c["pid"], c["starttime"]
            is_leader = pid == row["pid"]

            def check(fd, pid=pid, start=start, is_leader=is_leader):
                if is_leader:
                    return pidfd.matches(fd, pid, row["pidfd_ino"], row["starttime"])
                st = proc.stat(pid)
                env = proc.environ(pid) or {}
                if st is None or st.starttime != start or env.get(TOKEN_VAR) != row["token"]:
                    return False, f"pid {pid} changed between the scan and the signal: spared"
                return True, "rechecked through the pidfd"

            sent, why = pidfd.signal_if(pid, signal.SIGKILL, check)
            out.append({**c, "method": "pidfd_send_signal" if sent else "none", "signal_note": why,
                        "verified_dead": _wait_dead(pid, start, 5.0)})
        return out


def _spared(pid: int, reason: str) -> dict:
    st = proc.stat(pid)
    return {"pid": pid, "comm": st.comm if st else None, "starttime": st.starttime if st else None, "reason": reason}


def _dead(pid: int, start: int) -> bool:
    st = proc.stat(pid)
    return st is None or st.starttime != start or st.state in ("Z", "X")


def _wait_dead(pid: int, start: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not _dead(pid, start):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)
    return True


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
