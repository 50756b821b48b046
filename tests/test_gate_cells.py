"""The gate's verdicts met in real cells (tests/gate/ judges text and starts nothing): what it flags as
kernel-enforced, the cell's kernel refuses; a preset role refuses before any cell or runs a real one; run
quotas are counted by the journal across concurrent controllers."""
import json
import os
import select
import socket
import sqlite3
import subprocess
import threading
import time

import pytest

from agnsup import governance, policy, record
from agnsup.gate import GateContext, judge_shell
from conftest import write_role
from gate.test_presets import role
from gate.test_quota import quota_role

WT = "/workspace/project"


def ctx_of(name: str, **replace) -> GateContext:
    ctx = governance.context(policy.load(name), WT, "/var/lib/agnsup-test-state")
    return record.replace(ctx, **replace) if replace else ctx


# --- the kernel refuses what the gate flagged (tests/gate/test_kernel_enforced.py) -------------------

class Listener:
    """A TCP listener on every host address; records each connection."""

    def __init__(self):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("0.0.0.0", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        self.heard: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self):
        while not self._stop.is_set():
            r, _, _ = select.select([self.sock], [], [], 0.1)
            if r:
                conn, peer = self.sock.accept()
                self.heard.append(peer[0])
                conn.close()

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        time.sleep(0.3)  # a late connection still counts
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


def receipt(path) -> dict:
    with open(path) as f:
        return json.load(f)


NETWORK_COMMANDS = [
    ("curl", ["curl", "-sS", "--max-time", "5", "http://127.0.0.1:{port}/"]),
    ("bash /dev/tcp", ["bash", "-c", "echo hi > /dev/tcp/127.0.0.1/{port}"]),
]


@pytest.mark.parametrize("what,argv", NETWORK_COMMANDS, ids=[n[0] for n in NETWORK_COMMANDS])
def test_a_flagged_network_command_runs_in_an_executor_cell_and_the_host_listener_hears_nothing(
        what, argv, agnsup, worktree, tmp_path, policy_dir):
    with Listener() as lis:
        args = [a.format(port=lis.port) for a in argv]
        rec = tmp_path / "receipt.json"
        cp = agnsup("run", "--role", "executor", "--workdir", worktree, "--timeout", "30", "--receipt", str(rec),
                    "--", *args, timeout=120)
        assert cp.returncode not in (0, 126), cp.err  # ran, and failed to connect
        gov = receipt(rec)["governance"]
        assert gov["decision"]["allowed"] and "network.kernel_enforced" in gov["decision"]["flags"]
        assert any(t["rule"] == "network.kernel_enforced" for t in gov["trail"])
    assert lis.heard == []
    # Control: the same command from a host-network cell is heard, so silence above means something.
    # The listener is on the host's loopback, which a host-network role must list to reach.
    write_role(policy_dir, "networked-loopback", network__mode='"host"', network__allow_internal='["loopback"]')
    with Listener() as lis:
        args = [a.format(port=lis.port) for a in argv]
        agnsup("run", "--role", "networked-loopback", "--workdir", worktree, "--timeout", "30", "--", *args,
               timeout=120, env={"AGNSUP_POLICY_DIR": str(policy_dir)})
    assert lis.heard != []


def test_a_flagged_write_to_usr_runs_in_an_executor_cell_and_fails_with_erofs(agnsup, worktree, tmp_path):
    target = f"/usr/agnsup-kernel-test-{os.getpid()}"
    rec = tmp_path / "receipt.json"
    cp = agnsup("run", "--role", "executor", "--workdir", worktree, "--receipt", str(rec), "--",
                "sh", "-c", f"echo x > {target}", timeout=120)
    assert cp.returncode not in (0, 126) and "Read-only file system" in cp.err, cp.err
    assert not os.path.exists(target)
    gov = receipt(rec)["governance"]
    assert gov["decision"]["allowed"] and "sandbox.kernel_enforced" in gov["decision"]["flags"]
    assert gov["decision"]["flagged"][0]["evidence"].endswith(target) or target in gov["decision"]["flagged"][0]["reason"]


def test_a_flagged_read_of_a_masked_deny_path_runs_and_reads_nothing(agnsup, worktree, policy_dir, tmp_path):
    secrets_dir = os.path.join(worktree, "secrets")
    os.makedirs(secrets_dir)
    with open(os.path.join(secrets_dir, "key"), "w") as f:
        f.write("the-secret-value\n")
    write_role(policy_dir, "masking", filesystem__deny=json.dumps([secrets_dir]))
    write_role(policy_dir, "masking-early", filesystem__deny=json.dumps([secrets_dir]),
               governance__kernel_enforced='"deny"')
    env = {"AGNSUP_POLICY_DIR": str(policy_dir)}
    rec = tmp_path / "receipt.json"
    cp = agnsup("run", "--role", "masking", "--workdir", worktree, "--receipt", str(rec), "--",
                "cat", "secrets/key", env=env, timeout=120)
    assert cp.returncode not in (0, 126), cp.err
    assert "the-secret-value" not in cp.out
    assert "sandbox.kernel_enforced" in receipt(rec)["governance"]["decision"]["flags"]
    # The operator who wants early refusal gets it: nothing starts.
    cp = agnsup("run", "--role", "masking-early", "--workdir", worktree, "--", "cat", "secrets/key", env=env,
                check=126)
    assert "sandbox.deny_path" in cp.err and "the-secret-value" not in cp.out


