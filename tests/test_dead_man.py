"""on_controller_death (issue 18): the policy key, the per-cell option, what the
receipt says, and the pitfall of a parent-death signal tied to a thread."""
import json
import os
import signal
import subprocess
import time

import pytest

from conftest import write_role
from scenario import stubborn_argv, wait_beats


def _isolation(state, cell, run="default"):
    with open(os.path.join(state, "cells", run, cell, "receipt.json")) as f:
        return json.load(f)["isolation"]


def test_the_receipt_says_how_a_cell_dies_with_its_controller(agnsup, worktree, state):
    agnsup("run", "--workdir", worktree, "--cell", "k", "--", "true", check=0)
    iso = _isolation(state, "k")
    assert iso["on_controller_death"]["mode"] == "kill" and iso["on_controller_death"]["in_force"] is True
    assert iso["pid_namespace"] is True  # the switch is the namespace's init
    agnsup("run", "--workdir", worktree, "--cell", "p", "--on-controller-death", "keep", "--", "true", check=0)
    iso = _isolation(state, "p")
    assert iso["on_controller_death"]["mode"] == "keep" and iso["pid_namespace"] is False


def test_a_role_can_keep_its_trees_and_a_call_can_override_the_role(agnsup, worktree, state, policy_dir):
    write_role(policy_dir, "lasting", process__on_controller_death='"keep"')
    env = {"AGNSUP_POLICY_DIR": str(policy_dir)}
    agnsup("run", "--role", "lasting", "--workdir", worktree, "--cell", "r", "--", "true", check=0, env=env)
    assert _isolation(state, "r")["on_controller_death"]["mode"] == "keep"
    agnsup("run", "--role", "lasting", "--workdir", worktree, "--cell", "o", "--on-controller-death", "kill",
           "--", "true", check=0, env=env)
    assert _isolation(state, "o")["on_controller_death"]["mode"] == "kill"


@pytest.mark.parametrize("value", ["maybe", ""])
def test_a_bad_mode_is_one_clear_error(agnsup, worktree, value):
    cp = agnsup("run", "--workdir", worktree, "--on-controller-death", value, "--", "true", check=125)
    assert "kill" in cp.err and "keep" in cp.err and "Traceback" not in cp.err


def test_a_serve_cell_outlives_the_connection_that_spawned_it(agnsup, tmp_path):
    """PR_SET_PDEATHSIG fires when the *thread* that forked the cell exits; serve
    handles each connection in a thread of its own, which ends with the client's
    `agnsup spawn`. Cells are forked from a thread that lives as long as serve."""
    server = agnsup.popen("serve", stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        assert server.stdout.readline()
        wt = tmp_path / "wt"
        wt.mkdir()
        out = agnsup.json("spawn", "--role", "networked", "--cell", "s1", "--workdir", str(wt), "--",
                          *stubborn_argv(str(wt), "s1"))  # the client is gone once this returns
        hb = os.path.join(str(wt), "hb-s1")
        wait_beats([hb], 3)
        before = os.path.getsize(hb)
        time.sleep(1.5)
        assert os.path.getsize(hb) > before, "the cell died with the connection's thread"
        row = agnsup.json("ps", "--json")[0]
        assert row["cell_id"] == "s1" and row["state"] == "running" and row["pid"] == out["pid"]
        agnsup("cancel", "--cell", "s1", "--grace", "0", check=0)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)
        server.stdout.close()
