"""The container lane (issue 27): agnsup's image, built from deploy/Dockerfile, run by a real Docker engine.

One daemon, one base image and one agnsup image per pytest session (conftest.engine over tests/containers.py: a dockerd of the
session's own under /var/tmp, no bridge, no iptables, no IP forwarding; everything it made is removed at the
end, and the session checks the host's links, iptables rules, IP forwarding and mounts did not change).
Containers run only with `--network none` or `--network host`.

Which branch each test needs until the lead merges (issue27.md, "Who does what"), measured 2026-12-06 on
ctr-lane alone (4 fail, 5 pass, 1 ENV_BLOCKED skip) and merged with ctr-recipe + ctr-reduced + ctr-doctor
(9 pass, 1 ENV_BLOCKED skip: --privileged):
- ctr-recipe: the documented recipe without NET_ADMIN (on main: step 'loopback') and the normal user's cell
  (on main: "mount step mask /etc/shadow", /dev's nosuid).
- ctr-reduced: the default container's one-line refusal with both fixes, and `isolation.reduced`.
The rest passes on main.
"""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import time

import pytest

import containers
from conftest import REPO

pytestmark = pytest.mark.timeout(900)  # the session's first test builds the image (cold: debootstrap too)



def recipe() -> list[str]:
    """The flags of the `docker run` line in deploy/Dockerfile's comment (the recipe users copy): the test
    runs what the file says, so the two cannot drift apart."""
    with open(os.path.join(REPO, "deploy", "Dockerfile")) as f:
        comment = " ".join(" ".join(line[1:].rstrip().rstrip("\\").split()) for line in f if line.startswith("#"))
    m = re.search(r"docker run ((?:-\S+(?: (?!-)\S+)? )+)", comment)
    assert m, "deploy/Dockerfile's comment has no `docker run` line"
    flags = m.group(1).split()
    out, i = [], 0
    with_value = {"--cap-add", "--cap-drop", "--security-opt", "--cgroupns", "--user", "-u", "-e", "--env",
                  "--network", "-v", "--volume", "--mount", "--tmpfs", "--device"}
    while i < len(flags):
        f = flags[i]
        if f in ("--rm", "-it", "-i", "-t", "-ti"):
            i += 1
            continue
        if f in with_value:
            out += [f, flags[i + 1]]
            i += 2
            continue
        out.append(f)
        i += 1
    return out


# Until ctr-recipe's loopback lands, a cell needs NET_ADMIN for its own `lo` (measured on main 0c3fa06:
# SYS_ADMIN + NET_ADMIN under Docker's default seccomp profile runs a cell). The tests that are not about the
# recipe itself (sandboxd, the state volume) use this, so that they prove their own point on main already.
CELLS = ["--cgroupns=private", "--cap-add", "SYS_ADMIN", "--cap-add", "NET_ADMIN"]


def _one_line(text: str) -> list[str]:
    """agnsup's own lines of a container's stderr (the entrypoint's doctor report comes first)."""
    return [line for line in text.splitlines() if line.startswith("agnsup:")]


# -- the documented recipe


def test_the_documented_recipe_runs_a_cell_and_doctor_inside_says_ok(engine):
    """deploy/Dockerfile's `docker run` flags, as they stand: `agnsup run -- echo hello` says hello; doctor in
    the same container says ok (needs ctr-recipe: on main it fails at step 'loopback' without NET_ADMIN)."""
    flags = recipe()
    cp = engine.run(*flags, cmd=["agnsup", "run", "--", "echo", "hello"])
    assert (cp.returncode, cp.stdout) == (0, "hello\n"), f"recipe {flags}: exit {cp.returncode}: {cp.stderr[-2000:]}"
    cp = engine.run(*flags, cmd=["agnsup", "doctor"], entrypoint=False)
    assert cp.returncode == 0 and re.search(r"^status:\s+ok", cp.stdout, re.M), cp.stdout + cp.stderr


def test_sys_admin_and_net_admin_run_a_cell_under_dockers_default_seccomp_profile(engine):
    """No seccomp=unconfined: with CAP_SYS_ADMIN in the container's set, Docker's default profile allows
    unshare, mount and the new mount API (the Dockerfile's old comment said it refused them)."""
    cp = engine.run(*CELLS, cmd=["agnsup", "run", "--", "echo", "hello"], entrypoint=False)
    assert (cp.returncode, cp.stdout) == (0, "hello\n"), cp.stderr[-2000:]
    status = engine.run(*CELLS, cmd=["grep", "^Seccomp:", "/proc/self/status"], entrypoint=False)
    assert status.stdout.split() == ["Seccomp:", "2"], status.stdout  # the default profile is on


