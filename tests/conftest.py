"""Fixtures shared by every test: a fresh state root and cgroup root per test,
the installed `agnsup` console script, and a leak check that kills whatever a
test left behind (and fails that test for it)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from agnsup import backend
from agnsup.store.journal import open_journal
from agnsup.selftest.host import procs_with_env  # noqa: F401 - re-exported for the tests (one copy: the selftest's)

pytest_plugins = ["_workers"]  # tests/_workers.py: the tests' own roots registry; a run spread over processes

BIN = os.path.join(os.path.dirname(sys.executable), "agnsup")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# scripts/v2lane --budget: past this CLOCK_MONOTONIC second, tests still to start are not run, and say so
LANE_DEADLINE = float(os.environ.get("V2LANE_DEADLINE_MONO") or "inf")


def pytest_runtest_setup(item):
    if time.monotonic() > LANE_DEADLINE:
        pytest.skip("BUDGET: not run: the lane's time budget ran out (scripts/v2lane --budget)")
    if item.get_closest_marker("kernel") is None and KERNEL_FIXTURES.intersection(item.fixturenames):
        pytest.fail(f"a test of the fast tier's paths ({', '.join(PURE)}) uses "
                    f"{', '.join(sorted(KERNEL_FIXTURES.intersection(item.fixturenames)))}: it belongs in a "
                    "kernel-tier file (tests/conftest.py, PURE)", pytrace=False)


# -- the tiers (scripts/test.sh fast|smoke|kernel|all). A test is `kernel` (root, real cells, cgroups) unless it lies
# in PURE, and a test in PURE that asks for a fixture of KERNEL_FIXTURES fails (above) instead of being sorted
# out quietly, so the fast tier (`-m "not kernel"`) can neither grow a cell nor lose a test. `e2e`: tests/e2e.
PURE = ("unit/", "gate/", "test_architecture.py", "test_netpolicy.py", "test_redact.py")
FAST = "not kernel"  # the fast tier's -m (scripts/test.sh)
HERE = os.path.dirname(os.path.abspath(__file__))
KERNEL_FIXTURES = {"state", "agnsup", "user", "engine"}  # a state root (its cgroups purged after), a made user, dockerd
# `smoke`: one kernel test per seam, <= 3 minutes as root (a name without [params] takes every parameter)
SMOKE = """
test_lifecycle.py::test_a_backgrounded_sleep_does_not_outlive_its_cell
test_isolation_basics.py::test_the_worktree_is_writable_and_the_rest_is_read_only
test_home.py::test_the_hidden_home_cannot_be_written
test_startup_cost.py::test_a_cell_is_born_in_its_cgroup
test_limits.py::test_the_wall_clock_limit_ends_a_cell_with_exit_124
test_stream.py::test_stdout_and_stderr_come_back_in_order_and_stdin_round_trips_with_eof
test_terminal.py::test_the_cell_gets_a_controlling_terminal_its_input_and_the_users_window_size
test_cancel.py::test_a_term_trap_runs_within_the_grace_period_then_the_tree_is_killed
test_janitor.py::test_the_next_controller_start_runs_the_janitor
test_dead_man.py::test_the_receipt_says_how_a_cell_dies_with_its_controller
e2e/test_dead_man_switch.py::test_a_sigkilled_controller_of_every_kind_takes_its_cells_with_it
test_serve.py::test_spawn_returns_at_once_and_the_cell_runs_under_the_serve_controller
test_mcp.py::test_tools_run_deny_time_out_and_refuse_bad_arguments_as_tool_errors
test_sandboxd.py::test_execute_runs_a_command_as_a_cell_through_the_client_packages_executor
test_egress.py::test_an_unlisted_name_is_refused_with_the_rule_in_the_receipt
test_changes_cli.py::test_diff_shows_what_a_cell_changed_and_undo_puts_it_back_byte_for_byte_then_redo
test_doors_kernel.py::test_ipcs_in_a_cell_lists_nothing_of_the_hosts
test_gate_cells.py::test_a_flagged_write_to_usr_runs_in_an_executor_cell_and_fails_with_erofs
test_check_cli.py::test_check_denies_a_split_flag_rm_of_root_with_126_and_the_rule
test_redact_cells.py::test_run_process_returns_redacted_output_and_the_receipt_counts_each_rule
test_unprivileged.py::test_a_normal_user_runs_a_confined_cell_in_its_delegated_subtree
test_userns.py::test_an_unprivileged_controller_maps_its_cell_to_root_and_the_cell_builds_its_namespaces
test_reversible.py::test_every_kind_of_change_lands_when_the_cell_ends_and_not_before
test_confinement.py::test_a_cell_cannot_move_itself_out_of_its_cgroup
test_crashpoints.py::test_a_controller_killed_at_a_crash_point_leaves_nothing_after_the_janitor[after_exec]
test_journal_faults.py::test_a_damaged_journal_is_refused_kept_and_the_kill_switch_still_kills
test_devjobs.py::test_the_worktree_venv_is_on_path_and_runs_pytest
test_doctor.py::test_doctor_reports_the_detected_cgroup_layout_and_namespaces
test_selftest_isolation.py::test_all_fifteen_gates_pass_on_this_host
test_doors_sockets.py::test_a_cell_cannot_connect_to_host_sockets_under_var_lib_srv_run_or_in_its_worktree
test_doors_autoexec.py::test_a_cell_cannot_plant_git_config_hooks_or_editor_files_that_the_host_runs
""".split()


def pytest_ignore_collect(collection_path, config):
    """The fast tier does not import the kernel tier's files (a few seconds of imports and collection)."""
    rel = os.path.relpath(str(collection_path), HERE)
    if config.getoption("markexpr") == FAST and rel != "." and not rel.startswith("..") \
            and not (rel + "/").startswith(PURE):
        return True
    return None


def pytest_configure(config):
    for line in ("kernel: needs root and the kernel: real cells, cgroups, namespaces (every test outside PURE)",
                 "e2e: tests/e2e: drives the installed agnsup as a user would",
                 "smoke: one kernel test per seam (SMOKE)"):
        config.addinivalue_line("markers", line)


def pytest_collection_modifyitems(config, items):
    smoke = set()
    for item in items:
        rel = os.path.relpath(str(item.path), HERE)
        if not rel.startswith(PURE):
            item.add_marker(pytest.mark.kernel)
        if rel.startswith("e2e/"):
            item.add_marker(pytest.mark.e2e)
        name = f"{rel}::{item.name}"
        hit = set(SMOKE).intersection((name, name.partition("[")[0]))
        if hit:
            item.add_marker(pytest.mark.smoke)
            smoke |= hit
    # a smoke entry that names no test (renamed, moved) is an error where the whole tree was collected
    whole = any(os.path.abspath(os.path.join(config.invocation_params.dir, a)) == HERE for a in config.args)
    lost = [s for s in SMOKE if s not in smoke]
    if whole and lost and config.getoption("markexpr") != FAST:
        raise pytest.UsageError("tests/conftest.py SMOKE names no collected test: " + ", ".join(lost))


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
    with open(os.path.join(REPO, "agnsup", "policies", "executor.toml")) as f:
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
