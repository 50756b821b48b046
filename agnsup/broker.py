"""The broker: identity, journal intent, locks, and the cell's life cycle.

A Controller is one controller instance: it holds an exclusive flock on
<state>/controllers/<id>.lock for its whole life (the janitor's proof of
liveness) and journals every cell it starts, in two phases: the intent row
before any kernel object exists, the identity before the command may exec.

A one-cell controller (`agnsup run`, run_process) writes fewer transactions
for the same records: its own row rides in the cell's intent transaction
(its liveness lock is taken just before), and its end in the cell's
conclusion. What is durable when is unchanged (tests/test_crashpoints.py).
"""
from __future__ import annotations

import json
import os
import time

from . import crashpoints, governance, locks, supervisor
from .errors import AgnsupError, CancelledBeforeStart, Denied, RunNotActive, StateError
from .journal import TERMINAL_RUN
from .linux import cgroup, pidfd, proc
from .record import Factory, Record


def stage(name: str, **info) -> dict:
    return {"stage": name, "t": time.time(), **info}


class Cell(Record):
    spec: object
    plan: object
    controller_id: str
    boot_id: str
    decision: dict
    trail: list
    trace: list
    created_at: float = Factory(time.time)
    node: object = None
    cgroup_ino: int | None = None
    limits_applied: dict = Factory(dict)
    isolation: dict = Factory(dict)
    identity: dict = Factory(dict)
    started_at: float | None = None
    lock_fd: int | None = None
    lock_path: str | None = None
    child: object = None
    capture: bool = False
    pump: object = None          # output.Pump when the role caps output
    oom_fd: int | None = None    # v1 OOM eventfd (cgroup.create_cell)
    egress: object = None        # egress.proxy.Proxy: allowlist/internal roles
    network: dict | None = None  # the receipt's network section, once the proxy stopped

    def output_info(self) -> dict:
        from .digest import sha256
        out = {"mode": "captured" if self.capture else "passthrough"}
        out.update(self.pump.info() if self.pump is not None else {"via": "direct", "limit": None})
        if not self.capture:
            return out
        for name in ("stdout", "stderr"):
            p = os.path.join(self.plan.cell_dir, name)
            try:
                with open(p, "rb") as f:
                    data = f.read()
                out[name] = {"bytes": len(data), "sha256": sha256(data).hexdigest(), "path": p}
            except OSError:
                out[name] = None
        return out


