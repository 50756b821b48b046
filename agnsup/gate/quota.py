"""Run quotas: how many cells a run and an agent may start or hold at once,
and how long a run may go on.

    max_cells_per_run          quota.cells_per_run      cells a run may start in its life
    max_concurrent_per_run     quota.concurrent_run     live cells of one run at once
    max_concurrent_per_agent   quota.concurrent_agent   live cells of one agent (of a run) at once
    max_run_seconds            quota.run_wall_time      wall time since the run's first cell

The decision (`decide`) is pure. The counts come from the journal store
(journal.begin_cell counts them inside the broker's intent transaction, BEGIN
IMMEDIATE), so two controllers starting cells at the same moment cannot both
pass a limit of one: the second waits for the first's INSERT and counts it.
Without a journal (`agnsup check`, `check(...)` of an agent runtime) only a
limit of 0 can be judged; the other limits are reported as not judged.
"""

from __future__ import annotations


from ..util.record import Record
from .model import Finding, deny, ok

KEYS = ("max_cells_per_run", "max_concurrent_per_run", "max_concurrent_per_agent", "max_run_seconds")
RULES = {"max_cells_per_run": "quota.cells_per_run", "max_concurrent_per_run": "quota.concurrent_run",
         "max_concurrent_per_agent": "quota.concurrent_agent", "max_run_seconds": "quota.run_wall_time"}


class Usage(Record, frozen=True):
    """What a run and an agent hold, from the journal, before the new cell
    (in the order journal.begin_cell counts them)."""

    cells_in_run: int
    live_in_run: int
    live_of_agent: int
    run_age: float | None  # seconds since the run's first cell; None for a new run


def limits_of(policy_quota: dict | None) -> tuple[tuple[str, float], ...]:
    """The limits a role sets, as (key, value) pairs (unset keys left out)."""
    q = policy_quota or {}
    return tuple((k, q[k]) for k in KEYS if q.get(k) is not None)


def _hint(key: str, role: str) -> str:
    return (f"Raise quota.{key} in role '{role}' (or remove it), or wait for cells to end / start a new run "
            "with --run-id.")


def decide(limits, usage: Usage | None, role: str, run_id: str = "", agent_id: str = "") -> Finding:
    """The quota verdict for one more cell. usage None: judge only what needs no journal."""
    lim = dict(limits)
    run = f"run {run_id!r}" if run_id else "the run"
    agent = f"agent {agent_id!r}" if agent_id else "the agent"
    if usage is None:
        for key in ("max_cells_per_run", "max_concurrent_per_run", "max_concurrent_per_agent"):
            if lim.get(key) == 0:
                return deny(RULES[key], f"role '{role}' sets quota.{key} = 0: it may start no cell.",
                            _hint(key, role))
        pending = [f"{k}={lim[k]:g}" for k in KEYS if k in lim]
        if pending:
            return ok("quota.unjudged", "not judged without the journal (agnsup run judges them when the cell "
                      "starts): " + ", ".join(pending))
        return ok("quota.pass", "no quota set")
    age = usage.run_age  # None for a new run: no wall-time limit applies yet
    for key, held, what, per in (
            ("max_cells_per_run", usage.cells_in_run, f"{run} has started {usage.cells_in_run} cells", "per run"),
            ("max_concurrent_per_run", usage.live_in_run, f"{run} holds {usage.live_in_run} live cells", "at once"),
            ("max_concurrent_per_agent", usage.live_of_agent,
             f"{agent} of {run} holds {usage.live_of_agent} live cells", "at once"),
            ("max_run_seconds", age, f"{run} began {age or 0:.0f} s ago", "s of wall time per run")):
        n = lim.get(key)
        if n is not None and held is not None and held >= n:
            return deny(RULES[key], f"{what} and role '{role}' allows {n:g} {per} (quota.{key}).", _hint(key, role))
    return ok("quota.pass", "within the role's quotas")
