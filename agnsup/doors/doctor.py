"""`agnsup doctor`: what this host offers and what agnsup will do with it."""
from __future__ import annotations

import os

from ..process import helpers, namespaces
from ..linux import cgroup, pidfd, proc
from ..linux import sys as lsys

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
    from ..linux import landlock, seccomp
    from ..linux.host import protections
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
            ok, err = helpers.probe(fn)
            if not ok:
                out[name] = {"available": False, "why_not": f"fails here: {err}"}
    return out


def _mapped_uid_check() -> None:
    """The cells' user namespace can be made here and / (the root file system) id-mapped through it; other
    file systems are asked per device when a cell's plan is made (process.namespaces.idmap_refused)."""
    namespaces.cell_userns()
    why = namespaces.idmap_refused("/")
    if why:
        raise OSError(why)


def cell_identity(conf: dict) -> str:
    """Who a cell is on this host, for will_use."""
    from ..linux.userns import cell_range
    if os.geteuid() != 0:
        return f"uid {os.geteuid()} (the caller's own, in a user namespace of the cell's own)"
    if not conf["mapped_uid"]["available"]:
        return f"HOST ROOT (capabilities limited by the role): {conf['mapped_uid']['why_not']}"
    uid, gid, count = cell_range()
    return (f"uid 0 of a user namespace mapping 0-{count - 1} to host uids {uid}-{uid + count - 1} (gids {gid}-"
            f"{gid + count - 1}); worktree and caches id-mapped (where a file system cannot be, that cell runs as "
            "host root and its receipt says why); isolation.host_root = true opts out")


# A normal user's cell namespaces live in a user namespace of its own (process/steps.py): probe them there.
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
    from .. import changes
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
        ok, err = helpers.probe(lambda: _overlay_probe(scratch, os.geteuid() == 0))
        if not ok:
            return {**out, "why_not": f"an overlay of a worktree cannot be made here: {err}"}
        out["available"] = True
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return out


def _overlay_probe(scratch: str, root: bool) -> None:
    """In the throwaway child: an overlay over scratch/lower with scratch/layer, one file created through it,
    found in the upper layer (mounts.overlay)."""
    from ..linux import mounts, userns
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


def report(state_root: str, probe: bool = True, progress=None, roles: list[str] | None = None) -> dict:
    """The host report (`agnsup doctor --json`); `probe`: also a trivial cell per role through run's own
    path (probe_cells), and "ok" only when each ran. Keys are added, never renamed (docs/cli.md)."""
    from .. import backend as backends
    chosen = backends.choose(state_root)
    ev = evidence()
    # the layout the chosen backend uses (a normal user's systemd scope has one the mount point does not)
    layout = getattr(chosen, "layout", None) or cgroup.detect_layout()
    # cgroup.kill exists only in non-root cgroups, from Linux 5.14 on
    v2_kill = bool(layout.v2) and kernel_at_least(5, 14)
    ns = {}
    for name, flag in (("mount", lsys.CLONE_NEWNS), ("network", lsys.CLONE_NEWNET), ("pid", lsys.CLONE_NEWPID),
                       ("user", lsys.CLONE_NEWUSER)):
        ok, err = helpers.probe(_ns(flag))
        ns[name] = {"available": ok, **({"error": err} if err else {})}
    mount_api_ok, mount_api_err = helpers.probe(
        lambda: (lsys.unshare(lsys.CLONE_NEWNS | _IN_USERNS), lsys.mount_setattr("/", propagation=lsys.MS_PRIVATE)))
    from ..linux.host import protections
    ll = protections()["_abi"] or None
    hierarchies = {"v2": layout.v2, **{f"v1:{c}": m for c, m in layout.v1.items()}}
    support = chosen.limit_support()
    use = {
        "backend": type(chosen).__name__,
        "tracking_and_kill": chosen.describe(kernel_at_least(5, 14)),
        "limits": {c: f"cgroup {'v1' if c in chosen.roots() else 'v2'}" if why is None else
                   f"NOT IN FORCE: {why}; fix: {cgroup_fix(ev) or chosen.limit_fix(c)}" for c, why in support.items()},
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
    static_ok = ns["mount"]["available"] and mount_api_ok
    # what a role with isolation.reduced would lose here, as the compiler decides it (named by each fix's key)
    from ..compiler import reduced_pieces
    ev["refused"] = reduced = reduced_pieces(None, backend=chosen)
    cells = probe_cells(state_root, roles, ev, progress) if probe else {}
    failed = [r for r, v in cells.items() if not v["ran"]]
    # the probe cells are run's: where they lived is where run's cells live (issue 27: a normal user's
    # doctor said Untracked where run used the delegated subtree); a disagreement is a bug, said as one
    own = chosen.roots().get("v2")
    astray = [f"{r}: {v['cgroup']}" for r, v in cells.items() if v.get("cgroup") and not
              (own and v["cgroup"].startswith(own + "/"))]
    if astray:
        without.append(f"doctor's backend ({type(chosen).__name__}, root {own or 'none'}) is not the one run used "
                       f"(its cells lived in {'; '.join(astray)}): a bug, please report it")
    # probed, the cells are the truth (a role with isolation.reduced runs where namespaces are refused)
    if probe:
        status = "ok" if not failed else "cannot run cells" if len(failed) == len(cells) else "some roles cannot run"
    else:
        status = "not probed" if static_ok else "cannot run cells"
    host = host_report(chosen, layout, ns, mount_api_ok, conf, support, rev, ev)
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
        "ok": status in ("ok", "not probed"),
        "status": status,
        "probed": probe,
        "cells": cells,
        "reduced": reduced,
        "evidence": ev,
        "host": host,
    }


