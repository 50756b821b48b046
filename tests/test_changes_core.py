"""Reversible cells against the real kernel: an overlayfs over a worktree (lower = the worktree,
upper/work = changes.prepare()'s directories) mounted in a private mount namespace, real destructive
commands run in it, then changes.commit / undo / redo / refusals / crash recovery on what the kernel
left in the upper layer. Also a state root on tmpfs over a worktree on ext4 (every move is a copy)
and a normal user's state root (an overlay mounted in the user's own namespace: userxattr)."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time

import pytest

from agnsup import changes
from agnsup.errors import ChangeConflict, exit_code
from agnsup.store.journal import Journal

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="ENV_BLOCKED: root (mounts an overlay and a tmpfs)")

# the mount options issue26.md names; with userxattr (a normal user's overlay) this kernel refuses
# redirect_dir=off ("conflicting options: userxattr,redirect_dir=follow": off means follow while the
# module's redirect_always_follow is Y): nofollow there, which creates and follows no redirects
OPTS = "redirect_dir=off,index=off,metacopy=off,xino=off"
USER_OPTS = "userxattr,redirect_dir=nofollow,index=off,metacopy=off,xino=off"
NOBODY = 65534

# a normal user cannot run this venv's interpreter (under root's 0700 home): the system's, stdlib only
DUMP_PYTHON = "/usr/bin/python3"
DUMP = r"""
import hashlib, json, os, stat, sys
root = sys.argv[1]; out = {}
for dirpath, dirs, files in os.walk(root):
    for name in dirs + files:
        p = os.path.join(dirpath, name); st = os.lstat(p); rel = os.path.relpath(p, root)
        if stat.S_ISLNK(st.st_mode): body = ["link", os.readlink(p), st.st_mtime_ns]
        elif stat.S_ISDIR(st.st_mode): body = ["dir"]
        elif not stat.S_ISREG(st.st_mode): body = ["other", stat.S_IFMT(st.st_mode), st.st_mtime_ns]
        else: body = ["file", hashlib.sha256(open(p, "rb").read()).hexdigest(), st.st_mtime_ns]
        out[rel] = [stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid] + body
print(json.dumps(out))
"""


def tree(root: str) -> dict:
    """Per path: mode, owner, type, content digest or link target, and mtime (not a directory's:
    it moves with its entries). The same code as DUMP, which runs inside the cell's namespace."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            rel = os.path.relpath(p, root)
            if stat.S_ISLNK(st.st_mode):
                body = ["link", os.readlink(p), st.st_mtime_ns]
            elif stat.S_ISDIR(st.st_mode):
                body = ["dir"]
            elif not stat.S_ISREG(st.st_mode):
                body = ["other", stat.S_IFMT(st.st_mode), st.st_mtime_ns]
            else:
                with open(p, "rb") as f:
                    body = ["file", hashlib.sha256(f.read()).hexdigest(), st.st_mtime_ns]
            out[rel] = [stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid] + body
    return out


def overlay_run(layer: changes.Layer, wt: str, script: str, user: int | None = None) -> dict:
    """Mount the overlay on the worktree in a private mount namespace, run `script` in it with sh, and
    return the tree the cell saw when it ended (dumped inside the namespace)."""
    opts = USER_OPTS if user is not None else OPTS
    sh = (f"mount -t overlay overlay -o lowerdir={wt},upperdir={layer.upper},workdir={layer.work},{opts} {wt} "
          f"&& cd {wt} && ( set -e; {script} ) && cd / && {DUMP_PYTHON if user is not None else sys.executable} "
          f"-c '{DUMP}' {wt}")
    argv = ["unshare", "-m", "--propagation", "private", "sh", "-c", sh]
    if user is not None:
        argv = ["setpriv", "--reuid", str(user), "--regid", str(user), "--clear-groups",
                "unshare", "-Urm", "--propagation", "private", "sh", "-c", sh]
    cp = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert cp.returncode == 0, cp.stderr
    return json.loads(cp.stdout.splitlines()[-1])


def git(wt: str, *args: str) -> str:
    cp = subprocess.run(["git", "--no-optional-locks", "-C", wt, "-c", "user.name=t", "-c", "user.email=t@t", "-c", "init.defaultBranch=main",
                         *args], capture_output=True, text=True, timeout=60)
    assert cp.returncode == 0, cp.stderr
    return cp.stdout


