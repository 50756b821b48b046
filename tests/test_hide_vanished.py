"""linux/mounts._hide: a hidden home removed between the controller's plan and the leader's mount step (another
user's `userdel -r` meanwhile: the kernel tier met it, `mount: No such file or directory` failed the cell) leaves
nothing to read: the step goes on. Played against the kernel: in a private mount namespace of its own, a child
removes the directory right after _hide's stat, and the tmpfs mount itself finds it gone."""
import os
import subprocess
import sys

import pytest

PLAY = r'''
import os, sys
from agnsup.linux import mounts
target, points, vanish = sys.argv[1], sys.argv[2] == "points", sys.argv[3] == "vanish"
real_stat = os.stat
def stat_then_remove(path, *a, **k):
    st = real_stat(path, *a, **k)
    if vanish and path == target:
        os.rmdir(target)  # the race: gone between the stat and the mount
    return st
mounts.os.stat = stat_then_remove
try:
    mounts._hide(target, (((os.path.join(target, "kept"), True),) if points else ()))
except OSError as e:
    print("FAILED", e); sys.exit(1)
with open("/proc/self/mountinfo") as f:
    print("MOUNTED" if any(l.split()[4] == target for l in f) else "NOTHING")
'''


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs in a mount namespace of its own (root)")
@pytest.mark.parametrize("points", ["none", "points"])
@pytest.mark.parametrize("vanish", ["vanish", "stay"])
def test_a_directory_removed_before_its_hiding_mount_is_nothing_to_hide(tmp_path, points, vanish):
    target = tmp_path / "home"
    target.mkdir()
    cp = subprocess.run(["unshare", "--mount", "--propagation", "private", sys.executable, "-c", PLAY, str(target),
                         points, vanish], capture_output=True, text=True, timeout=60)
    assert cp.returncode == 0, cp.stdout + cp.stderr
    # the control: a directory still there is hidden (a real tmpfs on it); one gone is nothing, not a failure
    assert cp.stdout.strip() == ("NOTHING" if vanish == "vanish" else "MOUNTED"), cp.stdout
