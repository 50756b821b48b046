"""Supervisor: one long-lived controller instance for many concurrent cells.

The Python API an agent runtime embeds, and the core of `agnsup serve`:

    with Supervisor(state_dir) as sup:
        h = sup.spawn(["pytest", "-q"], run_id="R", agent_id="A")   # returns at once
        sup.wait(h["run_id"], h["cell_id"])                          # the result
        sup.cancel(run_id="R", agent_id="A")                         # three levels, or all
        sup.cleanup("R"); sup.list()
        sup.publish_port("R", "A", 8000)   # the agent's pod port 8000 on 127.0.0.1:N (agnsup/ports.py)

One Controller (one liveness lock, one journal connection) serves every cell;
each cell has a thread that waits for it and writes its receipt, or, for `run` and
`run_attached`, whose caller waits anyway, the caller's own thread does (`_here`). Cancel and
cleanup go through the journal and the cgroups (agnsup/cancel.py) exactly as
from another process. If this process is SIGKILLed, the janitor of the next
controller recovers its cells like any other controller's.
"""
from __future__ import annotations

import functools
import os
import signal as _signal
import sys
import threading
from contextlib import suppress

from .errors import UnknownId, UsageError
from .util import crashpoints

SIGNALS = {"INT": 2, "TERM": 15, "KILL": 9}  # what Supervisor.signal sends (signal(7) numbers)


class _Running:
    def __init__(self, cell, request, caller=None):
        self.cell, self.request, self.caller = cell, request, caller
        self.said: list[str] = []  # a caller's cell (run_attached): the lines `agnsup run` prints after it
        self.waiter = None
        self.started = threading.Event()  # its process exists (a queued cell: once it got its lock), or it never will
        self.done = threading.Event()
        self.result: dict | None = None
        self.error: BaseException | None = None
        # Our own pidfd of the leader, for group signals: the broker's copy is closed when the
        # leader is reaped. `lock` orders signal() against the end of the wait.
        self.lock = threading.Lock()
        self.group_fd: int | None = None
        self.leader_gone = False

    def attach(self, waiter) -> None:
        with self.lock:
            self.waiter = waiter
            self.group_fd = os.dup(self.cell.child.pidfd)
        self.started.set()


class _Worker:
    """A thread that runs the functions queued to it, in order, for as long as the Supervisor lives."""

    def __init__(self, name: str):
        import queue
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            fn, box, done = job
            try:
                box.append((True, fn()))
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                box.append((False, e))
            if done is not None:
                done.set()

    def call(self, fn):
        """Run `fn()` on the thread and return what it returned there."""
        box: list = []
        done = threading.Event()
        self.jobs.put((fn, box, done))
        done.wait()
        ok, value = box[0]
        if not ok:
            raise value
        return value

    def submit(self, fn) -> None:
        """Run `fn()` on the thread after the jobs queued before it; nobody waits for it and what it raises goes
        nowhere."""
        self.jobs.put((fn, [], None))

    def close(self) -> None:
        self.jobs.put(None)
        self.thread.join(5)


# what a spawn request unpickles (process/forkserver.py): the backend and its place (the plan travels as a
# forkserver.LeaderPlan of plain values). Nothing more: every module the server holds is mapped into each leader,
# whose page tables its clone copies (~0.02 ms a cell for agnsup.plan's and the proxy handoff's 16 modules); the
# proxy's handoff is imported by the first request that carries one, before that request's clone
PRELOAD = ("agnsup.backend.cgroups",)


class _Forker:
    """The thread a Supervisor's fork server is started from, and the server (process/forkserver.py), in which
    every cell's leader is born. The thread lives as long as the Supervisor: the server's PR_SET_PDEATHSIG (set
    before its exec) fires when the *thread* that forked it ends (prctl(2)), and serve's request threads end
    with their connections; each leader's follows the server. A server that died is started again, from this
    thread, by the next spawn."""

    def __init__(self):
        from .process.forkserver import Client
        self.server = Client(PRELOAD)
        self.worker = _Worker("agnsup-forker")
        self.starting = threading.Lock()
        self.worker.submit(self._ensure)  # at once, off the caller's path: the first cell finds it ready

    def _ensure(self) -> None:
        with self.starting:
            if not self.server.alive():
                self.server.start()

    def spawn(self, s, cgroup2: str | None):
        """leader.spawn's clone, in the fork server: (pid, pidfd, born, reap channel)."""
        if not self.server.alive():
            self.worker.call(self._ensure)  # raises forkserver.ServerGone saying why it cannot start
        return self.server.spawn(s, cgroup2)

    def close(self) -> None:
        self.worker.call(self.server.stop)
        self.worker.close()