class Controller:
    def __init__(self, state, kind: str = "run", journal=None, one_cell: bool = False):
        """`journal`: an open Journal to use (and close) instead of opening one.
        `one_cell`: this controller starts one cell and ends with it."""
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
        self.layout = cgroup.detect_layout()
        self.base = cgroup.base_node(self.layout, state.path)

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
    def start(self, plan, decision: dict, trail: list, trace: list, capture: bool = False, notify=None) -> Cell:
        spec = plan.spec
        cell = Cell(spec=spec, plan=plan, controller_id=self.id, boot_id=proc.boot_id(), decision=decision,
                    trail=trail, trace=trace, capture=capture)
        exclusive = plan.worktree_mode == "rw"
        cell.lock_path = self.state.worktree_lock(locks.worktree_key(spec.workdir))
        cell.lock_fd = locks.acquire(cell.lock_path, exclusive, spec.lock_timeout,
                                     f"worktree {spec.workdir}", f"cell {spec.cell_id} of run {spec.run_id}", notify)
        try:
            if not self._registered and self._lock_fd is None:
                self._take_lock()
            self._intent(cell)
        except BaseException as e:
            locks.release(cell.lock_path, cell.lock_fd)
            if isinstance(e, Denied):  # a run quota, judged in the intent transaction (rolled back)
                record_denied(self.state, spec, e.details["decision"], trail + e.details["trail"], trace)
            raise
        crashpoints.hit("after_intent")
        try:
            self._backend(cell)
            crashpoints.hit("after_cgroup")
            stdio, cell.pump = self._stdio(cell)
            try:
                cell.child = supervisor.spawn(plan, cell.node, lambda ident: self._identity(cell, ident), stdio)
                if cell.node is not None:
                    cell.isolation["cgroup_join"] = cell.child.cgroup_join
                self._start_egress(cell)
            finally:
                for fd in {fd for fd in stdio or () if fd is not None}:  # a pty slave may serve twice
                    os.close(fd)
            crashpoints.hit("after_exec")
            with self.journal.tx() as db:
                self.journal.update_cell(db, spec.run_id, spec.cell_id, state="running")
                self.journal.event(db, "state.running", spec.run_id, spec.cell_id)
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
            cell.egress = egress.serve(cell.child.egress_listener, cell.plan.egress,
                                       self.journal.path, cell.spec.run_id, cell.spec.cell_id)

    def _stop_egress(self, cell: Cell) -> None:
        """Close the proxy (and every connection it still relays); its records go to the receipt."""
        if cell.plan is not None and cell.plan.egress is not None and cell.network is None:
            from . import egress
            cell.network = egress.receipt_section(cell.egress, cell.plan.egress)
            if cell.egress is None and cell.child is not None and cell.child.egress_listener is not None:
                cell.child.egress_listener.close()  # the proxy never started: nobody serves the cell
            cell.egress = None

    def _intent(self, cell: Cell) -> None:
        spec, plan = cell.spec, cell.plan
        cell.trace.append(stage("broker", controller=self.id, token_set=True, lock=cell.lock_path))
        node = cgroup.cell_node(self.base, spec.run_id, spec.agent_id, spec.cell_id, plan.limits)
        now = time.time()
        with self.journal.tx() as db:
            if not self._registered:  # a one-cell controller: its row and its cell's, together
                self.journal.register_controller(self._row(), db)
            run = db.execute("SELECT state FROM runs WHERE run_id=?", (spec.run_id,)).fetchone()
            if run is None:
                db.execute("INSERT INTO runs(run_id, state, created_at) VALUES (?, 'active', ?)", (spec.run_id, now))
            elif run["state"] == "cancelled":
                raise RunNotActive(f"run {spec.run_id!r} was cancelled; it accepts no new cells (use another --run-id)")
            elif run["state"] in TERMINAL_RUN:
                db.execute("UPDATE runs SET state='active', ended_at=NULL WHERE run_id=?", (spec.run_id,))
            if db.execute("SELECT 1 FROM cells WHERE run_id=? AND cell_id=?", (spec.run_id, spec.cell_id)).fetchone():
                raise RunNotActive(f"cell {spec.cell_id!r} already exists in run {spec.run_id!r}; cell ids are never reused")
            # run quotas count the journal's cells: inside BEGIN IMMEDIATE, so race-free
            governance.admit(db, spec, plan.quota, cell.decision.get("zone", "yellow"), now)
            db.execute(
                "INSERT INTO cells(run_id, cell_id, agent_id, role, state, token, controller_id, boot_id, cgroup,"
                " tmpdir, worktree, lock_path, argv, exe, created_at) VALUES (?,?,?,?, 'starting', ?,?,?,?,?,?,?,?,?,?)",
                (spec.run_id, spec.cell_id, spec.agent_id, spec.role, spec.token, self.id, cell.boot_id,
                 json.dumps(node.as_dict()), plan.tmpdir, spec.workdir, cell.lock_path, json.dumps(spec.argv),
                 spec.exe, now))
            for st in cell.trace:
                self.journal.event(db, "stage." + st["stage"], spec.run_id, spec.cell_id, **st)
            self.journal.event(db, "state.starting", spec.run_id, spec.cell_id)
        self._registered = True
        cell.node = node

    def _backend(self, cell: Cell) -> None:
        spec, plan = cell.spec, cell.plan
        os.makedirs(os.path.join(plan.tmpdir, "home"), mode=0o700)
        if plan.uid is not None:  # process.user: the cell's HOME is its own
            os.chown(os.path.join(plan.tmpdir, "home"), plan.uid, plan.gid)
        os.chmod(plan.tmpdir, 0o1777)  # it is the cell's /tmp: sticky and world-writable, like the real one
        node = cell.node
        if node.paths:
            made = cgroup.create_cell(self.base, spec.run_id, spec.agent_id, spec.cell_id, plan.limits)
            cell.cgroup_ino, cell.limits_applied, cell.oom_fd = made["inode"], made["limits"], made["oom_fd"]
        else:
            cell.node = None
        cell.isolation = {
            "cgroup_layout": self.layout.kind,
            "tracking": node.primary[0] if node.paths else "session+token",
            "env_blocked": [] if node.paths else ["ENV_BLOCKED: cgroup"],
            "mount_namespace": True, "readonly_root": any(op[0] == "root" and op[3] for op in plan.mount_ops),
            "private_tmp": True, "masked": plan.deny_masked,
            "network_namespace": plan.new_netns, "network": plan.network,
            "cap_sys_admin_dropped": 21 in plan.drop_caps,
            "limits": cell.limits_applied,
            **plan.protections(),  # seccomp, landlock, no_new_privs, capabilities, uid, pid_namespace
        }
        st = stage("backend", layout=self.layout.kind, cgroup=node.as_dict(), cgroup_inode=cell.cgroup_ino,
                   isolation=cell.isolation)
        cell.trace.append(st)
        with self.journal.tx() as db:
            self.journal.update_cell(db, spec.run_id, spec.cell_id, cgroup_ino=cell.cgroup_ino)
            self.journal.event(db, "stage.backend", spec.run_id, spec.cell_id, **st)

    def _identity(self, cell: Cell, ident: dict) -> None:
        spec = cell.spec
        cell.identity, cell.started_at = ident, time.time()
        st = stage("process_supervisor", pid=ident["pid"], pgid=ident["pgid"], starttime=ident["starttime"],
                   pidfd_ino=ident["pidfd_ino"])
        cell.trace.append(st)
        # crash point "journal_tx": die inside the identity transaction, with the
        # child forked and waiting at the barrier; SQLite rolls the write back.
        with self.journal.tx(crash_point="journal_tx") as db:
            why = db.execute("SELECT cancel_reason FROM cells WHERE run_id=? AND cell_id=?",
                             (spec.run_id, spec.cell_id)).fetchone()[0]
            if why:  # a cancel landed while we were setting up: the command never runs
                raise CancelledBeforeStart(f"cell {spec.cell_id} of run {spec.run_id} was {why} before it started")
            self.journal.update_cell(db, spec.run_id, spec.cell_id, pid=ident["pid"], pidfd_ino=ident["pidfd_ino"],
                                     starttime=ident["starttime"], pgid=ident["pgid"], started_at=cell.started_at)
            self.journal.event(db, "stage.process_supervisor", spec.run_id, spec.cell_id, **st)

    def _stdio(self, cell: Cell) -> tuple:
        """(the child's fds 0-2, None meaning inherit; the output pump or None).

        Without an output cap the cell writes its destination directly: the
        controller's stdio (run) or the log files (capture). With a cap it
        writes pipes the supervisor pumps, counting bytes; a terminal on the
        controller's side becomes a pty of the cell's own, so isatty() still
        holds for the command but it never holds the user's terminal for output."""
        cap = cell.plan.limits.get("output_max")
        stdin = None
        if cell.capture:
            d = cell.plan.cell_dir
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
            stdin = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
            dst = {1: os.open(os.path.join(d, "stdout"), flags, 0o600), 2: os.open(os.path.join(d, "stderr"), flags, 0o600)}
            if cap is None:
                return (stdin, dst[1], dst[2]), None
        elif cap is None:
            return None, None
        else:
            dst = {1: 1, 2: 2}
        from .output import Pump
        ttys = [] if cell.capture else [n for n in (1, 2) if os.isatty(n)]
        pump = Pump(cap, "pty" if ttys else "pipe")
        child = [stdin, None, None]
        try:
            if ttys:
                master, slave = _cell_pty(ttys[0])
                for n in ttys:
                    child[n] = slave
                pump.add("tty", master, ttys[0])
            for n, name in ((1, "stdout"), (2, "stderr")):
                if child[n] is None:
                    r, w = os.pipe()  # both close-on-exec; the child dup2s w onto n
                    child[n] = w
                    pump.add(name, r, dst[n], own_dst=cell.capture)
        except BaseException:
            pump.close()
            for fd in {fd for fd in child if fd is not None}:
                os.close(fd)
            raise
        return tuple(child), pump

    # -- wait and finish --------------------------------------------------
    def waiter(self, cell: Cell, wake_fd: int | None = None) -> supervisor.Waiter:
        w = supervisor.Waiter(cell.child, cell.node, cell.plan.grace, cell.plan.timeout, wake_fd,
                              token=cell.spec.token, pump=cell.pump, oom_fd=cell.oom_fd)
        w.cancelled_elsewhere = lambda: self._cancel_reason(cell) is not None
        return w

    def _cancel_reason(self, cell: Cell) -> str | None:
        """The first cancel recorded for the cell by any process (agnsup cancel), or None."""
        row = self.journal.db.execute("SELECT cancel_reason FROM cells WHERE run_id=? AND cell_id=?",
                                      (cell.spec.run_id, cell.spec.cell_id)).fetchone()
        return row[0] if row else None

    def finish(self, cell: Cell, outcome) -> dict:
        """Release what the cell held, journal its end, write its receipt."""
        why = self._cancel_reason(cell)
        if why and outcome.reason != "timeout":
            # cancelled from another process: the journal holds the first reason
            outcome.reason, outcome.state, outcome.cancel_reason = "cancelled", "cancelled", why
        if outcome.state == "cancelled" and outcome.signal is None:
            # it exited on its own after SIGTERM: a cancelled cell still ends 128+SIGTERM (cli.md)
            outcome.exit_code = 128 + 15
        usage = cgroup.read_usage(cell.node) if cell.node else {}
        if usage.get("oom_kills") and outcome.reason in ("exited", "killed"):
            # the kernel's OOM killer acted inside the cell (v2 memory.oom.group took all of it)
            outcome.reason, outcome.state = "oom", "killed"
        self._close_fds(cell)
        released = self._release(cell)
        receipt = self._conclude(cell, outcome, usage, released)
        return receipt

    def fail(self, cell: Cell, error: AgnsupError) -> dict:
        """A cell that never ran: undo what exists, record why."""
        from .supervisor import Outcome
        code = getattr(error, "exit_code", 125)
        outcome = Outcome(exit_code=code, status=None, signal=None, reason=type(error).__name__, state="failed")
        if isinstance(error, CancelledBeforeStart):
            outcome.reason, outcome.state, outcome.cancel_reason = "cancelled", "cancelled", self._cancel_reason(cell)
        if cell.child is not None:
            os.close(cell.child.pidfd)
        self._close_fds(cell)
        if cell.node is not None and cgroup.populated(cell.node):
            cgroup.kill(cell.node)
            cgroup.wait_empty(cell.node, 5)
        released = self._release(cell)
        return self._conclude(cell, outcome, {}, released, error=error.message)

    def _close_fds(self, cell: Cell) -> None:
        self._stop_egress(cell)
        if cell.pump is not None:
            cell.pump.close()
        if cell.oom_fd is not None:
            os.close(cell.oom_fd)
            cell.oom_fd = None

    def _release(self, cell: Cell) -> list:
        from .reap import release_cell_resources
        released = release_cell_resources(cell.node, cell.plan.tmpdir, self.base)
        if cell.lock_fd is not None:
            locks.release(cell.lock_path, cell.lock_fd)
            cell.lock_fd = None
            released.append({"kind": "worktree_lock", "path": cell.lock_path})
        return released

    def _conclude(self, cell: Cell, outcome, usage: dict, released: list, error: str | None = None) -> dict:
        from . import receipts
        spec = cell.spec
        receipt = receipts.cell_receipt(cell, outcome, usage, released, error)
        path = os.path.join(cell.plan.cell_dir, "receipt.json")
        try:
            receipts.write(path, receipt)
        except OSError:
            path = None
        with self.journal.tx() as db:
            self.journal.update_cell(db, spec.run_id, spec.cell_id, state=receipt["state"], ended_at=receipt["ended_at"],
                                     exit_code=receipt["exit_code"], signal=receipt["signal"],
                                     reason=receipt["reason"], receipt_path=path)
            self.journal.add_receipt(db, "cell", spec.run_id, spec.cell_id, receipt)
            self.journal.event(db, "state." + receipt["state"], spec.run_id, spec.cell_id, reason=receipt["reason"],
                               exit_code=receipt["exit_code"])
            if self.one_cell and self._registered:  # its one cell is concluded: so is the controller
                self.journal.end_controller(self.id, db)
        if self.one_cell and self._registered:
            self._ended = True
        return receipt


def _cell_pty(like: int) -> tuple[int, int]:
    """A pty for the cell's output, sized like the controller's terminal `like`.

    Output post-processing is off (no ONLCR) so bytes reach the real terminal
    unchanged, and it does its own processing there."""
    import fcntl
    import termios
    master, slave = os.openpty()
    attrs = termios.tcgetattr(slave)
    attrs[1] &= ~termios.OPOST
    termios.tcsetattr(slave, termios.TCSANOW, attrs)
    try:
        fcntl.ioctl(master, termios.TIOCSWINSZ, fcntl.ioctl(like, termios.TIOCGWINSZ, b"\0" * 8))
    except OSError:
        pass
    return master, slave


def record_denied(state, spec, decision: dict, trail: list, trace: list) -> None:
    """A denied call starts nothing, but the journal remembers it was asked."""
    j = state.journal()
    try:
        with j.tx() as db:
            j.event(db, "denied", spec.run_id, spec.cell_id, argv=spec.argv, decision=decision, trail=trail,
                    chain=[s["stage"] for s in trace])
    finally:
        j.close()
