"""Cgroup primitives: layout detection, agnsup's directories, limits, membership (the kills are the backends').

Hosts come in four layouts, detected at run time from /proc/self/mountinfo:

- ``v2``:     cgroup2 at /sys/fs/cgroup carries every controller (most systemd hosts).
- ``hybrid``: cgroup2 somewhere (here /sys/fs/cgroup/unified) for tracking and
              ``cgroup.kill``; memory and pids as v1 hierarchies (these machines).
- ``v1``:     v1 only: the freezer makes a tree kill atomic.
- ``none``:   nothing writable.

What to do with each is the backends' business (agnsup/backend/): this module
only reads and writes cgroup files. agnsup owns one directory per hierarchy,
``agnsup-<digest of the state root>``, so two state roots never share a
subtree, and never writes a cgroup it did not create: controllers are enabled
only in our own directories' subtree_control. Beneath it the hierarchy mirrors
the domain: ``run-R/agent-A/cell-C``, so one write to ``cgroup.kill`` reaches a
whole cell, agent or run.
"""
from __future__ import annotations

import errno
import os
from contextlib import suppress

from . import proc
from ..util.digest import sha256
from ..util.record import Factory, Record

V1_CONTROLLERS = ("memory", "pids", "freezer", "cpu")


class Layout(Record, frozen=True):
    kind: str                        # v2 | hybrid | v1 | none
    v2: str | None                   # cgroup2 mount point
    v1: dict[str, str] = Factory(dict)   # controller -> mount point
    v2_controllers: tuple[str, ...] = ()

    def as_dict(self) -> dict:
        return {"kind": self.kind, "v2": self.v2, "v1": dict(self.v1), "v2_controllers": list(self.v2_controllers)}


