"""Live I/O of a cell through the in-process Supervisor (issue 17 §1, docs/streaming.md):
read_output in order, stdin with EOF, INT/TERM to the group, KILL of the whole tree,
a pty with its size and SIGWINCH, and the output cap over a streamed cell."""
import json
import os

import pytest
from conftest import write_role
from scenario import alive, wait_for

from agnsup import Supervisor
from agnsup.errors import UnknownId, UsageError
from agnsup.linux import proc

LOOP = "while :; do sleep 0.05; done"


@pytest.fixture
def sup(state):
    s = Supervisor(state)
    yield s
    s.close()


class Reader:
    """Follows one cell's output with read_output, as a client would."""

    def __init__(self, sup, h):
        self.sup, self.run_id, self.cell_id = sup, h["run_id"], h["cell_id"]
        self.next, self.chunks, self.ended = 0, [], False

    def read(self, timeout=10):
        out = self.sup.read_output(self.run_id, self.cell_id, self.next, timeout=timeout)
        seqs = [c["seq"] for c in out["chunks"]]
        assert seqs == list(range(self.next, self.next + len(seqs)))  # contiguous, from `since`
        self.chunks += out["chunks"]
        self.next, self.ended = out["next"], out["ended"]
        return out

    def data(self, stream=None) -> bytes:
        return b"".join(c["data"] for c in self.chunks if stream in (None, c["stream"]))

    def until(self, needle: bytes, timeout=20) -> bytes:
        def seen():
            if needle in self.data():
                return True
            assert not self.ended, f"output ended without {needle!r}: {self.data()!r}"
            self.read(0.5)
        wait_for(seen, timeout, f"{needle!r} in the output")
        return self.data()

    def to_end(self) -> bytes:
        wait_for(lambda: self.ended or self.read(1) and False, 30, "the end of the output")
        return self.data()


def test_stdout_and_stderr_come_back_in_order_and_stdin_round_trips_with_eof(sup, worktree, state):
    # the cell answers each stdin line on the stream it names: lockstep, so the order is defined
    script = 'while read s w; do if [ "$s" = err ]; then echo "$w" >&2; else echo "$w"; fi; done; echo eof'
    h = sup.spawn(["sh", "-c", script], workdir=worktree, stdin=True, stream=True)
    r = Reader(sup, h)
    want = [("stdout", "o1"), ("stderr", "e1"), ("stdout", "o2"), ("stderr", "e2"), ("stderr", "e3")]
    for stream, word in want:
        sup.write_stdin(h["run_id"], h["cell_id"], f"{stream[3:]} {word}\n".encode())
        r.until(word.encode() + b"\n")
    sup.write_stdin(h["run_id"], h["cell_id"], b"", eof=True)
    r.to_end()
    got = [(c["stream"], c["data"].decode()) for c in r.chunks]
    assert got == [(s, w + "\n") for s, w in want] + [("stdout", "eof\n")]
    assert sup.wait(h["run_id"], h["cell_id"], 30)["exit_code"] == 0
    cell_dir = os.path.join(state, "cells", h["run_id"], h["cell_id"])
    with open(os.path.join(cell_dir, "stdout"), "rb") as f:
        assert f.read() == r.data("stdout") == b"o1\no2\neof\n"  # the captured files stay the record
    with open(os.path.join(cell_dir, "stderr"), "rb") as f:
        assert f.read() == r.data("stderr") == b"e1\ne2\ne3\n"
    # a late reader gets everything again from seq 0, the cell long gone
    late = sup.read_output(h["run_id"], h["cell_id"], 0, timeout=0)
    assert [c["data"] for c in late["chunks"]] == [c["data"] for c in r.chunks] and late["ended"]
    with pytest.raises(UsageError, match="cannot write its stdin"):
        sup.write_stdin(h["run_id"], h["cell_id"], b"more")


def test_max_bytes_pages_and_a_timeout_returns_empty_while_the_cell_is_quiet(sup, worktree):
    h = sup.spawn(["sh", "-c", "head -c 300000 /dev/zero; read x || echo eof"], workdir=worktree, stdin=True, stream=True)
    r = Reader(sup, h)
    r.until(b"\0" * 1)
    wait_for(lambda: len(r.data()) == 300000 or r.read(1) and False, 20, "300000 bytes")
    first = sup.read_output(h["run_id"], h["cell_id"], 0, max_bytes=1)
    assert len(first["chunks"]) == 1 and first["next"] == 1  # at least one chunk, even past max_bytes
    quiet = sup.read_output(h["run_id"], h["cell_id"], r.next, timeout=0.05)
    assert quiet == {"chunks": [], "next": r.next, "ended": False}
    sup.write_stdin(h["run_id"], h["cell_id"], b"", eof=True)
    r.to_end()
    assert sup.wait(h["run_id"], h["cell_id"], 30)["exit_code"] == 0


