"""What the mount and network namespaces keep from a cell (issue 2 subset of spec/isolation.md)."""
import os
import socket
import threading

import pytest


def _mountinfo():
    with open("/proc/self/mountinfo") as f:
        return sorted(" ".join(line.split()[3:5]) for line in f)


def test_tmp_is_private_and_the_host_mount_table_is_unchanged(agnsup, worktree):
    before = _mountinfo()
    agnsup("run", "--workdir", worktree, "--", "sh", "-c", "echo secret > /tmp/agnsup-private-probe", check=0)
    assert not os.path.exists("/tmp/agnsup-private-probe")
    assert _mountinfo() == before


def test_the_state_root_cannot_be_read_from_a_cell(agnsup, worktree):
    agnsup("run", "--workdir", worktree, "--", "true", check=0)  # the journal exists now
    cp = agnsup("run", "--workdir", worktree, "--", "sh", "-c",
                f"ls -a {agnsup.state}; cat {agnsup.state}/journal.db && echo READ", check=None)
    assert "READ" not in cp.out
    assert "journal.db" not in cp.out


def test_the_worktree_is_writable_and_the_rest_is_read_only(agnsup, worktree):
    cp = agnsup("run", "--workdir", worktree, "--", "sh", "-c",
                "echo ok > made-here && (echo x > /etc/agnsup-probe 2>/dev/null && echo ETC_WRITTEN || echo etc-refused)",
                check=0)
    assert os.path.exists(os.path.join(worktree, "made-here"))
    assert "etc-refused" in cp.out and not os.path.exists("/etc/agnsup-probe")


def test_the_readonly_role_cannot_write_its_worktree(agnsup, worktree):
    cp = agnsup("run", "--role", "readonly", "--workdir", worktree, "--", "sh", "-c",
                "touch x 2>/dev/null && echo WROTE || echo refused; touch /tmp/y && echo tmp-ok", check=0)
    assert "refused" in cp.out and "tmp-ok" in cp.out
    assert not os.path.exists(os.path.join(worktree, "x"))


def test_deny_paths_are_masked(agnsup, worktree):
    # a masked file reads as empty (/dev/null is bound over it), a masked directory is an empty tmpfs
    cp = agnsup("run", "--workdir", worktree, "--", "sh", "-c", "cat /etc/shadow | wc -c", check=0)
    assert cp.out.strip() == "0"
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
    pyroute2 = pytest.importorskip("pyroute2")
    del pyroute2
    cp = agnsup("run", "--workdir", worktree, "--", "cat", "/proc/net/dev", check=0)
    ifaces = [line.split(":")[0].strip() for line in cp.out.splitlines()[2:]]
    assert ifaces == ["lo"]


def test_a_root_cell_cannot_write_its_pid_into_any_cgroup_procs_outside_its_own(agnsup, worktree):
    targets = ["/sys/fs/cgroup/unified/cgroup.procs", "/sys/fs/cgroup/memory/cgroup.procs",
               "/sys/fs/cgroup/pids/cgroup.procs", "/sys/fs/cgroup/cgroup.procs"]
    script = "; ".join(f"(echo $$ > {t}) 2>/dev/null && echo ESCAPED {t}" for t in targets)
    script += "; for f in $(find /sys/fs/cgroup -maxdepth 6 -name cgroup.procs 2>/dev/null); do " \
              "(echo $$ > $f) 2>/dev/null && echo ESCAPED $f; done; cat /proc/self/cgroup; " \
              "mount -o remount,rw /sys/fs/cgroup 2>/dev/null && echo REMOUNTED; grep CapBnd /proc/self/status"
    cp = agnsup("run", "--workdir", worktree, "--", "sh", "-c", script, check=0)
    assert "ESCAPED" not in cp.out and "REMOUNTED" not in cp.out
    capbnd = int(cp.out.split("CapBnd:")[1].split()[0], 16)
    assert not capbnd & (1 << 21), "CAP_SYS_ADMIN still in the bounding set"