def project(wt: str, repo: bool = True) -> None:
    """A small real project: a git repository with one commit, sources, docs, data, a symlink."""
    os.makedirs(os.path.join(wt, "src/pkg"))
    os.makedirs(os.path.join(wt, "docs"))
    files = {"src/pkg/__init__.py": "", "src/pkg/core.py": "def f():\n    return 42\n", "README": "readme\n",
             "docs/guide.md": "# guide\n", "docs/api.md": "# api\n", "data.csv": "a,b\n1,2\n" * 500,
             "notes.txt": "notes\n"}
    for rel, text in files.items():
        with open(os.path.join(wt, rel), "w") as f:
            f.write(text)
    os.symlink("README", os.path.join(wt, "README.link"))
    if not repo:  # a repository's index and commits hold times: not for trees compared across worktrees
        return
    git(wt, "init", "-q")
    git(wt, "add", "-A")
    git(wt, "commit", "-qm", "first")


DESTROY = ("rm -rf src .git; mv docs manual; chmod 600 README; ln -s manual/guide.md GUIDE; truncate -s 0 data.csv; "
           "mkdir empty; dd if=/dev/urandom of=big.bin bs=1M count=1 status=none; echo appended >> notes.txt; "
           "rm README.link")


class Env:
    def __init__(self, st: str, wt: str):
        self.st, self.wt = st, wt
        os.makedirs(st, exist_ok=True)
        os.makedirs(wt, exist_ok=True)
        self.j = Journal(os.path.join(st, "journal.db"))
        self.n = 0

    def cell(self, script: str, run: str = "R", commit: bool = True, user: int | None = None):
        self.n += 1
        cid = f"c{self.n}"
        layer = changes.prepare(self.st, run, cid, worktree=self.wt, agent_id="A",
                                owner=(user, user) if user is not None else None)
        seen = overlay_run(layer, self.wt, script, user=user)
        ch = None
        if commit:
            ch = changes.commit(self.st, run, cid, self.wt, agent_id="A")
            if ch.get("record"):
                self.j.add_change(changes.summary_row(ch))
        return cid, seen, ch

    def close(self):
        self.j.close()


@pytest.fixture
def env(tmp_path):
    e = Env(str(tmp_path / "state"), str(tmp_path / "wt"))
    yield e
    e.close()


def test_real_destructive_commands_land_as_the_cell_left_them_undo_restores_byte_for_byte_redo_reapplies(env):
    project(env.wt)
    orig = tree(env.wt)
    cid, seen, ch = env.cell(DESTROY)
    after = tree(env.wt)
    assert after == seen  # the worktree is exactly what the cell saw when it ended
    assert "src" not in after and ".git" not in after and "manual/guide.md" in after and "docs" not in after
    assert after["big.bin"][3] == "file" and after["empty"][3] == "dir" and after["GUIDE"][4] == "manual/guide.md"
    assert ch["record"] == f"R/{cid}" and ch["deleted"] >= 10 and ch["bytes"] >= 1 << 20
    # the space kept is what the cell changed: the pre-images of what it deleted or modified, not the worktree
    before_bytes = sum(os.lstat(os.path.join(d, f)).st_size for d, _, fs in
                       os.walk(os.path.join(changes.layer_dir(env.st, "R", cid), "before")) for f in fs)
    assert before_bytes < 64 * 1024
    out = changes.undo(env.st, env.j, [f"R/{cid}"])
    assert tree(env.wt) == orig
    assert git(env.wt, "log", "--oneline").strip().endswith("first") and git(env.wt, "status", "--porcelain") == ""
    git(env.wt, "fsck", "--strict")
    uid = out["records"][0]["record"].split("/")[1]
    changes.undo(env.st, env.j, [f"R/{uid}"])  # redo
    assert tree(env.wt) == after


def test_a_directory_rename_in_the_lower_is_a_copy_and_shows_as_deleted_plus_created(env):
    project(env.wt)
    cid, _, ch = env.cell("mv src source")
    rec = changes.diff(env.st, env.j, cid, stat=True)
    kinds = {e["path"]: e["change"] for e in rec["entries"]}
    assert kinds["src"] == "deleted" and kinds["source"] == "created" and kinds["source/pkg/core.py"] == "created"


