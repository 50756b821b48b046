"""Issue 25, door 5 and part of door 7: a root controller's cell is not host root, every home is hidden,
and /tmp is a capped tmpfs (docs/isolation.md, "Doors: identity").

Each security test plays the hostile cell with a Python probe that exits 77 (ESCAPED) when the
forbidden thing worked; paths the text gate might refuse on sight are passed in two pieces and joined in
the cell. The secrets are real: a root-owned 0600 file outside any home, another user's ~/.ssh/id_rsa (a
throwaway user with a home under a temp dir of ours), a canary in /root; all removed afterwards.
"""
from __future__ import annotations

import json
import os
import pty
import pwd
import shutil
import subprocess
import tempfile
import time

import pytest

from agnsup import backend
from agnsup.linux import userns
from conftest import Agnsup, run_door_gates, write_role

ESCAPED = 77
TMPFS_MAGIC = "tmpfs"

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="ENV_BLOCKED: root (the tests make a user, root-owned "
                                                          "secrets, and run agnsup as root)")

READ_SECRETS = r'''
import sys
got = []
for a, b in zip(sys.argv[1::2], sys.argv[2::2]):
    p = a + b
    try:
        with open(p) as f:
            got.append((p, f.read().strip()))
    except OSError as e:
        print("refused", p, e.strerror)
for p, text in got:
    print("READ", p, text)
sys.exit(77 if got else 0)
'''


def _split(path: str) -> list[str]:
    return [path[:len(path) - 3], path[len(path) - 3:]]


def _receipt(state: str) -> dict:
    found = []
    for root, _, files in os.walk(os.path.join(state, "cells")):
        found += [os.path.join(root, f) for f in files if f == "receipt.json"]
    assert len(found) == 1, found
    with open(found[0]) as f:
        return json.load(f)


