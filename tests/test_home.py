"""The invoking user's home is hidden from every cell (HOME_VISIBILITY), with the
worktree, the Python runtime and `filesystem.home_allow` re-exposed inside it.

Real cells, a real home: the files these tests read are made in the home of the
user running the suite (root's /root on the test VMs) and removed afterwards.
Probes are Python, and paths the text gate might refuse on sight are joined
inside the cell.
"""
from __future__ import annotations

import ast
import json
import os
import pwd
import secrets
import shutil
import subprocess
import sys
import tempfile

import pytest

from conftest import write_role

HOME = os.path.realpath(os.path.expanduser("~"))
PW_HOME = os.path.realpath(pwd.getpwuid(os.getuid()).pw_dir)

READ = r'''
import os, sys
for a, b in zip(sys.argv[1::2], sys.argv[2::2]):
    p = a + b
    try:
        if os.path.isdir(p):
            print("LISTED", p, sorted(os.listdir(p)))
        else:
            print("READ", p, open(p).read().strip() or "<empty>")
    except OSError as e:
        print("refused", p, e.strerror)
'''

WRITE = r'''
import sys
for p in sys.argv[1:]:
    try:
        open(p, "w").write("x"); print("WROTE", p)
    except OSError as e:
        print("refused", p, e.strerror)
'''


def _empty_or_closed(path: str, out: str) -> bool:
    """A deny mask seen from a cell: an empty directory (a host-root cell lists it), or one it may not
    enter (a mapped cell, uid 0 of a user namespace, on the mask's mode 000: tests/test_doors_identity.py)."""
    return f"LISTED {path} []" in out or f"refused {path} Permission denied" in out


def _split(path: str, deny: str | None = None) -> list[str]:
    # two pieces joined in the cell, neither a path the text gate would refuse on sight
    # (a path inside a deny directory is cut within the directory's own name)
    cut = len(deny) - 2 if deny else len(path) - 2
    return [path[:cut], path[cut:]]


def _receipt(state: str) -> dict:
    paths = []
    for root, _, files in os.walk(os.path.join(state, "cells")):
        paths += [os.path.join(root, f) for f in files if f == "receipt.json"]
    with open(max(paths, key=os.path.getmtime)) as f:
        return json.load(f)


@pytest.fixture
def in_home():
    """A fresh directory inside the real home, removed afterwards."""
    d = tempfile.mkdtemp(prefix=".agnsup-test-home-", dir=HOME)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def canary():
    """A file with a secret in the real home (and in the passwd home when that differs)."""
    token = "secret-" + secrets.token_hex(8)
    name = secrets.token_hex(4)
    paths = []
    for home in dict.fromkeys([HOME, PW_HOME]):
        p = os.path.join(home, f".agnsup-test-canary-{name}")
        with open(p, "w") as f:
            f.write(token)
        paths.append(p)
    yield token, paths
    for p in paths:
        os.unlink(p)


@pytest.mark.parametrize("role", ["executor", "readonly", "networked", "proxied"])
def test_a_file_in_the_invoking_users_home_is_unreadable_from_a_cell_of_each_shipped_role(
        agnsup, worktree, canary, role):
    token, paths = canary
    args = [a for p in paths for a in _split(p)]
    cp = agnsup("run", "--role", role, "--workdir", worktree, "--", "python3", "-c", READ, *args, check=0)
    assert token not in cp.out
    for p in paths:
        assert f"refused {p} No such file or directory" in cp.out, cp.out
        with open(p) as f:  # control: the host reads it
            assert f.read() == token
    iso = _receipt(agnsup.state)["isolation"]
    assert iso["home"] == "hidden" and HOME in iso["home_hidden"] and PW_HOME in iso["home_hidden"]


def test_the_hidden_home_lists_only_the_mount_points_of_what_is_re_exposed(agnsup, worktree):
    cp = agnsup("run", "--workdir", worktree, "--", "python3", "-c", READ, *_split(HOME), check=0)
    listed = ast.literal_eval(cp.out.split(" ", 2)[2])
    exposed = _receipt(agnsup.state)["isolation"]["home_exposed"]
    tops = {os.path.relpath(p, HOME).split("/")[0] for p in exposed if p.startswith(HOME + "/")}
    assert set(listed) == tops, (listed, exposed)
    assert set(listed) < set(os.listdir(HOME)) or not listed


def test_the_hidden_home_cannot_be_written(agnsup, worktree):
    name = f"agnsup-test-write-{secrets.token_hex(4)}"
    cp = agnsup("run", "--workdir", worktree, "--", "python3", "-c", WRITE, os.path.join(HOME, name), check=0)
    assert "refused" in cp.out and not os.path.exists(os.path.join(HOME, name))


