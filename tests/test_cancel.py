"""Hierarchical cancel and cleanup with real stubborn trees (phase 4 of the
authority-blackout spec), through the three ways a cell starts: a foreground
`agnsup run`, `agnsup serve` + `agnsup spawn`, and the Python API."""
import json
import os
import signal
import time

import pytest

from agnsup import locks
from agnsup.linux import cgroup
from scenario import STARTERS, alive, gone, growing, lines, stubborn_argv, tree_pids, wait_beats, wait_for


def _wt(tmp_path, name):
    d = tmp_path / name
    d.mkdir()
    return str(d)


def _run_cgroups(state, run_id):
    base = cgroup.base_node(cgroup.detect_layout(), state)
    return [p for p in cgroup.scope_node(base, run_id).paths.values() if os.path.exists(p)]


@pytest.mark.parametrize("how", ["run", "serve", "api"])
def test_cancel_of_an_agent_stops_its_trees_and_nothing_else_and_cancel_of_the_run_stops_the_rest(
        how, agnsup, tmp_path, state):
    starter = STARTERS[how](agnsup, tmp_path)
    try:
        wts = {c: _wt(tmp_path, c) for c in ("A1", "A2", "B1")}
        infos = {}
        for cell, agent in (("A1", "A"), ("A2", "A"), ("B1", "B")):
            infos[cell] = starter.start("R2", agent, cell, wts[cell], stubborn_argv(wts[cell], cell, term_wait=5))
        # LOCK_SCOPE: A1 and A2 (one agent, two worktrees) are up at the same time
        for info in infos.values():
            wait_beats(info["heartbeats"])
        assert all(growing(infos["A1"]["heartbeats"] + infos["A2"]["heartbeats"]).values())

        def free(cell):  # another agent's writer takes the cell's worktree at once (its own lock file, as a cell's)
            probe = os.path.join(state, "locks", locks.worktree_key(wts[cell], "probe", cell) + ".lock")
            fd = locks.try_acquire(probe, True, "probe", tree=wts[cell], agent="probe/p")
            if fd is not None:
                locks.release(probe, fd)
            return fd is not None
        assert not free("A1")  # held while A1 runs
        out = agnsup.json("cancel", "--run", "R2", "--agent", "A", "--grace", "0.5", "--json")
        assert out["cancelled"] == 2
        assert sorted(c["cell_id"] for c in out["cells"]) == ["A1", "A2"]
        assert all(c["state"] == "cancelled" and c["empty"] for c in out["cells"])
        for cell in ("A1", "A2"):
            assert gone(infos[cell]), f"{cell}: {[(p, alive(*p)) for p in tree_pids(infos[cell])]}"
            assert free(cell), f"{cell}'s worktree is still held"
            assert starter.exit_code("R2", cell) in (128 + signal.SIGTERM, 128 + signal.SIGKILL)
        # B1 untouched, the run still takes cells
        assert all(growing(infos["B1"]["heartbeats"]).values())
        agnsup("run", "--run-id", "R2", "--agent", "A", "--cell", "A3", "--workdir", wts["A1"], "--", "true", check=0)
        receipts = {r["cell_id"]: r for r in agnsup.json("receipts", "--run", "R2", "--json")}
        assert receipts["A1"]["state"] == "cancelled" and "agent A of run R2" in receipts["A1"]["cancel_reason"]

        again = agnsup.json("cancel", "--run", "R2", "--agent", "A", "--json")
        assert again["cancelled"] == 0 and again["cells"] == []
        assert all(growing(infos["B1"]["heartbeats"]).values())

        out = agnsup.json("cancel", "--run", "R2", "--grace", "0", "--json")
        assert [c["cell_id"] for c in out["cells"]] == ["B1"]
        assert gone(infos["B1"])
        assert starter.exit_code("R2", "B1") in (128 + signal.SIGTERM, 128 + signal.SIGKILL)
        assert agnsup.json("cancel", "--run", "R2", "--json")["cancelled"] == 0
        refused = agnsup("run", "--run-id", "R2", "--workdir", wts["B1"], "--", "true", check=125)
        assert "cancelled" in refused.err and refused.err.count("\n") == 1

        first = agnsup.json("cleanup", "--run", "R2", "--json")
        second = agnsup.json("cleanup", "--run", "R2", "--json")
        assert second["cleaned"] == 0 and second["items"] == [], (first, second)
        assert _run_cgroups(state, "R2") == []
        assert not os.path.exists(os.path.join(state, "cells", "R2", "A1", "tmp"))
    finally:
        starter.close()