class Secrets:
    """A root-owned 0600 file outside any home, another user's ~/.ssh/id_rsa, a canary in /root."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="agnsup-doors-", dir="/var/tmp")
        os.chmod(self.dir, 0o755)
        tag = os.urandom(4).hex()
        self.root_only = os.path.join(self.dir, "root-only.key")
        self._write(self.root_only, f"ROOT-ONLY-{tag}", 0o600)
        self.user = "agnsup-d" + tag[:6]
        self.home = os.path.join(self.dir, "home", self.user)
        os.makedirs(os.path.dirname(self.home))
        subprocess.run(["useradd", "-m", "-d", self.home, "-s", "/bin/sh", self.user], check=True,
                       capture_output=True)
        pw = pwd.getpwnam(self.user)
        self.uid, self.gid = pw.pw_uid, pw.pw_gid
        os.chmod(self.home, 0o755)  # a readable home: only the hiding keeps a normal user out of it
        ssh = os.path.join(self.home, ".ssh")
        os.mkdir(ssh, 0o700)
        self.id_rsa = os.path.join(ssh, "id_rsa")
        self._write(self.id_rsa, f"OTHER-KEY-{tag}", 0o600)
        self.notes = os.path.join(self.home, "notes.txt")  # world-readable: a normal user reads it on 215dff3
        self._write(self.notes, f"OTHER-NOTES-{tag}", 0o644)
        for p in (ssh, self.id_rsa, self.notes):
            os.chown(p, self.uid, self.gid)
        self.root_canary = os.path.join("/root", f"agnsup-doors-canary-{tag}")
        self._write(self.root_canary, f"ROOT-HOME-{tag}", 0o600)

    @staticmethod
    def _write(path: str, text: str, mode: int) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        with os.fdopen(fd, "w") as f:
            f.write(text + "\n")

    def argv(self, *paths: str) -> list[str]:
        return [piece for p in paths for piece in _split(p)]

    def remove(self) -> None:
        subprocess.run(["userdel", self.user], capture_output=True)
        shutil.rmtree(self.dir, ignore_errors=True)
        if os.path.exists(self.root_canary):
            os.unlink(self.root_canary)


@pytest.fixture(scope="module")
def secrets():
    s = Secrets()
    try:
        yield s
    finally:
        s.remove()


# ------------------------------------------------------------------ root-only files, other homes, /root

@pytest.mark.parametrize("role", ["readonly", "executor", "networked"])
def test_root_only_files_other_homes_and_root_are_unreadable_from_a_cell_of_each_shipped_role(
        agnsup, worktree, secrets, role):
    cp = agnsup("run", "--role", role, "--workdir", worktree, "--", "python3", "-c", READ_SECRETS,
                *secrets.argv(secrets.root_only, secrets.id_rsa, secrets.root_canary))
    assert cp.returncode == 0, f"the cell read a secret (exit {cp.returncode}):\n{cp.out}{cp.err}"
    assert cp.out.count("refused") == 3, cp.out


def test_a_state_root_and_a_0600_socket_made_after_a_long_running_cell_started_are_closed_to_it(agnsup, worktree, secrets):
    late = os.path.join(secrets.dir, "late-state")
    marker = os.path.join(worktree, "go")
    probe = r'''
import os, sys, time
late, marker = sys.argv[1] + sys.argv[2], sys.argv[3]
deadline = time.time() + 60
while not os.path.exists(marker) and time.time() < deadline:
    time.sleep(0.05)
escaped = False
try:
    names = os.listdir(late)
    print("LISTED", names)
    with open(os.path.join(late, "journal.db"), "rb") as f:
        print("READ journal", len(f.read()))
    escaped = True
except OSError as e:
    print("refused", e.strerror)
import socket
s = socket.socket(socket.AF_UNIX)
try:
    s.connect(sys.argv[4] + sys.argv[5])
    print("CONNECTED to the 0600 socket")
    escaped = True
except OSError as e:
    print("refused socket", e.strerror)
sys.exit(77 if escaped else 0)
'''
    import socket
    sock_path = os.path.join(secrets.dir, "control.sock")
    # live: the marker the host makes below must reach the running cell (a capturing cell sees its worktree
    # as it was when it started, and would wait out its 60 s deadline)
    p = agnsup.popen("run", "--role", "executor", "--changes", "live", "--workdir", worktree, "--", "python3", "-c",
                     probe,
                     *_split(late), marker, *_split(sock_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    listener = socket.socket(socket.AF_UNIX)
    try:
        time.sleep(1.0)  # the cell is running, waiting for the marker
        Agnsup(late)("run", "--workdir", worktree, "--", "true", check=0)  # a real state root, 0700, by root
        assert os.path.exists(os.path.join(late, "journal.db"))
        listener.bind(sock_path)  # a control socket made later, 0600 (as serve makes its own)
        os.chmod(sock_path, 0o600)
        listener.listen(1)
        open(marker, "w").close()
        out, err = p.communicate(timeout=90)
    finally:
        listener.close()
        if p.poll() is None:
            p.kill()
            p.wait()
        backend.choose(late).purge()
        if os.path.exists(sock_path):
            os.unlink(sock_path)
    assert p.returncode == 0, f"the cell reached the later state root or socket (exit {p.returncode}):\n{out}{err}"
    # DAC refuses the 0600 socket (EACCES); on an overlay (the v2 guest's /var/tmp) the cell's lookup lands on
    # the overlay's inode, which no listener is bound to: ECONNREFUSED, nothing reached either
    fstype = subprocess.run(["findmnt", "-no", "FSTYPE", "-T", secrets.dir], capture_output=True, text=True).stdout
    refusals = [b"refused socket Permission denied"] + ([b"refused socket Connection refused"]
                                                        if fstype.strip() == "overlay" else [])
    assert b"refused Permission denied" in out and any(r in out for r in refusals), (out, fstype)


# ------------------------------------------------------------------ the worktree, as root of a namespace

GIT_JOB = r'''set -e
id -u
head -1 /proc/self/uid_map
touch made-by-cell
echo more >> owned-by-user
git init -q repo
cd repo
echo one > a.txt
git add a.txt
git -c user.name=cell -c user.email=cell@example.invalid commit -q -m first
echo two > a.txt
git stash -q
git stash list | wc -l
git log --oneline | wc -l
'''


def test_the_executor_is_root_of_a_user_namespace_whose_worktree_writes_land_with_the_right_owners(
        agnsup, worktree, secrets):
    owned = os.path.join(worktree, "owned-by-user")
    with open(owned, "w") as f:
        f.write("user's\n")
    os.chown(owned, secrets.uid, secrets.gid)
    with open(os.path.join(worktree, "job.sh"), "w") as f:
        f.write(GIT_JOB)
    cp = agnsup("run", "--role", "executor", "--workdir", worktree, "--", "sh", "job.sh", check=0)
    lines = cp.out.split()
    assert lines[0] == "0", cp.out                                  # root in the cell ...
    assert lines[1:4] != ["0", "0", "4294967295"], cp.out           # ... not the host's root ...
    base, _, count = userns.cell_range()
    assert lines[1:4] == ["0", str(base), str(count)], cp.out       # ... but of a namespace mapped to the cells' range
    assert lines[4:6] == ["1", "1"], cp.out                         # one stash, one commit
    assert os.stat(os.path.join(worktree, "made-by-cell")).st_uid == 0   # on disk: the worktree's root
    assert os.stat(owned).st_uid == secrets.uid                          # an existing file keeps its owner
    assert os.stat(os.path.join(worktree, "repo", ".git", "HEAD")).st_uid == 0
    iso = _receipt(agnsup.state)["isolation"]
    assert iso["mapped_uid"] is True and iso["worktree_idmapped"] is True and iso["cell_host_uid"] == base


def test_a_worktree_owned_by_a_normal_user_is_writable_and_new_files_are_root_owned_on_disk(
        agnsup, tmp_path, secrets):
    wt = tmp_path / "userwt"
    wt.mkdir()
    os.chown(wt, secrets.uid, secrets.gid)
    os.chmod(wt, 0o755)
    cp = agnsup("run", "--role", "executor", "--workdir", str(wt), "--", "sh", "-c",
                "echo hi > new.txt && mkdir sub && echo ok", check=0)
    assert cp.out.strip() == "ok"
    assert os.stat(wt / "new.txt").st_uid == 0 and os.stat(wt / "sub").st_uid == 0
    assert os.stat(wt).st_uid == secrets.uid


# The base interpreter's setuptools may predate PEP 660 editable installs without `wheel`, and a cell
# without network has no index: the cell's venv also sees this run's setuptools (a .pth line), as a
# venv sees a wheelhouse
PROJECT = '''from setuptools import setup
setup(name="tinyproj", version="0.1", packages=["tinyproj"])
'''


def test_a_venv_made_in_the_cell_runs_and_installs_a_local_project_without_network(agnsup, worktree):
    import sys
    proj = os.path.join(worktree, "proj")
    os.makedirs(os.path.join(proj, "tinyproj"))
    with open(os.path.join(proj, "setup.py"), "w") as f:
        f.write(PROJECT)
    with open(os.path.join(proj, "tinyproj", "__init__.py"), "w") as f:
        f.write("ANSWER = 42\n")
    base = os.path.join(sys.base_prefix, "bin", "python3")
    import importlib.util  # not `import setuptools`: it replaces distutils for every later test's pip import
    site = os.path.dirname(os.path.dirname(importlib.util.find_spec("setuptools").origin))
    ver = "%d.%d" % sys.version_info[:2]
    with open(os.path.join(worktree, "venv.sh"), "w") as f:
        f.write(f"set -e\n{base} -m venv --without-pip --system-site-packages v\n"
                f"echo {site} > v/lib/python{ver}/site-packages/run-setuptools.pth\n"
                "v/bin/python -m pip install -q --no-index --no-build-isolation -e proj\n"
                "cd / && $OLDPWD/v/bin/python -c 'import tinyproj; print(tinyproj.ANSWER)'\n")
    cp = agnsup("run", "--role", "executor", "--workdir", worktree, "--", "sh", "venv.sh", timeout=300)
    assert cp.returncode == 0, cp.out + cp.err
    assert cp.out.strip().splitlines()[-1] == "42", cp.out


def test_dev_stdout_reopens_for_a_mapped_cell_through_a_pipe_a_capture_file_and_a_pty(agnsup, worktree, state):
    from agnsup.tool import run_process
    cp = agnsup("run", "--role", "executor", "--workdir", worktree, "--", "sh", "-c",
                "echo out > /dev/stdout && echo err > /dev/stderr", check=0)
    assert cp.out == "out\n" and cp.err == "err\n"
    res = run_process(["sh", "-c", "echo cap > /dev/stdout && echo caperr > /dev/stderr"], state_dir=state,
                      workdir=worktree, capture=True, timeout=60)
    assert res["exit_code"] == 0 and res["stdout"] == "cap\n" and res["stderr"] == "caperr\n", res
    master, slave = pty.openpty()
    try:
        p = agnsup.popen("run", "--role", "executor", "--workdir", worktree, "--", "sh", "-c",
                         "echo tty > /dev/stdout && echo ok-$(id -u) > /dev/tty", stdin=slave, stdout=slave,
                         stderr=slave)
        p.wait(timeout=60)
        os.close(slave)
        slave = None
        out = b""
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:
                break
            if not chunk:
                break
            out += chunk
    finally:
        if slave is not None:
            os.close(slave)
        os.close(master)
    assert p.returncode == 0, out
    assert b"tty" in out and b"ok-0" in out, out


def test_a_users_own_file_a_mapped_cell_could_not_reopen_gets_everything_uncapped(agnsup, worktree, policy_dir,
                                                                                   tmp_path):
    # agnsup run ... > out.txt (root's, 0644): the cell writes a pipe of its own, pumped into the file,
    # never capped by output_max (as the very descriptor would not be), and /dev/stdout reopens
    write_role(policy_dir, "smallcap", limits__output_max='"64K"')
    out = tmp_path / "out.txt"
    prog = "import sys\nsys.stdout.write('z' * (1 << 20))\nsys.stdout.flush()\nopen('/dev/stdout', 'a').write('end')\n"
    with open(out, "wb") as f:
        p = agnsup.popen("run", "--role", "smallcap", "--workdir", worktree, "--", "python3", "-c", prog,
                         env={"AGNSUP_POLICY_DIR": str(policy_dir)}, stdout=f, stderr=subprocess.PIPE,
                         stdin=subprocess.DEVNULL)
        _, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    assert out.read_bytes() == b"z" * (1 << 20) + b"end"


# ------------------------------------------------------------------ /tmp: a capped tmpfs

TMP_FILL = r'''
import os, sys, time
with open("/proc/self/mountinfo") as f:
    fstype = [l.split(" - ")[1].split()[0] for l in f if l.split()[4] == "/tmp"][-1]
print("fstype", fstype)
with open("/tmp/kept", "wb") as f:
    f.write(b"k" * (300 * 1024))
print("kept written", flush=True)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.05)
try:
    with open("/tmp/fill", "wb") as f:
        for _ in range(64):
            f.write(b"x" * (64 * 1024))
            f.flush()
    print("FILLED past the cap")
    sys.exit(77)
except OSError as e:
    print("refused", e.strerror)
'''


def test_tmp_is_a_capped_tmpfs_off_the_state_roots_disk_and_the_receipt_counts_it(agnsup, worktree, policy_dir,
                                                                                    state):
    write_role(policy_dir, "tmpcap", limits__tmp_max='"1M"')
    marker = os.path.join(worktree, "fill-now")
    # live: the cell waits for the marker the test writes into its worktree (a captured cell would not see it)
    p = agnsup.popen("run", "--role", "tmpcap", "--workdir", worktree, "--changes", "live", "--", "python3", "-c",
                     TMP_FILL, marker, env={"AGNSUP_POLICY_DIR": str(policy_dir)}, stdout=subprocess.PIPE,
                     stderr=subprocess.PIPE)
    try:
        first = p.stdout.readline() + p.stdout.readline()
        assert b"kept written" in first, first
        staged = [os.path.join(r, f) for r, _, fs in os.walk(os.path.join(state, "cells")) for f in fs]
        open(marker, "w").close()
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    out = first + out
    assert p.returncode == 0, f"the cell wrote past limits.tmp_max (exit {p.returncode}):\n{out}{err}"
    assert b"fstype tmpfs" in out and b"No space left on device" in out, out
    assert not [f for f in staged if f.endswith("/kept")], staged  # nothing of it on the state root's disk
    r = _receipt(state)
    assert r["limits"]["tmp_max"] == 1024 * 1024
    assert 300 * 1024 <= r["usage"]["tmp_bytes"] <= 1024 * 1024, r["usage"]


def test_a_tmp_max_below_64k_is_refused_with_one_line_and_nothing_starts(agnsup, worktree, policy_dir):
    write_role(policy_dir, "tinytmp", limits__tmp_max='"4K"')
    cp = agnsup("run", "--role", "tinytmp", "--workdir", worktree, "--", "true",
                env={"AGNSUP_POLICY_DIR": str(policy_dir)})
    assert cp.returncode == 125, cp.err
    assert "limits.tmp_max" in cp.err and "64K" in cp.err and len(cp.err.strip().splitlines()) == 1, cp.err


def test_host_root_opts_out_and_the_receipt_says_so(agnsup, worktree, policy_dir):
    write_role(policy_dir, "hostroot", isolation__host_root="true")
    cp = agnsup("run", "--role", "hostroot", "--workdir", worktree, "--", "sh", "-c", "head -1 /proc/self/uid_map",
                env={"AGNSUP_POLICY_DIR": str(policy_dir)}, check=0)
    assert cp.out.split() == ["0", "0", "4294967295"]
    assert _receipt(agnsup.state)["isolation"]["mapped_uid"] is False


PID1_LINKS = """
import os
for link in ("cwd", "exe", "root"):
    try:
        print("WORKED", link, os.readlink("/proc/1/" + link))
    except OSError as e:
        print("refused", link, e.strerror)
