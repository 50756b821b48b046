"""Published ports (agnsup/ports.py): a pod's port on the host's loopback through a forwarder that lives in the
pod's place, relays real bytes both ways, closes on request and with the pod, and never listens beyond loopback."""
import errno
import hashlib
import json
import os
import socket
import subprocess
import sys
import time

import pytest

from agnsup import backend as backends
from agnsup import ports
from agnsup.errors import UnknownId, UsageError
from agnsup.linux import proc
from agnsup.linux import sys as lsys
from agnsup.store.state import StateRoot

# The stand-in for a pod before pod.py: a process holding a network namespace with lo up, serving a TCP echo
# on 127.0.0.1:ECHO_PORT inside it, in the place a pod's keeper lives in (the backend's run/agent/"pod").
ECHO_PORT = 7007
KEEPER = f"""
import os, socket, threading
from agnsup.linux import netns, sys as lsys
lsys.unshare(lsys.CLONE_NEWNET)
netns.loopback_up()
srv = socket.create_server(("127.0.0.1", {ECHO_PORT}))
def echo(c):
    with c:
        while True:
            b = c.recv(1 << 16)
            if not b:
                c.shutdown(socket.SHUT_WR)
                return
            c.sendall(b)
print("ok", flush=True)
while True:
    c, _ = srv.accept()
    threading.Thread(target=echo, args=(c,), daemon=True).start()
"""