class Supervisor:
    def __init__(self, state_dir: str | None = None, kind: str = "serve", backend=None):
        from . import broker, janitor
        from .store import repair
        from .store.state import StateRoot
        self.state = StateRoot(state_dir).ensure()
        janitor.on_start(self.state)
        self._backend = backend  # the cells' (and cancel's) instead of the host's (backend.choose): tests' fake
        self.ctl = broker.Controller(self.state, kind=kind, backend=backend)
        self.ctl.forker = self._forker = _Forker()  # after the backend entered its place (systemd: its unit)
        self.ctl.journal.lock = threading.RLock()
        # the cells' empty directories and files on the state root's disk, made ahead between cells (store/spares.py);
        # after the controller's lock is held: the janitor sweeps only a dead controller's
        from .store import spares
        self._spares = spares.start(self.state.path, self.ctl.id, broker.spare_files())
        from .process.leader import MountSpare, TmpSpare
        self.ctl.tmp_spare = TmpSpare()  # the next cell's /tmp tmpfs, made after a cell's result (process/leader.py)
        self.ctl.mount_spare = MountSpare()  # ... and its /dev, hides and masks
        # the next cell of an agent made ahead, its cgroup and its leader included (process/cellspare.py)
        from .process.cellspare import CellSpares
        from .spec import new_cell_id
        if hasattr(self.ctl.backend, "clone_dir"):  # a cgroup backend (a test's fake has no directory to be born in)
            self.ctl.cell_spares = CellSpares(self.ctl.backend, self._forker.server, new_cell_id,
                                              lambda run_id, cell_id: os.path.lexists(self.state.cell_dir(run_id,
                                                                                                          cell_id)),
                                              self._forker.worker.submit)
        repair.maybe_prune(self.state, self.ctl.journal)  # the journal's default retention bound
        self._cells: dict[tuple[str, str], _Running] = {}
        self._threads: set[threading.Thread] = set()  # the cells' threads, until their work after the result ends
        self._guard = threading.Lock()
        # what the cells waited for on their callers' threads (run, run_attached) leave for after their results
        self._after = _Worker("agnsup-after")
        self._ending = 0  # such cells between their wait and that hand-over (close waits for them: _quiet)
        self._quiet = threading.Condition()
        self.closed = False

    @property
    def controller_id(self) -> str:
        return self.ctl.id

    # -- start ------------------------------------------------------------
    def spawn(self, argv: list[str], *, notify=None, **options) -> dict:
        """Start a cell and return at once: {cell_id, run_id, agent_id, pid, cgroup, state}.
        `options` are request.CellRequest's (role, run_id, agent_id, cell_id, workdir,
        timeout, lock_timeout, env, host_env, capture, receipt_file, entry), all checked
        before anything is created. Raises AgnsupError (denied, not found...) like
        run_process. When another cell holds the worktree lock the cell is queued:
        state "waiting", pid None; its thread waits for the lock (up to lock_timeout)
        and starts it, and `wait` gives its result as for any cell; `notify(line)`
        hears that it was queued (default: stderr).

        Live I/O: `stdin=True` (write_stdin), `pty={"cols", "rows"}` (resize; output
        is the stream "tty"), `stream=True` (read_output); stream and pty capture.
        On a queued cell they wait until it started (signal: a queued cell is cancelled)."""
        _, cell = self._start(argv, notify, None, options)
        return {"cell_id": cell.spec.cell_id, "run_id": cell.spec.run_id, "agent_id": cell.spec.agent_id,
                "pid": cell.identity.get("pid"), "cgroup": cell.place.dir, "controller": self.ctl.id,
                "state": "waiting" if cell.waiting else "running"}

    def run_attached(self, argv: list[str], caller, notify=None, started=None, **options) -> tuple[dict, list[str]]:
        """A cell that belongs to a caller in another process (serve's run_attached: a handed-over `agnsup run`,
        doors/handoff.py), waited for here: (its result, the lines `agnsup run` prints after it).

        `caller` (serve.Caller): `stdio`, the caller's fds 0-2 the cell gets as `agnsup run` would give it
        its own (io/wiring.py); `poll()`, called while the cell waits for its worktree lock (raises to give
        up, as a signal to `agnsup run` does: it is not queued); `fd` and `on_wake(waiter, cell)`, the
        caller's connection, watched by the cell's wait loop (its signals; its end, the dead-man switch).
        `started(cell_id)`: once its command runs."""
        # what `agnsup run` does before its cell (cli.md: a controller runs the janitor first): a controller
        # that died since this serve started is recovered now, not at the serve's next start (~0.02 ms when
        # none did); under the journal's lock: the recovery's transactions share the connection
        from . import janitor
        from .store import repair
        with self.ctl.journal.lock:
            janitor.on_start(self.state, self.ctl.journal)
            repair.maybe_prune(self.state, self.ctl.journal)
        r, cell = self._start(argv, notify, caller, options, here=True)
        if started is not None:
            try:
                started(cell.spec.cell_id)
            except BaseException:
                self._hand_over(r)
                raise
        return self._here(r)

    def _start(self, argv: list[str], notify, caller, options: dict, here: bool = False) -> tuple["_Running", object]:
        """(the cell's _Running, its broker.Cell: r.cell is let go of once it ended, which may be before this
        returns). `here`: the caller waits for the cell on its own thread (`_here`): no thread is made for a cell
        that started (a queued one has its thread, which starts it)."""
        from .request import CellRequest
        from .tool import prepare
        if self.closed:
            raise UnknownId("this supervisor is closed")
        options.setdefault("entry", "api")
        spare_id = None
        if self.ctl.cell_spares is not None:
            # a request that names no cell id gets a spare's, the id its cgroup was made by (process/cellspare.py),
            # and one that names the id a spare was made under (name_next_cells) gets that spare: its gate decides
            # as for any id; the broker takes the spare after the intent, or discards it
            spare_id = self.ctl.cell_spares.offer(options.get("run_id") or "default",
                                                  options.get("agent_id") or "default", options.get("cell_id"))
            if spare_id is not None:
                options["cell_id"] = spare_id
        try:
            request = CellRequest.make(argv, **options)
            prepared = prepare(self.state, self.ctl.journal, request)
            if caller is not None:
                caller.cell_id = prepared.plan.spec.cell_id
            if caller is None:
                cell = self.ctl.start(prepared, capture=request.capture, notify=notify, stdin=request.stdin,
                                      pty=request.pty, stream=request.stream, queue=True)
            else:
                cell = self.ctl.start(prepared, capture=request.capture, notify=notify, stdin=request.stdin,
                                      pty=request.pty, stream=request.stream, poll=caller.poll,
                                      caller_stdio=caller.stdio)
        except BaseException:
            if spare_id is not None:  # not taken by its cell (refused, denied, failed): discarded, off the path
                self.ctl.cell_spares.give_back(options.get("run_id") or "default", spare_id)
            raise
        if spare_id is not None and cell.waiting:  # queued: made when it gets its lock, as without a spare
            self.ctl.cell_spares.give_back(cell.spec.run_id, spare_id, now=True)
        r = _Running(cell, request, caller)
        if not cell.waiting:
            r.attach(self.ctl.waiter(cell, caller.fd if caller is not None else None, hold=True))
        with self._guard:
            self._cells[(cell.spec.run_id, cell.spec.cell_id)] = r
        if not here or cell.waiting:
            self._hand_over(r)
        if cell.waiting:  # said once the cell is supervised: a notify that raises cannot orphan its row
            line = (f"agnsup: cell {cell.spec.cell_id} is waiting for the worktree {cell.spec.worktree} lock "
                    f"(held by {cell.lock_holder or 'another cell'})")
            try:
                notify(line) if notify is not None else print(line, file=sys.stderr, flush=True)
            except BaseException as e:  # noqa: BLE001 - the caller's news channel (an MCP request cancelled
                if isinstance(e, (KeyboardInterrupt, SystemExit)):  # meanwhile raises here); the cell is queued
                    raise
        return r, cell

    def _hand_over(self, r: _Running) -> None:
        """The cell's own thread waits for it and ends it (`_supervise`)."""
        t = threading.Thread(target=self._supervise, args=(r,), name=f"cell-{r.cell.spec.cell_id}", daemon=True)
        with self._guard:
            self._threads.add(t)
        t.start()

    def _here(self, r: _Running) -> tuple[dict, list[str]]:
        """Wait for a started cell and end it on this thread, the caller's, which waits for its result anyway: no
        cell thread to make while the command runs, and no wake-up of the caller when the result is ready (two
        hand-offs between threads on a cell's path). What follows the result runs on the Supervisor's
        `agnsup-after` thread, in order. An exception that interrupts the wait (KeyboardInterrupt on the main
        thread) hands the cell over to a thread of its own, as `spawn`'s, and is raised; on the main thread the
        signals with a Python handler are held while the cell ends (`_SignalsHeld`), so that no handler's
        exception can cut its end (receipt, conclusion, release) short: they run once it is recorded."""
        if r.waiter is None:  # queued: its thread starts it
            r.done.wait()
        else:
            try:
                self.ctl.draft(r.cell)  # (while the command runs)
                r.waiter.wait(_poll_wake(r))
                held = _SignalsHeld().hold() if threading.current_thread() is threading.main_thread() else None
            except BaseException:
                self._hand_over(r)  # (Waiter.wait again, at once if the leader exited: the timeout as it was)
                raise
            with self._quiet:
                self._ending += 1
            try:
                self._supervise(r, waited=True)
            finally:
                with self._quiet:
                    self._ending -= 1
                    self._quiet.notify_all()
                if held is not None:
                    held.release()
        if r.error is not None:
            raise r.error
        return r.result, r.said

    def _supervise(self, r: _Running, waited: bool = False) -> None:
        """Wait for the cell (unless `waited`: `_here` did), end it, hand its result over; then, on this thread (a
        cell thread) or on `agnsup-after` (`waited`), what may follow the result."""
        from .tool import ended, said_lines
        key = (r.cell.spec.run_id, r.cell.spec.cell_id)
        plan = r.cell.plan
        later: list = []  # what finish left for after the result (Controller.finish)
        try:
            if r.cell.waiting:
                self.ctl.resume(r.cell)
                r.attach(self.ctl.waiter(r.cell, hold=True))
            caller = r.caller
            if not waited:
                if r.cell.draft is None:
                    self.ctl.draft(r.cell)
                r.waiter.wait(_poll_wake(r))
            with r.lock:  # from here the broker reaps the tree: signal() has nothing left to do
                r.leader_gone = True
                os.close(r.group_fd)
                r.group_fd = None
            receipt = self.ctl.finish(r.cell, r.waiter, later)
            r.result = ended(receipt, r.cell.plan.cell_dir, r.request)
            if caller is not None:
                r.said = said_lines(receipt)
        except BaseException as e:  # noqa: BLE001 - reported to whoever waits
            r.error = e
        finally:
            if r.cell is not None:  # an end that never reached the receipt: its reserved file's descriptor
                self.ctl.drop_reserve(r.cell)
            with r.lock:
                if r.group_fd is not None:
                    os.close(r.group_fd)
                    r.group_fd = None
            live_io = r.cell.pump is not None and r.cell.pump.tape is not None
            if live_io:
                r.cell.pump.tape.close()  # however finish went: no reader waits for more,
            for end in (r.cell.input, r.cell.terminal):
                if end is not None:
                    end.close()           # and no writer for room
            r.started.set()
            if not live_io:  # (a live-I/O cell's output stays readable through read_output)
                r.cell = r.request = None  # an ended cell leaves memory (issue 12 item 17)
                if r.error is None:
                    with self._guard:
                        # a waiter that already holds `r` gets r.result; a later one reads the
                        # journal and the output files (_ended): the same result
                        self._cells.pop(key, None)
            waiter = r.waiter
            r.done.set()
            if waited:
                self._after.submit(functools.partial(self._after_cell, plan, r.result, waiter, later))
            else:
                self._after_cell(plan, r.result, waiter, later)
                with self._guard:
                    self._threads.discard(threading.current_thread())

    def _after_cell(self, plan, result: dict | None, waiter, later: list) -> None:
        """What a cell's end leaves for after its result, on its thread or on `agnsup-after`."""
        if self.ctl.tmp_spare is not None:  # a /tmp for the role's next cell, off the request's path: first,
            self.ctl.tmp_spare.refill(plan)  # so that a caller's next request, at once, finds it ready
        if self.ctl.cell_spares is not None and _wants_spare(self.ctl.journal, plan, result):
            self.ctl.cell_spares.refill(plan)  # then the agent's next cell, its cgroup and leader (cellspare.py)
        if self.ctl.mount_spare is not None:
            self.ctl.mount_spare.refill(plan)
        _after_result(waiter, later)
        if self._spares is not None:  # what its place claimed, made again after its result (store/spares.py)
            self._spares.refill()

    def name_next_cells(self, run_id: str, agent_id: str, next_id) -> None:
        """For a door that names its cells (sandboxd: p-1, p-2, ...): `next_id()` is the id the next cell of
        run_id/agent_id will ask for, so that the agent's spare cell is made under it (process/cellspare.py: a
        cell's cgroup is named by its id). Without it a request naming its cell id never takes a spare."""
        if self.ctl.cell_spares is not None:
            self.ctl.cell_spares.name(run_id, agent_id, next_id)

    def run(self, argv: list[str], **options) -> dict:
        """spawn, then wait: the result dict of run_process (waited for on this thread: `_here`)."""
        notify = options.pop("notify", None)
        return self._here(self._start(argv, notify, None, options, here=True)[0])[0]

    # -- wait, cancel, cleanup, list ---------------------------------------
    def wait(self, run_id: str, cell_id: str, timeout: float | None = None) -> dict | None:
        """The cell's result once it ended (None if `timeout` passed first).
        A cell this supervisor did not start: its receipt from the journal."""
        with self._guard:
            r = self._cells.get((run_id, cell_id))
        if r is None:
            return self._ended(run_id, cell_id)
        if not r.done.wait(timeout):
            return None
        if r.error is not None:
            raise r.error
        return r.result

    def _ended(self, run_id: str, cell_id: str) -> dict:
        return journal_result(self.state, self.ctl.journal, run_id, cell_id)

    def receipt(self, run_id: str, cell_id: str) -> dict | None:
        """The cell's receipt from the journal (the last one: a recovered cell has the
        janitor's), or None while it runs. UnknownId for a cell the journal never saw."""
        if self.ctl.journal.cell(run_id, cell_id) is None:
            raise UnknownId(f"no cell {cell_id!r} in run {run_id!r} in the journal")
        recs = self.ctl.journal.receipts("cell", run_id, cell_id)
        return recs[-1] if recs else None

    def redactor(self, run_id: str, cell_id: str):
        """text -> text: the role's output redaction (governance.redact) for live output
        of a cell this supervisor started, as tool.ended applies it to returned output."""
        from .redact import Redactor, host_secrets
        r = self._running(run_id, cell_id)
        cfg = r.cell.plan.redact
        literals = []
        if r.cell.secrets:  # the cell's secret values, always (redact.secret.<name>)
            from .secrets import redaction_rules
            literals = redaction_rules(r.cell.secrets)
        if not cfg and not literals:
            return lambda text: text
        cfg = cfg or {"rules": [], "patterns": {}}
        return Redactor(cfg["rules"], cfg["patterns"], host_secrets(os.environ, r.cell.spec.env), literals)

    def cancel(self, cell_id: str | None = None, run_id: str | None = None, agent_id: str | None = None,
               everything: bool = False, grace: float | None = None) -> dict:
        from . import cancel as cancelmod
        scope = cancelmod.resolve(self.ctl.journal, cell_id, run_id, agent_id, everything)
        return cancelmod.cancel(self.state, scope, grace, by=f"supervisor {self.ctl.id} (pid {os.getpid()})",
                                backend=self._backend)

    def cleanup(self, run_id: str) -> dict:
        from . import cancel as cancelmod
        return cancelmod.cleanup(self.state, run_id)

    def list(self, run_id: str | None = None, include_ended: bool = False) -> list[dict]:
        from .store.cells import listing
        return listing(self.state, run_id, include_ended)

    # -- published ports (issue 28): a pod's port on the host's loopback ------------------------------------
    def publish_port(self, run_id: str, agent_id: str, port: int, host_port: int | None = None,
                     host: str | None = None) -> dict:
        """Publish port `port` of the agent's pod on 127.0.0.1:`host_port` (None or 0: a free one): the record
        {run_id, agent_id, pod_port, host, host_port, address, url, pid, published_at, by}. It closes with the
        pod (the agent's last cell), or by close_port. Refusals, nothing left behind: UnknownId (no live pod:
        the agent has one while one of its cells lives), UsageError (a bad port, a host address other than
        127.0.0.1, the pod port already published, the host port taken)."""
        from . import ports
        return ports.publish(self.state, run_id, agent_id, port, host_port, host, journal=self.ctl.journal,
                             backend=self.ctl.backend, by=f"supervisor {self.ctl.id}")

    def list_ports(self, run_id: str | None = None, agent_id: str | None = None) -> list[dict]:
        """The published ports whose forwarder lives (of one run, one agent, or all)."""
        from . import ports
        return ports.listing(self.state, run_id, agent_id)

    def close_port(self, run_id: str, agent_id: str, port: int) -> dict:
        """Close the agent's published pod port `port`: {"closed": [its record]}; UnknownId if not published."""
        from . import ports
        return ports.close(self.state, run_id, agent_id, port, journal=self.ctl.journal,
                           by=f"supervisor {self.ctl.id}")

    # -- reversible cells (issue 26) --------------------------------------------
    def diff(self, cell_id: str, run_id: str | None = None, stat: bool = False) -> dict:
        """What cell `cell_id` (or an undo record, `undo-...`) changed in its worktree, from its
        record: {"record", "kind", "state", "counts", "entries": [{"path", "change", "before",
        "after", "diff" (unified text) or "sizes" (binary)}]}; with `stat`, "added"/"removed"
        line counts instead of the text. `run_id` is needed only when the id names cells in
        several runs. Raises UnknownId / AmbiguousId (the id), NotReversible (nothing changed,
        ran live, record dropped), as `agnsup diff` refuses (exit 1)."""
        return diff_changes(self.state, self.ctl.journal, cell_id, run_id, stat)

    def undo(self, cell_id: str | None = None, run_id: str | None = None, agent_id: str | None = None,
             force: bool = False) -> dict:
        """Restore the pre-cell state of what one cell changed (`cell_id` [+ `run_id`]), or of every
        cell with changes kept in a run (`run_id`) or of an agent (`agent_id` [+ `run_id`]), newest
        first. Returns {"undone": [...], "records": [the new undo records]}; undo of an undo record
        (its id, `undo-...`) is a redo. Refusals, with nothing changed on disk: ChangeConflict
        (exit 75: a later cell, or something outside agnsup, changed the same paths since; `force`
        overrides), NotReversible (nothing to undo, already undone, dropped, a live cell, a
        worktree that moved), UnknownId / AmbiguousId, UsageError (no scope, or cell and agent)."""
        return undo_changes(self.state, self.ctl.journal, cell_id, run_id, agent_id, force)

    # -- live I/O (request options stdin, pty, stream) ------------------------
    def _running(self, run_id: str, cell_id: str) -> _Running:
        with self._guard:
            r = self._cells.get((run_id, cell_id))
        if r is None:
            if self.ctl.journal.cell(run_id, cell_id) is None:
                raise UnknownId(f"no cell {cell_id!r} in run {run_id!r} in the journal")
            raise UnknownId(f"cell {cell_id!r} of run {run_id!r} was not started by this supervisor: "
                            "no live I/O (its captured output is under its cell directory)")
        return r

    def read_output(self, run_id: str, cell_id: str, since: int = 0, timeout: float | None = None,
                    max_bytes: int | None = None) -> dict:
        """{"chunks": [{"seq", "stream", "data"}], "next", "ended"} of a cell spawned with
        `stream` or `pty`: chunks with seq >= since, in the order the pump read them,
        waiting up to `timeout` seconds (None: until one comes or the output ends).
        Every chunk since seq 0 stays readable (io.pump.Tape: served from the captured files).
        A role with output redaction gets it applied chunk by chunk (a secret split across two
        chunks can pass)."""
        r = self._running(run_id, cell_id)
        if not isinstance(since, int) or isinstance(since, bool) or since < 0:
            raise UsageError(f"since: must be an integer >= 0, not {since!r}")
        if timeout is not None and (not isinstance(timeout, (int, float)) or timeout < 0):
            raise UsageError(f"timeout: must be a number of seconds >= 0, not {timeout!r}")
        if max_bytes is not None and (not isinstance(max_bytes, int) or max_bytes <= 0):
            raise UsageError(f"max_bytes: must be an integer > 0, not {max_bytes!r}")
        if not r.started.wait(timeout):  # queued behind a held worktree lock: nothing yet
            return {"chunks": [], "next": since, "ended": False}
        tape = r.cell.pump.tape if r.cell.pump is not None else None
        if tape is None and r.error is not None and r.cell.child is None:
            raise r.error  # it never started (lock timeout, cancelled while queued)
        if tape is None:
            raise UsageError(f"cell {cell_id!r} was not spawned with stream or pty: no live output to read "
                             "(its captured files are under its cell directory)")
        out = tape.read(since, timeout, max_bytes)
        if r.cell.plan.redact or r.cell.secrets:  # the role's output redaction, as on returned output (per chunk)
            redact = self.redactor(run_id, cell_id)
            for c in out["chunks"]:
                c["data"] = redact(c["data"].decode(errors="surrogateescape")).encode(errors="surrogateescape")
        return out

    def write_stdin(self, run_id: str, cell_id: str, data: bytes, eof: bool = False) -> None:
        """Write all of `data` to the cell's fd 0 (waiting while it does not read), then
        close it if `eof` (a pty: its EOF character, ^D). The cell must have `stdin`."""
        r = self._running(run_id, cell_id)
        if not isinstance(data, (bytes, bytearray)):
            raise UsageError(f"data: must be bytes, not {type(data).__name__}")
        r.started.wait()
        if r.cell.input is None:
            raise UsageError(f"cell {cell_id!r} was not spawned with stdin: its fd 0 is /dev/null")
        try:
            r.cell.input.write(bytes(data), bool(eof))
        except BrokenPipeError as e:
            raise UsageError(f"cell {cell_id!r}: cannot write its stdin: {e.strerror}") from None

    def signal(self, run_id: str, cell_id: str, sig: str) -> None:
        """INT or TERM to the cell's process group (as a terminal's ^C would); KILL stops the
        whole tree through its cgroup (setsid daemons too) and the cell ends "killed".
        A cell that already ended: nothing to do. Journaled as a "signal" event."""
        r = self._running(run_id, cell_id)
        if sig not in SIGNALS:
            raise UsageError(f"sig: must be one of {', '.join(SIGNALS)}, not {sig!r}")
        from . import reaper
        with r.lock:
            if r.leader_gone or (r.waiter is None and r.started.is_set()):
                return  # it ended, or never started
            self.ctl.journal.add_event("signal", run_id, cell_id, signal=sig, by=f"supervisor {self.ctl.id}")
            queued = r.waiter is None  # a queued cell is cancelled below, outside the lock
            if sig == "KILL" and not queued:
                r.waiter.stop_now("killed")
            elif not queued:
                reaper.signal_group(r.group_fd, SIGNALS[sig])
        if queued:  # waiting for its worktree lock: it never starts
            self.cancel(cell_id=cell_id, run_id=run_id)

    def resize(self, run_id: str, cell_id: str, cols: int, rows: int) -> None:
        """Set a pty cell's terminal size; the kernel sends SIGWINCH to its foreground group."""
        from .request import KINDS
        r = self._running(run_id, cell_id)
        r.started.wait()
        if r.cell.terminal is None:
            raise UsageError(f"cell {cell_id!r} has no terminal (spawn it with pty)")
        if not KINDS["pty"][0]({"cols": cols, "rows": rows}):
            raise UsageError(f"resize: cols and rows must be integers from 1 to 65535, not {cols!r}x{rows!r}")
        with suppress(BrokenPipeError):  # it ended meanwhile: no terminal left to size
            r.cell.terminal.resize(cols, rows)

    # -- end ---------------------------------------------------------------
    def close(self, grace: float | None = None) -> None:
        """Cancel the cells this supervisor still runs, wait for their receipts, end the instance."""
        if self.closed:
            return
        self.closed = True
        with self._guard:
            live = [(k, r) for k, r in self._cells.items() if not r.done.is_set()]
        if live:
            from . import cancel as cancelmod
            for (run_id, cell_id), _ in live:
                cancelmod.cancel(self.state, cancelmod.Scope("cell", run_id, None, cell_id), grace,
                                 by=f"supervisor {self.ctl.id} shutting down", backend=self._backend)
            for _, r in live:
                r.done.wait(30)
        with self._guard:
            ending = list(self._threads)
        for t in ending:  # what their cells' ends left for after the result (_after_result): a few ms at most
            if t.is_alive():
                t.join(5)
        with self._quiet:  # the cells ended on their callers' threads: their work after the result queued first
            self._quiet.wait_for(lambda: self._ending == 0, 5)
        self._after.close()  # then done
        if self._spares is not None:  # before the controller ends: a crash in between leaves them to the janitor
            self._spares.close()
        if self.ctl.tmp_spare is not None:
            self.ctl.tmp_spare.close()
        if self.ctl.mount_spare is not None:
            self.ctl.mount_spare.close()
        if self.ctl.cell_spares is not None:  # before the fork server stops: their leaders are its children
            self.ctl.cell_spares.close()
        self.ctl.close()
        self._forker.close()

    def __enter__(self) -> "Supervisor":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _poll_wake(r: _Running):
    """What the cell's wait loop calls when its caller's connection is readable (run_attached), or None."""
    caller = r.caller
    return None if caller is None else lambda: caller.on_wake(r.waiter, r.cell)


