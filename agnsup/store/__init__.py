"""The store: the journal (the only module that speaks SQL) and its migrations, the state root,
the cells listing, repair after a crash."""
