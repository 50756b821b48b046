"""A Supervisor's leader is born in its fork server (process/forkserver.py, issue 29, fourth round) by
clone3(CLONE_INTO_CGROUP), in its cgroup2 directory, and joins its v1 hierarchies itself through `tasks` (one
thread moving itself: the kernel skips its global cgroup_threadgroup_rwsem and so the RCU grace period a
cgroup.procs write waits for). Both the PID namespace's init (the leader) and the command are in the cell's
directory of every hierarchy its receipt names.

Checked to fail: with CgroupBackend.attach writing nothing to the v1 hierarchies for a leader that moves
itself, the memory, pids and cpu lines below name the controller's cgroup, not the cell's."""
import json

from agnsup.supervisor import Supervisor

def _lines(text: str) -> dict[str, str]:
    """/proc/PID/cgroup: {hierarchy: path}, v2 as "v2"."""
    out = {}
    for line in text.splitlines():
        _, ctrl, path = line.split(":", 2)
        for c in (ctrl.split(",") if ctrl else ["v2"]):
            out[c] = path
    return out


def test_a_forked_leader_and_its_command_are_in_every_hierarchy_of_their_cell(state, worktree):
    with Supervisor(state) as sup:
        r = sup.run(["cat", "/proc/self/cgroup", "/proc/1/cgroup"], workdir=worktree, run_id="joined", capture=True)
    assert r["exit_code"] == 0, r
    with open(r["receipt"]) as f:
        receipt = json.load(f)
    assert receipt["isolation"]["cgroup_join"].startswith("clone3"), receipt["isolation"]  # its single-threaded server
    text = r["stdout"]
    n = len(text.splitlines()) // 2
    command, init = (_lines("\n".join(text.splitlines()[:n])), _lines("\n".join(text.splitlines()[n:])))
    assert receipt["cgroup"], receipt
    for h, path in receipt["cgroup"].items():
        rel = path[path.index("/agnsup-"):]  # below the hierarchy's mount point, wherever that is
        assert command.get(h) == rel, (h, rel, text)
        assert init.get(h) == rel, (h, rel, text)
