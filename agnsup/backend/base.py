"""The backend interface: what a `Place` is and the verbs every backend answers (the
Untracked backend is this base alone; backend/__init__.py chooses one per host).

The verbs (a `Place` is one cell's, agent's or run's place: a cgroup
backend's is a set of directories; an untracked backend's places have none,
and only `place`, `from_journal` and `usage` are asked of it):

    enter(run_helper)                           this process becomes a controller here (systemd: into the unit)
    place(run, agent, cell, limits) -> Place    where the cell will live (nothing created yet)
    create(place, limits) -> Place              make it and apply the limits (inode, what is in force)
    from_journal(paths, inode) -> (Place|None, note, bystanders)   only if provably the cell's
    scope(run, agent=None) -> Place             the run's or agent's place (one kill reaches all below)
    cells_under(scope) -> {dirs}                the cell directories below it
    clone_dir(place) -> path|None               the cgroup2 directory to be born in (clone3)
    attach(place, pid, born=False, alone=False) move a process in (0: the caller; born: in clone_dir already;
                                                alone: the caller, single-threaded, moves its one thread)
    members(place) / populated(place)           who is in the tree
    signal(place, sig) -> int                   every member, each through a checked pidfd
    kill(place) -> method                       the whole tree at once (or as close as the host allows)
    wait_empty(place, timeout) -> bool          verified empty (zombies count as gone)
    kill_place(place, grace) -> (method, empty) SIGTERM and the grace (if given), kill, verify (the base's)
    usage(place) -> dict                        resource use, for the receipt
    remove(place) -> [dirs]                     the directories, deepest first, and empty ancestors
    prune(place) -> [dirs]                      only the empty ones (cleanup of a run)

and the process evidence every backend shares (the reaper's view of /proc):
`snapshot()`, `signal_checked(cand, sig, recheck)`, `dead(pid, starttime)`.
"""
from __future__ import annotations

import os
import signal

from ..linux import cgroup, pidfd, proc, session
from ..util.record import Factory, Record


class Place(Record):
    """One cell's (or scope's) place in a backend: its cgroup directories, or none."""
    node: object = None                  # linux.cgroup.Node (hierarchy -> directory), None: no tree
    inode: int | None = None             # inode of the primary directory, once created
    limits: dict = Factory(dict)         # resource -> "v2:<dir>" | "v1:<dir>": what is in force
    missing: dict = Factory(dict)        # resource -> why not: asked for, not in force
    oom_fd: int | None = None            # v1: an eventfd the OOM killer signals

    @property
    def dir(self) -> str | None:
        """The directory membership is tracked and killed with (None: no tree)."""
        prim = self.node.primary if self.node is not None else None
        return prim[1] if prim else None

    def paths(self) -> dict:
        """What the journal and the receipt record: {hierarchy: directory} ({} without a tree)."""
        return self.node.as_dict() if self.node is not None else {}


