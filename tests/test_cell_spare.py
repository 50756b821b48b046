"""A Supervisor's spare cell (process/cellspare.py, issue 29's seventh round): after a cell of run R / agent A, the
next one's cgroup directories and a leader born in them, parked after its plan-independent steps; a request of R/A
that names no cell id takes it, anything else discards it, and a dead controller's spare leaves only an empty
directory, which the janitor removes.

Checked to fail: without the parent-death signal in steps.park (its `_pdeathsig` call removed) the parked leader
outlives its SIGKILLed fork server (the test times out; a SIGKILLed controller's spare dies all the same, of the EOF
on its socketpair, whose other end died with the controller: two ties, the test of the killed controller passes
with either one); without the fd
closing in steps.park the parked leader holds the fork server's descriptors of another running cell (its reap
channel, its leader's pidfd: the carry test); with the janitor's sweep not given `journaled` (janitor._sweep_held)
the dead controller's spare directory stays; with it removing cell directories without rmdir's refusal of a
populated one (a recursive kill-and-remove), the live controller's spare is gone and the next cell is not its."""
import glob
import json
import os
import select
import signal
import subprocess
import sys

import pytest

from agnsup import janitor
from agnsup.supervisor import Supervisor
from scenario import wait_for


def _spare(sup, run="r", agent="default"):
    wait_for(lambda: (run, agent) in sup.ctl.cell_spares._ready, what="a spare cell made after the result")
    return sup.ctl.cell_spares._ready[(run, agent)]


def _exited(pid_or_fd, timeout=30.0) -> bool:
    fd = os.pidfd_open(pid_or_fd) if pid_or_fd > 0 else -pid_or_fd
    try:
        return bool(select.select([fd], [], [], timeout)[0])
    finally:
        if pid_or_fd > 0:
            os.close(fd)


def _status(pid: int) -> dict:
    with open(f"/proc/{pid}/status") as f:
        return {k: v.strip() for k, _, v in (line.partition(":") for line in f)}


def _parked(pid: int) -> bool:
    """The leader waits in recvmsg (47 on x86_64) or read (0) on its socketpair, with its default signals: the end of
    steps.park (a system call number alone could be one of the steps before: the signals say it is past them)."""
    with open(f"/proc/{pid}/syscall") as f:
        call = f.read().split()[0]
    return call in ("0", "45", "47") and int(_status(pid)["SigCgt"], 16) == 0


def _procs(d: str) -> str:
    with open(os.path.join(d, "cgroup.procs")) as f:
        return f.read()


def test_a_request_naming_no_cell_id_takes_its_agents_spare_cgroup_and_leader(state, worktree):
    with Supervisor(state) as sup:
        assert sup.run(["true"], workdir=worktree, run_id="r")["exit_code"] == 0
        sp = _spare(sup)
        cell_id, pid, v2 = sp.cell_id, sp.pid, sp.place.node.paths["v2"]
        inode = os.stat(v2).st_ino
        h = sup.spawn(["sh", "-c", "grep -c . /proc/self/cgroup"], workdir=worktree, run_id="r", capture=True)
        assert h["cell_id"] == cell_id and h["pid"] == pid and h["cgroup"] == v2
        res = sup.wait("r", cell_id, timeout=30)
        assert res["exit_code"] == 0, res
        rec = sup.receipt("r", cell_id)
        assert rec["cgroup_inode"] == inode  # the made-ahead directory's, journaled as any cell's
        assert sup.ctl.journal.cell("r", cell_id)["cgroup_ino"] == inode
        assert rec["isolation"]["cgroup_join"].startswith("clone3(CLONE_INTO_CGROUP)")
        # another agent, or a request that names its cell: made as without a spare, the spare left for R/A
        sp2 = _spare(sup)
        other = sup.run(["true"], workdir=worktree, run_id="r", agent_id="b")
        named = sup.run(["true"], workdir=worktree, run_id="r", cell_id="named")
        assert other["exit_code"] == named["exit_code"] == 0
        assert sp2.cell_id not in (other["cell_id"], named["cell_id"])
        assert sup.ctl.cell_spares._ready.get(("r", "default")) is sp2 and not _exited(sp2.pid, 0)


