"""`agnsup doctor` reports what this host really has."""
import json
import os
import subprocess
import sys

import pytest

from agnsup.doors import doctor
from agnsup import policy
from agnsup.linux import cgroup
from conftest import BIN, seccomp_launcher


def test_doctor_reports_the_detected_cgroup_layout_and_namespaces(agnsup):
    r = json.loads(agnsup("doctor", "--json", "--no-probe", check=0).out)  # host facts: the probe cells are below
    layout = cgroup.detect_layout()
    assert r["cgroup"]["layout"] == layout.kind
    assert r["cgroup"]["hierarchies"]["v2"] == layout.v2
    assert r["namespaces"]["mount"]["available"] and r["namespaces"]["network"]["available"]
    if layout.v2:
        assert r["cgroup"]["cgroup_kill"] == (tuple(map(int, os.uname().release.split(".")[:2])) >= (5, 14))
        assert "cgroup" in r["will_use"]["tracking_and_kill"]
    assert r["ok"] is True


def test_mountinfo_parsing_finds_the_hybrid_hierarchies():
    mi = ("30 25 0:26 / /sys/fs/cgroup ro,nosuid - tmpfs tmpfs ro,mode=755\n"
          "31 30 0:27 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n"
          "32 30 0:28 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
          "33 30 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct\n"
          "34 30 0:30 / /sys/fs/cgroup/my\\040dir rw - cgroup cgroup rw,pids\n")
    v2, v1 = cgroup.parse_mountinfo(mi)
    assert v2 == "/sys/fs/cgroup/unified"
    assert v1 == {"memory": "/sys/fs/cgroup/memory", "cpu": "/sys/fs/cgroup/cpu,cpuacct",
                  "pids": "/sys/fs/cgroup/my dir"}


def test_mountinfo_parsing_of_a_pure_v2_host():
    v2, v1 = cgroup.parse_mountinfo("25 24 0:22 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n")
    assert (v2, v1) == ("/sys/fs/cgroup", {})


# ------------------------------------------------------------- doctor is never more optimistic than run (issue 27)


