"""`agnsup serve`'s protocol over the fake backend and fake process layer: the request -> handler table,
bad requests, the replies, notes, one connection's requests in order, the peer check's refusal, and
the client. Requests go to the dispatch directly, or over a socketpair; no cell process is started."""
import base64
import json
import os
import socket
import threading

import pytest

from agnsup.doors import serve
from agnsup.errors import NoServer, UnknownId, UsageError, exit_code

from fake_backend import FakeHost

WAIT = 30  # seconds a request waits for a cell the test ended (never reached when it passes)


class World(FakeHost):
    def __init__(self, tmp_path, monkeypatch):
        super().__init__(tmp_path, monkeypatch)
        self.server = serve.Server(self.state_dir, None, backend=self.backend)
        self.notes: list[str] = []

    def ask(self, op=None, line: bytes | None = None, **args) -> dict:
        """One request line through the server's dispatch, as a connection hands it over."""
        return self.server._dispatch(line if line is not None else json.dumps({"op": op, **args}).encode(),
                                     self.notes.append)

    def spawn(self, cell_id="c1", **options) -> dict:
        return self.ask("spawn", argv=["true"], workdir=self.wt, run_id="R", agent_id="A", cell_id=cell_id,
                        **options)


@pytest.fixture
def w(tmp_path, monkeypatch):
    world = World(tmp_path, monkeypatch)
    yield world
    world.server.shutdown()
    assert not os.path.lexists(world.server.path)


def test_ping_names_the_controller_and_its_pid(w):
    assert w.ask("ping") == {"ok": True, "controller": w.server.sup.controller_id, "pid": os.getpid()}


@pytest.mark.parametrize("line, says", [
    (b"not json\n", "bad request: "),
    (b"[1, 2]\n", "bad request: a request is a JSON object"),
    (b'{"run_id": "R"}\n', "unknown op None"),
    (b'{"op": "fork"}\n', "unknown op 'fork'"),
    (b'{"op": "__init__"}\n', "unknown op '__init__'"),
    (b'{"op": "wait", "cell_id": "c1"}\n', "bad request: 'run_id'"),
    (b'{"op": "stdin", "run_id": "R", "cell_id": "c1", "data_b64": "not base64!"}\n', "bad request: "),
    (b'{"op": "spawn", "argv": ["true"], "colour": "red"}\n', "colour"),
])
def test_a_bad_request_is_one_usage_error_line_and_the_server_goes_on(w, line, says):
    res = w.ask(line=line)
    assert (res["ok"], res["error_type"]) == (False, "UsageError") and says in res["error"], res
    assert res["exit_code"] == exit_code(UsageError("x"))
    assert w.ask("ping")["ok"] and w.procs.calls == []


def test_an_agnsup_error_keeps_its_type_and_exit_code_and_an_os_error_becomes_one_line(w, monkeypatch):
    res = w.ask("wait", run_id="R", cell_id="nope")
    assert res == {"ok": False, "error": "no cell 'nope' in run 'R' in the journal", "error_type": "UnknownId",
                   "exit_code": 1}

    def full(*a):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(w.server.sup, "list", full)
    res = w.ask("ps")
    assert res["ok"] is False and res["error"] == "serve: [Errno 28] No space left on device"
    assert (res["error_type"], res["exit_code"]) == ("AgnsupError", 125)


def test_spawn_ps_wait_cancel_each_reach_the_supervisor_and_the_entry_is_the_servers_to_say(w):
    h = w.spawn(capture=True, entry="mcp")
    assert h["ok"] and h["state"] == "running" and h["cell_id"] == "c1"
    stages = [e for e in w.server.sup.ctl.journal.events("R", "c1") if e["kind"] == "stage.public_tool"]
    assert json.loads(stages[0]["data"])["entry"] == "serve"
    assert [c["cell_id"] for c in w.ask("ps")["cells"]] == ["c1"]
    assert w.ask("wait", run_id="R", cell_id="c1", timeout=0) == {"ok": True, "pending": True}
    assert w.ask("cancel", cell_id="c1", grace=0)["cancelled"] == 1
    res = w.ask("wait", run_id="R", cell_id="c1", timeout=WAIT)
    assert (res["ok"], res["state"], res["exit_code"]) == (True, "cancelled", 143)
    assert w.ask("ps") == {"ok": True, "cells": []}
    assert [c["state"] for c in w.ask("ps", all=True)["cells"]] == ["cancelled"]
    assert w.ask("cleanup", run_id="nope")["ok"] is False  # a run the journal never saw


