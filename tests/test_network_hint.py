"""The network hint follows a failure only when the cell tried to reach beyond its network (issue 28 item 2),
and the proxy's refusals are said where the user looks (item 3).

No-network roles (executor: network.mode = "deny"): the controller holds the cell's network namespace and,
when the cell failed, reads the kernel's own counters there (Ip/Ip6 OutNoRoutes: a packet that had no
route out of a namespace with only lo up). Nothing leaves this machine: a connect() to a public address
fails inside the cell, and a DNS lookup asks a server the cell cannot reach. Allowlist roles: a local test
server the proxy refuses (its address is the host's loopback) and a name the role does not list.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess

import pytest

from conftest import Agnsup, write_role

HINT = "agnsup: the cell ran without network"
CONNECT4 = "import socket; socket.create_connection(('1.1.1.1', 80), timeout=5)"
CONNECT6 = "import socket; socket.create_connection(('2606:4700:4700::1111', 80), timeout=5)"
LOOKUP = "import socket; socket.getaddrinfo('pypi.org', 443)"


def _receipt(agnsup, cell):
    [r] = agnsup.json("receipts", "--cell", cell, "--json")
    return r


def _last(err: str) -> str:
    lines = err.strip().splitlines()
    return lines[-1] if lines else ""


@pytest.mark.parametrize("argv", [["false"], ["python3", "-c", "import sys; print('1 failed'); sys.exit(1)"],
                                  ["sh", "-c", "echo local > f; exit 3"]], ids=["false", "python", "sh"])
def test_a_failure_that_never_reached_out_gets_no_hint(agnsup, worktree, argv):
    cp = agnsup("run", "--cell", "c", "--workdir", worktree, "--", *argv)
    assert cp.returncode != 0
    assert HINT not in cp.err, cp.err
    net = _receipt(agnsup, "c")["kernel_record"]["network"]
    # read, and zero: the kernel's own count, not a guess from the exit code
    assert (net["mode"], net["observable"], net["no_route"]) == ("deny", True, 0), net


@pytest.mark.parametrize("code,counter", [(CONNECT4, "ipv4_no_route"), (CONNECT6, "ipv6_no_route"),
                                          (LOOKUP, "ipv4_no_route")], ids=["ipv4", "ipv6", "dns"])
def test_a_failure_that_tried_to_reach_out_gets_the_hint(agnsup, worktree, code, counter):
    """A connection to a public address (IPv4, IPv6) or a lookup of a public name: the process fails at once,
    and the hint says which role would allow it; the receipt keeps the kernel's count."""
    cp = agnsup("run", "--cell", "c", "--workdir", worktree, "--", "python3", "-c", code)
    assert cp.returncode == 1
    last = _last(cp.err)
    assert last.startswith(HINT + ": role executor has network.mode = \"deny\"") and "--role networked" in last
    assert "had no route out" in last
    r = _receipt(agnsup, "c")
    net = r["kernel_record"]["network"]
    assert net["observable"] and net[counter] >= 1 and net["no_route"] >= 1, net
    assert any(s["class"] == "network" and s["count"] == net["no_route"] for s in r["kernel_stopped"])


def test_curl_to_a_public_address_gets_the_hint(agnsup, worktree):
    if not os.path.exists("/usr/bin/curl"):
        pytest.skip("ENV_BLOCKED: /usr/bin/curl")
    cp = agnsup("run", "--workdir", worktree, "--", "curl", "-sS", "-m", "5", "http://1.1.1.1/")
    assert cp.returncode == 7 and _last(cp.err).startswith(HINT) and "1 connection(s)" in _last(cp.err), cp.err


def test_in_a_pid_namespace_too(worktree, policy_dir, state):
    """A PID-namespace cell's leader is its init: the namespace is held the same way, before the barrier."""
    write_role(policy_dir, "pidns", isolation__pid_namespace="true")
    a = Agnsup(state, env={"AGNSUP_POLICY_DIR": str(policy_dir)})
    quiet = a("run", "--role", "pidns", "--cell", "q", "--workdir", worktree, "--", "false")
    tried = a("run", "--role", "pidns", "--cell", "t", "--workdir", worktree, "--", "python3", "-c", CONNECT4)
    assert quiet.returncode == 1 and HINT not in quiet.err
    assert tried.returncode == 1 and _last(tried.err).startswith(HINT), tried.err
    assert _receipt(a, "t")["isolation"]["pid_namespace"] is True
    assert _receipt(a, "t")["kernel_record"]["network"]["no_route"] >= 1


