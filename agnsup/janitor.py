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
3. a cell that captured its worktree changes (reversible cells, agnsup/changes.py):
   what it left in its overlay's upper layer is committed into the worktree (the
   worktree ends as the cell left it, never half-merged; undoable with `agnsup undo`),
   and the receipt says so; then release through the one reap path (cgroup dirs,
   temp dir), remove the worktree lock file if nobody holds it;
4. in one transaction: the cell -> `recovered`, its run -> `recovered` when no
   other cell of it lives, a `recovery` receipt row; the receipt file is
   <state>/recovery/<janitor id>.json;
5. every change layer, commit or undo left in flight (changes.finish_all) finished;
   then network pods no live cell holds torn down (pod.sweep), and the empty run and
   agent directories a killed controller of many cells kept (backend/cgroups.py: hold)
   removed (_sweep_held: report "cgroups").

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

import errno
import json
import os
import sys
import time
from contextlib import suppress

from . import locks
from .linux import cgroup, proc, session

LOCK_TIMEOUT = 120.0
COMPACT_RECEIPT = 200  # processes; a larger recovery receipt is written on one line
COMPACT_CELLS = 20     # cells recovered at once; more: the recovery receipt and theirs are written on one line
RELEASE_THREADS = 4    # cells whose files and cgroups are removed side by side (janitor._each)


def _is_dead(boot: str, cboot: str, lock_path: str) -> bool:
    return cboot != boot or locks.is_free(lock_path)


def on_start(state, journal=None) -> dict | None:
    """Run at every controller start: recover only when some controller instance is dead.

    `journal`: the controller's own open Journal, to ask with (one connection
    fewer, and no SQLite checkpoint when this one closes)."""
    from .errors import AgnsupError
    from .store.journal import peek_open_controllers
    if journal is not None:
        try:
            rows = journal.open_controllers()
        except AgnsupError:
            return None  # the controller opens (and checks) the journal properly right after
    else:
        rows = peek_open_controllers(os.path.join(state.path, "journal.db"))
        if rows is None:
            return None
    boot = proc.boot_id()
    if not any(_is_dead(boot, cboot, lock) for _, cboot, lock in rows):
        return None
    try:
        report = run_janitor(state, journal)
    except (AgnsupError, OSError) as e:
        # a full or read-only state root: the controller's own start fails on it next, in one line that
        # says so (a second line here would say the same); the next start tries recovery again
        if getattr(e, "errno", None) not in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
            print(f"agnsup: janitor: recovery failed, continuing: {e}", file=sys.stderr, flush=True)
        return None
    if report["recovered"]:
        print(f"agnsup: janitor recovered {len(report['recovered'])} cell(s) of dead controller(s) "
              f"{', '.join(c['id'] for c in report['controllers'])} (agnsup receipts --recovery)",
              file=sys.stderr, flush=True)
    return report


def run_janitor(state_root, journal=None, backend=None) -> dict:
    """Recover every dead controller instance's cells now. Returns the report
    {"recovered", "killed", "skipped", "receipt", "controllers"}. `backend`:
    instead of the host's (backend.choose)."""
    from .store.state import StateRoot
    state = state_root if isinstance(state_root, StateRoot) else StateRoot(str(state_root))
    state.ensure()
    own = journal is None
    from .errors import JournalDamaged
    try:
        j = state.journal() if own else journal
    except JournalDamaged as e:
        return _without_journal(state, e, backend)
    lock_path = os.path.join(state.path, "janitor.lock")
    fd = locks.acquire(lock_path, True, LOCK_TIMEOUT, "janitor", f"janitor pid {os.getpid()}")
    try:
        jan = _Janitor(state, j, backend)
        report = jan.run()
        pods = _sweep_pods(state, jan.backend)
        if pods:
            report["pods"] = pods
        held = _sweep_held(jan.backend, j)  # after the pods: the run directories they were in
        if held:
            report["cgroups"] = held
        return report
    finally:
        locks.release(lock_path, fd)
        if own:
            j.close()


def _sweep_spares(state) -> list[str]:
    """The spare areas of controllers that are dead (spares.py: empty directories and files made ahead of their
    cells, nothing of a cell's in them): removed; a live controller's are its own. One listing a pass."""
    from .store import spares
    try:
        ids = os.listdir(os.path.join(state.path, spares.DIR))
    except OSError:
        return []
    swept = [cid for cid in ids if spares.controller_name(cid) and locks.is_free(state.controller_lock(cid))
             and spares.sweep(state.path, cid)]
    return swept


