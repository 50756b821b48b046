-- agnsup journal, schema 6: retention. `agnsup journal prune` (and the default
-- bound the janitor applies) removes ended cells' rows, events and receipts from
-- the journal; what stays is one row per pruned cell, so its id is never reused
-- and `agnsup journal check` still knows the cell directory on disk (its
-- receipt.json is kept there: receipts on disk are never removed by pruning).

CREATE TABLE pruned (
    run_id       TEXT NOT NULL,
    cell_id      TEXT NOT NULL,
    ended_at     REAL,
    receipt_path TEXT,
    pruned_at    REAL NOT NULL,
    PRIMARY KEY (run_id, cell_id)
)
