"""What this host offers a cell, probed once per process: {protection: None, or why not}.

The policy compiler takes this as an argument (it never probes the kernel
itself); `agnsup doctor` shows it, and proves seccomp and Landlock in a
throwaway child on top."""
from __future__ import annotations

import os

from . import proc

_cache: dict = {}


def protections() -> dict:
    """{"seccomp"|"landlock"|"landlock_scopes"|"no_new_privs"|"pid_namespace"|"capabilities":
    None when available, else why not; "_abi": the Landlock ABI; "_root": euid 0;
    "_cap_last": the highest capability number this kernel knows}."""
    if not _cache:
        from . import landlock, seccomp
        from .sys import cap_last_cap
        abi = landlock.abi()
        root = os.geteuid() == 0
        _cache.update({
            "seccomp": seccomp.supported(),
            "landlock": None if abi >= 1 else "no Landlock in this kernel (or it is disabled)",
            "landlock_scopes": None if abi >= 6 else f"Landlock ABI {abi} < 6 has no signal/socket scopes",
            "no_new_privs": None,
            "pid_namespace": None,  # root; a normal user's: asked again at each call (below)
            "capabilities": None,  # a root cell drops them; any other uid has none to drop
            "mapped_uid": _mapped_uid(root),
            "_abi": abi, "_root": root, "_cap_last": cap_last_cap(),
        })
    if _cache["_root"]:
        return _cache
    return {**_cache, "pid_namespace": _userns_pid()}


def _mapped_uid(root: bool) -> str | None:
    """Why a root controller's cells cannot run as uid 0 of the cells' user namespace here (None: they
    can; a normal user's cells run as that user already, never as host root). The file systems are asked
    per device when a plan is made (supervisor.idmap_refused); the namespace itself when it is made."""
    if not root:
        return None
    most = proc.sysctl("user/max_user_namespaces")
    if most is None:
        return "no user namespaces in this kernel"
    return "user.max_user_namespaces = 0 (sysctl -w user.max_user_namespaces=15000)" if most == "0" else None


def _userns_pid() -> str | None:
    """Why a normal user's cell cannot have a PID namespace here (None: it can). It is born in a user
    namespace of its own and PID 1 of a new PID namespace by one clone3 (supervisor.py)."""
    from . import userns
    blocked = userns.blocked_by_sysctl()
    return f"no user namespace for a normal user: {blocked[0]}" if blocked else None


CAP_NET_ADMIN = 12
_net_admin: list = []  # [bool], once known


def net_admin() -> bool:
    """Does this process hold CAP_NET_ADMIN (its effective set, /proc/self/status CapEff)? Read once per
    process. A root controller without it (Docker's recipe adds SYS_ADMIN only) cannot bring up the
    loopback of a network namespace its own user namespace owns: its cells' network namespaces are then
    owned by a user namespace of their own (supervisor.cell_netns)."""
    if not _net_admin:
        try:
            eff = int((proc.status() or {}).get("CapEff", "0"), 16)
        except ValueError:
            eff = 0
        _net_admin.append(bool(eff >> CAP_NET_ADMIN & 1))
    return _net_admin[0]
