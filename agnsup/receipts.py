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
        "reduced": (cell.isolation or {}).get("reduced", []),  # isolation.reduced pieces this cell ran without
        "limits": {**(plan.limits if plan else {}), "applied": cell.place.limits if cell.place else {},
                   "timeout": plan.timeout if plan else None, "grace": plan.grace if plan else None},
        "pids": {"leader": cell.identity.get("pid"), "pgid": cell.identity.get("pgid"),
                 "starttime": cell.identity.get("starttime"), "pidfd_ino": cell.identity.get("pidfd_ino"),
                 "left_after_leader": outcome.leftover},
        "started_at": cell.started_at, "ended_at": time.time(),
        "state": outcome.state, "reason": outcome.reason, "exit_code": outcome.exit_code,
        "exit_status": outcome.status, "signal": outcome.signal, "cancel_reason": outcome.cancel_reason,
        "kill_method": outcome.kill_method,
        "usage": usage, "released": released,
        "output": cell.output_info(),
    }
    r.update(argv_b64(spec.argv))
    if getattr(cell, "protected", None) is not None:  # protect.settle: what the cell planted, what it changed
        r["protected"] = cell.protected
    if getattr(cell, "changes", None) is not None:  # reversible cells: what landed, the record, or why live
        r["changes"] = cell.changes
    if cell.network is not None:  # allowlist/internal: every connection the proxy was asked for
        r["network"] = cell.network
    if plan is not None and getattr(plan, "redact", None) and cell.capture:
        # What each redaction rule takes out of the output a caller gets back (tool.ended).
        from .redact import receipt_section
        r["output"]["redaction"] = receipt_section(plan.redact, spec.env, plan.cell_dir, MAX_RETURNED_OUTPUT)
    r["limits"]["not_in_force"] = not_in_force(r["limits"])
    r["limits_hit"] = limits_hit(usage, r["output"])
    if error:
        r["error"] = error
    r["duration"] = round(r["ended_at"] - (cell.started_at or cell.created_at), 6)
    return r


def recovered_receipt(row, entry: dict, chain: list[dict], janitor: str, recovery_path: str, now: float) -> dict:
    """The cell receipt of a cell the janitor recovered (its controller died first):
    what the journal holds of it (the chain as each stage journaled it, ids, argv,
    the leader), state `recovered`, and what the janitor killed and spared and why,
    with a pointer to the recovery receipt. Never built from constants: a field the
    journal did not hold is None."""
    argv = json.loads(row["argv"]) if row["argv"] else []
    r = {"kind": "cell", "version": RECEIPT_VERSION, "run_id": row["run_id"], "agent_id": row["agent_id"],
         "cell_id": row["cell_id"], "role": row["role"], "controller": row["controller_id"],
         "boot_id": row["boot_id"], "chain": chain, "argv": argv, "exe": row["exe"], "workdir": row["worktree"],
         "cgroup": entry.get("cgroup"), "cgroup_inode": row["cgroup_ino"],
         "pids": {"leader": row["pid"], "pgid": row["pgid"], "starttime": row["starttime"],
                  "pidfd_ino": row["pidfd_ino"]},
         "started_at": row["started_at"], "ended_at": now, "state": "recovered", "reason": entry.get("reason"),
         "exit_code": None, "exit_status": None, "signal": None, "cancel_reason": row["cancel_reason"],
         "state_before": entry.get("state_before"),
         "recovery": {"janitor": janitor, "receipt": recovery_path, "killed": entry.get("killed", []),
                      "spared": entry.get("spared", []), "released": entry.get("released", []),
                      "notes": entry.get("notes", [])}}
    # what a reduced cell ran without (isolation.reduced), as its journaled backend stage said it
    r["reduced"] = next(((st.get("isolation") or {}).get("reduced") or [] for st in chain
                         if isinstance(st, dict) and st.get("stage") == "backend"), [])
    r.update(argv_b64(argv))
    if entry.get("protected") is not None:  # janitor._settle_protected
        r["protected"] = entry["protected"]
    if entry.get("changes") is not None:  # janitor._commit_changes: what the cell left, committed
        r["changes"] = entry["changes"]
    r["duration"] = round(now - (row["started_at"] or row["created_at"]), 6)
    return r


def argv_b64(argv: list[str]) -> dict:
    """{"argv_b64": argv as base64 of the exact bytes} when some argument is not UTF-8:
    `argv` then holds surrogate escapes (\\udcff) that only Python maps back, and a
    receipt must let any reader recover what ran. {} when argv is all UTF-8."""
    try:
        for a in argv:
            a.encode()
        return {}
    except UnicodeEncodeError:
        import base64  # here, not above: 1 ms of the run path for an argv that is almost never needed
        return {"argv_b64": [base64.b64encode(os.fsencode(a)).decode() for a in argv]}


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


_RESOURCE = {"memory_max": "memory", "pids_max": "pids", "cpu_weight": "cpu", "cpu_max": "cpu"}


def not_in_force(limits: dict) -> list[str]:
    """The role's limits no hierarchy holds on this host (a receipt never reports a
    limit as if it were applied): the keys whose resource is not in `applied`."""
    applied = limits.get("applied") or {}
    return sorted(k for k, res in _RESOURCE.items() if limits.get(k) is not None and res not in applied)


def limits_hit(usage: dict, output: dict) -> list[str]:
    """Which limits the cell ran into, from the kernel's own counters (and the pump's):
    memory (the OOM killer acted), pids (a fork was refused at pids.max), cpu (the
    quota throttled it), output (it wrote past output_max)."""
    seen = {"memory": usage.get("oom_kills"), "pids": usage.get("pids_max_events"),
            "cpu": usage.get("cpu_nr_throttled"), "output": output.get("exceeded")}
    return [limit for limit, counter in seen.items() if counter]
