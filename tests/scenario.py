"""Stubborn trees in cells, started three ways (the foreground `agnsup run`,
`agnsup serve` + `agnsup spawn`, the in-process Python API), and the checks
that prove a tree is gone: its processes, its heartbeats, its ports."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time

from conftest import REPO
from agnsup.linux import proc
from agnsup.selftest.host import bindable, lines  # one copy: the selftest's

SCRIPT = os.path.join(REPO, "agnsup", "selftest", "stubborn-tree")


def wait_for(cond, timeout: float = 60.0, what: str = "condition"):
    # 60 s: an emulated CPU (the pure-v2 guest, scripts/v2lane) takes seconds per controller start; a
    # condition that holds returns at once, so only a failing test waits that long
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def stop_server(p: subprocess.Popen, timeout: float = 60.0) -> int | None:
    """SIGTERM a server the test started and wait for it; one that does not end in time is
    SIGKILLed (None), so that nothing it runs outlives the test and its state root's teardown."""
    if p.poll() is None:
        p.terminate()
    try:
        return p.wait(timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        return None


def wait_beats(paths, n: int = 5, timeout: float = 30.0) -> None:
    wait_for(lambda: all(lines(p) >= n for p in paths), timeout, f"{n} heartbeats in {paths}")


def growing(paths, window: float = 0.6) -> dict:
    before = {p: lines(p) for p in paths}
    time.sleep(window)
    return {p: lines(p) > before[p] for p in paths}


def held_mount_namespaces() -> set[str]:
    """The mount namespaces this process holds a descriptor of, other than its own (a Supervisor's waiter holds a
    running cell's: Waiter.hold_mounts)."""
    own = os.readlink("/proc/self/ns/mnt")
    held = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("mnt:[") and link != own:
            held.add(link)
    return held


def alive(pid: int, starttime: int) -> bool:
    st = proc.stat(pid)
    return st is not None and st.starttime == starttime and st.state not in ("Z", "X")


def tree_pids(info: dict) -> list[tuple[int, int]]:
    out = [(info["pid"], info["starttime"]), (info["grandchild"]["pid"], info["grandchild"]["starttime"])]
    if info.get("stripped"):
        out.append((info["stripped"]["pid"], info["stripped"]["starttime"]))
    return out


def kill_exact(pairs) -> None:
    """Kill processes this test started, by pidfd after checking they are still them."""
    for pid, start in pairs:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue
        try:
            if alive(pid, start):
                signal.pidfd_send_signal(fd, signal.SIGKILL)
        except ProcessLookupError:
            pass
        finally:
            os.close(fd)


def cell_row(agnsup, cell: str) -> dict:
    """The one `agnsup ps --all` row of this cell id."""
    rows = [c for c in agnsup.json("ps", "--all", "--json") if c["cell_id"] == cell]
    assert len(rows) == 1, rows
    return rows[0]


def gone(info: dict) -> bool:
    """Every process of the tree dead and both its ports bindable."""
    return not any(alive(*p) for p in tree_pids(info)) and all(bindable(p) for p in info["ports"])


def stubborn_argv(worktree: str, name: str, term_wait: float = 1.0) -> list[str]:
    shutil.copy(SCRIPT, os.path.join(worktree, "stubborn_tree.py"))
    return ["python3", os.path.join(worktree, "stubborn_tree.py"), "--heartbeat",
            os.path.join(worktree, f"hb-{name}"), "--term-wait", str(term_wait)]


class CliStarter:
    """Each cell under its own foreground `agnsup run` controller."""
    name = "run"

    def __init__(self, agnsup, tmp_path):
        self.agnsup, self.tmp = agnsup, tmp_path
        self.procs: dict = {}

    def start(self, run_id, agent_id, cell_id, worktree, argv, role="networked") -> dict:
        err = open(self.tmp / f"ctl-{cell_id}.err", "wb")
        p = self.agnsup.popen("run", "--role", role, "--run-id", run_id, "--agent", agent_id, "--cell", cell_id,
                              "--workdir", worktree, *KEEP, "--", *argv, stdout=subprocess.PIPE, stderr=err)
        err.close()
        self.procs[cell_id] = p
        line = p.stdout.readline()
        assert line, (self.tmp / f"ctl-{cell_id}.err").read_text()
        return json.loads(line)

    def exit_code(self, run_id, cell_id) -> int:
        p = self.procs[cell_id]
        code = p.wait(30)
        p.stdout.close()
        return code

    def close(self):
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
            if p.stdout and not p.stdout.closed:
                p.stdout.close()


def _stdout_json(state: str, run_id: str, cell_id: str) -> dict:
    path = os.path.join(state, "cells", run_id, cell_id, "stdout")
    wait_for(lambda: lines(path) >= 1, 30, f"the report line in {path}")
    with open(path) as f:
        return json.loads(f.readline())


class ServeStarter:
    """One `agnsup serve` controller; cells through `agnsup spawn`."""
    name = "serve"

    def __init__(self, agnsup, tmp_path):
        self.agnsup, self.tmp = agnsup, tmp_path
        self.err = open(tmp_path / "serve.err", "wb")
        self.server = agnsup.popen("serve", stdout=subprocess.PIPE, stderr=self.err)
        line = self.server.stdout.readline()
        assert line, (tmp_path / "serve.err").read_text()
        self.ready = json.loads(line)

    def start(self, run_id, agent_id, cell_id, worktree, argv, role="networked") -> dict:
        out = self.agnsup.json("spawn", "--role", role, "--run-id", run_id, "--agent", agent_id, "--cell", cell_id,
                               "--workdir", worktree, *KEEP, "--", *argv)
        assert out["cell_id"] == cell_id and out["pid"] > 0
        info = _stdout_json(self.agnsup.state, run_id, cell_id)
        assert info["pid"] == out["pid"]
        return info

    def exit_code(self, run_id, cell_id) -> int:
        def receipt():
            r = self.agnsup.json("receipts", "--run", run_id, "--cell", cell_id, "--json")
            return r[0] if r else None
        return wait_for(receipt, 30, f"the receipt of {cell_id}")["exit_code"]

    def close(self):
        if self.server.poll() is None:
            self.server.terminate()
            self.server.wait(60)
        self.server.stdout.close()
        self.err.close()


class ApiStarter:
    """The in-process Python API: agnsup.Supervisor."""
    name = "api"

    def __init__(self, agnsup, tmp_path):
        from agnsup import Supervisor
        self.state = agnsup.state
        self.sup = Supervisor(agnsup.state)

    def start(self, run_id, agent_id, cell_id, worktree, argv, role="networked") -> dict:
        h = self.sup.spawn(argv, role=role, run_id=run_id, agent_id=agent_id, cell_id=cell_id, workdir=worktree,
                           on_controller_death="keep", changes="live")
        info = _stdout_json(self.state, run_id, cell_id)
        assert info["pid"] == h["pid"]
        return info

    def exit_code(self, run_id, cell_id) -> int:
        return self.sup.wait(run_id, cell_id, 30)["exit_code"]

    def close(self):
        self.sup.close()


# These cells outlive their controller (on_controller_death = keep): the trees report
# their pids from the host's PID namespace, and the tests kill and watch them by those; their
# heartbeats in the worktree are read as they are written (changes = live: not captured).
KEEP = ("--on-controller-death", "keep", "--changes", "live")
STARTERS = {"run": CliStarter, "serve": ServeStarter, "api": ApiStarter}
