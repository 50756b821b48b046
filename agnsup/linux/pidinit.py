"""PID 1 of a cell's PID namespace: forwards signals, reaps, passes the status on.

The controller (or its fork server) forks the init (journaled as the cell's
leader). The init confines itself exactly as the command is confined (the
same steps, in the same order: process/steps.py), the barrier passed, starts
the command with posix_spawn (vfork and execve: nothing of the init's
interpreter is copied; process/ does both: only it creates processes) and
then runs `supervise`. So the init holds no capability, uid or file access
the command lacks; it is non-dumpable (its uid is the command's: only that
keeps the command from its /proc/1 links and memory, and from ptrace). The
init:

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

Its own name (`take_own_name`, issue 25): as a fork of the controller, the
init's /proc/1/cmdline would be the controller's argv (host paths, the state
root) and its /proc/1/environ the controller's environment. Both files read
the process's own memory between the addresses /proc/PID/stat gives
(arg_start..arg_end, env_start..env_end; proc(5)), so the init overwrites
that memory in place, as setproctitle(3) does: no privilege (PR_SET_MM needs
CAP_SYS_RESOURCE), no mount, no file. Python keeps its own copies of argv and
the environment; the command gets its environment from execve.
"""
from __future__ import annotations

import ctypes
import functools
import os
import signal
from contextlib import suppress

import _signal

from . import proc

INIT_NAME = b"agnsup-init"
_PR_SET_NAME = 15

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
             signal.SIGWINCH, signal.SIGCONT, signal.SIGALRM)
WAITED = (*FORWARDED, signal.SIGCHLD)


def block_signals() -> None:
    """Before forking the command: nothing is lost between the fork and sigwaitinfo. (The C module's
    pthread_sigmask: the signal module's wraps its answer in enum members, Python a cell's init runs cold.)"""
    _signal.pthread_sigmask(_signal.SIG_BLOCK, WAITED)


@functools.lru_cache(maxsize=1)
def own_name_plan() -> tuple:
    """In the controller, once per process: where its argv and environment strings lie
    (arg_start, arg_end, env_start, env_end: proc(5) fields 48-51), and the comm buffer. The init is a
    fork of the controller, so the addresses hold there too; the child only writes memory."""
    return (*proc.arg_env_bounds(), ctypes.create_string_buffer(INIT_NAME))


def take_own_name(plan: tuple, prctl, comm_only: bool = False) -> None:
    """Make /proc/1/cmdline read "agnsup-init" (NULs after it), /proc/1/environ nothing, and the comm
    "agnsup-init", in the init before it starts the command. `plan`: own_name_plan() from the
    controller; `prctl`: linux.sys.prctl (the child imports nothing). `comm_only`: the comm again (Landlock's
    restrict_self named the process after its domain's log tag for the domain's record)."""
    arg_start, arg_end, env_start, env_end, comm = plan
    if comm_only:
        prctl(_PR_SET_NAME, ctypes.addressof(comm))
        return
    if arg_end > arg_start:
        ctypes.memset(arg_start, 0, arg_end - arg_start)
        name = INIT_NAME[:arg_end - arg_start - 1]  # the last byte stays NUL: the kernel reads the range as is
        ctypes.memmove(arg_start, name, len(name))
    if env_end > env_start:
        ctypes.memset(env_start, 0, env_end - env_start)
    prctl(_PR_SET_NAME, ctypes.addressof(comm))


def supervise(command_pid: int, status_fd: int) -> int:
    """Run as PID 1 until the command ends; returns the init's own exit code."""
    while True:
        info = signal.sigwaitinfo(WAITED)
        if info.si_signo != signal.SIGCHLD:
            with suppress(ProcessLookupError):
                os.kill(command_pid, info.si_signo)
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
                with suppress(OSError):
                    os.write(status_fd, report.encode())
                return code


def command_status(fd: int) -> tuple[int | None, int | None] | None:
    """In the controller, once the init has ended (or written its report): the command's (status, signal) as the
    init reported it; None when it wrote nothing (it was killed). Closes `fd`."""
    try:
        data = os.read(fd, 64).decode(errors="replace").split()
    except OSError:
        data = []
    finally:
        os.close(fd)
    if len(data) == 2 and data[1].isdigit():
        return (int(data[1]), None) if data[0] == "exit" else (None, int(data[1]))
    return None
