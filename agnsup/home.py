"""The cell's /tmp and HOME as the plan lists them (plan.tmp_links, tmp_files, caches): written here, decided before."""
from __future__ import annotations

import os


def make(plan) -> None:
    """The cell's /tmp: its HOME, @runtime's links, the HOME's tool configuration and the caches'
    mount points, owned by the cell's uid when process.user sets one (or the cell is mapped), like the
    HOME itself; the caches' host directories, kept between cells under the state root."""
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
    for host_dir, _, _ in plan.caches:  # filesystem.cache: kept between cells, under the state root
        os.makedirs(host_dir, mode=0o700, exist_ok=True)
        if plan.uid is not None:  # a mapped cell sees them through its id map: on-disk root is its root
            os.chown(host_dir, plan.uid, plan.gid)
    os.chmod(plan.tmpdir, 0o1777)  # it is the cell's /tmp: sticky and world-writable, like the real one


def _parents(tmpdir: str, path: str) -> list[str]:
    """Make the missing directories between tmpdir and path (mode 0755); the ones made."""
    made, d = [], os.path.dirname(path)
    while d != tmpdir and not os.path.isdir(d):
        made.append(d)
        d = os.path.dirname(d)
    for d in reversed(made):
        os.mkdir(d, 0o755)
    return made
