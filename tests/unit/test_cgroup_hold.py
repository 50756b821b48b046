"""A controller of many cells keeps the directories its cells hang from (CgroupBackend.hold): a cell's end removes
its own directories only; its agent's, run's and the base go when the agent is idle (HOLD_IDLE) or at let_go; the
janitor's sweep (sweep_ancestors) removes what a killed holder left, by scope_node's names only. Plain directories
stand in for the hierarchies (a cell without limits writes no control file; rmdir refuses a non-empty one as
cgroupfs refuses a cgroup with a child).

Checked to fail: with remove() pruning as before whatever the hold, the first test finds the agent's directories
gone after the first cell (and made again); with sweep_ancestors removing nothing, the sweep test fails."""
import os
import pickle
import time
from contextlib import contextmanager

from agnsup.backend import cgroups
from agnsup.backend.base import Place
from agnsup.backend.cgroups import CgroupBackend
from agnsup.linux import cgroup
from scenario import wait_for


def _backend(tmp_path):
    b = CgroupBackend.__new__(CgroupBackend)  # no host probe: each base a plain directory
    b.base = cgroup.Node({"v2": str(tmp_path / "v2" / "agnsup-x"), "memory": str(tmp_path / "memory" / "agnsup-x")})
    return b


@contextmanager
def _holding(tmp_path):
    """A backend that holds, let go at the end however the test went."""
    b = _backend(tmp_path)
    b.hold()
    try:
        yield b
    finally:
        b.let_go()


def _cell(b, cell, run="R", agent="A"):
    return b.create(Place(node=cgroup.cell_node(b.base, run, agent, cell, {})), {})


def _agent_dirs(b, run="R", agent="A"):
    return list(cgroup.scope_node(b.base, run, agent).paths.values())


def test_a_holding_backend_keeps_the_agents_directories_between_cells_and_removes_them_at_let_go(tmp_path):
    with _holding(tmp_path) as b:
        c1 = _cell(b, "c1")
        inodes = [os.stat(d).st_ino for d in _agent_dirs(b)]
        assert b.remove(c1) == list(c1.node.paths.values())  # the cell's own directories, in every hierarchy
        assert all(os.path.isdir(d) for d in _agent_dirs(b))
        c2 = _cell(b, "c2")
        assert [os.stat(d).st_ino for d in _agent_dirs(b)] == inodes  # the same directories: not made again
        b.remove(c2)
    assert not any(os.path.exists(p) for p in b.base.paths.values())


def test_without_a_hold_a_cells_end_removes_every_empty_directory_above_it(tmp_path):
    b = _backend(tmp_path)  # `agnsup run`: one cell, nothing kept
    b.remove(_cell(b, "c1"))
    assert not any(os.path.exists(p) for p in b.base.paths.values())


def test_an_idle_agents_directories_go_after_hold_idle_and_a_busy_agents_stay(tmp_path, monkeypatch):
    monkeypatch.setattr(cgroups, "HOLD_IDLE", 0.2)
    with _holding(tmp_path) as b:
        b.remove(_cell(b, "a1", agent="A"))
        busy = _cell(b, "b1", agent="B")  # agent B's cell still lives: its directories stay however long
        wait_for(lambda: not any(os.path.exists(d) for d in _agent_dirs(b, agent="A")), 10, "agent A's directories")
        time.sleep(0.3)
        assert all(os.path.isdir(d) for d in busy.node.paths.values())
        b.remove(busy)
        wait_for(lambda: not any(os.path.exists(p) for p in b.base.paths.values()), 10, "the base")


def test_a_pods_place_is_pruned_at_its_teardown_even_while_holding(tmp_path):
    with _holding(tmp_path) as b:
        pod = Place(node=cgroup.Node({"v2": os.path.join(cgroup.scope_node(b.base, "R").paths["v2"], "pod-A")}))
        b.create(pod, {})
        b.remove(pod)
        assert not os.path.exists(b.base.paths["v2"])  # the pod's end is its run's, when nothing else is there


def test_the_sweep_removes_empty_run_and_agent_directories_only(tmp_path):
    b = _backend(tmp_path)
    held = _backend(tmp_path)
    held.hold()
    held.remove(_cell(held, "c1", run="R1"))   # what a killed holder leaves: empty R1/A in both hierarchies
    held._held = None                           # (killed: no let_go)
    live = _cell(b, "c2", run="R2")            # a cell being made: its empty directory is never swept
    pod = os.path.join(cgroup.scope_node(b.base, "R2").paths["v2"], "pod-B")
    os.mkdir(pod)                              # nor a pod's place
    stranger = os.path.join(b.base.paths["memory"], "not-ours")
    os.mkdir(stranger)                         # nor a name the backend does not give
    removed = b.sweep_ancestors()
    assert sorted(removed) == sorted([*_agent_dirs(b, "R1"), *cgroup.scope_node(b.base, "R1").paths.values()])
    assert all(os.path.isdir(p) for p in [*live.node.paths.values(), pod, stranger])
    assert b.sweep_ancestors() == []


def test_a_spawn_request_carries_the_backend_without_its_hold(tmp_path):
    with _holding(tmp_path) as b:
        b.remove(_cell(b, "c1"))
        copy = pickle.loads(pickle.dumps(b))  # process/forkserver.py pickles the backend with the plan
        assert copy._held is None and copy.base == b.base


def test_a_holding_backend_makes_again_what_a_sweep_removed_under_it(tmp_path):
    with _holding(tmp_path) as b:
        b.remove(_cell(b, "c1"))
        assert b.sweep_ancestors()  # the janitor, while this controller lives: its kept directories go
        c2 = _cell(b, "c2")        # the cell's mkdir fails (ENOENT): the parents are made, then the cell
        assert all(os.path.isdir(p) for p in c2.node.paths.values())
        b.remove(c2)
    assert not any(os.path.exists(p) for p in b.base.paths.values())