# -- a default container: refused in one line, or reduced when the operator says so


def test_a_default_container_refuses_a_cell_in_one_line_naming_the_step_and_both_fixes(engine):
    """Docker's defaults (no capability added, its seccomp profile): exit 125, one line that names the step
    that failed, the container flag and the `isolation.reduced` key (needs ctr-reduced)."""
    cp = engine.run(cmd=["agnsup", "run", "--", "true"])
    lines = _one_line(cp.stderr)
    assert cp.returncode == 125 and len(lines) == 1, cp.stderr[-2000:]
    (line,) = lines
    assert "cell setup failed at step '" in line, line
    assert "--cap-add SYS_ADMIN" in line and "isolation.reduced" in line, line
    # and doctor in the same container is not more optimistic than run (needs ctr-doctor)
    cp = engine.run(cmd=["agnsup", "doctor"], entrypoint=False)
    assert not re.search(r"^status:\s+ok", cp.stdout, re.M), cp.stdout


REDUCED = ["mount_namespace", "network_namespace", "pid_namespace", "cgroup"]


def test_a_default_container_with_the_reduced_opt_in_runs_and_its_receipt_names_what_is_missing(engine, tmp_path):
    """A role with `isolation.reduced` (issue27.md's contract; needs ctr-reduced) runs in a default container;
    its receipt names each missing piece in `reduced` and `not_in_force`."""
    from conftest import write_role
    policies = tmp_path / "policies"
    policies.mkdir()
    write_role(policies, "lean", isolation__reduced=json.dumps(REDUCED))
    os.chmod(tmp_path, 0o755)
    # through the image's entrypoint, as users run it: it sets AGNSUP_CGROUP_LAYOUT=none here (no writable cgroup2)
    cp = engine.run("-v", f"{policies}:/policies:ro", "-e", "AGNSUP_POLICY_DIR=/policies",
                    cmd=["sh", "-c", "agnsup run --role lean --receipt /tmp/r.json -- echo reduced-ok "
                                     "&& cat /tmp/r.json"])
    assert cp.returncode == 0 and cp.stdout.startswith("reduced-ok\n"), cp.stderr[-2000:]
    receipt = json.loads(cp.stdout.split("\n", 1)[1])
    assert set(receipt["reduced"]) <= set(REDUCED) and receipt["reduced"], receipt.get("reduced")
    missing = " ".join(receipt["isolation"]["not_in_force"])
    for piece in receipt["reduced"]:
        assert piece in missing, (piece, missing)
    assert "pid_namespace" in receipt["reduced"]  # the default profile refuses unshare: it is missing here
    # the limits' fix is the container's, not "unset AGNSUP_CGROUP_LAYOUT" (which would change nothing here)
    assert "limit memory" in missing and "--cgroupns=private" in missing, missing
    assert "unset AGNSUP_CGROUP_LAYOUT" not in missing, missing


# -- a normal user inside the container


# A normal user's cell mounts its PID namespace's own /proc, which the kernel refuses while the engine masks
# files of /proc (mount_too_revealing; ctr-recipe's one-line refusal names it): measured, the recipe needs this
# too for a normal user (Kubernetes: securityContext.procMount: Unmasked)
ROOTLESS = ["--security-opt", "systempaths=unconfined"]


def test_a_normal_user_in_the_recipe_container_runs_a_cell_with_a_state_root_of_its_own(engine):
    """uid 65534 in the recipe's container, its state root and home under /var/tmp: a cell in a user
    namespace of its own (needs ctr-recipe: the mask's read-only remount must keep Docker's nosuid on /dev).
    A home under /tmp fails otherwise ("mount step attach /tmp/home/.npm: Read-only file system")."""
    cp = engine.run(*recipe(), *ROOTLESS, "--user", "65534:65534", "-e", "HOME=/var/tmp/home",
                    "-e", "AGNSUP_STATE_DIR=/var/tmp/state",
                    cmd=["sh", "-c", "mkdir /var/tmp/home /var/tmp/p && cd /var/tmp/p && "
                                     "agnsup run -- sh -c 'echo hello; id -u'"],
                    entrypoint=False)
    assert (cp.returncode, cp.stdout) == (0, "hello\n65534\n"), cp.stderr[-2000:]


