"""`agnsup sandboxd` driven by agent-sandbox's own Python client (k8s-agent-sandbox): its
generated ProcessService stubs, its sandboxd command executor and filesystem client
pointed at a local server. Every process is a cell; every file call is journaled."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from conftest import write_role
from scenario import alive, stop_server, wait_for

grpc = pytest.importorskip("grpc", reason="ENV_BLOCKED: grpcio is not installed (the k8s extra)")
pytest.importorskip("k8s_agent_sandbox", reason="ENV_BLOCKED: k8s-agent-sandbox is not installed (the test extra)")

from k8s_agent_sandbox.commands._process_stubs import process_pb2 as pb, process_pb2_grpc as pb_grpc  # noqa: E402


class Server:
    """One `agnsup sandboxd` on free loopback ports; `.ready` is its ready line."""

    def __init__(self, agnsup, tmp_path, worktree, *args, env=None):
        self.err_path = tmp_path / f"sandboxd-{os.urandom(3).hex()}.err"
        with open(self.err_path, "wb") as err:
            self.proc = agnsup.popen("sandboxd", "--grpc", "127.0.0.1:0", "--rest", "127.0.0.1:0", "--workdir",
                                     worktree, *args, env=env, stdout=subprocess.PIPE, stderr=err)
        line = self.proc.stdout.readline()
        assert line, self.err_path.read_text()
        self.ready = json.loads(line)
        self.channel = grpc.insecure_channel(self.ready["grpc"])
        self.stub = pb_grpc.ProcessServiceStub(self.channel)
        self.rest = "http://" + self.ready["rest"]

    def client(self):
        """The client package's own sandboxd command executor and filesystem client, aimed at this server."""
        from k8s_agent_sandbox.commands.command_executor import CommandExecutor
        from k8s_agent_sandbox.connector import SandboxConnector
        from k8s_agent_sandbox.files.filesystem import Filesystem
        from k8s_agent_sandbox.models import SandboxdInClusterConnectionConfig
        grpc_port = int(self.ready["grpc"].rpartition(":")[2])
        rest_port = int(self.ready["rest"].rpartition(":")[2])
        config = SandboxdInClusterConnectionConfig(mode="in-cluster-pod-ip", grpc_port=grpc_port, rest_port=rest_port)
        conn = SandboxConnector("local", "default", config, k8s_helper=None, get_pod_ip=lambda: "127.0.0.1")
        return conn, CommandExecutor(conn, None, "test"), Filesystem(conn, None, "test")

    def close(self):
        self.channel.close()
        stop_server(self.proc)
        self.proc.stdout.close()


@pytest.fixture
def server(agnsup, tmp_path, worktree):
    s = Server(agnsup, tmp_path, worktree)
    yield s
    s.close()
    assert s.proc.returncode == 0, s.err_path.read_text()


def _journal(state):
    from agnsup.store.state import StateRoot
    return StateRoot(state).journal()


def test_the_descriptor_is_the_proto_and_the_wire_is_agent_sandboxs():
    """agnsup's process.proto compiles to the descriptor it ships, and that descriptor
    has the standard's package, messages, field names, numbers, types, enum and rpcs."""
    pytest.importorskip("grpc_tools", reason="ENV_BLOCKED: grpcio-tools is not installed (the test extra)")
    from google.protobuf import descriptor_pb2

    from agnsup.doors.sandboxd import _descriptor, proto
    here = os.path.join(os.path.dirname(proto.__file__), "process.proto")
    assert proto.compile_proto(here) == _descriptor.FILE, "stale: run scripts/gen_sandboxd_descriptor"
    ours = descriptor_pb2.FileDescriptorProto.FromString(_descriptor.FILE)
    theirs = descriptor_pb2.FileDescriptorProto()
    pb.DESCRIPTOR.CopyToProto(theirs)
    for d in (ours, theirs):
        d.ClearField("options")
        d.ClearField("source_code_info")
    assert ours == theirs
    m = proto.messages()
    assert m.Signal == {"SIGNAL_UNSPECIFIED": 0, "SIGNAL_SIGINT": 2, "SIGNAL_SIGKILL": 9, "SIGNAL_SIGTERM": 15}
    wire = pb.StartRequest(config=pb.ProcessConfig(command=["a", "b"], env_vars={"K": "V"}, cwd="sub"),
                           pty=pb.PTY(cols=80, rows=24)).SerializeToString()
    assert m.StartRequest.FromString(wire).SerializeToString(deterministic=True) == wire


