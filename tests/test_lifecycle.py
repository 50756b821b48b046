"""A cell's life: exit status, no survivors, timeouts, signals, missing commands."""
import json
import os
import signal

from conftest import procs_with_env, write_role
from agnsup.linux import cgroup


def _receipt(agnsup, cell):
    return json.loads(agnsup("receipts", "--cell", cell, "--json", check=0).out)[0]


def _assert_cell_gone(agnsup, cell):
    r = _receipt(agnsup, cell)
    assert procs_with_env("AGNSUP_CELL_ID", cell) == []
    for path in (r["cgroup"] or {}).values():
        assert not os.path.exists(path), path
    assert not os.path.exists(os.path.join(agnsup.state, "cells", r["run_id"], cell, "tmp"))
    return r


def test_a_backgrounded_sleep_does_not_outlive_its_cell(agnsup, worktree):
    # keep: no PID namespace, so the rest of the tree is there to find when the leader exits
    agnsup("run", "--workdir", worktree, "--cell", "bg", "--on-controller-death", "keep", "--", "sh", "-c",
           "sleep 1000 & exit 3", check=3)
    r = _assert_cell_gone(agnsup, "bg")
    assert r["exit_code"] == 3 and r["state"] == "exited"
    assert r["pids"]["left_after_leader"], "the sleep should have been found in the cell after the leader exited"


def test_a_double_forked_setsid_daemon_is_gone_after_the_cell_ends(agnsup, worktree):
    script = "setsid sh -c 'sleep 1000 & sleep 1000' < /dev/null > /dev/null 2>&1 & sleep 0.2; exit 0"
    agnsup("run", "--workdir", worktree, "--cell", "daemon", "--", "sh", "-c", script, check=0)
    _assert_cell_gone(agnsup, "daemon")


def test_a_command_killed_by_a_signal_exits_128_plus_the_signal(agnsup, worktree):
    agnsup("run", "--workdir", worktree, "--cell", "k9", "--", "sh", "-c", "kill -9 $$", check=137)
    r = _assert_cell_gone(agnsup, "k9")
    assert r["signal"] == 9 and r["state"] == "killed"


def test_a_missing_command_exits_127(agnsup, worktree):
    cp = agnsup("run", "--workdir", worktree, "--", "no-such-command-xyz", check=127)
    assert "no-such-command-xyz" in cp.err and len(cp.err.strip().splitlines()) == 1


def test_a_command_named_dash_dash_help_is_run_not_parsed(agnsup, worktree):
    cp = agnsup("run", "--workdir", worktree, "--", "--help", check=127)
    assert "--help: command not found" in cp.err
    # the host's /tmp is hidden from the cell, so the program lives in the worktree
    bindir = os.path.join(worktree, "bin")
    os.mkdir(bindir)
    with open(os.path.join(bindir, "--help"), "w") as f:
        f.write("#!/bin/sh\necho i am --help\n")
    os.chmod(os.path.join(bindir, "--help"), 0o755)
    cp = agnsup("run", "--workdir", worktree, "--env", f"PATH={bindir}:/usr/bin:/bin", "--", "--help", check=0)
    assert cp.out.strip() == "i am --help"


def test_a_file_that_is_not_executable_exits_126(agnsup, worktree):
    p = os.path.join(worktree, "script.sh")
    with open(p, "w") as f:
        f.write("echo hi\n")
    agnsup("run", "--workdir", worktree, "--", "./script.sh", check=126)


def test_timeout_on_a_tree_that_ignores_sigterm_exits_124_and_leaves_nothing(agnsup, worktree, policy_dir):
    write_role(policy_dir, "quick", limits__grace="0.5")
    agnsup("run", "--role", "quick", "--workdir", worktree, "--cell", "to", "--timeout", "1", "--",
           "sh", "-c", "trap '' TERM; (trap '' TERM; sleep 1000) & sleep 1000",
           env={"AGNSUP_POLICY_DIR": str(policy_dir)}, check=124)
    r = _assert_cell_gone(agnsup, "to")
    assert r["state"] == "timeout" and r["reason"] == "timeout"
    # timeout 1 s + grace 0.5 s, then the kill: measured from the cell's start, not the controller's
    # (an interpreter start takes seconds on an emulated CPU)
    assert r["duration"] < 6, r["duration"]