def test_run_spawns_and_answers_with_the_result(w):
    w.procs.on_release = lambda child: w.k.procs[child.pid].exit(6)  # a command that ends at once
    res = w.ask("run", argv=["true"], workdir=w.wt, run_id="R", cell_id="c1", capture=True)
    assert (res["ok"], res["state"], res["exit_code"], res["stdout"]) == (True, "exited", 6, "")


def test_live_io_travels_as_base64_both_ways_and_kill_ends_the_cell(w):
    h = w.spawn(stdin=True, stream=True)
    leader = w.k.procs[h["pid"]]
    assert w.ask("stdin", run_id="R", cell_id="c1", data_b64=base64.b64encode(b"\x00\xff in").decode()) == \
        {"ok": True}
    assert os.read(leader.stdio[0], 100) == b"\x00\xff in"
    os.write(leader.stdio[1], b"\x01\xfe out")
    out = w.ask("output", run_id="R", cell_id="c1", since=0, timeout=WAIT)
    assert out["ok"] and [(c["seq"], c["stream"], base64.b64decode(c["data_b64"])) for c in out["chunks"]] == \
        [(0, "stdout", b"\x01\xfe out")]
    assert w.ask("signal", run_id="R", cell_id="c1", sig="KILL") == {"ok": True}
    res = w.ask("wait", run_id="R", cell_id="c1", timeout=WAIT)
    assert (res["state"], res["exit_code"]) == ("killed", 137) and not leader.alive


def test_resize_reaches_a_pty_cell(w):
    import fcntl
    import struct
    import termios
    h = w.spawn(pty={"cols": 80, "rows": 24})
    assert w.ask("resize", run_id="R", cell_id="c1", cols=120, rows=40) == {"ok": True}
    size = fcntl.ioctl(w.k.procs[h["pid"]].stdio[0], termios.TIOCGWINSZ, b"\0" * 8)
    assert struct.unpack("HHHH", size)[:2] == (40, 120)
    assert w.ask("resize", run_id="R", cell_id="c1", cols=120)["error"] == "bad request: 'rows'"
    w.k.procs[h["pid"]].exit(0)
    assert w.ask("wait", run_id="R", cell_id="c1", timeout=WAIT)["state"] == "exited"


def _connection(w, sent: bytes = b""):
    """Our end of a socketpair whose other end the server handles in a thread, as it does an accepted one
    (`sent`: what is written before it starts)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    ours.sendall(sent)
    t = threading.Thread(target=w.server._handle, args=(theirs,), daemon=True)
    t.start()
    return ours, ours.makefile("rwb"), t


def _serve_one(w) -> threading.Thread:
    """The server's listener accepts one connection and handles it, in a thread."""
    def accept_one():
        conn, _ = w.server.listener.accept()
        w.server._handle(conn)
    t = threading.Thread(target=accept_one, daemon=True)
    t.start()
    return t


def test_one_connection_answers_its_requests_in_order_notes_first_and_ends_at_eof(w):
    first = w.spawn("c1", capture=True)
    sock, f, t = _connection(w)
    w.procs.on_release = lambda child: w.k.procs[child.pid].exit(0)
    for req in ({"op": "ping"}, {"op": "spawn", "argv": ["true"], "workdir": w.wt, "run_id": "R", "cell_id": "c2",
                                 "capture": True}, {"op": "nope"}):
        f.write(json.dumps(req).encode() + b"\n")
    f.flush()
    replies = [json.loads(f.readline()) for _ in range(4)]
    assert replies[0]["ok"] and replies[0]["controller"] == w.server.sup.controller_id
    assert "is waiting for the worktree" in replies[1]["note"]  # the queued spawn says so before its reply
    assert (replies[2]["ok"], replies[2]["state"], replies[2]["pid"]) == (True, "waiting", None)
    assert replies[3]["error"] == "unknown op 'nope'"
    sock.shutdown(socket.SHUT_WR)  # EOF: the server closes its end
    assert f.readline() == b""
    t.join(WAIT)
    assert not t.is_alive()
    f.close()
    sock.close()
    w.k.procs[first["pid"]].exit(0)
    assert w.ask("wait", run_id="R", cell_id="c2", timeout=WAIT)["state"] == "exited"


