"""The start of a port forwarder (agnsup/ports.py): a detached process, never a cell, that lives in a pod's
place and relays a host loopback port into the pod. Here only because this is the package that may create
processes.

The caller has bound and listens on the host socket already (so a taken port is its error, before anything
starts). A double fork detaches the forwarder (its own session; its parent exits at once, so no controller
ever has to reap it); the caller moves it into the pod's place while it waits on a pipe, then lets it go: it
enters the pod (`enter`: Pod.enter, the pod's user namespace then its network namespace, in a process that
is single-threaded because it was just forked) and execs a fresh interpreter that runs `ports.forward_main`
(the relay, single-threaded, with selectors) with only the listening socket and a status pipe. The status
pipe says "ready" (or why not) before start() returns: a forwarder that could not enter the pod is killed
and nothing is left behind.
"""
from __future__ import annotations

import os
import signal
import sys

from .helpers import read_all

READY = b"ready"
READY_TIMEOUT = 30.0  # s from its release to its word: an interpreter's start, even on a loaded host


def start(listen_fd: int, enter, attach, argv: list[str], log_path: str | None = None,
          keep_fds: tuple[int, ...] = ()) -> tuple[int, int]:
    """(pid, a pidfd of it) once the forwarder said it is ready; OSError (its errno, its words) when it could not start.
    `enter()` runs in the forked child before exec; `attach(pid)` (the caller's: backend.attach into the pod's
    place) runs while the child waits. `argv` is appended to the interpreter's command line; the listening
    socket and the status pipe are given to it as `--listen-fd N --status-fd M`; `keep_fds` are passed too."""
    go_r, go_w = os.pipe2(os.O_CLOEXEC)
    st_r, st_w = os.pipe2(os.O_CLOEXEC)
    pid_r, pid_w = os.pipe2(os.O_CLOEXEC)
    first = os.fork()
    if first == 0:  # the intermediate: a session of its own, one child, and gone
        code = 1
        try:
            # nothing of the caller's but what the forwarder needs: a copy of a controller's liveness lock or
            # of a pod's membership lock held here would hold that lock (flock(2): per open file description)
            _close_all_but((go_r, st_w, pid_w, listen_fd, *keep_fds))
            os.setsid()
            pid = os.fork()
            if pid == 0:
                os.close(pid_w)  # the caller reads the pid until end of file
                _grandchild(go_r, st_w, listen_fd, enter, argv, log_path, keep_fds)  # never returns
            os.write(pid_w, str(pid).encode())
            code = 0
        finally:
            os._exit(code)
    for fd in (go_r, st_w, pid_w):
        os.close(fd)
    pidfd = -1
    try:
        said = read_all(pid_r)
        os.waitpid(first, 0)
        if not said.isdigit():
            raise OSError(0, "the forwarder's intermediate process exited without starting it")
        pid = int(said)
        pidfd = os.pidfd_open(pid)  # it waits on `go`, alive: the fd pins it, whatever happens to the number
        attach(pid)
        os.write(go_w, b"1")
        os.close(go_w)
        go_w = -1
        fd, st_r = st_r, -1
        status = read_all(fd, READY_TIMEOUT)  # closes fd
    except BaseException:
        if go_w >= 0:
            os.close(go_w)  # EOF: a child still waiting exits without doing anything
        if st_r >= 0:
            os.close(st_r)
        if pidfd >= 0:
            kill(pidfd)
            os.close(pidfd)
        raise
    if status == READY:
        return pid, pidfd
    kill(pidfd)
    os.close(pidfd)
    code, _, msg = status.decode(errors="replace").partition("\0")
    raise OSError(int(code) if code.isdigit() else 0, msg or "the forwarder exited before it was ready")


_MAXFD = os.sysconf("SC_OPEN_MAX")


def _close_all_but(keep) -> None:
    """Close every descriptor from 3 up but those in `keep`."""
    low = 3
    for fd in sorted(set(k for k in keep if k >= 3)):
        os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, _MAXFD)


def _grandchild(go_r: int, st_w: int, listen_fd: int, enter, argv, log_path, keep_fds) -> None:
    """In the forwarder before exec: wait to be placed, enter the pod, exec the relay."""
    try:
        if os.read(go_r, 1) != b"1":  # EOF: the caller gave up
            os._exit(0)
        try:
            enter()
            null = os.open(os.devnull, os.O_RDWR)
            err = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600) \
                if log_path else null
            os.dup2(null, 0)
            os.dup2(null, 1)
            os.dup2(err, 2)
            for fd in (listen_fd, st_w, *keep_fds):
                os.set_inheritable(fd, True)
            signal.pthread_sigmask(signal.SIG_SETMASK, [])  # the forking thread's mask is inherited by exec
            signal.signal(signal.SIGTERM, signal.SIG_DFL)   # close's SIGTERM ends it, whatever the caller set
            # a fresh interpreter: nothing of the caller's threads or locks, and the package found where the
            # caller found it (the environment is built from nothing, as a cell's)
            top = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
            os.execve(sys.executable, [sys.executable, "-s", "-c", "from agnsup.ports import forward_main; "
                                       "forward_main()", "--listen-fd", str(listen_fd), "--status-fd", str(st_w),
                                       *argv],
                      {"PYTHONPATH": top, "LC_ALL": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"})
        except OSError as e:
            os.write(st_w, f"{e.errno or 0}\0{e.strerror or e}".encode(errors="replace"))
        except BaseException as e:  # noqa: BLE001 - said to the caller, then gone
            os.write(st_w, f"0\0{type(e).__name__}: {e}".encode(errors="replace"))
    finally:
        os._exit(1)


def kill(pidfd: int, timeout: float = 5.0) -> bool:
    """SIGKILL the forwarder behind `pidfd` (never another process: the fd pins it) and wait until it is gone
    (it is not our child: its pidfd becomes readable when it exits). Whether it is gone."""
    import select
    try:
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    except ProcessLookupError:
        return True
    return bool(select.select([pidfd], [], [], timeout)[0])
