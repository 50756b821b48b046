"""agnsup/changes.py over real directories: an upper layer made by hand the way overlayfs leaves it
(whiteouts = character devices 0/0, opaque directories = trusted.overlay.opaque "y", copied-up
files), committed into a worktree, undone, redone, refused, crashed at every step and resumed.
The kernel's own overlay is in tests/test_changes_core.py."""
from __future__ import annotations

import json
import os
import stat
import time

import pytest

from agnsup import changes
from agnsup.errors import AmbiguousId, ChangeConflict, NotReversible, StateError, UnknownId, exit_code
from agnsup.store.journal import Journal

ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="whiteouts owned by root and trusted.* xattrs need root")


def tree(root: str, times: bool = True) -> dict:
    """Everything a developer would call the worktree's state: per path its type, mode, owner,
    content or link target, and a file's mtime (a directory's mtime moves with its entries;
    `times=False` to compare trees made at different times)."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(dirs + files):
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            rel = os.path.relpath(p, root)
            if stat.S_ISLNK(st.st_mode):
                body = ("link", os.readlink(p), st.st_mtime_ns)
            elif stat.S_ISDIR(st.st_mode):
                body = ("dir",)
            else:
                with open(p, "rb") as f:
                    body = ("file", f.read(), st.st_mtime_ns)
            out[rel] = (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, *(body if times else body[:2]))
    return out


def write(path: str, data: bytes | str = b"x", mode: int | None = None) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
    if mode is not None:
        os.chmod(path, mode)
    return path


def record_of(layer_dir: str) -> dict:
    with open(os.path.join(layer_dir, "record.json")) as f:
        return json.load(f)


def read(path: str) -> str:
    with open(path) as f:
        return f.read()


def whiteout(path: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    os.mknod(path, stat.S_IFCHR | 0o000, os.makedev(0, 0))


def copy_up(wt: str, upper: str, rel: str) -> str:
    """What overlayfs does before a write: the lower file's copy (content, mode, owner, times) in the upper."""
    src, dst = os.path.join(wt, rel), os.path.join(upper, rel)
    parent = os.path.dirname(rel)
    while parent and not os.path.isdir(os.path.join(upper, parent)):
        parent = os.path.dirname(parent)
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    for d in _dirs_between(os.path.dirname(rel)):  # copied-up parents keep their mode and owner
        st = os.stat(os.path.join(wt, d))
        os.chmod(os.path.join(upper, d), stat.S_IMODE(st.st_mode))
    import shutil
    shutil.copy2(src, dst)
    st = os.lstat(src)
    os.chown(dst, st.st_uid, st.st_gid)
    return dst


def _dirs_between(rel: str) -> list[str]:
    out = []
    while rel:
        out.append(rel)
        rel = os.path.dirname(rel)
    return out


class Cell:
    """A cell as the controller drives one: journal row, layer, (the 'cell' writes the upper), commit,
    conclude with the receipt's changes section."""
    n = 0

    def __init__(self, env, run="R", agent="A", cell=None):
        Cell.n += 1
        self.env, self.run, self.agent = env, run, agent
        self.id = cell or f"c{Cell.n}"
        env.j.begin_cell({"run_id": run, "cell_id": self.id, "agent_id": agent, "role": "executor", "token": "t",
                          "controller_id": "ctl-1", "boot_id": "b", "cgroup": "{}", "tmpdir": None,
                          "worktree": env.wt, "lock_path": None, "argv": '["true"]', "exe": "/bin/true",
                          "created_at": time.time(), "grace": 1.0}, [{"stage": "public_tool", "t": 0}])
        env.j.mark_running(run, self.id)
        self.layer = changes.prepare(env.st, run, self.id, worktree=env.wt, agent_id=agent)
        self.upper = self.layer.upper
        os.makedirs(os.path.join(self.layer.work, "work"), exist_ok=True)
        os.chmod(os.path.join(self.layer.work, "work"), 0)  # as the kernel leaves it

    def end(self, live: bool = False) -> dict:
        ch = {"mode": "live"} if live else changes.commit(self.env.st, self.run, self.id, self.env.wt,
                                                          agent_id=self.agent)
        self.env.j.conclude_cell({"run_id": self.run, "cell_id": self.id, "state": "exited",
                                  "ended_at": time.time(), "exit_code": 0, "signal": None, "reason": "exited",
                                  "agent_id": self.agent, "changes": ch}, None)
        return ch


class Env:
    def __init__(self, tmp_path):
        self.st = str(tmp_path / "state")
        self.wt = str(tmp_path / "wt")
        os.makedirs(self.st)
        os.makedirs(self.wt)
        self.j = Journal(os.path.join(self.st, "journal.db"))
        self.j.register_controller({"id": "ctl-1", "kind": "run", "pid": 1, "pidfd_ino": None, "starttime": 1,
                                    "boot_id": "b", "lock_path": str(tmp_path / "ctl.lock"),
                                    "started_at": time.time()})

    def cell(self, **kw) -> Cell:
        return Cell(self, **kw)

    def undo(self, *ids, force=False):
        return changes.undo(self.st, self.j, list(ids), force=force)


