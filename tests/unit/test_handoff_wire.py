"""The hand-off's wire (doors/handoff.py, serve.py's run_attached): the client's JSON from the C halves of json,
the server's line reader that keeps the descriptors a request came with, the caller's signal lines."""
import json
import os
import signal
import socket

from agnsup.doors import handoff, serve


def test_the_c_codec_writes_and_reads_what_json_does():
    dumps, loads = handoff._codec()
    req = {"op": handoff.OP, "argv": ["sh", "-c", "echo é \u2603 \"q\" \\\\ \n"], "timeout": 2.5, "cell_id": None,
           "env": ["A=1"], "host_env": {"HOME": "/root", "X": "\x00\x7f"}, "umask": 18, "flag": True}
    assert json.loads(dumps(req)) == req
    assert dumps(req).startswith('{"op": "run_attached"')  # serve's _handle tells the op by its first bytes
    line = json.dumps({"ok": True, "exit_code": 3, "said": ["agnsup: x"], "changes": {"paths": ["a"]}, "f": 1e-3})
    assert loads(line) == json.loads(line)


def test_the_line_reader_keeps_the_descriptors_with_their_request():
    a, b = socket.socketpair()
    r, w = os.pipe()
    try:
        socket.send_fds(a, [b'{"op": "x"}\n{"op": "y"}\n'], [r, w, r])
        a.sendall(b'{"op": "z"')
        a.shutdown(socket.SHUT_WR)
        lines = serve._Lines(b)
        first, fds = lines.readline(1 << 20)
        assert first == b'{"op": "x"}\n' and len(fds) == 3
        assert all(os.get_inheritable(fd) is False for fd in fds)  # MSG_CMSG_CLOEXEC
        serve._close_all(fds)
        assert fds == []
        assert lines.readline(1 << 20) == (b'{"op": "y"}\n', [])
        assert lines.readline(1 << 20) == (b'{"op": "z"', [])  # the end, without its newline
        assert lines.readline(1 << 20) == (b"", [])
    finally:
        for s in (a, b):
            s.close()
        os.close(r)
        os.close(w)


def test_a_long_line_is_cut_at_the_limit_as_readline_cuts_it():
    a, b = socket.socketpair()
    try:
        a.sendall(b"x" * 100 + b"\n")
        lines = serve._Lines(b)
        assert lines.readline(10) == (b"x" * 10, [])
    finally:
        a.close()
        b.close()


def test_the_caller_reads_its_signal_lines_and_its_end():
    a, b = socket.socketpair()
    try:
        c = serve.Caller(b, (0, 1, 2), 123, None)
        assert c._read() == (False, [])
        a.sendall(b'{"signal": 2}\n{"signal": 9}\nnot json\n{"signal": 15}\n{"sig')
        assert c._read() == (False, [signal.SIGINT, signal.SIGTERM])  # KILL is not a caller's to forward
        a.sendall(b'nal": 1}\n')
        assert c._read() == (False, [signal.SIGHUP])
        a.close()
        assert c._read() == (True, [])
    finally:
        a.close()
        b.close()


def test_the_opt_out(monkeypatch):
    monkeypatch.setenv(handoff.OPT_OUT, "0")
    assert handoff.wanted() is False


def test_a_missing_socket_is_no_serve(tmp_path):
    assert handoff._connect(str(tmp_path / "agnsup.sock")) is None
    long_dir = tmp_path / ("d" * 120)
    long_dir.mkdir()
    assert handoff._connect(str(long_dir / "agnsup.sock")) is None