def test_a_write_into_the_worktree_of_the_readonly_role_is_flagged_and_the_cell_refuses_it(agnsup, worktree,
                                                                                            tmp_path):
    d = judge_shell("echo x > out.txt", ctx_of("readonly"))
    assert d.allowed and "sandbox.kernel_enforced" in d.flags, d
    assert judge_shell("echo x > out.txt", ctx_of("readonly", kernel_enforced="deny")).rule == "sandbox.path_escape"
    rec = tmp_path / "receipt.json"
    cp = agnsup("run", "--role", "readonly", "--workdir", worktree, "--receipt", str(rec), "--",
                "sh", "-c", "echo x > out.txt", timeout=120)
    assert cp.returncode not in (0, 126) and "Read-only file system" in cp.err, cp.err
    assert not os.path.exists(os.path.join(worktree, "out.txt"))
    assert "sandbox.kernel_enforced" in receipt(rec)["governance"]["decision"]["flags"]



# --- presets (tests/gate/test_presets.py) ---------------------------------------------------------

def test_a_readonly_preset_role_starts_no_cell_and_says_why(agnsup, worktree, policy_dir):
    role(policy_dir, "look", 'preset = "readonly"')
    cp = agnsup("run", "--role", "look", "--workdir", worktree, "--", "touch", "x",
                env={"AGNSUP_POLICY_DIR": str(policy_dir)}, check=126)
    # the first refusal is the read-only worktree (sandbox comes before zone); mode readonly would refuse too
    assert "sandbox.path_escape" in cp.err and "read-only" in cp.err
    assert not os.path.exists(os.path.join(worktree, "x"))
    cp = agnsup("run", "--role", "look", "--workdir", worktree, "--", "ls",
                env={"AGNSUP_POLICY_DIR": str(policy_dir)}, check=126)
    assert "zone.yellow_readonly" in cp.err


def test_a_regulated_role_runs_a_real_cell_once_run_process_is_allowed(agnsup, worktree, policy_dir):
    env = {"AGNSUP_POLICY_DIR": str(policy_dir)}
    role(policy_dir, "reg", 'preset = "regulated"')
    cp = agnsup("run", "--role", "reg", "--workdir", worktree, "--", "touch", "x", env=env, check=126)
    assert "zone.yellow_locked" in cp.err and "yellow_allow" in cp.err
    role(policy_dir, "reg", 'preset = "regulated"\nyellow_allow = ["run_process"]')
    agnsup("run", "--role", "reg", "--workdir", worktree, "--", "touch", "x", env=env, check=0)
    assert os.path.exists(os.path.join(worktree, "x"))



# --- run quotas (tests/gate/test_quota.py) ---------------------------------------------------------

def _dirs(tmp_path, n):
    out = []
    for i in range(n):
        d = tmp_path / f"wt{i}"
        d.mkdir()
        out.append(str(d))
    return out


def _wait_running(state, cell, deadline=60):
    db = os.path.join(state, "journal.db")
    end = time.time() + deadline
    while time.time() < end:
        if os.path.exists(db):
            c = sqlite3.connect(db, timeout=30)
            try:
                row = c.execute("SELECT state FROM cells WHERE cell_id=?", (cell,)).fetchone()
            except sqlite3.OperationalError:
                row = None
            finally:
                c.close()
            if row and row[0] == "running":
                return
        time.sleep(0.05)
    raise AssertionError(f"cell {cell} never reached running")


def _denied_events(state):
    c = sqlite3.connect(os.path.join(state, "journal.db"))
    try:
        return [json.loads(r[0]) for r in c.execute("SELECT data FROM events WHERE kind='denied' ORDER BY id")]
    finally:
        c.close()


def _cells(state):
    c = sqlite3.connect(os.path.join(state, "journal.db"))
    try:
        return {r[0]: r[1] for r in c.execute("SELECT cell_id, state FROM cells")}
    finally:
        c.close()


def _stop(p):
    try:
        p.wait(timeout=120)
    finally:
        if p.poll() is None:
            p.terminate()  # our own controller: it cancels its cell
            p.wait(timeout=60)


