"""The container recipe with the fewest privileges, reproduced on this host without an engine (issue 27).

- A container's /dev is mounted nosuid (Docker's, Podman's): a normal user's cell copies it into a mount
  namespace its own user namespace owns, where the kernel locks that flag (mount_namespaces(7), "locked
  mounts"); a read-only remount of a mask that drops it is refused (EPERM). Reproduced here in a private
  mount namespace whose /dev the test remounts nosuid before the user's agnsup starts in it.
"""
import os
import subprocess

import pytest

from agnsup.linux import sys as lsys

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="ENV_BLOCKED: root (the test makes a user and a "
                                                          "mount namespace)")


def _in_a_container_like_mount_namespace(user):
    """preexec_fn: a private mount namespace of the process about to become `user`'s agnsup, whose /dev
    is nosuid as a container's is (the host's is not); then the user's own cgroup leaf and ids."""
    def enter():
        lsys.unshare(lsys.CLONE_NEWNS)
        lsys.mount(None, "/", None, lsys.MS_REC | lsys.MS_PRIVATE)  # nothing of this reaches the host
        lsys.mount(None, "/dev", None, lsys.MS_REMOUNT | lsys.MS_BIND | lsys.MS_NOSUID)
        user._enter()
    return enter


def test_a_normal_users_cell_masks_files_where_dev_is_nosuid(user):
    """The mask of a file (/etc/shadow: a bind of /dev/null, then read-only) keeps the nosuid the
    kernel locked on /dev: without that the cell fails at step 'mounts' (checked by removing the fix)."""
    wt = user.own_dir("wt-nosuid")
    with open(os.path.join(wt, "probe.sh"), "w") as f:  # a script: the gate reads a command line's writes
        # a write reaches /dev/null (a device node is writable on a read-only mount) and is discarded
        f.write("echo x > /etc/shadow; cat /etc/shadow | wc -c\n"
                "grep ' /etc/shadow ' /proc/self/mountinfo | cut -d' ' -f4-6\n")
    p = subprocess.Popen([user.agnsup, "run", "--workdir", wt, "--", "sh", "probe.sh"], env=user.env,
                         cwd=user.work, preexec_fn=_in_a_container_like_mount_namespace(user),
                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    # /etc/shadow is the host's /dev/null in the cell (masked, not missing), read-only, still nosuid
    size, source, target, options = out.split()
    assert (size, source, target) == ("0", "/null", "/etc/shadow"), out
    assert {"ro", "nosuid"} <= set(options.split(",")), out
    assert user.left() == []
