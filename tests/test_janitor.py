"""The startup janitor: crash recovery from composite evidence, with real processes.

A stubborn tree is started in a cell through `agnsup run`, the controller is
SIGKILLed, and the janitor must find and kill the whole tree (and nothing
else: not a sentinel started outside agnsup, not an innocent process wearing
a journaled pid), release every resource, converge the journal and say why.
"""
import json
import os
import secrets
import signal
import sqlite3
import subprocess
import sys
import time

import pytest

from conftest import procs_with_env
from agnsup.linux import pidfd, proc
from agnsup.store.state import StateRoot
from scenario import (KEEP, SCRIPT, alive, bindable, cell_row, growing, kill_exact, stubborn_argv, tree_pids,
                      wait_beats, wait_for)

# -- helpers ---------------------------------------------------------------
def start_stubborn(agnsup, worktree, cell, tmp_path, stripped=True, extra_env=None):
    """`agnsup run --role networked --cell CELL -- python3 <wt>/stubborn_tree.py ...`: (Popen, info)."""
    args = ["run", "--role", "networked", "--workdir", worktree, "--cell", cell, *KEEP, "--",
            *stubborn_argv(worktree, cell, term_wait=5)]
    if stripped:  # True, or the flag to use ("--stripped-in-session" keeps it in the leader's session)
        args.append(stripped if isinstance(stripped, str) else "--stripped")
    err = open(tmp_path / f"ctl-{cell}.err", "wb")
    p = agnsup.popen(*args, stdout=subprocess.PIPE, stderr=err, env=extra_env)
    err.close()
    line = p.stdout.readline()
    assert line, f"no report from the stubborn tree; controller stderr: {(tmp_path / f'ctl-{cell}.err').read_text()}"
    info = json.loads(line)
    wait_beats(info["heartbeats"])
    return p, info


