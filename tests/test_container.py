"""agnsup inside a container with its own cgroup namespace and a writable cgroup2 mount (issue 14 phase
B), made with what this host has (no Docker engine runs here): `unshare --cgroup --mount` from inside a
cgroup2 subtree the test made, /sys/fs/cgroup replaced by a fresh cgroup2 mount (what --cgroupns=private
with a writable cgroup mount gives a container: only cgroup2, rooted at the container's own cgroup).
deploy/entrypoint.sh is the container's entrypoint: it moves itself to a leaf before enabling controllers
("no internal processes"), then execs agnsup.
"""
import json
import os
import subprocess
import sys

import pytest

from agnsup.backend.base import Place
from agnsup.backend.cgroups import Cgroup2
from agnsup.linux import cgroup

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
AGNSUP = os.path.join(os.path.dirname(sys.executable), "agnsup")
UNSHARE = "/usr/bin/unshare"
ENTRYPOINT = os.path.join(REPO, "deploy", "entrypoint.sh")

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not os.access(UNSHARE, os.X_OK),
                                reason="ENV_BLOCKED: root and unshare(1) (the test makes the container)")


@pytest.fixture
def container(tmp_path):
    v2 = cgroup.detect_layout().v2
    if v2 is None:
        pytest.skip("ENV_BLOCKED: cgroup2 (no writable cgroup2 mount to give the container)")
    top = os.path.join(v2, "agnsup-ctr-" + os.urandom(4).hex())
    os.mkdir(top)
    state = str(tmp_path / "state")

    made = []

    def run(*args, timeout=120):
        # a container of its own per call, as a runtime makes one: its processes start in its cgroup (a
        # cgroup whose controllers are enabled for its children, as the entrypoint does, takes no
        # process: "no internal processes"), and a fresh cgroup2 mount over /sys/fs/cgroup shows it
        # only its own tree
        ctr = os.path.join(top, f"c{len(made)}")
        os.mkdir(ctr)
        made.append(ctr)
        enter = 'echo $$ > "$0/cgroup.procs" && exec "$@"'
        mount = 'umount -R /sys/fs/cgroup && mount -t cgroup2 -o nsdelegate cgroup2 /sys/fs/cgroup && exec "$@"'
        argv = ["/bin/sh", "-c", enter, ctr, UNSHARE, "--cgroup", "--mount", "--propagation", "private", "--",
                "/bin/sh", "-c", mount, "sh", "/bin/sh", ENTRYPOINT, AGNSUP, *args]
        env = {**os.environ, "AGNSUP_STATE_DIR": state}
        env.pop("AGNSUP_CGROUP_BASE", None)
        return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)

    try:
        yield made, run
    finally:
        if cgroup.procs(top):
            cgroup.write_kill(top)  # the container's cgroup, the test's own
            Cgroup2(cgroup.detect_layout(), top).wait_empty(Place(node=cgroup.Node({"v2": top})), 10.0)
        for d in cgroup.walk(top):
            os.rmdir(d)


def test_agnsup_in_a_container_with_its_own_cgroup_namespace_uses_it_and_doctor_says_so(container, tmp_path):
    made, run = container
    doc = run("doctor", "--json", "--no-probe")
    assert doc.returncode == 0, doc.stderr
    r = json.loads(doc.stdout)
    assert r["host"]["container"] == "cgroup namespace", r["host"]
    assert r["cgroup"]["layout"] == "v2" and r["cgroup"]["hierarchies"] == {"v2": "/sys/fs/cgroup"}
    assert r["host"]["guarantees"]["cgroup_tree"] == "in force"
    wt = tmp_path / "wt"
    wt.mkdir()
    cp = run("run", "--workdir", str(wt), "--", "cat", "/proc/self/cgroup")
    assert cp.returncode == 0, cp.stderr
    # the cell's cgroup as the container names it (relative to its own root, so inside it) ...
    line = cp.stdout.strip().splitlines()[-1]
    assert line.startswith("0::/agnsup-") and "/run-default/agent-default/cell-" in line, cp.stdout
    # ... and where it really is: inside the container's cgroup, never beside it
    ctr = made[-1]
    assert not os.path.exists(os.path.join(ctr, line[3:].lstrip("/")))  # removed at the cell's end
    assert os.path.isdir(os.path.join(ctr, "init"))  # the entrypoint's leaf
    with open(os.path.join(ctr, "cgroup.controllers")) as f:
        handed = set(f.read().split()) & {"memory", "pids", "cpu"}
    for c in ("memory", "pids", "cpu"):
        assert (r["host"]["guarantees"][f"limit_{c}"] == "in force") == (c in handed), r["host"]["guarantees"]
