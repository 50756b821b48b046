"""Fourteen spellings of "delete the worktree" that the gate lets through, each undone (issue 26).

No text gate reads every spelling: each form below passes `agnsup check` and really destroys a worktree
holding a source tree and a git repository (src/ gone or emptied, .git's history unreadable). The capture
does not read the command: it is the kernel's view of what the cell wrote (an overlay of the worktree), so
`agnsup undo CELL` gives the tree back byte for byte (paths, types, modes, owners, sizes, sha256, symlink
targets) and `git log` / `git fsck` work again.

The guarantee, removed: REV_PROOF_CHANGES=live runs the same cells with the role's
`[filesystem] changes = "live"` (writes straight to the worktree, not captured): every case fails (undo
refuses a live cell, and the tree stays destroyed; so do the records, symlink and daemon cases below;
measured: 18 failed, the 4 left are the control and the normal user's, which do not read it). The cost is
one worktree template per module, copied per case.

Beyond the spellings: a cell that goes for the records themselves (they are out of its reach), a
directory swapped for a symlink to a host directory (diff, undo and redo never write through it), a
destroyer that outlives its command (dead before the commit), and three forms as a normal user.
"""
from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess

import pytest

from conftest import skip_unless_capturable, write_role
from fsimages import listing, listing_diff

RM = "rm -rf src .git"  # what every form below spells differently
HEX = RM.encode().hex()
B64 = base64.b64encode(RM.encode()).decode()

ATTACKS = {
    "base64_pipe_sh": f"echo {B64} | base64 -d | sh",
    "sh_c_command_substitution": "sh -c \"$(printf '%s%s -%s%s src .git' r m r f)\"",
    "python_shutil_rmtree": "python3 -c 'import shutil\nfor p in (\"src\", \".git\"): shutil.rmtree(p, True)'",
    "shell_function": "tidy() { \"$1\" -rf src .git; }; tidy rm",
    "copied_rm": "cp /bin/rm /tmp/zap && /tmp/zap -rf src .git",
    "symlinked_rm": "ln -s /bin/rm /tmp/zap && /tmp/zap -rf src .git",
    "ifs_games": "IFS=_; c=rm_-rf_src_.git; $c",
    "perl_pack": f"perl -e 'system(pack(\"H*\", \"{HEX}\"))'",
    "script_file": "printf '#!/bin/sh\\nrm -rf src .git\\n' > /tmp/tidy.sh && sh /tmp/tidy.sh",
    "makefile_target": "printf 'tidy:\\n\\trm -rf src .git\\n' > /tmp/mk && make -s -f /tmp/mk tidy",
    "tar_remove_files": "tar --remove-files -cf /tmp/all.tar src .git",
    "ls_while_read": "ls -A | while read -r f; do rm -rf \"$f\"; done",
    "truncate_every_file": "find . -type f -print0 | xargs -0 truncate -s0",
    "moved_out_of_the_worktree": "mkdir /tmp/away && mv src .git /tmp/away/",
}

GIT = ["git", "-c", "user.name=t", "-c", "user.email=t@example.invalid", "-c", "init.defaultBranch=main",
       "-c", "safe.directory=*"]  # a normal user's worktree, read by root


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> str:
    """A small project, made once: src/ (text, binary, an executable, a symlink, an empty directory,
    a nested package) and a git repository of three commits, some objects packed, some loose."""
    root = str(tmp_path_factory.mktemp("attack") / "template")
    os.makedirs(os.path.join(root, "src", "pkg", "sub"))
    os.makedirs(os.path.join(root, "src", "empty"))
    for i in range(5):
        with open(os.path.join(root, "src", "pkg", f"m{i}.py"), "w") as f:
            f.write(f"def f{i}():\n    return {i}\n" * 20)
    with open(os.path.join(root, "src", "pkg", "sub", "data.bin"), "wb") as f:
        f.write(bytes(range(256)) * 64)
    with open(os.path.join(root, "src", "run.sh"), "w") as f:
        f.write("#!/bin/sh\necho run\n")
    os.chmod(os.path.join(root, "src", "run.sh"), 0o755)
    os.chmod(os.path.join(root, "src", "pkg", "sub"), 0o750)
    os.symlink("pkg/m0.py", os.path.join(root, "src", "entry.py"))
    with open(os.path.join(root, "README.md"), "w") as f:
        f.write("# project\n")

    def git(*args):
        subprocess.run([*GIT, *args], cwd=root, check=True, capture_output=True, timeout=60)

    git("init", "-q")
    git("add", "-A")
    git("commit", "-qm", "one")
    git("repack", "-qad")  # history in a pack, the later commits' objects loose
    with open(os.path.join(root, "src", "pkg", "m1.py"), "a") as f:
        f.write("# two\n")
    git("commit", "-qam", "two")
    with open(os.path.join(root, "README.md"), "a") as f:
        f.write("three\n")
    git("commit", "-qam", "three")
    return root