class NetnsPod:
    """What ports.py asks of a pod (pod.py's contract: dir, place, enter), made by the test itself."""

    def __init__(self, state_dir: str, run_id: str = "r1", agent_id: str = "a1"):
        self.state = StateRoot(state_dir).ensure()
        self.run_id, self.agent_id = run_id, agent_id
        self.dir = ports.pod_dir(self.state, run_id, agent_id)
        os.makedirs(self.dir)
        self.backend = backends.choose(self.state.path)
        self.place = self.backend.create(self.backend.place(run_id, agent_id, "pod", {}), {})
        self.keeper = subprocess.Popen([sys.executable, "-c", KEEPER], stdout=subprocess.PIPE)
        self.backend.attach(self.place, self.keeper.pid)
        assert self.keeper.stdout.readline() == b"ok\n"
        self.netns = os.open(f"/proc/{self.keeper.pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)

    def enter(self) -> None:
        lsys.setns(self.netns, lsys.CLONE_NEWNET)

    def teardown(self) -> None:
        """As the pod's teardown: the backend's kill of its place (never a pid alone), then its directory."""
        self.backend.kill_place(self.place)
        self.keeper.wait(10)
        self.keeper.stdout.close()
        os.close(self.netns)
        self.backend.remove(self.place)


@pytest.fixture
def pod(state):
    p = NetnsPod(state)
    yield p
    p.teardown()


def _roundtrip(port: int, payload: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=20) as c:
        import threading
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
        t.join(30)
    return bytes(got)


def _refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    except ConnectionRefusedError:
        return True
    return False


def _listeners(port: int) -> list[str]:
    """Lines of the host's /proc/net/tcp listening on `port` (state 0A)."""
    with open("/proc/net/tcp") as f:
        return [ln for ln in f.read().splitlines()[1:]
                if ln.split()[1].endswith(f":{port:04X}") and ln.split()[3] == "0A"]


def test_a_published_port_relays_a_large_body_both_ways_and_close_refuses_after(pod):
    rec = ports.publish(pod.state, pod.run_id, pod.agent_id, ECHO_PORT, pod=pod)
    assert rec["host"] == "127.0.0.1" and rec["host_port"] > 0 and rec["pod_port"] == ECHO_PORT
    # the pod's port is not the host's: only the forwarder reaches it
    assert ECHO_PORT == rec["host_port"] or _refused(ECHO_PORT)
    payload = os.urandom(8 << 20)
    for _ in range(2):  # two connections, one after the other, each a large body both ways
        back = _roundtrip(rec["host_port"], payload)
        assert hashlib.sha256(back).hexdigest() == hashlib.sha256(payload).hexdigest()
    # it lives in the pod's place: the pod's teardown reaches it
    assert rec["pid"] in pod.backend.members(pod.place)
    assert [r["host_port"] for r in ports.listing(pod.state)] == [rec["host_port"]]
    with open(os.path.join(pod.dir, "ports.json")) as f:
        assert json.load(f)[0]["pid"] == rec["pid"]
    out = ports.close(pod.state, pod.run_id, pod.agent_id, ECHO_PORT)
    assert out["closed"][0]["host_port"] == rec["host_port"]
    assert _refused(rec["host_port"]) and not _listeners(rec["host_port"])
    assert ports.listing(pod.state) == [] and not os.path.exists(os.path.join(pod.dir, "ports.json"))
    assert rec["pid"] not in pod.backend.members(pod.place)
    j = pod.state.journal()
    try:
        assert [(e["op"], e["pod_port"], e["host_port"], e["agent_id"]) for e in j.port_events(pod.run_id)] == \
            [("publish", ECHO_PORT, rec["host_port"], "a1"), ("close", ECHO_PORT, rec["host_port"], "a1")]
    finally:
        j.close()


def test_the_pods_teardown_ends_the_forwarder_and_its_listener(state):
    p = NetnsPod(state, "r2", "a2")
    try:
        rec = ports.publish(p.state, "r2", "a2", ECHO_PORT, pod=p)
        assert _roundtrip(rec["host_port"], b"hello") == b"hello"
    finally:
        p.teardown()
    assert _refused(rec["host_port"]) and not _listeners(rec["host_port"])
    assert proc.is_zombie(rec["pid"])  # gone (or only its exit status left for init)
    assert ports.listing(p.state) == []


def test_bad_input_is_refused_in_one_line_and_leaves_nothing(pod):
    with pytest.raises(UsageError, match="loopback"):  # the attack: listen on every address of the host
        ports.publish(pod.state, pod.run_id, pod.agent_id, ECHO_PORT, host="0.0.0.0", pod=pod)
    for bad in (0, 70000, "x", True):
        with pytest.raises(UsageError, match="port"):
            ports.publish(pod.state, pod.run_id, pod.agent_id, bad, pod=pod)
    rec = ports.publish(pod.state, pod.run_id, pod.agent_id, ECHO_PORT, pod=pod)
    with pytest.raises(UsageError, match="already published"):
        ports.publish(pod.state, pod.run_id, pod.agent_id, ECHO_PORT, pod=pod)
    with pytest.raises(UsageError, match="taken"):
        ports.publish(pod.state, pod.run_id, pod.agent_id, ECHO_PORT + 1, host_port=rec["host_port"], pod=pod)
    with pytest.raises(UnknownId, match="not published"):
        ports.close(pod.state, pod.run_id, pod.agent_id, ECHO_PORT + 1)
    # nothing was left by the refusals: one forwarder in the place, one record, one listener
    assert pod.backend.members(pod.place) == sorted([pod.keeper.pid, rec["pid"]]) or \
        set(pod.backend.members(pod.place)) == {pod.keeper.pid, rec["pid"]}
    assert [r["pod_port"] for r in ports.listing(pod.state)] == [ECHO_PORT]
    assert len(_listeners(rec["host_port"])) == 1
    ports.close(pod.state, pod.run_id, pod.agent_id, ECHO_PORT)


def test_the_forwarder_refuses_a_socket_that_is_not_on_loopback(pod):
    """The forwarder re-checks what publish decided: handed a socket bound to 0.0.0.0, it says why and exits."""
    from agnsup.process import forwarder
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind(("0.0.0.0", 0))
        s.listen(1)
        with pytest.raises(OSError) as e:
            forwarder.start(s.fileno(), pod.enter, lambda pid: pod.backend.attach(pod.place, pid),
                            ["--pod-port", str(ECHO_PORT)])
        assert e.value.errno == errno.EADDRNOTAVAIL and "only 127.0.0.1" in e.value.strerror
    finally:
        s.close()
    time.sleep(0)
    assert pod.backend.members(pod.place) == [pod.keeper.pid]
