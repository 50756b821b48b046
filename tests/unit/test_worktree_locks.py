"""Worktree locks between agents (issue 28): an agent's own cells never wait for each other; another
agent's writer keeps a tree to itself, readers share; overlapping trees are one tree; `agnsup undo`
(a holder without an agent) is in everyone's way. Real flocks in a temporary directory, no root."""
import os

import pytest

from agnsup import locks
from agnsup.errors import LockTimeout


@pytest.fixture
def d(tmp_path):
    os.makedirs(tmp_path / "locks")
    return tmp_path


class Cells:
    """Cells' own lock files, as broker.Controller names and takes them."""

    def __init__(self, root):
        self.root, self.held = root, []

    def path(self, tree, run, cell):
        return os.path.join(self.root, "locks", locks.worktree_key(tree, run, cell) + ".lock")

    def take(self, tree, run, agent, cell, write=True):
        path = self.path(tree, run, cell)
        fd, who = locks.take(path, write, locks.owner_of(run, agent, cell), tree, locks.agent_of(run, agent))
        if fd is not None:
            self.held.append((path, fd))
        return fd, who

    def release_all(self):
        for path, fd in self.held:
            locks.release(path, fd)
        self.held = []


@pytest.fixture
def cells(d):
    c = Cells(str(d))
    yield c
    c.release_all()


def test_cells_of_one_agent_share_a_tree_they_write(cells, d):
    tree = str(d / "repo")
    assert cells.take(tree, "R", "A", "server")[0] is not None
    assert cells.take(tree, "R", "A", "curl")[0] is not None
    assert cells.take(tree + "/sub", "R", "A", "test", write=False)[0] is not None  # overlapping, its own: shared


def test_another_agents_writer_waits_and_is_told_who_holds_the_tree(cells, d):
    tree = str(d / "repo")
    cells.take(tree, "R", "A", "server")
    fd, who = cells.take(tree, "R", "B", "b1")
    assert fd is None and who == "cell server of run R, agent A"
    fd, who = cells.take(tree + "/sub", "R", "B", "b2", write=False)  # a reader of an overlapping tree too
    assert fd is None and who == f"cell server of run R, agent A, overlapping {tree}"
    fd, _ = cells.take(tree, "R2", "A", "a1")  # the same agent id in another run is another agent
    assert fd is None
    assert cells.take(str(d / "beside"), "R", "B", "b3")[0] is not None


def test_readers_of_two_agents_share_and_a_writer_of_a_third_waits_for_them(cells, d):
    tree = str(d / "repo")
    assert cells.take(tree, "R", "A", "a1", write=False)[0] is not None
    assert cells.take(tree, "R", "B", "b1", write=False)[0] is not None
    fd, who = cells.take(tree, "R", "C", "c1")
    assert fd is None and who in ("cell a1 of run R, agent A", "cell b1 of run R, agent B")


def test_an_agents_writer_waits_for_another_agents_reader(cells, d):
    tree = str(d / "repo")
    cells.take(tree, "R", "B", "b1", write=False)
    fd, who = cells.take(tree, "R", "A", "a1")
    assert fd is None and who == "cell b1 of run R, agent B"


def test_a_cell_that_could_not_take_the_lock_leaves_no_file_behind(cells, d):
    tree = str(d / "repo")
    cells.take(tree, "R", "A", "a1")
    assert cells.take(tree, "R", "B", "b1")[0] is None
    assert not os.path.exists(cells.path(tree, "R", "b1"))
    cells.release_all()
    assert os.listdir(d / "locks") == []


def test_a_lock_whose_holder_is_gone_is_in_nobodys_way(cells, d):
    tree = str(d / "repo")
    cells.take(tree, "R", "A", "a1")
    (path, fd), = cells.held
    os.close(fd)  # the kernel drops the flock as when the controller dies; its file stays
    cells.held = []
    assert cells.take(tree, "R", "B", "b1")[0] is not None


def test_undo_without_an_agent_is_in_every_agents_way_and_waits_for_each(cells, d):
    tree = str(d / "repo")
    undo_path = os.path.join(str(d), "locks", locks.worktree_key(tree) + ".lock")
    fd = locks.try_acquire(undo_path, True, "agnsup undo (pid 1)", tree=tree)
    assert fd is not None
    try:
        got, who = cells.take(tree, "R", "A", "a1", write=False)
        assert got is None and who == "agnsup undo (pid 1)"
    finally:
        locks.release(undo_path, fd)
    cells.take(tree, "R", "A", "a1", write=False)
    assert locks.try_acquire(undo_path, True, "agnsup undo (pid 1)", tree=tree + "/sub") is None


def test_a_calls_timeout_bounds_its_lock_wait_and_the_smaller_bound_wins():
    assert locks.wait_bound(None, None) == (None, "")
    assert locks.wait_bound(30, None) == (30, "lock_timeout")
    assert locks.wait_bound(None, 2) == (2, "timeout")
    assert locks.wait_bound(30, 2) == (2, "timeout")
    assert locks.wait_bound(1, 2) == (1, "lock_timeout")


def test_the_lock_timeout_names_the_holder_the_time_waited_and_what_bounded_it(cells, d):
    tree = str(d / "repo")
    cells.take(tree, "R", "A", "server")
    path = cells.path(tree, "R", "b1")
    heard = []
    with pytest.raises(LockTimeout) as e:
        locks.acquire(path, True, 0.05, f"worktree {tree}", locks.owner_of("R", "B", "b1"), heard.append, tree=tree,
                      agent=locks.agent_of("R", "B"), bound_by="timeout")
    assert heard == [f"agnsup: waiting for the worktree {tree} lock (held by cell server of run R, agent A)"]
    msg = e.value.message
    assert msg.startswith(f"the worktree {tree} lock is held by cell server of run R, agent A; gave up after 0.05 s")
    assert "timeout" in msg and "\n" not in msg
    assert e.value.details["holder"] == "cell server of run R, agent A" and e.value.details["waited"] >= 0.05
    assert not os.path.exists(path)


def test_commits_of_one_run_take_turns_and_leave_no_file(d):
    import fcntl
    run_dir = str(d / "changes" / "R")
    os.makedirs(run_dir)
    with locks.commit_mutex(run_dir):
        fd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            with pytest.raises(BlockingIOError):  # a second commit waits for the first
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
    assert os.listdir(run_dir) == []
    with locks.commit_mutex(str(d / "changes" / "gone")):  # no layer directory: nothing to order
        pass
