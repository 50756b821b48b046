"""The broker: identity, journal intent, locks, and the cell's life cycle.

A Controller is one controller instance: it holds an exclusive flock on
<state>/controllers/<id>.lock for its whole life (the janitor's proof of
liveness) and journals every cell it starts, in two phases: the intent row
before any kernel object exists, the identity before the command may exec.

    start(prepared)   lock the worktree, journal the intent (run quotas judged inside
                      that transaction), make the cell's place (backend; its /tmp: home.py)
                      and its stdio (io.wiring), fork the leader (process.leader), journal
                      its identity, let it exec
    waiter(cell)      the wait loop (process.wait), stopping the cell's tree (reaper.Tree)
    finish(cell, w)   what is left of the tree after the leader is reaped (reaper), the
                      outcome, the receipt; fail(cell, error) for a cell that never ran

A one-cell controller (`agnsup run`, run_process) writes fewer transactions
for the same records: its own row rides in the cell's intent transaction
(its liveness lock is taken just before), and its end in the cell's
conclusion. What is durable when is unchanged (tests/test_crashpoints.py).
"""
from __future__ import annotations

import functools
import json
import os
import time

from . import changes, home, locks, protect, receipts, reaper
from .util import crashpoints
from .process import helpers, leader, wait
from .errors import AgnsupError, CancelledBeforeStart, Denied, RunNotActive, SetupError, StateError, UsageError
from .io import wiring
from .linux import pidfd, proc
from .store import spares
from .store.state import named_run
from .util.record import Factory, Record

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
    secrets: list | None = None  # secrets.Secret values (memory only): the proxy puts them on the wire


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
    pump: object = None          # io.pump.Pump when the role caps output or the cell is live
    input: object = None         # io.pump.Input: the supervisor's end of the cell's fd 0
    terminal: object = None      # io.pump.Input on the pty's master (pty cells)
    controlling_tty: bool = False  # agnsup run at a terminal: the cell's pty is its controlling terminal
    caller_stdio: tuple | None = None  # the caller's fds 0-2 when not this controller's own (serve's run_attached)
    egress: object = None        # egress.proxy.Proxy: allowlist/internal roles
    network: dict | None = None  # the receipt's network section, once the proxy stopped
    waiting: bool = False        # queued behind a held worktree lock (state waiting): Controller.resume starts it
    lock_holder: str = ""        # who held it when the cell was queued (locks.take)
    protect_start: dict | None = None   # the protected paths' baseline at start (protect.start)
    protected: dict | None = None       # the receipt's `protected` section, once the tree is dead
    cancelled_starting: str | None = None  # a cancel recorded between its identity commit and `running`
    layer: object = None         # changes.Layer: the overlay's upper and work, while a capturing cell runs
    changes: dict | None = None  # the receipt's `changes` section (changes.commit's summary, or live/none and why)
    audit: object = None         # linux.audit.Reader: the cell's Landlock denials, where the host audits
    landlock_audit: dict | None = None  # what it read once the tree was dead, or {"why": ...} it reads nothing
    net_tries: dict | None = None  # deny/loopback, a failed cell: what had no route out of its netns (netns_tries)
    pod: object = None           # pod.Membership: the cell's hold on its agent's network pod (plan.network_pod)
    secrets: list | None = None  # secrets.Secret values (memory only, never journaled): handed to its proxy
    authority: object = None     # egress.ca.Authority: the controller's CA, when the cell has secrets
    secret_summary: list | None = None  # the receipt's `secrets` section, once the proxy stopped
    scrubbed: dict | None = None  # {secret name: values masked in its capture files}, once it ended
    receipt_fd: int | None = None  # its receipt's file, made and opened while it runs (receipts.reserve)
    draft: object = None         # receipts.Draft: what of its receipt is fixed once it runs, encoded meanwhile (draft)

    def target(self) -> reaper.Target:
        spec = self.spec
        return reaper.Target(run_id=spec.run_id, cell_id=spec.cell_id, place=self.place,
                             leader=self.identity or None, token=spec.token,
                             since=self.identity.get("starttime") or 0, tmpdir=self.plan.tmpdir,
                             lock_path=self.lock_path, lock_fd=self.lock_fd)