@pytest.fixture
def env(tmp_path):
    e = Env(tmp_path)
    yield e
    e.j.close()


def project(wt: str) -> None:
    """A small project with history: sources, a .git directory, a symlink, an executable."""
    write(os.path.join(wt, "src/main.py"), "print('hello')\n")
    write(os.path.join(wt, "src/util/helpers.py"), "def f():\n    return 1\n")
    write(os.path.join(wt, ".git/HEAD"), "ref: refs/heads/main\n")
    write(os.path.join(wt, ".git/objects/ab/cdef"), bytes(range(256)) + b"\0" * 44)
    write(os.path.join(wt, "run.sh"), "#!/bin/sh\necho run\n", mode=0o755)
    write(os.path.join(wt, "README"), "readme\n")
    os.symlink("README", os.path.join(wt, "README.link"))


# -- commit --------------------------------------------------------------------------------------------
def test_a_cell_that_changed_nothing_leaves_no_record_no_layer_and_no_journal_row(env):
    project(env.wt)
    c = env.cell()
    ch = c.end()
    assert ch["files"] == 0 and "record" not in ch and ch["mode"] == "at_exit"
    assert not os.path.exists(changes.layer_dir(env.st, "R", c.id))
    assert not os.path.exists(os.path.join(env.st, "changes", "R"))
    assert env.j.change_rows() == []
    with pytest.raises(NotReversible, match="changed nothing"):
        env.undo(c.id)


@needs_root
def test_commit_lands_deletions_new_files_symlinks_and_empty_dirs_and_keeps_every_pre_image(env):
    project(env.wt)
    orig = tree(env.wt)
    c = env.cell()
    whiteout(os.path.join(c.upper, "src"))            # rm -rf src
    whiteout(os.path.join(c.upper, ".git"))           # rm -rf .git
    write(os.path.join(c.upper, "new/deep/file.txt"), "made by the cell\n")
    os.makedirs(os.path.join(c.upper, "emptydir"))
    os.symlink("new/deep/file.txt", os.path.join(c.upper, "link"))
    write(copy_up(env.wt, c.upper, "README"), "rewritten\n")
    ch = c.end()
    assert ch["record"] == f"R/{c.id}" and ch["created"] == 5 and ch["deleted"] == 9 and ch["modified"] == 1
    assert set(ch["paths"]) >= {"src", "src/main.py", ".git", ".git/objects/ab/cdef", "new/deep/file.txt", "README"}
    now = tree(env.wt)
    assert "src" not in now and ".git" not in now and now["emptydir"][3] == "dir"
    assert now["README"][4] == b"rewritten\n" and now["link"][4] == "new/deep/file.txt"
    assert not os.path.exists(c.upper) and not os.path.exists(c.layer.work)
    before = os.path.join(c.layer.dir, "before")
    assert tree(before) == {k: v for k, v in orig.items() if k.split("/")[0] in ("src", ".git", "README")}
    (row,) = env.j.change_rows()
    assert (row["run_id"], row["record_id"], row["state"], row["files"]) == ("R", c.id, "committed", ch["files"])
    rec = record_of(c.layer.dir)
    assert rec["version"] == 1 and rec["kind"] == "cell" and rec["worktree"] == env.wt
    assert {e["path"]: e["change"] for e in rec["entries"]}["README"] == "modified"


@needs_root
def test_an_opaque_directory_replaces_the_lower_tree_instead_of_merging_with_it(env):
    project(env.wt)
    c = env.cell()
    d = os.path.join(c.upper, "src")
    write(os.path.join(d, "only.py"), "new\n")  # rm -rf src; mkdir src; echo new > src/only.py
    os.setxattr(d, "trusted.overlay.opaque", b"y")
    c.end()
    assert sorted(os.listdir(os.path.join(env.wt, "src"))) == ["only.py"]
    assert "trusted.overlay.opaque" not in os.listxattr(os.path.join(env.wt, "src"))
    rec = record_of(c.layer.dir)
    assert {e["path"]: e["change"] for e in rec["entries"]} == {
        "src": "replaced", "src/main.py": "deleted", "src/only.py": "created", "src/util": "deleted",
        "src/util/helpers.py": "deleted"}


def test_a_merged_directory_keeps_the_lower_files_the_cell_did_not_touch(env):
    project(env.wt)
    c = env.cell()
    write(os.path.join(c.upper, "src/added.py"), "x\n")
    c.end()
    assert sorted(os.listdir(os.path.join(env.wt, "src"))) == ["added.py", "main.py", "util"]


