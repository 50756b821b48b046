"""`agnsup doctor`: what this host offers and what agnsup will do with it."""
from __future__ import annotations

import os

from . import supervisor
from .linux import cgroup, pidfd
from .linux import sys as lsys

def kernel_at_least(major: int, minor: int) -> bool:
    parts = os.uname().release.split(".")
    try:
        return (int(parts[0]), int(parts[1].split("-")[0])) >= (major, minor)
    except (ValueError, IndexError):
        return False


def confinement() -> dict:
    """Each protection a role can ask for (isolation.require names): available here, or why not.

    seccomp and Landlock are really applied in a throwaway child, so
    "available" means "works on this host", not "the kernel has the symbol"."""
    from .linux import landlock, seccomp
    from .linux.host import protections
    host = protections()
    out = {}
    for name in ("seccomp", "landlock", "landlock_scopes", "no_new_privs", "pid_namespace", "capabilities",
                 "mapped_uid"):
        out[name] = {"available": host[name] is None, **({"why_not": host[name]} if host[name] else {})}
    out["landlock"]["abi"] = host["_abi"] or None
    checks = {
        "seccomp": lambda: (lsys.set_no_new_privs(), seccomp.build(("ptrace", "mount")).load()),
        "landlock": lambda: (lsys.set_no_new_privs(), landlock.build(["/dev/null"], host["_abi"]).restrict_self()),
        "pid_namespace": lambda: lsys.unshare(lsys.CLONE_NEWPID | _IN_USERNS),
    }
    if host["_root"]:
        checks["mapped_uid"] = _mapped_uid_check
    for name, fn in checks.items():
        if out[name]["available"]:
            ok, err = supervisor.probe(fn)
            if not ok:
                out[name] = {"available": False, "why_not": f"fails here: {err}"}
    return out


def _mapped_uid_check() -> None:
    """The cells' user namespace can be made here and / (the root file system) id-mapped through it; other
    file systems are asked per device when a cell's plan is made (supervisor.idmap_refused)."""
    supervisor.cell_userns()
    why = supervisor.idmap_refused("/")
    if why:
        raise OSError(why)


def cell_identity(conf: dict) -> str:
    """Who a cell is on this host, for will_use."""
    from .linux.userns import cell_range
    if os.geteuid() != 0:
        return f"uid {os.geteuid()} (the caller's own, in a user namespace of the cell's own)"
    if not conf["mapped_uid"]["available"]:
        return f"HOST ROOT (capabilities limited by the role): {conf['mapped_uid']['why_not']}"
    uid, gid, count = cell_range()
    return (f"uid 0 of a user namespace mapping 0-{count - 1} to host uids {uid}-{uid + count - 1} (gids {gid}-"
            f"{gid + count - 1}); worktree and caches id-mapped (where a file system cannot be, that cell runs as "
            "host root and its receipt says why); isolation.host_root = true opts out")


# A normal user's cell namespaces live in a user namespace of its own (supervisor.py): probe them there.
_IN_USERNS = 0 if os.geteuid() == 0 else lsys.CLONE_NEWUSER


def _ns(flag: int):
    return lambda: lsys.unshare(flag | (_IN_USERNS if flag != lsys.CLONE_NEWUSER else 0))


def reversible(state_root: str) -> dict:
    """Can cells capture their worktree changes here (reversible cells, agnsup/changes.py)? The state
    root's file system as an overlay's upper layer (changes.unsupported), then a real overlay made in a
    throwaway child the way a cell makes it (mounts.overlay; in a user namespace of its own for a normal
    user), with one file written through it. {"available", "why_not"?, "live": what runs live anyway}."""
    import shutil
    import tempfile
    from . import changes
    live = ("long-lived cells (agnsup spawn, MCP spawn, sandboxd Start) under filesystem.changes = \"auto\", and "
            "roles with changes = \"live\": their writes land as they happen, not captured; a read-only worktree "
            "has nothing to capture")
    out: dict = {"available": False, "live": live}
    try:
        why = changes.unsupported(state_root, os.getcwd())
    except Exception as e:  # noqa: BLE001 - a doctor reports, never fails
        why = f"the check failed: {e}"
    if why:
        return {**out, "why_not": f"{why} (cells run live; isolation.require = [\"reversible\"] refuses them)"}
    os.makedirs(os.path.join(state_root, "cache"), exist_ok=True)
    scratch = tempfile.mkdtemp(prefix="doctor-overlay-", dir=os.path.join(state_root, "cache"))
    try:
        for d in ("lower", "layer/upper", "layer/work"):
            os.makedirs(os.path.join(scratch, d))
        ok, err = supervisor.probe(lambda: _overlay_probe(scratch, os.geteuid() == 0))
        if not ok:
            return {**out, "why_not": f"an overlay of a worktree cannot be made here: {err}"}
        out["available"] = True
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return out


