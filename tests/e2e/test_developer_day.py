"""A developer's day on their own project, through `agnsup run` only (issue 13):
a git repository with a venv that has pytest, tests run from a subdirectory, a
commit under the identity of the (hidden) home, a make build, and the receipts
that account for each step. The home's other contents stay hidden throughout."""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

import pytest

from devproject import GIT, make_project, write_identity


@pytest.fixture
def day():
    """(home, project) outside /tmp (a cell's /tmp is its own), removed afterwards."""
    root = tempfile.mkdtemp(prefix="agnsup-devday-", dir="/var/tmp")
    home = os.path.join(root, "home")
    write_identity(home)
    with open(os.path.join(home, ".git-credentials"), "w") as f:
        f.write("https://dev:ghp_devday_secret@github.example\n")
    project = make_project(os.path.join(home, "src", "calc"))  # ~/src/calc, as developers keep them
    yield home, project
    shutil.rmtree(root, ignore_errors=True)


def test_a_developer_day_in_cells(agnsup, day):
    home, project = day
    env = {"HOME": home}
    tests = os.path.join(project, "tests")

    cp = agnsup("run", "--", "pytest", "-q", cwd=tests, env=env, check=0)  # the README's first example
    assert "1 passed" in cp.out

    cp = agnsup("run", "--", "sh", "-c", "git add -A && git commit -qm 'first' && git log --format='%an <%ae> %s'",
                cwd=tests, env=env, check=0)
    assert cp.out.strip() == "Dev Eloper <dev@example.org> first"
    host_log = subprocess.run([GIT, "-C", project, "log", "--format=%ae"], capture_output=True, text=True,
                              env={"HOME": home, "PATH": "/usr/bin:/bin"}, check=True)
    assert host_log.stdout.strip() == "dev@example.org"  # the commit is in the real repository

    cp = agnsup("run", "--", "make", cwd=project, env=env, check=0)
    assert "built" in cp.out
    with open(os.path.join(project, "build", "out.txt")) as f:
        assert "def add" in f.read()
    assert "up to date" in agnsup("run", "--", "make", cwd=project, env=env, check=0).out

    # the home is still hidden: its credentials file is not there for the cell
    cp = agnsup("run", "--", "cat", os.path.join(home, ".git-credentials"), cwd=project, env=env)
    assert cp.returncode != 0 and "ghp_devday_secret" not in cp.out

    receipts = agnsup.json("receipts", "--json")
    assert len(receipts) == 5
    assert [r["workdir"] for r in receipts] == [tests, tests, project, project, project]
    for r in receipts:
        assert r["worktree"] == project and r["venv"] == os.path.join(project, ".venv")
        assert r["isolation"]["network"] == "deny" and r["isolation"]["home"] == "hidden"
        assert r["isolation"]["home_config"]["git"]["taken"] == ["user.name", "user.email", "safe.directory"]
    assert [r["exit_code"] for r in receipts] == [0, 0, 0, 0, receipts[-1]["exit_code"]]
    assert receipts[-1]["exit_code"] != 0
    assert "ghp_devday_secret" not in repr(receipts)
