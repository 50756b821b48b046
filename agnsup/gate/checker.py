"""The gate: named checks in order, first denial wins.

    hardline -> policy -> sandbox -> network -> zone -> quota

Each check returns a Finding; the trail records every check that ran. A
denial is a value carried to the receipt, never an exception. A refusal the
cell's kernel makes anyway (GateContext.kernel, governance.kernel_enforced)
is a pass with `flagged` notes: its rule id (`*.kernel_enforced`) joins the
decision's flags, the notes go to the trail entry and the decision.
"""

from __future__ import annotations

from . import hardline, network, policy, quota, sandbox, zones
from .commands import Analysis, analyze_argv, analyze_shell, split_words
from .model import Decision, Finding, GateContext

COMMAND_KEYS = ("command", "cmd", "script", "shell", "argv")
ORDER = ("hardline", "policy", "sandbox", "network", "zone", "quota")


def analyze_call(args: dict) -> Analysis | None:
    """Every command-like field of any tool, as one Analysis (None if none)."""
    an: Analysis | None = None
    for key in COMMAND_KEYS:
        v = args.get(key)
        if v is None:
            continue
        an = an or Analysis()
        if isinstance(v, (list, tuple)):
            an.merge(analyze_argv([str(x) for x in v]))
        elif isinstance(v, str):
            an.merge(analyze_argv(split_words(v)) if key == "argv" else analyze_shell(v))
    return an


def check(tool_name: str, args: dict, ctx: GateContext, *, resolver=None) -> tuple[Decision, list[dict]]:
    """Judge one tool call. Returns the decision and the trail of checks that ran.

    `resolver(host) -> list[str]` replaces DNS resolution for URL arguments
    (tests; a caller with its own resolver).
    """
    args = args or {}
    zone = zones.zone_of(tool_name, args)
    an = analyze_call(args)
    trail: list[dict] = []
    flags: list[str] = []
    notes: list[dict] = []  # kernel-backed refusals allowed with a flag
    pinned = ""
    final: Finding | None = None
    final_check = ""
    for name in ORDER:
        if name == "hardline":
            f = hardline.check(an, home=ctx.home, worktree=ctx.worktree) if an is not None else \
                hardline.ok("hardline.pass")
        elif name == "policy":
            f = policy.check(an, ctx)
        elif name == "sandbox":
            f = sandbox.check(tool_name, args, zone, an, ctx)
        elif name == "network":
            f = network.check(tool_name, args, an, ctx, resolver=resolver)
        elif name == "zone":
            f = zones.check(tool_name, zone, ctx)
        elif an is None or not ctx.quota:
            continue  # quotas count cells: only a call that runs a command starts one
        else:
            f = quota.decide(ctx.quota, ctx.usage, ctx.role, ctx.run_id, ctx.agent_id)
        entry = {"check": name, "allowed": f.allowed, "rule": f.rule, "reason": f.reason}
        if f.flagged:
            entry["flagged"] = [dict(n) for n in f.flagged]
            notes.extend(f.flagged)
        trail.append(entry)
        flags.extend(x for x in f.flags if x not in flags)
        pinned = pinned or f.pinned
        if name == "quota" and f.allowed:
            continue  # a passed quota leaves the zone's verdict as the decision
        final, final_check = f, name
        if not f.allowed:
            break
    if an is not None and "dynamic_code" in an.flags and "dynamic_command" not in flags:
        flags.append("dynamic_command")
    assert final is not None
    reason = final.reason
    if final.allowed:
        reason = f"allowed: {tool_name} is in the {zone} zone and role '{ctx.role}' ({ctx.mode}) permits it."
        if flags:
            reason = reason[:-1] + f" (flagged: {', '.join(flags)})."
    return Decision(
        allowed=final.allowed, rule=final.rule, zone=zone, reason=reason, check=final_check,
        hint=final.hint, flags=tuple(flags), pinned=pinned, evidence=final.evidence,
        flagged=tuple(notes),
    ), trail


def judge_shell(command: str, ctx: GateContext) -> Decision:
    """One shell command line (as `agnsup check --batch` sees it)."""
    return check("run_shell", {"command": command}, ctx)[0]
