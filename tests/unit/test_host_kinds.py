"""Host kinds, as pure logic over the fake backend and fake cgroup directories: what a backend says
about limits it cannot hold, and where the systemd backend puts agnsup."""
import os

import pytest

from agnsup.backend import systemd
from agnsup.backend.base import Backend, Place
from agnsup.linux import cgroup

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


def _delegate(path) -> bool:
    try:
        os.setxattr(path, "user.delegate", b"1")
        return True
    except OSError:
        return False


def test_only_the_nearest_unit_counts_and_only_with_delegate_yes(tmp_path):
    """A terminal in app.slice/foo.service is not in user@UID.service's delegation: agnsup must not
    move beside the user manager's slices (backend/systemd.py)."""
    mount = str(tmp_path)
    mgr = tmp_path / "user.slice" / "user-1000.slice" / "user@1000.service"
    term = mgr / "app.slice" / "foo.service"
    term.mkdir(parents=True)
    if not _delegate(mgr):
        pytest.skip("ENV_BLOCKED: user xattrs on the test's tmp dir")
    assert systemd._delegated_unit_of(str(term), mount) is None
    scope = mgr / "app.slice" / "agnsup-x-1.scope"
    (scope / "ctl-1").mkdir(parents=True)
    _delegate(scope)
    assert systemd._delegated_unit_of(str(scope / "ctl-1"), mount) == str(scope)
    assert systemd._delegated_unit_of(str(tmp_path / "system.slice" / "x.service"), mount) is None


def test_a_controller_already_in_its_scope_does_not_ask_systemd_again(tmp_path, monkeypatch):
    layout = cgroup.Layout("v2", str(tmp_path), {}, ("memory", "pids", "cpu"))
    state = str(tmp_path / "state")
    unit = systemd.unit_name(state)
    leaf = tmp_path / "system.slice" / unit / "ctl-7"
    leaf.mkdir(parents=True)
    monkeypatch.setattr(systemd, "_own_dir", lambda layout: str(leaf))
    b = systemd.SystemdScope(layout, state)
    assert b.entered and not b.shipped and b.scope_dir == str(leaf.parent)
    assert b.base.paths["v2"] == os.path.join(str(leaf.parent), cgroup.root_name(state))
    b.enter(lambda *a: pytest.fail("asked systemd again"))
    # not yet in it: the scope's fixed path in system.slice, and what a Delegate=yes unit would get
    monkeypatch.setattr(systemd, "_own_dir", lambda layout: str(tmp_path / "user.slice" / "session-1.scope"))
    b = systemd.SystemdScope(layout, str(tmp_path / "other"))
    assert not b.entered and b.scope_dir == os.path.join(str(tmp_path), "system.slice",
                                                         systemd.unit_name(str(tmp_path / "other")))
    assert b.limit_support() == {"memory": None, "pids": None, "cpu": None}
