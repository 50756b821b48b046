"""The self-test's view from outside: host processes it starts, and what it
observes of everything else (/proc, pidfds, ports, heartbeat files, the
journal read-only, canaries).

Nothing here trusts agnsup's word: a process is alive when its pidfd says so,
a port is free when it can be bound, a heartbeat stopped when the file stops
growing. The harness plays the user and the bystanders, so it starts plain
host processes (Procs.start, the one place in the package outside the
supervisor that does: never a cell's, tests/test_architecture.py).
"""
from __future__ import annotations

import json
import os
import select
import socket
import sqlite3
import time
from contextlib import suppress

from ..linux import proc

CANARY_SECRET = "must-never-reach-cell"
# Look-alike secrets: the names an exfiltrating tool would look for.
LOOKALIKES = {"OPENAI_API_KEY": "sk-canary-openai-0000", "AWS_SECRET_ACCESS_KEY": "canary-aws-secret-0000",
              "GITHUB_TOKEN": "ghp_canary0000"}
CANARY_NAMES = ("python3", "python", "sh", "bash", "dash", "env", "sleep", "kill", "ip", "mount", "umount",
                "unshare", "nsenter", "setsid", "nohup", "systemd-run", "cgexec", "timeout", "true", "false",
                "cat", "ps", "pkill", "killall", "bwrap", "sudo", "su", "chroot", "stdbuf", "xargs", "find")
MARKER = "DIRECT_BYPASS_DETECTED"


def make_canaries(root: str) -> dict:
    """A canary-bin directory of look-alike executables; each one that runs
    appends to the marker file and answers {"bypass":true} with exit 127."""
    bindir = os.path.join(root, "canary-bin")
    marker = os.path.join(root, MARKER)
    os.makedirs(bindir)
    for name in CANARY_NAMES:
        p = os.path.join(bindir, name)
        with open(p, "w") as f:
            # /bin/sh by absolute path: a canary must not find another canary
            f.write(f"#!/bin/sh\necho \"{MARKER} $0 $*\" >> '{marker}'\necho '{{\"bypass\":true}}'\nexit 127\n")
        os.chmod(p, 0o755)
    return {"bin": bindir, "marker": marker, "names": list(CANARY_NAMES)}


def canary_values(decoy: str) -> list[str]:
    return [CANARY_SECRET, decoy, *LOOKALIKES.values()]


# -- processes the harness starts -------------------------------------------
class Procs:
    """Host processes started by the harness, and (when the harness is PID 1 of
    its own PID namespace) the reaping of orphans reparented to it."""

    def __init__(self):
        self.started: list = []
        self.is_init = os.getpid() == 1

    def start(self, argv: list[str], **kw):
        import subprocess
        for k in ("stdin", "stdout", "stderr"):
            kw.setdefault(k, subprocess.DEVNULL)  # nothing of ours is inherited by accident
        kw.setdefault("close_fds", True)
        p = subprocess.Popen(argv, **kw)
        self.started.append(p)
        return p

    def reap_orphans(self) -> list[int]:
        """As init of our PID namespace, reap zombies that are not ours to wait for."""
        if not self.is_init:
            return []
        mine = {p.pid for p in self.started if p.returncode is None}
        reaped = []
        for pid in proc.pids():
            if pid in mine or pid == 1:
                continue
            st = proc.stat(pid)
            if st and st.ppid == 1 and st.state == "Z":
                with suppress(ChildProcessError):
                    os.waitpid(pid, os.WNOHANG)
                    reaped.append(pid)
        return reaped

    def sleep(self, seconds: float) -> None:
        """Sleep, reaping orphans as we go (a zombie keeps its PID)."""
        end = time.monotonic() + seconds
        while True:
            self.reap_orphans()
            left = end - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(0.05, left))

    def wait_for(self, cond, timeout: float, step: float = 0.05):
        """Poll cond() until it returns something true, or None at the deadline."""
        deadline = time.monotonic() + timeout
        while True:
            self.reap_orphans()
            v = cond()
            if v or time.monotonic() >= deadline:
                return v
            time.sleep(step)


def communicate(p, timeout: float) -> tuple[int | None, str, str]:
    try:
        out, err = p.communicate(timeout=timeout)
        rc, note = p.returncode, ""
    except Exception as e:  # noqa: BLE001 - subprocess.TimeoutExpired, without importing subprocess here
        if type(e).__name__ != "TimeoutExpired":
            raise
        p.kill()
        out, err = p.communicate()
        rc, note = None, f"\n[selftest: killed after {timeout} s]"
    return rc, (out or b"").decode(errors="replace"), (err or b"").decode(errors="replace") + note


