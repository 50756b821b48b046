"""Connection records into the journal, off the proxy's threads.

The proxy's records reach the journal through one writer thread with a
journal connection of its own (SQLite connections are not shared between
threads mid-transaction; the cell's controller keeps using its own). It
commits what arrived every FLUSH_EVERY seconds, in one transaction: a cell
that opens thousands of connections costs a few commits a second, and a
controller that dies loses at most the last fraction of a second of records
(the cell loses its network with it: handoff.py).
"""
from __future__ import annotations

import queue
import threading
import time
from contextlib import suppress

FLUSH_EVERY = 0.2
_STOP = object()


class JournalSink:
    def __init__(self, journal_path: str, run_id: str, cell_id: str):
        self.path, self.run_id, self.cell_id = journal_path, run_id, cell_id
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self.error: str | None = None
        self._t = threading.Thread(target=self._loop, name="egress-journal", daemon=True)
        self._t.start()

    def put(self, rec: dict) -> None:
        self.q.put(rec)

    def event(self, kind: str, **data) -> None:
        """A journal event of this cell (secret.exfiltration), committed with the next records."""
        self.q.put((kind, data))

    def close(self, timeout: float = 10.0) -> None:
        self.q.put(_STOP)
        self._t.join(timeout)

    def _loop(self) -> None:
        from ..store.journal import Journal
        try:
            j = Journal(self.path)
        except Exception as e:  # noqa: BLE001 - the receipt still carries every record
            self.error = str(e)
            j = None
        try:
            stop, last = False, 0.0
            while not stop:
                rows = [self.q.get()]
                # The first record after a quiet spell is committed at once; under load,
                # one commit per FLUSH_EVERY carries everything that arrived meanwhile.
                deadline = last + FLUSH_EVERY
                with suppress(queue.Empty):
                    while len(rows) < 500 and rows[-1] is not _STOP:
                        left = deadline - time.monotonic()
                        rows.append(self.q.get(timeout=left) if left > 0 else self.q.get_nowait())
                if _STOP in rows:
                    stop = True
                    rows = [r for r in rows if r is not _STOP]
                if rows and j is not None:
                    events = [r for r in rows if isinstance(r, tuple)]
                    rows = [r for r in rows if not isinstance(r, tuple)]
                    try:
                        with j.tx() as db:
                            if rows:
                                j.add_connections(db, self.run_id, self.cell_id, rows)
                            for kind, data in events:
                                j.event(db, kind, self.run_id, self.cell_id, **data)
                    except Exception as e:  # noqa: BLE001
                        self.error = str(e)
                last = time.monotonic()
        finally:
            if j is not None:
                j.close()