def _userns_fix() -> str:
    from ..linux import userns
    return "; ".join(userns.blocked_by_sysctl()) or ("let this user create user namespaces (an LSM such as AppArmor, "
                                                    "or a seccomp filter, refuses them here)")


def container() -> str | None:
    """"cgroup namespace" when this process sees a cgroup namespace of its own (a container made with
    --cgroupns=private or `unshare -C`): the root of its cgroup2 mount is not the hierarchy's real root,
    which alone has no cgroup.freeze and cgroup.kill."""
    v2 = cgroup.parse_mountinfo(proc.mountinfo())[0]
    if v2 and (os.path.exists(os.path.join(v2, "cgroup.freeze")) or os.path.exists(os.path.join(v2, "cgroup.kill"))):
        return "cgroup namespace"
    return None


def host_report(chosen, layout, ns: dict, mount_api_ok: bool, conf: dict, support: dict,
                rev: dict | None = None, ev: dict | None = None) -> dict:
    """The host kind, the backend chosen and why, and each guarantee: "in force", or "NOT IN FORCE: why;
    fix: the exact fix" (docs/hosts.md, section 4)."""
    root = os.geteuid() == 0
    from ..backend import systemd
    kind = ["root" if root else "normal user", {"v2": "pure cgroup v2", "hybrid": "hybrid cgroups",
                                                 "v1": "cgroup v1", "none": "no writable cgroup"}[layout.kind]]
    kind.append("systemd" if systemd.booted() else "no systemd")
    ev = evidence() if ev is None else ev
    ctr = ", ".join(ev["container"]) or None
    if ctr:
        kind.append(f"container ({ctr})")
    if ev["seccomp_filter"]:
        kind.append("under a seccomp filter")
    if ev["caps_missing"]:
        kind.append("without CAP_" + ", CAP_".join(ev["caps_missing"]))
    g: dict[str, str] = {}

    def put(name: str, ok: bool, why: str = "", fix: str = "") -> None:
        g[name] = "in force" if ok else f"NOT IN FORCE: {why}; fix: {fix}"

    cg_fix = cgroup_fix(ev)
    put("cgroup_tree", chosen.trees, "no cgroup of the cell's own: tracked by session + token, no atomic tree kill",
        cg_fix or chosen.limit_fix("memory"))
    for c, why in support.items():
        put(f"limit_{c}", why is None, why or "", cg_fix or chosen.limit_fix(c))
    userns_needed = not root
    if userns_needed:
        put("user_namespace", ns["user"]["available"], f"unshare(CLONE_NEWUSER): {ns['user'].get('error', '')}",
            _userns_fix())
    put("mount_namespace", ns["mount"]["available"] and mount_api_ok,
        f"{ns['mount'].get('error', '') or 'the new mount API'}: cells cannot start",
        fix_for("mount", ev) or (_userns_fix() if userns_needed else "a kernel with the new mount API (5.12+) "
                                                                     "and CAP_SYS_ADMIN"))
    put("network_namespace", ns["network"]["available"], ns["network"].get("error", ""),
        fix_for("network", ev) or (_userns_fix() if userns_needed else "CAP_SYS_ADMIN"))
    for name in ("pid_namespace", "seccomp", "landlock", "landlock_scopes", "no_new_privs"):
        v = conf[name]
        put(name, v["available"], v.get("why_not", ""), {"landlock": "a kernel with Landlock (5.13+, lsm=landlock)",
                                                         "landlock_scopes": "Linux 6.12+ (Landlock ABI 6)",
                                                         "seccomp": "a kernel with seccomp filters"}.get(
            name, (fix_for("pid_namespace", ev) or ("agnsup run (single-threaded) or root" if not root else
                                                     "CAP_SYS_ADMIN")) if name == "pid_namespace" else "-"))
    if rev is not None:
        refused = "cannot be made here" in rev.get("why_not", "")  # the overlay probe itself was refused
        put("reversible", rev["available"], rev.get("why_not", ""), (refused and fix_for("mount", ev)) or
            "a state root on a local file system with xattrs (ext4, xfs, btrfs, tmpfs): AGNSUP_STATE_DIR, --state-dir")
    return {"kind": ", ".join(kind), "backend": type(chosen).__name__, "why": getattr(chosen, "why", ""),
            # "container": the cgroup-namespace reading as before; every marker found: container_kinds
            "container": "cgroup namespace" if "cgroup namespace" in ev["container"] else None,
            "container_kinds": ev["container"], "guarantees": g}


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
    lines.append("reduced:         " + (", ".join(r["reduced"]) + " (what a role with isolation.reduced gives up "
                                                   "here)" if r.get("reduced") else "nothing (every piece holds here)"))
    lines += cells_text(r)
    lines.append("status:          " + {"ok": "ok", "not probed": "not probed (--no-probe): no cell was started",
                                         "some roles cannot run": "SOME ROLES CANNOT RUN CELLS on this host"}.get(
        r["status"], "CANNOT RUN CELLS on this host"))
    return "\n".join(lines)


