"""isolation.reduced (docs/isolation.md, "Reduced cells"): the key, and the plans the compiler makes from it
with fake host facts. The real cells (a default container, and this host under a seccomp filter that refuses
namespaces) are tests/test_reduced.py."""
import os

import pytest

from agnsup import compiler, policy, spec
from agnsup.errors import PolicyError, SetupError
from agnsup.request import CellRequest

HOST = {"seccomp": None, "landlock": None, "landlock_scopes": None, "no_new_privs": None, "pid_namespace": None,
        "capabilities": None, "mapped_uid": None, "_abi": 7, "_root": True, "_cap_last": 40}
REFUSED = {"mount_namespace": "unshare: Operation not permitted", "network_namespace": "unshare: Operation not "
           "permitted", "pid_namespace": "unshare: Operation not permitted"}
NONE_REFUSED = {"mount_namespace": None, "network_namespace": None, "pid_namespace": None}
ALL = '["mount_namespace", "network_namespace", "pid_namespace", "cgroup"]'


def role(tmp_path, monkeypatch, name: str, isolation: str = "", network: str = "") -> str:
    d = tmp_path / "policies"
    d.mkdir(exist_ok=True)
    (d / f"{name}.toml").write_text(f'[role]\nname = "{name}"\n[env]\npath = ["/usr/bin", "/bin", "@runtime"]\n'
                                    f'[isolation]\n{isolation}\n[network]\n{network}\n')
    monkeypatch.setenv("AGNSUP_POLICY_DIR", str(d))
    return name


def plan(tmp_path, name: str, refused: dict | None, root: bool = True, **kw):
    wt = tmp_path / "wt"
    wt.mkdir(exist_ok=True)
    pol = policy.load(name)
    calls = []

    def probe():
        calls.append(1)
        return dict(refused or NONE_REFUSED)
    host = {**HOST, "_root": root, "_namespaces": probe}
    p = compiler.compile_plan(spec.build(CellRequest.make(["true"], workdir=str(wt), role=name, **kw), pol),
                              pol, str(tmp_path / "state"), host)
    return p, calls


@pytest.mark.parametrize("value", ['["mount"]', '["seccomp"]', '"pid_namespace"', '[1]'])
def test_an_unknown_reduced_value_is_a_one_line_policy_error_naming_the_key(tmp_path, monkeypatch, value):
    role(tmp_path, monkeypatch, "bad", f"reduced = {value}")
    with pytest.raises(PolicyError) as e:
        policy.load("bad")
    assert "key isolation.reduced" in e.value.message and "\n" not in e.value.message


def test_require_and_reduced_cannot_both_list_the_pid_namespace(tmp_path, monkeypatch):
    role(tmp_path, monkeypatch, "both", 'pid_namespace = true\nrequire = ["pid_namespace"]\n'
         'reduced = ["pid_namespace"]')
    with pytest.raises(PolicyError, match="require and reduced both list 'pid_namespace'"):
        policy.load("both")


def test_the_shipped_reduced_role_is_the_executor_plus_every_piece():
    red, ex = policy.load("reduced"), policy.load("executor")
    assert list(red.isolation.reduced) == ["mount_namespace", "network_namespace", "pid_namespace", "cgroup"]
    assert list(ex.isolation.reduced) == []
    for section in ("filesystem", "network", "limits", "process"):
        assert red[section] == ex[section], section
    # what a full cell's kernel refuses anyway, the gate refuses: no namespace or mask does it in a reduced cell
    assert red.governance.kernel_enforced == "deny" and ex.governance.kernel_enforced == "flag"
    assert {k: v for k, v in red.governance.items() if k != "kernel_enforced"} == \
        {k: v for k, v in ex.governance.items() if k != "kernel_enforced"}


def test_a_role_without_reduced_never_asks_the_host(tmp_path):
    """The cost of `agnsup run -- true` on a full host is unchanged: no probe for a role that lists nothing."""
    p, calls = plan(tmp_path, "executor", REFUSED)
    assert calls == [] and p.reduced == [] and p.mount_namespace and p.new_netns and p.mount_ops