def test_server_reflection_describes_the_service_as_grpcurl_would_ask(server):
    pytest.importorskip("grpc_reflection", reason="ENV_BLOCKED: grpcio-reflection is not installed (the k8s extra)")
    from google.protobuf import descriptor_pool
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
    db = ProtoReflectionDescriptorDatabase(server.channel)
    assert "process.v1.ProcessService" in set(db.get_services())
    svc = descriptor_pool.DescriptorPool(db).FindServiceByName("process.v1.ProcessService")
    assert [m.name for m in svc.methods] == ["Start", "Execute", "ExecuteWithLimits", "WriteStdin", "SendSignal",
                                             "ResizeTTY"]
    assert svc.methods_by_name["Start"].output_type.fields_by_name["exit"].number == 4


def test_execute_runs_a_command_as_a_cell_through_the_client_packages_executor(server, agnsup, worktree):
    conn, commands, _ = server.client()
    try:
        r = commands.run("echo out; echo err >&2; exit 3", env={"GREETING": "hi"})
        assert (r.exit_code, r.stdout, r.stderr) == (3, "out\n", "err\n")
        r = commands.run('echo "$GREETING $AGNSUP_CELL_ID $PWD"', env={"GREETING": "hi"})
        assert r.exit_code == 0 and r.stdout == f"hi proc-2 {worktree}\n"
    finally:
        conn.close()
    # The standard's stub: the cell's ids and receipt come back as trailing metadata.
    resp, call = server.stub.Execute.with_call(pb.ExecuteRequest(config=pb.ProcessConfig(command=["true"])))
    md = dict(call.trailing_metadata())
    assert resp.exit_code == 0 and md["agnsup-cell-id"] == "proc-3" and md["agnsup-state"] == "exited"
    with open(md["agnsup-receipt"]) as f:
        receipt = json.load(f)
    assert receipt["run_id"] == "sandboxd" and receipt["chain"][0]["entry"] == "sandboxd"
    resp, call = server.stub.Execute.with_call(pb.ExecuteRequest(config=pb.ProcessConfig(
        command=["sh", "-c", "head -c 70000 /dev/zero | tr '\\0' x"])))
    md = dict(call.trailing_metadata())
    assert len(resp.stdout) == 64 * 1024 and md["agnsup-stdout-truncated"] == "true"
    assert "agnsup-stderr-truncated" not in md
    _, call = server.stub.Execute.with_call(pb.ExecuteRequest(config=pb.ProcessConfig(command=["true"])),
                                            metadata=[("agnsup-run-id", "other"), ("agnsup-agent-id", "me"),
                                                      ("agnsup-role", "networked")])
    assert dict(call.trailing_metadata())["agnsup-run-id"] == "other"
    (other,) = [c for c in agnsup.json("ps", "--all", "--json") if c["run_id"] == "other"]
    assert (other["cell_id"], other["agent_id"], other["role"]) == ("proc-5", "me", "executor")  # never the client's role
    cells = {c["cell_id"]: c for c in agnsup.json("ps", "--all", "--run", "sandboxd", "--json")}
    assert set(cells) == {"proc-1", "proc-2", "proc-3", "proc-4"}
    assert cells["proc-1"]["controller"] == server.ready["controller"] and cells["proc-1"]["exit_code"] == 3
    # the network hint as every door gives it: only when the cell tried to reach out (issue 28)
    _, call = server.stub.Execute.with_call(pb.ExecuteRequest(config=pb.ProcessConfig(command=["false"])))
    assert "agnsup-network-hint" not in dict(call.trailing_metadata())
    resp, call = server.stub.Execute.with_call(pb.ExecuteRequest(config=pb.ProcessConfig(command=[
        "python3", "-c", "import socket; socket.create_connection(('1.1.1.1', 80), timeout=5)"])))
    assert resp.exit_code == 1
    assert dict(call.trailing_metadata())["agnsup-network-hint"].startswith("agnsup: the cell ran without network")


def test_the_clients_deadline_bounds_the_cell_and_answers_124_with_its_output(server, agnsup):
    """The cell ends a reserve before the deadline, so the answer arrives: exit 124 and the output
    (the client's own `timed_out` result, with no output, is for an answer that never came)."""
    conn, commands, _ = server.client()
    try:
        r = commands.run("echo begun; setsid sleep 301 & sleep 300", command_timeout=1.5)
    finally:
        conn.close()
    assert (r.exit_code, r.stdout, r.timed_out) == (124, "begun\n", False)
    row = wait_for(lambda: [c for c in agnsup.json("ps", "--all", "--json") if c["state"] not in ("starting", "running")],
                   60, "the cell to end")[0]
    assert row["state"] in ("timeout", "cancelled"), row
    assert not os.path.exists(row["cgroup"].get("v2", "/nonexistent"))