def cells_text(r: dict) -> list[str]:
    """One line per probed role: ran, or the failed step, the one-line error and the fix."""
    if not r.get("probed"):
        return ["cells:           not probed (--no-probe)"]
    out = ["cells:           a `true` cell per role, as `agnsup run --role R` starts it"]
    for role, v in r["cells"].items():
        if v["ran"]:
            out.append(f"  role {role}: ran ({v['seconds']:.2f} s)")
        else:
            out.append(f"  role {role}: {v['error']}" + (f"; fix: {v['fix']}" if v.get("fix") else ""))
    return out


# --------------------------------------------------------------------------------------- where we run (issue 27)
CAP_NET_ADMIN = 12
CAP_SYS_ADMIN = 21


def container_kinds(environ: dict | None = None, read=lambda path: proc.text(path[len("/proc/"):]),
                    exists=os.path.exists) -> list[str]:
    """What says this process runs in a container, each a word: "docker" (/.dockerenv), "podman"
    (/run/.containerenv), "kubernetes" (KUBERNETES_SERVICE_HOST), "container=X" (PID 1's environment,
    where readable: systemd-nspawn, LXC, podman), "cgroup namespace" (container(): its own cgroup root)."""
    environ = os.environ if environ is None else environ
    out = []
    if exists("/.dockerenv"):
        out.append("docker")
    if exists("/run/.containerenv"):
        out.append("podman")
    if environ.get("KUBERNETES_SERVICE_HOST"):
        out.append("kubernetes")
    env1 = read("/proc/1/environ")
    for kv in (env1 or "").split("\0"):
        if kv.startswith("container=") and kv[10:]:
            word = kv[10:]
            if word not in out:
                out.append(f"container={word}")
    return out


