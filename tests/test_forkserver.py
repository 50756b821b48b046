"""A Supervisor's cells are born in its fork server (process/forkserver.py, issue 29, fourth round): a small
single-threaded process, the leaders' parent, tied to the Supervisor's forker thread by PR_SET_PDEATHSIG as each
leader is tied to it.

Checked to fail: with the "pdeathsig" step of process/steps.py doing nothing (the leader's tie to the server
removed), the SIGKILLed server's `sleep` cell goes on running and the wait below times out (its leader is
re-parented, alive)."""
import os
import signal
import sys

import pytest

from agnsup.errors import SetupError
from agnsup.supervisor import Supervisor


def _status(pid: int) -> dict:
    with open(f"/proc/{pid}/status") as f:
        return {k: v.strip() for k, _, v in (line.partition(":") for line in f)}


def test_a_supervisor_cells_leader_is_the_child_of_a_small_fork_server_not_of_the_controller(state, worktree):
    with Supervisor(state) as sup:
        h = sup.spawn(["sleep", "300"], workdir=worktree, run_id="born", cell_id="c1")
        server = sup._forker.server.pid
        assert server is not None and server != os.getpid()
        assert int(_status(h["pid"])["PPid"]) == server
        srv, me = _status(server), _status(os.getpid())
        assert int(srv["PPid"]) == os.getpid() and srv["Threads"] == "1"
        # small: a fresh interpreter with agnsup.process, not a copy of this controller (not a timing)
        assert int(srv["VmRSS"].split()[0]) * 2 < int(me["VmRSS"].split()[0]), (srv["VmRSS"], me["VmRSS"])
        sup.signal("born", "c1", "KILL")
        assert sup.wait("born", "c1", timeout=30)["state"] == "killed"


def test_the_fork_server_killed_alone_kills_its_cells_and_the_controller_reports_them(state, worktree):
    with Supervisor(state) as sup:
        h = sup.spawn(["sleep", "300"], workdir=worktree, run_id="dead", cell_id="c1")
        server = sup._forker.server.pid
        leader = os.pidfd_open(h["pid"])
        try:
            os.kill(server, signal.SIGKILL)  # our own Supervisor's server
            res = sup.wait("dead", "c1", timeout=30)
            assert res is not None, "the cell outlived its fork server"
            assert res["state"] == "killed" and res["exit_code"] == 128 + signal.SIGKILL, res
            assert sup.receipt("dead", "c1")["state"] == "killed"
            import select
            assert select.select([leader], [], [], 0)[0], "the leader still runs"
        finally:
            os.close(leader)
        # the next spawn starts a new server
        assert sup.run(["true"], workdir=worktree, run_id="dead", cell_id="c2")["exit_code"] == 0
        assert sup._forker.server.pid not in (None, server)


def test_a_fork_server_that_cannot_start_fails_the_spawn_clearly_and_journals_it(state, worktree, monkeypatch):
    monkeypatch.setattr(sys, "executable", "/nonexistent/python")
    with Supervisor(state) as sup:
        with pytest.raises(SetupError) as e:
            sup.spawn(["true"], workdir=worktree, run_id="refused", cell_id="c1")
        assert "fork_server" in str(e.value) and "/nonexistent/python" in str(e.value), str(e.value)
        row = sup.ctl.journal.cell("refused", "c1")
        assert row["state"] == "failed", dict(row)
        assert sup.receipt("refused", "c1")["state"] == "failed"


def test_a_fork_server_that_cannot_import_agnsup_says_why(state, worktree, monkeypatch):
    from agnsup.supervisor import PRELOAD
    monkeypatch.setattr("agnsup.supervisor.PRELOAD", (*PRELOAD, "agnsup.no_such_module"))
    with Supervisor(state) as sup:
        with pytest.raises(SetupError) as e:
            sup.spawn(["true"], workdir=worktree, run_id="refused", cell_id="c1")
        assert "fork_server" in str(e.value) and "no_such_module" in str(e.value), str(e.value)


