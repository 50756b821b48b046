"""Supervisor: one long-lived controller instance for many concurrent cells.

The Python API an agent runtime embeds, and the core of `agnsup serve`:

    with Supervisor(state_dir) as sup:
        h = sup.spawn(["pytest", "-q"], run_id="R", agent_id="A")   # returns at once
        sup.wait(h["run_id"], h["cell_id"])                          # the result
        sup.cancel(run_id="R", agent_id="A")                         # three levels, or all
        sup.cleanup("R"); sup.list()

One Controller (one liveness lock, one journal connection) serves every cell;
each cell has a thread that waits for it and writes its receipt. Cancel and
cleanup go through the journal and the cgroups (agnsup/cancel.py) exactly as
from another process. If this process is SIGKILLed, the janitor of the next
controller recovers its cells like any other controller's.
"""
from __future__ import annotations

import os
import threading

from .errors import UnknownId


class _Running:
    def __init__(self, cell, request):
        self.cell, self.request = cell, request
        self.done = threading.Event()
        self.result: dict | None = None
        self.error: BaseException | None = None


class _Forker:
    """The thread every cell of a Supervisor is forked from. It lives as long as the
    Supervisor: a cell's PR_SET_PDEATHSIG (on_controller_death = kill) fires when the
    *thread* that forked it ends (prctl(2)), and serve's request threads end with
    their connections."""

    def __init__(self):
        import queue
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name="agnsup-forker", daemon=True)
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
            done.set()

    def __call__(self, fn):
        box: list = []
        done = threading.Event()
        self.jobs.put((fn, box, done))
        done.wait()
        ok, value = box[0]
        if not ok:
            raise value
        return value

    def close(self) -> None:
        self.jobs.put(None)
        self.thread.join(5)


class Supervisor:
    def __init__(self, state_dir: str | None = None, kind: str = "serve"):
        from . import broker, janitor
        from .state import StateRoot
        self.state = StateRoot(state_dir).ensure()
        janitor.on_start(self.state)
        self._forker = _Forker()
        self.ctl = broker.Controller(self.state, kind=kind, forker=self._forker)
        self.ctl.journal.lock = threading.RLock()
        from . import repair
        repair.maybe_prune(self.state, self.ctl.journal)  # the journal's default retention bound
        self._cells: dict[tuple[str, str], _Running] = {}
        self._guard = threading.Lock()
        self.closed = False

    @property
    def controller_id(self) -> str:
        return self.ctl.id

    # -- start ------------------------------------------------------------
    def spawn(self, argv: list[str], *, notify=None, **options) -> dict:
        """Start a cell and return at once: {cell_id, run_id, agent_id, pid, cgroup}.
        `options` are request.CellRequest's (role, run_id, agent_id, cell_id, workdir,
        timeout, lock_timeout, env, host_env, capture, receipt_file, entry), all checked
        before anything is created. Raises AgnsupError (denied, not found, lock
        timeout...) like run_process. A held worktree lock is waited for;
        `notify(line)` hears about it (default: stderr)."""
        from .request import CellRequest
        from .tool import prepare
        if self.closed:
            raise UnknownId("this supervisor is closed")
        options.setdefault("entry", "api")
        request = CellRequest.make(argv, **options)
        cell = self.ctl.start(prepare(self.state, self.ctl.journal, request), capture=request.capture, notify=notify)
        r = _Running(cell, request)
        key = (cell.spec.run_id, cell.spec.cell_id)
        with self._guard:
            self._cells[key] = r
        t = threading.Thread(target=self._supervise, args=(r,), name=f"cell-{key[1]}", daemon=True)
        t.start()
        return {"cell_id": cell.spec.cell_id, "run_id": cell.spec.run_id, "agent_id": cell.spec.agent_id,
                "pid": cell.identity["pid"], "cgroup": cell.place.dir, "controller": self.ctl.id}

    def _supervise(self, r: _Running) -> None:
        from .tool import ended
        key = (r.cell.spec.run_id, r.cell.spec.cell_id)
        try:
            receipt = self.ctl.finish(r.cell, self.ctl.waiter(r.cell).wait())
            r.result = ended(receipt, r.cell.plan.cell_dir, r.request)
        except BaseException as e:  # noqa: BLE001 - reported to whoever waits
            r.error = e
        finally:
            r.cell = r.request = None  # an ended cell leaves memory (issue 12 item 17)
            if r.error is None:
                with self._guard:
                    # a waiter that already holds `r` gets r.result; a later one reads the
                    # journal and the output files (_ended): the same result
                    self._cells.pop(key, None)
            r.done.set()

    def run(self, argv: list[str], **options) -> dict:
        """spawn, then wait: the result dict of run_process."""
        h = self.spawn(argv, **options)
        return self.wait(h["run_id"], h["cell_id"])

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
        from .tool import ended
        row = self.ctl.journal.cell(run_id, cell_id)
        if row is None:
            raise UnknownId(f"no cell {cell_id!r} in run {run_id!r} in the journal")
        recs = self.ctl.journal.receipts("cell", run_id, cell_id)
        if not recs:
            return {"run_id": run_id, "cell_id": cell_id, "agent_id": row["agent_id"], "state": row["state"],
                    "exit_code": row["exit_code"], "reason": row["reason"], "receipt": None}
        d = self.state.cell_dir(run_id, cell_id)
        # captured output is in the cell directory: a result asked for later still carries it
        return ended(recs[-1], d, capture=os.path.exists(os.path.join(d, "stdout")))

    def cancel(self, cell_id: str | None = None, run_id: str | None = None, agent_id: str | None = None,
               everything: bool = False, grace: float | None = None) -> dict:
        from . import cancel as cancelmod
        scope = cancelmod.resolve(self.ctl.journal, cell_id, run_id, agent_id, everything)
        return cancelmod.cancel(self.state, scope, grace, by=f"supervisor {self.ctl.id} (pid {os.getpid()})")

    def cleanup(self, run_id: str) -> dict:
        from . import cancel as cancelmod
        return cancelmod.cleanup(self.state, run_id)

    def list(self, run_id: str | None = None, include_ended: bool = False) -> list[dict]:
        from .cells import listing
        return listing(self.state, run_id, include_ended)

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
                                 by=f"supervisor {self.ctl.id} shutting down")
            for _, r in live:
                r.done.wait(30)
        self.ctl.close()
        self._forker.close()

    def __enter__(self) -> "Supervisor":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
