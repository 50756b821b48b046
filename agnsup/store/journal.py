"""The journal store: SQLite in WAL mode under the state root, and the only module with SQL.

Writes go through `tx()` (BEGIN IMMEDIATE ... COMMIT) so each change is whole
or absent after a crash. synchronous=NORMAL: in WAL mode a commit survives the
death of the process (what the janitor needs); only a power cut may lose the
last commits, and a power cut also ends every process they described. The
same holds for a process that exits without closing its connection (the CLI
does, to skip the checkpoint-on-close): the WAL it leaves is folded into the
database by a later writer's automatic checkpoint.

The state machine lives here and is checked on every change:

    cell:  [waiting ->] starting -> running -> one of TERMINAL_CELL;  waiting | starting -> TERMINAL_CELL
           (a terminal cell never changes again)
    run:   active -> cancelled | finished | recovered
           finished | recovered -> active  (a new cell reopens the run: event `run.reopened`)
           cancelled: final (a cancelled run refuses every new cell)

Migrations are the numbered files in `journal/`, applied in order; in them
`@TERMINAL_CELL@` stands for the quoted list of terminal cell states, so the
partial index and the queries it serves are spelled from one constant.
"""
from __future__ import annotations

import errno
import json
import os
import time
from contextlib import closing, contextmanager, nullcontext, suppress
from functools import partialmethod

try:
    # The C module itself (same connect, Row and errors): the sqlite3 package
    # around it only adds date/datetime adapters agnsup never uses, and
    # imports datetime for them (~2 ms on every `agnsup run`).
    import _sqlite3 as sqlite3
except ImportError:  # pragma: no cover - an interpreter without the private name
    import sqlite3  # type: ignore[no-redef]  # the same module by its public name

from ..errors import CancelledBeforeStart, JournalDamaged, RunNotActive, StateError
from . import chain

TERMINAL_CELL = ("exited", "failed", "timeout", "cancelled", "killed", "recovered")
TERMINAL_RUN = ("cancelled", "finished", "recovered")
# waiting: spawn queued the cell behind a held worktree lock (nothing of it exists but
# this row; a dead controller's waiting cell is the janitor's like a starting one).
CELL_FLOW = {"waiting": ("starting", *TERMINAL_CELL), "starting": ("running", *TERMINAL_CELL),
             "running": TERMINAL_CELL}
RUN_FLOW = {"active": TERMINAL_RUN, "finished": ("active",), "recovered": ("active",), "cancelled": ()}

# each state's allowed predecessors, quoted for SQL (`_move_cell`'s guard)
_FROM_SQL = {to: ",".join(f"'{was}'" for was, nxt in CELL_FLOW.items() if to in nxt)
             for to in {s for nxt in CELL_FLOW.values() for s in nxt}}
_COLS = {tbl: ", ".join(cols) for tbl, cols in chain.COLUMNS.items()}  # the chained columns, in hashing order
_TERMINAL_SQL = ",".join(f"'{s}'" for s in TERMINAL_CELL)
LIVE_CELL = f"state NOT IN ({_TERMINAL_SQL})"  # the cells_live partial index's predicate, to the letter
OPEN_SQL = ("SELECT id, boot_id, lock_path FROM controllers WHERE ended_at IS NULL "
            "UNION SELECT c.id, c.boot_id, c.lock_path FROM cells x JOIN controllers c ON c.id = x.controller_id "
            "WHERE x." + LIVE_CELL)


def _migrations() -> list[tuple[int, str]]:
    from importlib.resources import files
    return sorted((int(e.name[:4]), e.read_text().replace("@TERMINAL_CELL@", _TERMINAL_SQL))
                  for e in files("agnsup.store.migrations").iterdir()
                  if e.name.endswith(".sql") and e.name[:4].isdigit())


