"""The broker: identity, journal intent, locks, and the cell's life cycle.

A Controller is one controller instance: it holds an exclusive flock on
<state>/controllers/<id>.lock for its whole life (the janitor's proof of
liveness) and journals every cell it starts, in two phases: the intent row
before any kernel object exists, the identity before the command may exec.

    start(prepared)   lock the worktree, journal the intent (run quotas judged inside
                      that transaction), make the cell's place (backend), fork the leader
                      (process.leader), journal its identity, let it exec
    waiter(cell)      the wait loop (process.wait), stopping the cell's tree (reaper.Tree)
    finish(cell, w)   what is left of the tree after the leader is reaped (reaper), the
                      outcome, the receipt; fail(cell, error) for a cell that never ran

A one-cell controller (`agnsup run`, run_process) writes fewer transactions
for the same records: its own row rides in the cell's intent transaction
(its liveness lock is taken just before), and its end in the cell's
conclusion. What is durable when is unchanged (tests/test_crashpoints.py).
"""
from __future__ import annotations

import json
import os
import time

from . import crashpoints, locks, reaper
from .process import helpers, leader, wait
from .errors import AgnsupError, CancelledBeforeStart, Denied, RunNotActive, SetupError, StateError
from .linux import pidfd, proc
from .record import Factory, Record

# How long after the leader ended a cell that another process cancelled (it owns
# the grace period and the kill) is left to that process, beyond the grace itself.
CANCELLER_SLACK = 2.0


def stage(name: str, **info) -> dict:
    return {"stage": name, "t": time.time(), **info}


class Prepared(Record):
    """What the stages before the broker hand it (tool.prepare)."""
    plan: object
    decision: dict
    trail: list
    trace: list
    admit: object = None   # admit(usage) judges run quotas inside the intent transaction; raises Denied


class Cell(Record):
    spec: object
    plan: object
    controller_id: str
    boot_id: str
    decision: dict
    trail: list
    trace: list
    created_at: float = Factory(time.time)
    place: object = None         # backend.Place: planned at intent, made by the backend
    isolation: dict = Factory(dict)
    identity: dict = Factory(dict)
    started_at: float | None = None
    lock_fd: int | None = None
    lock_path: str | None = None
    child: object = None
    capture: bool = False
    stdin: bool = False          # fd 0 is a pipe (or the pty) the supervisor writes: `input`
    pty: dict | None = None      # {"cols", "rows"}: fds 0-2 and the controlling terminal are a pty
    stream: bool = False         # the pump keeps a Tape for read_output (implied by pty)
    pump: object = None          # output.Pump when the role caps output or the cell is live
    input: object = None         # output.Input: the supervisor's end of the cell's fd 0
    terminal: object = None      # output.Input on the pty's master (pty cells)
    controlling_tty: bool = False  # agnsup run at a terminal: the cell's pty is its controlling terminal
    egress: object = None        # egress.proxy.Proxy: allowlist/internal roles
    network: dict | None = None  # the receipt's network section, once the proxy stopped
    waiting: bool = False        # queued behind a held worktree lock (state waiting): Controller.resume starts it
    protect_start: tuple | None = None  # (protected paths' identities, lifted paths' digests) at start (protect.py)
    protected: dict | None = None       # the receipt's `protected` section, once the tree is dead
    cancelled_starting: str | None = None  # a cancel recorded between its identity commit and `running`
    layer: object = None         # changes.Layer: the overlay's upper and work, while a capturing cell runs
    changes: dict | None = None  # the receipt's `changes` section (changes.commit's summary, or live/none and why)
    audit: object = None         # linux.audit.Reader: the cell's Landlock denials, where the host audits
    landlock_audit: dict | None = None  # what it read once the tree was dead, or {"why": ...} it reads nothing

    def target(self) -> reaper.Target:
        spec = self.spec
        return reaper.Target(run_id=spec.run_id, cell_id=spec.cell_id, place=self.place,
                             leader=self.identity or None, token=spec.token,
                             since=self.identity.get("starttime") or 0, tmpdir=self.plan.tmpdir,
                             lock_path=self.lock_path, lock_fd=self.lock_fd)

    def output_info(self) -> dict:
        from .digest import file_sha256
        out = {"mode": "captured" if self.capture else "passthrough"}
        out.update(self.pump.info() if self.pump is not None else {"via": "direct", "limit": None})
        if not self.capture:
            return out
        for name in ("stdout", "stderr"):
            p = os.path.join(self.plan.cell_dir, name)
            try:
                with open(p, "rb") as f:
                    size, digest = file_sha256(f)
                out[name] = {"bytes": size, "sha256": digest, "path": p}
            except OSError:
                out[name] = None
        return out


