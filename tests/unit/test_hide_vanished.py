"""linux/mounts._hide: a hidden home that is removed between the controller's plan and the leader's mount step
(`userdel -r` of another user meanwhile: seen in the kernel tier, `mount: No such file or directory` failed the
cell) leaves nothing to read: the step goes on."""
import errno

import pytest

from agnsup.linux import mounts


@pytest.mark.parametrize("points", [(), (("/x/y", True),)], ids=["read-only", "with-points"])
def test_a_directory_gone_before_its_hiding_mount_is_nothing_to_hide(tmp_path, monkeypatch, points):
    calls = []

    def vanished(source, target, fstype, flags, data=None):
        calls.append(target)
        raise OSError(errno.ENOENT, "mount: No such file or directory", target)
    monkeypatch.setattr(mounts.lsys, "mount", vanished)
    mounts._hide(str(tmp_path), points)  # the stat sees it; the mount finds it gone
    assert calls == [str(tmp_path)]


def test_another_mount_error_still_fails_the_step(tmp_path, monkeypatch):
    def refused(source, target, fstype, flags, data=None):
        raise OSError(errno.EPERM, "mount: Operation not permitted", target)
    monkeypatch.setattr(mounts.lsys, "mount", refused)
    with pytest.raises(PermissionError):
        mounts._hide(str(tmp_path), ())
