"""The governance stage: a list of named checks, first deny wins.

Each check returns a decision with a rule id namespaced by the check; the
decision (allowed or not) and the trail of every check that ran are values
that travel to the journal and the receipt. A denial starts nothing.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass

from .errors import Denied


@dataclass(frozen=True)
class Decision:
    allowed: bool
    rule: str
    zone: str
    reason: str
    check: str
    hint: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def _program(argv: list[str]) -> str:
    return os.path.basename(argv[0])


def check_deny_list(tool: str, args: dict, policy: dict) -> Decision | None:
    prog = _program(args.get("argv") or [""])
    if prog in policy["governance"].get("deny_commands", []):
        return Decision(False, "policy.deny_command", "yellow",
                        f"role {policy['role']['name']!r} never runs {prog!r}", "policy",
                        hint=f"remove {prog!r} from governance.deny_commands in {policy.get('_file')}")
    return None


def check_allow_list(tool: str, args: dict, policy: dict) -> Decision | None:
    allow = policy["governance"].get("allow_commands", [])
    prog = _program(args.get("argv") or [""])
    if allow and prog not in allow:
        return Decision(False, "policy.not_allowed", "yellow",
                        f"role {policy['role']['name']!r} only runs {', '.join(allow)}; {prog!r} is not one of them",
                        "policy", hint=f"add {prog!r} to governance.allow_commands in {policy.get('_file')}")
    return None


CHECKS = (("policy.deny_commands", check_deny_list), ("policy.allow_commands", check_allow_list))


def decide(tool: str, args: dict, policy: dict) -> tuple[Decision, list[dict]]:
    trail = []
    for name, fn in CHECKS:
        d = fn(tool, args, policy)
        trail.append({"check": name, "allowed": d is None or d.allowed, "rule": d.rule if d else "pass"})
        if d is not None and not d.allowed:
            return d, trail
    return Decision(True, "allow.default", "yellow", "no check denied the call", "governance"), trail


def enforce(decision: Decision) -> None:
    if not decision.allowed:
        hint = f" (if this is wrong: {decision.hint})" if decision.hint else ""
        raise Denied(f"denied by {decision.rule}: {decision.reason}{hint}", decision=decision.to_dict())