def test_a_spare_that_does_not_fit_is_discarded_and_its_leader_never_runs_anything(state, worktree, monkeypatch):
    from agnsup.process import cellspare
    with Supervisor(state) as sup:
        sup.run(["true"], workdir=worktree, run_id="r")
        sp = _spare(sup)
        fd, v2 = os.pidfd_open(sp.pid), sp.place.node.paths["v2"]
        try:
            monkeypatch.setattr(cellspare.Spare, "fits", lambda self, plan, place: False)  # another key
            res = sup.run(["true"], workdir=worktree, run_id="r")
            assert res["exit_code"] == 0 and res["cell_id"] == sp.cell_id  # its id, a cgroup made on the path
            assert _exited(-fd)
        finally:
            os.close(fd)
        wait_for(lambda: not os.path.exists(v2) or sup.receipt("r", sp.cell_id), what="the cell concluded")


def test_the_gate_decides_before_a_spare_is_bound_and_a_denied_request_discards_it(state, worktree):
    from agnsup.errors import AgnsupError
    with Supervisor(state) as sup:
        sup.run(["true"], workdir=worktree, run_id="r")
        sp = _spare(sup)
        leader, v2 = os.pidfd_open(sp.pid), sp.place.node.paths["v2"]
        try:
            with pytest.raises(AgnsupError) as e:  # hardline: a database drop (sqlite3 need not exist: never run)
                sup.run(["sqlite3", "db", "drop table t"], workdir=worktree, run_id="r")
            assert e.value.details.get("decision") or "denied" in str(e.value).lower(), e.value
            assert _exited(-leader), "the spare of a denied request was kept"
        finally:
            os.close(leader)
        wait_for(lambda: not os.path.exists(v2), what="its directories removed")
        res = sup.run(["true"], workdir=worktree, run_id="r")
        assert res["exit_code"] == 0 and res["cell_id"] != sp.cell_id, res


def test_a_taken_spares_command_never_runs_before_its_identity_is_journaled(state, worktree, monkeypatch):
    from agnsup.errors import StateError
    with Supervisor(state) as sup:
        sup.run(["true"], workdir=worktree, run_id="r")
        sp = _spare(sup)
        mark, leader = os.path.join(worktree, "ran"), os.pidfd_open(sp.pid)

        def refused(cell):  # the identity's transaction fails (a full disk): the barrier must never open
            assert cell.child.pid == sp.pid and not _exited(-leader, 0.2) and not os.path.exists(mark)
            raise StateError("the identity could not be journaled")
        monkeypatch.setattr(sup.ctl, "_identity", refused)
        try:
            with pytest.raises(StateError):
                sup.run(["touch", mark], workdir=worktree, run_id="r")
            assert _exited(-leader) and not os.path.exists(mark)
        finally:
            os.close(leader)
        assert sup.ctl.journal.cell("r", sp.cell_id)["state"] == "failed"


def test_a_spare_whose_leader_died_is_not_taken(state, worktree):
    with Supervisor(state) as sup:
        sup.run(["true"], workdir=worktree, run_id="r")
        sp = _spare(sup)
        v2 = sp.place.node.paths["v2"]
        with open(os.path.join(v2, "cgroup.kill"), "w") as f:  # as a cancel of its agent would: our own cgroup
            f.write("1")
        assert _exited(sp.pid)
        res = sup.run(["true"], workdir=worktree, run_id="r")
        assert res["exit_code"] == 0, res
        wait_for(lambda: not os.path.exists(v2) or res["cell_id"] != sp.cell_id, what="the dead spare discarded")


