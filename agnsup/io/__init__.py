"""A cell's live I/O: its stdio wiring (wiring.py) and the pump that drains it (pump.py)."""