def test_a_worktree_inside_the_home_is_writable_for_the_executor_role(agnsup, in_home):
    with open(os.path.join(in_home, "src.txt"), "w") as f:
        f.write("source")
    cp = agnsup("run", "--workdir", in_home, "--", "python3", "-c", READ + WRITE.replace("import sys", ""),
                *_split(os.path.join(in_home, "src.txt")), check=0)
    assert f"READ {in_home}/src.txt source" in cp.out
    # the write half of the probe takes every argument as a path: relative ones land in the worktree
    cp = agnsup("run", "--workdir", in_home, "--", "python3", "-c", WRITE, "made-in-cell", check=0)
    assert "WROTE made-in-cell" in cp.out
    assert os.path.exists(os.path.join(in_home, "made-in-cell"))
    assert _receipt(agnsup.state)["isolation"]["home_hidden"]


def test_a_worktree_inside_the_home_is_read_only_for_the_readonly_role(agnsup, in_home):
    with open(os.path.join(in_home, "src.txt"), "w") as f:
        f.write("source")
    cp = agnsup("run", "--role", "readonly", "--workdir", in_home, "--", "python3", "-c", READ,
                *_split(os.path.join(in_home, "src.txt")), check=0)
    assert f"READ {in_home}/src.txt source" in cp.out
    cp = agnsup("run", "--role", "readonly", "--workdir", in_home, "--", "python3", "-c", WRITE, "made-in-cell",
                check=0)
    assert "refused made-in-cell Read-only file system" in cp.out
    assert not os.path.exists(os.path.join(in_home, "made-in-cell"))


def test_a_worktree_that_is_the_home_itself_shows_the_home_but_not_its_deny_paths(
        agnsup, policy_dir, in_home, canary):
    # The user chose to work in the home: it is the worktree (read-only here), on top of
    # the hidden home; the role's deny paths inside it stay masked.
    token, paths = canary
    os.makedirs(os.path.join(in_home, "keys"))
    with open(os.path.join(in_home, "keys", "id"), "w") as f:
        f.write("PRIVATE KEY")
    write_role(policy_dir, "homewt", filesystem__worktree='"ro"',
               filesystem__deny=json.dumps([os.path.join(in_home, "keys")]))
    cp = agnsup("run", "--role", "homewt", "--workdir", HOME, "--", "python3", "-c", READ, *_split(paths[0]),
                *_split(os.path.join(in_home, "keys")),
                *_split(os.path.join(in_home, "keys", "id"), os.path.join(in_home, "keys")),
                env={"AGNSUP_POLICY_DIR": str(policy_dir)}, check=0)
    assert f"READ {paths[0]} {token}" in cp.out, cp.out
    assert "PRIVATE KEY" not in cp.out and _empty_or_closed(f"{in_home}/keys", cp.out), cp.out
    assert HOME in _receipt(agnsup.state)["isolation"]["home_hidden"]


def test_the_venv_python_runs_in_a_cell_with_its_real_prefix_re_exposed(agnsup, worktree):
    code = "import sys, json; print(json.dumps([sys.prefix, sys.base_prefix, sys.version]))"
    cp = agnsup("run", "--workdir", worktree, "--", sys.executable, "-c", code, check=0)
    prefix, base, version = json.loads(cp.out)
    assert (prefix, base, version) == (sys.prefix, sys.base_prefix, sys.version)
    exposed = _receipt(agnsup.state)["isolation"]["home_exposed"]
    real_base = os.path.realpath(sys.base_prefix)
    if real_base.startswith(HOME + "/"):  # this host: a pyenv interpreter under /root
        assert real_base in exposed, exposed


def test_the_runtime_is_re_exposed_read_only(agnsup, worktree):
    real_base = os.path.realpath(sys.base_prefix)
    if not real_base.startswith(HOME + "/"):
        pytest.skip(f"the interpreter's prefix {real_base} is not under the home {HOME}")
    cp = agnsup("run", "--workdir", worktree, "--", "python3", "-c", WRITE,
                os.path.join(real_base, f"agnsup-test-{secrets.token_hex(4)}"), check=0)
    assert "refused" in cp.out and "WROTE" not in cp.out