def test_doctor_starts_a_cell_per_role_as_run_does_and_leaves_nothing_behind(agnsup, state, tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    cp = agnsup("doctor", "--json", env={"TMPDIR": str(tmp)}, check=0)
    r = json.loads(cp.out)
    assert r["probed"] is True and r["status"] == "ok" and r["ok"] is True
    assert set(r["cells"]) == set(policy.known_roles())
    assert all(v["ran"] and v["exit_code"] == 0 for v in r["cells"].values()), r["cells"]
    # the probe cells lived where run's cells live: under doctor's own agnsup_root
    for v in r["cells"].values():
        if r["cgroup"]["agnsup_root"].get("v2"):
            assert v["cgroup"].startswith(r["cgroup"]["agnsup_root"]["v2"] + "/run-doctor-"), v
    # nothing of them is left: no receipt, no cell in ps, no cell directory, no worktree, no cache
    assert agnsup.json("receipts", "--json") == [] and agnsup.json("ps", "--all", "--json") == []
    assert os.listdir(os.path.join(state, "cells")) == [] and os.listdir(tmp) == []
    assert os.listdir(os.path.join(state, "caches")) == []
    # --no-probe starts none and says so
    r = json.loads(agnsup("doctor", "--json", "--no-probe", check=0).out)
    assert r["probed"] is False and r["cells"] == {} and r["status"] == "not probed"
    assert "status:          not probed" in agnsup("doctor", "--no-probe", check=0).out


def test_doctor_role_probes_only_the_roles_named_and_an_unknown_one_is_one_line_exit_125(agnsup):
    """--role R (repeatable): an operator who runs only `reduced` where the other roles cannot run asks about it."""
    r = json.loads(agnsup("doctor", "--json", "--role", "readonly", "--role", "reduced", check=0).out)
    assert set(r["cells"]) == {"readonly", "reduced"} and r["status"] == "ok", r["cells"]
    cp = agnsup("doctor", "--role", "no-such-role", check=125)
    assert cp.err.strip().splitlines() == [cp.err.strip()] and "unknown role 'no-such-role'" in cp.err


def _compare_with_run(agnsup, worktree, launcher: list[str]) -> dict:
    """doctor --json and `run --role R -- true` per role, both under `launcher`: doctor never says a role's
    cell runs when run's does not, nor ok when one does not."""
    def call(*args):
        return subprocess.run([*launcher, BIN, *args], env=agnsup.env, cwd=worktree, capture_output=True, text=True,
                              timeout=120, stdin=subprocess.DEVNULL)
    cp = call("doctor", "--json")
    r = json.loads(cp.stdout)
    assert set(r["cells"]) == set(policy.known_roles()), r["cells"]
    for role, v in r["cells"].items():
        run = call("run", "--role", role, "--", "true")
        assert v["ran"] == (run.returncode == 0), (role, v, run.stderr)
        if not v["ran"]:
            assert run.stderr.startswith(f"agnsup: {v['error']}"), (role, v, run.stderr)
    assert r["ok"] == all(v["ran"] for v in r["cells"].values()) and cp.returncode == (0 if r["ok"] else 1)
    return r


def test_without_cap_net_admin_doctor_says_what_run_says_the_recipe_containers_case(agnsup, worktree):
    """The issue's recipe container lacks CAP_NET_ADMIN: run failed at 'loopback' while doctor said ok.
    Dropping it from the bounding set (setpriv) makes this host that container."""
    if not os.path.exists("/usr/bin/setpriv") or os.geteuid() != 0:
        pytest.skip("ENV_BLOCKED: root and /usr/bin/setpriv (drops CAP_NET_ADMIN from agnsup's capabilities)")
    r = _compare_with_run(agnsup, worktree, ["/usr/bin/setpriv", "--bounding-set", "-net_admin"])
    failed = {role: v for role, v in r["cells"].items() if not v["ran"]}
    if not failed:
        return  # cells need no CAP_NET_ADMIN any more (the cell's own user namespace): run runs them too
    assert r["status"] in ("some roles cannot run", "cannot run cells") and r["ok"] is False
    for v in failed.values():
        assert v["step"] == "loopback" and "NET_ADMIN" in v["fix"], v
        assert 'isolation.reduced = ["network_namespace"]' in v["fix"], v
    assert "NET_ADMIN" in r["host"]["kind"]


NO_UNSHARE = seccomp_launcher({272: 1})  # unshare(2): EPERM, as a container's seccomp profile answers


def test_under_a_seccomp_filter_that_refuses_unshare_doctor_names_the_filter_not_the_kernel(agnsup, worktree):
    r = _compare_with_run(agnsup, worktree, [sys.executable, "-c", NO_UNSHARE])
    # a role that accepts a reduced cell (isolation.reduced) runs here; every other one cannot
    reduced = {role for role in r["cells"] if policy.load(role).isolation.get("reduced")}
    assert r["status"] == ("some roles cannot run" if reduced else "cannot run cells") and r["ok"] is False
    assert r["evidence"]["seccomp_filter"] is True and "under a seccomp filter" in r["host"]["kind"]
    in_ctr = bool(doctor.evidence()["container"])
    for role, v in r["cells"].items():
        if role in reduced:
            assert v["ran"], (role, v)
            continue
        assert not v["ran"] and v["fix"], (role, v)
        assert "kernel" not in v["fix"] and "single-threaded" not in v["fix"], v
        if os.geteuid() == 0:
            assert ("seccomp=unconfined" in v["fix"]) if in_ctr else ("seccomp filter on this process" in v["fix"])
            assert "isolation.reduced" in v["fix"], v
    g = r["host"]["guarantees"]
    for k in ("mount_namespace", "pid_namespace"):
        assert "kernel with the new mount API" not in g[k] and "single-threaded" not in g[k], g[k]
    assert "mount_namespace" in r["reduced"] and "pid_namespace" in r["reduced"]
    text = subprocess.run([sys.executable, "-c", NO_UNSHARE, BIN, "doctor"], env=agnsup.env, cwd=worktree,
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL).stdout
    assert ("status:          SOME ROLES CANNOT RUN CELLS on this host" if reduced else
            "status:          CANNOT RUN CELLS on this host") in text and "\nreduced:         " in text
    assert "  role executor: cell setup failed at step " in text


@pytest.fixture(scope="module")
def user():
    """conftest's throwaway user with a delegated subtree, where one can be made (the lanes' guests may
    have no useradd)."""
    import shutil
    if os.geteuid() != 0 or not shutil.which("useradd"):
        pytest.skip("ENV_BLOCKED: root and useradd (the test makes a user and delegates a cgroup subtree to it)")
    from test_unprivileged import User, _venv
    with User(_venv()) as u:
        yield u


def test_a_normal_user_with_a_delegated_subtree_doctor_and_run_agree_on_backend_and_layout(user):
    """issue 27: doctor said Untracked/none where run put cells in the subtree. The cell's own cgroup
    (run) is below doctor's agnsup_root, and so are doctor's probe cells."""
    wt = user.own_dir("wt-doctor")
    d = json.loads(user("doctor", "--json").stdout)
    cp = user("run", "--workdir", wt, "--", "cat", "/proc/self/cgroup")
    assert cp.returncode == 0, cp.stderr
    v2 = next(line for line in cp.stdout.splitlines() if line.startswith("0::"))[3:]
    assert d["host"]["backend"] == "Delegated" and d["cgroup"]["layout"] in ("v2", "hybrid"), d["host"]
    root = d["cgroup"]["agnsup_root"]["v2"]
    assert os.path.join(d["cgroup"]["hierarchies"]["v2"], v2.lstrip("/")).startswith(root + "/"), (root, v2)
    assert all(v["ran"] and v["cgroup"].startswith(root + "/") for v in d["cells"].values()), d["cells"]
    assert d["status"] == "ok" and user.left() == []
