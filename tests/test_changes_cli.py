"""`agnsup diff` and `agnsup undo` (issue 26) through the installed console script, over cells
that really ran (`agnsup run`: the overlay captured what they wrote), and Supervisor.diff/undo.

Each test compares full tree listings (paths, types, modes, owners, sizes, sha256, symlink
targets) before and after: an undo puts back exactly the pre-cell state, and a refusal
changes nothing on disk."""
import hashlib
import json
import os
import shutil
import stat
import subprocess
import time

import pytest

from conftest import Agnsup, write_role


def listing(root: str) -> dict:
    """Every path under `root` (itself included) -> (type, mode, uid, gid, size, sha256 | target)."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        dirs.sort()
        for name in [""] + sorted(dirs) + sorted(files):
            if name == "" and dirpath != root:
                continue
            p = os.path.join(dirpath, name) if name else dirpath
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode):
                what = os.readlink(p)
            elif stat.S_ISREG(st.st_mode):
                with open(p, "rb") as f:
                    what = hashlib.sha256(f.read()).hexdigest()
            else:
                what = None
            out[os.path.relpath(p, root)] = (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode), st.st_uid,
                                             st.st_gid, st.st_size if not stat.S_ISDIR(st.st_mode) else 0, what)
    return out


def git(wt, *args) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", wt, "-c", "user.name=t", "-c", "user.email=t@e", *args],
                          capture_output=True, text=True)


@pytest.fixture
def repo(worktree):
    """A worktree holding a git repository with two commits, text and binary files, a symlink."""
    os.makedirs(os.path.join(worktree, "src", "pkg"))
    for rel, text in (("README.md", "hello\nworld\n"), ("src/app.py", "print('app')\n"),
                      ("src/pkg/mod.py", "X = 1\nY = 2\n")):
        with open(os.path.join(worktree, rel), "w") as f:
            f.write(text)
    with open(os.path.join(worktree, "data.bin"), "wb") as f:
        f.write(bytes(range(256)) * 8)
    os.symlink("src/app.py", os.path.join(worktree, "app"))
    assert git(worktree, "init", "-q").returncode == 0
    assert git(worktree, "add", "-A").returncode == 0 and git(worktree, "commit", "-qm", "one").returncode == 0
    with open(os.path.join(worktree, "src/pkg/mod.py"), "a") as f:
        f.write("Z = 3\n")
    assert git(worktree, "commit", "-qam", "two").returncode == 0
    return worktree


def run(agnsup, wt, script, *opts, check=0):
    return agnsup("run", "--workdir", wt, *opts, "--", "sh", "-c", script, check=check)


def one_line(cp) -> str:
    lines = cp.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("agnsup"), cp.err
    return lines[0]


DESTROY = ("rm -rf src .git; printf 'bye\\n' >> README.md; chmod 600 README.md; echo new > new.txt; "
           "ln -sf README.md app; mkdir -p empty/dir; head -c 5000 /dev/zero > data.bin")


def test_diff_shows_what_a_cell_changed_and_undo_puts_it_back_byte_for_byte_then_redo(agnsup, repo):
    before = listing(repo)
    run(agnsup, repo, DESTROY, "--cell", "wreck")
    after = listing(repo)
    # .git/config and .git/hooks are kept read-only in a cell (protect): the rest of .git goes
    assert not os.path.exists(os.path.join(repo, ".git", "HEAD")) and git(repo, "log").returncode != 0

    text = agnsup("diff", "wreck", check=0).out
    head, *rows = text.splitlines()
    assert head.startswith("cell default/wreck (in force): ") and "created" in head and "deleted" in head
    for mark in ("M README.md  (mode 644 -> 600, +1 -0)", "A new.txt  (+1 -0)", "D src/  (dir)",
                 "D .git/HEAD  (+0 -1)", "A empty/  (dir)", "A empty/dir/  (dir)",
                 "M data.bin  (binary, 2.0 KiB -> 4.9 KiB)", "D src/app.py  (+0 -1)"):
        assert "  " + mark in rows, (mark, text)
    assert any(r.startswith("  ") and " app  (symlink, -> README.md" in r for r in rows), text
    assert "--- a/README.md\n+++ b/README.md\n" in text and "+bye\n" in text
    assert "-print('app')" in text and "Binary files a/data.bin and b/data.bin differ" in text

    st = agnsup("diff", "wreck", "--stat", check=0).out
    assert "  A new.txt  (+1 -0)" in st and "+++" not in st  # the list, no text

    d = agnsup.json("diff", "wreck", "--json")
    assert d["record"] == "default/wreck" and d["state"] == "committed" and d["kind"] == "cell"
    by_path = {e["path"]: e for e in d["entries"]}
    assert by_path["new.txt"]["change"] == "created" and "+new" in by_path["new.txt"]["diff"]
    assert by_path["src/app.py"]["change"] == "deleted" and by_path["data.bin"]["binary"]
    assert by_path["app"]["after"]["type"] == "symlink" and by_path["app"]["after"]["target"] == "README.md"

    rec = agnsup.json("receipts", "--cell", "wreck", "--json")[0]["changes"]
    assert rec["mode"] == "at_exit" and rec["record"] == "default/wreck" and rec["state"] == "kept"
    line = [x for x in agnsup("receipts", "--cell", "wreck", check=0).out.splitlines() if "changes:" in x]
    assert line and "(undo: agnsup undo wreck)" in line[0] and "deleted" in line[0], line

    out = agnsup("undo", "wreck", check=0).out
    assert listing(repo) == before  # byte for byte, modes, owners, symlink targets, .git included
    assert git(repo, "log", "--oneline").stdout.count("\n") == 2 and git(repo, "fsck").returncode == 0
    undo_id = out.split("this undo is record ", 1)[1].split()[0]
    assert undo_id.startswith("undo-") and f"undo it to redo: agnsup undo {undo_id}" in out

    cells = {c["cell_id"]: c for c in agnsup.json("ps", "--all", "--json")}
    assert cells["wreck"]["changes"] == {"record": "default/wreck", "files": len(d["entries"]), "state": "undone",
                                         "undone_by": undo_id}
    assert "changes=" in agnsup("ps", "--all", check=0).out
    again = agnsup("undo", "wreck", check=1)
    assert "already undone" in one_line(again) and undo_id in again.err

    u = agnsup.json("diff", undo_id, "--json")  # an undo record shows what it put back
    assert u["kind"] == "undo" and u["undoes"] == "wreck"

    redo = agnsup.json("undo", undo_id, "--json")  # undo of the undo: a redo
    assert redo["undone"] == [f"default/{undo_id}"] and redo["records"][0]["undoes"] == undo_id
    assert listing(repo) == after
    assert agnsup.json("ps", "--all", "--json")[0]["changes"]["state"] == "redone"
    assert agnsup("diff", "wreck", "--stat", check=0).out.startswith("cell default/wreck (redone, in force): ")
    agnsup("undo", "wreck", check=0)  # the cell's id still undoes what is in force (the redo)
    assert listing(repo) == before


def test_undo_refuses_over_a_later_cells_change_naming_it_and_force_overrides(agnsup, repo):
    run(agnsup, repo, "echo one >> README.md", "--cell", "first")
    run(agnsup, repo, "echo two >> README.md", "--cell", "second")
    now = listing(repo)
    cp = agnsup("undo", "first", check=75)
    line = one_line(cp)
    assert "second" in line and "README.md" in line and "--force" in line
    assert listing(repo) == now  # nothing touched
    j = agnsup("undo", "first", "--json", check=75)
    assert json.loads(j.out)["error_type"] == "ChangeConflict" and json.loads(j.out)["exit_code"] == 75
    agnsup("undo", "first", "--force", check=0)
    with open(os.path.join(repo, "README.md")) as f:
        assert f.read() == "hello\nworld\n"


def test_undo_refuses_a_change_made_outside_agnsup_since(agnsup, repo):
    run(agnsup, repo, "echo cell > out.txt", "--cell", "w")
    with open(os.path.join(repo, "out.txt"), "a") as f:
        f.write("by hand\n")
    now = listing(repo)
    line = one_line(agnsup("undo", "w", check=75))
    assert "changed outside agnsup since: out.txt" in line
    assert listing(repo) == now
    out = agnsup.json("undo", "w", "--force", "--json")
    assert not os.path.exists(os.path.join(repo, "out.txt"))
    # --force loses nothing: the undo's own record kept what it overwrote, the edit by hand included
    agnsup("undo", out["records"][0]["record"].split("/")[1], check=0)
    assert listing(repo) == now


def test_undo_a_run_or_an_agent_newest_first(agnsup, repo):
    before = listing(repo)
    run(agnsup, repo, "echo a1 >> README.md", "--run-id", "R", "--agent", "A", "--cell", "a1")
    run(agnsup, repo, "echo b1 > b.txt", "--run-id", "R", "--agent", "B", "--cell", "b1")
    run(agnsup, repo, "echo a2 >> README.md; rm src/app.py", "--run-id", "R", "--agent", "A", "--cell", "a2")
    run(agnsup, repo, "echo other > other.txt", "--run-id", "S", "--cell", "s1")

    out = agnsup.json("undo", "--agent", "A", "--run", "R", "--json")
    assert out["undone"] == ["R/a2", "R/a1"]  # newest first: a1's undo meets README.md as a1 left it
    with open(os.path.join(repo, "b.txt")) as f:
        assert f.read() == "b1\n"  # agent B's cell is not A's
    text = agnsup("undo", "--run", "R", check=0).out  # what is left of run R: b1
    assert "undid R/b1" in text and "--run R" in text
    assert os.path.exists(os.path.join(repo, "other.txt"))  # run S untouched
    agnsup("undo", "s1", check=0)
    assert listing(repo) == before
    line = one_line(agnsup("undo", "--run", "R", check=1))
    assert "nothing to undo for run R" in line


def test_bad_input_is_one_line_a_nonzero_exit_and_nothing_changed_on_disk(agnsup, repo, tmp_path, policy_dir):
    write_role(policy_dir, "liveexec", filesystem__changes='"live"')
    a = Agnsup(agnsup.state, env={"AGNSUP_POLICY_DIR": str(policy_dir)})
    run(a, repo, "true", "--cell", "idle")
    run(a, repo, "echo live > live.txt", "--role", "liveexec", "--cell", "lived")
    assert a.json("receipts", "--cell", "lived", "--json")[0]["changes"]["mode"] == "live"
    run(a, repo, "echo x > x.txt", "--cell", "twice", "--run-id", "R2")
    run(a, repo, "echo y > y.txt", "--cell", "twice", "--run-id", "R3")
    now, records = listing(repo), listing(os.path.join(agnsup.state, "changes"))
    rows = a.json("ps", "--all", "--json")
    for args, code, says in (
            (["undo", "nosuch"], 1, "no cell or change record 'nosuch'"),
            (["diff", "nosuch"], 1, "no cell or change record 'nosuch'"),
            (["undo", "idle"], 1, "changed nothing"),
            (["diff", "idle"], 1, "changed nothing"),
            (["undo", "lived"], 1, "ran live"),
            (["diff", "lived"], 1, "ran live"),
            (["undo", "twice"], 1, "several runs"),
            (["undo", "idle", "--run", "nosuchrun"], 1, "record 'idle' in run nosuchrun"),
            (["undo", "--run", "nosuchrun"], 1, "no run 'nosuchrun'"),
            (["undo", "--agent", "nobody"], 1, "no agent 'nobody'"),
            (["undo"], 125, "say what to undo"),
            (["undo", "idle", "--agent", "default"], 125, "give CELL"),
            (["undo", "bad/id"], 125, "invalid cell id"),
            (["diff"], 125, "Missing argument 'CELL'"),
            (["undo", "--bogus"], 125, "No such option"),
    ):
        cp = a(*args)
        assert cp.returncode == code and says in one_line(cp), (args, cp.returncode, cp.err)
        assert listing(repo) == now, args
        assert listing(os.path.join(agnsup.state, "changes")) == records, args  # no undo record begun
        if code != 125:
            js = a(*args, "--json")
            assert json.loads(js.out)["exit_code"] == code, (args, js.out)
    assert a.json("ps", "--all", "--json") == rows  # the journal says the same of every cell
    assert a.json("diff", "--cell-id", "twice", "--run-id", "R2", "--json")["record"] == "R2/twice"  # both spellings
    # run and --run R3: the id is no longer ambiguous
    a("undo", "--cell", "twice", "--run", "R3", check=0)
    assert not os.path.exists(os.path.join(repo, "y.txt"))


def test_a_dropped_record_and_a_moved_worktree_are_refused(agnsup, repo, tmp_path, policy_dir):
    write_role(policy_dir, "keepone", filesystem__changes_keep="1")
    a = Agnsup(agnsup.state, env={"AGNSUP_POLICY_DIR": str(policy_dir)})
    run(a, repo, "echo old > old.txt", "--role", "keepone", "--cell", "old")
    run(a, repo, "echo new > new.txt", "--role", "keepone", "--cell", "new")  # one record kept: `old` goes
    assert a.json("ps", "--all", "--json")[0]["changes"]["state"] == "dropped"
    assert not os.path.exists(os.path.join(agnsup.state, "changes", "default", "old"))  # its space freed
    assert "record dropped" in a("receipts", "--cell", "old", check=0).out
    now = listing(repo)
    assert "dropped" in one_line(a("undo", "old", check=1))
    assert "dropped" in one_line(a("diff", "old", check=1))
    assert listing(repo) == now

    moved = str(tmp_path / "moved")
    shutil.move(repo, moved)
    os.mkdir(repo)  # a new directory at the old path is not the worktree the record knows
    try:
        line = one_line(a("undo", "new", check=1))
        assert "moved or is gone" in line
        assert os.listdir(repo) == [] and os.path.exists(os.path.join(moved, "new.txt"))
    finally:
        os.rmdir(repo)
        shutil.move(moved, repo)
    a("undo", "new", check=0)
    assert not os.path.exists(os.path.join(repo, "new.txt"))


def test_undo_waits_for_the_worktree_lock_of_a_cell_still_running_there(agnsup, repo):
    """The undo writes the worktree: under a running cell's overlay that would change its lower
    layer (undefined for overlayfs) and interleave with its commit. It takes the lock first."""
    run(agnsup, repo, "echo w > w.txt", "--cell", "w")
    flag = os.path.join(repo, "started")
    p = agnsup.popen("run", "--workdir", repo, "--cell", "busy", "--", "sh", "-c",
                     f"touch {flag}; sleep 30", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not any(c["cell_id"] == "busy" and c["state"] == "running" for c in agnsup.json("ps", "--json")):
            assert time.monotonic() < deadline and p.poll() is None
            time.sleep(0.05)
        cp = agnsup("undo", "w", "--lock-timeout", "0.3", check=75)
        assert "lock" in cp.err.strip().splitlines()[-1] and os.path.exists(os.path.join(repo, "w.txt"))
    finally:
        agnsup("cancel", "--cell", "busy", "--grace", "0")
        p.wait(30)
    agnsup("undo", "busy", check=0)  # what it wrote (the flag) landed when it ended; now it goes
    agnsup("undo", "w", check=0)
    assert not os.path.exists(os.path.join(repo, "w.txt"))


def test_the_python_api_diffs_and_undoes_with_the_same_refusals(state, repo):
    from agnsup.errors import ChangeConflict, NotReversible, UnknownId, UsageError
    from agnsup.supervisor import Supervisor
    with Supervisor(state) as sup:
        r1 = sup.run(["sh", "-c", "echo one > f.txt; rm -r src"], workdir=repo, run_id="api", cell_id="c1")
        assert r1["exit_code"] == 0
        sup.run(["sh", "-c", "echo two >> f.txt"], workdir=repo, run_id="api", cell_id="c2")
        d = sup.diff("c1", stat=True)
        assert {e["path"]: e["change"] for e in d["entries"]}["f.txt"] == "created"
        assert "diff" not in d["entries"][0] and "added" in {k for e in d["entries"] for k in e}
        with pytest.raises(ChangeConflict) as e:
            sup.undo("c1", run_id="api")
        assert e.value.exit_code == 75 and "c2" in e.value.message
        with pytest.raises(UnknownId):
            sup.diff("nosuch")
        with pytest.raises(UsageError):
            sup.undo()
        out = sup.undo(run_id="api")
        assert out["undone"] == ["api/c2", "api/c1"]
        assert os.path.exists(os.path.join(repo, "src", "app.py")) and not os.path.exists(os.path.join(repo, "f.txt"))
        with pytest.raises(NotReversible):
            sup.undo("c1", run_id="api")
        redo = sup.undo(out["records"][-1]["record"].split("/")[1], run_id="api")
        assert redo["undone"] and os.path.exists(os.path.join(repo, "f.txt"))


def test_cleanup_of_a_run_frees_its_records(agnsup, repo):
    run(agnsup, repo, "echo r > r.txt", "--run-id", "R", "--cell", "r1")
    run(agnsup, repo, "echo s > s.txt", "--run-id", "S", "--cell", "s1")
    out = agnsup.json("cleanup", "--run", "R", "--json")
    assert {"kind": "changes", "path": "R/r1"} in out["items"]
    assert not os.path.exists(os.path.join(agnsup.state, "changes", "R"))
    assert "dropped" in one_line(agnsup("undo", "r1", check=1)) and os.path.exists(os.path.join(repo, "r.txt"))
    assert "record dropped" in agnsup("receipts", "--run", "R", check=0).out
    again = agnsup.json("cleanup", "--run", "R", "--json")
    assert not [i for i in again["items"] if i["kind"] == "changes"]
    agnsup("undo", "s1", check=0)  # another run's record is untouched


def test_a_host_git_status_after_the_cell_does_not_block_its_undo(agnsup, repo):
    """git's index is a stat cache: `git status` on the host rewrites it after every cell. An undo
    replaces it without calling that a change made outside agnsup; the redo brings back what it
    replaced (fails when .git/index drift counts: exit 75, "changed outside agnsup since")."""
    before = listing(repo)
    run(agnsup, repo, "echo more >> README.md && git -c user.name=t -c user.email=t@e commit -qam three")
    cell = agnsup.json("receipts", "--json")[-1]["cell_id"]
    index = os.path.join(repo, ".git", "index")
    stamp = os.stat(index)
    os.utime(os.path.join(repo, "src", "app.py"), (time.time() + 5, time.time() + 5))  # not the cell's file
    assert git(repo, "status", "--porcelain").returncode == 0
    assert os.stat(index).st_ino != stamp.st_ino  # git refreshed its index: a new file renamed into place
    undone = agnsup.json("undo", cell, "--json")
    after = listing(repo)
    assert {k: v for k, v in after.items() if k != ".git/index"} == \
        {k: v for k, v in before.items() if k != ".git/index"}
    assert git(repo, "fsck").returncode == 0 and git(repo, "log", "-1", "--format=%s").stdout.strip() == "two"
    agnsup.json("undo", undone["records"][0]["record"].split("/")[1], "--json")  # the redo
    assert git(repo, "log", "-1", "--format=%s").stdout.strip() == "three"