class Controller:
    def __init__(self, state, kind: str = "run", journal=None, one_cell: bool = False, backend=None, forker=None):
        """`journal`: an open Journal to use (and close) instead of opening one.
        `one_cell`: this controller starts one cell and ends with it. `forker`: the
        long-lived thread every cell is forked from (process.leader.spawn), when this
        controller has many threads."""
        from . import backend as backends
        self.state = state.ensure()
        self.journal = journal if journal is not None else state.journal()
        self.kind = kind
        self.one_cell = one_cell
        self.id = "ctl-" + os.urandom(6).hex()  # not `secrets`: ~5 ms of imports for the same bytes
        self.lock_path = state.controller_lock(self.id)
        self._lock_fd: int | None = None
        self._registered = self._ended = False
        if not one_cell:
            self._take_lock()
            self.journal.register_controller(self._row())
            self._registered = True
        self.backend = backend if backend is not None else backends.choose(state.path)
        self.backend.enter(helpers.run_helper)  # under systemd: into agnsup's own unit, before any cell
        self.forker = forker

    def _take_lock(self) -> None:
        self._lock_fd = locks.acquire(self.lock_path, True, 0, "controller", self.id)

    def _row(self) -> dict:
        me = os.getpid()
        fd = os.pidfd_open(me)
        try:
            ino = pidfd.inode(fd) if pidfd.has_pidfs() else None
        finally:
            os.close(fd)
        return {"id": self.id, "kind": self.kind, "pid": me, "pidfd_ino": ino, "starttime": proc.stat(me).starttime,
                "boot_id": proc.boot_id(), "lock_path": self.lock_path, "started_at": time.time()}

    def close(self, leave_journal_open: bool = False) -> None:
        """A clean exit: the instance is marked ended and its lock file removed.

        `leave_journal_open`: the process exits right after without closing
        the connection (the CLI, entry.py): the last connection's close would
        checkpoint the WAL (two fsyncs and an unlink, 3-15 ms here), and a WAL
        left behind is exactly what a crash after the last commit leaves, which
        the journal is built to keep (journal.py)."""
        try:
            if self._registered and not self._ended:
                self.journal.end_controller(self.id)
                self._ended = True
        finally:
            if self._lock_fd is not None:
                locks.release(self.lock_path, self._lock_fd)
                self._lock_fd = None
            if not leave_journal_open:
                self.journal.close()

    # -- start ------------------------------------------------------------
    def start(self, prepared: Prepared, capture: bool = False, notify=None, stdin: bool = False,
              pty: dict | None = None, stream: bool = False, queue: bool = False) -> Cell:
        """Lock the worktree, journal the intent, start the cell. `queue`: when the lock
        is held, journal the cell as `waiting` and return it at once (cell.waiting);
        `resume` then waits for the lock and starts it."""
        plan = prepared.plan
        spec = plan.spec
        cell = Cell(spec=spec, plan=plan, controller_id=self.id, boot_id=proc.boot_id(), decision=prepared.decision,
                    trail=prepared.trail, trace=prepared.trace, capture=capture or stream or pty is not None,
                    stdin=stdin, pty=pty, stream=stream or pty is not None)
        cell.lock_path = self.state.worktree_lock(locks.worktree_key(spec.worktree))
        if queue:
            cell.lock_fd = locks.try_acquire(cell.lock_path, plan.worktree_mode == "rw", self._owner(spec),
                                             tree=spec.worktree)
            cell.waiting = cell.lock_fd is None
        else:
            cell.lock_fd = locks.acquire(cell.lock_path, plan.worktree_mode == "rw", spec.lock_timeout,
                                         f"worktree {spec.worktree}", self._owner(spec), notify, tree=spec.worktree)
        try:
            self._intent(cell, prepared.admit, "waiting" if cell.waiting else "starting")
        except BaseException as e:
            if cell.lock_fd is not None:
                locks.release(cell.lock_path, cell.lock_fd)
            if isinstance(e, Denied):  # a run quota, judged in the intent transaction (rolled back)
                self.journal.record_denied(spec.run_id, spec.cell_id, argv=spec.argv, decision=e.details["decision"],
                                           trail=cell.trail + e.details["trail"],
                                           chain=[s["stage"] for s in cell.trace])
            raise
        crashpoints.hit("after_intent")
        return cell if cell.waiting else self._launch(cell)

    @staticmethod
    def _owner(spec) -> str:
        return f"cell {spec.cell_id} of run {spec.run_id}"

    def resume(self, cell: Cell) -> Cell:
        """A waiting cell: wait for its worktree lock (up to its lock_timeout; a cancel
        recorded meanwhile wins), then start it like any other."""
        spec = cell.spec

        def cancelled():
            self.journal.refuse_cancelled(spec.run_id, spec.cell_id)
        try:
            cell.lock_fd = locks.acquire(cell.lock_path, cell.plan.worktree_mode == "rw", spec.lock_timeout,
                                         f"worktree {spec.worktree}", self._owner(spec), False, tree=spec.worktree,
                                         poll=cancelled)
            cancelled()
            self.journal.mark_starting(spec.run_id, spec.cell_id)
        except AgnsupError as e:
            self.fail(cell, e)
            raise
        cell.waiting = False
        return self._launch(cell)

    def _launch(self, cell: Cell) -> Cell:
        plan, spec = cell.plan, cell.spec
        try:
            self._make_place(cell)
            crashpoints.hit("after_cgroup")
            stdio, cell.pump = self._stdio(cell)
            if plan.worktree_mode == "rw":
                cell.protect_start = _protect_baseline(plan)
                _keep_for_janitor(plan, cell.protect_start)
            _open_audit(cell)
            try:
                cell.child = leader.spawn(plan, self.backend, cell.place, stdio, self.forker,
                                              ctty=cell.pty is not None or cell.controlling_tty)
            finally:
                for fd in {fd for fd in stdio or () if fd is not None}:  # a pty slave may serve twice
                    os.close(fd)
            if cell.place.node is not None:
                cell.isolation["cgroup_join"] = cell.child.cgroup_join
            try:
                self._identity(cell)
            except BaseException:
                leader.abandon(cell.child)  # never runs: it exits at the barrier
                cell.child = None
                raise
            try:
                leader.release(plan, cell.child)
            except BaseException:
                cell.child = None  # reaped by release
                raise
            self._start_egress(cell)
            crashpoints.hit("after_exec")
            cell.cancelled_starting = self.journal.mark_running(spec.run_id, spec.cell_id)
        except AgnsupError as e:
            self.fail(cell, e)
            raise
        except OSError as e:
            err = StateError(f"cell setup failed: {e}")
            self.fail(cell, err)
            raise err from None
        return cell

    def _start_egress(self, cell: Cell) -> None:
        """allowlist/internal: the controller's proxy serves the cell's only way out (agnsup/egress/)."""
        if cell.child.egress_listener is not None:
            from . import egress
            cell.egress = egress.serve(cell.child.egress_listener, cell.plan.egress_rules,
                                       self.journal.path, cell.spec.run_id, cell.spec.cell_id)

    def _stop_egress(self, cell: Cell) -> None:
        """Close the proxy (and every connection it still relays); its records go to the receipt."""
        if cell.plan is not None and cell.plan.egress is not None and cell.network is None:
            from . import egress
            cell.network = egress.receipt_section(cell.egress, cell.plan.egress)
            if cell.egress is None and cell.child is not None and cell.child.egress_listener is not None:
                cell.child.egress_listener.close()  # the proxy never started: nobody serves the cell
            cell.egress = None

    def _intent(self, cell: Cell, admit, state: str = "starting") -> None:
        spec, plan = cell.spec, cell.plan
        cell.trace.append(stage("broker", controller=self.id, token_set=True, lock=cell.lock_path))
        if os.path.lexists(plan.cell_dir):
            # a receipt on disk is evidence: never overwritten, even when the journal lost the cell
            raise RunNotActive(f"cell {spec.cell_id!r} already exists in run {spec.run_id!r}; cell ids are never "
                               f"reused (its directory {plan.cell_dir} is on disk)")
        cell.place = self.backend.place(spec.run_id, spec.agent_id, spec.cell_id, plan.limits)
        controller = None
        if not self._registered:  # a one-cell controller: its row and its cell's, together
            if self._lock_fd is None:
                self._take_lock()
            controller = self._row()
        self.journal.begin_cell({
            "run_id": spec.run_id, "cell_id": spec.cell_id, "agent_id": spec.agent_id, "role": spec.role,
            "token": spec.token, "controller_id": self.id, "boot_id": cell.boot_id,
            "cgroup": json.dumps(cell.place.paths()), "tmpdir": plan.tmpdir, "worktree": spec.worktree,
            "lock_path": cell.lock_path, "argv": json.dumps(spec.argv), "exe": spec.exe, "created_at": time.time(),
            "grace": plan.grace, "on_controller_death": spec.on_controller_death,
            "dies_with_controller": plan.dies_with_controller}, cell.trace, admit, controller, state)
        self._registered = True

    def _make_place(self, cell: Cell) -> None:
        spec, plan, backend = cell.spec, cell.plan, self.backend
        os.makedirs(os.path.join(plan.tmpdir, "home"), mode=0o700)
        _make_home_files(plan)
        for host_dir, _, _ in plan.caches:  # filesystem.cache: kept between cells, under the state root
            os.makedirs(host_dir, mode=0o700, exist_ok=True)
            if plan.uid is not None:  # a mapped cell sees them through its id map: on-disk root is its root
                os.chown(host_dir, plan.uid, plan.gid)
        ids = plan.cell_ids()
        if ids is not None:  # process.user, a mapped cell: the cell's HOME is its own
            os.chown(os.path.join(plan.tmpdir, "home"), *ids)
        os.chmod(plan.tmpdir, 0o1777)  # it is the cell's /tmp: sticky and world-writable, like the real one
        if plan.captures():
            cell.layer = _prepare_layer(self.state.path, plan)
        if cell.place.node is not None:
            cell.place = backend.create(cell.place, plan.limits)
        # no limit is reported that is not in force: each missing one is named, or refused
        gaps = backend.limit_gaps(cell.place, plan.limits)
        if gaps and plan.require_limits:
            raise SetupError(f"role {spec.role} requires limits, which are not in force here: {'; '.join(gaps)}",
                             step="require")
        cell.isolation = {
            "cgroup_layout": backend.kind, "tracking": backend.tracking, "env_blocked": list(backend.env_blocked),
            "mount_namespace": True, "readonly_root": any(op[0] == "root" and op[3] for op in plan.mount_ops),
            "private_tmp": True, "masked": plan.deny_masked, "ipc_namespace": True,
            "network_namespace": plan.new_netns, "network": plan.network,
            "cap_sys_admin_dropped": 21 in plan.drop_caps,
            "limits": cell.place.limits,
            **plan.protections(),  # seccomp, landlock, no_new_privs, capabilities, uid, pid_namespace
        }
        cell.isolation["not_in_force"] = [*cell.isolation["not_in_force"], *gaps]
        cell.isolation.update(plan.reduced_by(backend, cell.isolation["not_in_force"]))  # isolation.reduced "cgroup"
        st = stage("backend", layout=backend.kind, cgroup=cell.place.paths(), cgroup_inode=cell.place.inode,
                   isolation=cell.isolation)
        cell.trace.append(st)
        self.journal.stage(spec.run_id, spec.cell_id, st, cgroup_ino=cell.place.inode)

    def _identity(self, cell: Cell) -> None:
        ident = cell.child.identity
        cell.identity, cell.started_at = ident, time.time()
        st = stage("process_supervisor", pid=ident["pid"], pgid=ident["pgid"], starttime=ident["starttime"],
                   pidfd_ino=ident["pidfd_ino"])
        cell.trace.append(st)
        self.journal.commit_identity(cell.spec.run_id, cell.spec.cell_id, {**ident, "started_at": cell.started_at}, st)

    def _stdio(self, cell: Cell) -> tuple:
        """(the child's fds 0-2, None meaning inherit; the output pump or None).

        Without an output cap the cell writes its destination directly: the
        controller's stdio (run) or the log files (capture). With a cap it
        writes pipes the supervisor pumps, counting bytes; a terminal on the
        controller's side becomes a pty of the cell's own, so isatty() still
        holds for the command but it never holds the user's terminal for output.
        A live cell (stream, pty) is always pumped into its log files, keeping a
        Tape; `stdin` makes fd 0 a pipe whose write end is `cell.input`."""
        from .output import Input
        cap = cell.plan.limits.get("output_max")
        child: list = [None, None, None]
        owned: list[int] = []  # closed here if anything fails
        try:
            if cell.stdin and cell.pty is None:
                r, w = os.pipe()
                owned += (r, w)
                child[0] = r
                cell.input = Input(w, tty=False)
            elif cell.capture:
                child[0] = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
                owned.append(child[0])
            if cell.capture:
                d = cell.plan.cell_dir
                flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
                dst = {1: os.open(os.path.join(d, "stdout"), flags, 0o600)}
                owned.append(dst[1])
                dst[2] = os.open(os.path.join(d, "stderr"), flags, 0o600)
                owned.append(dst[2])
                if cap is None and not cell.stream:
                    _cell_owns(cell.plan, dst[1], dst[2])  # a shell reopens them (/dev/stdout)
                    child[1], child[2] = dst[1], dst[2]
                    return tuple(child), None
            else:
                # At a terminal the cell gets a pty of its own as stdin and controlling
                # terminal (prompts: ssh, git, sudo, gpg), pumped to and from the user's.
                from .output import at_a_terminal
                cell.controlling_tty = not cell.stdin and at_a_terminal()
                # A cell that is not host root (mapped, process.user) could not reopen a file or pipe
                # of the user's that only its owner may write by path (/dev/stdout is /proc/self/fd/1,
                # a permission check on the inode): it writes a pipe of its own, pumped there, never capped.
                ids = cell.plan.cell_ids()
                closed = [] if ids is None else [n for n in (1, 2) if _users_own(n) and not _reopenable(n, ids)]
                if cap is None and not cell.controlling_tty and not closed:
                    return (tuple(child) if cell.stdin else None), None
                dst = {1: 1, 2: 2}
            # A file, /dev/null or a pipe the user gave is theirs: the cell gets that very
            # descriptor (no pump, nothing to cap; 2>&1 stays one descriptor, in order).
            direct = [] if cell.capture else [n for n in (1, 2) if _users_own(n) and n not in closed]
            if len(direct) == 2 and not cell.controlling_tty:
                return (tuple(child) if cell.stdin else None), None
            pump = self._pump(cell, cap, child, dst, owned, direct, [] if cell.capture else closed)
            _cell_owns(cell.plan, *{fd for fd in child if fd is not None and fd not in (0, 1, 2)})
            return tuple(child), pump
        except BaseException:
            if cell.input is not None:
                if cell.input.fd in owned:
                    owned.remove(cell.input.fd)
                cell.input.close()
            if cell.terminal is not None:
                cell.terminal.close()
            cell.input = cell.terminal = None
            for fd in owned:
                os.close(fd)
            raise

    def _pump(self, cell: Cell, cap: int | None, child: list, dst: dict, owned: list, direct: list,
              closed: list = ()) -> object:
        """The pump between the cell's pipes (or pty) and `dst`; fills `child` with the cell's ends.
        `closed`: the user's own descriptors pumped only because the cell could not reopen them (uncapped)."""
        from .output import Pump, Tape
        tape = None
        if cell.stream:
            d = cell.plan.cell_dir
            tape = Tape({"stdout": os.path.join(d, "stdout"), "stderr": os.path.join(d, "stderr"),
                         "tty": os.path.join(d, "stdout")})
        ttys = [] if cell.capture else [n for n in (1, 2) if os.isatty(n)]
        pump = Pump(cap, "pty" if ttys or cell.pty or cell.controlling_tty else "pipe", tape)
        pump.direct = ["stdout" if n == 1 else "stderr" for n in direct]
        try:
            return self._fill_pump(cell, pump, ttys, child, dst, owned, direct, closed)
        except BaseException:
            pump.close()
            raise

    @staticmethod
    def _fill_pump(cell: Cell, pump, ttys: list, child: list, dst: dict, owned: list, direct: list,
                   closed=()) -> object:
        from .output import Input
        if cell.pty is not None:
            # the cell's whole terminal: what it writes lands in the stdout file, stderr stays empty
            master, slave = _cell_pty(None, cell.pty, raw_output=False)
            child[0] = child[1] = child[2] = slave
            owned.append(slave)
            pump.add("tty", master, dst[1], own_dst=True)
            owned.remove(dst[1])
            cell.terminal = Input(os.dup(master), tty=True)  # resize; and write_stdin with `stdin`
            if cell.stdin:
                cell.input = cell.terminal
            os.close(dst[2])
            owned.remove(dst[2])
            return pump
        if cell.controlling_tty:
            from .output import UserTerminal
            master, slave = _cell_pty(0, raw_output=False, suspend=False)
            child[0] = slave
            for n in ttys:
                child[n] = slave
            owned.append(slave)
            pump.add("tty", master, ttys[0] if ttys else 0)  # fd 0 of a terminal is open read-write
            pump.add("stdin", os.dup(0), os.dup(master), own_dst=True, counted=False, nonblock=False)
            pump.terminal = UserTerminal(0, os.dup(master))
        elif ttys:
            master, slave = _cell_pty(ttys[0])
            for n in ttys:
                child[n] = slave
            owned.append(slave)
            pump.add("tty", master, ttys[0])
        if not cell.capture and not ttys and not direct and _same_file(1, 2):
            r, w = os.pipe()  # one destination (2>&1 to a socket...): one pipe, so the order holds
            child[1] = child[2] = w
            owned.append(w)
            pump.add("stdout", r, 1, capped=1 not in closed)
        for n, name in ((1, "stdout"), (2, "stderr")):
            if child[n] is None and n not in direct:
                r, w = os.pipe()  # both close-on-exec; the child dup2s w onto n
                child[n] = w
                owned.append(w)
                pump.add(name, r, dst[n], own_dst=cell.capture, capped=n not in closed)
                if cell.capture:
                    owned.remove(dst[n])
        return pump

    # -- wait and finish --------------------------------------------------
    def waiter(self, cell: Cell, wake_fd: int | None = None) -> wait.Waiter:
        tree = reaper.Tree(self.backend, cell.target(), cell.child.pidfd)
        waiter = wait.Waiter(cell.child.pidfd, tree, cell.plan.grace, cell.plan.timeout, wake_fd, pump=cell.pump,
                                   oom_fd=cell.place.oom_fd)
        if cell.cancelled_starting:
            # cancelled after its identity commit, before its leader was surely in its tree: the
            # canceller's reaper may have found nothing, so the stop is ours (TERM, grace, kill)
            waiter.request_stop("cancelled", cell.cancelled_starting)
        return waiter

    def finish(self, cell: Cell, waiter: wait.Waiter) -> dict:
        """The leader has exited: reap the rest of the tree, then the leader; release
        what the cell held, journal its end, write its receipt."""
        spec, target = cell.spec, cell.target()
        why = self.journal.cancel_reason(spec.run_id, spec.cell_id)  # a cancel by any process (agnsup cancel)
        until = waiter.grace_until()  # a stop in progress gets its grace period for the rest of the tree too
        if until is None and why:
            # the canceller owns the grace period and the kill (a TERM trap may be writing
            # its last words); if it died meanwhile, we kill after this wait
            until = time.monotonic() + cell.plan.grace + CANCELLER_SLACK
        # Before the leader is reaped: its pid, the cell's session id, stays ours meanwhile.
        left = reaper.stop(self.backend, [target], until=until, exclude=(cell.child.pid,))[0]
        if not left.empty:
            raise SetupError(left.error)
        status, sig = leader.collect(cell.child)
        if cell.pump is not None:
            cell.pump.drain(5.0)  # the tree is dead: every write end is closed, EOF comes at once
        reason = waiter.reason or ("exited" if status is not None else "killed")
        if cell.pump is not None and cell.pump.overflowed and waiter.reason is None:
            reason = "output_limit"  # it wrote past the cap and ended before we read it: delivered up to the cap
        cancel_reason = waiter.cancel_reason
        if why and reason != "timeout":
            reason, cancel_reason = "cancelled", why  # cancelled from another process: the journal holds the first reason
        usage = self.backend.usage(cell.place)
        if cell.child.tmp_used is not None:
            usage["tmp_bytes"] = cell.child.tmp_used  # the /tmp tmpfs when the cell ended (limits.tmp_max)
        if usage.get("oom_kills") and reason in ("exited", "killed"):
            reason = "oom"  # the kernel's OOM killer acted inside the cell (v2 memory.oom.group took all of it)
        outcome = wait.Outcome.of(reason, status, sig, stop_signal=waiter.stop_signal, cancel_reason=cancel_reason,
                                        kill_method=waiter.kill_method or left.method, leftover=left.left)
        self._close_fds(cell)
        self._commit_changes(cell)  # the tree is dead; the worktree lock is still ours; before protect.settle
        self._settle_protected(cell)
        receipt = self._conclude(cell, outcome, usage, self._release(cell, reaper.release(self.backend, target)))
        self._prune_changes(cell)
        return receipt

    def _commit_changes(self, cell: Cell) -> None:
        """A capturing cell's tree is dead: what it wrote lands in the worktree, the pre-images in its
        record (changes.commit); the receipt's `changes` section says what. A cell that runs live (or
        has a read-only worktree) gets the section that says so. A commit that fails leaves its plan
        for the janitor (changes.finish_all) and the receipt names the error; the cell's end is
        recorded all the same."""
        plan = cell.plan
        if plan is None or not plan.changes:
            return
        if cell.layer is None:
            if plan.changes.get("mode") != "at_exit":
                cell.changes = {"mode": plan.changes["mode"], "why": plan.changes.get("why")}
            return
        from . import changes
        spec = cell.spec
        cell.changes = changes.land(self.state.path, spec.run_id, spec.cell_id, spec.worktree,
                                    agent_id=spec.agent_id, id_shift=_id_shift(cell.plan))
        if cell.changes["mode"] == "live":  # the kernel refused the overlay: its writes landed live
            cell.isolation["not_in_force"] = [*cell.isolation.get("not_in_force", []),
                                              f"reversible (the cell's writes landed live, uncaptured): "
                                              f"{cell.changes['why']}"]
        cell.layer = None

    def _prune_changes(self, cell: Cell) -> None:
        """Retention after a commit that kept a record: the oldest records past the role's
        filesystem.changes_keep / changes_keep_bytes are dropped (changes.prune)."""
        if not cell.changes or not cell.changes.get("record") or not cell.changes.get("files"):
            return
        from . import changes
        try:
            changes.prune(self.state, self.journal, cell.plan.changes["keep"], cell.plan.changes["keep_bytes"])
        except Exception as e:  # noqa: BLE001 - retention never fails a cell that ended
            import sys
            print(f"agnsup: changes retention failed, continuing: {e}", file=sys.stderr, flush=True)

    def _settle_protected(self, cell: Cell) -> None:
        """The tree is dead: what it planted where tools run files on their own leaves the
        worktree for the cell's record directory (agnsup/protect.py); journaled when anything moved."""
        if cell.protect_start is None:
            return
        from . import protect
        baseline, before = cell.protect_start
        cell.protected = protect.settle(cell.spec.worktree, baseline, cell.plan.protected_lifted, before,
                                        os.path.join(cell.plan.cell_dir, "quarantine"))
        if cell.protected["quarantined"]:
            self.journal.add_event("protected.quarantined", cell.spec.run_id, cell.spec.cell_id,
                                   paths=cell.protected["quarantined"])
            _drop_quarantined(self.state.path, cell.spec, cell.changes, cell.protected["quarantined"])

    def fail(self, cell: Cell, error: AgnsupError) -> dict:
        """A cell that never ran (or whose start could not be recorded): undo what exists, record why."""
        cancel = self.journal.cancel_reason(cell.spec.run_id, cell.spec.cell_id) \
            if isinstance(error, CancelledBeforeStart) else None
        outcome = wait.Outcome.failed(error, cancel)
        target = cell.target()
        if cell.child is not None:  # it runs, but its start was not recorded: it must not
            reaper.Tree(self.backend, target, cell.child.pidfd).kill()
            leader.collect(cell.child)
        self._close_fds(cell)
        self._commit_changes(cell)  # what a cell killed before its start was recorded may have written
        r = reaper.reap(self.backend, target)
        receipt = self._conclude(cell, outcome, {}, self._release(cell, r.released), error=error.message)
        self._prune_changes(cell)
        return receipt

    def _close_fds(self, cell: Cell) -> None:
        self._stop_egress(cell)
        if cell.audit is not None:  # the tree is dead: its Landlock domain has ended, or ends now
            try:
                cell.landlock_audit = cell.audit.collect()
            finally:
                cell.audit.close()
                cell.audit = None
        for end in (cell.input, cell.terminal):
            if end is not None:
                end.close()
        if cell.pump is not None:
            cell.pump.close()
        if cell.place is not None and cell.place.oom_fd is not None:
            os.close(cell.place.oom_fd)
            cell.place.oom_fd = None

    @staticmethod
    def _release(cell: Cell, released: list) -> list:
        """The reaper's release dropped the worktree lock the cell's target carried."""
        cell.lock_fd = None
        return released

    def _conclude(self, cell: Cell, outcome, usage: dict, released: list, error: str | None = None) -> dict:
        from . import receipts
        receipt = receipts.cell_receipt(cell, outcome, usage, released, error)
        path = os.path.join(cell.plan.cell_dir, "receipt.json")
        try:
            receipts.write(path, receipt)
        except OSError:
            path = None
        ends = self.id if self.one_cell and self._registered else None  # its one cell is concluded: so is the controller
        try:
            self.journal.conclude_cell(receipt, path, end_controller=ends)
        except StateError as e:  # a full or read-only state root: the tree is gone, say what is not recorded
            raise StateError(f"cell {cell.spec.cell_id} ended ({receipt['state']}, exit {receipt['exit_code']}) but "
                             f"its end could not be journaled (receipt {'at ' + path if path else 'not written'}; "
                             f"the next janitor concludes it): {e.message}") from None
        if ends:
            self._ended = True
        return receipt


