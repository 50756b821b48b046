"""The cell's /tmp and HOME as the plan lists them (plan.tmp_links, tmp_files, caches): written here, decided before."""
from __future__ import annotations

import os
from contextlib import suppress

from .linux import fs
from .store import spares
from .process.helpers import tmp_entries as entries


def _cell_dir(tmpdir: str) -> None:
    """cells/<run>/<cell>/tmp made here (no spare): the run's directory, when made now, spread (linux/fs.spread), so
    that each cell's directory and the files its path makes in it lie in an ext4 block group of their own."""
    run = os.path.dirname(os.path.dirname(tmpdir))
    if os.path.basename(tmpdir) == "tmp":
        try:
            os.makedirs(run)
        except FileExistsError:
            pass
        else:
            fs.spread(run)
    os.makedirs(tmpdir)


def make(plan) -> bool:
    """The cell's /tmp: its HOME, @runtime's links, the HOME's tool configuration and the caches'
    mount points, owned by the cell's uid when process.user sets one (or the cell is mapped), like the
    HOME itself; the caches' host directories, kept between cells under the state root.

    A cell whose /tmp is a tmpfs the controller makes (plan.tmp_tmpfs) gets only the directory here:
    process.leader.make_tmp writes the same entries (process.helpers.tmp_entries) straight into its tmpfs, not through
    ~20 files and directories on the state root's disk copied over and removed again (issue 29).

    True when the cell's directory was a controller's spare (store/spares.py), with its empty files in it."""
    _shared(plan)
    # the cell's directory and its tmp/: a controller of many cells' spare (store/spares.py), else made here
    claimed = os.path.basename(plan.tmpdir) == "tmp" and spares.claim("cell", os.path.dirname(plan.tmpdir))
    if getattr(plan, "tmp_tmpfs", False):
        if not claimed:
            _cell_dir(plan.tmpdir)
        else:  # a spare's tmp/ is there (one failed mkdir, no new inode), never missing
            with suppress(FileExistsError):
                os.mkdir(plan.tmpdir)
        # on disk only what a mount step takes from here (a secret's trust files)
        sources = [op[1] for op in plan.mount_ops if len(op) > 1 and isinstance(op[1], str)
                   and op[1].startswith(plan.tmpdir + "/")]
        ids = plan.cell_ids()
        for e in entries(plan) if sources else ():  # usually none: then not even the list of entries
            path = os.path.join(plan.tmpdir, e[1])
            if not any(src == path or src.startswith(path + "/") for src in sources):
                continue
            if e[0] == "dir":
                os.mkdir(path, e[2])
            elif e[0] == "link":
                os.symlink(e[2], path)
            else:
                with open(path, "xb") as f:
                    f.write(e[3])
            if ids is not None and e[0] != "link":
                os.lchown(path, *ids)
        _caches(plan)
        os.chmod(plan.tmpdir, 0o1777)
        return claimed
    home = os.path.join(plan.tmpdir, "home")
    os.makedirs(home, mode=0o700)
    made = [home]
    for rel, target in plan.tmp_links:
        path = os.path.join(plan.tmpdir, rel)
        made += _parents(plan.tmpdir, path)
        os.symlink(target, path)
    for _, _, rel in plan.caches:  # the caches' mount points, the cell's own like its HOME
        made += _parents(plan.tmpdir, os.path.join(plan.tmpdir, rel, "."))
    for rel, text in plan.tmp_files:
        path = os.path.join(plan.tmpdir, rel)
        made += _parents(plan.tmpdir, path)
        with open(path, "x") as f:
            f.write(text)
        made.append(path)
    ids = plan.cell_ids()
    if ids is not None:
        for path in made:
            os.lchown(path, *ids)
    _caches(plan)
    os.chmod(plan.tmpdir, 0o1777)  # it is the cell's /tmp: sticky and world-writable, like the real one
    return claimed


def _shared(plan) -> None:
    """The files a mount step binds that many cells share (plan.shared_files: the offline resolver's), named by
    their content: written once, whole (a temporary name, then rename: a concurrent controller writes the same
    bytes), readable by any cell's ids (bound read-only), never removed with a cell."""
    for path, text in getattr(plan, "shared_files", ()):
        if os.path.exists(path):
            continue
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o444)
        os.replace(tmp, path)


def _caches(plan) -> None:
    for host_dir, _, _ in plan.caches:  # filesystem.cache: kept between cells, under the state root
        if not os.path.isdir(host_dir):  # one stat when it is there (makedirs: a stat, a failed mkdir, a stat)
            os.makedirs(host_dir, mode=0o700, exist_ok=True)
        if plan.uid is not None:  # a mapped cell sees them through its id map: on-disk root is its root
            os.chown(host_dir, plan.uid, plan.gid)


def _parents(tmpdir: str, path: str) -> list[str]:
    """Make the missing directories between tmpdir and path (mode 0755); the ones made."""
    made, d = [], os.path.dirname(path)
    while d != tmpdir and not os.path.isdir(d):
        made.append(d)
        d = os.path.dirname(d)
    for d in reversed(made):
        os.mkdir(d, 0o755)
    return made