def _caps(status: str) -> tuple[int | None, int | None]:
    """(CapEff bits, Seccomp mode) from /proc/self/status text (None: not there)."""
    st = proc.parse_status(status)
    return (int(st["CapEff"], 16) if "CapEff" in st else None), (int(st["Seccomp"]) if "Seccomp" in st else None)


def evidence() -> dict:
    """What decides a fix's wording here (fix_for): who we are, in what container, under what filter,
    with which capabilities, and whether a cgroup would be writable without the AGNSUP_CGROUP_LAYOUT
    override."""
    cap, mode = _caps(proc.text("self/status") or "")
    kinds = container_kinds()
    try:
        ns = container()
    except OSError:
        ns = None
    if ns:
        kinds.append(ns)
    root = os.geteuid() == 0
    missing = [] if cap is None or not root else \
        [n for n, bit in (("SYS_ADMIN", CAP_SYS_ADMIN), ("NET_ADMIN", CAP_NET_ADMIN)) if not cap >> bit & 1]
    return {"root": root, "container": kinds, "seccomp_filter": mode == 2, "caps_missing": missing,
            "cgroup_off": os.environ.get("AGNSUP_CGROUP_LAYOUT") == "none",
            "cgroup_writable": cgroup.writable_here(), "kernel": os.uname().release}


# The piece of isolation.reduced a failed step costs (issue 27: mount_namespace, network_namespace,
# pid_namespace, cgroup).
_PIECE = {"pid_namespace": "pid_namespace", "pid": "pid_namespace", "network": "network_namespace",
          "network_namespace": "network_namespace", "mount_namespace": "mount_namespace",
          "loopback": "network_namespace", "netns": "network_namespace", "egress": "network_namespace",
          "mount": "mount_namespace", "mounts": "mount_namespace", "unshare": "mount_namespace",
          "confinement": "mount_namespace", "new_mount_api": "mount_namespace", "cgroup": "cgroup"}


def _ctr_flag(ev: dict, cap: str | list[str] | None, seccomp: bool = False) -> str:
    """The container's own setting that gives `cap` (or lifts its seccomp profile), as its kind spells it."""
    caps = [cap] if isinstance(cap, str) else list(cap or [])
    if "kubernetes" in ev["container"]:
        if seccomp:
            return "securityContext.seccompProfile.type: Unconfined in the pod spec"
        return "securityContext.capabilities.add: [" + ", ".join(f'"{c}"' for c in caps) + "] in the pod spec"
    if seccomp:
        return "run the container with --security-opt seccomp=unconfined"
    return "run the container with " + " ".join(f"--cap-add {c}" for c in caps)