@pytest.fixture
def project(template, tmp_path) -> str:
    wt = str(tmp_path / "wt")
    subprocess.run(["cp", "-a", template, wt], check=True, timeout=60)
    return wt


def _git_ok(wt: str) -> bool:
    for args in (["log", "--oneline"], ["fsck", "--full", "--no-progress"]):
        if subprocess.run([*GIT, *args], cwd=wt, capture_output=True, timeout=60).returncode != 0:
            return False
    return True


def _role_args(policy_dir) -> list[str]:
    """The default role; REV_PROOF_CHANGES=live (or another mode) runs the cells under a copy of it
    with `[filesystem] changes` set so (how this file proves it fails when capture is off)."""
    mode = os.environ.get("REV_PROOF_CHANGES")
    if not mode:
        return []
    write_role(policy_dir, "attack", filesystem__changes=json.dumps(mode))
    return ["--role", "attack"]


@pytest.mark.parametrize("form", list(ATTACKS), ids=list(ATTACKS))
def test_an_obfuscated_delete_passes_the_gate_destroys_and_undo_restores_the_tree(form, project, agnsup,
                                                                                 policy_dir):
    script = ATTACKS[form]
    env = {"AGNSUP_POLICY_DIR": str(policy_dir)}
    role = _role_args(policy_dir)
    before = listing(project)
    assert _git_ok(project)

    # 1. the gate cannot read this spelling: it lets it through
    cp = agnsup("check", *role, "--workdir", project, "--json", "--", "sh", "-c", script, env=env)
    assert cp.returncode == 0 and json.loads(cp.out)["allowed"] is True, cp.out + cp.err

    # 2. it really destroys: src/ gone or emptied, and git's history unreadable
    cell = f"atk-{form.replace('_', '-')}"[:40]
    cp = agnsup("run", *role, "--cell", cell, "--workdir", project, "--", "sh", "-c", script, env=env,
                timeout=120)
    # the command's own status (rm, tar, truncate cannot remove the protected .git/config and hooks, which
    # are read-only in the cell): anything but agnsup's own failures (timeout, setup, denied, not found)
    assert cp.returncode not in (124, 125, 126, 127), cp.err
    src = os.path.join(project, "src")
    src_files = [v for p, v in listing(src).items() if v[0] == "file"] if os.path.isdir(src) else []
    assert not src_files or all(v[4] == 0 for v in src_files), f"{form} left src/ intact"
    assert not _git_ok(project), f"{form} left the git history readable"
    assert listing(project) != before

    # 3. undo gives the tree back byte for byte, and git works again
    cp = agnsup("undo", cell, "--json", env=env, timeout=120)
    assert cp.returncode == 0, cp.out + cp.err
    after = listing(project)
    assert after == before, listing_diff(before, after)
    assert _git_ok(project)

    # the receipt said what was captured, and the record is now undone
    [r] = [x for x in agnsup.json("receipts", "--json") if x["cell_id"] == cell]
    ch = r.get("changes") or {}
    assert ch.get("mode") == "at_exit" and ch.get("deleted", 0) + ch.get("modified", 0) > 0, ch


def test_without_undo_the_destroyed_worktree_stays_destroyed(template, tmp_path, agnsup):
    """The control: the same copy left alone after one form is not restored by anything else (no stray
    rollback hides in the cell's teardown)."""
    wt = str(tmp_path / "wt")
    shutil.copytree(template, wt, symlinks=True)
    cp = agnsup("run", "--cell", "control", "--workdir", wt, "--", "sh", "-c", ATTACKS["ifs_games"])
    assert cp.returncode not in (124, 125, 126, 127), cp.err
    assert not os.path.exists(os.path.join(wt, "src")) and not _git_ok(wt)


@pytest.fixture
def var_state(tmp_path):
    """A state root outside /tmp (the cell's /tmp is a tmpfs of its own, so a state root under the test's
    tmp_path is not even in the cell's view: here it is, where a real one is, e.g. /var/lib/agnsup)."""
    import tempfile

    from conftest import _cleanup_cgroups
    root = tempfile.mkdtemp(prefix="agnsup-proof-state.", dir="/var/tmp")
    yield root
    leaked = _cleanup_cgroups(root)
    shutil.rmtree(root, ignore_errors=True)
    assert not leaked, leaked


