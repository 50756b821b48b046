"""The container recipe with the fewest privileges, reproduced on this host without an engine (issue 27).

- A container's /dev is mounted nosuid (Docker's, Podman's): a normal user's cell copies it into a mount
  namespace its own user namespace owns, where the kernel locks that flag (mount_namespaces(7), "locked
  mounts"); a read-only remount of a mask that drops it is refused (EPERM). Reproduced here in a private
  mount namespace whose /dev the test remounts nosuid before the user's agnsup starts in it.
- The recipe gives the container CAP_SYS_ADMIN, not CAP_NET_ADMIN: a root controller without it gives each
  cell a network namespace owned by a user namespace of its own, lo up (linux/netns.py). Reproduced here by
  starting agnsup with CAP_NET_ADMIN out of its bounding set (setpriv).
"""
import errno
import http.server
import json
import os
import platform
import socket
import subprocess
import sys
import threading

import pytest

from agnsup.linux import sys as lsys
from conftest import BIN, Agnsup, seccomp_launcher, write_role

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="ENV_BLOCKED: root (the test makes a user and a "
                                                          "mount namespace)")


def _in_a_container_like_mount_namespace(user):
    """preexec_fn: a private mount namespace of the process about to become `user`'s agnsup, whose /dev
    is nosuid as a container's is (the host's is not); then the user's own cgroup leaf and ids."""
    def enter():
        lsys.unshare(lsys.CLONE_NEWNS)
        lsys.mount(None, "/", None, lsys.MS_REC | lsys.MS_PRIVATE)  # nothing of this reaches the host
        lsys.mount(None, "/dev", None, lsys.MS_REMOUNT | lsys.MS_BIND | lsys.MS_NOSUID)
        user._enter()
    return enter