def _open_audit(cell: Cell) -> None:
    """A Landlock ABI 7 cell on a host that audits: subscribe to the audit log before the cell
    exists, and name its domain (linux/audit.py). Elsewhere nothing is imported or called."""
    plan = cell.plan
    if plan.landlock_writable is None or plan.landlock_abi < 7:
        return
    from .linux import audit
    if not audit.wanted():
        return
    cell.audit, why = audit.Reader.open()
    if cell.audit is None:
        cell.landlock_audit = {"why": why}
    else:
        plan.landlock_log_tag = cell.audit.tag


def _users_own(fd: int) -> bool:
    """The controller's `fd` is a regular file, /dev/null or a pipe: handed to the cell as it is."""
    import stat
    try:
        st = os.fstat(fd)
    except OSError:
        return False
    if stat.S_ISREG(st.st_mode) or stat.S_ISFIFO(st.st_mode):
        return True
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == os.stat(os.devnull).st_rdev


def _reopenable(fd: int, ids: tuple[int, int]) -> bool:
    """Could a cell running as host `ids` open the controller's `fd` for writing by path (/dev/stdout)?"""
    try:
        st = os.fstat(fd)
    except OSError:
        return False
    return bool(st.st_mode & 0o002) or (st.st_uid == ids[0] and bool(st.st_mode & 0o200)) or \
        (st.st_gid == ids[1] and bool(st.st_mode & 0o020))


