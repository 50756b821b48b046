"""The directories a Supervisor's cells hang from (their agent's, run's and agnsup's base, in every hierarchy) stay
while its cells keep coming (backend/cgroups.py: hold), go at its close, and a Supervisor killed while it keeps them
leaves them to the janitor's sweep: nothing of the state root's cgroup tree is left in any hierarchy after it.

Checked to fail: with the janitor's sweep (janitor._sweep_held) taken out, the crash test finds the killed
Supervisor's empty agent, run and base directories after the janitor (on this hybrid host: in the v1 memory, pids
and cpu hierarchies and the v2 agent directory)."""
import json
import os
import signal
import subprocess
import sys

from agnsup.linux import cgroup
from agnsup.supervisor import Supervisor


def _base(state):
    return cgroup.base_node(cgroup.detect_layout(), state)


def _agent_dirs(state, run, agent):
    return [p for p in cgroup.scope_node(_base(state), run, agent).paths.values() if os.path.isdir(p)]


def _left(state):
    return [d for p in _base(state).paths.values() for d in cgroup.walk(p)]


def test_a_supervisor_keeps_its_cells_agent_directories_between_cells_and_removes_them_at_close(state, worktree):
    first: dict = {}
    with Supervisor(state) as sup:
        for i in range(3):
            h = sup.spawn(["true"], workdir=worktree, run_id="R", agent_id="A", cell_id=f"c{i}")
            assert sup.wait("R", f"c{i}", 30)["exit_code"] == 0
            kept = {d: os.stat(d).st_ino for d in _agent_dirs(state, "R", "A")}
            assert kept and not any(os.path.exists(p) for p in cgroup.scope_node(
                _base(state), "R", "A", f"c{i}").paths.values())  # the cell's own directories are gone
            first = first or kept
            assert kept == first, "the agent's directories were made again"
        assert h["cgroup"].startswith(tuple(kept))
    assert _left(state) == []


def test_agnsup_run_removes_its_cells_ancestors_at_its_end(agnsup, worktree, state):
    agnsup("run", "--run-id", "R", "--agent", "A", "--workdir", worktree, "--", "true")
    assert _left(state) == []


CRASHING = """import json, sys, time
from agnsup.supervisor import Supervisor
sup = Supervisor(sys.argv[1])
for agent in ("A", "B"):
    h = sup.spawn(["true"], workdir=sys.argv[2], run_id="R", agent_id=agent, cell_id="c" + agent)
    print(json.dumps(sup.wait("R", "c" + agent, 30)), flush=True)
time.sleep(60)
"""


def test_a_supervisor_killed_while_it_keeps_them_leaves_nothing_after_the_janitor(agnsup, state, worktree):
    p = subprocess.Popen([sys.executable, "-c", CRASHING, state, worktree], env=agnsup.env, stdout=subprocess.PIPE,
                         text=True)
    try:
        for _ in range(2):
            assert json.loads(p.stdout.readline())["exit_code"] == 0
        kept = _agent_dirs(state, "R", "A") + _agent_dirs(state, "R", "B")
        assert kept  # the window: both agents' directories kept, empty
    finally:
        p.kill()  # SIGKILL: no close, nothing let go
        p.wait(30)
        p.stdout.close()
    assert p.returncode == -signal.SIGKILL
    rep = agnsup.json("janitor", "--json")
    assert _left(state) == [], rep
    assert set(kept) <= {c["path"] for c in rep.get("cgroups", [])}, rep
    again = agnsup.json("janitor", "--json")
    assert "cgroups" not in again, again
