"""network.mode = "allowlist": the only way out of the cell is the controller's proxy.

Real cells (own network namespace, only lo up), a real proxy in the
controller, real clients inside the cell (curl, Python's urllib, pip, git).
The destination is a test HTTP/HTTPS server on the host's loopback that
plays the listed domain `pkg.test`: the test hands the proxy a name map
through the controller's environment (AGNSUP_TEST_EGRESS_HOSTS), which the
cell can neither see nor set. Nothing leaves this machine except in the one
end-to-end test that downloads from the pip index this host is configured
with.
"""
from __future__ import annotations

import hashlib
import http.server
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import zipfile

import pytest

from conftest import Agnsup, write_role

PKG = "agnsup-probe-pkg"
WHEEL = "agnsup_probe_pkg-1.0-py3-none-any.whl"
BIG = 2 * 1024 * 1024


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def do_GET(self):
        srv = self.server
        with srv.lock:
            srv.hits.append(self.path)
        if self.path.startswith("/slow"):
            # 4 KiB every 50 ms for at most 20 s: a download that is surely in flight when the test acts
            self.send_response(200)
            self.send_header("Content-Length", str(400 * 4096))
            self.end_headers()
            for _ in range(400):
                try:
                    self.wfile.write(b"s" * 4096)
                    self.wfile.flush()
                except OSError:
                    return
                time.sleep(0.05)
            return
        if self.path.startswith("/sleep"):
            time.sleep(1.0)
            body = b"slept\n"
        elif self.path.startswith("/big"):
            body = b"b" * BIG
        else:
            p = os.path.join(srv.root, self.path.split("?")[0].lstrip("/"))
            if p.endswith("/"):
                p += "index.html"
            try:
                with open(p, "rb") as f:
                    body = f.read()
            except OSError:
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
        self.send_response(200)
        self.send_header("Content-Type", "text/html" if self.path.endswith("/") else "application/octet-stream")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def _wheel(path: str) -> None:
    files = {"agnsup_probe_pkg/__init__.py": b"VALUE = 1\n",
             "agnsup_probe_pkg-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: agnsup-probe-pkg\nVersion: 1.0\n",
             "agnsup_probe_pkg-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                                   b"Tag: py3-none-any\n"}
    record = "".join(f"{n},sha256={hashlib.sha256(d).hexdigest()},{len(d)}\n" for n, d in files.items())
    record += "agnsup_probe_pkg-1.0.dist-info/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for n, d in files.items():
            z.writestr(n, d)
        z.writestr("agnsup_probe_pkg-1.0.dist-info/RECORD", record)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """pkg.test on the host's loopback: HTTP and HTTPS, a pip index with one wheel, a git repository."""
    d = tmp_path_factory.mktemp("site")
    root = d / "www"
    (root / "simple" / PKG).mkdir(parents=True)
    _wheel(str(root / WHEEL))
    (root / "simple" / PKG / "index.html").write_text(f'<a href="../../{WHEEL}">{WHEEL}</a>\n')
    (root / "hello.txt").write_text("hello from pkg.test\n")
    if os.path.exists("/usr/bin/git"):
        work = d / "work"
        work.mkdir()
        g = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "init.defaultBranch=main"]
        subprocess.run([*g, "init", "-q", str(work)], check=True)
        (work / "README").write_text("cloned through the proxy\n")
        subprocess.run([*g, "-C", str(work), "add", "README"], check=True)
        subprocess.run([*g, "-C", str(work), "commit", "-qm", "one"], check=True)
        subprocess.run([*g, "clone", "-q", "--bare", str(work), str(root / "repo.git")], check=True)
        subprocess.run(["git", "-C", str(root / "repo.git"), "update-server-info"], check=True)
    cert, key = d / "cert.pem", d / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=pkg.test",
                    "-addext", "subjectAltName=DNS:pkg.test,DNS:*.pkg.test"], check=True, capture_output=True)
    servers = {}
    for name in ("http", "https"):
        srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        srv.daemon_threads = True
        srv.root, srv.hits, srv.lock = str(root), [], threading.Lock()
        if name == "https":
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(str(cert), str(key))
            srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers[name] = srv
    yield {"http": servers["http"].server_address[1], "https": servers["https"].server_address[1],
           "cert": cert.read_bytes(), "servers": servers}
    for srv in servers.values():
        srv.shutdown()
        srv.server_close()