def test_a_reduced_role_on_a_full_host_gets_everything(tmp_path, monkeypatch):
    role(tmp_path, monkeypatch, "red", f"reduced = {ALL}")
    p, calls = plan(tmp_path, "red", NONE_REFUSED)
    assert calls == [1] and p.reduced == [] and p.mount_namespace and p.new_netns and p.pid_namespace
    assert any(op[0] == "root" for op in p.mount_ops) and p.dies_with_controller == "namespace"


def test_where_the_host_refuses_namespaces_a_reduced_cell_has_none_and_names_each(tmp_path, monkeypatch):
    role(tmp_path, monkeypatch, "red", f"reduced = {ALL}")
    p, _ = plan(tmp_path, "red", REFUSED)
    assert p.reduced == ["mount_namespace", "network_namespace", "pid_namespace"]
    assert p.mount_ops == [] and not p.mount_namespace and not p.new_netns and not p.pid_namespace
    assert p.network == "host" and p.dies_with_controller == "leader" and p.mapped is None and not p.tmp_tmpfs
    assert p.changes["mode"] == "live"
    for piece in p.reduced:
        assert any(n.startswith(f"{piece} (reduced: ") for n in p.not_in_force), piece
    iso = p.protections()
    assert iso["reduced"] == p.reduced and iso["mount_namespace"] is False and iso["private_tmp"] is False
    # Landlock is the only write line: the worktree and the cell's own directory, never the host's /tmp
    assert p.landlock_writable[:2] == [p.tmpdir, p.spec.worktree] and "/tmp" not in p.landlock_writable


def test_a_reduced_cell_without_a_mount_namespace_has_its_tmp_home_and_runtime_under_its_cell_dir(tmp_path,
                                                                                               monkeypatch):
    role(tmp_path, monkeypatch, "red", f"reduced = {ALL}")
    p, _ = plan(tmp_path, "red", REFUSED)
    env = p.spec.env
    assert env["TMPDIR"] == p.tmpdir and env["HOME"] == os.path.join(p.tmpdir, "home")
    path = env["PATH"].split(":")
    assert os.path.join(p.tmpdir, ".agnsup", "bin") in path and "/tmp/.agnsup/bin" not in path
    assert p.tmp_links and all(not rel.startswith("/") for rel, _ in p.tmp_links)


def test_only_what_the_role_lists_is_given_up(tmp_path, monkeypatch):
    role(tmp_path, monkeypatch, "pidonly", 'reduced = ["pid_namespace"]')
    p, _ = plan(tmp_path, "pidonly", {**NONE_REFUSED, "pid_namespace": "unshare: Operation not permitted"})
    assert p.reduced == ["pid_namespace"] and p.mount_namespace and p.new_netns and not p.pid_namespace
    assert p.dies_with_controller == "leader"


def test_a_reduced_network_drops_the_proxy_variables_and_says_the_network_is_the_hosts(tmp_path, monkeypatch):
    role(tmp_path, monkeypatch, "prox", f"reduced = {ALL}", 'mode = "allowlist"\nallow = ["example.org"]')
    p, _ = plan(tmp_path, "prox", REFUSED)
    assert p.network == "host" and p.egress is None and not p.new_netns
    assert not any(k.lower().endswith("_proxy") for k in p.spec.env)
    assert any(n.startswith("network.mode 'allowlist' (the cell has the host's network") for n in p.not_in_force)


def test_without_a_mount_namespace_the_pid_namespace_must_be_listed_too(tmp_path, monkeypatch):
    role(tmp_path, monkeypatch, "mntonly", 'reduced = ["mount_namespace"]')
    with pytest.raises(SetupError, match='isolation.reduced also lists "pid_namespace"'):
        plan(tmp_path, "mntonly", {**NONE_REFUSED, "mount_namespace": "fsopen: Operation not permitted"})


