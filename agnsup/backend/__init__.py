"""Backends: where a cell's processes live on this host, one implementation per host kind.

`choose(state_root)` picks one at start from the detected cgroup layout and
nobody above a backend branches on the layout:

    Cgroup2     pure v2: tracking, cgroup.kill and every limit in v2    (backend/cgroups.py)
    SystemdScope  pure v2 under systemd, as root: the same, inside agnsup's own unit with
                Delegate=yes, never beside systemd's slices              (backend/systemd.py)
    SystemdUserScope  a normal user with a systemd user manager: a scope of each controller's own
                with Delegate=yes, asked of that manager                 (backend/systemd.py)
    Delegated   a normal user's delegated cgroup2 subtree (AGNSUP_CGROUP_BASE): the same verbs, what
                the subtree was not given named per limit                  (backend/delegated.py)
    Hybrid      Cgroup2 on a hybrid host: v2 tracks and kills (cgroup.kill); memory, pids, cpu limits in v1
    Cgroup1     v1 only: the freezer makes a tree kill atomic                  (backend/cgroups.py)
    Untracked   no writable hierarchy (or AGNSUP_CGROUP_LAYOUT=none): no tree of its own;
                the reaper finds the cell's processes on session + token evidence (below)
    (a fake one for unit tests: tests/unit/fake_backend.py)

See backend/base.py for the verbs.
"""
from __future__ import annotations

import os

from .base import Backend, Untracked
from .cgroups import for_layout
from ..linux import cgroup
# backend/systemd.py and backend/delegated.py are imported where _choose picks them: a root on a hybrid or
# v1 host, the CLI's cancel among them, never needs either (issue 29: every module on the way to the kill)


def choose(state_root: str, mountinfo: str | None = None) -> Backend:
    """The backend for this host and state root (AGNSUP_CGROUP_LAYOUT=none: Untracked); its `why`
    says what decided it (agnsup doctor)."""
    b, why = _choose(state_root, mountinfo)
    b.why = why
    return b


def _choose(state_root: str, mountinfo: str | None) -> tuple[Backend, str]:
    layout = cgroup.detect_layout(mountinfo)
    live = mountinfo is None
    root = os.geteuid() == 0
    base = os.environ.get("AGNSUP_CGROUP_BASE") if live else None
    off = live and os.environ.get("AGNSUP_CGROUP_LAYOUT") == "none"  # cgroups turned off on this host
    if layout.kind == "none" and not root and live and not off and not base:
        from . import systemd
        user_layout = systemd.user_layout()
        if user_layout is not None:
            return systemd.SystemdUserScope(user_layout, state_root), \
                "a normal user with a running systemd user manager: it gives each controller a scope with Delegate=yes"
    if layout.kind == "none":
        if off:
            return Untracked(), "AGNSUP_CGROUP_LAYOUT=none"
        return Untracked(), ("no cgroup hierarchy is writable here" + ("" if root else
                             ", none is delegated to this user (AGNSUP_CGROUP_BASE) and no systemd user manager runs"))
    if layout.v2 and not root and base:
        from .delegated import Delegated
        return Delegated(layout, state_root), f"a normal user; AGNSUP_CGROUP_BASE={base} names its delegated subtree"
    if layout.kind == "v2" and root and not base and live:
        from . import systemd
        if systemd.booted():
            return systemd.SystemdScope(layout, state_root), \
                "root on pure cgroup v2 with systemd as PID 1 (it owns the tree): agnsup's own unit, Delegate=yes"
    why = {"v2": "cgroup2 is writable and carries the controllers", "hybrid": "cgroup2 is writable for tracking "
           "and cgroup.kill; memory, pids and cpu are v1 hierarchies", "v1": "only v1 hierarchies are writable"}
    return for_layout(layout, state_root), why[layout.kind] + (f" (under AGNSUP_CGROUP_BASE={base})" if base else "")
