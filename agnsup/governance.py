"""The governance stage: the role's policy as a GateContext, judged by agnsup.gate.

The gate (agnsup/gate/, docs/governance.md) applies its named checks in
order, first deny wins: hardline -> policy allow/deny lists -> sandbox ->
network -> zone -> quota. The decision and the trail of every check that ran
are values that travel to the journal and the receipt; a denial starts nothing.
Run quotas need the journal's counts: the gate judges only a limit of 0, and
`admission` gives the broker the judge of the rest, which it calls inside its
intent transaction.
"""
from __future__ import annotations

import os

from .errors import Denied


def kernel_of(policy, state_root: str | None):
    """What the kernel refuses in a cell of this role, from the keys compiler.compile_plan
    reads: a network namespace of its own (every mode but host), the read-only root,
    the masked deny paths and state root. A root cell that keeps CAP_SYS_ADMIN
    could remount or leave its namespaces, one that keeps CAP_NET_ADMIN could
    wire its namespace to the host's: then those guarantees are not claimed."""
    from .gate import Kernel
    fs = policy.filesystem
    kept = set(policy.isolation.capabilities)
    if "SYS_ADMIN" in kept:
        return Kernel()
    from .compiler import NETNS_MODES
    # isolation.reduced: a piece the role may run without is never claimed, whatever this host gives
    # (the gate's decision does not depend on the host); without the mount namespace, Landlock alone
    # keeps the read-only root and worktree read-only, and nothing masks a path
    reduced = set(policy.isolation.reduced)
    no_mounts = "mount_namespace" in reduced
    ro_held = not no_mounts or policy.isolation.landlock
    return Kernel(netns=policy.network.mode in NETNS_MODES and "NET_ADMIN" not in kept
                  and "network_namespace" not in reduced,
                  root_ro=fs.root == "ro" and ro_held, worktree_ro=fs.worktree == "ro" and ro_held,
                  masked=() if no_mounts else tuple(fs.deny) + ((state_root,) if state_root else ()))


# A controller of many cells judges its cells against the same few contexts: (id(policy), worktree, state root,
# home) -> (the policy, its GateContext). A GateContext is frozen, and everything it holds is read from its key: the
# policy object (policy.load hands out a new one whenever a role's files change: kept here by reference, so its id
# cannot be another policy's while the entry lives), the worktree, the state root, and the home (HOME, else the
# password database) looked up at each call.
_CONTEXTS: dict = {}
CONTEXTS_KEPT = 64


def context(policy, worktree: str, state_root: str | None):
    home = os.path.expanduser("~")
    key = (id(policy), worktree, state_root, home)
    kept = _CONTEXTS.get(key)
    if kept is not None and kept[0] is policy:
        return kept[1]
    ctx = _context(policy, worktree, state_root, home)
    if len(_CONTEXTS) >= CONTEXTS_KEPT:
        _CONTEXTS.clear()
    _CONTEXTS[key] = (policy, ctx)
    return ctx


def _context(policy, worktree: str, state_root: str | None, home: str):
    from .gate import GateContext
    from .gate.quota import limits_of
    gov, fs = policy.governance, policy.filesystem
    egress = None
    if policy.network.mode in ("allowlist", "internal"):
        from .netpolicy import Rules
        egress = Rules.of(policy.network)
    return GateContext(egress=egress,
        role=policy.role.name, mode=gov.mode, network=policy.network.mode,
        worktree=worktree, worktree_writable=fs.worktree == "rw",
        writable=("/tmp", "/dev/shm", "/dev/null"), deny_paths=tuple(fs.deny),
        state_root=state_root, home=home,
        allow_commands=gov.allow_commands, deny_commands=gov.deny_commands,
        yellow_allow=gov.yellow_allow, unparseable=gov.unparseable,
        quota=limits_of(policy.quota), kernel=kernel_of(policy, state_root), kernel_enforced=gov.kernel_enforced,
        unknown_operands=gov.unknown_operands, git_allow=gov.git_allow,
        allow_internal=policy.network.allow_internal, tunnels=policy.network.tunnels,
        unreadable=gov.unreadable, download_exec=policy.network.download_exec)


def decide(tool: str, args: dict, policy, worktree: str, state_root: str | None = None):
    """(decision, trail) for one tool call under `policy`."""
    from .gate import check
    return check(tool, args, context(policy, worktree, state_root))


def enforce(decision) -> None:
    if not decision.allowed:
        hint = f" (if this is wrong: {decision.hint})" if decision.hint else ""
        raise Denied(f"denied by {decision.rule}: {decision.reason}{hint}", decision=decision.to_dict())


def admission(spec, policy, zone: str):
    """The run-quota judge for one more cell of spec.run_id / spec.agent_id, or None
    when the role sets no quota. The broker calls it inside its intent transaction
    with the journal's counts (journal.begin_cell), which makes them race-free; it
    raises Denied carrying the decision and its trail entry."""
    from .gate import quota
    limits = quota.limits_of(policy.quota)
    if not limits:
        return None

    def admit(counts: tuple) -> None:
        from .gate import Decision
        f = quota.decide(limits, quota.Usage(*counts), spec.role, spec.run_id, spec.agent_id)
        if f.allowed:
            return
        d = Decision(allowed=False, rule=f.rule, zone=zone, reason=f.reason, check="quota", hint=f.hint)
        try:
            enforce(d)
        except Denied as e:
            e.details["trail"] = [{"check": "quota", "allowed": False, "rule": f.rule, "reason": f.reason}]
            raise
    return admit