# -- the main scenario ------------------------------------------------------
def test_janitor_recovers_a_stubborn_tree_after_the_controller_is_killed(agnsup, worktree, tmp_path):
    canary = {"AGNSUP_CANARY_SECRET": "must-never-reach-cell"}
    p, info = start_stubborn(agnsup, worktree, "a1", tmp_path, extra_env=canary)
    assert info["secret_env"] is None and info["token_seen"]
    row = cell_row(agnsup, "a1")
    assert row["controller"] and row["pid"] == info["pid"] and row["boot_id"] == proc.boot_id()

    # the sentinel: the same program, same argv, on the host outside agnsup
    sent_hb = str(tmp_path / "hb-sentinel")
    sentinel = subprocess.Popen([sys.executable, SCRIPT, "--heartbeat", sent_hb, "--stripped"],
                                stdout=subprocess.PIPE, start_new_session=True,
                                env={**os.environ, "AGNSUP_CELL_TOKEN": "forged-" + secrets.token_hex(8)})
    sinfo = json.loads(sentinel.stdout.readline())
    try:
        wait_beats(sinfo["heartbeats"])

        # controller death: SIGKILL, no shutdown hook
        p.kill()
        assert p.wait(10) == -signal.SIGKILL
        p.stdout.close()
        grow = growing(info["heartbeats"])
        assert all(grow.values()), f"the tree did not survive the controller: run invalid, {grow}"
        assert all(alive(*x) for x in tree_pids(info))

        rep = agnsup.json("janitor", "--json")
        assert rep["recovered"] == ["a1"]
        assert [c["id"] for c in rep["controllers"]] == [row["controller"]]
        assert rep["controllers"][0]["ended"]

        # ORPHAN_PROCESS_AFTER_CRASH, HEARTBEAT_CONTINUES, PORT_NOT_RELEASED
        for pid, start in tree_pids(info):
            assert not alive(pid, start), pid
        assert procs_with_env("AGNSUP_CELL_ID", "a1") == []
        assert not any(growing(info["heartbeats"], 1.0).values())
        for port in info["ports"]:
            assert bindable(port), port

        # SENTINEL_KILLED
        assert all(alive(*x) for x in tree_pids(sinfo))
        assert all(growing(sinfo["heartbeats"]).values())

        # the evidence: every tree process killed through the cell's cgroup, with its inode
        killed = {k["pid"]: k for k in rep["killed"]}
        for pid, _ in tree_pids(info):
            assert pid in killed, (pid, rep["killed"])
            assert any("cgroup" in e and "inode" in e for e in killed[pid]["evidence"]), killed[pid]
        assert any("journaled leader" in e for e in killed[info["pid"]]["evidence"])
        assert all(k["verified_dead"] for k in rep["killed"])
        assert sinfo["pid"] not in killed and sinfo["grandchild"]["pid"] not in killed

        # RESOURCE_LEAK, STATE_NOT_CONVERGED
        row = cell_row(agnsup, "a1")
        assert row["state"] == "recovered" and row["run_state"] == "recovered" and row["ended_at"]
        for path in row["cgroup"].values():
            assert not os.path.exists(path), path
        assert not os.path.exists(os.path.join(agnsup.state, "cells", "default", "a1", "tmp"))
        assert not os.listdir(os.path.join(agnsup.state, "locks"))
        assert not os.listdir(os.path.join(agnsup.state, "controllers"))

        # RECOVERY_RECEIPT_MISSING
        recs = agnsup.json("receipts", "--recovery", "--cell", "a1", "--json")
        assert len(recs) == 1 and recs[0]["controller"] == row["controller"]
        cell = recs[0]["cell"]
        assert cell["final_state"] == "recovered" and cell["run_state"] == "recovered"
        assert {k["pid"] for k in cell["killed"]} >= {pid for pid, _ in tree_pids(info)}
        kinds = {r["kind"] for r in cell["released"]}
        assert {"kill", "cgroup", "tmpdir", "worktree_lock"} <= kinds or {"cgroup", "tmpdir", "worktree_lock"} <= kinds
        with open(rep["receipt"]["path"]) as f:
            full = json.load(f)
        assert full["controllers"][0]["id"] == row["controller"] and full["duration"] >= 0
        assert "liveness lock" in full["controllers"][0]["why_dead"]

        # Issue 12 item 4: a recovered cell has a cell receipt too: the chain as journaled, what the
        # janitor killed and why, a pointer to the recovery receipt; in the journal and on disk
        (own,) = agnsup.json("receipts", "--run", "default", "--cell", "a1", "--json")
        assert own["state"] == "recovered" and own["reason"] and own["exit_code"] is None
        assert [st["stage"] for st in own["chain"]][:4] == ["public_tool", "spec_builder", "governance",
                                                           "policy_compiler"]
        assert own["recovery"]["receipt"] == rep["receipt"]["path"] and own["controller"] == row["controller"]
        assert {k["pid"] for k in own["recovery"]["killed"]} >= {pid for pid, _ in tree_pids(info)}
        with open(os.path.join(agnsup.state, "cells", "default", "a1", "receipt.json")) as f:
            assert json.load(f) == own
        # the dead controller's receipt file, made empty while the cell ran (receipts.reserve), is not left
        left = [n for n in os.listdir(os.path.join(agnsup.state, "cells", "default", "a1")) if n.endswith(".tmp")]
        assert not left, left

        # idempotent: the second janitor does nothing
        rep2 = agnsup.json("janitor", "--json")
        assert rep2["recovered"] == [] and rep2["killed"] == [] and rep2["receipt"] is None
        assert all(alive(*x) for x in tree_pids(sinfo))
    finally:
        kill_exact(tree_pids(sinfo))
        sentinel.stdout.close()
        sentinel.wait(10)


def test_the_next_controller_start_runs_the_janitor(agnsup, worktree, tmp_path):
    p, info = start_stubborn(agnsup, worktree, "b1", tmp_path, stripped=False)
    p.kill()
    p.wait(10)
    p.stdout.close()
    cp = agnsup("run", "--workdir", worktree, "--cell", "b2", "--", "true", check=0)
    assert "janitor recovered 1 cell" in cp.err
    for pid, start in tree_pids(info):
        assert not alive(pid, start)
    assert cell_row(agnsup, "b1")["state"] == "recovered"
    # b2 started on the same run after recovery, so the run is active again then finished its cell
    assert cell_row(agnsup, "b2")["state"] == "exited"


def test_a_live_controllers_cell_is_never_touched(agnsup, worktree, tmp_path):
    p = agnsup.popen("run", "--workdir", worktree, "--cell", "live", "--", "sleep", "1000",
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: procs_with_env("AGNSUP_CELL_ID", "live") or p.poll() is not None, what="the live cell")
        assert p.poll() is None
        rep = agnsup.json("janitor", "--json")
        assert rep["recovered"] == [] and rep["killed"] == [] and rep["controllers"] == []
        assert any(s.get("cell_id") == "live" and "alive" in s["reason"] for s in rep["skipped"])
        assert procs_with_env("AGNSUP_CELL_ID", "live")
        assert cell_row(agnsup, "live")["state"] == "running"
    finally:
        p.send_signal(signal.SIGTERM)
        assert p.wait(30) == 128 + signal.SIGTERM
    assert cell_row(agnsup, "live")["state"] == "cancelled"


