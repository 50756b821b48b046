"""Issue 25, door 6, for a normal user running agnsup itself (no root anywhere in the cell's
making: a user namespace of its own, tests/test_unprivileged.py's delegated-subtree user).
The user owns its worktree, so only the protection stands between the cell and the files
git and editors run. Against 215dff3 the writes succeed and the host's git runs the plant."""
import json
import os

import pytest

from test_doors_autoexec import PLANT, CREATE_AGENT_FILES, host_git, last_json, make_repo
from test_unprivileged import User, _venv

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="ENV_BLOCKED: root (the test makes a user and "
                                                          "delegates a cgroup subtree to it)")


@pytest.fixture(scope="module")
def user():
    with User(_venv()) as u:
        yield u


def _repo(user, name: str, tmp_path) -> str:
    wt = os.path.join(user.home, name)
    os.makedirs(wt)
    make_repo(wt, str(tmp_path / "hosthome"))
    for d, dirs, files in os.walk(user.home):
        for n in [d] + [os.path.join(d, x) for x in dirs + files]:
            os.lchown(n, user.uid, user.gid)
    return wt


def _run(user, wt: str, code: str, *args):
    rc = os.path.join(user.home, "receipt.json")
    cp = user("run", "--receipt", rc, "--workdir", wt, "--", "python3", "-c", code, *args)
    assert cp.returncode == 0, cp.stderr
    with open(rc) as f:
        cp.receipt = json.load(f)
    os.unlink(rc)
    return cp


def test_a_normal_users_cell_cannot_plant_what_the_host_runs(user, tmp_path):
    wt = _repo(user, "wt-plant", tmp_path)
    marker = str(tmp_path / "MARKER")
    cp = _run(user, wt, PLANT, marker)
    out = last_json(cp)
    assert [p for p, what in out.items() if what == "written"] == [], out
    assert cp.receipt["isolation"]["user_namespace"] and ".git/config" in cp.receipt["isolation"]["protected"]
    home = str(tmp_path / "hosthome")
    host_git(wt, home, "status", check=False)
    with open(os.path.join(wt, "README"), "a") as f:
        f.write("host edit\n")
    host_git(wt, home, "commit", "-qam", "host", check=False)
    assert not os.path.exists(marker), "a program the cell planted ran on the host"
    assert user.left() == []


def test_a_normal_users_cell_has_what_it_created_quarantined_into_its_own_state_root(user, tmp_path):
    wt = _repo(user, "wt-create", tmp_path)
    cp = _run(user, wt, CREATE_AGENT_FILES)
    moved = {m["path"]: m["to"] for m in cp.receipt["protected"]["quarantined"]}
    assert set(moved) == {".mcp.json", ".claude/commands"}, cp.receipt["protected"]
    assert all(to.startswith(os.path.join(user.home, ".local", "state", "agnsup")) for to in moved.values())
    assert not os.path.exists(os.path.join(wt, ".mcp.json"))