# -- identity and liveness, by pidfd ----------------------------------------
class Watch:
    """One process, pinned by a pidfd opened while it was known to be the one
    we mean (pid and start time checked after opening)."""

    def __init__(self, name: str, pid: int, starttime: int | None):
        self.name, self.pid, self.starttime = name, pid, starttime
        self.fd = None
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            return
        st = proc.stat(pid)
        if st is None or (starttime is not None and st.starttime != starttime):
            os.close(fd)
            return
        self.fd = fd

    @property
    def pinned(self) -> bool:
        return self.fd is not None

    def alive(self) -> bool:
        """Not exited (a zombie counts as exited): the pidfd is not readable."""
        if self.fd is None:
            return False
        p = select.poll()
        p.register(self.fd, select.POLLIN)
        return not p.poll(0)

    def inode(self) -> int | None:
        return os.fstat(self.fd).st_ino if self.fd is not None else None

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def kill(self) -> None:
        """SIGKILL this exact process (only ever one the harness started itself)."""
        import signal
        if self.fd is not None and self.alive():
            with suppress(ProcessLookupError):
                signal.pidfd_send_signal(self.fd, signal.SIGKILL)

    def describe(self) -> str:
        return f"{self.name} pid {self.pid} (start {self.starttime})"


def tree_watches(prefix: str, info: dict) -> list[Watch]:
    """Watches for every process a stubborn-tree reported: leader, detached, stripped."""
    out = [Watch(f"{prefix} leader", info["pid"], info["starttime"])]
    out += [Watch(f"{prefix} detached#{k}", g["pid"], g["starttime"])
            for k, g in enumerate(info.get("detached") or [], 1)]
    if info.get("stripped"):
        out.append(Watch(f"{prefix} stripped", info["stripped"]["pid"], info["stripped"]["starttime"]))
    return out


# -- heartbeats and ports ---------------------------------------------------
def size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return 0


def lines(path: str) -> int:
    try:
        with open(path, "rb") as f:
            return f.read().count(b"\n")
    except FileNotFoundError:
        return 0


def bindable(port: int) -> bool:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind(("127.0.0.1", port))
        return True
    except OSError:
        return False
    finally:
        s.close()


def listening(port: int) -> bool:
    """Something accepts connections on 127.0.0.1:port."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            return True
    except OSError:
        return False


# -- /proc ------------------------------------------------------------------
def environ_values(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read().decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None


def procs_with_env(key: str, value: str) -> list[int]:
    """Live processes whose environment holds key=value, as psutil sees them: an
    outside reader of /proc, not agnsup's own (linux/proc.py, under test here)."""
    import psutil
    return [p.pid for p in psutil.process_iter(["environ", "status"])
            if (p.info["environ"] or {}).get(key) == value and p.info["status"] != psutil.STATUS_ZOMBIE]


def scan_files(root: str, needles: list[str]) -> list[str]:
    """Files under root whose content holds any needle: 'path: needle'."""
    hits = []
    for d, _, files in os.walk(root):
        for name in files:
            p = os.path.join(d, name)
            try:
                with open(p, "rb") as f:
                    data = f.read(4 << 20).decode(errors="replace")
            except OSError:
                continue
            hits += [f"{p}: {n}" for n in needles if n in data]
    return hits


# -- the journal, read-only -------------------------------------------------
def journal_rows(state: str, sql: str, args: tuple = ()) -> list[dict]:
    db = sqlite3.connect(f"file:{os.path.join(state, 'journal.db')}?mode=ro", uri=True, timeout=30)
    db.row_factory = sqlite3.Row
    try:
        return [dict(r) for r in db.execute(sql, args).fetchall()]
    finally:
        db.close()


def flock_free(path: str) -> bool:
    """Nobody holds a flock on path (or it does not exist). The kernel answers,
    so the product's own probe is as good as an outside one."""
    from ..locks import is_free
    return is_free(path)


# -- the PID-reuse trap -----------------------------------------------------
NS_LAST_PID = "/proc/sys/kernel/ns_last_pid"


def start_with_pid(procs: Procs, want: int, argv: list[str], **kw):
    """Start argv so that it gets PID `want` in this PID namespace (write
    ns_last_pid = want - 1, then fork). Returns (Popen or None, note). The
    caller checks the Popen's pid: the trap only counts when it landed."""
    try:
        with open(NS_LAST_PID, "w") as f:
            f.write(str(want - 1))
    except OSError as e:
        return None, f"writing {NS_LAST_PID} failed: {e.strerror}"
    with open(NS_LAST_PID) as f:
        back = f.read().strip()
    p = procs.start(argv, **kw)
    with open(NS_LAST_PID) as f:
        after = f.read().strip()
    return p, f"wrote {want - 1} to {NS_LAST_PID}, read back {back}, after fork {after}"


def host_facts() -> dict:
    """What an operator pastes into a bug report about this host."""
    import platform
    from .. import __version__
    from ..linux import cgroup, pidfd
    facts = {"agnsup": __version__, "kernel": platform.release(), "machine": platform.machine(),
             "python": platform.python_version(), "euid": os.geteuid()}
    try:
        with open("/etc/os-release") as f:
            kv = dict(line.rstrip("\n").split("=", 1) for line in f if "=" in line)
        facts["os"] = kv.get("PRETTY_NAME", "").strip('"')
    except OSError:
        facts["os"] = None
    try:
        lay = cgroup.detect_layout()
        facts["cgroup_layout"] = lay.as_dict()
    except OSError as e:
        facts["cgroup_layout"] = {"error": str(e)}
    facts["pidfs"] = pidfd.has_pidfs()
    facts["boot_id"] = proc.boot_id()
    return facts


def dumps(obj) -> str:
    return json.dumps(obj, indent=2, sort_keys=True, default=str)