def test_int_and_term_go_to_the_cells_process_group(sup, worktree):
    h = sup.spawn(["sh", "-c", f"trap 'echo got-int; exit 5' INT; echo ready; {LOOP}"], workdir=worktree, stream=True)
    r = Reader(sup, h)
    r.until(b"ready")
    sup.signal(h["run_id"], h["cell_id"], "INT")
    res = sup.wait(h["run_id"], h["cell_id"], 30)
    assert res["exit_code"] == 5 and b"got-int" in r.to_end()

    # a second process of the group (a background subshell) hears TERM too
    child = f'(trap "echo child-term; exit 0" TERM; echo child-ready; {LOOP}) & '
    leader = f'trap "echo leader-term; wait; exit 7" TERM; echo leader-ready; {LOOP}'
    h = sup.spawn(["sh", "-c", child + leader], workdir=worktree, stream=True)
    r = Reader(sup, h)
    r.until(b"child-ready")
    r.until(b"leader-ready")
    sup.signal(h["run_id"], h["cell_id"], "TERM")
    res = sup.wait(h["run_id"], h["cell_id"], 30)
    out = r.to_end()
    assert res["exit_code"] == 7 and b"child-term" in out and b"leader-term" in out


def test_kill_stops_the_whole_tree_setsid_daemon_included(sup, worktree):
    # the daemon leaves the cell's session and group: only the cgroup still holds it
    script = f'setsid sh -c "{LOOP}" & echo ready; {LOOP}'
    h = sup.spawn(["sh", "-c", script], workdir=worktree, stream=True)
    Reader(sup, h).until(b"ready")

    def members():  # the cell's processes, by host pid, from its cgroup
        with open(os.path.join(h["cgroup"], "cgroup.procs")) as f:
            return [s for s in (proc.stat(int(p)) for p in f.read().split()) if s is not None]
    daemons = wait_for(lambda: [s for s in members() if s.sid != h["pid"] and s.comm == "sh"], 10, "the daemon")
    sup.signal(h["run_id"], h["cell_id"], "KILL")
    res = sup.wait(h["run_id"], h["cell_id"], 30)
    assert res["reason"] == "killed" and res["state"] == "killed" and res["exit_code"] == 128 + 9
    assert not any(alive(d.pid, d.starttime) for d in daemons)
    assert not os.path.exists(h["cgroup"])
    sup.signal(h["run_id"], h["cell_id"], "KILL")  # ended: nothing to do, no error
    events = [e for e in sup.ctl.journal.events(h["run_id"], h["cell_id"]) if e["kind"] == "signal"]
    assert len(events) == 1 and '"KILL"' in events[0]["data"]


def test_a_pty_cell_sees_a_terminal_of_its_size_and_resize_sends_sigwinch(sup, worktree, state):
    script = ("test -t 0 && test -t 1 && test -t 2 && echo all-ttys; stty size; "
              f"trap 'echo winch; stty size' WINCH; echo ready; {LOOP}")
    h = sup.spawn(["sh", "-c", script], workdir=worktree, pty={"cols": 100, "rows": 30})
    r = Reader(sup, h)
    out = r.until(b"ready")
    assert b"all-ttys\r\n30 100\r\n" in out  # a terminal's defaults: ONLCR
    sup.resize(h["run_id"], h["cell_id"], 132, 43)
    r.until(b"winch\r\n43 132\r\n")
    assert {c["stream"] for c in r.chunks} == {"tty"}
    with pytest.raises(UsageError, match="not spawned with stdin"):
        sup.write_stdin(h["run_id"], h["cell_id"], b"x")
    sup.signal(h["run_id"], h["cell_id"], "KILL")
    sup.wait(h["run_id"], h["cell_id"], 30)
    with open(os.path.join(state, "cells", h["run_id"], h["cell_id"], "stdout"), "rb") as f:
        assert f.read() == r.to_end()


def test_a_pty_cell_reads_its_input_line_by_line_and_eof_is_the_eof_character(sup, worktree):
    h = sup.spawn(["sh", "-c", "stty -echo; echo ready; cat; echo done"], workdir=worktree, stdin=True,
                  pty={"cols": 80, "rows": 24})
    r = Reader(sup, h)
    r.until(b"ready")
    sup.write_stdin(h["run_id"], h["cell_id"], b"one\n", eof=True)
    out = r.to_end()
    assert out.endswith(b"ready\r\none\r\ndone\r\n")
    assert sup.wait(h["run_id"], h["cell_id"], 30)["exit_code"] == 0


