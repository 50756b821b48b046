"""The egress CA (agnsup/egress/ca.py): a controller's one authority, leaves a client trusts, no key on disk."""
from __future__ import annotations

import os
import socket
import ssl
import threading

import pytest

from agnsup.egress import ca
from agnsup.errors import UsageError


def _handshake(auth: ca.Authority, name: str, trust: bytes, alpn=("http/1.1",)) -> tuple[str | None, dict]:
    """A TLS client (trusting `trust`) against a server using auth's leaf for `name`, over a socketpair."""
    a, b = socket.socketpair()
    out: dict = {}

    def serve():
        try:
            with auth.server_context(name).wrap_socket(a, server_side=True) as s:
                out["alpn"] = s.selected_alpn_protocol()
                s.sendall(b"ok")
        except (ssl.SSLError, OSError) as e:  # the client refused our certificate
            out["error"] = e

    t = threading.Thread(target=serve)
    t.start()
    cctx = ssl.create_default_context(cadata=trust.decode())
    cctx.set_alpn_protocols(list(alpn))
    try:
        with cctx.wrap_socket(b, server_hostname=name) as c:
            assert c.recv(2) == b"ok"
            return out.get("alpn"), c.getpeercert()
    finally:
        b.close()
        t.join(5)
        a.close()


def test_a_client_that_trusts_the_ca_accepts_the_leaf_for_a_name():
    auth = ca.Authority("ctl-test")
    alpn, cert = _handshake(auth, "api.secret.test", auth.cert_pem)
    assert alpn == "http/1.1"
    assert ("DNS", "api.secret.test") in cert["subjectAltName"]


def test_an_ip_address_gets_an_ip_san():
    auth = ca.Authority("ctl-test")
    _, cert = _handshake(auth, "127.0.0.1", auth.cert_pem)
    assert ("IP Address", "127.0.0.1") in cert["subjectAltName"]


def test_only_http1_is_offered_by_alpn():
    auth = ca.Authority("ctl-test")
    alpn, _ = _handshake(auth, "h.test", auth.cert_pem, alpn=("h2", "http/1.1"))
    assert alpn == "http/1.1"


def test_another_controllers_ca_is_not_trusted():
    auth, other = ca.Authority("a"), ca.Authority("b")
    with pytest.raises(ssl.SSLError):
        _handshake(auth, "h.test", other.cert_pem)


def test_the_leaf_context_is_cached_per_host():
    auth = ca.Authority("ctl-test")
    assert auth.server_context("X.test") is auth.server_context("x.test")
    assert auth.server_context("x.test") is not auth.server_context("y.test")


def test_authority_is_one_per_controller_and_state_root(tmp_path):
    a = ca.authority(str(tmp_path), "c1")
    assert ca.authority(str(tmp_path), "c1") is a
    assert ca.authority(str(tmp_path), "c2") is not a
    assert "PRIVATE" not in repr(a) and b"PRIVATE" not in a.cert_pem


def test_write_cert_writes_only_the_public_certificate(tmp_path):
    auth = ca.Authority("ctl-w")
    path = auth.write_cert(str(tmp_path / "ca"))
    assert path == str(tmp_path / "ca" / "ctl-w.pem")
    with open(path, "rb") as f:
        assert f.read() == auth.cert_pem
    auth.server_context("h.test")
    for root, _dirs, files in os.walk(tmp_path):
        for f in files:
            with open(os.path.join(root, f), "rb") as fh:
                assert b"PRIVATE KEY" not in fh.read()
    assert sorted(os.listdir(tmp_path / "ca")) == ["ctl-w.pem"]


def test_write_cert_to_an_unwritable_dir_is_one_usage_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(UsageError) as e:
        ca.Authority("ctl-x").write_cert(str(blocker / "ca"))
    assert "\n" not in str(e.value) and "not writable" in str(e.value)
