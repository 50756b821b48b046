"""Fixtures shared by every test: a fresh state root and cgroup root per test,
the installed `agnsup` console script, and a leak check that kills whatever a
test left behind (and fails that test for it)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from agnsup import backend
from agnsup.journal import open_journal
from agnsup.selftest.host import procs_with_env  # noqa: F401 - re-exported for the tests (one copy: the selftest's)

pytest_plugins = ["_workers"]  # tests/_workers.py: the tests' own roots registry; a run spread over processes

BIN = os.path.join(os.path.dirname(sys.executable), "agnsup")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# scripts/v2lane --budget: past this CLOCK_MONOTONIC second, tests still to start are not run, and say so
LANE_DEADLINE = float(os.environ.get("V2LANE_DEADLINE_MONO") or "inf")


def pytest_runtest_setup(item):
    if time.monotonic() > LANE_DEADLINE:
        pytest.skip("BUDGET: not run: the lane's time budget ran out (scripts/v2lane --budget)")


class Agnsup:
    """Runs the installed console script against one state root."""

    def __init__(self, state: str, env: dict | None = None):
        self.state = state
        self.env = {**os.environ, "AGNSUP_STATE_DIR": state, **(env or {})}

    def __call__(self, *args, check=None, timeout=60, env=None, cwd=None, input=None) -> subprocess.CompletedProcess:
        e = {**self.env, **(env or {})}
        cp = subprocess.run([BIN, *args], env=e, cwd=cwd, capture_output=True, timeout=timeout,
                            input=input, stdin=None if input is not None else subprocess.DEVNULL)
        cp.out, cp.err = cp.stdout.decode(errors="replace"), cp.stderr.decode(errors="replace")
        if check is not None:
            assert cp.returncode == check, f"exit {cp.returncode}, wanted {check}\nstdout: {cp.out}\nstderr: {cp.err}"
        return cp

    def popen(self, *args, env=None, cwd=None, **kw) -> subprocess.Popen:
        return subprocess.Popen([BIN, *args], env={**self.env, **(env or {})}, cwd=cwd, **kw)

    def json(self, *args):
        cp = self(*args, check=0)
        return json.loads(cp.out)


def seccomp_launcher(refuse: dict[int, int]) -> str:
    """Python source that installs a seccomp filter answering each system call number in `refuse` with
    its errno (classic BPF: load nr; nr == N ? ERRNO(e) : next; ...; allow), then execs argv[1:]: a host
    that refuses a kernel feature, as a container's seccomp profile or an LSM does."""
    rules = "".join(f"F(0x15, 0, 1, {nr}), F(0x06, 0, 0, 0x50000 | {err}), " for nr, err in refuse.items())
    n = 2 + 2 * len(refuse)
    return f'''
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
class F(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]
class P(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(F))]
prog = (F * {n})(F(0x20, 0, 0, 0), {rules}F(0x06, 0, 0, 0x7FFF0000))
fp = P({n}, ctypes.cast(prog, ctypes.POINTER(F)))
assert libc.prctl(38, 1, 0, 0, 0) == 0 and libc.prctl(22, 2, ctypes.byref(fp), 0, 0) == 0
os.execv(sys.argv[1], sys.argv[1:])
'''


def refusals(state: str) -> list[dict]:
    """What the journal of a state root holds as refused: cells refused before they started, peers a
    server refused."""
    j = open_journal(state)
    try:
        return j.refusals()
    finally:
        j.close()


def run_door_gates(runners: dict, user: int | None = None) -> dict:
    """{gate: result} of a selftest door module's RUNNERS, run through the isolation selftest's Harness as
    `agnsup selftest --isolation` runs them (the probe cells as `user` when given); nothing of the
    Harness is left after."""
    from agnsup.selftest.isolation import Harness
    h = Harness(keep=False, user=user)
    try:
        results = {name: run(h) for name, run in runners.items()}
    finally:
        h.close()
    assert not os.path.exists(h.root), h.root
    return results


def _cleanup_cgroups(state: str) -> list[str]:
    """Kill and remove this state root's cgroup tree; return what was there."""
    return backend.choose(state).purge()


@pytest.fixture
def state(tmp_path):
    root = str(tmp_path / "state")
    yield root
    leaked = _cleanup_cgroups(root)
    shutil.rmtree(root, ignore_errors=True)
    if leaked:
        pytest.fail("test leaked cgroups/processes: " + "; ".join(leaked))


@pytest.fixture
def agnsup(state):
    return Agnsup(state)


@pytest.fixture
def worktree(tmp_path):
    wt = tmp_path / "wt"
    wt.mkdir()
    return str(wt)


