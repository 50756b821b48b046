"""Crash points: the controller SIGKILLs itself at a named step
(AGNSUP_TEST_CRASH_AT), then the janitor must leave nothing behind.

For each point: no process of the cell alive, its cgroup directories and temp
dir gone, the cell terminal in `agnsup ps --all`, and a second janitor has
nothing to do. A point the run path cannot reach is skipped with the reason,
never passed.
"""
import json
import os
import signal
import subprocess

import pytest

from conftest import procs_with_env, write_role
from scenario import KEEP, cell_row, wait_for

# a leader that ignores SIGTERM from its first instruction on, so it outlives a graceful stop (an
# interpreter that installs SIG_IGN itself may still be starting when a 0.5 s timeout fires, on a slow CPU)
IGNORE_TERM = ["sh", "-c", "trap '' TERM; exec sleep 1000"]
# a tree: a background sleep plus a leader that lives on
TREE = ["sh", "-c", "sleep 1000 & echo x > /tmp/scratch; exec sleep 1000"]
QUICK = ["sh", "-c", "sleep 1000 & echo x > /tmp/scratch; exit 0"]
# worktree changes the controller commits when the cell ends (reversible cells): more than one step
WRITES = ["sh", "-c", "echo a > f1; echo b > f2; mkdir d; echo c > d/f3; exit 0"]
WRITTEN = {"f1": "a\n", "f2": "b\n", "d/f3": "c\n"}
CAPTURED = ["--changes", "at_exit"]  # (KEEP runs the other trees live: their heartbeats are read as written)

CASES = {
    # point: (argv, extra run options)
    "after_intent": (TREE, []),
    "after_cgroup": (TREE, []),
    "child_setup": (TREE, []),
    "after_exec": (TREE, []),
    "journal_tx": (TREE, []),  # inside the identity transaction: rolled back, the child exits at the barrier
    "cancel_grace": (IGNORE_TERM, ["--timeout", "0.5"]),
    "cancel_frozen": (IGNORE_TERM, ["--timeout", "0.5"]),
    "cleanup_before_rmdir": (QUICK, []),
    "cleanup_tmp_half": (QUICK, []),
    "changes_mid_commit": (WRITES, CAPTURED),     # the commit's first step done: the janitor finishes the plan
    "changes_before_record": (WRITES, CAPTURED),  # every step done, no record.json yet
}
# points after which the cell's processes are still running when the controller dies
SURVIVES = ("after_exec", "cancel_grace", "cancel_frozen")


def _crash_run(agnsup, tmp_path, point, cell, argv, opts, worktree, env=None):
    """`agnsup run` with the crash point set; stdio to files (the tree keeps them open)."""
    out = open(tmp_path / f"{cell}.out", "wb")
    err = open(tmp_path / f"{cell}.err", "wb")
    p = agnsup.popen("run", "--role", "quick", "--workdir", worktree, "--cell", cell, *KEEP, *opts, "--", *argv,
                     env={"AGNSUP_TEST_CRASH_AT": point, **(env or {})}, stdin=subprocess.DEVNULL,
                     stdout=out, stderr=err)
    out.close()
    err.close()
    try:
        rc = p.wait(60)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        raise
    return rc, (tmp_path / f"{cell}.err").read_text()


def _assert_converged(agnsup, cell):
    row = cell_row(agnsup, cell)
    assert row["state"] in ("exited", "failed", "timeout", "cancelled", "killed", "recovered"), row["state"]
    assert procs_with_env("AGNSUP_CELL_ID", cell) == []
    for path in (row["cgroup"] or {}).values():
        assert not os.path.exists(path), path
    assert not os.path.exists(os.path.join(agnsup.state, "cells", row["run_id"], cell, "tmp"))
    assert not os.listdir(os.path.join(agnsup.state, "locks"))
    assert not os.listdir(os.path.join(agnsup.state, "controllers"))
    return row


@pytest.mark.parametrize("point", list(CASES))
def test_a_controller_killed_at_a_crash_point_leaves_nothing_after_the_janitor(agnsup, worktree, tmp_path,
                                                                              policy_dir, point):
    write_role(policy_dir, "quick", limits__grace="0.5")
    agnsup.env["AGNSUP_POLICY_DIR"] = str(policy_dir)
    argv, opts = CASES[point]
    cell = "x-" + point.replace("_", "-")
    rc, err = _crash_run(agnsup, tmp_path, point, cell, argv, opts, worktree)
    # every case is built to reach its point: a controller that ends otherwise is a failure, not a skip
    assert rc == -signal.SIGKILL, f"crash point {point!r} was not reached (controller exited {rc}): {err}"
    row = cell_row(agnsup, cell)
    assert row["state"] in ("starting", "running"), row
    if point.startswith("changes_"):  # a commit in flight: its plan on disk, the worktree not yet all there
        assert os.path.exists(os.path.join(agnsup.state, "changes", "default", cell, "plan.json"))
        if point == "changes_mid_commit":
            assert sorted(os.listdir(worktree)) != ["d", "f1", "f2"]
    if point in SURVIVES:
        assert procs_with_env("AGNSUP_CELL_ID", cell), "the tree did not survive its controller: run invalid"
    rep = agnsup.json("janitor", "--json")
    assert rep["recovered"] == [cell], rep
    if point in SURVIVES:
        assert rep["killed"] and all(k["verified_dead"] for k in rep["killed"])
    assert _assert_converged(agnsup, cell)["state"] == "recovered"
    if point.startswith("changes_"):
        _assert_committed(agnsup, worktree, cell)
    again = agnsup.json("janitor", "--json")
    assert again["recovered"] == [] and again["killed"] == []


