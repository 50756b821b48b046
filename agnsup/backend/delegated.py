"""A normal user with a cgroup2 subtree delegated to it (AGNSUP_CGROUP_BASE names it).

cgroup-v2.rst, "Delegation": whoever delegates (systemd for `user@UID.service` or a unit with
Delegate=yes; root on a host without systemd) chowns the directory and its cgroup.procs,
cgroup.subtree_control and cgroup.threads to the user, and starts the user's process inside it
(a process cannot move itself in from outside: the common ancestor's cgroup.procs is not its own).
The user then makes `agnsup-<digest>/run-R/agent-A/cell-C` below it, sets their limits, writes their
cgroup.kill, and moves processes among them, exactly as root does elsewhere; the cell's own
namespaces live in a user namespace of its own (process/steps.py). What the subtree cannot give
(controllers the delegating side did not hand down; v1 hierarchies, which have no safe delegation)
is named per limit, never faked.

"No internal processes": a cgroup with processes in it cannot enable controllers for its children,
so a controller that finds itself in the delegated directory itself moves to a leaf of its own,
`<base>/ctl-<pid>`, before writing `+memory +pids +cpu` to the directory's cgroup.subtree_control.
"""
from __future__ import annotations

import os

from .cgroups import CONTROLLERS, Cgroup2
from ..errors import SetupError
from ..linux import cgroup, delegation


class Delegated(Cgroup2):
    """Cells below a cgroup2 subtree delegated to this (unprivileged) user."""

    def __init__(self, layout, state_root: str):
        super().__init__(layout, state_root)
        self.name = os.environ.get("AGNSUP_CGROUP_BASE", "").strip("/")
        self.top = os.path.join(layout.v2, self.name)
        self.own = delegation.own_dir(layout.v2)
        self.problems = delegation.check(self.top, inside=self.own)
        self.entered = False

    def describe(self, has_cgroup_kill: bool = True) -> str:
        how = "cgroup.kill" if has_cgroup_kill else "SIGKILL each member until empty"
        if self.problems:
            return f"NOT DELEGATED: {self.top}: {'; '.join(self.problems)}"
        return f"cgroup v2 subtree {self.top} delegated to uid {os.geteuid()}, {how}"

    def not_delegated(self) -> str:
        """The one line `run` and doctor give when the subtree cannot be used (and the fix)."""
        return (f"AGNSUP_CGROUP_BASE={self.name}: {self.top} is not a cgroup2 subtree delegated to uid "
                f"{os.geteuid()} with this process inside: {'; '.join(self.problems)}; fix: the delegating side "
                f"(systemd: Delegate=yes; root: chown U {self.top} and its cgroup.procs, cgroup.subtree_control, "
                "cgroup.threads) starts agnsup inside it")

    def enter(self, run_helper) -> None:
        if self.entered:
            return
        if self.problems:
            raise SetupError(self.not_delegated(), step="cgroup")
        handed = [c for c in CONTROLLERS if c in delegation.controllers(self.top)[0]]
        if handed and self.own == self.top:
            leaf = os.path.join(self.top, f"ctl-{os.getpid()}")
            os.makedirs(leaf, exist_ok=True)
            cgroup.write(os.path.join(leaf, "cgroup.procs"), "0")
            self.own = leaf
        cgroup.enable_controllers([self.top], CONTROLLERS)
        self.entered = True

    def _limit_controllers(self) -> list[str]:
        return delegation.controllers(self.top)[0]

    def _not_supported(self, c: str) -> str:
        if c not in self.layout.v2_controllers:
            return (f"this host's cgroup2 hierarchy has no {c!r} controller (it is in a cgroup v1 "
                    "hierarchy, which has no safe delegation)")
        return f"the cgroup2 controller {c!r} was not delegated to {self.top}"

    def limit_fix(self, controller: str) -> str:
        if controller not in self.layout.v2_controllers:
            return "a pure cgroup v2 host (systemd.unified_cgroup_hierarchy=1), or run agnsup as root"
        return (f"the delegating side enables +{controller} in {os.path.dirname(self.top)}/cgroup.subtree_control "
                f"(systemd: Delegate={' '.join(CONTROLLERS)})")