class _SignalsHeld:
    """On the main thread, between `hold` and `release`: every signal with a Python handler (SIGINT's
    default_int_handler at least) is recorded instead of handled, and handled at `release`, in the order they came
    (so a KeyboardInterrupt is raised there, not in the middle of a cell's end). A handler set meanwhile is kept.
    ~5 us a cell (one sigaction each way for SIGINT)."""

    def __init__(self):
        self.came: list = []
        self.held: dict = {}

    def _record(self, n, frame) -> None:
        self.came.append((n, frame))

    def hold(self) -> "_SignalsHeld":
        getsignal = _signal.getsignal
        try:
            for sig in _all_signals():
                h = getsignal(sig)
                if callable(h):
                    self.held[sig] = h
                    _signal.signal(sig, self._record)
        except BaseException:  # (a handler's exception between two of them: what was swapped is given back)
            self.release()
            raise
        return self

    def release(self) -> None:
        for sig, h in self.held.items():
            if _signal.getsignal(sig) == self._record:
                _signal.signal(sig, h)
        came, self.came = self.came, []
        for n, frame in came:
            self.held[n](n, frame)


@functools.lru_cache(maxsize=1)
def _all_signals() -> tuple:
    return tuple(_signal.valid_signals())


def _wants_spare(journal, plan, result: dict | None) -> bool:
    """A spare cell for the agent of a cell that ended (process/cellspare.py), unless it ended cancelled or its run
    was: a cancelled run takes no more cells, and a cancel is usually followed by the run's cleanup, which a spare
    made meanwhile would race."""
    if result is None or result.get("state") == "cancelled":
        return False
    with journal.lock:
        run = journal.run(plan.spec.run_id)
    return run is not None and run["state"] != "cancelled"