def test_a_cell_with_processes_in_its_own_sub_cgroup_is_fully_cancelled_and_both_directories_go(
        agnsup, tmp_path, state):
    starter = STARTERS["run"](agnsup, tmp_path)
    try:
        wt = _wt(tmp_path, "S1")
        info = starter.start("R", "A", "S1", wt, stubborn_argv(wt, "S1"))
        wait_beats(info["heartbeats"])
        row = [c for c in agnsup.json("ps", "--json") if c["cell_id"] == "S1"][0]
        cell_dir = row["cgroup"]["v2"] if "v2" in row["cgroup"] else next(iter(row["cgroup"].values()))
        sub = os.path.join(cell_dir, "delegated")
        os.mkdir(sub)  # as a role delegating the subtree to the cell would allow
        with open(os.path.join(sub, "cgroup.procs"), "w") as f:
            f.write(str(info["grandchild"]["pid"]))
        assert info["grandchild"]["pid"] in cgroup.procs(sub)

        out = agnsup.json("cancel", "--cell", "S1", "--grace", "0", "--json")
        assert out["cancelled"] == 1
        assert gone(info)
        assert starter.exit_code("R", "S1") == 128 + signal.SIGKILL
        assert not os.path.exists(sub) and not os.path.exists(cell_dir)
    finally:
        starter.close()


def test_a_term_trap_runs_within_the_grace_period_then_the_tree_is_killed(agnsup, tmp_path):
    wt = _wt(tmp_path, "T1")
    trap_file = os.path.join(wt, "trap.txt")
    script = f'trap "echo trapped > {trap_file}; sleep 60" TERM; echo up; sleep 60 & wait'
    p = agnsup.popen("run", "--cell", "T1", "--workdir", wt, "--", "sh", "-c", script,
                     stdout=__import__("subprocess").PIPE)
    try:
        assert p.stdout.readline() == b"up\n"
        t0 = time.monotonic()
        out = agnsup.json("cancel", "--cell", "T1", "--grace", "2", "--json")
        took = time.monotonic() - t0
        assert out["cancelled"] == 1 and out["cells"][0]["state"] == "cancelled"
        with open(trap_file) as f:
            assert f.read() == "trapped\n"
        assert took >= 1.9, f"the kill came before the grace period ended ({took:.2f} s)"
        assert p.wait(30) == 128 + signal.SIGKILL  # the trap's sleep outlived the grace: killed
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        p.stdout.close()


def test_a_second_cell_on_a_held_worktree_waits_until_the_first_ends(agnsup, worktree, tmp_path):
    # the first cell holds the worktree until the test lets it go, after it saw the second one wait:
    # no fixed sleep to outlast the second controller's start-up (seconds on an emulated CPU)
    release = os.path.join(worktree, ".release")
    first = agnsup.popen("run", "--cell", "w1", "--workdir", worktree, "--timeout", "120", "--changes", "live", "--",
                         "sh", "-c", f"while [ ! -e {release} ]; do sleep 0.05; done")  # live: it sees .release
    errf = tmp_path / "w2.err"
    second = None
    try:
        wait_for(lambda: any(c["cell_id"] == "w1" and c["state"] == "running" for c in agnsup.json("ps", "--json")),
                 what="w1 running")
        with open(errf, "wb") as err:
            second = agnsup.popen("run", "--cell", "w2", "--agent", "other", "--workdir", worktree, "--", "true",
                                  stderr=err)
        wait_for(lambda: "waiting for the worktree" in errf.read_text() or second.poll() is not None,
                 what="w2 waiting for the worktree lock")
        assert second.poll() is None, f"w2 did not wait for the worktree w1 holds: {errf.read_text()}"
        assert "w1" in errf.read_text()
        open(release, "w").close()
        assert first.wait(60) == 0 and second.wait(60) == 0
    finally:
        open(release, "a").close()
        for p in (first, second):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    rec = {r["cell_id"]: r for r in agnsup.json("receipts", "--json")}
    assert rec["w2"]["started_at"] >= rec["w1"]["ended_at"], "two cells wrote one worktree at once"


