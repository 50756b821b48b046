"""Reading `/proc`: the one place that parses it.

Like psutil, `/proc/PID/stat` is split at the *last* `)` because a process
name may hold spaces and parentheses; and a vanished process is not an error
but an answer (`None`), since any process can exit between two reads.
"""
from __future__ import annotations

import os
import time

from ..record import Record

_boot_id: str | None = None


def boot_id() -> str:
    global _boot_id
    if _boot_id is None:
        try:
            with open("/proc/sys/kernel/random/boot_id") as f:
                _boot_id = f.read().strip()
        except OSError as e:  # no procfs (a runtime that gives none, a masked /proc): no process can be known
            from ..errors import SetupError
            raise SetupError(f"/proc is not the kernel's procfs here ({e.strerror}: {e.filename}): agnsup knows "
                             "every process through it; mount proc on /proc (docs/hosts.md)", step="proc") from None
    return _boot_id


class Stat(Record, frozen=True):
    pid: int
    comm: str
    state: str
    ppid: int
    pgid: int
    sid: int
    starttime: int  # clock ticks since boot (field 22 of proc(5))


def stat(pid: int | str) -> Stat | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError):
        return None
    lpar, rpar = raw.index("("), raw.rindex(")")
    rest = raw[rpar + 2:].split()
    # rest[0] is field 3 (state); field N is rest[N - 3]
    return Stat(pid=int(raw[:lpar]), comm=raw[lpar + 1:rpar], state=rest[0], ppid=int(rest[1]),
                pgid=int(rest[2]), sid=int(rest[3]), starttime=int(rest[19]))


def is_zombie(pid: int) -> bool:
    s = stat(pid)
    return s is None or s.state in ("Z", "X")


def cgroup_lines(pid: int | str) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            return f.read().splitlines()
    except (FileNotFoundError, ProcessLookupError):
        return None


def environ(pid: int | str) -> dict[str, str] | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    env = {}
    for item in raw.split(b"\0"):
        if b"=" in item:
            k, _, v = item.partition(b"=")
            env[k.decode(errors="replace")] = v.decode(errors="replace")
    return env


def pids() -> list[int]:
    return [int(d) for d in os.listdir("/proc") if d.isdigit()]


def clock_ticks() -> int:
    return os.sysconf("SC_CLK_TCK")


def wall_to_ticks(t: float) -> int:
    """A wall-clock time (time.time()) in the unit of Stat.starttime, on this boot."""
    with open("/proc/uptime") as f:
        up = float(f.read().split()[0])
    return max(0, int((t - (time.time() - up)) * clock_ticks()))
