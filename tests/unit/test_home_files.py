"""home.make: the cell's /tmp and HOME as the plan lists them (no processes, no root)."""
import os
import stat
from types import SimpleNamespace

import pytest

from agnsup import home


def _plan(tmp_path, **kw):
    fields = {"tmpdir": str(tmp_path / "tmp"), "tmp_links": [], "tmp_files": [], "caches": [], "uid": None,
              "gid": None, "cell_ids": lambda: None, **kw}
    return SimpleNamespace(**fields)


def test_the_plans_links_files_and_cache_mount_points_land_in_the_cells_tmp(tmp_path):
    cache = tmp_path / "state" / "caches" / "pip"
    plan = _plan(tmp_path, tmp_links=[("home/.local/bin", "/opt/bin")], tmp_files=[("home/.config/pip/pip.conf", "[global]\n")],
                 caches=[(str(cache), "/tmp/home/.cache/pip", "home/.cache/pip")])
    home.make(plan)
    t = tmp_path / "tmp"
    assert stat.S_IMODE(os.stat(t).st_mode) == 0o1777
    assert stat.S_IMODE(os.stat(t / "home").st_mode) == 0o700
    assert os.readlink(t / "home/.local/bin") == "/opt/bin"
    assert (t / "home/.config/pip/pip.conf").read_text() == "[global]\n"
    assert (t / "home/.cache/pip").is_dir() and stat.S_IMODE(os.stat(cache).st_mode) == 0o700


def test_a_file_the_plan_lists_twice_is_refused_rather_than_overwritten(tmp_path):
    plan = _plan(tmp_path, tmp_files=[("home/.npmrc", "a"), ("home/.npmrc", "b")])
    with pytest.raises(FileExistsError):
        home.make(plan)
    assert (tmp_path / "tmp/home/.npmrc").read_text() == "a"