HOSTS = json.dumps({"pkg.test": "127.0.0.1", "files.pkg.test": "127.0.0.1", "other.test": "127.0.0.1"})


@pytest.fixture
def net(state, worktree, policy_dir, site):
    """Roles, the cert in the worktree, and an `agnsup` whose proxy resolves through the test's name map."""
    write_role(policy_dir, "pkgs", network__mode='"allowlist"', network__allow='["pkg.test:*", "*.pkg.test:*"]',
               network__allow_private="true")  # the test server is on the host's loopback
    write_role(policy_dir, "strict", network__mode='"allowlist"', network__allow='["pkg.test:*"]')
    write_role(policy_dir, "anyhost", network__mode='"allowlist"', network__allow='["*:*"]')
    write_role(policy_dir, "inner", network__mode='"internal"', network__allow='["*:*"]')
    with open(os.path.join(worktree, "cert.pem"), "wb") as f:
        f.write(site["cert"])
    for s in site["servers"].values():
        with s.lock:
            s.hits.clear()
    a = Agnsup(state, env={"AGNSUP_POLICY_DIR": str(policy_dir), "AGNSUP_TEST_EGRESS_HOSTS": HOSTS})
    a.site, a.worktree = site, worktree
    return a


def _receipt(state, cell):
    with open(os.path.join(state, "cells", "default", cell, "receipt.json")) as f:
        return json.load(f)


def _connections(state, cell) -> list[dict]:
    from agnsup.store.journal import open_journal
    if not os.path.exists(os.path.join(state, "journal.db")):
        return []
    j = open_journal(state)
    try:
        return j.connections("default", cell)
    finally:
        j.close()


def _run(net, role, cell, *argv, check=0, timeout=120, env=()):
    extra = [x for k in env for x in ("--env", k)]
    return net("run", "--role", role, "--cell", cell, "--workdir", net.worktree, *extra, "--", *argv, check=check,
               timeout=timeout)


# ------------------------------------------------------------------------------------ allowed names

def test_an_allowed_name_works_through_curl_over_http_https_and_socks5(net):
    p, s = net.site["http"], net.site["https"]
    cp = _run(net, "pkgs", "curl", "sh", "-c",
              f"curl -fsS http://pkg.test:{p}/hello.txt && curl -fsS --cacert cert.pem https://pkg.test:{s}/hello.txt"
              f" && curl -fsS --cacert cert.pem -x socks5h://127.0.0.1:3128 https://files.pkg.test:{s}/hello.txt")
    assert cp.out == "hello from pkg.test\n" * 3, cp.err
    net_ = _receipt(net.state, "curl")["network"]
    conns = net_["connections"]
    assert [(c["protocol"], c["name"], c["port"], c["address"], c["decision"]) for c in conns] == [
        ("http", "pkg.test", p, "127.0.0.1", "allowed"), ("http-connect", "pkg.test", s, "127.0.0.1", "allowed"),
        ("socks5", "files.pkg.test", s, "127.0.0.1", "allowed")]
    assert [c["rule"] for c in conns] == ["allow:pkg.test:*", "allow:pkg.test:*", "allow:*.pkg.test:*"]
    assert all(c["bytes_down"] > 20 and c["bytes_up"] > 20 and c["duration"] > 0 for c in conns)
    assert net_["attempts"] == 3 and net_["allowed"] == 3 and net_["resolver"].startswith("test name map")
    # every attempt is in the journal too, with the same bytes
    rows = _connections(net.state, "curl")
    assert [(r["seq"], r["name"], r["bytes_down"], r["decision"]) for r in rows] == [
        (c["seq"], c["name"], c["bytes_down"], c["decision"]) for c in conns]