def _same_file(a: int, b: int) -> bool:
    try:
        x, y = os.fstat(a), os.fstat(b)
    except OSError:
        return False
    return (x.st_dev, x.st_ino) == (y.st_dev, y.st_ino)


def _cell_pty(like: int | None, size: dict | None = None, raw_output: bool = True,
              suspend: bool = True) -> tuple[int, int]:
    """A pty for the cell, sized like the controller's terminal `like` or `size` ({"cols", "rows"}).

    `raw_output`: output post-processing off (no ONLCR) so bytes reach the real
    terminal unchanged, and it does its own processing there. A pty that is the
    cell's whole terminal (request `pty`) keeps a terminal's defaults.
    `suspend=False`: no ^Z (VSUSP): nothing above the cell does job control, so a
    stopped cell would hang the user's raw terminal."""
    import fcntl
    import termios
    master, slave = os.openpty()
    if raw_output or not suspend:
        attrs = termios.tcgetattr(slave)
        if raw_output:
            attrs[1] &= ~termios.OPOST
        if not suspend:
            attrs[6][termios.VSUSP] = b"\0"  # _POSIX_VDISABLE on Linux
        termios.tcsetattr(slave, termios.TCSANOW, attrs)
    try:
        if size is not None:
            from .output import set_winsize
            set_winsize(master, size["cols"], size["rows"])
        else:
            fcntl.ioctl(master, termios.TIOCSWINSZ, fcntl.ioctl(like, termios.TIOCGWINSZ, b"\0" * 8))
    except OSError:
        if size is not None:
            os.close(master)
            os.close(slave)
            raise
    return master, slave


