"""The gate: named checks in order, first denial wins.

    hardline -> gate -> policy -> git -> sandbox -> network -> zone -> quota

Each check returns a Finding; the trail records every check that ran. A
denial is a value carried to the receipt, never an exception: a call the
gate cannot judge (text nested deeper than it follows, or an error inside a
check) is denied as `gate.unjudgeable` with the reason, so one call is
always one decision. Code decoded at run time and run (`base64 -d | sh`;
gate/unreadable.py) is `gate.unreadable_code`: refused or flagged by
governance.unreadable. A refusal the cell's kernel makes anyway
(GateContext.kernel, governance.kernel_enforced), or an operand known only
at run time under governance.unknown_operands = "flag", is a pass with
`flagged` notes: its rule id joins the decision's flags, the notes go to the
trail entry and the decision. Every denial names its evidence.
"""

from __future__ import annotations

from . import hardline, network, programs, quota, sandbox, zones
from .commands import analyze_argv, analyze_shell
from .model import UPLOADERS, Analysis, Decision, Finding, GateContext, deny, ok, split_words

COMMAND_KEYS = ("command", "cmd", "script", "shell", "argv")
ORDER = ("hardline", "gate", "policy", "git", "sandbox", "network", "zone", "quota")
HINT_UNJUDGEABLE = ("Split the command into simpler steps (or pass an argv list to run_process); text the gate "
                    "cannot judge is refused in every role.")


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


def _evidence(args: dict, tool: str) -> str:
    """What a denial without an evidence of its own points at: the call's command, else the tool."""
    for key in COMMAND_KEYS:
        v = args.get(key)
        if isinstance(v, str) and v:
            return v[:200]
        if isinstance(v, (list, tuple)) and v:
            return " ".join(str(x) for x in v)[:200]
    return tool


def _unjudgeable(an: Analysis | None) -> Finding:
    if an is not None and an.unjudgeable:
        return deny("gate.unjudgeable", f"{an.unjudgeable[0]}, so it cannot be judged.", HINT_UNJUDGEABLE)
    return ok("gate.pass")


def check(tool_name: str, args: dict, ctx: GateContext, *, resolver=None) -> tuple[Decision, list[dict]]:
    """Judge one tool call. Returns the decision and the trail of checks that ran.

    `resolver(host) -> list[str]` replaces DNS resolution for URL arguments
    (tests; a caller with its own resolver). Never raises for a call it cannot
    judge: that is the decision `gate.unjudgeable`.
    """
    args = args if isinstance(args, dict) else {}
    try:
        return _check(tool_name, args, ctx, resolver)
    except (RecursionError, MemoryError) as e:
        why = f"the call is nested too deeply for the gate to follow ({type(e).__name__})"
    except Exception as e:  # a gate bug must refuse the call, not crash the caller
        why = f"the gate failed while judging it ({type(e).__name__}: {str(e)[:200]})"
    reason = f"{why}, so it cannot be judged."
    d = Decision(allowed=False, rule="gate.unjudgeable", zone=zones.zone_of(str(tool_name), args), reason=reason,
                 check="gate", hint=HINT_UNJUDGEABLE, evidence=_evidence(args, str(tool_name)))
    return d, [{"check": "gate", "allowed": False, "rule": d.rule, "reason": reason}]


def _check(tool_name: str, args: dict, ctx: GateContext, resolver) -> tuple[Decision, list[dict]]:
    zone = zones.zone_of(tool_name, args)
    an = analyze_call(args)
    trail: list[dict] = []
    flags: list[str] = []
    notes: list[dict] = []  # refusals allowed with a flag (kernel-backed, unknown operands)
    pinned = ""
    final: Finding | None = None
    final_check = ""
    for name in ORDER:
        if name == "hardline":
            f = hardline.check(an, home=ctx.home, worktree=ctx.worktree, unknown_operands=ctx.unknown_operands,
                               role=ctx.role) if an is not None else hardline.ok("hardline.pass")
        elif name == "gate":
            if an is None or not (an.unjudgeable or an.unreadable_code):
                continue
            if an.unjudgeable:
                f = _unjudgeable(an)
            else:
                from .unreadable import decide  # decoded code run (`base64 -d | sh`): refused or flagged
                f = decide(an, ctx)
        elif name == "policy":
            f = programs.check(an, ctx)
        elif name == "git":
            if an is None or not any(e.prog == "git" or e.prog.startswith("git-") for e in an.execs):
                continue  # only a call that runs git has anything for this check
            from . import git
            f = git.check(an, ctx)
        elif name == "sandbox":
            f = sandbox.check(tool_name, args, zone, an, ctx)
        elif name == "network":
            f = network.check(tool_name, args, an, ctx, resolver=resolver)
            # a program or a line that reads a credential and sends (inline.check passes anything else as is)
            if f.allowed and an is not None and an.execs and (an.exfil or any(e.prog in UPLOADERS for e in an.execs)):
                from . import inline
                f = inline.check(an, ctx, tool_name, f)
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
        reason = f"{tool_name} is in the {zone} zone and role '{ctx.role}' ({ctx.mode}) permits it."
        if flags:
            reason = reason[:-1] + f" (flagged: {', '.join(flags)})."
    evidence = final.evidence or ("" if final.allowed else _evidence(args, tool_name))
    return Decision(
        allowed=final.allowed, rule=final.rule, zone=zone, reason=reason, check=final_check,
        hint=final.hint, flags=tuple(flags), pinned=pinned, evidence=evidence,
        flagged=tuple(notes),
    ), trail


def judge_shell(command: str, ctx: GateContext) -> Decision:
    """One shell command line (as `agnsup check --batch` sees it)."""
    return check("run_shell", {"command": command}, ctx)[0]