def _without_journal(state, error, backend=None) -> dict:
    """Recovery when the journal is damaged or lost its history (issue 12 item 3):
    from the evidence that survives. The controllers' liveness locks say whether
    any controller lives; when none does, every process under this state root's
    own cgroup tree belongs to a dead controller's cell and is killed; when one
    lives, its cells cannot be told from the dead ones' without the journal, and
    nothing is touched. The recovery receipt is a file only (nothing is journaled)."""
    from . import backend as backends, reaper, receipts
    backend = backend or backends.choose(state.path)
    cdir = os.path.join(state.path, "controllers")
    try:
        held = [n[:-5] for n in sorted(os.listdir(cdir)) if n.endswith(".lock")
                and not locks.is_free(os.path.join(cdir, n))]
    except OSError:
        held = []
    report = {"recovered": [], "killed": [], "skipped": [], "receipt": None, "controllers": [],
              "journal": error.message, "journaled": False}
    if held:
        report["skipped"].append({"cell_id": "*", "reason": f"controller(s) {', '.join(held)} still live: without the "
                                  "journal their cells cannot be told apart; nothing killed"})
        return report
    root = reaper.kill_root(backend, 0.0)
    report["root"] = root
    if root["processes"]:
        import uuid
        jid = "j-" + uuid.uuid4().hex[:8]
        path = os.path.join(state.path, "recovery", jid + ".json")
        rec = {"kind": "recovery", "version": 1, "janitor": jid, "pid": os.getpid(), "boot_id": proc.boot_id(),
               "at": time.time(), "journal": error.message, "journaled": False,
               "evidence": "no controller lock held: every process under the state root's cgroup tree was a dead "
                           "controller's", "root": root}
        try:
            receipts.write(path, rec)
            report["receipt"] = {"path": path}
        except OSError as e:
            report["skipped"].append({"cell_id": "*", "reason": f"recovery receipt not written: {e.strerror}"})
    return report


def _sweep_pods(state, backend) -> list[dict]:
    """Network pods no live cell holds (their members' controllers died: the kernel dropped their shared locks)
    torn down: their keepers' places killed, their directories removed (agnsup/pod.py)."""
    from . import pod
    try:
        return pod.sweep(state, backend)
    except OSError as e:
        return [{"kind": "pod", "error": f"sweeping pods: {e.strerror or e}"}]


def _sweep_held(backend, journal) -> list[dict]:
    """The empty run and agent directories (and the base) of this state root's cgroup tree removed: what a
    controller of many cells killed while it kept them between its cells leaves (backend/cgroups.py: hold); and
    the empty cell directories no journal row names: a dead controller's spare cells (process/cellspare.py)."""
    known: dict[tuple[str, str], bool] = {}  # one question per cell, whatever its number of hierarchies

    def journaled(run_id: str, cell_id: str) -> bool:
        if (run_id, cell_id) not in known:
            known[(run_id, cell_id)] = journal.cell(run_id, cell_id) is not None
        return known[(run_id, cell_id)]
    try:
        return [{"kind": "cgroup", "path": d} for d in backend.sweep_ancestors(journaled)]
    except OSError as e:
        return [{"kind": "cgroup", "error": f"sweeping empty cgroup directories: {e.strerror or e}"}]


class _Cell:
    """One cell under recovery: its journal row, its receipt entry, the reaper's target."""
    __slots__ = ("cid", "row", "entry", "target", "signals", "error")

    def __init__(self, cid: str, row, entry: dict, signals: bool):
        self.cid, self.row, self.entry, self.signals = cid, row, entry, signals
        self.target = None
        self.error: str | None = None


