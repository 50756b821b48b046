"""The broker's Controller over the fake backend and a fake process layer, with a real journal and
real locks: what start journals and in which order, what finish and fail conclude, and what each
releases. No root, no process is started: a cell's leader is a FakeProc (fake_backend.FakeProcesses)."""
import json
import os

import pytest

from agnsup import broker, compiler, locks, policy, spec
from agnsup.errors import CancelledBeforeStart, Denied, LockTimeout, NotFound, RunNotActive, StateError
from agnsup.request import CellRequest
from agnsup.store.state import StateRoot

from fake_backend import HOST, FakeHost



class World(FakeHost):
    def __init__(self, tmp_path, monkeypatch):
        super().__init__(tmp_path, monkeypatch)
        self.state = StateRoot(self.state_dir).ensure()
        self.controllers = []

    def controller(self, **kw) -> broker.Controller:
        ctl = broker.Controller(self.state, backend=self.backend, **kw)
        self.controllers.append(ctl)
        return ctl

    def prepared(self, cell_id="c1", admit=None, role="executor", agent_id="A", **kw) -> broker.Prepared:
        pol = policy.load(role)
        s = spec.build(CellRequest.make(["true"], workdir=self.wt, role=role, run_id="R", agent_id=agent_id,
                                        cell_id=cell_id, **kw), pol)
        plan = compiler.compile_plan(s, pol, self.state.path, HOST)
        plan.grace = 0.0
        return broker.Prepared(plan=plan, decision={"allowed": True, "rule": "test"}, trail=[],
                               trace=[broker.stage("public_tool")], admit=admit)

    def lock_is_free(self, cell) -> bool:
        fd = locks.try_acquire(cell.lock_path, True, "test")
        if fd is None:
            return False
        locks.release(cell.lock_path, fd)
        return True


class Waited:
    """What finish reads of a Waiter whose leader ended by itself (or that stopped it: `reason`)."""
    cancel_reason = kill_method = None
    stop_signal = 15

    def __init__(self, reason=None):
        self.reason = reason

    def grace_until(self):
        return None


@pytest.fixture
def w(tmp_path, monkeypatch):
    world = World(tmp_path, monkeypatch)
    yield world
    for ctl in world.controllers:
        ctl.close()


def events(ctl, cell) -> list[str]:
    return [e["kind"] for e in ctl.journal.events("R", cell.spec.cell_id)]


def test_start_journals_the_intent_then_the_place_then_the_identity_and_only_then_lets_the_command_run(w):
    ctl = w.controller()
    seen = []
    w.procs.on_release = lambda child: seen.append(ctl.journal.cell("R", "c1")["pid"])
    cell = ctl.start(w.prepared(), capture=True)
    assert [c[0] for c in w.procs.calls] == ["spawn", "release"]
    assert seen == [cell.child.pid]  # its identity was journaled before it could exec
    assert [s["stage"] for s in cell.trace] == ["public_tool", "broker", "backend", "process_supervisor"]
    assert events(ctl, cell) == ["stage.public_tool", "stage.broker", "state.starting", "stage.backend",
                                 "stage.process_supervisor", "state.running"]
    row = ctl.journal.cell("R", "c1")
    assert row["state"] == "running" and row["controller_id"] == ctl.id and row["token"] == cell.spec.token
    assert json.loads(row["cgroup"]) == {"v2": "/fake/run-R/agent-A/cell-c1"}
    assert row["cgroup_ino"] == w.k.dirs["/fake/run-R/agent-A/cell-c1"]  # made by the backend, journaled
    assert cell.isolation["cgroup_layout"] == "fake" and cell.isolation["cgroup_join"] == "fake"
    assert oct(os.stat(cell.plan.tmpdir).st_mode & 0o7777) == "0o1777"
    assert not w.lock_is_free(cell)  # the worktree lock is held while it runs


def test_finish_reaps_concludes_writes_the_receipt_and_releases_the_place_and_the_lock(w):
    ctl = w.controller()
    cell = ctl.start(w.prepared(), capture=True)
    w.k.procs[cell.child.pid].exit(3)
    receipt = ctl.finish(cell, Waited())
    assert (receipt["state"], receipt["exit_code"], receipt["reason"]) == ("exited", 3, "exited")
    assert w.procs.calls[-1] == ("collect", cell.child.pid)
    with open(os.path.join(cell.plan.cell_dir, "receipt.json")) as f:
        assert json.load(f) == receipt
    row = ctl.journal.cell("R", "c1")
    assert (row["state"], row["exit_code"]) == ("exited", 3)
    assert ctl.journal.receipts("cell", "R", "c1") == [receipt]
    assert "/fake/run-R/agent-A/cell-c1" not in w.k.dirs and w.lock_is_free(cell)
    assert cell.lock_fd is None


