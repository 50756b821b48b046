"""One run of the authority-blackout scenario (../shared/spec/authority-blackout.md).

Runs as `python -m agnsup.selftest.scenario CONFIG.json RESULT.json`, normally
as PID 1 of its own PID namespace (blackout.py starts it through
`unshare --pid --fork --mount-proc`), where the PID-reuse trap can pick a PID.
It drives the installed `agnsup` console script exactly as a user would, with
the host canaries in the environment, and checks every gate from outside.

Phases: 1 execution authority (R1/A/A1 through `agnsup run`), 2 controller
death (kill -9 once the tree is up), 3 same-boot recovery (`agnsup janitor`
or the next `agnsup run`, from the seed), 4 hierarchical cancel (R2: A1, A2
of agent A, B1 of agent B; cancel agent, cancel run, cleanup twice).
"""
from __future__ import annotations

import json
import os
import random
import re
import secrets
import shutil
import sys
import time
from contextlib import suppress

from ..store.journal import TERMINAL_CELL, TERMINAL_RUN  # the states cli.md promises
from .gates import Verdicts
from .host import (LOOKALIKES, CANARY_SECRET, Procs, Watch, bindable, canary_values, communicate, environ_values,
                   flock_free, journal_rows, lines, listening, make_canaries, scan_files, size, start_with_pid,
                   tree_watches)

CHAIN = ["public_tool", "spec_builder", "governance", "policy_compiler", "broker", "backend", "process_supervisor"]
TREE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stubborn-tree")
GRACE = 0.5          # the selftest role's grace period (cancel sends SIGTERM, then kills after this)
TERM_WAIT = 5.0      # the stubborn leader outlives SIGTERM by this much: the kill is what ends it
CELL_PATH = ["/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin"]


class Invalid(Exception):
    """The scenario did not happen as written: the run proves nothing."""


def choices(seed: int) -> dict:
    """Everything random about one run, from its seed alone."""
    rng = random.Random(seed)
    return {
        "crash_after_beats": rng.randint(5, 12),      # leader heartbeats before kill -9
        "crash_jitter_ms": rng.randint(0, 99),         # where inside a heartbeat period it lands
        "detached": rng.randint(1, 3),                 # setsid double-forked descendants of A1
        "stripped": rng.random() < 0.75,               # one re-exec'd with an empty environment
        "recovery": rng.choice(["janitor", "next_run"]),
        "r2_order": rng.sample(["A1", "A2", "B1"], 3),
        "r2_detached": rng.randint(1, 2),
        "sentinel_detached": rng.randint(1, 2),
    }


