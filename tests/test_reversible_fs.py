"""Reversible cells on every file system a worktree lives on, and for a normal user (issue 26).

The same change set (a file modified, created, deleted, a mode changed, a directory replaced by a file, a
symlink retargeted and one made, empty directories made and removed, a file and a directory renamed, a
1 MB file, a git commit) runs as a cell with the worktree on tmpfs, ext4, xfs and btrfs (loop-mounted
images of the test's own, tests/fsimages.py), the state root on the same file system (the commit renames
pre-images into the record) and on another one (it copies them). After the cell the worktree is exactly
what the same script gives run directly (changes land when the cell ends); `agnsup undo` gives the
pre-cell tree back byte for byte; undo of the undo gives the cell's tree again. A normal user's cell
(rootless: the overlay mounted inside its user namespace) does the same.

Where a file system or the kernel cannot hold an overlay upper layer the cell runs live: the receipt and
`agnsup doctor` name why, and a role with `isolation.require = ["reversible"]` refuses the cell: a state
root on overlayfs (a container's root file system) is that case, asserted for real here.
"""
from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

from conftest import write_role
from fsimages import KINDS, Images, fs_type, images, listing, listing_diff  # noqa: F401 - images is a fixture (F811 where a test takes it)

# The change set, as shell: every kind of change the record names. Dates fixed so git's objects are the
# same bytes in the cell and in the reference run; the umask fixed so modes are.
GIT = "git -c user.name=t -c user.email=t@example.invalid -c commit.gpgsign=false"
CHANGES = f"""set -e
umask 022
export GIT_AUTHOR_DATE=2026-01-01T00:00:00Z GIT_COMMITTER_DATE=2026-01-01T00:00:00Z
echo changed >> README.md
printf 'new\\n' > src/new.txt
rm src/pkg/m2.py
chmod 0700 src/run.sh
rm -r src/pkg/sub && printf x > src/pkg/sub
rm src/entry.py && ln -s pkg/m1.py src/entry.py
ln -s ../README.md src/readme-link
mkdir src/made-empty
rmdir src/empty
mv src/pkg/m3.py src/pkg/m3_renamed.py
mv src/lib src/lib2
head -c 1048576 /dev/zero | tr '\\0' a > big.bin
{GIT} add -A
{GIT} commit -qm four
"""


def make_project(root: str, owner: tuple[int, int] | None = None) -> None:
    """A small project with a git history of two commits at `root` (made), owned by `owner` if given."""
    os.makedirs(os.path.join(root, "src", "pkg", "sub"))
    os.makedirs(os.path.join(root, "src", "empty"))
    os.makedirs(os.path.join(root, "src", "lib", "deep"))
    for i in range(5):
        with open(os.path.join(root, "src", "pkg", f"m{i}.py"), "w") as f:
            f.write(f"def f{i}():\n    return {i}\n")
    for name in ("a.txt", "deep/b.txt"):
        with open(os.path.join(root, "src", "lib", name), "w") as f:
            f.write(name * 10)
    with open(os.path.join(root, "src", "pkg", "sub", "data.bin"), "wb") as f:
        f.write(bytes(range(256)) * 16)
    with open(os.path.join(root, "src", "run.sh"), "w") as f:
        f.write("#!/bin/sh\necho run\n")
    os.chmod(os.path.join(root, "src", "run.sh"), 0o755)
    os.symlink("pkg/m0.py", os.path.join(root, "src", "entry.py"))
    with open(os.path.join(root, "README.md"), "w") as f:
        f.write("# project\n")
    env = {**os.environ, "GIT_AUTHOR_DATE": "2025-01-01T00:00:00Z", "GIT_COMMITTER_DATE": "2025-01-01T00:00:00Z"}
    for cmd in ("init -q -b main", "add -A", "commit -qm one"):
        subprocess.run(f"{GIT} {cmd}", shell=True, cwd=root, check=True, capture_output=True, env=env, timeout=60)
    with open(os.path.join(root, "README.md"), "a") as f:
        f.write("two\n")
    subprocess.run(f"{GIT} commit -qam two", shell=True, cwd=root, check=True, capture_output=True, env=env,
                   timeout=60)
    if owner:
        subprocess.run(["chown", "-R", f"{owner[0]}:{owner[1]}", root], check=True)


def reference(root: str, preexec=None) -> dict:
    """The listing CHANGES gives run directly on a copy of `root` (no agnsup)."""
    ref = root.rstrip("/") + ".ref"
    subprocess.run(["cp", "-a", root, ref], check=True, timeout=60)
    try:
        cp = subprocess.run(["sh", "-c", CHANGES], cwd=ref, capture_output=True, text=True, timeout=120,
                            preexec_fn=preexec, env={"PATH": "/usr/bin:/bin", "HOME": ref, "LANG": "C.UTF-8"})
        assert cp.returncode == 0, cp.stderr
        return listing(ref)
    finally:
        subprocess.run(["rm", "-rf", ref], check=True, timeout=60)


