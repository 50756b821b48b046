"""What a Supervisor cell's end does after its result (supervisor._after_result, issue 29's fifth round): the cell's
mount namespace, held by its waiter so that the leader's exit does not wait for its teardown, is let go there, and a
change layer the cell left unchanged is removed there. Nothing of it may leak, and a controller killed between the
result and that work leaves only what the next janitor removes (crash point `after_result`).

Checked to fail: without the let-go (`Waiter.let_go` doing nothing) the first test finds the cells' mount
namespaces still held; with the unchanged layer's pending marker removed before the result (the layer then
unknown to the janitor) the crash test finds the layer left after the janitor. The daemon test guards the end's
property around the early reap of a PID namespace's init (not seen failing: what gives it, the namespace and the
cgroup's kill, is not what this change touches)."""
import json
import os
import signal
import subprocess
import sys
import threading

import pytest

from agnsup.linux import proc
from agnsup.supervisor import Supervisor
from conftest import procs_with_env, skip_unless_capturable
from scenario import alive, held_mount_namespaces, wait_for


def _cell_thread_ended(cell_id: str) -> bool:
    return not any(t.name == f"cell-{cell_id}" for t in threading.enumerate())


def test_a_cells_mount_namespace_is_held_while_it_runs_and_let_go_after_its_result(state, worktree):
    if os.geteuid() != 0:
        pytest.skip("ENV_BLOCKED: root (a normal user may not open the init's /proc/PID/ns: it is not dumpable)")
    with Supervisor(state) as sup:
        h = sup.spawn(["sleep", "30"], workdir=worktree, cell_id="held")
        assert len(held_mount_namespaces()) == 1  # the running cell's own (its waiter's hold)
        sup.signal(h["run_id"], "held", "KILL")
        assert sup.wait(h["run_id"], "held", 30)["state"] == "killed"
        for i in range(3):  # and cells of `true`, which may end before the hold (then nothing is held)
            h = sup.spawn(["true"], workdir=worktree, cell_id=f"t{i}")
            assert sup.wait(h["run_id"], f"t{i}", 30)["exit_code"] == 0
        wait_for(lambda: all(_cell_thread_ended(c) for c in ("held", "t0", "t1", "t2")), 10, "the cells' threads")
        assert held_mount_namespaces() == set()


def test_a_daemon_the_command_left_is_dead_before_the_result_though_the_leader_is_reaped_early(state, worktree):
    """finish asks the fork server to reap a PID namespace's init before the rest of the tree is stopped (its pid
    no longer kept as evidence): a daemon in a session of its own that ignores TERM and HUP must still be dead
    when the result comes, and the command's own status reported. (The kernel's PID namespace and the cgroup's
    kill guarantee it; the test keeps them from being traded away for the early reap.)"""
    with Supervisor(state) as sup:
        h = sup.spawn(["sh", "-c", "setsid sh -c 'trap \"\" TERM HUP; exec sleep 300' & sleep 1; exit 3"],
                      workdir=worktree, cell_id="daemon")

        def sleeps():  # (host pid, start time) of the daemon's `sleep 300` and the command's `sleep 1`
            return [(p, st.starttime) for p in procs_with_env("AGNSUP_CELL_ID", "daemon")
                    if (st := proc.stat(p)) is not None and st.comm == "sleep"]
        seen = wait_for(lambda: len(sleeps()) == 2 and sleeps(), 10, "the daemon and the command's sleep")
        res = sup.wait(h["run_id"], "daemon", 30)
        assert (res["state"], res["exit_code"]) == ("exited", 3), res
        assert seen and not any(alive(p, t) for p, t in seen), seen
        assert procs_with_env("AGNSUP_CELL_ID", "daemon") == []


CRASHING = """import json, sys, time
from agnsup.supervisor import Supervisor
sup = Supervisor(sys.argv[1])
h = sup.spawn(["true"], workdir=sys.argv[2], cell_id="c1")
print(json.dumps(sup.wait(h["run_id"], "c1", 30)), flush=True)
time.sleep(60)  # the cell's thread kills the process at after_result
"""


def test_a_supervisor_killed_after_a_result_leaves_its_unchanged_layer_to_the_janitor(agnsup, state, worktree,
                                                                                    tmp_path):
    skip_unless_capturable(str(tmp_path))  # (the state root is in it)
    p = subprocess.run([sys.executable, "-c", CRASHING, state, worktree],
                       env={**agnsup.env, "AGNSUP_TEST_CRASH_AT": "after_result"}, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == -signal.SIGKILL, p.stdout + p.stderr
    # what precedes the result is durable: the receipt and the conclusion, the changes section included
    rows = [c for c in agnsup.json("ps", "--all", "--json") if c["cell_id"] == "c1"]
    assert len(rows) == 1 and rows[0]["state"] == "exited", rows
    with open(os.path.join(state, "cells", rows[0]["run_id"], "c1", "receipt.json")) as f:
        receipt = json.load(f)
    assert receipt["changes"]["files"] == 0 and receipt["changes"]["mode"] == "at_exit", receipt["changes"]
    layer = os.path.join(state, "changes", rows[0]["run_id"], "c1")
    marker = os.path.join(state, "changes", "pending", f"{rows[0]['run_id']}+c1")
    assert os.path.isdir(os.path.join(layer, "upper"))  # the window was hit: the layer is still there
    rep = agnsup.json("janitor", "--json")
    assert not os.path.exists(layer) and not os.path.exists(marker), rep
    assert [(c["record_id"], c["action"]) for c in rep.get("changes", [])] == [("c1", "empty")], rep
    again = agnsup.json("janitor", "--json")
    assert not again.get("changes") and again["recovered"] == [], again
