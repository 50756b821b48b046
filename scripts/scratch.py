"""What bench_cells.py, bench_mcp.py and bench_sandboxd.py share: a private state root and worktree."""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile


@contextlib.contextmanager
def scratch(agnsup: str, name: str):
    """(env naming a new state root, a new worktree), both under /var/tmp; afterwards every
    cell still running there is cancelled and both are removed."""
    state = tempfile.mkdtemp(prefix=f"agnsup-bench-{name}.", dir="/var/tmp")
    wt = tempfile.mkdtemp(prefix=f"agnsup-bench-{name}-wt.", dir="/var/tmp")
    env = {**os.environ, "AGNSUP_STATE_DIR": state}
    try:
        yield env, wt
    finally:
        subprocess.run([agnsup, "cancel", "--all", "--grace", "0"], env=env, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        shutil.rmtree(state, ignore_errors=True)
        shutil.rmtree(wt, ignore_errors=True)
