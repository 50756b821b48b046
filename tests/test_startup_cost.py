"""`agnsup run -- true` imports nothing heavy (issue 2, Speed).

A real `agnsup run` (real cell: cgroups, namespaces, journal, receipt) in a
fresh interpreter, through the console script's own entry point; at exit the
interpreter writes which modules it imported. Each module named here costs
more than bwrap needs to start a whole sandbox (or pulls in such a module),
and the run path needs none of them when the policy cache is warm.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HEAVY = ("click", "pydantic", "pydantic_core", "dataclasses", "inspect", "ast", "dis", "shutil", "tree_sitter",
         "tree_sitter_bash", "pyroute2", "psutil", "secrets", "random", "hmac", "typing", "tomllib",
         "importlib.resources", "importlib.metadata", "socket", "tempfile", "bz2", "lzma")

RUN = r"""
import atexit, json, sys
def _dump(path=sys.argv[1]):
    with open(path, "w") as f:
        json.dump(sorted(sys.modules), f)
atexit.register(_dump)
sys.argv = ["agnsup", *sys.argv[2:]]
from agnsup.entry import main
main()
"""


def _run_and_list_modules(state, worktree, tmp_path, *args):
    out = str(tmp_path / "modules.json")
    env = {**os.environ, "AGNSUP_STATE_DIR": state}
    cp = subprocess.run([sys.executable, "-c", RUN, out, *args], cwd=worktree, env=env, capture_output=True,
                        timeout=120, stdin=subprocess.DEVNULL)
    assert cp.returncode == 0, cp.stderr.decode(errors="replace")
    with open(out) as f:
        return set(json.load(f))


@pytest.mark.parametrize("role", ["executor", "networked", "readonly"])
def test_run_true_imports_nothing_heavy(state, worktree, tmp_path, role):
    _run_and_list_modules(state, worktree, tmp_path, "run", "--role", role, "--", "true")  # warms the policy cache
    mods = _run_and_list_modules(state, worktree, tmp_path, "run", "--role", role, "--", "true")
    assert "agnsup.supervisor" in mods and "agnsup.journal" in mods  # it did run the cell path
    heavy = sorted(m for m in mods if m in HEAVY or m.split(".")[0] in ("click", "pydantic", "tree_sitter"))
    assert heavy == [], f"the run path imported {heavy}"


def test_the_check_sees_a_heavy_import(state, worktree, tmp_path):
    """The same harness on a path that does import click (`agnsup ps`): the list is real."""
    mods = _run_and_list_modules(state, worktree, tmp_path, "ps", "--json")
    assert "click" in mods


def test_the_cell_was_recorded(state, worktree, tmp_path):
    """The fast path still journals the cell and writes its receipt."""
    _run_and_list_modules(state, worktree, tmp_path, "run", "--cell", "fast", "--", "true")
    with open(os.path.join(state, "cells", "default", "fast", "receipt.json")) as f:
        receipt = json.load(f)
    assert receipt["state"] == "exited" and receipt["exit_code"] == 0
    assert [s["stage"] for s in receipt["chain"]][:3] == ["public_tool", "spec_builder", "governance"]


def test_rmtree_removes_a_deep_tree_and_never_follows_symlinks(tmp_path):
    """reap.rmtree replaces shutil.rmtree on the cell's /tmp, which the cell wrote."""
    from agnsup.reap import rmtree
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("x")
    top = tmp_path / "cell-tmp"
    top.mkdir()
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(1500):  # deeper than Python's recursion limit
        os.mkdir("d", dir_fd=fd)
        fd2 = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = fd2
    os.close(os.open("f", os.O_WRONLY | os.O_CREAT, dir_fd=fd))
    os.close(fd)
    (top / "link-dir").symlink_to(outside)
    (top / "d" / "link-file").symlink_to(outside / "keep")
    os.mkfifo(top / "fifo")
    os.chmod(top / "d", 0o000)  # root removes it anyway, as shutil.rmtree does
    rmtree(str(top))
    assert not os.path.lexists(top)
    assert (outside / "keep").read_text() == "x"
    rmtree(str(top))  # already gone: not an error
    f = tmp_path / "file"
    f.write_text("x")
    rmtree(str(f))
    assert not f.exists()