def test_the_receipt_file_holds_the_journaled_receipt_byte_for_byte(w):
    """One encoding for both (receipts.dumps): `agnsup verify` holds the file to the row."""
    ctl = w.controller()
    cell = ctl.start(w.prepared(), capture=True)
    w.k.procs[cell.child.pid].exit(0)
    receipt = ctl.finish(cell, Waited())
    with open(os.path.join(cell.plan.cell_dir, "receipt.json")) as f:
        text = f.read()
    (row,) = ctl.journal._all("SELECT data FROM receipts WHERE kind='cell' AND run_id='R' AND cell_id='c1'")
    assert text == row["data"] + "\n" and json.loads(text) == receipt


def test_the_receipt_file_is_made_while_the_cell_runs_and_filled_at_its_end(w):
    """receipts.reserve: its inode made after the start, not on the end's path; the end renames it in place."""
    ctl = w.controller()
    cell = ctl.start(w.prepared(), capture=True)
    names = os.listdir(cell.plan.cell_dir)
    assert f"receipt.json.{os.getpid()}.tmp" in names and "receipt.json" not in names
    w.k.procs[cell.child.pid].exit(0)
    receipt = ctl.finish(cell, Waited())
    assert not [n for n in os.listdir(cell.plan.cell_dir) if n.startswith("receipt.json.")]
    with open(os.path.join(cell.plan.cell_dir, "receipt.json")) as f:
        assert json.load(f) == receipt


def test_a_controller_of_many_cells_checkpoints_the_wal_on_a_thread_of_its_own(w):
    """Journal.checkpoint_behind: woken at the first quiet commit (an identity's) after CHECKPOINT_EVERY
    commits, or after 4x without one; the main connection's auto-checkpoint only a bound."""
    import time
    from agnsup.store import journal as store
    ctl = w.controller()
    cp = ctl.journal._checkpointer
    assert cp is not None and cp.thread.is_alive()
    assert ctl.journal.db.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == store.WAL_PAGES * 4

    def ran(n):
        deadline = time.monotonic() + 60  # a bound for a stuck thread, not a timing: done counts what it ran
        while cp.done < n and time.monotonic() < deadline:
            time.sleep(0.01)
        return cp.done

    for i in range(store.CHECKPOINT_EVERY):
        ctl.journal.add_event("test.commit", "R", None, i=i)
    assert cp.count == store.CHECKPOINT_EVERY and cp.done == 0  # not woken by ordinary commits
    ctl.journal.commit_identity("R", "none", {"pid": 5, "pidfd_ino": None, "starttime": 9, "pgid": 5,
                                              "started_at": 1.0}, {"stage": "process_supervisor"})
    assert ran(1) == 1 and cp.count == 0
    for i in range(store.CHECKPOINT_EVERY * 4):  # none of them quiet: the bound wakes it
        ctl.journal.add_event("test.commit", "R", None, i=i)
    assert ran(2) == 2
    busy, frames, copied = ctl.journal.db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
    assert busy == 0 and frames == copied  # nothing it left behind
    assert ctl.journal.integrity() == ["ok"]
    one = w.controller(one_cell=True)  # the CLI's: checkpoint_in_quiet_commits, no thread
    assert one.journal._checkpointer is None and one.journal._quiet_checkpoint


def test_a_leader_killed_by_a_signal_ends_killed_with_128_plus_the_signal(w):
    ctl = w.controller()
    cell = ctl.start(w.prepared(), capture=True)
    w.k.deliver(cell.child.pid, 9)
    receipt = ctl.finish(cell, Waited())
    assert (receipt["state"], receipt["exit_code"], receipt["signal"]) == ("killed", 137, 9)