@pytest.mark.parametrize("volatile", [False, True])
def test_an_empty_cell_over_a_real_overlay_leaves_no_record_and_no_directory(env, monkeypatch, volatile):
    """`run -- true`: a few rmdir calls (a volatile overlay leaves work/work/incompat/volatile/dirty)."""
    if volatile:
        monkeypatch.setattr(sys.modules[__name__], "OPTS", OPTS + ",volatile")
    project(env.wt)
    orig = tree(env.wt)
    rmtree_used = []
    real = changes._rm
    monkeypatch.setattr(changes, "_rm", lambda p: rmtree_used.append(p) or real(p))
    cid, _, ch = env.cell("true; cat README > /dev/null")
    assert ch["files"] == 0 and not os.path.exists(changes.layer_dir(env.st, "R", cid)) and tree(env.wt) == orig
    assert env.j.change_rows() == [] and rmtree_used == []  # the fast path, no tree walk


def test_undo_refuses_with_75_naming_the_later_cell_and_force_overrides(env):
    project(env.wt)
    orig = tree(env.wt)
    a, _, _ = env.cell("echo by-a > README")
    b, _, _ = env.cell("echo by-b >> README; echo new > other")
    before = tree(env.wt)
    with pytest.raises(ChangeConflict) as ei:
        changes.undo(env.st, env.j, [f"R/{a}"])
    assert exit_code(ei.value) == 75 and b in ei.value.message and "README" in ei.value.message
    assert tree(env.wt) == before
    changes.undo(env.st, env.j, [f"R/{a}"], force=True)
    now = tree(env.wt)
    assert now["README"] == orig["README"] and "other" in now


@pytest.mark.parametrize("point", ["changes_mid_commit", "changes_before_record"])
def test_a_controller_killed_during_the_commit_leaves_it_for_the_janitor_who_finishes_it(env, point):
    project(env.wt)
    orig = tree(env.wt)
    layer = changes.prepare(env.st, "R", "c1", worktree=env.wt, agent_id="A")
    seen = overlay_run(layer, env.wt, DESTROY)
    code = ("import sys; from agnsup import changes; "
            f"changes.commit({env.st!r}, 'R', 'c1', {env.wt!r}, agent_id='A')")
    cp = subprocess.run([sys.executable, "-c", code], env={**os.environ, "AGNSUP_TEST_CRASH_AT": point},
                        capture_output=True, timeout=120)
    assert cp.returncode == -9, cp.stderr  # SIGKILLed at the point: no finally block ran
    assert os.path.exists(os.path.join(layer.dir, "plan.json"))
    done = changes.finish_all(env.st, env.j)
    assert [(d["record_id"], d["action"]) for d in done] == [("c1", "finished")]
    assert tree(env.wt) == seen
    assert env.j.change_row("R", "c1")["state"] == "committed"
    assert not os.path.exists(layer.upper) and not os.path.exists(os.path.join(layer.dir, "plan.json"))
    changes.undo(env.st, env.j, ["R/c1"])
    assert tree(env.wt) == orig


def test_a_dead_cells_layer_is_committed_by_the_janitor_and_says_so(env, tmp_path):
    project(env.wt)
    env.j.register_controller({"id": "ctl-1", "kind": "run", "pid": 1, "pidfd_ino": None, "starttime": 1,
                               "boot_id": "b", "lock_path": str(tmp_path / "ctl.lock"), "started_at": time.time()})
    env.j.begin_cell({"run_id": "R", "cell_id": "c1", "agent_id": "A", "role": "executor", "token": "t",
                      "controller_id": "ctl-1", "boot_id": "b", "cgroup": "{}", "tmpdir": None, "worktree": env.wt,
                      "lock_path": None, "argv": '["sh"]', "exe": "/bin/sh", "created_at": time.time(), "grace": 1.0},
                     [{"stage": "public_tool", "t": 0}])
    layer = changes.prepare(env.st, "R", "c1", worktree=env.wt, agent_id="A")
    seen = overlay_run(layer, env.wt, "rm -rf .git; echo left > left.txt")
    assert changes.finish_all(env.st, env.j) == []  # the journal says c1 is starting: its controller may live
    env.j.conclude_recovered([{"run_id": "R", "cell_id": "c1", "controller": "ctl-1", "entry": {"notes": []},
                               "receipt": {}}], "j-1", time.time(), "/dev/null")
    done = changes.finish_all(env.st, env.j)  # recovered: its tree is gone
    assert [(d["record_id"], d["action"]) for d in done] == [("c1", "committed")]
    assert done[0]["changes"]["record"] == "R/c1" and tree(env.wt) == seen


