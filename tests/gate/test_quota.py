"""Run quotas (quota.*): the pure decision, and real cells counted by the journal."""
import json
import os
import sqlite3
import subprocess
import time

import pytest

from agnsup.gate import GateContext, check
from agnsup.gate.quota import Usage, decide

ENV = '[env]\npath = ["/usr/bin", "/bin"]\n'


def quota_role(policy_dir, name, **quota):
    lines = "".join(f"{k} = {v}\n" for k, v in quota.items())
    (policy_dir / f"{name}.toml").write_text(f'[role]\nname = "{name}"\n{ENV}[quota]\n{lines}')


def usage(cells=0, run=0, agent=0, age=None):
    return Usage(cells_in_run=cells, live_in_run=run, live_of_agent=agent, run_age=age)


@pytest.mark.parametrize("limits,use,rule", [
    ({"max_cells_per_run": 3}, usage(cells=3), "quota.cells_per_run"),
    ({"max_cells_per_run": 3}, usage(cells=2), "quota.pass"),
    ({"max_concurrent_per_run": 2}, usage(cells=9, run=2, agent=0), "quota.concurrent_run"),
    ({"max_concurrent_per_run": 2}, usage(cells=9, run=1, agent=1), "quota.pass"),
    ({"max_concurrent_per_agent": 1}, usage(run=1, agent=1), "quota.concurrent_agent"),
    ({"max_concurrent_per_agent": 1}, usage(run=5, agent=0), "quota.pass"),
    ({"max_run_seconds": 60}, usage(age=61.0), "quota.run_wall_time"),
    ({"max_run_seconds": 60}, usage(age=59.0), "quota.pass"),
    ({"max_run_seconds": 60}, usage(age=None), "quota.pass"),
])
def test_each_quota_denies_at_its_limit_and_passes_below_it(limits, use, rule):
    assert decide(tuple(limits.items()), use, "r").rule == rule


def test_a_quota_denial_names_the_policy_key_to_change():
    f = decide((("max_concurrent_per_agent", 1),), usage(run=1, agent=1), "ci", "r1", "a1")
    assert not f.allowed and "agent 'a1'" in f.reason and "quota.max_concurrent_per_agent" in f.hint
    assert "role 'ci'" in f.hint


def test_without_the_journal_only_a_limit_of_zero_is_judged():
    assert decide((("max_cells_per_run", 0),), None, "r").rule == "quota.cells_per_run"
    f = decide((("max_cells_per_run", 5), ("max_run_seconds", 60)), None, "r")
    assert f.allowed and f.rule == "quota.unjudged"
    assert "max_cells_per_run=5" in f.reason and "max_run_seconds=60" in f.reason


def test_the_gate_reports_unjudged_quotas_in_the_trail_and_keeps_the_zone_verdict():
    ctx = GateContext(worktree="/w", writable=("/",), quota=(("max_concurrent_per_agent", 1),))
    d, trail = check("run_process", {"argv": ["true"]}, ctx)
    assert d.allowed and d.rule == "allow.yellow_open"
    assert trail[-1]["check"] == "quota" and trail[-1]["rule"] == "quota.unjudged"


def test_the_gate_judges_quotas_when_the_caller_gives_it_the_usage():
    ctx = GateContext(worktree="/w", writable=("/",), quota=(("max_cells_per_run", 2),), usage=usage(cells=2))
    d, _ = check("run_shell", {"command": "make"}, ctx)
    assert (d.allowed, d.rule, d.check) == (False, "quota.cells_per_run", "quota")


def test_quotas_do_not_apply_to_tools_that_start_no_cell():
    ctx = GateContext(worktree="/w", writable=("/",), quota=(("max_cells_per_run", 0),))
    assert check("read_file", {"path": "/w/a"}, ctx)[0].allowed
    assert check("write_file", {"path": "/w/a"}, ctx)[0].allowed
    assert check("run_process", {"argv": ["true"]}, ctx)[0].rule == "quota.cells_per_run"


def test_agnsup_check_denies_a_role_whose_quota_is_zero(agnsup, worktree, policy_dir):
    quota_role(policy_dir, "none", max_cells_per_run=0)
    cp = agnsup("check", "--role", "none", "--workdir", worktree, "--", "true",
                env={"AGNSUP_POLICY_DIR": str(policy_dir)}, check=126)
    assert "quota.cells_per_run" in cp.out and "max_cells_per_run" in cp.out


def test_agnsup_check_says_which_quotas_it_cannot_judge(agnsup, worktree, policy_dir):
    quota_role(policy_dir, "one", max_concurrent_per_agent=1)
    cp = agnsup("check", "--role", "one", "--workdir", worktree, "--json", "--", "true",
                env={"AGNSUP_POLICY_DIR": str(policy_dir)}, check=0)
    q = [t for t in json.loads(cp.out)["trail"] if t["check"] == "quota"]
    assert q and q[0]["rule"] == "quota.unjudged" and "max_concurrent_per_agent=1" in q[0]["reason"]


# -- real cells ------------------------------------------------------------

def _dirs(tmp_path, n):
    out = []
    for i in range(n):
        d = tmp_path / f"wt{i}"
        d.mkdir()
        out.append(str(d))
    return out


def _wait_running(state, cell, deadline=60):
    db = os.path.join(state, "journal.db")
    end = time.time() + deadline
    while time.time() < end:
        if os.path.exists(db):
            c = sqlite3.connect(db, timeout=30)
            try:
                row = c.execute("SELECT state FROM cells WHERE cell_id=?", (cell,)).fetchone()
            except sqlite3.OperationalError:
                row = None
            finally:
                c.close()
            if row and row[0] == "running":
                return
        time.sleep(0.05)
    raise AssertionError(f"cell {cell} never reached running")


