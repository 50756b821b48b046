"""`agnsup run` at a terminal (issue 13 "Terminals", docs/streaming.md): the cell gets a pty of
its own as stdin and controlling terminal, pumped both ways; the user's window size follows;
the user's terminal modes come back on every exit path; TIOCSTI stays refused.

The "user's terminal" is a real pty made here; agnsup runs as the session leader on it, so
it is agnsup's controlling terminal and its foreground group gets SIGWINCH."""
import fcntl
import os
import select
import signal
import struct
import subprocess
import sys
import termios
import time

from conftest import BIN

from agnsup.selftest.probes import TTY_INJECTION


BACKGROUND = "import subprocess, sys\nsys.exit(subprocess.Popen(sys.argv[1:], process_group=0).wait())\n"


def _size(fd, rows, cols):
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


class UserTerminal:
    def __init__(self, agnsup, *args, rows=30, cols=100, background=False, command=("run",)):
        self.master, slave = os.openpty()
        _size(self.master, rows, cols)
        self.slave_path = os.ttyname(slave)
        self.modes = termios.tcgetattr(slave)
        self.buf = b""

        def take_terminal():  # in the child: a new session whose controlling terminal is this pty
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)
        argv = [BIN, *command, *args]
        if background:  # a session leader that starts agnsup in a process group of its own, as `&` would
            argv = [sys.executable, "-c", BACKGROUND, *argv]
        self.p = subprocess.Popen(argv, env=agnsup.env, stdin=slave, stdout=slave, stderr=slave,
                                  start_new_session=True, preexec_fn=take_terminal)
        self.slave = slave  # kept open: the modes are read from it after agnsup ends

    def until(self, needle: bytes, timeout=30) -> bytes:
        deadline = time.monotonic() + timeout
        while needle not in self.buf:
            left = deadline - time.monotonic()
            assert left > 0, f"no {needle!r} on the terminal; got {self.buf!r}"
            r, _, _ = select.select([self.master], [], [], left)
            if r:
                try:
                    self.buf += os.read(self.master, 65536)
                except OSError:  # EIO: nobody has the terminal open any more
                    break
        assert needle in self.buf, self.buf
        return self.buf

    def type(self, data: bytes):
        os.write(self.master, data)

    def end(self, timeout=60) -> int:
        code = self.p.wait(timeout)
        self.now = termios.tcgetattr(self.slave)
        os.close(self.slave)
        os.close(self.master)
        return code


def test_the_cell_gets_a_controlling_terminal_its_input_and_the_users_window_size(agnsup, worktree):
    script = ("test -t 0 && test -t 1 && echo all-ttys; echo via-dev-tty > /dev/tty; stty size; echo ready; "
              "read x; echo got-$x; trap 'stty size; exit 3' WINCH; echo armed; while :; do sleep 0.05; done")
    t = UserTerminal(agnsup, "--workdir", worktree, "--", "sh", "-c", script)
    try:
        out = t.until(b"ready\r\n")
        assert b"all-ttys\r\nvia-dev-tty\r\n30 100\r\n" in out  # /dev/tty works: a controlling terminal
        assert termios.tcgetattr(t.slave)[3] & termios.ICANON == 0  # ours is raw while the cell runs
        t.type(b"hello\r")  # a raw terminal sends CR; the cell's own line discipline makes it a line
        t.until(b"got-hello\r\n")
        t.until(b"armed\r\n")
        _size(t.master, 40, 120)  # the kernel sends agnsup SIGWINCH; agnsup resizes the cell's pty
        t.until(b"40 120\r\n")
    finally:
        code = t.end()
    assert code == 3
    assert t.now == t.modes  # the user's modes are back


