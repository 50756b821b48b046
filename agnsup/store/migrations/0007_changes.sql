-- agnsup journal, schema 7: reversible cells (issue 26). One row per change record:
-- a cell's (kind 'cell', record_id = the cell id) or an undo's (kind 'undo', record_id
-- undo-<12hex>, in the run of the record it undoes). The truth is on disk
-- (<state>/changes/<run>/<record>/record.json); this table indexes it.

CREATE TABLE changes (
    seq          INTEGER PRIMARY KEY,      -- insertion order (ties of created_at)
    run_id       TEXT NOT NULL,
    record_id    TEXT NOT NULL,
    agent_id     TEXT,
    cell_id      TEXT,                     -- NULL for an undo record
    kind         TEXT NOT NULL,            -- cell | undo
    undoes       TEXT,                     -- the record (same run) an undo record undoes
    undone_by    TEXT,                     -- the undo record that undid this one
    worktree     TEXT,
    state        TEXT NOT NULL,            -- committed | undone | dropped
    created_at   REAL NOT NULL,
    files        INTEGER NOT NULL DEFAULT 0,
    bytes_saved  INTEGER NOT NULL DEFAULT 0,
    paths        TEXT,                     -- JSON list, the first 50
    UNIQUE (run_id, record_id)
);
CREATE INDEX changes_by_worktree ON changes(worktree, created_at);
CREATE INDEX changes_by_agent ON changes(agent_id, created_at)