def _after_result(waiter, later: list) -> None:
    """On a cell's thread, once its result is out: the mount namespace its waiter held let go first (its overlay is
    unmounted before the layer's directories go), then what finish left for now (Controller.finish's `later`), in
    order. Best effort, as each was before the result: what fails, or what a crash here leaves, is the janitor's
    (an unchanged change layer keeps its pending marker until it is gone: changes.finish_all drops it)."""
    crashpoints.hit("after_result")
    if waiter is not None:
        with suppress(OSError):
            waiter.let_go()
    for fn in later:
        with suppress(Exception):
            fn()


def journal_result(state, journal, run_id: str, cell_id: str) -> dict:
    """A cell's result as the journal knows it: from its receipt once it has one."""
    from .tool import ended
    row = journal.cell(run_id, cell_id)
    if row is None:
        raise UnknownId(f"no cell {cell_id!r} in run {run_id!r} in the journal")
    recs = journal.receipts("cell", run_id, cell_id)
    if not recs:
        return {"run_id": run_id, "cell_id": cell_id, "agent_id": row["agent_id"], "state": row["state"],
                "exit_code": row["exit_code"], "reason": row["reason"], "receipt": None}
    d = state.cell_dir(run_id, cell_id)
    # captured output is in the cell directory: a result asked for later still carries it
    return ended(recs[-1], d, capture=os.path.exists(os.path.join(d, "stdout")))


