"""agnsup's errors. The CLI is the only place that turns them into exit codes.

    AgnsupError                 exit 125: agnsup itself could not do its job
    ├── UsageError              a bad option or id
    ├── PolicyError             a malformed policy file or an unknown role
    ├── StateError              the state root or journal is unusable
    ├── SetupError              a cell could not be built (names the failed step)
    ├── LockTimeout             exit 75: the worktree lock was not free in time
    ├── UnknownId               exit 1: an id the journal never saw
    ├── RunNotActive            exit 1: the run was cancelled or recovered
    ├── AmbiguousId             exit 1: a cell id that names cells in several runs
    ├── CellsStillRunning       exit 1: cleanup of a run whose cells still run
    ├── NoServer                exit 125: no serve controller listens on the socket
    ├── CancelledBeforeStart    exit 143: cancelled between intent and exec
    ├── Denied                  exit 126: governance refused the command
    ├── NotExecutable           exit 126: found but cannot be executed
    └── NotFound                exit 127: not found on the cell's PATH
"""
from __future__ import annotations


class AgnsupError(Exception):
    exit_code = 125

    def __init__(self, message: str, **details):
        super().__init__(message)
        self.message = message
        self.details = details


class UsageError(AgnsupError):
    pass


class PolicyError(AgnsupError):
    pass


class StateError(AgnsupError):
    pass


class SetupError(AgnsupError):
    pass


class LockTimeout(AgnsupError):
    exit_code = 75  # EX_TEMPFAIL, sysexits(3): try again later


class UnknownId(AgnsupError):
    exit_code = 1


class RunNotActive(AgnsupError):
    exit_code = 1


class AmbiguousId(AgnsupError):
    exit_code = 1


class CellsStillRunning(AgnsupError):
    exit_code = 1


class NoServer(AgnsupError):
    pass


class CancelledBeforeStart(AgnsupError):
    exit_code = 128 + 15  # what a cell cancelled a moment later would have ended with


class Denied(AgnsupError):
    exit_code = 126


class NotExecutable(AgnsupError):
    exit_code = 126


class NotFound(AgnsupError):
    exit_code = 127
