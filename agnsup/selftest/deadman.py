"""`agnsup selftest --dead-man`: nothing outlives a SIGKILLed controller.

For each kind of controller a user runs (a foreground `agnsup run`, `agnsup
serve`, the Python `Supervisor` in a process of its own), one cell of the
shipped `networked` role (on_controller_death = "kill", host network so its
ports are the host's) runs a stubborn tree: double-forked `setsid` daemons
that ignore SIGTERM and hold ports, a descendant that re-executed itself with
an empty environment, and a process that renamed itself (PR_SET_NAME). The
harness finds every process of the tree from outside by the cell's PID
namespace (/proc/PID/ns/pid: stripped and renamed processes included), pins
each with a pidfd, SIGKILLs the controller, and one second later judges:

    TREE_OUTLIVES_CONTROLLER   a process of the tree is alive
    PORT_HELD_AFTER_DEATH      a port the tree held cannot be bound
    HEARTBEAT_AFTER_DEATH      a heartbeat file still grows
    JANITOR_HAD_TO_KILL        the next `agnsup janitor` found something of the tree to kill
    DEATH_NOT_RECORDED         no recovery receipt names the cell with reason controller_died

A host without PID namespaces for cells (the switch then covers the leader
only) makes every gate ENV_BLOCKED: pid_namespace, never a pass. The
blackout scenario (`agnsup selftest`) keeps proving the janitor with
on_controller_death = "keep". Private state root, cgroup root and work dir,
removed afterwards (unless --keep).
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from contextlib import suppress

from .blackout import SYSTEM_PATH, _agnsup_bin, _work_parent, cleanup_cgroups
from .gates import PASS, Verdicts
from .host import Procs, Watch, bindable, communicate, dumps, host_facts, lines, size

GATES = {
    "TREE_OUTLIVES_CONTROLLER": "a process of the cell's tree is alive 1 s after its controller was SIGKILLed",
    "PORT_HELD_AFTER_DEATH": "a port the tree held cannot be bound 1 s after the controller died",
    "HEARTBEAT_AFTER_DEATH": "a heartbeat file still grows after that second",
    "JANITOR_HAD_TO_KILL": "the next janitor found a process of the tree to kill",
    "DEATH_NOT_RECORDED": "no recovery receipt names the cell with reason controller_died",
}
WITHIN = 1.0  # seconds the tree gets to be gone after its controller's death
TREE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stubborn-tree")
RENAMED = ("setsid python3 -c 'import ctypes, time; ctypes.CDLL(None).prctl(15, b\"innocent\", 0, 0, 0); "
           "time.sleep(600)' </dev/null >/dev/null 2>&1 & ")
API = r"""
import json, sys, time
from agnsup import Supervisor
state, wt, argv = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
sup = Supervisor(state)
h = sup.spawn(argv, role="networked", run_id="R-api", cell_id="c-api", workdir=wt, on_controller_death=sys.argv[4],
              changes="live")
