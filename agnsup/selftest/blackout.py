"""`agnsup selftest`: the authority-blackout test on this host, N seeded runs.

Each run gets a private work directory (worktrees, canaries, decoy, role) and
a private state root, hence a private cgroup root (cgroup.base_node derives
it from the state root). The scenario itself (scenario.py) runs as PID 1 of
its own PID namespace when the host allows it (`unshare --pid --fork
--mount-proc --kill-child`): there the PID-reuse trap can put an innocent
process on the dead leader's PID, and if anything goes wrong, the end of that
PID 1 takes every process of the run with it. Afterwards this driver kills
whatever is left in the private cgroup root (its own) and removes both
directories, even when the run failed (unless --keep).

Exit 0 only when every gate passed in every run. The seed of run i is
seed + i; the table names it, so `agnsup selftest --seed S` replays a run.
"""
from __future__ import annotations

import fcntl
import glob
import json
import os
import random
import shutil
import sys
import tempfile
import time
from contextlib import suppress

from .gates import PASS, format_table
from .host import Procs, communicate, dumps, host_facts

RUN_TIMEOUT = 240.0
SYSTEM_PATH = "/usr/bin:/bin:/usr/sbin:/sbin"


def _agnsup_bin() -> str:
    """The installed console script next to this interpreter: what a user runs."""
    return os.path.join(os.path.dirname(sys.executable), "agnsup")


def _work_parent() -> str:
    # Not under /tmp: cells get a private /tmp, which would hide the decoy secret
    # for the wrong reason (the gate must see the role's deny rule do it).
    for d in (os.environ.get("AGNSUP_SELFTEST_DIR"), "/var/tmp", tempfile.gettempdir()):
        if d and os.path.isdir(d) and os.access(d, os.W_OK):
            return d
    return tempfile.gettempdir()


def pid_namespace(procs: Procs) -> tuple[list[str] | None, str]:
    """The command prefix that runs a program as PID 1 of a new PID namespace
    (with its own /proc), or (None, the capability that is missing)."""
    unshare = shutil.which("unshare", path=SYSTEM_PATH)
    if not unshare:
        return None, "unshare(1) not found in " + SYSTEM_PATH
    prefix = [unshare, "--pid", "--fork", "--mount-proc", "--kill-child", "--"]
    p = procs.start(prefix + [sys.executable, "-c", "import os; print(os.getpid(), open('/proc/sys/kernel/"
                                                    "ns_last_pid').read().strip())"],
                    stdout=-1, stderr=-1, env=dict(os.environ))
    rc, out, err = communicate(p, 60)
    if rc != 0 or not out.startswith("1 "):
        return None, f"unshare --pid --fork --mount-proc failed (rc {rc}): {err.strip()[-200:]}"
    return prefix, ""


def cleanup_cgroups(state: str) -> list[str]:
    """Kill and remove whatever is left of this run's private cgroup root; say what was there."""
    from .. import backend
    try:
        return backend.choose(state).purge()
    except OSError:
        return []


# Held (flock) by the run that made a work dir, for as long as it runs: the kernel drops it however that
# process dies. A work dir whose lock can be taken belongs to a run that was killed (a SIGKILLed
# `agnsup selftest`, an interrupted test): its cgroup tree and files are swept by the next run.
RUN_LOCK = "selftest.lock"