def test_lock_timeout_gives_up_with_exit_75_and_one_clear_line(agnsup, worktree):
    first = agnsup.popen("run", "--cell", "h1", "--workdir", worktree, "--", "sleep", "30")
    try:
        wait_for(lambda: any(c["cell_id"] == "h1" and c["state"] == "running" for c in agnsup.json("ps", "--json")),
                 what="h1 running")
        t0 = time.monotonic()
        cp = agnsup("run", "--cell", "h2", "--agent", "other", "--lock-timeout", "1", "--workdir", worktree, "--", "true",
                    check=75)
        assert 0.9 <= time.monotonic() - t0 < 10
        last = cp.err.strip().splitlines()[-1]
        assert "lock" in last and "h1" in last and "1 s" in last
        assert "h2" not in [c["cell_id"] for c in agnsup.json("ps", "--all", "--json")]
    finally:
        agnsup("cancel", "--cell", "h1", "--grace", "0", check=0)
        assert first.wait(30) in (128 + signal.SIGTERM, 128 + signal.SIGKILL)


def test_cancel_names_what_it_cannot_find_and_refuses_an_ambiguous_cell_id(agnsup, worktree):
    agnsup("run", "--run-id", "R1", "--cell", "x", "--workdir", worktree, "--", "true", check=0)
    agnsup("run", "--run-id", "R3", "--cell", "x", "--workdir", worktree, "--", "true", check=0)
    for args, words in ((("--cell", "nope"), "no cell 'nope'"), (("--run", "nope"), "no run 'nope'"),
                        (("--run", "R1", "--agent", "nope"), "no agent 'nope'"),
                        (("--cell", "x"), "R1, R3")):
        cp = agnsup("cancel", *args, check=1)
        assert words in cp.err and cp.err.count("\n") == 1, cp.err
    assert agnsup.json("cancel", "--cell", "x", "--run", "R1", "--json")["cancelled"] == 0
    assert "--agent needs --run" in agnsup("cancel", "--agent", "a", check=125).err
    assert agnsup("cleanup", "--run", "nope", check=1).err.startswith("agnsup: no run")


def test_cleanup_refuses_to_touch_a_running_cell_and_says_so(agnsup, worktree):
    p = agnsup.popen("run", "--run-id", "RC", "--cell", "busy", "--workdir", worktree, "--", "sleep", "30")
    try:
        wait_for(lambda: any(c["cell_id"] == "busy" and c["state"] == "running" for c in agnsup.json("ps", "--json")),
                 what="busy running")
        cp = agnsup("cleanup", "--run", "RC", "--json", check=1)
        assert json.loads(cp.out)["running"] == ["busy"]
        assert "busy" in cp.err and "cancel" in cp.err
        assert any(c["cell_id"] == "busy" and c["state"] == "running" for c in agnsup.json("ps", "--json"))
    finally:
        agnsup("cancel", "--run", "RC", "--grace", "0", check=0)
        p.wait(30)


def test_cancel_all_is_a_kill_switch_for_every_live_cell_and_leaves_runs_open(agnsup, tmp_path):
    ps = []
    try:
        for i, run in enumerate(("K1", "K2")):
            wt = _wt(tmp_path, f"k{i}")
            ps.append(agnsup.popen("run", "--run-id", run, "--cell", f"k{i}", "--workdir", wt, "--", "sleep", "60"))
        wait_for(lambda: len(agnsup.json("ps", "--json")) == 2, what="two live cells")
        out = agnsup.json("cancel", "--all", "--grace", "0", "--json")
        assert out["cancelled"] == 2 and agnsup.json("ps", "--json") == []
        assert all(p.wait(30) in (128 + signal.SIGTERM, 128 + signal.SIGKILL) for p in ps)
        assert agnsup.json("cancel", "--all", "--json")["cancelled"] == 0
        agnsup("run", "--run-id", "K1", "--workdir", str(tmp_path / "k0"), "--", "true", check=0)
    finally:
        for p in ps:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.mark.parametrize("how", ["serve", "api"])
