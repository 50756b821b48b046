"""The governance stage: the role's policy as a GateContext, judged by agnsup.gate.

The gate (agnsup/gate/, docs/governance.md) applies its named checks in
order, first deny wins: hardline -> policy allow/deny lists -> sandbox ->
network -> zone -> quota. The decision and the trail of every check that ran
are values that travel to the journal and the receipt; a denial starts nothing.
Run quotas need the journal's counts: the gate judges only a limit of 0, and
`admit` judges the rest inside the broker's intent transaction.
"""
from __future__ import annotations

import os

from .errors import Denied


def kernel_of(policy: dict, state_root: str | None):
    """What the kernel refuses in a cell of this role, from the keys compiler.compile_plan
    reads: a network namespace of its own for deny/loopback, the read-only root,
    the masked deny paths and state root. A root cell that keeps CAP_SYS_ADMIN
    could remount or leave its namespaces, one that keeps CAP_NET_ADMIN could
    wire its namespace to the host's: then those guarantees are not claimed."""
    from .gate import Kernel
    fs = policy["filesystem"]
    kept = set((policy.get("isolation") or {}).get("capabilities") or ())
    if "SYS_ADMIN" in kept:
        return Kernel()
    return Kernel(netns=policy["network"]["mode"] in ("deny", "loopback") and "NET_ADMIN" not in kept,
                  root_ro=fs.get("root", "ro") == "ro", worktree_ro=fs.get("worktree", "rw") == "ro",
                  masked=tuple(fs.get("deny", ())) + ((state_root,) if state_root else ()))


def context(policy: dict, worktree: str, state_root: str | None):
    from .gate import GateContext
    from .gate.quota import limits_of
    gov, fs = policy["governance"], policy["filesystem"]
    return GateContext(
        role=policy["role"]["name"], mode=gov.get("mode", "open"), network=policy["network"]["mode"],
        worktree=worktree, worktree_writable=fs.get("worktree", "rw") == "rw",
        writable=("/tmp", "/dev/shm", "/dev/null"), deny_paths=tuple(fs.get("deny", ())),
        state_root=state_root, home=os.path.expanduser("~"),
        allow_commands=tuple(gov.get("allow_commands", ())), deny_commands=tuple(gov.get("deny_commands", ())),
        yellow_allow=tuple(gov.get("yellow_allow", ())), unparseable=gov.get("unparseable"),
        quota=limits_of(policy.get("quota")),
        kernel=kernel_of(policy, state_root), kernel_enforced=gov.get("kernel_enforced", "flag"),
        unknown_operands=gov.get("unknown_operands", "flag"), git_allow=tuple(gov.get("git_allow", ())),
        allow_internal=tuple(policy["network"].get("allow_internal", ())),
        tunnels=policy["network"].get("tunnels", "deny"))


def decide(tool: str, args: dict, policy: dict, worktree: str, state_root: str | None = None):
    """(decision, trail) for one tool call under `policy`."""
    from .gate import check
    return check(tool, args, context(policy, worktree, state_root))


def enforce(decision) -> None:
    if not decision.allowed:
        hint = f" (if this is wrong: {decision.hint})" if decision.hint else ""
        raise Denied(f"denied by {decision.rule}: {decision.reason}{hint}", decision=decision.to_dict())


def admit(db, spec, limits, zone: str, now: float) -> None:
    """Run quotas for one more cell of spec.run_id / spec.agent_id, judged with the
    caller's journal connection. The broker calls this inside its intent
    transaction (BEGIN IMMEDIATE), which makes the counts race-free. Raises
    Denied carrying the decision and its trail entry."""
    from .gate import quota
    limits = quota.limits_of(limits)
    if not limits:
        return
    from .gate import Decision
    f = quota.decide(limits, quota.usage(db, spec.run_id, spec.agent_id, now), spec.role, spec.run_id, spec.agent_id)
    if f.allowed:
        return
    d = Decision(allowed=False, rule=f.rule, zone=zone, reason=f.reason, check="quota", hint=f.hint)
    try:
        enforce(d)
    except Denied as e:
        e.details["trail"] = [{"check": "quota", "allowed": False, "rule": f.rule, "reason": f.reason}]
        raise
