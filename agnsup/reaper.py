"""The reaper: the one way a cell's processes end and its resources go.

The foreground wait (what is left once the leader exited), a setup that
failed, cancel, cleanup and the janitor all come through here, so "recovery
said clean" and "the tree is gone" cannot disagree:

    stop(backend, targets, ...)   SIGTERM (when asked), the grace period, then kill rounds:
                                  the backend's tree kill (cgroup.kill; freeze, kill, thaw;
                                  ...) and, on evidence, single processes (SIGSTOP all, then
                                  SIGKILL, each through a checked pidfd), until a round finds
                                  nothing; every kill verified within VERIFY_TIMEOUT
    release(backend, target)      the cell's cgroup directories (and empty agent/run ones),
                                  its temp dir, its worktree lock
    Tree(backend, target)         the same TERM and kill for a cell that is still running
                                  (the supervisor's wait loop: timeout, cancel, broken limits)

Where a process may be found, by evidence (never a pid alone):
- in the cell's tree (the backend's place: cgroup membership, the directory's
  inode checked against the journal by backend.from_journal);
- with `thorough` (the janitor), or where the backend has no tree (untracked):
  the journaled leader identity (pidfd inode, start time), and processes on
  which two pieces agree: the ownership token plus a start time inside the
  cell's life, or the cell's session plus that start time (linux/session.py).

One outcome record, `Reaped`, for every caller. Idempotent: what is already
gone is skipped, never an error.
"""
from __future__ import annotations

import errno
import json
import os
import signal
import time

from . import locks
from .util import backoff
from .util import crashpoints
from .linux import fs, pidfd, proc, session
from .util.record import Factory, Record

VERIFY_TIMEOUT = 10.0  # how long a killed tree (or process) gets to be gone
EVIDENCE_KILL = "session+token"  # the method of a cell without a tree: single processes on evidence
KILL_ROUNDS = 50       # on evidence alone a tree may fork between scan and kill: scan again


class Target(Record):
    """One cell as the reaper sees it: where its tree is and what identifies its processes."""
    run_id: str
    cell_id: str
    place: object = None          # backend.Place (None: no tree, or not provably the cell's)
    leader: dict | None = None    # journaled identity: pid, pidfd_ino, starttime
    token: str | None = None      # the ownership token (a hint: counts only with a start time)
    since: int = 0                # the cell's start, clock ticks since boot
    tmpdir: str | None = None
    lock_path: str | None = None
    lock_fd: int | None = None    # held by this process: released, the file unlinked

    @property
    def has_tree(self) -> bool:
        return self.place is not None and self.place.node is not None


def from_row(backend, row) -> tuple[Target, str, list[int]]:
    """The reaper's view of one journaled cell, a note on its tree, and the pids of a
    look-alike tree (a directory at its path that is provably not the cell's). Its
    tree only through backend.from_journal (the journaled inode); its life begins
    at the leader's start, or, before an identity was committed, at its intent row."""
    place, note, bystanders = backend.from_journal(json.loads(row["cgroup"]) if row["cgroup"] else None,
                                                   row["cgroup_ino"])
    leader = {"pid": row["pid"], "pidfd_ino": row["pidfd_ino"], "starttime": row["starttime"]} if row["pid"] else None
    since = row["starttime"] if row["starttime"] is not None else proc.wall_to_ticks(row["created_at"] - 1.0)
    return Target(run_id=row["run_id"], cell_id=row["cell_id"], place=place, leader=leader, token=row["token"],
                  since=since, tmpdir=row["tmpdir"], lock_path=row["lock_path"]), note, bystanders


class Reaped(Record):
    """What one stop did to one cell."""
    left: list = Factory(list)      # pids found when the stop began
    signalled: int = 0              # processes sent SIGTERM
    method: str | None = None       # how the tree was killed
    killed: list = Factory(list)    # processes killed one by one, each with its evidence (thorough/untracked)
    spared: list = Factory(list)    # look-alikes not touched, and why
    empty: bool = True              # verified: nothing of the cell is left alive
    error: str | None = None
    released: list = Factory(list)

    def kill_note(self) -> str | None:
        """The kill, in a line (cancel's report)."""
        if self.method == EVIDENCE_KILL:
            return f"pidfd SIGSTOP+SIGKILL of {len(self.killed)} process(es) on session + token evidence"
        return self.method