def test_a_copy_up_with_the_same_content_is_a_mode_change_or_no_change_at_all(env):
    project(env.wt)
    c = env.cell()
    copy_up(env.wt, c.upper, "README")                          # opened for writing, left as it was
    os.chmod(copy_up(env.wt, c.upper, "run.sh"), 0o700)         # chmod
    ch = c.end()
    rec = record_of(c.layer.dir)
    assert [(e["path"], e["change"]) for e in rec["entries"]] == [("run.sh", "mode")]
    assert ch["files"] == 1 and stat.S_IMODE(os.stat(os.path.join(env.wt, "run.sh")).st_mode) == 0o700
    assert not os.path.exists(os.path.join(c.layer.dir, "before", "run.sh"))  # the content never moved
    env.undo(c.id)
    assert stat.S_IMODE(os.stat(os.path.join(env.wt, "run.sh")).st_mode) == 0o755


@pytest.mark.skipif(not ROOT, reason="root: the commit moves src/new.py out of the 0500 directory, which only "
                                     "root may (a normal user's commit fails there: EACCES in changes.put)")
def test_a_directory_whose_mode_changed_is_a_mode_entry_applied_after_its_children(env):
    project(env.wt)
    orig = tree(env.wt)
    c = env.cell()
    os.makedirs(os.path.join(c.upper, "src"))
    os.chmod(os.path.join(c.upper, "src"), 0o500)
    write(os.path.join(c.upper, "src/new.py"), "n\n")
    c.end()
    assert stat.S_IMODE(os.stat(os.path.join(env.wt, "src")).st_mode) == 0o500
    assert os.path.exists(os.path.join(env.wt, "src/new.py"))
    env.undo(c.id)
    assert tree(env.wt) == orig


def test_the_worktree_root_mode_change_is_recorded_only_against_what_prepare_saw(env):
    project(env.wt)
    os.chmod(env.wt, 0o755)
    c = env.cell()
    assert stat.S_IMODE(os.stat(c.upper).st_mode) == 0o755  # the cell sees its root as it is
    os.chmod(c.upper, 0o700)
    c.end()
    assert stat.S_IMODE(os.stat(env.wt).st_mode) == 0o700
    env.undo(c.id)
    assert stat.S_IMODE(os.stat(env.wt).st_mode) == 0o755


@needs_root
def test_id_shift_gives_the_files_of_a_mapped_cell_their_in_cell_owners(env):
    base = 100000
    c = env.cell()
    os.chown(c.upper, base, base)  # the upper's root as a mapped cell's layer holds it on disk
    p = write(os.path.join(c.upper, "made"), "m\n", mode=0o4755)
    os.chown(p, base + 1000, base + 1000)
    os.chmod(p, 0o4755)
    os.makedirs(os.path.join(c.upper, "d"))
    os.chown(os.path.join(c.upper, "d"), base, base)
    changes.commit(env.st, "R", c.id, env.wt, agent_id="A", id_shift=base)
    st = os.stat(os.path.join(env.wt, "made"))
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (1000, 1000, 0o4755)
    assert os.stat(os.path.join(env.wt, "d")).st_uid == 0
    assert os.stat(env.wt).st_uid == 0  # the root's owner is not taken for a change


@needs_root
def test_a_mapped_cell_that_changed_nothing_drops_its_layer_without_the_slow_path(env, monkeypatch):
    """The upper's root of a mapped cell holds the worktree root's owner shifted (mounts.overlay): a cell
    that wrote nothing is still "nothing changed" at a glance (the janitor's case for every dead cell)."""
    base = 100000
    c = env.cell()
    os.chown(c.upper, base, base)

    def slow(*a, **k):
        raise AssertionError("an empty layer went through the slow path")
    monkeypatch.setattr(changes, "_shift_ids", slow)
    monkeypatch.setattr(changes, "_scan", slow)
    ch = changes.commit(env.st, "R", c.id, env.wt, agent_id="A", id_shift=base)
    assert ch["files"] == 0 and "record" not in ch
    assert not os.path.exists(c.layer.dir)
    c2 = env.cell()  # a root whose owner the cell did change (shifted, not the worktree's) is not empty at a glance
    os.chown(c2.upper, base + 1000, base + 1000)
    with pytest.raises(AssertionError, match="slow path"):
        changes.commit(env.st, "R", c2.id, env.wt, agent_id="A", id_shift=base)


# -- undo, redo, refusals --------------------------------------------------------------------------------
def _destroy(env) -> Cell:
    c = env.cell()
    whiteout(os.path.join(c.upper, "src"))
    whiteout(os.path.join(c.upper, ".git"))
    write(copy_up(env.wt, c.upper, "README"), "gone\n")
    write(os.path.join(c.upper, "junk/a.bin"), os.urandom(2000))
    os.symlink("/etc/passwd", os.path.join(c.upper, "README.link.tmp"))
    c.end()
    return c