def test_a_normal_users_reduced_cell_without_namespaces_needs_no_user_namespace(tmp_path, monkeypatch):
    role(tmp_path, monkeypatch, "red", f"reduced = {ALL}")
    p, _ = plan(tmp_path, "red", REFUSED, root=False)
    assert not p.user_namespace and p.drop_caps == [] and p.cap_keep is None


def test_require_reversible_refuses_a_cell_without_a_mount_namespace(tmp_path, monkeypatch):
    role(tmp_path, monkeypatch, "rev", f'reduced = {ALL}\nrequire = ["reversible"]')
    with pytest.raises(SetupError, match="requires reversible"):
        plan(tmp_path, "rev", REFUSED)


def test_reduced_pieces_for_doctor(tmp_path, monkeypatch):
    class NoTree:
        trees = False

    class Tree:
        trees = True
    role(tmp_path, monkeypatch, "red", f"reduced = {ALL}")
    pol = policy.load("red")
    assert compiler.reduced_pieces(pol, {"_namespaces": lambda: REFUSED}, NoTree()) == \
        ["mount_namespace", "network_namespace", "pid_namespace", "cgroup"]
    assert compiler.reduced_pieces(pol, {"_namespaces": lambda: NONE_REFUSED}, Tree()) == []
    assert compiler.reduced_pieces(policy.load("executor"), {"_namespaces": lambda: REFUSED}, NoTree()) == []
    # doctor's call: every piece considered, the backend in the host dict
    assert compiler.reduced_pieces(None, {"_namespaces": lambda: NONE_REFUSED, "backend": NoTree()}) == ["cgroup"]


def test_the_cgroup_piece_is_named_once_the_backend_is_known(tmp_path, monkeypatch):
    class NoTree:
        trees, why = False, "no cgroup hierarchy is writable here"
    role(tmp_path, monkeypatch, "red", f"reduced = {ALL}")
    p, _ = plan(tmp_path, "red", NONE_REFUSED)
    got = p.reduced_by(NoTree(), ["x"])
    assert got["reduced"] == ["cgroup"] and got["not_in_force"][0] == "x"
    assert got["not_in_force"][1].startswith("cgroup (reduced: no cgroup tree")
    ex, _ = plan(tmp_path, "executor", None)
    assert ex.reduced_by(NoTree(), ["x"]) == {"reduced": []}


def test_the_gate_never_counts_on_a_piece_a_role_may_run_without(tmp_path, monkeypatch):
    """governance.kernel_of: what the gate leaves to the kernel (a network tool under network deny, a read of
    a masked path) is not left to it by a role that may run without the namespace that refuses it, whatever
    this host gives; Landlock still holds the read-only root."""
    from agnsup import governance
    role(tmp_path, monkeypatch, "full", "", 'mode = "deny"')
    full = governance.kernel_of(policy.load("full"), "/state")
    assert full.netns and full.root_ro and "/state" in full.masked
    role(tmp_path, monkeypatch, "red", f"reduced = {ALL}", 'mode = "deny"')
    red = governance.kernel_of(policy.load("red"), "/state")
    assert not red.netns and red.masked == () and red.root_ro
    role(tmp_path, monkeypatch, "red_nolandlock", f"reduced = {ALL}\nlandlock = false\nseccomp = false",
         'mode = "deny"')
    assert not governance.kernel_of(policy.load("red_nolandlock"), "/state").root_ro
    role(tmp_path, monkeypatch, "net_only", 'reduced = ["network_namespace"]', 'mode = "deny"')
    net_only = governance.kernel_of(policy.load("net_only"), "/state")
    assert not net_only.netns and "/state" in net_only.masked


def test_the_order_of_pieces_is_the_schemas_everywhere():
    from agnsup import policyfile
    from agnsup.process import namespaces
    assert compiler.REDUCIBLE_ORDER == namespaces.REDUCIBLE_ORDER == policyfile.REDUCIBLE