def _prepare_layer(state_root: str, plan):
    """The capturing cell's layer directory (changes.prepare; its upper's root gets the worktree
    root's owner and mode there: the overlay's root directory shows them)."""
    from . import changes
    spec = plan.spec
    return changes.prepare(state_root, spec.run_id, spec.cell_id, None, worktree=spec.worktree,
                           agent_id=spec.agent_id, id_shift=_id_shift(plan))


def _id_shift(plan) -> int | None:
    """A mapped cell writes its layer as host ids BASE+n (mounts.overlay "shift"): the commit's id_shift."""
    return plan.mapped["uid"] if plan.mapped else None


def _drop_quarantined(state_root: str, spec, summary: dict | None, quarantined: list) -> None:
    """protect.settle moved paths the cell planted out of the worktree after the commit: its record
    stops claiming them (changes.drop_paths)."""
    if not summary or not summary.get("record"):
        return
    from . import changes
    paths = [q["path"] if isinstance(q, dict) else q for q in quarantined]
    try:
        changes.drop_paths(state_root, spec.run_id, spec.cell_id, paths)
    except Exception as e:  # noqa: BLE001 - the quarantine is done; the record keeps what it said
        import sys
        print(f"agnsup: changes: quarantined paths not dropped from the record: {e}", file=sys.stderr, flush=True)


