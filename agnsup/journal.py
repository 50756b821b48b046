"""The journal: SQLite in WAL mode under the state root.

Writes go through `tx()` (BEGIN IMMEDIATE ... COMMIT) so each change is whole
or absent after a crash. synchronous=NORMAL: in WAL mode a commit survives the
death of the process (what the janitor needs); only a power cut may lose the
last commits, and a power cut also ends every process they described. The
same holds for a process that exits without closing its connection (the CLI
does, to skip the checkpoint-on-close): the WAL it leaves is folded into the
database by a later writer's automatic checkpoint.
Migrations are the numbered files in `journal/`, applied in order.
"""
from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager

try:
    # The C module itself (same connect, Row and errors): the sqlite3 package
    # around it only adds date/datetime adapters agnsup never uses, and
    # imports datetime for them (~2 ms on every `agnsup run`).
    import _sqlite3 as sqlite3
except ImportError:  # pragma: no cover - an interpreter without the private name
    import sqlite3

from .errors import StateError

TERMINAL_CELL = ("exited", "failed", "timeout", "cancelled", "killed", "recovered")
TERMINAL_RUN = ("cancelled", "finished", "recovered")


def _migrations() -> list[tuple[int, str]]:
    from importlib.resources import files
    out = []
    for entry in files("agnsup.migrations").iterdir():
        name = entry.name
        if name.endswith(".sql") and name[:4].isdigit():
            out.append((int(name[:4]), entry.read_text()))
    return sorted(out)


