"""Reversible cells through the real CLI (issue 26): a cell that writes its worktree runs over an
overlay of it, and what it wrote lands in the worktree when it ends, whatever the ending, kept as a
record; a live role writes through, a read-only role has no overlay; the everyday jobs give the same
worktree either way; a normal user's cell captures too."""
from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import stat
import subprocess
import zipfile

import pytest

from conftest import skip_unless_capturable, write_role
from devproject import GIT, git

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="ENV_BLOCKED: root (the cells' overlays and id maps)")

GIT_ENV = {"GIT_AUTHOR_NAME": "A", "GIT_AUTHOR_EMAIL": "a@example.org", "GIT_COMMITTER_NAME": "A",
           "GIT_COMMITTER_EMAIL": "a@example.org", "GIT_AUTHOR_DATE": "2026-01-01T00:00:00Z",
           "GIT_COMMITTER_DATE": "2026-01-01T00:00:00Z"}


def listing(root: str, skip_content=()) -> dict:
    """Every path under `root` (relative) -> (type, mode, uid, gid, size, sha256 or link target): the
    whole state of a tree but its times (and the content of paths matching `skip_content`)."""
    out = {}
    for d, dirs, files in os.walk(root):
        for n in dirs + files:
            p = os.path.join(d, n)
            rel = os.path.relpath(p, root)
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode):
                what = os.readlink(p)
            elif stat.S_ISREG(st.st_mode):
                if any(rel.endswith(s) or rel == s for s in skip_content):
                    what = None
                else:
                    with open(p, "rb") as f:
                        what = hashlib.sha256(f.read()).hexdigest()
            else:
                what = None
            size = st.st_size if stat.S_ISREG(st.st_mode) and what is not None else None
            out[rel] = (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, size, what)
    return out


def project(root: str) -> str:
    """A worktree with sources and a real git history."""
    os.makedirs(os.path.join(root, "src", "pkg"))
    for rel, text in (("src/pkg/a.py", "A = 1\n"), ("src/pkg/b.txt", "b\n"), ("README", "readme\n"),
                      ("run.sh", "#!/bin/sh\necho run\n")):
        with open(os.path.join(root, rel), "w") as f:
            f.write(text)
    os.chmod(os.path.join(root, "run.sh"), 0o755)
    git("init", "-q", "-b", "main", ".", cwd=root)
    git("add", "-A", cwd=root)
    git("commit", "-qm", "one", cwd=root, env=GIT_ENV)
    return root


@pytest.fixture
def outside():
    """A directory outside /tmp: a cell's /tmp is its own, and Landlock allows all of it, so only a worktree
    elsewhere shows that the cell may write its overlay because of the worktree's own rule."""
    import tempfile
    d = tempfile.mkdtemp(prefix="agnsup-test-", dir="/var/tmp")
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def receipt(state: str, run: str, cell: str) -> dict:
    with open(os.path.join(state, "cells", run, cell, "receipt.json")) as f:
        return json.load(f)