def test_a_cell_cannot_destroy_the_records_that_undo_it(project, var_state, policy_dir):
    """The second cell, after the first deleted src/, goes for the records too (the state root's path
    spelled in base64, every record.json the file system shows, its own overlay's layers named in
    /proc/self/mountinfo) and then .git: the records are out of its reach, and undo of the run takes
    the worktree back to before the first cell."""
    from conftest import Agnsup
    agnsup = Agnsup(var_state, env={"AGNSUP_POLICY_DIR": str(policy_dir)})
    role = _role_args(policy_dir)
    before = listing(project)
    cp = agnsup("run", *role, "--cell", "first", "--workdir", project, "--", "sh", "-c", ATTACKS["perl_pack"])
    assert not os.path.exists(os.path.join(project, "src")) and not _git_ok(project), cp.err
    records = os.path.join(var_state, "changes")
    kept = listing(records)
    assert any(p.endswith("record.json") for p in kept), kept

    b64 = base64.b64encode(var_state.encode()).decode()
    wipe = (f"s=$(echo {b64} | base64 -d); ls -la \"$s\" \"$s/changes\"; rm -rf \"$s\"/changes \"$s\"/*; "
            "find / -xdev -name record.json -path '*changes*' -exec rm -f {} + ; "
            "for l in $(sed -n 's/.*upperdir=\\([^,]*\\).*workdir=\\([^,]*\\).*/\\1 \\2/p' /proc/self/mountinfo); "
            "do rm -rf \"$l\" \"$l/..\"; done; "
            "echo mine > planted.txt; rm -rf .git README.md")
    cp = agnsup("check", *role, "--workdir", project, "--json", "--", "sh", "-c", wipe)
    assert cp.returncode == 0, cp.out + cp.err
    cp = agnsup("run", *role, "--cell", "second", "--workdir", project, "--", "sh", "-c", wipe)
    assert cp.returncode not in (124, 125, 126, 127), cp.err
    assert not os.path.exists(os.path.join(project, "README.md"))
    now = listing(records)
    assert {p: v for p, v in now.items() if p in kept} == kept, listing_diff(kept, now)

    cp = agnsup("undo", "--run", "default", "--json", timeout=120)
    assert cp.returncode == 0, cp.out + cp.err
    after = listing(project)
    assert after == before, listing_diff(before, after)
    assert _git_ok(project)


@pytest.mark.parametrize("what", ["src", ".git/objects"])  # .git itself holds read-only protected paths
def test_undo_and_redo_of_a_directory_swapped_for_a_symlink_never_write_through_it(what, project, agnsup,
                                                                                   tmp_path, policy_dir):
    """A cell replaces a directory of the worktree with a symlink to a directory outside it (a victim the
    host can write): the commit lands the symlink, and neither diff, undo nor redo follows it: the
    victim is the same bytes after each, and the directory comes back whole."""
    victim = str(tmp_path / "victim")
    os.makedirs(os.path.join(victim, "keep"))
    for name in ("m0.py", "keep/precious.txt", "HEAD"):
        with open(os.path.join(victim, name), "w") as f:
            f.write(f"victim {name}\n")
    spared = listing(victim)
    before = listing(project)
    agnsup.env["AGNSUP_POLICY_DIR"] = str(policy_dir)
    cp = agnsup("run", *_role_args(policy_dir), "--cell", "swap", "--workdir", project, "--", "sh", "-c",
                f"rm -rf {what} && ln -s {victim} {what}")
    assert cp.returncode not in (124, 125, 126, 127), cp.err
    assert os.readlink(os.path.join(project, what)) == victim
    assert agnsup("diff", "swap", "--json").returncode == 0
    assert listing(victim) == spared

    cp = agnsup("undo", "swap", "--json")
    assert cp.returncode == 0, cp.out + cp.err
    assert listing(victim) == spared
    after = listing(project)
    assert after == before, listing_diff(before, after)

    [rec] = json.loads(cp.out)["records"]
    run_id, undo_id = rec["record"].split("/")
    cp = agnsup("undo", undo_id, "--run", run_id, "--json")  # redo: the symlink again, the victim untouched
    assert cp.returncode == 0, cp.out + cp.err
    assert os.readlink(os.path.join(project, what)) == victim
    assert listing(victim) == spared


