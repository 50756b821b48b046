"""`agnsup ps --since/--until/--state/--limit` and `cleanup --older-than` (issue 28 §7): the time
parser, the filters, the bound, what a run is called, and the journal queries behind them."""
import json
import time
from datetime import datetime, timezone

import pytest
from click.testing import CliRunner

from agnsup.doors.cli import main
from agnsup.errors import UsageError
from agnsup.store.cells import check_states, newest, parse_when, run_label, select, tree_text
from agnsup.store.journal import Journal

NOW = 1_800_000_000.0


@pytest.mark.parametrize("text, back", [("30m", 1800), ("1h", 3600), ("2d", 172800), ("1w", 604800),
                                        ("45s", 45), ("1.5h", 5400), ("0s", 0), (" 2h ", 7200)])
def test_an_age_is_a_time_back_from_now(text, back):
    assert parse_when(text, "--since", NOW) == NOW - back


@pytest.mark.parametrize("text, utc", [
    ("2026-11-01", "2026-11-01T00:00:00"),                  # a date alone: midnight, UTC
    ("2026-11-01T12:00", "2026-11-01T12:00:00"),            # no offset: UTC (as journal prune --before)
    ("2026-11-01T12:00:00Z", "2026-11-01T12:00:00"),
    ("2026-11-01T14:00:00+02:00", "2026-11-01T12:00:00"),   # an offset is honoured
    ("2026-11-01 12:00:30", "2026-11-01T12:00:30"),
])
def test_an_iso_8601_time_is_utc_unless_it_names_an_offset(text, utc):
    want = datetime.fromisoformat(utc).replace(tzinfo=timezone.utc).timestamp()
    assert parse_when(text, "--until", NOW) == want


@pytest.mark.parametrize("text", ["yesterday", "", "h", "-1h", "infh", "nand", "1y", "2026-13-01", "1 h"])
def test_an_unparsable_time_is_one_usage_error_naming_the_option(text):
    with pytest.raises(UsageError) as e:
        parse_when(text, "--since", NOW)
    assert e.value.message.startswith("--since: ") and "\n" not in e.value.message


def cell(cid, created, ended=None, state=None, run="R"):
    return {"run_id": run, "cell_id": cid, "agent_id": "A", "state": state or ("exited" if ended else "running"),
            "run_state": "active", "created_at": created, "ended_at": ended, "pid": 1, "exit_code": None,
            "argv": ["true"]}


def test_the_window_keeps_the_cells_alive_in_it_ended_or_not():
    cells = [cell("before", 10, 20), cell("across", 15, 40), cell("inside", 32, 35), cell("after", 60, 70),
             cell("still", 5)]
    ids = lambda cs: [c["cell_id"] for c in cs]  # noqa: E731
    assert ids(select(cells, since=30)) == ["across", "inside", "after", "still"]
    assert ids(select(cells, until=30)) == ["before", "across", "still"]
    assert ids(select(cells, since=30, until=50)) == ["across", "inside", "still"]
    assert ids(select(cells)) == ids(cells)


def test_state_running_is_every_cell_not_ended_and_ended_every_other():
    cells = [cell("w", 1, state="waiting"), cell("s", 2, state="starting"), cell("r", 3),
             cell("x", 4, 5), cell("f", 5, 6, state="failed"), cell("k", 6, 7, state="killed")]
    assert [c["cell_id"] for c in select(cells, states=("running",))] == ["w", "s", "r"]
    assert [c["cell_id"] for c in select(cells, states=("ended",))] == ["x", "f", "k"]
    assert [c["cell_id"] for c in select(cells, states=("failed", "killed"))] == ["f", "k"]
    check_states(("running", "ended", "exited", "waiting", "recovered"))
    with pytest.raises(UsageError, match="'finished' is not a state"):
        check_states(("finished",))


def test_the_bound_keeps_the_newest_and_counts_the_rest():
    cells = [cell(f"c{i}", i) for i in range(120)]
    shown, left = newest(cells, 50)
    assert [c["cell_id"] for c in shown] == [f"c{i}" for i in range(70, 120)] and left == 70
    assert newest(cells, 0) == (cells, 0) and newest(cells, None) == (cells, 0) and newest(cells[:3], 50)[1] == 0


def test_an_active_run_is_ended_once_its_cells_ended_and_its_server_is_gone():
    assert run_label("active", (True, True)) == "active"     # a cell still runs
    assert run_label("active", (True, False)) == "active"    # a dead controller's live cell: the janitor's
    assert run_label("active", (False, True)) == "idle"      # its server (MCP, serve) is up: more may come
    assert run_label("active", (False, False)) == "ended"    # its server exited, or a one-cell run ended
    assert run_label("cancelled", (False, False)) == "cancelled" and run_label("finished", None) == "finished"
    lines = tree_text([cell("c1", 1, 2, run="R1"), cell("c2", 3, run="R2")], {"R1": "ended"})
    assert lines[0] == "run R1 [ended]" and "run R2 [active]" in lines