class _Janitor:
    def __init__(self, state, journal, backend=None):
        from . import backend as backends
        self.state, self.j = state, journal
        self.id = "jan-" + os.urandom(6).hex()
        self.boot = proc.boot_id()
        self.backend = backend if backend is not None else backends.choose(state.path)
        self.receipt_path = os.path.join(state.path, "recovery", self.id + ".json")
        self.receipt: dict | None = None

    # -- the pass ---------------------------------------------------------
    def run(self) -> dict:
        t0 = time.time()
        report = {"recovered": [], "killed": [], "skipped": [], "receipt": None, "controllers": []}
        dead: list[tuple[dict, str]] = []
        cells: list[_Cell] = []
        for cid, cboot, lock in self.j.open_controllers():
            if not _is_dead(self.boot, cboot, lock):
                for c in self.j.live_cells_of(cid):
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
        swept = _sweep_spares(self.state)
        if swept:
            report["spares"] = swept
        finished = self._finish_changes()
        if finished:
            report["changes"] = finished
            if self.receipt is not None:
                self.receipt["changes"] = finished
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

    def _write_file(self, t0: float) -> None:
        from . import receipts
        self.receipt["ended_at"] = time.time()
        self.receipt["duration"] = round(self.receipt["ended_at"] - t0, 6)
        self.receipt["path"] = self.receipt_path
        cells = [c for ctl in self.receipt["controllers"] for c in ctl["cells"]]
        big = sum(len(c["killed"]) + len(c["spared"]) for c in cells)
        receipts.write(self.receipt_path, self.receipt, compact=big > COMPACT_RECEIPT or len(cells) > COMPACT_CELLS)

    # -- one dead controller instance ------------------------------------
    def _controller(self, cid: str, cboot: str, lock: str) -> tuple[dict, list[_Cell]]:
        row = self.j.controller(cid)
        same_boot = cboot == self.boot
        if same_boot:
            why = f"its liveness lock {lock} is free: no live process holds it"
            ident = _identity_note(self.backend, row["pid"], row["pidfd_ino"], row["starttime"])
            if ident:
                why += f"; {ident}"
        else:
            why = f"it ran on boot {cboot}, this is boot {self.boot}: every process it had is gone"
        ctl = {"id": cid, "kind": row["kind"], "pid": row["pid"], "boot_id": cboot, "same_boot": same_boot,
               "why_dead": why, "cells": [], "ended": False}
        cells = []
        for r in self.j.live_cells_of(cid):
            c = _Cell(cid, r, self._entry(r), same_boot and r["boot_id"] == self.boot)
            ctl["cells"].append(c.entry)
            cells.append(c)
        return ctl, cells

    def _end_controllers(self, dead: list[tuple[dict, str]]) -> None:
        """A controller is marked ended only once all its cells are terminal; one transaction for all."""
        live = self.j.with_live_cells([ctl["id"] for ctl, _ in dead])
        ended = [(ctl, lock) for ctl, lock in dead if ctl["id"] not in live]
        if not ended:
            return
        self.j.end_controllers([ctl["id"] for ctl, _ in ended], self.id)
        for ctl, lock in ended:
            ctl["ended"] = True
            with suppress(FileNotFoundError):  # its CA's key died with it: nothing may trust the certificate now
                os.unlink(self.state.ca_cert(ctl["id"]))
            rel = locks.remove_if_free(lock)
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
        earlier = self.j.recovery_plans(row["run_id"], row["cell_id"])
        if earlier:
            entry["earlier_attempts"] = earlier
            entry["notes"].append(f"{len(earlier)} earlier janitor attempt(s) on this cell did not finish; "
                                  "this one redid the kill and finished")
        return entry

    # -- the cells ---------------------------------------------------------
    def _recover(self, cells: list[_Cell]) -> None:
        from .util import crashpoints
        from . import protect, reaper
        t0 = time.time()
        live = [c for c in cells if c.signals]
        for c in live:
            try:
                c.target, note, bystanders = reaper.from_row(self.backend, c.row)
            except OSError as e:
                c.error = str(e)
                continue
            if note:
                c.entry["notes"].append(note)
            c.entry["spared"] += [_spared(pid, f"{note}; spared") for pid in bystanders]
            if not json.loads(c.row["cgroup"] or "{}"):  # the cell never had a cgroup (layout none)
                c.entry["tracking"] = session.TRACKING
                c.entry["notes"].append(f"{session.BLOCKED} for this cell: its processes are found by session "
                                        "and token + start time evidence only (weaker than a cgroup)")
        todo = [c for c in live if c.error is None]
        by_target = {id(c.target): c for c in todo}

        def journal_plans(plans) -> None:  # the plans survive us: a next janitor reports them
            self.j.add_recovery_plans([(t.run_id, t.cell_id, {"janitor": self.id, "controller": by_target[id(t)].cid,
                                        "candidates": [reaper.public(k) for k in cands.values()]})
                                       for t, cands in plans if cands])

        done = reaper.stop(self.backend, [c.target for c in todo], thorough=True, on_plan=journal_plans)
        for c, r in zip(todo, done):
            c.entry["killed"] += r.killed
            c.entry["spared"] += r.spared
            if not r.empty:
                c.error = r.error
        if any(c.entry["killed"] for c in live):
            crashpoints.hit("janitor_after_kill")

        def converge(c: _Cell) -> None:  # files and cgroups only (no journal: this may run in a worker thread)
            try:
                if not c.signals:
                    c.entry["notes"].append(f"cell ran on boot {c.row['boot_id']}, this is boot {self.boot}: no "
                                            "process of it can be alive; no signal sent, only records and files "
                                            "converge")
                    paths = json.loads(c.row["cgroup"]) if c.row["cgroup"] else {}
                    prim = cgroup.Node(paths).primary
                    if prim and os.path.exists(prim[1]):
                        c.entry["notes"].append(f"a cgroup exists at {prim[1]} but belongs to this boot, "
                                                "not to the cell: not touched")
                    c.target = reaper.Target(run_id=c.row["run_id"], cell_id=c.row["cell_id"], tmpdir=c.row["tmpdir"],
                                             lock_path=c.row["lock_path"])
                self._commit_changes(c)  # the tree is dead, the worktree lock not yet released
                c.entry["released"] = reaper.release(self.backend, c.target)
            except OSError as e:  # leave it for the next janitor; never mark what is not converged
                c.error = str(e)

        chains: dict = {}

        def read_chains() -> None:  # the journal's reads, in this thread while the workers remove files
            chains.update(self._chains(cells))

        _each(converge, [c for c in cells if c.error is None], meanwhile=read_chains)
        for c in cells:
            if c.error is not None:
                continue
            try:
                settled = protect.settle_cell(self.j, c.row["run_id"], c.row["cell_id"],
                                              self.state.cell_dir(c.row["run_id"], c.row["cell_id"]), janitor=self.id)
                if settled is not None:
                    c.entry["protected"] = settled
            except OSError as e:
                c.error = str(e)
        now = time.time()
        done_cells = [c for c in cells if c.error is None]
        for c in cells:
            if c.error is not None:
                c.entry["error"] = c.error
        if done_cells:
            for c in done_cells:
                c.entry["final_state"] = "recovered"
                c.entry["duration"] = round(now - t0, 6)
                c.entry["reason"] = _reason(c)
            from . import receipts
            concluded = [
                {"run_id": c.row["run_id"], "cell_id": c.row["cell_id"], "controller": c.cid, "entry": c.entry,
                 "reason": c.entry["reason"],
                 "receipt": {"kind": "recovery", "version": 1, "janitor": self.id, "boot_id": self.boot,
                             "controller": c.cid, "cell": c.entry, "t": now, "path": self.receipt_path},
                 # every cell that started has a cell receipt too (issue 12 item 4)
                 "cell_receipt": receipts.recovered_receipt(c.row, c.entry, chains[c.row["run_id"], c.row["cell_id"]],
                                                            self.id, self.receipt_path, now)}
                for c in done_cells]
            self.j.conclude_recovered(concluded, self.id, now, self.receipt_path)
            compact = len(concluded) > COMPACT_CELLS  # indenting is pure Python: ~2 ms a receipt

            def on_disk(c: dict) -> None:  # and on disk, where no receipt is (one on disk is never overwritten)
                path = os.path.join(self.state.cell_dir(c["run_id"], c["cell_id"]), "receipt.json")
                receipts.discard_reserved(path)  # the dead controller's, made while the cell ran
                if not os.path.lexists(path) and os.path.isdir(os.path.dirname(path)):
                    with suppress(OSError):  # the journal holds it
                        receipts.write(path, c["cell_receipt"], compact=compact)
            # one file each in its own cell directory: side by side, as the releases (a create and a rename
            # on the state root's file system each)
            _each(on_disk, concluded, key=id)

    def _commit_changes(self, c: _Cell) -> None:
        """The cell captured its worktree changes and its controller died before committing them (or
        during the commit): what it left lands in the worktree now, as its controller would have done
        (broker.Controller._commit_changes); the commit resumes a plan an earlier attempt left."""
        from . import changes
        run, cell = c.row["run_id"], c.row["cell_id"]
        layer = changes.layer_dir(self.state.path, run, cell)
        if not any(os.path.lexists(os.path.join(layer, n)) for n in ("upper", "plan.json")):
            return  # it did not capture (live, read-only, never started), or it was committed already
        ch = changes.land(self.state.path, run, cell, c.row["worktree"], agent_id=c.row["agent_id"])
        c.entry["changes"] = ch
        n = ch.get("files") or 0
        if ch["mode"] == "live":
            c.entry["notes"].append(ch["why"])
        elif ch.get("error"):
            c.entry["notes"].append(f"its worktree changes could not be committed yet ({ch['error']})")
        elif n:
            c.entry["notes"].append(f"committed {n} change(s) the cell left in its worktree {c.row['worktree']} "
                                    f"(undo with agnsup undo {cell} --run {run})")
        else:
            c.entry["notes"].append("the cell changed nothing in its worktree")

    def _finish_changes(self) -> list:
        """Layers, commits and undos left in flight by processes that died (changes.finish_all)."""
        from . import changes
        try:
            return changes.finish_all(self.state.path, self.j)
        except Exception as e:  # noqa: BLE001 - recovery of the cells is done; the next janitor tries again
            print(f"agnsup: janitor: unfinished changes not finished yet: {e}", file=sys.stderr, flush=True)
            return []

    def _chains(self, cells: list[_Cell]) -> dict:
        """{(run_id, cell_id): the stages as the cell's events journaled them} (one read per run)."""
        rows = self.j.stage_events([(c.row["run_id"], c.row["cell_id"]) for c in cells])
        return {k: [json.loads(d) for d in data] for k, data in rows.items()}