def _overlay_probe(scratch: str, root: bool) -> None:
    """In the throwaway child: an overlay over scratch/lower with scratch/layer, one file created through it,
    found in the upper layer (mounts.overlay)."""
    from .linux import mounts, userns
    if not root:
        lsys.unshare(lsys.CLONE_NEWUSER)
        userns.write_id_maps("self", os.getuid(), os.getgid(), os.getuid(), os.getgid())
    lsys.unshare(lsys.CLONE_NEWNS)
    lsys.mount_setattr("/", propagation=lsys.MS_PRIVATE)
    lower = os.path.join(scratch, "lower")
    layer = os.path.join(scratch, "layer")
    fd = lsys.open_tree(layer, lsys.OPEN_TREE_CLONE | lsys.OPEN_TREE_CLOEXEC)
    mounts.overlay(lower, fd, () if root else (("userxattr",),))
    with open(os.path.join(lower, "probe"), "w") as f:
        f.write("x")
    if not os.path.exists(os.path.join(layer, "upper", "probe")):
        raise OSError("a file written through the overlay is not in its upper layer")


def report(state_root: str) -> dict:
    from . import backend as backends
    chosen = backends.choose(state_root)
    # the layout the chosen backend uses (a normal user's systemd scope has one the mount point does not)
    layout = getattr(chosen, "layout", None) or cgroup.detect_layout()
    # cgroup.kill exists only in non-root cgroups, from Linux 5.14 on
    v2_kill = bool(layout.v2) and kernel_at_least(5, 14)
    ns = {}
    for name, flag in (("mount", lsys.CLONE_NEWNS), ("network", lsys.CLONE_NEWNET), ("pid", lsys.CLONE_NEWPID),
                       ("user", lsys.CLONE_NEWUSER)):
        ok, err = supervisor.probe(_ns(flag))
        ns[name] = {"available": ok, **({"error": err} if err else {})}
    mount_api_ok, mount_api_err = supervisor.probe(
        lambda: (lsys.unshare(lsys.CLONE_NEWNS | _IN_USERNS), lsys.mount_setattr("/", propagation=lsys.MS_PRIVATE)))
    from .linux.host import protections
    ll = protections()["_abi"] or None
    hierarchies = {"v2": layout.v2, **{f"v1:{c}": m for c, m in layout.v1.items()}}
    support = chosen.limit_support()
    use = {
        "backend": type(chosen).__name__,
        "tracking_and_kill": chosen.describe(kernel_at_least(5, 14)),
        "limits": {c: f"cgroup {'v1' if c in chosen.roots() else 'v2'}" if why is None else f"NOT IN FORCE: {why}; fix: {chosen.limit_fix(c)}"
                   for c, why in support.items()},
        "mount_namespace": "private, read-only root, masked state root" if ns["mount"]["available"] and mount_api_ok
        else "UNAVAILABLE: cells cannot start",
        "network_deny": "network namespace with loopback only" if ns["network"]["available"]
        else "UNAVAILABLE: roles that deny network cannot start",
        "network_allowlist": "the cell's own namespace, out only through the controller's proxy"
        if ns["network"]["available"] else "UNAVAILABLE: allowlist and internal roles cannot start",
        "process_identity": "boot id + pidfd inode (pidfs)" if pidfd.has_pidfs() else "boot id + start time",
        "cgroup_escape": ("read-only /sys/fs/cgroup, capabilities dropped" if os.geteuid() == 0
                          else "unprivileged uid") + (", Landlock (no write rule there)" if ll else ""),
    }
    conf = confinement()
    use["confinement"] = ", ".join(k for k, v in conf.items() if v["available"]) + " (as each role asks)"
    use["cell_identity"] = cell_identity(conf)
    rev = reversible(state_root)
    use["reversible"] = ("worktree writes of waited-for cells land when each ends, kept as records (agnsup diff, "
                         "agnsup undo); live: " + rev["live"]) if rev["available"] else \
        f"NOT IN FORCE: {rev['why_not']}"
    without = [f"{k} ({v['why_not']})" for k, v in conf.items() if not v["available"]]
    if not rev["available"]:
        without.append(f"reversible ({rev['why_not']})")
    without += [f"limit {c} ({why})" for c, why in support.items() if why is not None]
    return {
        "euid": os.geteuid(),
        "cgroup": {"layout": layout.kind, "hierarchies": hierarchies, "v2_controllers": list(layout.v2_controllers),
                   "cgroup_kill": v2_kill, "agnsup_root": chosen.roots()},
        "namespaces": ns,
        "new_mount_api": {"available": mount_api_ok, **({"error": mount_api_err} if mount_api_err else {})},
        "pidfd": {"pidfd_open": True, "pidfs": pidfd.has_pidfs()},
        "seccomp": protections()["seccomp"] is None,
        "landlock_abi": ll,
        "confinement": conf,
        "reversible": rev,
        "will_use": use,
        "does_without": without,
        "ok": ns["mount"]["available"] and mount_api_ok,
        "host": host_report(chosen, layout, ns, mount_api_ok, conf, support, rev),
    }


def _userns_fix() -> str:
    from .linux import userns
    return "; ".join(userns.blocked_by_sysctl()) or ("let this user create user namespaces (an LSM such as AppArmor, "
                                                    "or a seccomp filter, refuses them here)")


