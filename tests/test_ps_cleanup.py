"""`agnsup ps` and `cleanup --older-than` over real cells (issue 28 §7): a run whose cells all ended
shows as ended once its server is gone (idle while it is up), `--state` splits live from ended, and
cleanup by age takes the old ended runs and never touches a live cell. The pure parts (time parser,
filters, bound) are tests/unit/test_ps_filters.py."""
from agnsup import Supervisor


def _runs(agnsup, *args) -> dict:
    """{run_id: its [label]} as `ps` prints them."""
    out = agnsup("ps", "--all", *args, check=0).out
    return {ln.split()[1]: ln.split()[2] for ln in out.splitlines() if ln.startswith("run ")}


def test_ps_calls_a_run_ended_when_its_cells_ended_and_its_server_exited(agnsup, state, worktree):
    agnsup("run", "--run-id", "one", "--workdir", worktree, "--", "true", check=0)
    sup = Supervisor(state)  # what `agnsup mcp` and `serve` hold for their life
    try:
        h = sup.spawn(["true"], run_id="mcp", workdir=worktree)
        sup.wait("mcp", h["cell_id"], 30)
        busy = sup.spawn(["sleep", "60"], run_id="busy", workdir=worktree)
        assert _runs(agnsup) == {"one": "[ended]", "mcp": "[idle]", "busy": "[active]"}
        live = agnsup.json("ps", "--state", "running", "--json")
        assert [c["cell_id"] for c in live] == [busy["cell_id"]]
        ended = agnsup.json("ps", "--state", "ended", "--json")
        assert {c["run_id"] for c in ended} == {"one", "mcp"}
        assert agnsup.json("ps", "--until", "2000-01-01", "--json") == []
        assert {c["run_id"] for c in agnsup.json("ps", "--since", "10m", "--json")} == {"one", "mcp", "busy"}
    finally:
        sup.close()  # the server exits: its runs are ended now (busy's cell was cancelled)
    assert _runs(agnsup) == {"one": "[ended]", "mcp": "[ended]", "busy": "[ended]"}


def test_cleanup_older_than_takes_old_ended_runs_and_never_a_live_cell(agnsup, state, worktree):
    for run in ("old1", "old2"):
        agnsup("run", "--run-id", run, "--workdir", worktree, "--", "true", check=0)
    sup = Supervisor(state)
    try:
        live = sup.spawn(["sleep", "60"], run_id="live", workdir=worktree)
        out = agnsup.json("cleanup", "--older-than", "0s", "--json")
        assert [r["run_id"] for r in out["runs"]] == ["old1", "old2"] and out["skipped"] == ["live"]
        assert {r["run_state"] for r in out["runs"]} == {"finished"}
        assert out["cleaned"] == len(out["items"]) and all(it["run_id"] in ("old1", "old2") for it in out["items"])
        assert [c["cell_id"] for c in agnsup.json("ps", "--json")] == [live["cell_id"]]  # untouched, running
        again = agnsup.json("cleanup", "--older-than", "0s", "--json")
        assert again["cleaned"] == 0 and again["runs"] == []
        assert agnsup.json("cleanup", "--older-than", "1d", "--json")["runs"] == []  # none is that old
        bad = agnsup("cleanup", "--older-than", "last week", check=125)
        assert bad.err.count("\n") == 1 and "--older-than: 'last week'" in bad.err
    finally:
        sup.close()