class Journal:
    def __init__(self, path: str, check: bool = True):
        """`check`: refuse a damaged journal or one that lost its history (preflight);
        only `agnsup journal repair` opens the new journal it rebuilds without it."""
        self.path = path
        self._pending: list[tuple[str, tuple]] = []  # (table, row) this transaction inserted: chained before COMMIT
        self._anchor = 0  # the newest head seq this process saw on disk (chain.py: each record carries it)
        self._sha = chain.sha256  # checkpoint_behind: OpenSSL's, for a controller of many cells
        self.lock = None  # a threading.RLock when one connection serves many threads (serve)
        self._checkpointer: _Checkpointer | None = None  # checkpoint_behind(): a controller of many cells
        self._quiet_checkpoint = False  # checkpoint_in_quiet_commits(): a one-cell controller
        if check:
            preflight(path)
        try:
            self.db = sqlite3.connect(path, timeout=30, isolation_level=None, check_same_thread=False)
            self.db.row_factory = sqlite3.Row
            self.db.execute("PRAGMA busy_timeout = 30000")
            mode = _wal_mode(self.db)
            self.db.execute("PRAGMA synchronous = NORMAL")
            # `agnsup run` exits without the checkpoint-on-close (broker.Controller.close),
            # so the next start rebuilds the WAL index from the WAL (~4 us a page):
            # a 256-page WAL bounds that to ~1 ms; a cell writes ~36 pages.
            self.db.execute(f"PRAGMA wal_autocheckpoint = {WAL_PAGES}")
            version = self.db.execute("PRAGMA user_version").fetchone()[0]
        except sqlite3.DatabaseError as e:
            raise self._failed(e, f"journal {path} is unusable: {e}") from None
        if mode != "wal":
            raise StateError(f"journal {path}: cannot switch to WAL mode (got {mode})")
        self._file = _file_id(path)
        _CONNECTED[self._file] = _CONNECTED.get(self._file, 0) + 1
        if version == 0 or version < _latest():
            self._migrate()

    def _migrate(self) -> None:
        try:
            with self.tx():
                current = self.db.execute("PRAGMA user_version").fetchone()[0]
                for num, sql in _migrations():
                    if num > current:
                        for stmt in sql.split(";\n"):
                            if stmt.strip():
                                self.db.execute(stmt)
                        self.db.execute(f"PRAGMA user_version = {num}")
                if current < 8:  # the chain's first writer chains the rows already there
                    ev = [("events", tuple(r)) for r in self.db.execute(f"SELECT {_COLS['events']} FROM events")]
                    rc = [("receipts", tuple(r)) for r in self.db.execute(f"SELECT {_COLS['receipts']} FROM receipts")]
                    self._pending = sorted(ev + rc, key=lambda x: (x[1][1 if x[0] == "events" else 4], x[0], x[1][0]))
        except sqlite3.DatabaseError as e:
            raise StateError(f"journal {self.path}: migration failed: {e}") from None

    @contextmanager
    def tx(self, crash_point: str | None = None, quiet: bool = False):
        """One write transaction. `crash_point` names a test-only crash point
        fired after the statements ran and before COMMIT (crashpoints.py).
        `quiet`: a commit nobody waits for (checkpoint_in_quiet_commits).
        An SQLite error inside it rolls back and becomes a StateError.
        The events and receipts rows it inserted are chained before COMMIT, in
        the same transaction, and the head written after it (store/chain.py)."""
        with self.lock or nullcontext():
            try:
                self.db.execute("BEGIN IMMEDIATE")
            except sqlite3.OperationalError as e:
                raise StateError(f"journal {self.path}: cannot write: {e}") from None
            self._pending = []
            try:
                yield self.db
                head = self._chain() if self._pending else None
                if crash_point:
                    from ..util import crashpoints
                    crashpoints.hit(crash_point)
                if quiet and self._quiet_checkpoint:
                    self.db.execute(f"PRAGMA wal_autocheckpoint = {WAL_PAGES}")  # read by SQLite after the COMMIT
                    try:
                        self.db.execute("COMMIT")
                    finally:
                        self.db.execute(f"PRAGMA wal_autocheckpoint = {WAL_PAGES * 4}")
                else:
                    self.db.execute("COMMIT")
            except BaseException as e:
                self._pending = []
                with suppress(sqlite3.Error):
                    self.db.execute("ROLLBACK")
                if isinstance(e, sqlite3.Error):
                    raise self._failed(e, f"journal {self.path}: cannot write: {e}") from None
                raise
            if head is not None:
                self._write_head(*head)
            if self._checkpointer is not None:
                self._checkpointer.committed(quiet)

    def checkpoint_behind(self) -> None:
        """A controller of many cells (the Supervisor: serve, MCP, sandboxd, the Python API): the WAL's
        checkpoint on a thread of its own, with a connection of its own, at the first identity commit after
        CHECKPOINT_EVERY commits of this connection (while the cell's child sets up and its request thread waits
        for the exec: _Checkpointer.committed), instead of inside whichever commit crossed wal_autocheckpoint (a
        cell's, on its request's path: the WAL's frames copied into the database between two fdatasyncs, ~2 ms
        every ~5 cells here, more on a busy disk). What a commit guarantees is unchanged: with
        synchronous=NORMAL a commit is in the WAL, which survives the process, when COMMIT returns; a checkpoint
        only folds the WAL into the database, and SQLite's own checkpoint is crash-safe wherever it stops. This
        connection's auto-checkpoint stays, at 4x the pages, as the bound should the thread fall behind (a
        PASSIVE checkpoint never waits for readers or writers: it copies what it can)."""
        if self._checkpointer is None:
            self.db.execute(f"PRAGMA wal_autocheckpoint = {WAL_PAGES * 4}")
            self._checkpointer = _Checkpointer(self.path)
            # the chain's digests by OpenSSL (the same SHA-256, ~5x faster on a receipt's row): a controller of
            # many cells pays hashlib's import (libcrypto, ~4 ms; a Supervisor has it already) once, not per cell
            from hashlib import sha256
            self._sha = sha256

    def checkpoint_in_quiet_commits(self) -> None:
        """A one-cell controller (`agnsup run`, whose process has no thread to spare: one in an fsync would hold
        up its exit): the auto-checkpoint only in the commits nobody waits for, those made while the cell's
        child works on another CPU (the identity's: the child sets up its namespaces and mounts meanwhile,
        several ms), not in whichever commit crossed wal_autocheckpoint (the intent's, the cgroup's and the
        conclusion's are each on the caller's path: 1.6-2.3 ms every ~5 runs here, more on a busy disk). The
        others keep a bound of 4x the pages (a run whose cell never reached its identity). Commits mean what
        they meant (checkpoint_behind)."""
        if self._checkpointer is None and not self._quiet_checkpoint:
            self.db.execute(f"PRAGMA wal_autocheckpoint = {WAL_PAGES * 4}")
            self._quiet_checkpoint = True

    def _chain(self) -> tuple[int, str]:
        """One chain row per row this transaction inserted (one SELECT, one INSERT); the new (seq, hash)."""
        pending, self._pending = self._pending, []
        rows = self._links(self.db.execute(_CHAIN_END).fetchone(), pending)
        self._insert_chain(rows)
        return rows[-1][0], rows[-1][4]

    def _links(self, last, pending: list) -> list[tuple]:
        seq, prev = (last[0], last[1]) if last else (0, chain.ZERO)
        # never past the chain's end: a head seen before `journal repair` restarted the chain belongs to the old one
        anchor, sha = min(self._anchor, seq), self._sha
        rows = []
        for tbl, content in pending:
            h = chain.link(prev, tbl, anchor, content, sha)
            seq += 1
            rows.append((seq, tbl, content[0], prev, h, anchor))
            prev = h
        return rows

    def _insert_chain(self, rows: list[tuple]) -> None:
        if len(rows) > _CHAIN_ROWS_AT_ONCE:  # a migration's first chaining: SQLite's bound on variables
            self.db.executemany("INSERT INTO chain(seq, tbl, row, prev, hash, anchor) VALUES (?,?,?,?,?,?)", rows)
        else:
            self.db.execute(_CHAIN_INSERT[len(rows) - 1], [v for row in rows for v in row])

    def _write_head(self, seq: int, hash_: str, force: bool = False) -> None:
        """After COMMIT (crash point `chain.head` between the two: verify says "not yet anchored"). A head that
        cannot be written (a read-only state root) leaves the records unanchored, never fails the write."""
        from ..util import crashpoints
        crashpoints.hit("chain.head")
        with suppress(OSError):
            self._anchor = max(self._anchor, chain.write_head(os.path.dirname(self.path) or ".", seq, hash_, force))

    def _within(self, db):
        """The caller's transaction `db`, or one of its own."""
        return self.tx() if db is None else nullcontext(db)

    def close(self) -> None:
        if self._checkpointer is not None:  # first: this connection's close, the last, then checkpoints the rest
            self._checkpointer.close()
            self._checkpointer = None
        self.db.close()
        n = _CONNECTED.pop(getattr(self, "_file", None), 0) - 1
        if n > 0:
            _CONNECTED[self._file] = n

    def _one(self, sql: str, args: tuple = ()):
        rows = self._all(sql, args)
        return rows[0] if rows else None

    def _all(self, sql: str, args: tuple = ()) -> list:
        """A read (under the lock when threads share the connection); SQLite errors become StateError."""
        try:
            with self.lock or nullcontext():
                return self.db.execute(sql, args).fetchall()
        except sqlite3.Error as e:
            raise self._failed(e, f"journal {self.path}: cannot read: {e}") from None

    def _failed(self, e: Exception, message: str) -> StateError:
        """An SQLite error as agnsup's: JournalDamaged (and the file marked) when corrupt, else StateError
        (with the errno of a full or read-only state root, as an OSError would carry it)."""
        if _corrupt(e):
            return self._damaged(str(e))
        err = StateError(message)
        code = getattr(e, "sqlite_errorcode", None)
        if code in (sqlite3.SQLITE_FULL, sqlite3.SQLITE_READONLY):
            err.errno = errno.ENOSPC if code == sqlite3.SQLITE_FULL else errno.EROFS
        return err

    def _damaged(self, why: str) -> JournalDamaged:
        """SQLite found the file corrupt: mark it, so that no later command writes into it."""
        with suppress(sqlite3.Error, AttributeError):
            self.close()
        with suppress(OSError):  # already marked, or a read-only state root: preflight still finds most of it
            with open(self.path + DAMAGED_MARK, "x") as f:
                f.write(why + "\n")
        return damaged(self.path, why)

    # -- events and controllers -------------------------------------------
    def event(self, db, kind: str, run_id=None, cell_id=None, **data) -> None:
        row = (time.time(), run_id, cell_id, kind, json.dumps(data) if data else None)
        cur = db.execute("INSERT INTO events(t, run_id, cell_id, kind, data) VALUES (?,?,?,?,?)", row)
        self._pending.append(("events", (cur.lastrowid, *row)))

    def event_rows(self, db, items: list[tuple[str, str | None, str | None, dict]]) -> None:
        """Several events, (kind, run_id, cell_id, data) each, in the order given, by one INSERT: its rows get
        consecutive ids in that order (an INTEGER PRIMARY KEY's new rowid is one past the largest, row after
        row), the last of them lastrowid."""
        if len(items) == 1 or len(items) > _CHAIN_ROWS_AT_ONCE:
            for kind, run_id, cell_id, data in items:
                self.event(db, kind, run_id, cell_id, **data)
            return
        rows = [(time.time(), run_id, cell_id, kind, json.dumps(data) if data else None)
                for kind, run_id, cell_id, data in items]
        cur = db.execute(_EVENTS_INSERT[len(rows) - 1], [v for row in rows for v in row])
        first = cur.lastrowid - len(rows) + 1
        self._pending.extend(("events", (first + i, *row)) for i, row in enumerate(rows))

    def add_event(self, kind: str, run_id=None, cell_id=None, **data) -> None:
        """One event in a transaction of its own."""
        with self.tx() as db:
            self.event(db, kind, run_id, cell_id, **data)

    def register_controller(self, row: dict, db=None) -> None:
        """The controller instance's row, in its own transaction or in the caller's `db`."""
        with self._within(db) as db:
            db.execute("INSERT INTO controllers(id, kind, pid, pidfd_ino, starttime, boot_id, lock_path, started_at)"
                       " VALUES (:id, :kind, :pid, :pidfd_ino, :starttime, :boot_id, :lock_path, :started_at)", row)

    def end_controller(self, cid: str, db=None) -> None:
        with self._within(db) as db:
            db.execute("UPDATE controllers SET ended_at=? WHERE id=? AND ended_at IS NULL", (time.time(), cid))

    def open_controllers(self) -> list:
        """(id, boot_id, lock_path) of every controller not ended or with a live cell."""
        return self._all(OPEN_SQL)

    def controller(self, cid: str):
        return self._one("SELECT * FROM controllers WHERE id=?", (cid,))

    # -- a cell's life ------------------------------------------------------
    def begin_cell(self, row: dict, trace: list, admit=None, controller: dict | None = None,
                   state: str = "starting") -> None:
        """The intent: the cell row (state `starting`) and its stage events, in one
        transaction. The run is created, reopened (finished or recovered before:
        event `run.reopened`) or refused (cancelled: RunNotActive); a cell id is
        never reused in a run. `admit(usage)` judges run quotas with counts taken
        inside this transaction (race-free) and raises to refuse; `controller`: a
        one-cell controller's own row, registered in the same transaction. `state`
        "waiting": queued behind a held worktree lock (mark_starting once it is taken)."""
        run_id, cell_id = row["run_id"], row["cell_id"]
        with self.tx() as db:
            if controller is not None:
                self.register_controller(controller, db)
            # the run's state and whether the cell id was ever used, in one statement
            run, used = db.execute("SELECT (SELECT state FROM runs WHERE run_id=:r), EXISTS (SELECT 1 FROM cells "
                                   "WHERE run_id=:r AND cell_id=:c) OR EXISTS (SELECT 1 FROM pruned WHERE "
                                   "run_id=:r AND cell_id=:c)", {"r": run_id, "c": cell_id}).fetchone()
            if run == "cancelled":
                raise RunNotActive(f"run {run_id!r} was cancelled; it accepts no new cells (use another --run-id)")
            if used:
                raise RunNotActive(f"cell {cell_id!r} already exists in run {run_id!r}; cell ids are never reused")
            evs: list = []
            if run is None:
                db.execute("INSERT INTO runs(run_id, state, created_at) VALUES (?, 'active', ?)",
                           (run_id, row["created_at"]))
            elif run != "active":
                self._move_run(db, run_id, run, "active", ended_at=None)
                evs.append(("run.reopened", run_id, cell_id, {"was": run}))
            if admit is not None:
                admit(self._quota_usage(db, run_id, row["agent_id"], row["created_at"]))
            cols = ", ".join(row)
            db.execute(f"INSERT INTO cells({cols}, state) VALUES ({', '.join(':' + k for k in row)}, :state)",
                       {**row, "state": state})
            evs += [("stage." + st["stage"], run_id, cell_id, st) for st in trace]
            evs.append(("state." + state, run_id, cell_id, {}))
            self.event_rows(db, evs)

    def _mark(self, run_id: str, cell_id: str, state: str) -> None:
        with self.tx() as db:
            self._move_cell(db, run_id, cell_id, state)
            self.event(db, "state." + state, run_id, cell_id)

    mark_starting = partialmethod(_mark, state="starting")  # a waiting cell took its worktree lock

    def mark_running(self, run_id: str, cell_id: str) -> str | None:
        """The command runs (it exec'd, inside its tree). Returns the cancel recorded while
        the cell was starting, read inside this transaction: its canceller may have found
        no process to stop (a forked leader joins its cgroups itself, after its identity
        commit), so the controller stops the cell; a cancel after this sees it running."""
        with self.tx() as db:
            self._move_cell(db, run_id, cell_id, "running")
            self.event(db, "state.running", run_id, cell_id)
            row = db.execute("SELECT cancel_reason FROM cells WHERE run_id=? AND cell_id=?",
                             (run_id, cell_id)).fetchone()
        return row[0] if row else None

    def _quota_usage(self, db, run_id: str, agent_id: str, now: float) -> tuple[int, int, int, float | None]:
        """(cells in the run, live cells of the run, live cells of the agent, run age in s or None)."""
        row = db.execute(f"SELECT COUNT(*), COALESCE(SUM({LIVE_CELL}), 0), COALESCE(SUM({LIVE_CELL} AND agent_id=?), 0)"
                         " FROM cells WHERE run_id=?", (agent_id, run_id)).fetchone()
        run = db.execute("SELECT created_at FROM runs WHERE run_id=?", (run_id,)).fetchone()
        age = None if run is None or run[0] is None else max(0.0, now - run[0])
        return row[0], row[1], row[2], age

    def stage(self, run_id: str, cell_id: str, st: dict, **fields) -> None:
        """A stage of the chain (and the cell fields it produced), in one transaction."""
        with self.tx() as db:
            if fields:
                self._set(db, run_id, cell_id, fields)
            self.event(db, "stage." + st["stage"], run_id, cell_id, **st)

    def commit_identity(self, run_id: str, cell_id: str, ident: dict, st: dict) -> None:
        """The leader's identity, before it may exec. A cancel recorded meanwhile
        wins: CancelledBeforeStart, and the command never runs. The crash point
        "journal_tx" dies inside this transaction (SQLite rolls it back)."""
        fields = {k: ident[k] for k in ("pid", "pidfd_ino", "starttime", "pgid")} | {"started_at": ident["started_at"]}
        with self.tx(crash_point="journal_tx", quiet=True) as db:  # the child sets up meanwhile
            # written only while no cancel is recorded (read inside this transaction: a canceller's commit is
            # before it or after it); else refuse_cancelled raises and the transaction rolls back
            cols = ", ".join(f"{k}=:{k}" for k in fields)
            if not db.execute(f"UPDATE cells SET {cols} WHERE run_id=:_r AND cell_id=:_c "
                              "AND COALESCE(cancel_reason, '') = ''", {**fields, "_r": run_id, "_c": cell_id}).rowcount:
                self.refuse_cancelled(run_id, cell_id)
            self.event(db, "stage." + st["stage"], run_id, cell_id, **st)

    def cancel_reason(self, run_id: str, cell_id: str) -> str | None:
        """The first cancel recorded for the cell by any process, or None."""
        row = self._one("SELECT cancel_reason FROM cells WHERE run_id=? AND cell_id=?", (run_id, cell_id))
        return row[0] if row else None

    def refuse_cancelled(self, run_id: str, cell_id: str) -> None:
        """A cancel recorded before the cell started wins: CancelledBeforeStart, and its command never runs."""
        why = self.cancel_reason(run_id, cell_id)
        if why:
            raise CancelledBeforeStart(f"cell {cell_id} of run {run_id} was {why} before it started")

    def conclude_cell(self, receipt: dict, receipt_path: str | None, end_controller: str | None = None,
                      text: str | None = None) -> None:
        """The cell's terminal state and its receipt, in one transaction (with
        `end_controller`: a one-cell controller ends with its cell). `text`: the
        receipt as receipts.dumps encoded it for its file (the row holds the same)."""
        run_id, cell_id = receipt["run_id"], receipt["cell_id"]
        with self.tx() as db:
            self._move_cell(db, run_id, cell_id, receipt["state"], ended_at=receipt["ended_at"],
                            exit_code=receipt["exit_code"], signal=receipt["signal"], reason=receipt["reason"],
                            receipt_path=receipt_path)
            self._add_receipt(db, "cell", run_id, cell_id, receipt, text)
            self.event(db, "state." + receipt["state"], run_id, cell_id, reason=receipt["reason"],
                       exit_code=receipt["exit_code"])
            row = None
            if (receipt.get("changes") or {}).get("record"):  # a change record (changes.commit): indexed here
                from ..changes import summary_row
                row = summary_row({"agent_id": receipt.get("agent_id"), **receipt["changes"]})
            if row is not None:
                self.add_change(row, db)
            if end_controller:
                self.end_controller(end_controller, db)
        if row is not None:  # journal.db lives in the state root: the record's pending marker can go
            from ..changes import settled
            settled(os.path.dirname(self.path), row["run_id"], row["record_id"])

    def _set(self, db, run_id: str, cell_id: str, fields: dict) -> None:
        assert "state" not in fields, "cell states change only through _move_cell"
        if not fields:
            return
        cols = ", ".join(f"{k}=:{k}" for k in fields)
        db.execute(f"UPDATE cells SET {cols} WHERE run_id=:_r AND cell_id=:_c", {**fields, "_r": run_id, "_c": cell_id})

    def _move_cell(self, db, run_id: str, cell_id: str, state: str, **fields) -> None:
        """One UPDATE of the state and `fields`, guarded by the states that may go to `state` (CELL_FLOW);
        when it changed no row, the cell's state (or its absence) says why."""
        assert "state" not in fields, "the state is the move's own argument"
        sets, was = "".join(f", {k}=:{k}" for k in fields), _FROM_SQL.get(state)
        if was and db.execute(f"UPDATE cells SET state=:_s{sets} WHERE run_id=:_r AND cell_id=:_c AND state IN ({was})",
                              {**fields, "_s": state, "_r": run_id, "_c": cell_id}).rowcount:
            return
        row = db.execute("SELECT state FROM cells WHERE run_id=? AND cell_id=?", (run_id, cell_id)).fetchone()
        if row is None:
            raise StateError(f"journal {self.path}: no cell {cell_id!r} in run {run_id!r}")
        raise StateError(f"journal {self.path}: cell {cell_id} of run {run_id} cannot go from {row[0]} to {state}")

    def _move_run(self, db, run_id: str, was: str, state: str, **fields) -> None:
        if state not in RUN_FLOW.get(was, ()):
            raise StateError(f"journal {self.path}: run {run_id} cannot go from {was} to {state}")
        sets = "".join(f", {k}=:{k}" for k in fields)
        db.execute(f"UPDATE runs SET state=:state{sets} WHERE run_id=:run_id AND state=:was",
                   {**fields, "state": state, "run_id": run_id, "was": was})

    # (run_id, cell_id, **data): a denied call starts nothing, but the journal remembers it was
    # asked; a start refused before a cell existed (not found, not executable) is an event too.
    record_denied = partialmethod(add_event, "denied")
    record_refused = partialmethod(add_event, "refused")

    def refusals(self, run_id: str | None = None) -> list[dict]:
        """The denied and refused calls, oldest first."""
        where, args = ("AND run_id=?", (run_id,)) if run_id else ("", ())
        return [{"kind": k, "run_id": r, "cell_id": c, "t": t, **json.loads(d or "{}")} for k, r, c, t, d in self._all(
            f"SELECT kind, run_id, cell_id, t, data FROM events WHERE kind IN ('denied','refused') {where} "
            "ORDER BY id", args)]

    def record_file_op(self, run_id: str, op: str, **data) -> None:
        """One call of sandboxd's filesystem API (read, stat, write, delete), allowed or refused."""
        self.add_event(f"file.{op}", run_id, None, **data)

    def file_ops(self, run_id: str) -> list[dict]:
        rows = self._all("SELECT t, kind, data FROM events WHERE run_id=? AND cell_id IS NULL AND kind LIKE 'file.%' "
                         "ORDER BY id", (run_id,))
        return [{"t": r["t"], "op": r["kind"][len("file."):], **json.loads(r["data"] or "{}")} for r in rows]

    def record_port(self, run_id: str, op: str, **data) -> None:
        """A published port of an agent's pod (agnsup/ports.py): op publish or close."""
        self.add_event(f"port.{op}", run_id, None, **data)

    def port_events(self, run_id: str | None = None) -> list[dict]:
        """The publish and close events of published ports, oldest first."""
        where, args = ("AND run_id=?", (run_id,)) if run_id else ("", ())
        rows = self._all(f"SELECT t, run_id, kind, data FROM events WHERE cell_id IS NULL AND kind LIKE 'port.%' "
                         f"{where} ORDER BY id", args)
        return [{"t": r["t"], "run_id": r["run_id"], "op": r["kind"][len("port."):], **json.loads(r["data"] or "{}")}
                for r in rows]

    def _add_receipt(self, db, kind: str, run_id, cell_id, data: dict, text: str | None = None) -> None:
        row = (kind, run_id, cell_id, time.time(), json.dumps(data, sort_keys=True) if text is None else text)
        cur = db.execute("INSERT INTO receipts(kind, run_id, cell_id, t, data) VALUES (?,?,?,?,?)", row)
        self._pending.append(("receipts", (cur.lastrowid, *row)))

    # -- change records (agnsup/changes.py) ------------------------------------
    def add_change(self, row: dict, db=None) -> None:
        """A change record's row (once: a janitor finishing a record the controller already indexed
        changes nothing); an undo record marks the record it undoes `undone`."""
        with self._within(db) as db:
            cur = db.execute(
                "INSERT OR IGNORE INTO changes(run_id, record_id, agent_id, cell_id, kind, undoes, worktree, state, "
                "created_at, files, bytes_saved, paths) VALUES (?,?,?,?,?,?,?,'committed',?,?,?,?)",
                (row["run_id"], row["record_id"], row.get("agent_id"), row.get("cell_id"), row.get("kind", "cell"),
                 row.get("undoes"), row.get("worktree"), row["created_at"], row.get("files", 0),
                 row.get("bytes_saved", 0), json.dumps(row.get("paths") or [])))
            if cur.rowcount and row.get("undoes"):
                db.execute("UPDATE changes SET state='undone', undone_by=? WHERE run_id=? AND record_id=? "
                           "AND state='committed'", (row["record_id"], row["run_id"], row["undoes"]))
            if cur.rowcount:
                self.event(db, "change." + row.get("kind", "cell"), row["run_id"], row.get("cell_id"),
                           record=row["record_id"], undoes=row.get("undoes"), files=row.get("files", 0))

    def change_row(self, run_id: str, record_id: str):
        return self._one("SELECT * FROM changes WHERE run_id=? AND record_id=?", (run_id, record_id))

    def change_rows(self, run_id=None, record_id=None, agent_id=None, cell_id=None, state=None, states=None,
                    worktree=None, after=None) -> list:
        """Change records, oldest first, filtered by whichever arguments are given (`after`: created later)."""
        where, args = [], []
        for col, val in (("run_id", run_id), ("record_id", record_id), ("agent_id", agent_id),
                         ("cell_id", cell_id), ("state", state), ("worktree", worktree)):
            if val is not None:
                where.append(f"{col}=?")
                args.append(val)
        if states:
            where.append(f"state IN ({','.join('?' * len(states))})")
            args.extend(states)
        if after is not None:
            where.append("created_at > ?")
            args.append(after)
        q = "SELECT * FROM changes" + (" WHERE " + " AND ".join(where) if where else "")
        return self._all(q + " ORDER BY created_at, seq", tuple(args))

    def set_change_state(self, keys: list[tuple[str, str]], state: str) -> None:
        """(run_id, record_id) pairs to `state` (retention: 'dropped')."""
        if not keys:
            return
        with self.tx() as db:
            db.executemany("UPDATE changes SET state=? WHERE run_id=? AND record_id=?",
                           [(state, r, c) for r, c in keys])

    # -- cancel and cleanup ---------------------------------------------------
    @staticmethod
    def _scope_where(kind: str, run_id, agent_id, cell_id) -> tuple[str, tuple]:
        return {"cell": ("run_id=? AND cell_id=?", (run_id, cell_id)),
                "agent": ("run_id=? AND agent_id=?", (run_id, agent_id)),
                "run": ("run_id=?", (run_id,)), "all": ("1=1", ())}[kind]

    def cell_runs(self, cell_id: str) -> list[str]:
        """The runs that hold a cell with this id."""
        return [r[0] for r in self._all("SELECT run_id FROM cells WHERE cell_id=? ORDER BY run_id", (cell_id,))]

    def has_agent(self, run_id: str, agent_id: str) -> bool:
        return self._one("SELECT 1 FROM cells WHERE run_id=? AND agent_id=? LIMIT 1", (run_id, agent_id)) is not None

    def record_cancel(self, kind: str, run_id, agent_id, cell_id, reason: str) -> list:
        """Every live cell of the scope gets `reason` unless it has one (first
        reason wins); a run scope also marks the run cancelled. Returns the rows."""
        where, args = self._scope_where(kind, run_id, agent_id, cell_id)
        with self.tx() as db:
            rows = db.execute(f"SELECT * FROM cells WHERE {where} AND {LIVE_CELL} ORDER BY created_at", args).fetchall()
            for r in rows:
                db.execute("UPDATE cells SET cancel_reason=? WHERE run_id=? AND cell_id=? AND cancel_reason IS NULL",
                           (reason, r["run_id"], r["cell_id"]))
            if kind == "run":
                db.execute("UPDATE runs SET state='cancelled', ended_at=?, cancel_reason=COALESCE(cancel_reason, ?) "
                           "WHERE run_id=? AND state='active'", (time.time(), reason, run_id))
            self.event(db, "cancel", run_id, cell_id, scope=kind, agent_id=agent_id, reason=reason,
                       cells=[[r["run_id"], r["cell_id"]] for r in rows])
        return rows

    def cell_state(self, run_id: str, cell_id: str) -> str | None:
        row = self._one("SELECT state FROM cells WHERE run_id=? AND cell_id=?", (run_id, cell_id))
        return row[0] if row else None

    def finish_run(self, run_id: str, items: list) -> None:
        """Cleanup: an active run with no live cell becomes finished; what was reclaimed is an event."""
        with self.tx() as db:
            if db.execute(f"SELECT 1 FROM cells WHERE run_id=? AND {LIVE_CELL} LIMIT 1", (run_id,)).fetchone() is None:
                db.execute("UPDATE runs SET state='finished', ended_at=? WHERE run_id=? AND state='active'",
                           (time.time(), run_id))
            if items:
                self.event(db, "cleanup", run_id, None, items=items)

    # -- recovery (the janitor) -------------------------------------------------
    def live_cells_of(self, cid: str) -> list:
        return self._all(f"SELECT * FROM cells WHERE controller_id=? AND {LIVE_CELL} ORDER BY created_at", (cid,))

    def with_live_cells(self, cids: list[str]) -> set[str]:
        """Which of the controllers `cids` have a live cell: one read per 500 (cells_live), not one each."""
        out: set[str] = set()
        for part, marks in _in_parts(cids):
            out.update(r[0] for r in self._all(f"SELECT DISTINCT controller_id FROM cells WHERE controller_id IN "
                                               f"({marks}) AND {LIVE_CELL}", part))
        return out

    def recovery_plans(self, run_id: str, cell_id: str) -> list[dict]:
        """What earlier janitors journaled they were about to kill in this cell."""
        return [json.loads(d or "{}") for (d,) in self._all(
            "SELECT data FROM events WHERE run_id=? AND cell_id=? AND kind='recovery.kill' ORDER BY id",
            (run_id, cell_id))]

    def add_recovery_plans(self, plans: list[tuple[str, str, dict]]) -> None:
        """(run, cell, plan) of one kill round, journaled before the kill: they survive the janitor."""
        with self.tx() as db:
            for run_id, cell_id, plan in plans:
                self.event(db, "recovery.kill", run_id, cell_id, **plan)

    def conclude_recovered(self, cells: list[dict], janitor: str, now: float, receipt_path: str) -> None:
        """One transaction: every recovered cell terminal, its run `recovered` when no
        other cell of it lives, a recovery receipt row each. `cells`: dicts with
        run_id, cell_id, controller, entry (the receipt entry, updated here) and
        optionally reason (default `recovered`)."""
        with self.tx() as db:
            for c in cells:
                self._move_cell(db, c["run_id"], c["cell_id"], "recovered", reason=c.get("reason", "recovered"),
                                ended_at=now, receipt_path=receipt_path)
                self.event(db, "state.recovered", c["run_id"], c["cell_id"], janitor=janitor,
                           controller=c["controller"])
            runs: dict[str, tuple[bool, str]] = {}  # (other cells live, state), asked once a run: nothing here moves it
            for c in cells:
                run_id, entry = c["run_id"], c["entry"]
                if run_id not in runs:
                    if db.execute(f"SELECT 1 FROM cells WHERE run_id=? AND {LIVE_CELL} LIMIT 1", (run_id,)).fetchone():
                        runs[run_id] = (True, "active")
                    else:
                        cur = db.execute("UPDATE runs SET state='recovered', ended_at=? WHERE run_id=? AND "
                                         "state='active'", (now, run_id))
                        runs[run_id] = (False, "recovered" if cur.rowcount else
                                        db.execute("SELECT state FROM runs WHERE run_id=?", (run_id,)).fetchone()[0])
                live, entry["run_state"] = runs[run_id]
                if live:
                    entry["notes"].append(f"run {run_id} has other live cells: it stays active")
                self._add_receipt(db, "recovery", run_id, c["cell_id"], c["receipt"])
                if c.get("cell_receipt") is not None:
                    self._add_receipt(db, "cell", run_id, c["cell_id"], c["cell_receipt"])

    def end_controllers(self, ids: list[str], janitor: str) -> None:
        with self.tx() as db:
            for cid in ids:
                self.end_controller(cid, db)
                self.event(db, "recovery.controller_ended", controller=cid, janitor=janitor)

    def add_connections(self, db, run_id: str, cell_id: str, rows: list[dict]) -> None:
        """Egress proxy records (egress/proxy.py): one row per attempt, replaced by its
        later version (the same seq) when the connection ends."""
        db.executemany(
            "INSERT INTO connections(run_id, cell_id, seq, t, protocol, requested, name, port, address, decision, rule,"
            " reason, bytes_up, bytes_down, duration, error) VALUES (:_r, :_c, :seq, :t, :protocol, :requested, :name,"
            " :port, :address, :decision, :rule, :reason, :bytes_up, :bytes_down, :duration, :error)"
            " ON CONFLICT(run_id, cell_id, seq) DO UPDATE SET address=excluded.address, decision=excluded.decision,"
            " rule=excluded.rule, reason=excluded.reason, bytes_up=excluded.bytes_up,"
            " bytes_down=excluded.bytes_down, duration=excluded.duration, error=excluded.error",
            [{"duration": None, "error": None, **r, "_r": run_id, "_c": cell_id} for r in rows])

    # -- reads ------------------------------------------------------------
    def run(self, run_id: str):
        return self._one("SELECT * FROM runs WHERE run_id=?", (run_id,))

    def cell(self, run_id: str, cell_id: str):
        return self._one("SELECT * FROM cells WHERE run_id=? AND cell_id=?", (run_id, cell_id))

    def cells(self, run_id: str | None = None, live_only: bool = False, scope: tuple | None = None) -> list:
        """Cells (with their run's state as run_state), oldest first: of one run, live
        ones only, or of a cancel scope (kind, run_id, agent_id, cell_id)."""
        q = "SELECT c.*, r.state AS run_state FROM cells c JOIN runs r USING (run_id)"
        where, args = (["c.run_id=?"], [run_id]) if run_id else ([], [])
        if live_only:
            where.append("c." + LIVE_CELL)
        if scope is not None:
            w, a = self._scope_where(*scope)
            where.append(" AND ".join("c." + p for p in w.split(" AND ")))
            args.extend(a)
        if where:
            q += " WHERE " + " AND ".join(where)
        return self._all(q + " ORDER BY c.created_at", tuple(args))

    def run_activity(self) -> dict[str, tuple[bool, bool]]:
        """{run_id: (has a live cell, a controller of its cells is still open)} of the active runs: what
        `ps` shows for a run the journal calls active (an MCP or serve run whose server exited is ended)."""
        rows = self._all(
            f"SELECT r.run_id, EXISTS (SELECT 1 FROM cells c WHERE c.run_id = r.run_id AND c.{LIVE_CELL}), "
            "EXISTS (SELECT 1 FROM cells c JOIN controllers k ON k.id = c.controller_id "
            "WHERE c.run_id = r.run_id AND k.ended_at IS NULL) FROM runs r WHERE r.state = 'active'")
        return {r[0]: (bool(r[1]), bool(r[2])) for r in rows}

    def runs_ended_before(self, before: float) -> tuple[list[str], list[str]]:
        """(runs not yet cleaned up whose cells all ended before `before`, the newest end or else the run's
        start; runs started before `before` with a cell still live): what `cleanup --older-than` takes, and
        what it leaves alone."""
        old = self._all(
            "SELECT r.run_id FROM runs r WHERE r.state != 'finished' AND NOT EXISTS (SELECT 1 FROM cells c "
            f"WHERE c.run_id = r.run_id AND c.{LIVE_CELL}) AND COALESCE((SELECT MAX(c.ended_at) FROM cells c "
            "WHERE c.run_id = r.run_id), r.created_at) < ? ORDER BY r.created_at", (before,))
        busy = self._all(
            f"SELECT r.run_id FROM runs r WHERE r.created_at < ? AND EXISTS (SELECT 1 FROM cells c "
            f"WHERE c.run_id = r.run_id AND c.{LIVE_CELL}) ORDER BY r.created_at", (before,))
        return [r[0] for r in old], [r[0] for r in busy]

    def events(self, run_id: str, cell_id: str) -> list:
        return self._all("SELECT * FROM events WHERE run_id=? AND cell_id=? ORDER BY id", (run_id, cell_id))

    def stage_events(self, cells: list[tuple[str, str]]) -> dict[tuple[str, str], list[str]]:
        """{(run_id, cell_id): the data of each of its `stage.*` events, in order} for many cells at once:
        one read per run and 500 cells (events_by_cell), not one a cell (the janitor's cell receipts)."""
        out: dict[tuple[str, str], list[str]] = {k: [] for k in cells}
        by_run: dict[str, list[str]] = {}
        for run_id, cell_id in out:
            by_run.setdefault(run_id, []).append(cell_id)
        for run_id, ids in by_run.items():
            for part, marks in _in_parts(ids):
                for cell_id, kind, data in self._all(
                        f"SELECT cell_id, kind, data FROM events WHERE run_id=? AND cell_id IN ({marks}) ORDER BY id",
                        (run_id, *part)):
                    if kind.startswith("stage.") and data:
                        out[run_id, cell_id].append(data)
        return out

    def connections(self, run_id: str, cell_id: str) -> list[dict]:
        return [dict(r) for r in self._all("SELECT * FROM connections WHERE run_id=? AND cell_id=? ORDER BY seq",
                                           (run_id, cell_id))]

    def receipts(self, kind: str | None = None, run_id: str | None = None, cell_id: str | None = None) -> list[dict]:
        where = [(f"{col}=?", val) for col, val in (("kind", kind), ("run_id", run_id), ("cell_id", cell_id)) if val]
        q = "SELECT data FROM receipts" + (" WHERE " + " AND ".join(w for w, _ in where) if where else "")
        try:
            return [json.loads(r[0]) for r in self._all(q + " ORDER BY id", tuple(v for _, v in where))]
        except ValueError as e:  # a row SQLite returns whole but whose bytes were overwritten
            raise self._damaged(f"a receipt row is not JSON: {e}") from None

    # -- the chain (agnsup/store/chain.py) ---------------------------------------------
    def chain_snapshot(self) -> dict:
        """The chain rows and the chained tables' rows (by id), one consistent read, and the cells on disk
        (their receipt files), for chain.verify."""
        with self.lock or nullcontext():
            try:
                self.db.execute("BEGIN")
                try:
                    return {"cells_on_disk": cells_on_disk(os.path.dirname(self.path)),
                            "chain": [tuple(r) for r in self.db.execute(
                                "SELECT seq, tbl, row, prev, hash, anchor FROM chain ORDER BY seq")],
                            **{tbl: {r[0]: tuple(r) for r in self.db.execute(f"SELECT {cols} FROM {tbl}")}
                               for tbl, cols in _COLS.items()},
                            "receipt_paths": {(r[0], r[1]): r[2] for r in self.db.execute(
                                "SELECT run_id, cell_id, receipt_path FROM cells WHERE receipt_path IS NOT NULL")}}
                finally:
                    self.db.execute("COMMIT")
            except sqlite3.Error as e:
                raise self._failed(e, f"journal {self.path}: cannot read: {e}") from None

    def chained_receipts(self, kind: str | None = None, run_id: str | None = None, cell_id: str | None = None):
        """(seq, hash, prev, anchor, the receipts row) of each receipt whose chain record holds, in chain order,
        streamed (a row the chain does not hold is verify's to name, not the export's to pass on)."""
        where = [(f"r.{col}=?", val) for col, val in (("kind", kind), ("run_id", run_id), ("cell_id", cell_id)) if val]
        q = (f"SELECT c.seq, c.hash, c.prev, c.anchor, {', '.join('r.' + c for c in chain.COLUMNS['receipts'])} "
             "FROM chain c JOIN receipts r ON r.id = c.row WHERE c.tbl = 'receipts'")
        q += "".join(" AND " + w for w, _ in where) + " ORDER BY c.seq"
        try:
            with self.lock or nullcontext():
                cur = self.db.execute(q, tuple(v for _, v in where))
                for r in cur:
                    if chain.link(r[2], "receipts", r[3], tuple(r)[4:]) == r[1]:
                        yield tuple(r)
        except sqlite3.Error as e:
            raise self._failed(e, f"journal {self.path}: cannot read: {e}") from None

    def restart_chain(self, old_head: dict | None) -> None:
        """`journal repair`: a chain that starts again (a rebuilt journal, or a head the journal no longer
        matches) begins with an event naming the old head; the head is then written whatever it was."""
        self._anchor = 0  # heads seen before belong to the old chain (verify: anchors count from the restart on)
        with self.tx() as db:
            self.event(db, "chain.restarted", old_head=old_head)
            head = self._chain()
            self._pending = []
        self._write_head(*head, force=True)

    # -- check and repair (agnsup/store/repair.py) ------------------------------------
    def integrity(self) -> list[str]:
        """PRAGMA integrity_check: ["ok"], or what SQLite found wrong (reads the whole file)."""
        return [r[0] for r in self._all("PRAGMA integrity_check(20)")]

    def known_cells(self) -> set[tuple[str, str]]:
        """Every cell the journal holds or pruned."""
        return {(r[0], r[1]) for r in self._all("SELECT run_id, cell_id FROM cells UNION "
                                                 "SELECT run_id, cell_id FROM pruned")}

    # -- retention -------------------------------------------------------------
    def prunable(self, before: float) -> list:
        """Ended cells that ended before `before`, with their newest cell receipt."""
        return self._all(
            f"SELECT c.run_id, c.cell_id, c.ended_at, c.receipt_path, (SELECT data FROM receipts r WHERE "
            f"r.kind='cell' AND r.run_id=c.run_id AND r.cell_id=c.cell_id ORDER BY r.id DESC LIMIT 1) AS receipt "
            f"FROM cells c WHERE c.state IN ({_TERMINAL_SQL}) AND c.ended_at < ? ORDER BY c.ended_at", (before,))

    def prune(self, cells: list[tuple[str, str, float | None, str | None]], before: float) -> dict:
        """Remove these ended cells' rows, events, receipts and connections (a `pruned` row
        each stays), then the calls that started nothing, ended controllers and
        finished runs left empty, all older than `before`. A cancelled run's row stays:
        it refuses new cells forever. One transaction."""
        now = time.time()
        out = {"cells": 0, "events": 0, "receipts": 0, "controllers": 0, "runs": 0}
        gone_rows: set[tuple[str, int]] = set()  # their chain rows stay: the event below names their seqs
        with self.tx() as db:
            for run_id, cell_id, ended_at, path in cells:
                db.execute("INSERT OR REPLACE INTO pruned(run_id, cell_id, ended_at, receipt_path, pruned_at) "
                           "VALUES (?,?,?,?,?)", (run_id, cell_id, ended_at, path, now))
                for table in ("events", "receipts", "connections", "cells"):  # the counts leave connections out
                    if table in chain.COLUMNS:
                        gone_rows.update((table, r[0]) for r in db.execute(
                            f"SELECT id FROM {table} WHERE run_id=? AND cell_id=?", (run_id, cell_id)))
                    gone = db.execute(f"DELETE FROM {table} WHERE run_id=? AND cell_id=?", (run_id, cell_id)).rowcount
                    if table in out:
                        out[table] += gone
            # the chain's own history (what was pruned, where a chain restarted) stays: verify reads it
            old = ("FROM events WHERE t < ? AND (cell_id IS NULL OR kind IN ('denied', 'refused')) "
                   "AND kind NOT IN ('journal.pruned', 'chain.restarted')")
            gone_rows.update(("events", r[0]) for r in db.execute("SELECT id " + old, (before,)))
            out["events"] += db.execute("DELETE " + old, (before,)).rowcount
            out["controllers"] = db.execute(
                "DELETE FROM controllers WHERE ended_at IS NOT NULL AND ended_at < ? AND NOT EXISTS "
                "(SELECT 1 FROM cells c WHERE c.controller_id = controllers.id)", (before,)).rowcount
            out["runs"] = db.execute(
                "DELETE FROM runs WHERE state IN ('finished', 'recovered') AND NOT EXISTS "
                "(SELECT 1 FROM cells c WHERE c.run_id = runs.run_id)").rowcount
            seqs = [r[0] for r in db.execute("SELECT seq, tbl, row FROM chain") if (r[1], r[2]) in gone_rows] \
                if gone_rows else []
            self.event(db, "journal.pruned", before=before, **out, chain=chain.ranges(seqs))
        return out

    def compact(self) -> None:
        """Give the freed pages back to the file system (VACUUM, then a WAL checkpoint)."""
        try:
            with self.lock or nullcontext():
                self.db.execute("VACUUM")
                self.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        except sqlite3.Error as e:
            raise StateError(f"journal {self.path}: cannot compact: {e}") from None

    def import_cell(self, receipt: dict, receipt_path: str) -> None:
        """A cell receipt found on disk into a rebuilt journal: its run, its controller
        (ended), its terminal row, the receipt and an event `repair.imported`."""
        run_id, cell_id, t = receipt["run_id"], receipt["cell_id"], receipt.get("ended_at") or time.time()
        started = receipt.get("started_at") or t
        pids = receipt.get("pids") or {}
        with self.tx() as db:
            db.execute("INSERT OR IGNORE INTO runs(run_id, state, created_at, ended_at) VALUES (?, ?, ?, ?)",
                       (run_id, "recovered" if receipt.get("state") == "recovered" else "finished", started, t))
            cid = receipt.get("controller") or "unknown"
            db.execute("INSERT OR IGNORE INTO controllers(id, kind, pid, starttime, boot_id, lock_path, started_at, "
                       "ended_at) VALUES (?, 'repaired', 0, 0, ?, '', ?, ?)",
                       (cid, receipt.get("boot_id") or "", started, t))
            db.execute(
                "INSERT INTO cells(run_id, cell_id, agent_id, role, state, token, controller_id, boot_id, cgroup, "
                "cgroup_ino, argv, exe, worktree, pid, starttime, pgid, created_at, started_at, ended_at, exit_code, "
                "signal, reason, cancel_reason, receipt_path) "
                "VALUES (?,?,?,?,?,'',?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (run_id, cell_id, receipt.get("agent_id") or "default", receipt.get("role") or "", receipt["state"],
                 cid, receipt.get("boot_id") or "", json.dumps(receipt.get("cgroup")), receipt.get("cgroup_inode"),
                 json.dumps(receipt.get("argv") or []), receipt.get("exe"), receipt.get("workdir"), pids.get("leader"),
                 pids.get("starttime"), pids.get("pgid"), started, started, t, receipt.get("exit_code"),
                 receipt.get("signal"), receipt.get("reason"), receipt.get("cancel_reason"), receipt_path))
            self._add_receipt(db, "cell", run_id, cell_id, receipt)
            self.event(db, "repair.imported", run_id, cell_id, receipt=receipt_path)

    def query_plan(self, sql: str) -> str:
        """EXPLAIN QUERY PLAN of one of this module's queries (tests: the indexes serve them)."""
        return " ".join(r[3] for r in self._all("EXPLAIN QUERY PLAN " + sql))