def test_what_the_leader_left_behind_in_its_tree_is_killed_by_finish(w):
    ctl = w.controller()
    cell = ctl.start(w.prepared(), capture=True)
    straggler = w.k.spawn(7777, dir=cell.place.dir, ignores_term=True)
    w.k.procs[cell.child.pid].exit(0)
    receipt = ctl.finish(cell, Waited())
    assert not straggler.alive and w.backend.kills == [cell.place.dir]
    assert receipt["exit_code"] == 0 and "/fake/run-R/agent-A/cell-c1" not in w.k.dirs


def test_a_cancel_recorded_by_another_process_makes_the_cell_cancelled_with_the_first_reason(w):
    ctl = w.controller()
    cell = ctl.start(w.prepared(), capture=True)
    ctl.journal.record_cancel("cell", "R", None, "c1", "cancelled by somebody (test)")
    w.k.deliver(cell.child.pid, 15)
    receipt = ctl.finish(cell, Waited())
    assert (receipt["state"], receipt["exit_code"]) == ("cancelled", 143)
    assert ctl.journal.cell("R", "c1")["reason"] == "cancelled"
    assert receipt["cancel_reason"] == "cancelled by somebody (test)"


def test_a_cancel_between_the_identity_and_running_is_stopped_by_the_controllers_own_waiter(w):
    ctl = w.controller()
    w.procs.on_release = lambda child: ctl.journal.record_cancel("cell", "R", None, "c1", "cancelled early")
    cell = ctl.start(w.prepared(), capture=True)
    assert cell.cancelled_starting == "cancelled early"
    waiter = ctl.waiter(cell)  # it sent SIGTERM to the tree at once: the fake leader ended of it
    assert w.k.procs[cell.child.pid].signals == [15]
    receipt = ctl.finish(cell, waiter.wait())
    assert (receipt["state"], receipt["exit_code"]) == ("cancelled", 143)


def test_a_timeout_stays_a_timeout_though_a_cancel_came_after(w):
    ctl = w.controller()
    cell = ctl.start(w.prepared(), capture=True)
    ctl.journal.record_cancel("cell", "R", None, "c1", "cancelled late")
    w.k.deliver(cell.child.pid, 15)
    receipt = ctl.finish(cell, Waited("timeout"))
    assert (receipt["state"], receipt["exit_code"], receipt["reason"]) == ("timeout", 124, "timeout")


def test_an_oom_kill_the_backend_counted_makes_the_cell_end_oom(w, monkeypatch):
    ctl = w.controller()
    cell = ctl.start(w.prepared(), capture=True)
    monkeypatch.setattr(w.backend, "usage", lambda place: {"oom_kills": 1})
    w.k.deliver(cell.child.pid, 9)
    receipt = ctl.finish(cell, Waited())
    assert (receipt["state"], receipt["reason"], receipt["usage"]["oom_kills"]) == ("killed", "oom", 1)


def test_output_past_the_cap_written_just_before_the_end_ends_the_cell_output_limit(w):
    ctl = w.controller()
    prepared = w.prepared()
    prepared.plan.limits["output_max"] = 4
    cell = ctl.start(prepared, capture=True)
    leader = w.k.procs[cell.child.pid]
    os.write(leader.stdio[1], b"0123456789")
    leader.exit(0)
    receipt = ctl.finish(cell, Waited())
    assert (receipt["state"], receipt["reason"], receipt["exit_code"]) == ("killed", "output_limit", 0)
    with open(os.path.join(cell.plan.cell_dir, "stdout"), "rb") as f:
        assert f.read() == b"0123"  # delivered up to the cap


def test_what_a_capturing_cell_wrote_lands_in_the_worktree_when_it_ends(w):
    ctl = w.controller()
    cell = ctl.start(w.prepared(), capture=True)
    assert cell.layer is not None  # the role captures: the overlay's upper layer is made before it starts
    with open(os.path.join(cell.layer.upper, "new.txt"), "w") as f:  # as the cell's overlay would write it
        f.write("made in the cell\n")
    w.k.procs[cell.child.pid].exit(0)
    receipt = ctl.finish(cell, Waited())
    with open(os.path.join(w.wt, "new.txt")) as f:
        assert f.read() == "made in the cell\n"
    assert (receipt["changes"]["record"], receipt["changes"]["created"], receipt["changes"]["paths"]) == \
        ("R/c1", 1, ["new.txt"])


