-- agnsup journal, schema 8: receipts nobody can rewrite (issue 32). Every row of
-- `events` and `receipts` gets one `chain` row in the transaction that inserts it:
-- hash = sha256(prev || canonical JSON of the row), prev = the hash of the record
-- before (64 zeros for the first). `anchor`: the head seq (journal.head) the writer
-- had seen, hashed too: a head file older than an anchor was rolled back.
-- The migration's first writer chains the rows already there (journal.py, _migrate).

CREATE TABLE chain (
    seq     INTEGER PRIMARY KEY,
    tbl     TEXT NOT NULL,                -- events | receipts
    row     INTEGER NOT NULL,             -- the row's id in that table
    prev    TEXT NOT NULL,
    hash    TEXT NOT NULL,
    anchor  INTEGER NOT NULL DEFAULT 0
)
