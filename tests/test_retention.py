"""A long-lived controller's memory stays flat and the journal has a retention bound (issue 12 item 17)."""
import gc
import json
import os
import weakref

from agnsup.supervisor import Supervisor


def test_an_ended_cell_leaves_the_supervisors_memory(state, worktree):
    """Issue 12 item 17: a long-lived Supervisor kept every ended cell (its plan, spec, trace and
    result: ~17-19 KB each, measured 19.3 KB/cell over 300 cells, scripts/bench_soak.py); now an
    ended cell is gone from it once its result is delivered, and a later wait reads the journal."""
    with Supervisor(state) as sup:
        first = sup.spawn(["true"], workdir=worktree)
        ref = weakref.ref(sup._cells[(first["run_id"], first["cell_id"])])
        assert sup.wait(first["run_id"], first["cell_id"])["exit_code"] == 0
        handles = [sup.spawn(["sh", "-c", "echo out"], workdir=worktree) for _ in range(3)]
        results = [sup.wait(h["run_id"], h["cell_id"]) for h in handles]
        assert [r["stdout"] for r in results] == ["out\n"] * 3
        gc.collect()
        assert ref() is None and sup._cells == {}
        again = sup.wait(handles[0]["run_id"], handles[0]["cell_id"])  # from the journal and the output file
        assert again["exit_code"] == 0 and again["stdout"] == "out\n" and again["state"] == "exited"


def test_prune_removes_ended_cells_from_the_journal_and_keeps_their_receipts_on_disk(agnsup, worktree):
    """Issue 12 item 17: `agnsup journal prune --before WHEN`; receipts on disk are kept (one whose
    file was missing is written there first), ids stay taken, live cells are never pruned."""
    for c in ("old1", "old2"):
        agnsup("run", "--workdir", worktree, "--cell", c, "--", "true", check=0)
    files = {c: os.path.join(agnsup.state, "cells", "default", c, "receipt.json") for c in ("old1", "old2")}
    with open(files["old1"]) as f:
        kept = f.read()
    os.unlink(files["old2"])
    live = agnsup.popen("run", "--workdir", worktree, "--cell", "live", "--", "sh", "-c", "echo up; exec sleep 100",
                        stdout=-1)
    try:
        assert live.stdout.readline().strip() == b"up"
        out = agnsup.json("journal", "prune", "--before", "0s", "--json")
        assert out["cells"] == 2 and out["archived"] == [files["old2"]]
        assert agnsup.json("receipts", "--json") == []
        assert [c["cell_id"] for c in agnsup.json("ps", "--json")] == ["live"]
        with open(files["old1"]) as f:
            assert f.read() == kept
        with open(files["old2"]) as f:
            assert json.load(f)["cell_id"] == "old2"
        assert agnsup("journal", "check", check=0).out.startswith("journal ")
    finally:
        agnsup("cancel", "--cell", "live", "--grace", "0", check=0)
        live.wait(30)
        live.stdout.close()
    assert "already exists" in agnsup("run", "--workdir", worktree, "--cell", "old1", "--", "true", check=125).err
    for bad in ("yesterday", "-3d"):
        assert "--before" in agnsup("journal", "prune", "--before", bad, check=125).err


def test_the_default_retention_bound_is_applied_at_a_controllers_start(agnsup, worktree):
    """Issue 12 item 17: without any command the journal keeps ended cells for
    AGNSUP_JOURNAL_RETENTION_DAYS (30 by default; 0 keeps all), applied once a day."""
    agnsup("run", "--workdir", worktree, "--cell", "a", "--", "true", env={"AGNSUP_JOURNAL_RETENTION_DAYS": "0"},
           check=0)
    assert [r["cell_id"] for r in agnsup.json("receipts", "--json")] == ["a"]
    agnsup("run", "--workdir", worktree, "--cell", "b", "--", "true",
           env={"AGNSUP_JOURNAL_RETENTION_DAYS": "0.000000001"}, check=0)  # "a" ended before: out of the bound
    assert [r["cell_id"] for r in agnsup.json("receipts", "--json")] == ["b"]
    assert os.path.exists(os.path.join(agnsup.state, "cells", "default", "a", "receipt.json"))
    cp = agnsup("run", "--workdir", worktree, "--", "true", env={"AGNSUP_JOURNAL_RETENTION_DAYS": "lots"}, check=125)
    assert "AGNSUP_JOURNAL_RETENTION_DAYS: must be a number of days" in cp.err and cp.err.count("\n") == 1