print(json.dumps(h), flush=True)
time.sleep(600)
"""


class DeadMan:
    def __init__(self, keep: bool, mode: str = "kill"):
        """`mode`: the cells' on_controller_death; "keep" is the control (tests: the gates must fail)."""
        self.keep, self.mode = keep, mode
        self.work = tempfile.mkdtemp(prefix="agnsup-deadman-", dir=_work_parent())
        self.state = os.path.join(self.work, "state")
        self.bin = _agnsup_bin()
        self.procs = Procs()
        self.v = Verdicts(GATES)
        self.watches: list[Watch] = []
        base = {k: v for k, v in os.environ.items() if not k.startswith("AGNSUP_") or k == "AGNSUP_CGROUP_BASE"}
        self.env = {**base, "PATH": os.environ.get("PATH", SYSTEM_PATH), "AGNSUP_STATE_DIR": self.state}

    def agnsup(self, *args, timeout: float = 60) -> tuple[int | None, str, str]:
        return communicate(self.procs.start([self.bin, *args], env=self.env, stdout=-1, stderr=-1, cwd=self.work),
                           timeout)

    def tree_argv(self, wt: str) -> list[str]:
        shutil.copy(TREE, os.path.join(wt, "stubborn-tree"))
        return ["sh", "-c", RENAMED + f"exec python3 {wt}/stubborn-tree --heartbeat {wt}/hb --detached 2 "
                "--stripped --term-wait 5"]

    def cell_args(self, kind: str, wt: str) -> list[str]:
        """run's and spawn's options for `kind`'s cell, up to the `--` before its command."""
        return ["--role", "networked", "--run-id", f"R-{kind}", "--cell", f"c-{kind}", "--workdir", wt,
                "--on-controller-death", self.mode, "--changes", "live", "--"]

    # -- one controller kind ----------------------------------------------
    def start(self, kind: str, wt: str):
        """(the controller process, the tree's report line) for `kind`."""
        argv = self.tree_argv(wt)
        if kind == "run":
            ctl = self.procs.start([self.bin, "run", *self.cell_args(kind, wt), *argv], env=self.env, stdout=-1, cwd=wt)
            return ctl, json.loads(ctl.stdout.readline() or "null")
        if kind == "serve":
            ctl = self.procs.start([self.bin, "serve"], env=self.env, stdout=-1, stderr=-1, cwd=self.work)
            if not ctl.stdout.readline():
                raise RuntimeError("agnsup serve did not start")
            rc, out, err = self.agnsup("spawn", *self.cell_args(kind, wt), *argv)
            if rc != 0:
                raise RuntimeError(f"agnsup spawn failed: {err.strip()[-300:]}")
        else:
            ctl = self.procs.start([sys.executable, "-c", API, self.state, wt, json.dumps(argv), self.mode],
                                   env=self.env, stdout=-1, stderr=-1, cwd=wt)
            if not ctl.stdout.readline():
                raise RuntimeError("the Supervisor did not start its cell")
        out = os.path.join(self.state, "cells", f"R-{kind}", f"c-{kind}", "stdout")
        deadline = time.monotonic() + 30
        while lines(out) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        with open(out) as f:
            return ctl, json.loads(f.readline() or "null")

    def tree(self, kind: str) -> tuple[list[Watch], str]:
        """Every process in the cell's PID namespace, pinned; or ([], why not)."""
        rc, out, err = self.agnsup("ps", "--json")
        row = next((r for r in (json.loads(out) if rc == 0 else []) if r["cell_id"] == f"c-{kind}"), None)
        if row is None or not row.get("pid"):
            return [], f"ps does not show c-{kind}: {err.strip()[-200:]}"
        if row.get("dies_with_controller") != "namespace":
            if self.mode == "kill":
                return [], "pid_namespace (this host gives a cell no PID namespace: only the leader dies with it)"
            return self._by_cgroup(kind, row)  # the control: the same tree, found by its cgroup
        try:
            ns = os.readlink(f"/proc/{row['pid']}/ns/pid")
        except OSError as e:
            return [], f"cannot read the leader's PID namespace: {e.strerror}"
        if ns == os.readlink("/proc/self/ns/pid"):
            return [], "pid_namespace (the cell shares the harness's PID namespace)"
        found = []
        for pid in (int(d) for d in os.listdir("/proc") if d.isdigit()):
            with suppress(OSError):
                if os.readlink(f"/proc/{pid}/ns/pid") == ns:
                    found.append(Watch(f"{kind} pid {pid}", pid, None))
        return [w for w in found if w.pinned], ""

    @staticmethod
    def _by_cgroup(kind: str, row: dict) -> tuple[list[Watch], str]:
        from ..linux import cgroup
        prim = cgroup.Node(row.get("cgroup") or {}).primary
        if prim is None:
            return [], "cgroup (no cgroup to find a keep-mode tree by)"
        return [w for w in (Watch(f"{kind} pid {p}", p, None) for p in cgroup.procs(prim[1])) if w.pinned], ""

    def one(self, kind: str) -> None:
        wt = os.path.join(self.work, "wt-" + kind)
        os.makedirs(wt)
        ctl, info = self.start(kind, wt)
        if not info:
            raise RuntimeError(f"the {kind} cell's tree did not report")
        beats = info["heartbeats"]
        deadline = time.monotonic() + 30
        while not all(lines(h) >= 2 for h in beats) and time.monotonic() < deadline:
            time.sleep(0.05)
        watches, blocked = self.tree(kind)
        if blocked:
            for g in GATES:
                self.v.blocked(g, blocked, kind)
            return
        self.watches += watches
        ctl.kill()  # the controller this harness started
        ctl.wait(10)
        t0 = time.monotonic()
        while any(w.alive() for w in watches) and time.monotonic() - t0 < WITHIN:
            time.sleep(0.01)
        alive = [w.describe() for w in watches if w.alive()]
        self.v.check("TREE_OUTLIVES_CONTROLLER", not alive,
                     f"{len(watches)} processes of the tree, none alive {time.monotonic() - t0:.2f} s after the "
                     f"controller's SIGKILL" if not alive else f"alive after {WITHIN:g} s: {alive}", kind)
        held = [p for p in info["ports"] if not bindable(p)]
        self.v.check("PORT_HELD_AFTER_DEATH", not held, f"ports {info['ports']} bindable" if not held else
                     f"still held: {held}", kind)
        before = {h: size(h) for h in beats}
        time.sleep(0.5)
        grew = [h for h in beats if size(h) != before[h]]
        self.v.check("HEARTBEAT_AFTER_DEATH", not grew, f"{len(beats)} heartbeat files still" if not grew else
                     f"still growing: {grew}", kind)
        rc, out, err = self.agnsup("janitor", "--json")
        rep = json.loads(out) if rc == 0 else {}
        killed = [k for k in rep.get("killed", []) if k.get("cell_id") == f"c-{kind}"]
        self.v.check("JANITOR_HAD_TO_KILL", rc == 0 and not killed,
                     "the janitor found nothing of the tree to kill" if rc == 0 and not killed else
                     f"janitor rc {rc}, killed {killed} {err.strip()[-200:]}", kind)
        cells = [c for ctl_ in (rep.get("receipt") or {}).get("controllers", []) for c in ctl_["cells"]
                 if c["cell_id"] == f"c-{kind}"]
        ok = bool(cells) and cells[0].get("reason") == "controller_died" and cells[0]["final_state"] == "recovered"
        self.v.check("DEATH_NOT_RECORDED", ok, f"recovery receipt {rep['receipt']['path']}: reason controller_died"
                     if ok else f"recovery receipt entry: {cells}", kind)

    def run(self) -> dict:
        t0 = time.monotonic()
        error = None
        try:
            for kind in ("run", "serve", "api"):
                self.one(kind)
        except Exception as e:  # noqa: BLE001 - reported; every gate still gets a verdict
            error = f"{type(e).__name__}: {e}"
        finally:
            for w in self.watches:  # processes of the tree, pinned by pidfd: ours to end
                w.kill()
                w.close()
            for p in self.procs.started:  # the controllers and clients it started
                if p.poll() is None:
                    p.kill()
                    p.wait()
                for f in (p.stdout, p.stderr):
                    if f is not None:
                        f.close()
            left = cleanup_cgroups(self.state)
        res = self.v.result()
        if error:
            res["status"] = "FAIL"
        res.update(error=error, seconds=round(time.monotonic() - t0, 3), left=left)
        if self.keep and res["status"] != PASS:
            res["kept"] = self.work
        else:
            shutil.rmtree(self.work, ignore_errors=True)
        return res


def main(as_json: bool = False, keep: bool = False) -> int:
    facts = host_facts()
    if not as_json:
        print("agnsup selftest --dead-man: a SIGKILLed controller takes its cells with it")
        for k in ("agnsup", "kernel", "euid", "pidfs"):
            print(f"  {k}: {facts.get(k)}")
    res = DeadMan(keep).run()
    res["host"] = facts
    if as_json:
        print(dumps(res))
    else:
        for g, v in res["gates"].items():
            print(f"  {g:<27} {v['status']}" + ("" if v["status"] == PASS else "  " + v["evidence"][:200]))
        if res.get("error"):
            print(f"  error: {res['error']}")
        print(f"{res['status']} ({res['seconds']:.1f} s)" + (f"; kept: {res['kept']}" if res.get("kept") else ""))
    return 0 if res["status"] == PASS else 1