def _hold(work: str) -> int:
    fd = os.open(os.path.join(work, RUN_LOCK), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def sweep_dead_runs(parent: str) -> list[str]:
    """Remove what killed runs left under `parent` (their private cgroup root first); a run alive,
    or kept with --keep (no lock file), is left alone. Returns the work dirs removed."""
    removed = []
    for work in glob.glob(os.path.join(parent, "agnsup-selftest-[0-9]*-*")):
        try:
            fd = os.open(os.path.join(work, RUN_LOCK), os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # its run is alive
        finally:
            os.close(fd)
        cleanup_cgroups(os.path.join(work, "state"))
        shutil.rmtree(work, ignore_errors=True)
        removed.append(work)
    return removed


def run_once(seed: int, keep: bool, procs: Procs, prefix: list[str] | None, blocked: str, **extra) -> dict:
    """One seeded run in its own work dir, state root and (when possible) PID
    namespace. `extra` goes to the scenario's config: tests use it to run some
    phases only, or to sabotage a run and prove a gate fires."""
    sweep_dead_runs(_work_parent())
    work = tempfile.mkdtemp(prefix=f"agnsup-selftest-{seed}-", dir=_work_parent())
    held = _hold(work)
    state = os.path.join(work, "state")
    cfg = {"seed": seed, "work": os.path.join(work, "run"), "state": state, "agnsup": _agnsup_bin(),
           "pidns": prefix is not None, "pidns_blocked": blocked, **extra}
    cfg_path, out_path = os.path.join(work, "config.json"), os.path.join(work, "result.json")
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    t0 = time.monotonic()
    # Under systemd the run's controllers live in agnsup's own unit for this state root; they run in a
    # PID namespace with its own /proc, where systemd cannot name them: the harness enters the unit
    # first, so they are born in it (a no-op on every other host kind).
    from .. import backend
    from ..process.helpers import run_helper
    from ..errors import AgnsupError
    with suppress(AgnsupError):  # the scenario's first controller meets the same refusal, and its result says so
        backend.choose(state).enter(run_helper)
    argv = [sys.executable, "-m", "agnsup.selftest.scenario", cfg_path, out_path]
    p = procs.start((prefix or []) + argv, stdout=-1, stderr=-1, env=dict(os.environ), cwd=work)
    rc, out, err = communicate(p, RUN_TIMEOUT)
    try:
        with open(out_path) as f:
            result = json.load(f)
    except (OSError, ValueError):
        result = {"seed": seed, "status": "FAIL", "gates": {}, "invalid": [],
                  "error": f"the scenario process ended (rc {rc}) without a result: {err.strip()[-1500:]}"}
    result["seconds"] = round(time.monotonic() - t0, 3)
    leftover = cleanup_cgroups(state)
    result["leftover"] = leftover
    if leftover and result["status"] == PASS:
        # everything had been cancelled, recovered and cleaned up: nothing may remain
        result["status"] = "FAIL"
        g = result["gates"]["RESOURCE_LEAK"]
        g["status"], g["evidence"] = "FAIL", f"[end] left in the private cgroup root: {leftover}"
    result["work"] = work
    if keep and result["status"] != PASS:
        result["kept"] = work
        os.unlink(os.path.join(work, RUN_LOCK))  # kept for inspection: no later run sweeps it
    else:
        shutil.rmtree(work, ignore_errors=True)
    os.close(held)
    return result


def main(runs: int = 1, seed: int | None = None, as_json: bool = False, keep: bool = False) -> int:
    if seed is None:
        seed = random.SystemRandom().randrange(1, 2 ** 31)
    facts = host_facts()
    procs = Procs()
    prefix, blocked = pid_namespace(procs)
    facts["pid_namespace"] = "yes (the PID-reuse trap runs)" if prefix else f"ENV_BLOCKED: {blocked}"
    if not as_json:
        print(f"agnsup selftest: authority blackout, {runs} run(s), seed {seed} "
              f"(replay one run: agnsup selftest --seed <its seed>)")
        for k in ("agnsup", "kernel", "os", "python", "euid", "pidfs", "pid_namespace"):
            print(f"  {k}: {facts.get(k)}")
        print(f"  cgroups: {json.dumps(facts.get('cgroup_layout'), sort_keys=True)}", flush=True)
    results = []
    for i in range(runs):
        r = run_once(seed + i, keep, procs, prefix, blocked)
        r["index"] = i
        results.append(r)
        if not as_json:
            print(format_table(r), flush=True)
            if r.get("kept"):
                print(f"  kept for inspection: {r['kept']}", flush=True)
    passed = [r for r in results if r["status"] == PASS]
    failed = [r for r in results if r["status"] != PASS]
    summary = {"status": PASS if not failed else "FAIL", "runs": runs, "passed": len(passed), "seed": seed,
               "failed_seeds": [r["seed"] for r in failed], "host": facts,
               "seconds": [r.get("seconds") for r in results], "results": results}
    if as_json:
        print(dumps(summary))
    else:
        secs = [r.get("seconds", 0) for r in results]
        print(f"{summary['status']}: {len(passed)}/{runs} runs passed every gate; "
              f"{sum(secs):.1f} s total, {max(secs):.1f} s slowest run"
              + (f"; replay a failure: agnsup selftest --seed {failed[0]['seed']} --keep" if failed else ""))
    return 0 if not failed else 1