def test_a_denied_command_is_permission_denied_with_the_rule_and_journaled(server, agnsup, state):
    conn, commands, _ = server.client()
    try:
        with pytest.raises(RuntimeError, match="PERMISSION_DENIED.*hardline.rm_root"):
            commands.run("rm -rf /")
    finally:
        conn.close()
    with pytest.raises(grpc.RpcError) as e:
        server.stub.Execute(pb.ExecuteRequest(config=pb.ProcessConfig(command=["no-such-cmd"])))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and "not found on the cell's PATH" in e.value.details()
    assert dict(e.value.trailing_metadata())["agnsup-exit-code"] == "127"
    for bad, code in ((pb.ProcessConfig(), grpc.StatusCode.INVALID_ARGUMENT),
                      (pb.ProcessConfig(command=["true"], cwd="../.."), grpc.StatusCode.PERMISSION_DENIED)):
        with pytest.raises(grpc.RpcError) as e:
            server.stub.Execute(pb.ExecuteRequest(config=bad))
        assert e.value.code() == code and e.value.details()
    j = _journal(state)
    try:
        denied = [ev for ev in j.events("sandboxd", "proc-1") if ev["kind"] == "denied"]
        escape = [ev for ev in j.events("sandboxd", "proc-3") if ev["kind"] == "denied"]
    finally:
        j.close()
    assert denied and json.loads(denied[0]["data"])["decision"]["rule"] == "hardline.rm_root"
    assert escape and json.loads(escape[0]["data"])["decision"]["rule"] == "sandboxd.cwd_escape"
    assert agnsup.json("ps", "--all", "--json") == []  # nothing started


def _limited(server, argv, **kw):
    """ExecuteWithLimits through the client package's generated stub: (the response, its trailing metadata)."""
    resp, call = server.stub.ExecuteWithLimits.with_call(
        pb.ExecuteWithLimitsRequest(config=pb.ProcessConfig(command=argv), **kw), timeout=120)
    return resp, dict(call.trailing_metadata())


def test_execute_with_limits_returns_each_stream_up_to_its_limit_byte_exact_and_says_when_it_cut(server):
    from agnsup.doors.sandboxd.process import LIMIT_CAP
    exited = pb.ExecuteTerminationReason.Value("EXECUTE_TERMINATION_REASON_EXITED")
    # bytes that are not UTF-8 come back as written: 300 on stdout, 200 on stderr, exit 3
    out, err = bytes(range(256)) + b"\xff\xfe" * 22, b"\x80\x00E" * 66 + b"\xc3\xa9"
    prog = (f"import sys; sys.stdout.buffer.write({out!r}); sys.stdout.flush(); "
            f"sys.stderr.buffer.write({err!r}); sys.exit(3)")
    assert (len(out), len(err)) == (300, 200)
    for kw, want in (({}, (out, False, err, False)),  # unset: the server's cap, far above
                     ({"stdout_limit_bytes": 300, "stderr_limit_bytes": 200}, (out, False, err, False)),  # exactly
                     ({"stdout_limit_bytes": 299, "stderr_limit_bytes": 1}, (out[:299], True, err[:1], True)),
                     ({"stdout_limit_bytes": 0}, (b"", True, err, False))):
        resp, md = _limited(server, ["python3", "-c", prog], **kw)
        assert (resp.stdout, resp.stdout_truncated, resp.stderr, resp.stderr_truncated) == want, kw
        assert (resp.exit_code, resp.termination_reason) == (3, exited)
        assert 0 < resp.elapsed_duration.ToNanoseconds() < 60 * 10**9
        assert md["agnsup-state"] == "exited" and os.path.exists(md["agnsup-receipt"])
    # a limit above the server's cap is clamped to it, and the flag says the rest was cut
    resp, _ = _limited(server, ["sh", "-c", f"head -c {LIMIT_CAP + 10} /dev/zero"], stdout_limit_bytes=2**64 - 1)
    assert (len(resp.stdout), resp.stdout_truncated, resp.exit_code) == (LIMIT_CAP, True, 0)
    resp, _ = _limited(server, ["false"], time_limit={"seconds": 60})
    assert (resp.exit_code, resp.termination_reason, resp.stdout, resp.stdout_truncated) == (1, exited, b"", False)


