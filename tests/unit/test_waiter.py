"""The wait loop over the fake backend: a pipe stands in for the leader's pidfd (readable once the leader
has exited), the fake kernel for the cell's tree (reaper.Tree over FakeBackend). No root, no process."""
import os
import select
import signal

import pytest

from agnsup import reaper
from agnsup.process.wait import Outcome, Waiter

from fake_backend import FakeBackend, FakeKernel

CELL = "/fake/run-R/agent-A/cell-c1"
pytestmark = pytest.mark.timeout(20)  # a wait that never ends fails here, not after the suite's 300 s


class Cell:
    """One cell of the fake kernel; its leader (pid 10) writes the pipe when it dies, as a pidfd turns readable."""

    def __init__(self, **leader):
        self.k = FakeKernel()
        self.b = FakeBackend(self.k)
        place = self.b.create(self.b.place("R", "A", "c1", {}), {})
        self.leader = self.k.spawn(10, dir=CELL, **leader)
        self.fd, self._w = os.pipe()
        self.tree = _Tree(self, self.b, reaper.Target(run_id="R", cell_id="c1", place=place), self.fd)

    def exit(self) -> None:
        """The leader exits (by itself, or by a signal the fake kernel delivered)."""
        self.leader.alive = False
        if self._w is not None:
            os.write(self._w, b"x")
            os.close(self._w)
            self._w = None

    def waiter(self, grace: float = 60.0, timeout: float | None = None, **kw) -> Waiter:
        return Waiter(self.fd, self.tree, grace, timeout, **kw)


class _Tree(reaper.Tree):
    def __init__(self, cell: Cell, *a):
        super().__init__(*a)
        self.cell = cell

    def _notice(self) -> None:
        if not self.cell.leader.alive:
            self.cell.exit()

    def term(self, sig: int = signal.SIGTERM) -> None:
        super().term(sig)
        self._notice()

    def kill(self) -> str:
        method = super().kill()
        self._notice()
        return method


@pytest.fixture
def pipes():
    made = []

    def pipe():
        made.append(os.pipe())
        return made[-1]
    yield pipe
    for fds in made:
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass


def test_a_leader_that_exits_by_itself_ends_the_wait_with_no_reason_and_no_signal():
    c = Cell()
    c.exit()
    w = c.waiter().wait()
    assert w.reason is None and w.kill_method is None and w.grace_until() is None
    assert c.leader.signals == [] and c.b.kills == []


def test_a_timeout_sends_sigterm_and_a_tree_that_obeys_ends_without_a_kill():
    c = Cell()
    w = c.waiter(timeout=0.01).wait()
    assert w.reason == "timeout" and w.stop_signal == signal.SIGTERM and w.kill_method is None
    assert c.leader.signals == [signal.SIGTERM] and c.b.kills == []
    assert Outcome.of(w.reason, None, signal.SIGTERM).exit_code == 124


def test_a_tree_that_ignores_sigterm_is_killed_when_the_grace_period_ends():
    c = Cell(ignores_term=True)
    w = c.waiter(grace=0.01, timeout=0.01).wait()
    assert w.reason == "timeout" and w.kill_method == "fake.kill" and c.b.kills == [CELL]
    assert c.leader.signals == [signal.SIGTERM, signal.SIGKILL]


def test_the_first_stop_reason_wins_and_the_tree_is_signalled_once():
    c = Cell(ignores_term=True)
    w = c.waiter(grace=60.0)
    w.request_stop("cancelled", "agnsup cancel by test")
    until = w.grace_until()
    w.request_stop("timeout", sig=signal.SIGINT)
    w.stop_now("output_limit")  # a limit broken meanwhile: the kill comes now, the reason stays
    assert w.wait() is w
    assert (w.reason, w.cancel_reason, w.stop_signal) == ("cancelled", "agnsup cancel by test", signal.SIGTERM)
    assert w.grace_until() == until and w.kill_method == "fake.kill"
    assert c.leader.signals == [signal.SIGTERM, signal.SIGKILL]


def test_a_cancel_by_sigint_is_remembered_as_the_stop_signal_of_the_outcome():
    c = Cell()
    w = c.waiter()
    w.request_stop("cancelled", "Ctrl-C", sig=signal.SIGINT)  # the fake leader survives SIGINT ...
    c.exit()  # ... and exits by itself
    w.wait()
    assert c.leader.signals == [signal.SIGINT] and w.kill_method is None
    out = Outcome.of(w.reason, 0, None, stop_signal=w.stop_signal, cancel_reason=w.cancel_reason)
    assert (out.exit_code, out.state, out.cancel_reason) == (128 + signal.SIGINT, "cancelled", "Ctrl-C")


def test_a_broken_output_cap_kills_the_tree_at_once_without_a_grace_period(pipes):
    r, w_ = pipes()

    class Pump:
        overflowed = False

        def interest(self):
            return {r: select.POLLIN}

        def handle(self, fd, mask):
            self.overflowed = len(os.read(fd, 10)) > 4  # past a cap of 4 bytes

    c = Cell(ignores_term=True)
    os.write(w_, b"too much")
    w = c.waiter(grace=60.0, pump=Pump()).wait()
    assert w.reason == "output_limit" and w.kill_method == "fake.kill" and w.grace_until() is None
    assert c.leader.signals == [signal.SIGKILL]


def test_the_pump_is_handed_the_events_of_the_fds_it_asks_for(pipes):
    c = Cell()
    r, w_ = pipes()
    got = []

    class Pump:
        overflowed = False

        def interest(self):
            return {} if got else {r: select.POLLIN}

        def handle(self, fd, mask):
            got.append((fd, mask, os.read(fd, 10)))
            c.exit()

    os.write(w_, b"out")
    w = c.waiter(pump=Pump()).wait()
    assert got == [(r, select.POLLIN, b"out")] and w.reason is None


def test_a_readable_wake_fd_calls_poll_wake(pipes):
    c = Cell()
    r, w_ = pipes()
    woken = []

    def poll_wake():
        woken.append(os.read(r, 10))
        c.exit()

    os.write(w_, b"stop?")
    w = c.waiter(wake_fd=r).wait(poll_wake)
    assert woken == [b"stop?"] and w.reason is None and c.leader.signals == []


def test_a_v1_oom_event_kills_the_rest_once_the_oom_killer_has_taken_its_victim(pipes):
    c = Cell(ignores_term=True)
    r, w_ = pipes()
    os.set_blocking(r, False)
    c.b.oom_kills = lambda place: 1  # the kernel's counter moved: its victim is taken
    os.write(w_, (1).to_bytes(8, "little"))  # the eventfd's counter
    w = c.waiter(oom_fd=r).wait()
    assert w.reason == "oom" and w.kill_method == "fake.kill" and c.leader.signals == [signal.SIGKILL]


def test_a_cell_that_never_ran_fails_with_its_error_class_and_a_cancelled_one_as_cancelled():
    from agnsup.errors import CancelledBeforeStart, NotFound
    assert (Outcome.failed(NotFound("x")).reason, Outcome.failed(NotFound("x")).state) == ("NotFound", "failed")
    out = Outcome.failed(CancelledBeforeStart("x"), "by test")
    assert (out.reason, out.state, out.cancel_reason) == ("cancelled", "cancelled", "by test")
