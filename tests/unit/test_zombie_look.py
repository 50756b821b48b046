"""wait_empty's look for a tree of zombies only (backend/cgroups.py _only_zombies), over a fake cgroup
directory: a look at the first pid listed answers "not only zombies" at once (issue 29: a killed tree of
~1,000 processes is not read and parsed on every quiet spell); only a full read says "only zombies"."""
import os
import subprocess
import sys

import pytest

from agnsup.backend.base import Place
from agnsup.backend.cgroups import Cgroup2
from agnsup.linux import cgroup


@pytest.fixture
def procs():
    """(a zombie child's pid, a live child's pid); both gone at the end."""
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    os.waitid(os.P_PID, zombie.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped: a zombie
    yield zombie.pid, live.pid
    live.kill()
    live.wait()
    zombie.wait()


def _only_zombies(tmp_path, pids) -> bool:
    (tmp_path / "cgroup.procs").write_text("".join(f"{p}\n" for p in pids))
    b = Cgroup2(cgroup.Layout("v2", str(tmp_path), {}, ()), str(tmp_path / "state"))  # the host's is not read
    return b._only_zombies(Place(node=cgroup.Node({"v2": str(tmp_path)})))


def test_a_live_process_listed_after_a_zombie_is_not_a_tree_of_zombies(tmp_path, procs):
    zombie, live = procs
    assert not _only_zombies(tmp_path, [zombie, live])  # the first look sees a zombie: the full read decides
    assert not _only_zombies(tmp_path, [live, zombie])  # the first look alone decides
    assert _only_zombies(tmp_path, [zombie])
    assert not _only_zombies(tmp_path, [])             # nothing listed: not "a tree of zombies"