def test_sigterm_to_the_controller_cancels_the_cell(agnsup, worktree, policy_dir):
    write_role(policy_dir, "quick", limits__grace="0.5")
    p = agnsup.popen("run", "--role", "quick", "--workdir", worktree, "--cell", "sig", "--",
                     "sh", "-c", "sleep 1000 & echo up; wait", env={"AGNSUP_POLICY_DIR": str(policy_dir)},
                     stdout=-1)
    assert p.stdout.readline().strip() == b"up"
    p.send_signal(signal.SIGTERM)
    assert p.wait(20) == 128 + signal.SIGTERM
    p.stdout.close()
    r = _assert_cell_gone(agnsup, "sig")
    assert r["state"] == "cancelled" and "SIGTERM" in r["cancel_reason"]


def test_ctrl_c_to_the_controller_reaches_the_cell_as_sigint_and_exits_130(agnsup, worktree, policy_dir):
    """Issue 12 item 15: Ctrl-C (SIGINT) to `agnsup run` exits 130 (128+SIGINT, as shells and
    timeout(1) users expect), not 143; the cell gets SIGINT, also when it handles it itself."""
    write_role(policy_dir, "quick", limits__grace="0.5")
    p = agnsup.popen("run", "--role", "quick", "--workdir", worktree, "--cell", "int", "--",
                     "sh", "-c", "trap 'echo got-int; exit 3' INT; echo up; sleep 1000 & wait",
                     env={"AGNSUP_POLICY_DIR": str(policy_dir)}, stdout=-1)
    assert p.stdout.readline().strip() == b"up"
    p.send_signal(signal.SIGINT)
    assert p.wait(20) == 128 + signal.SIGINT
    # the trap ran (twice when the SIGINT caught the `&` child between its fork and its exec)
    assert set(p.stdout.read().split()) == {b"got-int"}
    p.stdout.close()
    r = _assert_cell_gone(agnsup, "int")
    assert r["state"] == "cancelled" and r["exit_code"] == 130 and "SIGINT" in r["cancel_reason"]


def test_the_receipt_shows_the_whole_chain_in_order(agnsup, worktree):
    agnsup("run", "--workdir", worktree, "--cell", "chain", "--", "true", check=0)
    r = _receipt(agnsup, "chain")
    assert [s["stage"] for s in r["chain"]] == ["public_tool", "spec_builder", "governance", "policy_compiler",
                                                "broker", "backend", "process_supervisor"]
    assert r["chain"][0]["entry"] == "cli"
    for key in ("run_id", "agent_id", "cell_id", "controller", "boot_id", "cgroup", "policy_digest", "exe"):
        assert r[key], key
    assert r["pids"]["leader"] and r["pids"]["starttime"] is not None
    ps = agnsup.json("ps", "--all", "--json")
    row = [c for c in ps if c["cell_id"] == "chain"][0]
    for key in ("cell_id", "run_id", "agent_id", "state", "run_state", "pid", "pgid", "starttime", "boot_id",
                "cgroup", "controller"):
        assert key in row
    assert "token" not in row


def test_the_journal_records_every_stage_as_an_event(agnsup, worktree):
    agnsup("run", "--workdir", worktree, "--cell", "ev", "--", "true", check=0)
    import sqlite3
    db = sqlite3.connect(os.path.join(agnsup.state, "journal.db"))
    kinds = [k for (k,) in db.execute("SELECT kind FROM events WHERE cell_id='ev' ORDER BY id")]
    assert kinds == ["stage.public_tool", "stage.spec_builder", "stage.governance", "stage.policy_compiler",
                     "stage.broker", "state.starting", "stage.backend", "stage.process_supervisor",
                     "state.running", "state.exited"]


def test_memory_and_pids_limits_are_applied_on_the_hierarchy_that_has_them(agnsup, worktree):
    cp = agnsup("run", "--workdir", worktree, "--cell", "lim", "--", "cat", "/proc/self/cgroup", check=0)
    r = _receipt(agnsup, "lim")
    layout = cgroup.detect_layout()
    applied = r["limits"]["applied"]
    for ctrl in ("memory", "pids"):
        if ctrl in layout.v2_controllers:
            assert applied[ctrl].startswith("v2:")
        elif ctrl in layout.v1:
            assert applied[ctrl].startswith("v1:")
            assert f"{ctrl}:/agnsup-" in cp.out
    assert "0::/agnsup-" in cp.out or layout.v2 is None