def test_the_proxy_variables_are_in_the_cell_and_in_the_receipt(net):
    cp = _run(net, "pkgs", "env", "env")
    env = dict(line.split("=", 1) for line in cp.out.splitlines())
    for k in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
        assert env[k] == "http://127.0.0.1:3128"
    assert env["ALL_PROXY"] == env["all_proxy"] == "socks5h://127.0.0.1:3128"
    assert env["NO_PROXY"] == env["no_proxy"] == "localhost,127.0.0.1"
    assert "AGNSUP_TEST_EGRESS_HOSTS" not in env  # the name map is the controller's, never the cell's
    r = _receipt(net.state, "env")
    assert {k: r["env_sources"][k] for k in ("HTTPS_PROXY", "no_proxy")} == {"HTTPS_PROXY": "agnsup",
                                                                           "no_proxy": "agnsup"}
    assert r["isolation"]["network_namespace"] is True and r["isolation"]["network"] == "allowlist"


URLLIB = """
import ssl, sys, urllib.request
ctx = ssl.create_default_context(cafile="cert.pem")
for url in sys.argv[1:]:
    print(urllib.request.urlopen(url, context=ctx, timeout=20).read().decode(), end="")
"""


def test_an_allowed_name_works_through_python_urllib(net):
    p, s = net.site["http"], net.site["https"]
    cp = _run(net, "pkgs", "urllib", sys.executable, "-c", URLLIB, f"http://pkg.test:{p}/hello.txt",
              f"https://pkg.test:{s}/hello.txt")
    assert cp.out == "hello from pkg.test\n" * 2


def test_pip_download_goes_through_the_proxy(net):
    s = net.site["https"]
    # PIP_CONFIG_FILE=/dev/null: none of this host's pip configuration (its index, find-links)
    cp = _run(net, "pkgs", "pip", sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir",
              "--disable-pip-version-check", "--cert", "cert.pem", "--index-url", f"https://pkg.test:{s}/simple/",
              "-d", "dl", PKG, env=("PIP_CONFIG_FILE=/dev/null",), timeout=180)
    assert os.path.exists(os.path.join(net.worktree, "dl", WHEEL)), cp.out + cp.err
    conns = _receipt(net.state, "pip")["network"]["connections"]
    assert conns and all(c["name"] == "pkg.test" and c["decision"] == "allowed" for c in conns)
    assert sum(c["bytes_down"] for c in conns) > os.path.getsize(os.path.join(net.worktree, "dl", WHEEL))


@pytest.mark.skipif(not os.path.exists("/usr/bin/git"), reason="git is not installed on this host")
def test_git_clones_over_http_and_https_through_the_proxy(net):
    p, s = net.site["http"], net.site["https"]
    cp = _run(net, "pkgs", "git", "sh", "-c",
              f"git clone -q http://pkg.test:{p}/repo.git a && "
              f"git -c http.sslCAInfo=$PWD/cert.pem clone -q https://pkg.test:{s}/repo.git b && cat a/README b/README",
              env=("GIT_CONFIG_NOSYSTEM=1",))
    assert cp.out == "cloned through the proxy\n" * 2, cp.err
    conns = _receipt(net.state, "git")["network"]["connections"]
    assert {c["port"] for c in conns} == {p, s} and all(c["decision"] == "allowed" for c in conns)


# ------------------------------------------------------------------------------------ refusals

def test_an_unlisted_name_is_refused_with_the_rule_in_the_receipt(net):
    s = net.site["https"]
    cp = _run(net, "pkgs", "unlisted", "curl", "-sS", "--cacert", "cert.pem", f"https://other.test:{s}/hello.txt",
              check=None)
    assert cp.returncode != 0 and "hello" not in cp.out
    c, = _receipt(net.state, "unlisted")["network"]["connections"]
    assert (c["name"], c["decision"], c["rule"], c["address"]) == ("other.test", "refused", "unlisted", None)
    assert net.site["servers"]["https"].hits == []


