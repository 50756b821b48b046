"""Pure cgroup v2 under systemd, as root: agnsup lives in a unit of its own, never beside the slices.

systemd owns the cgroup tree; a program that makes directories beside its slices is in no unit,
gets only the controllers the root hands down (`memory pids` by default: a cpu_max was silently
dropped) and can be disturbed by systemd at any reload. The contract (systemd.io/CGROUP_DELEGATION)
is a unit with Delegate=yes: systemd enables every controller it manages for the unit's cgroup and
never touches what is below it.

One transient scope per state root, `system.slice/agnsup-<digest>.scope`, made by the first
controller with StartTransientUnit (PIDs=[itself], Delegate=yes, CollectMode=inactive-or-failed:
systemd removes it once nothing is left in it) on the system bus, through `busctl` run
by process.helpers.run_helper (the only spawner; the stdlib has no D-Bus client). A later controller of the same
state root, while the scope lives, moves itself in (root may write any cgroup.procs: the subtree is
ours by delegation). Inside, "no internal processes": each controller sits in a leaf of its own,
`ctl-<pid>`, the cells in `agnsup-<digest>/run-R/agent-A/cell-C`, and the scope's cgroup.subtree_control
enables `memory pids cpu` for both. A process already in a delegated unit (a shipped unit file,
deploy/agnsup-serve.service, Delegate=yes) keeps its unit and uses it in the same way.

Processes that are not controllers (doctor, cancel, janitor, ps) never move: they find the cells
through the journal and the same fixed path.
"""
from __future__ import annotations

import os
import time
from contextlib import suppress

from .cgroups import CONTROLLERS, Cgroup2
from ..linux import cgroup, delegation, proc

BUSCTL = "/usr/bin/busctl"
SLICE = "system.slice"
ENTER_TIMEOUT = 30.0  # the job runs in systemd; on an emulated guest a StartTransientUnit took ~1 s


def booted() -> bool:
    """systemd is PID 1 (sd_booted(3): /run/systemd/system exists)."""
    return os.path.isdir("/run/systemd/system")


def delegated(directory: str) -> bool:
    """systemd marks the cgroup of a unit with Delegate=yes with an xattr (systemd 251+)."""
    for name in ("trusted.delegate", "user.delegate"):
        with suppress(OSError):
            if os.getxattr(directory, name) == b"1":
                return True
    return False


def unit_name(state_root: str) -> str:
    return cgroup.root_name(state_root) + ".scope"


