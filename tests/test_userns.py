"""The unprivileged cell recipe (issue 14, phase B prototype: agnsup/linux/userns.py, delegation.py).

Each kernel test runs a fresh interpreter as the "controller": it drops to an unprivileged uid (as a
normal user's agnsup would run) and forks a "cell" that makes its own user namespace; the controller
writes the cell's id maps, then the cell unshares mount and network namespaces owned by that user
namespace and builds what a cell needs. Real kernel objects; nothing is wired into the supervisor yet.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from agnsup.linux import delegation, proc, userns

NOBODY = 65534

# argv: how the controller writes the maps (ordered | gid_first | other_uid), uid and gid inside.
# Prints {"controller_uid", "maps", "cell": {...}} as JSON.
CONTROLLER = r'''
import errno, json, os, sys
from agnsup.linux import landlock, netns, seccomp, userns
from agnsup.linux import sys as lsys
how, uid_in, gid_in = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
if os.geteuid() == 0:
    os.setgroups([]); os.setgid(65534); os.setuid(65534)
    # a uid change makes a process non-dumpable and its /proc files root's (proc(5), PR_SET_DUMPABLE);
    # a user's own controller never changed uid, so put that back
    lsys.prctl(lsys.PR_SET_DUMPABLE, 1)

def read(p):
    with open(p) as f:
        return f.read()

def recipe():
    """What an unprivileged cell's child does once its maps are written, in order (docs/hosts.md)."""
    out = {"uid": os.getuid(), "gid": os.getgid(), "uid_map": read("/proc/self/uid_map").split()}
    if how != "ordered":
        return out
    lsys.unshare(lsys.CLONE_NEWNS | lsys.CLONE_NEWNET)  # owned by the new user namespace: mounts allowed
    lsys.mount_setattr("/", propagation=lsys.MS_PRIVATE)  # nothing mounted here reaches the host
    lsys.mount("tmpfs", "/tmp", "tmpfs", lsys.MS_NOSUID | lsys.MS_NODEV, "mode=0700")  # the private /tmp
    lsys.mount_setattr("/", attr_set=lsys.MOUNT_ATTR_RDONLY)  # locked mounts from the parent may tighten
    try:
        open("/etc/agnsup-userns-probe", "w")
        out["rootfs"] = "writable"
    except OSError as e:
        out["rootfs"] = errno.errorcode[e.errno]
    netns.loopback_up()  # CAP_NET_ADMIN over a network namespace our user namespace owns
    out["net"] = sorted(l.split(":")[0].strip() for l in read("/proc/self/net/dev").splitlines()[2:])
    lsys.set_no_new_privs()
    seccomp.build(("ptrace", "mount")).load()
    abi = landlock.abi()
    if abi:
        landlock.build(["/tmp"], abi).restrict_self()
    try:
        lsys.mount("tmpfs", "/mnt", "tmpfs", 0)
        out["mount_after_seccomp"] = "allowed"
    except OSError as e:
        out["mount_after_seccomp"] = errno.errorcode[e.errno]
    return out

ready_r, ready_w = os.pipe(); go_r, go_w = os.pipe(); res_r, res_w = os.pipe()
pid = os.fork()
if pid == 0:  # the cell
    out = {}
    try:
        lsys.unshare(lsys.CLONE_NEWUSER)
        os.write(ready_w, b"x")
        os.read(go_r, 1)  # the controller wrote the maps (or failed to)
        out = recipe()
    except Exception as e:
        out["error"] = repr(e)
    finally:
        os.write(res_w, json.dumps(out).encode())
        os._exit(0)
for fd in (ready_w, go_r, res_w):
    os.close(fd)
os.read(ready_r, 1)
seen = {"controller_uid": os.geteuid()}
try:
    if how == "gid_first":
        with open(f"/proc/{pid}/gid_map", "w") as f:
            f.write(f"{gid_in} {os.getegid()} 1\n")
    userns.write_id_maps(pid, uid_in, gid_in, uid_outside=0 if how == "other_uid" else None)
    seen["maps"] = "written"
