"""A Supervisor's spare inodes (agnsup/store/spares.py, issue 29's fifth round): the empty directories and files its cells
need on the state root's disk, made ahead in <state>/spares/<controller> and claimed by rename into place.

Checked to fail: with the janitor's sweep taken out (`_sweep_spares` returning []) the first test finds the killed
Supervisor's spare area left; with a claimed cell spare's tmp/ not made again when missing (home.make), the second
test's cell fails at setup. The third holds the claimed inodes to what the cell's own path made (owner, mode)."""
import json
import os
import signal
import stat
import subprocess
import sys
from contextlib import contextmanager

import pytest

from agnsup.store import spares
from agnsup.supervisor import Supervisor
from conftest import procs_with_env, skip_unless_capturable
from scenario import wait_for


def _ready(sup) -> bool:
    return all(len(sup._spares.ready[k]) >= spares.WANT[k] for k in spares.KINDS)


KILLED = """import json, sys, time
from agnsup.store import spares
from agnsup.supervisor import Supervisor
sup = Supervisor(sys.argv[1])
h = sup.spawn(["true"], workdir=sys.argv[2], cell_id="c1")
sup.wait(h["run_id"], "c1", 30)
while not all(len(sup._spares.ready[k]) >= spares.WANT[k] for k in spares.KINDS):
    time.sleep(0.01)
print(json.dumps({"area": sup._spares.dir}), flush=True)
time.sleep(60)
"""


def test_the_janitor_removes_a_killed_supervisors_spares_and_nothing_else(agnsup, state, worktree, tmp_path):
    skip_unless_capturable(str(tmp_path))
    p = subprocess.Popen([sys.executable, "-c", KILLED, state, worktree], env=agnsup.env, stdout=subprocess.PIPE,
                         text=True)
    try:
        area = json.loads(p.stdout.readline())["area"]
        assert os.path.isdir(area) and len(os.listdir(area)) == sum(spares.WANT.values())
        # a live controller's spares are its own: a janitor meanwhile leaves them
        agnsup.json("janitor", "--json")
        assert os.path.isdir(area)
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(30)
        p.stdout.close()
    rep = agnsup.json("janitor", "--json")
    assert not os.path.exists(area), rep
    assert rep.get("spares") == [os.path.basename(area)], rep
    cell = os.path.join(state, "cells")
    assert any(os.path.isfile(os.path.join(cell, r, "c1", "receipt.json")) for r in os.listdir(cell))


def test_a_cell_whose_spares_are_missing_or_broken_still_runs(state, worktree, tmp_path):
    skip_unless_capturable(str(tmp_path))
    with Supervisor(state) as sup:
        sup.spawn(["true"], workdir=worktree, cell_id="c0", run_id="r")  # the run's cells/r/ made
        assert sup.wait("r", "c0", 30)["exit_code"] == 0
        wait_for(lambda: _ready(sup), 10, "the spares")
        m = sup._spares
        m._stop = True  # no more made: the cell meets exactly these
        m.claimed_kinds = set()
        claim = m.claim

        def noting(kind, target):
            ok = claim(kind, target)
            if ok:
                m.claimed_kinds.add(kind)
            return ok
        m.claim = noting
        with m._wake:
            m._wake.notify()
        m.thread.join(5)
        ready = {k: list(v) for k, v in m.ready.items()}
        # broken: the cell spares lost their tmp/, the layers their upper/ and work/; missing: every file spare
        for path in ready["cell"]:
            os.rmdir(os.path.join(path, "tmp"))
            for name in ("stdout", "stderr", "protect-start.json"):
                os.unlink(os.path.join(path, name))
        for path in ready["layer"]:
            os.rmdir(os.path.join(path, "upper"))
            os.rmdir(os.path.join(path, "work"))
        for path in ready["f600"]:
            os.unlink(path)
        h = sup.spawn(["sh", "-c", "echo out; echo hi > f; touch /tmp/x"], workdir=worktree, cell_id="c1",
                      capture=True, run_id="r")
        res = sup.wait(h["run_id"], "c1", 30)
        assert (res["state"], res["exit_code"]) == ("exited", 0), res
        assert res["stdout"] == "out\n"
        with open(os.path.join(worktree, "f")) as f:
            assert f.read() == "hi\n"
        # the broken dirs were claimed (and mended: the cell ran), the missing files made on the path
        assert m.claimed_kinds >= {"cell", "layer"}, m.claimed_kinds
        # none left to claim at all: made on the path as before
        m.ready = {k: type(v)() for k, v in m.ready.items()}
        h = sup.spawn(["true"], workdir=worktree, cell_id="c2", run_id="r")
        assert sup.wait(h["run_id"], "c2", 30)["exit_code"] == 0