def _worktree(c: _Cell) -> str:
    return c.row["worktree"] or c.cid + "/" + c.row["cell_id"]


def _each(work, cells: list, meanwhile=None, key=_worktree) -> None:
    """work(c) for every cell, the cells of different worktrees side by side in up to RELEASE_THREADS
    threads: a cell's release is mostly rmdir(2) and unlink(2) (its temp dir, its change layer, its
    cgroup directories: ~30 calls of ~50-100 us on ext4), which the kernel overlaps; the cells of one
    worktree one after another, in their order (a worktree's commits never interleave). `meanwhile()`:
    this thread's own work, once the workers started (the journal's reads: its connection stays here).
    `key`: what puts cells one after another (the same key: in order, in one thread)."""
    groups: dict = {}
    for c in cells:
        groups.setdefault(key(c), []).append(c)
    batches = list(groups.values())
    if len(batches) < 2:
        if meanwhile is not None:
            meanwhile()
        for c in cells:
            work(c)
        return
    import threading
    failed: list[BaseException] = []
    it = iter(batches)
    lock = threading.Lock()

    def worker() -> None:
        while not failed:
            with lock:
                batch = next(it, None)
            if batch is None:
                return
            try:
                for c in batch:
                    work(c)
            except BaseException as e:  # noqa: BLE001 - raised again in the janitor's thread below
                failed.append(e)

    threads = [threading.Thread(target=worker, name="agnsup-janitor-release", daemon=True)
               for _ in range(min(RELEASE_THREADS, len(batches)) - 1)]
    for t in threads:
        t.start()
    try:
        if meanwhile is not None:
            meanwhile()
    finally:
        worker()
    for t in threads:
        t.join()
    if failed:
        raise failed[0]


