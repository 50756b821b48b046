"""`python -m agnsup`: the console script's entry point (doors/entry.py, its fast path for `run` included), for
an agnsup reached by its interpreter rather than by PATH (an MCP client's config: `/venv/bin/python -m agnsup`)."""
from .doors.entry import main

if __name__ == "__main__":
    main()
