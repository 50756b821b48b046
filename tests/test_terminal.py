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
import termios
import time

from conftest import BIN

from agnsup.selftest.probes import TTY_INJECTION


def _size(fd, rows, cols):
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


class UserTerminal:
    def __init__(self, agnsup, *args, rows=30, cols=100):
        self.master, slave = os.openpty()
        _size(self.master, rows, cols)
        self.slave_path = os.ttyname(slave)
        self.modes = termios.tcgetattr(slave)
        self.buf = b""

        def take_terminal():  # in the child: a new session whose controlling terminal is this pty
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)
        self.p = subprocess.Popen([BIN, "run", *args], env=agnsup.env, stdin=slave, stdout=slave, stderr=slave,
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
