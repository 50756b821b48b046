"""What the mount and network namespaces keep from a cell (issue 2 subset of spec/isolation.md)."""
import os
import socket
import threading

import pytest


def _mountinfo():
    with open("/proc/self/mountinfo") as f:
        return sorted(" ".join(line.split()[3:5]) for line in f)


@pytest.mark.serial("compares the host's whole mount table before and after")
def test_tmp_is_private_and_the_host_mount_table_is_unchanged(agnsup, worktree):
    before = _mountinfo()
    agnsup("run", "--workdir", worktree, "--", "sh", "-c", "echo secret > /tmp/agnsup-private-probe", check=0)
    assert not os.path.exists("/tmp/agnsup-private-probe")
    assert _mountinfo() == before


def test_on_shared_mounts_nothing_a_cell_mounts_reaches_the_host(tmp_path):
    """systemd makes every mount shared: a clone of a shared mount joins its peer group, so a mount
    made on it inside the cell (a cache under the cell's HOME in its /tmp, a mask inside the
    worktree) would appear on the host too. Here the state root and the worktree live on a shared
    tmpfs of the test's own; the cell mounts caches there (executor: filesystem.cache) and its
    worktree inside its /tmp (the worktree is under the host's /tmp)."""
    import subprocess
    from agnsup import backend
    from conftest import Agnsup
    top = tmp_path / "shared"
    top.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(top)], check=True)
    try:
        subprocess.run(["mount", "--make-shared", str(top)], check=True)
        state, wt = str(top / "state"), top / "wt"
        wt.mkdir()
        before = [m for m in _mountinfo() if str(top) in m]
        Agnsup(state)("run", "--role", "executor", "--workdir", str(wt), "--", "true", check=0)
        after = [m for m in _mountinfo() if str(top) in m]
        assert after == before, f"the host gained {sorted(set(after) - set(before))}"
        assert backend.choose(state).purge() == []
    finally:
        subprocess.run(["umount", "-R", "-l", str(top)], check=False)


def test_the_state_root_cannot_be_read_from_a_cell(agnsup, worktree):
    agnsup("run", "--workdir", worktree, "--", "true", check=0)  # the journal exists now
    probe = ("import os, sys\nprint(os.listdir(sys.argv[1]))\n"
             "try: open(sys.argv[1] + '/journal.db', 'rb').read(); print('READ')\nexcept OSError as e: print(e)")
    cp = agnsup("run", "--workdir", worktree, "--", "python3", "-c", probe, agnsup.state, check=None)
    assert "READ" not in cp.out
    assert "journal.db" not in cp.out


def test_other_state_roots_on_the_host_cannot_be_read_from_a_cell(agnsup, worktree, tmp_path):
    """Issue 12 item 14: every state root agnsup knows on this host is hidden from a cell,
    not only the cell's own (a registry notes each root agnsup used)."""
    import shutil
    import tempfile
    from agnsup import backend
    from agnsup.store.state import StateRoot
    top = tempfile.mkdtemp(prefix="agnsup-test-", dir="/var/tmp")  # not under /tmp: a cell has its own /tmp
    other = os.path.join(top, "state")
    try:
        agnsup("run", "--state-dir", other, "--workdir", worktree, "--", "true", check=0)
        assert other in StateRoot(agnsup.state).other_roots()
        probe = ("import os, sys\nfor p in sys.argv[1:]:\n try: print(p, os.listdir(p))\n"
                 " except OSError as e: print(p, e.strerror)")
        roots = [other] + [p for p in ("/var/lib/agnsup",) if os.path.isdir(p)]
        cp = agnsup("run", "--workdir", worktree, "--", "python3", "-c", probe, *roots, check=0)
        assert f"{other} []" in cp.out or f"{other} Permission denied" in cp.out, cp.out
        assert "journal.db" not in cp.out and "controllers" not in cp.out, cp.out
    finally:
        leaked = backend.choose(other).purge()
        shutil.rmtree(top, ignore_errors=True)
    assert not leaked, leaked


def test_a_state_root_inside_a_worktree_is_refused(agnsup, worktree, tmp_path):
    """Issue 12 item 14: a state root inside a git worktree is refused before anything is made
    (a `git clean -fdx` there would take the journal and every receipt)."""
    repo = tmp_path / "repo"
    (repo / ".git").mkdir(parents=True)
    state = repo / "build" / "state"
    cp = agnsup("run", "--state-dir", str(state), "--workdir", worktree, "--", "true", check=125)
    assert f"is inside the worktree {repo}" in cp.err and cp.err.count("\n") == 1
    assert not state.exists()


