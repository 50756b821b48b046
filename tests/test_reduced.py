"""Reduced cells (issue 27; docs/isolation.md, "Reduced cells"): a host that refuses namespaces is not a
dead end when the operator opts in (isolation.reduced), and what must still hold holds, proven by attack.

The host is emulated here as Docker's default seccomp profile makes it for root without CAP_SYS_ADMIN:
agnsup runs under a seccomp filter that answers unshare, mount, setns and the new mount API with EPERM and
clone3 with ENOSYS (conftest.seccomp_launcher), and without a cgroup tree (AGNSUP_CGROUP_LAYOUT=none, as
the image's entrypoint sets it where /sys/fs/cgroup is read-only). The same attacks run in a real default
Docker container at the end (skipped, ENV_BLOCKED, without the engine: tests/containers.py).

Each attack has its control: the same attack with the guarantee switched off in the role succeeds, so the
test would see the guarantee go."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from conftest import BIN, procs_with_env, refusals, seccomp_launcher, write_role

if os.geteuid() != 0:
    pytest.skip("ENV_BLOCKED: root (the emulated container is root's, as a container's root is)",
                allow_module_level=True)

# Docker's default profile (no CAP_SYS_ADMIN): unshare 272, mount 165, setns 308, fsopen 430, open_tree 428,
# move_mount 429, mount_setattr 442: EPERM; clone3 435: ENOSYS (what runc's profile answers, so fork is used)
DEFAULT_PROFILE = seccomp_launcher({272: 1, 165: 1, 308: 1, 430: 1, 428: 1, 429: 1, 442: 1, 435: 38})
ALL = ["mount_namespace", "network_namespace", "pid_namespace", "cgroup"]
NOBODY = 65534


class Host:
    """`agnsup` under the emulated default container, with one state root."""

    def __init__(self, state: str, env: dict | None = None):
        self.state = state
        self.env = {**os.environ, "AGNSUP_STATE_DIR": state, "AGNSUP_CGROUP_LAYOUT": "none", **(env or {})}

    def argv(self, *args) -> list[str]:
        return [sys.executable, "-c", DEFAULT_PROFILE, BIN, *args]

    def __call__(self, *args, check=None, env=None, timeout=60) -> subprocess.CompletedProcess:
        cp = subprocess.run(self.argv(*args), env={**self.env, **(env or {})}, capture_output=True, text=True,
                            timeout=timeout, stdin=subprocess.DEVNULL)
        if check is not None:
            assert cp.returncode == check, f"exit {cp.returncode}\nstdout: {cp.stdout}\nstderr: {cp.stderr}"
        return cp

    def popen(self, *args, env=None, **kw) -> subprocess.Popen:
        return subprocess.Popen(self.argv(*args), env={**self.env, **(env or {})}, **kw)

    def receipt(self, cell: str, run: str = "default") -> dict:
        with open(os.path.join(self.state, "cells", run, cell, "receipt.json")) as f:
            return json.load(f)


@pytest.fixture
def host(state):
    return Host(state)


@pytest.fixture
def roles(policy_dir):
    """`reduced` as shipped, and its controls: the same role with one guarantee off."""
    write_role(policy_dir, "nolandlock", isolation__reduced=json.dumps(ALL), isolation__landlock="false")
    write_role(policy_dir, "passcanary", isolation__reduced=json.dumps(ALL),
               env__pass='["LANG", "LC_ALL", "TERM", "TZ", "REDUCED_CANARY"]')
    return {"AGNSUP_POLICY_DIR": str(policy_dir)}


# -- the opt-in, and its absence


def test_without_the_opt_in_a_refused_namespace_is_one_line_naming_the_piece_and_both_fixes(host, worktree):
    cp = host("run", "--workdir", worktree, "--cell", "plain", "--", "true", check=125)
    assert cp.stderr.count("\n") == 1 and cp.stderr.startswith("agnsup: cell setup failed at step "), cp.stderr
    assert "Operation not permitted" in cp.stderr
    assert "fix: run the container with --cap-add SYS_ADMIN (deploy/Dockerfile), or accept a reduced cell: " \
           'isolation.reduced = ["mount_namespace", "network_namespace", "pid_namespace"] (docs/hosts.md)' \
           in cp.stderr, cp.stderr
    # journaled as every failed start is: a failed cell whose receipt holds the same line
    r = host.receipt("plain")
    assert r["state"] == "failed" and r["exit_code"] == 125 and "isolation.reduced" in r["error"]


def test_an_unknown_reduced_value_is_one_line_exit_125(host, worktree, policy_dir):
    write_role(policy_dir, "typo", isolation__reduced='["mount"]')
    cp = host("run", "--role", "typo", "--workdir", worktree, "--", "true", check=125,
              env={"AGNSUP_POLICY_DIR": str(policy_dir)})
    assert cp.stderr.count("\n") == 1 and "key isolation.reduced: 'mount' is not a piece a cell can run without " \
        "(one of: mount_namespace, network_namespace, pid_namespace, cgroup)" in cp.stderr, cp.stderr


def test_a_reduced_cell_runs_and_its_receipt_names_each_missing_piece(host, worktree):
    cp = host("run", "--role", "reduced", "--workdir", worktree, "--cell", "r1", "--", "echo", "hello", check=0)
    assert cp.stdout == "hello\n"
    r = host.receipt("r1")
    assert r["reduced"] == ALL and r["isolation"]["reduced"] == ALL
    for piece in ALL:
        assert any(n.startswith(f"{piece} (reduced: ") for n in r["isolation"]["not_in_force"]), piece
    iso = r["isolation"]
    assert iso["mount_namespace"] is False and iso["network_namespace"] is False and iso["pid_namespace"] is False
    assert iso["network"] == "host" and iso["tracking"] == "session+token"
    # what still holds is in force, and said so
    assert iso["seccomp"] and iso["landlock"] and iso["no_new_privs"] and iso["landlock_scopes"]
    assert iso["on_controller_death"] == {"mode": "kill", "in_force": False, "how": iso["on_controller_death"]["how"]}
    # the journal holds the same receipt, and the text of receipts and ps says it
    assert [x["reduced"] for x in json.loads(host("receipts", "--json", check=0).stdout)] == [ALL]
    assert "  reduced: mount_namespace, network_namespace, pid_namespace, cgroup" in host("receipts", check=0).stdout


def test_a_reduced_role_on_a_full_host_gets_full_isolation(agnsup, worktree, state):
    """Never where the host offers it: the same role without the emulated profile is the executor."""
    agnsup("run", "--role", "reduced", "--workdir", worktree, "--cell", "full", "--", "true", check=0)
    with open(os.path.join(state, "cells", "default", "full", "receipt.json")) as f:
        r = json.load(f)
    assert r["reduced"] == [] and r["isolation"]["mount_namespace"] is True
    assert r["isolation"]["network_namespace"] is True and r["isolation"]["pid_namespace"] is True
    assert not any("reduced" in n for n in r["isolation"]["not_in_force"])


def test_the_gate_still_judges_a_reduced_cell(host, worktree):
    host("run", "--role", "reduced", "--workdir", worktree, "--", "git", "push", "--force", check=126)
    # what a full cell's mask or network namespace would refuse anyway, the reduced role's gate refuses early
    # (governance.kernel_enforced = "deny"): no mask or namespace refuses it in a reduced cell
    cp = host("run", "--role", "reduced", "--workdir", worktree, "--", "cat", "/etc/shadow", check=126)
    assert "denied by sandbox.deny_path" in cp.stderr
    host("run", "--role", "reduced", "--workdir", worktree, "--", "curl", "https://example.org", check=126)
    assert [x["kind"] for x in refusals(host.state)] == ["denied"] * 3, refusals(host.state)


# -- what still holds, by attack


def _sh(host, role: str, worktree: str, cell: str, script: str, env=None, **kw) -> tuple[subprocess.CompletedProcess,
                                                                                         dict]:
    cp = host("run", "--role", role, "--workdir", worktree, "--cell", cell, "--", "sh", "-c", script, env=env, **kw)
    return cp, host.receipt(cell)


def test_a_reduced_cell_writes_only_its_worktree_and_its_own_tmp(host, worktree, tmp_path, roles):
    """Landlock is the only write line without a mount namespace: the host's /tmp, a directory outside the
    worktree, the state root (the journal) are refused; the control (isolation.landlock = false) writes them."""
    outside = tmp_path / "outside"
    outside.mkdir()
    host_tmp = f"/tmp/agnsup-reduced-{os.getpid()}-{time.monotonic_ns()}"
    with open(os.path.join(worktree, "targets"), "w") as f:  # read by the cell: the gate refuses literals early
        f.write(f"{outside}/escaped {host_tmp} {host.state}/planted")
    script = ('for f in $(cat targets) "$TMPDIR/mine" ./mine; do '
              'if touch "$f" 2>/dev/null; then echo "wrote $f"; else echo "refused $f"; fi; done')
    try:
        cp, r = _sh(host, "reduced", worktree, "lw", script, env=roles)
        assert cp.returncode == 0, cp.stderr
        lines = cp.stdout.splitlines()
        assert lines[:3] == [f"refused {outside}/escaped", f"refused {host_tmp}", f"refused {host.state}/planted"]
        assert lines[3].startswith("wrote ") and lines[3].endswith("/tmp/mine") and lines[4] == "wrote ./mine"
        assert r["reduced"] == ALL
        cp, _ = _sh(host, "nolandlock", worktree, "lw0", script, env=roles)
        assert cp.stdout.splitlines()[:3] == [f"wrote {outside}/escaped", f"wrote {host_tmp}",
                                              f"wrote {host.state}/planted"], "the control could not write"
    finally:
        for p in (host_tmp, f"{host.state}/planted"):
            if os.path.exists(p):
                os.unlink(p)


def test_a_reduced_cell_cannot_signal_its_controller_or_another_process(host, worktree, roles):
    """No PID namespace: the cell sees the host's processes, but Landlock's signal scope keeps it from
    signalling any of them (its controller, a process of the same uid); the control kills the bystander."""
    bystander = subprocess.Popen(["sleep", "300"])
    try:
        script = (f'kill -0 "$PPID" 2>/dev/null && echo "signalled controller" || echo "refused controller"; '
                  f'kill -TERM {bystander.pid} 2>/dev/null && echo "signalled bystander" || echo "refused bystander"')
        cp, _ = _sh(host, "reduced", worktree, "sig", script, env=roles)
        assert cp.stdout.splitlines() == ["refused controller", "refused bystander"], cp.stdout + cp.stderr
        assert bystander.poll() is None
        cp, _ = _sh(host, "nolandlock", worktree, "sig0", script, env=roles)
        assert cp.stdout.splitlines() == ["signalled controller", "signalled bystander"], cp.stdout + cp.stderr
        assert bystander.wait(10) == -signal.SIGTERM
    finally:
        if bystander.poll() is None:
            bystander.kill()
        bystander.wait()


def test_a_reduced_cells_environment_is_built_from_nothing(host, worktree, roles):
    """The controller's environment does not cross (the control role passes the canary by name)."""
    env = {**roles, "REDUCED_CANARY": "c4n4ry-value"}
    cp, r = _sh(host, "reduced", worktree, "env", "env", env=env)
    assert "c4n4ry-value" not in cp.stdout and "AGNSUP_STATE_DIR" not in cp.stdout and cp.returncode == 0
    keys = {line.split("=", 1)[0] for line in cp.stdout.splitlines() if "=" in line}
    assert keys <= set(r["env_keys"]) | {"PWD", "SHLVL", "_", "OLDPWD"}, keys - set(r["env_keys"])
    cp, _ = _sh(host, "passcanary", worktree, "env0", "env", env=env)
    assert "REDUCED_CANARY=c4n4ry-value" in cp.stdout