def _reason(c: _Cell) -> str:
    """`controller_died` when the cell's tree died with its controller (on_controller_death
    = kill through a PID namespace: the kernel ended it, nothing was left to kill), else
    `recovered`."""
    dies = c.row["dies_with_controller"] if "dies_with_controller" in c.row.keys() else None
    if dies == "namespace" and c.signals and not c.entry["killed"]:
        c.entry["notes"].append("its processes ended with their controller: the PID namespace's init had "
                                "PR_SET_PDEATHSIG(SIGKILL) (on_controller_death = kill); nothing was left to kill")
        return "controller_died"
    return "recovered"


def _spared(pid: int, reason: str) -> dict:
    st = proc.stat(pid)
    return {"pid": pid, "comm": st.comm if st else None, "starttime": st.starttime if st else None, "reason": reason}


def _identity_note(backend, pid, pidfd_ino, starttime) -> str | None:
    if not pid:
        return None
    ok, why = backend.leader_matches(pid, pidfd_ino, starttime)
    if ok is None:
        return f"its pid {pid} is gone"
    return f"its pid {pid} is still that process but no longer holds the lock" if ok else why


def format_text(report: dict) -> str:
    if report.get("journaled") is False:
        root = report.get("root") or {}
        lines = [f"without the journal: killed {root.get('processes', 0)} process(es) under this state root's "
                 f"cgroups ({root.get('kill') or 'nothing to kill'}){'; ' + root['note'] if root.get('note') else ''}"]
    elif not report["controllers"]:
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
