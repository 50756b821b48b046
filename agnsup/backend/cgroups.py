"""The cgroup backends: a cell is a directory `run-R/agent-A/cell-C` in each hierarchy used.

agnsup owns one directory per hierarchy, `agnsup-<digest of the state root>`
(linux/cgroup.py: base_node), and never writes a cgroup it did not create.
The three kinds differ in how a tree dies:

- Cgroup2 (pure v2, or hybrid: v2 for tracking, v1 memory/pids/cpu for limits):
  one write to `cgroup.kill` (Linux 5.14); on older kernels SIGKILL every member
  until the directory is empty;
- Cgroup1: the freezer. Freeze, wait until the kernel says FROZEN (nothing can
  fork between our read of the members and the kill), SIGKILL each member, and
  thaw in every case: a frozen v1 task cannot die until thawed.

Which limit goes to which hierarchy is one pure function (linux/cgroup.py:
limit_writes); `create` reports only what is really in force.
"""
from __future__ import annotations

import errno
import os
import signal
import time
from contextlib import suppress

from .base import Backend, Place
from ..util import backoff
from ..linux import cgroup, delegation, pidfd, proc

CONTROLLERS = tuple(cgroup.V2_LIMIT_CONTROLLERS)  # memory, pids, cpu: what a limit needs
FREEZE_TIMEOUT = 2.0  # how long a v1 freezer may take to report FROZEN before we kill anyway


SIGNAL_BATCH = 256    # pidfds held at once by signal() (a process may start with RLIMIT_NOFILE 1024)
ZOMBIE_CHECK = 0.05   # s without a change of cgroup.events before wait_empty looks for a tree of zombies
# How long a controller of many cells (hold) keeps an agent's directories, and those above them, after that agent's
# last cell ended. They are empty directories (no process, no limit of their own), so longer than a pod's linger
# (pod.LINGER, which keeps a keeper process): an agent's next call usually comes within seconds, and one that comes
# later pays their mkdirs again (~0.35 ms on a hybrid host), nothing more.
HOLD_IDLE = 10.0


