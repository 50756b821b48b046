"""The v1-only backend (Cgroup1) on this host's real v1 hierarchies: freeze, wait for FROZEN, kill
each member, thaw. No host here is v1 only, so the test hands Cgroup1 the host's v1 mounts alone."""
import os
import signal
import subprocess
import time

import pytest

from agnsup.backend.cgroups import Cgroup1
from agnsup.linux import cgroup


def _v1_only(state):
    host = cgroup.detect_layout()
    if "freezer" not in host.v1:
        pytest.skip("ENV_BLOCKED: no writable v1 freezer hierarchy on this host")
    return Cgroup1(cgroup.Layout("v1", None, dict(host.v1)), state)


def test_a_v1_only_host_kills_a_forking_tree_through_the_freezer_and_removes_it(state):
    b = _v1_only(state)
    assert "freezer" in b.base.paths and "v2" not in b.base.paths
    limits = {"pids_max": 64}
    place = b.create(b.place("r1", "a1", "c1", limits), limits)
    assert place.dir == place.node.paths["freezer"] and "pids" in place.limits
    # daemons and a loop that forks all the time: between a read of the members and the kill, a
    # fork would escape a member-by-member kill; the freezer stops that
    p = subprocess.Popen(["sh", "-c", "sleep 300 & sleep 300 & while :; do sleep 0.01 & wait $!; done"],
                         preexec_fn=lambda: b.attach(place, 0), start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while len(b.members(place)) < 4 and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert p.poll() is None and len(b.members(place)) >= 4, (p.returncode, b.members(place))
        method = b.kill(place)
        assert method == "freezer", method
        assert b.wait_empty(place, 10.0), b.members(place)
        assert p.wait(timeout=10) == -signal.SIGKILL
        with open(os.path.join(place.dir, "freezer.state")) as f:
            assert f.read().strip() == "THAWED"  # thawed in every case: a frozen v1 task cannot die
        removed = b.remove(place)
        assert place.dir in removed and not any(os.path.isdir(d) for d in place.node.paths.values())
    finally:
        if p.poll() is None:
            b.kill(place)
            p.wait(timeout=10)
        assert not b.purge()