def _protect_baseline(plan) -> tuple[dict, dict]:
    """The protected paths as the cell finds them (taken just before it starts), and the
    lifted ones' digests: what protect.settle compares with once the cell is dead."""
    from . import protect
    found = protect.scan(plan.spec.worktree)
    lifted = plan.protected_lifted
    return protect.as_plan(found), (protect.digests(plan.spec.worktree, found, lifted) if lifted else {})


def _keep_for_janitor(plan, start: tuple) -> None:
    """The start snapshot in the cell's record directory: a janitor that concludes the cell of a
    dead controller settles its protected paths from it (janitor.py)."""
    import json
    with open(os.path.join(plan.cell_dir, "protect-start.json"), "w") as f:
        json.dump({"worktree": plan.spec.worktree, "baseline": start[0], "digests": start[1],
                   "lifted": list(plan.protected_lifted)}, f)


def _make_home_files(plan) -> None:
    """What the plan puts in the cell's /tmp: @runtime's links, the HOME's tool configuration
    (owned by the cell's uid when process.user sets one, like the HOME itself)."""
    made = []
    for rel, target in plan.tmp_links:
        path = os.path.join(plan.tmpdir, rel)
        made += _parents(plan.tmpdir, path)
        os.symlink(target, path)
    for _, _, rel in plan.caches:  # the caches' mount points, the cell's own like its HOME
        path = os.path.join(plan.tmpdir, rel)
        made += _parents(plan.tmpdir, os.path.join(path, "."))
    for rel, text in plan.tmp_files:
        path = os.path.join(plan.tmpdir, rel)
        made += _parents(plan.tmpdir, path)
        with open(path, "x") as f:
            f.write(text)
        made.append(path)
    ids = plan.cell_ids()
    if ids is not None:
        for path in made:
            os.lchown(path, *ids)