def spare_files() -> dict[str, int]:
    """The empty files a controller's cell spare holds (store/spares.py), name -> mode as the cell's own path makes
    them: its output files (io/wiring.stdio), the protected paths' baseline (protect.start), the receipt's reserve
    (receipts.reserve: named by the controller's pid); _make_place unlinks those a cell does not open."""
    return {"stdout": 0o600, "stderr": 0o600, "protect-start.json": 0o666,
            os.path.basename(receipts.reserved_name("receipt.json")): 0o666}


class Controller:
    def __init__(self, state, kind: str = "run", journal=None, one_cell: bool = False, backend=None, forker=None):
        """`journal`: an open Journal to use (and close) instead of opening one.
        `one_cell`: this controller starts one cell and ends with it. `forker`: the
        long-lived thread every cell is forked from (process.leader.spawn), when this
        controller has many threads."""
        from . import backend as backends
        from .store.chain import signing_problem
        unsigned = signing_problem()
        if unsigned:
            raise UsageError(unsigned)
        self.state = state.ensure()
        self.journal = journal if journal is not None else state.journal()
        self.kind = kind
        self.one_cell = one_cell
        self.id = "ctl-" + os.urandom(6).hex()  # not `secrets`: ~5 ms of imports for the same bytes
        self.lock_path = state.controller_lock(self.id)
        self._lock_fd: int | None = None
        self._registered = self._ended = False
        self._ca_cert: str | None = None  # <state>/ca/<id>.pem once a cell had secrets: removed at close
        if not one_cell:
            self._take_lock()
            self.journal.register_controller(self._row())
            self._registered = True
            self.journal.checkpoint_behind()  # the WAL's checkpoints off its cells' commits (store/journal.py)
        else:
            self.journal.checkpoint_in_quiet_commits()  # ... into its identity commit (store/journal.py)
        self.backend = backend if backend is not None else backends.choose(state.path)
        self.backend.enter(helpers.run_helper)  # under systemd: into agnsup's own unit, before any cell
        self.forker = forker
        self.cell_spares = None  # process.cellspare.CellSpares: a Supervisor's cells made ahead, cgroup and leader
        self.tmp_spare = None  # process.leader.TmpSpare: a Supervisor's cells' /tmp tmpfs, made ahead between cells
        self.mount_spare = None  # process.leader.MountSpare: ... and their /dev, hides and masks
        self.pods = None  # pod.Linger: a controller of many cells keeps a pod a moment after its last cell left
        if not one_cell:
            from .pod import Linger
            self.pods = Linger(self.backend, self.state)
            self.backend.hold()  # its cells' agent, run and base directories stay between cells (let go at close)

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
            if self.pods is not None:  # every lingering pod let go of at once, torn down when free
                pods, self.pods = self.pods, None
                try:
                    pods.close()
                except OSError:
                    pass  # left to the janitor's sweep
            self.backend.let_go()  # after the pods: the directories they hung from too
            if self._ca_cert is not None:  # its CA's key died with it: nothing may trust the certificate now
                try:
                    os.unlink(self._ca_cert)
                except OSError:
                    pass
                self._ca_cert = None
            if self._lock_fd is not None:
                locks.release(self.lock_path, self._lock_fd)
                self._lock_fd = None
            if not leave_journal_open:
                self.journal.close()

    # -- start ------------------------------------------------------------
    def start(self, prepared: Prepared, capture: bool = False, notify=None, stdin: bool = False,
              pty: dict | None = None, stream: bool = False, queue: bool = False, poll=None,
              caller_stdio: tuple | None = None) -> Cell:
        """Lock the worktree, journal the intent, start the cell. `queue`: when the lock
        is held, journal the cell as `waiting` and return it at once (cell.waiting);
        `resume` then waits for the lock and starts it. `poll()`: called while it waits
        for the lock, may raise to give up (a signal to `agnsup run`). `caller_stdio`: the
        caller's fds 0-2 when they are not this process's (io/wiring.py)."""
        plan = prepared.plan
        spec = plan.spec
        cell = Cell(spec=spec, plan=plan, controller_id=self.id, boot_id=proc.boot_id(), decision=prepared.decision,
                    trail=prepared.trail, trace=prepared.trace, capture=capture or stream or pty is not None,
                    stdin=stdin, pty=pty, stream=stream or pty is not None, secrets=prepared.secrets,
                    caller_stdio=caller_stdio)
        cell.lock_path = self.state.worktree_lock(locks.worktree_key(spec.worktree, spec.run_id, spec.cell_id))
        if queue:
            cell.lock_fd, cell.lock_holder = locks.take(cell.lock_path, plan.worktree_mode == "rw", self._owner(spec),
                                                        spec.worktree, self._agent(spec))
            cell.waiting = cell.lock_fd is None
        else:
            cell.lock_fd = self._wait_for_lock(cell, notify, poll)
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
        return locks.owner_of(spec.run_id, spec.agent_id, spec.cell_id)

    @staticmethod
    def _agent(spec) -> str:
        # in the run "default" (a call that names no run) each cell is an agent of its own, as for pods
        agent = spec.agent_id if named_run(spec.run_id) else f"{spec.agent_id}.{spec.cell_id}"
        return locks.agent_of(spec.run_id, agent)

    def _wait_for_lock(self, cell: Cell, notify=None, poll=None) -> int:
        """The cell's worktree lock: its agent's other cells are never in the way, another
        agent's may be (locks.py). The wait is bounded by the call's timeout too (locks.wait_bound)."""
        spec = cell.spec
        bound, by = locks.wait_bound(spec.lock_timeout, spec.timeout)
        return locks.acquire(cell.lock_path, cell.plan.worktree_mode == "rw", bound, f"worktree {spec.worktree}",
                             self._owner(spec), notify, tree=spec.worktree, poll=poll, agent=self._agent(spec),
                             bound_by=by)

    def resume(self, cell: Cell) -> Cell:
        """A waiting cell: wait for its worktree lock (up to its lock_timeout or timeout; a
        cancel recorded meanwhile wins), then start it like any other."""
        spec = cell.spec

        def cancelled():
            self.journal.refuse_cancelled(spec.run_id, spec.cell_id)
        try:
            cell.lock_fd = self._wait_for_lock(cell, False, cancelled)
            cancelled()
            self.journal.mark_starting(spec.run_id, spec.cell_id)
        except AgnsupError as e:
            self.fail(cell, e)
            raise
        cell.waiting = False
        return self._launch(cell)

    def _launch(self, cell: Cell) -> Cell:
        plan, spec = cell.plan, cell.spec
        # a spare given to this cell's request (Supervisor._start), taken when it fits: after the gate and the intent
        spare = self.cell_spares.take(plan, cell.place) if self.cell_spares is not None else None
        try:
            self._make_place(cell, spare)
            crashpoints.hit("after_cgroup")
            stdio, cell.pump = wiring.stdio(cell)
            if plan.worktree_mode == "rw":
                cell.protect_start = protect.start(plan)
            if plan.landlock_writable is not None and plan.landlock_abi >= 7:  # its denials, where the host audits
                from .linux import audit
                cell.audit, cell.landlock_audit = audit.subscribe(plan)
            try:
                cell.child = leader.spawn(plan, self.backend, cell.place, stdio, self.forker,
                                              ctty=cell.pty is not None or cell.controlling_tty,
                                              netns_fd=self._join_pod(cell), tmp_spare=self.tmp_spare,
                                              mount_spare=self.mount_spare, spare=spare)
                spare = None  # the cell's leader now
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
            if cell.child.egress_listener is not None:  # allowlist/internal: the proxy is the cell's only way out
                from . import egress
                cell.egress = egress.serve(cell.child.egress_listener, plan.egress_rules, self.journal.path,
                                           spec.run_id, spec.cell_id, secrets=cell.secrets,
                                           authority=cell.authority)
            crashpoints.hit("after_exec")
            cell.cancelled_starting = self.journal.mark_running(spec.run_id, spec.cell_id)
            # the receipt file's inode while the command runs, not at its end (receipts.reserve)
            cell.receipt_fd = receipts.reserve(os.path.join(plan.cell_dir, "receipt.json"))
        except AgnsupError as e:
            self._drop_spare(spare)
            self.fail(cell, e)
            raise
        except OSError as e:
            self._drop_spare(spare)
            err = StateError(f"cell setup failed: {e}")
            self.fail(cell, err)
            raise err from None
        return cell

    @staticmethod
    def _drop_spare(spare) -> None:
        """A taken spare whose cell failed before its leader got the Setup: the leader exits without exec; its
        directories are the cell's place now, which the cell's failure removes (fail)."""
        if spare is not None:
            spare.discard(keep_place=True)

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

    def _make_place(self, cell: Cell, spare=None) -> None:
        spec, plan, backend = cell.spec, cell.plan, self.backend
        if spare is not None:  # made ahead with the same limits (its key), the intent's paths: its inode is journaled
            cell.place = spare.place
        elif cell.place.node is not None:
            cell.place = backend.create(cell.place, plan.limits)
        if home.make(plan):  # a spare (store/spares.py, spare_files): what this cell does not open goes
            rw = plan.worktree_mode == "rw"
            spares.trim(plan.cell_dir, [n for n, used in (("stdout", cell.capture), ("stderr", cell.capture),
                                                          ("protect-start.json", rw)) if not used])
        if cell.secrets:
            self._trust(cell)
        if plan.captures():
            cell.layer = changes.prepare_cell(self.state.path, plan)
        # no limit is reported that is not in force: each missing one is named, or refused
        gaps = backend.limit_gaps(cell.place, plan.limits)
        if gaps and plan.require_limits:
            raise SetupError(f"role {spec.role} requires limits, which are not in force here: {'; '.join(gaps)}",
                             step="require")
        cell.isolation = plan.isolation(backend, cell.place.limits, gaps)
        st = stage("backend", layout=backend.kind, cgroup=cell.place.paths(), cgroup_inode=cell.place.inode,
                   isolation=cell.isolation)
        cell.trace.append(st)
        self.journal.stage(spec.run_id, spec.cell_id, st, cgroup_ino=cell.place.inode)

    def _trust(self, cell: Cell) -> None:
        """A cell with secrets trusts the controller's CA (made at its first such cell, key in memory only): its
        certificate at <state>/ca/<controller>.pem, and in the cell's own /tmp the bundle its clients read (the
        host's system bundle + that certificate; the compiler binds it over the system bundle) and the
        certificate alone (NODE_EXTRA_CA_CERTS). The values go to the cell's proxy and its output's redaction."""
        from . import secrets
        from .egress.ca import authority
        cell.authority = authority(self.state.path, self.id)
        if self._ca_cert is None:
            self._ca_cert = cell.authority.write_cert(self.state.ca_dir)
        for rel, data in ((secrets.CA_BUNDLE_REL, secrets.bundle_text(cell.authority.cert_pem)),
                          (secrets.CA_CERT_REL, cell.authority.cert_pem)):
            path = os.path.join(cell.plan.tmpdir, rel)
            os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
            with open(path, "xb") as f:
                f.write(data)
            os.chmod(path, 0o444)
        secrets.remember(cell.spec.run_id, cell.spec.cell_id, cell.secrets)

    def _join_pod(self, cell: Cell) -> int | tuple | None:
        """A cell of a pod (plan.network_pod): join its agent's pod (made when none is alive, agnsup/pod.py) and
        return a descriptor of the pod's network namespace for the child to setns into (a normal user's: and of
        the pod's user namespace, (net, user)); else None."""
        if not cell.plan.network_pod:
            return None
        from . import pod
        from .linux import host, userns
        spec = cell.spec
        owner = userns.netns_owner() if os.geteuid() == 0 and not host.net_admin() else None
        try:
            cell.pod = pod.join(self.state, self.backend, spec.run_id, spec.agent_id,
                                own_userns=cell.plan.user_namespace, netns_owner=owner, linger=self.pods)
            # those its join's proof of the keeper got (pod.Pod.ns_fds); a normal user's pod: its cells are of its
            # user namespace too
            fd, us = cell.pod.pod.ns_fds()
        except OSError as e:
            raise SetupError(f"cell setup failed at step 'network_pod': the network pod of agent {spec.agent_id} "
                             f"of run {spec.run_id}: {e.strerror or e}", step="network_pod", errno=e.errno) from None
        cell.isolation["network_pod"] = cell.pod.pod.key
        return (fd, us) if us is not None else fd

    def _leave_pod(self, cell: Cell) -> None:
        """The cell's tree is dead: let go of its pod; the last member out tears it down, in a controller of many
        cells after a linger of pod.LINGER s (agnsup/pod.py)."""
        if cell.pod is None:
            return
        from . import pod
        membership, cell.pod = cell.pod, None
        try:
            pod.leave(self.state, self.backend, membership, forks=not self.one_cell, linger=self.pods)
        except OSError:
            pass  # a pod left behind is the janitor's (pod.sweep); the cell's end is recorded all the same

    def _identity(self, cell: Cell) -> None:
        ident = cell.child.identity
        cell.identity, cell.started_at = ident, time.time()
        st = stage("process_supervisor", pid=ident["pid"], pgid=ident["pgid"], starttime=ident["starttime"],
                   pidfd_ino=ident["pidfd_ino"])
        cell.trace.append(st)
        self.journal.commit_identity(cell.spec.run_id, cell.spec.cell_id, {**ident, "started_at": cell.started_at}, st)

    # -- wait and finish --------------------------------------------------
    @staticmethod
    def draft(cell: Cell) -> None:
        """While the command runs, on the thread that will wait for it: what of its receipt is fixed by now, encoded
        (receipts.Draft), so that its end encodes only the rest. Best effort: without it the end encodes it all."""
        try:
            cell.draft = receipts.Draft(cell)
        except Exception:  # noqa: BLE001 - an optimisation: the receipt is whole without it
            cell.draft = None

    def waiter(self, cell: Cell, wake_fd: int | None = None, hold: bool = False) -> wait.Waiter:
        """`hold`: the waiter holds the cell's mount namespace (Waiter.hold_mounts), and the caller lets it go
        after the cell's result (a Supervisor: its teardown off the path from the command's exit to the result)."""
        tree = reaper.Tree(self.backend, cell.target(), cell.child.pidfd)
        waiter = wait.Waiter(cell.child.pidfd, tree, cell.plan.grace, cell.plan.timeout, wake_fd, pump=cell.pump,
                                   oom_fd=cell.place.oom_fd)
        if hold and cell.plan.mount_namespace:
            waiter.hold_mounts(cell.child.pid)
        if cell.cancelled_starting:
            # cancelled after its identity commit, before its leader was surely in its tree: the
            # canceller's reaper may have found nothing, so the stop is ours (TERM, grace, kill)
            waiter.request_stop("cancelled", cell.cancelled_starting)
        return waiter

    def finish(self, cell: Cell, waiter: wait.Waiter, later: list | None = None) -> dict:
        """The leader has exited: reap the rest of the tree, then the leader; release
        what the cell held, journal its end, write its receipt.

        `later`: a list the caller runs after it handed the result over (a Supervisor's cell thread): finish puts
        there what need not precede the result, and whose loss in a crash the janitor makes good: an unchanged
        change layer's directories (its pending marker stays until they are gone: changes.finish_all). Everything
        the receipt states is done before it is written; None: all now."""
        spec, target = cell.spec, cell.target()
        if target.has_tree and cell.plan.pid_namespace:
            # The leader was its PID namespace's init: the kernel reported its exit only once every other process
            # of the namespace was gone (zap_pid_ns_processes), and the rest of the tree is the cgroup's to kill,
            # not evidence's: its pid need not stay reserved until the stop below. Its reap (the fork server's
            # round trip) overlaps the stop.
            leader.ask_reap(cell.child)
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
        if why and reason != "timeout":  # cancelled from another process: the journal holds the first reason
            reason, cancel_reason = "cancelled", why
        usage = self.backend.usage(cell.place)
        if cell.child.tmp_used is not None:
            usage["tmp_bytes"] = cell.child.tmp_used  # the /tmp tmpfs when the cell ended (limits.tmp_max)
        if usage.get("oom_kills") and reason in ("exited", "killed"):
            reason = "oom"  # the kernel's OOM killer acted inside the cell (v2 memory.oom.group took all of it)
        outcome = wait.Outcome.of(reason, status, sig, stop_signal=waiter.stop_signal, cancel_reason=cancel_reason,
                                  kill_method=waiter.kill_method or left.method, leftover=left.left)
        cell.net_tries = leader.netns_tries(cell.child, read=outcome.exit_code != 0)  # the network hint's evidence
        self._close_fds(cell)
        self._commit_changes(cell, later)  # the tree is dead; the worktree lock is still ours; before protect.settle
        if cell.protect_start is not None:  # what it planted where tools run files on their own leaves the worktree
            cell.protected = protect.settle_cell(self.journal, spec.run_id, spec.cell_id, cell.plan.cell_dir,
                                                 cell.protect_start)
            changes.drop_quarantined(self.state.path, spec.run_id, spec.cell_id, cell.changes,
                                     cell.protected["quarantined"])
        receipt = self._conclude(cell, outcome, usage, reaper.release(self.backend, target))
        changes.prune_after(self.state, self.journal, cell.changes, cell.plan.changes)
        return receipt

    def _commit_changes(self, cell: Cell, later: list | None = None) -> None:
        """The receipt's `changes` section (changes.at_end): a commit that fails leaves its plan for the
        janitor (changes.finish_all) and the section names the error; the cell's end is recorded all the same.
        With `later` (finish's), a layer the cell left unchanged is removed after the result (changes.unchanged)."""
        if cell.layer is not None:  # the agent's other cells may be committing into the same worktree
            with locks.commit_mutex(os.path.dirname(changes.layer_dir(self.state.path, cell.spec.run_id,
                                                                       cell.spec.cell_id))):
                if later is not None and changes.unchanged(self.state.path, cell.plan):
                    section = changes.nothing_changed()
                    later.append(functools.partial(changes.drop_unchanged, self.state.path, cell.plan))
                else:
                    section = changes.at_end(self.state.path, cell.plan, True)
        else:
            section = changes.at_end(self.state.path, cell.plan, False)
        if section is not None:
            cell.changes = section
        if cell.layer is not None and section["mode"] == "live":  # the kernel refused the overlay: it ran live
            cell.isolation["not_in_force"] = [*cell.isolation.get("not_in_force", []),
                                              f"reversible (the cell's writes landed live, uncaptured): "
                                              f"{section['why']}"]
        cell.layer = None

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
        receipt = self._conclude(cell, outcome, {}, r.released, error=error.message)
        changes.prune_after(self.state, self.journal, cell.changes, cell.plan.changes)
        return receipt

    @staticmethod
    def drop_reserve(cell: Cell) -> None:
        """Close the receipt's reserved file when the cell's end never reached its receipt (an error in
        `finish`): the empty file stays for the janitor (receipts.discard_reserved), the descriptor goes."""
        fd, cell.receipt_fd = cell.receipt_fd, None
        if fd is not None:
            os.close(fd)

    def _close_fds(self, cell: Cell) -> None:
        if cell.plan is not None and cell.plan.egress is not None and cell.network is None:  # the proxy's records
            from . import egress
            listener = cell.child.egress_listener if cell.child is not None else None
            cell.network = egress.receipt_section(cell.egress, cell.plan.egress, listener)
            if cell.plan.spec.secrets:  # what each secret was used for, refused for (never a value)
                cell.secret_summary = egress.secret_section(cell.egress, cell.plan.spec.secrets)
            cell.egress = None
        if cell.child is not None:  # a cell that never ran: its network namespace is let go unread
            leader.netns_tries(cell.child, read=False)
        if cell.audit is not None:  # the tree is dead: its Landlock domain has ended, or ends now
            reader, cell.audit = cell.audit, None
            cell.landlock_audit = reader.conclude()
        wiring.close(cell)
        self._leave_pod(cell)
        if cell.place is not None and cell.place.oom_fd is not None:
            os.close(cell.place.oom_fd)
            cell.place.oom_fd = None

    def _conclude(self, cell: Cell, outcome, usage: dict, released: list, error: str | None = None) -> dict:
        cell.lock_fd = None  # `released`: the reaper's release dropped the worktree lock the cell's target carried
        if cell.secrets and cell.plan is not None:  # issue 32: no value kept in its capture files (egress/scrub.py)
            from .egress.scrub import scrub_cell
            cell.scrubbed = scrub_cell(cell.plan.cell_dir, cell.secrets)
        drafted, cell.draft = cell.draft, None
        receipt = receipts.cell_receipt(cell, outcome, usage, released, error, drafted)
        text = receipts.dumps(receipt, drafted)  # one encoding for the file and the journal's row
        path = os.path.join(cell.plan.cell_dir, "receipt.json")
        fd, cell.receipt_fd = cell.receipt_fd, None
        try:
            receipts.write(path, receipt, text=text, fd=fd)
        except OSError:
            path = None
        ends = self.id if self.one_cell and self._registered else None  # its one cell concluded: so is the controller
        try:
            self.journal.conclude_cell(receipt, path, end_controller=ends, text=text)
        except StateError as e:  # a full or read-only state root: the tree is gone, say what is not recorded
            raise StateError(f"cell {cell.spec.cell_id} ended ({receipt['state']}, exit {receipt['exit_code']}) but "
                             f"its end could not be journaled (receipt {'at ' + path if path else 'not written'}; "
                             f"the next janitor concludes it): {e.message}") from None
        if ends:
            self._ended = True
        return receipt

