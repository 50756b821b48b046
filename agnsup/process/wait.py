"""The wait loop of a running cell (Waiter) and how it ended (Outcome)."""
from __future__ import annotations

import os
import select
import signal
import time

from ..util import crashpoints
from ..linux import proc
from ..errors import CancelledBeforeStart, exit_code
from ..util.record import Record

OOM_SETTLE = 1.0  # seconds the v1 OOM killer gets to take its victim before we take the cell


class Outcome(Record):
    exit_code: int          # what the controller exits with (128+N for signal N)
    status: int | None      # the command's own exit status, if it exited
    signal: int | None      # the signal that killed the leader, if any
    reason: str             # exited | killed | timeout | cancelled | output_limit | oom | <error class>
    state: str              # the cell's terminal state
    cancel_reason: str | None = None
    kill_method: str | None = None
    leftover: list | None = None  # pids still in the cell after the leader ended

    @classmethod
    def of(cls, reason: str, status: int | None, sig: int | None, stop_signal: int = signal.SIGTERM,
           **more) -> "Outcome":
        """The one place a cell's exit status and terminal state are decided (cli.md):
        the command's own status; 128+N when signal N ended it; 124 for a timeout; a
        cancelled cell that exited by itself after the stop signal (SIGTERM; SIGINT
        for a Ctrl-C to `agnsup run`) still ends 128+that signal."""
        if reason == "timeout":
            code, state = 124, "timeout"
        elif reason == "cancelled":
            code, state = 128 + (sig if sig is not None else stop_signal), "cancelled"
        else:
            code = status if status is not None else 128 + sig
            # a broken limit (output_limit, oom) is a kill by the supervisor
            state = "killed" if reason in ("output_limit", "oom") or status is None else "exited"
        return cls(exit_code=code, status=status, signal=sig, reason=reason, state=state, **more)

    @classmethod
    def failed(cls, error: Exception, cancel_reason: str | None = None) -> "Outcome":
        """A cell that never ran its command."""
        if isinstance(error, CancelledBeforeStart):
            return cls(exit_code=exit_code(error), status=None, signal=None, reason="cancelled", state="cancelled",
                       cancel_reason=cancel_reason)
        return cls(exit_code=exit_code(error), status=None, signal=None, reason=type(error).__name__, state="failed")


