-- agnsup journal, schema 3: the grace period a cell's role gives it (limits.grace),
-- recorded at intent so that `agnsup cancel` from any process uses it without
-- reading the role policy again (which may have changed since).

ALTER TABLE cells ADD COLUMN grace REAL;
