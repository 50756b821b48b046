"""The process supervisor: the only module that creates processes.

spawn() forks one child and runs the cell recipe in it, in order:

    close every fd but 0-2 and the two pipes
    new session and process group (setsid)
    join the cell's cgroups (every hierarchy)
    default signal dispositions, empty signal mask
    unshare the mount (and, if the role denies network, network) namespace
    build the mount namespace from the plan's operations
    bring loopback up in the new network namespace
    drop capabilities from the bounding set (root cells lose CAP_SYS_ADMIN)
    wait at the barrier until the controller has journaled our identity
    chdir, execve

Any failure before execve is written to a close-on-exec pipe as
"step\\0errno\\0message" and the child exits without running the command: a
half-built cell never runs the payload. EOF on that pipe means execve worked.
If the controller dies while the child waits at the barrier, the child sees
EOF there and exits instead of running unrecorded.
"""
from __future__ import annotations

import errno
import os
import select
import signal
import time
from dataclasses import dataclass

from . import crashpoints
from .errors import NotExecutable, NotFound, SetupError
# Everything the child needs is imported here, before fork: after the mount
# namespace is built the package itself may be hidden (installed under /tmp or
# a masked path), so the child must not import anything.
from .linux import cgroup, mounts, netns, pidfd, proc
from .linux import sys as lsys

_MAXFD = os.sysconf("SC_OPEN_MAX")


@dataclass
class Child:
    pid: int
    pidfd: int
    identity: dict


@dataclass
class Outcome:
    exit_code: int          # what the controller exits with (128+N for signal N)
    status: int | None      # the command's own exit status, if it exited
    signal: int | None      # the signal that killed the leader, if any
    reason: str             # exited | killed | timeout | cancelled
    state: str              # the cell's terminal state
    cancel_reason: str | None = None
    kill_method: str | None = None
    leftover: list | None = None  # pids still in the cell after the leader ended


def _child(plan, node, barrier_r: int, err_w: int, stdio: tuple | None) -> None:
    """Runs in the forked child; never returns."""
    step = "start"
    try:
        if stdio:
            for target, fd in enumerate(stdio):
                if fd is not None and fd != target:
                    os.dup2(fd, target)
        keep = sorted({barrier_r, err_w})
        os.closerange(3, keep[0])
        os.closerange(keep[0] + 1, keep[1])
        os.closerange(keep[1] + 1, _MAXFD)
        step = "setsid"
        os.setsid()
        step = "cgroup"
        if node is not None:
            cgroup.join_self(node)
        step = "signals"
        for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT, signal.SIGTERM, signal.SIGHUP,
                    signal.SIGQUIT, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        step = "unshare"
        lsys.unshare(lsys.CLONE_NEWNS | (lsys.CLONE_NEWNET if plan.new_netns else 0))
        step = "mounts"
        mounts.apply(plan.mount_ops)
        if plan.new_netns:
            step = "loopback"
            netns.loopback_up()
        step = "capabilities"
        lsys.drop_bounding_caps(plan.drop_caps)
        crashpoints.hit("child_setup", os.getppid())
        step = "barrier"
        if os.read(barrier_r, 1) != b"1":
            os._exit(125)  # the controller died before recording us: never run unrecorded
        os.close(barrier_r)
        step = "chdir"
        os.chdir(plan.spec.workdir)
        step = "exec"
        os.execve(plan.spec.exe, plan.spec.argv, plan.spec.env)
    except BaseException as e:  # noqa: BLE001 - anything here must become a report, never a return
        code = getattr(e, "errno", None) or 0
        msg = getattr(e, "strerror", None) or str(e)
        try:
            os.write(err_w, f"{step}\0{code}\0{msg}".encode(errors="replace"))
        finally:
            os._exit(127 if step == "exec" and code == errno.ENOENT else 126 if step == "exec" else 125)


def spawn(plan, node, on_identity, stdio: tuple | None = None) -> Child:
    """Fork the cell leader; journal its identity through `on_identity(identity)`
    before it may exec; return once execve succeeded (or raise)."""
    barrier_r, barrier_w = os.pipe()
    err_r, err_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(barrier_w)
        os.close(err_r)
        _child(plan, node, barrier_r, err_w, stdio)
    os.close(barrier_r)
    os.close(err_w)
    try:
        fd = os.pidfd_open(pid)
        st = proc.stat(pid)
        identity = {"pid": pid, "pidfd_ino": pidfd.inode(fd) if pidfd.has_pidfs() else None,
                    "starttime": st.starttime if st else None, "pgid": pid, "boot_id": proc.boot_id()}
        on_identity(identity)
        os.write(barrier_w, b"1")
    except BaseException:
        # The child sees EOF at the barrier and exits without exec.
        os.close(barrier_w)
        os.close(err_r)
        _reap(pid)
        raise
    os.close(barrier_w)
    report = _read_all(err_r)
    if report:
        os.waitid(os.P_PIDFD, fd, os.WEXITED)
        os.close(fd)
        step, code, msg = (report.decode(errors="replace").split("\0") + ["", ""])[:3]
        code = int(code or 0)
        if step == "exec":
            exe = plan.spec.exe
            if code == errno.ENOENT:
                raise NotFound(f"{plan.spec.argv[0]}: {exe}: {msg}", step=step)
            raise NotExecutable(f"{plan.spec.argv[0]}: {exe}: {msg}", step=step)
        raise SetupError(f"cell setup failed at step {step!r}: {msg}", step=step, errno=code)
    return Child(pid=pid, pidfd=fd, identity=identity)


