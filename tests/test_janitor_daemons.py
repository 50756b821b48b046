"""Real programs that daemonize (redis-server, memcached) are recovered after the controller dies."""
import os
import shutil
import signal
import socket
import subprocess

import pytest

from conftest import procs_with_env
from scenario import KEEP, bindable, wait_for


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not (shutil.which("redis-server") and shutil.which("memcached")),
                    reason="redis-server and memcached are installed by scripts/test.sh")
def test_daemonized_redis_and_memcached_are_gone_after_the_janitor(agnsup, worktree):
    rport, mport = _free_port(), _free_port()
    script = (f"redis-server --port {rport} --bind 127.0.0.1 --daemonize yes --pidfile {worktree}/redis.pid "
              f"--dir {worktree} --save '' > /dev/null; "
              f"memcached -d -u root -l 127.0.0.1 -p {mport} -P {worktree}/mc.pid; sleep 1000")
    p = agnsup.popen("run", "--role", "networked", "--workdir", worktree, "--cell", "daemons", *KEEP, "--",
                     "sh", "-c", script, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL)
    wait_for(lambda: not bindable(rport) and not bindable(mport), what="the daemons listening")
    p.send_signal(signal.SIGKILL)
    p.wait(10)
    assert not bindable(rport) and not bindable(mport), "the daemons did not survive the controller: invalid"
    rep = agnsup.json("janitor", "--json")
    assert rep["recovered"] == ["daemons"]
    assert procs_with_env("AGNSUP_CELL_ID", "daemons") == []
    assert bindable(rport) and bindable(mport)
    assert os.path.exists(os.path.join(worktree, "redis.pid"))


@pytest.mark.skipif(not shutil.which("make"), reason="make is installed by scripts/test.sh")
def test_a_parallel_make_with_nested_shells_is_gone_after_the_janitor(agnsup, worktree):
    with open(os.path.join(worktree, "Makefile"), "w") as f:
        f.write("all: a b c d\n" + "".join(f"{t}:\n\tsh -c 'sh -c \"sleep 1000\"'\n" for t in "abcd"))
    p = agnsup.popen("run", "--workdir", worktree, "--cell", "make", *KEEP, "--", "make", "-j4",
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    # make + 4 x (sh, sh, sleep) at least
    wait_for(lambda: len(procs_with_env("AGNSUP_CELL_ID", "make")) >= 9, what="make's jobs")
    p.send_signal(signal.SIGKILL)
    p.wait(10)
    assert len(procs_with_env("AGNSUP_CELL_ID", "make")) >= 9, "the tree did not survive the controller: invalid"
    rep = agnsup.json("janitor", "--json")
    assert rep["recovered"] == ["make"]
    assert procs_with_env("AGNSUP_CELL_ID", "make") == []
