"""The journal store on a real SQLite file: the state machine, first-reason-wins, quotas' counts."""
import json
import os
import time

import pytest

from agnsup.errors import CancelledBeforeStart, RunNotActive, StateError
from agnsup.store.journal import LIVE_CELL, OPEN_SQL, TERMINAL_CELL, Journal


def journal_of(tmp_path, kind: str = "run") -> Journal:
    """A fresh journal in tmp_path with controller ctl-1 of `kind` registered (the store tests' fixture `j`)."""
    journal = Journal(str(tmp_path / "journal.db"))
    journal.register_controller({"id": "ctl-1", "kind": kind, "pid": 1, "pidfd_ino": None, "starttime": 1,
                                 "boot_id": "b", "lock_path": str(tmp_path / "ctl.lock"), "started_at": time.time()})
    return journal


@pytest.fixture
def j(tmp_path):
    journal = journal_of(tmp_path)
    yield journal
    journal.close()


def begin(j, cell="c1", run="R", agent="A", admit=None):
    j.begin_cell({"run_id": run, "cell_id": cell, "agent_id": agent, "role": "executor", "token": "t",
                  "controller_id": "ctl-1", "boot_id": "b", "cgroup": "{}", "tmpdir": None, "worktree": "/w",
                  "lock_path": None, "argv": '["true"]', "exe": "/bin/true", "created_at": time.time(), "grace": 1.0},
                 [{"stage": "public_tool", "t": 0}], admit)


def receipt(cell="c1", run="R", state="exited"):
    return {"run_id": run, "cell_id": cell, "state": state, "ended_at": time.time(), "exit_code": 0, "signal": None,
            "reason": state}


def test_a_cell_goes_starting_running_terminal_and_never_changes_after(j):
    begin(j)
    assert j.cell_state("R", "c1") == "starting"
    j.mark_running("R", "c1")
    j.conclude_cell(receipt(), None)
    assert j.cell_state("R", "c1") == "exited"
    with pytest.raises(StateError, match="cannot go from exited to running"):
        j.mark_running("R", "c1")
    with pytest.raises(StateError, match="cannot go from exited to cancelled"):
        j.conclude_cell(receipt(state="cancelled"), None)
    assert [e["kind"] for e in j.events("R", "c1")] == ["stage.public_tool", "state.starting", "state.running",
                                                         "state.exited"]


def test_a_refused_move_changes_no_field_of_the_cell(j):
    """The flow's guard is in the same UPDATE as the fields (journal._move_cell): a terminal cell's exit code,
    reason and receipt path stay as concluded."""
    begin(j)
    j.conclude_cell(receipt(), "/r1")
    late = {**receipt(state="killed"), "exit_code": 137, "signal": 9, "reason": "killed"}
    with pytest.raises(StateError, match="cannot go from exited to killed"):
        j.conclude_cell(late, "/r2")
    row = j.cell("R", "c1")
    assert (row["state"], row["exit_code"], row["signal"], row["reason"], row["receipt_path"]) == \
        ("exited", 0, None, "exited", "/r1")
    with pytest.raises(StateError, match="no cell 'c9' in run 'R'"):
        j.mark_running("R", "c9")


