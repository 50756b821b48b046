"""PID 1 of a cell's PID namespace: forwards signals, reaps, passes the status on.

The controller forks the init (journaled as the cell's leader); the init
forks the command (supervisor.py does both forks: only it creates
processes) and then runs `supervise`. The init:

- forwards SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2, SIGWINCH,
  SIGCONT and SIGALRM to the command (tini's default: to the command, not its
  group; a cancel signals the whole cgroup anyway);
- reaps every orphan re-parented to it;
- ends as soon as the command ends. The kernel then SIGKILLs whatever else
  is left in the namespace, so "left after leader" is always empty here.

Exit status: a PID-namespace init cannot die of a signal it raises itself
(the kernel ignores SIG_DFL signals to an init from inside its namespace,
pid_namespaces(7)), so it exits 128+N when the command died of signal N and
writes the exact result ("exit 3" / "signal 15") to a status pipe the
controller reads (`command_status`); the receipt carries the command's own
status and signal, never the init's.

The init does not carry the cell token in its environment (it is a fork of
the controller, its /proc/PID/environ is the controller's): the janitor finds
it by the journaled leader identity (pidfd inode, start time) and by cgroup
membership; the command and its descendants carry the token as usual.
"""
from __future__ import annotations

import os
import signal

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
             signal.SIGWINCH, signal.SIGCONT, signal.SIGALRM)
WAITED = (*FORWARDED, signal.SIGCHLD)


def block_signals() -> None:
    """Before forking the command: nothing is lost between the fork and sigwaitinfo."""
    signal.pthread_sigmask(signal.SIG_BLOCK, WAITED)


def supervise(command_pid: int, status_fd: int) -> int:
    """Run as PID 1 until the command ends; returns the init's own exit code."""
    while True:
        info = signal.sigwaitinfo(WAITED)
        if info.si_signo != signal.SIGCHLD:
            try:
                os.kill(command_pid, info.si_signo)
            except ProcessLookupError:
                pass
            continue
        while True:
            try:
                pid, st = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            if pid == command_pid:
                if os.WIFSIGNALED(st):
                    report, code = f"signal {os.WTERMSIG(st)}", 128 + os.WTERMSIG(st)
                else:
                    report, code = f"exit {os.WEXITSTATUS(st)}", os.WEXITSTATUS(st)
                try:
                    os.write(status_fd, report.encode())
                except OSError:
                    pass
                return code


def command_status(fd: int, status: int | None, sig: int | None) -> tuple[int | None, int | None]:
    """In the controller, after the init ended: the command's (status, signal).

    Falls back to the init's own when it wrote nothing (it was killed)."""
    try:
        data = os.read(fd, 64).decode(errors="replace").split()
    except OSError:
        data = []
    finally:
        os.close(fd)
    if len(data) == 2 and data[1].isdigit():
        return (int(data[1]), None) if data[0] == "exit" else (None, int(data[1]))
    return status, sig
