"""Issue 25, door 4: the cell's /dev is its own, not the host's (docs/isolation.md "Doors: /dev").

On 215dff3 a cell saw the host's /dev, and any uid-0 cell, even with no capability, read a host
block device: the raw disk (around every mask: the state root, ~/.ssh, /etc/shadow) or, here, a
loop device the test attaches over a file holding a marker. Each test plays the hostile cell in
the readonly and executor roles, as root and as a normal user running agnsup (its cells live in a
user namespace of their own), and also proves that what everyday jobs need of /dev still works:
ptys (pty.fork, script, tmux), /dev/fd, /dev/stdout, /dev/shm for multiprocessing, make -j.
"""
import json
import os
import subprocess
import types

import pytest

from agnsup import compiler
from agnsup.errors import SetupError
from conftest import REPO, Agnsup, run_door_gates, write_role
from test_confinement import last_receipt
from test_terminal import UserTerminal

MINIMAL = {"fd", "full", "null", "ptmx", "pts", "random", "shm", "stderr", "stdin", "stdout", "tty", "urandom", "zero"}
ROLES = ("readonly", "executor")

# ---------------------------------------------------------------- probes (Python: the text gate judges none of it)

# argv: marker, then device paths each in two pieces. Prints JSON: /dev's listing, and per path what happened.
P_DEVICES = r'''
import json, os, sys
marker = sys.argv[1].encode()
args = sys.argv[2:]
out = {"dev": sorted(os.listdir("/dev")), "pts": sorted(os.listdir("/dev/pts")), "paths": {}}
for a, b in zip(args[::2], args[1::2]):
    p = a + b
    try:
        with open(p, "rb") as f:
            data = f.read(4096)
        out["paths"][p] = "marker" if marker in data else f"read {len(data)} bytes"
    except OSError as e:
        out["paths"][p] = f"refused: {e.strerror}"
print(json.dumps(out))
'''

# Everyday jobs that need /dev. argv: st_dev of the host's /dev/pts, and "inherited" to also reopen the
# cell's own stdout and stderr. Prints "ok <job>" or "FAIL <job>: why".
P_EVERYDAY = r'''
import json, multiprocessing, os, pty, subprocess, sys
host_pts_dev = int(sys.argv[1])
failed = []
def check(name, ok, why=""):
    print(("ok " if ok else "FAIL ") + name + ("" if ok else ": " + str(why)), flush=True)
    if not ok:
        failed.append(name)
def run(argv, **kw):
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, **kw)

check("own devpts", os.stat("/dev/pts").st_dev != host_pts_dev and sorted(os.listdir("/dev/pts")) == ["ptmx"],
      f"st_dev {os.stat('/dev/pts').st_dev} (host {host_pts_dev}), holds {sorted(os.listdir('/dev/pts'))}")
pid, master = pty.fork()
if pid == 0:
    os.write(1, os.ttyname(0).encode() + b"\n")
    os._exit(0)
got = b""
while b"\n" not in got:
    try:
        chunk = os.read(master, 100)
    except OSError:
        break
    if not chunk:
        break
    got += chunk
_, status = os.waitpid(pid, 0)
name = got.decode().strip()
check("pty.fork", status == 0 and name.startswith("/dev/pts/") and os.path.exists(name), got)
r = run(["script", "-qc", "tty", "/dev/null"])
check("script", r.returncode == 0 and r.stdout.strip().startswith("/dev/pts/"), (r.returncode, r.stdout, r.stderr))
env = {**os.environ, "TMUX_TMPDIR": "/tmp", "SHELL": "/bin/sh"}  # uid 65534's login shell is nologin
r1 = run(["tmux", "-L", "doors", "new-session", "-d", "-s", "s", "sleep 60"], env=env)
r2 = run(["tmux", "-L", "doors", "has-session", "-t", "s"], env=env)
r3 = run(["tmux", "-L", "doors", "kill-server"], env=env)
check("tmux", (r1.returncode, r2.returncode, r3.returncode) == (0, 0, 0), (r1.stderr, r2.stderr, r3.stderr))
r = run(["bash", "-c", "cat <(echo from-process-substitution)"])
check("/dev/fd", r.stdout == "from-process-substitution\n", (r.returncode, r.stdout, r.stderr))
r = run(["bash", "-c", "echo via-dev-stdout > /dev/stdout"])  # a pipe made here, reopened by the shell
check("/dev/stdout", r.stdout == "via-dev-stdout\n", (r.returncode, r.stdout, r.stderr))
if "inherited" in sys.argv[2:]:
    # the cell's own stdout and stderr (a pipe, a file or a pty of the controller's), reopened by the shell
    r = subprocess.run(["bash", "-c", "echo via-dev-stdout > /dev/stdout; echo via-dev-stderr > /dev/stderr"])
    check("/dev/stdout inherited", r.returncode == 0, r.returncode)
lock = multiprocessing.Lock()
with lock:
    pass
q = multiprocessing.Queue()
p = multiprocessing.Process(target=q.put, args=(42,))
p.start()
check("multiprocessing", q.get(timeout=30) == 42, "no result")
p.join()
with open("/dev/urandom", "rb") as f:
    check("/dev/urandom", len(f.read(16)) == 16)
with open("/dev/null", "wb") as f:
    f.write(b"x")
with open("/dev/zero", "rb") as f:
    check("/dev/zero", f.read(8) == bytes(8))
try:
    with open("/dev/full", "wb", buffering=0) as f:
        f.write(b"x")
    check("/dev/full", False, "a write worked")
except OSError as e:
    check("/dev/full", e.errno == 28, e)
with open("/tmp/Makefile", "w") as f:
    f.write("all: a b\na:\n\t@true\nb:\n\t@true\n")
r = run(["make", "-j4", "-C", "/tmp"])
check("make -j", r.returncode == 0, r.stderr)
r = run(["ssh-agent", "-a", "/tmp/agent.sock"])
apid = next((l.split("=")[1].split(";")[0] for l in r.stdout.splitlines() if l.startswith("SSH_AGENT_PID=")), None)
check("ssh-agent", r.returncode == 0 and apid is not None, (r.stdout, r.stderr))
if apid:
    run(["ssh-agent", "-k"], env={**os.environ, "SSH_AGENT_PID": apid})
sys.exit(1 if failed else 0)
'''

