"""`agnsup serve` and `agnsup spawn`: the socket, the protocol's errors, and a
SIGKILLed serve recovered by the janitor like any controller."""
import json
import os
import signal
import stat

from scenario import STARTERS, alive, gone, growing, stubborn_argv, tree_pids, wait_beats

from agnsup.doors.serve import Client


def test_serve_prints_the_ready_line_and_its_socket_is_private(agnsup, tmp_path, state):
    s = STARTERS["serve"](agnsup, tmp_path)
    try:
        r = s.ready
        assert r["ready"] is True and r["socket"] == os.path.join(state, "agnsup.sock")
        assert r["controller"].startswith("ctl-")
        st = os.stat(r["socket"])
        assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
        with Client(r["socket"]) as c:
            assert c.call("ping")["controller"] == r["controller"]
        second = agnsup("serve", check=125)
        assert "already listens" in second.err
    finally:
        s.close()
    assert s.server.returncode == 0 and not os.path.exists(r["socket"])


def test_spawn_returns_at_once_and_the_cell_runs_under_the_serve_controller(agnsup, tmp_path, worktree):
    s = STARTERS["serve"](agnsup, tmp_path)
    try:
        out = agnsup.json("spawn", "--cell", "s1", "--workdir", worktree, "--", "sh", "-c", "sleep 0.3; echo done")
        assert set(out) >= {"cell_id", "run_id", "agent_id", "pid", "cgroup"}
        assert s.exit_code("default", "s1") == 0
        with open(os.path.join(agnsup.state, "cells", "default", "s1", "stdout")) as f:
            assert f.read() == "done\n"
        row = agnsup.json("ps", "--all", "--json")[0]
        assert row["controller"] == s.ready["controller"]
        with Client(s.ready["socket"]) as c:
            res = c.call("run", argv=["sh", "-c", "exit 3"], workdir=worktree, cell_id="s2")
            assert res["exit_code"] == 3 and res["state"] == "exited"
    finally:
        s.close()


def test_spawn_errors_carry_run_exit_codes_and_one_line(agnsup, tmp_path, worktree):
    cp = agnsup("spawn", "--workdir", worktree, "--", "true", check=125)
    assert "no serve controller" in cp.err and cp.err.count("\n") == 1
    s = STARTERS["serve"](agnsup, tmp_path)
    try:
        assert "not found" in agnsup("spawn", "--workdir", worktree, "--", "no-such-cmd", check=127).err
        assert "unknown role 'nope'" in agnsup("spawn", "--role", "nope", "--workdir", worktree, "--", "true",
                                               check=125).err
        with Client(s.ready["socket"]) as c:
            for bad in ({"op": "spawn", "argv": "true"}, {"op": "warp"}, {"op": "spawn", "argv": ["true"], "x": 1}):
                c.file.write(json.dumps(bad).encode() + b"\n")
                c.file.flush()
                resp = json.loads(c.file.readline())
                assert resp["ok"] is False and resp["exit_code"] == 125 and resp["error"]
            c.file.write(b"not json\n")
            c.file.flush()
            assert json.loads(c.file.readline())["ok"] is False
            assert c.call("ping")["pid"] == s.server.pid  # the connection survived bad requests
    finally:
        s.close()


def test_a_sigkilled_serve_is_recovered_by_the_janitor(agnsup, tmp_path):
    s = STARTERS["serve"](agnsup, tmp_path)
    try:
        wt = tmp_path / "k1"
        wt.mkdir()
        info = s.start("R", "A", "k1", str(wt), stubborn_argv(str(wt), "k1"))
        wait_beats(info["heartbeats"])
        s.server.kill()
        assert s.server.wait(10) == -signal.SIGKILL
        assert all(growing(info["heartbeats"]).values()), "the tree did not survive the serve controller: invalid"
        rep = agnsup.json("janitor", "--json")
        assert rep["recovered"] == ["k1"] and rep["controllers"][0]["id"] == s.ready["controller"]
        assert gone(info), [(p, alive(*p)) for p in tree_pids(info)]
        assert agnsup.json("ps", "--all", "--json")[0]["state"] == "recovered"
    finally:
        s.close()


