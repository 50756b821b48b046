"""Published ports (agnsup/ports.py): one of a pod's ports on the host's loopback through a forwarder that lives in
the pod's place, relays real bytes both ways, closes on request and with the pod, and never listens beyond
loopback; the same from the CLI, the Python API, serve and MCP."""
import errno
import hashlib
import json
import os
import signal
import socket
import subprocess
import threading
import time

import pytest

from agnsup import pod as pods
from agnsup import ports
from agnsup.errors import UnknownId, UsageError
from agnsup.linux import proc
from agnsup.store.journal import open_journal
from agnsup.store.state import StateRoot
from agnsup.supervisor import Supervisor

# A TCP echo server on 127.0.0.1:PORT inside the cell (so inside its agent's pod); says so in its worktree
ECHO = ("import socket, sys, threading\n"
        "srv = socket.create_server(('127.0.0.1', int(sys.argv[1])))\n"
        "open('listening', 'w').close()\n"
        "def echo(c):\n"
        "    with c:\n"
        "        while True:\n"
        "            b = c.recv(65536)\n"
        "            if not b:\n"
        "                c.shutdown(socket.SHUT_WR)\n"
        "                return\n"
        "            c.sendall(b)\n"
        "while True:\n"
        "    c, _ = srv.accept()\n"
        "    threading.Thread(target=echo, args=(c,), daemon=True).start()\n")
POD_PORT = 7007  # inside the pod: the host's 7007 is another port altogether


def _wait_file(path: str, timeout: float = 120.0) -> None:  # a cold start on a loaded host
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def _roundtrip(port: int, payload: bytes) -> bytes:
    """Send `payload` to 127.0.0.1:`port` while reading what comes back, then half-close: all of it."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as c:
        got = bytearray()

        def read():
            while True:
                b = c.recv(1 << 16)
                if not b:
                    return
                got.extend(b)
        t = threading.Thread(target=read)
        t.start()
        c.sendall(payload)
        c.shutdown(socket.SHUT_WR)
        t.join(60)
    return bytes(got)


def _refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    except ConnectionRefusedError:
        return True
    return False


def _listeners(port: int) -> list[str]:
    """The host's listening TCP sockets on `port` (any address; /proc/net/tcp and tcp6, state 0A)."""
    out = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/net/{table}") as f:
            out += [ln for ln in f.read().splitlines()[1:]
                    if ln.split()[1].endswith(f":{port:04X}") and ln.split()[3] == "0A"]
    return out