def test_home_allow_re_exposes_a_file_and_a_directory_read_only(agnsup, worktree, policy_dir, in_home):
    os.makedirs(os.path.join(in_home, "conf"))
    with open(os.path.join(in_home, "conf", "a"), "w") as f:
        f.write("dir-file")
    with open(os.path.join(in_home, "rc"), "w") as f:
        f.write("file")
    with open(os.path.join(in_home, "other"), "w") as f:
        f.write("not allowed")
    allow = [os.path.join(in_home, "conf"), "~/" + os.path.relpath(os.path.join(in_home, "rc"), HOME)]
    write_role(policy_dir, "allow", filesystem__home_allow=json.dumps(allow))
    env = {"AGNSUP_POLICY_DIR": str(policy_dir)}
    cp = agnsup("run", "--role", "allow", "--workdir", worktree, "--", "python3", "-c", READ,
                *_split(os.path.join(in_home, "conf", "a")), *_split(os.path.join(in_home, "rc")),
                *_split(os.path.join(in_home, "other")), env=env, check=0)
    assert f"READ {in_home}/conf/a dir-file" in cp.out and f"READ {in_home}/rc file" in cp.out, cp.out
    assert f"refused {in_home}/other No such file or directory" in cp.out
    cp = agnsup("run", "--role", "allow", "--workdir", worktree, "--", "python3", "-c", WRITE,
                os.path.join(in_home, "conf", "b"), os.path.join(in_home, "rc"), env=env, check=0)
    assert "WROTE" not in cp.out and cp.out.count("refused") == 2
    with open(os.path.join(in_home, "rc")) as f:
        assert f.read() == "file"


def test_the_opt_out_home_ro_restores_read_access(agnsup, worktree, policy_dir, canary):
    token, paths = canary
    write_role(policy_dir, "homeread", filesystem__home='"ro"')
    cp = agnsup("run", "--role", "homeread", "--workdir", worktree, "--", "python3", "-c", READ, *_split(paths[0]),
                env={"AGNSUP_POLICY_DIR": str(policy_dir)}, check=0)
    assert f"READ {paths[0]} {token}" in cp.out
    iso = _receipt(agnsup.state)["isolation"]
    # the invoking user's home is shown; every other home stays hidden (tests/test_doors_identity.py)
    assert iso["home"] == "ro" and PW_HOME not in iso["home_hidden"] and HOME not in iso["home_hidden"]


def test_home_ro_keeps_the_home_read_only_even_with_a_writable_root(agnsup, worktree, policy_dir, in_home):
    # Landlock off so only the mounts stand between the cell and the home.
    write_role(policy_dir, "rwroot", filesystem__home='"ro"', filesystem__root='"rw"', isolation__landlock="false")
    target = os.path.join(in_home, "written")
    cp = agnsup("run", "--role", "rwroot", "--workdir", worktree, "--", "python3", "-c", WRITE, target,
                env={"AGNSUP_POLICY_DIR": str(policy_dir)}, check=0)
    assert f"refused {target} Read-only file system" in cp.out and not os.path.exists(target)


def test_deny_paths_stay_hidden_even_when_home_allow_names_them(agnsup, worktree, policy_dir, in_home):
    ssh = os.path.join(in_home, ".ssh")
    os.makedirs(ssh)
    with open(os.path.join(ssh, "id_ed25519"), "w") as f:
        f.write("PRIVATE KEY")
    write_role(policy_dir, "allowssh", filesystem__home_allow=json.dumps([ssh]),
               filesystem__deny=json.dumps(["~/.ssh", ssh]))
    cp = agnsup("run", "--role", "allowssh", "--workdir", worktree, "--", "python3", "-c", READ,
                *_split(ssh), *_split(os.path.join(ssh, "id_ed25519"), ssh),
                env={"AGNSUP_POLICY_DIR": str(policy_dir)}, check=0)
    assert "PRIVATE KEY" not in cp.out
    assert _empty_or_closed(ssh, cp.out), cp.out


def test_a_shipped_deny_path_stays_hidden_inside_a_worktree_re_exposed_from_the_home(agnsup, in_home):
    # HOME points at a scratch home inside the real one that is also the worktree: its
    # ~/.ssh comes back with the worktree, and the shipped role's deny mask still covers it.
    ssh = os.path.join(in_home, ".ssh")
    os.makedirs(ssh)
    with open(os.path.join(ssh, "id_rsa"), "w") as f:
        f.write("PRIVATE KEY")
    cp = agnsup("run", "--workdir", in_home, "--", "python3", "-c", READ, *_split(ssh),
                *_split(os.path.join(ssh, "id_rsa"), ssh), env={"HOME": in_home}, check=0)
    assert "PRIVATE KEY" not in cp.out and _empty_or_closed(ssh, cp.out), cp.out