@pytest.mark.parametrize("trap", ["", "trap '' TERM; "], ids=["term-ends-it", "term-ignored-the-kill-ends-it"])
def test_execute_with_limits_time_limit_kills_the_whole_cell_and_says_time_limit_exceeded(server, agnsup, trap):
    """The time limit is agnsup's timeout of the cell: the command, its children and a setsid daemon all end
    (the cell's cgroup is empty and gone; a tree that ignores TERM too, by the kill after the role's grace),
    the answer comes with the output written before it."""
    argv = ["sh", "-c", trap + "echo begun; setsid sleep 301 & sleep 300 & sleep 302; echo never"]
    future = server.stub.ExecuteWithLimits.future(pb.ExecuteWithLimitsRequest(
        config=pb.ProcessConfig(command=argv), time_limit={"seconds": 2, "nanos": 500_000_000}), timeout=120)
    row = wait_for(lambda: [c for c in agnsup.json("ps", "--json") if c["state"] == "running"], 60, "the running cell")[0]
    if "v2" in (row["cgroup"] or {}):
        procs = wait_for(lambda: _members(row) if len(_members(row)) >= 4 else None, 30, "the tree's 4 processes")
    resp = future.result()
    assert resp.termination_reason == pb.ExecuteTerminationReason.Value("EXECUTE_TERMINATION_REASON_TIME_LIMIT_EXCEEDED")
    assert (resp.exit_code, resp.stdout, resp.stdout_truncated) == (124, b"begun\n", False)
    assert 2.5 <= resp.elapsed_duration.ToNanoseconds() / 1e9 < 60
    (ended,) = [c for c in agnsup.json("ps", "--all", "--json") if c["cell_id"] == row["cell_id"]]
    assert ended["state"] == "timeout", ended
    if "v2" not in (row["cgroup"] or {}):
        pytest.skip("ENV_BLOCKED: cgroup (no cgroup2 tree to read the cell's members from)")
    assert not any(alive(*p) for p in procs), "a process of the cell outlived its time limit"
    assert not os.path.exists(row["cgroup"]["v2"])


def test_execute_with_limits_refuses_bad_input_as_invalid_argument_and_starts_nothing(server, agnsup):
    true = pb.ProcessConfig(command=["true"])
    for request, words in (
            (pb.ExecuteWithLimitsRequest(), "config is required"),
            (pb.ExecuteWithLimitsRequest(config=pb.ProcessConfig()), "config.command is required"),
            (pb.ExecuteWithLimitsRequest(config=true, time_limit={"seconds": -1}), "must be positive"),
            (pb.ExecuteWithLimitsRequest(config=true, time_limit={}), "must be positive"),
            (pb.ExecuteWithLimitsRequest(config=true, time_limit={"seconds": 1, "nanos": -5}), "not a valid"),
            (pb.ExecuteWithLimitsRequest(config=true, time_limit={"nanos": 2_000_000_000}), "not a valid"),
            (pb.ExecuteWithLimitsRequest(config=true, time_limit={"seconds": 10**12}), "not a valid"),
            (pb.ExecuteWithLimitsRequest(config=true, time_limit={"seconds": 400 * 365 * 86400}), "at most")):
        with pytest.raises(grpc.RpcError) as e:
            server.stub.ExecuteWithLimits(request, timeout=60)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, request
        assert words in e.value.details() and dict(e.value.trailing_metadata())["agnsup-exit-code"] == "125"
    assert agnsup.json("ps", "--all", "--json") == []  # nothing started


def test_a_file_written_is_read_back_listed_and_deleted_and_each_call_journaled(server, state, worktree):
    conn, _, files = server.client()
    try:
        files.write("src/notes.txt", b"hello\x00world")
        assert files.read("src/notes.txt") == b"hello\x00world"
        with open(os.path.join(worktree, "src", "notes.txt"), "rb") as f:
            assert f.read() == b"hello\x00world"
        (entry,) = files.list("src")
        assert (entry.name, entry.size, entry.type, entry.mode) == ("notes.txt", 11, "file", "0644")
        assert files.exists("src/notes.txt") and not files.exists("src/absent")
        from k8s_agent_sandbox.exceptions import SandboxRequestError
        with pytest.raises(SandboxRequestError) as e:
            files.delete("src")
        assert e.value.status_code == 409
        files.delete("src", recursive=True)
        assert not os.path.exists(os.path.join(worktree, "src"))
    finally:
        conn.close()
    j = _journal(state)
    try:
        ops = [(o["op"], o["path"], o["status"]) for o in j.file_ops("sandboxd")]
    finally:
        j.close()
    assert ops == [("write", "src/notes.txt", 204), ("read", "src/notes.txt", 200), ("read", "src", 200),
                   ("stat", "src/notes.txt", 200), ("stat", "src/absent", 404), ("delete", "src", 409),
                   ("delete", "src", 204)]


