"""Reading `/proc`: the one place that parses it.

Like psutil, `/proc/PID/stat` is split at the *last* `)` because a process
name may hold spaces and parentheses; and a vanished process is not an error
but an answer (`None`), since any process can exit between two reads.
"""
from __future__ import annotations

import os
import time
from contextlib import suppress

from ..util.record import Record
from . import fs

_boot_id: str | None = None
READ_SIZE = 65536


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


def read(path: str, one_shot: bool = False) -> bytes | None:
    """A whole /proc file (`path` below /proc), or None when it is gone or not ours to read. `one_shot`:
    a file the kernel hands over whole in one read when it fits (stat, environ); a table (mountinfo,
    net/*: a seq_file) comes about a page per read(2), so it is read to EOF."""
    try:
        fd = os.open("/proc/" + path, os.O_RDONLY | os.O_CLOEXEC)
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    try:
        data = os.read(fd, READ_SIZE)
        if one_shot and len(data) < READ_SIZE:
            return data
        chunks = [data]
        while data:
            data = os.read(fd, READ_SIZE)
            chunks.append(data)
        return b"".join(chunks)
    except OSError:  # ESRCH and friends: the process went away between open and read
        return None
    finally:
        os.close(fd)


def text(path: str) -> str | None:
    raw = read(path)
    return None if raw is None else raw.decode(errors="replace")


def mountinfo() -> str:
    """This process's mount table (proc(5) mountinfo); OSError where /proc is not procfs."""
    with open("/proc/self/mountinfo") as f:
        return f.read()


def parse_status(text: str) -> dict[str, str]:
    """/proc/PID/status text as {key: value} (CapEff, Seccomp, Seccomp_filters, ...)."""
    return {k: v.strip() for k, _, v in (line.partition(":") for line in text.splitlines())}


def status(pid: int | str = "self") -> dict[str, str] | None:
    t = text(f"{pid}/status")
    return None if t is None else parse_status(t)


def sysctl(name: str, root: str = "/proc/sys") -> str | None:
    """A kernel setting ("kernel/cap_last_cap"), stripped; None where this kernel has no such file."""
    try:
        with open(os.path.join(root, name)) as f:
            return f.read().strip()
    except OSError:
        return None


def net(table: str) -> str:
    """A table of this network namespace (net/tcp, net/unix, ...: proc(5)); "" where this kernel has none."""
    return text("net/" + table) or ""


class Stat(Record, frozen=True):
    pid: int
    comm: str
    state: str
    ppid: int
    pgid: int
    sid: int
    starttime: int  # clock ticks since boot (field 22 of proc(5))


def fields(pid: int | str) -> tuple | None:
    """Stat's fields as a tuple (one per process in a janitor's scan: no record built)."""
    raw = read(f"{pid}/stat", True)
    if not raw:
        return None
    lpar, rpar = raw.index(b"("), raw.rindex(b")")
    rest = raw[rpar + 2:].split(None, 20)
    # rest[0] is field 3 (state); field N is rest[N - 3]
    return (int(raw[:lpar]), raw[lpar + 1:rpar].decode(errors="replace"), rest[0].decode(), int(rest[1]),
            int(rest[2]), int(rest[3]), int(rest[19]))


def stat(pid: int | str) -> Stat | None:
    f = fields(pid)
    return Stat(*f) if f else None


def arg_env_bounds(pid: int | str = "self") -> tuple[int, int, int, int]:
    """Where a process's argv and environment strings lie in its memory: arg_start, arg_end, env_start,
    env_end (stat fields 48-51)."""
    rest = (read(f"{pid}/stat", True) or b"").rsplit(b")", 1)[1].split()  # rest[0] is field 3
    return int(rest[45]), int(rest[46]), int(rest[47]), int(rest[48])


def is_zombie(pid: int) -> bool:
    f = fields(pid)
    return f is None or f[2] in ("Z", "X")


def dead(pid: int, start: int) -> bool:
    """Gone, a zombie, or the pid is another process now."""
    f = fields(pid)
    return f is None or f[6] != start or f[2] in ("Z", "X")


def cgroup_lines(pid: int | str) -> list[str] | None:
    t = text(f"{pid}/cgroup")
    return None if t is None else t.splitlines()


def own_cgroup(lines: str | None = None) -> str | None:
    """This process's cgroup2 path ("0::/a/b" -> "/a/b", from `lines` when given), or None on a v1-only host."""
    lines = cgroup_lines("self") if lines is None else lines.splitlines()
    return next((line[3:] for line in lines or () if line.startswith("0::")), None)


def raw_environ(pid: int | str) -> bytes | None:
    return read(f"{pid}/environ", True)


def environ(pid: int | str) -> dict[str, str] | None:
    raw = raw_environ(pid)
    return None if raw is None else {k.decode(errors="replace"): v.decode(errors="replace")
                                     for k, eq, v in (item.partition(b"=") for item in raw.split(b"\0")) if eq}


def holders(link: str, uid: int) -> list[int]:
    """The pids of the processes of `uid` (their /proc/PID's owner) with a descriptor that reads `link`
    ("socket:[INODE]"): a scan of every such process's fds."""
    out = []
    with os.scandir("/proc") as it:
        for e in it:
            if not e.name.isdigit():
                continue
            with suppress(OSError):  # gone, or not ours to look at (a non-dumpable process)
                if e.stat(follow_symlinks=False).st_uid != uid:
                    continue
                fds = f"/proc/{e.name}/fd"
                for fd in os.listdir(fds):
                    if os.readlink(f"{fds}/{fd}") == link:
                        out.append(int(e.name))
                        break
    return out


def ns(kind: str, pid: int | str = "self") -> int:
    """A descriptor of a namespace of a process ("net", "user", "pid": for setns(2) or SCM_RIGHTS)."""
    return os.open(f"/proc/{pid}/ns/{kind}", os.O_RDONLY | os.O_CLOEXEC)


def net_text(name: str) -> str:
    """A file of the calling thread's network namespace's /proc/net ("snmp", "snmp6": its counters). The thread's,
    not the process's: a thread that setns(2) elsewhere reads that namespace's."""
    return net_bytes(name).decode(errors="replace")


def net_bytes(name: str) -> bytes:
    """net_text's bytes, undecoded: what a cell's leader sends (steps "netns_watch"). Not a text file: in a
    freshly cloned leader the io module's objects cost ~20 copy-on-write faults and ~0.15 ms (issue 29)."""
    return fs.read_bytes(f"/proc/thread-self/net/{name}")


def ns_id(kind: str, pid: int | str = "self") -> str:
    """Which namespace it is ("mnt:[4026531841]"): equal for two processes in the same one."""
    return os.readlink(f"/proc/{pid}/ns/{kind}")


def threads(pid: int | str = "self") -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def own_pid() -> int:
    """This process's pid as the PID namespace of the mounted /proc numbers it (the host's, when this
    process is in a PID namespace of its own); getpid() when /proc cannot say."""
    try:
        return int(os.readlink("/proc/self"))
    except (OSError, ValueError):
        return os.getpid()


def pids() -> list[int]:
    return [int(d) for d in os.listdir("/proc") if d.isdigit()]


def clock_ticks() -> int:
    return os.sysconf("SC_CLK_TCK")


def wall_to_ticks(t: float) -> int:
    """A wall-clock time (time.time()) in the unit of Stat.starttime, on this boot."""
    up = float((text("uptime") or "").split()[0])
    return max(0, int((t - (time.time() - up)) * clock_ticks()))