@needs_root
def test_undo_restores_the_worktree_byte_for_byte_and_undo_of_the_undo_redoes(env):
    project(env.wt)
    orig = tree(env.wt)
    c = _destroy(env)
    after = tree(env.wt)
    out = env.undo(c.id)
    assert out["undone"] == [f"R/{c.id}"] and out["records"][0]["record"].startswith("R/undo-")
    assert tree(env.wt) == orig
    assert env.j.change_row("R", c.id)["state"] == "undone"
    uid = out["records"][0]["record"].split("/")[1]
    assert env.j.change_row("R", c.id)["undone_by"] == uid
    redo = env.undo(f"R/{uid}")
    assert tree(env.wt) == after
    # undo CELL after a redo undoes the redo: the cell's effect is what is in force
    env.undo(c.id)
    assert tree(env.wt) == orig
    assert redo["records"][0]["kind"] == "undo"


@needs_root
def test_undo_refuses_to_overwrite_a_later_cells_change_naming_it_and_force_overrides(env):
    project(env.wt)
    orig = tree(env.wt)
    a = env.cell()
    write(copy_up(env.wt, a.upper, "README"), "by a\n")
    a.end()
    b = env.cell()
    write(copy_up(env.wt, b.upper, "README"), "by b\n")
    b.end()
    snapshot = tree(env.wt)
    with pytest.raises(ChangeConflict, match=rf"later changes by cell\(s\) {b.id} \(README\)") as ei:
        env.undo(a.id)
    assert exit_code(ei.value) == 75 and "\n" not in ei.value.message
    assert tree(env.wt) == snapshot  # nothing changed on disk
    env.undo(b.id)
    env.undo(a.id)
    assert tree(env.wt) == orig


@needs_root
def test_undo_of_a_tree_refuses_when_a_later_cell_wrote_inside_it(env):
    project(env.wt)
    a = env.cell()
    write(os.path.join(a.upper, "build/out.o"), b"\x7fELF")
    a.end()
    b = env.cell()
    write(os.path.join(b.upper, "build/extra.o"), b"x")
    b.end()
    with pytest.raises(ChangeConflict, match=b.id):
        env.undo(a.id)


def test_undo_refuses_a_change_made_outside_agnsup_since(env):
    project(env.wt)
    a = env.cell()
    write(copy_up(env.wt, a.upper, "README"), "by a\n")
    a.end()
    write(os.path.join(env.wt, "README"), "by hand\n")
    with pytest.raises(ChangeConflict, match="changed outside agnsup since: README"):
        env.undo(a.id)
    assert read(os.path.join(env.wt, "README")) == "by hand\n"
    rec = env.undo(a.id, force=True)["records"][0]
    assert read(os.path.join(env.wt, "README")) == "readme\n"
    # the overwritten version is kept: the undo record's before/ holds it (a redo brings it back)
    run, rid = rec["record"].split("/")
    assert read(os.path.join(changes.layer_dir(env.st, run, rid), "before", "README")) == "by hand\n"


def test_undo_of_a_run_goes_newest_first_and_only_undoes_what_is_in_force(env):
    project(env.wt)
    orig = tree(env.wt)
    c0, c1, c2 = env.cell(), env.cell(), env.cell()
    write(os.path.join(c0.upper, "a.txt"), "a\n")
    c0.end()
    write(copy_up(env.wt, c1.upper, "README"), "v1\n")
    c1.end()
    write(os.path.join(c2.upper, "a.txt"), "a2\n")  # over c0's file
    write(os.path.join(c2.upper, "b.txt"), "b\n")
    c2.end()
    other = env.cell(run="R2")
    write(os.path.join(other.upper, "other.txt"), "o\n")
    other.end()
    env.undo(c1.id)  # undone already: `undo --run R` must not redo it
    rows = changes.select(env.j, run_id="R")
    assert [r["record_id"] for r in rows] == [c2.id, c0.id]
    changes.undo(env.st, env.j, [(r["run_id"], r["record_id"]) for r in rows])
    now = tree(env.wt)
    assert now == {**orig, "other.txt": now["other.txt"]}
    assert [r["record_id"] for r in changes.select(env.j, agent_id="A")] == [other.id]


def test_bad_input_is_one_line_non_zero_and_changes_nothing(env, tmp_path):
    project(env.wt)
    orig = tree(env.wt)
    with pytest.raises(UnknownId) as ei:
        env.undo("nosuchcell")
    assert exit_code(ei.value) == 1
    nothing = env.cell()
    nothing.end()
    live = env.cell()
    live.end(live=True)
    with pytest.raises(NotReversible, match="ran live"):
        env.undo(live.id)
    with pytest.raises(NotReversible, match="changed nothing"):
        env.undo(nothing.id)
    a = env.cell()
    write(os.path.join(a.upper, "x"), "x\n")
    a.end()
    after = tree(env.wt)
    changes.prune(env.st, env.j, keep=0, keep_bytes=1 << 40)
    with pytest.raises(NotReversible, match="dropped"):
        env.undo(a.id)
    with pytest.raises(NotReversible, match="dropped"):
        changes.diff(env.st, env.j, a.id)
    assert tree(env.wt) == after
    b = env.cell()
    write(os.path.join(b.upper, "y"), "y\n")
    b.end()
    os.rename(env.wt, env.wt + ".moved")
    os.makedirs(env.wt)
    with pytest.raises(NotReversible, match="moved or is gone"):
        env.undo(b.id)
    assert os.listdir(env.wt) == []
    assert orig  # the project existed


