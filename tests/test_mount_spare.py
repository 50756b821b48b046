"""What a Supervisor's cells' dev, hide, empty and mask steps mount, made ahead (process.leader.MountSpare, issue 29's
seventh round): each made-ahead mount is new and serves one cell, and the leader attaches one only where it would have
mounted the same thing itself.

Checked to fail: with `MountSpare.take` handing out a clone of a kept /dev (a template shared by the cells:
open_tree(OPEN_TREE_CLONE | AT_RECURSIVE) of the ready tree instead of the tree itself), the first test's second cell
sees the first cell's /dev/shm file and its pty; with the leader's hide taking a made-ahead tmpfs whatever the owner
(its name without the owner), the hide test's tmpfs keeps the old owner; with `_take_ahead` counting every failed
move_mount as done, the mask test's file is left unmasked; with the masks (or the hides) taken and not attached, the
hostile cell reaches /etc/shadow's file and the state root (or /run); with `take` ignoring the terminal, the pty
cell uses up the /dev made ahead."""
import os
import subprocess
import sys

import pytest

from scenario import wait_for
from agnsup.supervisor import Supervisor

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="made ahead by a root controller only")


def _dev_ahead() -> bool:
    """Whether this kernel lets the controller make a /dev ahead (6.15+: mounts inside a detached mount)."""
    from agnsup.linux import mounts
    try:
        _, fd = mounts.make_ahead(("dev", str(1 << 20)))
    except OSError:
        return False
    os.close(fd)
    return True


DEV_AHEAD = os.geteuid() == 0 and _dev_ahead()
needs_dev_ahead = pytest.mark.skipif(not DEV_AHEAD, reason="no mount inside a detached mount before Linux 6.15")

# A cell that holds a pty open and leaves a file in its /dev/shm while the next cells start
HOLD = ("import os, time, pty; m, s = pty.openpty(); open('/dev/shm/left-behind', 'w').write('secret'); "
        "print(os.ttyname(s), flush=True); time.sleep(30)")
LOOK = "stat -c %d /dev; ls -A /dev/shm; ls -A /dev/pts; cat /dev/shm/left-behind"


def _dev_ready(sup) -> set[int]:
    """The device numbers of the /devs made ahead for the next cells (one per shm size: a role's), once there is one
    (where the kernel makes none: once the masks are there, and the set is empty)."""
    kind = "dev" if DEV_AHEAD else "mask"
    wait_for(lambda: any(k[0] == kind for k in sup.ctl.mount_spare._ready), what=f"a {kind} made after the result")
    return {os.fstat(fd).st_dev for k, (_, fd) in sup.ctl.mount_spare._ready.items() if k[0] == "dev"}


@needs_dev_ahead
def test_a_cell_never_sees_another_cells_dev_shm_or_ptys(state, worktree):
    with Supervisor(state) as sup:
        assert sup.run(["true"], workdir=worktree, run_id="r")["exit_code"] == 0
        _dev_ready(sup)
        holder = sup.spawn([sys.executable, "-c", HOLD], workdir=worktree, run_id="r", stream=True)
        try:
            # the holder's pty exists and its file is written before the next cells start
            _wait_output(sup, holder, "/dev/pts/")  # the holder's pty is open and its file written
            assert sup.run(["true"], workdir=worktree, run_id="r")["exit_code"] == 0
            devs = _dev_ready(sup)
            seen = sup.run(["sh", "-c", LOOK], workdir=worktree, run_id="r", capture=True)
            lines = seen["stdout"].split()
            assert int(lines[0]) in devs, seen  # the /dev made ahead was taken
            assert seen["exit_code"] != 0 and "secret" not in seen["stdout"], seen
            assert lines[1:] == ["ptmx"], seen  # an empty /dev/shm, a devpts of its own: only its ptmx
        finally:
            sup.cancel(holder["cell_id"], holder["run_id"], grace=0)
            sup.wait(holder["run_id"], holder["cell_id"], timeout=30)


