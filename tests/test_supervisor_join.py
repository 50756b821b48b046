"""A Supervisor's leader is born in its fork server (process/forkserver.py, issue 29, fourth round) by
clone3(CLONE_INTO_CGROUP), in its cgroup2 directory, and joins its v1 hierarchies itself through `tasks` (one
thread moving itself: the kernel skips its global cgroup_threadgroup_rwsem and so the RCU grace period a
cgroup.procs write waits for). Both the PID namespace's init (the leader) and the command are in the cell's
directory of every hierarchy its receipt names.

Checked to fail: with CgroupBackend.attach writing nothing to the v1 hierarchies for a leader that moves
itself, the memory, pids and cpu lines below name the controller's cgroup, not the cell's."""
import ctypes
import json
import os
import struct

from agnsup.supervisor import Supervisor

def _lines(text: str) -> dict[str, str]:
    """/proc/PID/cgroup: {hierarchy: path}, v2 as "v2"."""
    out = {}
    for line in text.splitlines():
        _, ctrl, path = line.split(":", 2)
        for c in (ctrl.split(",") if ctrl else ["v2"]):
            out[c] = path
    return out


def test_a_forked_leader_and_its_command_are_in_every_hierarchy_of_their_cell(state, worktree):
    with Supervisor(state) as sup:
        r = sup.run(["cat", "/proc/self/cgroup", "/proc/1/cgroup"], workdir=worktree, run_id="joined", capture=True)
    assert r["exit_code"] == 0, r
    with open(r["receipt"]) as f:
        receipt = json.load(f)
    assert receipt["isolation"]["cgroup_join"].startswith("clone3"), receipt["isolation"]  # its single-threaded server
    text = r["stdout"]
    n = len(text.splitlines()) // 2
    command, init = (_lines("\n".join(text.splitlines()[:n])), _lines("\n".join(text.splitlines()[n:])))
    assert receipt["cgroup"], receipt
    for h, path in receipt["cgroup"].items():
        rel = path[path.index("/agnsup-"):]  # below the hierarchy's mount point, wherever that is
        assert command.get(h) == rel, (h, rel, text)
        assert init.get(h) == rel, (h, rel, text)


_IN_MODIFY = 0x2


class _WriteWatch:
    """inotify on cgroup directories: the kernel reports a write(2) to any of their files (vfs_write's
    fsnotify_modify, cgroupfs included) by the file's name, whoever the writer is."""

    def __init__(self):
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self.libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        assert self.fd >= 0, os.strerror(ctypes.get_errno())
        self.names = {}  # watch descriptor -> directory

    def add(self, path: str) -> None:
        wd = self.libc.inotify_add_watch(self.fd, path.encode(), _IN_MODIFY)
        assert wd >= 0, (path, os.strerror(ctypes.get_errno()))
        self.names[wd] = path

    def writes(self) -> list[tuple[str, str]]:
        """(directory, file) of every write seen so far."""
        out = []
        while True:
            try:
                buf = os.read(self.fd, 65536)
            except BlockingIOError:
                return out
            off = 0
            while off < len(buf):
                wd, mask, _, size = struct.unpack_from("iIII", buf, off)
                name = buf[off + 16:off + 16 + size].rstrip(b"\0").decode()
                if mask & _IN_MODIFY:
                    out.append((self.names.get(wd, "?"), name))
                off += 16 + size

    def close(self) -> None:
        os.close(self.fd)


def test_a_supervisor_leader_writes_no_cgroup_procs(state, worktree, monkeypatch):
    """What the fork server is for: a Supervisor cell's leader is born in its cgroup2 directory, so no process
    writes that cell's `cgroup.procs` in any hierarchy (a write there waits for the kernel's RCU grace period
    in a threaded controller, ~5-25 ms). fork4's first version wrote it while the receipt said clone3 (the
    server's child lost `born`); only strace caught it then. Checked to fail: with `born` left False in the
    server's unpack, the cell's v2 `cgroup.procs` is written."""
    watch = _WriteWatch()
    try:
        with Supervisor(state) as sup:
            kind = type(sup.ctl.backend)  # (the instance itself goes to the fork server, pickled)
            create = kind.create

            def watched(self, place, limits):  # the cell's directories exist, nothing is in them yet
                made = create(self, place, limits)
                for path in made.paths().values():
                    watch.add(path)
                return made
            monkeypatch.setattr(kind, "create", watched)
            r = sup.run(["true"], workdir=worktree, run_id="nowrite")
        assert r["exit_code"] == 0, r
        with open(r["receipt"]) as f:
            receipt = json.load(f)
        assert receipt["cgroup"], receipt
        assert receipt["isolation"]["cgroup_join"].startswith("clone3"), receipt["isolation"]
        writes = watch.writes()
        assert set(receipt["cgroup"].values()) <= set(watch.names.values()), (watch.names, receipt["cgroup"])
        assert not [w for w in writes if w[1] == "cgroup.procs"], writes
        # the watch sees the leader's own writes: a v1 hierarchy (a hybrid host) it joins through `tasks`
        # not its pod's, nor the spare cell made after it (process/cellspare.py: its leader joins by `tasks` too)
        cell = {p for p in watch.names.values() if os.path.basename(p) == f"cell-{r['cell_id']}"}
        v1 = cell - {receipt["cgroup"].get("v2")}
        spare = {d for d, _ in writes if os.path.basename(d).startswith("cell-")} - cell  # the spare's own joins
        assert {d for d, name in writes if name == "tasks"} - spare == v1, (writes, v1)
    finally:
        watch.close()