def _denied_events(state):
    c = sqlite3.connect(os.path.join(state, "journal.db"))
    try:
        return [json.loads(r[0]) for r in c.execute("SELECT data FROM events WHERE kind='denied' ORDER BY id")]
    finally:
        c.close()


def _cells(state):
    c = sqlite3.connect(os.path.join(state, "journal.db"))
    try:
        return {r[0]: r[1] for r in c.execute("SELECT cell_id, state FROM cells")}
    finally:
        c.close()


def _stop(p):
    try:
        p.wait(timeout=120)
    finally:
        if p.poll() is None:
            p.terminate()  # our own controller: it cancels its cell
            p.wait(timeout=60)


def test_a_second_concurrent_cell_of_one_agent_is_denied_and_another_agents_cell_starts(
        agnsup, state, policy_dir, tmp_path):
    env = {"AGNSUP_POLICY_DIR": str(policy_dir)}
    quota_role(policy_dir, "solo", max_concurrent_per_agent=1)
    w = _dirs(tmp_path, 3)
    gate = os.path.join(w[0], "release")
    # live: the cell waits for a file the host creates in its worktree (a capturing cell's overlay
    # need not see the lower layer change under it)
    first = agnsup.popen("run", "--role", "solo", "--agent", "a", "--cell", "c1", "--workdir", w[0],
                         "--changes", "live", "--",
                         "sh", "-c", f"while [ ! -e {gate} ]; do sleep 0.05; done", env=env)
    try:
        _wait_running(state, "c1")
        cp = agnsup("run", "--role", "solo", "--agent", "a", "--cell", "c2", "--workdir", w[1], "--", "true",
                    env=env, check=126)
        assert "quota.concurrent_agent" in cp.err and "quota.max_concurrent_per_agent" in cp.err
        agnsup("run", "--role", "solo", "--agent", "b", "--cell", "c3", "--workdir", w[2], "--", "true",
               env=env, check=0)
    finally:
        open(gate, "w").close()
        _stop(first)
    assert first.returncode == 0
    cells = _cells(state)
    assert cells == {"c1": "exited", "c3": "exited"}  # the denied call left no cell row
    (ev,) = _denied_events(state)
    assert ev["decision"]["rule"] == "quota.concurrent_agent" and ev["argv"] == ["true"]
    assert ev["trail"][-1]["check"] == "quota"
    # once the first cell ended, the same agent may start again
    agnsup("run", "--role", "solo", "--agent", "a", "--cell", "c4", "--workdir", w[1], "--", "true",
           env=env, check=0)


def test_a_run_starts_no_more_cells_than_its_quota_and_another_run_is_not_affected(agnsup, state, policy_dir,
                                                                                    worktree):
    env = {"AGNSUP_POLICY_DIR": str(policy_dir)}
    quota_role(policy_dir, "two", max_cells_per_run=2)
    for _ in range(2):
        agnsup("run", "--role", "two", "--run-id", "r1", "--workdir", worktree, "--", "true", env=env, check=0)
    cp = agnsup("run", "--role", "two", "--run-id", "r1", "--workdir", worktree, "--", "true", env=env, check=126)
    assert "quota.cells_per_run" in cp.err and "run 'r1' has started 2 cells" in cp.err
    agnsup("run", "--role", "two", "--run-id", "r2", "--workdir", worktree, "--", "true", env=env, check=0)


def test_a_run_past_its_wall_time_starts_no_new_cell(agnsup, state, policy_dir, worktree):
    env = {"AGNSUP_POLICY_DIR": str(policy_dir)}
    quota_role(policy_dir, "brief", max_run_seconds=1)
    agnsup("run", "--role", "brief", "--run-id", "r1", "--workdir", worktree, "--", "true", env=env, check=0)
    time.sleep(1.2)
    cp = agnsup("run", "--role", "brief", "--run-id", "r1", "--workdir", worktree, "--", "true", env=env, check=126)
    assert "quota.run_wall_time" in cp.err and "max_run_seconds" in cp.err


def test_cells_racing_for_the_last_slot_of_a_run_get_exactly_one_start(agnsup, state, policy_dir, tmp_path):
    """Four controllers start at once with max_concurrent_per_run = 1: the
    count happens inside BEGIN IMMEDIATE, so exactly one cell runs."""
    env = {"AGNSUP_POLICY_DIR": str(policy_dir)}
    quota_role(policy_dir, "single", max_concurrent_per_run=1)
    w = _dirs(tmp_path, 4)
    # the release file lies in each worktree: a cell sees its worktree, not the host's /tmp (live: a
    # capturing cell's overlay need not see what the host adds to the worktree under it)
    procs = [agnsup.popen("run", "--role", "single", "--agent", f"a{i}", "--cell", f"c{i}", "--workdir", w[i],
                          "--changes", "live", "--", "sh", "-c", "while [ ! -e release ]; do sleep 0.05; done", env=env,
                          stderr=subprocess.PIPE) for i in range(4)]
    try:
        # every loser exits 126 on its own; the winner waits for the release file
        end = time.time() + 120
        while sum(p.poll() is not None for p in procs) < 3 and time.time() < end:
            time.sleep(0.05)
    finally:
        for d in w:
            open(os.path.join(d, "release"), "w").close()
        for p in procs:
            _stop(p)
    codes = sorted(p.returncode for p in procs)
    errs = [p.stderr.read().decode() for p in procs]
    for p in procs:
        p.stderr.close()
    assert codes == [0, 126, 126, 126], errs
    assert sum("quota.concurrent_run" in e for e in errs) == 3
    assert list(_cells(state).values()) == ["exited"]