# -- the journal's queries -------------------------------------------------------------------
@pytest.fixture
def j(tmp_path):
    journal = Journal(str(tmp_path / "journal.db"))
    yield journal
    journal.close()


def controller(j, cid, ended=False):
    j.register_controller({"id": cid, "kind": "serve", "pid": 1, "pidfd_ino": None, "starttime": 1, "boot_id": "b",
                           "lock_path": f"/nonexistent/{cid}.lock", "started_at": time.time()})
    if ended:
        j.end_controller(cid)


def begin(j, run, cid, ctl, created=None):
    j.begin_cell({"run_id": run, "cell_id": cid, "agent_id": "A", "role": "executor", "token": "t",
                  "controller_id": ctl, "boot_id": "b", "cgroup": "{}", "tmpdir": None, "worktree": "/w",
                  "lock_path": None, "argv": '["true"]', "exe": "/bin/true",
                  "created_at": time.time() if created is None else created, "grace": 1.0},
                 [{"stage": "public_tool", "t": 0}])


def end(j, run, cid, at=None):
    j.conclude_cell({"run_id": run, "cell_id": cid, "state": "exited", "ended_at": time.time() if at is None else at,
                     "exit_code": 0, "signal": None, "reason": "exited"}, None)


def test_run_activity_says_which_active_runs_have_a_live_cell_or_an_open_controller(j):
    controller(j, "mcp-up")
    controller(j, "mcp-gone")
    begin(j, "busy", "c1", "mcp-up")
    begin(j, "idle", "c1", "mcp-up")
    end(j, "idle", "c1")
    begin(j, "gone", "c1", "mcp-gone")
    end(j, "gone", "c1")
    j.end_controller("mcp-gone")  # the MCP server exited
    assert j.run_activity() == {"busy": (True, True), "idle": (False, True), "gone": (False, False)}


def test_runs_ended_before_takes_old_runs_with_every_cell_ended_and_never_a_live_one(j):
    controller(j, "ctl")
    old = time.time() - 7200
    begin(j, "old", "c1", "ctl", created=old)
    end(j, "old", "c1", at=old + 60)
    begin(j, "recent", "c1", "ctl", created=old)
    end(j, "recent", "c1")                        # ended a moment ago: not old
    begin(j, "old-live", "c1", "ctl", created=old)  # still running: never touched, however old
    begin(j, "cleaned", "c1", "ctl", created=old)
    end(j, "cleaned", "c1", at=old + 60)
    j.finish_run("cleaned", [])                   # cleaned up already
    assert j.runs_ended_before(time.time() - 3600) == (["old"], ["old-live"])


# -- the command over a journal made here (no process needed) ----------------------------------
def test_ps_bounds_its_text_counts_what_it_left_out_and_json_keeps_its_shape(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    j = Journal(str(state / "journal.db"))
    controller(j, "ctl", ended=True)
    t0 = time.time() - 86400
    for i in range(60):
        begin(j, "R", f"c{i:02d}", "ctl", created=t0 + i * 60)
        end(j, "R", f"c{i:02d}", at=t0 + i * 60 + 1)
    j.close()
    run = lambda *a: CliRunner().invoke(main, ["--state-dir", str(state), "ps", *a])  # noqa: E731
    out = run("--all")
    assert out.exit_code == 0, out.output
    lines = out.output.splitlines()
    assert lines[0] == "run R [ended]"  # its controller ended: not [active] any more
    assert sum(" cell " in x for x in lines) == 50 and "c10" in out.output and "c09" not in out.output
    assert lines[-1].startswith("(10 older cell(s) not shown: --limit 0 shows all")
    assert sum(" cell " in x for x in run("--all", "--limit", "0").output.splitlines()) == 60
    rows = json.loads(run("--all", "--json").stdout)  # JSON: every cell, the same list of objects as before
    assert len(rows) == 60 and {"cell_id", "run_id", "state", "run_state"} <= set(rows[0])
    assert [c["cell_id"] for c in json.loads(run("--since", "2026-01-01T00:00:00Z", "--until",
                                                 "2026-01-02", "--json").stdout)] == []
    last = json.loads(run("--since", f"{86400 - 60 * 58}s", "--json").stdout)  # the last two, by their window
    assert [c["cell_id"] for c in last] == ["c58", "c59"]
    bad = run("--since", "yesterday")
    assert bad.exit_code == 125 and bad.output.count("\n") == 1 and "--since: 'yesterday'" in bad.output