PROBE = r"""
import json, socket, sys
port = int(sys.argv[1])
def http(request):
    s = socket.create_connection(("127.0.0.1", 3128), timeout=10)
    s.sendall(request.encode())
    line = s.recv(200).split(b"\r\n")[0].decode()
    s.close()
    return line
def connect_(host):
    return http(f"CONNECT {host}:{port} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n")
def absolute(host):
    return http(f"GET http://{host}:{port}/hello.txt HTTP/1.1\r\nHost: {host}\r\n\r\n")
def socks(host):
    s = socket.create_connection(("127.0.0.1", 3128), timeout=10)
    s.sendall(b"\x05\x01\x00")
    assert s.recv(2) == b"\x05\x00"
    h = host.encode()
    s.sendall(b"\x05\x01\x00\x03" + bytes([len(h)]) + h + port.to_bytes(2, "big"))
    rep = s.recv(10)
    s.close()
    return rep[1]
out = {h: [connect_(h), absolute(h), socks(h)] for h in sys.argv[2:]}
print(json.dumps(out))
"""


def test_ip_literals_localhost_and_every_loopback_spelling_are_refused(net):
    from test_netpolicy import LOOPBACK_SPELLINGS, UNSPECIFIED
    spellings = LOOPBACK_SPELLINGS + UNSPECIFIED
    p = net.site["http"]
    for role in ("anyhost", "pkgs"):  # any destination without allow_private; a listed name with it
        cp = _run(net, role, f"lo-{role}", sys.executable, "-c", PROBE, str(p), *spellings, timeout=180)
        out = json.loads(cp.out)
        for h in spellings:
            connect_, absolute, socks = out[h]
            assert connect_.startswith("HTTP/1.1 403") and absolute.startswith("HTTP/1.1 403"), (role, h, out[h])
            assert socks == 2, (role, h, socks)  # "connection not allowed by ruleset"
        conns = _receipt(net.state, f"lo-{role}")["network"]["connections"]
        assert len(conns) == 3 * len(spellings) and {c["decision"] for c in conns} == {"refused"}
        rules = {c["rule"] for c in conns}
        if role == "anyhost":
            assert rules <= {"address:loopback", "address:unspecified", "malformed"}, rules
            assert "address:loopback" in rules
        else:
            assert rules == {"unlisted"}, rules
    assert net.site["servers"]["http"].hits == []  # not one byte reached the server


def test_a_listed_name_resolving_to_a_private_address_is_refused_unless_allow_private(net):
    p = net.site["http"]
    cp = _run(net, "strict", "rebind", "curl", "-fsS", f"http://pkg.test:{p}/hello.txt", check=None)
    assert cp.returncode != 0 and "hello" not in cp.out
    c, = _receipt(net.state, "rebind")["network"]["connections"]
    assert (c["name"], c["address"], c["decision"], c["rule"]) == ("pkg.test", "127.0.0.1", "refused",
                                                                  "address:loopback")
    assert net.site["servers"]["http"].hits == []
    cp = _run(net, "pkgs", "private-ok", "curl", "-fsS", f"http://pkg.test:{p}/hello.txt")
    assert cp.out == "hello from pkg.test\n"


def test_internal_mode_reaches_a_private_destination_through_the_same_proxy(net):
    p = net.site["http"]
    cp = _run(net, "inner", "internal", "curl", "-fsS", f"http://pkg.test:{p}/hello.txt")
    assert cp.out == "hello from pkg.test\n"
    assert _receipt(net.state, "internal")["network"]["mode"] == "internal"


RAW = r"""
import json, socket, sys, time
port, host_addr = int(sys.argv[1]), sys.argv[2]
out = {}
def attempt(name, fn):
    try:
        fn(); out[name] = "WORKED"
    except OSError as e:
        out[name] = type(e).__name__
def tcp(addr):
    s = socket.create_connection((addr, port), timeout=3); s.sendall(b"GET /hello.txt HTTP/1.0\r\n\r\n")
    if not s.recv(10): raise ConnectionResetError
def udp(addr):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.sendto(b"x", (addr, 53))
attempt("tcp_host_loopback", lambda: tcp("127.0.0.1"))
attempt("tcp_host_address", lambda: tcp(host_addr))
attempt("udp_host_address", lambda: udp(host_addr))
t = time.monotonic()
attempt("dns_listed", lambda: socket.getaddrinfo("pkg.test", 443))
attempt("dns_public", lambda: socket.getaddrinfo("example.org", 443))
out["dns_seconds"] = time.monotonic() - t
print(json.dumps(out))
"""