# -- the state root as a volume


def test_the_images_state_volume_lets_a_cell_capture_its_changes(engine):
    """The image's VOLUME /var/lib/agnsup puts the state root on the data root's file system: a cell's
    changes are captured (at_exit); the same cell with a state root on the container's overlayfs runs live
    (the discriminator: without the VOLUME the first half fails)."""
    script = ("mkdir -p /workspace/p && cd /workspace/p && "
              "agnsup run --changes at_exit --receipt /tmp/r.json -- sh -c 'echo x > f' >/dev/null && cat /tmp/r.json")
    cp = engine.run(*CELLS, cmd=["sh", "-c", script], entrypoint=False)
    assert cp.returncode == 0, cp.stderr[-2000:]
    changes = json.loads(cp.stdout)["changes"]
    assert changes["mode"] == "at_exit" and changes["paths"] == ["f"], changes
    cp = engine.run(*CELLS, "-e", "AGNSUP_STATE_DIR=/var/tmp/state", cmd=["sh", "-c", script], entrypoint=False)
    assert cp.returncode == 0, cp.stderr[-2000:]
    receipt = json.loads(cp.stdout)
    assert (receipt.get("changes") or {}).get("mode") != "at_exit", receipt.get("changes")
    assert any("reversible" in m for m in receipt["isolation"]["not_in_force"]), receipt["isolation"]


def test_a_read_only_state_volume_is_refused_in_one_line(engine):
    """The state root on a volume mounted read-only (issue 27, bad input): exit 125, one line naming it."""
    vol = f"agnsup-ro-{os.urandom(3).hex()}"
    try:
        cp = engine.run(*CELLS, "-v", f"{vol}:/var/lib/agnsup:ro", cmd=["agnsup", "run", "--", "true"],
                        entrypoint=False)
    finally:
        engine.d.docker("volume", "rm", "-f", vol, check=False)
    assert cp.returncode == 125 and cp.stdout == "", cp.stderr
    assert cp.stderr.count("\n") == 1 and "read-only" in cp.stderr and "/var/lib/agnsup" in cp.stderr, cp.stderr


# -- sandboxd as the image runs it


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _events(d, cid: str, since: str) -> list[dict]:
    cp = d.docker("events", "--since", since, "--until", str(int(time.time()) + 1), "--filter", f"container={cid}",
                  "--format", "{{json .}}", timeout=30)
    return [json.loads(line) for line in cp.stdout.splitlines() if line.strip()]


# The k8s-agent-sandbox client, run next to sandboxd (`docker exec`: the container's PID namespace, as a
# sidecar with shareProcessNamespace or `kubectl exec`), from this venv's site-packages mounted read-only
# (the image has grpcio and protobuf, not the client package). sandboxd's peer check traces a loopback
# client's socket to its process: a client it cannot see is refused (see the test after this one).
CLIENT = """
import json, sys, urllib.request
from k8s_agent_sandbox.commands.command_executor import CommandExecutor
from k8s_agent_sandbox.connector import SandboxConnector
from k8s_agent_sandbox.models import SandboxdInClusterConnectionConfig
grpc_port, rest_port, script = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
with urllib.request.urlopen(f"http://127.0.0.1:{rest_port}/v1/health", timeout=10) as r:
    health = [r.status, json.loads(r.read())["status"]]
config = SandboxdInClusterConnectionConfig(mode="in-cluster-pod-ip", grpc_port=grpc_port, rest_port=rest_port)
conn = SandboxConnector("local", "default", config, k8s_helper=None, get_pod_ip=lambda: "127.0.0.1")
try:
    print(json.dumps({"health": health}), flush=True)
    r = CommandExecutor(conn, None, "test").run(script)
    print(json.dumps({"exit_code": r.exit_code, "stdout": r.stdout, "stderr": r.stderr}), flush=True)
finally:
    conn.close()
"""


