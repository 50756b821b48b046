"""Reversible cells in the plan (issue 26): which cells run over an overlay of their worktree, where
its op goes in the mount recipe, and why a cell runs live instead."""
import os

import pytest

from agnsup import compiler, policy, spec
from agnsup.errors import PolicyError, SetupError
from agnsup.request import CellRequest

HOST = {"seccomp": None, "landlock": None, "landlock_scopes": None, "no_new_privs": None, "pid_namespace": None,
        "capabilities": None, "_abi": 7, "_root": True, "_cap_last": 40}


def role_file(tmp_path, monkeypatch, name: str, filesystem: str = "", isolation: str = "") -> str:
    d = tmp_path / "roles"
    d.mkdir(exist_ok=True)
    (d / f"{name}.toml").write_text(f'[role]\nname = "{name}"\n[env]\npath = ["/usr/bin", "/bin"]\n'
                                    f'[filesystem]\nworktree = "rw"\n{filesystem}\n[isolation]\n{isolation}\n')
    monkeypatch.setenv("AGNSUP_POLICY_DIR", str(d))
    return name


def plan(tmp_path, role="executor", host=HOST, state=None, workdir=None, **kw):
    wt = workdir or tmp_path / "wt"
    os.makedirs(wt, exist_ok=True)
    pol = policy.load(role)
    s = spec.build(CellRequest.make(["true"], workdir=str(wt), role=role, **kw), pol)
    return compiler.compile_plan(s, pol, str(state or tmp_path / "state"), host)


def kinds(p) -> list[str]:
    return [op[0] for op in p.mount_ops]


def test_a_waited_for_cell_runs_over_an_overlay_attached_right_on_its_worktree(tmp_path):
    p = plan(tmp_path, run_id="r1", cell_id="c-1")
    wt = os.path.realpath(tmp_path / "wt")
    layer = os.path.join(str(tmp_path / "state"), "changes", "r1", "c-1")
    assert p.captures() and p.changes["mode"] == "at_exit" and p.changes["why"] is None
    assert p.changes["layer"] == layer and "options" not in p.changes
    # the layer directory is cloned with the others, before the root goes read-only
    assert p.mount_ops.index(("clone", layer, "layer", False)) < kinds(p).index("root")
    # the overlay comes right after the worktree's attach, before protect and every mask
    at = p.mount_ops.index(("attach", wt, "worktree"))
    assert p.mount_ops[at + 1] == ("overlay", wt, "layer", False, (("live_ok",),))
    assert all(i > at + 1 for i, k in enumerate(kinds(p)) if k in ("protect", "mask"))
    assert p.changes["keep"] == 200 and p.changes["keep_bytes"] == 2 << 30


def test_a_long_lived_cell_runs_live_under_auto_and_says_why(tmp_path):
    p = plan(tmp_path, long_lived=True)
    assert not p.captures() and p.changes["mode"] == "live" and "long-lived" in p.changes["why"]
    assert "overlay" not in kinds(p) and not any(op[2:3] == ("layer",) for op in p.mount_ops)


def test_a_live_role_writes_straight_to_the_worktree(tmp_path, monkeypatch):
    p = plan(tmp_path, role_file(tmp_path, monkeypatch, "livewt", 'changes = "live"'))
    assert p.changes["mode"] == "live" and p.changes["why"] == 'role filesystem.changes = "live"'
    assert "overlay" not in kinds(p)


def test_at_exit_captures_a_long_lived_cell_too(tmp_path, monkeypatch):
    p = plan(tmp_path, role_file(tmp_path, monkeypatch, "always", 'changes = "at_exit"'), long_lived=True)
    assert p.captures() and "overlay" in kinds(p)


def test_a_read_only_worktree_has_nothing_to_capture(tmp_path):
    p = plan(tmp_path, "readonly")
    assert p.changes["mode"] == "none" and "read-only" in p.changes["why"] and "overlay" not in kinds(p)


def test_where_the_state_root_cannot_hold_an_upper_layer_the_cell_runs_live_and_says_why(tmp_path):
    asked = []

    def unsupported(state_root, worktree):
        asked.append((state_root, worktree))
        return "the state root is on an NFS file system"
    p = plan(tmp_path, host={**HOST, "_reversible": unsupported})
    assert asked == [(str(tmp_path / "state"), os.path.realpath(tmp_path / "wt"))]
    assert p.changes["mode"] == "live" and p.changes["why"] == "the state root is on an NFS file system"
    assert "overlay" not in kinds(p)
    assert any(n.startswith("reversible") and "NFS" in n for n in p.not_in_force)


def test_require_reversible_refuses_a_cell_that_cannot_capture(tmp_path, monkeypatch):
    role = role_file(tmp_path, monkeypatch, "strict", isolation='require = ["reversible"]')
    with pytest.raises(SetupError, match="requires reversible.*NFS"):
        plan(tmp_path, role, host={**HOST, "_reversible": lambda s, w: "NFS"})
    # and captures a long-lived cell instead of letting it write live; a kernel that refuses the overlay
    # then fails the cell (no live_ok) instead of letting it run live
    p = plan(tmp_path, role, long_lived=True)
    assert p.captures() and next(op for op in p.mount_ops if op[0] == "overlay")[4] == ()


def test_a_state_root_inside_the_worktree_cannot_be_its_upper_layer(tmp_path):
    wt = tmp_path / "wt"
    (wt / ".agnsup-worktree").parent.mkdir()
    (wt / ".agnsup-worktree").write_text("")
    p = plan(tmp_path, state=wt / "state")
    assert p.changes["mode"] == "live" and "inside the worktree" in p.changes["why"]


def test_a_mapped_cell_maps_its_layer_and_a_normal_users_cell_uses_user_xattrs(tmp_path):
    from agnsup.linux.userns import cell_range
    mapped = plan(tmp_path, host={**HOST, "mapped_uid": None, "_idmap": lambda path: None})
    uid, gid, _ = cell_range()
    assert mapped.mapped is not None
    assert next(op for op in mapped.mount_ops if op[0] == "overlay")[4] == (("shift", uid, gid), ("live_ok",))
    user = plan(tmp_path, host={**HOST, "_root": False})
    assert next(op for op in user.mount_ops if op[0] == "overlay")[4] == (("userxattr",), ("live_ok",))


def test_the_role_keys_are_validated(tmp_path, monkeypatch):
    role = role_file(tmp_path, monkeypatch, "kept", 'changes = "at_exit"\nchanges_keep = 5\nchanges_keep_bytes = "64M"')
    fs = policy.load(role).filesystem
    assert (fs.changes, fs.changes_keep, fs.changes_keep_bytes) == ("at_exit", 5, 64 << 20)
    with pytest.raises(PolicyError, match="changes"):
        policy.load(role_file(tmp_path, monkeypatch, "bad", 'changes = "sometimes"'))
    with pytest.raises(PolicyError, match="changes_keep"):
        policy.load(role_file(tmp_path, monkeypatch, "neg", "changes_keep = -1"))
    with pytest.raises(PolicyError, match="reversible"):
        policy.load(role_file(tmp_path, monkeypatch, "contra", 'changes = "live"', 'require = ["reversible"]'))