class SystemdScope(Cgroup2):
    """Cells in `<unit>/agnsup-<digest>`; the unit is agnsup's own scope, or a unit with Delegate=yes."""
    kind = "v2"
    bus = "--system"
    slice_property = ("Slice", "s", SLICE)  # the user manager's scope: none, its default (app.slice)

    def __init__(self, layout, state_root: str):
        super().__init__(layout, state_root)
        self.state_root = state_root
        self.unit = self._unit_name(state_root)
        own = _own_dir(layout)
        home = _delegated_unit_of(own, layout.v2) if own else None
        if own and os.path.basename(own).startswith("ctl-") and os.path.basename(os.path.dirname(own)) == self.unit:
            home = os.path.dirname(own)  # this process entered our unit before (another Controller of it)
        # a shipped unit with Delegate=yes (or our scope, already entered): its own directory
        self.scope_dir = home or self._default_dir()
        self.entered = home is not None and os.path.basename(own).startswith("ctl-")
        self.shipped = home is not None and os.path.basename(home) != self.unit  # a unit file's, not our scope
        self.base = cgroup.Node({"v2": os.path.join(self.scope_dir, cgroup.root_name(state_root))})

    def _unit_name(self, state_root: str) -> str:
        return unit_name(state_root)

    def _default_dir(self) -> str:
        return os.path.join(self.layout.v2, SLICE, self.unit)

    def _start_argv(self) -> list[str]:
        return [BUSCTL, self.bus, "call", "org.freedesktop.systemd1", "/org/freedesktop/systemd1",
                "org.freedesktop.systemd1.Manager", "StartTransientUnit", "ssa(sv)a(sa(sv))",
                self.unit, "fail", str(3 + bool(self.slice_property)), "PIDs", "au", "1", str(proc.own_pid()),
                "Delegate", "b", "true", "CollectMode", "s", "inactive-or-failed", *self.slice_property, "0"]

    def describe(self, has_cgroup_kill: bool = True) -> str:
        return (f"cgroup v2 in systemd unit {os.path.basename(self.scope_dir)} (Delegate=yes), "
                + ("cgroup.kill" if has_cgroup_kill else "SIGKILL each member until empty"))

    def limit_fix(self, controller: str) -> str:
        return (f"systemd did not delegate {controller} to {os.path.basename(self.scope_dir)}: "
                f"enable {controller.capitalize()}Accounting= for its slice, or Delegate={' '.join(CONTROLLERS)}")

    def limit_support(self) -> dict[str, str | None]:
        """What the scope gets from systemd (its cgroup.controllers); before it exists, what systemd
        gives a new unit with Delegate=yes: every controller its manager has (_manager_controllers)."""
        if os.path.isdir(self.scope_dir):
            where, have = f"{self.scope_dir}/cgroup.controllers", delegation.controllers(self.scope_dir)[0]
        else:
            where, have = self._manager_controllers()
        return {c: None if c in have else f"the cgroup2 controller {c!r} is not in {where}" for c in CONTROLLERS}

    def _manager_controllers(self) -> tuple[str, list[str]]:
        return f"{self.layout.v2}/cgroup.controllers", list(self.layout.v2_controllers)

    def enter(self, run_helper) -> None:
        """Make this process a controller in agnsup's unit: move it to `<scope>/ctl-<pid>` (asking
        systemd for the scope first when there is none), then enable the controllers for the cells."""
        if self.entered:
            return
        deadline = time.monotonic() + ENTER_TIMEOUT
        while True:
            # always asked: a directory left at that path is no proof of a live unit (systemd may be
            # collecting it, or did and the path was made again); "already exists" means it is live
            if not self.shipped:
                self._start_scope(run_helper, deadline)
            try:
                self._move_to_leaf(proc.own_pid())
                break
            except FileNotFoundError:  # systemd collected the empty scope as we came: ask again
                if time.monotonic() >= deadline:
                    raise
        cgroup.enable_controllers([self.scope_dir], CONTROLLERS)
        os.makedirs(self.base.paths["v2"], exist_ok=True)
        self.entered = True

    def _start_scope(self, run_helper, deadline: float) -> None:
        from ..errors import SetupError
        argv = self._start_argv()
        rc, out, err = run_helper(argv, max(1.0, deadline - time.monotonic()), self.helper_env())
        if rc != 0 and "already exists" not in err and "already loaded" not in err:  # a concurrent one's: join
            raise SetupError(f"systemd did not give agnsup a unit of its own ({' '.join(argv[:1])} "
                             f"StartTransientUnit {self.unit}: {err.strip() or out.strip() or rc}); "
                             "run agnsup in a unit with Delegate=yes (deploy/agnsup-serve.service)",
                             step="cgroup")
        # moved in by systemd (ours), or the scope exists (a concurrent controller's): we join it
        moved = rc == 0
        if moved:
            self._found(deadline)
        while not (_under(_own_dir(self.layout) or "", self.scope_dir) if moved else os.path.isdir(self.scope_dir)):
            if time.monotonic() >= deadline:
                raise SetupError(f"systemd's scope {self.unit} did not appear within {ENTER_TIMEOUT:.0f} s",
                                 step="cgroup")
            time.sleep(0.01)

    def helper_env(self) -> dict:
        return {"LC_ALL": "C"}

    def _found(self, deadline: float) -> None:
        """Where systemd put the unit (the system scope's path is fixed: nothing to find)."""

    def _move_to_leaf(self, pid: int) -> None:
        leaf = os.path.join(self.scope_dir, f"ctl-{pid}")
        with suppress(FileExistsError):
            os.mkdir(leaf)
        cgroup.write(os.path.join(leaf, "cgroup.procs"), "0")
        for name in os.listdir(self.scope_dir):  # leaves of controllers gone (pids are not reused while we live)
            if name.startswith("ctl-") and name != f"ctl-{pid}":
                cgroup.remove_if_empty(os.path.join(self.scope_dir, name))


