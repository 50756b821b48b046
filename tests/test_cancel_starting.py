"""A cancel that lands while a cell is starting, after its identity was journaled and
before its leader can be found, is not lost.

The race behind the intermittent tests/test_mcp.py failure (an MCP request given up on
right after its cell's spawn): a leader that is forked and joins its cgroups itself (a
Supervisor's before its fork server; now only where clone3(CLONE_INTO_CGROUP) is refused)
leaves its cgroup empty for a moment after its identity is committed. A cancel recorded then passes commit_identity's check
(already done), and its reaper finds nothing to stop; the leader then joins, is
released and runs its command with nobody left to cancel it.

Here the forked leader is held before it joins its cgroups until the canceller's
reaper pass is over: the interleaving that lost the cancel, made deterministic.
Real cells, cgroups and journal; only the child's arrival in its cgroup is delayed.
"""
import os
import threading
import time

import pytest

from agnsup import cancel as cancelmod
from agnsup.process import steps
from agnsup.supervisor import Supervisor
from scenario import wait_for

FORKED = "fork, cgroup.procs (v1: tasks) by the child"


class _ForkedHere:
    """A fork server's part (supervisor._Forker.spawn) played in this process: the leader forked, not born."""

    def __init__(self, worker):
        self.worker = worker

    def spawn(self, s, cgroup2):
        def fork():
            pid = os.fork()
            if pid == 0:
                steps.child(s)  # never returns
            return pid, os.pidfd_open(pid), False, None
        return self.worker.call(fork)


def test_a_cancel_between_identity_and_cgroup_join_stops_the_cell(state, worktree, tmp_path, monkeypatch):
    held, go = str(tmp_path / "held"), str(tmp_path / "go")
    monkeypatch.setattr(cancelmod, "CONCLUDE_TIMEOUT", 3.0)  # the lost cancel's wait: not the default 15 s
    reaped = threading.Event()
    conclude = cancelmod._conclude

    def after_the_reaper(state_, journal, keys):
        reaped.set()
        open(go, "w").close()  # the reaper found nothing: now the leader may join its cgroups
        return conclude(state_, journal, keys)
    monkeypatch.setattr(cancelmod, "_conclude", after_the_reaper)

    with Supervisor(state) as sup:
        attach = sup.ctl.backend.attach
        if sup.ctl.backend.kind == "none" or not sup.ctl.backend.trees:
            pytest.skip("ENV_BLOCKED: cgroup: no cell tree to join (the window is the cgroup join)")

        def late_attach(place, pid, born=False, **how):
            if pid == 0:  # in the forked leader (a copy of this process), before it joins its cgroups
                open(held, "w").close()
                deadline = time.monotonic() + 60
                while not os.path.exists(go) and time.monotonic() < deadline:
                    time.sleep(0.005)
            return attach(place, pid, born, **how)
        sup.ctl.backend.attach = late_attach
        # The window exists for a leader that is forked, not born in its cgroup (a host without clone3
        # CLONE_INTO_CGROUP; a Supervisor's fork server then forks): played here on the Supervisor's forker
        # thread, so that the leader is a copy of this process and late_attach holds it
        sup.ctl.forker = _ForkedHere(sup._forker.worker)

        spawned: list = []
        spawner = threading.Thread(target=lambda: spawned.append(
            sup.spawn(["sleep", "300"], run_id="r", cell_id="c-late", workdir=worktree)))
        spawner.start()
        # the identity is journaled (the leader is held before its cgroup join): cancel now
        wait_for(lambda: sup.ctl.journal.cell("r", "c-late") is not None
                 and sup.ctl.journal.cell("r", "c-late")["pid"] is not None, what="the identity commit")
        assert os.path.exists(held), "the leader was not forked (born in its cgroup): no window to test"
        cancelled: list = []
        canceller = threading.Thread(target=lambda: cancelled.append(sup.cancel(cell_id="c-late", run_id="r")))
        canceller.start()
        spawner.join(60)
        assert spawned and reaped.is_set()
        res = sup.wait("r", "c-late", 30)
        canceller.join(60)
        assert res is not None, "the cancelled cell still runs its command"
        receipt = sup.receipt("r", "c-late")
        assert res["state"] == "cancelled" and receipt["cancel_reason"].startswith("cancelled by cell c-late")
        assert receipt["isolation"]["cgroup_join"] == FORKED
        assert cancelled[0]["cancelled"] == 1
        assert not sup.list("r")