def while_it_waits(p, holds, line: bytes) -> tuple[bytes, bytes]:
    """`p`: a cell (its controller) that prints "ready" and waits for a line on stdin. `holds()` must be
    true while it waits (what it wrote is still in its layer); then the line lets it end: (out, err)."""
    try:
        assert p.stdout.readline() == b"ready\n", p.stderr.read() if p.poll() is not None else ""
        assert holds()
        return p.communicate(line, timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()

def test_every_kind_of_change_lands_when_the_cell_ends_and_not_before(agnsup, tmp_path, outside):
    wt = project(os.path.join(outside, "wt"))
    before = listing(wt)
    # the cell reports "ready" once it has written everything, then waits for a line on its stdin
    script = ("echo more >> README; rm -rf src .git; chmod 700 run.sh; ln -s README link; mkdir empty; "
              "printf 'x%.0s' $(seq 1000) > new.txt; echo ready; read line; echo done")
    p = agnsup.popen("run", "--run", "r1", "--cell", "c1", "--workdir", wt, "--", "sh", "-c", script,
                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    # everything is written in the cell, nothing yet in the worktree
    out, err = while_it_waits(p, lambda: listing(wt) == before, b"go\n")
    assert p.returncode == 0, err
    after = listing(wt)
    assert not os.path.exists(os.path.join(wt, "src"))
    with open(os.path.join(wt, "README")) as f:
        assert f.read() == "readme\nmore\n"
    assert stat.S_IMODE(os.stat(os.path.join(wt, "run.sh")).st_mode) == 0o700
    assert os.readlink(os.path.join(wt, "link")) == "README"
    assert os.path.isdir(os.path.join(wt, "empty")) and os.listdir(os.path.join(wt, "empty")) == []
    assert os.path.getsize(os.path.join(wt, "new.txt")) == 1000
    # the files git runs on its own stay (read-only in the cell, protect.py): the history does not
    assert not os.path.exists(os.path.join(wt, ".git", "objects")) and ".git/HEAD" not in after
    # the owners a mapped cell writes with are those of the worktree (on-disk root), never the host range
    assert {v[2] for v in after.values()} == {0}
    r = receipt(agnsup.state, "r1", "c1")
    ch = r["changes"]
    assert ch["mode"] == "at_exit" and ch["record"] == "r1/c1"
    assert ch["created"] >= 3 and ch["deleted"] >= 5 and ch["modified"] >= 1
    assert {"README", "new.txt", "link", "empty", "src"} <= set(ch["paths"])
    rec = os.path.join(agnsup.state, "changes", "r1", "c1")
    assert os.path.isfile(os.path.join(rec, "record.json"))
    assert not os.path.exists(os.path.join(rec, "upper")) and not os.path.exists(os.path.join(rec, "plan.json"))
    with open(os.path.join(rec, "before", "src", "pkg", "a.py")) as f:
        assert f.read() == "A = 1\n"  # the pre-image of what it deleted


def test_a_cell_that_changes_nothing_keeps_no_record(agnsup, tmp_path, outside):
    wt = project(os.path.join(outside, "wt"))
    agnsup("run", "--run", "r1", "--cell", "c1", "--workdir", wt, "--", "cat", "README", check=0)
    ch = receipt(agnsup.state, "r1", "c1")["changes"]
    assert ch["mode"] == "at_exit" and ch["files"] == 0 and not ch.get("record")
    assert not os.path.exists(os.path.join(agnsup.state, "changes", "r1", "c1"))


def test_a_timed_out_cells_changes_land_too(agnsup, tmp_path, outside):
    wt = project(os.path.join(outside, "wt"))
    cp = agnsup("run", "--run", "r1", "--cell", "c1", "--timeout", "1", "--workdir", wt, "--", "sh", "-c",
                "echo partial > out.txt; rm README; exec sleep 60")
    assert cp.returncode == 124, cp.err
    with open(os.path.join(wt, "out.txt")) as f:
        assert f.read() == "partial\n"
    assert not os.path.exists(os.path.join(wt, "README"))
    r = receipt(agnsup.state, "r1", "c1")
    assert r["state"] == "timeout" and r["changes"]["record"] == "r1/c1" and r["changes"]["files"] == 2


def test_a_cancelled_cells_changes_land_too(agnsup, tmp_path, outside):
    wt = project(os.path.join(outside, "wt"))
    p = agnsup.popen("run", "--run", "r1", "--cell", "c1", "--workdir", wt, "--", "sh", "-c",
                     "echo partial > out.txt; echo ready; exec sleep 60", stdout=subprocess.PIPE,
                     stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    try:
        assert p.stdout.readline() == b"ready\n"
        agnsup("cancel", "--run", "r1", "--cell", "c1", "--grace", "0", check=0)
        p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    r = receipt(agnsup.state, "r1", "c1")
    assert r["state"] == "cancelled" and r["changes"]["record"] == "r1/c1"
    with open(os.path.join(wt, "out.txt")) as f:
        assert f.read() == "partial\n"


def test_a_live_role_writes_straight_through_and_says_so(agnsup, tmp_path, outside, policy_dir):
    write_role(policy_dir, "livewt", filesystem__changes='"live"')
    wt = project(os.path.join(outside, "wt"))
    p = agnsup.popen("run", "--role", "livewt", "--run", "r1", "--cell", "c1", "--workdir", wt, "--", "sh", "-c",
                     "echo now > seen.txt; echo ready; read line", env={"AGNSUP_POLICY_DIR": str(policy_dir)},
                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert p.stdout.readline() == b"ready\n"
        assert os.path.exists(os.path.join(wt, "seen.txt"))  # seen while the cell still runs
        p.communicate(b"\n", timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    r = receipt(agnsup.state, "r1", "c1")
    assert r["changes"] == {"mode": "live", "why": 'role filesystem.changes = "live"'}
    assert not os.path.exists(os.path.join(agnsup.state, "changes", "r1"))


def test_a_read_only_role_has_no_overlay(agnsup, tmp_path, outside):
    wt = project(os.path.join(outside, "wt"))
    # the file system of the topmost mount at the worktree (not any overlay: the v2 guest's / is one)
    top = (f"awk '$5 == \"{wt}\" {{for (i = 7; i <= NF; i++) if ($i == \"-\") {{print $(i + 1); break}}}}' "
           "/proc/self/mountinfo | tail -1; echo x > y")
    cp = agnsup("run", "--role", "readonly", "--run", "r1", "--cell", "c1", "--workdir", wt, "--", "sh", "-c", top)
    host = subprocess.run(["stat", "-f", "-c", "%T", wt], capture_output=True, text=True).stdout.strip()
    # the host's own file system there, not an overlay of the cell's (the v2 guest's / is one: then alike)
    assert cp.out.strip() and (cp.out.strip() != "overlay" or host == "overlayfs") and cp.returncode != 0, \
        (cp.out, host)
    ch = receipt(agnsup.state, "r1", "c1")["changes"]
    assert ch["mode"] == "none" and "read-only" in ch["why"]


def test_the_overlay_is_the_cells_worktree_and_nothing_else_sees_its_layer(agnsup, tmp_path, outside):
    wt = project(os.path.join(outside, "wt"))
    probe = (f"awk '$5 == \"{wt}\" {{for (i = 7; i <= NF; i++) if ($i == \"-\") {{print $(i + 1); break}}}}' "
             "/proc/self/mountinfo | tail -1; "
             f"ls -A {agnsup.state} 2>/dev/null | wc -l; test -w . && echo writable; "
             # the layer's scratch attach (mounts.overlay) is gone before the command runs
             "awk '$5 ~ /agnsup-layer/' /proc/self/mountinfo | wc -l; ls -A /tmp | grep agnsup-layer | wc -l")
    cp = agnsup("run", "--run", "r1", "--cell", "c1", "--workdir", wt, "--", "sh", "-c", probe, check=0)
    top, listed, writable, mounted, left = cp.out.split()
    assert top == "overlay" and listed == "0" and writable == "writable" and mounted == left == "0", cp.out


def _wheel(where: str) -> str:
    """A real wheel (pure Python), made by hand: pip installs it with no build step and no index."""
    files = {"tinypkg/__init__.py": b"VALUE = 42\n",
             "tinypkg-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: tinypkg\nVersion: 1.0\n",
             "tinypkg-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                            b"Tag: py3-none-any\n"}
    record = "".join(f"{n},sha256={base64.urlsafe_b64encode(hashlib.sha256(d).digest()).rstrip(b'=').decode()},"
                     f"{len(d)}\n" for n, d in files.items()) + "tinypkg-1.0.dist-info/RECORD,,\n"
    path = os.path.join(where, "tinypkg-1.0-py3-none-any.whl")
    with zipfile.ZipFile(path, "w") as z:
        for n, d in files.items():
            z.writestr(n, d)
        z.writestr("tinypkg-1.0.dist-info/RECORD", record)
    return path


EVERYDAY = ("git init -q -b main repo && cd repo && echo one > f && git add f && git commit -qm one && "
            "echo two >> f && git commit -qam two && git rm -q f && echo three > g && git add g && "
            "git commit -qm three && cd .. && "
            "printf 'out/x: in\\n\\tmkdir -p out && cp in out/x\\n' > Makefile && echo data > in && make -s && "
            "/usr/bin/python3 -m venv v && v/bin/pip install -q --no-index --disable-pip-version-check "
            "./tinypkg-1.0-py3-none-any.whl && v/bin/python -c 'import tinypkg; print(tinypkg.VALUE)'")


def test_the_everyday_jobs_leave_the_same_worktree_captured_or_live(agnsup, tmp_path, outside, policy_dir):
    """git init/commit, make, a venv with a wheel installed by pip: the worktree after a captured cell is
    the one a live cell leaves (every path, type, mode, owner, size, content; not times, and not the
    bytes of what records times or inode numbers: .pyc files, git's index)."""
    write_role(policy_dir, "livewt", filesystem__changes='"live"')
    template = str(tmp_path / "template")
    os.mkdir(template)
    _wheel(template)
    wt = os.path.join(outside, "wt")
    results = {}
    for role in ("livewt", "executor"):
        shutil.rmtree(wt, ignore_errors=True)
        shutil.copytree(template, wt)
        with open(os.path.join(wt, ".agnsup-worktree"), "w"):
            pass
        cp = agnsup("run", "--role", role, "--run", role, "--cell", "c1", "--workdir", wt,
                    *(a for k, v in GIT_ENV.items() for a in ("--env", f"{k}={v}")), "--", "sh", "-c", EVERYDAY,
                    env={"AGNSUP_POLICY_DIR": str(policy_dir)}, timeout=300)
        assert cp.returncode == 0 and cp.out.strip().endswith("42"), cp.err
        log = git("log", "--format=%H %s", cwd=os.path.join(wt, "repo")).stdout
        status = git("status", "--porcelain", cwd=os.path.join(wt, "repo")).stdout
        fsck = subprocess.run([GIT, "fsck", "--strict"], cwd=os.path.join(wt, "repo"), capture_output=True)
        make = subprocess.run(["make", "-q"], cwd=wt, capture_output=True)
        results[role] = (listing(wt, skip_content=(".pyc", ".git/index")), log, status, fsck.returncode,
                         make.returncode)
        assert receipt(agnsup.state, role, "c1")["changes"]["mode"] == ("live" if role == "livewt" else "at_exit")
    live, captured = results["livewt"], results["executor"]
    assert captured[1].count("\n") == 3 and captured[3] == 0 and captured[4] == 0
    assert set(captured[0]) == set(live[0])
    assert {k: v for k, v in captured[0].items() if live[0][k] != v} == {}
    assert captured[1:] == live[1:]
    assert receipt(agnsup.state, "executor", "c1")["changes"]["created"] > 100


def test_a_normal_users_cell_captures_its_changes(tmp_path):
    from test_unprivileged import User, _venv
    with User(_venv()) as user:
        skip_unless_capturable(user.home)  # the user's state root is in its home
        wt = user.own_dir("rev")
        for rel, text in (("keep.txt", "keep\n"), ("gone.txt", "gone\n")):
            with open(os.path.join(wt, rel), "w") as f:
                f.write(text)
            os.chown(os.path.join(wt, rel), user.uid, user.gid)
        with open(os.path.join(wt, ".agnsup-worktree"), "w"):
            pass
        state = user.own_dir("state")
        env = {**user.env, "AGNSUP_STATE_DIR": state}
        p = subprocess.Popen([user.agnsup, "run", "--run", "r1", "--cell", "c1", "--workdir", wt, "--", "sh", "-c",
                              "echo more >> keep.txt; rm gone.txt; mkdir d; echo new > d/n; echo ready; read line"],
                             env=env, cwd=user.work, preexec_fn=user._enter, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = while_it_waits(p, lambda: os.path.exists(os.path.join(wt, "gone.txt"))
                                  and not os.path.exists(os.path.join(wt, "d")), b"\n")
        assert p.returncode == 0, err
        with open(os.path.join(wt, "keep.txt")) as f:
            assert f.read() == "keep\nmore\n"
        assert not os.path.exists(os.path.join(wt, "gone.txt"))
        st = os.stat(os.path.join(wt, "d", "n"))
        assert (st.st_uid, st.st_gid) == (user.uid, user.gid)
        with open(os.path.join(state, "cells", "r1", "c1", "receipt.json")) as f:
            ch = json.load(f)["changes"]
        assert ch["mode"] == "at_exit" and ch["record"] == "r1/c1" and ch["files"] == 4, ch
        # what the user's overlay kept its whiteouts and opaque marks in: user.* xattrs, gone after the commit
        assert not os.path.exists(os.path.join(state, "changes", "r1", "c1", "upper"))
        # the work directory too: the kernel's mode-000 work/work and the volatile mount's incompat/ in it
        assert sorted(os.listdir(os.path.join(state, "changes", "r1", "c1"))) == ["before", "record.json"]
        assert not user.left()


def test_a_mapped_cells_layer_is_shifted_back_at_commit(tmp_path, outside):
    """mounts.overlay for a mapped cell, in a forked child as the cell's setup does: what the cell (uid 0 of
    the cells' namespace) writes is host BASE+n in the upper, the overlay's root shows the worktree root's
    owner, and the commit leaves the owners the cell's id map means: what it made is on-disk 0, the rest
    as it was, the worktree root unchanged."""
    from agnsup import changes
    from agnsup.process import namespaces
    from agnsup.linux import mounts, userns
    from agnsup.linux import sys as lsys
    wt = os.path.join(outside, "wt")
    os.makedirs(os.path.join(wt, "sub"))
    refused = namespaces.idmap_refused(wt)
    if refused:
        pytest.skip(f"ENV_BLOCKED: no id-mapped mount of {wt} here: {refused}")
    with open(os.path.join(wt, "a"), "w") as f:
        f.write("a\n")
    os.chown(os.path.join(wt, "sub"), 1000, 1000)
    state = str(tmp_path / "state")
    os.mkdir(state, 0o700)
    base, gbase, _ = userns.cell_range()
    layer = changes.prepare(state, "r1", "c1", None, worktree=wt, agent_id="a", id_shift=base)
    ns = namespaces.cell_userns()

    def as_the_cell():
        lsys.unshare(lsys.CLONE_NEWNS)
        lsys.mount_setattr("/", propagation=lsys.MS_PRIVATE)
        fd = lsys.open_tree(wt, lsys.OPEN_TREE_CLONE | lsys.OPEN_TREE_CLOEXEC | lsys.AT_RECURSIVE)
        lsys.mount_setattr(wt, attr_set=lsys.MOUNT_ATTR_IDMAP, propagation=lsys.MS_PRIVATE, fd=fd, userns_fd=ns)
        lsys.move_mount_fd(fd, wt)
        lfd = lsys.open_tree(layer.dir, lsys.OPEN_TREE_CLONE | lsys.OPEN_TREE_CLOEXEC | lsys.AT_RECURSIVE)
        mounts.overlay(wt, lfd, (("shift", base, gbase),))
        lsys.setns(ns, lsys.CLONE_NEWUSER)
        os.setgroups([])
        os.setresgid(0, 0, 0)
        os.setresuid(0, 0, 0)
        if os.stat(wt).st_uid != 0:  # the overlay's root: the cell's own worktree root, as without capture
            raise AssertionError(f"the worktree root is uid {os.stat(wt).st_uid} in the cell")
        with open(os.path.join(wt, "a"), "a") as f:
            f.write("more\n")
        with open(os.path.join(wt, "n"), "w") as f:
            f.write("n\n")
        os.mkdir(os.path.join(wt, "d"))
        with open(os.path.join(wt, "sub", "x"), "w") as f:
            f.write("x\n")
    said = _in_a_child(as_the_cell)
    assert said == b"ok", said
    assert os.lstat(os.path.join(layer.upper, "n")).st_uid == base  # written as the host's BASE
    summary = changes.commit(state, "r1", "c1", wt, agent_id="a", id_shift=base)
    assert summary["files"] == 4, summary
    owners = {rel: (os.lstat(os.path.join(wt, rel)).st_uid, os.lstat(os.path.join(wt, rel)).st_gid)
              for rel in (".", "a", "n", "d", "sub", "sub/x")}
    assert owners == {".": (0, 0), "a": (0, 0), "n": (0, 0), "d": (0, 0), "sub": (1000, 1000), "sub/x": (0, 0)}
    with open(os.path.join(wt, "a")) as f:
        assert f.read() == "a\nmore\n"


def test_a_spawned_cell_writes_live_and_a_served_run_is_captured(agnsup, tmp_path, outside):
    """filesystem.changes = "auto": `agnsup spawn` (a server, a watcher) writes its worktree as it runs,
    seen by everyone; a call that is waited for (serve's run) lands its changes when it ends."""
    from agnsup.doors.serve import Client
    from scenario import STARTERS, wait_for
    wt = project(os.path.join(outside, "wt"))
    s = STARTERS["serve"](agnsup, tmp_path)
    try:
        agnsup.json("spawn", "--cell", "s1", "--workdir", wt, "--", "sh", "-c", "echo live > served.txt; exec sleep 60")
        wait_for(lambda: os.path.exists(os.path.join(wt, "served.txt")), what="the spawned cell's write, live")
        with Client(s.ready["socket"]) as c:
            c.call("cancel", cell_id="s1", run_id="default")
            res = c.call("run", argv=["sh", "-c", "echo later > ran.txt"], workdir=wt, cell_id="s2")
        assert res["exit_code"] == 0
        assert os.path.exists(os.path.join(wt, "ran.txt"))
    finally:
        s.close()
    live = receipt(agnsup.state, "default", "s1")["changes"]
    assert live["mode"] == "live" and "long-lived" in live["why"]
    ran = receipt(agnsup.state, "default", "s2")["changes"]
    assert ran["mode"] == "at_exit" and ran["record"] == "default/s2" and ran["paths"] == ["ran.txt"]


def test_what_protect_quarantines_after_the_commit_leaves_the_record(agnsup, tmp_path, outside):
    """A cell that creates a file tools run on their own (.vscode/ where there was none): the commit lands
    it, protect.settle moves it out to the cell's quarantine, and the record no longer claims it (an undo
    would otherwise fight the quarantine); the rest of what the cell wrote stays recorded."""
    wt = project(os.path.join(outside, "wt"))
    agnsup("run", "--run", "r1", "--cell", "c1", "--workdir", wt, "--", "sh", "-c",
           "mkdir .vscode && echo '{}' > .vscode/tasks.json && echo ok > keep.txt", check=0)
    assert not os.path.exists(os.path.join(wt, ".vscode")) and os.path.exists(os.path.join(wt, "keep.txt"))
    r = receipt(agnsup.state, "r1", "c1")
    assert [q["path"] for q in r["protected"]["quarantined"]] == [".vscode"]
    with open(os.path.join(agnsup.state, "changes", "r1", "c1", "record.json")) as f:
        assert [e["path"] for e in json.load(f)["entries"]] == ["keep.txt"]


def _in_a_child(fn) -> bytes:
    """fn() in a forked child (its own mount namespace, its own ids, as a cell's setup): b"ok", or the
    repr of what it raised."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            fn()
            os.write(w, b"ok")
        except BaseException as e:  # noqa: BLE001
            os.write(w, repr(e).encode())
        finally:
            os._exit(0)
    os.close(w)
    said = os.read(r, 4096)
    os.close(r)
    os.waitpid(pid, 0)
    return said


def _overlay_in_a_child(wt: str, layer: str, options: tuple) -> bytes:
    """mounts.overlay over `wt` in a forked child's own mount namespace, then a write to wt/probe: what it
    said ("ok" or the error)."""
    from agnsup.linux import mounts
    from agnsup.linux import sys as lsys

    def overlay_and_write():
        lsys.unshare(lsys.CLONE_NEWNS)
        lsys.mount_setattr("/", propagation=lsys.MS_PRIVATE)
        lfd = lsys.open_tree(layer, lsys.OPEN_TREE_CLONE | lsys.OPEN_TREE_CLOEXEC | lsys.AT_RECURSIVE)
        mounts.overlay(wt, lfd, options)
        with open(os.path.join(wt, "probe"), "w") as f:
            f.write("x")
    return _in_a_child(overlay_and_write)


def test_an_overlay_the_kernel_refuses_runs_the_cell_live_and_says_why_unless_reversible_is_required(
        tmp_path, outside):
    from agnsup import changes
    from agnsup.linux import mounts
    wt = os.path.join(outside, "wt")
    os.mkdir(wt)
    layer = str(tmp_path / "layer")
    os.makedirs(os.path.join(layer, "upper"))  # no work/: the kernel refuses the overlay (ENOENT)
    said = _overlay_in_a_child(wt, layer, ())
    assert b"No such file" in said and not os.path.exists(os.path.join(wt, "probe"))  # required: the cell fails
    assert changes.ran_live(layer) is None
    assert _overlay_in_a_child(wt, layer, (("live_ok",),)) == b"ok"
    assert os.path.exists(os.path.join(wt, "probe"))  # written live, straight to the worktree
    why = changes.ran_live(layer)
    assert why.startswith("the kernel refused the worktree's overlay here (") and "ran live" in why
    assert os.path.exists(os.path.join(layer, mounts.LAYER_LIVE))