def _cell_owns(plan, *fds: int) -> None:
    """The cell's ends of its stdio (capture files, its pty slave, the pump's pipes) become its own, as
    login(1) chowns a tty: a shell reopens them by path (`echo x > /dev/stdout` opens /proc/self/fd/1,
    a permission check against the inode), and a cell that is not host root (process.user, a mapped
    cell) would be refused a root-owned 0600 one. Never the user's own descriptors (handed on as they are)."""
    import stat
    ids = plan.cell_ids()
    if ids is None:
        return
    for fd in fds:
        st = os.fstat(fd)
        # only what the controller made for this cell: a file, a pipe, a pty slave (Unix98 majors 136-143);
        # never a shared device such as /dev/null
        if stat.S_ISREG(st.st_mode) or stat.S_ISFIFO(st.st_mode) or \
                (stat.S_ISCHR(st.st_mode) and 136 <= os.major(st.st_rdev) <= 143):
            os.fchown(fd, *ids)


def _parents(tmpdir: str, path: str) -> list[str]:
    """Make the missing directories between tmpdir and path (mode 0755); the ones made."""
    made, d = [], os.path.dirname(path)
    while d != tmpdir and not os.path.isdir(d):
        made.append(d)
        d = os.path.dirname(d)
    for d in reversed(made):
        os.mkdir(d, 0o755)
    return made
