"""`agnsup check` judges without running anything."""
import json


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
