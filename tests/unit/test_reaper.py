"""The reaper over the fake backend: TERM, grace, the kill, verification, evidence, release."""
import os
import signal

import pytest

from agnsup import reaper
from agnsup.backend.base import Place

from fake_backend import FakeBackend, FakeKernel

CELL = "/fake/run-R/agent-A/cell-c1"


@pytest.fixture
def k():
    return FakeKernel()


def _cell(b, k, cell="c1", agent="A", **t):
    place = b.create(b.place("R", agent, cell, {}), {})
    return reaper.Target(run_id="R", cell_id=cell, place=place, **t)


def test_a_tree_that_obeys_sigterm_ends_within_the_grace_period_without_a_kill(k):
    b = FakeBackend(k)
    t = _cell(b, k)
    k.spawn(10, dir=CELL)
    k.spawn(11, dir=CELL)
    (r,) = reaper.stop(b, [t], term=True, grace=5.0)
    assert r.empty and r.method is None and r.signalled == 2 and r.left == [10, 11]
    assert b.kills == [] and all(p.signals == [signal.SIGTERM] for p in k.procs.values())


def test_a_tree_that_ignores_sigterm_is_killed_when_the_grace_period_ends(k):
    b = FakeBackend(k)
    t = _cell(b, k)
    k.spawn(10, dir=CELL, ignores_term=True)
    (r,) = reaper.stop(b, [t], term=True, grace=0.05)
    assert r.empty and r.method == "fake.kill" and b.kills == [CELL]
    assert k.procs[10].signals == [signal.SIGTERM, signal.SIGKILL]


def test_a_tree_that_survives_the_kill_is_reported_not_empty_with_the_cgroup_named(k):
    b = FakeBackend(k)
    t = _cell(b, k)
    k.spawn(10, dir=CELL, unkillable=True)
    (r,) = reaper.stop(b, [t])
    assert not r.empty and CELL in r.error and "still populated" in r.error


def test_without_a_term_request_the_rest_of_the_tree_is_killed_at_once(k):
    b = FakeBackend(k)
    t = _cell(b, k)
    k.spawn(10, dir=CELL)
    (r,) = reaper.stop(b, [t])
    assert r.method == "fake.kill" and k.procs[10].signals == [signal.SIGKILL]


def test_a_stop_that_need_not_list_the_tree_kills_it_all_the_same_without_reading_it_first(k, monkeypatch):
    """cancel's stop (list_left=False, issue 29): the tree is not read before its kill (~1,000 pids), and
    the kill still reaches every process in it and is verified."""
    b = FakeBackend(k)
    t = _cell(b, k)
    for pid in (10, 11, 12):
        k.spawn(pid, dir=CELL, ignores_term=True)
    listed = []  # how many kills had been written at each listing of the tree
    members = b.members
    monkeypatch.setattr(b, "populated", lambda place: bool(b._in(place.dir)))  # cgroup.events: no listing
    monkeypatch.setattr(b, "members", lambda place: listed.append(len(b.kills)) or members(place))
    (r,) = reaper.stop(b, [t], list_left=False)
    assert 0 not in listed and r.left == []
    assert r.empty and r.method == "fake.kill" and all(p.signals == [signal.SIGKILL] for p in k.procs.values())
    assert k.live() == []


def test_one_kill_of_the_scope_reaches_an_agent_whose_every_cell_is_cancelled(k):
    b = FakeBackend(k)
    t1, t2 = _cell(b, k, "c1"), _cell(b, k, "c2")
    k.spawn(10, dir=t1.place.dir, ignores_term=True)
    k.spawn(20, dir=t2.place.dir, ignores_term=True)
    scope = b.scope("R", "A")
    rs = reaper.stop(b, [t1, t2], term=True, grace=0.0, scope=scope)
    assert b.kills == ["/fake/run-R/agent-A"] and all(r.method == "fake.kill on /fake/run-R/agent-A" for r in rs)


def test_an_agent_directory_that_also_holds_a_cell_not_cancelled_is_killed_cell_by_cell(k):
    b = FakeBackend(k)
    t1, other = _cell(b, k, "c1"), _cell(b, k, "c2")
    k.spawn(10, dir=t1.place.dir)
    k.spawn(20, dir=other.place.dir)
    reaper.stop(b, [t1], scope=b.scope("R", "A"))
    assert b.kills == [t1.place.dir] and k.procs[20].alive


def test_without_a_tree_the_session_and_the_token_find_the_cell_and_nothing_else(k):
    b = FakeBackend(k, trees=False)
    k.spawn(50, start=100, token="tok")                      # the leader
    k.spawn(51, start=110, sid=50)                           # in the cell's session
    k.spawn(52, start=120, sid=52, token="tok")              # left the session, carries the token
    k.spawn(53, start=90, sid=53, token="tok")               # the token, but older than the cell: forged
    k.spawn(54, start=130, sid=54)                           # a stranger
    t = reaper.Target(run_id="R", cell_id="c1", place=Place(), token="tok", since=100,
                      leader={"pid": 50, "pidfd_ino": None, "starttime": 100})
    (r,) = reaper.stop(b, [t], exclude=(50,))
    assert sorted(x["pid"] for x in r.killed) == [51, 52] and r.method == reaper.EVIDENCE_KILL and r.empty
    assert k.procs[50].alive and k.procs[53].alive and k.procs[54].alive
    assert any(s["pid"] == 53 and "before the cell began" in s["reason"] for s in r.spared)
    assert all(p.signals[:2] == [signal.SIGSTOP, signal.SIGKILL] for p in (k.procs[51], k.procs[52]))