def test_where_proc_has_masked_files_a_normal_users_cell_names_the_fix(user):
    """A container engine masks files of /proc (Docker: /proc/keys, /proc/timer_list, ... under /dev/null);
    the kernel then refuses a new proc in a user namespace (mount_too_revealing), and a normal user's PID
    namespace has no /proc of its own: one line with the fixes (Docker's systempaths=unconfined)."""
    wt = user.own_dir("wt-proc")

    def enter():
        lsys.unshare(lsys.CLONE_NEWNS)
        lsys.mount(None, "/", None, lsys.MS_REC | lsys.MS_PRIVATE)
        lsys.mount("/dev/null", "/proc/keys", None, lsys.MS_BIND)  # as Docker's masked paths
        user._enter()
    p = subprocess.Popen([user.agnsup, "run", "--workdir", wt, "--", "true"], env=user.env, cwd=user.work,
                         preexec_fn=enter, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 125, err
    assert len(err.strip().splitlines()) == 1 and "step 'proc'" in err, err
    assert "systempaths=unconfined" in err and "procMount: Unmasked" in err, err
    assert user.left() == []


def test_a_normal_users_cell_masks_files_where_dev_is_nosuid(user):
    """The mask of a file (/etc/shadow: a bind of /dev/null, then read-only) keeps the nosuid the
    kernel locked on /dev: without that the cell fails at step 'mounts' (checked by removing the fix)."""
    wt = user.own_dir("wt-nosuid")
    with open(os.path.join(wt, "probe.sh"), "w") as f:  # a script: the gate reads a command line's writes
        # a write reaches /dev/null (a device node is writable on a read-only mount) and is discarded
        f.write("echo x > /etc/shadow; cat /etc/shadow | wc -c\n"
                "grep ' /etc/shadow ' /proc/self/mountinfo | cut -d' ' -f4-6\n")
    p = subprocess.Popen([user.agnsup, "run", "--workdir", wt, "--", "sh", "probe.sh"], env=user.env,
                         cwd=user.work, preexec_fn=_in_a_container_like_mount_namespace(user),
                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    # /etc/shadow is the host's /dev/null in the cell (masked, not missing), read-only, still nosuid
    size, source, target, options = out.split()
    assert (size, source, target) == ("0", "/null", "/etc/shadow"), out
    assert {"ro", "nosuid"} <= set(options.split(",")), out
    assert user.left() == []


# -- a root controller without CAP_NET_ADMIN (Docker's recipe: --cap-add SYS_ADMIN only) -----------------------

NO_NET_ADMIN = ("setpriv", "--bounding-set", "-net_admin", "--inh-caps", "-net_admin")

CELL_NET_PROBE = r'''
import fcntl, os, socket, struct, sys
s = socket.socket()
s.bind(("127.0.0.1", 0))
s.listen()
c = socket.create_connection(s.getsockname(), timeout=5)
a, _ = s.accept()
c.sendall(b"ping")
print("loopback", a.recv(4).decode())
try:
    socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=5)
    print("REACHED-THE-HOST")
except ConnectionRefusedError:
    print("host-refused")
try:  # lo down: CAP_NET_ADMIN over this network namespace
    fcntl.ioctl(c.fileno(), 0x8914, struct.pack("16sH14x", b"lo", 0))
    print("NET-ADMIN")
except PermissionError:
    print("no-net-admin")
print(os.readlink("/proc/self/ns/net"))
'''


def _no_net_admin(agnsup, *args, env=None, timeout=120, launcher=()):
    """agnsup as root whose bounding set (so every capability set after exec) lacks CAP_NET_ADMIN."""
    if not os.access("/usr/bin/setpriv", os.X_OK):
        pytest.skip("ENV_BLOCKED: /usr/bin/setpriv (util-linux) to start agnsup without CAP_NET_ADMIN")
    cp = subprocess.run([*NO_NET_ADMIN, *launcher, BIN, *args], env={**agnsup.env, **(env or {})}, capture_output=True,
                        text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    cp.out, cp.err = cp.stdout, cp.stderr
    return cp


def _receipt(state: str) -> dict:
    [r] = json.loads(Agnsup(state)("receipts", "--json", check=0).out)
    return r


@pytest.mark.parametrize("host_root", [False, True], ids=["mapped", "host_root"])
def test_a_root_controller_without_net_admin_gives_its_cell_a_loopback_of_its_own(agnsup, worktree, policy_dir,
                                                                                   host_root):
    """Docker's recipe adds CAP_SYS_ADMIN, not CAP_NET_ADMIN: the cell's network namespace is then owned by a
    user namespace of its own (process.namespaces.cell_netns), whose lo is up. The cell talks to itself on 127.0.0.1,
    cannot reach the controller's loopback, and holds no CAP_NET_ADMIN over its namespace, also as host root:
    that namespace's owner is not root (without the fix: step 'loopback', EPERM; with root as the owner, the
    host_root cell brings lo down: both checked by removing them)."""
    write_role(policy_dir, "hostroot", isolation__host_root="true")
    with open(os.path.join(worktree, "probe.py"), "w") as f:
        f.write(CELL_NET_PROBE)
    host = socket.socket()
    host.bind(("127.0.0.1", 0))
    host.listen()
    try:
        cp = _no_net_admin(agnsup, "run", "--role", "hostroot" if host_root else "executor", "--workdir", worktree,
                           "--", "/usr/bin/python3", "probe.py", str(host.getsockname()[1]),
                           env={"AGNSUP_POLICY_DIR": str(policy_dir)})
    finally:
        host.close()
    assert cp.returncode == 0, cp.err
    lines = cp.out.split()
    assert lines[:4] == ["loopback", "ping", "host-refused", "no-net-admin"], cp.out
    assert lines[4] != os.readlink("/proc/self/ns/net")
    iso = _receipt(agnsup.state)["isolation"]
    assert iso["network_namespace"] is True and iso["mapped_uid"] is (not host_root), iso
    assert not any("network" in m for m in iso["not_in_force"]), iso


def test_an_allowlist_cell_reaches_an_allowed_name_through_the_proxy_without_net_admin(agnsup, worktree,
                                                                                        policy_dir):
    """The proxy's listener is made in the cell's own network namespace (egress/handoff.py) as before."""
    write_role(policy_dir, "pkgs", network__mode='"allowlist"', network__allow='["pkg.test:*"]',
               network__allow_private="true")  # the test's server is on the host's loopback

    class Hello(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"hello from pkg.test\n")

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hello)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        port = srv.server_address[1]
        cp = _no_net_admin(agnsup, "run", "--role", "pkgs", "--workdir", worktree, "--", "sh", "-c",
                           f"curl -fsS http://pkg.test:{port}/ && curl -fsS --max-time 5 http://127.0.0.1:{port}/ "
                           "--noproxy '*' || echo direct-refused",
                           env={"AGNSUP_POLICY_DIR": str(policy_dir),
                                "AGNSUP_TEST_EGRESS_HOSTS": json.dumps({"pkg.test": "127.0.0.1"})})
    finally:
        srv.shutdown()
        srv.server_close()
    assert cp.returncode == 0, cp.err
    assert cp.out == "hello from pkg.test\ndirect-refused\n", (cp.out, cp.err)
    r = _receipt(agnsup.state)
    assert r["network"]["allowed"] == 1, r["network"]


def test_without_net_admin_or_a_user_namespace_the_refusal_names_both_fixes(agnsup, worktree):
    """A host that also refuses the cell's own user namespace (here a seccomp filter on unshare, as a
    container's profile may): one line, the step, and both fixes."""
    if platform.machine() != "x86_64":
        pytest.skip("ENV_BLOCKED: the test's seccomp launcher names x86_64's unshare")
    launcher = os.path.join(worktree, "..", "refuse_unshare.py")
    with open(launcher, "w") as f:
        f.write(seccomp_launcher({272: errno.EPERM}))  # x86_64 unshare
    cp = _no_net_admin(agnsup, "run", "--workdir", worktree, "--", "true", launcher=(sys.executable, launcher))
    assert cp.returncode == 125, cp.err
    assert len(cp.err.strip().splitlines()) == 1, cp.err
    assert "step 'network_namespace'" in cp.err and "--cap-add NET_ADMIN" in cp.err, cp.err
    assert 'isolation.reduced = ["network_namespace"]' in cp.err, cp.err
