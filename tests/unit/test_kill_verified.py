"""Every kill is verified, over the fake backend: kill_place (the one kill-and-verify of a whole tree:
the reaper's kill switch without a journal, the purge of a private cgroup root) and the reaper's wait
for each process it killed on evidence."""
import signal

import pytest

from agnsup import reaper
from agnsup.backend.base import Place

from fake_backend import FakeBackend, FakeKernel

CELL = "/fake/run-R/agent-A/cell-c1"


@pytest.fixture
def k():
    return FakeKernel()


def test_a_tree_gets_sigterm_then_the_kill_and_is_verified_empty(k):
    b = FakeBackend(k)
    k.spawn(10, dir=CELL)
    k.spawn(11, dir=CELL, ignores_term=True)
    assert b.kill_place(b.scope("R"), 0.0) == ("fake.kill", True)
    assert k.procs[10].signals == [signal.SIGTERM] and k.procs[11].signals == [signal.SIGTERM, signal.SIGKILL]


def test_a_tree_that_ends_at_sigterm_gets_no_kill(k):
    b = FakeBackend(k)
    k.spawn(10, dir=CELL)
    assert b.kill_place(b.scope("R"), 5.0) == (None, True) and b.kills == []


def test_a_tree_that_survives_its_kill_is_not_called_empty(k):
    b = FakeBackend(k)
    k.spawn(10, dir=CELL, unkillable=True)
    assert b.kill_place(b.scope("R")) == ("fake.kill", False)
    assert k.procs[10].signals == [signal.SIGKILL]  # no grace given: no SIGTERM


def test_the_kill_switch_says_when_the_state_roots_tree_survived(k):
    b = FakeBackend(k)
    b.root = lambda: b.scope("R")
    k.spawn(10, dir=CELL, ignores_term=True)
    k.spawn(11, dir=CELL, unkillable=True)
    assert reaper.kill_root(b, 0.0) == {"processes": 2, "kill": "fake.kill", "empty": False, "note": ""}
    k.procs[11].unkillable = False
    k.procs[11].alive = False
    assert reaper.kill_root(b, 0.0) == {"processes": 0, "kill": None, "empty": True, "note": ""}


def test_a_process_that_survives_its_kill_on_evidence_is_not_verified_dead(k, monkeypatch):
    monkeypatch.setattr(reaper, "VERIFY_TIMEOUT", 0.01)
    monkeypatch.setattr(reaper, "KILL_ROUNDS", 2)
    b = FakeBackend(k, trees=False)
    k.spawn(50, start=100, token="tok")                      # the leader
    k.spawn(51, start=110, sid=50, unkillable=True)          # in the cell's session
    t = reaper.Target(run_id="R", cell_id="c1", place=Place(), token="tok", since=100,
                      leader={"pid": 50, "pidfd_ino": None, "starttime": 100})
    (r,) = reaper.stop(b, [t], exclude=(50,))
    assert not r.empty and "process 51 of cell c1 still alive after the kill" in r.error
    assert r.killed and not any(x["verified_dead"] for x in r.killed)