def _inodes(cell_dir: str) -> dict:
    out = {}
    for rel in (".", "tmp", "stdout", "stderr", "receipt.json", "protect-start.json"):
        p = os.path.join(cell_dir, rel)
        if os.path.lexists(p):
            st = os.lstat(p)
            out[rel] = (st.st_uid, st.st_gid, stat.filemode(st.st_mode))
    return out


def _layer(state: str, run_id: str, cell_id: str) -> dict:
    d = os.path.join(state, "changes", run_id, cell_id)
    out = {}
    for rel in (".", "upper", "work"):
        st = os.lstat(os.path.join(d, rel))
        out[rel] = (st.st_uid, st.st_gid, stat.filemode(st.st_mode))
    return out


@contextmanager
def _spares(sup, on: bool):
    """The cells started inside: with the Supervisor's spares all ready (on), or with none to claim (off)."""
    if on:
        wait_for(lambda: _ready(sup), 10, "the spares")
        yield
        return
    saved, spares._makers = spares._makers, {}
    try:
        yield
    finally:
        spares._makers = saved


def test_a_claimed_spare_is_owned_and_moded_as_the_cells_own_path_made_it(state, worktree, tmp_path):
    skip_unless_capturable(str(tmp_path))
    seen = {}
    with Supervisor(state) as sup:
        for cell_id, with_spares in (("made", False), ("claimed", True)):
            claims_before = sup._spares.claimed
            with _spares(sup, with_spares):
                # `sleep`: the layer is looked at while it is there (an unchanged one goes after the result)
                sup.spawn(["sh", "-c", "echo out; sleep 30"], workdir=worktree, cell_id=cell_id, capture=True,
                          run_id="r")
                wait_for(lambda: os.path.isdir(os.path.join(state, "changes", "r", cell_id, "work", "work")), 10,
                         "the overlay")
                layer = _layer(state, "r", cell_id), _inodes(os.path.join(state, "cells", "r", cell_id))
                sup.signal("r", cell_id, "KILL")
                sup.wait("r", cell_id, 30)
            seen[cell_id] = (_inodes(os.path.join(state, "cells", "r", cell_id)), *layer)
        # its cell dir (with tmp/, stdout, stderr, protect-start.json, the receipt's reserve), the change layer (with
        # upper/ and work/), its pending marker; the run's layer directory when it was gone
        assert sup._spares.claimed - claims_before >= 3, sup._spares.claimed - claims_before
    assert seen["claimed"] == seen["made"], seen
    assert set(seen["made"][0]) == {".", "stdout", "stderr", "receipt.json", "protect-start.json"}  # at the end
    assert set(os.listdir(os.path.join(state, "cells", "r", "claimed"))) == set(
        os.listdir(os.path.join(state, "cells", "r", "made")))
    assert set(seen["made"][2]) == {".", "tmp", "stdout", "stderr", "protect-start.json"}  # while it ran


def test_a_claimed_cell_spare_keeps_only_the_files_its_cell_opens(state, worktree, tmp_path):
    """A read-only cell opens no protect-start.json: a claimed spare's is unlinked (broker._make_place, spares.trim),
    and its directory ends as the cell's own path leaves it."""
    skip_unless_capturable(str(tmp_path))
    with Supervisor(state) as sup:
        sup.spawn(["true"], workdir=worktree, cell_id="c0", run_id="r", role="readonly")  # cells/r/ made
        sup.wait("r", "c0", 30)
        for cell_id, with_spares in (("made", False), ("claimed", True)):
            before = sup._spares.claimed
            with _spares(sup, with_spares):
                sup.spawn(["true"], workdir=worktree, cell_id=cell_id, run_id="r", role="readonly")
                assert sup.wait("r", cell_id, 30)["exit_code"] == 0
        assert sup._spares.claimed > before
    made, claimed = (os.path.join(state, "cells", "r", c) for c in ("made", "claimed"))
    assert sorted(os.listdir(claimed)) == sorted(os.listdir(made))
    assert "protect-start.json" not in os.listdir(made)
    assert _inodes(claimed) == _inodes(made)