# -- evidence -------------------------------------------------------------------
def find(backend, t: Target, snap, ev=None, thorough: bool = False, exclude: tuple = ()) -> tuple[dict, list]:
    """(candidates {pid: {pid, comm, starttime, evidence, via, recheck}}, spared) of one
    cell in `snap`; `ev`: its linux.session.Evidence, when evidence counts (else the tree only)."""
    found: dict[int, dict] = {}
    spared: list[dict] = []

    def add(p, why, via, recheck):
        k = found.setdefault(p.pid, {"pid": p.pid, "comm": p.comm, "starttime": p.starttime, "evidence": [],
                                     "via": via, "recheck": []})
        k["via"] = "cgroup" if via == "cgroup" else k["via"]
        k["evidence"].append(why)
        k["recheck"].append(recheck)

    def alive(pid):  # a lookup per pid, not a dict of the whole host per cell (100 cells: ~100k entries)
        p = snap.procs.get(pid)
        return p if p is not None and p.state not in ("Z", "X") and pid not in exclude else None

    if thorough and t.has_tree:
        for pid in backend.members(t.place):
            p = alive(pid)
            if p is not None:
                add(p, f"member of the cell's cgroup {t.place.dir} (directory inode {t.place.inode} "
                               "matches the journal)", "cgroup", "cgroup")
    if ev is None:
        return found, spared
    leader = alive(ev.leader) if ev.leader is not None else None
    if thorough and leader is not None and ev.leader_ok:
        add(leader, f"journaled leader: boot id matches, {ev.leader_why}", "single", "leader")
    elif thorough and leader is not None and ev.leader_ok is False and leader.pid not in found:
        spared.append({"pid": leader.pid, "comm": leader.comm, "starttime": leader.starttime,
                       "reason": f"the journaled leader pid {leader.pid} is another process now: {ev.leader_why}; "
                                 "spared"})
    more, why_spared = ev.find(snap)
    for pid, k in more.items():
        for why, recheck in zip(k["evidence"], k["recheck"]):
            p = alive(pid)
            if p is not None:
                add(p, why, "single", recheck)
    spared.extend(s for s in why_spared if s["pid"] not in found)
    return found, spared


def public(cand: dict) -> dict:
    """A candidate as the receipts and the journal show it: without its recheck plan."""
    return {k: v for k, v in cand.items() if k != "recheck"}


class _Job:
    """One target's stop in progress: its evidence (when it counts) and its outcome."""

    def __init__(self, backend, t: Target, thorough: bool):
        self.t, self.r = t, Reaped()
        self.ev = _evidence(backend, t) if thorough or (not t.has_tree and not backend.trees) else None
        self.seen: set = set()

    def find(self, backend, snap, thorough, exclude) -> dict:
        if snap is None:
            return {}
        cands, spared = find(backend, self.t, snap, self.ev, thorough, exclude)
        for s in spared:
            if (s["pid"], s["reason"]) not in self.seen:
                self.seen.add((s["pid"], s["reason"]))
                self.r.spared.append(s)
        return cands

    def signal(self, backend, cands: dict, sig: int, refused: dict | None = None) -> dict[int, tuple[bool, str]]:
        """Each single candidate through its own pidfd, once its evidence is rechecked there;
        one that failed its check in `refused` (the SIGSTOP pass) is not ours to kill."""
        out = {}
        for c in cands.values():
            if c["via"] == "cgroup":
                continue
            if refused is not None and not refused[c["pid"]][0]:
                out[c["pid"]] = refused[c["pid"]]
                continue
            out[c["pid"]] = backend.signal_checked(c, sig, lambda fd, cand: backend.recheck(fd, cand, self.t.leader,
                                                                                           self.ev))
        return out


def _evidence(backend, t: Target):
    leader = t.leader or {}
    lpid = leader.get("pid")
    ok, why = (backend.leader_matches(lpid, leader.get("pidfd_ino"), leader.get("starttime")) if lpid
               else (None, ""))
    return session.Evidence(lpid, ok, t.token, t.since, why)