# What a hostile cell tries against the steps made ahead: each line names what it reached; nothing is the answer
PROBE = r"""
import os, stat, sys
state = sys.argv[1]
def tried(what, fn):
    try:
        got = fn()
    except OSError:
        return
    if got:
        print("REACHED", what, got)
tried("shadow", lambda: open("/etc/" + "shadow").read())
# a mapped cell's uid could not read the host's shadow or list a 0700 directory anyway: the masks and hides are there
tried("shadow unmasked", lambda: not stat.S_ISCHR(os.stat("/etc/" + "shadow").st_mode) and "not /dev/null")
tried("state root unmasked", lambda: stat.S_IMODE(os.stat(state).st_mode) and "not the mode 000 tmpfs")
tried("a home unhidden", lambda: os.stat("/root").st_dev == os.stat("/").st_dev and "the host's /root")
tried("state root", lambda: os.listdir(state))
tried("a hidden home", lambda: [n for n in os.listdir("/root") if n != ".pyenv"])
tried("/run", lambda: os.listdir("/run"))
tried("a node", lambda: sorted(set(os.listdir("/dev")) - {"null", "zero", "full", "random", "urandom", "tty", "pts",
                                                          "shm", "ptmx", "fd", "stdin", "stdout", "stderr"}))
tried("the host's ptys", lambda: [n for n in os.listdir("/dev/pts") if n != "ptmx"])
tried("a file in /dev", lambda: open("/dev/" + "made", "w"))
tried("a file in a hide", lambda: open("/root/" + "made", "w"))
tried("a file in a mask", lambda: open(state + "/made", "w"))
tried("a node made", lambda: os.mknod("/dev/shm/" + "sda", 0o600 | 0o060000, os.makedev(8, 0)) or "made")
tried("a writable null", lambda: os.chmod("/dev/" + "null", 0o600) or "chmod")
print("DONE", os.stat("/dev").st_dev)
"""


def test_a_cell_of_made_ahead_mounts_is_as_closed_as_any(state, worktree):
    with Supervisor(state) as sup:
        assert sup.run(["true"], workdir=worktree, run_id="r")["exit_code"] == 0
        devs = _dev_ready(sup)
        assert any(k[0] == "mask" for k in sup.ctl.mount_spare._ready) and \
            any(k[0] == "hide" for k in sup.ctl.mount_spare._ready)
        for role in ("executor", "readonly"):
            got = sup.run([sys.executable, "-c", PROBE, os.path.realpath(state)], workdir=worktree, run_id="r",
                          role=role, capture=True)
            assert got["exit_code"] == 0 and "REACHED" not in got["stdout"], got
            if role == "executor" and DEV_AHEAD:
                assert int(got["stdout"].split()[-1]) in devs, got  # it ran on the /dev made ahead
            devs = _dev_ready(sup)


def test_on_shared_mounts_nothing_a_made_ahead_mount_reaches_the_host(tmp_path):
    """As tests/test_isolation_basics.py's test for `agnsup run`: the state root and the worktree on a shared tmpfs
    (the state root masked in every cell, the caches cloned from it), several cells of one Supervisor: the host's
    mount table gains nothing."""
    top = tmp_path / "shared"
    top.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(top)], check=True)
    try:
        subprocess.run(["mount", "--make-shared", str(top)], check=True)
        wt = top / "wt"
        wt.mkdir()
        before = _mounts(str(top))
        with Supervisor(str(top / "state")) as sup:
            for _ in range(3):
                assert sup.run(["true"], workdir=str(wt), run_id="r")["exit_code"] == 0
                _dev_ready(sup)
                assert _mounts(str(top)) == before
    finally:
        subprocess.run(["umount", "-R", "-l", str(top)], check=False)


def _mounts(under: str) -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return sorted(" ".join(line.split()[3:5]) for line in f if under in line)


def _wait_output(sup, handle, text: str) -> None:
    said, since = "", 0
    while text not in said:
        got = sup.read_output(handle["run_id"], handle["cell_id"], since=since, timeout=30)
        assert got["chunks"] or not got["ended"], said
        said += _text(got["chunks"])
        since = got["next"]


PLAY = r'''
import os, stat, sys
from agnsup.linux import mounts
kind, target = sys.argv[1], sys.argv[2]
if kind == "hide":  # made ahead for the owner the directory has now, then given to another owner
    name, fd = mounts.make_ahead(mounts.ahead_key(("hide", target, "", True, ((target + "/kept", True),))))
    os.chown(target, 4242, 4343)
    mounts._hide(target, ((target + "/kept", True),), premade={name: fd})
    st = os.stat(target)
    print("OWNER", st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode), os.path.isdir(target + "/kept"))
elif kind == "mask":  # made ahead for a directory, which is a file by the cell's start
    name, fd = mounts.make_ahead(mounts.ahead_key(("mask", target)))
    os.rmdir(target)
    with open(target, "w") as f:
        f.write("secret")
    mounts._mask(target, fd)
    with open(target) as f:
        print("READ", repr(f.read()))
elif kind == "gone":  # made ahead, removed before the cell's start: nothing to mask, not a failure
    name, fd = mounts.make_ahead(mounts.ahead_key(("mask", target)))
    os.rmdir(target)
    mounts._mask(target, fd)
    print("NOTHING", os.path.exists(target))
'''


def _play(kind: str, target) -> str:
    cp = subprocess.run(["unshare", "--mount", "--propagation", "private", sys.executable, "-c", PLAY, kind,
                         str(target)], capture_output=True, text=True, timeout=60)
    assert cp.returncode == 0, cp.stdout + cp.stderr
    return cp.stdout.strip()


def test_a_hide_made_for_another_owner_is_made_again_for_the_owner_now(tmp_path):
    target = tmp_path / "home"
    target.mkdir()
    assert _play("hide", target) == "OWNER 4242 4343 493 True"  # 0755, its point inside


