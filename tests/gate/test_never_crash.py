"""One input line is one decision, always: the gate never raises, `check --batch` goes on (tests/test_check_cli.py),
every denial names its evidence, and no reason shows the gate's own pid."""

import json
import os
import shlex
from pathlib import Path

import pytest

from agnsup import governance, policy, record
from agnsup.gate import GateContext, check, judge_shell

CTX = GateContext(mode="open", network="host", worktree="/workspace/project", writable=("/",), home="/home/user")
CORPORA = Path(__file__).resolve().parents[1] / "data" / "corpora"


def _nested_sh(code: str, n: int) -> str:
    for _ in range(n):
        code = "bash -c " + shlex.quote(code)
    return code


UNJUDGEABLE = [
    "echo " + "$(echo " * 300 + "/" + ")" * 300,
    "rm -rf " + '"$(echo ' * 400 + "/" + ')"' * 400,
    "{ " * 500 + "ls" + "; }" * 500,
    "(" * 300 + "ls" + ")" * 300,
    _nested_sh("ls", 12),
    _nested_sh("rm -rf /", 9),
    "if true; then " * 200 + "ls" + "; fi" * 200,
]
ODD = ["", " ", "\x00", "\x00rm -rf /", "\udcff\udcfe", "((((((((" * 100, "a=" + "$(" * 1000, "x" * 200_000,
       "'" * 1001, "echo $((" + "1+" * 5000 + "1))", "cat <<EOF\n" + "line\n" * 10000 + "EOF", "\\" * 5000,
       "ls /proc/1/root/", "cat /proc/1/cwd/x", "touch /proc/1/root/etc/x", "cd /proc/1/root && rm -rf *"]


@pytest.mark.parametrize("command", UNJUDGEABLE, ids=range(len(UNJUDGEABLE)))
def test_text_nested_deeper_than_the_gate_follows_is_denied_as_unjudgeable(command):
    d = judge_shell(command, CTX)
    assert (d.allowed, d.rule, d.check) == (False, "gate.unjudgeable", "gate"), d
    assert "cannot be judged" in d.reason and d.hint and d.evidence


@pytest.mark.parametrize("command", ODD, ids=range(len(ODD)))
def test_odd_input_gets_a_decision_and_no_exception(command):
    d = judge_shell(command, CTX)
    assert d.rule and d.reason and (d.allowed or d.evidence)


def test_paths_through_proc_1_root_are_judged_as_the_paths_they_name():
    assert judge_shell("cat /proc/1/root/etc/shadow", CTX).rule == "sandbox.deny_path"
    assert judge_shell("rm -rf /proc/1/root/", CTX).rule == "hardline.rm_root"
    assert judge_shell("cd /proc/1/root && rm -rf *", CTX).rule == "hardline.rm_root"


def test_a_failing_check_is_a_denial_with_the_reason_not_an_exception(monkeypatch):
    from agnsup.gate import hardline

    def broken(*a, **k):
        raise ValueError("boom")
    monkeypatch.setattr(hardline, "check", broken)
    d, trail = check("run_shell", {"command": "ls"}, CTX)
    assert (d.allowed, d.rule) == (False, "gate.unjudgeable") and "ValueError: boom" in d.reason
    assert d.evidence == "ls" and trail == [{"check": "gate", "allowed": False, "rule": "gate.unjudgeable",
                                             "reason": d.reason}]


def _corpus_lines():
    out = []
    for name in ("benign_hard_negatives.txt", "dangerous_catastrophic.txt"):
        out += [x for x in (CORPORA / name).read_text(encoding="utf-8").splitlines() if x.strip()]
    out += [json.loads(x)["command"] for x in (CORPORA / "dcg_labeled_corpus.jsonl").read_text().splitlines()]
    return out + ["ls /proc/self/fd", "echo x > /proc/self/fd/9", "touch /proc/self/cwd/../../../x",
                  "cat /proc/thread-self/root/etc/shadow", "cp x /proc/self/root/usr/bin/"]


def test_every_denial_names_its_evidence_and_no_reason_shows_the_gates_pid(tmp_path, monkeypatch):
    (tmp_path / "reg.toml").write_text('[role]\nname = "reg"\n[env]\npath = ["/usr/bin"]\n'
                                       '[governance]\npreset = "regulated"\n')
    monkeypatch.setenv("AGNSUP_POLICY_DIR", str(tmp_path))
    pid = str(os.getpid())
    lines = _corpus_lines()
    for role in ("reg", "executor", "networked", "readonly"):
        ctx = record.replace(governance.context(policy.load(role), "/workspace/project", None), home="/home/user")
        decisions = [(c, judge_shell(c, ctx)) for c in lines]
        assert [c for c, d in decisions if not d.allowed and not d.evidence] == [], role
        assert [c for c, d in decisions if f"/proc/{pid}" in json.dumps(d.to_dict())] == [], role
        if role == "reg":
            assert sum(not d.allowed for _, d in decisions) == len(lines)  # locked without yellow_allow
