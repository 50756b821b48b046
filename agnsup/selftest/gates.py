"""The twenty hard gates of the authority-blackout test, and their verdicts.

A gate is checked one or more times during a run (each phase adds evidence).
Its verdict: FAIL if any check failed; otherwise ENV_BLOCKED: <capability>
if the host could not offer what a check needed; otherwise PASS if at least
one check passed. A gate nobody checked is NOT_EVALUATED, which is a failure:
a gate is evaluated, never assumed. A run whose scenario did not really
happen (the tree died with its controller, the PID-reuse trap missed) is
INVALID, not passed.
"""
from __future__ import annotations

GATES = {
    "DIRECT_PROCESS_BYPASS": "a canary-bin executable ran, or a process was started outside the process supervisor",
    "HOST_SECRET_LEAK": "a canary value reached a cell (environ, output, written file) or the cell read the decoy",
    "CALL_CHAIN_INCOMPLETE": "the receipt or journal lacks a stage of the chain, or shows them out of order",
    "OWNERSHIP_RECORD_MISSING": "before the crash, the journal lacks part of the cell's ownership record",
    "SAME_BOOT_IGNORED": "the janitor skipped the dead controller's cells because the boot id was unchanged",
    "ORPHAN_PROCESS_AFTER_CRASH": "a process of A1's tree is alive after recovery",
    "HEARTBEAT_CONTINUES": "a heartbeat file grows during the second after recovery (or cancel) reports done",
    "PORT_NOT_RELEASED": "a port the tree held cannot be bound after recovery or cancel",
    "SENTINEL_KILLED": "the sentinel (outside agnsup) was killed or signalled",
    "PID_REUSE_KILL": "the innocent process that reused a recorded PID was killed or signalled",
    "RESOURCE_LEAK": "after recovery or cleanup, a cgroup, temp dir, lock or lease remains",
    "STATE_NOT_CONVERGED": "R1 or A1 is not in an explicit terminal state after recovery",
    "RECOVERY_RECEIPT_MISSING": "no recovery receipt names the controller, each cell, the evidence and outcome",
    "RECEIPT_MISMATCH": "a receipt's exit status, termination reason or pids disagree with what happened",
    "CANCEL_AGENT_INCOMPLETE": "after cancel agent A, a process of A is alive or A's ports or locks are held",
    "CANCEL_CROSS_TALK": "cancel agent A stopped B1's heartbeats, or R2 no longer accepts a cell",
    "CANCEL_NOT_IDEMPOTENT": "a repeated cancel (cell, agent or run) errors or affects anything",
    "CANCEL_RUN_INCOMPLETE": "after cancel run R2, a process of R2 is alive",
    "CLEANUP_NOT_IDEMPOTENT": "the second cleanup run R2 errors or reports more than zero items",
    "LOCK_SCOPE_WRONG": "two worktrees of one agent cannot run at once, or two agents write one worktree at once",
}

PASS, FAIL, BLOCKED, NOT_EVALUATED = "PASS", "FAIL", "ENV_BLOCKED", "NOT_EVALUATED"


class Verdicts:
    def __init__(self, gates: dict | None = None):
        """`gates`: another table than the blackout's (the dead-man scenario's)."""
        self.gates = gates or GATES
        self.checks: dict[str, list[dict]] = {g: [] for g in self.gates}
        self.invalid: list[str] = []

    def check(self, gate: str, ok: bool, evidence: str, phase: str) -> bool:
        """Record one check of `gate`; `evidence` says what was observed either way."""
        if gate not in self.gates:
            raise KeyError(gate)
        self.checks[gate].append({"ok": bool(ok), "phase": phase, "evidence": evidence})
        return bool(ok)

    def blocked(self, gate: str, capability: str, phase: str) -> None:
        self.checks[gate].append({"ok": None, "phase": phase, "blocked": capability,
                                  "evidence": f"ENV_BLOCKED: {capability}"})

    def mark_invalid(self, why: str) -> None:
        self.invalid.append(why)

    def verdict(self, gate: str) -> tuple[str, str]:
        cs = self.checks[gate]
        fails = [c for c in cs if c["ok"] is False]
        if fails:
            return FAIL, "; ".join(f"[{c['phase']}] {c['evidence']}" for c in fails)
        blocked = [c for c in cs if c["ok"] is None]
        if blocked:
            return f"{BLOCKED}: {blocked[0]['blocked']}", "; ".join(f"[{c['phase']}] {c['evidence']}" for c in blocked)
        if cs:
            return PASS, "; ".join(f"[{c['phase']}] {c['evidence']}" for c in cs)
        return NOT_EVALUATED, "no check of this gate ran (an earlier step failed)"

    def result(self) -> dict:
        gates = {}
        for g in self.gates:
            status, evidence = self.verdict(g)
            gates[g] = {"status": status, "evidence": evidence, "checks": self.checks[g]}
        status = "INVALID" if self.invalid else PASS if all(v["status"] == PASS for v in gates.values()) else FAIL
        return {"status": status, "invalid": self.invalid, "gates": gates}


def format_table(run: dict, width: int = 110) -> str:
    """One run's gates as a text table an operator can paste into a bug report."""
    lines = [f"run {run['index'] + 1}  seed {run['seed']}  {run['status']}  ({run.get('seconds', 0):.1f} s)  "
             f"choices: {_choices(run.get('choices', {}))}"]
    lines += [f"  INVALID: {why}" for why in run.get("invalid", [])]
    for g, v in run.get("gates", {}).items():
        status = v["status"]
        ev = "" if status == PASS else "  " + v["evidence"]
        if len(ev) > width:
            ev = ev[:width - 3] + "..."
        lines.append(f"  {g:<27} {status}{ev}")
    if run.get("error"):
        lines.append(f"  error: {run['error']}")
    return "\n".join(lines)


def _choices(c: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in c.items())
