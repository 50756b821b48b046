"""File systems of a test's own, and a full listing of a tree (issue 26: reversible cells).

`Images(parent)` makes mounted file systems under `parent`: "tmpfs" (no loop device), "ext4", "xfs" and
"btrfs" (a sparse image, mkfs, `losetup --find --show`, mount) and "overlay" (an overlayfs of two
directories: a file system that cannot hold an overlay upper layer). Everything it made is unmounted and
its loop device detached by `close()`, even when a test failed half-way, and even for an image whose
mkfs or mount failed. Without root, mkfs.xfs (xfsprogs), mkfs.btrfs (btrfs-progs), a free loop device or
the kernel's file system, the test skips with an ENV_BLOCKED reason naming what is missing.

`listing(root)` is the tree as an undo must give it back, byte for byte: every path with its type, mode,
owner, size, sha256 of its content and symlink target (not times: git and builds never read them back).
"""
from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess

import pytest

# mkfs.xfs refuses images under 300 MB (xfsprogs >= 5.19); every image is sparse, so this costs nothing
IMAGE_MB = 300
MKFS = {
    "ext4": (["mkfs.ext4", "-q", "-F"], "e2fsprogs"),
    "xfs": (["mkfs.xfs", "-q", "-f"], "xfsprogs"),
    "btrfs": (["mkfs.btrfs", "-q", "-f"], "btrfs-progs"),
}
KINDS = ("tmpfs", "ext4", "xfs", "btrfs")


def _run(argv: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)


def _last_line(cp: subprocess.CompletedProcess) -> str:
    return ((cp.stderr or cp.stdout).strip().splitlines() or [f"exit {cp.returncode}"])[-1]


class Images:
    """Mounted file systems of one test; `close()` takes them all down (as a context manager too)."""

    def __init__(self, parent: str):
        self.parent = parent
        self.mounts: list[str] = []  # mount points, in the order mounted
        self.loops: list[str] = []   # loop devices attached
        self.files: list[str] = []   # image files and overlay scratch directories

    def __enter__(self) -> "Images":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def make(self, kind: str, name: str | None = None) -> str:
        """A fresh, empty file system of `kind`, mounted; returns its mount point."""
        if os.geteuid() != 0:
            pytest.skip(f"ENV_BLOCKED: root (a test {kind} mount)")
        mnt = os.path.join(self.parent, name or kind)
        os.makedirs(mnt)
        if kind == "tmpfs":
            self._mount(["mount", "-t", "tmpfs", "-o", "size=512m,mode=0755", "tmpfs", mnt], kind)
        elif kind == "overlay":
            base = mnt + ".layers"
            self.files.append(base)
            for d in ("lower", "upper", "work"):
                os.makedirs(os.path.join(base, d))
            opts = f"lowerdir={base}/lower,upperdir={base}/upper,workdir={base}/work"
            self._mount(["mount", "-t", "overlay", "-o", opts, "overlay", mnt], kind)
        elif kind in MKFS:
            argv, package = MKFS[kind]
            if shutil.which(argv[0]) is None:
                pytest.skip(f"ENV_BLOCKED: {argv[0]} is missing (apt-get install {package}; scripts/test.sh "
                            "installs it)")
            if not os.path.exists("/dev/loop-control") or shutil.which("losetup") is None:
                pytest.skip("ENV_BLOCKED: loop devices (/dev/loop-control or losetup missing)")
            img = mnt + ".img"
            self.files.append(img)
            with open(img, "wb") as f:
                f.truncate(IMAGE_MB << 20)
            cp = _run([*argv, img])
            if cp.returncode != 0:
                pytest.fail(f"{argv[0]} {img}: {_last_line(cp)}")
            cp = _run(["losetup", "--find", "--show", img])
            if cp.returncode != 0:
                pytest.skip(f"ENV_BLOCKED: a free loop device (losetup --find: {_last_line(cp)})")
            dev = cp.stdout.strip()
            self.loops.append(dev)
            self._mount(["mount", "-t", kind, dev, mnt], kind)
        else:
            raise ValueError(f"unknown file system kind {kind!r}")
        return mnt

    def _mount(self, argv: list[str], kind: str) -> None:
        cp = _run(argv)
        if cp.returncode != 0:
            with open("/proc/filesystems") as f:
                known = any(line.split()[-1] == kind for line in f if line.strip())
            if not known:
                pytest.skip(f"ENV_BLOCKED: this kernel has no {kind} file system ({_last_line(cp)})")
            pytest.fail(f"mount {kind}: {_last_line(cp)}")
        self.mounts.append(argv[-1])

    def close(self) -> None:
        """Unmount (newest first), detach, remove. Best effort for each, every one tried; a mount still
        busy (a process the test leaked) is detached lazily so the loop device still goes."""
        errors = []
        for mnt in reversed(self.mounts):
            cp = _run(["umount", mnt])
            if cp.returncode != 0:
                lazy = _run(["umount", "--lazy", mnt])
                errors.append(f"umount {mnt}: {_last_line(cp)}" + ("" if lazy.returncode == 0 else " (lazy too)"))
        self.mounts.clear()
        for dev in reversed(self.loops):
            cp = _run(["losetup", "-d", dev])
            if cp.returncode != 0:
                errors.append(f"losetup -d {dev}: {_last_line(cp)}")
        self.loops.clear()
        for p in self.files:
            if os.path.isdir(p):
                shutil.rmtree(p, ignore_errors=True)
            elif os.path.exists(p):
                os.unlink(p)
        self.files.clear()
        if errors:
            raise AssertionError("test file systems left behind: " + "; ".join(errors))


