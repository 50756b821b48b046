"""A normal user with a delegated cgroup2 subtree, for real on this host (issue 14 phase B).

The test plays systemd's part, as root: it makes a user, a directory under the cgroup2 mount, chowns it
and its cgroup.procs, cgroup.subtree_control and cgroup.threads to the user (cgroup-v2.rst, Delegation),
and starts each of the user's processes inside it (a process cannot move itself in from outside). The
user runs agnsup from a venv of the system's /usr/bin/python3 (this machine's default interpreter
lives under root's private home) that shares this run's packages, with AGNSUP_CGROUP_BASE naming the subtree and no state dir given:
the state root is $XDG_STATE_HOME/agnsup. Cells get a user namespace of their own with mount and network
namespaces inside, Landlock and seccomp; cancel and the janitor work; user and subtree are removed after.
"""
import fcntl
import hashlib
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys

import pytest

from agnsup.backend.base import Place
from agnsup.backend.cgroups import Cgroup2
from agnsup.linux import cgroup
from conftest import seccomp_launcher
from scenario import wait_for

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SYSTEM_PYTHON = "/usr/bin/python3"

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="ENV_BLOCKED: root (the test makes a user and "
                                                          "delegates a cgroup subtree to it)")


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _venv() -> str:
    """A venv of /usr/bin/python3 that sees this test run's packages (agnsup from this checkout, its
    dependencies): the same minor version shares their wheels, so a .pth adds this venv's site-packages
    (no index needed; a guest or CI runner may have none). Kept across runs."""
    if not os.access(SYSTEM_PYTHON, os.X_OK):
        pytest.skip(f"ENV_BLOCKED: {SYSTEM_PYTHON} (a system interpreter the test user can run)")
    cp = subprocess.run([SYSTEM_PYTHON, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                        capture_output=True, text=True, timeout=60)
    mine = "%d.%d" % sys.version_info[:2]
    if cp.stdout.strip() != mine:
        pytest.skip(f"ENV_BLOCKED: {SYSTEM_PYTHON} is Python {cp.stdout.strip() or '?'}, this run's is {mine} "
                    "(the test user's venv shares this run's packages)")
    sites = [p for p in sys.path if p.endswith("site-packages") and p.startswith(sys.prefix)]
    launcher = "import sys\nfrom agnsup.doors.entry import main\nsys.exit(main())\n"
    # the console script's text is in the stamp: a moved entry point makes a new venv, never a stale one
    venv = "/var/tmp/agnsup-test-user-venv-" + hashlib.sha256("\n".join([REPO, sys.prefix, *sites, launcher]).encode()).hexdigest()[:12]
    with open(venv + ".lock", "a") as lock:  # made once when two workers of one run ask (tests/_workers.py)
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(os.path.join(venv, ".ready")):
            shutil.rmtree(venv, ignore_errors=True)
            cp = subprocess.run([SYSTEM_PYTHON, "-m", "venv", "--without-pip", venv], capture_output=True, text=True,
                                timeout=300)
            if cp.returncode != 0:
                pytest.skip(f"ENV_BLOCKED: a venv of {SYSTEM_PYTHON} ({(cp.stderr.strip().splitlines() or ['?'])[-1]})")
            with open(os.path.join(venv, "lib", f"python{mine}", "site-packages", "agnsup-test-run.pth"), "w") as f:
                f.write("".join(f"import site; site.addsitedir({p!r})\n" for p in sites))
            script = os.path.join(venv, "bin", "agnsup")
            with open(script, "w") as f:
                f.write(f"#!{venv}/bin/python\n{launcher}")
            os.chmod(script, 0o755)
            open(os.path.join(venv, ".ready"), "w").close()
    return venv


class User:
    """A normal user of the test's own, with a delegated cgroup2 subtree; runs commands inside it.
    As a context manager (`with User(_venv()) as u:`) it is removed at the end, even on failure."""

    def __init__(self, venv: str):
        self.name = "agnsup-t" + os.urandom(3).hex()
        subprocess.run(["useradd", "-m", "-s", "/bin/sh", self.name], check=True, capture_output=True)
        pw = pwd.getpwnam(self.name)
        self.uid, self.gid, self.home = pw.pw_uid, pw.pw_gid, pw.pw_dir
        # where its commands start: a project of its own (the home itself is never a cell's worktree)
        self.work = os.path.join(self.home, "work")
        os.mkdir(self.work)
        os.chown(self.work, self.uid, self.gid)
        v2 = cgroup.detect_layout().v2
        if v2 is None:
            self.remove()
            pytest.skip("ENV_BLOCKED: cgroup2 (no writable cgroup2 mount to delegate from)")
        self.base = f"agnsup-user-{self.uid}"
        self.dir = os.path.join(v2, self.base)
        os.mkdir(self.dir)
        for p in (self.dir, *(os.path.join(self.dir, f) for f in ("cgroup.procs", "cgroup.subtree_control",
                                                                    "cgroup.threads"))):
            os.chown(p, self.uid, self.gid)
        self.agnsup = os.path.join(venv, "bin", "agnsup")
        self.python = os.path.join(venv, "bin", "python")
        self.env = {"HOME": self.home, "USER": self.name, "LOGNAME": self.name, "PATH": "/usr/bin:/bin",
                    "LANG": "C.UTF-8", "AGNSUP_CGROUP_BASE": self.base}

    def __enter__(self) -> "User":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def own_dir(self, path: str) -> str:
        """A directory of the user's own: `path` in its home (or an absolute path), made if missing."""
        path = os.path.join(self.home, path)
        os.makedirs(path, exist_ok=True)
        os.chown(path, self.uid, self.gid)
        return path

    def _enter(self):
        """In the child, as root still: into a leaf of its own in the delegated subtree (as systemd starts
        each unit in a cgroup of its own: once agnsup enabled controllers for the subtree's children, no
        process may join the subtree's top, "no internal processes"), then drop to the user."""
        leaf = os.path.join(self.dir, f"job-{os.getpid()}")
        os.mkdir(leaf)
        with open(os.path.join(leaf, "cgroup.procs"), "w") as f:
            f.write("0")
        os.setgroups([])
        os.setgid(self.gid)
        os.setuid(self.uid)

    def popen(self, *args, launcher=(), env=None, **kw) -> subprocess.Popen:
        return subprocess.Popen([*launcher, self.agnsup, *args], env=env if env is not None else self.env,
                                cwd=self.work, preexec_fn=self._enter, stdin=subprocess.DEVNULL, **kw)

    def __call__(self, *args, timeout=120, launcher=(), env=None) -> subprocess.CompletedProcess:
        """agnsup as the user; stdout and stderr are text, also as .out and .err (as conftest's Agnsup gives them)."""
        p = self.popen(*args, launcher=launcher, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = p.communicate(timeout=timeout)
        cp = subprocess.CompletedProcess(p.args, p.returncode, out, err)
        cp.out, cp.err = out, err
        return cp

    def json(self, *args):
        cp = self(*args)
        assert cp.returncode == 0, cp.stderr
        return json.loads(cp.stdout)

    def left(self) -> list[int]:
        """Processes still anywhere in the delegated subtree."""
        return cgroup.procs(self.dir)

    def remove(self) -> None:
        if getattr(self, "dir", None) and os.path.isdir(self.dir):
            if cgroup.procs(self.dir):
                cgroup.write_kill(self.dir)  # the subtree the test made: everything in it is the test's
                Cgroup2(cgroup.detect_layout(), self.dir).wait_empty(Place(node=cgroup.Node({"v2": self.dir})), 10.0)
            for d in cgroup.walk(self.dir):
                os.rmdir(d)
        subprocess.run(["userdel", "-r", self.name], capture_output=True)


@pytest.fixture(scope="module")
def user():
    with User(_venv()) as u:
        yield u
    assert not os.path.exists(u.dir)
    with pytest.raises(KeyError):
        pwd.getpwnam(u.name)


def test_a_normal_user_runs_a_confined_cell_in_its_delegated_subtree(user, tmp_path):
    wt = user.own_dir("wt")
    secret = os.path.join(user.home, ".secret-token")  # what the hidden home must not show
    with open(secret, "w") as f:
        f.write("s3cret\n")
    os.chown(secret, user.uid, user.gid)
    probe = (f"cat /proc/self/cgroup; id -u; test -e {secret} && echo HOME-SEEN; set -- /proc/[0-9]*; "
             "echo pids $#; "
             f"echo $$ > {user.dir}/cgroup.procs 2>/dev/null && echo LEFT-ITS-CELL; "
             "echo made > made")
    cp = user("run", "--workdir", wt, "--", "sh", "-c", probe)
    assert cp.returncode == 0, cp.stderr
    lines = cp.stdout.splitlines()
    v2_line = next(line for line in lines if line.startswith("0::"))
    assert v2_line.startswith(f"0::/{user.base}/agnsup-") and "/run-default/agent-default/cell-" in v2_line
    assert str(user.uid) in lines  # mapped to itself in the cell's user namespace
    assert "HOME-SEEN" not in lines  # its home is hidden (an empty tmpfs but for the worktree)
    assert "pids 2" in lines, lines  # its own PID namespace: its init and the shell, nothing of the user's

    assert "LEFT-ITS-CELL" not in cp.stdout  # /sys/fs/cgroup is read-only in the cell
    assert _read(os.path.join(wt, "made")) == "made\n"
    # the state root is the user's own, under $XDG_STATE_HOME (~/.local/state)
    assert os.path.isdir(os.path.join(user.home, ".local", "state", "agnsup", "cells"))
    [r] = user.json("receipts", "--json")
    iso = r["isolation"]
    assert iso["user_namespace"] and iso["mount_namespace"] and iso["network_namespace"]
    assert iso["seccomp"] and iso["landlock"] and iso["no_new_privs"] and iso["cap_sys_admin_dropped"]
    assert iso["tracking"] == "v2" and r["state"] == "exited"
    # a PID namespace in its user namespace: the cell sees none of the user's other processes, and the
    # whole tree dies with the controller
    assert iso["pid_namespace"] and iso["on_controller_death"]["in_force"], iso
    handed = _read(os.path.join(user.dir, "cgroup.controllers")).split()
    for c in ("memory", "pids"):  # the executor role sets memory_max and pids_max
        named = [m for m in iso["not_in_force"] if m.startswith(f"limit {c}:")]
        assert (c in r["limits"]["applied"]) == (c in handed) and bool(named) == (c not in handed), (c, iso)
    assert user.left() == []


THREADED_CALLER = r'''
import json, threading, time
from agnsup.tool import run_process
threading.Thread(target=time.sleep, args=(30,), daemon=True).start()  # a threaded caller, as serve is
r = run_process(["sh", "-c", "set -- /proc/[0-9]*; echo pids $#"], capture=True)
with open(r["receipt"]) as f:
    iso = json.load(f)["isolation"]
print(json.dumps({"stdout": r["stdout"], "pid_namespace": iso["pid_namespace"]}))
'''


def _caller(user, script: str) -> dict:
    """Run a Python API script as the normal user; its last line of JSON."""
    p = subprocess.Popen([user.python, "-c", script], env=user.env, cwd=user.work,
                         preexec_fn=user._enter, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        out, err = p.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        p.kill()  # our own child: a hung caller must not stay in the user's subtree for the next tests
        out, err = p.communicate()
        raise AssertionError(f"the caller hung (killed after 120 s): {err}") from None
    assert p.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


def test_a_threaded_caller_gives_a_normal_users_cell_its_pid_namespace_too(user):
    """The raw clone3 is for single-threaded processes only: a threaded controller clones from a
    throwaway child of its own, with CLONE_PARENT (process/clone.py)."""
    r = _caller(user, THREADED_CALLER)
    assert r["pid_namespace"] is True and r["stdout"].strip() == "pids 2", r
    assert user.left() == []


SUPERVISOR_CALLER = r'''
import json, os
from agnsup.supervisor import Supervisor
with Supervisor() as sup:
    r = sup.run(["sh", "-c", "set -- /proc/[0-9]*; echo pids $#"], capture=True, run_id="u")
    h = sup.spawn(["sleep", "300"], run_id="u", cell_id="held")
    with open(f"/proc/{h['pid']}/status") as f:
        parent = int(next(line.split()[1] for line in f if line.startswith("PPid:")))
    server = sup._forker.server.pid
    sup.signal("u", "held", "KILL")
    sup.wait("u", "held", timeout=60)
with open(r["receipt"]) as f:
    iso = json.load(f)["isolation"]
print(json.dumps({"stdout": r["stdout"], "pid_namespace": iso["pid_namespace"], "server": server, "parent": parent,
                  "me": os.getpid()}))
'''


def test_a_normal_users_supervisor_cell_is_born_in_its_fork_server_with_its_pid_namespace(user):
    """A Supervisor's leader is its fork server's child (process/forkserver.py), for a normal user too: the server
    is single-threaded, so its clone3 makes the user namespace and the PID namespace in one call."""
    r = _caller(user, SUPERVISOR_CALLER)
    assert r["pid_namespace"] is True and r["stdout"].strip() == "pids 2", r
    assert r["parent"] == r["server"] and r["server"] not in (None, r["me"]), r
    assert user.left() == []


SPARES_CALLER = r'''
import json, os, stat, time
from agnsup.store import spares
from agnsup.supervisor import Supervisor

def inodes(state, cell):
    out = {}
    for rel in ("cells/u/" + cell, "cells/u/%s/tmp" % cell, "cells/u/%s/stdout" % cell, "cells/u/%s/stderr" % cell,
                "changes/u/" + cell, "changes/u/%s/upper" % cell, "changes/u/%s/work" % cell):
        try:
            st = os.lstat(os.path.join(state, rel))
        except FileNotFoundError:  # no change layer: a state root that cannot hold an overlay runs cells live
            if rel.startswith("changes/"):
                continue
            raise
        out[rel.replace(cell, "C")] = [st.st_uid, st.st_gid, stat.filemode(st.st_mode)]
    return out

seen = {}
with Supervisor() as sup:
    state = sup.state.path
    for cell, with_spares in (("made", False), ("claimed", True)):
        if with_spares:
            while not all(len(sup._spares.ready[k]) >= spares.WANT[k] for k in spares.KINDS):
                time.sleep(0.01)
            before = sup._spares.claimed
        else:
            saved, spares._makers = spares._makers, {}
        h = sup.spawn(["sh", "-c", "echo out; sleep 30"], run_id="u", cell_id=cell, capture=True)
        while not os.path.getsize(os.path.join(state, "cells/u", cell, "stdout")):  # it runs: its mounts are made
            time.sleep(0.01)
        seen[cell] = inodes(state, cell)
        sup.signal("u", cell, "KILL")
        sup.wait("u", cell, timeout=60)
        if not with_spares:
            spares._makers = saved
    claimed = sup._spares.claimed - before
print(json.dumps({"seen": seen, "claimed": claimed, "uid": os.getuid(), "left": os.listdir(os.path.join(state, "spares"))}))
'''


def test_a_normal_users_supervisor_claims_spares_owned_and_moded_as_its_cells_own(user):
    """A normal user's Supervisor makes its spares too (agnsup/store/spares.py): what a cell claims is the user's,
    with the modes the cell's own path gives, and nothing is left at its close."""
    r = _caller(user, SPARES_CALLER)
    assert r["seen"]["claimed"] == r["seen"]["made"], r
    assert r["seen"]["made"]["cells/u/C"][0] == r["uid"], r
    layer = any(k.startswith("changes/") for k in r["seen"]["made"])  # none where cells run live (the v2 guest)
    assert r["claimed"] >= (3 if layer else 1) and r["left"] == [], r
    assert user.left() == []


def _sigkill_once_running(user, cell: str, p: subprocess.Popen) -> None:
    """SIGKILL `p` (our own child: a controller, or a caller handed to a serve) once its cell runs."""
    try:
        wait_for(lambda: any(c["cell_id"] == cell and c["state"] == "running" for c in user.json("ps", "--json")),
                 what=f"cell {cell} running")
        p.send_signal(signal.SIGKILL)
        p.wait(60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_cancel_and_the_janitor_work_for_a_normal_user(user):
    wt = user.own_dir("wt2")

    def running(cell):
        return any(c["cell_id"] == cell and c["state"] == "running" for c in user.json("ps", "--json"))

    ctl = user.popen("run", "--cell", "k1", "--workdir", wt, "--", "sleep", "300",
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: running("k1"), what="cell k1 running")
        out = user.json("cancel", "--cell", "k1", "--grace", "0", "--json")
        assert out["cancelled"] == 1, out
        assert ctl.wait(60) != 0
    finally:
        if ctl.poll() is None:
            ctl.kill()
            ctl.wait()
    k1 = next(x for x in user.json("receipts", "--json") if x["cell_id"] == "k1")
    assert k1["state"] == "cancelled"

    # SIGKILL the controller of a cell whose child outlives its leader: the janitor takes the rest
    _sigkill_once_running(user, "k2", user.popen("run", "--cell", "k2", "--workdir", wt, "--", "sh", "-c",
                                                 "sleep 300 & wait", stdout=subprocess.DEVNULL,
                                                 stderr=subprocess.DEVNULL))
    cp = user("janitor")
    assert cp.returncode == 0, cp.stderr
    wait_for(lambda: user.left() == [], what="nothing left in the user's subtree")
    rec = user.json("receipts", "--recovery", "--json")
    assert any("k2" in json.dumps(x) for x in rec), rec


def test_a_normal_users_run_is_handed_to_its_serve_and_its_cell_dies_with_the_caller(user):
    """doors/handoff.py as a normal user: `run` beside the user's own serve is a client; the cell writes the
    caller's descriptors, and SIGKILL to the caller ends the cell (the serve watches the connection)."""
    wt = user.own_dir("wt-handoff")
    srv = user.popen("serve", stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        ready = json.loads(srv.stdout.readline() or "{}")
        assert ready.get("ready"), f"serve did not start (exit {srv.poll()})"
        cp = user("run", "--cell", "ho1", "--workdir", wt, "--", "sh", "-c", "echo out; echo err >&2; exit 3")
        assert (cp.returncode, cp.out, cp.err) == (3, "out\n", "err\n"), cp
        (rec,) = user.json("receipts", "--cell", "ho1", "--json")
        assert rec["controller"] == ready["controller"], rec  # handed over, not an in-process controller
        _sigkill_once_running(user, "ho2", user.popen("run", "--cell", "ho2", "--workdir", wt, "--", "sleep", "300",
                                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        wait_for(lambda: user.json("receipts", "--cell", "ho2", "--json"), what="ho2's receipt")
        (rec,) = user.json("receipts", "--cell", "ho2", "--json")
        assert rec["reason"] == "controller_died" and rec["controller"] == ready["controller"], rec
    finally:
        srv.send_signal(signal.SIGTERM)  # our own child
        try:
            srv.wait(60)
        except subprocess.TimeoutExpired:
            srv.kill()
            srv.wait()
        srv.stdout.close()
    wait_for(lambda: user.left() == [], what="nothing left in the user's subtree")


def test_without_a_delegated_subtree_cells_still_run_and_each_missing_limit_names_the_fix(user):
    env = {k: v for k, v in user.env.items() if k != "AGNSUP_CGROUP_BASE"}
    cp = user("run", "--", "sh", "-c", "id -u", env=env)
    assert cp.returncode == 0 and cp.stdout.strip() == str(user.uid), cp.stderr
    r = next(x for x in user.json("receipts", "--json") if x["argv"] == ["sh", "-c", "id -u"])
    iso = r["isolation"]
    assert iso["env_blocked"] == ["ENV_BLOCKED: cgroup"] and iso["tracking"] == "session+token"
    assert iso["user_namespace"] and iso["mount_namespace"] and iso["seccomp"] and iso["landlock"]
    gaps = [m for m in iso["not_in_force"] if m.startswith("limit ")]
    assert gaps and all("fix: a cgroup2 subtree delegated to this user" in m for m in gaps), gaps


# A host that refuses a normal user's namespaces, as Ubuntu 24.04's AppArmor restriction or a
# container's seccomp profile does: unshare(2) (272) and clone3(2) (435) answer EPERM.
NO_USERNS_LAUNCHER = seccomp_launcher({272: 1, 435: 1})  # unshare, clone3: EPERM


def test_without_user_namespaces_run_refuses_in_one_line_naming_what_is_missing_and_the_fix(user):
    launcher = (user.python, "-c", NO_USERNS_LAUNCHER)
    cp = user("run", "--", "true", launcher=launcher)
    assert cp.returncode == 125, cp.stderr
    assert cp.stderr.count("\n") == 1 and cp.stderr.startswith("agnsup: cell setup failed at step 'user_namespace': ")
    assert "only inside a user namespace of its own; fix: " in cp.stderr
    doc = json.loads(user("doctor", "--json", launcher=launcher).stdout)
    assert doc["namespaces"]["user"]["available"] is False and doc["ok"] is False
    assert user.left() == []


def test_the_isolation_selftest_passes_as_a_normal_user(user):
    cp = user("selftest", "--isolation", timeout=600)
    assert "FAIL" not in cp.stdout, cp.stdout + cp.stderr
    assert cp.returncode in (0, 1), cp.stderr
    print(cp.stdout)
    assert user.left() == []
