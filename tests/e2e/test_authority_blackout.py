"""The authority-blackout acceptance test (../shared/spec/authority-blackout.md, issue 5).

CI runs 20 seeded runs of `agnsup selftest` (the same code users run to
certify their host), through the installed console script, in four blocks of
five so each block stays well inside the per-test timeout. Every gate must
PASS in every run: ENV_BLOCKED, NOT_EVALUATED, INVALID and FAIL all fail the
test. AGNSUP_SELFTEST_SEED replays another sequence (the seed of each run is
printed with its gate table).

The sabotage tests prove the gates can fire: a run that leaks a canary
secret, signals the sentinel, or skips recovery must fail exactly there.
"""
import json
import os
import subprocess

import pytest

from conftest import BIN
from agnsup.selftest.gates import GATES, format_table

SEED = int(os.environ.get("AGNSUP_SELFTEST_SEED", "5150"))
BLOCKS, PER_BLOCK = 4, 5
pytestmark = pytest.mark.serial("a scenario whose gates time heartbeats and rebind host ports")


def _selftest(*args, timeout=290):
    cp = subprocess.run([BIN, "selftest", *args, "--json"], capture_output=True, timeout=timeout,
                        stdin=subprocess.DEVNULL)
    out = cp.stdout.decode(errors="replace")
    try:
        return cp.returncode, json.loads(out), cp.stderr.decode(errors="replace")
    except ValueError:
        pytest.fail(f"selftest printed no JSON (rc {cp.returncode}): {out[-2000:]} {cp.stderr[-2000:]!r}")


def _no_leftovers(results):
    from agnsup.linux import cgroup
    layout = cgroup.detect_layout()
    for r in results:
        assert not os.path.exists(r["work"]), f"selftest left its work dir {r['work']}"
        base = cgroup.base_node(layout, os.path.join(r["work"], "state"))
        for p in base.paths.values():
            assert not os.path.exists(p), f"selftest left its cgroup root {p}"


@pytest.mark.parametrize("block", range(BLOCKS))
def test_twenty_seeded_blackout_runs_pass_every_gate(block):
    first = SEED + block * PER_BLOCK
    rc, report, err = _selftest("--runs", str(PER_BLOCK), "--seed", str(first))
    for r in report["results"]:
        print(f"seed {r['seed']}: {r['status']} in {r['seconds']:.1f} s {r.get('timings')}")
    failed = [format_table(r, 400) for r in report["results"] if r["status"] != "PASS"]
    assert not failed, "\n".join(failed) + f"\nhost: {report['host']}\nstderr: {err[-2000:]}"
    for r in report["results"]:
        assert set(r["gates"]) == set(GATES)
        assert all(v["status"] == "PASS" for v in r["gates"].values())
        assert r["pid_namespace"] and r["facts"]["pid_trap"]["pid"] > 1  # the trap landed (else INVALID)
    assert rc == 0 and report["status"] == "PASS" and report["passed"] == PER_BLOCK
    _no_leftovers(report["results"])


def _sabotaged(**extra):
    from agnsup.selftest import blackout
    from agnsup.selftest.host import Procs
    procs = Procs()
    prefix, blocked = blackout.pid_namespace(procs)
    r = blackout.run_once(SEED, False, procs, prefix, blocked, **extra)
    _no_leftovers([r])
    return r


def test_a_leaked_secret_fails_host_secret_leak():
    r = _sabotaged(phases="1", run_extra=["--env", "AGNSUP_CANARY_SECRET"])
    g = r["gates"]["HOST_SECRET_LEAK"]
    assert g["status"] == "FAIL" and "AGNSUP_CANARY_SECRET reached the cell" in g["evidence"], g
    assert r["status"] == "FAIL"


def test_a_signalled_sentinel_fails_sentinel_killed():
    r = _sabotaged(phases="123", sabotage="signal_sentinel")
    g = r["gates"]["SENTINEL_KILLED"]
    assert g["status"] == "FAIL" and "SIGUSR1" in g["evidence"], g
    assert r["gates"]["ORPHAN_PROCESS_AFTER_CRASH"]["status"] == "PASS"


def test_skipping_recovery_fails_the_recovery_gates():
    r = _sabotaged(phases="123", sabotage="skip_recovery")
    for gate in ("ORPHAN_PROCESS_AFTER_CRASH", "HEARTBEAT_CONTINUES", "PORT_NOT_RELEASED", "STATE_NOT_CONVERGED",
                 "RECOVERY_RECEIPT_MISSING", "RESOURCE_LEAK"):
        assert r["gates"][gate]["status"] == "FAIL", (gate, r["gates"][gate])
    assert r["status"] == "FAIL"
    # phase 4 never ran: its gates are not evaluated, which is not a pass either
    assert r["gates"]["CANCEL_RUN_INCOMPLETE"]["status"] == "NOT_EVALUATED"


def test_selftest_exit_status_and_table_name_the_seed():
    cp = subprocess.run([BIN, "selftest", "--runs", "1", "--seed", str(SEED)], capture_output=True, timeout=290,
                        stdin=subprocess.DEVNULL)
    out = cp.stdout.decode(errors="replace")
    assert cp.returncode == 0, out
    assert f"seed {SEED}" in out and "kernel:" in out and "cgroups:" in out
    assert out.count(" PASS") >= len(GATES) and "PASS: 1/1 runs passed every gate" in out


def test_a_killed_selftest_leaves_nothing_the_next_run_does_not_sweep(tmp_path):
    """`agnsup selftest` SIGKILLed mid-run (an interrupted test: subprocess.run kills its child) leaves its
    work dir and a private cgroup tree with live cells in it; the next run's sweep (its lock is free)
    kills and removes them. Fails without the sweep: the cgroup tree stays."""
    import glob
    import signal
    import time
    from agnsup.linux import cgroup
    from agnsup.selftest import blackout
    env = {**os.environ, "AGNSUP_SELFTEST_DIR": str(tmp_path)}
    p = subprocess.Popen([BIN, "selftest", "--runs", "1", "--seed", str(SEED)], env=env, start_new_session=True,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    roots = []
    try:
        deadline = time.monotonic() + 120
        while not roots and time.monotonic() < deadline:
            roots = [r for w in glob.glob(str(tmp_path / "agnsup-selftest-*"))
                     for r in glob.glob(f"/sys/fs/cgroup/*/{cgroup.root_name(os.path.join(w, 'state'))}/run-*")]
            time.sleep(0.1)
        assert roots, "the selftest never made its cells' cgroups"
    finally:
        os.killpg(p.pid, signal.SIGKILL)  # the selftest, its unshare and scenario: what this test started
        p.wait()
    (work,) = glob.glob(str(tmp_path / "agnsup-selftest-*"))
    assert os.path.isdir(roots[0])  # left behind by the killed run
    assert blackout.sweep_dead_runs(str(tmp_path)) == [work]
    assert not os.path.exists(work) and not any(os.path.exists(os.path.dirname(r)) for r in roots)