def _receipt(receipts: list[dict], cell: str) -> dict:
    [r] = [x for x in receipts if x["cell_id"] == cell]
    return r


def _pre_image_moved_or_copied(state: str, original: os.stat_result, where: str) -> None:
    """The record's pre-image of README.md is the worktree's old file itself (renamed: same device and
    inode) when the state root shares its file system, a copy when it does not."""
    st = os.stat(os.path.join(state, "changes", "default", "fs1", "before", "README.md"))
    moved = (st.st_dev, st.st_ino) == (original.st_dev, original.st_ino)
    assert moved == (where == "same"), (where, st, original)


def _changed_then_undone(run, wt: str, cell: str, expected_after: dict, receipts, after_cell=None) -> None:
    """The cell's changes land at its end exactly as run directly; diff names them; undo gives the
    pre-cell tree; undo of the undo (redo) gives the cell's tree again."""
    before = listing(wt)
    cp = run("run", "--cell", cell, "--workdir", wt, "--", "sh", "-c", CHANGES)
    assert cp.returncode == 0, cp.err
    ch = _receipt(receipts(), cell).get("changes") or {}
    if ch.get("mode") != "at_exit":
        # a limit of this kernel or file system, not a pass: the receipt and doctor must both name it
        assert ch.get("mode") == "live" and ch.get("why"), f"capture did not happen and nothing says why: {ch}"
        doctor = json.loads(run("doctor", "--json").out).get("reversible") or {}
        assert doctor.get("available") is False and doctor.get("why_not"), (ch, doctor)
        pytest.skip(f"ENV_BLOCKED: {ch['why']} (doctor: {doctor['why_not']})")
    assert not ch.get("error"), ch  # the commit finished (else the janitor would have to)
    after = listing(wt)
    # .git/index caches each file's inode, device and times: the one path whose bytes differ between any
    # two runs of the same commands; git status reads it back as clean in both
    same = {p: v for p, v in after.items() if p != ".git/index"}
    assert same == {p: v for p, v in expected_after.items() if p != ".git/index"}, listing_diff(expected_after, after)
    assert after.keys() == expected_after.keys()
    assert ch["files"] > 0 and ch["created"] > 0 and ch["modified"] > 0 and ch["deleted"] > 0, ch
    if after_cell:
        after_cell()

    cp = run("diff", cell, "--json")
    assert cp.returncode == 0, cp.err
    text = cp.out
    for path in ("README.md", "src/new.txt", "src/pkg/m2.py", "big.bin", "src/pkg/m3_renamed.py"):
        assert path in text, (path, text[:2000])
    assert "+changed" in text  # a unified diff for the text file

    cp = run("undo", cell, "--json")
    assert cp.returncode == 0, cp.out + cp.err
    undone = listing(wt)
    assert undone == before, listing_diff(before, undone)
    [rec] = json.loads(cp.out)["records"]
    run_id, undo_id = rec["record"].split("/")
    assert undo_id.startswith("undo-"), rec
    cp = run("undo", undo_id, "--run", run_id, "--json")  # undo of an undo = redo
    assert cp.returncode == 0, cp.out + cp.err
    redone = listing(wt)
    assert redone == after, listing_diff(after, redone)


# every kind with the state root on it and on the host's file system; a worktree on overlayfs (a
# container's root file system: a fine lower layer) with the state root elsewhere
MATRIX = [(k, w) for k in KINDS for w in ("same", "other")] + [("overlay", "other")]


@pytest.mark.parametrize("kind,where", MATRIX, ids=[f"{k}-state-{w}-fs" for k, w in MATRIX])
def test_a_cells_changes_land_at_its_end_and_undo_restores_them(kind, where, images, tmp_path, agnsup):  # noqa: F811
    mnt = images.make(kind)
    assert fs_type(mnt) == kind
    wt = os.path.join(mnt, "wt")
    make_project(wt)
    expected = reference(wt)
    if where == "same":
        agnsup.state = os.path.join(mnt, "state")  # the commit renames pre-images into the record
        agnsup.env["AGNSUP_STATE_DIR"] = agnsup.state
        assert os.stat(agnsup.state if os.path.exists(agnsup.state) else mnt).st_dev == os.stat(wt).st_dev
    else:
        assert os.stat(str(tmp_path)).st_dev != os.stat(wt).st_dev  # the commit copies them
    readme = os.stat(os.path.join(wt, "README.md"))
    try:
        _changed_then_undone(agnsup, wt, "fs1", expected, lambda: agnsup.json("receipts", "--json"),
                             after_cell=lambda: _pre_image_moved_or_copied(agnsup.state, readme, where))
    finally:
        if where == "same":  # the state root on the image: its cgroups and files go before the unmount
            from conftest import _cleanup_cgroups
            leaked = _cleanup_cgroups(agnsup.state)
            assert not leaked, leaked


