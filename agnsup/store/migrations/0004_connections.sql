-- agnsup journal, schema 4: every connection a cell's egress proxy was asked for
-- (network.mode allowlist/internal), allowed or refused. One row per attempt,
-- written when it was judged and again when it ended (bytes, duration).
-- A cell keeps at most egress/proxy.py MAX_RECORDED rows; its receipt counts the rest.

CREATE TABLE connections (
    run_id      TEXT NOT NULL,
    cell_id     TEXT NOT NULL,
    seq         INTEGER NOT NULL,          -- per cell, in the order the proxy accepted them
    t           REAL NOT NULL,             -- when the cell connected to the proxy
    protocol    TEXT,                      -- http | http-connect | socks5 | socks4
    requested   TEXT,                      -- the host as the cell wrote it
    name        TEXT,                      -- that host normalised (a name, or an address for an IP literal)
    port        INTEGER,
    address     TEXT,                      -- the resolved address judged (and connected to)
    decision    TEXT NOT NULL,             -- allowed | refused | failed
    rule        TEXT,                      -- allow:<entry> | deny:<entry> | unlisted | address:<class> | ...
    reason      TEXT,
    bytes_up    INTEGER NOT NULL DEFAULT 0,  -- cell -> destination
    bytes_down  INTEGER NOT NULL DEFAULT 0,  -- destination -> cell
    duration    REAL,                      -- NULL while it was open
    error       TEXT,
    PRIMARY KEY (run_id, cell_id, seq)
);