def test_sigterm_to_serve_cancels_its_running_cells_and_removes_the_socket(agnsup, tmp_path, worktree):
    s = STARTERS["serve"](agnsup, tmp_path)
    try:
        out = agnsup.json("spawn", "--cell", "long", "--workdir", worktree, "--", "sleep", "60")
        s.server.send_signal(signal.SIGTERM)
        assert s.server.wait(60) == 0
        assert not os.path.exists(s.ready["socket"])
        row = agnsup.json("ps", "--all", "--json")[0]
        assert row["cell_id"] == "long" and row["state"] == "cancelled" and row["pid"] == out["pid"]
        assert "shutting down" in agnsup.json("receipts", "--cell", "long", "--json")[0]["cancel_reason"]
    finally:
        s.close()


def _holder(agnsup, worktree, cell):
    """Spawn a cell that holds the worktree lock until the test writes a line into its FIFO."""
    gate = os.path.join(worktree, f"gate-{cell}")
    os.mkfifo(gate)
    out = agnsup.json("spawn", "--cell", cell, "--workdir", worktree, "--", "sh", "-c", f"read x < {gate}")
    assert out["state"] == "running" and out["pid"]
    return gate


def _release(gate):
    try:  # non-blocking: a holder that already died (with its controller) reads nothing
        fd = os.open(gate, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
        return
    os.write(fd, b"go\n")
    os.close(fd)


def test_spawn_queues_behind_a_held_worktree_lock_and_wait_gives_its_exit_status(agnsup, tmp_path, worktree):
    s = STARTERS["serve"](agnsup, tmp_path)
    try:
        gate = _holder(agnsup, worktree, "h1")
        cp = agnsup("spawn", "--cell", "q1", "--agent", "other", "--workdir", worktree, "--", "sh", "-c", "exit 7", check=0)
        out = json.loads(cp.out)
        assert (out["state"], out["pid"]) == ("waiting", None)
        assert "waiting for the worktree" in cp.err and "held by cell h1" in cp.err
        states = {r["cell_id"]: r["state"] for r in agnsup.json("ps", "--json")}
        assert states == {"h1": "running", "q1": "waiting"}
        pending = agnsup("wait", "q1", "--timeout", "0.2")
        assert pending.returncode == 75 and "still waiting" in pending.err
        _release(gate)
        done = agnsup("wait", "q1", "--json")
        assert done.returncode == 7 and json.loads(done.out)["state"] == "exited"
        agnsup("wait", "h1", check=0)
        assert agnsup("wait", "nope").returncode == 1
    finally:
        s.close()


def test_a_waiting_cell_can_be_cancelled_and_the_janitor_knows_it(agnsup, tmp_path, worktree):
    s = STARTERS["serve"](agnsup, tmp_path)
    try:
        gate = _holder(agnsup, worktree, "h2")
        assert agnsup.json("spawn", "--cell", "q2", "--agent", "other", "--workdir", worktree, "--", "true")["state"] == "waiting"
        res = agnsup.json("cancel", "--cell", "q2", "--json")
        assert res["cells"][0]["state"] == "cancelled"
        assert agnsup("wait", "q2").returncode != 0
        assert agnsup.json("spawn", "--cell", "q3", "--agent", "other", "--workdir", worktree, "--", "true")["state"] == "waiting"
    finally:
        s.server.send_signal(signal.SIGKILL)  # q3 is still queued: its controller dies with it
        s.server.wait()
        _release(gate)
    report = agnsup.json("janitor", "--json")
    assert "q3" in report["recovered"]
    assert agnsup.json("ps", "--all", "--json")[-1]["state"] != "waiting"
    s.close()