def test_a_reused_leader_pid_vouches_for_nobody_in_its_session(k):
    b = FakeBackend(k, trees=False)
    k.spawn(50, start=999)                  # pid 50 now belongs to someone else
    k.spawn(51, start=1000, sid=50)         # ... and its session
    t = reaper.Target(run_id="R", cell_id="c1", place=Place(), token="tok", since=100,
                      leader={"pid": 50, "pidfd_ino": None, "starttime": 100})
    (r,) = reaper.stop(b, [t], thorough=True)
    assert r.killed == [] and k.procs[50].alive and k.procs[51].alive
    assert {s["pid"] for s in r.spared} == {50, 51}


def test_thorough_recovery_names_the_evidence_of_every_process_it_kills(k):
    b = FakeBackend(k)
    t = _cell(b, k, token="tok", since=100, leader={"pid": 10, "pidfd_ino": None, "starttime": 100})
    k.spawn(10, start=100, dir=CELL)
    k.spawn(11, start=105, sid=11, token="tok")        # outside the tree: token + start time
    plans = []
    (r,) = reaper.stop(b, [t], thorough=True, on_plan=plans.append)
    by = {x["pid"]: x for x in r.killed}
    assert by[10]["via"] == "cgroup" and "member of the cell's cgroup" in by[10]["evidence"][0]
    assert by[11]["via"] == "single" and "ownership token" in by[11]["evidence"][0]
    assert all(x["verified_dead"] for x in r.killed) and r.empty
    assert plans and {p for t_, cands in plans[0] for p in cands} == {10, 11}  # journaled before the kill


def test_an_excluded_pid_is_never_signalled(k):
    b = FakeBackend(k, trees=False)
    k.spawn(50, start=100, token="tok")
    t = reaper.Target(run_id="R", cell_id="c1", place=Place(), token="tok", since=100,
                      leader={"pid": 50, "pidfd_ino": None, "starttime": 100})
    reaper.stop(b, [t], term=True, grace=0.0, exclude=(50,))
    assert k.procs[50].signals == []


def test_release_removes_the_tree_the_temp_dir_and_a_free_lock_file(k, tmp_path):
    b = FakeBackend(k)
    tmpdir = tmp_path / "tmp"
    (tmpdir / "deep" / "er").mkdir(parents=True)
    lock = tmp_path / "wt.lock"
    lock.write_text("x")
    t = _cell(b, k, tmpdir=str(tmpdir), lock_path=str(lock))
    kinds = [x["kind"] for x in reaper.release(b, t)]
    assert kinds == ["cgroup", "tmpdir", "worktree_lock"]
    assert CELL not in k.dirs and not tmpdir.exists() and not lock.exists()
    assert reaper.release(b, t) == []  # idempotent: what is gone is skipped


def test_a_lock_a_live_process_holds_is_left_alone(tmp_path):
    import fcntl
    from agnsup import locks
    lock = tmp_path / "held.lock"
    fd = os.open(lock, os.O_CREAT | os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        assert locks.remove_if_free(str(lock))["left"] == "held by a live process" and lock.exists()
    finally:
        os.close(fd)


def test_reap_releases_only_what_is_verified_empty(k, tmp_path):
    b = FakeBackend(k)
    (tmp_path / "tmp").mkdir()
    t = _cell(b, k, tmpdir=str(tmp_path / "tmp"))
    k.spawn(10, dir=CELL, unkillable=True)
    r = reaper.reap(b, t)
    assert not r.empty and (tmp_path / "tmp").exists() and CELL in k.dirs


class _CountingBackend(FakeBackend):
    def __init__(self, k, **kw):
        super().__init__(k, **kw)
        self.scans = 0

    def snapshot(self, exclude=()):
        self.scans += 1
        return super().snapshot(exclude)


def test_without_a_term_request_the_first_scan_is_the_first_kill_rounds(k):
    # nothing was signalled between them: one /proc scan, not two (the janitor's 100 cells: ~35 ms)
    b = _CountingBackend(k)
    t = _cell(b, k, token="tok", since=100, leader={"pid": 10, "pidfd_ino": None, "starttime": 100})
    (r,) = reaper.stop(b, [t], thorough=True)
    assert b.scans == 1 and r.empty and r.killed == []


def test_a_round_that_killed_is_still_followed_by_a_scan_that_finds_none(k):
    b = _CountingBackend(k)
    t = _cell(b, k, token="tok", since=100, leader={"pid": 10, "pidfd_ino": None, "starttime": 100})
    k.spawn(10, start=100, dir=CELL)
    k.spawn(11, start=105, sid=11, token="tok")
    (r,) = reaper.stop(b, [t], thorough=True)
    assert {x["pid"] for x in r.killed} == {10, 11} and r.empty
    assert b.scans == 2  # the first (stop's own, reused by round 1), then the one that finds none