def test_a_destroyer_that_outlives_the_command_is_dead_before_the_commit_and_undone(project, agnsup, policy_dir):
    """The command double-forks a setsid daemon that deletes the tree and then keeps writing, and exits
    as soon as the daemon has started: the cell's tree is killed before the commit (the state fixture
    fails the test if a process or cgroup is left), everything it did is in the record, and undo restores
    the tree. Nothing writes the worktree after `agnsup run` returned."""
    before = listing(project)
    script = ("mkfifo /tmp/up; "
              "setsid sh -c 'rm -rf src .git/objects; echo up > /tmp/up; while :; do echo x >> log; done' "
              "</dev/null >/dev/null 2>&1 & "
              "read line < /tmp/up; exit 0")
    agnsup.env["AGNSUP_POLICY_DIR"] = str(policy_dir)
    cp = agnsup("run", *_role_args(policy_dir), "--cell", "daemon", "--workdir", project, "--", "sh", "-c", script)
    assert cp.returncode == 0, cp.err
    assert not os.path.exists(os.path.join(project, "src")) and os.path.exists(os.path.join(project, "log"))
    size = os.path.getsize(os.path.join(project, "log"))
    [r] = [x for x in agnsup.json("receipts", "--json") if x["cell_id"] == "daemon"]
    assert r["changes"]["mode"] == "at_exit" and r["changes"]["deleted"] > 0, r["changes"]
    assert os.path.getsize(os.path.join(project, "log")) == size  # nothing of the cell writes any more
    cp = agnsup("undo", "daemon")
    assert cp.returncode == 0, cp.out + cp.err
    after = listing(project)
    assert after == before, listing_diff(before, after)
    assert _git_ok(project)


@pytest.mark.parametrize("form", ["ifs_games", "python_shutil_rmtree", "truncate_every_file"])
def test_a_normal_users_obfuscated_delete_is_undone(form, template, user):
    """Rootless: the overlay is mounted in the user's cell's own user namespace (userxattr), its record
    under the user's state root; the same destruction, the same byte-for-byte undo, owners kept."""
    skip_unless_capturable(user.home)  # the user's state root is in its home
    wt = os.path.join(user.own_dir("attack"), form)
    subprocess.run(["cp", "-a", template, wt], check=True, timeout=60)
    subprocess.run(["chown", "-R", f"{user.uid}:{user.gid}", wt], check=True, timeout=60)
    before = listing(wt)
    assert _git_ok(wt)
    cell = f"u-{form.replace('_', '-')}"
    cp = user("run", "--cell", cell, "--workdir", wt, "--", "sh", "-c", ATTACKS[form])
    assert cp.returncode not in (124, 125, 126, 127), cp.err
    assert not _git_ok(wt) and listing(wt) != before
    [r] = [x for x in user.json("receipts", "--json") if x["cell_id"] == cell]
    assert r["changes"]["mode"] == "at_exit" and not r["changes"].get("error"), r["changes"]
    cp = user("undo", cell)
    assert cp.returncode == 0, cp.out + cp.err
    after = listing(wt)
    assert after == before, listing_diff(before, after)
    assert _git_ok(wt)
    assert user.left() == []


# ---------------------------------------------------------------- the selftest door

@pytest.mark.parametrize("user", [None, 65534])
def test_the_worktree_selftest_door_holds_here_and_opens_with_capture_off(user, monkeypatch):
    """`agnsup selftest --isolation`'s WORKTREE_DESTROYED: HELD here (the undo gives back every path),
    OPEN when the probe's cell runs live (the door is judged by the undo, not by the receipt)."""
    from agnsup import tool
    from agnsup.selftest import doors_worktree, isolation
    h = isolation.Harness(keep=False, user=user)
    try:
        g = doors_worktree.RUNNERS["WORKTREE_DESTROYED"](h)
        if g["status"].startswith("ENV_BLOCKED"):  # the selftest's scratch cannot hold an upper (9p, overlayfs)
            pytest.skip(f"{g['status']}: {g['evidence']}")
        assert g["status"] == "PASS", g
        assert "put back all" in g["evidence"], g
        real = tool.run_process
        monkeypatch.setattr(tool, "run_process", lambda *a, **k: real(*a, changes="live", **k))
        shutil.rmtree(os.path.join(h.root, "reversible"))
        g = doors_worktree.RUNNERS["WORKTREE_DESTROYED"](h)
        assert g["status"] == "FAIL" and "ran live" in g["evidence"], g
    finally:
        h.close()