def test_a_cell_id_in_two_runs_is_ambiguous_without_the_run(env):
    for run in ("R1", "R2"):
        c = env.cell(run=run, cell="same")
        write(os.path.join(c.upper, f"{run}.txt"), run)
        c.end()
    with pytest.raises(AmbiguousId, match="R1, R2"):
        env.undo("same")
    env.undo("R2/same")
    assert os.listdir(env.wt) == ["R1.txt"]


# -- crash safety ------------------------------------------------------------------------------------------
class Crash(Exception):
    pass


def _crash_at(k: int):
    seen = []

    def hook(name):
        seen.append(name)
        if len(seen) == k:
            raise Crash(name)
    return hook, seen


@needs_root
@pytest.mark.parametrize("what", ["commit", "undo"])
def test_a_crash_at_any_step_is_finished_by_the_next_attempt_never_half_merged(tmp_path, monkeypatch, what):
    """Run once without crashing to count the steps; then for every step k: crash there, resume
    (the next commit attempt, or the janitor for an undo), and get exactly the uncrashed result."""
    def scenario(k: int | None, sub: str):
        e = Env(tmp_path / sub)
        project(e.wt)
        c = e.cell()
        whiteout(os.path.join(c.upper, "src"))
        write(copy_up(e.wt, c.upper, "README"), "new\n")
        write(os.path.join(c.upper, "made/x"), "x\n")
        os.chmod(copy_up(e.wt, c.upper, "run.sh"), 0o700)
        hook, seen = _crash_at(k) if k is not None else (None, [])
        if what == "undo":
            c.end()
        monkeypatch.setattr(changes, "_step_hook", hook or (lambda n: seen.append(n)))
        try:
            if what == "commit":
                c.end()
            else:
                e.undo(c.id)
        except Crash:
            monkeypatch.setattr(changes, "_step_hook", None)
            if what == "commit":
                c.end()  # the controller's next attempt (the janitor's is the same call: finish_all)
            else:
                done = changes.finish_all(e.st, e.j)
                assert [d["action"] for d in done] == ["finished"]
        monkeypatch.setattr(changes, "_step_hook", None)
        result = tree(e.wt, times=False)
        # and the record is whole: undoing it (or redoing, for an undo) gets the other tree exactly
        last = e.j.change_rows()[-1]
        e.undo(f"R/{last['record_id']}")
        result = (result, tree(e.wt, times=False))
        e.j.close()
        return result, seen

    want, steps = scenario(None, "clean")
    assert len(steps) >= 6
    for k in range(1, len(steps) + 1):
        got, _ = scenario(k, f"crash{k}")
        assert got == want, f"crash at step {k} ({steps[k - 1]})"


def test_finish_all_commits_a_dead_controllers_cell_and_leaves_a_running_one_alone(env):
    project(env.wt)
    dead = env.cell()
    write(os.path.join(dead.upper, "left-by-dead.txt"), "d\n")
    running = env.cell()
    write(os.path.join(running.upper, "in-progress.txt"), "r\n")
    # the janitor marks the dead controller's cell recovered, then finishes what it left
    env.j.conclude_recovered([{"run_id": "R", "cell_id": dead.id, "controller": "ctl-1",
                               "entry": {"notes": []}, "receipt": {}}], "j-1", time.time(), "/dev/null")
    done = changes.finish_all(env.st, env.j)
    assert [(d["record_id"], d["action"]) for d in done] == [(dead.id, "committed")]
    assert done[0]["changes"]["paths"] == ["left-by-dead.txt"]
    assert os.path.exists(os.path.join(env.wt, "left-by-dead.txt"))
    assert not os.path.exists(os.path.join(env.wt, "in-progress.txt"))
    assert env.j.change_row("R", dead.id)["state"] == "committed"
    assert changes.finish_all(env.st, env.j) == []  # a second janitor: nothing to do
    running.end()
    assert changes.finish_all(env.st, env.j) == []  # indexed by conclude: only the marker went
    assert os.listdir(os.path.join(env.st, "changes", "pending")) == []


