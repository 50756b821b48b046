"""CgroupBackend.create when a neighbour cell's cleanup removes the shared run/agent directories under it
(the race the parallel kernel tier found: `[Errno 17] File exists: .../run-default/agent-default`). Plain
directories stand in for the cgroup hierarchy: a cell without limits writes no control file."""
import errno
import os

import pytest

from agnsup.backend.base import Place
from agnsup.backend.cgroups import CgroupBackend
from agnsup.linux import cgroup


def _backend_and_place(tmp_path, cell="c-1"):
    b = CgroupBackend.__new__(CgroupBackend)  # no host probe: the base is a plain directory
    b.base = cgroup.Node({"v2": str(tmp_path / "agnsup-x")})
    return b, Place(node=cgroup.cell_node(b.base, "default", "default", cell, {}))


def test_an_agent_directory_removed_between_makedirs_mkdir_and_its_check_is_made_again(tmp_path, monkeypatch):
    b, place = _backend_and_place(tmp_path)
    real, calls = os.makedirs, []

    def racing(path, mode=0o777, exist_ok=False):
        calls.append(path)
        if len(calls) == 1:  # what makedirs raises when the directory it met vanished before its isdir check
            raise FileExistsError(errno.EEXIST, "File exists", path)
        return real(path, mode, exist_ok)

    monkeypatch.setattr(os, "makedirs", racing)
    made = b.create(place, {})
    assert os.path.isdir(place.dir) and made.inode == os.stat(place.dir).st_ino and len(calls) > 1  # raced, then made


def test_the_cells_own_directory_existing_is_still_an_error(tmp_path):
    b, place = _backend_and_place(tmp_path)
    os.makedirs(place.dir)
    with pytest.raises(FileExistsError):
        b.create(place, {})
