"""A cell that `Supervisor.run` (and serve's `run`, `run_attached`) waits for is waited for and ended on the caller's
own thread (supervisor._here, issue 29's seventh round): no cell thread, no hand-off of its result. What must hold:
the cell is ended and recorded whatever interrupts its caller (a KeyboardInterrupt on the main thread in the wait
hands the cell over to a thread of its own; one during its end waits until the end is recorded), and what follows
the result still happens (on the Supervisor's `agnsup-after` thread).

Checked to fail: with the hand-over taken out of `_here`, the interrupted wait's cell is never concluded (its row stays
`running`); with `_signals_held` a null context, the end cut by the KeyboardInterrupt leaves its row `running`."""
import os
import signal
import threading
import time

import pytest

from agnsup.supervisor import Supervisor
from conftest import procs_with_env
from scenario import held_mount_namespaces, wait_for


def _cell_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("cell-")]


def test_run_waits_on_the_callers_thread_and_the_work_after_the_result_still_happens(state, worktree):
    seen: list = []
    with Supervisor(state) as sup:
        watch = threading.Timer(0.3, lambda: seen.append(_cell_threads()))
        watch.start()
        res = sup.run(["sh", "-c", "sleep 0.6; exit 5"], workdir=worktree, cell_id="here")
        watch.join()
        assert (res["state"], res["exit_code"]) == ("exited", 5), res
        assert seen == [[]]  # no cell thread while it ran
        assert sup.receipt(res["run_id"], "here")["exit_code"] == 5
        if os.geteuid() == 0:  # its mount namespace, held while it ran, let go after the result (agnsup-after)
            wait_for(lambda: not held_mount_namespaces(), 10, "the cell's mount namespace let go")


def _interrupt_main_once_running(cell: str) -> threading.Thread:
    """SIGINT to the main thread once the cell's command runs (its environment names the cell: exec'd), and a
    moment more for the caller to be in its wait: not after a fixed delay, which a slow host (the v2 guest's
    emulated CPUs) spends before the cell even started."""
    def interrupt():
        wait_for(lambda: procs_with_env("AGNSUP_CELL_ID", cell), 120, "the cell's command running")
        time.sleep(0.5)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
    t = threading.Thread(target=interrupt, daemon=True)
    t.start()
    return t


@pytest.fixture
def sigint_raises():
    """SIGINT raises KeyboardInterrupt in the main thread for the test, as in a plain interpreter: a pytest-xdist
    worker ignores SIGINT (its controller stops it), where no KeyboardInterrupt would ever come."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("the main thread's own case")
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


def test_a_keyboard_interrupt_in_the_wait_hands_the_cell_to_a_thread_that_ends_and_records_it(state, worktree,
                                                                                          sigint_raises):
    with Supervisor(state) as sup:
        t = _interrupt_main_once_running("cut")
        with pytest.raises(KeyboardInterrupt):
            sup.run(["sh", "-c", "sleep 3; exit 4"], workdir=worktree, cell_id="cut", run_id="R")
        t.join()
        assert _cell_threads() == ["cell-cut"]  # taken over
        res = sup.wait("R", "cut", 30)
        assert (res["state"], res["exit_code"]) == ("exited", 4), res
        assert sup.ctl.journal.cell("R", "cut")["state"] == "exited"


def test_a_keyboard_interrupt_during_the_cells_end_comes_after_the_end_is_recorded(state, worktree, sigint_raises):
    with Supervisor(state) as sup:
        finish = sup.ctl.finish

        def interrupted_finish(*a, **k):
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            time.sleep(0.05)  # the handler runs here, in the middle of the end, unless held
            return finish(*a, **k)
        sup.ctl.finish = interrupted_finish
        with pytest.raises(KeyboardInterrupt):
            sup.run(["sh", "-c", "exit 6"], workdir=worktree, cell_id="end", run_id="R")
        row = sup.ctl.journal.cell("R", "end")
        assert (row["state"], row["exit_code"]) == ("exited", 6), dict(row)
        assert sup.receipt("R", "end")["exit_code"] == 6
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # given back


def _zombie_children(ppid: int) -> list[int]:
    out = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open(f"/proc/{p}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == ppid and fields[0] == "Z":
                out.append(int(p))
    return out


def test_the_fork_server_reaps_every_init_whose_answer_the_end_no_longer_waits_for(state, worktree):
    """leader.collect leaves a reported init to the server (its answer unread): the server still reaps each one,
    and a killed cell (no report: its status is the init's, from the server) still ends `killed`."""
    with Supervisor(state) as sup:
        for i in range(4):
            res = sup.run(["sh", "-c", f"exit {i}"], workdir=worktree, cell_id=f"z{i}")
            assert res["exit_code"] == i, res
        server = sup._forker.server.pid
        wait_for(lambda: not _zombie_children(server), 10, "the fork server's children reaped")
        h = sup.spawn(["sleep", "30"], workdir=worktree, cell_id="killed")
        sup.signal(h["run_id"], "killed", "KILL")
        res = sup.wait(h["run_id"], "killed", 30)
        assert (res["state"], res["exit_code"]) == ("killed", 137), res
        wait_for(lambda: not _zombie_children(server), 10, "the fork server's children reaped")


def test_close_while_a_cell_ends_on_its_callers_thread_lets_go_of_everything_it_held(state, worktree):
    """Supervisor.close cancels a run() cell another thread waits for, and waits for that cell's work after the
    result (queued on agnsup-after by the caller's thread) before it ends: nothing of it is held after close. (A
    race without close's wait; not seen failing reliably.)"""
    sup = Supervisor(state)
    got: list = []
    t = threading.Thread(target=lambda: got.append(sup.run(["sleep", "30"], workdir=worktree, cell_id="c")))
    t.start()
    wait_for(lambda: any(k[1] == "c" for k in sup._cells), 10, "the cell running, supervised")
    sup.close(grace=0)
    t.join(30)
    assert got and got[0]["state"] == "cancelled", got
    if os.geteuid() == 0:
        assert held_mount_namespaces() == set()
    assert not any(t.name == "agnsup-after" for t in threading.enumerate())