def _under(path: str, top: str) -> bool:
    return path == top or path.startswith(top + "/")


def _own_dir(layout) -> str | None:
    return delegation.own_dir(layout.v2)


def _delegated_unit_of(own: str, mount: str) -> str | None:
    """The directory of the unit `own` is in (itself or its nearest ancestor unit), if that unit has
    Delegate=yes; never a unit further up (a user's terminal in app.slice/foo.service is not in
    user@UID.service's delegation: it would put agnsup beside the user manager's slices)."""
    d = own
    while _under(d, mount) and d != mount:
        if d.endswith((".scope", ".service")):
            return d if delegated(d) else None
        d = os.path.dirname(d)
    return None


class SystemdUserScope(SystemdScope):
    """A normal user under systemd with a user manager (`user@UID.service`, delegated by default): each
    controller asks that manager for a scope of its own with Delegate=yes, as `systemd-run --user --scope
    -p Delegate=yes` does. One per controller: a process of the login session (session-N.scope, not
    delegated) cannot move into a scope made earlier, whose common ancestor with it is root's."""
    bus = "--user"
    slice_property = ()

    def _unit_name(self, state_root: str) -> str:
        return f"{cgroup.root_name(state_root)}-{os.getpid()}.scope"

    def _default_dir(self) -> str:
        return os.path.join(self.layout.v2, "user.slice", f"user-{os.getuid()}.slice", f"user@{os.getuid()}.service",
                            "app.slice", self.unit)

    def helper_env(self) -> dict:
        env = {"LC_ALL": "C", "XDG_RUNTIME_DIR": f"/run/user/{os.getuid()}"}  # the default, unless set
        return env | {k: os.environ[k] for k in ("XDG_RUNTIME_DIR", "DBUS_SESSION_BUS_ADDRESS") if k in os.environ}

    def _found(self, deadline: float) -> None:
        while True:
            own = _own_dir(self.layout) or ""
            if os.path.basename(own) == self.unit:
                self.scope_dir = own
                self.base = cgroup.Node({"v2": os.path.join(own, cgroup.root_name(self.state_root))})
                return
            if time.monotonic() >= deadline:
                from ..errors import SetupError
                raise SetupError(f"systemd's user manager did not move agnsup into {self.unit} within "
                                 f"{ENTER_TIMEOUT:.0f} s", step="cgroup")
            time.sleep(0.01)

    def _manager_controllers(self) -> tuple[str, list[str]]:
        manager = os.path.join(self.layout.v2, "user.slice", f"user-{os.getuid()}.slice", f"user@{os.getuid()}.service")
        return f"{manager}/cgroup.controllers", delegation.controllers(manager)[0]

    def limit_fix(self, controller: str) -> str:
        return (f"systemd's user manager did not delegate {controller}: as root, "
                f"systemctl set-property user@{os.getuid()}.service Delegate={' '.join(CONTROLLERS)}")


def user_manager_bus() -> str | None:
    """The user manager's bus socket, if this user has a running one ($XDG_RUNTIME_DIR/bus)."""
    path = os.path.join(os.environ.get("XDG_RUNTIME_DIR") or f"/run/user/{os.getuid()}", "bus")
    return path if os.path.exists(path) else None


def user_layout():
    """A pure-v2 layout for a normal user whose systemd user manager runs (its bus exists), else None."""
    if not booted() or user_manager_bus() is None:
        return None
    v2, v1 = cgroup.parse_mountinfo(proc.mountinfo())
    if v2 is None or v1:
        return None  # hybrid: the user manager delegates nothing the limits could use
    ctrl = cgroup.controllers_of(v2)
    return None if ctrl is None else cgroup.Layout("v2", v2, {}, ctrl)