@pytest.fixture
def tmpfs_state(tmp_path):
    mnt = str(tmp_path / "tmpfs")
    os.makedirs(mnt)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m,mode=0700", "tmpfs", mnt], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", mnt], check=True)


def test_a_state_root_on_tmpfs_over_a_worktree_on_ext4_copies_across_and_undoes(tmpfs_state, tmp_path):
    wt = str(tmp_path / "wt")
    if changes.fs_type(str(tmp_path)) == 0x01021994:  # TMPFS_MAGIC
        pytest.skip("ENV_BLOCKED: the test's own directory is a tmpfs here (the v2 guest's /tmp): no second "
                    "file system for the worktree")
    e = Env(os.path.join(tmpfs_state, "state"), wt)
    try:
        assert changes.fs_type(e.st) == 0x01021994 and changes.fs_type(wt) != 0x01021994  # TMPFS_MAGIC
        assert changes.unsupported(e.st, wt) is None
        project(wt)
        orig = tree(wt)
        cid, seen, ch = e.cell(DESTROY)
        assert tree(wt) == seen
        out = changes.undo(e.st, e.j, [f"R/{cid}"])
        assert tree(wt) == orig
        changes.undo(e.st, e.j, [out["records"][0]["record"]])
        assert tree(wt) == seen
    finally:
        e.close()


def test_a_crash_at_every_cross_fs_step_is_finished_by_the_next_attempt(tmpfs_state, tmp_path, monkeypatch):
    """State on tmpfs, worktree on ext4: every save and install is copy + rename + remove. Count
    the steps of a clean commit, then crash at each one and resume: always the clean result."""
    def scenario(k, name):
        wt = str(tmp_path / f"wt-{name}")
        e = Env(os.path.join(tmpfs_state, f"state-{name}"), wt)
        project(wt, repo=False)
        layer = changes.prepare(e.st, "R", "c1", worktree=wt, agent_id="A")
        overlay_run(layer, wt, "rm -rf src; echo x >> README; mkdir -p made/d; echo y > made/d/y; chmod 700 notes.txt")
        seen = []

        def hook(step):
            seen.append(step)
            if len(seen) == k:
                raise RuntimeError("crash at " + step)
        monkeypatch.setattr(changes, "_step_hook", hook)
        try:
            changes.commit(e.st, "R", "c1", wt, agent_id="A")
        except RuntimeError:
            monkeypatch.setattr(changes, "_step_hook", None)
            changes.commit(e.st, "R", "c1", wt, agent_id="A")
        monkeypatch.setattr(changes, "_step_hook", None)
        got = {p: v[:5] for p, v in tree(wt).items()}  # without times: each scenario's files are new
        e.close()
        return got, seen

    want, steps = scenario(None, "clean")
    assert {"put.saved_copy", "put.copied", "put.src_removed"} <= set(steps)
    for k in range(1, len(steps) + 1):
        got, _ = scenario(k, f"k{k}")
        assert got == want, f"crash at step {k} ({steps[k - 1]})"