def _host_address() -> str:
    """An address of this host outside loopback (no packet is sent to it from here)."""
    with open("/proc/net/route") as f:
        ifaces = [line.split()[0] for line in f.readlines()[1:]]
    import fcntl
    import struct
    for name in ifaces:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
            return socket.inet_ntoa(packed[20:24])
        except OSError:
            continue
        finally:
            s.close()
    return "192.0.2.1"


def test_raw_tcp_udp_and_dns_from_the_cell_fail(net):
    cp = _run(net, "pkgs", "raw", sys.executable, "-c", RAW, str(net.site["http"]), _host_address())
    out = json.loads(cp.out)
    assert out["tcp_host_loopback"] == "ConnectionRefusedError"  # its own loopback: nobody there
    for k in ("tcp_host_address", "udp_host_address", "dns_listed", "dns_public"):
        assert out[k] != "WORKED", (k, out)
    assert out["dns_seconds"] < 2.0, out  # no resolver to wait for: it fails at once
    assert net.site["servers"]["http"].hits == []
    assert _receipt(net.state, "raw")["network"]["attempts"] == 0  # none of it even reached the proxy


CONCURRENT = r"""
import sys, threading, time, urllib.request
url, n = sys.argv[1], int(sys.argv[2])
res = []
def get():
    res.append(urllib.request.urlopen(url, timeout=30).read())
t = time.monotonic()
ts = [threading.Thread(target=get) for _ in range(n)]
[x.start() for x in ts]; [x.join() for x in ts]
print(len([r for r in res if r == b"slept\n"]), round(time.monotonic() - t, 3))
"""


@pytest.mark.serial("24 requests of 1 s within 6 s")
def test_many_concurrent_connections_from_one_cell_do_not_serialise(net):
    n = 24
    cp = _run(net, "pkgs", "many", sys.executable, "-c", CONCURRENT, f"http://pkg.test:{net.site['http']}/sleep", str(n))
    done, seconds = cp.out.split()
    assert int(done) == n
    assert float(seconds) < 6.0, f"{n} requests of 1 s each took {seconds} s: the proxy serialised them"
    assert _receipt(net.state, "many")["network"]["allowed"] == n


# ------------------------------------------------------------------------------------ fail closed

KILLED = r"""
import json, os, socket, sys, time, urllib.request
port, flag = int(sys.argv[1]), sys.argv[2]
out = {}
r = urllib.request.urlopen(f"http://pkg.test:{port}/slow", timeout=30)
got = len(r.read(8192))
open(flag, "w").write("started")
try:
    while True:
        b = r.read(65536)
        if not b: break
        got += len(b)
    out["download"] = "ended"
except Exception as e:
    out["download"] = type(e).__name__
out["bytes"] = got
# Only once the controller is gone (the test says so): the kernel closes a dying
# process's descriptors one by one, so the download can end a moment before the
# listener is closed.
deadline = time.monotonic() + 30
while not os.path.exists(flag + ".dead") and time.monotonic() < deadline:
    time.sleep(0.02)
def attempt(name, fn):
    try:
        fn(); out[name] = "WORKED"
    except OSError as e:
        out[name] = type(e).__name__
attempt("proxy_again", lambda: socket.create_connection(("127.0.0.1", 3128), timeout=3))
attempt("direct", lambda: socket.create_connection(("127.0.0.1", port), timeout=3))
open(flag + ".json", "w").write(json.dumps(out))
time.sleep(60)
"""