def test_a_cell_that_runs_but_whose_running_state_cannot_be_journaled_is_killed_and_failed(w, monkeypatch):
    ctl = w.controller()

    def refused(*a):
        raise StateError("read-only state root")
    monkeypatch.setattr(ctl.journal, "mark_running", refused)
    with pytest.raises(StateError, match="read-only state root"):
        ctl.start(w.prepared(), capture=True)
    pid = w.procs.calls[1][1]
    assert w.procs.calls == [("spawn", None), ("release", pid), ("collect", pid)]
    assert w.k.procs[pid].signals == [9] and w.backend.kills == ["/fake/run-R/agent-A/cell-c1"]
    assert ctl.journal.cell_state("R", "c1") == "failed"


def test_a_cell_whose_setup_fails_is_concluded_failed_and_leaves_nothing_held(w):
    ctl = w.controller()
    w.procs.fail["spawn"] = StateError("no fork for you")
    with pytest.raises(StateError, match="no fork for you"):
        ctl.start(w.prepared(), capture=True)
    row = ctl.journal.cell("R", "c1")
    assert (row["state"], row["reason"], row["exit_code"]) == ("failed", "StateError", 125)
    (receipt,) = ctl.journal.receipts("cell", "R", "c1")
    assert receipt["error"] == "no fork for you"
    assert "/fake/run-R/agent-A/cell-c1" not in w.k.dirs and not w.k.live()
    assert not os.listdir(os.path.join(w.state.path, "locks"))  # its worktree lock went with it


def test_an_error_of_the_os_while_setting_up_becomes_one_state_error(w):
    ctl = w.controller()
    w.procs.fail["spawn"] = OSError(24, "Too many open files")
    with pytest.raises(StateError, match="cell setup failed: .*Too many open files"):
        ctl.start(w.prepared(), capture=True)
    assert ctl.journal.cell("R", "c1")["state"] == "failed"


def test_a_leader_whose_identity_cannot_be_journaled_is_abandoned_and_never_runs(w, monkeypatch):
    ctl = w.controller()

    def refused(*a, **kw):
        raise StateError("disk full")
    monkeypatch.setattr(ctl.journal, "commit_identity", refused)
    with pytest.raises(StateError, match="disk full"):
        ctl.start(w.prepared(), capture=True)
    assert [c[0] for c in w.procs.calls] == ["spawn", "abandon"]  # never released to exec
    assert ctl.journal.cell("R", "c1")["state"] == "failed" and not w.k.live()


def test_a_child_whose_own_setup_failed_at_release_is_not_collected_twice(w):
    ctl = w.controller()
    w.procs.fail["release"] = NotFound("nosuch: command not found", step="exec")
    with pytest.raises(NotFound):
        ctl.start(w.prepared(), capture=True)
    assert [c[0] for c in w.procs.calls] == ["spawn", "release"]
    row = ctl.journal.cell("R", "c1")
    assert (row["state"], row["exit_code"]) == ("failed", 127)


def test_a_run_quota_refusal_in_the_intent_transaction_journals_the_denial_and_creates_nothing(w):
    ctl = w.controller()

    def admit(counts):
        raise Denied("quota: 1 cell per run", decision={"allowed": False, "rule": "quota"},
                     trail=[{"stage": "quota"}])
    with pytest.raises(Denied):
        ctl.start(w.prepared(admit=admit), capture=True)
    assert ctl.journal.cell("R", "c1") is None and w.procs.calls == [] and not w.k.dirs
    (denied,) = ctl.journal.refusals("R")
    assert denied["kind"] == "denied" and denied["cell_id"] == "c1"
    assert not os.listdir(os.path.join(w.state.path, "locks"))


def test_a_cell_id_whose_directory_is_on_disk_is_never_reused(w):
    ctl = w.controller()
    prepared = w.prepared()
    os.makedirs(prepared.plan.cell_dir)
    with pytest.raises(RunNotActive, match="already exists"):
        ctl.start(prepared, capture=True)
    assert ctl.journal.cell("R", "c1") is None and w.procs.calls == []
    assert not os.listdir(os.path.join(w.state.path, "locks"))


def test_a_queued_cell_waits_for_the_worktree_lock_and_resume_starts_it(w):
    ctl = w.controller()
    first = ctl.start(w.prepared("c1"), capture=True)
    queued = ctl.start(w.prepared("c2", agent_id="B"), capture=True, queue=True)
    assert queued.waiting and queued.child is None and ctl.journal.cell_state("R", "c2") == "waiting"
    assert w.procs.calls == [("spawn", None), ("release", first.child.pid)]
    w.k.procs[first.child.pid].exit(0)
    ctl.finish(first, Waited())
    ctl.resume(queued)
    assert not queued.waiting and ctl.journal.cell_state("R", "c2") == "running"
    assert "state.waiting" in events(ctl, queued) and events(ctl, queued)[-1] == "state.running"