def fix_for(step: str, ev: dict, code: int | None = None) -> str | None:
    """The fix for a cell (or a probe) that failed at `step` here, from the evidence (evidence()):
    in a container, the container's flags; a normal user, the user-namespace fix; None when doctor
    knows none better than the error's own. `code`: the errno, when known (EPERM/EACCES/ENOSYS are
    refusals; others are not the host's policy)."""
    import errno as E
    piece = _PIECE.get(step)
    if code is not None and code not in (E.EPERM, E.EACCES, E.ENOSYS, E.EINVAL):
        return None
    in_ctr = bool(ev["container"])
    # the key names every piece this host refuses (ev["refused"]: report's reduced line), not only this step's:
    # a cell reduced by one piece would stop at the next refused one
    listed = ev.get("refused") or []
    names = listed if piece in listed else [piece]
    reduced = ("; or accept a reduced cell: isolation.reduced = [" + ", ".join(f'"{p}"' for p in names) +
               "] (docs/hosts.md)" if piece else "")
    if piece == "cgroup":
        return cgroup_fix(ev)
    if not ev["root"]:
        if in_ctr and ev["seccomp_filter"]:
            return ("the container's seccomp profile refuses a normal user's user namespace: "
                    f"{_ctr_flag(ev, None, seccomp=True)}, or run agnsup as root in it") + reduced
        return None  # the user-namespace fix run gives is right (process.namespaces.userns_refused)
    if piece == "network_namespace" and "NET_ADMIN" in ev["caps_missing"] and "SYS_ADMIN" not in ev["caps_missing"]:
        why = "bringing up the cell's loopback needs CAP_NET_ADMIN, which this process lacks (CapEff)"
        return f"{why}: " + (_ctr_flag(ev, "NET_ADMIN") if in_ctr else "run agnsup with CAP_NET_ADMIN") + reduced
    if piece is None:
        return None
    if "SYS_ADMIN" in ev["caps_missing"]:
        # a cell's network namespace also needs its loopback up: CAP_NET_ADMIN, named with it when missing
        caps = ["SYS_ADMIN"] + (["NET_ADMIN"] if piece == "network_namespace" and "NET_ADMIN" in ev["caps_missing"]
                                else [])
        why = ("namespaces and mounts need CAP_SYS_ADMIN" + (" (and the cell's loopback CAP_NET_ADMIN)"
                                                             if len(caps) > 1 else "") +
               ", which this process lacks (CapEff)")
        if in_ctr:
            return (f"{why}: {_ctr_flag(ev, caps)} (Docker's default seccomp profile allows unshare and "
                    "mount once SYS_ADMIN is added; deploy/Dockerfile)" + reduced)
        return f"{why}: run agnsup as root with its full capabilities" + reduced
    if ev["seccomp_filter"]:
        if in_ctr:
            return ("the container's seccomp profile refuses namespaces or the mount API even with CAP_SYS_ADMIN: "
                    f"{_ctr_flag(ev, None, seccomp=True)}" + reduced)
        return ("a seccomp filter on this process refuses namespaces or the mount API (a service manager's "
                "SystemCallFilter=, a sandbox around agnsup): start agnsup without it" + reduced)
    if piece == "mount_namespace" and not kernel_at_least(5, 12):
        return f"a kernel with the new mount API (5.12+; this one is {ev['kernel']})" + reduced
    if in_ctr:
        return ("the container's LSM profile (AppArmor, SELinux) refuses it: run the container with --security-opt "
                "apparmor=unconfined (or its SELinux equivalent)" + reduced)
    return None


def cgroup_fix(ev: dict) -> str | None:
    """The fix for no cgroup of the cell's own where unsetting AGNSUP_CGROUP_LAYOUT would change nothing
    (the entrypoint's fallback in a container with no writable cgroup2); None: the backend's own fix."""
    if ev["cgroup_writable"] or not (ev["cgroup_off"] or ev["container"]):
        return None
    if "kubernetes" in ev["container"]:
        return ("a node on pure cgroup v2 (the runtime then gives the pod's containers a cgroup namespace and a "
                "writable cgroup2 of their own)")
    if ev["container"]:
        return ("a writable cgroup2 of the container's own: run it with --cgroupns=private on a pure cgroup v2 host "
                "(Docker on a hybrid or v1 host mounts the container's cgroups read-only, v1)")
    return "a writable cgroup hierarchy (mount cgroup2), or a subtree delegated to agnsup (AGNSUP_CGROUP_BASE)"


# ------------------------------------------------------------------------------- cells, as run makes them
PROBE_TIMEOUT = 30.0


def _split_fix(message: str) -> tuple[str, str | None]:
    """("cell setup failed at step ...: error", "its own fix" or None) of one refusal line."""
    head, sep, fix = message.partition("; fix: ")
    return (head, fix) if sep else (message, None)