WAL_PAGES = 256  # the auto-checkpoint's bound (Journal.__init__)
# the chain's and the events' INSERTs of 1..N rows as one statement each (the same text every time: SQLite's
# statement cache, 128 per connection, keeps each prepared); more rows go by executemany (6 variables a row)
_CHAIN_ROWS_AT_ONCE = 16
_CHAIN_END = "SELECT seq, hash FROM chain ORDER BY seq DESC LIMIT 1"
_CHAIN_INSERT = ["INSERT INTO chain(seq, tbl, row, prev, hash, anchor) VALUES " + ",".join(["(?,?,?,?,?,?)"] * n)
                 for n in range(1, _CHAIN_ROWS_AT_ONCE + 1)]
_EVENTS_INSERT = ["INSERT INTO events(t, run_id, cell_id, kind, data) VALUES " + ",".join(["(?,?,?,?,?)"] * n)
                  for n in range(1, _CHAIN_ROWS_AT_ONCE + 1)]
CHECKPOINT_EVERY = 20  # commits of a controller of many cells between its background checkpoints (~4 cells)


class _Checkpointer:
    """Journal.checkpoint_behind's thread: PRAGMA wal_checkpoint(PASSIVE) on its own connection when told,
    errors left to the auto-checkpoint (a journal that is damaged shows on the main connection)."""

    def __init__(self, path: str):
        import threading
        self.path = path
        self.count = 0
        self.wake = threading.Event()
        self.closing = False
        self.done = 0  # checkpoints run (tests)
        self.thread = threading.Thread(target=self._loop, name="agnsup-checkpoint", daemon=True)
        self.thread.start()

    def committed(self, quiet: bool) -> None:
        """One commit of the main connection (under its lock, when it has one). The thread is woken at a quiet
        one (a cell's identity: its request thread then waits for the child's exec, its CPU free), or after
        4x the commits without one."""
        self.count += 1
        if self.count >= CHECKPOINT_EVERY * (1 if quiet else 4):
            self.count = 0
            self.wake.set()

    def _loop(self) -> None:
        db = None
        try:
            while True:
                self.wake.wait()
                self.wake.clear()
                if self.closing:
                    return
                try:
                    if db is None:
                        db = sqlite3.connect(self.path, timeout=30, isolation_level=None, check_same_thread=False)
                    db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
                    self.done += 1
                except sqlite3.Error:
                    pass
        finally:
            if db is not None:
                with suppress(sqlite3.Error):
                    db.close()

    def close(self) -> None:
        self.closing = True
        self.wake.set()
        self.thread.join(30)