for name in ("environ", "mem"):
    try:
        open("/proc/1/" + name, "rb").close()
        print("WORKED", name)
    except OSError as e:
        print("refused", name, e.strerror)
"""


def test_a_host_root_cell_cannot_read_its_inits_proc_links_or_memory(agnsup, worktree, policy_dir):
    """The PID namespace's init takes the command's confinement (the same uid, the same capabilities) and starts
    it: a host-root cell's init changes no credential on the way, so only its PR_SET_DUMPABLE 0 keeps the command
    out of /proc/1's links (the fork server's interpreter), environment and memory (process/steps.py "after_credentials")."""
    write_role(policy_dir, "hostroot", isolation__host_root="true")
    cp = agnsup("run", "--role", "hostroot", "--workdir", worktree, "--", "python3", "-c", PID1_LINKS,
                env={"AGNSUP_POLICY_DIR": str(policy_dir)}, check=0)
    assert _receipt(agnsup.state)["isolation"]["pid_namespace"] is True
    assert "WORKED" not in cp.out and cp.out.count("refused") == 5, cp.out + cp.err


def test_require_mapped_uid_with_host_root_is_a_policy_error(agnsup, worktree, policy_dir):
    write_role(policy_dir, "contradict", isolation__host_root="true", isolation__require='["mapped_uid"]')
    cp = agnsup("run", "--role", "contradict", "--workdir", worktree, "--", "true",
                env={"AGNSUP_POLICY_DIR": str(policy_dir)})
    assert cp.returncode == 125 and "mapped_uid" in cp.err, cp.err


# ------------------------------------------------------------------ a normal user's cells: other homes hidden

def test_a_normal_users_cell_does_not_see_another_users_readable_home(secrets):
    from test_unprivileged import User, _venv
    with User(_venv()) as u:
        wt = u.own_dir("wt")
        # the user's agnsup imports what this run imports (PYTHONPATH: another checkout, e.g. to check 215dff3)
        env = {**u.env, **{k: os.environ[k] for k in ("PYTHONPATH", "AGNSUP_POLICY_DIR") if k in os.environ}}
        cp = u("run", "--workdir", wt, "--", "python3", "-c", READ_SECRETS, *secrets.argv(secrets.notes), env=env)
    assert cp.returncode == 0, f"the cell read another user's home (exit {cp.returncode}):\n{cp.stdout}{cp.stderr}"
    assert "refused" in cp.stdout, cp.stdout + cp.stderr


FILL_2M = r'''
import sys
with open("/proc/self/mountinfo") as f:
    print("/tmp is", [l.split(" - ")[1].split()[0] for l in f if l.split()[4] == "/tmp"][-1])
try:
    with open("/tmp/fill", "wb") as f:
        for _ in range(32):
            f.write(b"x" * 65536)
            f.flush()
    sys.exit(77)
except OSError as e:
    print("refused", e.strerror)
'''


def test_a_normal_users_cell_gets_a_capped_tmpfs_tmp_too():
    from test_unprivileged import User, _venv
    with User(_venv()) as u:
        pol = os.path.join(u.home, "policies")
        os.mkdir(pol, 0o755)
        write_role(pol, "tmpcap", limits__tmp_max='"1M"')
        wt = u.own_dir("wt")
        env = {**u.env, "AGNSUP_POLICY_DIR": pol, **{k: os.environ[k] for k in ("PYTHONPATH",) if k in os.environ}}
        cp = u("run", "--role", "tmpcap", "--workdir", wt, "--", "python3", "-c", FILL_2M, env=env)
    assert cp.returncode == 0, f"the cell wrote 2M past a 1M /tmp (exit {cp.returncode}):\n{cp.stdout}{cp.stderr}"
    assert "/tmp is tmpfs" in cp.stdout and "No space left on device" in cp.stdout, cp.stdout


# ------------------------------------------------------------------ the selftest's gates

def test_the_identity_selftest_gates_pass_here():
    from agnsup.process import namespaces
    from agnsup.selftest import doors_identity
    # where the selftest's scratch cannot be id-mapped (the v2 guest's /var/tmp is 9p under an overlay), a
    # root controller's cell runs as host root: ROOT_ONLY_FILES must then say so, never PASS
    unmappable = namespaces.idmap_refused(os.environ.get("AGNSUP_SELFTEST_DIR", "/var/tmp"))
    for g in run_door_gates(doors_identity.RUNNERS).values():
        blocked = g["status"].startswith("ENV_BLOCKED") and (
            g["gate"] == "OTHER_HOMES"  # a host with no other home
            or (g["gate"] == "ROOT_ONLY_FILES" and unmappable and "mapped_uid" in g["status"]))
        assert g["status"] == "PASS" or blocked, (g, unmappable)


# ------------------------------------------------------------------ pure parts

def test_the_cell_range_comes_from_an_agnsup_subuid_entry_else_the_default(tmp_path):
    sub = tmp_path / "subuid"
    sub.write_text("alice:100000:65536\nagnsup:3000000:65536\n")
    small = tmp_path / "small"
    small.write_text("agnsup:3000000:1000\n")
    assert userns.cell_range(str(sub), str(sub)) == (3000000, 3000000, 65536)
    assert userns.cell_range(str(small), str(tmp_path / "none")) == (userns.DEFAULT_BASE, userns.DEFAULT_BASE, 65536)
    base = userns.cell_range()[0]
    assert userns.is_cell_uid(base) and userns.is_cell_uid(base + 65535)
    assert not userns.is_cell_uid(base - 1) and not userns.is_cell_uid(base + 65536) and not userns.is_cell_uid(0)
    # the default stays clear of systemd's nspawn and foreign ranges and of 2^31 (UIDS-GIDS.md)
    assert 1879048192 <= userns.DEFAULT_BASE and userns.DEFAULT_BASE + 65536 <= 0x7FFE0000


def test_the_password_files_homes_are_read_again_when_it_changes(tmp_path):
    from agnsup.linux import host
    f = tmp_path / "passwd"
    f.write_text("root:x:0:0:root:/root:/bin/sh\nweird:x:1:1::relative:/bin/sh\nann:x:1000:1000::/home//ann/:/bin/sh\n")
    assert host.passwd_homes(str(f)) == ["/root", "/home/ann"]
    f.write_text(f.read_text() + "bob:x:1001:1001::/srv/bob:/bin/sh\n")
    assert host.passwd_homes(str(f)) == ["/root", "/home/ann", "/srv/bob"]
    assert "/root" in host.all_homes()  # the real file again


def test_every_home_but_the_systems_own_is_hidden(tmp_path):
    from agnsup.linux import host
    homes = host.all_homes()
    assert "/root" in homes
    for h in homes:
        assert h != "/" and not any(host.under(h, d) for d in host.OS_TREES), h
        assert not host.under(h, "/tmp")



PURE_HOST = {"seccomp": None, "landlock": None, "landlock_scopes": None, "no_new_privs": None, "pid_namespace": None,
             "capabilities": None, "mapped_uid": None, "_abi": 7, "_root": True, "_cap_last": 40}


def _plan(tmp_path, host, role="executor"):
    from agnsup import compiler, policy, spec
    from agnsup.request import CellRequest
    wt = tmp_path / "wt"
    wt.mkdir(exist_ok=True)
    s = spec.build(CellRequest.make(["true"], workdir=str(wt), role=role), policy.load(role))
    return compiler.compile_plan(s, policy.load(role), str(tmp_path / "state"), host)


def test_a_worktree_that_cannot_be_id_mapped_runs_as_host_root_and_the_plan_says_why(tmp_path, policy_dir,
                                                                                    monkeypatch):
    from agnsup.errors import SetupError
    wt = str(tmp_path / "wt")
    ok = _plan(tmp_path, {**PURE_HOST, "_idmap": lambda path: None})
    base, gbase, count = userns.cell_range()
    assert ok.mapped == {"uid": base, "gid": gbase, "count": count} and ok.cell_ids() == (base, gbase)
    assert ("idclone", wt, "worktree", False) in ok.mount_ops and ok.protections()["worktree_idmapped"]
    refused = {**PURE_HOST, "_idmap": lambda path: f"the file system of {path} cannot be id-mapped here (9p)"}
    p = _plan(tmp_path, refused)
    assert p.mapped is None and not any(op[0] == "idclone" for op in p.mount_ops)
    assert [m for m in p.not_in_force if m.startswith("mapped_uid (the cell runs as host root)") and "9p" in m]
    monkeypatch.setenv("AGNSUP_POLICY_DIR", str(policy_dir))
    write_role(policy_dir, "needsmap", isolation__require='["mapped_uid"]')
    with pytest.raises(SetupError, match="requires mapped_uid.*9p"):
        _plan(tmp_path, refused, role="needsmap")
    # a normal user's controller: the caller's own uid, nothing mapped, nothing missing
    mine = _plan(tmp_path, {**PURE_HOST, "_root": False, "_idmap": lambda path: "never asked"})
    assert mine.mapped is None and not [m for m in mine.not_in_force if "mapped_uid" in m]