def test_as_a_normal_user_the_helper_enters_the_cells_user_namespace(user):
    """A normal user's cell netns is owned by the cell's user namespace: a throwaway helper enters it to read."""
    wt = user.own_dir("hint-wt")
    quiet = user("run", "--cell", "uq", "--workdir", wt, "--", "false")
    tried = user("run", "--cell", "ut", "--workdir", wt, "--", "python3", "-c", CONNECT4)
    assert quiet.returncode == 1 and HINT not in quiet.err, quiet.err
    assert tried.returncode == 1 and _last(tried.err).startswith(HINT), tried.err
    [r] = user.json("receipts", "--cell", "ut", "--json")
    assert r["isolation"]["user_namespace"] and r["kernel_record"]["network"]["no_route"] >= 1, r["kernel_record"]
    [r] = user.json("receipts", "--cell", "uq", "--json")
    assert r["kernel_record"]["network"]["observable"] and r["kernel_record"]["network"]["no_route"] == 0
    assert user.left() == []


def test_a_dns_lookup_fails_at_once_as_not_found_and_is_counted(agnsup, worktree):
    """The offline resolver asks a server no cell can reach (the kernel counts the query), then files again:
    "not found" (EAI_NONAME), never "try again", and /etc/hosts still answers."""
    code = ("import socket\n"
            "try:\n    socket.getaddrinfo('pypi.org', 443)\nexcept socket.gaierror as e:\n"
            "    print('noname' if e.errno == socket.EAI_NONAME else e)\n"
            "print(socket.getaddrinfo('localhost', 80)[0][4][0])\n")
    cp = agnsup("run", "--cell", "c", "--workdir", worktree, "--", "sh", "-c",
                "python3 -c \"$0\"; grep '^nameserver' /etc/resolv.conf; grep '^hosts:' /etc/nsswitch.conf; "
                "exit 9", code)
    assert cp.returncode == 9
    assert cp.out.splitlines() == ["noname", "127.0.0.1", "nameserver 192.0.2.1", "hosts: files dns files"]
    assert _receipt(agnsup, "c")["kernel_record"]["network"]["ipv4_no_route"] >= 1
    assert _last(cp.err).startswith(HINT)


def test_a_success_reads_nothing_and_says_nothing(agnsup, worktree):
    cp = agnsup("run", "--cell", "c", "--workdir", worktree, "--", "python3", "-c",
                "import socket\ntry: socket.create_connection(('1.1.1.1', 80), timeout=5)\nexcept OSError: pass")
    assert cp.returncode == 0 and HINT not in cp.err
    net = _receipt(agnsup, "c")["kernel_record"]["network"]
    assert net["observable"] is False and "read only when the cell fails" in net["why"], net


def test_the_api_and_a_rebuilt_result_carry_the_hint_only_when_it_applies(state, worktree):
    """run_process (the Python API, serve and MCP build results in tool.ended) and a result built later from
    the receipt (Supervisor.wait of a cell another process ran) agree."""
    from agnsup.supervisor import journal_result
    from agnsup.store.state import StateRoot
    from agnsup.tool import run_process
    quiet = run_process(["python3", "-c", "raise SystemExit(2)"], state_dir=state, workdir=worktree, cell_id="q")
    tried = run_process(["python3", "-c", CONNECT4], state_dir=state, workdir=worktree, cell_id="t")
    assert quiet["exit_code"] == 2 and "network_hint" not in quiet
    assert tried["exit_code"] == 1 and tried["network_hint"].startswith(HINT)
    root = StateRoot(state)
    j = root.journal()
    try:
        assert "network_hint" not in journal_result(root, j, "default", "q")
        assert journal_result(root, j, "default", "t")["network_hint"] == tried["network_hint"]
    finally:
        j.close()


def test_mcp_results_carry_the_hint_only_when_the_cell_tried(state, worktree):
    """No hint after a failing test run, in the structured result a model reads; the hint after a
    connection that had no route."""
    anyio = pytest.importorskip("anyio")
    pytest.importorskip("mcp")
    from test_mcp import session, value

    async def main():
        async with session(state, worktree, "--run-id", "h1") as s:
            v = value(await s.call_tool("run_process", {"argv": ["sh", "-c", "echo '1 failed'; exit 1"]}))
            assert v["exit_code"] == 1 and "network_hint" not in v, v
            v = value(await s.call_tool("run_process", {"argv": ["python3", "-c", CONNECT4]}))
            assert v["exit_code"] == 1 and v["network_hint"].startswith(HINT), v
            assert "network_refused" not in v
    anyio.run(main)


# -- the proxy's refusals ---------------------------------------------------------------------------------