class Waiter:
    """Waits for the leader; honours a timeout, stop requests and broken limits
    by stopping the tree (reaper.Tree: SIGTERM, then the kill when the grace
    period ends). Returns once the leader has exited, unreaped: its pid, the
    cell's session id, stays ours until `collect`, after the rest is reaped.
    `leader_fd`: readable once the leader has exited (its pidfd; a pipe in tests/unit/test_waiter.py)."""

    def __init__(self, leader_fd: int, tree, grace: float, timeout: float | None, wake_fd: int | None = None,
                 pump=None, oom_fd: int | None = None):
        self.leader_fd, self.tree, self.grace, self.timeout = leader_fd, tree, grace, timeout
        self.wake_fd = wake_fd
        self.pump = pump        # io.pump.Pump: the cell's stdout/stderr, counted against the cap
        self.oom_fd = oom_fd    # eventfd the v1 OOM killer signals (CgroupBackend.create)
        self._oom_at: float | None = None
        self.reason: str | None = None      # why we stopped it (first reason wins), None: it ended by itself
        self.cancel_reason: str | None = None
        self.term_sent_at: float | None = None
        self.stop_signal: int = signal.SIGTERM  # what the tree got first
        self.kill_method: str | None = None
        self.mounts: int | None = None  # the cell's mount namespace, while held (hold_mounts)
        self.began: float | None = None  # the first wait's start (monotonic): the timeout counts from it

    def hold_mounts(self, pid: int) -> None:
        """Hold the mount namespace of the leader `pid` (unreaped: the number is still ours) until `let_go`.

        The last process of a mount namespace tears it down in its exit: every mount of the cell (~40: its
        overlay, tmpfs, binds) unmounted and an expedited RCU grace period waited for (namespace_unlock), ~1 ms
        here, before its pidfd says it exited. Held here, the leader's exit ends the tree without that wait: the
        tree is dead as soon (zap_pid_ns_processes; the mounts hold no process), and the teardown runs at
        `let_go`, after the cell's result (Supervisor._supervise). Best effort: a leader already gone (a command
        that ended within the spawn), or a /proc we may not read (the init is not dumpable: root only), holds
        nothing and costs the wait as before. A controller killed meanwhile lets go with its descriptors."""
        try:
            self.mounts = proc.ns("mnt", pid)
        except OSError:
            self.mounts = None

    def let_go(self) -> None:
        """The held mount namespace (hold_mounts) let go: its teardown runs here when ours was the last reference."""
        fd, self.mounts = self.mounts, None
        if fd is not None:
            os.close(fd)

    def request_stop(self, reason: str, cancel_reason: str | None = None, sig: int = signal.SIGTERM) -> None:
        """Send `sig` (SIGTERM) to the whole tree now; SIGKILL it when the grace period
        ends. First reason wins."""
        if self.reason is None:
            self.reason = reason
            self.cancel_reason = cancel_reason
        if self.term_sent_at is None:
            self.term_sent_at = time.monotonic()
            self.stop_signal = sig
            self.tree.term(sig)
            crashpoints.hit("cancel_grace")

    def stop_now(self, reason: str, why: str | None = None) -> None:
        """Kill the whole tree at once, no grace: the cell broke a limit (or its caller died: `why`, the
        receipt's cancel_reason). First reason wins."""
        if self.reason is None:
            self.reason = reason
            self.cancel_reason = why
        self._kill_tree()

    def grace_until(self) -> float | None:
        """When a stop in progress must have killed the rest (monotonic), else None."""
        return self.term_sent_at + self.grace if self.term_sent_at is not None else None

    def _on_oom(self) -> None:
        try:
            os.read(self.oom_fd, 8)
        except BlockingIOError:
            return
        # v1 has no memory.oom.group: the OOM killer takes one process, we take the rest.
        # The kernel notifies before it picks its victim (mem_cgroup_oom_notify precedes
        # out_of_memory), so we let it act first (the receipt then shows its kill in
        # oom_kills) and kill the rest once the counter moves, or OOM_SETTLE later.
        if self._oom_at is None:
            self._oom_at = time.monotonic()

    def _oom_due(self, now: float) -> bool:
        if self._oom_at is None or self.reason is not None:
            return False
        return now >= self._oom_at + OOM_SETTLE or (self.tree.oom_kills() or 0) > 0

    def wait(self, poll_wake=None) -> "Waiter":
        """Block until the leader exits; `poll_wake()` is called when wake_fd is readable (and returns False
        when wake_fd is to be watched no more: a closed connection stays readable).

        The same loop pumps the cell's output (if the role caps it) and watches
        the v1 OOM eventfd."""
        if self.began is None:  # waited for again (a caller interrupted, the cell's thread took over): same timeout
            self.began = time.monotonic()
        start = self.began
        p = select.poll()
        p.register(self.leader_fd, select.POLLIN)
        if self.wake_fd is not None:
            p.register(self.wake_fd, select.POLLIN)
        if self.oom_fd is not None:
            p.register(self.oom_fd, select.POLLIN)
        pumped: dict[int, int] = {}
        while True:
            if self.pump is not None:
                pumped = _sync_poll(p, pumped, self.pump.interest())
            now = time.monotonic()
            deadlines = []
            if self.timeout and self.term_sent_at is None:
                deadlines.append(start + self.timeout)
            if self.term_sent_at is not None:
                deadlines.append(self.term_sent_at + self.grace)
            if self._oom_at is not None and self.reason is None:
                deadlines.append(now + 0.02)  # look at the OOM counter again shortly
            wait_ms = None if not deadlines else max(0, int((min(deadlines) - now) * 1000) + 1)
            events = p.poll(wait_ms)
            for fd, mask in events:
                if fd == self.wake_fd and poll_wake:
                    if poll_wake() is False:
                        p.unregister(fd)
                        self.wake_fd = None
                elif fd == self.oom_fd:
                    self._on_oom()
                elif fd in pumped:
                    self.pump.handle(fd, mask)
            if self.pump is not None and self.pump.overflowed:
                self.stop_now("output_limit")
            if self._oom_due(time.monotonic()):
                self.stop_now("oom")
            if any(fd == self.leader_fd for fd, _ in events):
                return self
            now = time.monotonic()
            if self.timeout and self.term_sent_at is None and now >= start + self.timeout:
                self.request_stop("timeout")
            elif self.term_sent_at is not None and now >= self.term_sent_at + self.grace:
                self._kill_tree()

    def _kill_tree(self) -> None:
        if self.kill_method is None:
            crashpoints.hit("cancel_frozen")
            self.kill_method = self.tree.kill()


def _sync_poll(p, current: dict[int, int], want: dict[int, int]) -> dict[int, int]:
    """Make the poll object's registrations for the pump equal `want`."""
    for fd in current.keys() - want.keys():
        p.unregister(fd)
    for fd, mask in want.items():
        if current.get(fd) != mask:
            p.register(fd, mask)
    return want