CRASHING = """import json, sys, time
from agnsup.store import spares
from agnsup.supervisor import Supervisor
from agnsup.util import crashpoints
sup = Supervisor(sys.argv[1])
h = sup.spawn(["true"], workdir=sys.argv[2], cell_id="c1", run_id="r")  # the run's cells/r/ made
sup.wait("r", "c1", 30)
while not all(len(sup._spares.ready[k]) >= spares.WANT[k] for k in spares.KINDS):
    time.sleep(0.01)
print(json.dumps({"area": sup._spares.dir}), flush=True)
crashpoints._AT = sys.argv[3]
sup.spawn(["sh", "-c", "echo a > f1; sleep 1000 & exec sleep 1000"], workdir=sys.argv[2], cell_id="c2", run_id="r",
          capture=True)
time.sleep(60)
"""


@pytest.mark.parametrize("point", ["after_intent", "after_cgroup", "after_exec"])
def test_a_supervisor_killed_with_claimed_spares_leaves_nothing_after_the_janitor(agnsup, state, worktree, tmp_path,
                                                                                   point):
    skip_unless_capturable(str(tmp_path))
    p = subprocess.run([sys.executable, "-c", CRASHING, state, worktree, point], env=agnsup.env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == -signal.SIGKILL, p.stdout + p.stderr
    area = json.loads(p.stdout.splitlines()[0])["area"]
    assert os.path.isdir(area)
    rep = agnsup.json("janitor", "--json")
    assert rep["recovered"] == ["c2"], rep
    assert procs_with_env("AGNSUP_CELL_ID", "c2") == []
    assert not os.path.exists(area)
    assert not os.path.exists(os.path.join(state, "cells", "r", "c2", "tmp"))
    assert not os.listdir(os.path.join(state, "locks"))
    assert not os.listdir(os.path.join(state, "controllers"))
    assert not os.path.exists(os.path.join(state, "changes", "r", "c2", "upper"))
    assert not os.listdir(os.path.join(state, "changes", "pending"))
    for name in os.listdir(os.path.join(state, "cells", "r", "c2")) if point != "after_intent" else ():
        assert name in ("receipt.json", "stdout", "stderr", "protect-start.json"), name  # nothing left of a spare
    again = agnsup.json("janitor", "--json")
    assert again["recovered"] == [] and not again.get("spares"), again


def test_the_spare_area_and_a_runs_layer_directories_spread_what_is_made_in_them(agnsup, state, worktree, tmp_path):
    """Each cell's change layer and spares in an ext4 block group of their own (linux/fs.spread, FS_TOPDIR_FL): in
    the parent's group, where the state root's recent deletions are, the overlay's new inodes at its mount took
    5.5 ms a cell on this host's busy /var/tmp, spread 0.4 ms (issue 29, sixth round). The spare area, its spare
    run directories, a run directory of change layers made on a cell's path and a run's cells/<run>/ carry the flag.
    Checked to fail with the spread of the spare area, of the spare "dir" kind, of changes.prepare's directories and
    of home.make's, each taken out."""
    from agnsup import changes
    from agnsup.linux import fs
    probe = tmp_path / "probe"
    probe.mkdir()
    fs.spread(str(probe))
    if not fs.topdir(str(probe)):
        pytest.skip("this file system has no FS_TOPDIR_FL")
    with Supervisor(state) as sup:
        assert sup.run(["true"], workdir=worktree, run_id="sp", cell_id="c1")["exit_code"] == 0
        wait_for(lambda: _ready(sup), 10, "the spares")
        assert fs.topdir(sup._spares.dir)
        assert sup._spares.ready["dir"] and all(fs.topdir(p) for p in sup._spares.ready["dir"])
    layer = changes.prepare(state, "made-here", "c2")  # no maker: made on the path, as `agnsup run` does
    assert fs.topdir(os.path.dirname(layer.dir))
    # `agnsup run` (no spares): the run's cells/<run>/, made by home.make, spreads its cells' directories too
    assert agnsup("run", "--run", "spread", "--workdir", worktree, "--", "true").returncode == 0
    assert fs.topdir(os.path.join(agnsup.state, "cells", "spread"))