def test_a_reduced_cell_has_its_own_session_and_process_group(host, worktree):
    cp, r = _sh(host, "reduced", worktree, "sess", 'echo $$; cut -d" " -f5,6 /proc/$$/stat')
    pid, (pgid, sid) = int(cp.stdout.split()[0]), map(int, cp.stdout.split()[1:3])
    assert pid == r["pids"]["leader"] and pgid == pid and sid == pid
    assert sid != os.getsid(0)


@pytest.mark.parametrize("as_user", [False, True], ids=["root", "process_user"])
def test_killing_a_reduced_cells_controller_kills_its_leader_and_the_janitor_recovers_the_rest(host, worktree,
                                                                                              policy_dir, as_user):
    """The dead-man switch of a cell without a PID namespace is the leader's PR_SET_PDEATHSIG; what the leader
    started outlives it (named in the receipt) until the janitor finds it by session + token and kills it.
    With process.user the leader changes its uid, which clears the signal: it is set again after (process/steps.py
    "after_credentials")."""
    role = "reduced"
    if as_user:
        role = "reduceduser"
        write_role(policy_dir, role, isolation__reduced=json.dumps(ALL), process__user=str(NOBODY))
        host.env["AGNSUP_POLICY_DIR"] = str(policy_dir)
        # no mount namespace: the host's own path must let uid 65534 in (pytest's tmp_path does not)
        worktree = tempfile.mkdtemp(prefix="agnsup-test-reduced-", dir="/var/tmp")
        os.chmod(worktree, 0o755)
        os.chown(worktree, NOBODY, NOBODY)  # where its shell writes the background pid
    bg = os.path.join(worktree, "bg")

    def bg_pid() -> int | None:
        try:
            with open(bg) as f:
                return int(f.read().strip() or 0) or None
        except OSError:
            return None
    ctl = host.popen("run", "--role", role, "--workdir", worktree, "--cell", "dm", "--", "sh", "-c",
                     f'sleep 300 & echo $! > "{bg}"; exec sleep 301', stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while bg_pid() is None:
            assert time.monotonic() < deadline and ctl.poll() is None, "the cell did not start"
            time.sleep(0.05)
        tree = procs_with_env("AGNSUP_CELL_ID", "dm")
        assert len(tree) == 2, tree
        ctl.send_signal(signal.SIGKILL)
        ctl.wait(10)
        deadline = time.monotonic() + 10
        while len(procs_with_env("AGNSUP_CELL_ID", "dm")) > 1:
            assert time.monotonic() < deadline, "the leader outlived its controller"
            time.sleep(0.05)
        left = procs_with_env("AGNSUP_CELL_ID", "dm")
        assert left == [bg_pid()], left  # the leader died with it; what it started did not
        host("janitor", check=0)
        assert procs_with_env("AGNSUP_CELL_ID", "dm") == []
        rec = [r for r in json.loads(host("receipts", "--json", check=0).stdout) if r["cell_id"] == "dm"]
        assert rec and rec[0]["state"] == "recovered" and rec[0]["reduced"] == ALL, rec
        assert bg_pid() in [k.get("pid") for k in rec[0]["recovery"]["killed"]], rec[0]["recovery"]
    finally:
        if ctl.poll() is None:
            ctl.kill()
            ctl.wait()
        for pid in procs_with_env("AGNSUP_CELL_ID", "dm"):
            os.kill(pid, signal.SIGKILL)
        if as_user:
            shutil.rmtree(worktree, ignore_errors=True)


def test_the_cells_own_seccomp_filter_is_stacked_on_the_containers(host, worktree):
    cp, r = _sh(host, "reduced", worktree, "sc", "grep ^Seccomp_filters: /proc/self/status")
    assert cp.stdout.split() == ["Seccomp_filters:", "2"], cp.stdout  # the profile's, then the cell's own
    assert r["isolation"]["seccomp"] is True


# -- the same, in a real default Docker container (Docker's own seccomp profile, no capability added)

IN_CONTAINER = r'''
set -u
mkdir -p /tmp/wt && cd /tmp/wt
sleep 300 & BY=$!
# the targets read from a file: the reduced role's gate (kernel_enforced = "deny") refuses literal ones early
echo /etc/planted /tmp/planted /var/lib/agnsup/planted > /tmp/wt/targets
attack='for f in $(cat targets) "$TMPDIR/mine" ./mine; do
  if touch "$f" 2>/dev/null; then echo "wrote $f"; else echo "refused $f"; fi; done
kill -0 $PPID 2>/dev/null && echo "signalled controller" || echo "refused controller"
kill -TERM '$BY' 2>/dev/null && echo "signalled bystander" || echo "refused bystander"
echo "canary $(env | grep -c REDUCED_CANARY)"
echo "session $$ $(cut -d" " -f5,6 /proc/$$/stat)"'
echo "== reduced"; agnsup run --role reduced --cell a -- sh -c "$attack"; echo "exit $?"
kill -0 $BY 2>/dev/null && echo "bystander alive"
rm -f /etc/planted /tmp/planted /var/lib/agnsup/planted
echo "== control"; agnsup run --role nolandlock --cell a0 -- sh -c "$attack"; echo "exit $?"
echo "== gate"; agnsup run --role reduced -- git push --force 2>/dev/null; echo "exit $?"
echo "== deadman"
agnsup run --role reduced --cell dm -- sh -c 'sleep 300 & echo $! > /tmp/wt/bg; exec sleep 301' & CTL=$!
while [ ! -s /tmp/wt/bg ]; do sleep 0.1; done
LEADER=$(agnsup ps --json | python3 -c 'import json,sys; print([c["pid"] for c in json.load(sys.stdin) if c["cell_id"] == "dm"][0])')
kill -KILL $CTL; sleep 1
kill -0 $LEADER 2>/dev/null && echo "leader alive" || echo "leader dead"
kill -0 $(cat /tmp/wt/bg) 2>/dev/null && echo "orphan alive" || echo "orphan dead"
agnsup janitor >/dev/null; echo "janitor exit $?"
kill -0 $(cat /tmp/wt/bg) 2>/dev/null && echo "orphan alive" || echo "orphan dead"
echo "== receipts"; agnsup receipts --json | python3 -c 'import json,sys; [print(json.dumps({k: r.get(k) for k in ("cell_id", "state", "reduced")} | {"landlock": (r.get("isolation") or {}).get("landlock"), "seccomp": (r.get("isolation") or {}).get("seccomp")})) for r in json.load(sys.stdin)]'
'''


@pytest.mark.timeout(900)
def test_in_a_default_docker_container_a_reduced_cell_holds_what_it_must(tmp_path, engine):
    """Docker 20.10's default profile, no flag: the reduced role runs; writes outside the worktree and its
    own tmp (/etc, /tmp, the state root) are refused, the controller and a bystander cannot be signalled, the
    environment is from nothing, the cell has its own session, the gate judges, the leader dies with a
    SIGKILLed controller and the janitor kills what it left; the control (no Landlock) writes and signals."""
    policies = tmp_path / "policies"
    policies.mkdir()
    write_role(policies, "nolandlock", isolation__reduced=json.dumps(ALL), isolation__landlock="false")
    (tmp_path / "attack.sh").write_text(IN_CONTAINER)
    os.chmod(tmp_path, 0o755)
    cp = engine.run("-v", f"{tmp_path}:/t:ro", "-e", "AGNSUP_POLICY_DIR=/t/policies", "-e", "REDUCED_CANARY=c4n4ry",
                    cmd=["sh", "/t/attack.sh"], timeout=300)  # through the entrypoint, as users run it
    out = cp.stdout if isinstance(cp.stdout, str) else cp.stdout.decode()
    print(out)
    part = dict(p.split("\n", 1) for p in out.split("== ")[1:])
    assert part["reduced"].splitlines() == [
        "refused /etc/planted", "refused /tmp/planted", "refused /var/lib/agnsup/planted",
        part["reduced"].splitlines()[3], "wrote ./mine", "refused controller", "refused bystander", "canary 0",
        part["reduced"].splitlines()[8], "exit 0", "bystander alive"], out
    assert part["reduced"].splitlines()[3].startswith("wrote /var/lib/agnsup/cells/default/a/tmp/mine")
    pid, pgid, sid = part["reduced"].splitlines()[8].split()[1:]
    assert pid == pgid == sid, part["reduced"]
    assert part["control"].splitlines()[:5] == ["wrote /etc/planted", "wrote /tmp/planted",
                                                "wrote /var/lib/agnsup/planted", part["control"].splitlines()[3],
                                                "wrote ./mine"], out
    assert "signalled controller" in part["control"] and "signalled bystander" in part["control"]
    assert part["gate"].strip() == "exit 126", out
    assert part["deadman"].splitlines() == ["leader dead", "orphan alive", "janitor exit 0", "orphan dead"], out
    receipts = {r["cell_id"]: r for r in map(json.loads, part["receipts"].splitlines())}
    assert receipts["a"]["reduced"] == ALL and receipts["a"]["landlock"] and receipts["a"]["seccomp"], receipts
    assert receipts["dm"]["state"] == "recovered" and receipts["dm"]["reduced"] == ALL, receipts


def test_a_normal_users_reduced_cell_runs_without_any_namespace_and_holds_its_writes(user):
    """A normal user where namespaces are refused (no user namespace: Docker's profile, an LSM): the reduced
    role needs none, not even a user namespace of its own; Landlock still holds its writes."""
    launcher = (user.python, "-c", DEFAULT_PROFILE)
    outside = user.own_dir("outside")
    cp = user("run", "--workdir", user.work, "--", "true", launcher=launcher)
    assert cp.returncode == 125 and "isolation.reduced = [" in cp.stderr, cp.stderr
    # the path read from a file: the gate (kernel_enforced = "deny") refuses the literal early; the kernel is tested
    target = os.path.join(user.work, "target")
    with open(target, "w") as f:
        f.write(f"{outside}/escaped")
    os.chown(target, user.uid, user.gid)
    script = ('touch "$(cat target)" 2>/dev/null && echo "wrote outside" || echo "refused outside"; '
              'touch ./mine "$TMPDIR/mine" && echo "wrote own"')
    cp = user("run", "--role", "reduced", "--workdir", user.work, "--cell", "u1", "--", "sh", "-c", script,
              launcher=launcher)
    assert cp.returncode == 0 and cp.stdout.splitlines() == ["refused outside", "wrote own"], cp.stdout + cp.stderr
    r = user.json("receipts", "--json", "--cell", "u1")[0]
    assert r["reduced"][:3] == ["mount_namespace", "network_namespace", "pid_namespace"]
    assert r["isolation"]["user_namespace"] is False and r["isolation"]["landlock"] is True
    assert user.left() == []