def test_a_state_root_that_cannot_hold_an_upper_layer_runs_live_named_by_receipt_and_doctor(
        images, tmp_path, policy_dir, agnsup):  # noqa: F811 - fsimages' fixture
    """overlayfs cannot be an overlay's upper file system (a container's root is one): capture is
    impossible there, so the cell runs live and says why; require = ["reversible"] refuses it."""
    mnt = images.make("overlay")
    state = os.path.join(mnt, "state")
    agnsup.state = state
    agnsup.env["AGNSUP_STATE_DIR"] = state
    wt = str(tmp_path / "wt")
    make_project(wt)
    try:
        cp = agnsup("run", "--cell", "ov1", "--workdir", wt, "--", "sh", "-c", "echo live >> README.md")
        assert cp.returncode == 0, cp.err
        with open(os.path.join(wt, "README.md")) as f:
            assert f.read().endswith("live\n")  # the write went straight to the worktree
        ch = _receipt(agnsup.json("receipts", "--json"), "ov1").get("changes") or {}
        assert ch.get("mode") == "live", ch
        why = ch.get("reason") or ch.get("why") or ""
        assert why and "overlay" in why.lower(), ch
        doctor = agnsup("doctor", "--json")
        assert why in doctor.out, (why, doctor.out[-3000:])
        cp = agnsup("undo", "ov1")
        assert cp.returncode == 1 and cp.err.count("\n") == 1, cp.err
        assert "live" in cp.err

        write_role(policy_dir, "strict", isolation__require='["reversible"]')
        before = listing(wt)
        cp = agnsup("run", "--role", "strict", "--workdir", wt, "--", "sh", "-c", "echo no >> README.md",
                    env={"AGNSUP_POLICY_DIR": str(policy_dir)})
        assert cp.returncode in (125, 126) and cp.err.count("\n") == 1, cp.err
        assert "reversible" in cp.err
        assert listing(wt) == before
    finally:
        from conftest import _cleanup_cgroups
        assert not _cleanup_cgroups(state)


# --- a normal user's cell (rootless) -----------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["home", *KINDS])
def test_a_normal_users_cell_is_captured_and_undone(kind, user):
    """The user's worktree in its home (the host's file system) or on a file system of its own; the
    state root in its home ($XDG_STATE_HOME/agnsup): the overlay is mounted in the cell's user
    namespace (userxattr), its upper under the user's state root."""
    # the images under the user's home (the test's tmp_path is root's, 0700: the user could not reach it)
    with Images(user.own_dir(f"fs-{kind}")) as imgs:
        if kind == "home":
            wt = os.path.join(imgs.parent, "wt")
        else:
            mnt = imgs.make(kind)
            os.chown(mnt, user.uid, user.gid)
            wt = os.path.join(mnt, "wt")
        _user_case(kind, user, wt)


def _user_case(kind, user, wt):
    make_project(wt, owner=(user.uid, user.gid))

    def as_user():
        os.setgroups([])
        os.setgid(user.gid)
        os.setuid(user.uid)

    expected = reference(wt, preexec=as_user)
    cell = f"u-{kind}"
    _changed_then_undone(user, wt, cell, expected, lambda: user.json("receipts", "--json"))
    assert user.left() == []
    assert all(v[2] == user.uid for v in listing(wt).values()), "a path of the user's worktree changed owner"


def test_the_test_file_systems_come_down_even_when_a_test_fails_half_way(tmp_path):
    """tests/fsimages.py's promise: every mount and loop device it made is gone after close(), also when
    the test raised with them mounted and busy-free."""
    parent = str(tmp_path / "imgs")
    os.makedirs(parent)
    made = {}
    with pytest.raises(RuntimeError):
        with Images(parent) as imgs:
            for kind in (*KINDS, "overlay"):
                made[kind] = imgs.make(kind)
                assert fs_type(made[kind]) == kind
            loops = list(imgs.loops)
            raise RuntimeError("the test failed half-way")
    with open("/proc/self/mountinfo") as f:
        mounted = f.read()
    assert not any(m in mounted for m in made.values()), mounted
    # a cell another test starts meanwhile copies the host's mount table into its namespace: the kernel then
    # detaches (autoclear) when that copy goes, so the device may outlive close() by that cell's life
    deadline = time.monotonic() + 60
    while True:
        attached = subprocess.run(["losetup", "-a"], capture_output=True, text=True).stdout
        if not any(dev + ":" in attached for dev in loops) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not any(dev + ":" in attached for dev in loops), attached
    assert not any(name.endswith(".img") for name in os.listdir(parent))