def test_a_parked_leader_holds_nothing_of_another_cell(state, worktree):
    with Supervisor(state) as sup:
        sup.run(["true"], workdir=worktree, run_id="r")
        sp = _spare(sup)
        sup.ctl.cell_spares._ready.clear()  # made again below, while another cell runs in the fork server
        sp.discard()
        h = sup.spawn(["sleep", "300"], workdir=worktree, run_id="r", cell_id="running")
        try:
            sup.ctl.cell_spares.refill(sup._cells[("r", "running")].cell.plan)
            sp = sup.ctl.cell_spares._ready[("r", "default")]
            # parked: blocked on its socketpair after steps.park (its signal dispositions say nothing: the server
            # may catch none, so they read "default" before the fds are closed; a loaded CI host caught that)
            wait_for(lambda: _parked(sp.pid), 60, "the spare leader parked")
            fds = sorted(int(n) for n in os.listdir(f"/proc/{sp.pid}/fd"))
            # fds 0-2 (the server's stdio, replaced by the cell's), its socketpair, the server's pidfd: nothing else
            links = [os.readlink(f"/proc/{sp.pid}/fd/{n}") for n in fds[3:]]
            assert len(fds) == 5 and fds[:3] == [0, 1, 2], (fds, links)
            assert any(x.startswith("socket:") for x in links) and "anon_inode:[pidfd]" in links, links
            assert os.stat(sp.place.node.paths["v2"]).st_ino != os.stat(h["cgroup"]).st_ino
        finally:
            sup.signal("r", "running", "KILL")
            sup.wait("r", "running", timeout=30)
        res = sup.run(["sh", "-c", "ls /proc/self/fd"], workdir=worktree, run_id="r", capture=True)
        assert res["cell_id"] == sp.cell_id and res["stdout"].split() == ["0", "1", "2", "3"], res


def test_a_cleanup_of_the_run_kills_a_live_supervisors_spare_and_leaves_none_of_the_runs_directories(state, worktree):
    from agnsup import cancel
    from agnsup.store.state import StateRoot
    with Supervisor(state) as sup:
        sup.run(["true"], workdir=worktree, run_id="r")
        sp = _spare(sup)
        paths = list(sp.place.node.paths.values())
        out = cancel.cleanup(StateRoot(state), "r")
        assert {it["path"] for it in out["items"] if it["kind"] == "cgroup"} >= set(paths)
        assert _exited(sp.pid)
        # no cell's directory is left (the Supervisor's pod lingers a moment in run-r: agnsup/pod.py)
        assert not any(os.path.exists(d) for d in paths), paths
        runs = {os.path.dirname(os.path.dirname(p)) for p in paths}
        assert not [c for run in runs for c in glob.glob(os.path.join(run, "agent-*", "cell-*"))]


def test_a_cancel_of_the_agent_kills_its_spare_and_still_kills_the_scope_at_once(state, worktree):
    from agnsup import cancel
    from agnsup.store.state import StateRoot
    with Supervisor(state) as sup:
        sup.run(["true"], workdir=worktree, run_id="r")
        sp = _spare(sup)
        paths = list(sp.place.node.paths.values())
        h = sup.spawn(["sleep", "300"], workdir=worktree, run_id="r", cell_id="long")
        assert h["cell_id"] != sp.cell_id

        def running() -> bool:  # a cell still starting is the starter's to kill (no kill in the cancel's answer)
            with sup.ctl.journal.lock:
                return sup.ctl.journal.cell("r", "long")["state"] == "running"
        wait_for(running, 30, "the long cell running")
        out = cancel.cancel(StateRoot(state), cancel.Scope("agent", "r", "default", None), 0.0, by="test")
        assert _exited(sp.pid) and not any(os.path.exists(p) for p in paths)
        (c,) = out["cells"]
        assert c["cell_id"] == "long" and " on " in c["kill"], c  # one kill of the agent's directory (reaper._covers)
        assert sup.wait("r", "long", timeout=30)["state"] == "cancelled"


def test_a_spare_leader_dies_with_its_fork_server(state, worktree):
    with Supervisor(state) as sup:
        sup.run(["true"], workdir=worktree, run_id="r")
        sp = _spare(sup)
        os.kill(sup._forker.server.pid, signal.SIGKILL)  # our own Supervisor's server
        assert _exited(sp.pid), "the parked leader outlived its fork server"
        res = sup.run(["true"], workdir=worktree, run_id="r")  # not taken: a new server, a new leader
        assert res["exit_code"] == 0, res


