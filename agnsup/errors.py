"""agnsup's errors, and the one table that turns them into exit codes.

    AgnsupError                 125  agnsup itself could not do its job
    ├── UsageError              125  a bad option, id or argument
    ├── PolicyError             125  a malformed policy file or an unknown role
    ├── StateError              125  the state root or journal is unusable
    │   ├── JournalDamaged      125  the journal is corrupt or lost its history: nothing
    │   │                            is written into it (agnsup journal check / repair)
    │   └── NoPermission        125  the state root is another user's (permission denied)
    ├── SetupError              125  a cell could not be built (names the failed step)
    ├── NoServer                125  no serve controller listens on the socket
    ├── LockTimeout              75  the worktree lock was not free in time (EX_TEMPFAIL)
    ├── UnknownId                 1  an id the journal never saw (cancel, cleanup, wait)
    ├── NotReversible             1  diff/undo of a record that cannot be: nothing changed,
    │                                dropped, a live cell, a worktree that moved or is gone
    ├── ChangeConflict           75  undo would overwrite a later change (a later cell's, or
    │                                one made outside agnsup): names it; --force overrides
    ├── RunNotActive            125  a start refused: the run was cancelled, or the cell
    │                                id is taken (125, not 1: `run` must not look like
    │                                a command that exited 1)
    ├── AmbiguousId               1  a cell id that names cells in several runs
    ├── CellsStillRunning         1  cleanup of a run whose cells still run
    ├── CancelledBeforeStart    143  cancelled between intent and exec (what a cell
    │                                cancelled a moment later ends with: 128+SIGTERM)
    ├── Denied                  126  governance refused the command
    ├── NotExecutable           126  found but cannot be executed
    └── NotFound                127  not found on the cell's PATH

Only front doors look at the table: the CLI exits with `exit_code(e)`; the
Python tool API and the serve protocol return `as_value(e)`, and the serve
client turns such a value back into the same error with `from_value`.
A cell's own exit status (the command's, 128+N, 124 for a timeout) is not an
error: `process.wait.Outcome` decides it.
"""
from __future__ import annotations


class AgnsupError(Exception):
    def __init__(self, message: str, **details):
        super().__init__(message)
        self.message = message
        self.details = details

    @property
    def exit_code(self) -> int:
        return exit_code(self)


class UsageError(AgnsupError):
    pass


class PolicyError(AgnsupError):
    pass


class StateError(AgnsupError):
    errno: int | None = None  # ENOSPC or EROFS: a full or read-only state root (journal.Journal._failed)


class JournalDamaged(StateError):
    pass


class NoPermission(StateError):
    pass


class SetupError(AgnsupError):
    pass


class NoServer(AgnsupError):
    pass


class LockTimeout(AgnsupError):
    pass


class UnknownId(AgnsupError):
    pass


class NotReversible(AgnsupError):
    """diff/undo refused: nothing to restore, or no safe way to (the message says which)."""


class ChangeConflict(AgnsupError):
    """undo refused: a later cell, or something outside agnsup, changed the same paths since."""


class RunNotActive(AgnsupError):
    pass


class AmbiguousId(AgnsupError):
    pass


class CellsStillRunning(AgnsupError):
    pass


class WaitTimeout(AgnsupError):
    """`agnsup wait --timeout`: the cell had not ended yet."""


class CancelledBeforeStart(AgnsupError):
    pass


class Denied(AgnsupError):
    pass


class NotExecutable(AgnsupError):
    pass


class NotFound(AgnsupError):
    pass


EXIT_CODES: dict[type, int] = {
    AgnsupError: 125, LockTimeout: 75, WaitTimeout: 75, UnknownId: 1, NotReversible: 1, ChangeConflict: 75,
    RunNotActive: 125, AmbiguousId: 1, CellsStillRunning: 1,
    CancelledBeforeStart: 128 + 15, Denied: 126, NotExecutable: 126, NotFound: 127,
}


def exit_code(e: BaseException) -> int:
    """The CLI's exit status for `e` (its nearest class in EXIT_CODES; 125 for anything else)."""
    for cls in type(e).__mro__:
        if cls in EXIT_CODES:
            return EXIT_CODES[cls]
    return 125


def as_value(e: AgnsupError) -> dict:
    """The error as a front door returns it instead of raising (tool API, serve)."""
    out = {"error": e.message, "error_type": type(e).__name__, "exit_code": exit_code(e)}
    if "decision" in e.details:
        out["decision"] = e.details["decision"]
    return out


def from_value(v: dict) -> AgnsupError:
    """The error an `as_value` dict describes (the serve client raises it)."""
    cls = globals().get(str(v.get("error_type")))
    if not (isinstance(cls, type) and issubclass(cls, AgnsupError)):
        cls = AgnsupError
    return cls(v.get("error") or "request failed", **({"decision": v["decision"]} if "decision" in v else {}))
