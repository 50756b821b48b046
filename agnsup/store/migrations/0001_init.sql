-- agnsup journal, schema 1. The only memory that survives a crash.
-- Applied in one transaction; PRAGMA user_version records the last migration.

CREATE TABLE controllers (
    id          TEXT PRIMARY KEY,          -- controller instance id
    kind        TEXT NOT NULL,             -- run | serve | janitor | cancel
    pid         INTEGER NOT NULL,
    pidfd_ino   INTEGER,                   -- NULL where the kernel has no pidfs
    starttime   INTEGER NOT NULL,          -- /proc/PID/stat field 22
    boot_id     TEXT NOT NULL,
    lock_path   TEXT NOT NULL,             -- flock held for the instance's whole life
    started_at  REAL NOT NULL,
    ended_at    REAL
);

CREATE TABLE runs (
    run_id        TEXT PRIMARY KEY,
    state         TEXT NOT NULL,           -- active | cancelled | finished | recovered
    created_at    REAL NOT NULL,
    ended_at      REAL,
    cancel_reason TEXT
);

CREATE TABLE cells (
    run_id        TEXT NOT NULL,
    cell_id       TEXT NOT NULL,
    agent_id      TEXT NOT NULL,
    role          TEXT NOT NULL,
    state         TEXT NOT NULL,           -- starting | running | exited | failed | timeout | cancelled | killed | recovered
    token         TEXT NOT NULL,           -- ownership token (never printed)
    controller_id TEXT NOT NULL REFERENCES controllers(id),
    boot_id       TEXT NOT NULL,
    cgroup        TEXT,                    -- JSON {hierarchy: path}
    cgroup_ino    INTEGER,                 -- inode of the primary cgroup directory
    tmpdir        TEXT,
    worktree      TEXT,
    lock_path     TEXT,
    pid           INTEGER,
    pidfd_ino     INTEGER,
    starttime     INTEGER,
    pgid          INTEGER,
    argv          TEXT NOT NULL,           -- JSON list
    exe           TEXT,
    created_at    REAL NOT NULL,
    started_at    REAL,
    ended_at      REAL,
    exit_code     INTEGER,
    signal        INTEGER,
    reason        TEXT,
    cancel_reason TEXT,
    receipt_path  TEXT,
    PRIMARY KEY (run_id, cell_id)
);
CREATE INDEX cells_by_state ON cells(state);
CREATE INDEX cells_by_controller ON cells(controller_id);

CREATE TABLE events (
    id       INTEGER PRIMARY KEY,
    t        REAL NOT NULL,
    run_id   TEXT,
    cell_id  TEXT,
    kind     TEXT NOT NULL,               -- stage.<name> | state.<state> | cancel | recovery ...
    data     TEXT                          -- JSON
);
CREATE INDEX events_by_cell ON events(run_id, cell_id);

CREATE TABLE receipts (
    id       INTEGER PRIMARY KEY,
    kind     TEXT NOT NULL,               -- cell | recovery
    run_id   TEXT,
    cell_id  TEXT,
    t        REAL NOT NULL,
    data     TEXT NOT NULL                 -- the receipt JSON
);
CREATE INDEX receipts_by_cell ON receipts(run_id, cell_id);