def test_a_sigkilled_controller_leaves_the_cell_without_network_and_nothing_to_clean(net):
    p = net.site["http"]
    flag = os.path.join(net.worktree, "flag")
    ctl = net.popen("run", "--role", "pkgs", "--cell", "killed", "--workdir", net.worktree,
                    "--on-controller-death", "keep", "--changes", "live", "--", sys.executable,  # its flag, read live
                    "-c", KILLED, str(p), flag, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 60
        while not os.path.exists(flag) and time.time() < deadline and ctl.poll() is None:
            time.sleep(0.05)
        assert os.path.exists(flag), ctl.stderr.read().decode() if ctl.poll() is not None else "no start"
        deadline = time.time() + 5
        while not _connections(net.state, "killed") and time.time() < deadline:
            time.sleep(0.02)  # the attempt is journaled while it is in flight
        ctl.send_signal(signal.SIGKILL)  # the controller this test started
        ctl.wait(10)
        open(flag + ".dead", "w").close()
        deadline = time.time() + 30
        while not os.path.exists(flag + ".json") and time.time() < deadline:
            time.sleep(0.05)
        with open(flag + ".json") as f:
            out = json.load(f)
    finally:
        if ctl.poll() is None:
            ctl.kill()
            ctl.wait()
        ctl.stdout.close()
        ctl.stderr.close()
    assert out["bytes"] < 400 * 4096, out  # cut off mid-download
    assert out["proxy_again"] == "ConnectionRefusedError", out  # the listener died with the controller
    assert out["direct"] == "ConnectionRefusedError", out
    rows = _connections(net.state, "killed")
    assert [(r["name"], r["decision"], r["duration"]) for r in rows] == [("pkg.test", "allowed", None)]
    rec = net.json("janitor", "--json")
    assert rec["recovered"] == ["killed"], rec
    recovery, = net.json("receipts", "--recovery", "--json")
    released = recovery["cell"]["released"]
    assert released and {x["kind"] for x in released} <= {"kill", "cgroup", "tmpdir", "lock", "worktree_lock"}, released
    assert net.json("janitor", "--json")["recovered"] == []  # nothing left the second time


def test_without_network_namespaces_an_allowlist_role_refuses_to_start(net, tmp_path):
    """A host that lacks network namespaces (here: unshare(CLONE_NEWNET) refused with EPERM, as
    a container's seccomp does) never runs an allowlist cell on the host's network."""
    script = tmp_path / "nonetns.py"
    script.write_text(
        "import errno, json, os, sys\n"
        "from agnsup.linux import sys as lsys\n"
        "real = lsys.unshare\n"
        "def unshare(flags):\n"
        "    if flags & lsys.CLONE_NEWNET:\n"
        "        raise OSError(errno.EPERM, 'unshare: Operation not permitted')\n"
        "    real(flags)\n"
        "lsys.unshare = unshare\n"
        "sys.argv = ['agnsup', *sys.argv[1:]]\n"
        "from agnsup.doors.entry import main\n"
        "main()\n")
    env = {**net.env}
    cp = subprocess.run([sys.executable, str(script), "run", "--role", "pkgs", "--cell", "nonet", "--workdir",
                         net.worktree, "--", "sh", "-c", "echo ran > ran"], env=env, capture_output=True,
                        timeout=60)
    assert cp.returncode == 125, cp.stderr
    # one line: the step, then both fixes (issue 27): the container's flag, or a reduced cell
    assert cp.stderr.decode().startswith("agnsup: cell setup failed at step 'unshare': unshare: Operation not "
                                         "permitted (") and cp.stderr.decode().count("\n") == 1
    assert 'accept a reduced cell: isolation.reduced = ["network_namespace"]' in cp.stderr.decode()
    assert not os.path.exists(os.path.join(net.worktree, "ran"))
    r = _receipt(net.state, "nonet")
    assert r["state"] == "failed" and r["network"]["attempts"] == 0


# ------------------------------------------------------------------------------------ evidence

def test_receipts_show_a_network_summary(net):
    p = net.site["http"]
    _run(net, "pkgs", "summary", "sh", "-c",
         f"curl -fsS http://pkg.test:{p}/hello.txt; curl -sS http://other.test:{p}/ || true")
    cp = net("receipts", "--cell", "summary", check=0)
    assert "network allowlist: 2 connections (1 allowed, 1 refused" in cp.out, cp.out
    assert "refused other.test:%d (unlisted)" % p in cp.out, cp.out


def test_a_long_lived_cell_keeps_the_first_records_and_counts_the_rest(monkeypatch):
    """The proxy itself, on a listener of the test's own: past MAX_RECORDED only counts grow."""
    from agnsup.egress import proxy as proxymod
    from agnsup.netpolicy import Rules
    monkeypatch.setattr(proxymod, "MAX_RECORDED", 5)
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(64)
    port = lst.getsockname()[1]

    class Sink:
        rows = []
        error = None

        def put(self, r):
            self.rows.append(r)

        def close(self):
            pass

    px = proxymod.Proxy(lst, Rules.of({"allow": ["pkg.test"]}), proxymod.map_resolver({}), Sink()).start()
    for i in range(12):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"CONNECT nope%d.test:443 HTTP/1.1\r\n\r\n" % (i % 3))
        assert s.recv(100).startswith(b"HTTP/1.1 403")
        s.close()
    deadline = time.time() + 5
    while px.totals["attempts"] < 12 and time.time() < deadline:
        time.sleep(0.01)
    summary = px.stop()
    assert summary["attempts"] == 12 and summary["recorded"] == 5 and summary["not_recorded"] == 7
    assert len(summary["connections"]) == 5 and len(Sink.rows) == 5
    assert sorted(d["count"] for d in summary["by_destination"]) == [4, 4, 4]


