"""The terminal's end of input (issue 28 §6) on ptys made here, no cell: what UserTerminal reads before
it sets the terminal raw, and what ends a pty's input (pump.end_of_input, Input.write eof).
The whole path under script(1) and a pty driver is tests/test_terminal.py."""
import os
import select
import termios
import tty

import pytest

from agnsup.io.pump import Input, UserTerminal, end_of_input


@pytest.fixture
def pty_pair():
    master, slave = os.openpty()
    yield master, slave
    for fd in (master, slave):
        try:
            os.close(fd)
        except OSError:
            pass


def _settle(fd):
    """The line discipline has taken what was written to the master (a poll flushes its work)."""
    select.select([fd], [], [], 0.5)


def _read(fd) -> bytes:
    """One read, once there is something (a line, or an end of file) to read: never a hang."""
    assert select.select([fd], [], [], 10)[0], "nothing to read: the reader would wait for ever"
    return os.read(fd, 64)


def test_an_end_of_input_typed_before_raw_mode_is_read_as_one_not_as_a_nul_byte(pty_pair):
    master, slave = pty_pair
    before = termios.tcgetattr(slave)
    os.write(master, b"one\n\x04two\x04")
    _settle(slave)
    t = UserTerminal(slave, None)
    try:
        assert t.ahead == [(b"one\n", False), (b"", True), (b"two", True)]
        assert termios.tcgetattr(slave)[3] & termios.ICANON == 0  # raw now
        os.write(master, b"\x04")  # typed now: a byte the raw read hands on
        _settle(slave)
        assert _read(slave) == b"\x04"
    finally:
        t.restore()
    assert termios.tcgetattr(slave) == before  # VEOF too is back


def test_without_raw_mode_the_pending_end_of_input_would_be_a_nul_byte(pty_pair):
    # the bug, kept as a fact of the kernel the fix relies on: n_tty stores VEOF as 0
    master, slave = pty_pair
    os.write(master, b"\x04")
    _settle(slave)
    tty.setraw(slave, termios.TCSANOW)
    _settle(slave)
    assert _read(slave) == b"\0"


def test_end_of_input_is_veof_at_line_start_twice_after_a_partial_line_once_when_raw(pty_pair):
    master, slave = pty_pair
    assert end_of_input(master, b"\n") == b"\x04"
    assert end_of_input(master, b"x") == b"\x04\x04"
    assert end_of_input(master, b"\r") == b"\x04"    # ICRNL: Enter ends the line
    assert end_of_input(master, b"\x15") == b"\x04"  # ^U killed the line
    tty.setraw(slave, termios.TCSANOW)
    assert end_of_input(master, b"x") == b"\x04"     # a raw program reads the byte itself
    attrs = termios.tcgetattr(slave)
    attrs[3] |= termios.ICANON
    attrs[6][termios.VEOF] = b"\0"
    termios.tcsetattr(slave, termios.TCSANOW, attrs)
    assert end_of_input(master, b"\n") == b""        # VEOF disabled: nothing ends the input


def test_write_stdin_eof_on_a_pty_after_a_partial_line_hands_it_on_then_end_of_file(pty_pair):
    master, slave = pty_pair
    attrs = termios.tcgetattr(slave)
    attrs[3] &= ~termios.ECHO
    termios.tcsetattr(slave, termios.TCSANOW, attrs)
    i = Input(os.dup(master), tty=True)
    try:
        i.write(b"one\ntwo", eof=True)
        _settle(slave)
        assert _read(slave) == b"one\n" and _read(slave) == b"two" and _read(slave) == b""
        i.write(b"", eof=True)  # at the start of a line now: one VEOF, one end of file
        assert _read(slave) == b""
    finally:
        i.close()
