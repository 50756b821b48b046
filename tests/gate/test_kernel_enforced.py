"""What the cell's kernel refuses anyway is a flag under mode open, a denial otherwise.

Under `network: deny` a cell has its own network namespace (only lo up); under
`filesystem.root = "ro"` everything but the worktree, /tmp and /dev/shm is a
read-only mount; the role's deny paths are masked. For a command that runs in
a cell (run_process, run_shell) under mode open with governance.kernel_enforced
= "flag" (the standard preset), the gate's matching refusals become flags
(network.kernel_enforced, sandbox.kernel_enforced). Under locked (regulated)
or kernel_enforced = "deny" they stay denials; what the kernel does not
enforce stays a denial in every mode. tests/test_gate_cells.py runs the flagged
commands in real cells and watches the kernel refuse them.
"""
import os
import types

import pytest

from agnsup import compiler, governance, policy, record
from agnsup.errors import PolicyError
from agnsup.gate import GateContext, check, judge_shell
from conftest import write_role

WT = "/workspace/project"


def ctx_of(name: str, **replace) -> GateContext:
    ctx = governance.context(policy.load(name), WT, "/var/lib/agnsup-test-state")
    return record.replace(ctx, **replace) if replace else ctx


@pytest.fixture
def roles(policy_dir, monkeypatch):
    monkeypatch.setenv("AGNSUP_POLICY_DIR", str(policy_dir))
    return policy_dir


# (what, command, the denial the kernel backs, the flag under open)
DEMOTED = [
    ("a curl under network deny", "curl -sS https://github.com/org/repo", "network.command"),
    ("an ssh behind sudo under network deny", "sudo ssh build-host uptime", "network.command"),
    ("an rsync to a remote host under network deny", "rsync -a ./dist/ user@host:/srv/", "network.command"),
    ("a /dev/tcp redirection under network deny", "echo hi > /dev/tcp/10.0.0.1/80", "network.dev_tcp"),
    ("a pip install under network deny", "pip install requests", "network.command"),
    ("a python -m pip install -r under network deny", "python3 -m pip install -r requirements.txt",
     "network.command"),
    ("an npm install under network deny", "npm install is-odd", "network.command"),
    ("a git clone of an https URL under network deny", "git clone https://github.com/org/repo", "network.command"),
    ("a git fetch from an scp-style remote under network deny", "git fetch git@github.com:org/repo.git",
     "network.command"),
    ("a cargo fetch under network deny", "cargo fetch", "network.command"),
    ("a write under /usr with a read-only root", "echo x > /usr/local/share/x.txt", "sandbox.path_escape"),
    ("an rsync into /dest with a read-only root", "rsync -a /src/ /dest/", "sandbox.path_escape"),
    ("a removal in the host's /var/tmp with a read-only root", "rm -rf /var/tmp/build", "sandbox.path_escape"),
    ("a cgroup write with a read-only root", "echo $$ > /sys/fs/cgroup/cpu/tasks", "sandbox.path_escape"),
    ("a read of the masked ~/.ssh", "cat ~/.ssh/config", "sandbox.deny_path"),
    ("a read of the masked state root", "cat /var/lib/agnsup-test-state/journal.db", "sandbox.deny_path"),
]
FLAG_OF = {"network": "network.kernel_enforced", "sandbox": "sandbox.kernel_enforced"}


@pytest.mark.parametrize("what,command,rule", DEMOTED, ids=[d[0] for d in DEMOTED])
def test_a_kernel_backed_refusal_is_a_flag_under_open_with_its_rule_and_reason(what, command, rule):
    d, trail = check("run_shell", {"command": command}, ctx_of("executor"))
    flag = FLAG_OF[rule.split(".")[0]]
    assert d.allowed and d.rule == "allow.yellow_open", d
    assert flag in d.flags and flag in d.reason
    note = next(n for n in d.flagged if n["rule"] == flag)
    assert ("network namespace" if flag.startswith("network") else "mount") in note["reason"]
    entry = next(t for t in trail if t["rule"] == flag)
    assert entry["allowed"] and entry["flagged"][0]["rule"] == flag
    assert d.to_dict()["flagged"][0]["rule"] == flag


@pytest.mark.parametrize("command", ["pip install -e .", "pip install ./dist/x-1.0-py3-none-any.whl",
                                     "pip download --no-index -d wheels x", "npm ci --offline", "git clone ../other",
                                     "git commit -m x", "git fetch origin", "cargo build --offline",
                                     "cargo install --path ."])