# argv: how many bytes to try. Writes /dev/shm/fill until it fails; prints JSON.
P_SHM_FILL = r'''
import errno, json, os, sys
want, written, err = int(sys.argv[1]), 0, None
try:
    with open("/dev/shm/fill", "wb", buffering=0) as f:
        while written < want:
            written += f.write(b"z" * 65536)
except OSError as e:
    err = errno.errorcode.get(e.errno, e.errno)
print(json.dumps({"written": written, "error": err}))
'''


def script_file(directory: str, text: str) -> str:
    """The probe as a file the cell runs (a fork on the command line is a hardline denial of the text gate)."""
    path = os.path.join(directory, "agnsup-door4-probe.py")
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, 0o644)
    return path


def pieces(path: str) -> list[str]:
    return [path[:5], path[5:]]


def probe_json(cp) -> dict:
    assert cp.returncode == 0, f"exit {cp.returncode}\nstdout: {cp.out}\nstderr: {cp.err}"
    return json.loads(cp.out.strip().splitlines()[-1])


def role_from(policy_dir, base: str, name: str, filesystem: str = "", limits: str = "") -> str:
    """A copy of a packaged role under another name, with lines added to [filesystem] and [limits]."""
    with open(os.path.join(REPO, "agnsup", "policies", f"{base}.toml")) as f:
        src = f.read().replace(f'name = "{base}"', f'name = "{name}"')
    src = src.replace("[filesystem]\n", f"[filesystem]\n{filesystem}\n").replace("[limits]\n", f"[limits]\n{limits}\n")
    with open(os.path.join(str(policy_dir), f"{name}.toml"), "w") as f:
        f.write(src)
    return name


