"""Listing cells from the journal: what `agnsup ps`, the serve protocol and the
Python API show. The ownership token is never part of it."""
from __future__ import annotations

import json
import re

LIVE = ("waiting", "starting", "running")
DEFAULT_LIMIT = 50      # `ps` without --limit: the newest cells, and a line counting the rest
AGE_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_when(text: str, option: str, now: float) -> float:
    """A time as seconds since the epoch: an age back from `now` (`30m`, `1h`, `2d`, `1w`, `45s`), or an
    ISO 8601 date or time, UTC unless it names an offset (`2026-11-01`, `2026-11-01T12:00`,
    `2026-11-01T12:00:00+02:00`, `...Z`). UsageError naming `option` otherwise."""
    from datetime import datetime, timezone

    from ..errors import UsageError
    t = text.strip()
    if re.fullmatch(r"[0-9]+(\.[0-9]+)?[smhdw]", t):
        return now - float(t[:-1]) * AGE_UNITS[t[-1]]
    try:
        when = datetime.fromisoformat(t)
    except ValueError:
        raise UsageError(f"{option}: {text!r} is neither an age (30m, 1h, 2d, 1w) nor an ISO 8601 time "
                         "(2026-11-01, 2026-11-01T12:00, 2026-11-01T12:00:00+02:00)") from None
    return (when if when.tzinfo else when.replace(tzinfo=timezone.utc)).timestamp()


def state_matches(state: str, wanted: str) -> bool:
    """`ps --state`: `running` is every cell not ended yet (waiting, starting, running), `ended` every
    ended one; any other word is one cell state (exited, failed, timeout, cancelled, killed, recovered...)."""
    if wanted == "running":
        return state in LIVE
    if wanted == "ended":
        return state not in LIVE
    return state == wanted


def check_states(wanted) -> None:
    """UsageError for a `--state` word that names no state."""
    from ..errors import UsageError
    from .journal import TERMINAL_CELL
    known = ("running", "ended", *LIVE, *TERMINAL_CELL)
    for w in wanted:
        if w not in known:
            raise UsageError(f"--state: {w!r} is not a state: running, ended, or one of "
                             f"{', '.join(s for s in known[2:] if s != 'running')}")


def select(cells: list[dict], since: float | None = None, until: float | None = None,
           states: tuple = ()) -> list[dict]:
    """The cells that existed during [since, until] (started by `until`, not ended before `since`),
    in one of `states` (state_matches) when given; the order kept (oldest first)."""
    out = []
    for c in cells:
        if until is not None and c["created_at"] > until:
            continue
        if since is not None and c["ended_at"] is not None and c["ended_at"] < since:
            continue
        if states and not any(state_matches(c["state"], w) for w in states):
            continue
        out.append(c)
    return out


def newest(cells: list[dict], limit: int | None) -> tuple[list[dict], int]:
    """(the newest `limit` cells, oldest first as given; how many older ones were left out). 0/None: all."""
    if not limit or len(cells) <= limit:
        return cells, 0
    return cells[-limit:], len(cells) - limit


def run_label(run_state: str, activity: tuple[bool, bool] | None) -> str:
    """What `ps` calls a run. The journal's state, except for an `active` run (it takes new cells):
    `ended` once its cells all ended and no controller of them is open (a one-cell `run` that ended, an
    MCP or serve run whose server exited), `idle` while its server is still up, `active` with a live cell.
    `activity`: Journal.run_activity's (live cell, open controller) for the run."""
    if run_state != "active" or activity is None:
        return run_state
    live, serving = activity
    return "active" if live else "idle" if serving else "ended"


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


def tree_text(cells: list[dict], labels: dict | None = None) -> list[str]:
    """run -> agent -> cell, one line each, for a terminal. `labels`: {run_id: what to call the run}
    (run_label), else the journal's run state."""
    tree: dict = {}
    for c in cells:
        rstate = (labels or {}).get(c["run_id"], c["run_state"])
        tree.setdefault((c["run_id"], rstate), {}).setdefault(c["agent_id"], []).append(c)
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