except OSError as e:
    seen["maps"] = "refused: " + errno.errorcode.get(e.errno, str(e.errno))
os.write(go_w, b"x")
data = b""
while chunk := os.read(res_r, 65536):
    data += chunk
os.waitpid(pid, 0)
seen["cell"] = json.loads(data or b"{}")
print(json.dumps(seen))
'''


def _controller(how: str, uid_inside: int, gid_inside: int) -> dict:
    cp = subprocess.run([sys.executable, "-c", CONTROLLER, how, str(uid_inside), str(gid_inside)],
                        capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert cp.returncode == 0, cp.stderr
    return json.loads(cp.stdout)


@pytest.fixture
def userns_allowed():
    blocked = userns.blocked_by_sysctl()
    if blocked:
        pytest.skip("ENV_BLOCKED: unprivileged user namespaces: " + "; ".join(blocked))


def test_an_unprivileged_controller_maps_its_cell_to_root_and_the_cell_builds_its_namespaces(userns_allowed):
    seen = _controller("ordered", 0, 0)
    assert seen["maps"] == "written", seen
    cell = seen["cell"]
    assert "error" not in cell, cell
    assert (cell["uid"], cell["gid"]) == (0, 0) and cell["uid_map"] == ["0", str(seen["controller_uid"]), "1"]
    assert cell["rootfs"] == "EROFS"
    assert cell["net"] == ["lo"]
    assert cell["mount_after_seccomp"] == "EPERM"  # seccomp (and Landlock) apply inside as outside


def test_a_cell_mapped_to_its_own_uid_is_not_root_inside_but_still_builds_its_namespaces(userns_allowed):
    me = NOBODY if os.geteuid() == 0 else os.geteuid()
    seen = _controller("ordered", me, NOBODY if os.geteuid() == 0 else os.getegid())
    cell = seen["cell"]
    assert seen["maps"] == "written" and "error" not in cell, seen
    assert cell["uid"] == me and cell["rootfs"] == "EROFS" and cell["net"] == ["lo"]


def test_gid_map_before_setgroups_deny_is_refused_so_the_order_is_setgroups_first(userns_allowed):
    seen = _controller("gid_first", 0, 0)
    assert seen["maps"] == "refused: EPERM", seen
    assert seen["cell"]["uid"] == NOBODY  # unmapped: the overflow uid


def test_an_unprivileged_writer_may_map_only_its_own_uid(userns_allowed):
    seen = _controller("other_uid", 0, 0)
    if seen["controller_uid"] == 0:
        pytest.skip("needs to drop to an unprivileged uid: run as root")
    assert seen["maps"] == "refused: EPERM", seen


def test_sysctls_that_refuse_user_namespaces_are_named_with_their_fix(tmp_path):
    for rel, value in (("kernel/unprivileged_userns_clone", "0"), ("user/max_user_namespaces", "0"),
                       ("kernel/apparmor_restrict_unprivileged_userns", "1")):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(value + "\n")
    why = userns.blocked_by_sysctl(str(tmp_path))
    assert len(why) == 3 and "sysctl -w kernel.unprivileged_userns_clone=1" in why[0] and "AppArmor" in why[2]
    (tmp_path / "user/max_user_namespaces").write_text("15000\n")
    (tmp_path / "kernel/apparmor_restrict_unprivileged_userns").write_text("0\n")
    (tmp_path / "kernel/unprivileged_userns_clone").unlink()
    assert userns.blocked_by_sysctl(str(tmp_path)) == []
    with pytest.raises(ValueError):
        userns.id_map(-1, 0)


# ---------------------------------------------------------------- a delegated cgroup2 subtree

def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


@pytest.fixture
def delegated():
    """A cgroup2 directory handed to uid 65534 the way systemd's Delegate=yes does (ours: made here)."""
    from agnsup.linux import cgroup
    v2, _ = cgroup.parse_mountinfo(_read("/proc/self/mountinfo"))
    if os.geteuid() != 0 or not v2 or not os.access(v2, os.W_OK):
        pytest.skip("ENV_BLOCKED: root and a writable cgroup2 hierarchy, to delegate a subtree")
    d = os.path.join(v2, f"agnsup-test-deleg-{os.getpid()}")
    os.mkdir(d)
    for p in (d, *(os.path.join(d, f) for f in delegation.DELEGATED_FILES)):
        os.chown(p, NOBODY, NOBODY)
    try:
        yield d
    finally:
        with open(os.path.join(d, "cgroup.kill"), "w") as f:  # whatever a failed test left in our subtree
            f.write("1")
        deadline = time.monotonic() + 10
        while "populated 1" in _read(os.path.join(d, "cgroup.events")) and time.monotonic() < deadline:
            time.sleep(0.01)
        for sub in sorted((os.path.join(root, x) for root, dirs, _ in os.walk(d) for x in dirs), reverse=True):
            os.rmdir(sub)
        os.rmdir(d)


def test_a_chowned_subtree_is_delegated_to_that_uid_and_to_nobody_else(delegated):
    assert delegation.check(delegated, uid=NOBODY) == []
    why = delegation.check(delegated, uid=4321)
    assert any("owned by uid 65534, not 4321" in w for w in why)
    os.chown(os.path.join(delegated, "cgroup.subtree_control"), 0, 0)
    assert delegation.check(delegated, uid=NOBODY) == [
        f"{delegated}/cgroup.subtree_control is owned by uid 0, not 65534"]
    assert "cannot move itself in" in delegation.check(delegated, uid=0, inside="/")[0]
    assert proc.own_cgroup("12:pids:/x\n0::/user.slice/u.scope\n") == "/user.slice/u.scope"


# argv: the delegated directory. Started inside it by root, as systemd starts a unit's process.
IN_SUBTREE = r'''
import errno, json, os, sys
d = sys.argv[1]
with open(os.path.join(d, "cgroup.procs"), "w") as f:
    f.write("0")
