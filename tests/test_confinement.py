"""Kernel confinement inside the cell: seccomp, Landlock, capabilities, uid, PID namespace.

Every probe is a small Python program run inside a real cell through the
installed `agnsup run`; it tries the forbidden thing and exits 77 when the
forbidden thing worked (nsjail's convention), 0 when it was refused. Probes
are Python so the governance text gate lets them through: these tests are
about what the kernel stops. Each gate runs as root (the hard case) and as
an unprivileged uid; a few controls run the same probe with the protection
switched off and see it succeed, so the probes are proven able to fail.
"""
import json
import os
import pty
import shutil
import signal
import subprocess
import sys
import time

import pytest

from agnsup.linux import proc
from agnsup.selftest.probes import (CGROUP_ESCAPE, CONTROLLER_SIGNAL, ENVIRON_FORGE, ESCAPED, STATE_ROOT,
                                    TTY_INJECTION, WRITE_ESCAPE)
from conftest import REPO, Agnsup, seccomp_launcher, write_role

NOBODY = 65534

# ---------------------------------------------------------------- helpers


def make_role(policy_dir, name: str, extra: str = "", **overrides) -> None:
    """The packaged executor role with some keys replaced and TOML appended."""
    path = write_role(policy_dir, name, **overrides)
    if extra:
        with open(path, "a") as f:
            f.write("\n" + extra + "\n")


def iso(**keys) -> dict:
    return {f"isolation__{k}": v for k, v in keys.items()}


@pytest.fixture(params=["root", "nobody"])
def cell(request, state, worktree, policy_dir):
    """Runs a probe in a confined cell, as root or as uid 65534."""
    as_user = request.param == "nobody"
    make_role(policy_dir, "probe", **({"process__user": str(NOBODY)} if as_user else {}))
    if as_user:
        os.chmod(os.path.dirname(worktree), 0o755)
        os.chown(worktree, NOBODY, NOBODY)
    a = Agnsup(state, env={"AGNSUP_POLICY_DIR": str(policy_dir)})

    def run(probe: str, *args, role="probe", **kw):
        return a("run", "--role", role, "--workdir", worktree, "--", "python3", "-c", probe, *args, **kw)
    run.agnsup, run.worktree, run.user, run.policy_dir = a, worktree, request.param, policy_dir
    return run


@pytest.fixture
def plain(state, worktree, policy_dir):
    """An agnsup whose policy dir tests fill with their own roles (root cells)."""
    return Agnsup(state, env={"AGNSUP_POLICY_DIR": str(policy_dir)})


def refused(cp) -> None:
    assert cp.returncode == 0, (f"the probe {'ESCAPED' if cp.returncode == ESCAPED else 'failed'} "
                                f"(exit {cp.returncode})\nstdout: {cp.out}\nstderr: {cp.err}")


def escaped(cp) -> None:
    assert cp.returncode == ESCAPED, f"control: wanted the probe to succeed\nstdout: {cp.out}\nstderr: {cp.err}"


def signals_to(host_pid: int) -> tuple[str, str]:
    """CONTROLLER_SIGNAL's argv: SIGCONT to the controller (harmless if it arrives), SIGTERM to a host process."""
    return f"ppid:{int(signal.SIGCONT)}", f"{host_pid}:{int(signal.SIGTERM)}"


def last_receipt(state: str) -> dict:
    cells = os.path.join(state, "cells")
    paths = []
    for root, _, files in os.walk(cells):
        paths += [os.path.join(root, f) for f in files if f == "receipt.json"]
    with open(max(paths, key=os.path.getmtime)) as f:
        return json.load(f)


# ---------------------------------------------------------------- probes
# (those `agnsup selftest --isolation` runs too are in agnsup/selftest/probes.py)

IO_URING = r'''
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
params = ctypes.create_string_buffer(120)
fd = libc.syscall(425, 4, params)
if fd >= 0:
    print("io_uring_setup worked"); sys.exit(77)
e = ctypes.get_errno()
print("io_uring_setup", os.strerror(e))
sys.exit(0 if e == 1 else 3)
'''