def test_two_janitors_at_once_recover_each_cell_once(agnsup, worktree, tmp_path):
    p, info = start_stubborn(agnsup, worktree, "c1", tmp_path, stripped=False)
    p.kill()
    p.wait(10)
    p.stdout.close()
    js = [agnsup.popen("janitor", "--json", stdout=subprocess.PIPE) for _ in range(2)]
    reps = [json.loads(j.communicate(timeout=60)[0]) for j in js]
    assert sorted(r["recovered"] for r in reps) == [[], ["c1"]]
    assert len(agnsup.json("receipts", "--recovery", "--json")) == 1
    for pid, start in tree_pids(info):
        assert not alive(pid, start)


# -- journal rows crafted by hand: other boot, pid reuse --------------------
def _fake_dead_cell(state, boot, pid=None, pidfd_ino=None, starttime=None, token=None, cgroup=None):
    """A journal with one dead controller instance and one running cell."""
    st = StateRoot(state).ensure()
    j = st.journal()
    now = time.time()
    cid, run, cell = "ctl-dead" + secrets.token_hex(3), "r-fake", "c-fake"
    cell_dir = st.cell_dir(run, cell)
    tmpdir = os.path.join(cell_dir, "tmp")
    os.makedirs(os.path.join(tmpdir, "home"))
    open(os.path.join(tmpdir, "home", "f"), "w").close()
    lock = st.worktree_lock("f" * 24)
    open(lock, "w").close()
    ctl_lock = st.controller_lock(cid)
    open(ctl_lock, "w").close()  # nobody holds it: the instance is dead
    with j.tx() as db:
        db.execute("INSERT INTO controllers(id, kind, pid, pidfd_ino, starttime, boot_id, lock_path, started_at)"
                   " VALUES (?, 'run', 1, NULL, 0, ?, ?, ?)", (cid, boot, ctl_lock, now - 5))
        db.execute("INSERT INTO runs(run_id, state, created_at) VALUES (?, 'active', ?)", (run, now - 5))
        db.execute("INSERT INTO cells(run_id, cell_id, agent_id, role, state, token, controller_id, boot_id, cgroup,"
                   " cgroup_ino, tmpdir, worktree, lock_path, pid, pidfd_ino, starttime, pgid, argv, exe, created_at,"
                   " started_at) VALUES (?,?, 'default', 'executor', 'running', ?,?,?,?, NULL, ?, '/nonexistent', ?,"
                   " ?,?,?,?, '[\"sleep\", \"1000\"]', '/bin/sleep', ?, ?)",
                   (run, cell, token or secrets.token_hex(16), cid, boot, json.dumps(cgroup) if cgroup else None,
                    tmpdir, lock, pid, pidfd_ino, starttime, pid, now - 5, now - 5))
    j.close()
    return {"controller": cid, "run": run, "cell": cell, "tmpdir": tmpdir, "lock": lock, "ctl_lock": ctl_lock}


def _innocent(env=None):
    p = subprocess.Popen(["sleep", "1000"], env={**os.environ, **(env or {})}, start_new_session=True)
    deadline = time.monotonic() + 5
    while proc.stat(p.pid) is None or proc.stat(p.pid).comm != "sleep":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    fd = os.pidfd_open(p.pid)
    ino = os.fstat(fd).st_ino
    os.close(fd)
    return p, ino, proc.stat(p.pid).starttime


def test_a_cell_from_another_boot_gets_no_signal_only_records_and_files_converge(agnsup, state):
    token = secrets.token_hex(16)
    # the innocent process carries every piece of evidence this boot would accept
    p, ino, start = _innocent({"AGNSUP_CELL_TOKEN": token})
    try:
        f = _fake_dead_cell(state, "00000000-0000-0000-0000-0000deadbeef", pid=p.pid, pidfd_ino=ino,
                            starttime=start, token=token)
        rep = agnsup.json("janitor", "--json")
        assert rep["recovered"] == [f["cell"]] and rep["killed"] == []
        assert p.poll() is None, "a process was signalled on behalf of a cell from another boot"
        assert "boot" in rep["controllers"][0]["why_dead"] and rep["controllers"][0]["ended"]
        cell = agnsup.json("receipts", "--recovery", "--json")[0]["cell"]
        assert any("no signal sent" in n for n in cell["notes"])
        assert not os.path.exists(f["tmpdir"]) and not os.path.exists(f["lock"])
        assert not os.path.exists(f["ctl_lock"])
        row = cell_row(agnsup, f["cell"])
        assert row["state"] == "recovered" and row["run_state"] == "recovered"
        db = sqlite3.connect(os.path.join(state, "journal.db"))
        assert db.execute("SELECT ended_at FROM controllers WHERE id=?", (f["controller"],)).fetchone()[0]
        db.close()
        assert agnsup.json("janitor", "--json")["recovered"] == []
    finally:
        p.kill()
        p.wait()


