"""Network pods (issue 28, "Servers beside later calls"): the cells of one agent of a named run share one private
network namespace, so a server one cell started is reachable on localhost from the agent's later cells, and
from nobody else: not from another agent's cells, not from the host. The pod goes with the agent's last cell;
one a killed controller left behind goes with the janitor or `agnsup cleanup`. A role with network.pod = false
keeps a namespace per cell."""
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time

import pytest

from agnsup import pod as pods
from agnsup.linux import proc
from agnsup.supervisor import Supervisor
from conftest import write_role

# a server on 127.0.0.1:PORT that says so in its worktree once it listens
SERVER = ("import http.server, sys\n"
          "s = http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), http.server.SimpleHTTPRequestHandler)\n"
          "open('listening', 'w').close()\n"
          "s.serve_forever()\n")
# exit 0 when GET http://localhost:PORT/ answers 200, 7 (curl's "could not connect") when nothing listens
PROBE = ("import sys, urllib.request\n"
         "try:\n"
         "    print(urllib.request.urlopen('http://localhost:%s/' % sys.argv[1], timeout=5).status)\n"
         "except OSError as e:\n"
         "    print(e); sys.exit(7)\n")


def _free_port() -> int:
    """A port nothing on the host listens on (the host's loopback is not the pod's: a clash is harmless)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _wait_file(path: str, server=None, timeout: float = 120.0) -> None:
    """Until the server says it listens (a cold first cell in the emulated v2 guest takes tens of seconds);
    a server that ended first fails at once, with what it said."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if server is not None and server.poll() is not None:
            err = server.stderr.read() if server.stderr else b""
            pytest.fail(f"the server cell ended ({server.returncode}) before listening: {err!r}")
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def _host_reaches(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        return True
    except OSError:
        return False


def _receipt(state: str, run: str, cell: str) -> dict:
    with open(os.path.join(state, "cells", run, cell, "receipt.json")) as f:
        return json.load(f)


def _keeper_ends(keeper: dict, seconds: float) -> bool:
    """Has the keeper (pod.json's identity) ended within `seconds`?"""
    deadline = time.monotonic() + seconds
    while True:
        st = proc.stat(keeper["pid"])
        if st is None or st.starttime != keeper["starttime"] or st.state == "Z":
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def _gone(pod: dict, state: str, run: str, agent: str) -> None:
    """The pod went whole: its keeper, its cgroup place, its directory."""
    keeper = pod["keeper"]
    assert _keeper_ends(keeper, 10), f"the keeper {keeper['pid']} outlived its pod"
    for path in pod["place"].values():
        assert not os.path.exists(path), f"the pod's place {path} is still there"
    assert not os.path.exists(pods.pod_dir(state, run, agent))
    assert pods.find(state, run, agent) is None


def _pod_json(state: str, run: str, agent: str) -> dict:
    with open(os.path.join(pods.pod_dir(state, run, agent), "pod.json")) as f:
        return json.load(f)


@pytest.fixture
def trees(tmp_path):
    """Two worktrees: the server's, where the agent's later cells run too (one agent's cells never block each
    other there, locks.py), and another agent's (a writing server keeps its tree from other agents)."""
    out = []
    for name in ("srv", "cli"):
        d = tmp_path / name
        d.mkdir()
        out.append(str(d))
    return out


def test_a_server_one_cell_started_answers_the_agents_later_cell_and_nobody_else(agnsup, state, trees):
    srv, cli = trees
    port = _free_port()
    server = agnsup.popen("run", "--run", "r", "--agent", "a", "--cell", "server", "--workdir", srv,
                          "--changes", "live", "--",
                          "python3", "-c", SERVER, str(port), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        _wait_file(os.path.join(srv, "listening"), server)
        pod = _pod_json(state, "r", "a")
        later = agnsup("run", "--run", "r", "--agent", "a", "--cell", "later", "--workdir", srv, "--",
                       "python3", "-c", PROBE, str(port))
        assert later.returncode == 0 and "200" in later.out, later.out + later.err
        assert _receipt(state, "r", "later")["isolation"]["network_pod"] == "r/a"
        # the hostile view: another agent of the same run, and the host itself
        other = agnsup("run", "--run", "r", "--agent", "b", "--cell", "other", "--workdir", cli, "--",
                       "python3", "-c", PROBE, str(port))
        assert other.returncode == 7, other.out + other.err
        assert _receipt(state, "r", "other")["isolation"]["network_pod"] == "r/b"
        assert not _host_reaches(port)
        assert pods.find(state, "r", "b") is None  # the other agent's pod went with its only cell
    finally:
        server.send_signal(signal.SIGTERM)
        server.communicate(timeout=30)
    _gone(pod, state, "r", "a")  # the last cell of the agent ended: the pod went with it
    assert _receipt(state, "r", "server")["isolation"]["network_pod"] == "r/a"


def test_the_api_spawns_a_server_and_a_later_call_of_the_agent_reaches_it(state, trees):
    srv, cli = trees
    port = _free_port()
    with Supervisor(state) as sup:
        h = sup.spawn(["python3", "-c", SERVER, str(port)], run_id="api", agent_id="a", workdir=srv,
                      changes="live")
        _wait_file(os.path.join(srv, "listening"))
        pod = _pod_json(state, "api", "a")
        r = sup.run(["python3", "-c", PROBE, str(port)], run_id="api", agent_id="a", workdir=srv)
        assert r["exit_code"] == 0, r
        r = sup.run(["python3", "-c", PROBE, str(port)], run_id="api", agent_id="b", workdir=cli)
        assert r["exit_code"] == 7, r
        assert pods.find(state, "api", "a") is not None  # the server still holds it
        sup.cancel(cell_id=h["cell_id"], run_id="api")
        sup.wait("api", h["cell_id"], timeout=30)
    _gone(pod, state, "api", "a")


def test_a_cell_outside_a_named_run_or_with_network_pod_false_has_a_namespace_of_its_own(agnsup, state, trees,
                                                                                           policy_dir):
    srv, cli = trees
    write_role(policy_dir, "alone", network__pod="false")
    env = {"AGNSUP_POLICY_DIR": str(policy_dir)}
    port = _free_port()
    server = agnsup.popen("run", "--role", "alone", "--run", "r", "--agent", "a", "--cell", "server",
                          "--workdir", srv, "--changes", "live", "--", "python3", "-c", SERVER, str(port), env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_file(os.path.join(srv, "listening"), server)
        later = agnsup("run", "--role", "alone", "--run", "r", "--agent", "a", "--cell", "later", "--workdir", cli,
                       "--", "python3", "-c", PROBE, str(port), env=env)
        assert later.returncode == 7, later.out + later.err
        assert "network_pod" not in _receipt(state, "r", "later")["isolation"]
        assert not os.path.exists(pods.root(state))
    finally:
        server.send_signal(signal.SIGTERM)
        server.communicate(timeout=30)
    agnsup("run", "--cell", "plain", "--workdir", cli, "--", "true", check=0)  # the run "default": no pod
    assert "network_pod" not in _receipt(state, "default", "plain")["isolation"]
    assert not os.path.exists(pods.root(state))


def _pod_of_a_sigkilled_controller(agnsup, state: str, srv: str, run: str) -> dict:
    """A server cell of agent "a" in a pod of run `run`, its controller then SIGKILLed (no leave, no teardown: the
    kernel drops the controller's shared lock); the pod's pod.json."""
    port = _free_port()
    server = agnsup.popen("run", "--run", run, "--agent", "a", "--cell", "server", "--workdir", srv,
                          "--changes", "live", "--",
                          "python3", "-c", SERVER, str(port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _wait_file(os.path.join(srv, "listening"), server)
    pod = _pod_json(state, run, "a")
    server.send_signal(signal.SIGKILL)
    server.wait(timeout=10)
    return pod


@pytest.mark.parametrize("sweeper", ["janitor", "cleanup"])
def test_a_pod_a_sigkilled_controller_left_is_removed_by_the_janitor_and_cleanup(agnsup, state, trees, sweeper):
    pod = _pod_of_a_sigkilled_controller(agnsup, state, trees[0], "k")
    place = list(pod["place"].values())
    assert place and all(os.path.isdir(p) for p in place)
    assert os.path.exists(os.path.join(pods.pod_dir(state, "k", "a"), "pod.json"))  # left behind, until ...
    if sweeper == "janitor":
        agnsup("janitor", check=0)
    else:
        agnsup("cleanup", "--run", "k", check=0)
    _gone(pod, state, "k", "a")


def test_a_keeper_whose_members_all_died_ends_by_itself_without_a_janitor(agnsup, state, trees):
    """A crashed controller (SIGKILL: no leave, no teardown) leaves no process of its pod behind: the keeper finds
    pod.lock free on two probes in a row (process/keeper.py, PROBE s apart) and exits; what stays is files and an
    empty place, the janitor's to sweep. Checked to fail with the keeper's probe taken out: it serves on."""
    from agnsup.process import keeper as keeper_mod
    pod = _pod_of_a_sigkilled_controller(agnsup, state, trees[0], "kd")
    keeper = pod["keeper"]
    assert _keeper_ends(keeper, 6 * keeper_mod.PROBE + 10), f"the keeper {keeper['pid']} outlived every member of its pod"
    assert pods.find(state, "kd", "a") is None  # a dead keeper: no pod to join (the next joiner makes one)
    agnsup("janitor", check=0)  # the files and the emptied place
    _gone(pod, state, "kd", "a")


def test_a_normal_users_cells_of_one_agent_share_a_pod_or_the_skip_says_why(agnsup, state):
    """uid 65534 (tests/test_bad_input.py's way of running agnsup as another user)."""
    import shutil
    import tempfile
    from test_bad_input import _as_nobody, need_another_users_python
    need_another_users_python()
    from agnsup import backend
    own = tempfile.mkdtemp(prefix="agnsup-nobody-")
    port = _free_port()
    st = own + "/state"
    try:
        os.chown(own, 65534, 65534)
        for d in ("srv", "cli"):
            os.mkdir(os.path.join(own, d))
            os.chown(os.path.join(own, d), 65534, 65534)
        code = (f"import site, sys; site.addsitedir({[p for p in sys.path if p.endswith('site-packages')][0]!r}); "
                "from agnsup.doors.entry import main; sys.argv[0] = 'agnsup'; main()")
        server = subprocess.Popen(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "env", "-i",
                                   "PATH=/usr/bin:/bin", "HOME=/nonexistent",
                                   f"AGNSUP_ROOTS_REGISTRY={os.environ['AGNSUP_ROOTS_REGISTRY']}",
                                   "/usr/bin/python3", "-c", code, "--state-dir", st, "run", "--run", "u",
                                   "--agent", "a", "--workdir", own + "/srv", "--timeout", "60", "--changes", "live", "--",
                                   "python3", "-c", SERVER, str(port)],
                                  cwd=own + "/srv", stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            _wait_file(os.path.join(own, "srv", "listening"), server)
            cp = _as_nobody("--state-dir", st, "run", "--run", "u", "--agent", "a", "--cell", "later",
                            "--workdir", own + "/cli", "--", "python3", "-c", PROBE, str(port), cwd=own + "/cli")
            iso = _receipt(st, "u", "later")["isolation"]
            if "network_pod" not in iso:
                pytest.skip("ENV_BLOCKED: network pod for a normal user: its cell's network namespace is owned by "
                            "the user namespace the cell makes for itself (compiler.network_pod); cell "
                            f"{'reached' if cp.returncode == 0 else 'did not reach'} the server")
            assert cp.returncode == 0 and iso["network_pod"] == "u/a", cp.out + cp.err
            assert not _host_reaches(port)
            other = _as_nobody("--state-dir", st, "run", "--run", "u", "--agent", "b", "--workdir", own + "/cli",
                               "--", "python3", "-c", PROBE, str(port), cwd=own + "/cli")
            assert other.returncode == 7, other.out + other.err
        finally:
            server.send_signal(signal.SIGTERM)
            server.communicate(timeout=30)
        assert not os.path.exists(pods.pod_dir(st, "u", "a"))
    finally:
        leaked = backend.choose(st).purge()
        shutil.rmtree(own, ignore_errors=True)
    assert not leaked, leaked


def test_joiners_racing_for_a_pod_that_does_not_exist_make_one_and_all_join_it(state, monkeypatch):
    """Two `agnsup run` (or serve's threads) for the same agent at once: one makes the pod, the others wait
    for it and join it (not the exclusive lock for as long as the first member lives). Every joiner is held
    right after its first (shared) look, so all of them find no pod and go for the exclusive lock together."""
    import fcntl
    import threading
    from agnsup import backend
    b = backend.choose(state)
    got, errors = [], []
    monkeypatch.setattr(pods, "JOIN_TIMEOUT", 3.0)
    together, looked = threading.Barrier(4), set()
    lock = pods._lock

    def held_after_the_first_look(path, mode, deadline, give_up=None):
        fd = lock(path, mode, deadline, give_up)
        if mode == fcntl.LOCK_SH and threading.get_ident() not in looked:
            looked.add(threading.get_ident())
            together.wait(timeout=10)
        return fd
    monkeypatch.setattr(pods, "_lock", held_after_the_first_look)

    def join():
        try:
            t = time.monotonic()
            got.append((pods.join(state, b, "race", "a"), time.monotonic() - t))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
    threads = [threading.Thread(target=join) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert sum(m.created for m, _ in got) == 1
    assert len({m.pod.keeper["pid"] for m, _ in got}) == 1
    assert max(d for _, d in got) < pods.JOIN_TIMEOUT / 2
    pod = pods.find(state, "race", "a").as_dict()
    for m, _ in got:
        pods.leave(state, b, m)
    _gone(pod, state, "race", "a")


def test_a_root_controller_without_cap_net_admin_makes_the_pod_in_a_user_namespace_of_its_own(agnsup, state, trees):
    """A container given CAP_SYS_ADMIN only (process.namespaces.cell_netns; Docker's recipe: no CAP_NET_ADMIN, no
    CAP_SYS_PTRACE): the keeper brings lo up in a network namespace a user namespace of userns.netns_owner()
    owns; the agent's cells join it all the same. Its euid is that owner's then, so a controller without
    CAP_SYS_PTRACE may not open its /proc/PID/ns/*: the keeper hands them out itself (process.keeper.ask)."""
    import shutil
    from conftest import BIN
    from agnsup.linux import userns
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("ENV_BLOCKED: root and setpriv (to drop CAP_NET_ADMIN from the bounding set)")
    srv, cli = trees
    port = _free_port()
    drop = ["setpriv", "--bounding-set=-net_admin,-sys_ptrace", BIN, "run", "--run", "c", "--agent", "a"]
    server = subprocess.Popen([*drop, "--workdir", srv, "--changes", "live", "--", "python3", "-c", SERVER, str(port)],
                              env=agnsup.env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        _wait_file(os.path.join(srv, "listening"), server)
        pod = _pod_json(state, "c", "a")
        with open(f"/proc/{pod['keeper']['pid']}/status") as f:
            uids = next(line for line in f if line.startswith("Uid:")).split()[1:]
        assert uids[1] == str(userns.netns_owner())  # its euid: the owner of the netns's user namespace
        later = subprocess.run([*drop, "--workdir", cli, "--", "python3", "-c", PROBE, str(port)], env=agnsup.env,
                               capture_output=True, text=True, timeout=120)
        assert later.returncode == 0, later.stdout + later.stderr
        assert not _host_reaches(port)
    finally:
        server.send_signal(signal.SIGTERM)
        server.communicate(timeout=30)
    _gone(pod, state, "c", "a")


def test_the_keeper_hands_its_namespaces_to_its_own_uid_only(state):
    """The keeper's socket (process.keeper.ask) is its user's alone (0600), and a process of another uid that
    gets past the file's mode (CAP_DAC_OVERRIDE) gets no descriptor from it (SO_PEERCRED)."""
    import stat
    from agnsup import backend
    from agnsup.linux import sys as lsys
    from agnsup.process import keeper
    if os.geteuid() != 0:
        pytest.skip("ENV_BLOCKED: root (a process of another uid with CAP_DAC_OVERRIDE asks the keeper)")
    b = backend.choose(state)
    m = pods.join(state, b, "peer", "a")
    pod = m.pod.as_dict()
    try:
        path = os.path.join(m.pod.dir, keeper.SOCKET)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and os.stat(path).st_uid == os.getuid()
        net, us = keeper.ask(m.pod.dir, m.pod.keeper["pid"])  # its own uid: the pod's namespaces
        assert os.fstat(net).st_ino == m.pod.netns
        for fd in (net, us):
            if fd is not None:
                os.close(fd)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.close(r)
                os.seteuid(65534)
                lsys.set_caps([lsys.CAP_NAMES.index("DAC_OVERRIDE")])
                try:
                    keeper.ask(m.pod.dir, m.pod.keeper["pid"])
                    os.write(w, b"handed out")
                except ProcessLookupError as e:
                    os.write(w, str(e.strerror).encode())
            finally:
                os._exit(0)
        os.close(w)
        with os.fdopen(r, "rb") as f:
            said = f.read().decode()
        os.waitpid(pid, 0)
        assert "it refused us" in said, said
        assert pods.find(state, "peer", "a") is not None  # the keeper serves on
    finally:
        pods.leave(state, b, m)
    _gone(pod, state, "peer", "a")


def test_a_seccomp_filter_that_refuses_unshare_fails_a_pod_cell_with_the_unshare_steps_line(agnsup, state, trees):
    """The keeper makes the pod's namespaces before the cell makes its own: a host that refuses them gets the
    line a cell of its own gives (process.namespaces.keeper_refusal: the filter and both fixes), not the
    keeper's bare errno, and nothing is left behind."""
    from conftest import BIN, seccomp_launcher
    srv, _ = trees
    cp = subprocess.run([sys.executable, "-c", seccomp_launcher({272: 1}), BIN, "run", "--run", "s", "--agent", "a",
                         "--workdir", srv, "--", "true"], env=agnsup.env, capture_output=True, text=True,
                        timeout=120, stdin=subprocess.DEVNULL)
    assert cp.returncode != 0
    line = cp.stderr.strip().splitlines()[0]
    assert "network_pod" not in line and "keeper" not in line, line
    if os.geteuid() == 0:
        assert line.startswith("agnsup: cell setup failed at step 'unshare': ") and "isolation.reduced" in line, line
    else:
        assert line.startswith("agnsup: cell setup failed at step 'user_namespace': "), line
    assert not os.path.exists(pods.pod_dir(state, "s", "a"))


def test_without_cap_sys_admin_a_pod_cell_names_cap_sys_admin_as_a_cell_of_its_own_does(agnsup, state, trees):
    """A container without CAP_SYS_ADMIN (and CAP_NET_ADMIN: Docker's defaults): the keeper's namespaces are
    refused before the cell's mounts would be; its line names what a cell of its own names (--cap-add
    SYS_ADMIN, the mount namespace among the reduced pieces), not CAP_NET_ADMIN alone."""
    import shutil
    from conftest import BIN
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("ENV_BLOCKED: root and setpriv (to drop CAP_SYS_ADMIN and CAP_NET_ADMIN from the bounding set)")
    srv, _ = trees
    lines = []
    for named in (["--run", "n", "--agent", "a"], []):  # a pod's cell, a cell of its own
        cp = subprocess.run(["setpriv", "--bounding-set=-net_admin,-sys_admin", BIN, "run", *named, "--workdir", srv,
                             "--", "true"], env=agnsup.env, capture_output=True, text=True, timeout=120,
                            stdin=subprocess.DEVNULL)
        assert cp.returncode == 125, cp.stderr
        lines.append(cp.stderr.strip().splitlines()[0])
    pod_line, own_line = lines
    fix = own_line[own_line.index("; fix: "):]
    assert "--cap-add SYS_ADMIN" in fix and '"mount_namespace"' in fix, own_line
    assert pod_line.endswith(fix) and "network_pod" not in pod_line, pod_line
    assert not os.path.exists(pods.pod_dir(state, "n", "a"))


def test_an_agents_sequential_cells_in_one_supervisor_reuse_its_lingering_pod_and_close_lets_go(state, trees,
                                                                                                 monkeypatch):
    """A controller of many cells keeps a pod a moment after its last cell left (pod.Linger): the agent's next cell
    joins it (the same keeper) instead of making one. A long LINGER here, so "within the linger" is no matter of
    timing; the Supervisor's close lets go at once and nothing is left. With LINGER = 0 each cell makes its own."""
    srv, cli = trees
    monkeypatch.setattr(pods, "LINGER", 600.0)
    joined = []
    join = pods.join

    def recorded(*a, **kw):
        m = join(*a, **kw)
        joined.append((m.pod.keeper["pid"], m.pod.keeper["starttime"], m.created))
        return m
    monkeypatch.setattr(pods, "join", recorded)
    with Supervisor(state) as sup:
        r1 = sup.run(["true"], run_id="ling", agent_id="a", workdir=srv)
        assert pods.find(state, "ling", "a") is not None  # it lingers: no member cell, the Supervisor's hold
        assert not pods.cells_held(pods.pod_dir(state, "ling", "a"))
        pod = _pod_json(state, "ling", "a")
        r2 = sup.run(["true"], run_id="ling", agent_id="a", workdir=srv)
        assert r1["exit_code"] == r2["exit_code"] == 0, (r1, r2)
        assert _receipt(state, "ling", r2["cell_id"])["isolation"]["network_pod"] == "ling/a"
        assert [j[:2] for j in joined] == [(pod["keeper"]["pid"], pod["keeper"]["starttime"])] * 2, joined
        assert [j[2] for j in joined] == [True, False]  # one keeper made, for the first cell alone
        monkeypatch.setattr(pods, "LINGER", 0.1)  # the timer's end (not the close's): polled for, not timed
        # another agent: a pod of its own; and nothing of agent a's lingering pod (the hold's descriptor) in it
        r3 = sup.run(["ls", "-l", "/proc/self/fd/"], run_id="ling", agent_id="b", workdir=cli, capture=True)
        assert r3["exit_code"] == 0 and joined[-1][0] != pod["keeper"]["pid"]
        assert r3["stdout"].count(" -> ") >= 3 and "pod.lock" not in r3["stdout"] and "cells.lock" not in r3["stdout"], \
            r3["stdout"]
        deadline = time.monotonic() + 60
        while os.path.exists(pods.pod_dir(state, "ling", "b")):
            assert time.monotonic() < deadline, "agent b's pod outlived its linger"
            time.sleep(0.05)
        assert pods.find(state, "ling", "a") is not None  # agent a's lingers on (600 s when it was kept)
    _gone(pod, state, "ling", "a")
    assert os.listdir(pods.root(state)) == []  # agent b's went too


def test_a_sigkilled_supervisors_lingering_pod_is_removed_by_the_janitor(agnsup, state, trees):
    """The dead-man path of a lingering pod: the controller's death drops its hold (the kernel), and the janitor's
    sweep removes the pod as it removes one a killed `agnsup run` left."""
    srv, _ = trees
    code = ("import sys\n"
            "from agnsup import pod\n"
            "from agnsup.supervisor import Supervisor\n"
            "pod.LINGER = 600.0\n"
            "sup = Supervisor(sys.argv[1])\n"
            "r = sup.run(['true'], run_id='kl', agent_id='a', workdir=sys.argv[2])\n"
            "print(r['exit_code'], flush=True)\n"
            "sys.stdin.read()\n")
    ctl = subprocess.Popen([sys.executable, "-c", code, state, srv], env=agnsup.env, stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        said = ctl.stdout.readline()
        assert said.strip() == "0", said + ctl.stderr.read() if ctl.poll() is not None else said
        pod = _pod_json(state, "kl", "a")
        assert pods.find(state, "kl", "a") is not None  # it lingers, held by the living controller ...
        agnsup("janitor", check=0)
        assert pods.find(state, "kl", "a") is not None  # ... which the janitor leaves alone
    finally:
        ctl.send_signal(signal.SIGKILL)  # no close, no teardown: the kernel drops the controller's hold
        ctl.wait(timeout=10)
        ctl.stdout.close()
        ctl.stderr.close()
        ctl.stdin.close()
    assert os.path.exists(os.path.join(pods.pod_dir(state, "kl", "a"), "pod.json"))  # left behind, until ...
    agnsup("janitor", check=0)
    _gone(pod, state, "kl", "a")


def test_a_cell_joining_a_lingering_pod_asks_its_keeper_once_and_lands_in_the_pods_namespace(state, trees,
                                                                                             monkeypatch):
    """The namespaces the keeper hands out for the join's proof that the pod is alive are the ones the cell joins
    (Pod.alive(keep=True), Pod.ns_fds), and the controller keeps that proof (Linger.remember): its later cells of the
    pod ask the keeper no more while it has not exited (Linger.proven), and land in the pod's recorded network
    namespace. A keeper replaced behind pod.json is no pod (its netns inode differs): the cell gets a new pod, never
    that namespace."""
    from agnsup.process import keeper
    srv, _ = trees
    monkeypatch.setattr(pods, "LINGER", 600.0)
    asked = []
    ask = keeper.ask
    monkeypatch.setattr(keeper, "ask", lambda *a, **kw: asked.append(a) or ask(*a, **kw))
    with Supervisor(state) as sup:
        sup.run(["true"], run_id="once", agent_id="a", workdir=srv)
        pod = _pod_json(state, "once", "a")
        asked.clear()
        r = sup.run(["readlink", "/proc/self/ns/net"], run_id="once", agent_id="a", workdir=srv, capture=True)
        assert r["exit_code"] == 0 and r["stdout"].strip() == f"net:[{pod['netns']}]", r
        assert asked == [], asked  # proven by the first cell's ask (Linger.proven)
        # pod.json names a netns the keeper does not hand out: not alive, so a new pod (another keeper)
        path = os.path.join(pods.pod_dir(state, "once", "a"), "pod.json")
        with open(path, "w") as f:
            json.dump({**pod, "netns": pod["netns"] + 1}, f)
        r = sup.run(["readlink", "/proc/self/ns/net"], run_id="once", agent_id="a", workdir=srv, capture=True)
        # (not "another inode than before": the old keeper is torn down with its pod, and the kernel may give
        # the new namespace the number the old one freed, as it did once in CI's parallel run)
        new = _pod_json(state, "once", "a")
        assert new["keeper"]["pid"] != pod["keeper"]["pid"], (new, pod)
        assert r["exit_code"] == 0 and r["stdout"].strip() == f"net:[{new['netns']}]", r


def test_a_keeper_that_died_between_two_cells_is_no_proof_the_next_cell_gets_a_new_pod(state, trees, monkeypatch):
    """What a controller remembers of a pod's proof (Linger.remember) holds only while the keeper it proved has not
    exited: a keeper SIGKILLed between two cells of its agent (the pod lingering, its hold still the controller's)
    gives the next cell a new pod and keeper, never the dead one's namespace. Checked to fail with Linger.proven's
    look at the keeper's pidfd taken out (the cell then joins the old keeper's namespace, which the remembered
    descriptors kept)."""
    srv, _ = trees
    monkeypatch.setattr(pods, "LINGER", 600.0)
    with Supervisor(state) as sup:
        for _ in range(2):  # the second cell: proven from memory
            r = sup.run(["true"], run_id="kk", agent_id="a", workdir=srv)
            assert r["exit_code"] == 0, r
        pod = _pod_json(state, "kk", "a")
        fd = os.pidfd_open(pod["keeper"]["pid"])
        try:
            signal.pidfd_send_signal(fd, signal.SIGKILL)
            select.select([fd], [], [], 10)
        finally:
            os.close(fd)
        r = sup.run(["readlink", "/proc/self/ns/net"], run_id="kk", agent_id="a", workdir=srv, capture=True)
        new = _pod_json(state, "kk", "a")
        assert new["keeper"]["pid"] != pod["keeper"]["pid"], (new, pod)
        assert r["exit_code"] == 0 and r["stdout"].strip() == f"net:[{new['netns']}]", r
