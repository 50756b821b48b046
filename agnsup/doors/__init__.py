"""The front doors: the command line, its fast entry, serve, mcp, sandboxd, doctor.

Each turns its callers' words into cell requests for the Supervisor; nothing below imports a door."""