class Backend:
    """What every backend has; the tree verbs are the cgroup backends' (backend/cgroups.py)
    and are called only for a Place with a node. This base is the Untracked backend's whole."""
    kind = "none"               # receipt isolation.cgroup_layout
    why = ""                    # what chose this backend here (choose(); agnsup doctor)
    tracking = "session+token"  # receipt isolation.tracking
    trees = False               # does a cell get a tree of its own (a cgroup)?
    env_blocked: tuple[str, ...] = ("ENV_BLOCKED: cgroup",)

    def enter(self, run_helper) -> None:
        """Make this process a controller of cells here (once, before its first cell). Only the
        systemd backend moves it (into agnsup's own unit); `run_helper(argv, timeout)` ->
        (rc, stdout, stderr) comes from process.helpers, the only spawner."""

    def place(self, run_id: str, agent_id: str, cell_id: str, limits: dict) -> Place:
        return Place()

    def from_journal(self, paths: dict | None, inode: int | None) -> tuple[Place | None, str, list[int]]:
        """(the journaled place if provably the cell's, a note, pids of a look-alike place)."""
        return None, "", []

    def usage(self, place: Place) -> dict:
        return {}

    def limit_fix(self, controller: str) -> str:
        """The fix a missing limit needs on this kind of host (doctor, the receipt's not_in_force)."""
        if os.environ.get("AGNSUP_CGROUP_LAYOUT") == "none" and cgroup.writable_here():
            return "unset AGNSUP_CGROUP_LAYOUT (it turns cgroups off)"
        if os.environ.get("AGNSUP_CGROUP_LAYOUT") == "none":
            # the image's entrypoint set it: nothing here is writable (a container on a hybrid or v1 host, an
            # unprivileged pod); unsetting it would change nothing
            return ("a writable cgroup2 of the container's own: --cgroupns=private on a pure cgroup v2 host, or "
                    "a Kubernetes node on pure cgroup v2 (docs/hosts.md)")
        if os.geteuid() != 0 and os.path.isdir("/run/systemd/system"):
            import pwd
            user = pwd.getpwuid(os.geteuid()).pw_name
            return (f"a systemd user manager for {user} (log in, or as root: loginctl enable-linger {user}); "
                    "agnsup then asks it for a scope with Delegate=yes")
        if os.geteuid() != 0:
            return ("a cgroup2 subtree delegated to this user: as root, mkdir it under the cgroup2 mount, chown it "
                    "and its cgroup.procs, cgroup.subtree_control, cgroup.threads, start agnsup inside it, and "
                    "name it in AGNSUP_CGROUP_BASE")
        return "a writable cgroup hierarchy (mount cgroup2), or a subtree delegated to agnsup (AGNSUP_CGROUP_BASE)"

    def limit_support(self) -> dict[str, str | None]:
        """{memory|pids|cpu: None when a cell's limit on it would be in force, else why not} (doctor)."""
        return {c: "no cgroup tree here" for c in ("memory", "pids", "cpu")}

    def limit_gaps(self, place: Place, limits: dict) -> list[str]:
        """Each limit `limits` asks for that `place` does not have in force, with why and the fix:
        no limit is ever reported that is not in force (receipt not_in_force, isolation.require)."""
        support = None
        out = []
        for c in cgroup.wanted_controllers(limits):
            if c in place.limits:
                continue
            why = place.missing.get(c)
            if why is None:
                support = self.limit_support() if support is None else support
                why = support.get(c) or "not applied"
            out.append(f"limit {c}: {why}; fix: {self.limit_fix(c)}")
        return out

    def describe(self, has_cgroup_kill: bool = True) -> str:
        """How this backend tracks and kills a cell's tree (agnsup doctor)."""
        return ("ENV_BLOCKED: cgroup: tracking session+token (the cell's session and process group, token + "
                "start time; stop then kill through pidfds until a scan finds none; weaker: no limits, no atomic "
                "tree kill, a process that leaves the session and clears its environment is not found)")

    def roots(self) -> dict:
        """agnsup's own directory per hierarchy for this state root (doctor, receipts)."""
        return {}

    def root(self) -> "Place | None":
        """This state root's own cgroup root, every cell below it (None: no cgroups here)."""
        return None

    def kill_place(self, place: Place, grace: float | None = None, verify: float = 10.0) -> tuple[str | None, bool]:
        """Every process in the tree of `place`, never one by pid alone: SIGTERM and up to `grace` s
        first (None: none), then the tree's kill if any is left; (kill method or None, verified empty
        within `verify` s). The reaper's kill switch and the purge of a private root both come here."""
        if grace is not None:
            self.signal(place, signal.SIGTERM)
            self.wait_empty(place, grace)
        method = self.kill(place) if self.populated(place) else None
        return method, self.wait_empty(place, verify)

    def hold(self) -> None:
        """This process is a controller of many cells: what their trees hang from may stay between them
        (backend/cgroups.py); nothing here."""

    def let_go(self) -> None:
        """The end of hold(): what it kept removed (the controller's close)."""

    def sweep_ancestors(self, journaled=None) -> list[str]:
        """The empty directories a killed controller's hold left, removed (the janitor); with `journaled(run_id,
        cell_id)`, the empty cell directories of cells no journal row names too (a dead controller's spares)."""
        return []

    def drop_unjournaled(self, run_id: str, journaled, agent_id: str | None = None) -> list[str]:
        """A run's (an agent's) cell directories no journal row names (a live Supervisor's spare), killed and removed
        (cancel, cleanup)."""
        return []

    def purge(self) -> list[str]:
        """Kill whatever is left under this state root's own cgroup root and remove it
        (a private root of the self-test or of a test, at its end). Returns what was there."""
        return []

    # -- process evidence (one /proc view, shared by every backend) ---------
    def snapshot(self, exclude: tuple = ()):
        return session.Snapshot.take(exclude=(os.getpid(), *exclude))

    def signal_checked(self, cand: dict, sig: int, recheck) -> tuple[bool, str]:
        """Signal one process through a pidfd, once `recheck(fd, cand)` -> (ok, why) holds."""
        return pidfd.signal_if(cand["pid"], sig, lambda fd: recheck(fd, cand))

    def dead(self, pid: int, starttime: int) -> bool:
        return proc.dead(pid, starttime)

    def leader_matches(self, pid: int, pidfd_ino: int | None, starttime: int | None) -> tuple[bool | None, str]:
        """Is `pid` the journaled leader? True, False (another process holds the number), None (gone)."""
        try:
            fd = pidfd.open(pid)
        except OSError:  # EINVAL: the number is a thread's now, so not the leader's
            return False, f"pid {pid} is a thread of another process"
        if fd is None:
            return None, f"pid {pid} is gone"
        try:
            return pidfd.matches(fd, pid, pidfd_ino, starttime)
        finally:
            os.close(fd)

    def recheck(self, fd: int, cand: dict, leader: dict | None, evidence) -> tuple[bool, str]:
        """After the pidfd is open: is it still the process the evidence found?"""
        if "leader" in cand["recheck"] and leader is not None:
            return pidfd.matches(fd, cand["pid"], leader.get("pidfd_ino"), leader.get("starttime"))
        return evidence.recheck(cand["pid"], cand)


class Untracked(Backend):
    """No writable cgroup hierarchy here (an unprivileged user without delegation, a
    container; or AGNSUP_CGROUP_LAYOUT=none): a cell has no tree of its own, so the
    reaper finds its processes on session + token + start-time evidence alone
    (linux/session.py), and no limit can be applied. Every verb is the base's."""