@pytest.fixture
def images(tmp_path):
    """Images under the test's tmp_path, all taken down after the test (failed or not)."""
    imgs = Images(str(tmp_path / "fs"))
    os.makedirs(imgs.parent)
    try:
        yield imgs
    finally:
        imgs.close()


def fs_type(path: str) -> str:
    """The file system type of the mount holding `path` (from /proc/self/mountinfo, the longest prefix)."""
    path = os.path.realpath(path)
    best, kind = "", "?"
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            mnt = fields[4].replace("\\040", " ")
            sep = fields.index("-")
            if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                best, kind = mnt, fields[sep + 1]
    return kind


def listing(root: str) -> dict[str, tuple]:
    """{relative path: (type, mode, uid, gid, size, sha256 | symlink target | None)} of every path under
    `root` (root itself as "."), symlinks not followed."""
    out: dict[str, tuple] = {}

    def one(path: str, rel: str) -> None:
        st = os.lstat(path)
        mode = stat.S_IMODE(st.st_mode)
        if stat.S_ISLNK(st.st_mode):
            out[rel] = ("symlink", mode, st.st_uid, st.st_gid, st.st_size, os.readlink(path))
        elif stat.S_ISREG(st.st_mode):
            h = hashlib.sha256()
            with open(path, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
            out[rel] = ("file", mode, st.st_uid, st.st_gid, st.st_size, h.hexdigest())
        elif stat.S_ISDIR(st.st_mode):
            out[rel] = ("dir", mode, st.st_uid, st.st_gid, None, None)
        else:
            out[rel] = ("other", mode, st.st_uid, st.st_gid, None, stat.S_IFMT(st.st_mode))

    one(root, ".")
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            one(p, os.path.relpath(p, root))
    return out


def listing_diff(before: dict, after: dict, limit: int = 20) -> str:
    """The paths where two listings differ, as lines (for an assertion's message)."""
    lines = []
    for p in sorted(set(before) | set(after)):
        if before.get(p) != after.get(p):
            lines.append(f"{p}: {before.get(p, 'absent')} -> {after.get(p, 'absent')}")
    more = len(lines) - limit
    return "\n".join(lines[:limit] + ([f"... {more} more"] if more > 0 else []))
