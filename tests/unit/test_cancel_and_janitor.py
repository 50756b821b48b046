"""Cancel's and the janitor's decisions over the fake backend and a real journal file:
what they touch, what they spare and why, what they record."""
import json
import os
import signal
import time

import pytest

from agnsup import cancel, janitor, locks
from agnsup.linux import proc
from agnsup.store.state import StateRoot

from fake_backend import FakeBackend, FakeKernel


@pytest.fixture
def world(tmp_path):
    state = StateRoot(str(tmp_path / "state")).ensure()
    j = state.journal()
    k = FakeKernel()
    yield state, j, k, FakeBackend(k)
    j.close()


def controller(state, j, cid, alive: bool, boot=None):
    lock = state.controller_lock(cid)
    fd = locks.acquire(lock, True, 0, "controller", cid) if alive else None
    j.register_controller({"id": cid, "kind": "run", "pid": 1, "pidfd_ino": None, "starttime": 1,
                           "boot_id": boot or proc.boot_id(), "lock_path": lock, "started_at": time.time()})
    return fd


def cell(j, b, k, cid, cell_id, run="R", agent="A", pid=None, boot=None, token="tok", dies=""):
    place = b.create(b.place(run, agent, cell_id, {}), {})
    j.begin_cell({"run_id": run, "cell_id": cell_id, "agent_id": agent, "role": "executor", "token": token,
                  "controller_id": cid, "boot_id": boot or proc.boot_id(), "cgroup": json.dumps(place.paths()),
                  "tmpdir": None, "worktree": "/w", "lock_path": None, "argv": '["x"]', "exe": "/x",
                  "created_at": time.time(), "grace": 0.0, "on_controller_death": "kill" if dies else "keep",
                  "dies_with_controller": dies}, [])
    j.stage(run, cell_id, {"stage": "backend"}, cgroup_ino=place.inode)
    if pid:
        k.spawn(pid, start=100, dir=place.dir, token=token)
        j.commit_identity(run, cell_id, {"pid": pid, "pidfd_ino": None, "starttime": 100, "pgid": pid,
                                         "started_at": time.time()}, {"stage": "process_supervisor"})
        j.mark_running(run, cell_id)
    return place


def test_cancelling_an_agent_records_the_first_reason_and_kills_its_directory_once(world, monkeypatch):
    state, j, k, b = world
    monkeypatch.setattr(cancel, "CONCLUDE_TIMEOUT", 0.1)
    controller(state, j, "ctl-live", alive=True)
    cell(j, b, k, "ctl-live", "c1", pid=10)
    cell(j, b, k, "ctl-live", "c2", pid=20)
    k.procs[10].ignores_term = True
    out = cancel.cancel(state, cancel.Scope("agent", "R", "A"), grace=0.0, by="test", backend=b)
    assert out["cancelled"] == 2 and b.kills == ["/fake/run-R/agent-A"]
    c1, c2 = out["cells"]
    assert c1["empty"] and c1["kill"] == "fake.kill on /fake/run-R/agent-A"
    assert c2["empty"] and c2["kill"] is None  # it ended at SIGTERM, within the grace period
    assert j.cancel_reason("R", "c1") == "cancelled by agent A of run R (test)"
    again = cancel.cancel(state, cancel.Scope("cell", "R", None, "c1"), grace=0.0, by="again", backend=b)
    assert j.cancel_reason("R", "c1").endswith("(test)")  # first reason wins
    assert again["cells"][0]["signalled"] == 0


def test_a_cancel_with_no_grace_sends_sigterm_to_the_leader_alone_then_kills_the_tree_at_once(world, monkeypatch):
    state, j, k, b = world
    monkeypatch.setattr(cancel, "CONCLUDE_TIMEOUT", 0.1)
    controller(state, j, "ctl-live", alive=True)
    place = cell(j, b, k, "ctl-live", "c1", pid=10)
    k.procs[10].ignores_term = True
    k.spawn(11, start=101, dir=place.dir)  # would die at SIGTERM: it is killed without one
    (c1,) = cancel.cancel(state, cancel.Scope("cell", "R", None, "c1"), grace=0.0, backend=b)["cells"]
    assert c1["empty"] and c1["signalled"] == 1 and c1["kill"] == "fake.kill"
    assert k.procs[10].signals == [signal.SIGTERM, signal.SIGKILL] and k.procs[11].signals == [signal.SIGKILL]


def test_a_reused_leader_pid_gets_no_sigterm_from_a_cancel_with_no_grace(world, monkeypatch):
    state, j, k, b = world
    monkeypatch.setattr(cancel, "CONCLUDE_TIMEOUT", 0.1)
    controller(state, j, "ctl-live", alive=True)
    cell(j, b, k, "ctl-live", "c1", pid=10)
    k.procs[10].exit()
    k.spawn(10, start=999)  # the number reused outside the cell
    (c1,) = cancel.cancel(state, cancel.Scope("cell", "R", None, "c1"), grace=0.0, backend=b)["cells"]
    assert c1["signalled"] == 0 and k.procs[10].alive and k.procs[10].signals == []


