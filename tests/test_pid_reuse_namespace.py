"""The PID-reuse trap alone (issues 3 and 5), through the self-test's own harness.

Inside a fresh PID namespace: a stubborn tree runs in a cell, its controller
is SIGKILLed, its recorded leader exits, and an innocent process is started
on exactly the leader's PID (ns_last_pid). The janitor must kill the rest of
the tree, spare the innocent (no signal at all) and say why in the recovery
receipt. The trap must really land (the innocent has the recorded PID),
else the run is INVALID, and this test fails rather than passes.
"""
import pytest

from agnsup.linux import pidfd
from agnsup.selftest import blackout
from agnsup.selftest.host import Procs

TRAP_GATES = ("PID_REUSE_KILL", "ORPHAN_PROCESS_AFTER_CRASH", "RECOVERY_RECEIPT_MISSING", "RECEIPT_MISMATCH",
              "SAME_BOOT_IGNORED", "STATE_NOT_CONVERGED")


@pytest.mark.parametrize("seed", [11, 12])  # 11 recovers through `agnsup janitor`, 12 through the next `agnsup run`
def test_an_innocent_process_on_the_recorded_leader_pid_is_spared(seed):
    procs = Procs()
    prefix, blocked = blackout.pid_namespace(procs)
    if prefix is None:
        pytest.skip(f"ENV_BLOCKED: PID namespace ({blocked})")
    r = blackout.run_once(seed, False, procs, prefix, blocked, phases="123")
    assert not r["invalid"], r["invalid"]
    assert r["error"] is None, (r["error"], r["facts"].get("traceback"))
    trap = r["facts"]["pid_trap"]
    assert trap["pid"] > 1 and "after fork" in trap["note"]
    for g in TRAP_GATES:
        assert r["gates"][g]["status"] == "PASS", (g, r["gates"][g])
    why = r["facts"]["innocent_spared_because"]
    assert f"pid {trap['pid']}" in why and "spared" in why
    if pidfd.has_pidfs():
        assert "pidfd inode" in why, why
    assert not r["leftover"]
