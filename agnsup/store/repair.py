"""`agnsup journal check` and `agnsup journal repair`: a journal that is damaged or lost its history.

The journal refuses itself when it is damaged (journal.preflight, and
Journal._damaged when SQLite meets a corrupt page) or when it lost its
history (empty or missing while cells are on disk). Then nothing writes into
it, and these two commands say what is there and rebuild it:

- check: the file (header, size, the damage mark), SQLite's integrity check
  when the file opens, and the cells on disk the journal does not know.
- repair: refuses while processes still run under this state root's cgroup
  root (`agnsup cancel --all` kills them from the kernel's evidence first);
  moves a damaged or lost journal aside into <state>/quarantine/ (never
  deleted), opens a new one and imports every cell receipt on disk it does not
  know; a cell directory without a receipt is listed, and its id stays taken
  (broker: a cell directory on disk is never reused). Receipt files are only
  read, never rewritten.
"""
from __future__ import annotations

import json
import os
import time

from ..errors import CellsStillRunning, JournalDamaged, StateError


def _receipt(state, run_id: str, cell_id: str) -> tuple[str, dict | None, str | None]:
    """(path, receipt or None, why not)."""
    path = os.path.join(state.cell_dir(run_id, cell_id), "receipt.json")
    try:
        with open(path) as f:
            r = json.load(f)
    except FileNotFoundError:
        return path, None, "no receipt"
    except (OSError, ValueError) as e:
        return path, None, f"unreadable receipt: {e}"
    if not isinstance(r, dict) or r.get("kind") != "cell" or (r.get("run_id"), r.get("cell_id")) != (run_id, cell_id):
        return path, None, "not this cell's receipt"
    return path, r, None


def check(state) -> dict:
    """What is wrong with the journal, and what the disk still holds. `ok`: nothing is."""
    from . import journal as jmod
    path = os.path.join(state.path, "journal.db")
    on_disk = jmod.cells_on_disk(state.path)
    out: dict = {"journal": path, "size": jmod._size(path), "wal_size": jmod._size(path + "-wal"),
           "cells_on_disk": len(on_disk), "problems": [], "unknown_cells": []}
    try:
        j = jmod.Journal(path)
    except StateError as e:
        out["problems"].append(e.message)
        out["unknown_cells"] = [f"{r}/{c}" for r, c in on_disk]
        return out | {"ok": False}
    try:
        found = j.integrity()
        if found != ["ok"]:
            out["problems"].append(f"integrity check: {'; '.join(found)}")
        known = j.known_cells()
        out["unknown_cells"] = [f"{r}/{c}" for r, c in on_disk if (r, c) not in known]
        if out["unknown_cells"]:
            out["problems"].append(f"{len(out['unknown_cells'])} cell(s) on disk the journal does not know "
                                   f"(e.g. {out['unknown_cells'][0]}): it lost history")
    except JournalDamaged as e:
        out["problems"].append(e.message)
    finally:
        j.close()
    out["ok"] = not out["problems"]
    return out


