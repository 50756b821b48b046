"""Listing cells from the journal: what `agnsup ps`, the serve protocol and the
Python API show. The ownership token is never part of it."""
from __future__ import annotations

import json


def listing(state, run_id: str | None = None, include_ended: bool = False) -> list[dict]:
    """Cells (live ones unless `include_ended`) as dicts with the cli.md `ps` keys."""
    if not state.exists():
        return []
    j = state.journal()
    try:
        rows = j.cells(run_id, live_only=not include_ended)
    finally:
        j.close()
    cells = []
    for r in rows:
        d = {k: r[k] for k in r.keys() if k != "token"}
        d["controller"] = d.pop("controller_id")
        d["cgroup"] = json.loads(d["cgroup"]) if d.get("cgroup") else None
        d["argv"] = json.loads(d["argv"])
        cells.append(d)
    return cells


def tree_text(cells: list[dict]) -> list[str]:
    """run -> agent -> cell, one line each, for a terminal."""
    tree: dict = {}
    for c in cells:
        tree.setdefault((c["run_id"], c["run_state"]), {}).setdefault(c["agent_id"], []).append(c)
    lines = []
    for (run, rstate), agents in tree.items():
        lines.append(f"run {run} [{rstate}]")
        for agent, cs in agents.items():
            lines.append(f"  agent {agent}")
            for c in cs:
                pid = c["pid"] if c["pid"] is not None else "-"
                extra = f" exit={c['exit_code']}" if c["exit_code"] is not None else ""
                if c.get("changes"):  # agnsup ps adds it (issue 26): the cell's change record, kept/undone/dropped
                    extra += f" changes={c['changes']['files']}:{c['changes']['state']}"
                if c.get("reduced"):  # agnsup ps adds it (issue 27): what a reduced cell runs without
                    extra += f" reduced={','.join(c['reduced'])}"
                lines.append(f"    cell {c['cell_id']:<14} {c['state']:<10} pid={pid}{extra}  "
                             f"{' '.join(c['argv'])[:60]}")
    return lines


def reduced_of(journal, cells: list[dict]) -> None:
    """Each cell's `reduced` (isolation.reduced pieces it runs without, docs/isolation.md "Reduced cells"),
    from its journaled backend stage, into the dicts (a key only for a reduced cell). Live cells only: an
    ended cell's receipt says it (agnsup receipts), and `ps --all` stays one query."""
    for c in cells:
        if c["state"] not in ("waiting", "starting", "running"):
            continue
        for ev in journal.events(c["run_id"], c["cell_id"]):
            if ev["kind"] == "stage.backend" and ev["data"]:
                got = (json.loads(ev["data"]).get("isolation") or {}).get("reduced")
                if got:
                    c["reduced"] = got