def _unescape(s: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as octal (proc(5))
    return s.encode().decode("unicode_escape") if "\\" in s else s


def parse_mountinfo(mountinfo: str) -> tuple[str | None, dict[str, str]]:
    """(cgroup2 mount point, {v1 controller: mount point}) from /proc/self/mountinfo text."""
    v2 = None
    v1: dict[str, str] = {}
    for line in mountinfo.splitlines():
        left, _, right = line.partition(" - ")
        fields, rfields = left.split(), right.split()
        if len(fields) < 5 or len(rfields) < 3:
            continue
        mnt, fstype, opts = _unescape(fields[4]), rfields[0], rfields[2].split(",")
        if fstype == "cgroup2" and v2 is None:
            v2 = mnt
        elif fstype == "cgroup":
            for c in V1_CONTROLLERS:
                if c in opts and c not in v1:
                    v1[c] = mnt
    return v2, v1


def detect_layout(mountinfo: str | None = None) -> Layout:
    """The host's layout; AGNSUP_CGROUP_LAYOUT=none runs without cgroups even
    where they are writable (cells are then tracked by session + token)."""
    live = mountinfo is None  # this host (not a test's mountinfo text): the environment counts
    forced = os.environ.get("AGNSUP_CGROUP_LAYOUT", "") if live else ""
    if forced == "none":
        return Layout("none", None)
    if forced:
        from ..errors import UsageError
        raise UsageError(f"AGNSUP_CGROUP_LAYOUT={forced!r}: the only override is 'none' (run without cgroups)")
    v2, v1 = parse_mountinfo(proc.mountinfo() if mountinfo is None else mountinfo)
    v2_ctrl = controllers_of(v2) if v2 is not None else None
    if v2_ctrl is None:  # no cgroup2 mount, or its root's controllers unreadable: not usable
        v2, v2_ctrl = None, ()
    if v2 is not None and not os.access(v2, os.W_OK) and not _delegated_base(v2, live):
        v2 = None
    v1 = {c: m for c, m in v1.items() if os.access(m, os.W_OK)}
    if v2 and not v1:
        kind = "v2"
    elif v2:
        kind = "hybrid"
    elif v1:
        kind = "v1"
    else:
        kind = "none"
    return Layout(kind, v2, v1, v2_ctrl)


def controllers_of(directory: str) -> tuple[str, ...] | None:
    """What `directory`'s cgroup.controllers lists (None: unreadable)."""
    try:
        return tuple(read(os.path.join(directory, "cgroup.controllers")).split())
    except OSError:
        return None


def writable_here() -> bool:
    """Would a cgroup tree be usable here, AGNSUP_CGROUP_LAYOUT aside (this process's mountinfo)?"""
    try:
        return detect_layout(proc.mountinfo()).kind != "none"  # mountinfo given: the environment is not read
    except Exception:  # noqa: BLE001 - a fix's wording, a doctor's report: never a failure
        return False


def _delegated_base(v2: str, live: bool) -> bool:
    """A normal user cannot write the cgroup2 mount point, but AGNSUP_CGROUP_BASE may name a subtree
    delegated to it (backend/delegated.py checks the delegation itself, and names what is wrong)."""
    base = os.environ.get("AGNSUP_CGROUP_BASE", "").strip("/") if live else ""
    return bool(base) and os.path.isdir(os.path.join(v2, base))


def root_name(state_root: str) -> str:
    return "agnsup-" + sha256(os.path.realpath(state_root).encode()).hexdigest()[:12]


class Node(Record, frozen=True):
    """One logical cgroup (a run, an agent or a cell) across the hierarchies.

    ``paths`` maps a hierarchy ("v2", "memory", "pids", "freezer", "cpu") to a directory.
    """
    paths: dict[str, str]

    @property
    def primary(self) -> tuple[str, str] | None:
        """The hierarchy we track membership and kill with."""
        for h in ("v2", "freezer", "memory", "pids"):
            if h in self.paths:
                return h, self.paths[h]
        return None

    def as_dict(self) -> dict:
        return dict(self.paths)

    def child(self, name: str) -> "Node":
        return Node({h: os.path.join(p, name) for h, p in self.paths.items()})


def base_node(layout: Layout, state_root: str) -> Node:
    """agnsup's own directory in each usable hierarchy for this state root."""
    name = root_name(state_root)
    base = os.environ.get("AGNSUP_CGROUP_BASE", "").strip("/")
    paths = {}
    if layout.v2:
        paths["v2"] = os.path.join(layout.v2, base, name)  # base "": directly under the mount
    for c in V1_CONTROLLERS:
        # On a hybrid host the v2 tree tracks and kills; the freezer is only needed where there
        # is no cgroup.kill. cpu limits go to v2 where its cpu controller is available (pure v2 hosts).
        skip = (c == "freezer" and layout.v2) or (c == "cpu" and "cpu" in layout.v2_controllers)
        if c in layout.v1 and not skip:
            paths[c] = os.path.join(layout.v1[c], name)
    return Node(paths)


def scope_node(base: Node, run_id: str, agent_id: str | None = None, cell_id: str | None = None) -> Node:
    node = base.child(f"run-{run_id}")
    if agent_id is not None:
        node = node.child(f"agent-{agent_id}")
        if cell_id is not None:
            node = node.child(f"cell-{cell_id}")
    return node


def cell_node(base: Node, run_id: str, agent_id: str, cell_id: str, limits: dict) -> Node:
    """The cell's directories: every hierarchy of the base, except the v1 cpu
    hierarchy when the role sets no CPU limit (joined only to limit: one mkdir
    and one move fewer per cell)."""
    node = scope_node(base, run_id, agent_id, cell_id)
    if "cpu" in node.paths and not (limits.get("cpu_weight") or limits.get("cpu_max")):
        node = Node({h: p for h, p in node.paths.items() if h != "cpu"})
    return node


def write(path: str, value: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def read(path: str) -> str:
    """A cgroup file's text. Through the descriptor, without Python's file object: 4 system calls for a small
    file, not 9 (its fstat, isatty ioctl and seeks), and a cell's end reads about a dozen of these."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks = []
        while True:  # to EOF: a kernfs file may come in parts (cgroup.procs of a big tree)
            b = os.read(fd, 65536)
            if not b:
                return b"".join(chunks).decode()
            chunks.append(b)
    finally:
        os.close(fd)


def enable_controllers(dirs: list[str], wanted: tuple[str, ...]) -> tuple[list[str], dict[str, str]]:
    """Enable `wanted` controllers down our own v2 directories: (those in force, {controller: why not}).

    Ours: agnsup's own, or delegated to it (systemd's Delegate=yes, root's chown). A controller the
    first directory does not list in cgroup.controllers was not handed down to it by its parent, which
    is not ours to write (systemd's, or the host's root): named, never faked. A refused write (EBUSY:
    a process is left in the directory itself) enables nothing: each cell's missing limit is named."""
    enabled = list(wanted)
    why: dict[str, str] = {}
    for d in dirs:
        try:
            avail = read(os.path.join(d, "cgroup.controllers")).split()
        except OSError as e:
            return [], {c: f"{d}/cgroup.controllers: {e.strerror}" for c in wanted}
        for c in enabled:
            if c not in avail:
                why[c] = (f"the cgroup2 controller {c!r} is not enabled for {d} (not in its cgroup.controllers: "
                          f"{os.path.dirname(d)}/cgroup.subtree_control lacks +{c})")
        enabled = [c for c in enabled if c in avail]
        if not enabled:
            return [], why
        try:
            # written even when cgroup.subtree_control lists them: the kernel lists a controller before
            # the children's files are visible (another cell's write in flight), and a write waits for it
            write(os.path.join(d, "cgroup.subtree_control"), " ".join("+" + c for c in enabled))
        except OSError as e:
            return [], {**why, **{c: f"writing {d}/cgroup.subtree_control: {e.strerror}" for c in enabled}}
    return enabled, why


# Which v2 controller each limit key needs.
V2_LIMIT_CONTROLLERS = {"memory": ("memory_max",), "pids": ("pids_max",), "cpu": ("cpu_weight", "cpu_max")}


def wanted_controllers(limits: dict) -> list[str]:
    """The controllers the limits a role sets need (memory, pids, cpu), in that order."""
    return [c for c, keys in V2_LIMIT_CONTROLLERS.items() if any(limits.get(k) for k in keys)]
CPU_PERIOD_US = 100_000


def limit_writes(paths: dict[str, str], v2_controllers: list[str], limits: dict) -> list[tuple[str, str, str]]:
    """The files to write for `limits`, as (resource, file path, value), in order.

    One code path per layout: a resource goes to the v2 directory when the v2
    hierarchy has its controller enabled for us, else to the v1 hierarchy of
    that controller. Pure (no I/O), so both layouts are unit-tested on any host.
    """
    out: list[tuple[str, str, str]] = []
    v2 = paths.get("v2")
    mem, pids = limits.get("memory_max"), limits.get("pids_max")
    weight, cpus = limits.get("cpu_weight"), limits.get("cpu_max")
    quota = cpus and max(1000, int(cpus * CPU_PERIOD_US))

    def put(resource: str, *files: tuple[str, object]) -> None:
        """Each (file, value) whose value is set, in the v2 directory when v2 has `resource`'s
        controller enabled for us, else in that controller's v1 directory (neither: not written)."""
        d = v2 if v2 and resource in v2_controllers else paths.get(resource)
        out.extend((resource, os.path.join(d, f), str(v)) for f, v in files if d and v)

    if mem and v2 and "memory" in v2_controllers:
        # no swap beyond the limit (else the hog swaps instead of meeting the OOM killer),
        # and the OOM killer takes the whole cell, never half a tree (cgroup-v2.rst: memory.oom.group)
        put("memory", ("memory.max", mem), ("memory.swap.max", "0"), ("memory.oom.group", "1"))
    elif mem:
        # memory+swap may not be below memory (so written second); absent without swapaccount
        put("memory", ("memory.limit_in_bytes", mem), ("memory.memsw.limit_in_bytes", mem))
    put("pids", ("pids.max", pids))
    if v2 and "cpu" in v2_controllers:
        put("cpu", ("cpu.weight", weight), ("cpu.max", cpus and f"{quota} {CPU_PERIOD_US}"))
    else:
        # v1 shares default to 1024 where v2's weight defaults to 100 (the kernel's own
        # mapping, cgroup-v2.rst "cpu.weight")
        put("cpu", ("cpu.shares", weight and max(2, weight * 1024 // 100)),
            ("cpu.cfs_period_us", cpus and CPU_PERIOD_US), ("cpu.cfs_quota_us", quota))
    return out


# Files a kernel may lack without weakening the limit itself (no swap accounting).
_OPTIONAL = ("memory.swap.max", "memory.memsw.limit_in_bytes")


def apply_limits(paths: dict[str, str], v2_controllers: list[str], limits: dict) -> dict[str, str]:
    """Write the limit files; returns {resource: "v2:<dir>" | "v1:<dir>"} for what is in force.

    A limit the role asks for that no hierarchy can hold is simply absent
    from the result (the receipt shows it); a write the kernel refuses raises."""
    applied: dict[str, str] = {}
    for resource, path, value in limit_writes(paths, v2_controllers, limits):
        try:
            write(path, value)
        except FileNotFoundError:
            if os.path.basename(path) in _OPTIONAL:
                continue
            raise
        except OSError as e:  # name what was refused, not only "[Errno 22]"
            raise OSError(e.errno, f"the {resource} limit: writing {value} to {path}: {e.strerror}") from None
        d = os.path.dirname(path)
        applied[resource] = ("v2:" if d == paths.get("v2") else "v1:") + d
    return applied


def walk(path: str) -> list[str]:
    """`path` and every directory below it, deepest first."""
    out = []
    with suppress(OSError):
        for root, dirs, _ in os.walk(path, topdown=False):
            out.append(root)
    if not out and os.path.isdir(path):
        out.append(path)
    return out


def procs(path: str) -> list[int]:
    """Every pid in `path` and its descendants (cgroup.procs is per directory)."""
    out: list[int] = []
    for d in walk(path):
        with suppress(FileNotFoundError, OSError):
            out.extend(int(x) for x in read(os.path.join(d, "cgroup.procs")).split())
    return out


def in_tree(lines: list[str] | None, hierarchy: str, path: str, layout: Layout) -> bool:
    if not lines:
        return False
    mount_rel = _relative(path, layout)
    for line in lines:
        _, ctrls, cg = line.split(":", 2)
        if (hierarchy == "v2" and line.startswith("0::")) or hierarchy in ctrls.split(","):
            return cg == mount_rel or cg.startswith(mount_rel + "/")
    return False


def _relative(path: str, layout: Layout) -> str:
    """/sys/fs/cgroup/unified/agnsup-x/run-R -> /agnsup-x/run-R (as /proc/PID/cgroup shows it)."""
    for mnt in ([layout.v2] if layout.v2 else []) + list(layout.v1.values()):
        if path == mnt:
            return "/"
        if path.startswith(mnt.rstrip("/") + "/"):
            return path[len(mnt.rstrip("/")):]
    return path


def write_kill(path: str) -> bool:
    """SIGKILL every process in the v2 directory `path` and below at once
    (cgroup.kill, Linux 5.14). False when there is no cgroup.kill to write
    (an older kernel, or a v1 directory)."""
    try:
        write(os.path.join(path, "cgroup.kill"), "1")
    except FileNotFoundError:
        return not os.path.isdir(path)  # the directory itself is gone: nothing left to kill
    except OSError as e:
        if e.errno != errno.ENODEV:  # ENODEV: being removed under us, so empty
            raise
    return True


def remove_if_empty(path: str) -> bool:
    try:
        os.rmdir(path)
        return True
    except OSError:
        return False
