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

import os
import signal
import stat
import time

from . import crashpoints
from .record import Factory, Record

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
    import json
    place, note, bystanders = backend.from_journal(json.loads(row["cgroup"]) if row["cgroup"] else None,
                                                   row["cgroup_ino"])
    leader = {"pid": row["pid"], "pidfd_ino": row["pidfd_ino"], "starttime": row["starttime"]} if row["pid"] else None
    from .linux import proc
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
def _uses_evidence(backend, t: Target, thorough: bool) -> bool:
    return thorough or (not t.has_tree and not backend.trees)


def _evidence(backend, t: Target):
    from .linux import session
    leader = t.leader or {}
    lpid = leader.get("pid")
    ok, why = (backend.leader_matches(lpid, leader.get("pidfd_ino"), leader.get("starttime")) if lpid
               else (None, ""))
    return session.Evidence(lpid, ok, t.token, t.since, why)


def find(backend, t: Target, snap, thorough: bool = False, exclude: tuple = ()) -> tuple[dict, list]:
    """(candidates {pid: {pid, comm, starttime, evidence, via, recheck}}, spared) for one cell."""
    found: dict[int, dict] = {}
    spared: list[dict] = []

    def add(pid, comm, start, why, via, recheck):
        if pid in exclude:
            return
        k = found.setdefault(pid, {"pid": pid, "comm": comm, "starttime": start, "evidence": [], "via": via,
                                   "recheck": []})
        if via == "cgroup":
            k["via"] = "cgroup"
        k["evidence"].append(why)
        k["recheck"].append(recheck)

    if thorough and t.has_tree:
        for pid in backend.members(t.place):
            p = snap.procs.get(pid)
            if p is not None and p.state not in ("Z", "X"):
                add(pid, p.comm, p.starttime, f"member of the cell's cgroup {t.place.dir} (directory inode "
                                              f"{t.place.inode} matches the journal)", "cgroup", "cgroup")
    if not _uses_evidence(backend, t, thorough):
        return found, spared
    ev = _evidence(backend, t)
    lpid = ev.leader
    if lpid and thorough:
        p = snap.procs.get(lpid)
        if ev.leader_ok and p is not None and p.state not in ("Z", "X"):
            add(lpid, p.comm, p.starttime, f"journaled leader: boot id matches, {ev.leader_why}", "single", "leader")
        elif ev.leader_ok is False and lpid not in found and p is not None and p.state not in ("Z", "X"):
            spared.append(_spared(p, f"the journaled leader pid {lpid} is another process now: {ev.leader_why}; "
                                     "spared"))
    more, why_spared = ev.find(snap)
    for pid, k in more.items():
        for why, recheck in zip(k["evidence"], k["recheck"]):
            add(pid, k["comm"], k["starttime"], why, "single", recheck)
    spared.extend(s for s in why_spared if s["pid"] not in found)
    return found, spared


def _spared(p, reason: str) -> dict:
    return {"pid": p.pid, "comm": p.comm, "starttime": p.starttime, "reason": reason}


def _signal_each(backend, cands: list[tuple[Target, dict]], sig: int, evidence_of: dict,
                 refused: dict | None = None) -> dict[int, tuple[bool, str]]:
    """Signal each candidate through its own pidfd once its evidence is rechecked there.
    `refused`: an earlier pass's answers; a candidate that failed its check then is skipped."""
    out = {}
    for t, c in cands:
        if refused is not None and not refused.get(c["pid"], (True,))[0]:
            out[c["pid"]] = refused[c["pid"]]  # it failed its check at SIGSTOP: not ours to kill
            continue
        ev = evidence_of[id(t)]
        out[c["pid"]] = backend.signal_checked(c, sig, lambda fd, cand: backend.recheck(fd, cand, t.leader, ev))
    return out


# -- stop -----------------------------------------------------------------------
def stop(backend, targets: list[Target], *, term: bool = False, grace: float = 0.0, until: float | None = None,
         thorough: bool = False, scope=None, exclude: tuple = (), on_plan=None) -> list[Reaped]:
    """End every process of `targets`. `term`: SIGTERM first; then wait until they
    are gone or the grace period is over (`until`: a monotonic deadline instead);
    then kill rounds until a round finds nothing. `scope`: a run or agent place
    whose whole tree is these targets (one kill reaches them all). `on_plan(plans)`
    hears [(target, candidates)] before each round's kill (the janitor journals
    them). `exclude`: pids never touched (a leader the caller reaps itself)."""
    out = [Reaped() for _ in targets]
    if not targets:
        return out
    evidence_of = {id(t): _evidence(backend, t) for t in targets if _uses_evidence(backend, t, thorough)}
    snap = backend.snapshot(exclude) if evidence_of else None
    found = [find(backend, t, snap, thorough, exclude) if id(t) in evidence_of or thorough else ({}, [])
             for t in targets]
    for r, t, (cands, spared) in zip(out, targets, found):
        r.left = sorted(set(backend.members(t.place) if t.has_tree else []) | set(cands))
        r.spared.extend(spared)
    if term:
        for r, t, (cands, _) in zip(out, targets, found):
            if t.has_tree:
                r.signalled += backend.signal(t.place, signal.SIGTERM)
        sent = _signal_each(backend, [(t, c) for t, (cands, _) in zip(targets, found) for c in cands.values()
                                      if c["via"] != "cgroup"], signal.SIGTERM, evidence_of)
        for r, (cands, _) in zip(out, found):
            r.signalled += sum(1 for pid in cands if pid in sent and sent[pid][0])
        crashpoints.hit("cancel_grace")
    deadline = until if until is not None else time.monotonic() + (grace if term else 0.0)
    _wait_quiet(backend, targets, deadline, thorough, exclude, evidence_of)
    _kill_rounds(backend, targets, out, thorough, scope, exclude, on_plan, evidence_of)
    return out