def test_a_path_outside_the_worktree_is_refused_however_it_is_spelled(server, state, worktree, tmp_path):
    import requests
    outside = tmp_path / "outside.txt"
    outside.write_text("secret")
    os.symlink(str(tmp_path), os.path.join(worktree, "link"))
    spellings = ("../outside.txt", "link/outside.txt", "sub/../../outside.txt")
    # The server's own refusal, below any client's check: the raw REST call, the path percent-encoded whole
    for path in spellings:
        r = requests.get(server.rest + "/v1/files/" + path.replace("/", "%2F"))
        assert (r.status_code, r.json()["code"], r.json()["rule"]) == (403, "PERMISSION_DENIED", "sandboxd.path_escape")
    r = requests.put(server.rest + "/v1/files/sub%2F..%2F..%2Fnew.txt", data=b"x")
    assert r.status_code == 403 and not (tmp_path / "new.txt").exists()
    # Through the client package: refused, whichever side refuses (k8s-agent-sandbox >= 1.0.11 refuses a
    # ".." segment itself, before sending; a symlink out is the server's to refuse)
    conn, _, files = server.client()
    try:
        from k8s_agent_sandbox.exceptions import SandboxRequestError
        for path in spellings:
            with pytest.raises((SandboxRequestError, ValueError)) as e:
                files.read(path, allow_unsafe_paths=True)
            if isinstance(e.value, SandboxRequestError):
                assert e.value.status_code == 403, path
                assert e.value.response.json()["code"] == "PERMISSION_DENIED"
        with pytest.raises(SandboxRequestError) as e:
            files.write("link/new.txt", b"x", allow_unsafe_paths=True)
        assert e.value.status_code == 403 and not (tmp_path / "new.txt").exists()
    finally:
        conn.close()
    # curl -F file=@... style uploads, as the standard allows
    assert requests.put(server.rest + "/v1/files/up.bin?mode=0600", files={"file": ("x", b"\x00multi\r\npart")}
                        ).status_code == 204
    with open(os.path.join(worktree, "up.bin"), "rb") as f:
        assert f.read() == b"\x00multi\r\npart" and oct(os.fstat(f.fileno()).st_mode & 0o777) == "0o600"
    assert requests.put(server.rest + "/v1/files/up.bin", files={"other": b"x"}).status_code == 400
    # a file where a directory should be: absent for a read or delete, a bad target for a write
    assert requests.get(server.rest + "/v1/files/up.bin%2Fx").status_code == 404
    assert requests.delete(server.rest + "/v1/files/up.bin%2Fx").status_code == 404
    assert requests.put(server.rest + "/v1/files/up.bin%2Fx%2Fy", data=b"z").status_code == 400
    # An absolute path is the worktree's (as the standard's server reads it), never the host's.
    r = requests.get(server.rest + "/v1/files/%2Fetc%2Fpasswd")
    assert r.status_code == 404 and r.json()["code"] == "NOT_FOUND"
    assert requests.get(server.rest + "/v1/health").json()["status"] == "ok"
    assert requests.get(server.rest + "/v1/agnsup").json()["worktree"] == worktree
    j = _journal(state)
    try:
        refused = [o for o in j.file_ops("sandboxd") if o["status"] == 403]
    finally:
        j.close()
    assert len(refused) >= 6 and all(o["rule"] == "sandboxd.path_escape" for o in refused)
    assert {*spellings, "sub/../../new.txt", "link/new.txt"} <= {o["path"] for o in refused}


def test_a_readonly_role_reads_files_but_the_gate_refuses_writes_and_metadata_hides_credentials(agnsup, tmp_path, worktree):
    import requests
    with open(os.path.join(worktree, "a.txt"), "w") as f:
        f.write("A")
    s = Server(agnsup, tmp_path, worktree, "--role", "readonly",
               env={"SANDBOX_ID": "sb-1", "SANDBOX_API_TOKEN": "t", "SANDBOX_DB_PASSWORD": "p", "OTHER": "x"})
    try:
        # /v1/metadata: the orchestrator's SANDBOX_* values, never one that looks like a credential
        assert requests.get(s.rest + "/v1/metadata").json() == {"env": {"SANDBOX_ID": "sb-1"}}
        assert requests.get(s.rest + "/v1/agnsup").json()["role"] == "readonly"
        assert requests.get(s.rest + "/v1/files/a.txt").content == b"A"
        r = requests.put(s.rest + "/v1/files/a.txt", data=b"B")
        assert r.status_code == 403 and r.json()["rule"].startswith(("zone.", "sandbox."))
        assert requests.delete(s.rest + "/v1/files/a.txt").status_code == 403
    finally:
        s.close()
    with open(os.path.join(worktree, "a.txt")) as f:
        assert f.read() == "A"