class Scenario:
    def __init__(self, cfg: dict):
        self.cfg = cfg
        self.seed = cfg["seed"]
        self.c = choices(self.seed)
        self.work = cfg["work"]
        self.state = cfg["state"]
        self.bin = cfg["agnsup"]
        self.pidns = cfg.get("pidns", False)
        self.pidns_blocked = cfg.get("pidns_blocked")
        self.v = Verdicts()
        self.procs = Procs()
        self.watches: dict[str, list[Watch]] = {}
        self.outputs: list[str] = []     # everything the cells' controllers printed
        self.timings: dict[str, float] = {}
        self.facts: dict = {}
        self.py = shutil.which("python3", path=":".join(CELL_PATH)) or sys.executable
        self.decoy_value = "decoy-" + secrets.token_hex(8)

    # -- set-up -----------------------------------------------------------
    def setup(self) -> None:
        os.makedirs(self.work, exist_ok=True)
        self.canary = make_canaries(os.path.join(self.work, "canary"))
        decoy_dir = os.path.join(self.work, "decoy")
        os.makedirs(decoy_dir)
        self.decoy = os.path.join(decoy_dir, "credentials")
        with open(self.decoy, "w") as f:
            f.write(self.decoy_value + "\n")
        self.policy_dir = os.path.join(self.work, "policies")
        os.makedirs(self.policy_dir)
        with open(os.path.join(self.policy_dir, "selftest.toml"), "w") as f:
            f.write(self._role(decoy_dir))
        base = {k: v for k, v in os.environ.items() if not k.startswith("AGNSUP_") or k == "AGNSUP_CGROUP_BASE"}
        self.env = {**base, "PATH": self.canary["bin"] + ":" + os.environ.get("PATH", "/usr/bin:/bin"),
                    "AGNSUP_STATE_DIR": self.state, "AGNSUP_POLICY_DIR": self.policy_dir,
                    "AGNSUP_CANARY_SECRET": CANARY_SECRET, **LOOKALIKES}
        self.secrets = canary_values(self.decoy_value)

    @staticmethod
    def _role(decoy_dir: str) -> str:
        """The packaged networked role (ports visible from the host), with a short
        grace period, the decoy's directory denied, on_controller_death = keep and
        changes = live (the heartbeats are read from the host while the cells run)."""
        from ..policy import _packaged_dir
        with open(os.path.join(_packaged_dir(), "networked.toml")) as f:
            src = f.read()
        src = src.replace('name = "networked"', 'name = "selftest"')
        src = re.sub(r"(?m)^grace = .*$", f"grace = {GRACE}", src)
        src = re.sub(r"(?m)^deny = \[", f"deny = [{json.dumps(decoy_dir)}, ", src)
        # the blackout scenario watches heartbeats in the worktrees as they are written: live, not captured
        src = re.sub(r'(?m)^changes = .*$', 'changes = "live"', src)
        # the blackout scenario proves the janitor: the tree must outlive its controller
        return re.sub(r'(?m)^on_controller_death = .*$', 'on_controller_death = "keep"', src)

    def worktree(self, name: str) -> str:
        wt = os.path.join(self.work, "wt-" + name)
        os.makedirs(wt)
        shutil.copy(TREE, os.path.join(wt, "stubborn-tree"))
        with open(os.path.join(wt, "decoy-path"), "w") as f:
            f.write(self.decoy)
        return wt

    # -- driving agnsup ---------------------------------------------------
    def agnsup(self, *args, timeout: float = 120) -> tuple[int | None, str, str]:
        p = self.procs.start([self.bin, *args], env=self.env, stdout=-1, stderr=-1, cwd=self.work)
        return communicate(p, timeout)

    def agnsup_json(self, *args, timeout: float = 120):
        rc, out, err = self.agnsup(*args, timeout=timeout)
        try:
            data = json.loads(out) if rc == 0 else None
        except ValueError:
            data = None
        return rc, data, (err.strip() or out.strip())[-400:]

    def launch_cell(self, run: str, agent: str, cell: str, wt: str, detached: int, stripped: bool,
                    extra: list[str] = ()):
        """`agnsup run ... -- python3 <wt>/stubborn-tree ...` in the background."""
        argv = [self.bin, "run", "--role", "selftest", "--run-id", run, "--agent", agent, "--cell", cell,
                "--workdir", wt, *self.cfg.get("run_extra", []), "--", "python3", os.path.join(wt, "stubborn-tree"),
                "--heartbeat", os.path.join(wt, "hb"), "--detached", str(detached),
                "--secret-file", "@" + os.path.join(wt, "decoy-path"),  # the path itself would be refused by governance
                "--term-wait", str(TERM_WAIT), *(["--stripped"] if stripped else []), *extra]
        err_path = os.path.join(self.work, f"ctl-{run}-{cell}.err")
        with open(err_path, "wb") as err:
            p = self.procs.start(argv, env=self.env, stdout=-1, stderr=err, cwd=wt)
        p.err_path, p.cell = err_path, f"{run}/{cell}"
        return p

    def report_of(self, p) -> dict:
        """The tree's one JSON line, read from its controller's stdout (the cell's)."""
        line = self._readline(p, 60)
        self.outputs.append(line)
        try:
            info = json.loads(line)
        except ValueError:
            info = None
        if not isinstance(info, dict) or "pid" not in info:
            with open(p.err_path, errors="replace") as f:
                err_text = f.read()[-600:]
            if isinstance(info, dict) and info.get("bypass"):
                self.v.check("DIRECT_PROCESS_BYPASS", False, f"{p.cell}: a canary answered instead of "
                             f"python3: {line.strip()}", "phase1")
            raise RuntimeError(f"cell {p.cell} did not start (controller rc {p.poll()}): "
                               f"stdout {line.strip()!r}, stderr {err_text.strip()!r}")
        return info

    def start_cell(self, *args, **kw):
        p = self.launch_cell(*args, **kw)
        return p, self.report_of(p)

    def _readline(self, p, timeout: float) -> str:
        import select
        fd = p.stdout.fileno()
        buf = b""
        deadline = time.monotonic() + timeout
        while not buf.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            r, _, _ = select.select([fd], [], [], min(left, 0.1))
            self.procs.reap_orphans()
            if r:
                chunk = os.read(fd, 4096)
                if not chunk:
                    break
                buf += chunk
        return buf.decode(errors="replace")

    def ps_row(self, run: str, cell: str) -> dict | None:
        rc, rows, err = self.agnsup_json("ps", "--all", "--json", "--run", run)
        if rc != 0:
            raise RuntimeError(f"agnsup ps failed: {err}")
        rows = [r for r in rows if r["cell_id"] == cell]
        return rows[0] if len(rows) == 1 else None

    def wait_beats(self, paths: list[str], n: int, timeout: float = 30) -> bool:
        return bool(self.procs.wait_for(lambda: all(lines(p) >= n for p in paths), timeout))

    def growing(self, paths: list[str], timeout: float = 10) -> list[str]:
        """Paths that did NOT grow within timeout (empty list: all grew)."""
        before = {p: size(p) for p in paths}
        self.procs.wait_for(lambda: all(size(p) > before[p] for p in paths), timeout)
        return [p for p in paths if size(p) <= before[p]]

    def still(self, paths: list[str], window: float = 1.0) -> list[str]:
        """Paths that DID grow during `window` seconds (empty list: all still)."""
        before = {p: size(p) for p in paths}
        self.procs.sleep(window)
        return [f"{os.path.basename(p)} +{size(p) - before[p]} bytes" for p in paths if size(p) > before[p]]

    # -- the run ----------------------------------------------------------
    def run(self) -> dict:
        t0 = time.monotonic()
        error = None
        try:
            self.setup()
            self.start_sentinel()
            phases = self.cfg.get("phases", "1234")
            for name, fn in (("phase1", self.phase1), ("phase2", self.phase2), ("phase3", self.phase3),
                             ("phase4", self.phase4), ("final", self.final)):
                if name[-1].isdigit() and name[-1] not in phases:
                    continue
                t = time.monotonic()
                fn()
                self.timings[name] = round(time.monotonic() - t, 3)
        except Invalid as e:
            self.v.mark_invalid(str(e))
        except Exception as e:  # noqa: BLE001 - reported as the run's error, every gate still gets a verdict
            import traceback
            error = f"{type(e).__name__}: {e}"
            self.facts["traceback"] = traceback.format_exc()[-3000:]
        finally:
            self.teardown()
        res = self.v.result()
        if error:
            res["status"] = "FAIL" if res["status"] != "INVALID" else "INVALID"
        return {"seed": self.seed, "choices": self.c, **res, "error": error, "timings": self.timings,
                "seconds": round(time.monotonic() - t0, 3), "pid_namespace": self.pidns, "facts": self.facts}

    # -- the sentinel -----------------------------------------------------
    def start_sentinel(self) -> None:
        """The same program, same options, on the host outside agnsup: its own
        session, not in any agnsup cgroup, carrying a forged token and A1's ids."""
        d = os.path.join(self.work, "sentinel")
        os.makedirs(d)
        shutil.copy(TREE, os.path.join(d, "stubborn-tree"))
        self.sentinel_log = os.path.join(d, "signals")
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("AGNSUP_")},
               "AGNSUP_CELL_TOKEN": "forged-" + secrets.token_hex(16), "AGNSUP_RUN_ID": "R1",
               "AGNSUP_AGENT_ID": "A", "AGNSUP_CELL_ID": "A1"}
        self.sentinel = self.procs.start(
            [self.py, os.path.join(d, "stubborn-tree"), "--heartbeat", os.path.join(d, "hb"),
             "--detached", str(self.c["sentinel_detached"]), "--stripped", "--term-wait", str(TERM_WAIT),
             "--signal-log", self.sentinel_log], env=env, stdout=-1, start_new_session=True, cwd=d)
        self.sinfo = json.loads(self._readline(self.sentinel, 30) or "null")
        if not self.sinfo:
            raise RuntimeError("the sentinel did not start")
        self.watches["sentinel"] = tree_watches("sentinel", self.sinfo)
        if not self.wait_beats(self.sinfo["heartbeats"], 2):
            raise RuntimeError("the sentinel does not heartbeat")

    def check_sentinel(self, phase: str) -> None:
        dead = [w.describe() for w in self.watches["sentinel"] if not w.alive()]
        with_log = os.path.exists(self.sentinel_log) and open(self.sentinel_log).read().strip()
        stalled = self.growing(self.sinfo["heartbeats"])
        ok = not dead and not with_log and not stalled
        self.v.check("SENTINEL_KILLED", ok, "sentinel tree alive, unsignalled, heartbeating "
                     f"({len(self.watches['sentinel'])} processes)" if ok else
                     f"dead: {dead}; signals received: {with_log!r}; heartbeats stalled: {stalled}", phase)

    # -- phase 1: execution authority -------------------------------------
    def phase1(self) -> None:
        wt = self.wt1 = self.worktree("r1-a1")
        self.ctl1, info = self.start_cell("R1", "A", "A1", wt, self.c["detached"], self.c["stripped"],
                                          ["--leader-exit-file", os.path.join(wt, "leader-exit")])
        self.info1 = info
        self.watches["A1"] = tree_watches("A1", info)
        unpinned = [w.describe() for w in self.watches["A1"] if not w.pinned]
        if unpinned:
            raise RuntimeError(f"could not pin A1's processes by pidfd: {unpinned}")
        if not self.wait_beats(info["heartbeats"], 5):
            raise Invalid(f"A1's tree never reached 5 heartbeats on every file: "
                          f"{ {os.path.basename(p): lines(p) for p in info['heartbeats']} }")
        closed = [p for p in info["ports"] if not listening(p)]
        if closed:
            raise Invalid(f"A1's tree does not listen on its ports {closed}")
        row = self.row1 = self.ps_row("R1", "A1")
        tok = journal_rows(self.state, "SELECT token, lock_path FROM cells WHERE run_id='R1' AND cell_id='A1'")
        self.token1 = tok[0]["token"] if tok else None
        self.lock1 = tok[0]["lock_path"] if tok else None

        # DIRECT_PROCESS_BYPASS: the leader is the supervisor's child in its own session, and the
        # whole tree sits in the cell's cgroup; no canary ran
        pid = info["pid"]
        problems = []
        if info["sid"] != pid or info["pgid"] != pid:
            problems.append(f"leader pid {pid} is not its own session/group leader (sid {info['sid']}, "
                            f"pgid {info['pgid']})")
        from ..linux import proc
        st = proc.stat(pid)
        if st is None or st.ppid != self.ctl1.pid:
            problems.append(f"leader's parent is {st.ppid if st else None}, not the controller {self.ctl1.pid}")
        if row is None:
            problems.append("agnsup ps does not list R1/A1")
        elif row.get("pid") != pid:
            problems.append(f"journaled leader pid {row.get('pid')} is not the tree's pid {pid}")
        cg = (row or {}).get("cgroup") or {}
        if not cg:
            self.v.blocked("DIRECT_PROCESS_BYPASS", "writable cgroup hierarchy (cell membership unprovable)",
                           "phase1")
        else:
            hier, path = ("v2", cg["v2"]) if "v2" in cg else next(iter(cg.items()))
            try:
                with open(os.path.join(path, "cgroup.procs")) as f:
                    members = {int(x) for x in f.read().split()}
            except OSError as e:
                members = set()
                problems.append(f"cannot read {path}/cgroup.procs: {e.strerror}")
            outside = [w.describe() for w in self.watches["A1"] if w.pid not in members]
            if outside:
                problems.append(f"not in the cell's cgroup {path}: {outside}")
        if os.path.exists(self.canary["marker"]):
            problems.append(f"canary marker: {open(self.canary['marker']).read().strip()!r}")
        self.v.check("DIRECT_PROCESS_BYPASS", not problems, "; ".join(problems) or
                     f"leader {pid} forked by controller {self.ctl1.pid} in its own session; all "
                     f"{len(self.watches['A1'])} processes in the cell's cgroup; no canary ran", "phase1")

        self.check_secrets("phase1", info, self.watches["A1"])
        self.check_chain_journal("R1", "A1", "phase1")

        # OWNERSHIP_RECORD_MISSING: every field, and each agrees with what the kernel says
        from ..linux.proc import boot_id
        got = row or {}
        want = {"run_id": "R1", "agent_id": "A", "cell_id": "A1", "pid": pid, "starttime": info["starttime"],
                "pgid": info["pgid"], "boot_id": boot_id()}
        missing = [f"{k}={got.get(k)!r} (expected {val!r})" for k, val in want.items() if got.get(k) != val]
        missing += [f"{k} missing" for k in ("controller", "cgroup") if not got.get(k)]
        if not self.token1 or len(self.token1) < 16:
            missing.append("ownership token missing from the journal")
        ctl = journal_rows(self.state, "SELECT pid, boot_id FROM controllers WHERE id=?", (got.get("controller"),))
        if not ctl or ctl[0]["pid"] != self.ctl1.pid:
            missing.append(f"controller instance row {ctl} does not name the controller pid {self.ctl1.pid}")
        self.v.check("OWNERSHIP_RECORD_MISSING", not missing, "; ".join(missing) or
                     "run, agent, cell, controller instance, boot id, leader pid+start time, pgid, cgroup, "
                     "token all journaled and matching /proc", "phase1")

    def check_secrets(self, phase: str, info: dict, watches: list[Watch]) -> None:
        leaks = []
        if info.get("secret_env") is not None:
            leaks.append(f"AGNSUP_CANARY_SECRET reached the cell: {info['secret_env']!r}")
        sf = info.get("secret_file")
        if not isinstance(sf, dict):
            leaks.append(f"the cell read the decoy file {self.decoy}: {str(sf)[:60]!r}")
        for w in watches:
            env = environ_values(w.pid) if w.alive() else None
            if env is None:
                leaks.append(f"{w.describe()}: environ unreadable") if w.alive() else None
                continue
            leaks += [f"{w.describe()} environ holds {s[:12]}..." for s in self.secrets if s in env]
        if info.get("stripped"):
            # Python itself puts LC_CTYPE back (PEP 538); anything else came from somewhere
            bad = [k for k in info["stripped"].get("env_keys", []) if k.startswith("AGNSUP_") or k in LOOKALIKES]
            if bad:
                leaks.append(f"the descendant re-executed with an empty environment has {bad}")
        self.v.check("HOST_SECRET_LEAK", not leaks, "; ".join(leaks) or
                     f"no canary in the environ of {len(watches)} cell processes; the decoy read failed "
                     f"({sf.get('error') if isinstance(sf, dict) else sf})", phase)

    def check_chain_journal(self, run: str, cell: str, phase: str) -> None:
        ev = journal_rows(self.state, "SELECT kind, t FROM events WHERE run_id=? AND cell_id=? AND kind LIKE "
                          "'stage.%' ORDER BY id", (run, cell))
        stages = [e["kind"][6:] for e in ev]
        ts = [e["t"] for e in ev]
        ok = stages == CHAIN and ts == sorted(ts)
        self.v.check("CALL_CHAIN_INCOMPLETE", ok, f"journal of {run}/{cell}: {' -> '.join(stages)}"
                     + ("" if ts == sorted(ts) else " (timestamps out of order)"), phase)

    def check_chain_receipt(self, rec: dict, phase: str) -> None:
        stages = [s.get("stage") for s in rec.get("chain", [])]
        ts = [s.get("t") for s in rec.get("chain", [])]
        ok = stages == CHAIN and ts == sorted(ts) and rec["chain"][0].get("entry") == "cli"
        self.v.check("CALL_CHAIN_INCOMPLETE", ok, f"receipt of {rec.get('run_id')}/{rec.get('cell_id')}: "
                     f"{' -> '.join(map(str, stages))} (entry {rec.get('chain', [{}])[0].get('entry')})", phase)

    # -- phase 2: controller death ----------------------------------------
    def phase2(self) -> None:
        hb = self.info1["heartbeats"][0]
        self.procs.wait_for(lambda: lines(hb) >= self.c["crash_after_beats"], 30)
        self.procs.sleep(self.c["crash_jitter_ms"] / 1000)
        self.ctl1.kill()  # kill -9: no shutdown hook, no finally block runs
        rc = self.ctl1.wait(30)
        self.outputs.append(_drain(self.ctl1))
        if rc != -9:
            raise Invalid(f"the controller was not killed by SIGKILL (returncode {rc})")
        stalled = self.growing(self.info1["heartbeats"])
        dead = [w.describe() for w in self.watches["A1"] if not w.alive()]
        if stalled or dead:
            raise Invalid(f"A1's tree did not survive its controller (dead {dead}, stalled {stalled}): "
                          "nothing to recover, the run proves nothing")
        self.facts["crash"] = {"leader_beats": lines(hb), "tree_processes": len(self.watches["A1"])}
        row = self.ps_row("R1", "A1")
        if row is None or row["state"] in TERMINAL_CELL:
            raise Invalid(f"after the crash the journal already shows A1 as {row and row['state']}")

    # -- phase 3: same-boot recovery --------------------------------------
    def pid_trap(self) -> None:
        """Let the recorded leader die, then start an innocent process on its PID."""
        self.innocent = None
        if not self.pidns:
            self.v.blocked("PID_REUSE_KILL", f"PID namespace with ns_last_pid ({self.pidns_blocked})", "phase3")
            return
        leader = self.watches["A1"][0]
        open(os.path.join(self.wt1, "leader-exit"), "w").close()
        if not self.procs.wait_for(lambda: not leader.alive(), 20):
            raise Invalid("the recorded leader did not exit for the PID-reuse trap")
        from ..linux import proc
        if not self.procs.wait_for(lambda: proc.stat(leader.pid) is None, 20):
            raise Invalid(f"the leader's pid {leader.pid} was never released (zombie not reaped)")
        d = os.path.join(self.work, "innocent")
        os.makedirs(d)
        self.innocent_log = os.path.join(d, "signals")
        env = {k: v for k, v in os.environ.items() if not k.startswith("AGNSUP_")}
        p, note = start_with_pid(self.procs, leader.pid,
                                 [self.py, TREE, "--heartbeat", os.path.join(d, "hb"), "--detached", "0",
                                  "--signal-log", self.innocent_log], env=env, stdout=-1, start_new_session=True,
                                 cwd=d)
        if p is None:
            self.v.blocked("PID_REUSE_KILL", f"choosing a PID ({note})", "phase3")
            return
        self.innocent = p
        info = json.loads(self._readline(p, 30) or "null")
        if p.pid != leader.pid:
            holders = {q: (proc.stat(q).comm, proc.stat(q).state) for q in proc.pids() if q < p.pid and proc.stat(q)}
            raise Invalid(f"PID-reuse trap missed: the innocent got pid {p.pid}, the recorded leader had "
                          f"{leader.pid} ({note}); processes below {p.pid}: {holders}")
        if not info or info.get("pid") != leader.pid:
            raise Invalid(f"the innocent process on pid {leader.pid} did not start: {info}")
        self.innocent_watch = Watch("innocent", p.pid, info["starttime"])
        self.facts["pid_trap"] = {"pid": p.pid, "leader_starttime": leader.starttime,
                                  "innocent_starttime": info["starttime"], "note": note}

    def phase3(self) -> None:
        self.pid_trap()
        before = [w for w in self.watches["A1"] if w.alive()]
        t = time.monotonic()
        if self.cfg.get("sabotage") == "skip_recovery":
            # tests only: prove the recovery gates fire when nothing recovers
            ok, how = True, "sabotage: no recovery ran"
        elif self.c["recovery"] == "janitor":
            rc, rep, err = self.agnsup_json("janitor", "--json")
            ok = rc == 0 and rep is not None and "A1" in rep.get("recovered", [])
            how = f"`agnsup janitor` rc {rc}, recovered {rep and rep.get('recovered')}"
        else:
            wt = self.worktree("probe")
            rc, out, err = self.agnsup("run", "--role", "selftest", "--run-id", "R0", "--agent", "probe",
                                       "--cell", "next", "--workdir", wt, "--", "true")
            self.outputs += [out, err]
            ok = rc == 0 and "janitor recovered" in err
            how = f"next `agnsup run` rc {rc}, stderr {err.strip()[-200:]!r}"
        self.timings["recovery"] = round(time.monotonic() - t, 3)
        self.facts["recovery"] = how
        hbs = self.info1["heartbeats"]

        grew = self.still(hbs, 1.0)
        self.v.check("HEARTBEAT_CONTINUES", not grew, f"after recovery: grew {grew}" if grew else
                     f"{len(hbs)} heartbeat files still for 1 s after recovery reported done", "phase3")
        alive = [w.describe() for w in self.watches["A1"] if w.alive()]
        tok = list(_procs_with_token(self.token1)) if self.token1 else []
        self.v.check("ORPHAN_PROCESS_AFTER_CRASH", ok and not alive and not tok,
                     f"{how}; alive: {alive}; processes with A1's token: {tok}" if (alive or tok or not ok) else
                     f"{how}; all {len(self.watches['A1'])} processes of A1's tree dead (by pidfd), "
                     "none carries its token", "phase3")
        held = [p for p in self.info1["ports"] if not bindable(p)]
        self.v.check("PORT_NOT_RELEASED", not held, f"ports still held after recovery: {held}" if held else
                     f"ports {self.info1['ports']} bindable after recovery", "phase3")
        if self.cfg.get("sabotage") == "signal_sentinel":
            # tests only: prove SENTINEL_KILLED fires when the sentinel is signalled
            import signal
            signal.pidfd_send_signal(self.watches["sentinel"][0].fd, signal.SIGUSR1)
            self.procs.wait_for(lambda: os.path.exists(self.sentinel_log), 10)
        self.check_sentinel("phase3")
        self.check_innocent()

        # the journal and the receipts
        row = self.ps_row("R1", "A1")
        conv = row is not None and row["state"] in TERMINAL_CELL and row["run_state"] in TERMINAL_RUN
        self.v.check("STATE_NOT_CONVERGED", conv, f"A1 {row and row['state']}, R1 {row and row['run_state']}",
                     "phase3")
        rc, recs, err = self.agnsup_json("receipts", "--recovery", "--run", "R1", "--cell", "A1", "--json")
        recs = recs or []
        self.check_recovery_receipt(recs, before, rc, err)
        self.check_resources_r1(row)

    def check_innocent(self, phase: str = "phase3") -> None:
        if getattr(self, "innocent", None) is None:
            return
        w = self.innocent_watch
        sig = os.path.exists(self.innocent_log) and open(self.innocent_log).read().strip()
        ok = w.alive() and not sig
        self.v.check("PID_REUSE_KILL", ok, f"innocent on the recorded leader pid {w.pid} alive and unsignalled" if ok
                     else f"innocent pid {w.pid}: alive={w.alive()}, signals received {sig!r}", phase)

    def check_recovery_receipt(self, recs: list, before: list[Watch], rc, err) -> None:
        problems = []
        if rc != 0 or len(recs) != 1:
            self.v.check("RECOVERY_RECEIPT_MISSING", False, f"`agnsup receipts --recovery` rc {rc}, "
                         f"{len(recs)} receipts for R1/A1: {err}", "phase3")
            self.v.check("SAME_BOOT_IGNORED", False, "no recovery receipt for A1", "phase3")
            self.v.check("RECEIPT_MISMATCH", False, "no recovery receipt for A1", "phase3")
            return
        r = recs[0]
        cell = r.get("cell") or {}
        if r.get("controller") != self.row1.get("controller"):
            problems.append(f"names controller {r.get('controller')}, the dead one was {self.row1.get('controller')}")
        if cell.get("cell_id") != "A1" or cell.get("final_state") not in TERMINAL_CELL:
            problems.append(f"cell entry {cell.get('cell_id')} final_state {cell.get('final_state')}")
        killed, spared = cell.get("killed") or [], cell.get("spared") or []
        if not killed:
            problems.append("lists no killed process")
        problems += [f"kill of pid {k.get('pid')} has no evidence" for k in killed if not k.get("evidence")]
        problems += [f"spare of pid {s.get('pid')} has no reason" for s in spared if not s.get("reason")]
        if getattr(self, "innocent", None) is not None:
            mine = [s for s in spared if s.get("pid") == self.innocent.pid]
            if not mine:
                problems.append(f"does not say why the innocent pid {self.innocent.pid} was spared")
            self.facts["innocent_spared_because"] = mine[0]["reason"] if mine else None
        path = r.get("path")
        full = None
        try:
            with open(path) as f:
                full = json.load(f)
        except (OSError, TypeError, ValueError) as e:
            problems.append(f"recovery receipt file {path}: {e}")
        self.v.check("RECOVERY_RECEIPT_MISSING", not problems, "; ".join(problems) or
                     f"receipt {os.path.basename(path)} names controller {r.get('controller')}, cell A1 "
                     f"({cell.get('final_state')}), {len(killed)} kills with evidence, {len(spared)} spares "
                     "with reasons", "phase3")

        same = [c for c in (full or {}).get("controllers", []) if c.get("id") == r.get("controller")]
        notes = " ".join(cell.get("notes") or [])
        ok = bool(killed) and "no signal sent" not in notes and same and same[0].get("same_boot") is True
        self.v.check("SAME_BOOT_IGNORED", ok, f"same boot {same and same[0].get('same_boot')}, {len(killed)} "
                     f"processes killed{'; notes: ' + notes if not ok else ''}", "phase3")

        mism = []
        want = {w.pid for w in before}
        got = {k.get("pid") for k in killed}
        if got != want:
            mism.append(f"killed pids {sorted(got)} != the tree's live pids {sorted(want)}")
        unverified = [k.get("pid") for k in killed if not k.get("verified_dead")]
        if unverified:
            mism.append(f"kills not verified dead: {unverified}")
        lead = cell.get("leader") or {}
        if lead.get("pid") != self.info1["pid"] or lead.get("starttime") != self.info1["starttime"]:
            mism.append(f"leader {lead} is not the tree's leader {self.info1['pid']}/{self.info1['starttime']}")
        self.v.check("RECEIPT_MISMATCH", not mism, "; ".join(mism) or
                     f"recovery receipt: killed exactly the {len(want)} live tree pids, leader identity matches",
                     "phase3")

    def check_resources_r1(self, row) -> None:
        left = [f"cgroup {path}" for path in ((row or {}).get("cgroup") or {}).values() if os.path.exists(path)]
        tmp = os.path.join(self.state, "cells", "R1", "A1", "tmp")
        if os.path.exists(tmp):
            left.append(f"temp dir {tmp}")
        if self.lock1 and not flock_free(self.lock1):
            left.append(f"worktree lock {self.lock1} held")
        if self.lock1 and os.path.exists(self.lock1):
            left.append(f"worktree lock file {self.lock1}")
        ctl = journal_rows(self.state, "SELECT lock_path, ended_at FROM controllers WHERE id=?",
                           ((row or {}).get("controller"),))
        if ctl and os.path.exists(ctl[0]["lock_path"]):
            left.append(f"dead controller's lock {ctl[0]['lock_path']}")
        if ctl and not ctl[0]["ended_at"]:
            left.append("dead controller instance not marked ended")
        self.v.check("RESOURCE_LEAK", not left, f"after recovery: {left}" if left else
                     "after recovery: A1's cgroups, temp dir, worktree lock and the dead controller's lock are gone"
                     " (role network=host: no network namespace to leak)", "phase3")

    # -- phase 4: hierarchical cancel -------------------------------------
    def phase4(self) -> None:
        agents = {"A1": "A", "A2": "A", "B1": "B"}
        self.r2: dict[str, dict] = {}
        for cell in self.c["r2_order"]:  # launched in the seed's order, without waiting for each other
            wt = self.worktree("r2-" + cell.lower())
            p = self.launch_cell("R2", agents[cell], cell, wt, self.c["r2_detached"], False)
            self.r2[cell] = {"ctl": p, "wt": wt}
        for cell in self.c["r2_order"]:
            info = self.r2[cell]["info"] = self.report_of(self.r2[cell]["ctl"])
            self.watches["R2/" + cell] = tree_watches("R2/" + cell, info)
        for cell, c in self.r2.items():
            if not self.wait_beats(c["info"]["heartbeats"], 3):
                raise Invalid(f"R2/{cell}'s tree never heartbeated")
            self.check_secrets("phase4", c["info"], self.watches["R2/" + cell])
        locks = {r["cell_id"]: r for r in journal_rows(
            self.state, "SELECT cell_id, lock_path, token, cgroup FROM cells WHERE run_id='R2'")}

        # LOCK_SCOPE_WRONG: A1 and A2 (one agent, two worktrees) run at once; a writer of A1's of another agent does not
        both = all(w.alive() for k in ("A1", "A2") for w in self.watches["R2/" + k])
        stalled = self.growing(self.r2["A1"]["info"]["heartbeats"][:1] + self.r2["A2"]["info"]["heartbeats"][:1])
        ran = os.path.join(self.r2["A1"]["wt"], "A3-ran")
        rc, out, err = self.agnsup("run", "--role", "selftest", "--run-id", "R2", "--agent", "B", "--cell", "A3",
                                   "--workdir", self.r2["A1"]["wt"], "--lock-timeout", "0.3", "--", "touch", ran)
        ok = both and not stalled and rc == 75 and not os.path.exists(ran)
        self.v.check("LOCK_SCOPE_WRONG", ok, f"A1 and A2 on two worktrees both running: {both and not stalled}; "
                     f"agent B writing A1's worktree: rc {rc} (75 = lock timeout), ran: {os.path.exists(ran)}"
                     + ("" if ok else f"; {err.strip()[-200:]}"), "phase4")

        # cancel agent A
        rc, rep, err = self.agnsup_json("cancel", "--run", "R2", "--agent", "A", "--grace", str(GRACE), "--json")
        a_ctls = [self.r2[k]["ctl"] for k in ("A1", "A2")]
        exited = rc == 0 and self.procs.wait_for(lambda: all(p.poll() is not None for p in a_ctls), GRACE + 30)
        a_watch = self.watches["R2/A1"] + self.watches["R2/A2"]
        alive = [w.describe() for w in a_watch if w.alive()]
        ports = [p for k in ("A1", "A2") for p in self.r2[k]["info"]["ports"] if not bindable(p)]
        held = [k for k in ("A1", "A2") if k in locks and not flock_free(locks[k]["lock_path"])]
        n = rep.get("cancelled") if isinstance(rep, dict) else None
        ok = rc == 0 and n == 2 and exited and not alive and not ports and not held
        self.v.check("CANCEL_AGENT_INCOMPLETE", ok, f"`cancel --run R2 --agent A` rc {rc}, cancelled {n}; "
                     f"controllers exited: {bool(exited)}; alive: {alive}; ports held: {ports}; locks held: {held}"
                     + ("" if rc == 0 else f"; {err}"), "phase4")
        self.v.check("PORT_NOT_RELEASED", not ports, f"after cancel agent A, held: {ports}" if ports else
                     "A1/A2 ports bindable after cancel agent A", "phase4")
        grew = self.still([h for k in ("A1", "A2") for h in self.r2[k]["info"]["heartbeats"]], 1.0)
        self.v.check("HEARTBEAT_CONTINUES", not grew, f"after cancel agent A: grew {grew}" if grew else
                     "A1/A2 heartbeats still for 1 s after cancel", "phase4")
        for k in ("A1", "A2"):
            self.check_cell_receipt("R2", k, self.r2[k], "phase4")

        # B1 untouched, R2 still open
        b_dead = [w.describe() for w in self.watches["R2/B1"] if not w.alive()]
        b_stalled = self.growing(self.r2["B1"]["info"]["heartbeats"])
        wt = self.worktree("r2-c1")
        rc_c, out, err_c = self.agnsup("run", "--role", "selftest", "--run-id", "R2", "--agent", "C", "--cell",
                                       "C1", "--workdir", wt, "--", "true")
        self.outputs += [out, err_c]
        ok = not b_dead and not b_stalled and rc_c == 0
        self.v.check("CANCEL_CROSS_TALK", ok, f"B1 dead: {b_dead}, stalled: {b_stalled}; a new cell in R2: "
                     f"rc {rc_c}" + ("" if rc_c == 0 else f" {err_c.strip()[-200:]}"), "phase4")

        # idempotence: agent again, a cell again
        rc2, rep2, err2 = self.agnsup_json("cancel", "--run", "R2", "--agent", "A", "--grace", str(GRACE), "--json")
        rc3, rep3, err3 = self.agnsup_json("cancel", "--run", "R2", "--cell", "A1", "--json")
        b_dead = [w.describe() for w in self.watches["R2/B1"] if not w.alive()]
        n2 = rep2.get("cancelled") if isinstance(rep2, dict) else None
        n3 = rep3.get("cancelled") if isinstance(rep3, dict) else None
        ok = rc2 == 0 and n2 == 0 and rc3 == 0 and n3 == 0 and not b_dead
        self.v.check("CANCEL_NOT_IDEMPOTENT", ok, f"second cancel agent A: rc {rc2}, cancelled {n2}; cancel of the "
                     f"ended cell A1: rc {rc3}, cancelled {n3}; B1 dead after: {b_dead}"
                     + ("" if ok else f"; {err2} {err3}"), "phase4")

        # cancel run R2
        rc, rep, err = self.agnsup_json("cancel", "--run", "R2", "--grace", str(GRACE), "--json")
        b_ctl = self.r2["B1"]["ctl"]
        exited = rc == 0 and self.procs.wait_for(lambda: b_ctl.poll() is not None, GRACE + 30)
        all_r2 = [w for k in self.r2 for w in self.watches["R2/" + k]]
        alive = [w.describe() for w in all_r2 if w.alive()]
        tokens = [p for r in locks.values() for p in _procs_with_token(r["token"])]
        n = rep.get("cancelled") if isinstance(rep, dict) else None
        ok = rc == 0 and n == 1 and exited and not alive and not tokens
        self.v.check("CANCEL_RUN_INCOMPLETE", ok, f"`cancel --run R2` rc {rc}, cancelled {n}; B1's controller "
                     f"exited: {bool(exited)}; alive: {alive}; processes with R2 tokens: {tokens}"
                     + ("" if rc == 0 else f"; {err}"), "phase4")
        self.check_cell_receipt("R2", "B1", self.r2["B1"], "phase4")
        rc2, rep2, err2 = self.agnsup_json("cancel", "--run", "R2", "--grace", str(GRACE), "--json")
        n2 = rep2.get("cancelled") if isinstance(rep2, dict) else None
        self.v.check("CANCEL_NOT_IDEMPOTENT", rc2 == 0 and n2 == 0, f"second cancel run R2: rc {rc2}, "
                     f"cancelled {n2}" + ("" if rc2 == 0 else f"; {err2}"), "phase4")
        held = [p for p in self.r2["B1"]["info"]["ports"] if not bindable(p)]
        self.v.check("PORT_NOT_RELEASED", not held, f"after cancel run R2, held: {held}" if held else
                     "B1 ports bindable after cancel run R2", "phase4")

        # cleanup twice
        rc1, rep1, err1 = self.agnsup_json("cleanup", "--run", "R2", "--json")
        rc2, rep2, err2 = self.agnsup_json("cleanup", "--run", "R2", "--json")
        n1 = rep1.get("cleaned") if isinstance(rep1, dict) else None
        n2 = rep2.get("cleaned") if isinstance(rep2, dict) else None
        items2 = rep2.get("items") if isinstance(rep2, dict) else None
        ok = rc1 == 0 and rc2 == 0 and n2 == 0 and items2 == []
        self.v.check("CLEANUP_NOT_IDEMPOTENT", ok, f"first cleanup rc {rc1}, cleaned {n1}; second rc {rc2}, "
                     f"cleaned {n2}, items {items2}" + ("" if ok else f"; {err1} {err2}"), "phase4")
        self.check_resources_r2(locks)

    def check_cell_receipt(self, run: str, cell: str, c: dict, phase: str) -> None:
        rc, recs, err = self.agnsup_json("receipts", "--run", run, "--cell", cell, "--json")
        ctl_rc = c["ctl"].poll()
        self.outputs.append(_drain(c["ctl"]))
        recs = recs or []
        if rc != 0 or len(recs) != 1:
            self.v.check("RECEIPT_MISMATCH", False, f"{run}/{cell}: rc {rc}, {len(recs)} receipts: {err}", phase)
            self.v.check("CALL_CHAIN_INCOMPLETE", False, f"{run}/{cell}: no receipt", phase)
            return
        r = recs[0]
        self.check_chain_receipt(r, phase)
        mism = []
        if r.get("exit_code") != ctl_rc:
            mism.append(f"exit_code {r.get('exit_code')} but `agnsup run` exited {ctl_rc}")
        if r.get("state") != "cancelled" or r.get("reason") != "cancelled":
            mism.append(f"state/reason {r.get('state')}/{r.get('reason')}, expected cancelled")
        if ctl_rc is not None and ctl_rc > 128 and r.get("signal") != ctl_rc - 128:
            mism.append(f"signal {r.get('signal')} but exit {ctl_rc}")
        pids = r.get("pids") or {}
        if pids.get("leader") != c["info"]["pid"] or pids.get("starttime") != c["info"]["starttime"]:
            mism.append(f"leader {pids.get('leader')}/{pids.get('starttime')} is not the tree's "
                        f"{c['info']['pid']}/{c['info']['starttime']}")
        self.v.check("RECEIPT_MISMATCH", not mism, f"{run}/{cell}: " + ("; ".join(mism) or
                     f"cancelled, exit {ctl_rc} (signal {r.get('signal')}), leader {pids.get('leader')} as observed"),
                     phase)

    def check_resources_r2(self, cells: dict) -> None:
        from ..linux import cgroup
        base = cgroup.base_node(cgroup.detect_layout(), self.state)
        run_dirs = cgroup.scope_node(base, "R2").paths.values()
        tmps = [os.path.join(self.state, "cells", "R2", cell, "tmp") for cell in [*cells, "A3", "C1"]]
        left = [f"cgroup {p}" for p in run_dirs if os.path.exists(p)]
        left += [f"temp dir {tmp}" for tmp in tmps if os.path.exists(tmp)]
        left += [f"worktree lock of {k} held" for k, r in cells.items()
                 if r["lock_path"] and not flock_free(r["lock_path"])]
        self.v.check("RESOURCE_LEAK", not left, f"after cleanup of R2: {left}" if left else
                     "after cleanup of R2: no cgroup under run-R2, no temp dir, no lock held", "phase4")

    # -- the end --------------------------------------------------------------
    def final(self) -> None:
        self.check_sentinel("final")
        if getattr(self, "innocent", None) is not None:
            self.check_innocent("final")
        marker = os.path.exists(self.canary["marker"])
        self.v.check("DIRECT_PROCESS_BYPASS", not marker,
                     f"canary marker: {open(self.canary['marker']).read().strip()!r}" if marker else
                     f"none of the {len(self.canary['names'])} canary-bin executables ran during the whole run",
                     "final")
        hits = [h for h in scan_files(self.work, self.secrets)
                if not h.startswith((self.decoy, self.policy_dir, self.canary["bin"]))]
        out_hits = [s[:12] for s in self.secrets for o in self.outputs if s in o]
        self.v.check("HOST_SECRET_LEAK", not hits and not out_hits,
                     f"in files: {hits}; in cell output: {out_hits}" if hits or out_hits else
                     "no canary value in any file the cells wrote or in their output", "final")

    def teardown(self) -> None:
        """Stop what the harness itself started (sentinel, innocent, controllers it
        still waits for); cell trees left behind are the driver's to kill by cgroup."""
        for w in self.watches.get("sentinel", []):
            w.kill()
        if getattr(self, "innocent_watch", None) is not None:
            self.innocent_watch.kill()
        for p in self.procs.started:
            if p.poll() is None:
                p.kill()
            with suppress(Exception):  # noqa: BLE001
                p.wait(10)
            for s in (p.stdout, p.stderr):
                if s:
                    s.close()
        for ws in self.watches.values():
            for w in ws:
                w.close()
        self.procs.reap_orphans()


def _drain(p) -> str:
    """What a controller's stdout pipe holds now, without waiting for EOF (the
    cell's descendants may hold the pipe open); then close it."""
    import select
    fd, buf = p.stdout.fileno(), b""
    while select.select([fd], [], [], 0)[0]:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        buf += chunk
    p.stdout.close()
    return buf.decode(errors="replace")


def _procs_with_token(token: str) -> list[int]:
    from .host import procs_with_env
    return procs_with_env("AGNSUP_CELL_TOKEN", token)


def main(argv: list[str]) -> int:
    cfg_path, out_path = argv
    with open(cfg_path) as f:
        cfg = json.load(f)
    result = Scenario(cfg).run()
    tmp = out_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=2, default=str)
    os.replace(tmp, out_path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