UNSHARE_MOUNT = r'''
import ctypes, errno, os, sys
libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID = 0x20000, 0x10000000, 0x20000000
worked, not_eperm = [], []
def check(name, ret, want=errno.EPERM):
    e = ctypes.get_errno()
    if ret == 0 or (name.startswith("clone") and ret > 0):
        worked.append(name)
        if ret > 0:
            os.waitpid(ret, 0)
    elif e != want:
        not_eperm.append(f"{name}: {errno.errorcode.get(e, e)}")
    print(name, "worked" if ret >= 0 else errno.errorcode.get(e, e))
check("unshare(CLONE_NEWUSER)", libc.unshare(CLONE_NEWUSER))
check("unshare(CLONE_NEWNS)", libc.unshare(CLONE_NEWNS))
check("mount tmpfs", libc.mount(b"tmpfs", b"/tmp", b"tmpfs", 0, None))
check("umount2", libc.umount2(b"/tmp", 2))
libc.syscall.restype = ctypes.c_long
# clone3 with CLONE_NEWUSER (struct clone_args: flags first, exit_signal 4th); the filter answers ENOSYS
args = (ctypes.c_uint64 * 11)(CLONE_NEWUSER, 0, 0, 0, 17, 0, 0, 0, 0, 0, 0)
r = libc.syscall(435, args, ctypes.sizeof(args))
if r == 0:
    os._exit(0)
check("clone3(CLONE_NEWUSER)", r, errno.ENOSYS)
# fork's clone(2) with a namespace flag (raw syscall, SIGCHLD exit signal)
r = libc.syscall(56, CLONE_NEWUSER | 17, 0, 0, 0, 0)
if r == 0:
    os._exit(0)
check("clone(CLONE_NEWUSER)", r)
print("not refused by the filter:", not_eperm)
sys.exit(77 if worked else 3 if not_eperm else 0)
'''

PTRACE = r'''
import ctypes, errno, os, sys
libc = ctypes.CDLL(None, use_errno=True)
PTRACE_ATTACH, PTRACE_DETACH = 16, 17
worked = []
for pid in (os.getppid(), int(sys.argv[1])):
    if libc.ptrace(PTRACE_ATTACH, pid, 0, 0) == 0:
        worked.append(pid)
        libc.ptrace(PTRACE_DETACH, pid, 0, 0)
        print("attached", pid)
    else:
        print("refused", pid, errno.errorcode[ctypes.get_errno()])
sys.exit(77 if worked else 0)
'''

HOST_PROCESSES = r'''
import os, sys
marker = (sys.argv[1] + sys.argv[2]).encode()  # two pieces: our own argv must not hold the marker
seen = []
for p in os.listdir("/proc"):
    if p.isdigit():
        try:
            if marker in open(f"/proc/{p}/cmdline", "rb").read():
                seen.append(p)
        except OSError:
            pass
pids = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
print("pids", pids, "host marker seen at", seen)
sys.exit(77 if seen else 0)
'''