class Sandboxd:
    """The image's ENTRYPOINT and CMD with the ports overridden to free loopback ones, --network host, its
    state root on a named volume (so the journal can be read after the container ended)."""

    def __init__(self, engine):
        pytest.importorskip("k8s_agent_sandbox",
                            reason="ENV_BLOCKED: k8s-agent-sandbox is not installed (the test extra)")
        import k8s_agent_sandbox
        self.d, self.image = engine.d, engine.image
        self.site = os.path.dirname(os.path.dirname(k8s_agent_sandbox.__file__))
        self.grpc_port, self.rest_port = _free_port(), _free_port()
        self.vol = f"agnsup-state-{os.urandom(3).hex()}"
        self.since = str(int(time.time()) - 1)
        self.cid = self.d.docker(
            "run", "-d", "--network", "host", *CELLS, "-v", f"{self.vol}:/var/lib/agnsup",
            "-v", f"{self.site}:/hostsite:ro", self.image,
            "agnsup", "sandboxd", "--grpc", f"127.0.0.1:{self.grpc_port}", "--rest", f"127.0.0.1:{self.rest_port}",
            "--workdir", "/workspace").stdout.strip()
        for _ in range(600):
            if '"ready": true' in self.d.docker("logs", self.cid, check=False).stdout:
                break
            if self.d.inspect(self.cid, "{{.State.Running}}") != "true":
                pytest.fail("sandboxd ended at start: " + self.d.docker("logs", self.cid, check=False).stderr[-2000:])
            time.sleep(0.1)
        else:
            pytest.fail("sandboxd never said ready: " + self.d.docker("logs", self.cid, check=False).stderr[-2000:])

    def client(self, script: str, popen: bool = False):
        argv = [containers.DOCKER, "exec", "-e", "PYTHONPATH=/hostsite", self.cid, "python3", "-c", CLIENT,
                str(self.grpc_port), str(self.rest_port), script]
        env = {**os.environ, "DOCKER_HOST": self.d.host}
        if popen:
            return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        cp = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
        assert cp.returncode == 0, cp.stderr[-2000:]
        return [json.loads(line) for line in cp.stdout.splitlines()]

    def close(self):
        self.d.docker("rm", "-f", "-v", self.cid, check=False)
        self.d.docker("volume", "rm", "-f", self.vol, check=False)


@pytest.fixture
def sandboxd(engine):
    s = Sandboxd(engine)
    yield s
    s.close()


def test_sandboxd_from_the_images_entrypoint_answers_and_docker_stop_ends_it_within_its_grace(sandboxd):
    """/v1/health answers and the k8s-agent-sandbox client's Execute runs a cell; `docker stop -t G` with a
    cell still running ends sandboxd by SIGTERM within G (the daemon's own record: exit code 0, not 137, and
    its kill -> die events), its cell cancelled by sandboxd's shutdown and the journal left consistent (a
    fresh agnsup on the same volume reads it: a SIGKILLed server would have left the cell running)."""
    s, d, grace = sandboxd, sandboxd.d, 20
    health, r = s.client("echo out; echo err >&2; exit 3")
    assert health == {"health": [200, "ok"]}
    assert r == {"exit_code": 3, "stdout": "out\n", "stderr": "err\n"}
    long = s.client("sleep 300", popen=True)
    try:
        for _ in range(300):
            rows = json.loads(d.docker("exec", s.cid, "agnsup", "ps", "--json").stdout)
            if any(row["state"] == "running" for row in rows):
                break
            time.sleep(0.1)
        else:
            pytest.fail(f"the long cell never ran: {rows}")
        d.docker("stop", "-t", str(grace), s.cid, timeout=grace + 60)
    finally:
        long.communicate(timeout=60)
    state = json.loads(d.inspect(s.cid, "{{json .State}}"))
    assert state["ExitCode"] == 0 and not state["OOMKilled"], state  # 137: docker had to SIGKILL it
    ev = _events(d, s.cid, s.since)
    kills = [e for e in ev if e.get("status") == "kill"]
    dies = [e for e in ev if e.get("status") == "die"]
    assert kills and kills[0]["Actor"]["Attributes"]["signal"] == "15" and len(dies) == 1, ev
    took = (dies[0]["timeNano"] - kills[0]["timeNano"]) / 1e9
    print(f"docker stop: SIGTERM -> exit in {took:.2f} s (grace {grace} s), exit code {state['ExitCode']}")
    assert took < grace, f"sandboxd took {took:.1f} s of its {grace} s grace"
    rows = json.loads(d.docker("run", "--rm", "--network", "none", "-v", f"{s.vol}:/var/lib/agnsup", "--entrypoint",
                               "agnsup", s.image, "ps", "--all", "--json").stdout)
    assert sorted(row["state"] for row in rows) == ["cancelled", "exited"], rows


