"""What a controller of many cells remembers from one cell's prepare to the next (issue 29, fifth round), and what
makes it look again: a role's policy (kept while the files it came from keep their identity), the controller's own
runtime paths (its interpreter), and the host facts one cell's prepare asks several times (kept for that cell
only: a symlink or a home changed between two cells is seen by the second)."""
import os
import shutil
import sys

import pytest

from agnsup import compiler, policy, spec
from agnsup.linux import host
from agnsup.request import CellRequest
from conftest import write_role

HOST = {"seccomp": None, "landlock": None, "landlock_scopes": None, "no_new_privs": None, "pid_namespace": None,
        "capabilities": None, "_abi": 7, "_root": True, "_cap_last": 40}
PRESET = os.path.join(os.path.dirname(policy.__file__), "policies", "presets", "standard.toml")


@pytest.fixture
def settled(monkeypatch):
    """Every file counts as settled at once (the tests write and load within one clock tick)."""
    monkeypatch.setattr(policy, "MEMO_SETTLED", -1)


@pytest.fixture
def reads(monkeypatch):
    """The reads of role "memo"'s file by policy.load."""
    seen = []
    real = policy._read
    monkeypatch.setattr(policy, "_read", lambda p: (p.endswith("/memo.toml") and seen.append(p)) or real(p))
    return seen


def test_a_role_loaded_again_unchanged_is_not_read_again(policy_dir, monkeypatch, settled, reads):
    write_role(policy_dir, "memo")
    monkeypatch.setenv("AGNSUP_POLICY_DIR", str(policy_dir))
    assert policy.load("memo") is policy.load("memo")
    assert len(reads) == 1


def test_a_role_file_edited_in_place_between_two_cells_is_read_again(policy_dir, monkeypatch, settled, reads):
    write_role(policy_dir, "memo", limits__grace="3.0")
    monkeypatch.setenv("AGNSUP_POLICY_DIR", str(policy_dir))
    assert policy.load("memo").limits.grace == 3.0
    write_role(policy_dir, "memo", limits__grace="12.5")  # the same inode, rewritten
    assert policy.load("memo").limits.grace == 12.5
    assert len(reads) == 2


def test_a_role_file_replaced_by_one_of_the_same_size_is_read_again(policy_dir, monkeypatch, settled, reads):
    path = write_role(policy_dir, "memo", limits__grace="3.0")
    monkeypatch.setenv("AGNSUP_POLICY_DIR", str(policy_dir))
    assert policy.load("memo").limits.grace == 3.0
    other = write_role(policy_dir, "memo2", limits__grace="4.0")
    with open(other) as f:
        text = f.read().replace('name = "memo2"', 'name = "memo"')
    with open(path + ".new", "w") as f:
        f.write(text)
    os.utime(path + ".new", ns=(os.stat(path).st_atime_ns, os.stat(path).st_mtime_ns))  # even the same mtime
    assert os.path.getsize(path + ".new") == os.path.getsize(path)
    os.replace(path + ".new", path)  # another inode
    assert policy.load("memo").limits.grace == 4.0


def test_a_role_file_that_appears_in_the_policy_dir_wins_at_the_next_cell(policy_dir, monkeypatch, settled):
    monkeypatch.setenv("AGNSUP_POLICY_DIR", str(policy_dir))
    assert policy.load("executor").limits.grace == 3.0  # the packaged role
    write_role(policy_dir, "executor", limits__grace="7.5")
    assert policy.load("executor").limits.grace == 7.5


def test_a_preset_edited_between_two_cells_is_merged_again(policy_dir, monkeypatch, settled):
    write_role(policy_dir, "memo")  # executor's copy: preset "standard", which sets kernel_enforced
    monkeypatch.setenv("AGNSUP_POLICY_DIR", str(policy_dir))
    (policy_dir / "presets").mkdir()
    shutil.copy(PRESET, policy_dir / "presets" / "standard.toml")
    assert policy.load("memo").governance.kernel_enforced == "flag"
    text = (policy_dir / "presets" / "standard.toml").read_text()
    (policy_dir / "presets" / "standard.toml").write_text(text.replace('kernel_enforced = "flag"',
                                                                       'kernel_enforced = "deny"'))
    assert policy.load("memo").governance.kernel_enforced == "deny"