def test_through_serve_and_the_api_a_held_worktree_makes_a_cell_wait_or_time_out(how, agnsup, tmp_path, worktree):
    starter = STARTERS[how](agnsup, tmp_path)
    try:
        info = starter.start("R", "A", "L1", worktree, stubborn_argv(worktree, "L1"), role="executor")
        wait_beats(info["heartbeats"][:1])
        t0 = time.monotonic()
        # spawn returns at once with the cell queued; its lock timeout runs out in the background
        if how == "serve":
            cp = agnsup("spawn", "--cell", "L2", "--lock-timeout", "1", "--workdir", worktree, "--", "true", check=0)
            assert json.loads(cp.out)["state"] == "waiting"
            assert "waiting for the worktree" in cp.err and "L1" in cp.err.splitlines()[-1]
            w = agnsup("wait", "L2", "--json", check=75)
            assert json.loads(w.out)["reason"] == "LockTimeout"
        else:
            from agnsup.errors import LockTimeout
            h = starter.sup.spawn(["true"], cell_id="L2", lock_timeout=1, workdir=worktree, notify=lambda _: None)
            assert h["state"] == "waiting"
            with pytest.raises(LockTimeout, match="L1"):
                starter.sup.wait(h["run_id"], "L2")
        assert time.monotonic() - t0 >= 0.9
        # cancel through the same front door, then the worktree is free again
        if how == "serve":
            from agnsup.doors.serve import Client
            with Client(starter.ready["socket"]) as c:
                assert c.call("cancel", cell_id="L1", run_id="R", grace=0)["cancelled"] == 1
                assert c.call("run", argv=["true"], cell_id="L3", workdir=worktree, lock_timeout=1)["exit_code"] == 0
        else:
            assert starter.sup.cancel(cell_id="L1", run_id="R", grace=0)["cancelled"] == 1
            assert starter.sup.run(["true"], cell_id="L3", workdir=worktree, lock_timeout=1)["exit_code"] == 0
            starter.sup.cleanup("R")
            assert starter.sup.cleanup("R")["cleaned"] == 0
        assert not any(alive(*p) for p in tree_pids(info))  # executor: its ports were in the cell's own netns
        assert starter.exit_code("R", "L1") in (128 + signal.SIGTERM, 128 + signal.SIGKILL)
    finally:
        starter.close()


def test_a_term_trap_gets_its_grace_when_the_cell_runs_under_serve(agnsup, tmp_path, worktree):
    starter = STARTERS["serve"](agnsup, tmp_path)
    try:
        trap_file = os.path.join(worktree, "trap.txt")
        script = f'trap "echo trapped > {trap_file}; sleep 60" TERM; echo up; sleep 60 & wait'
        agnsup.json("spawn", "--cell", "T2", "--workdir", worktree, "--", "sh", "-c", script)
        out_file = os.path.join(agnsup.state, "cells", "default", "T2", "stdout")
        wait_for(lambda: lines(out_file) == 1, what="the trap set")
        t0 = time.monotonic()
        out = agnsup.json("cancel", "--cell", "T2", "--grace", "1.5", "--json")
        assert time.monotonic() - t0 >= 1.4 and out["cells"][0]["state"] == "cancelled"
        with open(trap_file) as f:
            assert f.read() == "trapped\n"
        assert starter.exit_code("default", "T2") == 128 + signal.SIGKILL
    finally:
        starter.close()


def test_without_cgroups_cancel_from_another_process_stops_the_whole_session_and_token_tree(state, tmp_path):
    from conftest import Agnsup
    agnsup = Agnsup(state, env={"AGNSUP_CGROUP_LAYOUT": "none"})
    starter = STARTERS["run"](agnsup, tmp_path)
    try:
        wt = _wt(tmp_path, "N1")
        info = starter.start("RN", "A", "N1", wt, stubborn_argv(wt, "N1") + ["--stripped-in-session"])
        wait_beats(info["heartbeats"])
        assert not agnsup.json("ps", "--json")[0]["cgroup"]  # {}: no hierarchy
        out = agnsup.json("cancel", "--run", "RN", "--agent", "A", "--grace", "0.5", "--json")
        assert out["cancelled"] == 1 and out["cells"][0]["empty"] and out["cells"][0]["state"] == "cancelled"
        assert "session" in out["cells"][0]["kill"]
        assert gone(info), [(p, alive(*p)) for p in tree_pids(info)]
        assert not any(growing(info["heartbeats"]).values())
        assert starter.exit_code("RN", "N1") in (128 + signal.SIGTERM, 128 + signal.SIGKILL)
    finally:
        starter.close()