def probe_cells(state_root: str, roles: list[str] | None = None, ev: dict | None = None, progress=None) -> dict:
    """A trivial cell (`true`) per role (default: every role `--role` accepts here, policy.known_roles)
    through run's own path (tool.run_process: governance, the compiler, the broker, the backend `run`
    would choose, the same state root), in a throwaway worktree under a run of doctor's own
    (`doctor-<pid>-<hex>`), everything it made removed after (remove_probe_run). {role: {"ran": bool,
    "exit_code", "seconds", and when it did not run: "step", "error", "fix"; "cgroup": the cell's v2
    directory when it had one}}. `progress(role, result)` after each."""
    import tempfile
    import time
    from .. import policy, tool
    from ..errors import AgnsupError
    ev = evidence() if ev is None else ev
    roles = policy.known_roles() if roles is None else roles
    run_id = f"doctor-{os.getpid()}-{os.urandom(3).hex()}"
    wt = tempfile.mkdtemp(prefix="agnsup-doctor-")
    out: dict = {}
    try:
        for role in roles:
            t0 = time.monotonic()
            try:
                r = tool.run_process(["true"], role=role, run_id=run_id, cell_id=f"probe-{role}"[:64], workdir=wt,
                                     capture=True, entry="doctor", state_dir=state_root, timeout=PROBE_TIMEOUT)
                res = {"ran": r.get("exit_code") == 0, "exit_code": r.get("exit_code")}
                rec = _receipt(r.get("receipt"))
                if (rec.get("cgroup") or {}).get("v2"):
                    res["cgroup"] = rec["cgroup"]["v2"]
                if not res["ran"]:
                    res.update(step="exec", error=f"`true` ended {r.get('state')} with exit {r.get('exit_code')}"
                                                  f" ({r.get('reason') or '-'})", fix=None)
            except AgnsupError as e:
                step = e.details.get("step") or type(e).__name__
                err, own = _split_fix(e.message)
                res = {"ran": False, "exit_code": e.exit_code, "step": step, "error": err,
                       "fix": fix_for(step, ev, e.details.get("errno")) or own}
            except Exception as e:  # noqa: BLE001 - a doctor reports, never fails
                res = {"ran": False, "exit_code": None, "step": "doctor", "error": f"{type(e).__name__}: {e}",
                       "fix": None}
            res["seconds"] = round(time.monotonic() - t0, 3)
            out[role] = res
            if progress is not None:
                progress(role, res)
    finally:
        remove_probe_run(state_root, run_id, wt)
    return out


def _receipt(path: str | None) -> dict:
    import json
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, TypeError, ValueError):
        return {}


def remove_probe_run(state_root: str, run_id: str, worktree: str) -> None:
    """Everything doctor's probe cells made: what `agnsup cleanup --run` reclaims (cgroups, temp dirs,
    locks, change records), then the run's journal rows (the journal's own prune: a `pruned` row keeps
    each id taken), its cells' directories and receipts, the throwaway worktree and its caches."""
    import shutil
    from .. import cancel
    from ..errors import AgnsupError
    from ..locks import worktree_key
    from ..store.state import StateRoot
    state = StateRoot(state_root)
    try:
        if state.exists():
            try:
                cancel.cleanup(state, run_id)
            except AgnsupError:
                pass  # no cell was ever journaled (all refused), or one still runs: pruned below all the same
            j = state.journal()
            try:
                keys = {(r["run_id"], r["cell_id"]): (r["ended_at"], r["receipt_path"]) for r in j.cells(run_id)
                        if r["state"] in cancel.TERMINAL_CELL}
                keys.update({(x["run_id"], x["cell_id"]): (None, None) for x in j.refusals(run_id)
                             if x.get("cell_id")})
                if keys:
                    j.prune([(*k, *v) for k, v in keys.items()], 0.0)  # 0: no sweep of older rows
            finally:
                j.close()
    finally:
        shutil.rmtree(os.path.join(state_root, "cells", run_id), ignore_errors=True)
        shutil.rmtree(os.path.join(state_root, "caches", f"worktree-{worktree_key(worktree)}"), ignore_errors=True)
        shutil.rmtree(worktree, ignore_errors=True)