os.setgroups([]); os.setgid(65534); os.setuid(65534)
out = {}
leaf, cell = os.path.join(d, "controller"), os.path.join(d, "cell")
os.mkdir(leaf)
with open(os.path.join(leaf, "cgroup.procs"), "w") as f:
    f.write("0")  # no internal processes: the controller lives in a leaf of its own
os.mkdir(cell)
r, w = os.pipe()
child = os.fork()
if child == 0:
    os.close(r)
    os.write(w, b"x")
    os.pause()
    os._exit(0)
os.close(w)
os.read(r, 1)
with open(os.path.join(cell, "cgroup.procs"), "w") as f:
    f.write(str(child))
with open(os.path.join(cell, "cgroup.procs")) as f:
    out["in_cell"] = f.read().split() == [str(child)]
try:
    with open(os.path.join(os.path.dirname(d), "cgroup.procs"), "w") as f:
        f.write(str(child))
    out["escape"] = "worked"
except OSError as e:
    out["escape"] = errno.errorcode[e.errno]
with open(os.path.join(cell, "cgroup.kill"), "w") as f:
    f.write("1")
_, status = os.waitpid(child, 0)
out["child"] = os.WTERMSIG(status) if os.WIFSIGNALED(status) else "exited"
os.rmdir(cell)
out["removed"] = not os.path.exists(cell)
print(json.dumps(out))
'''


def test_in_a_delegated_subtree_the_user_makes_cells_kills_them_and_cannot_leave(delegated):
    """What phase B's unprivileged backend stands on: started inside by whoever delegated (root here,
    systemd elsewhere), the user moves to a leaf, makes a cell, moves a child in, kills it with
    cgroup.kill, and cannot move anything out of the subtree."""
    cp = subprocess.run([sys.executable, "-c", IN_SUBTREE, delegated], capture_output=True, text=True,
                        timeout=60, stdin=subprocess.DEVNULL)
    assert cp.returncode == 0, cp.stderr
    assert json.loads(cp.stdout) == {"in_cell": True, "escape": "EACCES", "child": 9, "removed": True}
