"""Redaction in real cells (the engine's tables: tests/test_redact.py): what run_process, a Supervisor and
the receipt give back, and that the capture files and a terminal's output are left as the cell wrote them."""
import json
import os

import pytest

from test_redact import ALL, AWS_ID, PEM


@pytest.fixture
def redacting(policy_dir, monkeypatch, worktree):
    from conftest import write_role
    write_role(policy_dir, "redacting", governance__redact=json.dumps(ALL),
               governance__redact_patterns='{ ticket = "ACME-[0-9]{6}" }')
    write_role(policy_dir, "plain")
    monkeypatch.setenv("AGNSUP_POLICY_DIR", str(policy_dir))
    monkeypatch.setenv("DEPLOY_TOKEN", "dpl-5f3a9c0e7b21")  # a host secret the cell is not given
    secrets = f"id={AWS_ID}\ntoken=dpl-5f3a9c0e7b21\nticket ACME-123456\n{PEM}\n"
    with open(os.path.join(worktree, "leak.txt"), "w") as f:
        f.write(secrets)
    return secrets


def test_run_process_returns_redacted_output_and_the_receipt_counts_each_rule(state, worktree, redacting):
    from agnsup.tool import run_process
    res = run_process(["sh", "-c", "cat leak.txt; cat leak.txt >&2"], role="redacting", state_dir=state,
                      workdir=worktree, timeout=60)
    assert res["exit_code"] == 0, res
    for stream in ("stdout", "stderr"):
        out = res[stream]
        assert AWS_ID not in out and "dpl-5f3a9c0e7b21" not in out and "ACME-123456" not in out
        assert "b3BlbnNzaC1rZXktdjEAAAAABG5vbmU=" not in out and out.startswith("id=[REDACTED:redact.aws_access_key_id]")
    with open(res["receipt"]) as f:
        receipt = json.load(f)
    red = receipt["output"]["redaction"]
    assert red["rules"] == ALL and red["patterns"] == {"ticket": "ACME-[0-9]{6}"}
    assert red["counts"] == {"redact.aws_access_key_id": 2, "redact.host_secret": 2, "redact.private_key": 2,
                             "redact.role.ticket": 2}
    assert "dpl-5f3a9c0e7b21" not in json.dumps(receipt)
    # the capture file holds what the cell wrote (its digest is in the receipt)
    with open(receipt["output"]["stdout"]["path"]) as f:
        assert f.read() == redacting


def test_a_role_without_redaction_gets_the_output_as_written(state, worktree, redacting):
    from agnsup.tool import run_process
    res = run_process(["cat", "leak.txt"], role="plain", state_dir=state, workdir=worktree, timeout=60)
    assert res["stdout"] == redacting
    with open(res["receipt"]) as f:
        assert "redaction" not in json.load(f)["output"]


def test_a_secret_the_cell_was_given_is_its_own_and_not_redacted(state, worktree, redacting):
    from agnsup.tool import run_process
    res = run_process(["sh", "-c", 'echo "$DEPLOY_TOKEN"'], role="redacting", state_dir=state, workdir=worktree,
                      env=["DEPLOY_TOKEN"], timeout=60)
    assert res["stdout"] == "dpl-5f3a9c0e7b21\n"


def test_the_supervisor_front_door_returns_redacted_output(state, worktree, redacting):
    from agnsup import Supervisor
    with Supervisor(state_dir=state) as sup:
        h = sup.spawn(["cat", "leak.txt"], run_id="R", agent_id="A", role="redacting", workdir=worktree)
        res = sup.wait(h["run_id"], h["cell_id"])
    assert AWS_ID not in res["stdout"] and "[REDACTED:redact.host_secret]" in res["stdout"]


def test_a_terminal_gets_what_the_cell_wrote(agnsup, worktree, redacting, policy_dir):
    cp = agnsup("run", "--role", "redacting", "--workdir", worktree, "--", "cat", "leak.txt",
                env={"AGNSUP_POLICY_DIR": str(policy_dir)}, check=0)
    assert cp.out == redacting

