-- agnsup journal, schema 5: what a cell does when its controller dies
-- (process.on_controller_death: kill | keep) and how `kill` was in force
-- (namespace: the PID namespace's init has PR_SET_PDEATHSIG, so the whole tree dies
-- with the controller; leader: only the leader has it; empty: keep). The janitor
-- names a cell whose tree died with its controller `controller_died`.

ALTER TABLE cells ADD COLUMN on_controller_death TEXT;
ALTER TABLE cells ADD COLUMN dies_with_controller TEXT