def test_the_output_cap_still_stops_a_streamed_cell_and_the_file_holds_what_was_delivered(
        sup, worktree, policy_dir, monkeypatch, state):
    write_role(policy_dir, "capped", limits__output_max='"64K"')
    monkeypatch.setenv("AGNSUP_POLICY_DIR", str(policy_dir))
    h = sup.spawn(["sh", "-c", "echo start >&2; read go; yes"], role="capped", workdir=worktree, stream=True,
                  stdin=True)
    r = Reader(sup, h)
    r.until(b"start\n")  # stderr counts against the cap too: in before the flood
    sup.write_stdin(h["run_id"], h["cell_id"], b"go\n")
    res = sup.wait(h["run_id"], h["cell_id"], 30)
    data = r.to_end()
    assert res["reason"] == "output_limit" and len(data) == 64 * 1024
    cell_dir = os.path.join(state, "cells", h["run_id"], h["cell_id"])
    with open(os.path.join(cell_dir, "stdout"), "rb") as f, open(os.path.join(cell_dir, "stderr"), "rb") as g:
        assert f.read() == r.data("stdout") and g.read() == r.data("stderr") == b"start\n"


def test_live_io_refuses_clearly(sup, worktree):
    with pytest.raises(UnknownId):
        sup.read_output("default", "no-such-cell")
    h = sup.spawn(["true"], workdir=worktree)
    for call, fragment in ((lambda: sup.read_output(h["run_id"], h["cell_id"]), "not spawned with stream"),
                           (lambda: sup.write_stdin(h["run_id"], h["cell_id"], b"x"), "not spawned with stdin"),
                           (lambda: sup.resize(h["run_id"], h["cell_id"], 80, 24), "has no terminal"),
                           (lambda: sup.signal(h["run_id"], h["cell_id"], "HUP"), "must be one of INT, TERM, KILL"),
                           (lambda: sup.read_output(h["run_id"], h["cell_id"], -1), "since: must be")):
        with pytest.raises(UsageError, match=fragment):
            call()
    sup.wait(h["run_id"], h["cell_id"], 30)
    with pytest.raises(UsageError, match="pty: must be"):
        sup.spawn(["true"], workdir=worktree, pty={"cols": 0, "rows": 24})


def test_serve_ops_carry_live_io_and_spawn_follow_prints_the_output(agnsup, tmp_path, worktree):
    import base64

    from scenario import STARTERS

    from agnsup.doors.serve import Client
    s = STARTERS["serve"](agnsup, tmp_path)
    try:
        with Client(s.ready["socket"]) as c:
            h = c.call("spawn", argv=["sh", "-c", "read x; echo got-$x; read y; echo $y >&2"], workdir=worktree,
                       stdin=True, stream=True)
            ids = {"run_id": h["run_id"], "cell_id": h["cell_id"]}
            c.call("stdin", **ids, data_b64=base64.b64encode(b"one\n").decode())
            c.call("stdin", **ids, data_b64=base64.b64encode(b"two\n").decode(), eof=True)
            chunks, since = [], 0
            while True:
                out = c.call("output", **ids, since=since, timeout=10)
                chunks += out["chunks"]
                since = out["next"]
                if out["ended"]:
                    break
            got = {(ch["stream"], base64.b64decode(ch["data_b64"])) for ch in chunks}
            assert got == {("stdout", b"got-one\n"), ("stderr", b"two\n")}
            assert c.call("wait", **ids, timeout=30)["exit_code"] == 0
            for op, args, fragment in (("stdin", {"data_b64": "!!"}, "bad request"),
                                       ("resize", {"cols": 80, "rows": 24}, "has no terminal"),
                                       ("signal", {"sig": "STOP"}, "must be one of")):
                c.file.write(json.dumps({"op": op, **ids, **args}).encode() + b"\n")
                c.file.flush()
                resp = json.loads(c.file.readline())
                assert resp["ok"] is False and resp["exit_code"] == 125 and fragment in resp["error"], resp
        cp = agnsup("spawn", "--follow", "--workdir", worktree, "--", "sh", "-c", "echo o1; echo e1 >&2; exit 3",
                    check=3)
        assert cp.out == "o1\n"
        handle, rest = cp.err.split("\n", 1)
        assert json.loads(handle)["cell_id"].startswith("c-") and rest == "e1\n"
        cp = agnsup("spawn", "--follow", "--timeout", "0.3", "--workdir", worktree, "--", "sleep", "30", check=124)
        cell = json.loads(cp.err.split("\n", 1)[0])["cell_id"]
        assert cp.err.split("\n")[1] == f"agnsup: cell {cell} stopped: timeout (timeout = 0.3 s)"
    finally:
        s.close()


