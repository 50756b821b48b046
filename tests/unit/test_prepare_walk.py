"""What one cell's prepare asks of the host once (issue 29, sixth round), and what a controller of many cells keeps
from one cell to the next: each path component looked at once in a cell (linux/host.one_look's walk, never kept past
the cell: a symlink swapped between two cells is followed by the second), and the small host files read at every
cell (util/filememo.py: kept while the file they came from keeps its identity)."""
import os
import random

import pytest

from agnsup import compiler, policy, spec, toolconfig
from agnsup.linux import host
from agnsup.request import CellRequest
from agnsup.util import filememo
from conftest import write_role

HOST = {"seccomp": None, "landlock": None, "landlock_scopes": None, "no_new_privs": None, "pid_namespace": None,
        "capabilities": None, "_abi": 7, "_root": True, "_cap_last": 40}


@pytest.fixture
def settled(monkeypatch):
    """Every file counts as settled at once (the tests write and read within one clock tick)."""
    monkeypatch.setattr(filememo, "SETTLED", -1)
    monkeypatch.setattr(filememo, "_KEPT", {})


def _tree(d):
    os.makedirs(d / "a" / "b" / "c")
    os.symlink("b", d / "a" / "lb")
    os.symlink(str(d / "a" / "b" / "c"), d / "abs")
    os.symlink("loop2", d / "loop1")
    os.symlink("loop1", d / "loop2")
    os.symlink("../..", d / "a" / "b" / "up")
    os.symlink("nope/x", d / "dang")
    os.symlink("self", d / "self")
    os.symlink("a/lb/up/abs", d / "chain")
    (d / "a" / "f").write_text("")


def test_the_walk_gives_what_realpath_gives(tmp_path):
    """Links, absolute and relative, chains, "..", loops, dangling links, missing names, files used as directories:
    each answer within a look is os.path.realpath's, whatever was walked before it in the same look."""
    _tree(tmp_path)
    names = ["a", "b", "c", "f", "lb", "abs", "loop1", "loop2", "up", "dang", "self", "chain", "..", ".", "", "zz"]
    rnd = random.Random(29)
    for _ in range(3000):
        paths = [str(tmp_path) + "/" + "/".join(rnd.choice(names) for _ in range(rnd.randint(0, 5)))
                 for _ in range(3)]
        with host.one_look():
            got = [host.realpath(p) for p in paths]
        assert got == [os.path.realpath(p) for p in paths], paths


def test_within_one_cell_each_component_is_looked_at_once(tmp_path, monkeypatch):
    (tmp_path / "x" / "wt").mkdir(parents=True)
    (tmp_path / "x" / "state").mkdir()
    seen = []
    real = os.lstat
    monkeypatch.setattr(host.os, "lstat", lambda p, *a, **k: seen.append(p) or real(p, *a, **k))
    with host.one_look():
        host.realpath(str(tmp_path / "x" / "wt"))
        host.realpath(str(tmp_path / "x" / "state"))
        host.realpath(str(tmp_path / "x" / "wt"))
        assert host.isdir(str(tmp_path / "x" / "wt")) and host.exists(str(tmp_path / "x" / "state"))
    assert len(seen) == len(set(seen)) == str(tmp_path).count("/") + 3


def _plan(tmp_path, workdir, state_root, role="executor"):
    pol = policy.load(role)
    with host.one_look():
        s = spec.build(CellRequest.make(["true"], workdir=str(workdir), role=role), pol)
        return compiler.compile_plan(s, pol, str(state_root), HOST)


def test_a_worktree_parent_swapped_between_two_cells_is_followed_by_the_second(tmp_path):
    """The hostile case for a walk kept too long: the second cell's worktree (its writable attach, its lock) is where
    the path leads now."""
    for side in ("a", "b"):
        (tmp_path / side / "wt" / ".git").mkdir(parents=True)
    (tmp_path / "state").mkdir()
    link = tmp_path / "p"
    link.symlink_to(tmp_path / "a")
    first = _plan(tmp_path, link / "wt", tmp_path / "state")
    assert first.spec.worktree == str(tmp_path / "a" / "wt")
    link.unlink()
    link.symlink_to(tmp_path / "b")
    second = _plan(tmp_path, link / "wt", tmp_path / "state")
    assert second.spec.worktree == str(tmp_path / "b" / "wt")
    assert ("attach", str(tmp_path / "b" / "wt"), "worktree") in second.mount_ops