def _wal_mode(db) -> str:
    """PRAGMA journal_mode = WAL, retried while another connection is switching the same fresh file: the switch
    takes SHARED then EXCLUSIVE, and SQLite answers SQLITE_BUSY at once, without the busy handler, to one of two
    connections that both hold SHARED and want more (a deadlock it refuses to wait in: two controllers started
    together on a new state root; seen ~1 open in 75). Bounded by the busy timeout."""
    import time
    deadline = time.monotonic() + 30
    while True:
        try:
            return db.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        except sqlite3.OperationalError as e:
            if getattr(e, "sqlite_errorcode", None) != sqlite3.SQLITE_BUSY or time.monotonic() > deadline:
                raise
            time.sleep(0.005)


def _latest() -> int:
    """The newest migration number, from the file names alone (cheap: every start asks)."""
    from . import migrations
    d = list(migrations.__path__)[0]
    try:
        names = os.listdir(d)
    except OSError:
        return max(n for n, _ in _migrations())
    return max(int(n[:4]) for n in names if n.endswith(".sql") and n[:4].isdigit())


# -- a journal that is damaged or lost its history (issue 12 items 2, 3) -----------
DAMAGED_MARK = ".damaged"  # next to journal.db: why agnsup refuses to write into it
_SQLITE_CORRUPT, _SQLITE_NOTADB = 11, 26