def repair(state, backend=None) -> dict:
    """Quarantine a damaged/lost journal and rebuild it from the receipts on disk."""
    from .. import backend as backends, reaper
    from . import journal as jmod
    backend = backend or backends.choose(state.path)
    live = reaper.live_under_root(backend)
    if live:
        raise CellsStillRunning(f"{len(live)} process(es) still run under this state root's cgroups "
                                f"({', '.join(map(str, live[:5]))}{'...' if len(live) > 5 else ''}): "
                                "`agnsup cancel --all` kills them first, then repair", result={})
    report = check(state)
    path = report["journal"]
    moved = []
    if any("damaged" in p or "lost its history" in p or "integrity check" in p for p in report["problems"]):
        qdir = os.path.join(state.path, "quarantine")
        os.makedirs(qdir, mode=0o700, exist_ok=True)
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        for suffix in ("", "-wal", "-shm", jmod.DAMAGED_MARK):
            src = path + suffix
            if os.path.lexists(src):
                dst = os.path.join(qdir, f"journal-{stamp}.db{suffix}")
                os.rename(src, dst)
                moved.append(dst)
    from . import chain
    try:
        old_head = chain.read_head(chain.head_path(state.path))
    except (OSError, ValueError) as e:
        old_head = {"unreadable": str(e)}
    j = jmod.Journal(path, check=False)
    imported, skipped = [], []
    try:
        # a rebuilt journal, or one its head no longer matches, starts a new chain: its first record names the
        # old head (the quarantined file still holds the old chain); breaks inside a kept chain stay visible
        restarted = bool(moved) or any("head" in b["what"]
                                       for b in chain.verify(j.chain_snapshot(), state.path)["broken"])
        if restarted:
            j.restart_chain(old_head)
        known = j.known_cells()
        for run_id, cell_id in jmod.cells_on_disk(state.path):
            if (run_id, cell_id) in known:
                continue
            rpath, r, why = _receipt(state, run_id, cell_id)
            if r is None:
                skipped.append({"cell": f"{run_id}/{cell_id}", "why": f"{why}: not imported; its id stays taken"})
                continue
            j.import_cell(r, rpath)
            imported.append(f"{run_id}/{cell_id}")
        from .. import changes  # the change records on disk (issue 26): indexed again
        out = {"quarantined": moved, "imported": imported, "skipped": skipped,
               "changes": changes.reindex(state.path, j), "problems_before": report["problems"],
               "chain_restarted": restarted}
        j.add_event("repair", **{k: v for k, v in out.items() if k != "problems_before"}, problems=report["problems"])
    finally:
        j.close()
    return out


# -- retention (issue 12 item 17) ---------------------------------------------------
DEFAULT_RETENTION_DAYS = 30.0  # ended cells older than this leave the journal (their receipt files stay)
PRUNE_EVERY = 86400.0          # the default bound is applied at most once a day, at a controller's start


def retention_days() -> float:
    """AGNSUP_JOURNAL_RETENTION_DAYS (0: keep every cell in the journal forever)."""
    raw = os.environ.get("AGNSUP_JOURNAL_RETENTION_DAYS")
    if raw is None or raw == "":
        return DEFAULT_RETENTION_DAYS
    try:
        days = float(raw)
    except ValueError:
        days = -1.0
    if not days >= 0:
        from ..errors import UsageError
        raise UsageError(f"AGNSUP_JOURNAL_RETENTION_DAYS: must be a number of days >= 0, not {raw!r}")
    return days


def parse_before(text: str, now: float | None = None) -> float:
    """`journal prune --before`'s cut-off: an age (`30d`, `12h`, `90m`, `45s`) or a date, UTC unless it names an
    offset (`2026-11-01`, `2026-11-01T12:00`): the same reading as `ps --since` (cells.parse_when)."""
    from .cells import parse_when
    return parse_when(text, "--before", time.time() if now is None else now)


def prune(state, before: float, journal=None, compact: bool = False) -> dict:
    """Ended cells that ended before `before` leave the journal; each one's receipt is on
    disk first (written there from the journal if its file is missing: `archived`),
    and a `pruned` row keeps its id taken."""
    from .. import receipts
    j = journal if journal is not None else state.journal()
    try:
        archived, keys = [], []
        for r in j.prunable(before):
            path = r["receipt_path"] or os.path.join(state.cell_dir(r["run_id"], r["cell_id"]), "receipt.json")
            if not os.path.exists(path) and r["receipt"]:
                receipts.write(path, json.loads(r["receipt"]))  # never lost: on disk before it leaves
                archived.append(path)
            keys.append((r["run_id"], r["cell_id"], r["ended_at"], path))
        out = {"before": before, **j.prune(keys, before), "archived": archived}
        if compact:
            j.compact()
        return out
    finally:
        if journal is None:
            j.close()


def maybe_prune(state, journal) -> dict | None:
    """The default bound, at a controller's start: one stat when it ran within the day."""
    days = retention_days()
    if not days:
        return None
    stamp = os.path.join(state.path, "cache", "pruned-at")
    try:
        if time.time() - os.stat(stamp).st_mtime < PRUNE_EVERY:
            return None
    except FileNotFoundError:
        pass
    except OSError:
        return None
    try:
        out = prune(state, time.time() - days * 86400, journal)
        os.makedirs(os.path.dirname(stamp), mode=0o700, exist_ok=True)
        with open(stamp, "w") as f:
            f.write(json.dumps(out) + "\n")
        return out
    except (StateError, OSError):
        return None  # a full or read-only state root: the controller's own start says so