def test_a_deny_path_swapped_between_two_cells_is_masked_where_it_leads_now(tmp_path, policy_dir, monkeypatch):
    (tmp_path / "wt" / ".git").mkdir(parents=True)
    (tmp_path / "state").mkdir()
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    secret = tmp_path / "secret"
    secret.symlink_to(tmp_path / "one")
    write_role(policy_dir, "walk", filesystem__deny=f'["{secret}"]')
    monkeypatch.setenv("AGNSUP_POLICY_DIR", str(policy_dir))
    assert ("mask", str(tmp_path / "one")) in _plan(tmp_path, tmp_path / "wt", tmp_path / "state", "walk").mount_ops
    secret.unlink()
    secret.symlink_to(tmp_path / "two")
    ops = _plan(tmp_path, tmp_path / "wt", tmp_path / "state", "walk").mount_ops
    assert ("mask", str(tmp_path / "two")) in ops and ("mask", str(tmp_path / "one")) not in ops


def test_a_deny_path_that_appears_between_two_cells_is_masked_by_the_second(tmp_path, policy_dir, monkeypatch):
    """What the walk saw (a missing name) answers exists() in its own cell only."""
    (tmp_path / "wt" / ".git").mkdir(parents=True)
    (tmp_path / "state").mkdir()
    secret = tmp_path / "secret"
    write_role(policy_dir, "walk", filesystem__deny=f'["{secret}"]')
    monkeypatch.setenv("AGNSUP_POLICY_DIR", str(policy_dir))
    assert ("mask", str(secret)) not in _plan(tmp_path, tmp_path / "wt", tmp_path / "state", "walk").mount_ops
    secret.mkdir()
    assert ("mask", str(secret)) in _plan(tmp_path, tmp_path / "wt", tmp_path / "state", "walk").mount_ops


def test_outside_a_look_nothing_is_remembered(tmp_path):
    (tmp_path / "one").mkdir()
    link = tmp_path / "l"
    link.symlink_to(tmp_path / "one")
    assert host.realpath(str(link)) == str(tmp_path / "one")
    link.unlink()
    link.symlink_to(tmp_path)
    assert host.realpath(str(link)) == str(tmp_path) and host.isdir(str(link))


# -- small host files kept while they keep their identity (util/filememo.py) --

def _npmrc(home) -> str | None:
    files, _ = toolconfig.home_files(["npm"], str(home), "/nonexistent-wt")
    return dict(files).get(".npmrc")


def test_a_tool_config_file_edited_in_place_between_two_cells_is_read_again(tmp_path, settled):
    rc = tmp_path / ".npmrc"
    rc.write_text("registry=https://a.example/\n")
    assert _npmrc(tmp_path) == "registry=https://a.example/\n"
    ino = os.stat(rc).st_ino
    with open(rc, "r+") as f:  # the same inode, the same size
        f.write("registry=https://b.example/\n")
    assert os.stat(rc).st_ino == ino
    assert _npmrc(tmp_path) == "registry=https://b.example/\n"