def _corrupt(e: Exception) -> bool:
    code = getattr(e, "sqlite_errorcode", None)
    if code is not None and code & 0xFF in (_SQLITE_CORRUPT, _SQLITE_NOTADB):
        return True
    # garbage where text was: the pages parse, their bytes do not
    return any(m in str(e) for m in ("malformed", "not a database", "Could not decode to UTF-8"))


def damaged(path: str, why: str) -> JournalDamaged:
    return JournalDamaged(f"journal {path} is unusable: damaged ({why}); agnsup writes nothing into it. "
                          "`agnsup journal repair` keeps it aside and rebuilds the journal from the receipts on disk "
                          "(`agnsup journal check` says what is there); `agnsup cancel --all` still kills")


def cells_on_disk(state_root: str) -> list[tuple[str, str]]:
    """(run_id, cell_id) of every cell directory under <state>/cells: what the journal must know."""
    out: list[tuple[str, str]] = []
    top = os.path.join(state_root, "cells")
    try:
        runs = sorted(os.listdir(top))
    except OSError:
        return out
    for run in runs:
        with suppress(OSError):
            out += [(run, c) for c in sorted(os.listdir(os.path.join(top, run)))]
    return out


def _size(path: str) -> int | None:
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return None


# Journal files this process holds an SQLite connection to, by (st_dev, st_ino), counted.
# Closing *any* descriptor of a file drops every POSIX lock the process holds on it, SQLite's
# own included (fcntl(2); sqlite.org/howtocorrupt.html 2.2): preflight must not open and
# close such a file behind the connection's back, so it leaves the header to that connection.
_CONNECTED: dict[tuple[int, int] | None, int] = {}


