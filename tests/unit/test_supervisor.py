"""supervisor.Supervisor, the long-lived controller an agent runtime embeds, over the fake backend and a fake
process layer (fake_backend.FakeProcesses), with a real journal, real locks and the real Waiter, pump
and forker thread: spawn, wait, list, cancel, signal, live I/O, close. No root, no cell process: a
cell's leader is a FakeProc whose pidfd is a pipe that ends with it, holding copies of its stdio."""
import fcntl
import os
import struct
import termios
import threading

import pytest

from agnsup.errors import CancelledBeforeStart, UnknownId, UsageError, WaitTimeout
from agnsup.supervisor import Supervisor, wait_cell

from fake_backend import FakeHost

WAIT = 30  # seconds a test waits for a cell it ended (never reached when it passes)


class World(FakeHost):
    def __init__(self, tmp_path, monkeypatch):
        super().__init__(tmp_path, monkeypatch)
        self.sup = Supervisor(self.state_dir, backend=self.backend)

    def spawn(self, cell_id="c1", agent_id="A", **options) -> dict:
        return self.sup.spawn(["true"], workdir=self.wt, run_id="R", agent_id=agent_id, cell_id=cell_id, **options)

    def leader(self, h: dict):
        return self.k.procs[h["pid"]]


@pytest.fixture
def w(tmp_path, monkeypatch):
    world = World(tmp_path, monkeypatch)
    yield world
    world.sup.close(grace=0.0)


def test_spawn_returns_at_once_and_wait_gives_the_result_once_the_leader_ended(w):
    h = w.spawn(capture=True)
    assert h == {"cell_id": "c1", "run_id": "R", "agent_id": "A", "pid": h["pid"], "controller": w.sup.controller_id,
                 "cgroup": "/fake/run-R/agent-A/cell-c1", "state": "running"}
    assert w.leader(h).alive and w.sup.wait("R", "c1", timeout=0) is None
    assert w.sup.receipt("R", "c1") is None  # it runs: no receipt yet
    w.leader(h).exit(4)
    res = w.sup.wait("R", "c1", timeout=WAIT)
    assert (res["state"], res["exit_code"], res["stdout"]) == ("exited", 4, "")
    assert w.sup.receipt("R", "c1")["exit_code"] == 4
    assert not w.sup._cells  # an ended cell leaves memory (issue 12 item 17)
    again = w.sup.wait("R", "c1")  # so the journal answers: the same
    assert {k: again[k] for k in ("state", "exit_code", "receipt")} == \
        {k: res[k] for k in ("state", "exit_code", "receipt")}


def test_the_fork_server_is_started_from_the_supervisors_own_thread(tmp_path, monkeypatch):
    """PR_SET_PDEATHSIG fires when the thread that forked a process ends: the fork server's (every cell's leader
    is its child, process/forkserver.py) is the Supervisor's own thread, never a request's."""
    from agnsup.process import forkserver
    started_in = []
    monkeypatch.setattr(forkserver.Client, "start", lambda self: started_in.append(threading.current_thread().name))
    world = World(tmp_path, monkeypatch)
    try:
        world.sup._forker.worker.call(lambda: None)  # the start queued at its creation has run
        assert started_in == ["agnsup-forker"]
    finally:
        world.sup.close(grace=0.0)


def test_list_shows_live_cells_without_their_token_and_ended_ones_on_request(w):
    h = w.spawn(capture=True)
    (row,) = w.sup.list()
    assert (row["cell_id"], row["state"], row["argv"], row["controller"]) == ("c1", "running", ["true"],
                                                                              w.sup.controller_id)
    assert row["cgroup"] == {"v2": "/fake/run-R/agent-A/cell-c1"} and "token" not in row
    w.leader(h).exit(0)
    w.sup.wait("R", "c1", timeout=WAIT)
    assert w.sup.list() == [] and [r["state"] for r in w.sup.list("R", include_ended=True)] == ["exited"]


def test_cancel_stops_the_cells_tree_and_the_cell_ends_cancelled(w):
    h = w.spawn(capture=True)
    out = w.sup.cancel(cell_id="c1", grace=0.0)
    assert out["cancelled"] == 1 and not w.leader(h).alive and w.leader(h).signals[0] == 15
    res = w.sup.wait("R", "c1", timeout=WAIT)
    assert (res["state"], res["exit_code"], res["reason"]) == ("cancelled", 143, "cancelled")
    assert w.sup.receipt("R", "c1")["cancel_reason"].startswith(f"cancelled by cell c1 of run R (supervisor "
                                                                 f"{w.sup.controller_id}")


def test_kill_stops_the_whole_tree_at_once_and_is_journaled(w):
    h = w.spawn(capture=True)
    w.k.spawn(9001, dir=h["cgroup"], ignores_term=True)  # a daemon of its own session: still in the tree
    w.sup.signal("R", "c1", "KILL")
    res = w.sup.wait("R", "c1", timeout=WAIT)
    assert (res["state"], res["exit_code"], res["reason"]) == ("killed", 137, "killed")
    assert not w.k.procs[9001].alive and w.backend.kills[0] == h["cgroup"]
    assert "signal" in [e["kind"] for e in w.sup.ctl.journal.events("R", "c1")]