def wait_cell(state_dir: str | None, cell_id: str, run_id: str | None = None, timeout: float | None = None) -> dict:
    """`agnsup wait`: from any process, until the cell ended (whichever controller runs
    it, a queued one included); its result. WaitTimeout when `timeout` passes first."""
    import time
    from . import cancel, janitor
    from .util import backoff
    from .errors import WaitTimeout
    from .store.journal import TERMINAL_CELL
    from .store.state import StateRoot
    state = StateRoot(state_dir)
    if not state.exists():
        raise UnknownId(f"no cell {cell_id!r}: the state root {state.path} has no journal")
    journal = state.journal()
    try:
        scope = cancel.resolve(journal, cell_id, run_id)
        deadline = None if timeout is None else time.monotonic() + timeout
        checked = time.monotonic()
        for delay in backoff.delays(0.02, 0.25, 1.5):
            st = journal.cell_state(scope.run_id, cell_id)
            if st in TERMINAL_CELL and journal.receipts("cell", scope.run_id, cell_id):
                return journal_result(state, journal, scope.run_id, cell_id)
            if deadline is not None and time.monotonic() >= deadline:
                raise WaitTimeout(f"cell {cell_id} of run {scope.run_id} is still {st} after {timeout:g} s")
            if time.monotonic() - checked > 2.0:  # its controller may have died: the janitor concludes the cell
                janitor.on_start(state, journal)
                checked = time.monotonic()
            time.sleep(delay)  # another process ends the cell: the journal is all we share with it
    finally:
        journal.close()