@pytest.fixture
def policy_dir(tmp_path):
    """A directory for test roles, searched before the packaged ones."""
    d = tmp_path / "policies"
    d.mkdir()
    return d


def write_role(policy_dir, name: str, **overrides) -> str:
    """A copy of the packaged executor role with some keys replaced."""
    with open(os.path.join(REPO, "policies", "executor.toml")) as f:
        src = f.read()
    src = src.replace('name = "executor"', f'name = "{name}"')
    for key, value in overrides.items():
        section, _, field = key.partition("__")
        line_start = f"{field} = "
        lines = src.splitlines()
        in_section = False
        done = False
        for i, line in enumerate(lines):
            if line.startswith("["):
                in_section = line.strip() == f"[{section}]"
            elif in_section and line.startswith(line_start):
                lines[i] = f"{field} = {value}"
                done = True
        if not done:
            idx = next(i for i, line in enumerate(lines) if line.strip() == f"[{section}]")
            lines.insert(idx + 1, f"{field} = {value}")
        src = "\n".join(lines) + "\n"
    path = os.path.join(str(policy_dir), f"{name}.toml")
    with open(path, "w") as f:
        f.write(src)
    return path


@pytest.fixture(scope="module")
def user():
    """A throwaway normal user with this project's venv (test_unprivileged.User), removed after the
    module (files that need more of it define their own `user`)."""
    if os.geteuid() != 0:
        pytest.skip("ENV_BLOCKED: root (the test makes a user)")
    from test_unprivileged import User, _venv
    with User(_venv()) as u:
        yield u


def skip_unless_capturable(path: str) -> None:
    """Skip, named ENV_BLOCKED, where a state root at `path` cannot hold an overlay's upper layer
    (the v2 guest's / is overlayfs over 9p): agnsup runs such cells live and says why."""
    from agnsup import changes
    kinds = {0x794C7630: "overlayfs", 0x01021997: "9p", 0x6969: "nfs", 0x65735546: "fuse"}
    kind = kinds.get(changes.fs_type(path))
    if kind:
        pytest.skip(f"ENV_BLOCKED: {path} is on {kind}, which cannot hold an overlay upper layer (cells run live)")


# -- the container lane's engine (tests/containers.py): one dockerd, one base and one agnsup image per session,
# shared by tests/test_docker.py and tests/test_reduced.py; the session checks the host's networking is unchanged

ENGINE_IMAGE = "agnsup:test"


class Engine:
    def __init__(self, d, image: str):
        self.d, self.image = d, image

    def run(self, *flags: str, cmd: tuple | list = (), network: str = "none", timeout: float = 120,
            entrypoint: bool = True) -> subprocess.CompletedProcess:
        """`docker run --rm` of the image with `flags` and `cmd` (through the image's ENTRYPOINT, which prints
        doctor on stderr first, unless `entrypoint` is False)."""
        argv = ["run", "--rm", "--network", network, *flags]
        if not entrypoint:
            argv += ["--entrypoint", cmd[0]]
            cmd = cmd[1:]
        return self.d.docker(*argv, self.image, *cmd, check=False, timeout=timeout)


def _host_network() -> dict:
    def out(*argv):
        return subprocess.run(argv, capture_output=True, text=True).stdout
    with open("/proc/sys/net/ipv4/ip_forward") as f:
        fwd = f.read().strip()
    return {"links": out("ip", "-br", "link"), "addresses": out("ip", "-br", "addr"),
            "iptables": out("iptables", "-S") + out("iptables", "-t", "nat", "-S"),
            "ip6tables": out("ip6tables", "-S"), "ip_forward": fwd}


@pytest.fixture(scope="session")
def engine():
    import containers  # tests/containers.py: only the sessions that use the engine import it
    why = containers.installed()
    if why:
        pytest.skip(why)
    before = _host_network()
    d = containers.Daemon()
    try:
        d.__enter__()
        try:
            containers.base_rootfs()
        except containers.DockerError as e:  # the Debian mirror out of reach: the lane cannot be made here
            pytest.skip(f"ENV_BLOCKED: no base rootfs: {e}")
        containers.base_image(d)
        containers.build_image(d, REPO, ENGINE_IMAGE)
        yield Engine(d, ENGINE_IMAGE)
    finally:
        root = d.root
        forced = d.close()
    after = _host_network()
    assert after == before, f"the container lane changed the host's networking: {before} -> {after}"
    assert root is None or (not os.path.exists(root) and not containers.mounts_under(root)), root
    assert not forced, f"the daemon's teardown had to force: {forced}"
