"""What a test run across processes (pytest-xdist, `-n 2 --dist loadgroup`; scripts/test.sh) needs beyond one
process's run, loaded by conftest (`pytest_plugins`). Without xdist only the first item applies.

- Each pytest process notes its state roots in a registry of its own (state.registry_dir), not the host's and not
  another worker's: every cell is built around the roots registered there, and another worker's come and go.
  Everything else a test makes is its own already: its state root is under its worker's tmp_path, the cgroup
  root is named by a digest of that path (linux/cgroup.root_name), users and selftest directories have
  random names.
- `@pytest.mark.serial("reason")`: a test that needs the machine alone (a fork bomb, a deadline under load, a host-wide
  comparison) runs with no other test beside it: the workers share a lock, taken shared by every test and
  exclusively by a serial one (a turnstile before it, so a waiting serial test is not starved).
- The container lane's tests (the session fixture `engine`: one dockerd and its images per process) run on one
  worker (a group of --dist loadgroup), so the run starts one daemon, as a serial run does.
"""
from __future__ import annotations

import atexit
import contextlib
import fcntl
import glob
import json
import os
import shutil
import tempfile

import pytest

WORKER = os.environ.get("PYTEST_XDIST_WORKER")  # set by xdist in a worker before it reads any conftest
LOCKS = "AGNSUP_TEST_LOCKS"  # the controller's directory of the two lock files, inherited by its workers

if WORKER or "AGNSUP_ROOTS_REGISTRY" not in os.environ:
    os.environ["AGNSUP_ROOTS_REGISTRY"] = os.path.join("/tmp", f"agnsup-test-roots-{os.getpid()}")
    atexit.register(shutil.rmtree, os.environ["AGNSUP_ROOTS_REGISTRY"], True)


def pytest_configure(config):
    config.addinivalue_line("markers", "serial(reason): runs with no other test beside it when the run is "
                                       "spread over processes (tests/_workers.py)")
    if not WORKER and getattr(config.option, "numprocesses", None):
        os.environ[LOCKS] = tempfile.mkdtemp(prefix="agnsup-test-locks-")
        config.add_cleanup(lambda: shutil.rmtree(os.environ.pop(LOCKS), True))


@pytest.hookimpl(tryfirst=True)  # written before the worker tells the controller its collection
def pytest_collection_finish(session):
    """The worker's groups for the controller's scheduler, in a file (xdist 3.8 passes an xdist_group in the test
    id, and pytest 9.2's ids no longer take it: pytest-xdist#1386)."""
    if WORKER and os.environ.get(LOCKS):
        groups = {item.nodeid: "engine" for item in session.items if "engine" in item.fixturenames}
        path = os.path.join(os.environ[LOCKS], f"groups-{WORKER}.json")
        with open(path + ".part", "w") as f:
            json.dump(groups, f)
        os.rename(path + ".part", path)


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # before xdist's own choice (a hook of xdist)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class Groups(LoadGroupScheduling):
        """--dist loadgroup with the groups the workers wrote (every worker has collected when it asks)."""
        groups = None

        def _split_scope(self, nodeid):
            if self.groups is None:
                self.groups = {}
                for name in glob.glob(os.path.join(os.environ[LOCKS], "groups-*.json")):
                    with open(name) as f:
                        self.groups.update(json.load(f))
            return self.groups.get(nodeid) or super()._split_scope(nodeid)
    return Groups(config, log)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item):
    if not (WORKER and os.environ.get(LOCKS)):
        return (yield)
    with _turn(fcntl.LOCK_EX if item.get_closest_marker("serial") else fcntl.LOCK_SH):
        return (yield)


@contextlib.contextmanager
def _turn(mode: int):
    d = os.environ[LOCKS]
    with open(os.path.join(d, "all"), "a") as every, open(os.path.join(d, "turnstile"), "a") as turnstile:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(every, mode)
        finally:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(every, fcntl.LOCK_UN)