def test_a_client_on_the_host_is_refused_by_sandboxds_peer_check_over_network_host(sandboxd):
    """The same server, called from this (host) process over the shared loopback: sandboxd cannot trace the
    client's socket to a process in its own PID namespace and fails closed (403, rule sandboxd.peer). In a
    pod the standard's client comes from another pod's address, beyond this check; a sidecar over 127.0.0.1
    without shareProcessNamespace is refused the same way (issue 27: for the lead)."""
    import urllib.error
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"http://127.0.0.1:{sandboxd.rest_port}/v1/health", timeout=10)
    body = json.loads(e.value.read())
    assert e.value.code == 403 and body["rule"] == "sandboxd.peer", body


# -- what does not start here


def test_privileged_is_named_env_blocked_where_runc_refuses_it(engine):
    """`--privileged` does not start on these machines (runc: "unable to apply caps"): skipped, naming runc's
    line, never a pass; where it starts, a cell runs in it."""
    cp = engine.run("--privileged", cmd=["agnsup", "run", "--", "echo", "hello"])
    if cp.returncode != 0 and "unable to apply caps" in cp.stderr:
        runc = next(line for line in cp.stderr.splitlines() if "unable to apply caps" in line)
        pytest.skip(f"ENV_BLOCKED: --privileged does not start here: {runc.strip()[:300]}")
    assert (cp.returncode, cp.stdout) == (0, "hello\n"), cp.stderr[-2000:]


# -- the daemon itself


def test_the_lanes_daemon_leaves_networking_alone_and_removes_all_it_made():
    """tests/containers.Daemon in a network namespace of its own (IP forwarding off there first): after it
    started and ran a container, forwarding is still off, `lo` is the only link and no iptables rule exists
    (dockerd's defaults would turn forwarding on); leaving it removes its temp dir, mounts and cgroups."""
    why = containers.installed()
    if why:
        pytest.skip(why)
    with containers.Daemon(netns=True) as d:
        ns = f"/proc/{d.pid}/ns/net"

        def inside(*argv):
            return subprocess.run(["nsenter", f"--net={ns}", *argv], capture_output=True, text=True).stdout
        cp = d.docker("run", "--network", "none", *containers.tiny_image(d), "/bin/true", check=False)
        assert cp.returncode == 0, cp.stderr
        assert inside("cat", "/proc/sys/net/ipv4/ip_forward").strip() == "0"
        assert [line.split()[0] for line in inside("ip", "-br", "link").splitlines()] == ["lo"]
        assert "-A " not in inside("iptables", "-S") + inside("iptables", "-t", "nat", "-S")
        root, name = d.root, d.name
        assert containers.mounts_under(root)
    assert not os.path.exists(root) and not containers.mounts_under(root)
    assert not [top for top in os.listdir("/sys/fs/cgroup") if os.path.exists(f"/sys/fs/cgroup/{top}/{name}")]
    assert not os.path.exists(f"/proc/{d.pid}") or d.proc.returncode is not None


def test_the_entrypoints_doctor_is_chosen_by_one_variable_and_a_bad_value_is_refused_in_one_line(engine):
    """AGNSUP_ENTRYPOINT_DOCTOR: probe (default: doctor's cells), no-probe, off; anything else exits 125 in one line
    before the command runs."""
    probe = engine.run(cmd=["true"])
    assert probe.returncode == 0 and "status:" in probe.stderr and "not probed" not in probe.stderr, probe.stderr
    quick = engine.run("-e", "AGNSUP_ENTRYPOINT_DOCTOR=no-probe", cmd=["true"])
    assert quick.returncode == 0 and "not probed" in quick.stderr, quick.stderr
    off = engine.run("-e", "AGNSUP_ENTRYPOINT_DOCTOR=off", cmd=["echo", "ran"])
    assert off.returncode == 0 and "status:" not in off.stderr and off.stdout == "ran\n", off.stderr
    bad = engine.run("-e", "AGNSUP_ENTRYPOINT_DOCTOR=maybe", cmd=["echo", "ran"])
    assert bad.returncode == 125 and bad.stdout == "" and len(bad.stderr.strip().splitlines()) == 1, bad