def _start(server, argv, **kw):
    """A Start stream: (the call, its events iterator, the init's process id, the cell id)."""
    call = server.stub.Start(pb.StartRequest(config=pb.ProcessConfig(command=argv), **kw), timeout=120)
    events = iter(call)
    first = next(events)
    assert first.WhichOneof("event") == "init" and first.init.process_id > 0
    cell = dict(call.initial_metadata())["agnsup-cell-id"]
    assert cell == f"proc-{first.init.process_id}"
    return call, events, first.init.process_id, cell


def _rest_of(events) -> tuple[bytes, bytes, int]:
    out, err, code = b"", b"", None
    for ev in events:
        kind = ev.WhichOneof("event")
        assert code is None, "nothing comes after the exit event"
        if kind == "stdout":
            out += ev.stdout
        elif kind == "stderr":
            err += ev.stderr
        elif kind == "exit":
            code = ev.exit.exit_code
    return out, err, code


def test_start_streams_output_live_and_takes_stdin_then_eof(server):
    call, events, pid, cell = _start(server, ["sh", "-c", "echo ready; read line; echo got:$line; echo oops >&2; "
                                              "cat; echo after-eof"])
    ev = next(events)  # output arrives while the process waits for its stdin: live, not at the end
    assert ev.WhichOneof("event") == "stdout" and ev.stdout == b"ready\n"
    server.stub.WriteStdin(pb.WriteStdinRequest(process_id=pid, input=b"hello\n"))
    server.stub.WriteStdin(pb.WriteStdinRequest(process_id=pid, input=b"more\n"))
    from google.protobuf import empty_pb2
    server.stub.WriteStdin(pb.WriteStdinRequest(process_id=pid, eof=empty_pb2.Empty()))
    out, err, code = _rest_of(events)
    assert (out, err, code) == (b"got:hello\nmore\nafter-eof\n", b"oops\n", 0)
    assert dict(call.trailing_metadata())["agnsup-state"] == "exited"
    with pytest.raises(grpc.RpcError) as e:  # it ended: its process id names nothing now
        server.stub.WriteStdin(pb.WriteStdinRequest(process_id=pid, input=b"late"))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_start_with_a_pty_gives_a_terminal_of_that_size_and_resizes_it(server):
    _call, events, pid, _cell = _start(server, ["sh", "-c", "stty size; read x; stty size"], pty=pb.PTY(cols=80, rows=24))
    ev = next(events)
    assert ev.stdout.strip() == b"24 80"
    server.stub.ResizeTTY(pb.ResizeTTYRequest(process_id=pid, cols=132, rows=50))
    server.stub.WriteStdin(pb.WriteStdinRequest(process_id=pid, input=b"\n"))
    out, _err, code = _rest_of(events)
    assert code == 0 and out.replace(b"\r", b"").strip().endswith(b"50 132")
    _call, events, pid, _cell = _start(server, ["sh", "-c", "read x"])
    with pytest.raises(grpc.RpcError) as e:  # no pty
        server.stub.ResizeTTY(pb.ResizeTTYRequest(process_id=pid, cols=10, rows=10))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(grpc.RpcError) as e:
        server.stub.SendSignal(pb.SendSignalRequest(process_id=pid, signal=pb.SIGNAL_UNSPECIFIED))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    server.stub.SendSignal(pb.SendSignalRequest(process_id=pid, signal=pb.SIGNAL_SIGKILL))
    assert _rest_of(events)[2] == 137
    with pytest.raises(grpc.RpcError) as e:
        server.stub.SendSignal(pb.SendSignalRequest(process_id=4242, signal=pb.SIGNAL_SIGTERM))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_client_that_goes_away_mid_start_takes_its_process_with_it(server, agnsup):
    call, _events, _pid, cell = _start(server, ["sh", "-c", "setsid sleep 301 & exec sleep 300"])
    wait_for(lambda: any(c["cell_id"] == cell and c["state"] == "running" for c in agnsup.json("ps", "--json")), 60,
             "the running cell")
    call.cancel()
    row = wait_for(lambda: [c for c in agnsup.json("ps", "--all", "--json") if c["cell_id"] == cell
                            and c["state"] not in ("starting", "running")], 60, "the cell to end")[0]
    assert row["state"] == "cancelled", row