def test_the_users_modes_come_back_when_agnsup_is_stopped_and_tiocsti_stays_refused(agnsup, worktree):
    t = UserTerminal(agnsup, "--workdir", worktree, "--", "python3", "-c", TTY_INJECTION)
    try:
        t.until(b"TIOCLINUX")
    finally:
        code = t.end()
    assert b"TIOCSTI EPERM" in t.buf and b"TIOCSTI worked" not in t.buf
    assert code == 0 and t.now == t.modes

    t = UserTerminal(agnsup, "--workdir", worktree, "--", "sh", "-c", "echo ready; while :; do sleep 0.05; done")
    try:
        t.until(b"ready")
        t.p.send_signal(signal.SIGTERM)  # agnsup cancels the cell (grace, then kill)
    finally:
        code = t.end()
    assert code == 128 + signal.SIGTERM and t.now == t.modes


def test_ctrl_c_typed_at_the_terminal_interrupts_the_cell_not_agnsup(agnsup, worktree):
    t = UserTerminal(agnsup, "--workdir", worktree, "--", "sh", "-c",
                     "trap 'echo interrupted; exit 4' INT; echo ready; while :; do sleep 0.05; done")
    try:
        t.until(b"ready")
        t.type(b"\x03")  # ^C: the cell's pty turns it into SIGINT for the cell's foreground group
        t.until(b"interrupted")
    finally:
        code = t.end()
    assert code == 4 and t.now == t.modes


def test_a_background_agnsup_leaves_the_terminal_alone(agnsup, worktree):
    # taking the terminal (raw mode) from a background group would stop agnsup with SIGTTOU
    t = UserTerminal(agnsup, "--workdir", worktree, "--", "sh", "-c", "echo done", background=True)
    try:
        t.until(b"done")
    finally:
        code = t.end()
    assert code == 0 and t.now == t.modes


def test_spawn_follow_at_a_terminal_is_interactive_like_run(agnsup, tmp_path, worktree):
    from scenario import STARTERS
    s = STARTERS["serve"](agnsup, tmp_path)
    try:
        script = ("stty size; echo ready; read x; echo got-$x; trap 'stty size; exit 3' WINCH; echo armed; "
                  "while :; do sleep 0.05; done")
        t = UserTerminal(agnsup, "--workdir", worktree, "--", "sh", "-c", script, command=("spawn", "--follow"))
        try:
            t.until(b"30 100\r\nready\r\n")  # a pty of our terminal's size, through serve
            t.type(b"hi\r")  # keys go to the cell's stdin op
            t.until(b"got-hi\r\n")
            t.until(b"armed\r\n")
            _size(t.master, 40, 120)  # SIGWINCH here: the resize op
            t.until(b"40 120\r\n")
        finally:
            code = t.end()
        assert code == 3 and t.now == t.modes
    finally:
        s.close()


# -- the terminal's end of input (issue 28 §6) ---------------------------------------------------
# A pty wrapper whose own input is at end of file (script(1), expect, ssh -t, a CI runner's pty) types
# the terminal's VEOF (^D) at once, before agnsup has set the terminal raw: it waits in the canonical
# line discipline as an end of input, which raw mode would hand on as a NUL byte. The cell must read
# end of file as it would without agnsup. Timeouts here are guards against a hang, never measures.
READ_ALL = "import sys; print(repr(sys.stdin.read()))"


def _script(agnsup, worktree, stdin: bytes) -> bytes:
    import shlex
    import shutil
    if shutil.which("script") is None:
        import pytest
        pytest.skip("ENV_BLOCKED: no script(1) (util-linux) on this host")
    line = shlex.join([BIN, "run", "--workdir", worktree, "--", "python3", "-c", READ_ALL])
    p = subprocess.run(["script", "-qec", line, "/dev/null"], input=stdin, capture_output=True,
                       env=agnsup.env, timeout=60)
    return p.stdout


def test_under_script_with_stdin_at_end_of_file_the_cell_reads_end_of_file(agnsup, worktree):
    out = _script(agnsup, worktree, b"")
    assert b"''\r\n" in out and b"^@" not in out, out


def test_under_script_data_then_end_of_file_reaches_the_cell_then_end_of_file(agnsup, worktree):
    out = _script(agnsup, worktree, b"hello\nworld\n")
    assert b"'hello\\nworld\\n'\r\n" in out and b"^@" not in out, out