def test_local_package_and_git_jobs_are_no_network_use(command):
    d = judge_shell(command, ctx_of("executor", kernel_enforced="deny"))
    assert d.allowed and "network.kernel_enforced" not in d.flags, d


@pytest.mark.parametrize("what,command,rule", DEMOTED, ids=[d[0] for d in DEMOTED])
def test_the_same_refusal_is_a_denial_with_kernel_enforced_deny(what, command, rule):
    d = judge_shell(command, ctx_of("executor", kernel_enforced="deny"))
    assert (d.allowed, d.rule) == (False, rule), d
    assert "kernel_enforced" in d.hint  # says which key would let it run flagged


@pytest.mark.parametrize("what,command,rule", DEMOTED, ids=[d[0] for d in DEMOTED])
def test_the_same_refusal_is_a_denial_under_locked_even_with_kernel_enforced_flag(what, command, rule):
    d = judge_shell(command, ctx_of("executor", mode="locked", yellow_allow=("run_shell",)))
    assert (d.allowed, d.rule) == (False, rule), d


@pytest.mark.parametrize("what,command,rule", DEMOTED, ids=[d[0] for d in DEMOTED])
def test_the_same_refusal_is_a_denial_under_the_regulated_preset(what, command, rule, roles):
    write_role(roles, "reg", governance__preset='"regulated"', governance__mode='"locked"',
               governance__yellow_allow='["run_shell"]')
    ctx = ctx_of("reg")
    assert ctx.kernel_enforced == "deny"
    d = judge_shell(command, ctx)
    assert (d.allowed, d.rule) == (False, rule), d


# What the kernel does not enforce for the role stays a denial under open + flag.
NOT_DEMOTED = [
    ("hardline is never lifted", "executor", {}, "rm -rf /usr/lib", "hardline.rm_system"),
    ("a catastrophic kubectl stays hardline", "executor", {}, "kubectl delete namespace production",
     "hardline.cloud_destroy"),
    ("metadata SSRF under the host network", "networked", {}, "curl http://169.254.169.254/latest/meta-data/",
     "network.ssrf_metadata"),
    ("a role's deny_commands", "executor", {"deny_commands": ("rsync",)}, "rsync -a /src/ /dest/",
     "policy.deny_command"),
    ("a write to a deny path", "executor", {}, "touch ~/.aws/credentials", "sandbox.deny_path"),
    ("a write to a character device", "executor", {}, "echo x > /dev/kmsg", "sandbox.path_escape"),
    ("a write outside when the root is read-write", "executor", {"kernel": "root_rw"}, "echo x > /usr/local/x",
     "sandbox.path_escape"),
    ("a network tool when the cell shares the host's namespace", "executor", {"kernel": "no_netns"},
     "curl https://example.com", "network.command"),
    ("a read of a default deny path the role does not mask", "executor", {"kernel": "no_masks"},
     "cat ~/.ssh/config", "sandbox.deny_path"),
    ("a call judged without a cell (an agent runtime's own gate)", "executor", {"kernel": None},
     "curl https://example.com", "network.command"),
]


@pytest.mark.parametrize("what,role,change,command,rule", NOT_DEMOTED, ids=[n[0] for n in NOT_DEMOTED])
def test_what_the_kernel_does_not_enforce_stays_denied_under_open(what, role, change, command, rule):
    ctx = ctx_of(role)
    change = dict(change)
    if "kernel" in change:
        k = change.pop("kernel")
        change["kernel"] = None if k is None else record.replace(
            ctx.kernel, **{"root_rw": {"root_ro": False}, "no_netns": {"netns": False},
                           "no_masks": {"masked": ()}}[k])
    d = judge_shell(command, record.replace(ctx, **change))
    assert (d.allowed, d.rule) == (False, rule), d
    assert not any(f.endswith("kernel_enforced") for f in d.flags)


@pytest.mark.parametrize("caps,command,rule", [
    ('["SYS_ADMIN"]', "echo x > /usr/local/x", "sandbox.path_escape"),
    ('["SYS_ADMIN"]', "cat ~/.ssh/config", "sandbox.deny_path"),
    ('["SYS_ADMIN"]', "curl https://example.com", "network.command"),
    ('["NET_ADMIN"]', "curl https://example.com", "network.command"),
])
def test_a_role_whose_root_cell_keeps_admin_capabilities_gets_no_kernel_flag(caps, command, rule, roles):
    write_role(roles, "capable", isolation__capabilities=caps)
    d = judge_shell(command, ctx_of("capable"))
    assert (d.allowed, d.rule) == (False, rule), d


