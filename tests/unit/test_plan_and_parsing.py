"""Plan compilation from a role and the host's facts, and the parsers that read the kernel's files."""
import os

import pytest

from agnsup import compiler, policy, spec
from agnsup.errors import SetupError, UsageError
from agnsup.linux import cgroup, proc, session
from agnsup.request import CellRequest

HOST = {"seccomp": None, "landlock": None, "landlock_scopes": None, "no_new_privs": None, "pid_namespace": None,
        "capabilities": None, "_abi": 7, "_root": True,
        "_cap_last": 40}


def plan(tmp_path, role="executor", host=HOST, **kw):
    wt = tmp_path / "wt"
    wt.mkdir(exist_ok=True)
    s = spec.build(CellRequest.make(["true"], workdir=str(wt), role=role, **kw), policy.load(role))
    return compiler.compile_plan(s, policy.load(role), str(tmp_path / "state"), host)


def test_a_role_that_denies_network_gets_a_namespace_and_the_host_network_role_does_not(tmp_path):
    assert plan(tmp_path).new_netns and not plan(tmp_path, "networked").new_netns


def test_the_plan_masks_the_state_root_and_makes_the_root_read_only(tmp_path):
    p = plan(tmp_path)
    assert ("mask", os.path.realpath(tmp_path / "state")) in p.mount_ops
    assert next(op for op in p.mount_ops if op[0] == "root")[3] is True


def test_a_protection_the_host_lacks_is_named_not_in_force(tmp_path):
    p = plan(tmp_path, host={**HOST, "landlock": "no Landlock here", "landlock_scopes": "no Landlock here"})
    assert p.landlock_writable is None and any(n.startswith("landlock:") for n in p.not_in_force)


def test_a_role_that_requires_a_missing_protection_is_refused_before_anything_starts(tmp_path, monkeypatch):
    (tmp_path / "strict.toml").write_text('[role]\nname = "strict"\n[env]\npath = ["/usr/bin", "/bin"]\n'
                                          '[isolation]\nrequire = ["landlock"]\n')
    monkeypatch.setenv("AGNSUP_POLICY_DIR", str(tmp_path))
    with pytest.raises(SetupError, match="requires landlock"):
        plan(tmp_path, "strict", host={**HOST, "landlock": "no Landlock here"})


def test_a_worktree_inside_the_state_root_is_refused(tmp_path):
    (tmp_path / "state").mkdir()
    with pytest.raises(UsageError, match="inside the state root"):
        s = spec.build(CellRequest.make(["true"], workdir=str(tmp_path / "state")), policy.load("executor"))
        compiler.compile_plan(s, policy.load("executor"), str(tmp_path / "state"), HOST)


def test_the_policy_is_read_only_and_has_every_default():
    pol = policy.load("executor")
    assert pol.limits.grace == pol["limits"]["grace"] and isinstance(pol.env.path, tuple)
    with pytest.raises(AttributeError):
        pol.limits.grace = 9
    with pytest.raises(AttributeError, match="no key 'graec'"):
        pol.limits.graec


def test_proc_stat_is_split_at_the_last_parenthesis(monkeypatch):
    raw = b"4242 (a) b (c)) S 1 4242 4242 0 -1 4194560 0 0 0 0 0 0 0 0 20 0 1 0 987654 0 0"
    monkeypatch.setattr(proc, "read",
                        lambda path, *_: raw if path.endswith("/stat") else b"X=1\0AGNSUP_CELL_TOKEN=t0k\0")
    p = session.read_proc(4242)
    assert (p.comm, p.state, p.pgid, p.sid, p.starttime, p.token) == ("a) b (c)", "S", 4242, 4242, 987654, "t0k")


@pytest.mark.parametrize("env, token", [(b"AGNSUP_CELL_TOKEN=abc\0X=1", "abc"), (b"X=1\0AGNSUP_CELL_TOKEN=d", "d"),
                                        (b"XAGNSUP_CELL_TOKEN=no\0", None), (b"", None), (None, None)])
def test_the_token_is_read_only_as_a_whole_variable(env, token):
    assert session.token_of(env) == token


def test_mountinfo_names_the_cgroup2_mount_and_the_v1_controllers():
    text = ("30 25 0:26 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw,nsdelegate\n"
            "31 25 0:27 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n"
            "32 25 0:28 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct\n"
            r"33 25 0:29 / /mnt/with\040space rw - cgroup cgroup rw,pids" "\n")
    v2, v1 = cgroup.parse_mountinfo(text)
    assert v2 == "/sys/fs/cgroup/unified"
    assert v1 == {"memory": "/sys/fs/cgroup/memory", "cpu": "/sys/fs/cgroup/cpu,cpuacct", "pids": "/mnt/with space"}


def test_kill_on_controller_death_runs_the_cell_under_an_init_that_dies_with_the_controller(tmp_path):
    p = plan(tmp_path)
    assert p.pid_namespace and p.dies_with_controller == "namespace"
    assert p.on_controller_death() == {**p.on_controller_death(), "mode": "kill", "in_force": True}


def test_without_pid_namespaces_kill_covers_the_leader_only_and_says_so(tmp_path):
    p = plan(tmp_path, host={**HOST, "pid_namespace": "a PID namespace needs agnsup to run as root", "_root": False})
    assert not p.pid_namespace and p.dies_with_controller == "leader"
    assert p.on_controller_death()["in_force"] is False and "janitor" in p.on_controller_death()["how"]
    assert any(n.startswith("on_controller_death kill") for n in p.not_in_force)


def test_keep_adds_no_namespace_and_no_parent_death_signal(tmp_path):
    p = plan(tmp_path, on_controller_death="keep")
    assert not p.pid_namespace and p.dies_with_controller == "" and p.on_controller_death()["mode"] == "keep"


def test_other_state_roots_are_masked_unless_the_cells_private_tmp_hides_them_already(tmp_path):
    """Every other state root is hidden (issue 12 item 14), but one under /tmp outside what the
    cell sees again there costs no mount: a test session registers thousands of those."""
    import tempfile
    wt = tmp_path / "wt"
    in_tmp, in_wt = tmp_path / "other-state", wt / "sub" / "state"
    in_wt.mkdir(parents=True)
    in_tmp.mkdir()
    in_var = tempfile.mkdtemp(prefix="agnsup-unit-", dir="/var/tmp")
    try:
        s = spec.build(CellRequest.make(["true"], workdir=str(wt), role="executor"), policy.load("executor"))
        roots = tuple(os.path.realpath(p) for p in (in_tmp, in_wt, in_var))
        p = compiler.compile_plan(s, policy.load("executor"), str(tmp_path / "state"), HOST, other_roots=roots)
        masks = {op[1] for op in p.mount_ops if op[0] == "mask"}
        assert {roots[1], roots[2]} <= masks and roots[0] not in masks
    finally:
        os.rmdir(in_var)