def _pty_driver(agnsup, argv: list, typed: bytes, after: bytes = b"", hangup=False) -> tuple[bytes, int]:
    """As expect or a CI runner: agnsup on a pty of ours (its controlling terminal); `typed` goes in
    at once (still canonical), then, once `after` appeared on the terminal, the end of our input: ^D,
    or with `hangup` we close the terminal. The output until it closes, and agnsup's exit status."""
    import pty
    pid, master = pty.fork()
    if pid == 0:  # the child: exec at once (nothing else in a forked copy of pytest)
        os.execve(BIN, [BIN, *argv], agnsup.env)
    buf = b""
    try:
        os.write(master, typed if after else typed + b"\x04")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            r, _, _ = select.select([master], [], [], deadline - time.monotonic())
            if not r:
                break
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: agnsup and the cell are gone
                break
            if not chunk:
                break
            buf += chunk
            if after and after in buf:
                if hangup:
                    break
                os.write(master, b"\x04")
                after = b""
    finally:
        os.close(master)  # a hangup: agnsup cancels the cell if it still runs (the guard fired)
        deadline = time.monotonic() + 30
        while not (done := os.waitpid(pid, os.WNOHANG))[0] and time.monotonic() < deadline:
            time.sleep(0.1)
        status = done[1]
        if not done[0]:
            os.kill(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
    return buf, os.waitstatus_to_exitcode(status)


def test_a_pty_driver_that_ends_its_input_at_once_gives_the_cell_end_of_file(agnsup, worktree):
    out, code = _pty_driver(agnsup, ["run", "--workdir", worktree, "--", "python3", "-c", READ_ALL], b"")
    assert b"''\r\n" in out and b"^@" not in out and code == 0, out


def test_a_pty_driver_with_lines_then_the_end_of_its_input(agnsup, worktree):
    # what the terminal held before agnsup went raw reaches the cell in order: a line, a partial
    # line the terminal's ^D handed on, then the end of input
    script = "import sys; print(repr(sys.stdin.readline())); print(repr(sys.stdin.read()))"
    out, code = _pty_driver(agnsup, ["run", "--workdir", worktree, "--", "python3", "-c", script],
                            b"one\ntwo\x04")
    assert b"'one\\n'\r\n'two'\r\n" in out and b"^@" not in out and code == 0, out


def test_an_end_of_input_typed_while_the_cell_runs_is_end_of_file_too(agnsup, worktree):
    script = "import sys; print('ready', flush=True); print(repr(sys.stdin.read()))"
    out, code = _pty_driver(agnsup, ["run", "--workdir", worktree, "--", "python3", "-c", script], b"",
                            after=b"ready\r\n")
    assert b"''\r\n" in out and code == 0, out


def test_spawn_follow_under_a_pty_driver_with_its_input_ended_gives_end_of_file(agnsup, tmp_path, worktree):
    from scenario import STARTERS
    s = STARTERS["serve"](agnsup, tmp_path)
    try:
        out, code = _pty_driver(agnsup, ["spawn", "--follow", "--workdir", worktree, "--", "python3", "-c",
                                         READ_ALL], b"hi\n")
    finally:
        s.close()
    assert b"'hi\\n'\r\n" in out and b"^@" not in out and code == 0, out


def test_a_hangup_of_the_terminal_cancels_the_cell_and_agnsup_ends_cleanly(agnsup, worktree):
    # the far side closes the terminal (expect's `close`, a dropped ssh connection): SIGHUP cancels the
    # cell; giving the modes back to a hung-up terminal fails (termios.error, EIO), and must not crash
    out, code = _pty_driver(agnsup, ["run", "--workdir", worktree, "--", "sh", "-c", "echo ready; read x"], b"",
                            after=b"ready\r\n", hangup=True)
    assert code == 128 + signal.SIGHUP, out
    ps = agnsup("ps", "--all", check=0)
    assert "cancelled" in ps.out and "recovered" not in ps.out + ps.err, ps.out + ps.err