def test_a_write_to_a_fifo_outside_the_writable_paths_stays_denied_a_read_only_mount_does_not_stop_it():
    fifo = f"/var/tmp/agnsup-gate-fifo-{os.getpid()}"
    os.mkfifo(fifo)
    try:
        d = judge_shell(f"echo x > {fifo}", ctx_of("executor"))
        assert (d.allowed, d.rule) == (False, "sandbox.path_escape"), d
    finally:
        os.unlink(fifo)
    assert judge_shell(f"echo x > {fifo}", ctx_of("executor")).allowed  # gone: creating it would be EROFS


@pytest.mark.parametrize("tool,args,rule", [
    ("write_file", {"path": "/usr/local/x"}, "sandbox.path_escape"),
    ("read_file", {"path": "~/.ssh/config"}, "sandbox.deny_path"),
    ("fetch", {"url": "https://example.com"}, "network.url"),
])
def test_a_tool_that_runs_in_no_cell_is_not_covered_by_the_cell_kernel(tool, args, rule):
    d, _ = check(tool, args, ctx_of("executor"))
    assert (d.allowed, d.rule) == (False, rule), d


def test_a_flag_does_not_hide_a_later_denial_in_the_same_line():
    d = judge_shell("curl https://example.com; rm -rf /", ctx_of("executor"))
    assert (d.allowed, d.rule) == (False, "hardline.rm_root")
    d = judge_shell("cat ~/.ssh/config > /tmp/x; touch ~/.aws/credentials", ctx_of("executor"))
    assert (d.allowed, d.rule) == (False, "sandbox.deny_path") and "writing" in d.reason


def test_a_process_tool_argv_is_flagged_like_shell_text():
    d, _ = check("run_process", {"argv": ["curl", "-o", "/usr/x", "https://example.com"], "cwd": WT},
                 ctx_of("executor"))
    assert d.allowed and set(d.flags) >= {"network.kernel_enforced", "sandbox.kernel_enforced"}


# --- the policy key ---------------------------------------------------------------

def test_the_standard_preset_flags_and_the_regulated_preset_fixes_deny(roles):
    assert ctx_of("executor").kernel_enforced == "flag"
    write_role(roles, "reg", governance__preset='"regulated"', governance__mode='"locked"')
    assert ctx_of("reg").kernel_enforced == "deny"


def test_a_standard_role_may_choose_early_refusal(roles):
    write_role(roles, "early", governance__kernel_enforced='"deny"')
    assert judge_shell("curl https://example.com", ctx_of("early")).rule == "network.command"


def test_a_regulated_role_cannot_loosen_kernel_enforced(roles):
    path = write_role(roles, "reg", governance__preset='"regulated"', governance__mode='"locked"',
                      governance__kernel_enforced='"flag"')
    with pytest.raises(PolicyError) as e:
        policy.load("reg")
    assert path in str(e.value) and "governance.kernel_enforced" in str(e.value) and "looser" in str(e.value)


def test_a_bad_kernel_enforced_value_names_file_and_key(roles):
    path = write_role(roles, "bad", governance__kernel_enforced='"sometimes"')
    with pytest.raises(PolicyError) as e:
        policy.load("bad")
    assert path in str(e.value) and "governance.kernel_enforced" in str(e.value)


@pytest.mark.parametrize("role", ["executor", "networked", "readonly", "proxied"])
def test_the_gate_knows_the_kernel_the_compiler_builds(role, tmp_path):
    pol = policy.load(role)
    state = str(tmp_path / "state")
    os.makedirs(state)
    spec = types.SimpleNamespace(workdir=str(tmp_path), run_id="r", cell_id="c", timeout=None, role=role,
                                 on_controller_death="kill", worktree=str(tmp_path), interpreter=[],
                                 tool_env_dropped=[], env={}, long_lived=False, changes=None)
    from agnsup.linux.host import protections
    plan = compiler.compile_plan(spec, pol, state, protections())
    k = governance.kernel_of(pol, state)
    assert k.netns == plan.new_netns
    assert k.root_ro == next(op[3] for op in plan.mount_ops if op[0] == "root")
    assert k.worktree_ro == next(op[3] for op in plan.mount_ops if op[0] in ("clone", "idclone") and op[2] == "worktree")
    home = os.path.expanduser("~")
    gate_masked = {os.path.realpath(os.path.join(home, m[2:]) if m.startswith("~/") else m) for m in k.masked}
    assert set(plan.deny_masked) <= gate_masked  # every path the gate calls masked that exists, the plan masks
    assert {p for p in gate_masked if os.path.lexists(p)} <= set(plan.deny_masked)