# -- diff, retention, quarantine, support -----------------------------------------------------------------
@needs_root
def test_diff_gives_unified_text_for_text_sizes_for_binary_and_follows_later_records(env):
    project(env.wt)
    a = env.cell()
    write(copy_up(env.wt, a.upper, "src/main.py"), "print('bye')\nprint('again')\n")
    write(os.path.join(a.upper, "blob.bin"), b"\0\1\2" * 100)
    whiteout(os.path.join(a.upper, "README"))
    a.end()
    d = changes.diff(env.st, env.j, a.id)
    by = {e["path"]: e for e in d["entries"]}
    assert by["src/main.py"]["diff"].splitlines()[:2] == ["--- a/src/main.py", "+++ b/src/main.py"]
    assert "-print('hello')" in by["src/main.py"]["diff"] and "+print('again')" in by["src/main.py"]["diff"]
    assert by["blob.bin"]["binary"] and by["blob.bin"]["sizes"] == [0, 300]
    assert by["README"]["diff"] == "--- a/README\n+++ /dev/null\n@@ -1 +0,0 @@\n-readme\n"
    s = changes.diff(env.st, env.j, a.id, stat=True)
    assert {e["path"]: (e.get("added"), e.get("removed")) for e in s["entries"]}["src/main.py"] == (2, 1)
    assert all("diff" not in e for e in s["entries"])
    # a later cell rewrote the file: a's after version is found in the later record's before/
    b = env.cell()
    write(copy_up(env.wt, b.upper, "src/main.py"), "third\n")
    b.end()
    assert "+print('again')" in {e["path"]: e for e in changes.diff(env.st, env.j, a.id)["entries"]}["src/main.py"]["diff"]
    # after undo, the diff is still readable (the pre-images went back into the worktree)
    env.undo(b.id)
    env.undo(a.id)
    d = changes.diff(env.st, env.j, a.id)
    assert d["state"] == "undone" and "-print('hello')" in {e["path"]: e for e in d["entries"]}["src/main.py"]["diff"]


def test_prune_drops_the_oldest_records_first_and_frees_their_space(env):
    ids = []
    for i in range(4):
        c = env.cell()
        write(os.path.join(c.upper, f"f{i}"), "y" * (1000 * (i + 1)))
        c.end()
        ids.append(c.id)
    for i in range(4):  # each a modification: pre-images of 1000..4000 bytes
        c = env.cell()
        write(copy_up(env.wt, c.upper, f"f{i}"), "z")
        c.end()
        ids.append(c.id)
    dropped = changes.prune(env.st, env.j, keep=6, keep_bytes=1 << 40)
    assert dropped == [f"R/{ids[0]}", f"R/{ids[1]}"]
    assert not os.path.exists(changes.layer_dir(env.st, "R", ids[0]))
    assert env.j.change_row("R", ids[0])["state"] == "dropped"
    # pre-images kept: 0, 0 (two creations), then 1000, 2000, 3000, 4000 bytes; down to 7000
    dropped = changes.prune(env.st, env.j, keep=100, keep_bytes=7000)
    assert dropped == [f"R/{i}" for i in ids[2:6]]
    assert changes.free_run(env.st, env.j, "R") == [f"R/{i}" for i in ids[6:]]
    assert not os.path.exists(os.path.join(env.st, "changes", "R"))


def test_cleanup_frees_the_runs_records_but_never_a_layer_not_yet_committed(env):
    """A layer whose commit has not happened (a read-only state root, a refused path) is the cell's
    only copy of its work: `cleanup --run` frees the records, leaves the layer for the janitor."""
    kept = env.cell()
    write(os.path.join(kept.upper, "done.txt"), "landed\n")
    kept.end()
    waiting = env.cell()
    write(os.path.join(waiting.upper, "work.txt"), "an afternoon\n")
    assert changes.free_run(env.st, env.j, "R") == [f"R/{kept.id}"]
    assert not os.path.exists(changes.layer_dir(env.st, "R", kept.id))
    with open(os.path.join(waiting.upper, "work.txt")) as f:
        assert f.read() == "an afternoon\n"


def test_drop_paths_forgets_what_protect_settle_quarantined(env):
    c = env.cell()
    write(os.path.join(c.upper, ".git/hooks/pre-commit"), "evil\n")
    write(os.path.join(c.upper, "ok.txt"), "ok\n")
    c.end()
    os.rename(os.path.join(env.wt, ".git"), str(env.wt) + ".quarantine")  # what settle does
    changes.drop_paths(env.st, "R", c.id, [".git"])
    rec = record_of(changes.layer_dir(env.st, "R", c.id))
    assert [e["path"] for e in rec["entries"]] == ["ok.txt"] and rec["quarantined"] == [".git"]
    env.undo(c.id)
    assert os.listdir(env.wt) == []


def test_unsupported_names_a_state_root_that_cannot_hold_an_upper_layer(env, monkeypatch):
    assert changes.unsupported(env.st, env.wt) is None
    assert changes.unsupported(env.st, os.path.join(env.wt, "nope")) == f"the worktree {env.wt}/nope is not a directory"
    os.unlink(os.path.join(env.st, "changes", ".xattr-probe"))  # as a state root never probed
    monkeypatch.setattr(changes, "_UNSUPPORTED_CACHE", {})
    monkeypatch.setattr(changes, "fs_type", lambda p: 0x6969)
    why = changes.unsupported(env.st, env.wt)
    assert why == f"the state root {env.st} is on NFS, which cannot hold an overlay upper layer"
    monkeypatch.setattr(changes, "_UNSUPPORTED_CACHE", {})
    monkeypatch.setattr(changes, "fs_type", lambda p: 0x794C7630)
    assert "overlayfs" in changes.unsupported(env.st, env.wt)