def _quiet(backend, targets, thorough, exclude, evidence_of) -> bool:
    snap = backend.snapshot(exclude) if evidence_of else None
    for t in targets:
        if t.has_tree and backend.populated(t.place):
            return False
        if id(t) in evidence_of and find(backend, t, snap, thorough, exclude)[0]:
            return False
    return True


def _wait_quiet(backend, targets, deadline, thorough, exclude, evidence_of) -> None:
    delay = 0.002
    while time.monotonic() < deadline and not _quiet(backend, targets, thorough, exclude, evidence_of):
        time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
        delay = min(delay * 2, 0.05)


def _kill_rounds(backend, targets, out, thorough, scope, exclude, on_plan, evidence_of) -> None:
    pending = list(range(len(targets)))
    seen_spared: list[set] = [{(s["pid"], s["reason"]) for s in r.spared} for r in out]
    for _ in range(KILL_ROUNDS if evidence_of or thorough else 1):
        snap = backend.snapshot(exclude) if evidence_of or thorough else None
        plans = []
        for i in pending:
            t = targets[i]
            cands, spared = find(backend, t, snap, thorough, exclude) if snap is not None else ({}, [])
            for s in spared:
                if (s["pid"], s["reason"]) not in seen_spared[i]:
                    seen_spared[i].add((s["pid"], s["reason"]))
                    out[i].spared.append(s)
            live_tree = t.has_tree and backend.populated(t.place)
            if cands or live_tree:
                plans.append((i, cands, live_tree))
        if not plans:
            return
        if on_plan is not None:
            on_plan([(targets[i], cands) for i, cands, _ in plans])
        crashpoints.hit("cancel_frozen")
        trees = [i for i, _, live in plans if live]
        if scope is not None and trees and _covers(backend, scope, targets):
            method = f"{backend.kill(scope)} on {scope.dir}"
            for i in trees:
                out[i].method = out[i].method or method
        else:
            for i in trees:
                try:
                    m = backend.kill(targets[i].place)
                except OSError as e:
                    out[i].error = f"cannot kill the cgroup of cell {targets[i].cell_id}: {e}"
                    continue
                out[i].method = out[i].method or m
        # SIGSTOP every single first (none can fork or exec any more), then SIGKILL
        singles = [(targets[i], c) for i, cands, _ in plans for c in cands.values() if c["via"] != "cgroup"]
        stopped = _signal_each(backend, singles, signal.SIGSTOP, evidence_of)
        sent = _signal_each(backend, singles, signal.SIGKILL, evidence_of, refused=stopped)
        verify_by = time.monotonic() + VERIFY_TIMEOUT
        for i, cands, live in plans:
            r, t = out[i], targets[i]
            if live and not backend.wait_empty(t.place, max(0.0, verify_by - time.monotonic())):
                r.empty = False
                r.error = r.error or f"cell cgroup {t.place.dir} is still populated {VERIFY_TIMEOUT:g} s after the kill"
            for c in cands.values():
                rec = {k: v for k, v in c.items() if k != "recheck"}
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
        pending = [i for i, _, _ in plans if out[i].error is None]
        if not evidence_of and not thorough:
            return
    for i in pending:
        out[i].empty = False
        out[i].error = out[i].error or (f"processes of cell {targets[i].cell_id} still found after "
                                        f"{KILL_ROUNDS} kill rounds")


def _covers(backend, scope, targets) -> bool:
    """Every cell directory under `scope` is one of `targets` (then one kill of the scope is exact)."""
    found = backend.cells_under(scope)
    ours = {os.path.realpath(t.place.dir) for t in targets if t.has_tree}
    return bool(found) and found <= ours


def _wait_dead(backend, pid: int, start: int, deadline: float) -> bool:
    delay = 0.0005
    while not backend.dead(pid, start):
        if time.monotonic() >= deadline:
            return False
        time.sleep(delay)
        delay = min(delay * 2, 0.02)
    return True