# Kernel probes are written in Python so that the text gate (which would refuse
# `echo x > /etc/...` up front) lets them through: these tests are about what
# the kernel stops.
WRITE_PROBE = ("import sys\nfor p in sys.argv[1:]:\n try:\n  open(p, 'w').write('x'); print('WROTE', p)\n"
               " except OSError as e: print('refused', p, e.strerror)\n")


def test_the_worktree_is_writable_and_the_rest_is_read_only(agnsup, worktree):
    cp = agnsup("run", "--workdir", worktree, "--", "python3", "-c", WRITE_PROBE, "made-here", "/etc/agnsup-probe",
                check=0)
    assert os.path.exists(os.path.join(worktree, "made-here"))
    assert "refused /etc/agnsup-probe Read-only file system" in cp.out and not os.path.exists("/etc/agnsup-probe")


def test_the_readonly_role_cannot_write_its_worktree(agnsup, worktree):
    cp = agnsup("run", "--role", "readonly", "--workdir", worktree, "--", "python3", "-c", WRITE_PROBE,
                "x", "/tmp/y", check=0)
    assert "refused x" in cp.out and "WROTE /tmp/y" in cp.out
    assert not os.path.exists(os.path.join(worktree, "x"))


def test_deny_paths_are_masked(agnsup, worktree):
    # a masked file reads as empty (/dev/null is bound over it), a masked directory is an empty tmpfs
    # the path is assembled inside the cell so the text gate cannot refuse it first
    probe = "import sys\np = sys.argv[1] + sys.argv[2]\nprint(p, len(open(p).read()))"
    cp = agnsup("run", "--workdir", worktree, "--", "python3", "-c", probe, "/etc/", "shadow", check=0)
    assert cp.out.strip() == "/etc/shadow 0"
    assert os.path.getsize("/etc/shadow") > 0


def test_with_network_denied_a_cell_cannot_reach_the_hosts_loopback(agnsup, worktree):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(5)
    srv.settimeout(0.2)
    port = srv.getsockname()[1]
    got = []

    def accept():
        for _ in range(25):
            try:
                c, _ = srv.accept()
                got.append(c.recv(100))
                c.close()
            except socket.timeout:
                continue

    t = threading.Thread(target=accept)
    t.start()
    probe = ("import socket\ns=socket.socket()\ns.settimeout(2)\n"
             f"try:\n s.connect(('127.0.0.1',{port})); s.send(b'LEAK'); print('CONNECTED')\n"
             "except OSError as e: print('refused', e)\n")
    cp = agnsup("run", "--workdir", worktree, "--", "python3", "-c", probe, check=0)
    t.join()
    srv.close()
    assert "refused" in cp.out and got == []


def test_the_network_namespace_has_only_loopback_up(agnsup, worktree):
    cp = agnsup("run", "--workdir", worktree, "--", "cat", "/proc/net/dev", check=0)
    ifaces = [line.split(":")[0].strip() for line in cp.out.splitlines()[2:]]
    assert ifaces == ["lo"]


def test_a_root_cell_cannot_write_its_pid_into_any_cgroup_procs_outside_its_own(agnsup, worktree):
    probe = (
        "import ctypes, glob, os\n"
        "me = str(os.getpid())\n"
        "for f in sorted(set(glob.glob('/sys/fs/cgroup/**/cgroup.procs', recursive=True))):\n"
        "    try:\n"
        "        open(f, 'w').write(me); print('ESCAPED', f)\n"
        "    except OSError:\n"
        "        pass\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "if libc.mount(None, b'/sys/fs/cgroup', None, 32 | 4096, None) == 0: print('REMOUNTED')\n"
        "print(open('/proc/self/status').read().split('CapBnd:')[1].split()[0])\n")
    cp = agnsup("run", "--workdir", worktree, "--", "python3", "-c", probe, check=0)
    assert "ESCAPED" not in cp.out and "REMOUNTED" not in cp.out
    capbnd = int(cp.out.split()[-1], 16)
    assert not capbnd & (1 << 21), "CAP_SYS_ADMIN still in the bounding set"


def test_the_private_tmp_looks_like_a_real_tmp(agnsup, worktree):
    cp = agnsup("run", "--workdir", worktree, "--", "stat", "-c", "%a", "/tmp", check=0)
    assert cp.out.strip() == "1777"