def test_the_probe_is_cached_on_disk_so_a_new_process_pays_one_getxattr(env, monkeypatch):
    assert changes.unsupported(env.st, env.wt) is None
    monkeypatch.setattr(changes, "_UNSUPPORTED_CACHE", {})
    calls = []
    real = os.setxattr
    monkeypatch.setattr(os, "setxattr", lambda *a, **k: calls.append(a) or real(*a, **k))
    monkeypatch.setattr(changes, "fs_type", lambda p: calls.append(p))
    assert changes.unsupported(env.st, env.wt) is None and calls == []


# -- the worktree is never reached through a symlink ---------------------------------------------------
def test_a_worktree_directory_swapped_for_a_symlink_mid_commit_is_never_followed(env, tmp_path, monkeypatch):
    """A live cell of the same agent could swap a directory for a symlink to /etc between the scan and
    the renames: the commit must fail there, not write through it (the layer stays for the janitor)."""
    os.makedirs(os.path.join(env.wt, "a"))
    write(os.path.join(env.wt, "a/y"), "y\n")
    outside = str(tmp_path / "outside")
    os.makedirs(outside)
    c = env.cell()
    write(os.path.join(c.upper, "a/x"), "planted\n")

    def swap(step):
        if step == "plan_written":
            os.rename(os.path.join(env.wt, "a"), os.path.join(env.wt, "a.real"))
            os.symlink(outside, os.path.join(env.wt, "a"))
    monkeypatch.setattr(changes, "_step_hook", swap)
    with pytest.raises(changes.UnsafePath):
        changes.commit(env.st, "R", c.id, env.wt, agent_id="A")
    assert os.listdir(outside) == []
    assert os.path.exists(os.path.join(c.upper, "a/x"))  # nothing lost: the janitor retries


def test_a_forced_undo_through_a_swapped_directory_neither_reads_nor_removes_outside_files(env, tmp_path):
    os.makedirs(os.path.join(env.wt, "a"))
    c = env.cell()
    write(os.path.join(c.upper, "a/x"), "made\n")
    c.end()
    outside = str(tmp_path / "outside")
    os.makedirs(outside)
    write(os.path.join(outside, "x"), "precious\n")
    os.rename(os.path.join(env.wt, "a"), os.path.join(env.wt, "a.real"))
    os.symlink(outside, os.path.join(env.wt, "a"))
    with pytest.raises(ChangeConflict, match="changed outside agnsup since: a/x"):
        env.undo(c.id)
    with pytest.raises(StateError, match="undo of R/.* stopped: .*symlink"):
        env.undo(c.id, force=True)
    assert read(os.path.join(outside, "x")) == "precious\n"


def test_importing_changes_costs_no_heavy_module_on_the_run_path():
    """commit() runs in every `agnsup run`: the modules test_startup_cost.py calls heavy stay out."""
    import subprocess
    import sys
    cp = subprocess.run([sys.executable, "-X", "importtime", "-c", "import agnsup.changes"], capture_output=True,
                        text=True, timeout=60)
    mods = {line.rpartition("|")[2].strip() for line in cp.stderr.splitlines() if line.startswith("import time:")}
    assert "agnsup.changes" in mods
    assert not mods & {"shutil", "typing", "secrets", "difflib", "ctypes", "sqlite3", "_sqlite3", "tempfile"}


def test_an_undo_that_died_before_its_plan_leaves_nothing_and_the_janitor_clears_it(env, monkeypatch):
    project(env.wt)
    c = env.cell()
    write(copy_up(env.wt, c.upper, "README"), "new\n")
    c.end()
    after = tree(env.wt)

    def die(*a, **k):
        raise Crash("before the plan")
    monkeypatch.setattr(changes, "_write_json", die)
    with pytest.raises(Crash):
        env.undo(c.id)
    monkeypatch.undo()
    assert tree(env.wt) == after
    assert [d for d in changes.finish_all(env.st, env.j)] == []
    assert sorted(os.listdir(os.path.join(env.st, "changes", "R"))) == [c.id]
    assert os.listdir(os.path.join(env.st, "changes", "pending")) == []
    env.undo(c.id)  # and the undo itself still works
    assert read(os.path.join(env.wt, "README")) == "readme\n"


def test_a_quarantined_replacement_leaves_the_pre_image_to_undo(env):
    """settle moved a file the cell replaced out of the worktree: undo brings the original back."""
    write(os.path.join(env.wt, ".mcp.json"), "{}\n")
    c = env.cell()
    write(copy_up(env.wt, c.upper, ".mcp.json"), '{"evil": 1}\n')
    c.end()
    os.rename(os.path.join(env.wt, ".mcp.json"), str(env.wt) + ".quarantined")
    changes.drop_paths(env.st, "R", c.id, [".mcp.json"])
    rec = record_of(changes.layer_dir(env.st, "R", c.id))
    assert [(e["path"], e["change"]) for e in rec["entries"]] == [(".mcp.json", "deleted")]
    env.undo(c.id)
    assert read(os.path.join(env.wt, ".mcp.json")) == "{}\n"