@pytest.fixture
def proxied(state, worktree, policy_dir):
    """Allowlist roles and a local server: `pkg.test` names the host's loopback (the proxy's test name map),
    which `strict` may not reach (no allow_private); `private` may. The server accepts and answers nothing:
    the refusals are decided before any connection to it."""
    write_role(policy_dir, "strict", network__mode='"allowlist"', network__allow='["pkg.test:*"]')
    write_role(policy_dir, "private", network__mode='"allowlist"', network__allow='["pkg.test:*"]',
               network__allow_private="true")
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    hosts = json.dumps({"pkg.test": "127.0.0.1", "other.test": "127.0.0.1"})
    a = Agnsup(state, env={"AGNSUP_POLICY_DIR": str(policy_dir), "AGNSUP_TEST_EGRESS_HOSTS": hosts})
    a.port, a.worktree = srv.getsockname()[1], worktree
    yield a
    srv.close()


def test_a_refused_connection_is_one_stderr_line_and_a_result_field(proxied):
    p = proxied.port
    cp = proxied("run", "--role", "strict", "--cell", "r", "--workdir", proxied.worktree, "--", "sh", "-c",
                 f"curl -sS -m 10 http://pkg.test:{p}/; curl -sS -m 10 http://other.test:{p}/; exit 22")
    assert cp.returncode == 22
    last = _last(cp.err)
    assert last == (f"agnsup: cell r: the proxy refused pkg.test:{p} (address:loopback): network.allow_private = "
                    f"true allows it; other.test:{p} (unlisted): network.allow += [\"other.test:{p}\"] allows it"), \
        cp.err
    assert HINT not in cp.err  # an allowlist cell has network: the refusals say what is missing
    from agnsup.tool import run_process
    env = {"AGNSUP_POLICY_DIR": proxied.env["AGNSUP_POLICY_DIR"],
           "AGNSUP_TEST_EGRESS_HOSTS": proxied.env["AGNSUP_TEST_EGRESS_HOSTS"]}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the controller's own environment: here, this process's
    try:
        res = run_process(["curl", "-fsS", "-m", "10", f"http://pkg.test:{p}/"], state_dir=proxied.state,
                          role="strict", workdir=proxied.worktree, cell_id="api", capture=True)
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    assert res["exit_code"] == 22 and "403" in res["stderr"]
    assert res["network_refused"] == [{"host": "pkg.test", "port": p, "rule": "address:loopback",
                                       "allow_key": "network.allow_private = true"}]


    # nothing refused (the same destination, allowed): no line, no field
    cp = proxied("run", "--role", "private", "--cell", "ok", "--workdir", proxied.worktree, "--", "sh", "-c",
                 f"curl -sS -m 3 http://pkg.test:{p}/; exit 5")
    assert cp.returncode == 5
    assert "the proxy refused" not in cp.err and HINT not in cp.err, cp.err
    r = _receipt(proxied, "ok")
    assert r["network"]["refused"] == 0 and r["network"]["attempts"] >= 1


