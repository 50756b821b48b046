"""Issue 25 follow-up: agnsup's control endpoints on loopback TCP (sandboxd's gRPC and REST ports,
`mcp --http 127.0.0.1:PORT`), played as the hostile cell.

A `networked` cell shares the host's network namespace, so the host's loopback: on doors-lead it could
call sandboxd (no authentication, as the standard defines it) and start cells in sandboxd's role and
worktree, or read and write that worktree through /v1/files. linux/peer.py check_tcp names the client
socket's owner from the kernel's socket table (sock_diag, /proc/net/tcp as the fallback) and refuses a
cell's. docs/isolation.md "Loopback TCP control endpoints" says what closes each door.
"""
import ipaddress
import json
import os
import socket
import subprocess
import sys
import sysconfig
import time

import pytest

from conftest import Agnsup, refusals, run_door_gates
from scenario import stop_server
from test_doors_sockets import P_MCP_GET

from agnsup.process import namespaces
from agnsup.linux import peer

NOBODY = 65534
SITE = sysconfig.get_paths()["purelib"]  # grpc and the agent-sandbox client, for the cell's /usr/bin/python3

def _needs(module: str, what: str) -> None:
    """Skip without it; never imported here: grpc's fork handlers in this process would meet the forks of
    the in-process selftest (sandboxd sets GRPC_ENABLE_FORK_SUPPORT before its own import)."""
    import importlib.util
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"ENV_BLOCKED: {what} is not installed")


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="ENV_BLOCKED: root (cells as the mapped uid, setuid "
                                                          "children)")


# ------------------------------------------------------------------ the parser, on sample lines

# x86 (little-endian) rows as the kernel prints them: a listener on 127.0.0.1:8080, the client end
# 127.0.0.1:40000 -> :8080 (uid 2130706432, the default cell base), the server end, a TIME_WAIT row
# (uid 0, inode 0), and in tcp6 the same connection made by AF_INET6 sockets over ::1 and the mapped form.
TCP = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1001 1 0 100 0 0 10 0
   1: 0100007F:9C40 0100007F:1F90 01 00000000:00000000 00:00000000 00000000 2130706432        0 1002 1 0 20 4 30 10 -1
   2: 0100007F:1F90 0100007F:9C40 01 00000000:00000000 00:00000000 00000000     0        0 1003 1 0 20 4 30 10 -1
   3: 0100007F:9C41 0100007F:1F90 06 00000000:00000000 03:00001234 00000000     0        0 0 3 0
"""
TCP6 = """\
  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000000000000000000001000000:9C42 00000000000000000000000001000000:1F90 01 00000000:00000000 00:00000000 00000000  1000        0 2001 1 0 20 4 30 10 -1
   1: 0000000000000000FFFF00000100007F:9C43 0000000000000000FFFF00000100007F:1F90 01 00000000:00000000 00:00000000 00000000 65534        0 2002 1 0 20 4 30 10 -1