def container() -> str | None:
    """"cgroup namespace" when this process sees a cgroup namespace of its own (a container made with
    --cgroupns=private or `unshare -C`): the root of its cgroup2 mount is not the hierarchy's real root,
    which alone has no cgroup.freeze and cgroup.kill."""
    with open("/proc/self/mountinfo") as f:
        v2 = cgroup.parse_mountinfo(f.read())[0]
    if v2 and (os.path.exists(os.path.join(v2, "cgroup.freeze")) or os.path.exists(os.path.join(v2, "cgroup.kill"))):
        return "cgroup namespace"
    return None


def host_report(chosen, layout, ns: dict, mount_api_ok: bool, conf: dict, support: dict,
                rev: dict | None = None) -> dict:
    """The host kind, the backend chosen and why, and each guarantee: "in force", or "NOT IN FORCE: why;
    fix: the exact fix" (docs/hosts.md, section 4)."""
    root = os.geteuid() == 0
    from .backend import systemd
    kind = ["root" if root else "normal user", {"v2": "pure cgroup v2", "hybrid": "hybrid cgroups",
                                                 "v1": "cgroup v1", "none": "no writable cgroup"}[layout.kind]]
    kind.append("systemd" if systemd.booted() else "no systemd")
    ctr = container()
    if ctr:
        kind.append(f"container ({ctr})")
    g: dict[str, str] = {}

    def put(name: str, ok: bool, why: str = "", fix: str = "") -> None:
        g[name] = "in force" if ok else f"NOT IN FORCE: {why}; fix: {fix}"

    put("cgroup_tree", chosen.trees, "no cgroup of the cell's own: tracked by session + token, no atomic tree kill",
        chosen.limit_fix("memory"))
    for c, why in support.items():
        put(f"limit_{c}", why is None, why or "", chosen.limit_fix(c))
    userns_needed = not root
    if userns_needed:
        put("user_namespace", ns["user"]["available"], f"unshare(CLONE_NEWUSER): {ns['user'].get('error', '')}",
            _userns_fix())
    put("mount_namespace", ns["mount"]["available"] and mount_api_ok,
        f"{ns['mount'].get('error', '') or 'the new mount API'}: cells cannot start",
        _userns_fix() if userns_needed else "a kernel with the new mount API (5.12+) and CAP_SYS_ADMIN")
    put("network_namespace", ns["network"]["available"], ns["network"].get("error", ""),
        _userns_fix() if userns_needed else "CAP_SYS_ADMIN")
    for name in ("pid_namespace", "seccomp", "landlock", "landlock_scopes", "no_new_privs"):
        v = conf[name]
        put(name, v["available"], v.get("why_not", ""), {"landlock": "a kernel with Landlock (5.13+, lsm=landlock)",
                                                         "landlock_scopes": "Linux 6.12+ (Landlock ABI 6)",
                                                         "seccomp": "a kernel with seccomp filters"}.get(
            name, "agnsup run (single-threaded) or root" if name == "pid_namespace" else "-"))
    if rev is not None:
        put("reversible", rev["available"], rev.get("why_not", ""), "a state root on a local file system with "
            "xattrs (ext4, xfs, btrfs, tmpfs): AGNSUP_STATE_DIR, --state-dir")
    return {"kind": ", ".join(kind), "backend": type(chosen).__name__, "why": getattr(chosen, "why", ""),
            "container": ctr, "guarantees": g}


def format_text(r: dict) -> str:
    h = r["host"]
    lines = [f"host:            {h['kind']}", f"backend:         {h['backend']} ({h['why']})", "guarantees:"]
    lines += [f"  {k:18} {v}" for k, v in h["guarantees"].items()]
    lines.append(f"cgroup layout:   {r['cgroup']['layout']}")
    lines += [f"  {h:14} {m or '-'}" for h, m in r["cgroup"]["hierarchies"].items()]
    lines.append(f"  cgroup.kill    {'yes' if r['cgroup']['cgroup_kill'] else 'no'}")
    lines.append("namespaces:      " + ", ".join(f"{k} {'yes' if v['available'] else 'NO'}"
                                                for k, v in r["namespaces"].items()))
    lines.append(f"new mount API:   {'yes' if r['new_mount_api']['available'] else 'NO'}")
    lines.append(f"pidfd:           yes, pidfs {'yes' if r['pidfd']['pidfs'] else 'no (start time fallback)'}")
    lines.append(f"seccomp:         {'yes' if r['seccomp'] else 'no'}")
    lines.append(f"landlock ABI:    {r['landlock_abi'] or 'none'}")
    lines.append("confinement:")
    for k, v in r["confinement"].items():
        extra = f" (ABI {v['abi']})" if v.get("abi") else ""
        lines.append(f"  {k:18} {'yes' + extra if v['available'] else 'NO: ' + v['why_not']}")
    lines.append("agnsup will use:")
    lines += [f"  {k:18} {v}" for k, v in r["will_use"].items()]
    lines.append("does without:    " + ("; ".join(r["does_without"]) or "nothing"))
    lines.append("status:          " + ("ok" if r["ok"] else "CANNOT RUN CELLS on this host"))
    return "\n".join(lines)
