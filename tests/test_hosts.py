"""Host kinds (issue 14 phase B), for real on this host: no limit is reported that is not in
force (the receipt's not_in_force names each missing one, isolation.require = ["limits"] refuses
the cell), and doctor names each limit it cannot hold with the fix."""
import json
import os

from conftest import Agnsup, write_role

NONE = {"AGNSUP_CGROUP_LAYOUT": "none"}  # no cgroup tree: a host where no limit can be held


def _receipt(path) -> dict:
    with open(path) as f:
        return json.load(f)


def test_a_limit_the_host_cannot_hold_is_named_in_not_in_force_never_reported_applied(state, worktree, policy_dir,
                                                                                       tmp_path):
    a = Agnsup(state, env={"AGNSUP_POLICY_DIR": str(policy_dir), **NONE})
    write_role(policy_dir, "capped", limits__cpu_max="0.5")
    rfile = tmp_path / "r.json"
    a("run", "--role", "capped", "--receipt", str(rfile), "--workdir", worktree, "--", "true", check=0)
    r = _receipt(rfile)
    assert r["limits"]["applied"] == {}
    gaps = [m for m in r["isolation"]["not_in_force"] if m.startswith("limit ")]
    assert [m.split(":")[0] for m in gaps] == ["limit memory", "limit pids", "limit cpu"]
    assert all("fix: unset AGNSUP_CGROUP_LAYOUT" in m for m in gaps)


def test_a_role_that_requires_limits_is_refused_in_one_line_and_the_refusal_is_journaled(state, worktree,
                                                                                        policy_dir):
    a = Agnsup(state, env={"AGNSUP_POLICY_DIR": str(policy_dir), **NONE})
    write_role(policy_dir, "strict", isolation__require='["limits"]')
    cp = a("run", "--role", "strict", "--workdir", worktree, "--", "touch", "made")
    assert cp.returncode == 125, cp.err
    assert cp.err.count("\n") == 1 and cp.err.startswith(
        "agnsup: role strict requires limits, which are not in force here: limit memory: no cgroup tree here")
    assert not os.path.exists(os.path.join(worktree, "made"))
    cells = a.json("ps", "--all", "--json")
    assert len(cells) == 1 and cells[0]["state"] == "failed", cells
    [r] = a.json("receipts", "--json")
    assert "requires limits" in r["error"], r
    # where the host holds them (root on this host: v1 memory, pids, cpu), the same role runs
    cp = Agnsup(state, env={"AGNSUP_POLICY_DIR": str(policy_dir)})("run", "--role", "strict", "--workdir",
                                                                     worktree, "--", "true")
    assert cp.returncode == 0, cp.err


def test_doctor_names_each_limit_it_cannot_hold_with_the_fix(agnsup):
    rep = json.loads(agnsup("doctor", "--json", "--no-probe", env=NONE, check=0).out)
    assert set(rep["will_use"]["limits"]) == {"memory", "pids", "cpu"}
    assert all(v.startswith("NOT IN FORCE: no cgroup tree here; fix: ") for v in rep["will_use"]["limits"].values())
    assert "limit cpu (no cgroup tree here)" in rep["does_without"]
    here = json.loads(agnsup("doctor", "--json", "--no-probe", check=0).out)["will_use"]["limits"]
    assert not any(v.startswith("NOT IN FORCE") for v in here.values()), here
