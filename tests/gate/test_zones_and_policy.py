"""Zones, modes, role allow/deny lists, unparseable input, and the decision's shape."""

import pytest

from agnsup.gate import Decision, GateContext, check, judge_shell
from agnsup.gate.programs import RECOMMENDED_DENY_COMMANDS

BASE = dict(worktree="/workspace/project", writable=("/",), home="/home/user", network="host")


@pytest.mark.parametrize("tool,zone", [
    ("read_file", "green"), ("grep", "green"), ("fetch", "green"), ("write_file", "yellow"),
    ("run_process", "yellow"), ("run_shell", "yellow"), ("apply_patch", "yellow"), ("some_new_tool", "yellow"),
    ("spawn_agent", "red"), ("delegate_task", "red"),
])
def test_tool_is_classified_into_its_zone(tool, zone):
    assert check(tool, {}, GateContext(**BASE))[0].zone == zone


def test_fetch_with_a_writing_method_is_yellow():
    assert check("fetch", {"method": "POST"}, GateContext(**BASE))[0].zone == "yellow"


@pytest.mark.parametrize("mode,tool,allowed,rule", [
    ("open", "write_file", True, "allow.yellow_open"),
    ("locked", "write_file", False, "zone.yellow_locked"),
    ("readonly", "write_file", False, "zone.yellow_readonly"),
    ("readonly", "read_file", True, "allow.green"),
    ("locked", "read_file", True, "allow.green"),
    ("open", "spawn_agent", True, "allow.red_audited"),
    ("readonly", "spawn_agent", False, "zone.red_readonly"),
    ("locked", "spawn_agent", False, "zone.red_locked"),
])
def test_mode_decides_the_yellow_and_red_zones(mode, tool, allowed, rule):
    d, _ = check(tool, {"path": "a.txt"}, GateContext(mode=mode, **BASE))
    assert (d.allowed, d.rule) == (allowed, rule)


def test_locked_role_allows_yellow_tools_it_lists():
    d, _ = check("write_file", {"path": "a"}, GateContext(mode="locked", yellow_allow=("write_file",), **BASE))
    assert d.allowed and d.rule == "allow.yellow_listed"


def test_locked_refusal_says_what_to_change():
    d, _ = check("write_file", {"path": "a"}, GateContext(mode="locked", **BASE))
    assert "yellow_allow" in d.hint and "write_file" in d.reason


def test_red_zone_is_always_flagged_audited():
    d, _ = check("spawn_agent", {"task": "x"}, GateContext(**BASE))
    assert "audited" in d.flags


def test_deny_command_refuses_the_program_and_its_wrappers():
    ctx = GateContext(deny_commands=("sudo", "docker"), **BASE)
    assert judge_shell("sudo ls", ctx).rule == "policy.deny_command"
    assert judge_shell("ls && docker ps", ctx).rule == "policy.deny_command"
    assert judge_shell("ls", ctx).allowed


def test_multi_word_deny_entry_matches_subcommand_and_flag_clusters():
    ctx = GateContext(deny_commands=RECOMMENDED_DENY_COMMANDS, **BASE)
    for c in ("git reset --hard", "sudo git reset --hard", "\\git reset --hard", "git clean -fdx",
              "git push --force=true origin main", "git push -f origin main", "echo $(git reset --hard)"):
        assert judge_shell(c, ctx).rule == "policy.deny_command", c
    for c in ("git reset --soft HEAD~1", "git status", "git clean -n", "echo 'git reset --hard'", "git push"):
        assert judge_shell(c, ctx).allowed, c


def test_allow_list_refuses_programs_not_on_it_but_not_shell_builtins():
    ctx = GateContext(allow_commands=("make", "pytest"), **BASE)
    assert judge_shell("cd src && make test", ctx).allowed
    d = judge_shell("make && curl x", ctx)
    assert d.rule == "policy.not_allowed" and "allow_commands" in d.hint and "curl" in d.reason


def test_empty_allow_entry_means_everything_is_allowed():
    assert judge_shell("anything --goes", GateContext(allow_commands=("",), **BASE)).allowed


def test_unparseable_text_is_denied_under_locked_and_flagged_under_open():
    text = "echo 'unterminated"
    locked = GateContext(mode="locked", yellow_allow=("run_shell",), **BASE)
    d = judge_shell(text, locked)
    assert d.rule == "policy.unparseable" and "parse" in d.reason
    d = judge_shell(text, GateContext(mode="open", **BASE))
    assert d.allowed and "unparseable" in d.flags


def test_unparseable_setting_overrides_the_mode_default():
    ctx = GateContext(mode="open", unparseable="deny", **BASE)
    assert judge_shell("ls (", ctx).rule == "policy.unparseable"


def test_dynamic_command_word_is_flagged_under_open():
    d = judge_shell('eval "$CMD"', GateContext(**BASE))
    assert d.allowed and "dynamic_command" in d.flags


def test_trail_lists_every_check_that_ran_in_order():
    _, trail = check("run_shell", {"command": "ls"}, GateContext(**BASE))
    assert [t["check"] for t in trail] == ["hardline", "policy", "sandbox", "network", "zone"]
    assert all(t["allowed"] for t in trail)


def test_first_denial_stops_the_chain():
    _, trail = check("run_shell", {"command": "curl x"}, GateContext(network="deny", worktree="/w", home="/h"))
    assert [t["check"] for t in trail] == ["hardline", "policy", "sandbox", "network"]
    assert trail[-1]["rule"] == "network.command"


def test_decision_serialises_to_a_plain_dict():
    d = judge_shell("rm -rf /", GateContext(**BASE))
    assert isinstance(d, Decision)
    data = d.to_dict()
    assert data["rule"] == "hardline.rm_root" and data["check"] == "hardline" and data["allowed"] is False
    assert set(data) >= {"allowed", "rule", "zone", "reason", "check", "hint", "flags"}


@pytest.mark.parametrize("command", ["rm -rf /", "curl x", "echo x > /etc/motd", "ls"])
def test_every_rule_id_is_namespaced_by_its_check(command):
    d = judge_shell(command, GateContext(worktree="/w", home="/h"))
    assert d.rule.split(".")[0] in ("hardline", "policy", "sandbox", "network", "zone", "allow")
    assert d.allowed == d.rule.startswith("allow.")