# ---------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def loop():
    """A loop device over a file that starts with a marker; detached and removed at the end, even on failure."""
    if os.geteuid() != 0:
        pytest.skip("ENV_BLOCKED: root (the test attaches a loop device)")
    marker = "agnsup-door4-" + os.urandom(6).hex()
    path = f"/var/tmp/agnsup-door4-{os.getpid()}.img"
    with open(path, "wb") as f:
        f.write((marker.encode() + b"\n") * 64 + bytes(1 << 20))
    cp = subprocess.run(["losetup", "--find", "--show", path], capture_output=True, text=True)
    if cp.returncode != 0:
        os.unlink(path)
        pytest.skip(f"ENV_BLOCKED: loop devices ({cp.stderr.strip()})")
    dev = cp.stdout.strip()
    try:
        yield types.SimpleNamespace(dev=dev, marker=marker)
    finally:
        subprocess.run(["losetup", "-d", dev], capture_output=True)
        os.unlink(path)


def root_disk() -> str | None:
    from agnsup.selftest.doors_dev import root_block_device
    return root_block_device()


def host_pts_dev() -> str:
    return str(os.stat("/dev/pts").st_dev)


# ---------------------------------------------------------------- as root

@pytest.mark.parametrize("role", ROLES)
def test_a_root_cell_sees_only_the_minimal_dev_and_cannot_read_a_host_block_device(agnsup, worktree, loop, role):
    disk = root_disk()
    paths = [loop.dev] + ([disk] if disk else [])
    host_pty = os.openpty()  # a host terminal the cell must not see
    try:
        out = probe_json(agnsup("run", "--role", role, "--workdir", worktree, "--", "python3", "-c", P_DEVICES,
                                loop.marker, *(x for p in paths for x in pieces(p))))
    finally:
        os.close(host_pty[0]), os.close(host_pty[1])
    assert set(out["dev"]) == MINIMAL, out["dev"]
    assert out["pts"] == ["ptmx"], out["pts"]  # its own devpts: no host terminal
    for p in paths:
        assert out["paths"][p] == "refused: No such file or directory", (p, out["paths"][p])
    iso = last_receipt(agnsup.state)["isolation"]
    assert iso["dev"] == "minimal" and iso["devices"] == [] and "/dev/null" in iso["dev_nodes"]
    assert "/dev/pts" not in iso["landlock_writable"] and "/dev/ptmx" not in iso["landlock_writable"]


@pytest.mark.parametrize("base", ROLES)
def test_a_role_that_lists_the_device_gets_it_and_the_receipt_says_what_it_gives_up(agnsup, worktree, policy_dir,
                                                                                     loop, base):
    role = role_from(policy_dir, base, f"{base}-loop", filesystem=f'devices = ["{loop.dev}"]')
    a = Agnsup(agnsup.state, env={"AGNSUP_POLICY_DIR": str(policy_dir)})
    out = probe_json(a("run", "--role", role, "--workdir", worktree, "--", "python3", "-c", P_DEVICES, loop.marker,
                       *pieces(loop.dev)))
    assert out["paths"][loop.dev] == "marker"
    assert set(out["dev"]) == MINIMAL | {os.path.basename(loop.dev)}
    iso = last_receipt(a.state)["isolation"]
    assert iso["devices"] == [{"path": loop.dev, "kind": "block", "gives_up": f"the cell can read and write "
                               f"{loop.dev} (a block device of the host): whatever that device reaches"}]
    assert loop.dev in iso["landlock_writable"] and loop.dev in iso["dev_nodes"]


def test_a_role_listing_a_device_that_is_not_there_refuses_the_cell_in_one_line(agnsup, worktree, policy_dir):
    a = Agnsup(agnsup.state, env={"AGNSUP_POLICY_DIR": str(policy_dir)})
    role_from(policy_dir, "executor", "missing", filesystem='devices = ["/dev/agnsup-no-such-device"]')
    role_from(policy_dir, "executor", "notdev", filesystem='devices = ["/dev/net"]')
    role_from(policy_dir, "executor", "own", filesystem='devices = ["/dev/pts/0"]')
    cp = a("run", "--role", "missing", "--workdir", worktree, "--run", "R", "--cell", "m", "--", "true", check=125)
    assert cp.err.strip().splitlines() == ["agnsup: role missing: filesystem.devices lists /dev/agnsup-no-such-device, "
                                           "which does not exist on this host"], cp.err
    if os.path.isdir("/dev/net"):
        cp = a("run", "--role", "notdev", "--workdir", worktree, "--", "true", check=125)
        assert "/dev/net, which is not a device node" in cp.err and len(cp.err.strip().splitlines()) == 1
    cp = a("run", "--role", "own", "--workdir", worktree, "--", "true", check=125)  # the model's check
    assert "key filesystem.devices: '/dev/pts/0' is the cell's own" in cp.err and len(cp.err.strip().splitlines()) == 1
    refused = a.json("receipts", "--refused", "--run", "R", "--json")
    assert [(r["cell_id"], r["exit_code"], r["error_type"]) for r in refused] == [("m", 125, "SetupError")]
    assert "/dev/agnsup-no-such-device" in refused[0]["error"]
    assert not os.path.exists(os.path.join(a.state, "cells", "R"))  # nothing started
    assert a.json("receipts", "--run", "R", "--json") == []


