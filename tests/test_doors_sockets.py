"""Issue 25, doors 1 and 2: control sockets and host Unix sockets, played as the hostile cell.

A pathname Unix socket is a file: no network namespace covers it, a read-only mount does not stop
connect(2), Landlock has no right for it. Each attack test below makes a real host listener (in a
directory of its own under /var/lib, /srv or /run, removed after), runs a real cell that tries to
connect, and fails when the cell reached it (the listener's side is asked too). The control-socket
tests start a real `agnsup serve` and let a cell talk to it. docs/isolation.md "Doors: control sockets
and host Unix sockets" says what closes each door.
"""
import json
import os
import shutil
import socket
import subprocess
import tempfile

import pytest

from conftest import REPO, Agnsup, refusals, run_door_gates
from scenario import stop_server, wait_for
from test_confinement import last_receipt

from agnsup import compiler, policy as policymod
from agnsup.selftest.doors_sockets import HostListener, P_ASK, P_CONNECT
from agnsup.doors.serve import Client

ESCAPED = 77
NOBODY = 65534

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="ENV_BLOCKED: root (the tests make listeners under "
                                                          "/run, /var/lib and /srv)")

# argv: socket paths. Exit 77 when any connect() worked (and says which), 0 when every one was refused.
# argv: go-file, socket paths: says "started" on stdout, waits for go, then tries P_CONNECT's connects.
P_LATE = r'''
import os, sys, time
go, paths = sys.argv[1], sys.argv[2:]
print("started", flush=True)
deadline = time.monotonic() + 60
while not os.path.exists(go):
    if time.monotonic() > deadline:
        sys.exit(3)
    time.sleep(0.05)
sys.argv[1:] = paths
''' + P_CONNECT

# argv: mcp's address (unix:PATH or HOST:PORT), then a bearer token to offer (optional). GET /mcp: exit 0 when
# mcp answered 403 naming an agnsup cell, 77 otherwise (tests/test_doors_tcppeer.py asks mcp on loopback TCP)
P_MCP_GET = r'''
import socket, sys
where = sys.argv[1]
if where.startswith("unix:"):
    s = socket.socket(socket.AF_UNIX)
    s.connect(where[len("unix:"):])
else:
    host, port = where.rsplit(":", 1)
    s = socket.create_connection((host, int(port)))
token = b"Authorization: Bearer " + sys.argv[2].encode() + b"\r\n" if len(sys.argv) > 2 else b""
try:
    s.sendall(b"GET /mcp HTTP/1.1\r\nHost: localhost\r\n" + token + b"\r\n")
except OSError as e:  # mcp answers a cell at accept and closes: a late write fails, its answer is still there
    print("send:", e.strerror)
head = s.recv(4096).decode()
print(head)
sys.exit(0 if head.startswith("HTTP/1.1 403") and "agnsup cell" in head else 77)
'''

# A Unix server and client inside one cell: in its /tmp and in its worktree. argv: worktree.
P_OWN = r'''
import os, socket, sys, threading
# a read-only worktree (the readonly role) takes no new file, socket or not
for path in ["/tmp/own.sock"] + ([os.path.join(sys.argv[1], "own.sock")] if os.access(sys.argv[1], os.W_OK) else []):
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)
    def serve():
        c, _ = srv.accept()
        c.sendall(c.recv(64).upper())
        c.close()
    t = threading.Thread(target=serve)
    t.start()
    cl = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    cl.connect(path)
    cl.sendall(b"ping")
    assert cl.recv(64) == b"PING", path
    t.join()
    srv.close()
    os.unlink(path)
    print("own socket works:", path)
'''


