"""Host kinds, as pure logic over the fake backend: what a backend says about limits it cannot hold."""
from agnsup.backend import Backend, Place

from fake_backend import FakeBackend, FakeKernel


def test_every_limit_asked_for_and_not_in_force_is_a_gap_with_its_fix():
    b = FakeBackend(FakeKernel())
    place = b.create(b.place("R", "A", "C", {}), {})          # the fake holds pids only
    assert place.limits == {"pids": "v2:" + place.dir}
    gaps = b.limit_gaps(place, {"memory_max": 1 << 20, "pids_max": 9, "cpu_max": 0.5, "output_max": 10})
    assert [g.split(":")[0] for g in gaps] == ["limit memory", "limit cpu"]
    assert all("; fix: " in g for g in gaps)
    assert b.limit_gaps(place, {"pids_max": 9}) == []
    assert b.limit_gaps(place, {}) == []


def test_the_reason_the_backend_found_at_create_time_is_the_one_named():
    place = Place(limits={"pids": "v2:/x"}, missing={"cpu": "the cgroup2 controller 'cpu' is not enabled for /x"})
    [gap] = Backend().limit_gaps(place, {"pids_max": 9, "cpu_weight": 50})
    assert gap.startswith("limit cpu: the cgroup2 controller 'cpu' is not enabled for /x; fix: ")


def test_without_a_tree_no_limit_is_in_force_and_each_is_named():
    b = FakeBackend(FakeKernel(), trees=False)
    gaps = b.limit_gaps(b.place("R", "A", "C", {}), {"memory_max": 1, "pids_max": 1, "cpu_weight": 1})
    assert [g.split(":")[0] for g in gaps] == ["limit memory", "limit pids", "limit cpu"]
    assert all("no cgroup tree here" in g for g in gaps)