@pytest.fixture
def outside():
    """A world-writable directory outside /tmp (each cell has its own /tmp), where no cell may write."""
    import tempfile
    d = tempfile.mkdtemp(prefix="agnsup-outside-", dir="/var/tmp")
    os.chmod(d, 0o777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def host_sleeper():
    """A host process the cells must not see or touch."""
    marker = f"agnsup-host-marker-{os.getpid()}-{time.monotonic_ns()}"
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", marker])
    yield p, marker
    p.kill()
    p.wait()


# ---------------------------------------------------------------- gates, as root and as uid 65534


def test_a_cell_cannot_rewrite_its_environment_with_prctl_pr_set_mm(cell):
    cp = cell(ENVIRON_FORGE, check=None)
    refused(cp)
    assert "PR_SET_MM_MAP -1 Operation not permitted" in cp.out


def test_a_cell_cannot_push_input_into_its_terminal_with_tiocsti(cell, state):
    master, slave = pty.openpty()
    try:
        p = cell.agnsup.popen("run", "--role", "probe", "--workdir", cell.worktree, "--", "python3", "-c",
                              TTY_INJECTION, stdin=slave, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = p.communicate(timeout=60)
    finally:
        os.close(slave)
        os.close(master)
    assert p.returncode == 0, f"exit {p.returncode}\n{out.decode()}\n{err.decode()}"
    assert b"TIOCSTI EPERM" in out and b"TIOCLINUX EPERM" in out


def test_a_cell_cannot_signal_the_controller_or_a_host_process(cell, host_sleeper):
    proc_, _ = host_sleeper
    cp = cell(CONTROLLER_SIGNAL, *signals_to(proc_.pid), check=None)
    refused(cp)
    assert proc_.poll() is None, "the host process died"


def test_a_cell_cannot_ptrace_the_controller_or_a_host_process(cell, host_sleeper):
    proc_, _ = host_sleeper
    cp = cell(PTRACE, str(proc_.pid), check=None)
    refused(cp)
    assert cp.out.count("EPERM") == 2


def test_a_cell_cannot_move_itself_out_of_its_cgroup(cell):
    cp = cell(CGROUP_ESCAPE, check=None)
    refused(cp)
    assert "tried" in cp.out and "tried 0 " not in cp.out


def test_a_cell_cannot_write_outside_its_worktree_and_tmp(cell, outside):
    os.symlink(outside, os.path.join(cell.worktree, "link"))
    up = os.path.relpath(outside, cell.worktree)  # ../../../var/tmp/agnsup-outside-...
    cp = cell(WRITE_ESCAPE, f"{up}/a", "link/b", f"{outside}/c", check=None)
    refused(cp)
    assert cp.out.count("refused") == 3 and not os.listdir(outside)


def test_a_cell_cannot_reach_the_state_root_even_through_proc(cell):
    cell.agnsup("run", "--workdir", cell.worktree, "--", "true", check=0)  # the journal exists now
    # the path goes in two pieces, so the text gate (which refuses it outright) lets the probe through
    state = cell.agnsup.state
    cp = cell(STATE_ROOT, state[:5], state[5:], check=None)
    refused(cp)
    assert not os.path.exists(os.path.join(cell.agnsup.state, "agnsup-probe"))


def test_a_cell_cannot_set_up_io_uring(cell):
    cp = cell(IO_URING, check=None)
    refused(cp)


def test_a_cell_cannot_unshare_mount_or_clone_namespaces(cell):
    cp = cell(UNSHARE_MOUNT, check=None)
    refused(cp)


def test_a_normal_toolchain_still_works_in_a_confined_cell(cell):
    wt = cell.worktree
    with open(os.path.join(wt, "Makefile"), "w") as f:
        f.write("all: out.txt\n\nout.txt:\n\techo built by make > $@\n\tsh -c 'echo sub-shell $$$$ >> $@'\n"
                "\techo to stderr >&2\n")
    if cell.user == "nobody":
        os.chown(os.path.join(wt, "Makefile"), NOBODY, NOBODY)
    probe = r'''
import multiprocessing, os, subprocess, sys, tempfile, threading
out = []
t = threading.Thread(target=out.append, args=("thread",)); t.start(); t.join()
subprocess.run(["make", "-s"], check=True)
subprocess.run(["git", "init", "-q", "."], check=True)
subprocess.run(["git", "-c", "user.name=a", "-c", "user.email=a@b", "add", "out.txt"], check=True)
subprocess.run(["git", "-c", "user.name=a", "-c", "user.email=a@b", "commit", "-qm", "x"], check=True)
with multiprocessing.Pool(2) as pool:
    out.append(sum(pool.map(abs, [-1, -2])))
lock = multiprocessing.Lock()  # a POSIX semaphore in /dev/shm
with tempfile.NamedTemporaryFile(dir="/tmp") as f:
    f.write(b"x")
open(os.path.join(os.environ["HOME"], "rc"), "w").write("home is writable")
print(out, open("out.txt").read().split())
'''
    cp = cell(probe, check=0)
    assert "['thread', 3]" in cp.out and "make" in cp.out and "sub-shell" in cp.out
    cp = cell.agnsup("run", "--role", "probe", "--workdir", wt, "--", "sh", "-c", "python3 -m pytest --version",
                     check=None)
    assert cp.returncode == 0 or "No module named pytest" in cp.err, cp.err


def test_stdio_files_stay_writable_through_dev_stdout(plain, worktree, tmp_path):
    """Landlock allows the cell's own stdio files: shells reopen them as /dev/stdout."""
    out = tmp_path / "out.txt"
    with open(out, "wb") as f:
        p = plain.popen("run", "--workdir", worktree, "--", "sh", "-c", "echo via-dev-stdout > /dev/stdout",
                        stdout=f, stderr=subprocess.PIPE)
        _, err = p.communicate(timeout=60)
    assert p.returncode == 0, err.decode()
    assert out.read_text() == "via-dev-stdout\n"


def test_the_receipt_lists_the_protections_in_force(cell):
    cell("pass", check=0)
    iso_ = last_receipt(cell.agnsup.state)["isolation"]
    assert iso_["seccomp"] and iso_["landlock"] and iso_["landlock_scopes"] and iso_["no_new_privs"]
    assert iso_["not_in_force"] == []
    if cell.user == "nobody":
        assert iso_["uid"] == NOBODY and iso_["capabilities_kept"] == []
    else:
        assert "SYS_ADMIN" not in iso_["capabilities_kept"]


def test_the_cell_process_really_carries_the_confinement(cell):
    probe = ("import os\nst = dict(l.split(':', 1) for l in open('/proc/self/status'))\n"
             "print(os.getuid(), st['NoNewPrivs'].strip(), st['Seccomp'].strip(), st['CapEff'].strip(),"
             " st['CapBnd'].strip(), st['CapAmb'].strip())")
    uid, nnp, secc, eff, bnd, amb = cell(probe, check=0).out.split()
    assert (nnp, secc, amb) == ("1", "2", "0000000000000000")
    if cell.user == "nobody":
        assert uid == str(NOBODY) and int(eff, 16) == 0 and int(bnd, 16) == 0
    else:
        assert uid == "0" and int(eff, 16) == int(bnd, 16) and not int(bnd, 16) & (1 << 21)


# ---------------------------------------------------------------- Landlock alone (a wrong mount layout)


def test_landlock_alone_refuses_cgroup_and_outside_writes_under_a_writable_root(plain, worktree, policy_dir,
                                                                                   outside):
    make_role(policy_dir, "rwroot", filesystem__root='"rw"')
    cp = plain("run", "--role", "rwroot", "--workdir", worktree, "--", "python3", "-c", CGROUP_ESCAPE, check=None)
    refused(cp)
    assert "Permission denied" in cp.out  # Landlock's EACCES, not a read-only mount's EROFS
    cp = plain("run", "--role", "rwroot", "--workdir", worktree, "--", "python3", "-c", WRITE_ESCAPE,
               f"{outside}/a", check=None)
    refused(cp)
    assert "Permission denied" in cp.out and not os.listdir(outside)


# ---------------------------------------------------------------- controls: the probes can fail


def test_control_without_landlock_a_writable_root_lets_the_probes_escape(plain, worktree, policy_dir, outside):
    # host_root: a mapped cell (uid 0 of a user namespace) owns no cgroup file either (tests/test_doors_identity.py)
    make_role(policy_dir, "open", filesystem__root='"rw"', **iso(landlock="false", host_root="true"),
              process__on_controller_death='"keep"')
    cp = plain("run", "--role", "open", "--workdir", worktree, "--", "python3", "-c", WRITE_ESCAPE,
               f"{outside}/a", check=None)
    escaped(cp)
    cp = plain("run", "--role", "open", "--workdir", worktree, "--", "python3", "-c", CGROUP_ESCAPE, check=None)
    escaped(cp)
    assert "ESCAPED to /sys/fs/cgroup/" in cp.out
    if os.path.isdir("/sys/fs/cgroup/unified"):
        # the probe stops at the first ancestor that takes it: on a hybrid host agnsup's own agent directory.
        # On pure v2 an ancestor with controllers in its subtree_control takes no process (no internal
        # processes: EBUSY), so the first that does can be the root's.
        assert "agnsup-" in cp.out


def test_control_without_seccomp_the_probes_succeed(plain, worktree, policy_dir):
    make_role(policy_dir, "noseccomp", **iso(seccomp="false"), process__on_controller_death='"keep"')
    for probe in (ENVIRON_FORGE, IO_URING):
        escaped(plain("run", "--role", "noseccomp", "--workdir", worktree, "--", "python3", "-c", probe, check=None))
    master, slave = pty.openpty()
    try:
        p = plain.popen("run", "--role", "noseccomp", "--workdir", worktree, "--", "python3", "-c", TTY_INJECTION,
                        stdin=slave, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, _ = p.communicate(timeout=60)
    finally:
        os.close(slave)
        os.close(master)
    assert p.returncode == ESCAPED, out


def test_control_without_landlock_a_root_cell_can_signal_a_host_process(plain, worktree, policy_dir,
                                                                          host_sleeper):
    proc_, _ = host_sleeper
    # host_root: a mapped cell has no CAP_KILL over host processes either (tests/test_doors_identity.py)
    make_role(policy_dir, "nolandlock", **iso(landlock="false", host_root="true"), process__on_controller_death='"keep"')
    cp = plain("run", "--role", "nolandlock", "--workdir", worktree, "--", "python3", "-c", CONTROLLER_SIGNAL,
               *signals_to(proc_.pid), check=None)
    escaped(cp)
    assert proc_.wait(timeout=30) == -signal.SIGTERM


# ---------------------------------------------------------------- PID namespace


@pytest.fixture(params=["root", "nobody"])
def pidns(request, state, worktree, policy_dir):
    as_user = request.param == "nobody"
    make_role(policy_dir, "pidns", **({"process__user": str(NOBODY)} if as_user else {}),
              **iso(pid_namespace="true"))
    if as_user:
        os.chmod(os.path.dirname(worktree), 0o755)
        os.chown(worktree, NOBODY, NOBODY)
    a = Agnsup(state, env={"AGNSUP_POLICY_DIR": str(policy_dir)})

    def run(*argv, extra=(), **kw):
        return a("run", "--role", "pidns", "--workdir", worktree, *extra, "--", *argv, **kw)
    run.agnsup = a
    return run


def test_with_a_pid_namespace_a_cell_cannot_see_host_processes(pidns, host_sleeper, plain, worktree):
    _, marker = host_sleeper
    cp = pidns("python3", "-c", HOST_PROCESSES, marker[:6], marker[6:], check=None)
    refused(cp)
    assert cp.out.startswith("pids [1, 2")
    # control: without the namespace the same probe sees the host process
    escaped(plain("run", "--workdir", worktree, "--on-controller-death", "keep", "--", "python3", "-c",
                  HOST_PROCESSES, marker[:6], marker[6:],
                  check=None))


def test_the_pid_namespace_init_passes_an_exit_status_on_exactly(pidns):
    pidns("python3", "-c", "import sys; sys.exit(3)", check=3)
    r = last_receipt(pidns.agnsup.state)
    assert (r["state"], r["exit_code"], r["exit_status"], r["signal"]) == ("exited", 3, 3, None)
    assert r["isolation"]["pid_namespace"] is True


def test_a_signal_death_inside_the_pid_namespace_is_reported_as_that_signal(pidns):
    pidns("python3", "-c", "import os, signal; os.kill(os.getpid(), signal.SIGTERM)", check=128 + 15)
    r = last_receipt(pidns.agnsup.state)
    assert (r["state"], r["exit_code"], r["exit_status"], r["signal"]) == ("killed", 143, None, 15)
    # an exit(143) is not a signal death
    pidns("python3", "-c", "import sys; sys.exit(143)", check=143)
    r = last_receipt(pidns.agnsup.state)
    assert (r["state"], r["exit_status"], r["signal"]) == ("exited", 143, None)


def test_the_pid_namespace_init_forwards_signals_and_reaps_orphans(pidns, state):
    probe = r'''
import os, signal, subprocess, sys, time
signal.signal(signal.SIGUSR1, lambda *a: sys.exit(7))
subprocess.run(["sh", "-c", "sleep 0.3 & exit 0"])  # the sleep becomes an orphan of PID 1
time.sleep(1.5)
zombies = [p for p in os.listdir("/proc") if p.isdigit() and open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"]
print("zombies", zombies, "my pid", os.getpid(), flush=True)
time.sleep(120)
'''
    p = pidns.agnsup.popen("run", "--role", "pidns", "--", "python3", "-c", probe, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, cwd=os.path.dirname(state))
    try:
        line = p.stdout.readline().decode()
        assert line.startswith("zombies [] my pid 2"), line
        init = _child_of(p.pid)
        assert init is not None
        os.kill(init, signal.SIGUSR1)  # to the init (the journaled leader): forwarded to the command
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 7, err.decode()


def _child_of(ppid: int) -> int | None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for pid in proc.pids():
            st = proc.stat(pid)
            if st is not None and st.ppid == ppid:
                return pid
        time.sleep(0.05)
    return None


def test_cancel_and_timeout_still_kill_everything_in_a_pid_namespace(pidns):
    """The init is inside the cell's cgroup: a timeout takes the whole tree (the leak check proves it)."""
    pidns("python3", "-c", "import subprocess, time\nkids = [subprocess.Popen(['sleep', '300']) for _ in range(3)]\n"
          "time.sleep(300)", check=124, timeout=120, extra=("--timeout", "1"))


# ---------------------------------------------------------------- require, policy keys, doctor


# A host without Landlock, as a container whose seccomp profile predates Landlock
# presents one: landlock_create_ruleset answers ENOSYS. The launcher installs
# that filter (classic BPF: load nr; nr == 444 ? ENOSYS : allow) and execs agnsup.
NO_LANDLOCK_LAUNCHER = seccomp_launcher({444: 38})  # landlock_create_ruleset: ENOSYS


def _without_landlock(a: Agnsup, *args, **kw):
    bin_ = os.path.join(os.path.dirname(sys.executable), "agnsup")
    cp = subprocess.run([sys.executable, "-c", NO_LANDLOCK_LAUNCHER, bin_, *args], env=a.env, capture_output=True,
                        timeout=60, stdin=subprocess.DEVNULL, **kw)
    cp.out, cp.err = cp.stdout.decode(errors="replace"), cp.stderr.decode(errors="replace")
    return cp


def test_a_required_protection_the_host_lacks_refuses_to_start_the_cell(plain, worktree, policy_dir, state):
    make_role(policy_dir, "needll", **iso(require='["seccomp", "landlock"]'))
    cp = _without_landlock(plain, "run", "--role", "needll", "--workdir", worktree, "--", "touch", "made")
    assert cp.returncode == 125, cp.err
    assert cp.err == ("agnsup: role needll requires landlock, which is not available here: "
                      "no Landlock in this kernel (or it is disabled)\n")
    assert not os.path.exists(os.path.join(worktree, "made"))


def test_a_missing_protection_the_role_does_not_require_is_reported_not_hidden(plain, worktree, policy_dir, state):
    make_role(policy_dir, "wantll", **iso(require='["seccomp"]'))
    cp = _without_landlock(plain, "run", "--role", "wantll", "--workdir", worktree, "--", "true")
    assert cp.returncode == 0, cp.err
    iso_ = last_receipt(state)["isolation"]
    assert iso_["landlock"] is False and iso_["seccomp"] is True
    assert any(m.startswith("landlock:") for m in iso_["not_in_force"])
    doc = json.loads(_without_landlock(plain, "doctor", "--json").out)
    assert doc["confinement"]["landlock"]["available"] is False


@pytest.mark.parametrize("keys, problem", [
    (iso(require='["landlock"]', landlock="false"), "key isolation: require lists 'landlock' but isolation.landlock is false"),
    (iso(require='["tinfoil"]'), "key isolation.require: 'tinfoil' is not a protection"),
    (iso(capabilities='["SYS_FLY"]'), "key isolation.capabilities: 'SYS_FLY' is not a capability name"),
    (iso(seccomp="1"), "key isolation.seccomp"),
    (iso(no_new_privs="false"), "seccomp and landlock need no_new_privs"),
    (iso(writable='["relative/dir"]'), "key isolation.writable: 'relative/dir' is not an absolute path"),
])
def test_bad_isolation_keys_are_refused_naming_file_and_key(plain, worktree, policy_dir, keys, problem):
    make_role(policy_dir, "bad", **keys)
    cp = plain("run", "--role", "bad", "--workdir", worktree, "--", "true", check=125)
    assert problem in cp.err and os.path.join(str(policy_dir), "bad.toml") in cp.err
    assert cp.err.count("\n") == 1


def test_an_unknown_process_user_is_refused(plain, worktree, policy_dir):
    make_role(policy_dir, "bad2", process__user='"no-such-user-here"', **iso(capabilities="[]"))
    cp = plain("run", "--role", "bad2", "--workdir", worktree, "--", "true", check=125)
    assert "process.user 'no-such-user-here' is not a user on this host" in cp.err


def test_doctor_lists_the_confinement_this_host_offers(agnsup):
    r = agnsup.json("doctor", "--json", "--no-probe")
    c = r["confinement"]
    assert c["seccomp"]["available"] and c["landlock"]["available"] and c["landlock"]["abi"] >= 1
    assert set(c) >= {"seccomp", "landlock", "landlock_scopes", "no_new_privs", "pid_namespace", "capabilities"}
    text = agnsup("doctor", "--no-probe", check=0).out
    assert "confinement:" in text and "seccomp" in text and "landlock" in text


def test_the_shipped_roles_confine_with_seccomp_and_landlock():
    import tomllib
    for role in ("executor", "readonly", "networked", "proxied"):
        with open(os.path.join(REPO, "agnsup", "policies", f"{role}.toml"), "rb") as f:
            doc = tomllib.load(f)
        assert doc["isolation"]["seccomp"] is True and doc["isolation"]["landlock"] is True, role
    assert shutil.which("python3")


def test_the_janitor_recovers_a_pid_namespace_cell_of_a_killed_controller(pidns, worktree):
    a = pidns.agnsup
    p = a.popen("run", "--role", "pidns", "--workdir", worktree, "--cell", "p1", "--", "python3", "-c",
                "import time; print('ready', flush=True); time.sleep(300)", stdout=subprocess.PIPE)
    try:
        assert p.stdout.readline() == b"ready\n"
        init = _child_of(p.pid)
        command = _child_of(init)
        ids = [(pid, proc.stat(pid).starttime) for pid in (init, command)]
        p.kill()  # the controller dies without a word
        p.wait(10)
    finally:
        p.stdout.close()
        if p.poll() is None:
            p.kill()
            p.wait()
    cp = a("run", "--workdir", worktree, "--cell", "p2", "--", "true", check=0)
    assert "janitor recovered 1 cell" in cp.err
    for pid, start in ids:
        st = proc.stat(pid)
        assert st is None or st.starttime != start or st.state in ("Z", "X"), f"{pid} survived the janitor"
