"""`agnsup check` judges without running anything (the gate itself: tests/gate/)."""
import json

from gate.test_presets import role
from gate.test_quota import quota_role


def test_check_denies_a_split_flag_rm_of_root_with_126_and_the_rule(agnsup, worktree):
    cp = agnsup("check", "--workdir", worktree, "--", "rm", "-r", "-f", "/", check=126)
    assert "hardline.rm_root" in cp.out


def test_check_allows_grep_for_the_word_curl(agnsup, worktree):
    cp = agnsup("check", "--workdir", worktree, "--json", "--", "grep", "-r", "curl", ".", check=0)
    assert json.loads(cp.out)["allowed"] is True


def test_check_batch_prints_one_json_decision_per_line(agnsup, worktree):
    lines = "rm -fr /\ngrep -r curl .\ncurl http://example.invalid\n"
    # one line is denied, so the batch exits 126 (docs/cli.md); every line still has its decision
    cp = agnsup("check", "--workdir", worktree, "--batch", "-", input=lines.encode(), check=126)
    out = [json.loads(line) for line in cp.out.splitlines()]
    # executor (mode open, kernel_enforced flag): the cell's network namespace refuses curl, so it is flagged
    assert [d["allowed"] for d in out] == [False, True, True]
    assert [d["rule"].split(".")[0] for d in out] == ["hardline", "allow", "allow"]
    assert "network.kernel_enforced" in out[2]["flags"] and out[2]["flagged"][0]["rule"] == "network.kernel_enforced"
    assert all({"command", "allowed", "rule", "zone", "reason"} <= set(d) for d in out)


def test_check_prints_each_flag_with_its_reason(agnsup, worktree):
    cp = agnsup("check", "--workdir", worktree, "--", "curl", "https://example.com", check=0)
    assert cp.out.startswith("allowed:") and "flagged network.kernel_enforced:" in cp.out
    assert "network namespace" in cp.out



def test_the_check_command_judges_under_a_preset(agnsup, worktree, policy_dir):
    role(policy_dir, "reg", 'preset = "regulated"')
    cp = agnsup("check", "--role", "reg", "--workdir", worktree, "--json", "--", "ls",
                env={"AGNSUP_POLICY_DIR": str(policy_dir)}, check=126)
    assert json.loads(cp.out)["rule"] == "zone.yellow_locked"



def test_agnsup_check_denies_a_role_whose_quota_is_zero(agnsup, worktree, policy_dir):
    quota_role(policy_dir, "none", max_cells_per_run=0)
    cp = agnsup("check", "--role", "none", "--workdir", worktree, "--", "true",
                env={"AGNSUP_POLICY_DIR": str(policy_dir)}, check=126)
    assert "quota.cells_per_run" in cp.out and "max_cells_per_run" in cp.out


def test_agnsup_check_says_which_quotas_it_cannot_judge(agnsup, worktree, policy_dir):
    quota_role(policy_dir, "one", max_concurrent_per_agent=1)
    cp = agnsup("check", "--role", "one", "--workdir", worktree, "--json", "--", "true",
                env={"AGNSUP_POLICY_DIR": str(policy_dir)}, check=0)
    q = [t for t in json.loads(cp.out)["trail"] if t["check"] == "quota"]
    assert q and q[0]["rule"] == "quota.unjudged" and "max_concurrent_per_agent=1" in q[0]["reason"]



def test_check_batch_judges_every_line_and_its_exit_status_says_whether_one_was_denied(agnsup, worktree):
    lines = ["ls", "cat /proc/1/root/etc/shadow", "echo " + "$(echo " * 300 + "x" + ")" * 300, "rm -rf /",
             "\udcff".encode("utf-8", "surrogateescape").decode("latin-1") + " ls", "git status"]
    data = "\n".join(lines).encode("utf-8", "surrogateescape") + b"\n\xff\xfe\x00 bad bytes\n"
    cp = agnsup("check", "--workdir", worktree, "--batch", "-", input=data, check=126)
    out = [json.loads(x) for x in cp.out.splitlines()]
    assert len(out) == len(lines) + 1
    assert [d["rule"] for d in out[:4]] == ["allow.yellow_open", "sandbox.deny_path", "gate.unjudgeable",
                                            "hardline.rm_root"]
    assert out[5]["allowed"] and "bad bytes" in out[6]["command"]
    assert all(d["evidence"] for d in out if not d["allowed"])
    cp = agnsup("check", "--workdir", worktree, "--batch", "-", input=b"ls\ngit status\n\n", check=0)
    assert len(cp.out.splitlines()) == 2


def test_a_single_check_of_an_unjudgeable_or_proc_path_exits_126(agnsup, worktree):
    cp = agnsup("check", "--workdir", worktree, "--", "cat", "/proc/1/root/etc/shadow", check=126)
    assert "sandbox.deny_path" in cp.out
    cp = agnsup("check", "--workdir", worktree, "--", "bash", "-c", "echo " + "$(echo " * 300 + ")" * 300, check=126)
    assert "gate.unjudgeable" in cp.out