# -- reversible cells (issue 26): the one path diff and undo take from every front door --------
# The CLI, Supervisor.diff/undo and the MCP tools all come here, so they resolve ids, lock and
# refuse alike; changes.py does the work and owns the record's format.
UNDO_LOCK_TIMEOUT = 30.0  # seconds an undo waits for the worktree lock a running cell holds


def _check_ids(cell_id: str | None, run_id: str | None, agent_id: str | None = None) -> None:
    from .store.state import check_id
    for kind, value in (("cell", cell_id), ("run", run_id), ("agent", agent_id)):
        if value is not None:
            check_id(kind, value)


def diff_changes(state, journal, cell_id: str, run_id: str | None = None, stat: bool = False) -> dict:
    """What cell (or undo record) `cell_id` changed in its worktree: changes.diff's dict, plus
    "now": {"state": kept | undone | redone, "by": the undo record in force} (the chain followed)."""
    from . import changes
    _check_ids(cell_id, run_id)
    d = changes.diff(state, journal, cell_id, run_id, stat)
    run, _, rid = d["record"].rpartition("/")
    row = journal.change_row(run, rid)
    if row is not None:
        now, by = changes.record_state(row, journal.change_row)
        d["now"] = {"state": now, "by": by}
    return d


def undo_targets(journal, cell_id: str | None = None, run_id: str | None = None,
                 agent_id: str | None = None) -> list[str]:
    """The records an undo names: one cell's (or an undo record's: a redo), as "run/record" or
    the bare id (changes resolves it: UnknownId, AmbiguousId, NotReversible saying why), or
    every record in force of a run or an agent that moves forward (changes.select, newest first:
    a cell's or a redo; an undo in force is a restoration and stays)."""
    from . import changes
    from .errors import NotReversible
    _check_ids(cell_id, run_id, agent_id)
    if cell_id is not None:
        if agent_id is not None:
            raise UsageError("give CELL [--run R], or --run R, or --agent A [--run R]")
        return [f"{run_id}/{cell_id}" if run_id else cell_id]
    if run_id is None and agent_id is None:
        raise UsageError("say what to undo: CELL [--run R], --run R, or --agent A [--run R]")
    if run_id is not None and journal.run(run_id) is None:
        raise UnknownId(f"no run {run_id!r} in the journal")
    if agent_id is not None and not (journal.has_agent(run_id, agent_id) if run_id is not None else
                                     journal.change_rows(agent_id=agent_id) or any(
                                         c["agent_id"] == agent_id for c in journal.cells())):
        raise UnknownId(f"no agent {agent_id!r}{f' in run {run_id!r}' if run_id else ''} in the journal")
    rows = changes.select(journal, run_id=run_id, agent_id=agent_id)
    if not rows:
        scope = " of ".join(f"{k} {v}" for k, v in (("agent", agent_id), ("run", run_id)) if v)
        raise NotReversible(f"nothing to undo for {scope}: no cell of it has changes in force (it changed "
                            "nothing, ran live, or was undone or dropped already)")
    return [f"{r['run_id']}/{r['record_id']}" for r in rows]


