-- agnsup journal, schema 2: what the startup janitor asks at every controller start,
-- answered from two small partial indexes instead of scans of ever-growing tables.
-- The cells_live predicate must stay textually identical to janitor.LIVE_CELL.

CREATE INDEX controllers_open ON controllers(id) WHERE ended_at IS NULL;
CREATE INDEX cells_live ON cells(controller_id) WHERE state NOT IN ('exited','failed','timeout','cancelled','killed','recovered');