@pytest.mark.parametrize("sig,argv,code", [
    ("SIGNAL_SIGINT", ["sh", "-c", "setsid sleep 301 & exec sleep 300"], 130),
    ("SIGNAL_SIGTERM", ["sh", "-c", "setsid sleep 301 & exec sleep 300"], 143),
    ("SIGNAL_SIGKILL", ["sh", "-c", "trap '' TERM INT; setsid sleep 301 & sleep 300; sleep 302"], 137)])
def test_send_signal_stops_the_tree_and_the_setsid_daemon_it_left(server, agnsup, sig, argv, code):
    _call, events, pid, cell = _start(server, argv)
    row = wait_for(lambda: [c for c in agnsup.json("ps", "--json") if c["cell_id"] == cell and c["state"] == "running"],
                   60, "the running cell")[0]
    if "v2" not in (row["cgroup"] or {}):
        pytest.skip("ENV_BLOCKED: cgroup (no cgroup2 tree to read the cell's members from)")
    procs = wait_for(lambda: [m for m in _members(row) if b"sleep\x00301" in _cmdline(m[0])] and _members(row), 30,
                     "the setsid daemon in the cell")
    server.stub.SendSignal(pb.SendSignalRequest(process_id=pid, signal=pb.Signal.Value(sig)))
    assert _rest_of(events)[2] == code
    assert not any(alive(*p) for p in procs), "a process of the tree outlived SendSignal"
    assert not os.path.exists(row["cgroup"]["v2"])


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def test_the_roles_deny_paths_hold_inside_the_worktree_for_every_file_call(agnsup, tmp_path, worktree, policy_dir,
                                                                           state):
    import requests
    os.makedirs(os.path.join(worktree, "private"))
    with open(os.path.join(worktree, "private", "key"), "w") as f:
        f.write("k")
    write_role(policy_dir, "guarded", filesystem__deny=f'["~/.ssh", "{worktree}/private"]')
    s = Server(agnsup, tmp_path, worktree, "--role", "guarded", env={"AGNSUP_POLICY_DIR": str(policy_dir)})
    try:
        for method, path in (("GET", "private/key"), ("GET", "private"), ("PUT", "private/new"),
                             ("DELETE", "private/key"), ("HEAD", "private/absent")):
            r = requests.request(method, s.rest + "/v1/files/" + path.replace("/", "%2F"), data=b"x")
            assert r.status_code == 403, (method, path, r.status_code)
            if method != "HEAD":
                assert r.json()["rule"] == "sandbox.deny_path"
        assert requests.get(s.rest + "/v1/files/").json()["entries"][0]["name"] == "private"
    finally:
        s.close()
    assert os.listdir(os.path.join(worktree, "private")) == ["key"]
    j = _journal(state)
    try:
        assert [o["rule"] for o in j.file_ops("sandboxd") if o["status"] == 403] == ["sandbox.deny_path"] * 5
    finally:
        j.close()


def test_a_sigkilled_server_leaves_its_cells_to_the_janitor_of_its_next_start(agnsup, tmp_path, worktree, state,
                                                                               policy_dir):
    """Cells outlive the server (role keeps them); the restarted server's janitor kills the
    whole tree, a setsid daemon included, and records them recovered."""
    write_role(policy_dir, "lasting", process__on_controller_death='"keep"')
    env = {"AGNSUP_POLICY_DIR": str(policy_dir)}
    s = Server(agnsup, tmp_path, worktree, "--role", "lasting", env=env)
    futures = []
    try:
        argv = ["sh", "-c", "setsid sleep 301 & sleep 300"]
        futures = [s.stub.Execute.future(pb.ExecuteRequest(config=pb.ProcessConfig(command=argv))) for _ in range(2)]
        # Two cells of one worktree take turns on its lock: the first runs, the second waits for it.
        cell = wait_for(lambda: [c for c in agnsup.json("ps", "--json") if c["state"] == "running"], 60,
                        "a running cell")[0]
        if "v2" not in (cell["cgroup"] or {}):
            pytest.skip("ENV_BLOCKED: cgroup (no cgroup2 tree to read the cell's members from)")
        cg = os.path.join(cell["cgroup"]["v2"], "cgroup.procs")
        procs = wait_for(lambda: _members(cell) if len(_members(cell)) >= 3 else None, 30, "the tree's 3 processes")
        os.kill(s.proc.pid, signal.SIGKILL)
        s.proc.wait(30)
        assert all(alive(*p) for p in procs), "the role keeps cells alive after their controller"
    finally:
        for f in futures:
            f.cancel()
        s.close()
    s2 = Server(agnsup, tmp_path, worktree, "--role", "lasting", env=env)
    try:
        assert not any(alive(*p) for p in procs)
        rows = {c["cell_id"]: c["state"] for c in agnsup.json("ps", "--all", "--json")}
        assert rows[cell["cell_id"]] == "recovered", rows
        assert not os.path.exists(cg)
        _, call = s2.stub.Execute.with_call(pb.ExecuteRequest(config=pb.ProcessConfig(command=["true"])))
        # The numbering goes on after the journal's highest proc-N: an old process id names no new process.
        assert int(dict(call.trailing_metadata())["agnsup-cell-id"][5:]) > max(int(c[5:]) for c in rows)
    finally:
        s2.close()