def test_bad_requests_are_refused_before_anything_is_created(w):
    with pytest.raises(UsageError):
        w.spawn(timeout="soon")
    with pytest.raises(UnknownId):
        w.sup.wait("R", "nope")
    with pytest.raises(UnknownId):
        w.sup.receipt("R", "nope")
    assert w.procs.calls == [] and w.sup.list("R", include_ended=True) == []
    h = w.spawn(capture=True)
    with pytest.raises(UsageError, match="sig: must be one of INT, TERM, KILL"):
        w.sup.signal("R", "c1", "HUP")
    with pytest.raises(UsageError, match="not spawned with stdin"):
        w.sup.write_stdin("R", "c1", b"x")
    with pytest.raises(UsageError, match="no terminal"):
        w.sup.resize("R", "c1", 80, 24)
    with pytest.raises(UsageError, match="not spawned with stream or pty"):
        w.sup.read_output("R", "c1")
    with pytest.raises(UsageError, match="since"):
        w.sup.read_output("R", "c1", since=-1)
    w.leader(h).exit(0)
    w.sup.wait("R", "c1", timeout=WAIT)


def test_a_cell_in_a_held_worktree_is_queued_and_starts_once_the_lock_is_free(w):
    first = w.spawn("c1", capture=True)
    heard = []
    w.procs.on_release = lambda child: w.k.procs[child.pid].exit(0)  # the queued one ends as it starts
    h = w.spawn("c2", agent_id="B", capture=True, notify=heard.append)
    assert (h["state"], h["pid"]) == ("waiting", None)
    assert len(heard) == 1 and "is waiting for the worktree" in heard[0] and "cell c1 of run R" in heard[0]
    assert w.sup.wait("R", "c2", timeout=0) is None
    w.leader(first).exit(0)
    assert w.sup.wait("R", "c2", timeout=WAIT)["state"] == "exited"


def test_a_signal_to_a_queued_cell_cancels_it_and_it_never_starts(w):
    first = w.spawn("c1", capture=True)
    w.spawn("c2", agent_id="B", capture=True, lock_timeout=WAIT, notify=lambda line: None)
    w.sup.signal("R", "c2", "INT")
    with pytest.raises(CancelledBeforeStart):
        w.sup.wait("R", "c2", timeout=WAIT)
    assert [c for c, _ in w.procs.calls].count("spawn") == 1 and w.sup.ctl.journal.cell_state("R", "c2") == "cancelled"
    w.leader(first).exit(0)
    w.sup.wait("R", "c1", timeout=WAIT)


def test_wait_cell_from_any_process_reads_the_result_from_the_journal(w):
    h = w.spawn(capture=True)
    with pytest.raises(WaitTimeout, match="c1 of run R is still running"):
        wait_cell(w.sup.state.path, "c1", timeout=0)
    w.leader(h).exit(2)
    w.sup.wait("R", "c1", timeout=WAIT)
    res = wait_cell(w.sup.state.path, "c1")
    assert (res["run_id"], res["state"], res["exit_code"], res["stdout"]) == ("R", "exited", 2, "")
    with pytest.raises(UnknownId):
        wait_cell(w.sup.state.path, "nope")


def test_live_io_stdin_reaches_the_cell_and_its_output_is_read_back_in_order(w):
    h = w.spawn(stdin=True, stream=True)
    w.sup.write_stdin("R", "c1", b"question\n")
    cell_in, cell_out = w.leader(h).stdio[0], w.leader(h).stdio[1]
    assert os.read(cell_in, 100) == b"question\n"
    os.write(cell_out, b"answer\n")
    got = w.sup.read_output("R", "c1", since=0, timeout=WAIT)
    assert [(c["seq"], c["stream"], c["data"]) for c in got["chunks"]] == [(0, "stdout", b"answer\n")]
    w.sup.write_stdin("R", "c1", b"", eof=True)
    assert os.read(cell_in, 100) == b""  # EOF
    w.leader(h).exit(0)
    res = w.sup.wait("R", "c1", timeout=WAIT)
    assert res["stdout"] == "answer\n"
    end = w.sup.read_output("R", "c1", since=got["next"], timeout=WAIT)
    assert end["chunks"] == [] and end["ended"]


def test_resize_sets_the_size_of_a_pty_cells_terminal(w):
    h = w.spawn(pty={"cols": 100, "rows": 30})
    slave = w.leader(h).stdio[0]
    assert struct.unpack("HHHH", fcntl.ioctl(slave, termios.TIOCGWINSZ, b"\0" * 8))[:2] == (30, 100)
    w.sup.resize("R", "c1", 132, 43)
    assert struct.unpack("HHHH", fcntl.ioctl(slave, termios.TIOCGWINSZ, b"\0" * 8))[:2] == (43, 132)
    with pytest.raises(UsageError, match="cols and rows"):
        w.sup.resize("R", "c1", 0, 43)
    w.leader(h).exit(0)
    w.sup.wait("R", "c1", timeout=WAIT)


def test_close_cancels_what_still_runs_waits_for_its_receipt_and_refuses_more(w):
    h = w.spawn(capture=True)
    w.sup.close(grace=0.0)
    assert not w.leader(h).alive
    j = w.sup.state.journal()  # the supervisor's own closed with it
    try:
        assert j.cell_state("R", "c1") == "cancelled"
        assert j.controller(w.sup.controller_id)["ended_at"] is not None
    finally:
        j.close()
    with pytest.raises(UnknownId, match="closed"):
        w.spawn("c2")
    w.sup.close()  # twice: nothing more