def _gone(pid: int) -> bool:
    deadline = time.monotonic() + 10
    while not proc.is_zombie(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _members(state: str, run: str, agent: str) -> list[int]:
    from agnsup import backend
    p = pods.find(state, run, agent)
    return sorted(backend.choose(state).members(p.place)) if p is not None else []


@pytest.fixture
def server(agnsup, tmp_path):
    """An echo server cell of agent a of run r (so the agent's pod lives while it does)."""
    wt = tmp_path / "srv"
    wt.mkdir()
    p = agnsup.popen("run", "--run", "r", "--agent", "a", "--cell", "server", "--workdir", str(wt),
                     "--changes", "live", "--", "python3", "-c", ECHO, str(POD_PORT),
                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        _wait_file(str(wt / "listening"))
        yield p
    finally:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
        p.communicate(timeout=30)


def test_a_published_port_relays_a_large_body_both_ways_and_close_refuses_after(agnsup, state, server):
    out = agnsup.json("ports", "publish", str(POD_PORT), "--run", "r", "--agent", "a", "--json")
    hp = out["host_port"]
    assert out["host"] == "127.0.0.1" and hp > 0 and out["pod_port"] == POD_PORT and out["url"].endswith(f":{hp}/")
    payload = os.urandom(8 << 20)
    for _ in range(2):  # two connections, one after the other, each 8 MiB both ways
        back = _roundtrip(hp, payload)
        assert len(back) == len(payload) and hashlib.sha256(back).digest() == hashlib.sha256(payload).digest()
    # it lives in the pod's place (the pod's teardown reaches it), and listens on loopback alone
    assert out["pid"] in _members(state, "r", "a")
    assert [ln.split()[1] for ln in _listeners(hp)] == [f"0100007F:{hp:04X}"]
    assert proc.status(out["pid"])["Threads"] == "1"
    assert [p["host_port"] for p in agnsup.json("ports", "--json")] == [hp]
    assert [p["host_port"] for p in agnsup.json("ports", "list", "--run", "r", "--agent", "a", "--json")] == [hp]
    assert agnsup.json("ports", "--run", "other", "--json") == []
    assert "pod port 7007 -> 127.0.0.1:" in agnsup("ports", check=0).out
    closed = agnsup.json("ports", "close", str(POD_PORT), "--run", "r", "--agent", "a", "--json")
    assert [c["host_port"] for c in closed["closed"]] == [hp]
    assert _refused(hp) and not _listeners(hp) and _gone(out["pid"])
    assert agnsup.json("ports", "--json") == []
    assert out["pid"] not in _members(state, "r", "a")
    j = open_journal(state)
    try:
        assert [(e["op"], e["pod_port"], e["host_port"], e["agent_id"]) for e in j.port_events("r")] == \
            [("publish", POD_PORT, hp, "a"), ("close", POD_PORT, hp, "a")]
    finally:
        j.close()


def test_the_pods_end_closes_the_forwarder_and_leaves_nothing(agnsup, state, tmp_path, monkeypatch):
    """Through the Python API: publish beside a spawned server; the server's end is the agent's last cell's, so
    its forwarder and listener go at once, though the Supervisor keeps the pod itself a while (pod.Linger: a
    long one here, so the port's end is the last cell's, not the pod's), and the pod goes with its close."""
    monkeypatch.setattr(pods, "LINGER", 600.0)
    wt = tmp_path / "srv"
    wt.mkdir()
    with Supervisor(state) as sup:
        h = sup.spawn(["python3", "-c", ECHO, str(POD_PORT)], run_id="api", agent_id="a", workdir=str(wt),
                      changes="live")
        _wait_file(str(wt / "listening"))
        rec = sup.publish_port("api", "a", POD_PORT)
        assert _roundtrip(rec["host_port"], b"hello pod") == b"hello pod"
        assert [p["pod_port"] for p in sup.list_ports("api", "a")] == [POD_PORT]
        sup.cancel(cell_id=h["cell_id"], run_id="api")
        sup.wait("api", h["cell_id"], timeout=30)
        assert pods.find(state, "api", "a") is not None  # it lingers ...
        assert _gone(rec["pid"])  # ... but what its cell published does not
        assert _refused(rec["host_port"]) and not _listeners(rec["host_port"])
        assert sup.list_ports() == []
        with pytest.raises(UnknownId, match="not published"):
            sup.close_port("api", "a", POD_PORT)
        # the pod itself may linger a moment (pod.Linger: its namespace and keeper, nothing a cell published), and
        # no port opens into it then: a publish needs a live cell of the agent
        with pytest.raises(UnknownId, match="no pod for agent"):
            sup.publish_port("api", "a", POD_PORT)
        assert sup.list_ports() == []
    assert not os.path.exists(pods.pod_dir(state, "api", "a"))  # the Supervisor's close let go of it


def test_bad_input_is_one_line_and_leaves_nothing_behind(agnsup, state, server):
    def one_line(cp, code, words):
        assert cp.returncode == code, (cp.returncode, cp.out, cp.err)
        assert cp.err.count("\n") == 1 and words in cp.err, cp.err
    one_line(agnsup("ports", "publish", str(POD_PORT), "--run", "r", "--agent", "nobody"), 1, "no pod for agent")
    assert not os.path.exists(pods.pod_dir(state, "r", "nobody"))
    # the attack: listen on every address of the host (and any other than loopback)
    for host in ("0.0.0.0", "::", "10.0.0.1"):
        one_line(agnsup("ports", "publish", str(POD_PORT), "--host", host, "--run", "r", "--agent", "a"), 125,
                 "loopback")
    one_line(agnsup("ports", "publish", "70000", "--run", "r", "--agent", "a"), 125, "POD_PORT")
    one_line(agnsup("ports", "--run", "../../etc"), 125, "invalid run id")
    one_line(agnsup("ports", "publish", str(POD_PORT), "--run", "r", "--agent", "../a"), 125, "invalid agent id")
    rec = agnsup.json("ports", "publish", str(POD_PORT), "--run", "r", "--agent", "a", "--json")
    one_line(agnsup("ports", "publish", str(POD_PORT), "--run", "r", "--agent", "a"), 125, "already published")
    one_line(agnsup("ports", "publish", str(POD_PORT + 1), "--host-port", str(rec["host_port"]), "--run", "r",
                    "--agent", "a"), 125, "taken")
    one_line(agnsup("ports", "close", str(POD_PORT + 1), "--run", "r", "--agent", "a"), 1, "not published")
    cp = agnsup("ports", "publish", str(POD_PORT), "--run", "r", "--agent", "a", "--json")
    assert json.loads(cp.out)["error_type"] == "UsageError" and cp.returncode == 125
    # nothing left by the refusals: one forwarder beside the keeper, one record, one listener
    keeper = pods.find(state, "r", "a").keeper["pid"]
    assert _members(state, "r", "a") == sorted([keeper, rec["pid"]])
    assert [p["pod_port"] for p in agnsup.json("ports", "--json")] == [POD_PORT]
    assert len(_listeners(rec["host_port"])) == 1
    with pytest.raises(UsageError, match="loopback"):  # the API refuses alike
        ports.publish(StateRoot(state), "r", "a", POD_PORT + 2, host="0.0.0.0")


def test_the_forwarder_itself_refuses_a_socket_that_is_not_on_loopback(state, server):
    """The forwarder re-checks what publish decided: handed a socket bound to 0.0.0.0, it says why and ends."""
    from agnsup import backend
    from agnsup.process import forwarder
    p = pods.find(state, "r", "a")
    before = _members(state, "r", "a")
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind(("0.0.0.0", 0))
        s.listen(1)
        with pytest.raises(OSError) as e:
            forwarder.start(s.fileno(), p.enter, lambda pid: backend.choose(state).attach(p.place, pid),
                            ["--pod-port", str(POD_PORT)])
        assert e.value.errno == errno.EADDRNOTAVAIL and "only 127.0.0.1" in e.value.strerror
    finally:
        s.close()
    assert _members(state, "r", "a") == before


def test_serve_publishes_lists_and_closes_a_port(agnsup, state, server, tmp_path):
    from scenario import STARTERS
    from agnsup.doors.serve import Client
    s = STARTERS["serve"](agnsup, tmp_path)
    try:
        with Client(s.ready["socket"]) as c:
            rec = c.call("publish_port", run_id="r", agent_id="a", port=POD_PORT)
            assert _roundtrip(rec["host_port"], b"via serve") == b"via serve"
            assert [p["host_port"] for p in c.call("list_ports", run_id="r")["ports"]] == [rec["host_port"]]
            with pytest.raises(UsageError, match="loopback"):
                c.call("publish_port", run_id="r", agent_id="a", port=POD_PORT + 1, host="0.0.0.0")
            assert c.call("close_port", run_id="r", agent_id="a", port=POD_PORT)["closed"][0]["pid"] == rec["pid"]
            assert _refused(rec["host_port"])
    finally:
        s.close()


def test_mcp_publishes_a_port_of_the_sessions_agent_and_its_end_closes_it(state, worktree):
    pytest.importorskip("mcp")
    import anyio
    from test_mcp import session, value

    async def main():
        async with session(state, worktree, "--run-id", "m") as s:
            h = value(await s.call_tool("spawn", {"argv": ["python3", "-c", ECHO, str(POD_PORT)]}))
            await anyio.to_thread.run_sync(_wait_file, os.path.join(worktree, "listening"))
            res = await s.call_tool("publish_port", {"port": POD_PORT})
            rec = value(res)
            assert not res.is_error and (rec["run_id"], rec["agent_id"]) == ("m", h["agent_id"])
            assert rec["url"] == f"http://127.0.0.1:{rec['host_port']}/"
            assert await anyio.to_thread.run_sync(_roundtrip, rec["host_port"], b"via mcp") == b"via mcp"
            listed = value(await s.call_tool("list_ports", {}))["ports"]
            assert [p["host_port"] for p in listed] == [rec["host_port"]]
            res = await s.call_tool("publish_port", {"port": POD_PORT, "host": "0.0.0.0"})  # no such argument
            assert res.is_error and value(res)["error_type"] == "UsageError"
            res = await s.call_tool("publish_port", {"port": POD_PORT})
            assert res.is_error and "already published" in value(res)["error"]
            return rec
    rec = anyio.run(main)
    assert _gone(rec["pid"]) and _refused(rec["host_port"])  # the session's end ended its cells, its pod, its port


def test_a_normal_users_pod_publishes_through_its_user_namespace_or_the_skip_says_why(state):
    """uid 65534 (tests/test_bad_input.py's way): the pod's network namespace is owned by the pod's user
    namespace, so the forwarder enters that first (Pod.enter), then the network namespace."""
    import shutil
    import sys
    import tempfile
    from test_bad_input import _as_nobody, need_another_users_python
    need_another_users_python()
    from agnsup import backend
    own = tempfile.mkdtemp(prefix="agnsup-nobody-")
    st = own + "/state"
    try:
        os.chown(own, 65534, 65534)
        os.mkdir(own + "/srv")
        os.chown(own + "/srv", 65534, 65534)
        site = [p for p in sys.path if p.endswith("site-packages")][0]
        code = (f"import site, sys; site.addsitedir({site!r}); "
                "from agnsup.doors.entry import main; sys.argv[0] = 'agnsup'; main()")
        server = subprocess.Popen(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "env", "-i",
                                   "PATH=/usr/bin:/bin", "HOME=/nonexistent",
                                   f"AGNSUP_ROOTS_REGISTRY={os.environ['AGNSUP_ROOTS_REGISTRY']}",
                                   "/usr/bin/python3", "-c", code, "--state-dir", st, "run", "--run", "u",
                                   "--agent", "a", "--workdir", own + "/srv", "--timeout", "60", "--changes", "live",
                                   "--", "python3", "-c", ECHO, str(POD_PORT)],
                                  cwd=own + "/srv", stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            _wait_file(os.path.join(own, "srv", "listening"))
            p = pods.find(st, "u", "a")
            if p is None:
                pytest.skip("ENV_BLOCKED: no pod for a normal user's cells here (tests/test_pod.py says why)")
            cp = _as_nobody("--state-dir", st, "ports", "publish", str(POD_PORT), "--run", "u", "--agent", "a",
                            "--json", cwd=own)
            assert cp.returncode == 0, cp.out + cp.err
            rec = json.loads(cp.out)
            assert _roundtrip(rec["host_port"], b"as nobody" * 1000) == b"as nobody" * 1000
            assert proc.status(rec["pid"])["Uid"].split()[0] == "65534"
            # not dumpable (its /proc entries are root's though it runs as 65534): nothing of the pod can ptrace it
            assert os.stat(f"/proc/{rec['pid']}/environ").st_uid == 0
            assert p.userns is not None  # a normal user's pod has a user namespace of its own: the forwarder is in it
            assert os.stat(f"/proc/{rec['pid']}/ns/user").st_ino == p.userns
            assert os.stat(f"/proc/{rec['pid']}/ns/net").st_ino == p.netns
        finally:
            server.send_signal(signal.SIGTERM)
            server.communicate(timeout=30)
        assert _gone(rec["pid"]) and _refused(rec["host_port"])
    finally:
        leaked = backend.choose(st).purge()
        shutil.rmtree(own, ignore_errors=True)
    assert not leaked, leaked


def test_a_sigkilled_controllers_pod_is_swept_by_the_janitor_with_its_published_port(agnsup, state, tmp_path):
    wt = tmp_path / "srv"
    wt.mkdir()
    p = agnsup.popen("run", "--run", "k", "--agent", "a", "--cell", "server", "--workdir", str(wt),
                     "--changes", "live", "--", "python3", "-c", ECHO, str(POD_PORT),
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _wait_file(str(wt / "listening"))
    rec = agnsup.json("ports", "publish", str(POD_PORT), "--run", "k", "--agent", "a", "--json")
    p.send_signal(signal.SIGKILL)  # no leave, no teardown: the pod and its forwarder are left (the server died
    p.wait(timeout=10)             # with its controller) ...
    assert _listeners(rec["host_port"]) and not proc.is_zombie(rec["pid"])
    agnsup("janitor", check=0)  # ... until the janitor's sweep
    assert _gone(rec["pid"]) and _refused(rec["host_port"]) and not _listeners(rec["host_port"])
    assert agnsup.json("ports", "--json") == []


def test_a_dev_server_in_a_pod_is_previewed_from_the_host_with_curl_once_published(agnsup, state, tmp_path):
    """The issue's story: a spawned `http.server`, published, answers a person's curl on the host."""
    import shutil
    from test_pod import SERVER, _free_port
    if not shutil.which("curl"):
        pytest.skip("ENV_BLOCKED: curl is not installed")
    wt = tmp_path / "site"
    wt.mkdir()
    (wt / "index.html").write_text("<h1>agent's app</h1>\n")
    port = _free_port()
    p = agnsup.popen("run", "--run", "web", "--agent", "dev", "--workdir", str(wt), "--changes", "live", "--",
                     "python3", "-c", SERVER, str(port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_file(str(wt / "listening"))
        assert _refused(port)  # not published: the host does not reach it
        rec = agnsup.json("ports", "publish", str(port), "--run", "web", "--agent", "dev", "--json")
        cp = subprocess.run(["curl", "-sS", "--max-time", "10", rec["url"]], capture_output=True, text=True)
        assert cp.returncode == 0 and cp.stdout == "<h1>agent's app</h1>\n", cp.stderr
    finally:
        p.send_signal(signal.SIGTERM)
        p.communicate(timeout=30)
    assert _gone(rec["pid"]) and _refused(rec["host_port"])


def test_without_cgroups_the_forwarder_ends_with_the_pods_keeper(state, tmp_path):
    """AGNSUP_CGROUP_LAYOUT=none: no place to kill, the teardown kills the keeper alone; the forwarder holds the
    keeper's pidfd and ends with it."""
    from conftest import Agnsup
    agnsup = Agnsup(state, env={"AGNSUP_CGROUP_LAYOUT": "none"})
    wt = tmp_path / "srv"
    wt.mkdir()
    p = agnsup.popen("run", "--run", "n", "--agent", "a", "--workdir", str(wt), "--changes", "live", "--",
                     "python3", "-c", ECHO, str(POD_PORT), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        _wait_file(str(wt / "listening"))
        assert pods.find(state, "n", "a").place.node is None  # no tree here
        rec = agnsup.json("ports", "publish", str(POD_PORT), "--run", "n", "--agent", "a", "--json")
        assert _roundtrip(rec["host_port"], b"no cgroups") == b"no cgroups"
    finally:
        p.send_signal(signal.SIGTERM)
        p.communicate(timeout=30)
    assert _gone(rec["pid"]) and _refused(rec["host_port"]) and not _listeners(rec["host_port"])
