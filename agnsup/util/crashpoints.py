"""Test-only crash points: the controller SIGKILLs itself at a named step.

Inert unless the environment variable AGNSUP_TEST_CRASH_AT names a point
(the crash-recovery tests set it; nothing else should). SIGKILL, not an
exception: no finally block, atexit hook or signal handler may run, exactly
as when an operator or the OOM killer ends the controller.

Points (../shared/spec/authority-blackout.md, "Crash points"):
  after_intent, after_cgroup, child_setup, after_exec,
  journal_tx (inside the transaction that records the leader's identity),
  cancel_grace, cancel_frozen, cleanup_before_rmdir, cleanup_tmp_half,
  janitor_after_kill,
  changes_mid_commit (changes.py: a commit or undo after its first step),
  changes_before_record (every step done, record.json not yet written),
  chain.head (journal.py: a transaction committed, its chain head not yet written),
  after_result (supervisor.py: a Supervisor cell's result handed over, what may follow it not yet done)
"""
import os
import signal

_AT = os.environ.get("AGNSUP_TEST_CRASH_AT")


def hit(name: str, pid: int | None = None) -> None:
    if _AT == name:
        os.kill(pid or os.getpid(), signal.SIGKILL)


def enabled(name: str) -> bool:
    return _AT == name
