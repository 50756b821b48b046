"""A mask whose path is removed between its stat and its mount (another state root deleted while a cell
starts: 100 controllers at once in bench_janitor) is nothing to mask, not a failed cell (exit 125)."""
import errno

import pytest

from agnsup.linux import mounts


@pytest.mark.parametrize("kind", ["dir", "file"])
def test_a_path_gone_before_its_mask_mount_is_skipped(tmp_path, monkeypatch, kind):
    path = tmp_path / "other-state-root"
    path.mkdir() if kind == "dir" else path.write_text("")
    tried = []

    def gone(src, target, *a, **kw):  # the directory was removed after _mask's stat
        tried.append(target)
        raise FileNotFoundError(errno.ENOENT, "No such file or directory")
    monkeypatch.setattr(mounts.lsys, "mount", gone)
    mounts._mask(str(path))
    assert tried == [str(path)]


def test_any_other_mask_failure_still_fails_the_cell(tmp_path, monkeypatch):
    def refused(*a, **kw):
        raise PermissionError(errno.EPERM, "Operation not permitted")
    monkeypatch.setattr(mounts.lsys, "mount", refused)
    with pytest.raises(PermissionError):
        mounts._mask(str(tmp_path))