def _read_all(fd: int) -> bytes:
    chunks = []
    try:
        while True:
            b = os.read(fd, 4096)
            if not b:
                return b"".join(chunks)
            chunks.append(b)
    finally:
        os.close(fd)


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass


class Waiter:
    """Waits for the leader, honours a timeout and cancel requests, kills the tree."""

    def __init__(self, child: Child, node, grace: float, timeout: float | None, wake_fd: int | None = None):
        self.child, self.node, self.grace, self.timeout = child, node, grace, timeout
        self.wake_fd = wake_fd
        self.cancel_reason: str | None = None
        self._term_sent_at: float | None = None
        self._reason: str | None = None
        self.kill_method: str | None = None
        # Set by the broker: True once another process (agnsup cancel) recorded
        # a cancel; that process then owns the grace period and the kill.
        self.cancelled_elsewhere = lambda: False

    def request_stop(self, reason: str, cancel_reason: str | None = None) -> None:
        """SIGTERM the whole tree now; SIGKILL it when the grace period ends. First reason wins."""
        if self._reason is None:
            self._reason = reason
            self.cancel_reason = cancel_reason
        if self._term_sent_at is None:
            self._term_sent_at = time.monotonic()
            if self.node is not None:
                cgroup.signal_all(self.node, signal.SIGTERM)
            else:
                pidfd.send(self.child.pidfd, signal.SIGTERM)
            crashpoints.hit("cancel_grace")

    def wait(self, poll_wake=None) -> Outcome:
        """Block until the leader exits; `poll_wake()` is called when wake_fd is readable."""
        start = time.monotonic()
        p = select.poll()
        p.register(self.child.pidfd, select.POLLIN)
        if self.wake_fd is not None:
            p.register(self.wake_fd, select.POLLIN)
        while True:
            now = time.monotonic()
            deadlines = []
            if self.timeout and self._term_sent_at is None:
                deadlines.append(start + self.timeout)
            if self._term_sent_at is not None:
                deadlines.append(self._term_sent_at + self.grace)
            wait_ms = None if not deadlines else max(0, int((min(deadlines) - now) * 1000) + 1)
            events = p.poll(wait_ms)
            for fd, _ in events:
                if fd == self.wake_fd and poll_wake:
                    poll_wake()
            if any(fd == self.child.pidfd for fd, _ in events):
                break
            now = time.monotonic()
            if self.timeout and self._term_sent_at is None and now >= start + self.timeout:
                self.request_stop("timeout")
            elif self._term_sent_at is not None and now >= self._term_sent_at + self.grace:
                self._kill_tree()
        info = os.waitid(os.P_PIDFD, self.child.pidfd, os.WEXITED)
        status = sig = None
        if info.si_code == os.CLD_EXITED:
            status = info.si_status
        else:
            sig = info.si_status
        return self._finish(status, sig)

    def _kill_tree(self) -> None:
        if self.kill_method is None:
            crashpoints.hit("cancel_frozen")
            self.kill_method = cgroup.kill(self.node) if self.node is not None else "pidfd"
            if self.node is None:
                pidfd.send(self.child.pidfd, signal.SIGKILL)

    def _finish(self, status, sig) -> Outcome:
        leftover = []
        if self.node is not None:
            prim = self.node.primary
            leftover = cgroup.procs(prim[1]) if prim else []
            # A stop in progress gets its grace period for the rest of the tree too.
            if self._term_sent_at is not None and leftover:
                remaining = self._term_sent_at + self.grace - time.monotonic()
                if remaining > 0:
                    cgroup.wait_empty(self.node, remaining)
            elif leftover and self.cancelled_elsewhere():
                # let the canceller's grace period run (a TERM trap may be writing
                # its last words); if it died meanwhile, we kill after this wait
                cgroup.wait_empty(self.node, self.grace + 2.0)
            if cgroup.populated(self.node):
                m = cgroup.kill(self.node)
                self.kill_method = self.kill_method or m
            if not cgroup.wait_empty(self.node, 10.0):
                raise SetupError(f"cell cgroup {prim[1]} is still populated 10 s after the kill")
        os.close(self.child.pidfd)
        reason = self._reason or ("exited" if status is not None else "killed")
        if reason == "timeout":
            code, state = 124, "timeout"
        elif status is not None:
            code = status
            state = "cancelled" if reason == "cancelled" else "exited"
        else:
            code = 128 + sig
            state = "cancelled" if reason == "cancelled" else "killed"
        return Outcome(exit_code=code, status=status, signal=sig, reason=reason, state=state,
                       cancel_reason=self.cancel_reason, kill_method=self.kill_method, leftover=leftover)


def probe(fn) -> tuple[bool, str]:
    """Run `fn()` in a throwaway child (for `doctor`): (succeeded, error text).

    Lives here because only the supervisor creates processes."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            fn()
            os._exit(0)
        except BaseException as e:  # noqa: BLE001
            try:
                os.write(w, str(e).encode(errors="replace")[:500])
            finally:
                os._exit(1)
    os.close(w)
    err = _read_all(r)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0, err.decode(errors="replace")


def host_process(argv: list[str], **popen_kw):
    """A plain host process outside any cell, for the self-test harness only
    (agnsup/selftest/: it plays the user, the sentinel and the innocent
    bystander). Never used on the path of a cell; subprocess is imported here,
    lazily, because only the supervisor creates processes."""
    import subprocess
    return subprocess.Popen(argv, **popen_kw)