def test_a_peer_that_is_a_cells_process_gets_one_refusal_line_journaled_and_no_request_is_read(w, monkeypatch):
    from agnsup.linux import peer
    checked = []

    def a_cell(conn):
        checked.append(conn)
        return peer.Peer(4321, 0, 0, ["its cgroup is cell c9's"])
    monkeypatch.setattr(peer, "check", a_cell)
    sock, f, t = _connection(w, b'{"op": "spawn", "argv": ["true"]}\n')
    line = ("serve: refused: the connecting process (pid 4321, uid 0) is a process of an agnsup cell "
            "(its cgroup is cell c9's); cells never reach a control socket")
    assert json.loads(f.readline()) == {"ok": False, "error": line, "error_type": "Denied", "exit_code": 126}
    try:
        rest = f.readline()
    except ConnectionResetError:  # it closed the connection with our request unread in it
        rest = b""
    assert rest == b"" and len(checked) == 1 and w.procs.calls == []
    (refused,) = w.server.sup.ctl.journal.refusals()
    assert (refused["kind"], refused["error"], refused["entry"], refused["peer"]["pid"]) == \
        ("refused", line, "serve", 4321)
    t.join(WAIT)
    f.close()
    sock.close()


def test_the_client_raises_the_error_a_reply_carries_and_says_when_nobody_listens(w, tmp_path):
    t = _serve_one(w)
    with serve.Client(w.server.path) as c:
        assert c.call("ping")["controller"] == w.server.sup.controller_id
        with pytest.raises(UnknownId, match="no cell 'nope'"):
            c.call("wait", run_id="R", cell_id="nope")
    t.join(WAIT)
    with pytest.raises(NoServer, match="no serve controller listens at"):
        serve.Client(str(tmp_path / "nobody.sock"))


def test_follow_prints_the_cells_output_as_it_comes_and_returns_its_result(w, capsys):
    h = w.spawn(stream=True)
    leader = w.k.procs[h["pid"]]
    os.write(leader.stdio[1], b"to stdout\n")
    os.write(leader.stdio[2], b"to stderr\n")
    leader.exit(3)
    t = _serve_one(w)
    with serve.Client(w.server.path) as c:
        res = serve._follow(c, {"run_id": "R", "cell_id": "c1"})
    t.join(WAIT)
    assert (res["state"], res["exit_code"]) == ("exited", 3)
    assert capsys.readouterr() == ("to stdout\n", "to stderr\n")


def test_a_control_socket_lives_only_where_no_cell_reaches_it(tmp_path):
    state = str(tmp_path / "state")
    for ok in (os.path.join(state, "x.sock"), "/run/agnsup-test.sock", "/tmp/x/agnsup.sock"):
        assert serve.socket_place(ok, state, "--socket X") == ok
    for bad in ("/var/lib/x.sock", "/tmpx/a.sock", "/run/../etc/a.sock", "/x.sock"):
        with pytest.raises(UsageError, match="--socket X: a control socket must live where no cell can reach"):
            serve.socket_place(bad, state, "--socket X")


def test_a_listening_socket_is_born_0600_a_dead_ones_file_is_replaced_and_a_live_one_is_refused(tmp_path):
    os.mkdir(tmp_path / ("d" * 110))
    path = str(tmp_path / ("d" * 110) / "x.sock")  # past sun_path's 107 bytes: bound through its directory
    first = serve.listen_unix(path, "serve controller")
    try:
        assert os.stat(path).st_mode & 0o777 == 0o600
        with pytest.raises(UsageError, match=f"another serve controller already listens at {path}"):
            serve.listen_unix(path, "serve controller")
    finally:
        first.close()
    second = serve.listen_unix(path, "serve controller")  # the file of a listener that is gone
    second.close()


def test_the_spawn_request_carries_the_callers_directory_environment_and_absolute_receipt_path(tmp_path,
                                                                                             monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("AGNSUP_UNIT_MARK", "1")
    req = serve.spawn_request(["make"], {"env": ("A",), "receipt_file": "r.json", "role": "executor"})
    assert (req["argv"], req["env"], req["workdir"], req["receipt_file"], req["role"]) == \
        (["make"], ["A"], os.path.realpath(tmp_path), str(tmp_path / "r.json"), "executor")
    assert req["host_env"]["AGNSUP_UNIT_MARK"] == "1"