def test_under_sudo_the_sudo_users_home_is_hidden_too(agnsup, worktree):
    if os.getuid() != 0:
        pytest.skip("SUDO_USER is honoured when agnsup runs as root")
    others = [p for p in pwd.getpwall() if p.pw_uid != 0 and os.path.realpath(p.pw_dir).startswith(("/home/", "/var/lib/"))
              and os.path.isdir(p.pw_dir) and os.listdir(p.pw_dir)]
    if not others:
        pytest.skip("no other user on this host has a non-empty home directory")
    user = others[0]
    home = os.path.realpath(user.pw_dir)
    cp = agnsup("run", "--workdir", worktree, "--", "python3", "-c", READ, *_split(home),
                env={"SUDO_USER": user.pw_name}, check=0)
    assert home in _receipt(agnsup.state)["isolation"]["home_hidden"]
    assert f"LISTED {home} []" in cp.out, cp.out
    # without sudo too: every home of the password database is hidden (issue 25, tests/test_doors_identity.py)
    cp = agnsup("run", "--workdir", worktree, "--", "python3", "-c", READ, *_split(home), check=0)
    assert f"LISTED {home} []" in cp.out, cp.out


def test_a_home_that_holds_the_system_refuses_the_cell_naming_the_key(agnsup, worktree):
    cp = agnsup("run", "--workdir", worktree, "--", "true", env={"HOME": "/var"}, check=125)
    assert "home /var holds /var" in cp.err and 'filesystem.home = "ro"' in cp.err
    assert len(cp.err.strip().splitlines()) == 1, cp.err


def test_a_home_of_slash_is_not_a_home_and_the_cell_runs(agnsup, worktree):
    agnsup("run", "--workdir", worktree, "--", "true", env={"HOME": "/"}, check=0)
    iso = _receipt(agnsup.state)["isolation"]
    assert "/" not in iso["home_hidden"] and PW_HOME in iso["home_hidden"]


@pytest.mark.parametrize("key,value,problem", [
    ("home", '"maybe"', "filesystem.home"),
    ("home_allow", '["relative/path"]', "not a path inside the home"),
    ("home_allow", '["~/../etc"]', "holds '..'"),
])
def test_a_bad_home_key_is_refused_with_file_key_and_problem(agnsup, worktree, policy_dir, key, value, problem):
    path = write_role(policy_dir, "badhome", **{f"filesystem__{key}": value})
    cp = agnsup("run", "--role", "badhome", "--workdir", worktree, "--", "true",
                env={"AGNSUP_POLICY_DIR": str(policy_dir)}, check=125)
    assert path in cp.err and problem in cp.err, cp.err


def test_home_allow_with_a_visible_home_is_refused(agnsup, worktree, policy_dir):
    write_role(policy_dir, "badmix", filesystem__home='"ro"', filesystem__home_allow='["~/x"]')
    cp = agnsup("run", "--role", "badmix", "--workdir", worktree, "--", "true",
                env={"AGNSUP_POLICY_DIR": str(policy_dir)}, check=125)
    assert "home_allow applies to a hidden home" in cp.err, cp.err


def test_home_ro_on_a_file_system_that_cannot_be_id_mapped_runs_the_cell_as_host_root_and_says_why(
        agnsup, worktree, policy_dir):
    # A root controller's cell is uid 0 of the cells' user namespace; home = "ro" shows it the home through an
    # id-mapped clone. ramfs refuses id-mapped mounts (as NFS or 9p homes do): the controller must see that
    # before the start, like a worktree's (not fail in the child's mount step).
    if os.getuid() != 0:
        pytest.skip("mapped cells are a root controller's")
    from pathlib import Path
    home = Path(tempfile.mkdtemp(prefix="agnsup-test-ramhome-", dir="/var/tmp"))  # a cell has its own /tmp
    subprocess.run(["mount", "-t", "ramfs", "-o", "mode=0700", "ramfs", str(home)], check=True)
    try:
        token = secrets.token_hex(8)
        (home / "note").write_text(token)
        write_role(policy_dir, "homeread", filesystem__home='"ro"')
        cp = agnsup("run", "--role", "homeread", "--workdir", worktree, "--", "python3", "-c", READ,
                    *_split(str(home / "note")), env={"AGNSUP_POLICY_DIR": str(policy_dir), "HOME": str(home)},
                    check=0)
        assert cp.returncode == 0 and f"READ {home}/note {token}" in cp.out, (cp.out, cp.err)
        receipt = _receipt(agnsup.state)
        from agnsup.process.namespaces import idmap_refused
        why = [m for m in receipt["isolation"]["not_in_force"] if m.startswith("mapped_uid (the cell runs as host root)")]
        assert why, receipt["isolation"]["not_in_force"]
        # the first file system that cannot be id-mapped is named: the ramfs home's where the worktree's and the
        # passwd home's can be (in the v2 guest /root, an overlay over 9p, is named first)
        named = why[0].split("the file system of ", 1)[1].split(" cannot be id-mapped", 1)[0]
        assert idmap_refused(named) is not None, why
        if idmap_refused(worktree) is None and idmap_refused(PW_HOME) is None:
            assert named == str(home), why
    finally:
        subprocess.run(["umount", str(home)], check=True)
        home.rmdir()