# -- stop -----------------------------------------------------------------------
def stop(backend, targets: list[Target], *, term: bool = False, grace: float = 0.0, until: float | None = None,
         thorough: bool = False, scope=None, exclude: tuple = (), on_plan=None, list_left: bool = True) -> list[Reaped]:
    """End every process of `targets`. `term`: SIGTERM first; then wait until they
    are gone or the grace period is over (`until`: a monotonic deadline instead);
    then kill rounds until a round finds nothing. `scope`: a run or agent place
    whose whole tree is these targets (one kill reaches them all). `on_plan(plans)`
    hears [(target, candidates)] before each round's kill (the janitor journals
    them). `exclude`: pids never touched (a leader the caller reaps itself).
    `list_left`: Reaped.left lists the tree's pids when the stop began; a caller that never reads
    it (cancel) says False: a tree of ~1,000 processes is not read and parsed before its kill."""
    jobs = [_Job(backend, t, thorough) for t in targets]
    scans = thorough or any(j.ev for j in jobs)
    snap = backend.snapshot(exclude) if scans else None
    found = {}
    for j in jobs:
        cands = found[j] = j.find(backend, snap, thorough, exclude)
        listed = backend.members(j.t.place) if j.t.has_tree and list_left else ()
        j.r.left = sorted(set(listed) | set(cands))
        if term:
            j.r.signalled += backend.signal(j.t.place, signal.SIGTERM) if j.t.has_tree else 0
            j.r.signalled += sum(ok for ok, _ in j.signal(backend, cands, signal.SIGTERM).values())
    if term:
        crashpoints.hit("cancel_grace")
    deadline = until if until is not None else time.monotonic() + (grace if term else 0.0)
    first = None
    if time.monotonic() < deadline:
        if not scans and jobs and all(j.t.has_tree for j in jobs):
            # trees only: the backend's wait for each (cgroup2: woken by the kernel when the tree
            # empties, not a back-off whose sleeps outlast it by up to 50 ms)
            for j in jobs:
                if not backend.wait_empty(j.t.place, max(0.0, deadline - time.monotonic())):
                    break
        else:
            backoff.until(lambda: not _busy(backend, jobs, thorough, exclude, scans), deadline, 0.002, 0.05)
    elif not term:
        # nothing was signalled and no time was given: the scan just taken is the first kill round's
        # (the same candidates it would find; the rounds after it scan again until one finds none)
        first = found
    _kill_rounds(backend, jobs, thorough, scope, exclude, on_plan, scans, first)
    return [j.r for j in jobs]


def term_leader(backend, t: Target) -> int:
    """SIGTERM to the cell's journaled leader alone (cancel with no grace period), through a pidfd rechecked
    against the leader's journaled identity (pidfd inode, start time), never by its pid alone: 1 when sent."""
    if not t.leader or not t.leader.get("pid"):
        return 0
    cand = {"pid": t.leader["pid"], "starttime": t.leader.get("starttime"), "recheck": ["leader"]}
    ok, _ = backend.signal_checked(cand, signal.SIGTERM, lambda fd, c: backend.recheck(fd, c, t.leader, None))
    return int(ok)


def _busy(backend, jobs, thorough, exclude, scans) -> bool:
    snap = backend.snapshot(exclude) if scans else None
    return any((j.t.has_tree and backend.populated(j.t.place)) or j.find(backend, snap, thorough, exclude)
               for j in jobs)