def test_spawn_follow_sends_ctrl_c_to_the_cell_and_exits_with_its_status(agnsup, tmp_path, worktree):
    import signal
    import subprocess

    from scenario import STARTERS
    s = STARTERS["serve"](agnsup, tmp_path)
    try:
        p = agnsup.popen("spawn", "--follow", "--workdir", worktree, "--", "sh", "-c",
                         f"trap 'echo interrupted; exit 4' INT; echo ready; {LOOP}",
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
        assert p.stdout.readline() == b"ready\n"
        p.send_signal(signal.SIGINT)  # as ^C at the client's terminal would
        assert p.stdout.readline() == b"interrupted\n"
        assert p.wait(60) == 4
        p.stdout.close()
        p.stderr.close()
    finally:
        s.close()


def test_run_process_runs_a_cell_under_a_pty_and_refuses_stdin(state, worktree):
    from agnsup.tool import run_process
    res = run_process(["sh", "-c", "test -t 1 && stty size"], state_dir=state, workdir=worktree,
                      pty={"cols": 90, "rows": 20})
    assert res["exit_code"] == 0 and res["stdout"] == "20 90\r\n"
    with pytest.raises(UsageError, match="nobody could write its stdin"):
        run_process(["cat"], state_dir=state, workdir=worktree, stdin=True)


def test_a_redacting_role_redacts_live_output_for_every_client(state, worktree, policy_dir, monkeypatch):
    """read_output (and so serve's output op, agnsup mcp and sandboxd's Start) applies the role's
    output redaction, as returned output gets it: the captured file keeps what the cell wrote."""
    write_role(policy_dir, "redacting", governance__redact='["key_formats"]')
    monkeypatch.setenv("AGNSUP_POLICY_DIR", str(policy_dir))
    token = "ghp_" + "a1B2c3D4e5F6g7H8i9J0k1L2m3N4o5P6q7R8"
    with Supervisor(state) as sup:
        h = sup.spawn(["echo", "token", token], role="redacting", workdir=worktree, stream=True)
        r = Reader(sup, h)
        wait_for(lambda: r.read(timeout=1)["ended"], what="the end of its output")
        assert r.data() == b"token [REDACTED:redact.github_token]\n"
        assert sup.wait(h["run_id"], h["cell_id"], 30)["exit_code"] == 0


def test_a_notify_that_raises_cannot_orphan_a_queued_cell(sup, worktree):
    """A queued cell is supervised before its caller hears that it waits: an MCP request cancelled
    at that moment made notify raise, and the cell's row stayed `waiting` with nobody to start or
    end it."""
    first = sup.spawn(["sleep", "300"], workdir=worktree)

    def gone(line):
        raise RuntimeError("the client went away")
    h = sup.spawn(["true"], workdir=worktree, agent_id="other", notify=gone)
    assert h["state"] == "waiting"
    sup.cancel(cell_id=h["cell_id"], run_id=h["run_id"])
    sup.cancel(cell_id=first["cell_id"], run_id=first["run_id"], grace=0)
    from agnsup.errors import CancelledBeforeStart
    with pytest.raises(CancelledBeforeStart):  # it never started: its thread ended it
        sup.wait(h["run_id"], h["cell_id"], 30)
    assert sup.wait(first["run_id"], first["cell_id"], 30)["state"] == "cancelled"


def test_eof_after_a_partial_line_on_a_pty_hands_the_line_on_then_end_of_file(sup, worktree):
    # one VEOF would only hand "two" to cat's read; the second is the end of file (termios(3))
    h = sup.spawn(["sh", "-c", "stty -echo; echo ready; cat; echo done"], workdir=worktree, stdin=True,
                  pty={"cols": 80, "rows": 24})
    r = Reader(sup, h)
    r.until(b"ready")
    sup.write_stdin(h["run_id"], h["cell_id"], b"one\ntwo", eof=True)
    assert r.to_end().endswith(b"ready\r\none\r\ntwodone\r\n")
    assert sup.wait(h["run_id"], h["cell_id"], 30)["exit_code"] == 0