def test_a_directorys_mask_made_ahead_still_masks_what_is_a_file_now(tmp_path):
    target = tmp_path / "other-state-root"
    target.mkdir()
    assert _play("mask", target) == "READ ''"  # /dev/null over it


def test_a_mask_made_ahead_for_a_path_gone_since_is_nothing_to_mask(tmp_path):
    target = tmp_path / "other-state-root"
    target.mkdir()
    assert _play("gone", target) == "NOTHING False"


def test_made_ahead_mounts_are_the_ones_the_leader_would_make(tmp_path):
    """A hide with points, a mask and /dev made ahead, against the same made by the leader's steps: the same mount
    options, entries, modes and owners (mountinfo but the ids, device numbers and order)."""
    out = subprocess.run(["unshare", "--mount", "--propagation", "private", sys.executable, "-c", SAME,
                          str(tmp_path)], capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stdout + out.stderr
    here, ahead, dev_here, dev_ahead = out.stdout.split("====\n")
    assert here == ahead and "tmpfs" in here
    if DEV_AHEAD:
        assert dev_here == dev_ahead and "devpts" in dev_here and "/shm" in dev_here


SAME = r"""
import os, sys
from agnsup.linux import mounts, sys as lsys
base = sys.argv[1]
os.umask(0o077)  # a controller's umask is not what the modes come from (the leader's steps set their own)

def look(root):
    rows = []
    for line in open("/proc/self/mountinfo"):
        f = line.split()
        if f[4] == root or f[4].startswith(root + "/"):
            rows.append(" ".join([f[3], f[4][len(root):], f[5], *f[f.index("-") + 1:]]))
    for d, dirs, files in os.walk(root):
        for n in dirs + files:
            st = os.lstat(os.path.join(d, n))
            rows.append(f"{os.path.join(d, n)[len(root):]} {st.st_mode:o} {st.st_uid} {st.st_gid}")
    return "\n".join(sorted(rows)) + "\n====\n"

out = []
for which in ("here", "ahead"):
    root = os.path.join(base, which)
    for d in ("home", "mask"):
        os.makedirs(os.path.join(root, d))
    os.chown(os.path.join(root, "home"), 4242, 4343)
    home = os.path.join(root, "home")
    points = ((os.path.join(home, "a", "b"), True), (os.path.join(home, "c", "f"), False))
    keys = (mounts.ahead_key(("hide", home, "", True, points)), mounts.ahead_key(("mask", os.path.join(root, "mask"))))
    if which == "here":
        os.umask(0o022)  # the leader's
        mounts._hide(home, points)
        mounts._mask(keys[1][1])
        os.umask(0o077)
    else:
        for key in keys:
            name, fd = mounts.make_ahead(key)
            lsys.move_mount_fd(fd, key[1], follow=True)
            os.close(fd)
    out.append(look(root).replace(root, "ROOT"))
lsys.mount_setattr("/", attr_set=lsys.MOUNT_ATTR_RDONLY, propagation=lsys.MS_PRIVATE)  # the "root" step
os.umask(0o022)
mounts._dev(1 << 20, ())
out.append(look("/dev"))
lsys.umount("/dev")
os.umask(0o077)
try:
    name, fd = mounts.make_ahead(mounts.ahead_key(("dev", "/dev", str(1 << 20), True, ())))
except OSError:  # before 6.15: made in the leader only
    fd = None
mounts._dev(1 << 20, (), premade=fd)
out.append(look("/dev"))
sys.stdout.write("".join(out)[:-len("====\n")])
"""


@needs_dev_ahead
def test_a_cell_at_a_terminal_gets_its_console_and_leaves_the_dev_made_ahead(state, worktree):
    """A pty cell's /dev holds /dev/console (made by its leader): the /dev made ahead stays for the next cell."""
    with Supervisor(state) as sup:
        assert sup.run(["true"], workdir=worktree, run_id="r")["exit_code"] == 0
        devs = _dev_ready(sup)
        h = sup.spawn(["sh", "-c", "tty; ls /dev; stat -c %d /dev"], workdir=worktree, run_id="r",
                      pty={"cols": 80, "rows": 24})
        assert sup.wait(h["run_id"], h["cell_id"], timeout=60)["exit_code"] == 0
        said = _output(sup, h)
        assert "/dev/console" in said and "console" in said.split()[1:], said
        assert int(said.split()[-1]) not in devs and _dev_ready(sup) & devs == devs, said  # not taken


def _output(sup, handle) -> str:
    got = sup.read_output(handle["run_id"], handle["cell_id"], since=0, timeout=30)
    return _text(got["chunks"])


def _text(chunks) -> str:
    return "".join(c["data"].decode() if isinstance(c["data"], bytes) else c["data"] for c in chunks)
