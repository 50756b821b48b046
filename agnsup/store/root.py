"""Where the state root is by default: kept apart from state.py so the console script's hand-off
(doors/handoff.py) finds serve's socket without importing the store."""
from __future__ import annotations

import os


def default_root() -> str:
    env = os.environ.get("AGNSUP_STATE_DIR")
    if env:
        return env
    if os.geteuid() == 0:
        return "/var/lib/agnsup"
    xdg = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(xdg, "agnsup")