def test_a_preset_that_appears_in_the_policy_dir_is_merged_at_the_next_cell(policy_dir, monkeypatch, settled):
    write_role(policy_dir, "memo")
    monkeypatch.setenv("AGNSUP_POLICY_DIR", str(policy_dir))
    (policy_dir / "presets").mkdir()
    assert policy.load("memo").governance.kernel_enforced == "flag"  # the packaged preset
    with open(PRESET) as f:
        text = f.read().replace('kernel_enforced = "flag"', 'kernel_enforced = "deny"')
    (policy_dir / "presets" / "standard.toml").write_text(text)
    assert policy.load("memo").governance.kernel_enforced == "deny"


def test_a_role_file_changed_within_the_last_second_is_not_kept(policy_dir, monkeypatch, reads):
    """A write in the clock tick of the read could leave size, times and inode as they were: nothing is kept
    until the files have been still for MEMO_SETTLED."""
    write_role(policy_dir, "memo")
    monkeypatch.setenv("AGNSUP_POLICY_DIR", str(policy_dir))
    policy.load("memo")
    policy.load("memo")
    assert len(reads) == 2


def test_the_runtime_paths_follow_the_interpreter_that_names_them(monkeypatch, tmp_path):
    pol = policy.load("executor")
    mine = compiler.runtime_paths(pol)
    assert compiler.runtime_paths(pol) == mine
    other = tmp_path / "venv" / "bin"
    other.mkdir(parents=True)
    os.symlink(sys.executable, other / "python")
    monkeypatch.setattr(sys, "executable", str(other / "python"))
    assert compiler.runtime_paths(pol) != mine


def _plan(tmp_path, state_root: str):
    wt = tmp_path / "wt"
    wt.mkdir(exist_ok=True)
    pol = policy.load("executor")
    with host.one_look():
        s = spec.build(CellRequest.make(["true"], workdir=str(wt)), pol)
        return compiler.compile_plan(s, pol, state_root, HOST)


def test_a_state_root_symlink_swapped_between_two_cells_is_masked_where_it_leads_now(tmp_path):
    """The hostile case for a remembered real path: the second cell must mask the directory the state root's
    path leads to now, not the one it led to at the first cell."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    link = tmp_path / "state"
    link.symlink_to(a)
    assert ("mask", str(a)) in _plan(tmp_path, str(link)).mount_ops
    link.unlink()
    link.symlink_to(b)
    ops = _plan(tmp_path, str(link)).mount_ops
    assert ("mask", str(b)) in ops and ("mask", str(a)) not in ops


def test_within_one_cell_the_invoking_homes_are_looked_up_once_and_again_at_the_next(monkeypatch, tmp_path):
    calls = []
    real = host.pwd.getpwuid
    monkeypatch.setattr(host.pwd, "getpwuid", lambda uid: calls.append(uid) or real(uid))
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    monkeypatch.setenv("HOME", str(one))
    with host.one_look():
        first = host.invoking_homes()
        assert host.invoking_homes() == first and len(calls) == 1
    assert str(one) in first
    monkeypatch.setenv("HOME", str(two))
    with host.one_look():
        second = host.invoking_homes()
    assert str(two) in second and str(one) not in second and len(calls) == 2
    assert host.invoking_homes() == second and len(calls) == 3  # outside a look: every call looks


def test_the_gate_context_is_kept_for_the_same_policy_and_made_again_for_another_or_a_new_home(
        policy_dir, monkeypatch, settled, tmp_path):
    from agnsup import governance
    write_role(policy_dir, "memo", governance__mode='"open"')
    monkeypatch.setenv("AGNSUP_POLICY_DIR", str(policy_dir))
    monkeypatch.setenv("HOME", str(tmp_path))
    pol = policy.load("memo")
    ctx = governance.context(pol, "/w", "/s")
    assert governance.context(policy.load("memo"), "/w", "/s") is ctx and ctx.mode == "open"
    assert governance.context(pol, "/w2", "/s").worktree == "/w2"
    write_role(policy_dir, "memo", governance__mode='"locked"')  # the role edited: a new policy, a new context
    assert governance.context(policy.load("memo"), "/w", "/s").mode == "locked"
    monkeypatch.setenv("HOME", str(tmp_path / "elsewhere"))
    assert governance.context(pol, "/w", "/s").home == str(tmp_path / "elsewhere")