def test_records_committed_before_a_crash_at_the_head_write_are_not_yet_anchored_until_the_next_writer(
        agnsup, worktree, tmp_path, policy_dir):
    """Crash point chain.head: the transaction committed, the controller died before writing the head.
    `agnsup verify` says the records past the head are not yet anchored and exits 0; the next writer (here the
    janitor) anchors them."""
    write_role(policy_dir, "quick", limits__grace="0.5")
    agnsup.env["AGNSUP_POLICY_DIR"] = str(policy_dir)
    agnsup("run", "--role", "quick", "--workdir", worktree, "--", "true", check=0)  # a head exists
    anchored = json.loads(agnsup("verify", "--json", check=0).out)["records"]
    rc, err = _crash_run(agnsup, tmp_path, "chain.head", "x-head", QUICK, [], worktree)
    assert rc == -signal.SIGKILL, err
    cp = agnsup("verify", check=0)
    assert "not yet anchored (a controller died before writing the head)" in cp.out, cp.out
    r = json.loads(agnsup("verify", "--json", check=0).out)
    assert r["ok"] and r["anchored"] == anchored and r["not_anchored"] == r["records"] - anchored > 0
    assert agnsup.json("janitor", "--json")["recovered"] == ["x-head"]
    assert _assert_converged(agnsup, "x-head")["state"] == "recovered"
    r = json.loads(agnsup("verify", "--json", check=0).out)
    assert r["ok"] and r["not_anchored"] == 0 and r["anchored"] == r["records"] > anchored


def _assert_committed(agnsup, worktree, cell, run="default"):
    """The worktree is as the cell left it (never half-merged), its record complete and undoable."""
    for rel, text in WRITTEN.items():
        with open(os.path.join(worktree, rel)) as f:
            assert f.read() == text, rel
    rec = os.path.join(agnsup.state, "changes", run, cell)
    assert sorted(os.listdir(rec)) in (["record.json"], ["before", "record.json"]), os.listdir(rec)
    with open(os.path.join(rec, "record.json")) as f:
        assert sorted(e["path"] for e in json.load(f)["entries"]) == ["d", "d/f3", "f1", "f2"]
    receipt = json.loads(agnsup("receipts", "--recovery", "--cell", cell, "--json", check=0).out)[0]["cell"]
    assert receipt["changes"]["record"] == f"{run}/{cell}", receipt
    assert any("undo" in n for n in receipt["notes"]), receipt["notes"]


def test_a_cell_whose_controller_died_while_it_ran_has_its_changes_committed_by_the_janitor(agnsup, worktree,
                                                                                            tmp_path, policy_dir):
    write_role(policy_dir, "quick", limits__grace="0.5")
    agnsup.env["AGNSUP_POLICY_DIR"] = str(policy_dir)
    cell = "x-died-running-" + os.urandom(4).hex()  # its processes are looked up host-wide by cell id
    argv = ["sh", "-c", WRITES[2].replace("exit 0", "exec sleep 1000")]
    p = agnsup.popen("run", "--role", "quick", "--workdir", worktree, "--cell", cell, *KEEP, *CAPTURED, "--",
                     *argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        upper = os.path.join(agnsup.state, "changes", "default", cell, "upper")
        wait_for(lambda: os.path.exists(os.path.join(upper, "d", "f3")) or p.poll() is not None, what="the writes")
        assert p.poll() is None
        assert os.listdir(worktree) == []  # in the cell's layer only, while it runs
    finally:
        p.kill()
        p.wait(10)
    rep = agnsup.json("janitor", "--json")
    assert rep["recovered"] == [cell]
    assert _assert_converged(agnsup, cell)["state"] == "recovered"
    _assert_committed(agnsup, worktree, cell)


def test_a_janitor_killed_after_its_kill_leaves_a_state_the_next_one_finishes(agnsup, worktree, tmp_path,
                                                                              policy_dir):
    write_role(policy_dir, "quick", limits__grace="0.5")
    agnsup.env["AGNSUP_POLICY_DIR"] = str(policy_dir)
    cell = "x-janitor"
    p = agnsup.popen("run", "--role", "quick", "--workdir", worktree, "--cell", cell, *KEEP, "--", *TREE,
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for(lambda: len(procs_with_env("AGNSUP_CELL_ID", cell)) >= 2 or p.poll() is not None, what="the tree")
    assert p.poll() is None
    p.kill()
    p.wait(10)
    assert procs_with_env("AGNSUP_CELL_ID", cell), "the tree did not survive its controller: run invalid"

    first = agnsup("janitor", "--json", env={"AGNSUP_TEST_CRASH_AT": "janitor_after_kill"})
    assert first.returncode == -signal.SIGKILL, (first.returncode, first.out, first.err)
    assert procs_with_env("AGNSUP_CELL_ID", cell) == []          # it killed ...
    assert cell_row(agnsup, cell)["state"] in ("starting", "running")  # ... but recorded nothing

    rep = agnsup.json("janitor", "--json")
    assert rep["recovered"] == [cell]
    cell_rec = json.loads(agnsup("receipts", "--recovery", "--cell", cell, "--json", check=0).out)[0]["cell"]
    assert cell_rec["earlier_attempts"] and cell_rec["earlier_attempts"][0]["candidates"]
    assert _assert_converged(agnsup, cell)["state"] == "recovered"
    assert agnsup.json("janitor", "--json")["recovered"] == []