def test_docker_recipe_root_without_net_admin_or_sys_ptrace(agnsup, worktree):
    """Docker's recipe: root with CAP_SYS_ADMIN but neither CAP_NET_ADMIN (the cell's namespace is made by a
    helper, owned by a user namespace of its own: process.namespaces.cell_netns) nor CAP_SYS_PTRACE (a
    mapped cell's leader has other ids before its barrier: the controller could not open its /proc/PID/ns/net;
    the child sends the namespace instead)."""
    if not os.access("/usr/bin/setpriv", os.X_OK):
        pytest.skip("ENV_BLOCKED: /usr/bin/setpriv (util-linux)")
    import subprocess
    from conftest import BIN
    drop = ("setpriv", "--bounding-set", "-net_admin,-sys_ptrace", "--inh-caps", "-net_admin,-sys_ptrace")

    def run(cell, *argv):
        cp = subprocess.run([*drop, BIN, "run", "--cell", cell, "--workdir", worktree, "--", *argv], env=agnsup.env,
                            capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
        return cp
    quiet, tried = run("q", "false"), run("t", "python3", "-c", CONNECT4)
    assert quiet.returncode == 1 and HINT not in quiet.stderr, quiet.stderr
    assert tried.returncode == 1 and _last(tried.stderr).startswith(HINT), tried.stderr
    r = _receipt(agnsup, "t")
    assert r["isolation"]["mapped_uid"] and r["kernel_record"]["network"]["no_route"] >= 1, r["kernel_record"]
    assert _receipt(agnsup, "q")["kernel_record"]["network"]["no_route"] == 0


def test_a_loopback_role_talks_to_itself_without_a_hint_and_gets_one_when_it_reaches_out(worktree, policy_dir,
                                                                                          state):
    """network.mode = "loopback": a server and a client on the cell's own lo are no try to leave it."""
    write_role(policy_dir, "lo", network__mode='"loopback"')
    a = Agnsup(state, env={"AGNSUP_POLICY_DIR": str(policy_dir)})
    local = ("import socket, sys\ns = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()\n"
             "c = socket.create_connection(s.getsockname()); c.close()\n"
             "try: socket.create_connection(('127.0.0.1', 9), timeout=5)\nexcept ConnectionRefusedError: pass\n"
             "sys.exit(4)\n")
    quiet = a("run", "--role", "lo", "--cell", "q", "--workdir", worktree, "--", "python3", "-c", local)
    tried = a("run", "--role", "lo", "--cell", "t", "--workdir", worktree, "--", "python3", "-c", CONNECT4)
    assert quiet.returncode == 4 and HINT not in quiet.err, quiet.err
    assert tried.returncode == 1 and _last(tried.err).startswith(HINT + ": role lo has network.mode = \"loopback\"")


def test_in_a_shared_namespace_the_count_is_what_the_cell_added(agnsup, worktree):
    """A pod's cells share one network namespace (the pod's keeper holds it): what a neighbour's tries left in
    its counters before this cell started is not this cell's. A sleeping cell of the agent holds its pod; two
    later cells of the agent each try once: each counts one, not the pod's running total."""
    import signal
    import time
    holder = agnsup.popen("run", "--run", "hintpod", "--agent", "a", "--cell-id", "holder", "--", "sleep", "120",
                          cwd=worktree, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        pod_dir = os.path.join(agnsup.state, "pods", "hintpod", "a")
        deadline = time.monotonic() + 120
        while not os.path.exists(os.path.join(pod_dir, "pod.json")):
            assert holder.poll() is None and time.monotonic() < deadline, "the holder's pod never appeared"
            time.sleep(0.05)
        for cell in ("first", "second"):
            r = agnsup("run", "--run", "hintpod", "--agent", "a", "--cell-id", cell, "--", "python3", "-c", CONNECT4,
                       cwd=worktree)
            assert r.returncode == 1 and HINT in r.err, r.err
            net = _receipt(agnsup, cell)["kernel_record"]["network"]
            assert net["ipv4_no_route"] == 1, (cell, net)  # the first's try (before the second started) is not its
            assert _receipt(agnsup, cell)["isolation"]["network_pod"] == "hintpod/a"
    finally:
        holder.send_signal(signal.SIGINT)  # ours: the CLI hands it to the cell, which ends
        holder.wait(timeout=60)


def test_spawn_follow_through_serve_says_the_hint_as_run_does(agnsup, worktree, tmp_path):
    """`agnsup spawn --follow` (serve's client) ends with the same stderr lines as `agnsup run`: the hint only after
    a try to reach out."""
    from scenario import STARTERS
    s = STARTERS["serve"](agnsup, tmp_path)
    try:
        cp = agnsup("spawn", "--follow", "--cell", "f1", "--workdir", worktree, "--", "false", check=None)
        assert cp.returncode == 1 and HINT not in cp.err, cp.err
        cp = agnsup("spawn", "--follow", "--cell", "f2", "--workdir", worktree, "--", "python3", "-c", CONNECT4,
                    check=None)
        assert cp.returncode == 1 and _last(cp.err).startswith(HINT), cp.err
    finally:
        s.close()



def test_a_supervisors_pod_cells_count_what_each_added(state, worktree):
    """The same through a Supervisor (its leaders are born in its fork server): two cells of an agent whose pod a
    sleeping cell holds each try once and count one, not the pod's running total."""
    from agnsup.supervisor import Supervisor
    with Supervisor(state) as sup:
        holder = sup.spawn(["sleep", "120"], run_id="hintsup", agent_id="a", cell_id="holder", workdir=worktree)
        try:
            for cell in ("first", "second"):
                r = sup.run(["python3", "-c", CONNECT4], run_id="hintsup", agent_id="a", cell_id=cell,
                            workdir=worktree)
                assert r["exit_code"] == 1 and r["network_hint"].startswith(HINT), r
                with open(os.path.join(state, "cells", "hintsup", cell, "receipt.json")) as f:
                    receipt = json.load(f)
                assert receipt["isolation"]["network_pod"] == "hintsup/a"
                net = receipt["kernel_record"]["network"]
                assert net["ipv4_no_route"] == 1, (cell, net)  # the first's try (before the second started) is not its
        finally:
            sup.cancel(cell_id=holder["cell_id"], run_id="hintsup")
            sup.wait("hintsup", holder["cell_id"], timeout=30)
