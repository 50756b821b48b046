-- agnsup journal, schema 2: what the startup janitor asks at every controller start,
-- answered from two small partial indexes instead of scans of ever-growing tables.
-- @TERMINAL_CELL@ is journal.TERMINAL_CELL, quoted: the index predicate and the
-- queries it serves (journal.LIVE_CELL) are spelled from that one constant.

CREATE INDEX controllers_open ON controllers(id) WHERE ended_at IS NULL;
CREATE INDEX cells_live ON cells(controller_id) WHERE state NOT IN (@TERMINAL_CELL@);