@pytest.fixture
def host_dirs():
    """A directory of the test's own under /var/lib, /srv and /run (0755), removed after."""
    made = {top: tempfile.mkdtemp(prefix="agnsup-test-", dir=top) for top in ("/var/lib", "/srv", "/run")}
    for d in made.values():
        os.chmod(d, 0o755)
    yield made
    for d in made.values():
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def listeners():
    made: list[HostListener] = []

    def make(path: str) -> HostListener:
        made.append(HostListener(path))
        return made[-1]
    yield make
    for lst in made:
        lst.close()


def packaged_role(policy_dir, base: str, name: str, sockets=(), user: int | None = None) -> None:
    """A copy of a packaged role (readonly, executor, networked) under another name, with
    filesystem.unix_sockets and process.user set as asked."""
    from agnsup.selftest.isolation import _set_key
    with open(os.path.join(REPO, "agnsup", "policies", f"{base}.toml")) as f:
        src = f.read().replace(f'name = "{base}"', f'name = "{name}"')
    if sockets:
        src = _set_key(src, "filesystem", "unix_sockets", json.dumps(list(sockets)))
    if user is not None:
        src = _set_key(src, "process", "user", str(user))
    with open(os.path.join(str(policy_dir), f"{name}.toml"), "w") as f:
        f.write(src)


@pytest.fixture(params=["readonly", "executor", "executor-as-nobody"])
def hostile(request, state, worktree, policy_dir):
    """Runs a probe in a cell of the readonly or executor role (as root, or the executor as uid 65534)."""
    base, _, as_user = request.param.partition("-as-")
    packaged_role(policy_dir, base, "hostile", user=NOBODY if as_user else None)
    if as_user:
        os.chmod(os.path.dirname(worktree), 0o755)
        os.chown(worktree, NOBODY, NOBODY)
    a = Agnsup(state, env={"AGNSUP_POLICY_DIR": str(policy_dir)})

    def run(probe: str, *args, role="hostile", **kw):
        return a("run", "--role", role, "--workdir", worktree, "--", "python3", "-c", probe, *args, **kw)
    run.agnsup, run.worktree, run.policy_dir, run.user = a, worktree, policy_dir, as_user or "root"
    run.role_base = base
    return run


def held(cp, *lsts) -> None:
    assert cp.returncode == 0, (f"the cell {'REACHED a host socket' if cp.returncode == ESCAPED else 'failed'} "
                                f"(exit {cp.returncode})\nstdout: {cp.out}\nstderr: {cp.err}")
    for lst in lsts:
        assert lst.accepted == [], f"{lst.path} accepted {lst.accepted}"


# ------------------------------------------------------------------ door 2: host Unix sockets

def test_a_cell_cannot_connect_to_host_sockets_under_var_lib_srv_run_or_in_its_worktree(hostile, host_dirs,
                                                                                            listeners):
    lsts = [listeners(os.path.join(d, "host.sock")) for d in host_dirs.values()]
    # a host process's socket inside the repository the cell works in
    lsts.append(listeners(os.path.join(hostile.worktree, "host-in-repo.sock")))
    cp = hostile(P_CONNECT, *(lst.path for lst in lsts))
    held(cp, *lsts)
    assert sum(line.startswith("refused ") for line in cp.out.splitlines()) == len(lsts)
    # the receipt names what was masked and that /run is the cell's own
    socks = last_receipt(hostile.agnsup.state)["isolation"]["unix_sockets"]
    assert "/run" in socks["run_private"]
    assert {lsts[0].path, lsts[1].path, lsts[3].path} <= set(socks["masked"])