def test_a_second_concurrent_cell_of_one_agent_is_denied_and_another_agents_cell_starts(
        agnsup, state, policy_dir, tmp_path):
    env = {"AGNSUP_POLICY_DIR": str(policy_dir)}
    quota_role(policy_dir, "solo", max_concurrent_per_agent=1)
    w = _dirs(tmp_path, 3)
    gate = os.path.join(w[0], "release")
    # live: the cell waits for a file the host creates in its worktree (a capturing cell's overlay
    # need not see the lower layer change under it)
    first = agnsup.popen("run", "--role", "solo", "--agent", "a", "--cell", "c1", "--workdir", w[0],
                         "--changes", "live", "--",
                         "sh", "-c", f"while [ ! -e {gate} ]; do sleep 0.05; done", env=env)
    try:
        _wait_running(state, "c1")
        cp = agnsup("run", "--role", "solo", "--agent", "a", "--cell", "c2", "--workdir", w[1], "--", "true",
                    env=env, check=126)
        assert "quota.concurrent_agent" in cp.err and "quota.max_concurrent_per_agent" in cp.err
        agnsup("run", "--role", "solo", "--agent", "b", "--cell", "c3", "--workdir", w[2], "--", "true",
               env=env, check=0)
    finally:
        open(gate, "w").close()
        _stop(first)
    assert first.returncode == 0
    cells = _cells(state)
    assert cells == {"c1": "exited", "c3": "exited"}  # the denied call left no cell row
    (ev,) = _denied_events(state)
    assert ev["decision"]["rule"] == "quota.concurrent_agent" and ev["argv"] == ["true"]
    assert ev["trail"][-1]["check"] == "quota"
    # once the first cell ended, the same agent may start again
    agnsup("run", "--role", "solo", "--agent", "a", "--cell", "c4", "--workdir", w[1], "--", "true",
           env=env, check=0)


def test_a_run_starts_no_more_cells_than_its_quota_and_another_run_is_not_affected(agnsup, state, policy_dir,
                                                                                    worktree):
    env = {"AGNSUP_POLICY_DIR": str(policy_dir)}
    quota_role(policy_dir, "two", max_cells_per_run=2)
    for _ in range(2):
        agnsup("run", "--role", "two", "--run-id", "r1", "--workdir", worktree, "--", "true", env=env, check=0)
    cp = agnsup("run", "--role", "two", "--run-id", "r1", "--workdir", worktree, "--", "true", env=env, check=126)
    assert "quota.cells_per_run" in cp.err and "run 'r1' has started 2 cells" in cp.err
    agnsup("run", "--role", "two", "--run-id", "r2", "--workdir", worktree, "--", "true", env=env, check=0)


def test_a_run_past_its_wall_time_starts_no_new_cell(agnsup, state, policy_dir, worktree):
    env = {"AGNSUP_POLICY_DIR": str(policy_dir)}
    quota_role(policy_dir, "brief", max_run_seconds=1)
    agnsup("run", "--role", "brief", "--run-id", "r1", "--workdir", worktree, "--", "true", env=env, check=0)
    time.sleep(1.2)
    cp = agnsup("run", "--role", "brief", "--run-id", "r1", "--workdir", worktree, "--", "true", env=env, check=126)
    assert "quota.run_wall_time" in cp.err and "max_run_seconds" in cp.err


def test_cells_racing_for_the_last_slot_of_a_run_get_exactly_one_start(agnsup, state, policy_dir, tmp_path):
    """Four controllers start at once with max_concurrent_per_run = 1: the
    count happens inside BEGIN IMMEDIATE, so exactly one cell runs."""
    env = {"AGNSUP_POLICY_DIR": str(policy_dir)}
    quota_role(policy_dir, "single", max_concurrent_per_run=1)
    w = _dirs(tmp_path, 4)
    # the release file lies in each worktree: a cell sees its worktree, not the host's /tmp (live: a
    # capturing cell's overlay need not see what the host adds to the worktree under it)
    procs = [agnsup.popen("run", "--role", "single", "--agent", f"a{i}", "--cell", f"c{i}", "--workdir", w[i],
                          "--changes", "live", "--", "sh", "-c", "while [ ! -e release ]; do sleep 0.05; done", env=env,
                          stderr=subprocess.PIPE) for i in range(4)]
    try:
        # every loser exits 126 on its own; the winner waits for the release file
        end = time.time() + 120
        while sum(p.poll() is not None for p in procs) < 3 and time.time() < end:
            time.sleep(0.05)
    finally:
        for d in w:
            open(os.path.join(d, "release"), "w").close()
        for p in procs:
            _stop(p)
    codes = sorted(p.returncode for p in procs)
    errs = [p.stderr.read().decode() for p in procs]
    for p in procs:
        p.stderr.close()
    assert codes == [0, 126, 126, 126], errs
    assert sum("quota.concurrent_run" in e for e in errs) == 3
    assert list(_cells(state).values()) == ["exited"]