def test_a_fork_server_that_never_says_ready_fails_the_spawn_in_bounded_time(state, worktree, monkeypatch, tmp_path):
    """An interpreter that hangs (a stuck import, a hung file system) is no server: the spawn fails, saying so,
    and the hung process is ended. Checked to fail: without the bound the spawn waits for ever (the test's own
    timeout)."""
    import agnsup.process.forkserver as forkserver
    hang = tmp_path / "python"
    hang.write_text("#!/bin/sh\nexec sleep 300\n")
    hang.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(hang))
    monkeypatch.setattr(forkserver, "READY_WAIT", 0.5)
    with Supervisor(state) as sup:
        with pytest.raises(SetupError) as e:
            sup.spawn(["true"], workdir=worktree, run_id="hung", cell_id="c1")
        assert "fork_server" in str(e.value) and "did not say ready" in str(e.value), str(e.value)
        assert sup._forker.server.pid is None  # the hung one was killed and reaped
        assert sup.ctl.journal.cell("hung", "c1")["state"] == "failed"


def test_a_spawn_request_larger_than_a_socket_message_reaches_the_cell_whole(state, worktree):
    """A big environment makes a request larger than one SOCK_SEQPACKET message can be: it goes in a memfd.
    Checked to fail: with forkserver.INLINE at 1 MiB the send fails (EMSGSIZE) and the spawn with it."""
    env = {f"BIG{i}": str(i) * 100_000 for i in range(3)}  # 300 KB (one string may have 128 KiB: execve(2))
    with Supervisor(state) as sup:
        r = sup.run(["sh", "-c", 'echo $((${#BIG0} + ${#BIG1} + ${#BIG2})) "${BIG2#"${BIG2%?}"}"'],
                    workdir=worktree, run_id="big", env=env, capture=True)
    assert r["exit_code"] == 0 and r["stdout"].split() == ["300000", "2"], r


def test_a_keep_cell_that_outlives_its_killed_fork_server_still_gets_its_own_exit_status(state, worktree):
    """A leader of on_controller_death = "keep" has no PR_SET_PDEATHSIG: the server's death leaves it running, and
    whoever inherits it reaps it. The controller reads its status from pidfs (PIDFD_INFO_EXIT, Linux 6.15+)."""
    from agnsup.linux import pidfd
    probe = os.fork()
    if probe == 0:
        os._exit(3)
    fd = os.pidfd_open(probe)
    os.waitpid(probe, 0)
    supported = pidfd.exit_status(fd) == 3 << 8
    os.close(fd)
    if not supported:
        pytest.skip("ENV_BLOCKED: PIDFD_INFO_EXIT (Linux 6.15+): the status of a leader reaped elsewhere")
    with Supervisor(state) as sup:
        sup.spawn(["sh", "-c", "read line; exit 7"], workdir=worktree, run_id="keep", cell_id="c1",
                  on_controller_death="keep", stdin=True)
        os.kill(sup._forker.server.pid, signal.SIGKILL)  # our own Supervisor's server
        sup.write_stdin("keep", "c1", b"go\n", eof=True)  # now it ends, unreaped by its dead server
        res = sup.wait("keep", "c1", timeout=30)
        assert res is not None and (res["state"], res["exit_code"]) == ("exited", 7), res


# the signals steps "signals" sets to their defaults, and the bits of /proc/PID/status's SigIgn they take
_DEFAULTED = (signal.SIGHUP, signal.SIGINT, signal.SIGQUIT, signal.SIGPIPE, signal.SIGTERM, signal.SIGCHLD,
              signal.SIGXFSZ)


def test_the_command_starts_with_default_signals_and_an_empty_mask_whatever_the_controller_had(state, worktree):
    """A controller run under nohup (SIGHUP ignored) that blocks SIGTERM, and a fork server whose interpreter
    ignores SIGPIPE and SIGXFSZ (Python's start-up): all of it crosses exec into the server, and none of it may
    reach a cell's command (steps "signals", docs/isolation.md). Checked to fail with that step doing nothing."""
    old_hup = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])  # the forker thread inherits it
    try:
        with Supervisor(state) as sup:
            r = sup.run(["grep", "-E", "^Sig(Ign|Blk):", "/proc/self/status"], workdir=worktree, run_id="sigs")
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        signal.signal(signal.SIGHUP, old_hup)
    assert r["exit_code"] == 0, r
    got = {k: int(v, 16) for k, _, v in (line.partition(":\t") for line in r["stdout"].splitlines())}
    assert got["SigBlk"] == 0, r["stdout"]
    ignored = [s.name for s in _DEFAULTED if got["SigIgn"] & (1 << (s - 1))]
    assert ignored == [], r["stdout"]