def test_a_symlink_or_a_file_in_filesystem_devices_is_refused(tmp_path):
    link, plain = tmp_path / "link", tmp_path / "plain"
    plain.write_text("")
    link.symlink_to("/dev/null")
    for p, why in ((str(link), "a symlink to /dev/null: list the device node itself"),
                   (str(plain), "not a device node")):
        with pytest.raises(SetupError, match=why) as e:
            compiler.host_devices(types.SimpleNamespace(devices=(p,)), "r")
        assert e.value.details["step"] == "devices" and e.value.exit_code == 125
    assert compiler.host_devices(types.SimpleNamespace(devices=("/dev/null", "/dev/null")), "r") == [
        ("/dev/null", "character")]


@pytest.mark.parametrize("role", ROLES)
def test_everyday_jobs_keep_working_with_the_minimal_dev(agnsup, worktree, role):
    cp = agnsup("run", "--role", role, "--workdir", worktree, "--", "python3", script_file(worktree, P_EVERYDAY),
                host_pts_dev(), "inherited", timeout=120)
    assert cp.returncode == 0 and "FAIL" not in cp.out, f"exit {cp.returncode}\n{cp.out}\n{cp.err}"
    assert "via-dev-stdout" in cp.out and "via-dev-stderr" in cp.err


def test_everyday_jobs_keep_working_in_a_cell_of_uid_65534(agnsup, worktree, policy_dir):
    """process.user: the cell's ptys, /dev/shm and the bound nodes serve a uid that is not root."""
    write_role(policy_dir, "nobody", process__user="65534")
    os.chmod(os.path.dirname(worktree), 0o755)
    os.chown(worktree, 65534, 65534)
    a = Agnsup(agnsup.state, env={"AGNSUP_POLICY_DIR": str(policy_dir)})
    # not "inherited": agnsup's stdout is this test's pipe, mode 0600 and root's, which uid 65534 may not reopen
    cp = a("run", "--role", "nobody", "--workdir", worktree, "--", "python3", script_file(worktree, P_EVERYDAY),
           host_pts_dev(), timeout=120)
    assert cp.returncode == 0 and "FAIL" not in cp.out, f"exit {cp.returncode}\n{cp.out}\n{cp.err}"


def test_dev_shm_is_capped_by_limits_shm_max(agnsup, worktree, policy_dir):
    a = Agnsup(agnsup.state, env={"AGNSUP_POLICY_DIR": str(policy_dir)})
    role_from(policy_dir, "executor", "shm", limits='shm_max = "1M"')
    out = probe_json(a("run", "--role", "shm", "--workdir", worktree, "--", "python3", "-c", P_SHM_FILL,
                       str(8 << 20)))
    assert out == {"written": 1 << 20, "error": "ENOSPC"}, out
    assert last_receipt(a.state)["isolation"]["dev_shm_max"] == 1 << 20
    # unset: half the role's memory_max (executor: 4G)
    probe_json(a("run", "--workdir", worktree, "--", "python3", "-c", P_SHM_FILL, "0"))
    assert last_receipt(a.state)["isolation"]["dev_shm_max"] == 2 << 30


def test_at_a_terminal_the_cell_finds_its_terminal_and_no_host_one(agnsup, worktree):
    script = ("import os, subprocess\n"
              "print('ttyname', os.ttyname(0))\n"
              "print('pts', sorted(os.listdir('/dev/pts')))\n"
              "subprocess.run(['sh', '-c', 'echo at-pty > /dev/stdout; tty'])\n"
              "print('done')\n")
    t = UserTerminal(agnsup, "--workdir", worktree, "--", "python3", "-c", script)
    try:
        out = t.until(b"done\r\n")
    finally:
        code = t.end()
    assert code == 0, out
    assert b"ttyname /dev/console\r\n" in out and b"pts ['ptmx']\r\n" in out, out
    assert b"at-pty\r\n/dev/console\r\n" in out, out  # /dev/stdout reopens the pty (Landlock allows it)