class Tree:
    """A running cell's processes, for the supervisor's wait loop: SIGTERM now, kill now.

    `leader_fd`: the controller's pidfd of the unreaped leader (its pid, the
    cell's session id, cannot be reused meanwhile); the leader itself is
    signalled through it, the rest through the backend's tree or, without one,
    on evidence."""

    def __init__(self, backend, target: Target, leader_fd: int):
        self.backend, self.target, self.leader_fd = backend, target, leader_fd
        self.exclude = (target.leader["pid"],) if target.leader else ()

    def term(self) -> None:
        from .linux import pidfd
        if self.target.has_tree:
            self.backend.signal(self.target.place, signal.SIGTERM)
            return
        pidfd.send(self.leader_fd, signal.SIGTERM)
        t = self.target
        cands, _ = find(self.backend, t, self.backend.snapshot(self.exclude), exclude=self.exclude)
        _signal_each(self.backend, [(t, c) for c in cands.values()], signal.SIGTERM, {id(t): _evidence(self.backend, t)})

    def oom_kills(self) -> int | None:
        return self.backend.oom_kills(self.target.place) if self.target.has_tree else None

    def kill(self) -> str:
        from .linux import pidfd
        if self.target.has_tree:
            return self.backend.kill(self.target.place)
        pidfd.send(self.leader_fd, signal.SIGKILL)
        stop(self.backend, [self.target], exclude=self.exclude)
        return EVIDENCE_KILL


# -- release --------------------------------------------------------------------
def release(backend, t: Target) -> list[dict]:
    """Remove what the cell held: its cgroup directories, temp dir, worktree lock."""
    from . import locks
    released: list[dict] = []
    if t.has_tree:
        crashpoints.hit("cleanup_before_rmdir")
        released += [{"kind": "cgroup", "path": d} for d in backend.remove(t.place)]
    if t.tmpdir and os.path.lexists(t.tmpdir):
        _remove_tree(t.tmpdir)
        released.append({"kind": "tmpdir", "path": t.tmpdir})
    if t.lock_fd is not None:
        locks.release(t.lock_path, t.lock_fd)
        released.append({"kind": "worktree_lock", "path": t.lock_path})
    else:
        rel = release_lock_file(t.lock_path)
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


def _remove_tree(path: str) -> None:
    if crashpoints.enabled("cleanup_tmp_half"):
        # remove one entry, then die: the next reap must finish the job
        for name in os.listdir(path):
            p = os.path.join(path, name)
            rmtree(p) if os.path.isdir(p) else os.unlink(p)
            break
        crashpoints.hit("cleanup_tmp_half")
    rmtree(path)


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def rmtree(path: str) -> None:
    """Remove `path` and everything below it; errors are ignored (what is left, the next reap removes).

    shutil.rmtree costs ~9 ms of imports on every cell. This does the same as
    its fd-based variant: every directory is opened relative to its parent
    with O_NOFOLLOW, so a symlink the cell planted in its /tmp is unlinked,
    never followed out of the tree."""
    try:
        st = os.lstat(path)
    except OSError:
        return
    if not stat.S_ISDIR(st.st_mode):
        try:
            os.unlink(path)
        except OSError:
            pass
        return
    try:
        fd = os.open(path, _DIR_FLAGS)
    except OSError:
        return
    try:
        _empty_dir(fd)
    finally:
        os.close(fd)
    try:
        os.rmdir(path)
    except OSError:
        pass


def _empty_dir(top: int) -> None:
    """Empty the directory open as `top`, depth first, without recursion (a cell
    can nest directories deeper than Python's recursion limit)."""
    stack = [(top, _entries(top), "")]  # (dir fd, its entries left, its name in the parent)
    try:
        _drain(stack)
    finally:
        for fd, _, _ in stack[1:]:
            os.close(fd)


def _drain(stack: list) -> None:
    while stack:
        fd, entries, name = stack[-1]
        entry = next(entries, None)
        if entry is None:
            stack.pop()
            if stack:
                os.close(fd)
                try:
                    os.rmdir(name, dir_fd=stack[-1][0])
                except OSError:
                    pass
            continue
        try:
            is_dir = entry.is_dir(follow_symlinks=False)
        except OSError:
            is_dir = False
        if not is_dir:
            try:
                os.unlink(entry.name, dir_fd=fd)
            except OSError:
                pass
            continue
        try:
            sub = os.open(entry.name, _DIR_FLAGS, dir_fd=fd)
        except OSError:
            continue  # e.g. out of fds at a great depth: left for the next reap
        stack.append((sub, _entries(sub), entry.name))


def _entries(fd: int):
    try:
        with os.scandir(fd) as it:
            return iter(list(it))
    except OSError:
        return iter(())


def release_lock_file(path: str | None) -> dict | None:
    """Remove a lock file nobody holds any more (a dead controller's worktree or
    liveness lock). A lock some live process still holds is left alone: it is
    theirs too. Returns what was released, or None."""
    import fcntl
    if not path:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return {"kind": "lock", "path": path, "left": "held by a live process"}
        try:
            if os.fstat(fd).st_ino != os.stat(path).st_ino:
                return None  # already unlinked and recreated by someone else: not ours
        except FileNotFoundError:
            return None
        os.unlink(path)
        return {"kind": "lock", "path": path}
    finally:
        os.close(fd)
