"""Servers beside later calls (issue 28): a long cell an agent spawned (a dev server) does not hold up
that agent's later calls in its worktree; another agent's call waits for the worktree lock no longer
than its timeout and gets an error naming the holder (agent, cell, run), through every door."""
import json
import os
import subprocess
import sys

import pytest

from agnsup.errors import LockTimeout
from agnsup.supervisor import Supervisor

BIN = os.path.join(os.path.dirname(sys.executable), "agnsup")
LONG = ["sleep", "300"]  # the server: it never ends by itself within a test


def test_an_agents_later_run_beside_its_spawned_server_finishes_and_another_agents_gives_up_at_its_timeout(
        state, worktree):
    with Supervisor(state) as sup:
        srv = sup.spawn(LONG, run_id="R", agent_id="A", cell_id="srv", workdir=worktree)
        assert srv["state"] == "running"
        h = sup.spawn(["sh", "-c", "echo beside"], run_id="R", agent_id="A", cell_id="curl", workdir=worktree,
                      capture=True)
        assert h["state"] == "running"  # not queued behind its own agent's server
        res = sup.wait("R", "curl", timeout=60)
        assert res is not None and (res["state"], res["exit_code"], res["stdout"]) == ("exited", 0, "beside\n")

        heard = []
        b = sup.spawn(["true"], run_id="R", agent_id="B", cell_id="b1", workdir=worktree, timeout=2,
                      notify=heard.append)
        assert (b["state"], b["pid"]) == ("waiting", None)
        assert heard and "held by cell srv of run R, agent A" in heard[0]
        with pytest.raises(LockTimeout) as e:
            sup.wait("R", "b1", timeout=60)  # a wait that does not end raises nothing: the assertion below fails
        assert "held by cell srv of run R, agent A" in e.value.message and "gave up after 2 s" in e.value.message
        assert "timeout" in e.value.message and e.value.details["waited"] >= 2
        assert sup.wait("R", "srv", timeout=0) is None  # the server still runs: B gave up before it ended
        sup.cancel(cell_id="srv", run_id="R", grace=0)
        assert sup.wait("R", "srv", timeout=60)["state"] == "cancelled"


def test_the_cli_gives_up_at_the_calls_timeout_in_one_line_with_exit_75_and_the_same_agent_runs(agnsup, worktree):
    server = agnsup.popen("run", "--run-id", "R", "--agent", "A", "--cell", "srv", "--workdir", worktree, "--",
                          "sh", "-c", "echo up; exec sleep 300", stdout=subprocess.PIPE)
    try:
        assert server.stdout.readline() == b"up\n"
        cp = agnsup("run", "--run-id", "R", "--agent", "A", "--workdir", worktree, "--", "echo", "beside", check=0)
        assert cp.out == "beside\n" and "waiting" not in cp.err
        cp = agnsup("run", "--run-id", "R", "--agent", "B", "--cell", "b1", "--timeout", "2", "--workdir", worktree,
                    "--", "true", check=75)
        last = cp.err.strip().splitlines()
        assert len(last) == 2 and last[0].startswith("agnsup: waiting for the worktree"), cp.err
        assert last[1].startswith("agnsup: ") and "held by cell srv of run R, agent A" in last[1]
        assert "gave up after 2 s" in last[1] and "timeout" in last[1]
        assert server.poll() is None  # it gave up while the server still ran
        assert "b1" not in [c["cell_id"] for c in agnsup.json("ps", "--all", "--json")]
    finally:
        agnsup("cancel", "--run", "R", "--grace", "0", check=0)
        server.wait(30)
        server.stdout.close()


def test_mcp_says_a_queued_call_waits_for_the_lock_and_its_timeout_ends_the_wait_with_the_holder(state, worktree):
    anyio = pytest.importorskip("anyio")
    from test_mcp import cells, session, value

    async def main():
        async with session(state, worktree, "--run-id", "R", "--agent-id", "A") as a, \
                session(state, worktree, "--run-id", "R", "--agent-id", "B") as b:
            srv = value(await a.call_tool("spawn", {"argv": LONG}))
            assert srv["state"] == "running"
            with anyio.fail_after(60):
                v = value(await a.call_tool("run_process", {"argv": ["echo", "beside"], "timeout": 5}))
            assert (v["exit_code"], v["stdout"]) == (0, "beside\n")

            notes = []

            async def on_progress(done, total, message):
                notes.append(message)
            with anyio.fail_after(60):
                res = await b.call_tool("run_process", {"argv": ["true"], "timeout": 2}, progress_callback=on_progress)
            v = value(res)
            assert res.is_error and (v["error_type"], v["exit_code"]) == ("LockTimeout", 75)
            assert f"held by cell {srv['cell_id']} of run R, agent A" in v["error"] and "gave up after 2 s" in v["error"]
            assert v["holder"] == f"cell {srv['cell_id']} of run R, agent A" and v["waited"] >= 2
            assert not any("pid None" in n or "running for" in n for n in notes), notes
            assert any(f"held by cell {srv['cell_id']}" in n for n in notes), notes
            assert [c["state"] for c in await cells(a)] == ["running"]  # the server outlived B's wait
            await a.call_tool("cancel", {"cell_id": srv["cell_id"], "grace": 0})
    anyio.run(main)
    assert json.loads(subprocess.run([BIN, "--state-dir", state, "ps", "--json"], capture_output=True,
                                     check=True).stdout) == []


