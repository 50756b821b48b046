"""The state root: where it is, and its layout.

    <state>/journal.db                  SQLite, WAL
    <state>/controllers/<id>.lock       flock held by a live controller instance
    <state>/cells/<run>/<cell>/         temp dir (tmp/), receipt.json
    <state>/locks/<digest>.lock         worktree isolation locks
    <state>/caches/<scope>/             persistent package caches (filesystem.cache)
    <state>/cache/                      validated policies
    <state>/agnsup.sock                 the serve controller's socket
"""
from __future__ import annotations

import os

from .errors import StateError, UsageError

_ID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


def default_root() -> str:
    env = os.environ.get("AGNSUP_STATE_DIR")
    if env:
        return env
    if os.geteuid() == 0:
        return "/var/lib/agnsup"
    xdg = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(xdg, "agnsup")


def check_id(kind: str, value: str) -> str:
    # ^[A-Za-z0-9][A-Za-z0-9._-]{0,63}\Z without compiling a regex on every start (the
    # regex this replaces ended in `$`, which also let a trailing newline through)
    if not value or len(value) > 64 or value[0] in "._-" or not _ID_CHARS.issuperset(value):
        raise UsageError(f"invalid {kind} id {value!r}: use 1-64 letters, digits, '.', '_' or '-', "
                         "starting with a letter or digit")
    return value


class StateRoot:
    def __init__(self, path: str | None = None):
        self.path = os.path.abspath(path or default_root())

    def ensure(self) -> "StateRoot":
        """Create the layout (mode 0700); a clear StateError if we cannot."""
        try:
            os.makedirs(self.path, mode=0o700, exist_ok=True)
            for sub in ("controllers", "cells", "locks"):
                os.makedirs(os.path.join(self.path, sub), mode=0o700, exist_ok=True)
        except OSError as e:
            raise StateError(f"state root {self.path} is unusable: {e.strerror}") from None
        if not os.access(self.path, os.W_OK):
            raise StateError(f"state root {self.path} is not writable")
        return self

    def exists(self) -> bool:
        return os.path.exists(os.path.join(self.path, "journal.db"))

    def journal(self):
        from .journal import open_journal
        return open_journal(self.path)

    def cell_dir(self, run_id: str, cell_id: str) -> str:
        return os.path.join(self.path, "cells", run_id, cell_id)

    def controller_lock(self, cid: str) -> str:
        return os.path.join(self.path, "controllers", cid + ".lock")

    def worktree_lock(self, digest: str) -> str:
        return os.path.join(self.path, "locks", digest + ".lock")