def test_a_queued_cell_cancelled_while_it_waits_never_starts(w):
    ctl = w.controller()
    ctl.start(w.prepared("c1"), capture=True)
    queued = ctl.start(w.prepared("c2", agent_id="B", lock_timeout=5), capture=True, queue=True)
    ctl.journal.record_cancel("cell", "R", None, "c2", "cancelled while queued")
    with pytest.raises(CancelledBeforeStart):
        ctl.resume(queued)
    row = ctl.journal.cell("R", "c2")
    assert (row["state"], row["exit_code"], row["reason"]) == ("cancelled", 143, "cancelled")
    assert len(w.procs.calls) == 2  # c1's spawn and release only


def test_a_queued_cell_cancelled_before_its_lock_came_free_never_starts(w):
    ctl = w.controller()
    first = ctl.start(w.prepared("c1"), capture=True)
    queued = ctl.start(w.prepared("c2", agent_id="B"), capture=True, queue=True)
    ctl.journal.record_cancel("cell", "R", None, "c2", "cancelled while queued")
    w.k.procs[first.child.pid].exit(0)
    ctl.finish(first, Waited())  # the lock is free: resume takes it at once, without waiting
    with pytest.raises(CancelledBeforeStart):
        ctl.resume(queued)
    assert ctl.journal.cell_state("R", "c2") == "cancelled" and len(w.procs.calls) == 3


def test_a_queued_cell_whose_lock_never_comes_fails_with_the_lock_timeout(w):
    ctl = w.controller()
    ctl.start(w.prepared("c1"), capture=True)
    queued = ctl.start(w.prepared("c2", agent_id="B", lock_timeout=0), capture=True, queue=True)
    with pytest.raises(LockTimeout):
        ctl.resume(queued)
    assert ctl.journal.cell_state("R", "c2") == "failed"


def test_a_controller_registers_itself_and_close_ends_it_and_drops_its_lock(w):
    ctl = broker.Controller(w.state, backend=w.backend)
    row = ctl.journal.controller(ctl.id)
    assert row["pid"] == os.getpid() and row["ended_at"] is None and os.path.exists(ctl.lock_path)
    ctl.close(leave_journal_open=True)
    assert ctl.journal.controller(ctl.id)["ended_at"] is not None and not os.path.exists(ctl.lock_path)
    ctl.journal.close()


def test_a_one_cell_controller_is_journaled_with_its_cell_and_ends_with_its_conclusion(w):
    ctl = w.controller(one_cell=True)
    assert ctl.journal.controller(ctl.id) is None  # nothing written before its cell's intent
    cell = ctl.start(w.prepared(), capture=True)
    assert ctl.journal.controller(ctl.id)["ended_at"] is None
    w.k.procs[cell.child.pid].exit(0)
    ctl.finish(cell, Waited())
    assert ctl.journal.controller(ctl.id)["ended_at"] is not None


def test_a_cell_of_the_same_agent_starts_at_once_beside_a_running_one_in_its_worktree(w):
    ctl = w.controller()
    server = ctl.start(w.prepared("c1"), capture=True)
    curl = ctl.start(w.prepared("c2"), capture=True, queue=True)
    assert not curl.waiting and ctl.journal.cell_state("R", "c2") == "running"
    assert server.lock_path != curl.lock_path and not w.lock_is_free(server) and not w.lock_is_free(curl)
    for cell in (curl, server):
        w.k.procs[cell.child.pid].exit(0)
        ctl.finish(cell, Waited())
    assert not os.listdir(os.path.join(w.state.path, "locks"))


def test_the_calls_timeout_bounds_a_queued_cells_lock_wait_and_the_error_names_the_holder(w):
    ctl = w.controller()
    ctl.start(w.prepared("c1"), capture=True)
    queued = ctl.start(w.prepared("c2", agent_id="B", timeout=0.05), capture=True, queue=True)
    assert queued.waiting and queued.lock_holder == "cell c1 of run R, agent A"
    with pytest.raises(LockTimeout, match=r"held by cell c1 of run R, agent A; gave up after 0.05 s \(the call's "
                                          r"timeout bounds its lock wait\)"):
        ctl.resume(queued)
    assert ctl.journal.cell_state("R", "c2") == "failed"