# ---------------------------------------------------------------- as a normal user (its cells in a user namespace)

@pytest.fixture(scope="module")
def normal_user():
    if os.geteuid() != 0:
        pytest.skip("ENV_BLOCKED: root (the test makes a user and delegates a cgroup subtree to it)")
    from agnsup.linux import userns
    if userns.blocked_by_sysctl():
        pytest.skip("ENV_BLOCKED: unprivileged user namespaces: " + "; ".join(userns.blocked_by_sysctl()))
    from test_unprivileged import User, _venv
    with User(_venv()) as u:
        yield u


@pytest.fixture
def user_policies(normal_user):
    """A policy directory the user can read (pytest's tmp_path lies under root's 0700 directory)."""
    import shutil
    import tempfile
    d = tempfile.mkdtemp(prefix="agnsup-door4-policies-", dir="/var/tmp")
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _as_user(u, policy_dir, *args) -> subprocess.CompletedProcess:
    env = {**u.env, "AGNSUP_POLICY_DIR": str(policy_dir)}
    return u(*args, env=env, timeout=180)


@pytest.mark.parametrize("base", ROLES)
def test_a_normal_users_cell_sees_only_the_minimal_dev_even_for_a_device_the_user_may_read(normal_user, user_policies,
                                                                                             loop, base):
    u = normal_user
    os.chown(loop.dev, u.uid, u.gid)  # the user may read it on the host: only the cell's /dev stands in the way
    try:
        plain = _as_user(u, user_policies, "run", "--role", base, "--workdir", u.work, "--", "python3", "-c",
                         P_DEVICES, loop.marker, *pieces(loop.dev))
        role = role_from(user_policies, base, f"{base}-loop", filesystem=f'devices = ["{loop.dev}"]')
        listed = _as_user(u, user_policies, "run", "--role", role, "--workdir", u.work, "--", "python3", "-c",
                          P_DEVICES, loop.marker, *pieces(loop.dev))
    finally:
        os.chown(loop.dev, 0, 0)
    out = probe_json(plain)
    assert set(out["dev"]) == MINIMAL and out["pts"] == ["ptmx"], out
    assert out["paths"][loop.dev] == "refused: No such file or directory", out
    assert probe_json(listed)["paths"][loop.dev] == "marker"


@pytest.mark.parametrize("role", ROLES)
def test_a_normal_users_everyday_jobs_keep_working_with_the_minimal_dev(normal_user, user_policies, role):
    u = normal_user
    # not "inherited": agnsup's stdout here is a pipe of this (root) test, mode 0600, which the user may
    # not reopen through /proc/self/fd, bare or in a cell; the probe's own pipes stand in for it
    cp = _as_user(u, user_policies, "run", "--role", role, "--workdir", u.work, "--", "python3",
                  script_file(u.work, P_EVERYDAY), host_pts_dev())
    assert cp.returncode == 0 and "FAIL" not in cp.out, f"exit {cp.returncode}\n{cp.out}\n{cp.err}"
    assert "ok /dev/stdout" in cp.out


def test_a_normal_users_dev_shm_is_capped(normal_user, user_policies):
    u = normal_user
    role_from(user_policies, "executor", "shm", limits='shm_max = "1M"')
    out = probe_json(_as_user(u, user_policies, "run", "--role", "shm", "--workdir", u.work, "--", "python3", "-c",
                              P_SHM_FILL, str(8 << 20)))
    assert out == {"written": 1 << 20, "error": "ENOSPC"}, out


# ---------------------------------------------------------------- the selftest gate

def test_the_selftest_gate_host_devices_passes_as_root_and_as_uid_65534(tmp_path):
    from agnsup.selftest import doors_dev
    for user in (None, 65534):
        g = run_door_gates(doors_dev.RUNNERS, user)["HOST_DEVICES"]
        assert g["status"] == "PASS", (user, g)