class Journal:
    def __init__(self, path: str):
        self.path = path
        self.lock = None  # a threading.RLock when one connection serves many threads (serve)
        try:
            self.db = sqlite3.connect(path, timeout=30, isolation_level=None, check_same_thread=False)
            self.db.row_factory = sqlite3.Row
            self.db.execute("PRAGMA busy_timeout = 30000")
            mode = self.db.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            self.db.execute("PRAGMA synchronous = NORMAL")
            # `agnsup run` exits without the checkpoint-on-close (broker.Controller.close),
            # so the next start rebuilds the WAL index from the WAL (~4 us a page):
            # a 256-page WAL bounds that to ~1 ms; a cell writes ~36 pages.
            self.db.execute("PRAGMA wal_autocheckpoint = 256")
            version = self.db.execute("PRAGMA user_version").fetchone()[0]
        except sqlite3.DatabaseError as e:
            raise StateError(f"journal {path} is unusable: {e}") from None
        if mode != "wal":
            raise StateError(f"journal {path}: cannot switch to WAL mode (got {mode})")
        if version == 0 or version < _latest():
            self._migrate(version)

    def _migrate(self, version: int) -> None:
        try:
            with self.tx():
                current = self.db.execute("PRAGMA user_version").fetchone()[0]
                for num, sql in _migrations():
                    if num > current:
                        for stmt in sql.split(";\n"):
                            if stmt.strip():
                                self.db.execute(stmt)
                        self.db.execute(f"PRAGMA user_version = {num}")
        except sqlite3.DatabaseError as e:
            raise StateError(f"journal {self.path}: migration failed: {e}") from None

    @contextmanager
    def tx(self, crash_point: str | None = None):
        """One write transaction. `crash_point` names a test-only crash point
        fired after the statements ran and before COMMIT (crashpoints.py)."""
        lock = self.lock
        if lock is not None:
            lock.acquire()
        try:
            try:
                self.db.execute("BEGIN IMMEDIATE")
            except sqlite3.OperationalError as e:
                raise StateError(f"journal {self.path}: cannot write: {e}") from None
            try:
                yield self.db
                if crash_point:
                    from . import crashpoints
                    crashpoints.hit(crash_point)
                self.db.execute("COMMIT")
            except BaseException:
                try:
                    self.db.execute("ROLLBACK")
                except sqlite3.Error:
                    pass
                raise
        finally:
            if lock is not None:
                lock.release()

    def close(self) -> None:
        self.db.close()

    # -- writes -----------------------------------------------------------
    def event(self, db, kind: str, run_id=None, cell_id=None, **data) -> None:
        db.execute("INSERT INTO events(t, run_id, cell_id, kind, data) VALUES (?,?,?,?,?)",
                   (time.time(), run_id, cell_id, kind, json.dumps(data) if data else None))

    def register_controller(self, row: dict, db=None) -> None:
        """The controller instance's row, in its own transaction or in the caller's `db`."""
        if db is None:
            with self.tx() as db:
                self.register_controller(row, db)
            return
        db.execute("INSERT INTO controllers(id, kind, pid, pidfd_ino, starttime, boot_id, lock_path, started_at)"
                   " VALUES (:id, :kind, :pid, :pidfd_ino, :starttime, :boot_id, :lock_path, :started_at)", row)

    def end_controller(self, cid: str, db=None) -> None:
        if db is None:
            with self.tx() as db:
                self.end_controller(cid, db)
            return
        db.execute("UPDATE controllers SET ended_at=? WHERE id=?", (time.time(), cid))

    def update_cell(self, db, run_id: str, cell_id: str, **fields) -> None:
        cols = ", ".join(f"{k}=:{k}" for k in fields)
        db.execute(f"UPDATE cells SET {cols} WHERE run_id=:_r AND cell_id=:_c",
                   {**fields, "_r": run_id, "_c": cell_id})

    def add_receipt(self, db, kind: str, run_id, cell_id, data: dict) -> None:
        db.execute("INSERT INTO receipts(kind, run_id, cell_id, t, data) VALUES (?,?,?,?,?)",
                   (kind, run_id, cell_id, time.time(), json.dumps(data, sort_keys=True)))

    def add_connections(self, db, run_id: str, cell_id: str, rows: list[dict]) -> None:
        """Egress proxy records (egress/proxy.py): one row per attempt, replaced by its
        later version (the same seq) when the connection ends."""
        db.executemany(
            "INSERT INTO connections(run_id, cell_id, seq, t, protocol, requested, name, port, address, decision, rule, reason,"
            " bytes_up, bytes_down, duration, error) VALUES (:_r, :_c, :seq, :t, :protocol, :requested, :name, :port,"
            " :address,"
            " :decision, :rule, :reason, :bytes_up, :bytes_down, :duration, :error)"
            " ON CONFLICT(run_id, cell_id, seq) DO UPDATE SET address=excluded.address, decision=excluded.decision,"
            " rule=excluded.rule, reason=excluded.reason, bytes_up=excluded.bytes_up,"
            " bytes_down=excluded.bytes_down, duration=excluded.duration, error=excluded.error",
            [{"duration": None, "error": None, **r, "_r": run_id, "_c": cell_id} for r in rows])

    # -- reads ------------------------------------------------------------
    def run(self, run_id: str):
        return self.db.execute("SELECT * FROM runs WHERE run_id=?", (run_id,)).fetchone()

    def cell(self, run_id: str, cell_id: str):
        return self.db.execute("SELECT * FROM cells WHERE run_id=? AND cell_id=?", (run_id, cell_id)).fetchone()

    def cells(self, run_id: str | None = None, live_only: bool = False) -> list:
        q, args = "SELECT c.*, r.state AS run_state FROM cells c JOIN runs r USING (run_id)", []
        where = []
        if run_id:
            where.append("c.run_id=?")
            args.append(run_id)
        if live_only:
            where.append(f"c.state NOT IN ({','.join('?' * len(TERMINAL_CELL))})")
            args.extend(TERMINAL_CELL)
        if where:
            q += " WHERE " + " AND ".join(where)
        return self.db.execute(q + " ORDER BY c.created_at", args).fetchall()

    def events(self, run_id: str, cell_id: str) -> list:
        return self.db.execute("SELECT * FROM events WHERE run_id=? AND cell_id=? ORDER BY id",
                               (run_id, cell_id)).fetchall()

    def connections(self, run_id: str, cell_id: str) -> list[dict]:
        return [dict(r) for r in self.db.execute("SELECT * FROM connections WHERE run_id=? AND cell_id=? ORDER BY seq",
                                                 (run_id, cell_id))]

    def receipts(self, kind: str | None = None, run_id: str | None = None, cell_id: str | None = None) -> list[dict]:
        q, args, where = "SELECT data FROM receipts", [], []
        for col, val in (("kind", kind), ("run_id", run_id), ("cell_id", cell_id)):
            if val:
                where.append(f"{col}=?")
                args.append(val)
        if where:
            q += " WHERE " + " AND ".join(where)
        return [json.loads(r[0]) for r in self.db.execute(q + " ORDER BY id", args)]


def _latest() -> int:
    """The newest migration number, from the file names alone (cheap: every start asks)."""
    from . import migrations
    d = list(migrations.__path__)[0]
    try:
        names = os.listdir(d)
    except OSError:
        return max(n for n, _ in _migrations())
    return max(int(n[:4]) for n in names if n.endswith(".sql") and n[:4].isdigit())


def open_journal(state_root: str) -> Journal:
    return Journal(os.path.join(state_root, "journal.db"))