def _worktrees(journal, refs: list[str]) -> list[str]:
    """The worktrees the records live in (from the journal's index; an id it cannot place yet
    is left for changes.undo to refuse)."""
    trees = set()
    for ref in refs:
        run_id, _, record_id = ref.rpartition("/")
        for r in journal.change_rows(run_id=run_id or None, record_id=record_id):
            if r["worktree"]:
                trees.add(r["worktree"])
    return sorted(trees)


def undo_changes(state, journal, cell_id: str | None = None, run_id: str | None = None,
                 agent_id: str | None = None, force: bool = False,
                 lock_timeout: float | None = UNDO_LOCK_TIMEOUT, notify=None) -> dict:
    """Undo what a cell, a run's cells or an agent's cells changed: changes.undo's dict
    ({"undone", "records": the new undo records}). Refusals: UnknownId/AmbiguousId (the id),
    NotReversible (nothing to undo, dropped, live, a worktree that moved), ChangeConflict
    (a later change to the same paths; force overrides), LockTimeout (a cell still runs in
    the worktree); nothing changed on disk then.

    The undo holds each worktree's lock, exclusive, as a writing cell does: a cell running
    there sees its lower layer change under it otherwise (overlayfs: undefined), and its
    commit at exit would interleave with the undo's."""
    from . import changes, locks
    refs = undo_targets(journal, cell_id, run_id, agent_id)
    held: list[tuple[str, int]] = []
    try:
        for wt in _worktrees(journal, refs):
            path = state.worktree_lock(locks.worktree_key(wt))
            os.makedirs(os.path.dirname(path), exist_ok=True)
            held.append((path, locks.acquire(path, True, lock_timeout, f"worktree {wt}",
                                             f"agnsup undo (pid {os.getpid()})", notify, tree=wt)))
        return changes.undo(state, journal, refs, force=force)
    finally:
        for path, fd in reversed(held):
            locks.release(path, fd)