def test_cancel_never_touches_a_directory_recreated_at_the_cells_path(world, monkeypatch):
    state, j, k, b = world
    monkeypatch.setattr(cancel, "CONCLUDE_TIMEOUT", 0.1)
    controller(state, j, "ctl-live", alive=True)
    place = cell(j, b, k, "ctl-live", "c1", pid=10)
    k.dirs[place.dir] += 1  # rmdir + mkdir by somebody else: another inode
    out = cancel.cancel(state, cancel.Scope("cell", "R", None, "c1"), grace=0.0, backend=b)
    assert k.procs[10].alive and k.procs[10].signals == [] and b.kills == []
    assert any("recreated" in n for n in out["cells"][0]["notes"])


def test_the_janitor_recovers_a_dead_controllers_cells_and_only_those(world):
    state, j, k, b = world
    controller(state, j, "ctl-dead", alive=False)
    keep = controller(state, j, "ctl-live", alive=True)
    cell(j, b, k, "ctl-dead", "c1", pid=10)
    k.spawn(11, start=150, sid=11, token="tok")         # left the tree, carries the token
    k.spawn(12, start=50, sid=12, token="tok")          # forged token, older than the cell
    cell(j, b, k, "ctl-live", "c2", run="R2", pid=20, token="tok2")
    rep = janitor.run_janitor(state, j, backend=b)
    assert rep["recovered"] == ["c1"] and j.cell_state("R", "c1") == "recovered"
    assert sorted(x["pid"] for x in rep["killed"]) == [10, 11]
    assert k.procs[12].alive and k.procs[20].alive and j.cell_state("R2", "c2") == "running"
    assert any(s.get("cell_id") == "c2" and "is alive" in s["reason"] for s in rep["skipped"])
    assert any(s.get("pid") == 12 and "before the cell began" in s["reason"] for s in rep["skipped"])
    (rec,) = j.receipts("recovery", "R", "c1")
    assert rec["cell"]["final_state"] == "recovered" and os.path.exists(rec["path"])
    assert janitor.run_janitor(state, j, backend=b)["recovered"] == []  # a second pass does nothing
    os.close(keep)


def test_a_cell_from_another_boot_gets_no_signal_only_its_records_converge(world):
    state, j, k, b = world
    controller(state, j, "ctl-old", alive=False, boot="another-boot")
    place = cell(j, b, k, "ctl-old", "c1", pid=10, boot="another-boot")
    rep = janitor.run_janitor(state, j, backend=b)
    assert rep["recovered"] == ["c1"] and rep["killed"] == [] and k.procs[10].signals == []
    (rec,) = j.receipts("recovery", "R", "c1")
    assert any("no signal sent" in n for n in rec["cell"]["notes"])
    assert place.dir in k.dirs  # this boot's directory at that path is not the cell's


def test_the_janitor_leaves_a_cell_whose_tree_will_not_die_for_the_next_janitor(world, monkeypatch):
    from agnsup import reaper
    monkeypatch.setattr(reaper, "VERIFY_TIMEOUT", 0.05)
    state, j, k, b = world
    controller(state, j, "ctl-dead", alive=False)
    cell(j, b, k, "ctl-dead", "c1", pid=10)
    k.procs[10].unkillable = True
    rep = janitor.run_janitor(state, j, backend=b)
    assert rep["recovered"] == [] and j.cell_state("R", "c1") == "running"
    assert any("still" in s["reason"] for s in rep["skipped"] if s.get("cell_id") == "c1")
    assert [e for e in j.events("R", "c1") if e["kind"] == "recovery.kill"]  # the plan survives


def test_a_cell_whose_tree_died_with_its_controller_is_recorded_as_controller_died(world):
    state, j, k, b = world
    controller(state, j, "ctl-dead", alive=False)
    cell(j, b, k, "ctl-dead", "c1", pid=10, dies="namespace")
    k.procs[10].alive = False  # the kernel ended the namespace with its init
    cell(j, b, k, "ctl-dead", "c2", pid=20, dies="namespace", token="tok2")  # ... but here something is left
    rep = janitor.run_janitor(state, j, backend=b)
    assert sorted(rep["recovered"]) == ["c1", "c2"] and [x["pid"] for x in rep["killed"]] == [20]
    assert j.cell("R", "c1")["reason"] == "controller_died" and j.cell("R", "c2")["reason"] == "recovered"
    (rec,) = j.receipts("recovery", "R", "c1")
    assert rec["cell"]["reason"] == "controller_died" and any("PR_SET_PDEATHSIG" in n for n in rec["cell"]["notes"])