def _wal_frames(j) -> int:
    page = j.db.execute("PRAGMA page_size").fetchone()[0]
    return max(0, (os.path.getsize(j.path + "-wal") - 32) // (page + 24))


def test_a_one_cell_controller_checkpoints_in_its_identity_commit_not_in_the_others(j):
    """checkpoint_in_quiet_commits: the commits on the caller's path leave the WAL past the usual bound; the
    identity's, made while the child sets up, folds it in (the next write then starts the WAL again)."""
    from agnsup.store.journal import WAL_PAGES
    j.checkpoint_in_quiet_commits()
    begin(j)
    i = 0
    while _wal_frames(j) <= WAL_PAGES + 50 and i < 1000:
        j.add_event("test.filler", "R", "c1", pad="x" * 3000, i=i)
        i += 1
    assert _wal_frames(j) > WAL_PAGES + 50  # no auto-checkpoint (and restart) in those commits
    j.commit_identity("R", "c1", {"pid": 5, "pidfd_ino": None, "starttime": 9, "pgid": 5, "started_at": 1.0},
                      {"stage": "process_supervisor"})
    j.add_event("test.after", "R", "c1")
    busy, frames, copied = j.db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
    assert busy == 0 and frames < 20  # the WAL started again after the identity commit's checkpoint
    assert j.db.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == WAL_PAGES * 4
    assert j.cell("R", "c1")["pid"] == 5


def test_a_cell_id_is_never_reused_in_a_run_but_may_be_in_another(j):
    begin(j)
    with pytest.raises(RunNotActive, match="never reused"):
        begin(j)
    begin(j, run="R2")
    assert j.cell_runs("c1") == ["R", "R2"]


def test_a_finished_run_is_reopened_by_a_new_cell_and_the_journal_says_so(j):
    begin(j)
    j.conclude_cell(receipt(), None)
    j.finish_run("R", [])
    assert j.run("R")["state"] == "finished"
    begin(j, cell="c2")
    assert j.run("R")["state"] == "active" and j.run("R")["ended_at"] is None
    (ev,) = [e for e in j.events("R", "c2") if e["kind"] == "run.reopened"]
    assert '"was": "finished"' in ev["data"]


def test_a_cancelled_run_refuses_every_new_cell(j):
    begin(j)
    j.record_cancel("run", "R", None, None, "cancelled by run R (test)")
    assert j.run("R")["state"] == "cancelled"
    with pytest.raises(RunNotActive, match="was cancelled"):
        begin(j, cell="c2")
    assert j.cell("R", "c2") is None  # the refused intent left nothing


def test_the_first_cancel_reason_wins_and_a_cell_setting_up_never_starts(j):
    begin(j)
    assert [r["cell_id"] for r in j.record_cancel("cell", "R", None, "c1", "first")] == ["c1"]
    j.record_cancel("agent", "R", "A", None, "second")
    assert j.cancel_reason("R", "c1") == "first"
    with pytest.raises(CancelledBeforeStart, match="first"):
        j.commit_identity("R", "c1", {"pid": 5, "pidfd_ino": None, "starttime": 9, "pgid": 5, "started_at": 1.0},
                          {"stage": "process_supervisor"})
    assert j.cell("R", "c1")["pid"] is None  # rolled back


def test_a_quota_judge_sees_the_counts_inside_the_intent_transaction(j):
    seen = []
    begin(j, admit=seen.append)
    begin(j, cell="c2", agent="B", admit=seen.append)
    assert seen[0] == (0, 0, 0, 0.0)                              # a new run: created with this cell
    assert seen[1][:3] == (1, 1, 0) and seen[1][3] >= 0          # one live cell, of agent A

    def refuse(counts):
        raise RunNotActive("quota")
    with pytest.raises(RunNotActive):
        begin(j, cell="c3", admit=refuse)
    assert j.cell("R", "c3") is None


def test_recovery_marks_the_run_recovered_only_when_no_other_cell_lives(j):
    begin(j)
    begin(j, cell="c2")
    entries = [{"notes": []}, {"notes": []}]
    j.conclude_recovered([{"run_id": "R", "cell_id": "c1", "controller": "ctl-1", "entry": entries[0],
                           "receipt": {"kind": "recovery"}}], "jan-1", time.time(), "/r.json")
    assert entries[0]["run_state"] == "active" and j.run("R")["state"] == "active"
    j.conclude_recovered([{"run_id": "R", "cell_id": "c2", "controller": "ctl-1", "entry": entries[1],
                           "receipt": {"kind": "recovery"}}], "jan-1", time.time(), "/r.json")
    assert entries[1]["run_state"] == "recovered" and j.run("R")["state"] == "recovered"
    assert len(j.receipts("recovery", "R")) == 2


def test_cells_of_one_run_recovered_together_each_say_the_runs_state(j):
    """conclude_recovered asks a run once for all its cells in the batch: every entry still says it."""
    for c in ("c1", "c2", "c3"):
        begin(j, cell=c)
    entries = [{"notes": []} for _ in range(2)]
    j.conclude_recovered([{"run_id": "R", "cell_id": c, "controller": "ctl-1", "entry": e,
                           "receipt": {"kind": "recovery"}} for c, e in zip(("c1", "c2"), entries)],
                         "jan-1", time.time(), "/r.json")
    assert [e["run_state"] for e in entries] == ["active", "active"] and j.run("R")["state"] == "active"
    assert all(e["notes"] == ["run R has other live cells: it stays active"] for e in entries)
    begin(j, run="S", cell="d1")
    begin(j, run="S", cell="d2")
    more = [{"notes": []} for _ in range(3)]
    j.conclude_recovered([{"run_id": r, "cell_id": c, "controller": "ctl-1", "entry": e, "receipt": {"kind": "recovery"}}
                          for (r, c), e in zip((("R", "c3"), ("S", "d1"), ("S", "d2")), more)],
                         "jan-1", time.time(), "/r.json")
    assert [e["run_state"] for e in more] == ["recovered"] * 3 and all(e["notes"] == [] for e in more)
    assert j.run("R")["state"] == j.run("S")["state"] == "recovered"


def test_the_terminal_states_are_spelled_once_and_the_live_index_serves_the_janitor(j):
    assert all(f"'{s}'" in LIVE_CELL for s in TERMINAL_CELL)
    plan = j.query_plan(OPEN_SQL)
    assert "controllers_open" in plan and "cells_live" in plan, plan


def test_stage_events_of_many_cells_are_each_cells_own_stage_events_in_order(j):
    """The janitor reads the stage events of every recovered cell at once: per cell exactly what reading
    its events one cell at a time and keeping the `stage.*` ones with data gives."""
    for run, cell in (("R", "c1"), ("R", "c2"), ("R", "c3"), ("S", "c1")):
        begin(j, run=run, cell=cell)
    j.add_event("stage.spawn", "R", "c1", stage="spawn", t=1)
    j.add_event("state.running", "R", "c1", x=1)
    j.add_event("stage.spawn", "R", "c2", stage="spawn", t=2)
    j.add_event("stage.exec", "R", "c1", stage="exec", t=3)
    j.add_event("stage.empty", "R", "c1")  # no data: not a stage of the chain
    j.add_event("stage.spawn", "S", "c1", stage="spawn", t=4)
    keys = [("R", "c1"), ("R", "c2"), ("S", "c1"), ("S", "nope")]
    got = j.stage_events(keys)
    one_by_one = {k: [e["data"] for e in j.events(*k) if e["kind"].startswith("stage.") and e["data"]] for k in keys}
    assert got == one_by_one
    assert [json.loads(d)["stage"] for d in got["R", "c1"]][-2:] == ["spawn", "exec"]
    assert got["S", "nope"] == [] and ("R", "c3") not in got


def test_with_live_cells_names_the_controllers_that_still_have_one(j):
    begin(j, cell="c1")
    begin(j, cell="c2")
    j.conclude_recovered([{"run_id": "R", "cell_id": "c1", "controller": "ctl-1", "entry": {"notes": []},
                           "receipt": {"kind": "recovery"}}], "jan-1", time.time(), "/r.json")
    assert j.with_live_cells(["ctl-1", "ctl-2"]) == {"ctl-1"} == {r["controller_id"] for r in j.live_cells_of("ctl-1")}
    j.conclude_recovered([{"run_id": "R", "cell_id": "c2", "controller": "ctl-1", "entry": {"notes": []},
                           "receipt": {"kind": "recovery"}}], "jan-1", time.time(), "/r.json")
    assert j.with_live_cells(["ctl-1", "ctl-2"]) == set() and j.with_live_cells([]) == set()


def test_the_switch_to_wal_is_retried_while_another_connection_switches_the_same_fresh_file():
    """Two controllers started together on a new state root both switch its fresh journal to WAL: SQLite answers
    one of them SQLITE_BUSY at once, without the busy handler (two SHARED locks that both want EXCLUSIVE: it refuses
    to wait in a deadlock), which made `agnsup mcp` twice at once fail ~1 open in 75 with "database is locked".
    Checked to fail without the retry in journal._wal_mode."""
    import sqlite3
    from agnsup.store import journal

    class Busy:
        tries = 0

        def execute(self, sql):
            assert sql == "PRAGMA journal_mode = WAL"
            self.tries += 1
            if self.tries < 3:
                e = sqlite3.OperationalError("database is locked")
                e.sqlite_errorcode = sqlite3.SQLITE_BUSY
                raise e
            return self

        def fetchone(self):
            return ("wal",)

    db = Busy()
    assert journal._wal_mode(db) == "wal" and db.tries == 3

    class Broken(Busy):
        def execute(self, sql):
            e = sqlite3.OperationalError("disk I/O error")
            e.sqlite_errorcode = sqlite3.SQLITE_IOERR
            raise e
    with pytest.raises(sqlite3.OperationalError):  # anything else is not retried
        journal._wal_mode(Broken())
