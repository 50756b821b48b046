"""`agnsup run` hands its call to a live `agnsup serve` of the same state root (doors/handoff.py, serve's
run_attached op), and for the caller nothing differs: the same output on the same descriptors, the same
stderr lines and exit status; the cell dies with its caller (the connection's end), signals reach it; no
serve, a stale socket, another user's listener or AGNSUP_HANDOFF=0: the in-process path."""
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile

import pytest

from conftest import BIN
from scenario import STARTERS, wait_for


@pytest.fixture
def served(agnsup, tmp_path):
    s = STARTERS["serve"](agnsup, tmp_path)
    yield s
    s.close()


def _run(agnsup, *args, env=None, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=None):
    """`agnsup run ARGS` with no terminal anywhere (stdin /dev/null): (exit code, stdout, stderr)."""
    p = subprocess.Popen([BIN, "run", *args], env={**agnsup.env, **(env or {})}, stdin=subprocess.DEVNULL,
                         stdout=stdout, stderr=stderr, cwd=cwd)
    out, err = p.communicate(timeout=60)
    return p.returncode, (out or b"").decode(), (err or b"").decode()


def _receipt(agnsup, cell: str) -> dict:
    (rec,) = agnsup.json("receipts", "--cell", cell, "--json")
    return rec


def _running(agnsup, cell: str) -> dict:
    def row():
        rows = [r for r in agnsup.json("ps", "--json") if r["cell_id"] == cell and r["state"] == "running"]
        return rows[0] if rows else None
    return wait_for(row, what=f"cell {cell} running")


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def test_a_run_beside_a_serve_is_handed_to_it_and_writes_the_callers_file_and_pipe(agnsup, served, worktree,
                                                                                    tmp_path):
    out = tmp_path / "out.txt"
    with open(out, "wb") as f:
        code, _, err = _run(agnsup, "--cell", "h1", "--workdir", worktree, "--", "sh", "-c",
                            "echo to-file; echo to-pipe >&2; exit 3", stdout=f)
    assert code == 3 and err == "to-pipe\n"
    assert out.read_text() == "to-file\n"
    rec = _receipt(agnsup, "h1")
    assert rec["controller"] == served.ready["controller"]  # the serve's controller ran it
    assert rec["chain"][0]["entry"] == "cli" and rec["exit_code"] == 3 and rec["state"] == "exited"


def test_2_to_1_through_the_hand_off_keeps_the_order(agnsup, served, worktree):
    r, w = os.pipe()
    p = subprocess.Popen([BIN, "run", "--cell", "h2", "--workdir", worktree, "--", "sh", "-c",
                          "echo 1; echo 2 >&2; echo 3; echo 4 >&2"], env=agnsup.env, stdin=subprocess.DEVNULL,
                         stdout=w, stderr=w)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        got = f.read()
    assert p.wait(60) == 0 and got == b"1\n2\n3\n4\n"
    assert _receipt(agnsup, "h2")["controller"] == served.ready["controller"]


CASES = {"true": ["true"], "exit 7": ["sh", "-c", "echo no >&2; exit 7"], "missing": ["no-such-command-h6"],
         "denied": ["rm", "-rf", "/"]}


@pytest.mark.parametrize("case", list(CASES))
def test_exit_code_and_stderr_are_the_in_process_runs(agnsup, served, worktree, case):
    handed = _run(agnsup, "--workdir", worktree, "--", *CASES[case])
    alone = _run(agnsup, "--workdir", worktree, "--", *CASES[case], env={"AGNSUP_HANDOFF": "0"})
    assert handed == alone, (handed, alone)
    assert handed[0] == {"true": 0, "exit 7": 7, "missing": 127, "denied": 126}[case]
    controllers = [r["controller"] for r in agnsup.json("receipts", "--json")]
    if case in ("true", "exit 7"):  # a refused call has no receipt: one controller each
        assert controllers[0] == served.ready["controller"] and controllers[1] != served.ready["controller"]