def test_a_rebuilt_journal_indexes_the_records_on_disk_again_with_their_undo_state(env, tmp_path):
    project(env.wt)
    a, b = env.cell(), env.cell()
    write(copy_up(env.wt, a.upper, "README"), "a\n")
    a.end()
    write(os.path.join(b.upper, "new"), "b\n")
    b.end()
    env.undo(a.id)
    fresh = Journal(str(tmp_path / "rebuilt.db"))
    try:
        added = changes.reindex(env.st, fresh)
        assert len(added) == 3 and added[:2] == [f"R/{a.id}", f"R/{b.id}"]
        assert fresh.change_row("R", a.id)["state"] == "undone"
        assert [r["record_id"] for r in changes.select(fresh, run_id="R")] == [b.id]
        assert changes.reindex(env.st, fresh) == []
    finally:
        fresh.close()


def test_a_cell_whose_commit_has_not_finished_is_named_so_not_as_unchanged(env, monkeypatch):
    project(env.wt)
    c = env.cell()
    write(copy_up(env.wt, c.upper, "README"), "new\n")

    def fail(step):
        if step == "plan_written":
            raise OSError(5, "Input/output error")
    monkeypatch.setattr(changes, "_step_hook", fail)
    with pytest.raises(OSError):
        changes.commit(env.st, "R", c.id, env.wt, agent_id="A")
    monkeypatch.setattr(changes, "_step_hook", None)
    env.j.conclude_cell({"run_id": "R", "cell_id": c.id, "state": "exited", "ended_at": time.time(), "exit_code": 0,
                         "signal": None, "reason": "exited", "agent_id": "A",
                         "changes": {"mode": "at_exit", "files": None, "error": "Input/output error"}}, None)
    with pytest.raises(NotReversible, match="not committed yet .Input/output error.: the janitor finishes"):
        env.undo(c.id)
    assert [d["action"] for d in changes.finish_all(env.st, env.j)] == ["finished"]
    env.undo(c.id)
    assert read(os.path.join(env.wt, "README")) == "readme\n"


def test_an_empty_layer_on_a_state_root_gone_read_only_is_still_nothing_changed(env, monkeypatch):
    c = env.cell()

    def erofs(*a, **k):
        raise OSError(30, "Read-only file system")
    for name in ("rmdir", "unlink"):
        monkeypatch.setattr(os, name, erofs)
    ch = changes.commit(env.st, "R", c.id, env.wt, agent_id="A")
    monkeypatch.undo()
    assert ch["files"] == 0 and "record" not in ch
    assert os.path.isdir(c.layer.dir)  # left for the janitor
    env.j.conclude_cell({"run_id": "R", "cell_id": c.id, "state": "exited", "ended_at": time.time(), "exit_code": 0,
                         "signal": None, "reason": "exited", "agent_id": "A", "changes": ch}, None)
    assert [d["action"] for d in changes.finish_all(env.st, env.j)] == ["empty"]
    assert not os.path.exists(c.layer.dir)


def test_a_tree_deeper_than_the_recursion_limit_is_recorded_and_removed(env):
    """A cell can make a directory chain deeper than Python's recursion limit: its record is still
    written, and dropping the record (retention) still frees it."""
    c = env.cell()
    fd = os.open(c.upper, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(1100):  # sys.getrecursionlimit() is 1000
        os.mkdir("d", dir_fd=fd)
        nfd = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = nfd
    os.close(os.open("leaf", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd))
    os.close(fd)
    ch = c.end()
    assert ch["files"] == 1101
    env.undo(c.id)  # the undo moves the chain into the undo record's before/ (one rename)
    assert os.listdir(env.wt) == []
    assert len(changes.prune(env.st, env.j, keep=0, keep_bytes=0)) == 2
    assert sorted(os.listdir(os.path.join(env.st, "changes"))) == [".xattr-probe", "pending"] or \
        not os.path.exists(os.path.join(env.st, "changes", "R"))


def test_prepare_makes_the_runs_directory_again_when_a_neighbour_cell_took_it_as_empty(tmp_path, monkeypatch):
    """Two cells of one run start at once: one that changed nothing removes the run's directory as empty
    (_drop_layer) just after the other made or found it; the other's layer is made all the same."""
    real, taken = os.mkdir, []

    def mkdir(path, mode=0o777):
        real(path, mode)
        if path == str(tmp_path / "changes" / "R") and not taken:  # the neighbour's rmdir, right after
            taken.append(path)
            os.rmdir(path)
    monkeypatch.setattr(changes.os, "mkdir", mkdir)
    layer = changes.prepare(str(tmp_path), "R", "c1")
    assert taken and os.path.isdir(layer.upper) and os.path.isdir(layer.work)