class CgroupBackend(Backend):
    env_blocked = ()
    trees = True
    _held: "_Held | None" = None  # hold(): a controller of many cells keeps what its cells hang from

    def __init__(self, layout, state_root: str):
        self.layout = layout
        self.kind = layout.kind
        self.base = cgroup.base_node(layout, state_root)
        self.tracking = self.base.primary[0] if self.base.primary else "none"

    def hold(self) -> None:
        """This process is a controller of many cells (the Supervisor): a cell's end removes the cell's own
        directories only; its agent's, its run's and the base directory, in every hierarchy, stay while the agent's
        cells keep coming, so the next cell makes one directory per hierarchy, not four (a hybrid host: 4 mkdir a
        cell instead of 14, and 4 rmdir instead of 15). They go when the agent had no cell end for HOLD_IDLE s, or at
        let_go (the controller's close); a controller killed meanwhile leaves them empty, to the janitor's sweep
        (sweep_ancestors). `agnsup run` (one cell) does not hold: its cell's end removes them, as before."""
        if self._held is None:
            self._held = _Held(self._prune_from)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_held": None}  # a spawn request carries the backend (process/forkserver.py)

    def let_go(self) -> None:
        """The end of hold(): every directory it kept removed now, when empty (the controller's close)."""
        held, self._held = self._held, None
        if held is not None:
            held.close()

    def place(self, run_id: str, agent_id: str, cell_id: str, limits: dict) -> Place:
        return Place(node=cgroup.cell_node(self.base, run_id, agent_id, cell_id, limits))

    def create(self, place: Place, limits: dict) -> Place:
        """mkdir the run/agent/cell directories of `place` and apply the limits: the Place has the
        primary directory's inode, what is in force, what is missing and why, and an eventfd the v1
        OOM killer signals (or None). A directory that already exists for the cell is an error: a
        cell id is never reused within a run, and a recreated directory must not pass as ours."""
        paths = place.node.paths
        for p in paths.values():
            # held (a controller of many cells): the agent's directory is usually there, and the cell's mkdir
            # alone makes the cell (os.makedirs with exist_ok costs a failed mkdir when it exists); else made first
            parents = self._held is None
            for _ in range(5):
                # The run's and agent's directories are shared: the cleanup of a neighbour cell that just
                # ended (or the janitor's sweep) may rmdir them, empty, under us: makedirs then fails with
                # ENOENT, or with EEXIST when it vanished between its mkdir and its isdir check, or the
                # cell's mkdir with ENOENT. Each time: make them again.
                if parents:
                    with suppress(FileNotFoundError, FileExistsError):
                        os.makedirs(os.path.dirname(p), exist_ok=True)
                try:
                    os.mkdir(p)  # EEXIST here is the cell's own directory: never ours, raised
                    break
                except FileNotFoundError:
                    parents = True
            else:
                raise OSError(errno.ENOENT, f"cannot create cgroup {p}", p)
        v2 = paths.get("v2")
        wanted = tuple(cgroup.wanted_controllers(limits))
        v2_ctrl, why = [], {}
        if v2 and wanted:
            chain = [self.base.paths["v2"], os.path.dirname(os.path.dirname(v2)), os.path.dirname(v2)]
            v2_ctrl, why = cgroup.enable_controllers(chain, wanted)
        applied = cgroup.apply_limits(paths, v2_ctrl, limits)
        missing = {c: why.get(c, f"no cgroup hierarchy here holds {c} limits") for c in wanted if c not in applied}
        oom_fd = _v1_oom_eventfd(paths["memory"]) if applied.get("memory", "").startswith("v1:") else None
        return Place(node=place.node, inode=os.stat(place.dir).st_ino if place.dir else None, limits=applied,
                     missing=missing, oom_fd=oom_fd)

    def limit_fix(self, controller: str) -> str:
        v2 = self.base.paths.get("v2")
        if v2 is None:
            return f"mount the v1 {controller} hierarchy writable for agnsup"
        return (f"echo +{controller} > {os.path.dirname(v2)}/cgroup.subtree_control (as its owner), "
                "or run agnsup in a systemd unit with Delegate=yes")

    def limit_support(self) -> dict[str, str | None]:
        have = self._limit_controllers()
        return {c: None if c in have else self._not_supported(c) for c in CONTROLLERS}

    def _limit_controllers(self) -> list[str]:
        """Where a limit can go: a v1 hierarchy of agnsup's own, or the v2 controllers the parent
        of agnsup's v2 directory hands down (its cgroup.subtree_control; not ours to write)."""
        v2 = self.base.paths.get("v2")
        return [*self.base.paths, *(delegation.controllers(os.path.dirname(v2))[1] if v2 else [])]

    def _not_supported(self, c: str) -> str:
        """Why a cell's limit on controller `c` would not be in force here."""
        v2 = self.base.paths.get("v2")
        if v2 is None:
            return f"no {c} hierarchy is writable here"
        return (f"the cgroup2 controller {c!r} is not enabled for agnsup's directory "
                f"({os.path.dirname(v2)}/cgroup.subtree_control lacks +{c})")

    def from_journal(self, paths: dict | None, inode: int | None) -> tuple[Place | None, str, list[int]]:
        """The journaled place if its directory is provably the cell's: (place or None,
        a note for the receipt, pids in a directory at that path that is *not* the cell's).
        A directory recreated at the same path (another inode) is not the cell's."""
        place = Place(node=cgroup.Node(paths or {}))
        path = place.dir
        if path is None:
            return None, "no cgroup journaled for the cell", []
        try:
            ino = os.stat(path).st_ino
        except FileNotFoundError:
            # the other hierarchies may remain (a crash between two rmdirs): empty ones are still ours
            rest = {h: p for h, p in place.node.paths.items() if h != place.node.primary[0] and os.path.isdir(p)}
            return (Place(node=cgroup.Node(rest)) if rest else None), \
                f"cgroup {path} does not exist (not yet made, or already removed)", []
        if inode is None:
            if self.populated(place):
                return None, (f"cgroup {path} has no journaled inode and is populated: membership proves nothing; "
                              "not touched"), cgroup.procs(path)
            return place, f"cgroup {path} has no journaled inode (it was not yet recorded) and is empty", []
        if ino != inode:
            return None, (f"cgroup {path} was recreated (inode {ino}, journaled {inode}): nothing of the cell can "
                          "be in it; not touched"), cgroup.procs(path)
        return Place(node=place.node, inode=ino), "", []

    def scope(self, run_id: str, agent_id: str | None = None) -> Place:
        return Place(node=cgroup.scope_node(self.base, run_id, agent_id))

    def cells_under(self, scope: Place) -> set[str]:
        """The cell directories below a run or agent directory (real paths)."""
        top = scope.dir
        depth = 1 if os.path.basename(top).startswith("agent-") else 2
        out = set()
        for d in cgroup.walk(top):
            rel = os.path.relpath(d, top)
            if rel != "." and rel.count("/") == depth - 1:
                out.add(os.path.realpath(d))
        return out

    def clone_dir(self, place: Place) -> str | None:
        """The cgroup2 directory a child can be born in (clone3 CLONE_INTO_CGROUP), if any."""
        return place.node.paths.get("v2")

    def attach(self, place: Place, pid: int, born: bool = False, alone: bool = False) -> None:
        """Move `pid` (0: the caller) into the place; `born`: it was born in clone_dir's hierarchy. `alone`: the
        caller moves itself (pid 0) and has one thread (a child just forked): in a v1 hierarchy it writes `tasks`,
        moving its one thread, which is the whole process. The kernel moves a thread that moves itself without
        its global cgroup_threadgroup_rwsem (cgroup_procs_write_start: "If we migrate a single thread, we don't
        care about threadgroup stability"), so without the RCU grace period the first cgroup.procs write after
        an idle spell waits for (issue 29: 0.13 against 7.7 ms here). v2 refuses a thread across domains
        (EOPNOTSUPP): its cgroup.procs stays."""
        for h, p in place.node.paths.items():
            if not (born and h == "v2"):
                name = "tasks" if alone and pid == 0 and h != "v2" else "cgroup.procs"
                cgroup.write(os.path.join(p, name), str(pid))

    def members(self, place: Place) -> list[int]:
        return cgroup.procs(place.dir) if place.dir else []

    def populated(self, place: Place) -> bool:
        prim = place.node.primary
        if prim is None:
            return False
        h, path = prim
        if h == "v2":
            try:
                for line in cgroup.read(os.path.join(path, "cgroup.events")).splitlines():
                    if line.startswith("populated "):
                        return line.split()[1] == "1"
            except (FileNotFoundError, OSError) as e:
                # ENOENT, or ENODEV from a directory being removed under us (its
                # controller concluded the cell while we looked): gone means empty
                if isinstance(e, FileNotFoundError) or e.errno == errno.ENODEV:
                    return False
                raise
        return bool(cgroup.procs(path))

    def signal(self, place: Place, sig: int) -> int:
        """Send `sig` to every process in the tree, each through a pidfd.

        Membership is rechecked after the pidfds are open: a pid is signalled only when
        the tree still lists it while its pidfd pins the process, so a pid that was reused
        by a process outside the tree between the first read and the open is skipped (its
        number is not listed, unless that very process joined the tree). One re-read of
        cgroup.procs per batch of pidfds, not a /proc/PID/cgroup per process (1,000
        processes: ~1,000 file reads fewer)."""
        prim = place.node.primary
        if prim is None:
            return 0
        pids = cgroup.procs(prim[1])
        sent = 0
        for i in range(0, len(pids), SIGNAL_BATCH):
            fds: dict[int, int] = {}
            try:
                for pid in pids[i:i + SIGNAL_BATCH]:
                    try:
                        fd = pidfd.open(pid)
                    except OSError:  # EINVAL: the number is a thread's now, not a process of the tree
                        continue
                    if fd is not None:
                        fds[pid] = fd
                if not fds:
                    continue
                members = set(cgroup.procs(prim[1]))
                for pid, fd in fds.items():
                    if pid in members and pidfd.send(fd, sig):
                        sent += 1
            finally:
                for fd in fds.values():
                    os.close(fd)
        return sent

    def kill(self, place: Place) -> str:
        path = place.dir
        if path is None:
            return "none"
        if not os.path.isdir(path):
            return "gone"
        return self._kill(place, path)

    def _kill(self, place: Place, path: str) -> str:
        if cgroup.write_kill(path):
            return "cgroup.kill"
        # no cgroup.kill (Linux < 5.14): no atomic kill, repeat until a scan finds none
        for _ in range(100):
            if self.signal(place, signal.SIGKILL) == 0:
                break
        return "signal-loop"

    def wait_empty(self, place: Place, timeout: float) -> bool:
        """Verified empty: zombies count as gone. A cgroup2 directory says so itself: its
        cgroup.events reads `populated 0`, and the kernel wakes a poll(2) on that file when it
        changes, so the wait ends when the tree does (no sleep to outlast); a v1 one is polled."""
        deadline = time.monotonic() + timeout
        prim = place.node.primary
        if prim is not None and prim[0] == "v2":
            done = self._wait_events(place, prim[1], deadline)
            if done is not None:
                return done
        return backoff.until(lambda: not self.populated(place) or self._only_zombies(place), deadline, 0.0005, 0.02)

    def _wait_events(self, place: Place, path: str, deadline: float) -> bool | None:
        """wait_empty through poll(2) on cgroup.events; None: not possible here (the caller polls)."""
        import select
        try:
            fd = os.open(os.path.join(path, "cgroup.events"), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return not os.path.isdir(path) or None  # the directory gone: empty
        except OSError as e:
            return True if e.errno == errno.ENODEV else None  # ENODEV: being removed, so empty
        try:
            poller = select.poll()
            poller.register(fd, select.POLLPRI | select.POLLERR)
            quiet = ZOMBIE_CHECK
            while True:
                try:
                    text = os.pread(fd, 4096, 0)  # the read re-arms the notification (kernfs)
                except OSError as e:
                    if e.errno == errno.ENODEV:
                        return True
                    raise
                if b"populated 0" in text:
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                if not poller.poll(max(1, int(min(left, quiet) * 1000))):
                    # no change for a while: a tree of zombies only counts as gone (a v2 zombie has
                    # normally left `populated` already), checked now and then, not on every wake
                    if self._only_zombies(place):
                        return True
                    quiet = min(quiet * 2, 0.5)
        finally:
            os.close(fd)

    def _only_zombies(self, place: Place) -> bool:
        # a tree being killed lists up to ~1,000 pids for tens of ms (issue 29's cancel): a look at the first one
        # listed says "not only zombies" without reading and parsing them all while the kernel kills the rest
        first = _first_pid(place.dir) if place.dir else None
        if first is not None and not proc.is_zombie(first):
            return False
        pids = self.members(place)
        return bool(pids) and all(proc.is_zombie(p) for p in pids)

    def usage(self, place: Place) -> dict:
        """Resource use the cgroup recorded, for the receipt (read before removal).

        Each counter is read on its own: a file one kernel lacks costs that
        counter only. Keys name the limit they bear on: oom_kills (memory),
        pids_max_events (pids), cpu_throttled_usec / cpu_nr_throttled (cpu)."""
        if place.node is None:
            return {}
        paths = place.node.paths
        out: dict = {}
        if "v2" in paths:
            for k, v in _keyed(os.path.join(paths["v2"], "cpu.stat")).items():
                if k in ("usage_usec", "user_usec", "system_usec", "throttled_usec", "nr_throttled"):
                    out["cpu_" + k] = v
        def events_max(path: str) -> int | None:
            return _keyed(path).get("max")
        for h, name, key, read_one in (("v2", "memory.peak", "memory_peak", _int),
                                       ("v2", "pids.events", "pids_max_events", events_max),
                                       ("memory", "memory.max_usage_in_bytes", "memory_max_usage", _int),
                                       ("memory", "memory.failcnt", "memory_failcnt", _int),
                                       ("pids", "pids.events", "pids_max_events", events_max)):
            if h in paths:
                v = read_one(os.path.join(paths[h], name))
                if v is not None:
                    out[key] = v
        if "cpu" in paths:
            st = _keyed(os.path.join(paths["cpu"], "cpu.stat"))
            if "nr_throttled" in st:
                out["cpu_nr_throttled"] = st["nr_throttled"]
                out["cpu_throttled_usec"] = st.get("throttled_time", 0) // 1000
        kills = self.oom_kills(place)
        if kills is not None:
            out["oom_kills"] = kills
        return out

    def oom_kills(self, place: Place) -> int | None:
        """How many processes the OOM killer took in the cell (None: not knowable here).

        v2 memory.events counts the subtree; v1 memory.oom_control has an oom_kill
        counter (Linux 4.13). Read before the cgroup is removed."""
        paths = place.node.paths
        for h, name in (("v2", "memory.events"), ("memory", "memory.oom_control")):
            kills = _keyed(os.path.join(paths[h], name)).get("oom_kill") if h in paths else None
            if kills is not None:
                return kills
        return None

    def remove(self, place: Place) -> list[str]:
        """rmdir the place's directories (and any sub-cgroups the cell made), deepest first, then the
        empty ones above it. Returns the directories removed below `place`. Missing directories are
        not an error: removal is idempotent."""
        removed = []
        for d in (d for p in place.node.paths.values() for d in self._rmdir_or_walk(p, removed)):
            for attempt in range(50):
                try:
                    os.rmdir(d)
                    removed.append(d)
                    break
                except FileNotFoundError:
                    break
                except OSError as e:
                    # EBUSY: the last task is still leaving (exit is asynchronous)
                    if e.errno != errno.EBUSY or attempt == 49:
                        raise
                    time.sleep(0.002)
        held = self._held
        if not (held is not None and _hangs_from_agent(place) and
                held.keep({h: os.path.dirname(p) for h, p in place.node.paths.items()})):
            self._prune_up(place)  # (a pod's place, run-R/pod-A: its teardown is the pod's end, pruned now)
        return removed

    @staticmethod
    def _rmdir_or_walk(path: str, removed: list[str]) -> list[str]:
        """`path` removed at once when it has no sub-cgroup and no task (a cell's directory, usually:
        no listing of its ~20-60 interface files); else its directories deepest first (cgroup.walk),
        for remove() to take one by one (EBUSY: a sub-cgroup, or a last task still leaving)."""
        try:
            os.rmdir(path)
        except FileNotFoundError:
            return []
        except OSError as e:
            if e.errno != errno.EBUSY:
                raise
            return cgroup.walk(path)
        removed.append(path)
        return []

    def prune(self, place: Place) -> list[str]:
        removed = [d for p in place.node.paths.values() for d in cgroup.walk(p) if cgroup.remove_if_empty(d)]
        self._prune_up(place)
        return removed

    def _prune_up(self, place: Place) -> None:
        """The agent, run and base directories above `place`, if now empty; never
        above our own base directory: what is above it is not ours."""
        self._prune_from({h: os.path.dirname(p) for h, p in place.node.paths.items()})

    def _prune_from(self, dirs: dict[str, str]) -> None:
        """Each directory of `dirs` ({hierarchy: path}) and those above it, while empty, up to our base."""
        for h, up in dirs.items():
            top = self.base.paths.get(h)
            while top and (up == top or up.startswith(top + "/")) and cgroup.remove_if_empty(up):
                up = os.path.dirname(up)

    def sweep_ancestors(self, journaled=None) -> list[str]:
        """The empty run and agent directories below this state root's own base, and the base, in every hierarchy,
        removed (the janitor): what a controller of many cells killed while it held them (hold) leaves, which no
        journaled cell names. Only directories by the names scope_node gives (`run-R`, `run-R/agent-A`): a pod's
        place is never touched, nor anything with a sub-cgroup or a process (rmdir(2) refuses them: EBUSY). A live
        controller's empty ones may go too: its next cell makes them again (create).
        `journaled(run_id, cell_id)`: with it, the empty cell directories (`run-R/agent-A/cell-C`) of cells it says
        no journal row names go too: a dead controller's spare cell (process/cellspare.py), whose leader died with
        it. Asked after the listing: a cell's directory is made after its intent row is committed, so one listed
        is named by then (a live controller's spare holds its leader: rmdir refuses it; one caught empty, between
        its mkdir and its leader's clone, is not made: the clone fails)."""
        removed = []
        for top in self.base.paths.values():
            for run in _named(top, "run-"):
                if journaled is not None:
                    run_id = os.path.basename(run)[len("run-"):]
                    removed += [d for _, cell_id, d in _cell_dirs(run)
                                if not journaled(run_id, cell_id) and cgroup.remove_if_empty(d)]
                removed += [d for d in _named(run, "agent-") if cgroup.remove_if_empty(d)]
                if cgroup.remove_if_empty(run):
                    removed.append(run)
            if cgroup.remove_if_empty(top):
                removed.append(top)
        return removed

    def drop_unjournaled(self, run_id: str, journaled, agent_id: str | None = None) -> list[str]:
        """The cell directories of run `run_id` (of its agent `agent_id` only, if given) that no journal row names
        (`journaled(run_id, cell_id)`, asked after the listing, as sweep_ancestors does): a live Supervisor's spare
        cell (process/cellspare.py), its parked leader killed (it never ran anything; its Supervisor discards it,
        dead) and its directories removed: a cancel of the run or agent then kills its scope in one write as
        before (reaper: _covers), and a cleanup of the run leaves none of its directories. Returns the directories
        removed."""
        found = {(a, c): None for top in self.base.paths.values()
                 for a, c, _ in _cell_dirs(os.path.join(top, f"run-{run_id}"), agent_id)}
        removed: list[str] = []
        for agent_id, cell_id in found:
            if journaled(run_id, cell_id):
                continue
            node = cgroup.scope_node(self.base, run_id, agent_id, cell_id)
            place = Place(node=cgroup.Node({h: p for h, p in node.paths.items() if os.path.isdir(p)}))
            with suppress(OSError):
                self.kill_place(place)
                removed += self.remove(place)
        return removed

    def roots(self) -> dict:
        return self.base.as_dict()

    def root(self) -> Place | None:
        present = {h: p for h, p in self.base.paths.items() if os.path.isdir(p)}
        return Place(node=cgroup.Node(present)) if present else None

    def purge(self) -> list[str]:
        found = []
        root = self.root()
        present = root.node.paths if root else {}
        for p in present.values():
            dirs = [d for d in cgroup.walk(p) if d != p]
            pids = cgroup.procs(p)
            if dirs or pids:
                found.append(f"{p}: {len(dirs)} dirs, pids {pids}")
        if root:
            self.kill_place(root)  # this state root's own cgroup root: ours
        for p in present.values():
            for d in cgroup.walk(p):
                try:
                    os.rmdir(d)
                except OSError as e:
                    found.append(f"could not remove {d}: {e.strerror}")
        return found


class Cgroup2(CgroupBackend):
    """cgroup v2 tracks and kills (cgroup.kill). Pure v2: every limit there too; a hybrid host
    (v2 at /sys/fs/cgroup/unified): memory, pids and cpu limits go to their v1 hierarchies
    (linux/cgroup.py: base_node, limit_writes); Hybrid below is this code under the hybrid host's name."""

    def describe(self, has_cgroup_kill: bool = True) -> str:
        return "cgroup v2 cgroup.kill" if has_cgroup_kill else "cgroup v2 membership, SIGKILL each member until empty"


class Hybrid(Cgroup2):
    """Cgroup2 on a hybrid host: the same code, named apart so that doctor says which host this is."""


class Cgroup1(CgroupBackend):
    """v1 only: the freezer hierarchy tracks, and makes the kill atomic."""

    def describe(self, has_cgroup_kill: bool = True) -> str:
        return "cgroup v1 freezer (freeze, wait for FROZEN, kill, thaw)" if "freezer" in self.base.paths else \
            "cgroup v1 membership, SIGKILL each member until empty"

    def _kill(self, place: Place, path: str) -> str:
        if "freezer" not in place.node.paths:
            return super()._kill(place, path)
        # freeze, and wait until the kernel reports FROZEN (not FREEZING): then nothing in the
        # tree can fork between our read of its members and the kill
        state = os.path.join(path, "freezer.state")
        try:  # from the first write on: whatever fails, the tree is thawed again
            cgroup.write(state, "FROZEN")
            frozen = backoff.until(lambda: cgroup.read(state).strip() == "FROZEN", time.monotonic() + FREEZE_TIMEOUT,
                                   0.001, 0.001)
            self.signal(place, signal.SIGKILL)
        finally:
            with suppress(FileNotFoundError):
                cgroup.write(state, "THAWED")  # a frozen v1 task cannot die until thawed
        return "freezer" if frozen else "freezer (never reached FROZEN: killed while freezing)"


class _Held:
    """A controller of many cells' hold on the directories its cells hang from (CgroupBackend.hold): per agent, its
    directory in each hierarchy, removed with those above it (when empty) HOLD_IDLE s after the agent's last cell
    ended, on one timer thread (util/deadlines.py). A removal racing a new cell of the agent is harmless: rmdir(2)
    refuses a directory with a cell in it, and create makes what vanished again."""

    def __init__(self, prune):
        from ..util.deadlines import Deadlines  # here: the fork server preloads this module and needs no threads
        self._prune = prune                 # {hierarchy: dir} -> None (CgroupBackend._prune_from)
        # agent directory (first hierarchy) -> {hierarchy: dir}
        self._due = Deadlines(lambda _, dirs: self._quietly(dirs), "agnsup-cgroup-hold")

    def keep(self, dirs: dict[str, str]) -> bool:
        """Keep `dirs` (a cell's agent directories) for HOLD_IDLE s more; False once closing (the caller prunes)."""
        if not dirs:
            return False
        return self._due.put(next(iter(dirs.values())), HOLD_IDLE, lambda old: {**(old or {}), **dirs})

    def close(self) -> None:
        for dirs in self._due.close().values():
            self._quietly(dirs)

    def _quietly(self, dirs: dict[str, str]) -> None:
        with suppress(OSError):
            self._prune(dirs)


def _hangs_from_agent(place: Place) -> bool:
    """A cell's place (`run-R/agent-A/cell-C`), not a pod's (`run-R/pod-A`)."""
    return bool(place.dir) and os.path.basename(os.path.dirname(place.dir)).startswith("agent-")


def _named(directory: str, prefix: str) -> list[str]:
    """The subdirectories of `directory` whose names start with `prefix` ([] if it is gone)."""
    try:
        return [os.path.join(directory, n) for n in os.listdir(directory) if n.startswith(prefix)]
    except OSError:
        return []


def _cell_dirs(run_dir: str, agent_id: str | None = None):
    """(agent id, cell id, directory) of each cell directory under a run's (`run-R/agent-A/cell-C`; of agent_id's
    only, if given)."""
    for agent in _named(run_dir, "agent-"):
        a = os.path.basename(agent)[len("agent-"):]
        if agent_id is None or a == agent_id:
            for cell in _named(agent, "cell-"):
                yield a, os.path.basename(cell)[len("cell-"):], cell


def for_layout(layout, state_root: str) -> CgroupBackend:
    return {"v2": Cgroup2, "hybrid": Hybrid, "v1": Cgroup1}[layout.kind](layout, state_root)


def _v1_oom_eventfd(memory_dir: str) -> int | None:
    """An eventfd the kernel signals when the OOM killer acts in this v1 memory
    cgroup (memory.oom_control notification, Documentation/admin-guide/cgroup-v1/memory.rst
    section 10): v1 has no memory.oom.group, so the controller kills the rest of
    the cell itself. None where the kernel lacks the interface."""
    efd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
    try:
        ofd = os.open(os.path.join(memory_dir, "memory.oom_control"), os.O_RDONLY | os.O_CLOEXEC)
        try:
            cgroup.write(os.path.join(memory_dir, "cgroup.event_control"), f"{efd} {ofd}")
        finally:
            os.close(ofd)
    except OSError:
        os.close(efd)
        return None
    return efd


def _keyed(path: str) -> dict[str, int]:
    """A flat-keyed cgroup file ("key value" per line) as a dict; {} if unreadable."""
    out: dict[str, int] = {}
    with suppress(OSError):
        for line in cgroup.read(path).splitlines():
            k, _, v = line.partition(" ")
            with suppress(ValueError):
                out[k] = int(v)
    return out


def _int(path: str) -> int | None:
    try:
        return int(cgroup.read(path))
    except (OSError, ValueError):
        return None


def _first_pid(path: str) -> int | None:
    """The first pid `path`'s own cgroup.procs lists (a read of 32 bytes: the kernel formats no more), or None."""
    try:
        fd = os.open(os.path.join(path, "cgroup.procs"), os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        head = os.read(fd, 32)
    except OSError:
        return None
    finally:
        os.close(fd)
    line, nl, _ = head.partition(b"\n")
    return int(line) if nl and line.isdigit() else None