"""

little_endian = pytest.mark.skipif(sys.byteorder != "little", reason="ENV_BLOCKED: the sample rows are x86's "
                                                                     "(little-endian) byte order")


@little_endian
def test_the_parser_reads_ipv4_ipv6_and_mapped_rows():
    assert peer.parse_tcp_endpoint("0100007F:1F90") == (ipaddress.ip_address("127.0.0.1"), 8080)
    assert peer.parse_tcp_endpoint("00000000000000000000000001000000:9C42") == (ipaddress.ip_address("::1"), 40002)
    mapped = peer.parse_tcp_endpoint("0000000000000000FFFF00000100007F:9C43")
    assert mapped == (ipaddress.ip_address("::ffff:127.0.0.1"), 40003)
    rows = [r for r in map(peer.parse_tcp_line, TCP.splitlines()) if r is not None]
    assert len(rows) == 4  # the header is no row
    assert (rows[1].state, rows[1].uid, rows[1].inode) == (1, 2130706432, 1002)
    assert (rows[3].state, rows[3].uid, rows[3].inode) == (6, 0, 0)


@little_endian
def test_the_client_end_is_found_and_never_the_server_end_or_the_listener():
    v4 = ipaddress.ip_address("127.0.0.1")
    [row] = peer.tcp_client_sockets([TCP, TCP6], (v4, 40000), 8080)
    assert (row.uid, row.inode) == (2130706432, 1002)
    assert peer.tcp_client_sockets([TCP, TCP6], (v4, 40000), 8080, v4)[0].inode == 1002
    assert peer.tcp_client_sockets([TCP, TCP6], (v4, 40000), 8081) == []  # another server port
    [row] = peer.tcp_client_sockets([TCP, TCP6], (ipaddress.ip_address("::1"), 40002), 8080)
    assert (row.uid, row.inode) == (1000, 2001)
    # a dual-stack client's socket is a tcp6 row in the mapped form; the server may name it either way
    for client in ("127.0.0.1", "::ffff:127.0.0.1"):
        [row] = peer.tcp_client_sockets([TCP, TCP6], (ipaddress.ip_address(client), 40003), 8080)
        assert (row.uid, row.inode) == (NOBODY, 2002)
    # judged: the cell range refuses, a gone socket (TIME_WAIT: uid 0, inode 0) refuses, never passes as root
    cell = peer.check_tcp(("127.0.0.1", 40000), 8080, tables=[TCP, TCP6])
    assert any("cell uid range" in e for e in cell.evidence), cell.evidence
    gone = peer.check_tcp(("127.0.0.1", 40001), 8080, tables=[TCP, TCP6])
    assert gone.evidence and "no process holds" in gone.evidence[0]
    foreign = peer.check_tcp(("::ffff:127.0.0.1", 40003), 8080, tables=[TCP, TCP6])
    assert any(f"uid {NOBODY} is neither" in e for e in foreign.evidence) or os.geteuid() == NOBODY
    missing = peer.check_tcp(("127.0.0.1", 40009), 8080, tables=[TCP, TCP6])
    assert missing.evidence and "no socket of this network namespace" in missing.evidence[0]
    # an address of no interface of this host: the pod's network, not this check's
    assert peer.check_tcp(("192.0.2.7", 40009), 8080, tables=[TCP, TCP6]).evidence == []


def test_grpc_peer_strings_are_parsed_and_anything_else_is_none():
    from agnsup.doors.sandboxd.process import grpc_peer_address
    assert grpc_peer_address("ipv4:127.0.0.1:5000") == ("127.0.0.1", 5000)
    assert grpc_peer_address("ipv6:[::1]:5000") == ("::1", 5000)
    assert grpc_peer_address("ipv6:[fe80::1%25lo]:7") == ("fe80::1", 7)
    assert grpc_peer_address("unix:/run/x.sock") is None
    assert grpc_peer_address("ipv4:127.0.0.1:") is None


# ------------------------------------------------------------------ check_tcp on real sockets

# argv: host, port, then "hold": connects to the server and holds the socket until stdin closes.
P_CLIENT = r'''
import socket, sys
host, port = sys.argv[1], int(sys.argv[2])
s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
s.connect((host, port))
print(s.getsockname()[1], flush=True)
sys.stdin.read()
'''


def _client(listener, *launcher, env=None):
    host, port = listener.getsockname()[:2]
    p = subprocess.Popen([*launcher, "/usr/bin/python3", "-c", P_CLIENT, host, str(port)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, env=env or {"PATH": "/usr/bin:/bin"})
    line = p.stdout.readline()
    assert line, "the client did not connect"
    conn, addr = listener.accept()
    return p, conn, addr


def _end(p, conn):
    conn.close()
    p.stdin.close()
    p.wait(10)
    p.stdout.close()


@needs_root
@pytest.mark.parametrize("family,host", [(socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")])
def test_check_tcp_trusts_this_servers_uid_and_refuses_foreign_cell_and_closed_sockets(family, host):
    from agnsup.linux.userns import cell_range
    lst = socket.socket(family)
    lst.bind((host, 0))
    lst.listen(8)
    port = lst.getsockname()[1]
    try:
        p, conn, addr = _client(lst)
        mine = peer.check_tcp(addr[:2], port, host)
        assert mine.evidence == [] and mine.uid == 0
        # the /proc/net fallback names the same socket as sock_diag
        [row] = peer.tcp_client_sockets(peer._read_tables(), (ipaddress.ip_address(addr[0]), addr[1]), port)
        assert (row.uid, row.inode) == (mine.uid, mine.inode)
        # a client that sent its request and closed before the check (the server's end still open): its
        # socket is an orphan, then a TIME_WAIT row, whose uid reads 0: refused, never taken for root
        p.stdin.close()
        p.wait(10)
        p.stdout.close()
        time.sleep(0.05)
        closed = peer.check_tcp(addr[:2], port, host)
        assert closed.is_cell and "no process holds" in closed.evidence[0], closed.evidence
        conn.close()

        p, conn, addr = _client(lst, "setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups")
        assert f"uid {NOBODY} is neither this server's (0) nor root" in peer.check_tcp(addr[:2], port, host).evidence
        # mcp's rule (its bearer token authenticates other users): another uid is judged by its process
        assert peer.check_tcp(addr[:2], port, host, others_refused=False).evidence == []
        _end(p, conn)
        p, conn, addr = _client(lst, "setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                                env={"PATH": "/usr/bin:/bin", "AGNSUP_CELL_TOKEN": "0" * 32})
        other_cell = peer.check_tcp(addr[:2], port, host, others_refused=False)
        assert other_cell.evidence == ["AGNSUP_CELL_TOKEN in its environment"], other_cell.as_dict()
        _end(p, conn)

        base = cell_range()[0]
        p, conn, addr = _client(lst, "setpriv", f"--reuid={base}", f"--regid={base}", "--clear-groups")
        assert f"uid {base} is in the cell uid range" in peer.check_tcp(addr[:2], port, host).evidence
        _end(p, conn)

        # a host-root process with a cell's token (an unmapped root cell): found by its socket's holder
        p, conn, addr = _client(lst, env={"PATH": "/usr/bin:/bin", "AGNSUP_CELL_TOKEN": "0" * 32})
        tok = peer.check_tcp(addr[:2], port, host)
        assert tok.evidence == ["AGNSUP_CELL_TOKEN in its environment"] and tok.pid == p.pid, tok.as_dict()
        _end(p, conn)
    finally:
        lst.close()


@needs_root
def test_a_kernel_without_tcp_diag_leaves_the_decision_to_the_tables(monkeypatch):
    """sock_diag answers ENOENT when tcp_diag is not loaded (a container, a guest that cannot load
    modules): that is no evidence against the client, the /proc tables decide (seen in the v2 guest:
    every sandboxd call refused)."""
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(8)
    port = lst.getsockname()[1]
    monkeypatch.setattr(peer, "diag_lookup", lambda client, server: None)
    try:
        p, conn, addr = _client(lst)
        mine = peer.check_tcp(addr[:2], port, "127.0.0.1")
        assert mine.evidence == [] and mine.uid == 0, mine.as_dict()
        _end(p, conn)
        p, conn, addr = _client(lst, "setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups")
        assert f"uid {NOBODY} is neither this server's (0) nor root" in \
            peer.check_tcp(addr[:2], port, "127.0.0.1").evidence
        _end(p, conn)
    finally:
        lst.close()


@needs_root
def test_a_normal_users_server_traces_its_own_uids_client_to_the_process():
    """A normal user's cells run as that user: the uid alone cannot tell them, the holder's token does."""
    prog = r'''
import json, socket, subprocess, sys
from agnsup.linux import peer
lst = socket.socket(); lst.bind(("127.0.0.1", 0)); lst.listen(4)
port = lst.getsockname()[1]
out = {}
for name, env in (("plain", {"PATH": "/usr/bin:/bin"}), ("cell", {"PATH": "/usr/bin:/bin", "AGNSUP_CELL_TOKEN": "0" * 32})):
    p = subprocess.Popen(["/usr/bin/python3", "-c", sys.argv[1], "127.0.0.1", str(port)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, env=env)
    p.stdout.readline()
    conn, addr = lst.accept()
    out[name] = peer.check_tcp(addr[:2], port, "127.0.0.1").as_dict()
    conn.close(); p.stdin.close(); p.wait()
print(json.dumps(out))
'''
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(peer.__file__))))
    cp = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "/usr/bin/python3",
                         "-c", prog, P_CLIENT], capture_output=True, text=True, timeout=60,
                        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": repo}, cwd="/")
    if cp.returncode != 0 and "Permission denied" in cp.stderr:
        pytest.skip(f"ENV_BLOCKED: uid {NOBODY} cannot read this checkout ({cp.stderr.strip().splitlines()[-1]})")
    assert cp.returncode == 0, cp.stderr
    out = json.loads(cp.stdout)
    assert out["plain"]["evidence"] == [] and out["plain"]["uid"] == NOBODY, out
    assert out["cell"]["evidence"] == ["AGNSUP_CELL_TOKEN in its environment"], out


# ------------------------------------------------------------------ the attack: a cell calls sandboxd

# argv: site-packages, gRPC address, REST address, the path Execute would touch. Prints one JSON line:
# what each call got. "SERVED" in any answer is the door open.
P_CALL_SANDBOXD = r'''
import json, sys, urllib.request, urllib.error
sys.path.insert(0, sys.argv[1])
grpc_addr, rest, target = sys.argv[2:5]
out = {}
import grpc
from k8s_agent_sandbox.commands._process_stubs import process_pb2 as pb, process_pb2_grpc as pb_grpc
with grpc.insecure_channel(grpc_addr) as ch:
    stub = pb_grpc.ProcessServiceStub(ch)
    try:
        r = stub.Execute(pb.ExecuteRequest(config=pb.ProcessConfig(command=["touch", target])), timeout=30)
        out["execute"] = "SERVED exit %d" % r.exit_code
    except grpc.RpcError as e:
        out["execute"] = "%s %s" % (e.code().name, e.details())
    try:
        r = stub.ExecuteWithLimits(pb.ExecuteWithLimitsRequest(config=pb.ProcessConfig(command=["touch", target]),
                                                               time_limit={"seconds": 20}), timeout=30)
        out["execute_with_limits"] = "SERVED exit %d" % r.exit_code
    except grpc.RpcError as e:
        out["execute_with_limits"] = "%s %s" % (e.code().name, e.details())
    try:
        first = next(iter(stub.Start(pb.StartRequest(config=pb.ProcessConfig(command=["sleep", "30"])), timeout=30)))
        out["start"] = "SERVED %s" % first
    except grpc.RpcError as e:
        out["start"] = "%s %s" % (e.code().name, e.details())
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
for name, method, path, body in (("put", "PUT", "/v1/files/cell-wrote.txt", b"owned"),
                                 ("get", "GET", "/v1/files/secret.txt", None),
                                 ("health", "GET", "/v1/health", None),
                                 ("process", "POST", "/v1/agnsup/processes", json.dumps({"command": ["touch", target]}).encode())):
    try:
        with opener.open(urllib.request.Request("http://" + rest + path, data=body, method=method), timeout=30) as r:
            out[name] = "SERVED %d %s" % (r.status, r.read()[:40])
    except urllib.error.HTTPError as e:
        out[name] = "%d %s" % (e.code, e.read().decode(errors="replace"))
    except OSError as e:
        out[name] = "unreachable %s" % e
print("ANSWERS " + json.dumps(out))
'''


# argv: site-packages, gRPC address: one Execute of `true`, as a trusted caller
P_CALL_AS_USER = r'''
import sys
sys.path.insert(0, sys.argv[1])
import grpc
from k8s_agent_sandbox.commands._process_stubs import process_pb2 as pb, process_pb2_grpc as pb_grpc
with grpc.insecure_channel(sys.argv[2]) as ch:
    r = pb_grpc.ProcessServiceStub(ch).Execute(pb.ExecuteRequest(config=pb.ProcessConfig(command=["true"])), timeout=60)
print("EXIT", r.exit_code)
'''


class Sandboxd:
    def __init__(self, a: Agnsup, workdir: str, err_path: str):
        with open(err_path, "wb") as err:
            self.p = a.popen("sandboxd", "--grpc", "127.0.0.1:0", "--rest", "127.0.0.1:0", "--workdir", workdir,
                             "--role", "executor", stdout=subprocess.PIPE, stderr=err)
        line = self.p.stdout.readline()
        assert line, open(err_path).read()
        self.ready = json.loads(line)

    def close(self):
        assert stop_server(self.p) == 0
        self.p.stdout.close()


def _sandboxd_cells(a: Agnsup) -> list:
    return [c for c in a.json("ps", "--all", "--json") if c.get("run_id") == "sandboxd"]


@needs_root
@pytest.mark.parametrize("role", ["networked", "executor", "readonly"])
def test_a_cell_cannot_call_sandboxd_on_loopback(state, worktree, tmp_path, role):
    _needs("grpc", "grpcio (the k8s extra)")
    _needs("k8s_agent_sandbox", "k8s-agent-sandbox (the test extra)")
    a = Agnsup(state)
    with open(os.path.join(worktree, "secret.txt"), "w") as f:
        f.write("sandboxd's worktree, not the cell's\n")
    cell_wt = tmp_path / "cellwt"
    cell_wt.mkdir()
    target = os.path.join(worktree, "executed-by-cell")
    s = Sandboxd(a, worktree, str(tmp_path / "sandboxd.err"))
    try:
        cp = a("run", "--role", role, "--cell", "attacker", "--workdir", str(cell_wt), "--", "/usr/bin/python3",
               "-c", P_CALL_SANDBOXD, SITE, s.ready["grpc"], s.ready["rest"], target, timeout=120)
        assert "ANSWERS " in cp.out, cp.out + cp.err
        answers = json.loads(cp.out.split("ANSWERS ", 1)[1])
        assert not any(v.startswith("SERVED") for v in answers.values()), answers
        assert not os.path.exists(target) and not os.path.exists(os.path.join(worktree, "cell-wrote.txt"))
        assert _sandboxd_cells(a) == [], "sandboxd started a cell for the cell's call"
        refused = [r for r in refusals(state) if r.get("entry") == "sandboxd"]
        if role == "networked":  # the host's loopback: it reached the ports, the peer check refused it
            assert answers["execute"].startswith("PERMISSION_DENIED sandboxd: refused"), answers
            assert answers["start"].startswith("PERMISSION_DENIED sandboxd: refused"), answers
            assert answers["execute_with_limits"].startswith("PERMISSION_DENIED sandboxd: refused"), answers
            for k in ("put", "get", "health", "process"):
                assert answers[k].startswith("403 ") and "agnsup cell" in answers[k], answers
            assert len(refused) >= 6, refused
            for r in refused:
                assert peer.is_cell_uid(r["peer"]["uid"]) and r["peer"]["inode"], r
                assert any("cell uid range" in e for e in r["peer"]["evidence"]), r
        else:  # a network namespace of its own: the host's loopback is not there at all
            assert answers["execute"].startswith("UNAVAILABLE"), answers
            assert answers["execute_with_limits"].startswith("UNAVAILABLE"), answers
            assert all(answers[k].startswith("unreachable") for k in ("put", "get", "health", "process")), answers
            assert refused == []
        # the server's own uid, root, is served (the gRPC client in a process of its own: grpc's threads in
        # this one would meet the forks of the in-process selftest below)
        ok = subprocess.run([sys.executable, "-c", P_CALL_AS_USER, SITE, s.ready["grpc"]], capture_output=True,
                            text=True, timeout=120)
        assert ok.stdout.strip() == "EXIT 0", ok.stdout + ok.stderr
        import urllib.request
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        req = urllib.request.Request(f"http://{s.ready['rest']}/v1/files/by-root.txt", data=b"ok", method="PUT")
        with opener.open(req, timeout=30) as resp:
            assert resp.status == 204
        with open(os.path.join(worktree, "by-root.txt")) as f:
            assert f.read() == "ok"
    finally:
        s.close()


@needs_root
def test_mcp_on_a_loopback_port_refuses_a_networked_cell_before_the_token(state, worktree, tmp_path):
    _needs("mcp", "the mcp extra")
    a = Agnsup(state)
    p = a.popen("mcp", "--workdir", worktree, "--run-id", "m", "--http", "127.0.0.1:0", stdout=subprocess.PIPE,
                stderr=subprocess.PIPE)
    try:
        ready = json.loads(p.stdout.readline())
        host_port = ready["url"].split("//", 1)[1].split("/", 1)[0]
        cell_wt = tmp_path / "cellwt"
        cell_wt.mkdir()
        # even a cell that had the token (it never gets it) is refused before it is looked at
        cp = a("run", "--role", "networked", "--workdir", str(cell_wt), "--", "/usr/bin/python3", "-c",
               P_MCP_GET, host_port, ready["token"])
        assert cp.returncode == 0, cp.out + cp.err
        assert [r for r in refusals(state) if r.get("entry") == "mcp"]
        # the server's own uid gets uvicorn's answer: 401 without the token
        c = socket.create_connection(tuple(host_port.rsplit(":", 1)[:1]) + (int(host_port.rsplit(":", 1)[1]),))
        c.sendall(b"GET /mcp HTTP/1.1\r\nHost: localhost\r\n\r\n")
        assert c.recv(4096).startswith(b"HTTP/1.1 401")
        c.close()
    finally:
        stop_server(p)
        p.stdout.close()
        p.stderr.close()


# ------------------------------------------------------------------ as a normal user (agnsup not root)



@needs_root
def test_a_normal_users_sandboxd_refuses_that_users_own_networked_cell():
    """Its cells run as the user itself: the uid cannot tell them from the user's own client, the socket's
    holder (its cgroup, its token) does."""
    _needs("grpc", "grpcio (the k8s extra)")
    _needs("k8s_agent_sandbox", "k8s-agent-sandbox (the test extra)")
    from test_unprivileged import User, _venv
    with User(_venv()) as u:
        wt, cell_wt = u.own_dir("proj"), u.own_dir("cellwt")
        with open(os.path.join(wt, "secret.txt"), "w") as f:
            f.write("sandboxd's worktree\n")
        target = os.path.join(wt, "executed-by-cell")
        p = u.popen("sandboxd", "--grpc", "127.0.0.1:0", "--rest", "127.0.0.1:0", "--workdir", wt,
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            line = p.stdout.readline()
            assert line, p.stderr.read().decode()
            ready = json.loads(line)
            cp = u("run", "--role", "networked", "--workdir", cell_wt, "--", "/usr/bin/python3", "-c",
                   P_CALL_SANDBOXD, SITE, ready["grpc"], ready["rest"], target)
            assert "ANSWERS " in cp.stdout, cp.stdout + cp.stderr
            answers = json.loads(cp.stdout.split("ANSWERS ", 1)[1])
            assert not any(v.startswith("SERVED") for v in answers.values()), answers
            assert answers["execute"].startswith("PERMISSION_DENIED sandboxd: refused"), answers
            assert answers["put"].startswith("403 ") and answers["get"].startswith("403 "), answers
            assert not os.path.exists(target) and not os.path.exists(os.path.join(wt, "cell-wrote.txt"))
            refused = [r for r in refusals(os.path.join(u.home, ".local", "state", "agnsup"))
                       if r.get("entry") == "sandboxd"]
            assert refused and all(r["peer"]["uid"] == u.uid for r in refused), refused
            assert all(any(e.startswith("cgroup ") for e in r["peer"]["evidence"]) for r in refused), refused
            # the user's own process, not a cell, is served
            ok = subprocess.run([u.python, "-c", P_CALL_AS_USER, SITE, ready["grpc"]], preexec_fn=u._enter,
                                env=u.env, cwd=u.work, capture_output=True, text=True, timeout=120)
            assert ok.stdout.strip() == "EXIT 0", ok.stdout + ok.stderr
        finally:
            stop_server(p)
            p.stdout.close()
            p.stderr.close()


@needs_root
@pytest.mark.parametrize("user", [None, NOBODY], ids=["root", "nobody"])
def test_the_selftest_gate_holds_here(user):
    from agnsup.selftest.doors_tcppeer import RUNNERS
    r = run_door_gates(RUNNERS, user)["LOOPBACK_TCP_CONTROL"]
    assert r["status"] == "PASS", r
    if user is not None:
        assert f"uid {NOBODY} is neither" in r["evidence"], r
    elif namespaces.idmap_refused(os.environ.get("AGNSUP_SELFTEST_DIR", "/var/tmp")):
        # a scratch that cannot be id-mapped (the v2 guest's /var/tmp): the cell is host root, known by its cgroup
        assert "cgroup /" in r["evidence"] and "/cell-" in r["evidence"], r
    else:
        assert "cell uid range" in r["evidence"], r