def _kill_rounds(backend, jobs, thorough, scope, exclude, on_plan, scans, first=None) -> None:
    """`first`: {job: candidates} of a scan taken just before (stop: nothing happened since), the
    first round's; every later round scans again."""
    pending = jobs
    for _ in range(KILL_ROUNDS if scans else 1):
        if first is not None:
            found, first = first, None
        else:
            snap = backend.snapshot(exclude) if scans else None
            found = {j: j.find(backend, snap, thorough, exclude) for j in pending}
        plans = [(j, cands, live) for j in pending
                 for cands, live in [(found[j], j.t.has_tree and backend.populated(j.t.place))] if cands or live]
        if not plans:
            return
        if on_plan is not None:
            on_plan([(j.t, cands) for j, cands, _ in plans])
        crashpoints.hit("cancel_frozen")
        trees = [j for j, _, live in plans if live]
        if scope is not None and trees and _covers(backend, scope, jobs):
            method = f"{backend.kill(scope)} on {scope.dir}"
            for j in trees:
                j.r.method = j.r.method or method
            trees = []
        for j in trees:
            try:
                j.r.method = j.r.method or backend.kill(j.t.place)
            except OSError as e:
                j.r.error = f"cannot kill the cgroup of cell {j.t.cell_id}: {e}"
        # SIGSTOP every single one first (none can fork or exec any more), then SIGKILL
        stopped = {j: j.signal(backend, cands, signal.SIGSTOP) for j, cands, _ in plans}
        sent = {j: j.signal(backend, cands, signal.SIGKILL, refused=stopped[j]) for j, cands, _ in plans}
        verify_by = time.monotonic() + VERIFY_TIMEOUT
        for j, cands, live in plans:
            _verify(backend, j, cands, live, sent[j], verify_by)
        if not scans:
            return  # the tree was killed and verified: a cgroup leaves nothing to scan for
        pending = [j for j, _, _ in plans if j.r.error is None]
    for j in pending:
        j.r.empty = False
        j.r.error = j.r.error or f"processes of cell {j.t.cell_id} still found after {KILL_ROUNDS} kill rounds"


def _verify(backend, j: _Job, cands: dict, live: bool, sent: dict, verify_by: float) -> None:
    r, t = j.r, j.t
    if live and not backend.wait_empty(t.place, max(0.0, verify_by - time.monotonic())):
        r.empty = False
        r.error = r.error or f"cell cgroup {t.place.dir} is still populated {VERIFY_TIMEOUT:g} s after the kill"
    for c in cands.values():
        rec = public(c)
        if c["via"] == "cgroup":
            rec["method"] = r.method or "none"
        else:
            ok, why = sent[c["pid"]]
            rec.update(method="pidfd_send_signal" if ok else "none", signal_note=why)
            if ok and not t.has_tree:
                r.method = r.method or EVIDENCE_KILL
        # wait, not a glance: a PID-namespace init leaves its cgroup before it has
        # finished dying (it first reaps its namespace, pid_namespaces(7))
        rec["verified_dead"] = _wait_dead(backend, c["pid"], c["starttime"], verify_by)
        r.killed.append(rec)
        if not rec["verified_dead"] and rec["method"] != "none":
            r.empty = False
            r.error = r.error or f"process {c['pid']} of cell {t.cell_id} still alive after the kill"


def _covers(backend, scope, jobs) -> bool:
    """Every cell directory under `scope` is one of ours (then one kill of the scope is exact)."""
    found = backend.cells_under(scope)
    return bool(found) and found <= {os.path.realpath(j.t.place.dir) for j in jobs if j.t.has_tree}


def _wait_dead(backend, pid: int, start: int, deadline: float) -> bool:
    return backoff.until(lambda: backend.dead(pid, start), deadline, 0.0005, 0.02)


class Tree:
    """A running cell's processes, for the supervisor's wait loop: SIGTERM now, kill now.

    `leader_fd`: the controller's pidfd of the unreaped leader (its pid, the
    cell's session id, cannot be reused meanwhile); the leader itself is
    signalled through it, the rest through the backend's tree or, without one,
    on evidence."""

    def __init__(self, backend, target: Target, leader_fd: int):
        self.backend, self.target, self.leader_fd = backend, target, leader_fd
        self.exclude = (target.leader["pid"],) if target.leader else ()

    def term(self, sig: int = signal.SIGTERM) -> None:
        if self.target.has_tree:
            self.backend.signal(self.target.place, sig)
            return
        pidfd.send(self.leader_fd, sig)
        job = _Job(self.backend, self.target, thorough=False)
        job.signal(self.backend, job.find(self.backend, self.backend.snapshot(self.exclude), False, self.exclude),
                   sig)

    def oom_kills(self) -> int | None:
        return self.backend.oom_kills(self.target.place) if self.target.has_tree else None

    def kill(self) -> str:
        if self.target.has_tree:
            return self.backend.kill(self.target.place)
        pidfd.send(self.leader_fd, signal.SIGKILL)
        stop(self.backend, [self.target], exclude=self.exclude)
        return EVIDENCE_KILL