def _points_at(fd: int) -> str | None:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except FileNotFoundError:
        return None


def test_the_end_writes_the_receipt_through_the_descriptor_reserved_while_the_cell_ran(w, monkeypatch):
    """receipts.reserve returns its file open; the end fills it through that descriptor (no open, no truncate on
    the end's path), closes it, and renames it into place: the same bytes as the journaled row."""
    ctl = w.controller()
    cell = ctl.start(w.prepared(), capture=True)
    fd = cell.receipt_fd
    assert fd is not None and _points_at(fd).endswith(f"receipt.json.{os.getpid()}.tmp")
    opened, real = [], os.open
    monkeypatch.setattr(os, "open", lambda p, *a, **k: (opened.append(str(p)), real(p, *a, **k))[1])
    w.k.procs[cell.child.pid].exit(0)
    ctl.finish(cell, Waited())
    monkeypatch.setattr(os, "open", real)
    assert not [p for p in opened if "receipt.json" in p]
    assert cell.receipt_fd is None and "receipt.json" not in (_points_at(fd) or "")
    with open(os.path.join(cell.plan.cell_dir, "receipt.json")) as f:
        text = f.read()
    (row,) = ctl.journal._all("SELECT data FROM receipts WHERE kind='cell' AND run_id='R' AND cell_id='c1'")
    assert text == row["data"] + "\n"


def test_a_reserved_receipt_file_removed_while_the_cell_ran_is_made_again_at_its_end(w):
    ctl = w.controller()
    cell = ctl.start(w.prepared(), capture=True)
    fd = cell.receipt_fd
    os.unlink(os.path.join(cell.plan.cell_dir, f"receipt.json.{os.getpid()}.tmp"))
    w.k.procs[cell.child.pid].exit(0)
    receipt = ctl.finish(cell, Waited())
    with open(os.path.join(cell.plan.cell_dir, "receipt.json")) as f:
        assert json.load(f) == receipt
    assert "receipt.json" not in (_points_at(fd) or "")
    assert not [n for n in os.listdir(cell.plan.cell_dir) if n.startswith("receipt.json.")]


def test_an_end_that_never_reached_its_receipt_lets_the_reserved_descriptor_go(w):
    ctl = w.controller()
    cell = ctl.start(w.prepared(), capture=True)
    fd = cell.receipt_fd
    ctl.drop_reserve(cell)
    assert cell.receipt_fd is None and "receipt.json" not in (_points_at(fd) or "")
    ctl.drop_reserve(cell)  # twice: nothing left to close
    w.k.procs[cell.child.pid].exit(0)
    ctl.finish(cell, Waited())  # the end writes it as before (receipts.write opens it)
    assert os.path.exists(os.path.join(cell.plan.cell_dir, "receipt.json"))


def test_the_reserved_receipt_file_is_never_truncated_open_and_a_leftover_is_emptied(w, monkeypatch, tmp_path):
    """ext4 flushes a file truncated to size 0 at its close (auto_da_alloc): the receipt's file is opened without
    O_TRUNC, at reserve and at the end; one found with content (never a cell's own) is emptied by reserve."""
    from agnsup import receipts
    flags, real = [], os.open
    monkeypatch.setattr(os, "open", lambda p, f, *a, **k: (flags.append((str(p), f)), real(p, f, *a, **k))[1])
    ctl = w.controller()
    cell = ctl.start(w.prepared(), capture=True)
    w.k.procs[cell.child.pid].exit(0)
    ctl.finish(cell, Waited())
    monkeypatch.setattr(os, "open", real)
    mine = [f for p, f in flags if "receipt.json" in p]
    assert mine and not [f for f in mine if f & os.O_TRUNC]
    assert not [p for p, f in flags if f & os.O_TRUNC and os.path.basename(p) == "protect-start.json"]
    path = str(tmp_path / "receipt.json")
    with open(receipts.reserved_name(path), "w") as f:
        f.write("left over by another writer, longer than the receipt")
    fd = receipts.reserve(path)
    receipts.write(path, {"a": 1}, text='{"a": 1}', fd=fd)
    with open(path) as f:
        assert f.read() == '{"a": 1}\n'