_CONTROLLER = """
import json, sys, time
from agnsup.supervisor import Supervisor
sup = Supervisor(sys.argv[1])
sup.run(["true"], workdir=sys.argv[2], run_id="r")
while ("r", "default") not in sup.ctl.cell_spares._ready:
    time.sleep(0.01)
sp = sup.ctl.cell_spares._ready[("r", "default")]
print(json.dumps({"pid": sp.pid, "cell_id": sp.cell_id, "paths": sp.place.node.paths}), flush=True)
time.sleep(300)
"""


def test_a_killed_controllers_spare_dies_and_the_janitor_removes_its_empty_directory(state, worktree):
    p = subprocess.Popen([sys.executable, "-c", _CONTROLLER, state, worktree], stdout=subprocess.PIPE, text=True)
    try:
        got = json.loads(p.stdout.readline())
        leader = os.pidfd_open(got["pid"])
    finally:
        p.kill()  # SIGKILL: no close, no discard
        p.wait()
        p.stdout.close()
    try:
        assert _exited(-leader), "the parked leader outlived its SIGKILLed controller"
    finally:
        os.close(leader)
    paths = got["paths"]
    wait_for(lambda: all(os.path.isdir(d) and not _procs(d) for d in paths.values()), what="an empty cell directory")
    with Supervisor(state) as sup:  # its start runs the janitor (a controller died)
        assert sup.ctl.journal.cell("r", got["cell_id"]) is None
        assert not any(os.path.exists(d) for d in paths.values()), paths


def test_the_janitor_never_removes_a_live_controllers_spare(state, worktree):
    with Supervisor(state) as sup:
        sup.run(["true"], workdir=worktree, run_id="r")
        sp = _spare(sup)
        janitor.run_janitor(state)
        assert all(os.path.isdir(d) for d in sp.place.node.paths.values())
        assert not _exited(sp.pid, 0)
        res = sup.run(["true"], workdir=worktree, run_id="r")
        assert res["exit_code"] == 0 and res["cell_id"] == sp.cell_id, res


def test_a_door_that_names_its_cells_gets_its_agents_spare_under_the_id_it_asks_for_next(state, worktree):
    """sandboxd names its cells p-1, p-2, ...: Supervisor.name_next_cells makes the agent's spare under the id its
    next request will name, and that request takes it; a spare whose number another request took first (the door
    asks for a later one) is discarded, and the next is made under the id the door says now. Checked to fail with
    offer() ignoring a named id (the named request is made without the spare)."""
    door = {"next": 2}  # as sandboxd's counter: its number is taken when a request starts
    with Supervisor(state) as sup:
        sup.name_next_cells("r", "default", lambda: f"n-{door['next']}")
        assert sup.run(["true"], workdir=worktree, run_id="r", cell_id="n-1")["exit_code"] == 0
        sp = _spare(sup)
        assert sp.cell_id == "n-2"
        pid, v2 = sp.pid, sp.place.node.paths["v2"]
        door["next"] = 3
        h = sup.spawn(["true"], workdir=worktree, run_id="r", cell_id="n-2")
        assert (h["cell_id"], h["pid"], h["cgroup"]) == ("n-2", pid, v2)  # the spare's leader and directory
        assert sup.wait("r", "n-2", timeout=30)["exit_code"] == 0
        wait_for(lambda: getattr(sup.ctl.cell_spares._ready.get(("r", "default")), "cell_id", None) == "n-3",
                 what="the next spare made under n-3")
        stale = sup.ctl.cell_spares._ready[("r", "default")]
        stale_fd = os.pidfd_open(stale.pid)
        door["next"] = 5  # another request took n-3: this one names n-4
        res = sup.run(["true"], workdir=worktree, run_id="r", cell_id="n-4")
        assert res["exit_code"] == 0
        assert _exited(-stale_fd)  # discarded: its leader exits without exec
        os.close(stale_fd)
        wait_for(lambda: getattr(sup.ctl.cell_spares._ready.get(("r", "default")), "cell_id", None) == "n-5",
                 what="a spare made under the id the door asks for now")
