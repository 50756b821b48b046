"""A Supervisor's cells' /tmp tmpfs made ahead (process.leader.TmpSpare, issue 29's sixth round): a cell takes the
tmpfs made after an earlier cell's result only when everything it is made from is the same (its size, its owner and
every entry: path, mode, link target, file content; the modes carry the controller's umask), and a tmpfs serves one
cell only.

Checked to fail: with `TmpSpare.take` ignoring the key (any ready tmpfs taken) the first three tests get the earlier
plan's content, size, owner or mode; with a cell's used /tmp kept in the spare instead of a new one made after its
result, the last test's second cell sees the first cell's file."""
import os
import stat
from types import SimpleNamespace

from agnsup.process import leader
from agnsup.supervisor import Supervisor
from scenario import wait_for


def _plan(tmp_path, gitconfig: str = "[user]\n", size: int = 64 << 20, ids=None):
    tmpdir = tmp_path / "staging" / "tmp"
    tmpdir.mkdir(parents=True, exist_ok=True)
    return SimpleNamespace(tmpdir=str(tmpdir), tmp_tmpfs=True, limits={"tmp_max": size}, cell_ids=lambda: ids,
                           tmp_links=[(".agnsup/bin/agnsup", "/usr/bin/agnsup")],
                           tmp_files=[("home/.gitconfig", gitconfig)],
                           caches=[("/nowhere", "/tmp/home/.cache/pip", "home/.cache/pip")])


def _read(fd: int, rel: str) -> bytes:
    f = os.open(rel, os.O_RDONLY | os.O_CLOEXEC, dir_fd=fd)
    try:
        return os.read(f, 4096)
    finally:
        os.close(f)


def _made_ahead(spare, plan) -> int:
    """The device of the tmpfs the spare made for `plan` (each tmpfs has its own)."""
    spare.refill(plan)
    (fd,) = spare._ready.values()
    return os.fstat(fd).st_dev


def test_a_spare_with_other_file_content_is_not_taken(tmp_path):
    spare = leader.TmpSpare()
    try:
        dev = _made_ahead(spare, _plan(tmp_path, "[user]\n\tname = a\n"))
        fd = leader.make_tmp(_plan(tmp_path, "[user]\n\tname = b\n"), spare)
        try:
            assert os.fstat(fd).st_dev != dev
            assert _read(fd, "home/.gitconfig") == b"[user]\n\tname = b\n"
        finally:
            os.close(fd)
        fd = leader.make_tmp(_plan(tmp_path, "[user]\n\tname = a\n"), spare)  # the same entries: the spare
        try:
            assert os.fstat(fd).st_dev == dev and _read(fd, "home/.gitconfig") == b"[user]\n\tname = a\n"
        finally:
            os.close(fd)
        assert not spare._ready  # taken once
    finally:
        spare.close()


def test_a_spare_of_another_size_or_owner_is_not_taken(tmp_path):
    spare = leader.TmpSpare()
    try:
        dev = _made_ahead(spare, _plan(tmp_path, size=64 << 20))
        fd = leader.make_tmp(_plan(tmp_path, size=32 << 20), spare)
        try:
            sv = os.fstatvfs(fd)
            assert os.fstat(fd).st_dev != dev and sv.f_blocks * sv.f_frsize == 32 << 20
        finally:
            os.close(fd)
        fd = leader.make_tmp(_plan(tmp_path, ids=(12345, 12345)), spare)
        try:
            assert os.fstat(fd).st_dev != dev
            assert os.stat("home", dir_fd=fd).st_uid == 12345
        finally:
            os.close(fd)
    finally:
        spare.close()


def test_a_spare_made_under_another_umask_is_not_taken(tmp_path):
    spare = leader.TmpSpare()
    old = os.umask(0o022)
    try:
        dev = _made_ahead(spare, _plan(tmp_path))
        os.umask(0o077)
        fd = leader.make_tmp(_plan(tmp_path), spare)
        try:
            assert os.fstat(fd).st_dev != dev
            assert stat.S_IMODE(os.stat("home/.gitconfig", dir_fd=fd).st_mode) == 0o600
        finally:
            os.close(fd)
    finally:
        os.umask(old)
        spare.close()


def test_the_staging_tmpdir_is_merged_into_a_taken_spare(tmp_path):
    spare = leader.TmpSpare()
    try:
        plan = _plan(tmp_path)
        dev = _made_ahead(spare, plan)
        with open(os.path.join(plan.tmpdir, "ca.pem"), "w") as f:  # what broker._trust stages for a secret cell
            f.write("cert")
        fd = leader.make_tmp(plan, spare)
        try:
            assert os.fstat(fd).st_dev == dev and _read(fd, "ca.pem") == b"cert"
        finally:
            os.close(fd)
    finally:
        spare.close()


def test_a_cells_tmp_is_never_the_one_an_earlier_cell_had(state, worktree):
    with Supervisor(state) as sup:
        first = sup.run(["sh", "-c", "echo secret > /tmp/left-behind && ls /tmp"], workdir=worktree, run_id="r",
                        capture=True)
        assert first["exit_code"] == 0 and "left-behind" in first["stdout"], first
        wait_for(lambda: sup.ctl.tmp_spare._ready, what="a tmpfs made for the role's next cell after the result")
        (dev,) = [os.fstat(fd).st_dev for fd in sup.ctl.tmp_spare._ready.values()]
        second = sup.run(["sh", "-c", "ls -a /tmp /tmp/home; cat /tmp/left-behind"], workdir=worktree, run_id="r",
                         capture=True)
        assert second["exit_code"] != 0 and "left-behind" not in second["stdout"], second
        assert "home" in second["stdout"] and ".gitconfig" in second["stdout"], second
        assert all(os.fstat(fd).st_dev != dev for fd in sup.ctl.tmp_spare._ready.values())  # it took that one
