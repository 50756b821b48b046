"""process.helpers.tmp_entries: what a root cell's /tmp tmpfs is filled with (process.leader.make_tmp) is exactly
what home.make stages on disk for a cell without one: same paths, kinds, modes, link targets, file bytes."""
import os
import stat
from types import SimpleNamespace

from agnsup import home
from agnsup.process.helpers import tmp_entries


def _plan(tmp_path, tmpfs: bool):
    cache = tmp_path / "state" / "caches" / "pip"
    tmpdir = tmp_path / ("fs" if tmpfs else "disk") / "tmp"
    return SimpleNamespace(
        tmpdir=str(tmpdir), tmp_tmpfs=tmpfs, uid=None, gid=None, cell_ids=lambda: None,
        tmp_links=[("home/.local/bin", "/opt/bin"), (".agnsup/bin/agnsup", "/usr/bin/agnsup")],
        tmp_files=[("home/.config/pip/pip.conf", "[global]\n"), (".agnsup/etc/resolv.conf", "nameserver 0\n"),
                   ("home/.gitconfig", "[user]\n")],
        caches=[(str(cache), "/tmp/home/.cache/pip", "home/.cache/pip"),
                (str(cache) + "2", "/tmp/home/.npm", "home/.npm")],
        mount_ops=[("clone", str(tmpdir / ".agnsup/etc/resolv.conf"), "offline-resolv.conf", True)])


def _tree(root: str) -> dict:
    out = {}
    for d, dirs, files in os.walk(root):
        for name in dirs + files:
            p = os.path.join(d, name)
            st = os.lstat(p)
            rel = os.path.relpath(p, root)
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", os.readlink(p))
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ("dir", stat.S_IMODE(st.st_mode))
            else:
                with open(p, "rb") as f:
                    out[rel] = ("file", stat.S_IMODE(st.st_mode), f.read())
    return out


def test_the_tmpfs_entries_are_what_home_make_stages_on_disk(tmp_path):
    disk = _plan(tmp_path, tmpfs=False)
    home.make(disk)
    want = _tree(disk.tmpdir)
    got = {}
    for e in tmp_entries(disk):
        got[e[1]] = ("dir", e[2]) if e[0] == "dir" else ("link", e[2]) if e[0] == "link" else ("file", e[2], e[3])
    assert got == want


def test_a_tmpfs_cell_stages_on_disk_only_what_a_mount_step_clones(tmp_path):
    plan = _plan(tmp_path, tmpfs=True)
    home.make(plan)
    assert stat.S_IMODE(os.stat(plan.tmpdir).st_mode) == 0o1777
    assert set(_tree(plan.tmpdir)) == {".agnsup", ".agnsup/etc", ".agnsup/etc/resolv.conf"}
    with open(os.path.join(plan.tmpdir, ".agnsup/etc/resolv.conf")) as f:
        assert f.read() == "nameserver 0\n"
    assert all(os.path.isdir(h) for h, _, _ in plan.caches)  # the caches' host directories, as before