def test_a_killed_caller_kills_its_cell(agnsup, served, worktree):
    """The dead-man switch follows the caller, not the serve: SIGKILL to `agnsup run` ends its cell."""
    p = subprocess.Popen([BIN, "run", "--cell", "dm", "--workdir", worktree, "--", "sleep", "300"], env=agnsup.env,
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        row = _running(agnsup, "dm")
        p.kill()
        p.wait(30)
        wait_for(lambda: agnsup.json("receipts", "--cell", "dm", "--json"), what="the cell's receipt")
        rec = _receipt(agnsup, "dm")
        assert rec["controller"] == served.ready["controller"]
        assert rec["reason"] == "controller_died" and rec["state"] == "killed", rec
        assert f"(pid {p.pid})" in rec["cancel_reason"]
        assert _gone(row["pid"])
        assert not [r for r in agnsup.json("ps", "--json") if r["cell_id"] == "dm"]
        for path in (row["cgroup"].values() if isinstance(row["cgroup"], dict) else [row["cgroup"]]):
            procs = os.path.join(path, "cgroup.procs")  # removed with the cell, or empty
            assert not os.path.exists(procs) or not open(procs).read().strip()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_with_keep_the_cell_outlives_its_caller_under_serve(agnsup, served, worktree):
    p = subprocess.Popen([BIN, "run", "--cell", "kp", "--on-controller-death", "keep", "--workdir", worktree, "--",
                          "sleep", "300"], env=agnsup.env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    try:
        row = _running(agnsup, "kp")
        p.kill()
        p.wait(30)
        j = _journal(agnsup.state)
        try:
            wait_for(lambda: [e for e in j.events("default", "kp") if e["kind"] == "caller_gone"],
                     what="the caller_gone event")
        finally:
            j.close()
        assert not _gone(row["pid"])
        assert [r["state"] for r in agnsup.json("ps", "--json") if r["cell_id"] == "kp"] == ["running"]
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        agnsup("cancel", "--cell", "kp", "--grace", "0", check=0)


def test_a_handed_over_run_recovers_what_a_controller_that_died_since_the_serve_started_left(agnsup, served,
                                                                                              worktree):
    """cli.md: a controller runs the janitor before anything else. A handed-over run's controller is the serve,
    which ran it at its start: a cold `run` killed after that left a cell the next handed-over run recovers."""
    p = subprocess.Popen([BIN, "run", "--cell", "orphan", "--on-controller-death", "keep", "--workdir", worktree, "--",
                          "sleep", "300"], env={**agnsup.env, "AGNSUP_HANDOFF": "0"}, stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        row = _running(agnsup, "orphan")
        p.kill()
        p.wait(30)
        assert not _gone(row["pid"])  # keep: its tree outlives the dead controller, until a janitor runs
        assert _run(agnsup, "--cell", "next", "--workdir", worktree, "--", "true")[0] == 0
        assert _receipt(agnsup, "next")["controller"] == served.ready["controller"]  # handed over
        assert _gone(row["pid"])
        rec = _receipt(agnsup, "orphan")
        assert rec["state"] == "recovered", rec
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        agnsup("janitor", check=0)


def _journal(state):
    from agnsup.store.state import StateRoot
    return StateRoot(state).journal()


def test_sigint_to_the_caller_reaches_its_cell(agnsup, served, worktree):
    p = subprocess.Popen([BIN, "run", "--cell", "si", "--workdir", worktree, "--", "sleep", "300"], env=agnsup.env,
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        _running(agnsup, "si")
        p.send_signal(signal.SIGINT)
        assert p.wait(30) == 128 + signal.SIGINT
        rec = _receipt(agnsup, "si")
        assert rec["controller"] == served.ready["controller"]
        assert rec["state"] == "cancelled" and "signal SIGINT to the controller" in rec["cancel_reason"]
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        p.stderr.close()


def test_a_serve_killed_mid_cell_ends_the_cell_and_the_caller_says_so(agnsup, served, worktree):
    p = subprocess.Popen([BIN, "run", "--cell", "sk", "--workdir", worktree, "--", "sleep", "300"], env=agnsup.env,
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        row = _running(agnsup, "sk")
        served.server.kill()
        served.server.wait(30)
        err = p.stderr.read().decode()
        assert p.wait(30) == 125
        assert err.count("\n") == 1 and "went away before cell sk ended" in err, err
        wait_for(lambda: _gone(row["pid"]), what="the cell's end with its serve")
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        p.stderr.close()
    agnsup("janitor", check=0)


def _in_process(agnsup, cell: str, serve_controller: str | None = None) -> None:
    rec = _receipt(agnsup, cell)
    assert rec["exit_code"] == 0 and rec["controller"] != serve_controller


def test_a_stale_socket_means_in_process(agnsup, state, worktree):
    os.makedirs(state, exist_ok=True)
    s = socket.socket(socket.AF_UNIX)
    s.bind(os.path.join(state, "agnsup.sock"))
    s.close()  # the file stays, nobody listens: ECONNREFUSED
    assert _run(agnsup, "--cell", "st", "--workdir", worktree, "--", "true")[0] == 0
    _in_process(agnsup, "st")


def test_the_opt_out_runs_in_process(agnsup, served, worktree):
    assert _run(agnsup, "--cell", "oo", "--workdir", worktree, "--", "true", env={"AGNSUP_HANDOFF": "0"})[0] == 0
    _in_process(agnsup, "oo", served.ready["controller"])


LISTENER = """
import os, socket, sys
s = socket.socket(socket.AF_UNIX)
s.bind(sys.argv[1])
s.listen(1)
print("ready", flush=True)
c, _ = s.accept()
c.settimeout(10)
got = b""
try:
    while True:
        d = c.recv(4096)
        if not d:
            break
        got += d
except OSError:
    pass
print(len(got), flush=True)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to play another user's listener")
def test_a_listener_of_another_uid_is_not_used(worktree):
    from conftest import Agnsup, _cleanup_cgroups
    top = tempfile.mkdtemp(prefix="agnsup-handoff-uid.", dir="/var/tmp")  # a path the other user can reach
    state = os.path.join(top, "state")
    os.mkdir(state)
    os.chmod(top, 0o755)
    os.chmod(state, 0o777)  # only while the other user binds its socket there
    lst = subprocess.Popen(["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", sys.executable,
                            "-c", LISTENER, os.path.join(state, "agnsup.sock")], stdout=subprocess.PIPE)
    try:
        assert lst.stdout.readline() == b"ready\n"
        os.chmod(state, 0o700)
        agnsup = Agnsup(state)
        assert _run(agnsup, "--cell", "ou", "--workdir", worktree, "--", "true")[0] == 0
        assert lst.stdout.readline() == b"0\n"  # it was connected to, and sent nothing
        assert lst.wait(30) == 0
        _in_process(agnsup, "ou")
    finally:
        if lst.poll() is None:
            lst.kill()
            lst.wait()
        lst.stdout.close()
        _cleanup_cgroups(state)
        shutil.rmtree(top, ignore_errors=True)


def test_the_hand_off_imports_no_controller_and_no_socket_or_json(agnsup, served, worktree):
    """Its cost is the point of it: the client reads the console script's own entry point, then only the C halves
    of socket, json and signal (tests/test_startup_cost.py measures the in-process path)."""
    run = "import sys; sys.argv = ['agnsup', *sys.argv[1:]]; from agnsup.doors.entry import main; main()"
    at_start = subprocess.run([sys.executable, "-X", "importtime", "-c", "pass"], capture_output=True, timeout=60)
    cp = subprocess.run([sys.executable, "-X", "importtime", "-c", run, "run", "--cell", "imp", "--workdir", worktree,
                         "--", "true"], env=agnsup.env, capture_output=True, timeout=60, stdin=subprocess.DEVNULL)
    assert cp.returncode == 0, cp.stderr.decode()

    def mods(err: bytes) -> set[str]:
        return {line.rpartition("|")[2].strip() for line in err.decode().splitlines() if line.startswith("import time:")}
    new = mods(cp.stderr) - mods(at_start.stderr)
    assert "agnsup.doors.handoff" in new and _receipt(agnsup, "imp")["controller"] == served.ready["controller"]
    heavy = {"agnsup.tool", "agnsup.broker", "agnsup.supervisor", "agnsup.store.state", "agnsup.store.journal",
             "socket", "json", "signal", "contextlib", "enum", "re", "threading", "struct"}
    assert not new & heavy, sorted(new & heavy)


def test_at_a_terminal_run_keeps_its_in_process_path(agnsup, served, worktree):
    master, slave = os.openpty()
    try:
        p = subprocess.Popen([BIN, "run", "--cell", "tty", "--workdir", worktree, "--", "true"], env=agnsup.env,
                             stdin=subprocess.DEVNULL, stdout=slave, stderr=slave)
        os.close(slave)
        slave = None
        assert p.wait(60) == 0
    finally:
        if slave is not None:
            os.close(slave)
        os.close(master)
    _in_process(agnsup, "tty", served.ready["controller"])


@pytest.mark.parametrize("differs", ["AGNSUP_* environment", "umask"])
def test_a_caller_the_serve_differs_from_runs_in_process(agnsup, served, worktree, tmp_path, differs):
    """What a controller's process gives its cell or reads itself (the policy directory, the umask) must not
    change with the hand-off: the serve declines, and nothing ran there."""
    env, pre = {}, None
    if differs == "umask":
        def pre():
            os.umask(0o002)  # differs from the serve's 022
    else:
        env["AGNSUP_POLICY_DIR"] = str(tmp_path)
    p = subprocess.Popen([BIN, "run", "--cell", "df", "--workdir", worktree, "--", "true"],
                         env={**agnsup.env, **env}, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, preexec_fn=pre)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 0 and err == b"", err
    _in_process(agnsup, "df", served.ready["controller"])


def test_a_capped_cells_output_and_its_stopped_line_are_the_in_process_runs(state, worktree, tmp_path):
    """The cap's pump writes the caller's pipe from the serve, and the line a limit's stop ends with comes back."""
    from conftest import Agnsup, write_role
    pol = tmp_path / "policies"
    pol.mkdir()
    write_role(pol, "capped", limits__output_max='"1K"')
    agnsup = Agnsup(state, env={"AGNSUP_POLICY_DIR": str(pol)})
    s = STARTERS["serve"](agnsup, tmp_path)
    try:
        got = {}
        for how, env in (("handed", {}), ("alone", {"AGNSUP_HANDOFF": "0"})):
            ours, theirs = socket.socketpair()  # not a file or pipe of the caller's: pumped, and capped
            with ours, theirs:
                got[how] = _run(agnsup, "--role", "capped", "--cell", how, "--workdir", worktree, "--", "sh", "-c",
                                "head -c 100000 /dev/zero; sleep 30", env=env, stdout=theirs)
                theirs.close()
                out = b"".join(iter(lambda: ours.recv(65536), b""))
            assert out == b"\0" * 1024, len(out)
        assert _receipt(agnsup, "handed")["controller"] == s.ready["controller"]
        assert _receipt(agnsup, "alone")["controller"] != s.ready["controller"]
        assert got["handed"][0] == got["alone"][0] == 137
        assert got["handed"][2] == got["alone"][2].replace("cell alone", "cell handed")
        assert "stopped: output_limit (limits.output_max = 1024 bytes)" in got["handed"][2]
    finally:
        s.close()
