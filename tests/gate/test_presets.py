"""Presets standard, regulated and readonly: files a role inherits governance from."""
import os

import pytest

from agnsup import governance, policy
from agnsup.errors import PolicyError
from agnsup.gate import check

ENV = '[env]\npath = ["/usr/bin", "/bin"]\n'


def role(policy_dir, name, governance_lines="", extra=""):
    text = f'[role]\nname = "{name}"\n{ENV}[governance]\n{governance_lines}\n{extra}'
    (policy_dir / f"{name}.toml").write_text(text)
    return str(policy_dir / f"{name}.toml")


@pytest.fixture
def roles(policy_dir, monkeypatch):
    monkeypatch.setenv("AGNSUP_POLICY_DIR", str(policy_dir))
    return policy_dir


def preset(policy_dir, name, body=""):
    """A preset file presets/NAME.toml holding body, and a role "r" that inherits it; returns the file."""
    (policy_dir / "presets").mkdir(exist_ok=True)
    path = policy_dir / "presets" / f"{name}.toml"
    path.write_text(f'[preset]\nname = "{name}"\n{body}')
    role(policy_dir, "r", f'preset = "{name}"')
    return path


def load_error(name) -> str:
    """The message of the PolicyError loading this role raises."""
    with pytest.raises(PolicyError) as e:
        policy.load(name)
    return e.value.message


def ctx_of(name, worktree="/workspace/project"):
    return governance.context(policy.load(name), worktree, None)


def test_the_shipped_presets_are_standard_regulated_and_readonly():
    assert policy.known_presets() == ["readonly", "regulated", "standard"]


def test_the_shipped_command_roles_inherit_the_standard_preset():
    for name in ("executor", "networked", "readonly", "proxied"):
        assert policy.load(name)["_preset"]["name"] == "standard"


def test_the_standard_preset_allows_side_effects_and_flags_unparseable_text(roles):
    role(roles, "std", 'preset = "standard"')
    ctx = ctx_of("std")
    assert (ctx.mode, ctx.unparseable, ctx.network) == ("open", "flag", "deny")
    assert check("write_file", {"path": "a.txt"}, ctx)[0].rule == "allow.yellow_open"
    d, _ = check("run_shell", {"command": "echo 'unterminated"}, ctx)
    assert d.allowed and "unparseable" in d.flags


def test_the_regulated_preset_locks_every_yellow_tool_the_role_does_not_list(roles):
    role(roles, "reg", 'preset = "regulated"')
    ctx = ctx_of("reg")
    assert (ctx.mode, ctx.network) == ("locked", "deny")
    for tool in ("write_file", "run_process", "apply_patch"):
        d, _ = check(tool, {"path": "a.txt"}, ctx)
        assert (d.allowed, d.rule) == (False, "zone.yellow_locked") and "yellow_allow" in d.hint
    assert check("read_file", {"path": "a.txt"}, ctx)[0].allowed


def test_the_regulated_preset_allows_exactly_the_tools_in_yellow_allow(roles):
    role(roles, "reg", 'preset = "regulated"\nyellow_allow = ["write_file", "spawn_agent"]')
    ctx = ctx_of("reg")
    assert check("write_file", {"path": "a.txt"}, ctx)[0].rule == "allow.yellow_listed"
    assert check("edit", {"path": "a.txt"}, ctx)[0].rule == "zone.yellow_locked"
    red, _ = check("spawn_agent", {"task": "x"}, ctx)
    assert red.allowed and "audited" in red.flags


def test_the_regulated_preset_refuses_text_it_cannot_parse(roles):
    role(roles, "reg", 'preset = "regulated"\nyellow_allow = ["run_shell"]')
    d, _ = check("run_shell", {"command": "echo 'unterminated"}, ctx_of("reg"))
    assert (d.allowed, d.rule) == (False, "policy.unparseable")


def test_the_regulated_preset_refuses_history_destroying_git_and_a_role_adds_to_that_list(roles):
    role(roles, "reg", 'preset = "regulated"\nyellow_allow = ["run_shell"]\ndeny_commands = ["docker"]')
    ctx = ctx_of("reg")
    assert check("run_shell", {"command": "git reset --hard HEAD~3"}, ctx)[0].rule == "policy.deny_command"
    assert check("run_shell", {"command": "docker ps"}, ctx)[0].rule == "policy.deny_command"
    assert check("run_shell", {"command": "git status"}, ctx)[0].allowed