# ------------------------------------------------------------------------------------ the real index

def _pip_config() -> dict:
    """pip's own configuration, read now (never written anywhere): `pip config list` plus PIP_* variables."""
    cp = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, timeout=60)
    conf = {}
    for line in cp.stdout.splitlines():
        key, _, value = line.partition("=")
        conf[key.split(".", 1)[-1]] = value.strip().strip("'\"")
    for k, v in os.environ.items():
        if k.startswith("PIP_"):
            conf[k[4:].lower().replace("_", "-")] = v
    return conf


def test_pip_downloads_a_package_from_this_hosts_index_through_the_proxy(agnsup, state, worktree, policy_dir):
    import urllib.parse
    import urllib.request
    conf = _pip_config()
    index = conf.get("index-url")
    if not index:
        # no index-url configured: pip uses its built-in default, read from pip itself
        try:
            from pip._internal.models.index import PyPI
        except ImportError:
            pytest.skip("no pip index configured on this host (no index-url in pip config, PIP_INDEX_URL unset)")
        index = PyPI.simple_url
    if not index.startswith(("http://", "https://")):
        pytest.skip(f"this host's pip index is not reached over HTTP(S): {index.split(':')[0]}")
    pkg = "six"
    page_url = index.rstrip("/") + f"/{pkg}/"
    ctx = None
    if conf.get("cert"):
        ctx = ssl.create_default_context(cafile=conf["cert"])
    try:  # which hosts the index sends pip to (its file links), asked from the host itself
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=ctx))
        page = opener.open(page_url, timeout=30).read().decode(errors="replace")
    except OSError as e:
        pytest.skip(f"ENV_BLOCKED: this host's pip index {urllib.parse.urlsplit(index).hostname} is not reachable "
                    f"from the host: {e}")
    import re
    hosts = {urllib.parse.urlsplit(index).hostname}
    hosts |= {urllib.parse.urlsplit(urllib.parse.urljoin(page_url, h)).hostname
              for h in re.findall(r'href="([^"]+)"', page)}
    from agnsup.netpolicy import Rules
    addrs = {a[4][0] for h in hosts for a in socket.getaddrinfo(h, 443, type=socket.SOCK_STREAM)}
    # allow_private only where this host's resolver answers with non-public addresses for the index
    # (an intercepting mirror); the receipt shows the address class either way
    public = Rules.of({"allow": ["*"]}).judge_addresses([__import__("ipaddress").ip_address(a) for a in addrs])
    allow = json.dumps(sorted(hosts))
    write_role(policy_dir, "pipindex", network__mode='"allowlist"', network__allow=allow,
               network__allow_private="false" if public.allowed else "true")
    a = Agnsup(state, env={"AGNSUP_POLICY_DIR": str(policy_dir)})
    args = ["--no-deps", "--no-cache-dir", "--disable-pip-version-check", "--index-url", index, "-d", "dl", pkg]
    if conf.get("cert"):
        args[:0] = ["--cert", conf["cert"]]
    cp = a("run", "--role", "pipindex", "--cell", "real", "--workdir", worktree, "--env", "PIP_CONFIG_FILE=/dev/null",
           "--", sys.executable, "-m", "pip", "download", *args, timeout=300)
    assert cp.returncode == 0, cp.out + cp.err
    got = os.listdir(os.path.join(worktree, "dl"))
    assert len(got) == 1 and got[0].startswith("six-"), got
    r = _receipt(state, "real")["network"]
    allowed = [c for c in r["connections"] if c["decision"] == "allowed"]
    assert allowed and {c["name"] for c in allowed} <= hosts and r["refused"] == 0
    assert sum(c["bytes_down"] for c in allowed) > os.path.getsize(os.path.join(worktree, "dl", got[0]))


