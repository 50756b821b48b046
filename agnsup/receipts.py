"""Receipts: the JSON account of one cell (or one recovery), written when it ends.

A receipt is built from what was recorded and observed, never from constants:
the chain is the trace each stage appended, the isolation is what the backend
really set up, the pids are those the kernel reported.
"""
from __future__ import annotations

import json
import os
import time

RECEIPT_VERSION = 1
MAX_RETURNED_OUTPUT = 64 * 1024  # captured output a caller gets back (tool.ended); redaction counts cover it


def cell_receipt(cell, outcome, usage: dict, released: list, error: str | None = None) -> dict:
    spec, plan = cell.spec, cell.plan
    r = {
        "kind": "cell", "version": RECEIPT_VERSION,
        "run_id": spec.run_id, "agent_id": spec.agent_id, "cell_id": spec.cell_id,
        "role": spec.role, "policy_digest": plan.policy_digest if plan else None,
        "controller": cell.controller_id, "boot_id": cell.boot_id,
        "governance": {"decision": cell.decision, "trail": cell.trail},
        "chain": cell.trace,
        "argv": spec.argv, "exe": spec.exe, "workdir": spec.workdir, "worktree": spec.worktree, "venv": spec.venv,
        "env_keys": sorted(spec.env), "env": redacted_env(spec), "env_sources": spec.env_sources,
        "cgroup": cell.place.paths() or None if cell.place else None,
        "cgroup_inode": cell.place.inode if cell.place else None,
        "isolation": cell.isolation,
        "limits": {**(plan.limits if plan else {}), "applied": cell.place.limits if cell.place else {},
                   "timeout": plan.timeout if plan else None, "grace": plan.grace if plan else None},
        "pids": {"leader": cell.identity.get("pid"), "pgid": cell.identity.get("pgid"),
                 "starttime": cell.identity.get("starttime"), "pidfd_ino": cell.identity.get("pidfd_ino"),
                 "left_after_leader": outcome.leftover if outcome else None},
        "started_at": cell.started_at, "ended_at": time.time(),
        "state": outcome.state if outcome else "failed",
        "reason": outcome.reason if outcome else "failed",
        "exit_code": outcome.exit_code if outcome else None,
        "exit_status": outcome.status if outcome else None,
        "signal": outcome.signal if outcome else None,
        "cancel_reason": outcome.cancel_reason if outcome else None,
        "kill_method": outcome.kill_method if outcome else None,
        "usage": usage, "released": released,
        "output": cell.output_info(),
    }
    if cell.network is not None:  # allowlist/internal: every connection the proxy was asked for
        r["network"] = cell.network
    if plan is not None and getattr(plan, "redact", None) and cell.capture:
        # What each redaction rule takes out of the output a caller gets back (tool.ended).
        from .redact import receipt_section
        r["output"]["redaction"] = receipt_section(plan.redact, spec.env, plan.cell_dir, MAX_RETURNED_OUTPUT)
    r["limits_hit"] = limits_hit(usage, r["output"])
    if error:
        r["error"] = error
    r["duration"] = round(r["ended_at"] - (cell.started_at or cell.created_at), 6)
    return r


def redacted_env(spec) -> dict[str, str]:
    """The environment for a receipt: secret-looking values and the token hidden."""
    from .linux.session import TOKEN_VAR
    from .secretkeys import looks_secret
    return {k: ("<redacted>" if k == TOKEN_VAR or looks_secret(k) else v) for k, v in spec.env.items()}


def write(path: str, receipt: dict, compact: bool = False) -> None:
    """Atomically. `compact`: one line, through the C encoder (indenting is pure
    Python: ~100 ms for a recovery receipt of 1,000 processes)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(json.dumps(receipt, sort_keys=True, separators=(",", ":")) if compact else
                json.dumps(receipt, indent=2, sort_keys=True))
        f.write("\n")
    os.replace(tmp, path)


def limits_hit(usage: dict, output: dict) -> list[str]:
    """Which limits the cell ran into, from the kernel's own counters (and the pump's):
    memory (the OOM killer acted), pids (a fork was refused at pids.max), cpu (the
    quota throttled it), output (it wrote past output_max)."""
    hit = []
    if usage.get("oom_kills"):
        hit.append("memory")
    if usage.get("pids_max_events"):
        hit.append("pids")
    if usage.get("cpu_nr_throttled"):
        hit.append("cpu")
    if output.get("exceeded"):
        hit.append("output")
    return hit