PIDFD_SIGNAL_PROCESS_GROUP = 1 << 2  # linux/pidfd.h, Linux 6.9+


def signal_group(leader_fd: int, sig: int) -> bool:
    """`sig` to the process group of the process behind `leader_fd`, as a terminal would
    (a cell's leader leads its session and group). The pidfd pins the group's struct
    pid, so this never reaches another group that reused the number; False when no
    member is left. Before Linux 6.9: the leader alone."""
    try:
        signal.pidfd_send_signal(leader_fd, sig, None, PIDFD_SIGNAL_PROCESS_GROUP)
        return True
    except ProcessLookupError:
        return False
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
    return pidfd.send(leader_fd, sig)
# -- without a journal (issue 12 item 3: the kill switch works from what survives) ----
def live_under_root(backend) -> list[int]:
    """The pids under this state root's own cgroup root: every cell's, whoever started it."""
    root = backend.root()
    return backend.members(root) if root is not None else []


def kill_root(backend, grace: float) -> dict:
    """The kill switch when the journal cannot say which cells live: every process
    under this state root's own cgroup root (agnsup made that tree: all of it is
    cells) gets SIGTERM, then after `grace` the tree's kill, then it is verified
    empty. Without cgroups there is no such evidence: nothing is touched, and the
    result says so."""
    root = backend.root()
    if root is None and not backend.trees:
        return {"processes": 0, "kill": None, "empty": None,
                "note": "no cgroups on this host (ENV_BLOCKED: cgroup): without the journal no process can be "
                        "proven a cell's"}
    before = backend.members(root) if root is not None else []  # no tree under this state root: no cell lives
    if not before:
        return {"processes": 0, "kill": None, "empty": True, "note": ""}
    method, empty = backend.kill_place(root, grace, VERIFY_TIMEOUT)
    return {"processes": len(before), "kill": method, "empty": empty, "note": ""}


# -- release --------------------------------------------------------------------
def release(backend, t: Target) -> list[dict]:
    """Remove what the cell held: its cgroup directories, temp dir, worktree lock."""
    released: list[dict] = []
    if t.has_tree:
        crashpoints.hit("cleanup_before_rmdir")
        released += [{"kind": "cgroup", "path": d} for d in backend.remove(t.place)]
    if t.tmpdir and _remove_tree(t.tmpdir):
        released.append({"kind": "tmpdir", "path": t.tmpdir})
    if t.lock_fd is not None:
        locks.release(t.lock_path, t.lock_fd)
        released.append({"kind": "worktree_lock", "path": t.lock_path})
    else:
        rel = locks.remove_if_free(t.lock_path)
        if rel and "left" not in rel:
            released.append({**rel, "kind": "worktree_lock"})
    return released


def reap(backend, t: Target, **stop_options) -> Reaped:
    """stop, then release what the cell held (only once it is verified empty)."""
    r = stop(backend, [t], **stop_options)[0]
    if r.method:
        r.released.append({"kind": "kill", "method": r.method})
    if r.empty:
        r.released += release(backend, t)
    return r


def _remove_tree(path: str) -> bool:
    """Remove the temp dir `path` and all in it; False: there was none. An empty one (a cell with a /tmp of its own
    leaves its on-disk directory empty) goes in one rmdir, without a listing."""
    half = crashpoints.enabled("cleanup_tmp_half")
    if not half:
        try:
            os.rmdir(path)
            return True
        except FileNotFoundError:
            return False
        except OSError:
            pass  # not empty, or not a directory: removed below
    if not os.path.lexists(path):
        return False
    if half:
        # remove one entry, then die: the next reap must finish the job
        for name in os.listdir(path):
            p = os.path.join(path, name)
            fs.rmtree(p) if os.path.isdir(p) else os.unlink(p)
            break
        crashpoints.hit("cleanup_tmp_half")
    fs.rmtree(path)
    return True