def test_serve_cells_get_the_proxy_too_and_pid_namespace_cells_as_well(net, monkeypatch, policy_dir):
    """Through the long-lived controller (the Python API serve uses): one proxy per cell, concurrently."""
    from agnsup import Supervisor
    monkeypatch.setenv("AGNSUP_POLICY_DIR", str(policy_dir))
    monkeypatch.setenv("AGNSUP_TEST_EGRESS_HOSTS", HOSTS)
    write_role(policy_dir, "pkgsns", network__mode='"allowlist"', network__allow='["pkg.test:*"]',
               network__allow_private="true", isolation__pid_namespace="true")
    url = f"http://pkg.test:{net.site['http']}/hello.txt"
    with Supervisor(net.state) as sup:
        hs = [sup.spawn(["curl", "-fsS", url], role=role, cell_id=f"s{i}", workdir=net.worktree)
              for i, role in enumerate(["pkgs", "pkgs", "pkgsns"])]
        results = [sup.wait(h["run_id"], h["cell_id"], timeout=60) for h in hs]
    assert [r["stdout"] for r in results] == ["hello from pkg.test\n"] * 3, results
    for i in range(3):
        c, = _receipt(net.state, f"s{i}")["network"]["connections"]
        assert c["decision"] == "allowed" and c["bytes_down"] > 0
    assert _receipt(net.state, "s2")["isolation"]["pid_namespace"] is True


def test_the_shipped_proxied_role_reaches_public_names_only(state, worktree, site):
    """`proxied` as shipped: any name, ports 80 and 443, never the host's loopback (so not our server)."""
    from agnsup import policy
    pol = policy.load("proxied")
    assert pol["network"] == {"mode": "allowlist", "allow": ["*"], "deny": [], "allow_private": False,
                              "proxy_port": 3128, "allow_internal": [], "tunnels": "deny", "download_exec": "deny",
                              "pod": True}
    a = Agnsup(state, env={"AGNSUP_TEST_EGRESS_HOSTS": HOSTS})
    cp = a("run", "--role", "proxied", "--cell", "pub", "--workdir", worktree, "--", "curl", "-sS", "-o", "/dev/null",
           "-o", "/dev/null", "-w", "%{http_code}", f"http://pkg.test:{site['http']}/hello.txt", "http://pkg.test/hello.txt",
           check=None)
    assert cp.out == "403403", cp.out + cp.err
    rules = [c["rule"] for c in _receipt(state, "pub")["network"]["connections"]]
    # a port other than 80/443, and the host's loopback (the proxy records each when its thread is done with
    # it, which may be after curl moved on to the next: the order is not the requests')
    assert sorted(rules) == ["address:loopback", "unlisted"]