def _file_id(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def preflight(path: str) -> None:
    """Refuse a journal that is damaged or that lost its history, before SQLite
    opens (and would happily write into) it. Cheap enough for every start: one
    stat and the 100-byte header; the cell directories are listed only when the
    journal is empty or missing. Corruption deeper in the file shows when SQLite
    reads it (Journal._damaged marks it then) and in `agnsup journal check`."""
    try:
        with open(path + DAMAGED_MARK) as f:
            raise damaged(path, f.read().strip() or "marked damaged")
    except FileNotFoundError:
        pass
    except OSError as e:
        raise StateError(f"journal {path}{DAMAGED_MARK}: cannot read: {e.strerror}") from None
    size, wal = _size(path), _size(path + "-wal")
    if not size:
        if not wal:
            lost = cells_on_disk(os.path.dirname(path))
            if lost:
                raise JournalDamaged(
                    f"journal {path} lost its history: it is {'missing' if size is None else 'empty'} but "
                    f"{len(lost)} cell(s) are on disk under cells/ (e.g. {lost[0][0]}/{lost[0][1]}); agnsup writes "
                    "nothing into it and reuses no id. `agnsup journal repair` rebuilds it from the receipts on disk "
                    "(`agnsup journal check` says what is there)")
        return
    if _CONNECTED and _file_id(path) in _CONNECTED:
        return  # checked when this process first connected; its connection holds locks on the file
    try:
        with open(path, "rb") as f:
            head = f.read(100)
    except OSError as e:
        raise StateError(f"journal {path} is unusable: {e.strerror}") from None
    if not head.startswith(b"SQLite format 3\0"):
        raise damaged(path, "not an SQLite database: its header is gone")
    if len(head) == 100 and not wal:
        page = int.from_bytes(head[16:18], "big")
        page = 65536 if page == 1 else page
        pages = int.from_bytes(head[28:32], "big")
        # the header's page count holds when its version-valid-for number matches the change counter
        if head[92:96] == head[24:28] and pages * page > size:
            raise damaged(path, f"truncated: {size} bytes where its header counts {pages * page}")


def open_journal(state_root: str) -> Journal:
    return Journal(os.path.join(state_root, "journal.db"))


def peek_open_controllers(path: str) -> list | None:
    """OPEN_SQL on a journal file without opening it for writing (the janitor's
    start-up probe); None if there is no usable journal."""
    if not os.path.exists(path):
        return None
    try:
        with closing(sqlite3.connect(path, timeout=30)) as db:
            return db.execute(OPEN_SQL).fetchall()
    except sqlite3.Error:
        return None


def _in_parts(values: list, size: int = 500) -> list[tuple[tuple, str]]:
    """`values` in parts of at most `size` (SQLite's bound on a statement's variables), each with its
    "?,?,..." for an IN (...) list."""
    parts = [tuple(values[i:i + size]) for i in range(0, len(values), size)]
    return [(p, ",".join("?" * len(p))) for p in parts]
