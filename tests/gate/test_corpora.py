"""Figures on the corpora in tests/data/corpora (text only: nothing is executed)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from agnsup import governance, policy
from agnsup.util import record
from agnsup.gate import GateContext, judge_shell
from agnsup.gate.programs import RECOMMENDED_DENY_COMMANDS

ROOT = Path(__file__).resolve().parents[2]
CORPORA = ROOT / "tests" / "data" / "corpora"
EXECUTOR = GateContext(mode="open", network="deny", worktree="/workspace/project", writable=("/tmp", "/var/tmp"),
                       home="/home/user")
LAYOUT_FREE = GateContext(mode="open", network="host", worktree="/workspace/project", writable=("/",),
                          home="/home/user")
# A worktree clean step, not a catastrophe; kept allowed on purpose (docs/governance.md).
CATASTROPHIC_EXCEPTIONS = {"rm -rf ./build"}


def _lines(name):
    out = []
    for raw in (CORPORA / name).read_text(encoding="utf-8").splitlines():
        if raw.strip():
            out.append(raw.replace("\\n", "\n") if "<<" in raw else raw)
    return out


def _dcg():
    return [json.loads(x) for x in (CORPORA / "dcg_labeled_corpus.jsonl").read_text(encoding="utf-8").splitlines()]


@pytest.mark.parametrize("command", [c for c in _lines("dangerous_catastrophic.txt")
                                     if c not in CATASTROPHIC_EXCEPTIONS])
def test_every_catastrophic_line_is_denied_by_hardline(command):
    d = judge_shell(command, EXECUTOR)
    assert not d.allowed and d.check == "hardline", d


def test_the_documented_catastrophic_exceptions_are_still_allowed():
    for c in CATASTROPHIC_EXCEPTIONS:
        assert judge_shell(c, EXECUTOR).allowed


def shipped(role: str) -> GateContext:
    """A shipped role's gate context as `agnsup run` builds it (kernel_enforced flag from its preset)."""
    from agnsup.util import record
    return record.replace(governance.context(policy.load(role), "/workspace/project", None), home="/home/user")


@pytest.mark.parametrize("role", ["executor", "networked"])
def test_hard_negatives_are_falsely_denied_less_than_one_percent_of_the_time_under_the_shipped_role(role):
    lines = _lines("benign_hard_negatives.txt")
    decisions = [(c, judge_shell(c, shipped(role))) for c in lines]
    # With the host network, the host's loopback services are the role's to list (network.allow_internal);
    # the shipped networked role lists none, so `curl http://localhost:9200/...` is refused by design.
    loopback = [c for c, d in decisions if d.rule == "network.ssrf" and "loopback" in d.reason]
    denied = [c for c, d in decisions if not d.allowed and c not in loopback]
    assert len(denied) / len(lines) < 0.01, denied
    if role == "networked":
        assert len(loopback) == 18 and all("localhost" in c for c in loopback), loopback
        listed = record.replace(shipped(role), allow_internal=("loopback",))
        assert [c for c in loopback if not judge_shell(c, listed).allowed] == []
    else:
        assert loopback == []


def test_every_catastrophic_line_is_still_denied_by_hardline_under_the_shipped_executor_role():
    ctx = shipped("executor")
    assert ctx.kernel_enforced == "flag" and ctx.kernel.netns and ctx.kernel.root_ro
    allowed = [c for c in _lines("dangerous_catastrophic.txt") if judge_shell(c, ctx).check != "hardline"]
    assert allowed == sorted(CATASTROPHIC_EXCEPTIONS)


def test_hard_negatives_are_falsely_denied_less_than_one_percent_of_the_time():
    lines = _lines("benign_hard_negatives.txt")
    # host network, no network.allow_internal: the 18 `curl http://localhost:...` lines are refused by design
    denied = [c for c in lines if not judge_shell(c, record.replace(LAYOUT_FREE, allow_internal=("loopback",))).allowed]
    assert len(denied) / len(lines) < 0.01, denied


def test_dcg_bypass_attempts_are_all_caught_with_the_recommended_deny_list():
    ctx = GateContext(mode="open", network="host", worktree="/workspace/project", writable=("/",),
                      home="/home/user", deny_commands=RECOMMENDED_DENY_COMMANDS)
    rows = [r for r in _dcg() if r["category"].startswith(("bypass", "wrappers", "multi-segment",
                                                           "command-substitution", "quoted", "git.", "rm."))]
    missed = [r["command"] for r in rows if (r["expected"] == "deny") == judge_shell(r["command"], ctx).allowed]
    assert missed == []


def test_dcg_false_positive_set_is_allowed():
    rows = [r for r in _dcg() if r["category"] in ("false_positives", "substring.false-positives", "git.safe",
                                                   "rm.safe.tmp", "wrappers.command") and r["expected"] == "allow"]
    denied = [r["command"] for r in rows if not judge_shell(r["command"], LAYOUT_FREE).allowed]
    assert denied == []


def test_importing_the_gate_and_judging_an_argv_does_not_load_the_shell_parser():
    code = ("import sys; from agnsup.gate import check, GateContext; "
            "d, _ = check('run_process', {'argv': ['true']}, GateContext()); "
            "assert d.allowed; assert 'tree_sitter' not in sys.modules, 'parser loaded'; "
            "check('run_process', {'argv': ['sh', '-c', 'true']}, GateContext()); "
            "assert 'tree_sitter' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