def test_serve_queues_another_agents_spawn_and_its_timeout_fails_it_with_the_holder_named(agnsup, tmp_path, worktree):
    from scenario import STARTERS
    s = STARTERS["serve"](agnsup, tmp_path)
    try:
        srv = agnsup.json("spawn", "--run-id", "R", "--agent", "A", "--cell", "srv", "--workdir", worktree, "--",
                          *LONG)
        assert srv["state"] == "running"
        mine = agnsup.json("spawn", "--run-id", "R", "--agent", "A", "--cell", "a2", "--workdir", worktree, "--",
                           "true")
        assert mine["state"] == "running"  # its own agent's server is not in its way
        cp = agnsup("spawn", "--run-id", "R", "--agent", "B", "--cell", "b1", "--timeout", "2", "--workdir",
                    worktree, "--", "true", check=0)
        assert json.loads(cp.out)["state"] == "waiting" and "held by cell srv of run R, agent A" in cp.err
        done = agnsup("wait", "b1", "--run", "R", "--timeout", "60")
        assert done.returncode == 75, (done.out, done.err)
        (rec,) = agnsup.json("receipts", "--run", "R", "--cell", "b1", "--json")
        assert rec["state"] == "failed" and "\n" not in rec["error"]
        assert "held by cell srv of run R, agent A" in rec["error"] and "gave up after 2 s" in rec["error"]
        assert "timeout" in rec["error"]
        assert [c["cell_id"] for c in agnsup.json("ps", "--json")] == ["srv"]  # the server outlived B's wait
    finally:
        agnsup("cancel", "--run", "R", "--grace", "0", check=0)
        s.close()


def test_a_signal_to_agnsup_run_waiting_for_another_agents_lock_ends_it_at_once(agnsup, worktree, tmp_path):
    import signal
    server = agnsup.popen("run", "--run-id", "R", "--agent", "A", "--cell", "srv", "--workdir", worktree, "--",
                          "sh", "-c", "echo up; exec sleep 300", stdout=subprocess.PIPE)
    errf = tmp_path / "b.err"
    try:
        assert server.stdout.readline() == b"up\n"
        with open(errf, "wb") as err:
            waiting = agnsup.popen("run", "--run-id", "R", "--agent", "B", "--cell", "b1", "--workdir", worktree,
                                   "--", "true", stderr=err)
        from scenario import wait_for
        wait_for(lambda: "waiting for the worktree" in errf.read_text(), what="b1 waiting for the lock")
        waiting.send_signal(signal.SIGINT)
        assert waiting.wait(30) == 143  # CancelledBeforeStart (was: the signal waited for the lock, 300 s)
        last = errf.read_text().strip().splitlines()[-1]
        assert "cell b1 cancelled by signal SIGINT" in last and "never started" in last
        assert server.poll() is None
        assert "b1" not in [c["cell_id"] for c in agnsup.json("ps", "--all", "--json")]
    finally:
        agnsup("cancel", "--run", "R", "--grace", "0", check=0)
        server.wait(30)
        server.stdout.close()


def test_two_capturing_cells_of_one_agent_write_one_worktree_at_once_and_both_land_and_undo(state, worktree):
    """Side by side, each over its own overlay: both commit (one at a time), each its own record."""
    with Supervisor(state) as sup:
        for c in ("w1", "w2"):
            h = sup.spawn(["sh", "-c", f"echo {c} > shared; echo {c} > own-{c}"], run_id="R", agent_id="A",
                          cell_id=c, workdir=worktree)
            assert h["state"] == "running"
        res = {c: sup.wait("R", c, timeout=60) for c in ("w1", "w2")}
        assert all(r is not None and r["exit_code"] == 0 and r["changes"]["files"] == 2 for r in res.values()), res
        with open(os.path.join(worktree, "shared")) as f:
            assert f.read() in ("w1\n", "w2\n")
        assert {n for n in os.listdir(worktree) if n.startswith("own-")} == {"own-w1", "own-w2"}
        out = sup.undo(run_id="R", agent_id="A")
        assert len(out["undone"]) == 2
        assert not [n for n in os.listdir(worktree) if n in ("shared", "own-w1", "own-w2")]


def test_calls_that_name_no_run_are_each_an_agent_of_their_own_and_keep_out_of_each_others_worktree(agnsup, worktree):
    """Two terminals' `agnsup run -- make` in one project (no --run): unrelated commands, as before issue 28; the
    run "default" names no lasting agent (CellSpec.named_run), so its cells still exclude each other."""
    first = agnsup.popen("run", "--cell", "d1", "--workdir", worktree, "--", "sh", "-c", "echo up; exec sleep 300",
                         stdout=subprocess.PIPE)
    try:
        assert first.stdout.readline() == b"up\n"
        cp = agnsup("run", "--cell", "d2", "--timeout", "2", "--workdir", worktree, "--", "true", check=75)
        assert "held by cell d1 of run default" in cp.err, cp.err
    finally:
        agnsup("cancel", "--cell", "d1", "--grace", "0", check=0)
        first.wait(30)
        first.stdout.close()