@pytest.mark.parametrize("trap", ["same_starttime_other_pidfd_inode", "other_starttime_copied_token"])
def test_pid_reuse_trap_the_innocent_process_is_spared_and_the_receipt_says_why(agnsup, state, trap):
    token = secrets.token_hex(16)
    if trap == "same_starttime_other_pidfd_inode":
        # a forced reuse within one clock tick: (pid, start time) agree, only the pidfd inode tells them apart
        if not pidfd.has_pidfs():
            pytest.skip("ENV_BLOCKED: pidfs (Linux 6.9+): every pidfd shares one inode here, so a reuse with the"
                        " same start time cannot be told apart; the janitor falls back to start time")
        p, ino, start = _innocent()
        f = _fake_dead_cell(state, proc.boot_id(), pid=p.pid, pidfd_ino=ino + 1000003, starttime=start, token=token)
        expect = "pidfd inode"
    else:
        # the innocent copied the token but started before the cell: one piece of evidence only
        p, ino, start = _innocent({"AGNSUP_CELL_TOKEN": token})
        f = _fake_dead_cell(state, proc.boot_id(), pid=p.pid, pidfd_ino=None, starttime=start + 50, token=token)
        expect = "start time"
    try:
        rep = agnsup.json("janitor", "--json")
        assert p.poll() is None, "PID_REUSE_KILL: the innocent process was killed"
        assert rep["recovered"] == [f["cell"]] and rep["killed"] == []
        spared = [s for s in rep["skipped"] if s.get("pid") == p.pid]
        assert spared and "journaled leader pid" in spared[0]["reason"] and expect in spared[0]["reason"]
        assert "spared" in spared[0]["reason"]
        if trap == "other_starttime_copied_token":
            assert any("token matches but start time" in s["reason"] for s in spared)
        cell = agnsup.json("receipts", "--recovery", "--json")[0]["cell"]
        assert any(s["pid"] == p.pid for s in cell["spared"])
        assert not os.path.exists(f["tmpdir"])
        assert cell_row(agnsup, f["cell"])["state"] == "recovered"
    finally:
        p.kill()
        p.wait()


def test_a_recreated_cgroup_with_another_inode_is_not_killed_through(agnsup, state):
    from agnsup.linux import cgroup
    layout = cgroup.detect_layout()
    if layout.kind == "none":
        pytest.skip("ENV_BLOCKED: no writable cgroup hierarchy")
    from agnsup.backend.cgroups import for_layout
    backend = for_layout(layout, state)
    place = backend.create(backend.place("r-fake", "default", "c-fake", {}), {})
    node = place.node
    p, ino, start = _innocent()
    try:
        with open(os.path.join(node.primary[1], "cgroup.procs"), "w") as fh:
            fh.write(str(p.pid))
        f = _fake_dead_cell(state, proc.boot_id(), cgroup=node.as_dict())
        db = sqlite3.connect(os.path.join(state, "journal.db"))
        db.execute("UPDATE cells SET cgroup_ino=? WHERE cell_id=?", (place.inode + 7, f["cell"]))
        db.commit()
        db.close()
        rep = agnsup.json("janitor", "--json")
        assert p.poll() is None and rep["killed"] == []
        assert any(s.get("pid") == p.pid and "recreated" in s["reason"] for s in rep["skipped"])
        assert os.path.isdir(node.primary[1])
    finally:
        p.kill()
        p.wait()
        backend.wait_empty(place, 5)
        backend.remove(place)  # and the empty agent, run and base directories above it


def test_startup_check_is_one_cheap_query_when_nothing_is_dead(agnsup, worktree, state, monkeypatch):
    # what it costs is a bench line (scripts/bench janitor); here: one statement, and an indexed one
    import sqlite3
    from agnsup import janitor
    from agnsup.store import journal as journal_mod
    agnsup("run", "--workdir", worktree, "--cell", "q1", "--", "true", check=0)
    st = StateRoot(state)
    ran, connect = [], sqlite3.connect

    def traced(*a, **kw):
        db = connect(*a, **kw)
        db.set_trace_callback(ran.append)
        return db
    monkeypatch.setattr(journal_mod.sqlite3, "connect", traced)
    for _ in range(3):
        assert janitor.on_start(st) is None
    monkeypatch.undo()
    from agnsup.store.journal import OPEN_SQL
    assert len(ran) == 3 and all(" ".join(q.split()) == " ".join(OPEN_SQL.split()) for q in ran), ran
    plan = st.journal().query_plan(OPEN_SQL)
    assert "controllers_open" in plan and "cells_live" in plan, plan
