"""agnsup/ports.py without a pod: the checks every front door's input goes through, and the forwarder's relay on the
host's own loopback (no root, no namespace): bytes both ways, half-close carried through, a server on ::1 only,
and the end when the watched descriptor (the pod's keeper, in a real forwarder) turns readable."""
import hashlib
import os
import socket
import threading

import pytest

from agnsup import ports
from agnsup.errors import UsageError


def test_a_port_is_a_number_from_1_and_the_host_is_loopback_alone():
    assert ports.check_port("port", 8000) == 8000 and ports.check_port("port", "8000") == 8000
    assert ports.check_port("host_port", 0, zero_ok=True) == 0
    for bad in (0, -1, 65536, "x", True, 1.5, None):
        with pytest.raises(UsageError, match="port: must be a port number"):
            ports.check_port("port", bad)
    for ok in (None, "", "127.0.0.1", "localhost"):
        assert ports.check_host(ok) == "127.0.0.1"
    for bad in ("0.0.0.0", "::", "::1", "10.0.0.1", "127.0.0.2", "example.com"):
        with pytest.raises(UsageError, match="loopback"):
            ports.check_host(bad)


def _echo(family, addr):
    srv = socket.create_server((addr, 0), family=family)

    def serve():
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return

            def one(c=c):
                with c:
                    while True:
                        b = c.recv(65536)
                        if not b:
                            c.shutdown(socket.SHUT_WR)
                            return
                        c.sendall(b)
            threading.Thread(target=one, daemon=True).start()
    threading.Thread(target=serve, daemon=True).start()
    return srv


def _through(port: int, payload: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=20) as c:
        got = bytearray()
        t = threading.Thread(target=lambda: [got.extend(b) for b in iter(lambda: c.recv(65536), b"")])
        t.start()
        c.sendall(payload)
        c.shutdown(socket.SHUT_WR)
        t.join(30)
    return bytes(got)


@pytest.mark.parametrize("family,addr", [(socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")])
def test_the_relay_copies_both_ways_carries_the_half_close_and_ends_with_the_watched_fd(family, addr):
    if family == socket.AF_INET6 and not socket.has_ipv6:
        pytest.skip("ENV_BLOCKED: no IPv6 on this host's loopback")
    try:
        srv = _echo(family, addr)
    except OSError as e:
        pytest.skip(f"ENV_BLOCKED: {addr}: {e}")
    listener = socket.create_server(("127.0.0.1", 0))
    watch_r, watch_w = os.pipe()
    relay = ports.Relay(listener, srv.getsockname()[1], watch_r)
    t = threading.Thread(target=relay.serve, daemon=True)
    t.start()
    try:
        payload = os.urandom(3 << 20)
        back = _through(listener.getsockname()[1], payload)
        assert hashlib.sha256(back).digest() == hashlib.sha256(payload).digest()
        assert _through(listener.getsockname()[1], b"") == b""  # a bare half-close comes back as one
    finally:
        os.write(watch_w, b"x")  # the pod's end, as the keeper's pidfd says it
        t.join(10)
        assert not t.is_alive()
        for fd in (watch_r, watch_w):
            os.close(fd)
        listener.close()
        srv.close()