def test_a_socket_made_under_run_after_a_long_running_cell_started_is_out_of_its_reach(hostile, host_dirs,
                                                                                        listeners):
    go = os.path.join(hostile.worktree, "go")
    late_dir = os.path.join(host_dirs["/run"], "late")
    late_sock = os.path.join(late_dir, "late.sock")
    a = hostile.agnsup
    # live: the long-running cell waits for the `go` file the test writes into its worktree
    p = a.popen("run", "--role", "hostile", "--workdir", hostile.worktree, "--changes", "live", "--", "python3", "-c",
                P_LATE, go, late_sock, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert p.stdout.readline() == b"started\n"
        os.mkdir(late_dir, 0o755)  # the directory and the socket are both newer than the cell
        lst = listeners(late_sock)
        open(go, "w").close()
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    cp = subprocess.CompletedProcess(p.args, p.returncode)
    cp.out, cp.err = "started\n" + out.decode(), err.decode()
    held(cp, lst)


def test_the_role_key_shows_exactly_the_listed_sockets(state, worktree, policy_dir, host_dirs, listeners):
    listed_run = listeners(os.path.join(host_dirs["/run"], "listed.sock"))
    other_run = listeners(os.path.join(host_dirs["/run"], "other.sock"))
    listed_lib = listeners(os.path.join(host_dirs["/var/lib"], "listed.sock"))
    other_lib = listeners(os.path.join(host_dirs["/var/lib"], "other.sock"))
    packaged_role(policy_dir, "readonly", "listing", sockets=[listed_run.path, listed_lib.path])
    a = Agnsup(state, env={"AGNSUP_POLICY_DIR": str(policy_dir)})
    for path, lst in ((listed_run.path, listed_run), (listed_lib.path, listed_lib)):
        cp = a("run", "--role", "listing", "--workdir", worktree, "--", "python3", "-c", P_CONNECT, path)
        assert cp.returncode == ESCAPED and f"REACHED {path}" in cp.out, cp.out + cp.err
        wait_for(lambda lst=lst: lst.accepted, 5, "the listener to hear the cell")
        assert lst.accepted == [b"a cell was here\n"]
    cp = a("run", "--role", "listing", "--workdir", worktree, "--", "python3", "-c", P_CONNECT, other_run.path,
           other_lib.path)
    held(cp, other_run, other_lib)


@pytest.mark.parametrize("what", ["missing", "regular file", "under /tmp"])
def test_a_listed_path_that_is_not_a_socket_refuses_the_cell_in_one_line_journaled(state, worktree, policy_dir,
                                                                                   host_dirs, what):
    path = {"missing": os.path.join(host_dirs["/run"], "nope.sock"),
            "regular file": os.path.join(host_dirs["/run"], "file"), "under /tmp": None}[what]
    if what == "regular file":
        open(path, "w").close()
    tmp_listener = None
    if what == "under /tmp":
        path = os.path.join(tempfile.mkdtemp(prefix="agnsup-test-"), "s.sock")
        tmp_listener = HostListener(path)
    try:
        packaged_role(policy_dir, "executor", "badsock", sockets=[path])
        a = Agnsup(state, env={"AGNSUP_POLICY_DIR": str(policy_dir)})
        marker = os.path.join(worktree, "ran")
        cp = a("run", "--role", "badsock", "--cell", "bad", "--workdir", worktree, "--", "touch", marker, check=125)
        assert cp.err.count("\n") == 1 and "filesystem.unix_sockets" in cp.err and path in cp.err, cp.err
        assert not os.path.exists(marker)
        refused = [r for r in refusals(state) if r["cell_id"] == "bad"]
        assert refused and refused[0]["kind"] == "refused" and refused[0]["exit_code"] == 125
        assert "filesystem.unix_sockets" in refused[0]["error"]
    finally:
        if tmp_listener is not None:
            tmp_listener.close()
            shutil.rmtree(os.path.dirname(path), ignore_errors=True)


def test_a_cells_own_sockets_work_in_its_tmp_and_its_worktree(hostile):
    cp = hostile(P_OWN, hostile.worktree)
    assert cp.returncode == 0, cp.out + cp.err
    assert cp.out.count("own socket works") == (1 if hostile.role_base == "readonly" else 2), cp.out


@pytest.mark.parametrize("tool", ["tmux", "ssh-agent", "gpg-agent"])
def test_agents_and_tmux_started_inside_a_cell_work(hostile, tool):
    exe = {"tmux": "tmux", "ssh-agent": "ssh-agent", "gpg-agent": "gpg-connect-agent"}[tool]
    if shutil.which(exe) is None:
        pytest.skip(f"ENV_BLOCKED: {exe} is not installed (scripts/test.sh installs it)")
    line = {
        # a server in the cell's /tmp, a client talking to it, the server ended
        # (SHELL: tmux runs the pane's command with the passwd shell otherwise: nobody's is nologin)
        "tmux": "export SHELL=/bin/sh; tmux new-session -d -s t 'sleep 30' && tmux ls && tmux kill-server",
        # ssh-add -l exits 1 for "no identities" (it reached the agent), 2 when it could not
        "ssh-agent": 'eval "$(ssh-agent -s)" >/dev/null; ssh-add -l; rc=$?; ssh-agent -k >/dev/null; '
                     '[ $rc -eq 1 ] && echo agent-answered',
        "gpg-agent": "export GNUPGHOME=$HOME/.gnupg; mkdir -m 700 -p $GNUPGHOME; "
                     "gpg-connect-agent 'getinfo version' /bye && gpgconf --kill gpg-agent",
    }[tool]
    cp = hostile.agnsup("run", "--role", "hostile", "--workdir", hostile.worktree, "--", "sh", "-c", line)
    assert cp.returncode == 0, cp.out + cp.err
    assert {"tmux": "t: 1 windows", "ssh-agent": "agent-answered", "gpg-agent": "OK"}[tool] in cp.out, cp.out


def test_dns_the_resolv_conf_target_under_run_comes_back_for_host_network_roles(monkeypatch, tmp_path, host_dirs,
                                                                             worktree):
    """This host's /etc/resolv.conf is a plain file; systemd-resolved's is a link to
    /run/systemd/resolve/stub-resolv.conf (run on the systemd guest lane). Here a link of the
    test's points into /run: the plan brings its target back into the cell's empty /run, and a real
    networked cell reads it there; a deny role's plan does not (its own file is bound instead)."""
    from agnsup import spec as specmod
    from agnsup.linux import host
    from agnsup.request import CellRequest
    from agnsup.tool import run_process
    stub_dir = os.path.join(host_dirs["/run"], "resolve")
    os.mkdir(stub_dir, 0o755)
    stub = os.path.join(stub_dir, "stub-resolv.conf")
    with open(stub, "w") as f:
        f.write("nameserver 127.0.0.53\n# agnsup test stub\n")
    link = tmp_path / "resolv.conf"
    link.symlink_to(stub)
    monkeypatch.setattr(compiler, "RESOLV_CONF", str(link))
    state = str(tmp_path / "state")
    for role, shown in (("networked", True), ("readonly", False)):
        pol = policymod.load(role, state)
        sp = specmod.build(CellRequest.make(["true"], workdir=worktree, role=role), pol)
        plan = compiler.compile_plan(sp, pol, state, host.protections(), ())
        assert (stub in plan.run_shown) is shown
        hide = next(op for op in plan.mount_ops if op[0] == "empty" and op[1] == "/run")
        assert ((stub, False) in hide[4]) is shown
        assert (("attach", stub, "run0") in plan.mount_ops) is shown
    res = run_process(["cat", stub], role="networked", workdir=worktree, state_dir=state, capture=True)
    try:
        assert res["exit_code"] == 0 and "agnsup test stub" in res["stdout"], res
    finally:
        from conftest import _cleanup_cgroups
        _cleanup_cgroups(state)


# ------------------------------------------------------------------ door 1: control sockets

class Serve:
    """`agnsup serve` on a state root (and socket) of the test's choice."""

    def __init__(self, agnsup: Agnsup, *args: str):
        self.p = agnsup.popen("serve", *args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        line = self.p.stdout.readline()
        assert line, self.p.stderr.read().decode()
        self.ready = json.loads(line)

    def close(self) -> None:
        try:
            with Client(self.ready["socket"]) as c:
                c.call("shutdown")
        except Exception:  # noqa: BLE001 - it may be gone already; terminate below
            pass
        try:
            self.p.wait(20)
        except subprocess.TimeoutExpired:
            self.p.terminate()
            self.p.wait(10)
        self.p.stdout.close()
        self.p.stderr.close()


def test_serve_refuses_a_cell_that_reaches_its_socket_and_journals_the_peer(state, worktree, policy_dir,
                                                                           host_dirs):
    """The role lists serve's socket on purpose, so that only the peer check stands."""
    sock = os.path.join(host_dirs["/run"], "serve.sock")
    a = Agnsup(state, env={"AGNSUP_POLICY_DIR": str(policy_dir)})
    s = Serve(a, "--socket", sock)
    try:
        os.chmod(sock, 0o666)  # past DAC too (a root controller's cell is an unprivileged uid): only the peer check
        packaged_role(policy_dir, "readonly", "reacher", sockets=[sock])
        escape = tempfile.mkdtemp(prefix="agnsup-test-escape-", dir="/var/tmp")  # where the attack would write
        host_dirs["escape"] = escape  # removed with the others
        ask = json.dumps({"op": "run", "argv": ["touch", os.path.join(escape, "owned")], "role": "networked",
                          "workdir": escape, "host_env": {"PATH": "/usr/bin:/bin"}})
        cp = a("run", "--role", "reacher", "--cell", "attacker", "--workdir", worktree, "--", "python3", "-c", P_ASK,
               sock, ask)
        assert cp.returncode == 0, f"the cell's request was served\n{cp.out}{cp.err}"
        answer = json.loads(cp.out.split("ANSWER ", 1)[1])
        assert answer["ok"] is False and answer["exit_code"] == 126 and answer["error_type"] == "Denied"
        assert "agnsup cell" in answer["error"] and "\n" not in answer["error"]
        assert not os.listdir(escape)
        refused = [r for r in refusals(state) if r.get("entry") == "serve"]
        assert len(refused) == 1 and refused[0]["peer"]["pid"] > 0
        assert any(e.startswith("cgroup ") for e in refused[0]["peer"]["evidence"]) or \
            any("AGNSUP_CELL_TOKEN" in e for e in refused[0]["peer"]["evidence"]), refused[0]
        # a cell that writes its request only after serve answered still writes it and reads its refusal
        late = _strict(P_ASK.replace("try:\n    s.sendall", "import time; time.sleep(0.5)\ntry:\n    s.sendall", 1))
        cp = a("run", "--role", "reacher", "--cell", "late", "--workdir", worktree, "--", "python3", "-c", late,
               sock, ask)
        assert cp.returncode == 0 and '"exit_code": 126' in cp.out, cp.out + cp.err
        with Client(sock) as c:  # the server's own uid, not a cell: a trusted caller
            assert c.call("ping")["pid"] == s.ready["pid"]
    finally:
        s.close()


def _strict(client: str) -> str:
    """A refused client that fails when its request cannot be written (the refusal's answer lost to EPIPE)."""
    assert 'print("send:", e.strerror)' in client
    return client.replace('print("send:", e.strerror)', 'sys.exit("send: " + e.strerror)')


def test_a_serve_started_after_a_long_running_cell_in_a_new_state_root_refuses_it(hostile):
    """The reviewer's attack: masks are computed at cell start, so a state root made later is visible
    to a cell that was already running; the peer check refuses it all the same."""
    top = tempfile.mkdtemp(prefix="agnsup-test-late-", dir="/var/tmp")
    os.chmod(top, 0o755)
    late_state = os.path.join(top, "state")
    sock = os.path.join(late_state, "agnsup.sock")
    go = os.path.join(hostile.worktree, "go")
    probe = P_LATE.replace("sys.argv[1:] = paths\n", "sys.argv[1:] = [paths[0], '{\"op\": \"ping\"}']\n") \
        .replace(P_CONNECT, P_ASK)
    p = hostile.agnsup.popen("run", "--role", "hostile", "--workdir", hostile.worktree, "--changes", "live", "--",
                             "python3", "-c", probe, go, sock, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    s = None
    try:
        assert p.stdout.readline() == b"started\n"
        s = Serve(Agnsup(late_state), "--socket", sock)
        os.chmod(late_state, 0o755)  # even open to every uid: only the peer check stands
        os.chmod(sock, 0o777)
        open(go, "w").close()
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, f"the cell was served (exit {p.returncode})\n{out.decode()}{err.decode()}"
        assert b'"exit_code": 126' in out, out
        assert [r for r in refusals(late_state) if r.get("entry") == "serve"]
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        if s is not None:
            s.close()
        from conftest import _cleanup_cgroups
        _cleanup_cgroups(late_state)
        shutil.rmtree(top, ignore_errors=True)


@pytest.mark.parametrize("where", ["/var/tmp", "/srv"])
def test_serve_and_mcp_refuse_a_socket_where_a_cell_could_reach_it(agnsup, host_dirs, where):
    d = tempfile.mkdtemp(prefix="agnsup-test-", dir=where)
    try:
        sock = os.path.join(d, "ctl.sock")
        cp = agnsup("serve", "--socket", sock, check=125, timeout=30)
        assert cp.err.count("\n") == 1 and "inside the state root" in cp.err and "/run" in cp.err, cp.err
        cp = agnsup("mcp", "--http", f"unix:{sock}", check=125, timeout=30)
        assert cp.err.count("\n") == 1 and "inside the state root" in cp.err, cp.err
        assert os.listdir(d) == []
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_mcp_over_a_unix_socket_refuses_a_cell_peer(state, worktree, policy_dir, host_dirs):
    pytest.importorskip("mcp", reason="ENV_BLOCKED: the mcp extra")
    sock = os.path.join(host_dirs["/run"], "mcp.sock")
    a = Agnsup(state, env={"AGNSUP_POLICY_DIR": str(policy_dir)})
    p = a.popen("mcp", "--workdir", worktree, "--run-id", "m", "--http", f"unix:{sock}", stdout=subprocess.PIPE,
                stderr=subprocess.PIPE)
    try:
        assert json.loads(p.stdout.readline())["socket"] == sock
        os.chmod(sock, 0o666)  # past DAC too (a root controller's cell is an unprivileged uid): only the peer check
        packaged_role(policy_dir, "readonly", "reacher", sockets=[sock])
        cp = a("run", "--role", "reacher", "--workdir", worktree, "--", "python3", "-c", P_MCP_GET, f"unix:{sock}")
        assert cp.returncode == 0, cp.out + cp.err
        # a client that writes its request only after mcp answered still writes it and reads the 403 (CI saw one
        # whose write came late fail with EPIPE before it read the answer): serve.refuse drains before it closes
        late = _strict(P_MCP_GET.replace("token = b", "import time; time.sleep(0.5)\ntoken = b", 1))
        cp = a("run", "--role", "reacher", "--workdir", worktree, "--", "python3", "-c", late, f"unix:{sock}")
        assert cp.returncode == 0, cp.out + cp.err
        assert [r for r in refusals(state) if r.get("entry") == "mcp"]
        # a trusted caller still gets HTTP from uvicorn
        c = socket.socket(socket.AF_UNIX)
        c.connect(sock)
        c.sendall(b"GET /nothing HTTP/1.1\r\nHost: localhost\r\n\r\n")
        assert c.recv(4096).startswith(b"HTTP/1.1 404")
        c.close()
    finally:
        stop_server(p)
        p.stdout.close()
        p.stderr.close()


@pytest.mark.parametrize("workdir", ["/etc", "/opt", "/", "/root"])
def test_a_request_for_a_system_worktree_is_refused_from_the_cli_and_through_serve(agnsup, state, tmp_path,
                                                                                   workdir):
    cp = agnsup("run", "--role", "networked", "--cell", "sys1", "--workdir", workdir, "--", "true", check=125)
    assert cp.err.count("\n") == 1 and f"worktree {workdir} " in cp.err, cp.err
    s = Serve(agnsup)
    try:
        with Client(s.ready["socket"]) as c:
            c.file.write(json.dumps({"op": "spawn", "argv": ["true"], "role": "networked", "workdir": workdir,
                                     "cell_id": "sys2"}).encode() + b"\n")
            c.file.flush()
            resp = json.loads(c.file.readline())
        assert resp["ok"] is False and resp["exit_code"] == 125 and f"worktree {workdir} " in resp["error"]
    finally:
        s.close()
    refused = {r["cell_id"]: r for r in refusals(state)}
    assert {"sys1", "sys2"} <= set(refused) and refused["sys2"]["entry"] == "serve"
    assert agnsup.json("ps", "--all", "--json") == []


def test_a_read_only_worktree_may_be_a_system_directory_but_never_the_root(agnsup):
    assert agnsup("run", "--role", "readonly", "--workdir", "/etc", "--", "true").returncode == 0
    cp = agnsup("run", "--role", "readonly", "--workdir", "/", "--", "true", check=125)
    assert "root of the file system" in cp.err


def test_worktree_refusal_names_homes_home_roots_and_state_roots(tmp_path):
    state = str(tmp_path / "state")
    assert compiler.worktree_refusal("/home", state) is not None
    assert compiler.worktree_refusal("/var/lib", state) is not None
    assert compiler.worktree_refusal("/etc/nginx", state) == "lies inside the system directory /etc"
    assert "state root" in compiler.worktree_refusal(os.path.join(state, "x"), state)
    other = str(tmp_path / "other-state")
    assert "state root" in compiler.worktree_refusal(os.path.join(other, "cells"), state, (other,))
    assert compiler.worktree_refusal(str(tmp_path), state) is None  # holds it: masked inside
    assert compiler.worktree_refusal(str(tmp_path / "project"), state) is None
    assert compiler.worktree_refusal("/srv/app", state) is None


# ------------------------------------------------------------------ the peer check, on real processes

def _peer_of(argv_prefix: list[str], env: dict):
    from agnsup.linux import peer as peermod
    d = tempfile.mkdtemp(prefix="agnsup-test-peer-")
    os.chmod(d, 0o755)
    path = os.path.join(d, "s")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    os.chmod(path, 0o777)
    srv.listen(1)
    client = subprocess.Popen([*argv_prefix, "/usr/bin/python3", "-c",
                               "import socket, sys, time; s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); "
                               "time.sleep(10)", path], env=env)
    try:
        srv.settimeout(20)
        conn, _ = srv.accept()
        p = peermod.check(conn)
        assert p.pid == client.pid
        conn.close()
        return p
    finally:
        client.kill()
        client.wait()
        srv.close()
        shutil.rmtree(d)


def test_the_peer_check_trusts_the_servers_own_uid_and_refuses_token_and_foreign_uids():
    plain = {"PATH": "/usr/bin:/bin"}
    assert _peer_of([], plain).evidence == []
    tok = _peer_of([], {**plain, "AGNSUP_CELL_TOKEN": "0" * 32}).evidence
    assert tok == ["AGNSUP_CELL_TOKEN in its environment"]
    other = _peer_of(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"], plain).evidence
    assert other == [f"uid {NOBODY} is neither this server's (0) nor root"]


def test_mcp_and_sandboxd_take_no_host_side_option_from_their_clients():
    from agnsup.doors.mcp.tools import check_arguments
    from agnsup.errors import UsageError
    for key, value in (("receipt_file", "/etc/cron.d/x"), ("host_env", {"PATH": "/tmp"})):
        for tool in ("run_process", "spawn"):
            with pytest.raises(UsageError, match=f"unknown argument.*{key}"):
                check_arguments(tool, {"argv": ["true"], key: value})
    # sandboxd: what reaches Supervisor.spawn is its own fixed set (the client gives command, env, cwd)
    from agnsup.doors.sandboxd import process
    with open(process.__file__) as f:
        src = f.read()
    assert "receipt_file" not in src and "host_env" not in src


def test_the_cell_cgroup_pattern_matches_every_backends_cell_and_nothing_else():
    from agnsup.linux import peer as peermod
    cell = peermod._CELL_CGROUP.search
    d = "agnsup-0123456789ab"
    assert cell(f"/{d}/run-R/agent-A/cell-c-1")
    assert cell(f"/system.slice/{d}.scope/{d}/run-R/agent-A/cell-c-1")
    assert cell(f"/agnsup-user-1000/job-1/{d}/run-R/agent-A/cell-c-1")
    assert not cell(f"/system.slice/{d}.scope/ctl-123")
    assert not cell(f"/{d}/run-R/agent-A")
    assert not cell("/user.slice/run-R/agent-A/cell-c-1")


@pytest.mark.parametrize("user", [None, NOBODY], ids=["root", "nobody"])
def test_the_selftest_gates_hold_here(user):
    from agnsup.selftest.doors_sockets import RUNNERS
    results = run_door_gates(RUNNERS, user)
    for name, r in results.items():
        assert r["status"] == "PASS", r
    assert "cgroup " in results["CONTROL_SOCKET"]["evidence"]


# ------------------------------------------------------------------ as a normal user (agnsup not root)

@pytest.fixture(scope="module")
def normal_user():
    """tests/test_unprivileged.py's user: a delegated cgroup2 subtree, agnsup from a venv of the system python."""
    from test_unprivileged import User, _venv
    with User(_venv()) as u:
        yield u


def test_a_normal_users_cells_reach_no_host_socket_nor_its_serve_and_never_get_its_home(normal_user, host_dirs,
                                                                                      listeners):
    u = normal_user
    wt = u.own_dir("proj")
    lsts = [listeners(os.path.join(d, "host.sock")) for d in host_dirs.values()]
    cp = u("run", "--workdir", wt, "--", "python3", "-c", P_CONNECT, *(lst.path for lst in lsts))
    held(cp, *lsts)
    # its own serve, on a socket it may make under /run, reachable on purpose through the role key
    sock = os.path.join(u.own_dir(os.path.join(host_dirs["/run"], "user")), "serve.sock")
    pol = os.path.join(host_dirs["/var/lib"], "policies")  # the user reads it (pytest's tmp_path is root's, 0700)
    os.mkdir(pol, 0o755)
    packaged_role(pol, "executor", "reacher", sockets=[sock])
    env = {**u.env, "AGNSUP_POLICY_DIR": pol}
    server = u.popen("serve", "--socket", sock, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        line = server.stdout.readline()
        assert line, server.stderr.read().decode()
        cp = u("run", "--role", "reacher", "--workdir", wt, "--", "python3", "-c", P_ASK, sock, '{"op": "ping"}',
               env=env)
        assert cp.returncode == 0, f"the cell was served (exit {cp.returncode})\n{cp.stdout}{cp.stderr}"
        answer = json.loads(cp.stdout.split("ANSWER ", 1)[1])
        assert answer["exit_code"] == 126 and "agnsup cell" in answer["error"], answer
    finally:
        server.terminate()
        server.wait(30)
        server.stdout.close()
        server.stderr.close()
    # the reviewer's rootless variant: the whole home as the writable worktree
    cp = u("run", "--workdir", u.home, "--", "true")
    assert cp.returncode == 125 and f"worktree {u.home} is the system or home directory" in cp.stderr, cp.stderr