@pytest.fixture
def shared_tmp():
    """A directory a normal user can reach (pytest's tmp_path is root's, mode 0700), on a file system
    that can hold an overlay's upper layer."""
    d = tempfile.mkdtemp(prefix="agnsup-changes-", dir="/var/tmp")
    os.chmod(d, 0o755)
    why = changes.unsupported(d, d)
    if why is not None:
        shutil.rmtree(d, ignore_errors=True)
        pytest.skip(f"ENV_BLOCKED: /var/tmp here: {why} (the v2 guest's is 9p under an overlay)")
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def as_user(uid: int, fn, *args) -> None:
    """Run fn(*args) in a forked child with the user's ids only (the controller of a normal user).
    What the child imports is imported first: this interpreter's library may lie where that user
    cannot read (pyenv under /root)."""
    import ctypes  # noqa: F401 - linux/sys.py's, imported lazily by changes
    import importlib.readers  # noqa: F401 - the journal's migrations (importlib.resources)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            fn(*args)
            code = 0
        except BaseException as e:  # noqa: BLE001 - reported through the exit status
            sys.stderr.write(f"as_user: {e!r}\n")
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_normal_users_state_root_and_overlay_userxattr_commit_undo_and_redo(shared_tmp):
    st, wt = os.path.join(shared_tmp, "state"), os.path.join(shared_tmp, "wt")
    os.makedirs(wt)
    project(wt)
    subprocess.run(["chown", "-R", f"{NOBODY}:{NOBODY}", wt], check=True)
    os.makedirs(st, mode=0o700)
    os.chown(st, NOBODY, NOBODY)
    orig = tree(wt)
    results = os.path.join(shared_tmp, "out.json")
    open(results, "w").close()
    os.chown(results, NOBODY, NOBODY)

    def prep():
        changes._UNSUPPORTED_CACHE.clear()
        assert changes.unsupported(st, wt) is None  # the user.* probe
        changes.prepare(st, "R", "c1", worktree=wt, agent_id="A")
    as_user(NOBODY, prep)
    layer = changes.Layer(changes.layer_dir(st, "R", "c1"), *(os.path.join(changes.layer_dir(st, "R", "c1"), p)
                                                              for p in ("upper", "work")))
    seen = overlay_run(layer, wt, "rm -rf src; mkdir src; echo n > src/n.py; rm README; echo new >> notes.txt",
                       user=NOBODY)
    assert os.getxattr(os.path.join(layer.upper, "src"), "user.overlay.opaque") == b"y"
    # inside its namespace the user is root (unshare -U maps the user to 0): back to host ids
    seen = {p: [v[0], NOBODY if v[1] == 0 else v[1], NOBODY if v[2] == 0 else v[2], *v[3:]] for p, v in seen.items()}

    def commit_undo_redo():
        j = Journal(os.path.join(st, "journal.db"))
        ch = changes.commit(st, "R", "c1", wt, agent_id="A")
        j.add_change(changes.summary_row(ch))
        with open(results, "w") as f:
            json.dump({"after": tree(wt)}, f)
        out = changes.undo(st, j, ["R/c1"])
        with open(results) as f:
            r = json.load(f)
        r["undone"] = tree(wt)
        changes.undo(st, j, [out["records"][0]["record"]])
        r["redone"] = tree(wt)
        with open(results, "w") as f:
            json.dump(r, f)
        j.close()
    as_user(NOBODY, commit_undo_redo)
    with open(results) as f:
        r = json.load(f)
    assert r["after"] == seen and r["undone"] == orig and r["redone"] == seen
    assert sorted(os.listdir(os.path.join(wt, "src"))) == ["n.py"]
    assert all(v[1] == NOBODY for v in r["after"].values())
    assert "user.overlay.opaque" not in os.listxattr(os.path.join(wt, "src"))


def test_special_files_across_file_systems_a_fifo_is_kept_a_bound_socket_is_not(tmpfs_state, tmp_path):
    wt = str(tmp_path / "wt")
    e = Env(os.path.join(tmpfs_state, "state"), wt)
    try:
        project(wt, repo=False)
        sock = "import socket; s = socket.socket(socket.AF_UNIX); s.bind('sock')"
        cid, seen, ch = e.cell(f"mkfifo fifo; {sys.executable} -c \"{sock}\"")
        assert seen["sock"][3:5] == ["other", stat.S_IFSOCK]  # the cell saw its socket
        assert stat.S_ISFIFO(os.lstat(os.path.join(wt, "fifo")).st_mode)
        assert not os.path.lexists(os.path.join(wt, "sock"))  # a socket's name means nothing once its process is gone
        changes.undo(e.st, e.j, [f"R/{cid}"])
        assert not os.path.lexists(os.path.join(wt, "fifo"))
    finally:
        e.close()