def _members(cell: dict) -> list[tuple[int, int]]:
    from agnsup.linux import proc
    path = os.path.join(cell["cgroup"]["v2"], "cgroup.procs")
    try:
        with open(path) as f:
            pids = [int(x) for x in f.read().split()]
    except FileNotFoundError:
        return []
    out = []
    for pid in pids:
        st = proc.stat(pid)
        if st is not None:
            out.append((pid, st.starttime))
    return out


def test_bad_addresses_and_workdirs_are_one_line_and_exit_125(agnsup, tmp_path, worktree, server):
    taken = server.ready["rest"]
    for args, words in ((("--grpc", "localhost:http"), "--grpc 'localhost:http': expected HOST:PORT"),
                        (("--workdir", str(tmp_path / "absent")), "is not a directory"),
                        (("--rest", taken, "--grpc", "127.0.0.1:0"), "cannot listen there"),
                        (("--role", "nope"), "unknown role 'nope'")):
        cp = agnsup("sandboxd", "--workdir", worktree, *args, check=125)
        assert words in cp.err and cp.err.count("\n") == 1, cp.err


def test_sigterm_ends_the_server_and_cancels_its_live_processes(agnsup, tmp_path, worktree):
    s = Server(agnsup, tmp_path, worktree)
    try:
        _call, events, _pid, cell = _start(s, ["sh", "-c", "setsid sleep 301 & exec sleep 300"])
        wait_for(lambda: any(c["cell_id"] == cell and c["state"] == "running" for c in agnsup.json("ps", "--json")),
                 60, "the running cell")
        s.proc.terminate()
        assert _rest_of(events)[2] == 143  # cancelled (TERM), and the stream still got its exit event
        assert s.proc.wait(60) == 0, s.err_path.read_text()
    finally:
        s.close()
    (row,) = [c for c in agnsup.json("ps", "--all", "--json") if c["cell_id"] == cell]
    assert row["state"] == "cancelled" and not os.path.exists(row["cgroup"].get("v2", "/nonexistent"))


def test_without_the_k8s_extra_sandboxd_says_what_to_install(agnsup, worktree):
    code = ("import sys; sys.modules['grpc'] = None; from agnsup.doors.cli import main; "
            f"main(['sandboxd', '--workdir', {worktree!r}])")
    cp = subprocess.run([sys.executable, "-c", code], env=agnsup.env, capture_output=True, text=True, timeout=60)
    assert cp.returncode == 125 and cp.stderr == "agnsup: agnsup sandboxd needs the k8s extra: pip install 'agnsup[k8s]'\n"


def test_the_image_entrypoint_without_a_writable_cgroup2_runs_cells_without_cgroups(agnsup, tmp_path):
    """deploy/entrypoint.sh's fallback (an unprivileged pod): it says so, names what is lost through
    doctor, and execs the command with AGNSUP_CGROUP_LAYOUT=none."""
    if os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
        pytest.skip("ENV_BLOCKED: a cgroup2 mount at /sys/fs/cgroup (the entrypoint would move itself into a "
                    "leaf of the host's root cgroup: a pod's own cgroup namespace only)")
    from conftest import REPO
    env = {**agnsup.env, "PATH": os.path.dirname(sys.executable) + ":/usr/bin:/bin"}
    env.pop("AGNSUP_CGROUP_LAYOUT", None)
    cp = subprocess.run(["sh", os.path.join(REPO, "deploy", "entrypoint.sh"), "sh", "-c", "echo $AGNSUP_CGROUP_LAYOUT"],
                        env=env, capture_output=True, text=True, timeout=120)
    assert cp.returncode == 0 and cp.stdout == "none\n", cp.stderr
    assert "cells run without cgroups" in cp.stderr and "ENV_BLOCKED: cgroup" in cp.stderr
