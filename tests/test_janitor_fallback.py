"""The cgroup-less fallback (layout `none`), for real on this host through
AGNSUP_CGROUP_LAYOUT=none: a cell is then tracked by its session (the leader
called setsid: sid == pgid == leader pid) plus token + start time, every signal
through a checked pidfd, repeated until a scan finds none.

The tree is scripts/stubborn_tree.py with --stripped-in-session: its double-forked setsid
grandchild left the session (found by token + start time) and its stripped
descendant cleared its environment (found by the session only). The sentinel
is the same program started outside agnsup before the cell, its token then
forged in its memory to the cell's real one: token matches, start time does
not, spared.
"""
import json
import os
import secrets
import signal
import subprocess
import sys
import time

import pytest

from conftest import procs_with_env
from scenario import KEEP, SCRIPT, alive, bindable, cell_row, growing, kill_exact, tree_pids, wait_beats
from test_janitor import _fake_dead_cell, start_stubborn
from agnsup.errors import UsageError
from agnsup.linux import cgroup, proc

NONE = {"AGNSUP_CGROUP_LAYOUT": "none"}
PLACEHOLDER = "0" * 32  # as long as a real token, so the forgery can overwrite it in place


def _forge_token(pid: int, token: str) -> None:
    """Overwrite the token in a live process's environment block (as root, through
    /proc/PID/mem): /proc/PID/environ then shows the cell's real token."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        raw = f.read()
    env_start = int(raw[raw.rindex(b")") + 2:].split()[47])  # field 50 of proc(5)
    with open(f"/proc/{pid}/environ", "rb") as f:
        env = f.read()
    key = b"AGNSUP_CELL_TOKEN=" + PLACEHOLDER.encode()
    at = env.index(key) + len(b"AGNSUP_CELL_TOKEN=")
    with open(f"/proc/{pid}/mem", "r+b", buffering=0) as f:
        f.seek(env_start + at)
        f.write(token.encode())
    assert proc.environ(pid)["AGNSUP_CELL_TOKEN"] == token


def _sentinel(tmp_path):
    hb = str(tmp_path / "hb-sentinel")
    s = subprocess.Popen([sys.executable, SCRIPT, "--heartbeat", hb, "--stripped-in-session"], stdout=subprocess.PIPE,
                         start_new_session=True, env={**os.environ, "AGNSUP_CELL_TOKEN": PLACEHOLDER})
    info = json.loads(s.stdout.readline())
    wait_beats(info["heartbeats"])
    return s, info


def _forge_sentinel(sinfo, token):
    for pid in (sinfo["pid"], sinfo["grandchild"]["pid"]):  # the stripped one has no environment at all
        _forge_token(pid, token)


def _stop_sentinel(s, sinfo):
    kill_exact(tree_pids(sinfo))
    s.stdout.close()
    s.wait(10)


def _assert_tree_gone(info):
    for pid, start in tree_pids(info):
        assert not alive(pid, start), pid
    assert not any(growing(info["heartbeats"], 1.0).values())
    for port in info["ports"]:
        assert bindable(port), port


def test_the_layout_override_and_what_doctor_says(agnsup, monkeypatch):
    monkeypatch.setenv("AGNSUP_CGROUP_LAYOUT", "none")
    assert cgroup.detect_layout().kind == "none"
    assert cgroup.base_node(cgroup.detect_layout(), agnsup.state).paths == {}
    monkeypatch.setenv("AGNSUP_CGROUP_LAYOUT", "v7")
    with pytest.raises(UsageError, match="only override is 'none'"):
        cgroup.detect_layout()
    monkeypatch.delenv("AGNSUP_CGROUP_LAYOUT")
    rep = json.loads(agnsup("doctor", "--json", "--no-probe", env=NONE, check=0).out)
    assert rep["cgroup"]["layout"] == "none"
    assert rep["will_use"]["tracking_and_kill"].startswith("ENV_BLOCKED: cgroup: tracking session+token")
    assert "ENV_BLOCKED: cgroup" in agnsup("doctor", "--no-probe", env=NONE, check=0).out
    bad = agnsup("run", "--", "true", env={"AGNSUP_CGROUP_LAYOUT": "v7"})
    assert bad.returncode == 125 and bad.err.count("\n") == 1 and "AGNSUP_CGROUP_LAYOUT" in bad.err


def test_the_normal_end_of_a_cell_without_cgroup_kills_the_whole_tree(agnsup, worktree, tmp_path):
    import shutil
    shutil.copy(SCRIPT, os.path.join(worktree, "stubborn_tree.py"))
    s, sinfo = _sentinel(tmp_path)
    hb = os.path.join(worktree, "hb-n1")
    go = os.path.join(worktree, "go")
    err = open(tmp_path / "ctl.err", "wb")
    p = agnsup.popen("run", "--role", "networked", "--workdir", worktree, "--cell", "n1", *KEEP, "--", "sh", "-c",
                     f"python3 stubborn_tree.py --heartbeat {hb} --stripped-in-session & "
                     f"while [ ! -e {go} ]; do sleep 0.1; done", env=NONE, stdout=subprocess.PIPE, stderr=err)
    err.close()
    token = None
    try:
        line = p.stdout.readline()
        assert line, (tmp_path / "ctl.err").read_text()
        info = json.loads(line)
        wait_beats(info["heartbeats"])
        token = proc.environ(info["pid"])["AGNSUP_CELL_TOKEN"]
        _forge_sentinel(sinfo, token)
        # the shapes under test: the grandchild left the session, the stripped one has no token
        assert info["grandchild"]["sid"] != info["sid"] and info["stripped"]["sid"] == info["sid"]
        assert "AGNSUP_CELL_TOKEN" not in proc.environ(info["stripped"]["pid"])

        open(go, "w").close()  # the leader ends normally; the rest of the cell must go with it
        assert p.wait(60) == 0, (tmp_path / "ctl.err").read_text()
        p.stdout.close()
        _assert_tree_gone(info)
        forged = {pid for pid, _ in tree_pids(sinfo)}  # the sentinel carries the cell's token too
        assert [q for q in procs_with_env("AGNSUP_CELL_TOKEN", token) if q not in forged] == []

        # SENTINEL_KILLED: token forged to the cell's, but it started before the cell
        assert all(alive(*x) for x in tree_pids(sinfo))
        assert all(growing(sinfo["heartbeats"]).values())

        row = cell_row(agnsup, "n1")
        assert row["state"] == "exited"
        with open(os.path.join(agnsup.state, "cells", "default", "n1", "receipt.json")) as f:
            rec = json.load(f)
        assert rec["isolation"]["tracking"] == "session+token"
        assert rec["isolation"]["env_blocked"] == ["ENV_BLOCKED: cgroup"] and rec["cgroup"] is None
        assert rec["kill_method"] == "session+token"
        assert {pid for pid, _ in tree_pids(info)} <= set(rec["pids"]["left_after_leader"])
        assert sinfo["pid"] not in rec["pids"]["left_after_leader"]
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        if token:  # no cgroup to sweep: a failed run must not leave the cell's processes behind
            forged = {pid for pid, _ in tree_pids(sinfo)}
            kill_exact([(q, proc.stat(q).starttime) for q in procs_with_env("AGNSUP_CELL_TOKEN", token)
                        if q not in forged and proc.stat(q)])
        _stop_sentinel(s, sinfo)


def test_a_timeout_without_cgroup_stops_then_kills_the_tree(agnsup, worktree):
    cell = "t1-" + secrets.token_hex(4)  # processes are looked up host-wide by cell id: make it unique
    cp = agnsup("run", "--workdir", worktree, "--cell", cell, "--timeout", "1", *KEEP, "--", "sh", "-c",
                "trap '' TERM; (trap '' TERM; setsid sleep 1000 & sleep 1000) & sleep 1000", env=NONE)
    assert cp.returncode == 124, cp.err
    assert procs_with_env("AGNSUP_CELL_ID", cell) == []
    assert cell_row(agnsup, cell)["state"] == "timeout"


def test_the_janitor_without_cgroup_kills_the_tree_of_a_sigkilled_controller(agnsup, worktree, tmp_path):
    agnsup.env.update(NONE)
    s, sinfo = _sentinel(tmp_path)
    try:
        p, info = start_stubborn(agnsup, worktree, "j1", tmp_path, stripped="--stripped-in-session", extra_env=NONE)
        token = proc.environ(info["pid"])["AGNSUP_CELL_TOKEN"]
        _forge_sentinel(sinfo, token)
        p.kill()
        assert p.wait(10) == -signal.SIGKILL
        p.stdout.close()
        grow = growing(info["heartbeats"])
        assert all(grow.values()), f"the tree did not survive the controller: run invalid, {grow}"

        rep = agnsup.json("janitor", "--json")
        assert rep["recovered"] == ["j1"]
        _assert_tree_gone(info)
        forged = {pid for pid, _ in tree_pids(sinfo)}  # the sentinel carries the cell's token too
        assert [q for q in procs_with_env("AGNSUP_CELL_TOKEN", token) if q not in forged] == []
        assert all(alive(*x) for x in tree_pids(sinfo))
        assert all(growing(sinfo["heartbeats"]).values())

        # the evidence, by name, for each shape
        killed = {k["pid"]: k for k in rep["killed"]}
        assert all(k["verified_dead"] and k["method"] == "pidfd_send_signal" for k in rep["killed"])
        assert any("journaled leader" in e for e in killed[info["pid"]]["evidence"])
        gc = killed[info["grandchild"]["pid"]]["evidence"]
        assert any("token matches" in e for e in gc) and not any("session" in e for e in gc)
        st = killed[info["stripped"]["pid"]]["evidence"]
        assert any(f"session {info['pid']}" in e for e in st) and not any("token" in e for e in st)
        spared = [x for x in rep["skipped"] if x.get("pid") == sinfo["pid"]]
        assert spared and "token matches but start time" in spared[0]["reason"]

        cell = agnsup.json("receipts", "--recovery", "--cell", "j1", "--json")[0]["cell"]
        assert cell["tracking"] == "session+token" and any("ENV_BLOCKED: cgroup" in n for n in cell["notes"])
        row = cell_row(agnsup, "j1")
        assert row["state"] == "recovered" and row["run_state"] == "recovered"
        assert not os.path.exists(os.path.join(agnsup.state, "cells", "default", "j1", "tmp"))
        again = agnsup.json("janitor", "--json")
        assert again["recovered"] == [] and again["killed"] == []
    finally:
        _stop_sentinel(s, sinfo)


def test_a_session_whose_leader_pid_was_reused_is_spared(agnsup, state):
    """pid L of a dead cell is now another process's, leading its own session L with a
    member that started inside the cell's life: session L is not the cell's."""
    agnsup.env.update(NONE)
    p = subprocess.Popen(["sh", "-c", "sleep 1000 & exec sleep 1000"], start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while len([q for q in proc.pids() if (st := proc.stat(q)) and st.sid == p.pid and st.comm == "sleep"]) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        member = next(q for q in proc.pids() if q != p.pid and (st := proc.stat(q)) and st.sid == p.pid)
        lead = proc.stat(p.pid)
        f = _fake_dead_cell(state, proc.boot_id(), pid=p.pid, pidfd_ino=None, starttime=lead.starttime - 50,
                            token=secrets.token_hex(16))
        rep = agnsup.json("janitor", "--json")
        assert rep["recovered"] == [f["cell"]] and rep["killed"] == []
        assert p.poll() is None and proc.stat(member) is not None and not proc.is_zombie(member)
        reasons = {s["pid"]: s["reason"] for s in rep["skipped"] if "pid" in s}
        assert "start time" in reasons[p.pid] and "journaled leader" in reasons[p.pid]
        assert "a new session with the same number" in reasons[member]
    finally:
        os.killpg(p.pid, signal.SIGKILL)  # our own session: the sh we started and its sleep
        p.wait()
