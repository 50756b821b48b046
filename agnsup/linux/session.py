"""A cell's processes without a cgroup: session, token and start-time evidence.

Where no cgroup hierarchy is writable (layout ``none``: an unprivileged user
without delegation, a container), a cell has no directory that holds its tree,
so its processes are found in one scan of /proc on evidence:

- **session**: the leader called setsid, so the cell's session id (and process
  group) is the leader's pid L. A process in session L that started inside
  the cell's life on this boot is a descendant that did not leave the session:
  a session is joined only by inheritance, and the number L cannot be reused
  while any process still belongs to session L (the kernel frees a pid number
  only when no task uses it as pid, process group or session). So when L is
  held right now by a process that is not the journaled leader, session L is
  somebody else's, and nobody in it is touched;
- **token + start time**: a process that called setsid again left the session;
  it is ours when the cell's token is in its environment AND it started inside
  the cell's life. The token alone is a hint (a process can copy it), and so
  is a start time alone.

Residual weakness, said in receipts and by `agnsup doctor`: a process that left
the session *and* cleared its environment is not found, and if the leader and
every member of its session ended, an unrelated process could take pid L,
start a new session L and end itself before the scan, leaving members that
would match (while it lives, its identity tells it apart). Cgroups have
neither gap.

The kill is the reaper's (agnsup/reaper.py): every signal through a pidfd
opened, then checked here (`Evidence.recheck`: the evidence still holds, not a
zombie); SIGSTOP every candidate first, so none can fork between the scan and
the kill, then SIGKILL; repeated until a scan finds none.
"""
from __future__ import annotations

from . import proc

TOKEN_VAR = "AGNSUP_CELL_TOKEN"  # the ownership token's name in a cell's environment (spec.py sets it)
TOKEN_KEY = TOKEN_VAR.encode() + b"="
TRACKING = "session+token"
BLOCKED = "ENV_BLOCKED: cgroup"


class Proc:
    """One line of a /proc snapshot."""
    __slots__ = ("pid", "comm", "state", "pgid", "sid", "starttime", "token")

    def __init__(self, pid, comm, state, pgid, sid, starttime, token):
        self.pid, self.comm, self.state, self.pgid, self.sid = pid, comm, state, pgid, sid
        self.starttime, self.token = starttime, token


def token_of(env: bytes | None) -> str | None:
    """The ownership token in a raw /proc/PID/environ, or None."""
    if not env:
        return None
    if env.startswith(TOKEN_KEY):
        i = len(TOKEN_KEY)
    else:
        k = env.find(b"\0" + TOKEN_KEY)
        if k < 0:
            return None
        i = k + 1 + len(TOKEN_KEY)
    j = env.find(b"\0", i)
    return env[i:j if j >= 0 else len(env)].decode(errors="replace")


def read_proc(pid: int) -> Proc | None:
    f = proc.fields(pid)  # (pid, comm, state, ppid, pgid, sid, starttime)
    return f and Proc(pid, f[1], f[2], f[4], f[5], f[6], token_of(proc.raw_environ(pid)))


class Snapshot:
    """Every process on the host, read once: stat and the ownership token.

    One snapshot serves every cell of a janitor round, so the cost is one
    /proc scan per round, not one per cell."""

    def __init__(self, procs: dict[int, Proc]):
        self.procs = procs
        self.by_token: dict[str, list[Proc]] = {}
        self.by_sid: dict[int, list[Proc]] = {}
        for p in procs.values():
            if p.token is not None:
                self.by_token.setdefault(p.token, []).append(p)
            self.by_sid.setdefault(p.sid, []).append(p)

    @classmethod
    def take(cls, exclude: tuple[int, ...] = ()) -> "Snapshot":
        out = {}
        for pid in proc.pids():
            if pid in exclude:
                continue
            p = read_proc(pid)
            if p is not None:
                out[pid] = p
        return cls(out)


class Evidence:
    """What ties a process to one cell outside a cgroup.

    leader: pid L (== the cell's session id and process group);
    leader_ok: True when L is the journaled leader (identity checked), False
    when another process holds L now (session L is not the cell's), None when
    no process holds L; lo: the cell's start, in clock ticks since boot."""

    def __init__(self, leader: int | None, leader_ok: bool | None, token: str | None, lo: int,
                 leader_why: str = ""):
        self.leader, self.leader_ok, self.token, self.lo, self.leader_why = leader, leader_ok, token, lo, leader_why

    def find(self, snap: Snapshot) -> tuple[dict[int, dict], list[dict]]:
        """(candidates {pid: {pid, comm, starttime, evidence, recheck}}, spared [{pid, comm, starttime, reason}])."""
        found: dict[int, dict] = {}
        spared: list[dict] = []

        def add(p: Proc, why: str, recheck: str) -> None:
            c = found.setdefault(p.pid, {"pid": p.pid, "comm": p.comm, "starttime": p.starttime, "evidence": [],
                                         "via": "single", "recheck": []})
            c["evidence"].append(why)
            c["recheck"].append(recheck)

        def spare(p: Proc, reason: str) -> None:
            spared.append({"pid": p.pid, "comm": p.comm, "starttime": p.starttime, "reason": reason})

        if self.token:
            for p in snap.by_token.get(self.token, ()):
                if p.state in ("Z", "X"):
                    continue
                if p.starttime >= self.lo:
                    add(p, f"ownership token matches and start time {p.starttime} is inside the cell's life "
                           f"(>= {self.lo}, this boot)", "token")
                else:
                    spare(p, f"ownership token matches but start time {p.starttime} is before the cell began "
                             f"({self.lo}): one piece of evidence is not enough, spared")
        if self.leader:
            for p in snap.by_sid.get(self.leader, ()):
                if p.state in ("Z", "X") or p.pid == self.leader:
                    continue  # the leader itself is judged by its identity, not by its session
                if p.pid in found and self.leader_ok is False:
                    continue  # found by token + start time; a reused session number vouches for nothing
                if self.leader_ok is False:
                    spare(p, f"in session {self.leader}, but pid {self.leader} is now another process "
                             f"({self.leader_why}): a new session with the same number, not the cell's; spared")
                elif p.starttime < self.lo:
                    spare(p, f"in session {self.leader} but start time {p.starttime} is before the cell began "
                             f"({self.lo}): spared")
                else:
                    group = f", process group {p.pgid}" if p.pgid == self.leader else ""
                    held = "held by the journaled leader" if self.leader_ok else \
                        "pinned by its members since the leader ended"
                    add(p, f"in the cell's session {self.leader}{group} (the number is {held}) and start time "
                           f"{p.starttime} is inside the cell's life (>= {self.lo}, this boot)", "session")
        return found, spared

    def recheck(self, pid: int, cand: dict) -> tuple[bool, str]:
        """After the pidfd is open: is it the same process, and does its evidence still hold?"""
        p = read_proc(pid)
        if p is None or p.starttime != cand["starttime"]:
            return False, f"pid {pid} changed between the scan and the signal: spared"
        if "session" in cand["recheck"] and p.sid == self.leader:
            return True, "rechecked through the pidfd: same start time, same session"
        if "token" in cand["recheck"] and p.token == self.token:
            return True, "rechecked through the pidfd: same start time, same token"
        return False, f"pid {pid} no longer carries the evidence it was found by: spared"