def test_the_regulated_preset_sets_run_quotas_a_role_may_change(roles):
    role(roles, "reg", 'preset = "regulated"', '[quota]\nmax_concurrent_per_agent = 1\n')
    q = policy.load("reg")["quota"]
    assert q["max_concurrent_per_agent"] == 1 and q["max_concurrent_per_run"] == 8


@pytest.mark.parametrize("lines,key", [
    ('mode = "open"', "governance.mode"),
    ('unparseable = "flag"', "governance.unparseable"),
])
def test_a_role_cannot_loosen_a_key_the_regulated_preset_fixes(roles, lines, key):
    path = role(roles, "loose", f'preset = "regulated"\n{lines}')
    msg = load_error("loose")
    assert msg.startswith(path) and f"key {key}" in msg and "regulated" in msg and "looser" in msg


def test_a_role_cannot_give_a_regulated_role_the_host_network(roles):
    path = role(roles, "netreg", 'preset = "regulated"', '[network]\nmode = "host"\n')
    msg = load_error("netreg")
    assert msg.startswith(path) and "key network.mode: 'host' is looser" in msg


def test_a_role_may_tighten_a_fixed_key_of_its_preset(roles):
    role(roles, "tight", 'preset = "regulated"\nmode = "readonly"')
    assert ctx_of("tight").mode == "readonly"


def test_the_readonly_preset_denies_yellow_and_red_and_allows_green(roles):
    role(roles, "look", 'preset = "readonly"')
    ctx = ctx_of("look")
    d = check("write_file", {"path": "a.txt"}, ctx)[0]  # the worktree is read-only: the sandbox refuses first
    assert d.rule == "sandbox.path_escape" and "read-only" in d.reason and "filesystem.worktree" in d.hint
    assert check("write_file", {"path": "/tmp/a.txt"}, ctx)[0].rule == "zone.yellow_readonly"
    assert check("run_process", {"argv": ["ls"]}, ctx)[0].rule == "zone.yellow_readonly"
    assert check("spawn_agent", {}, ctx)[0].rule == "zone.red_readonly"
    assert check("grep", {"pattern": "x", "path": "."}, ctx)[0].rule == "allow.green"
    assert policy.load("look")["filesystem"]["worktree"] == "ro"


def test_an_unknown_preset_names_the_file_the_key_and_the_known_presets(roles):
    path = role(roles, "typo", 'preset = "regulatd"')
    assert load_error("typo") == (f"{path}: key governance.preset: unknown preset 'regulatd' "
                               "(known: readonly, regulated, standard)")


def test_a_preset_with_a_section_it_may_not_set_is_refused_naming_the_preset_file(roles):
    bad = preset(roles, "odd", '[env]\npath = ["/bin"]\n')
    assert load_error("r").startswith(f"{bad}: key env: a preset may set only governance")


def test_a_bad_value_inherited_from_a_preset_is_blamed_on_the_preset_file(roles):
    bad = preset(roles, "odd", '[governance]\nmode = "lax"\n')
    assert load_error("r").startswith(f"{bad}: key governance.mode: Input should be")


def test_a_preset_cannot_fix_a_key_it_does_not_set(roles):
    preset(roles, "odd", 'fixed = ["network.mode"]\n')
    with pytest.raises(PolicyError, match=r"key preset.fixed: 'network.mode' is fixed but the preset does not set"):
        policy.load("r")


def test_editing_a_preset_invalidates_the_cached_role(roles, tmp_path):
    state = str(tmp_path / "st")
    os.makedirs(state)
    pre = preset(roles, "mine", '[governance]\nmode = "open"\n')
    first = policy.load("r", state)
    assert first["governance"]["mode"] == "open"
    pre.write_text('[preset]\nname = "mine"\n[governance]\nmode = "locked"\n')
    second = policy.load("r", state)
    assert second["governance"]["mode"] == "locked" and second["_digest"] != first["_digest"]