def test_a_tool_config_file_replaced_with_the_same_size_and_times_is_read_again(tmp_path, settled):
    rc = tmp_path / ".npmrc"
    rc.write_text("registry=https://a.example/\n")
    assert _npmrc(tmp_path) == "registry=https://a.example/\n"
    new = tmp_path / "new"
    new.write_text("registry=https://b.example/\n")
    st = os.stat(rc)
    os.utime(new, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(new, rc)  # another inode, the same size and mtime
    assert _npmrc(tmp_path) == "registry=https://b.example/\n"


def test_a_tool_config_symlink_pointed_elsewhere_between_two_cells_is_read_again(tmp_path, settled):
    (tmp_path / "one").write_text("registry=https://a.example/\n")
    (tmp_path / "two").write_text("registry=https://b.example/\n")
    rc = tmp_path / ".npmrc"
    rc.symlink_to(tmp_path / "one")
    assert _npmrc(tmp_path) == "registry=https://a.example/\n"
    rc.unlink()
    rc.symlink_to(tmp_path / "two")
    assert _npmrc(tmp_path) == "registry=https://b.example/\n"
    rc.unlink()
    assert _npmrc(tmp_path) is None


def test_an_unchanged_tool_config_file_is_one_stat_and_no_read(tmp_path, settled, monkeypatch):
    (tmp_path / ".npmrc").write_text("registry=https://a.example/\n")
    assert _npmrc(tmp_path)
    opened = []
    real = open
    monkeypatch.setattr("builtins.open", lambda p, *a, **k: opened.append(p) or real(p, *a, **k))
    assert _npmrc(tmp_path) == "registry=https://a.example/\n"
    assert not [p for p in opened if str(p).endswith(".npmrc")]


def test_a_file_changed_within_the_last_second_is_not_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(filememo, "_KEPT", {})
    (tmp_path / ".npmrc").write_text("registry=https://a.example/\n")
    _npmrc(tmp_path)
    assert str(tmp_path / ".npmrc") not in filememo._KEPT


def test_the_offline_resolver_follows_an_edited_nsswitch_conf(tmp_path, settled, monkeypatch):
    """A role without network binds its own nsswitch.conf, made from the host's: the host's edited between two
    cells is the second cell's."""
    conf = tmp_path / "nsswitch.conf"
    conf.write_text("passwd: files\nhosts: files dns\n")
    monkeypatch.setattr(compiler, "NSSWITCH", str(conf))
    (tmp_path / "wt" / ".git").mkdir(parents=True)
    (tmp_path / "state").mkdir()

    def nsswitch():
        plan = _plan(tmp_path, tmp_path / "wt", tmp_path / "state")
        return next((t for p, t in plan.shared_files if p.endswith("-nsswitch.conf")), None)
    if not os.path.isfile(os.path.realpath("/etc/nsswitch.conf")):
        pytest.skip("this host has no /etc/nsswitch.conf to bind over")
    assert "passwd: files\n" in nsswitch()
    with open(conf, "r+") as f:  # in place, the same size
        f.write("passwd: nisxx\n")
    assert "passwd: nisxx\n" in nsswitch()


def test_a_tool_config_value_naming_a_path_in_the_home_is_judged_again_at_every_cell(tmp_path, settled):
    """What the cell sees of the home (filesystem.home_allow's real paths) is looked at per cell: an answer that
    asked it is never reused."""
    (tmp_path / ".config" / "pip").mkdir(parents=True)
    (tmp_path / ".config" / "pip" / "pip.conf").write_text(f"[global]\nfind-links = {tmp_path}/wheels\n")

    def pip(shown):
        files, _ = toolconfig.home_files(["pip"], str(tmp_path), "/nonexistent-wt", None, shown)
        return dict(files).get(os.path.join(".config", "pip", "pip.conf"))
    assert pip(lambda p: False) is None  # names a hidden path: left out
    assert pip(lambda p: True) == f"[global]\nfind-links = {tmp_path}/wheels\n"  # now shown: kept
    assert pip(lambda p: False) is None


def test_a_directory_above_the_worktree_closed_between_two_cells_is_hidden_from_the_second(monkeypatch):
    """A mapped cell's closed ancestors (compiler._closed_ancestors) are read from the cell's own walk: a chmod
    between two cells is the second cell's."""
    import shutil
    import tempfile
    base = tempfile.mkdtemp(prefix="agnsup-walk-", dir="/var/tmp")  # not under /tmp: every cell has its own
    try:
        os.chmod(base, 0o755)
        d = os.path.join(base, "d")
        os.makedirs(os.path.join(d, "wt", ".git"))
        os.makedirs(os.path.join(base, "state"))
        mapped = {**HOST, "mapped_uid": None, "_idmap": lambda path: None}

        def hidden():
            pol = policy.load("executor")
            with host.one_look():
                s = spec.build(CellRequest.make(["true"], workdir=os.path.join(d, "wt")), pol)
                return compiler.compile_plan(s, pol, os.path.join(base, "state"), mapped).home_hidden
        os.chmod(d, 0o755)
        assert d not in hidden()
        os.chmod(d, 0o750)
        assert d in hidden()
        os.chmod(d, 0o755)
        assert d not in hidden()
    finally:
        shutil.rmtree(base, ignore_errors=True)
