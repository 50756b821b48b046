"""The policy compiler: role policy + CellSpec -> ExecutionPlan (plan.py).

The backend re-checks the plan; a plan that cannot be honoured fails before the command runs.
"""
from __future__ import annotations

import os
from contextlib import suppress

from .errors import SetupError, UsageError
from .linux.host import (all_homes, exists, in_private_dir, invoking_homes, invoking_homes_safe, isdir, isfile,
                         lexists, outermost, passwd_homes, realpath, stat_mode, under)
from .plan import REDUCED_LOSS, ExecutionPlan
from .spec import CellSpec
from .store.state import named_run

def _expand(path: str, home: str) -> str:
    return os.path.join(home, path[2:]) if path == "~" or path.startswith("~/") else path


# A worktree a cell may write is never one of these or an ancestor of one (nor inside the first group).
SYSTEM_TREES = ("/etc", "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/boot", "/proc", "/sys",
                "/dev", "/run", "/var/run")
SYSTEM_TOPS = ("/opt", "/var", "/var/lib", "/var/tmp", "/var/log", "/var/cache", "/var/spool", "/srv", "/root",
               "/home", "/tmp", "/mnt", "/media", "/snap")


_HOME_ROOTS: dict = {}  # "of": the passwd_homes list it was made from, "roots": what it gave


def _homes_and_home_roots() -> list[str]:
    """Every home in /etc/passwd and each one's parent (/home, /var/lib, ...), as written (the
    invoking user's homes are added as real paths by worktree_refusal)."""
    homes = passwd_homes()
    if _HOME_ROOTS.get("of") is not homes:  # a new list whenever /etc/passwd changed (passwd_homes' cache)
        found = {q for h in homes for q in (h, os.path.dirname(h))}
        found.discard("/")
        _HOME_ROOTS.update(of=homes, roots=sorted(found))
    return _HOME_ROOTS["roots"]


def worktree_refusal(wt: str, state_root: str, other_roots=(), env=None) -> str | None:
    """Why a cell may not have `wt` (a real path) as its writable worktree, or None: "/", a
    system directory or an ancestor of one (a cell could rewrite the host: /etc, /opt),
    a home or a home root (every user's keys), a state root or inside one. `other_roots`: real paths, as
    StateRoot.other_roots gives them (resolved once per controller, not per cell)."""
    if wt == "/":
        return "is the root of the file system"
    for d in (*SYSTEM_TREES, *SYSTEM_TOPS, *_homes_and_home_roots(), *invoking_homes_safe(env)):
        if under(d, wt):
            return f"is the system or home directory {d}" if d == wt else f"holds the system or home directory {d}"
    for d in SYSTEM_TREES:
        if under(wt, d):
            return f"lies inside the system directory {d}"
    # (a worktree holding a state root is allowed: the root is masked inside it, the mask goes last)
    for r in (realpath(state_root), *other_roots):
        if under(wt, r):
            return f"is or lies inside the state root {r}"
    return None


_RUNTIME: dict = {}  # (sys.executable, sys.prefix, sys.base_prefix, @runtime wanted) -> runtime_paths


def runtime_paths(policy) -> list[str]:
    """What a cell needs of the interpreter running agnsup: the venv, the
    interpreter's real prefix (a venv's python is often a symlink into a
    pyenv/asdf tree under the home), and the @runtime PATH directory.

    Resolved once per controller (issue 29, fifth round: ~25 lstat and 3 readlink a cell, twice): these are
    the controller's own static paths, the interpreter it runs, keyed by what names them. A symlink among
    them swapped later changes what the controller itself executes, not what a cell is given of the host."""
    import sys
    key = (sys.executable, sys.prefix, sys.base_prefix, "@runtime" in policy.env.path)
    found = _RUNTIME.get(key)
    if found is None:
        paths = [sys.prefix, sys.base_prefix, os.path.dirname(os.path.realpath(sys.executable))]
        if key[3]:
            paths.append(os.path.dirname(sys.executable))
        found = _RUNTIME[key] = [os.path.realpath(p) for p in paths]
    return list(found)


def _closed_ancestors(paths, hidden: list[str]) -> list[str]:
    """The directories above `paths` that only their owner may enter (no search bit for others) and
    that no hidden home covers: a mapped cell, a uid that owns nothing on the host, could not reach a
    worktree or runtime below them. They are hidden like homes (an empty tmpfs that may be entered,
    with the mount points of what lies below): the cell reaches what it needs, never their other entries."""
    out: list[str] = []
    seen: set[str] = set()  # a directory above several of `paths` is looked at once
    for p in paths:
        d = os.path.dirname(p)
        while d not in ("/", "") and d not in seen:
            seen.add(d)
            if not in_private_dir(d) and not any(under(d, h) for h in hidden):
                with suppress(OSError):
                    if not stat_mode(d) & 0o001:  # the ancestors of a walked real path: from its walk
                        out.append(d)
            d = os.path.dirname(d)
    return outermost(out)


def _home_ops(fs, policy, home: str, wt: str, interpreter, mapped: bool = False) -> tuple[list, list, list[str],
                                                                                         list[str]]:
    """(clones, placements, hidden, exposed) for filesystem.home: hides first,
    then attaches; compile_plan sorts them outermost first with the /tmp and
    worktree attaches. "hidden" hides every home (all_homes), the invoking user's
    checked as before; `mapped`: also the closed directories a mapped cell must cross."""
    mine = invoking_homes()
    ro_clones: list = []
    ro_places: list = []
    if fs.home == "ro":
        # The invoking user's home stays visible, never writable (matters when filesystem.root = "rw");
        # every other home is still hidden.
        # A mapped cell reads it through its id map (it owns nothing on the host): home = "ro" opts in.
        if fs.root != "ro" or mapped:
            keys = [f"home{i}" for i in range(len(mine))]
            ro_clones = [("idclone" if mapped else "clone", h, k, True) for h, k in zip(mine, keys)]
            ro_places = [("attach", h, k) for h, k in zip(mine, keys)]
        homes = outermost(h for h in all_homes() if not any(under(h, m) or under(m, h) for m in mine))
    else:
        homes = outermost(mine + all_homes())
    wanted = runtime_paths(policy) + list(interpreter) + [realpath(_expand(p, home)) for p in fs.home_allow] \
        + [realpath(p) for p in fs.get("unix_sockets", ())]
    if mapped:
        shown = homes + (mine if fs.home == "ro" else [])
        homes = outermost(homes + _closed_ancestors([wt] + [p for p in wanted if exists(p)], shown))
    if not homes:
        return ro_clones, ro_places, [], []
    expose = outermost(p for p in wanted
                        if any(under(p, h) and p != h for h in homes) and exists(p)
                        and not under(p, wt) and not under(p, "/tmp"))
    keys = [f"expose{i}" for i in range(len(expose))]
    clones = [("clone", p, k, True) for p, k in zip(expose, keys)]
    targets = [(p, isdir(p)) for p in expose] + [(wt, True)]
    places = [("hide", h, "", True, tuple((p, d) for p, d in targets if under(p, h) and p != h))
              for h in homes]  # each home hidden, with the mount points made inside its tmpfs
    places += [("attach", p, k) for p, k in zip(expose, keys)]
    return ro_clones + clones, ro_places + places, homes, expose


def compile_plan(spec: CellSpec, policy, state_root: str, host: dict, other_roots: tuple = ()) -> ExecutionPlan:
    """The plan for `spec` under `policy` (policy.Frozen). Pure: `host` is what this
    host offers ({protection: None or why not}, linux/host.protections());
    `other_roots`: the host's other state roots (StateRoot.other_roots), hidden too."""
    fs = policy.filesystem
    wt = spec.worktree or spec.workdir
    reduced, host = _reduced(policy, spec, host)
    if "mount_namespace" in reduced:
        return _reduced_plan(spec, policy, state_root, host, reduced)
    state_real = realpath(state_root)
    if wt == state_real or wt.startswith(state_real + "/"):
        raise UsageError(f"workdir {wt} is inside the state root {state_real}, which cells never see")
    cell_dir = os.path.join(state_root, "cells", spec.run_id, spec.cell_id)
    tmpdir = os.path.join(cell_dir, "tmp")
    home = os.path.expanduser("~")
    deny = [realpath(_expand(p, home)) for p in fs.deny]
    caches = cache_dirs(fs, spec, state_root)
    devices = host_devices(fs, spec.role)
    conf = _confinement(policy, spec, wt, tmpdir, home, fs.worktree == "rw", host,
                        [h for h, _, _ in caches] + [p for p, _ in devices], state_root)
    home_clones, home_places, hidden, exposed = _home_ops(fs, policy, home, wt, spec.interpreter,
                                                          bool(conf.get("mapped")))
    # A runtime installed under /tmp (a CI checkout, a throwaway venv) would vanish
    # behind the cell's private /tmp: it comes back read-only inside it.
    tmp_rt = outermost(p for p in runtime_paths(policy) + list(spec.interpreter)
                        if under(p, "/tmp") and p != "/tmp" and isdir(p) and not under(p, wt))
    tmp_keys = [f"tmprt{i}" for i in range(len(tmp_rt))]
    home_clones += [("clone", p, k, True) for p, k in zip(tmp_rt, tmp_keys)]
    home_places += [("attach", p, k) for p, k in zip(tmp_rt, tmp_keys)]
    offline_clones, offline_places, shared = _offline_resolver(policy, spec.role, state_root)
    home_clones += offline_clones
    home_places += offline_places
    trust_clones, trust_places = _secret_trust(spec, tmpdir)
    home_clones += trust_clones
    home_places += trust_places
    allowed_sockets = _listed_sockets(fs, spec.role)
    run_dirs, run_shown = _private_run(policy, allowed_sockets)
    run_keys = [f"run{i}" for i in range(len(run_shown))]
    home_clones += [("clone", p, k, True) for p, k in zip(run_shown, run_keys)]
    written = "idclone" if conf.get("mapped") else "clone"  # what a mapped cell writes goes through its id map
    home_clones += [(written, h, f"cache{i}", False) for i, (h, _, _) in enumerate(caches)]
    home_places += [("attach", c, f"cache{i}") for i, (_, c, _) in enumerate(caches)]
    # Clones first, while their mounts are still read-write and nothing covers them.
    # The cell's /tmp is a tmpfs of limits.tmp_max (off the state root's disk) filled from the staged tmpdir,
    # attached under the key "tmp": as root the controller makes it (and measures it at the end); a normal
    # user's controller cannot make one outside the cell: its child does (tmpcopy), unmeasured.
    tmp_tmpfs = bool(host["_root"])
    changes = changes_mode(fs, spec, wt, state_root, host, policy.isolation, conf)
    # a capturing cell's layer directory (its overlay's upper and work), cloned while its mount is read-write
    layer = [("clone", changes["layer"], "layer", False)] if changes["mode"] == "at_exit" else []
    ops: list[tuple] = [*([] if tmp_tmpfs else [("tmpcopy", tmpdir, "tmp", False, (policy.limits.tmp_max,))]),
                        (written, wt, "worktree", fs.worktree == "ro"), *layer,
                        *home_clones]
    ops.append(("root", "/", "", fs.root == "ro"))
    shm_max = policy.limits.shm_max or (policy.limits.memory_max // 2 if policy.limits.memory_max else SHM_DEFAULT)
    ops.append(("dev", "/dev", str(shm_max), True, tuple(p for p, _ in devices)))
    # Outermost first, by depth; the sort is stable and at equal depth hides come
    # before attaches and the home's attaches before the worktree's, so a worktree
    # that is the home itself lands on top.
    places = home_places + [("attach", "/tmp", "tmp"), ("attach", wt, "worktree")]
    # Files tools run on their own (git hooks and config, .vscode/, .mcp.json, ...) bound
    # read-only onto themselves once the worktree is attached, deeper after shallower.
    protected: list[str] | str = "all"
    lifted = list(fs.writable_protected)
    if fs.worktree == "rw":
        from . import protect
        protect_ops, protected = protect.mount_ops(wt, protect.scan(wt), lifted)
        places += protect_ops
    places.sort(key=lambda op: op[1].count("/"))
    if layer:
        # right on the worktree's attach (its lower layer), before protect (which binds paths of the
        # overlay's view) and the masks
        at = places.index(("attach", wt, "worktree")) + 1
        places.insert(at, ("overlay", wt, "layer", False, changes.pop("options")))
    # /run after everything else is in place (a worktree of "/" would otherwise bring the host's back),
    # with the mount points of what comes back beneath it made inside its tmpfs
    in_run = [op for op in places if op[0] == "attach" and any(under(op[1], d) and op[1] != d for d in run_dirs)]
    ops.extend(op for op in places if op not in in_run)
    in_run += [("attach", p, k) for p, k in zip(run_shown, run_keys)]
    for d in run_dirs:
        ops.append(("empty", d, "", True, tuple((op[1], os.path.isdir(op[1])) for op in in_run if under(op[1], d))))
    ops.extend(sorted(in_run, key=lambda op: op[1].count("/")))
    # Masks go last so they also cover a deny path or the state root that
    # happens to lie inside the re-attached worktree (or a re-exposed path).
    # Another root under /tmp or /dev/shm is out of sight already (the cell's are its own) unless
    # something re-attached there shows it: no mount for it (a test session has thousands).
    shown_again = [wt, *tmp_rt]
    masked = [p for p in deny if lexists(p)] + [state_real] + \
        [p for p in other_roots if p != state_real and not under(state_real, p) and not under(wt, p)
         and not (in_private_dir(p) and not any(under(p, s) for s in shown_again)) and lexists(p)]
    ops.extend(("mask", p) for p in masked)
    sockets = _seen_sockets(shown=[wt, *tmp_rt, *exposed], hidden=[*hidden, *run_dirs, *masked],
                            allowed=allowed_sockets)
    ops.extend(("mask", p) for p in sockets)
    return _plan(policy, spec, reduced, conf, home, wt, None,
                 cell_dir=cell_dir, tmpdir=tmpdir, mount_ops=ops, tmp_tmpfs=tmp_tmpfs, deny_masked=masked,
                 shared_files=shared,
                 home_hidden=hidden, home_exposed=exposed, caches=caches, devices=devices, shm_max=shm_max,
                 protected=protected, protected_lifted=lifted, run_private=run_dirs, run_shown=run_shown,
                 sockets_masked=sockets, sockets_allowed=allowed_sockets, changes=changes)


def _plan(policy, spec: CellSpec, reduced: dict, conf: dict, home: str, wt: str, links_tmpdir: str | None,
          **fields) -> ExecutionPlan:
    """What the full and the reduced plan fill alike; `fields`: the rest, where they differ."""
    fs, lim = policy.filesystem, policy.limits
    home_links, home_files, home_config = _home_config(fs, spec, home, wt)
    from .redact import config_of as redact_config  # plain data: nothing is compiled here
    spec, net = _reduced_network(spec, policy, reduced, conf)
    proxied = net in ("allowlist", "internal")
    if proxied:
        from .netpolicy import Rules
        conf["egress_rules"] = Rules.of(policy.network)
    return ExecutionPlan(
        spec=spec, new_netns=net in NETNS_MODES, network=net, reduced=list(reduced),
        network_pod=network_pod(policy, spec, net, conf),
        reduced_accepted=list(policy.isolation.get("reduced", ())),
        egress=policy.network.as_dict() if proxied else None,
        limits={k: lim[k] for k in ("memory_max", "pids_max", "cpu_weight", "cpu_max", "output_max", "tmp_max")},
        grace=float(lim.grace), timeout=spec.timeout if spec.timeout is not None else lim.timeout,
        worktree_mode=fs.worktree, policy_digest=policy.get("_digest", ""), home=fs.home,
        redact=redact_config(policy.governance), tmp_links=_runtime_links(spec, links_tmpdir) + home_links,
        tmp_files=home_files, home_config=home_config, **fields, **conf)


def changes_mode(fs, spec: CellSpec, wt: str, state_root: str, host: dict, iso, conf: dict) -> dict:
    """Whether this cell captures its worktree changes (filesystem.changes; docs/architecture.md
    "Reversible cells"): {"mode": "at_exit" (an overlay, the changes land when it ends) | "live"
    (writes go straight to the worktree) | "none" (a read-only worktree), "why": one line or None,
    "role": the role's value, "keep", "keep_bytes"; at_exit adds "layer" (the layer directory) and
    "options" (the overlay op's)}. Impossible here (host["_reversible"](state_root, wt) says why; a
    state root inside the worktree): live, named in not_in_force, or refused (SetupError) when the
    role requires "reversible", which also captures a long-lived cell."""
    role = fs.get("changes", "auto")
    asked = spec.changes or role  # the call's (CLI --changes, the API's changes=) over the role's
    out = {"role": role, "keep": fs.get("changes_keep", 200), "keep_bytes": fs.get("changes_keep_bytes", 2 << 30)}
    required = "reversible" in iso.require
    if fs.worktree != "rw":
        return {**out, "mode": "none", "why": "the worktree is read-only (role filesystem.worktree = \"ro\"): "
                "nothing to capture"}
    if asked == "live" and required:
        raise SetupError(f"role {spec.role} requires reversible: a live cell (changes = \"live\") is not",
                         step="require")
    if asked == "live":
        return {**out, "mode": "live", "why": "changes = \"live\" (this call)" if spec.changes
                else "role filesystem.changes = \"live\""}
    if asked == "auto" and spec.long_lived and not required:
        return {**out, "mode": "live", "why": "a long-lived cell (spawn) under filesystem.changes = \"auto\": "
                "its writes are seen as they happen"}
    state_real = realpath(state_root)
    why = f"the state root {state_real} lies inside the worktree" if under(state_real, wt) else None
    probe = host.get("_reversible")
    if why is None and probe is not None:
        why = probe(state_root, wt)
    if why is not None:
        if required:
            raise SetupError(f"role {spec.role} requires reversible, which is not available here: {why}",
                             step="require")
        conf["not_in_force"].append(f"reversible (the cell's writes land live, uncaptured): {why}")
        return {**out, "mode": "live", "why": why}
    from .changes import layer_dir
    if not host["_root"]:
        options = (("userxattr",),)  # mounted inside the cell's own user namespace: user.overlay.* xattrs
    elif conf.get("mapped"):
        options = (("shift", conf["mapped"]["uid"], conf["mapped"]["gid"]),)
    else:
        options = ()
    if not required:
        options += (("live_ok",),)  # a kernel that refuses the overlay here: the cell runs live, and says so
    return {**out, "mode": "at_exit", "why": None, "layer": layer_dir(state_root, spec.run_id, spec.cell_id),
            "options": options}


SHM_DEFAULT = 64 << 20  # a role with neither limits.shm_max nor memory_max: Docker's default /dev/shm


def host_devices(fs, role: str) -> list[tuple[str, str]]:
    """filesystem.devices as (path, kind): each must be a device node on this host now, or the
    cell is refused (exit 125) before anything is journaled or created."""
    import stat
    out = []
    for p in fs.devices:
        try:
            st = os.lstat(p)
        except OSError as e:
            why = "does not exist on this host" if isinstance(e, FileNotFoundError) else f"cannot be read: {e.strerror}"
            raise SetupError(f"role {role}: filesystem.devices lists {p}, which {why}", step="devices") from None
        if stat.S_ISLNK(st.st_mode):
            raise SetupError(f"role {role}: filesystem.devices lists {p}, a symlink to {os.path.realpath(p)}: list "
                             "the device node itself", step="devices")
        if not (stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)):
            raise SetupError(f"role {role}: filesystem.devices lists {p}, which is not a device node (a character "
                             "or block device)", step="devices")
        if p not in (q for q, _ in out):
            out.append((p, "character" if stat.S_ISCHR(st.st_mode) else "block"))
    return out


# Where host daemons keep their sockets: every cell gets its own, empty and read-only.
RUN_DIRS = ("/run", "/var/run")
RESOLV_CONF = "/etc/resolv.conf"
NSSWITCH = "/etc/nsswitch.conf"



def _listed_sockets(fs, role: str) -> list[str]:
    """filesystem.unix_sockets as real paths, each an existing socket now; anything else
    refuses the cell (a SetupError naming the path)."""
    import stat
    out = []
    for p in fs.get("unix_sockets", ()):
        real = realpath(p)
        try:
            mode = os.stat(real).st_mode
        except OSError as e:
            raise SetupError(f"role {role}: filesystem.unix_sockets lists {p}: {e.strerror}", step="unix_sockets") \
                from None
        if not stat.S_ISSOCK(mode):
            raise SetupError(f"role {role}: filesystem.unix_sockets lists {p}, which is not a socket",
                             step="unix_sockets")
        if in_private_dir(real):
            raise SetupError(f"role {role}: filesystem.unix_sockets lists {p}, under /tmp or /dev/shm, which every "
                             "cell has a private one of; listen elsewhere (e.g. under /run)", step="unix_sockets")
        out.append(real)
    return out


def _private_run(policy, allowed_sockets: list[str]) -> tuple[list[str], list[str]]:
    """(the run directories a cell gets an empty read-only tmpfs on, the host paths that come
    back into them read-only): /run, and /var/run when it is a directory of its own (not the
    usual link to /run). Back come the role's listed sockets there and, for a role whose
    names resolve through the host's resolver (not deny/loopback: _offline_resolver binds
    its own file), /etc/resolv.conf's target when it lies there (systemd-resolved's stub)."""
    run_dirs = [d for d in RUN_DIRS if _lstat_is_dir(d)]  # a directory, not a link (one lstat)
    shown = [p for p in allowed_sockets if any(under(p, d) for d in run_dirs)]
    if policy.network.mode not in ("deny", "loopback"):
        resolv = realpath(RESOLV_CONF)
        if any(under(resolv, d) and resolv != d for d in run_dirs) and isfile(resolv):
            shown.append(resolv)
    return run_dirs, sorted(set(shown))


def _lstat_is_dir(path: str) -> bool:
    """os.path.isdir(path) and not os.path.islink(path), in one lstat."""
    import stat
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _seen_sockets(shown: list[str], hidden: list[str], allowed: list[str]) -> list[str]:
    """The host's bound pathname sockets a cell would see (linux/unixsock.py): not under a
    directory it has its own of (/tmp, /dev/shm) unless shown again there, not under what
    is hidden or masked anyway unless shown again, not listed by the role."""
    from .linux import unixsock
    from .linux.host import prefixes
    out = []
    shown_at, shown_in = set(shown), prefixes(shown)  # under(p, s) for some s: p is one, or lies in one
    hidden_at, hidden_in = set(hidden), prefixes(hidden)
    for p in sorted(unixsock.bound_paths()):
        again = p in shown_at or p.startswith(shown_in)
        if p in allowed or (not again and (in_private_dir(p) or p in hidden_at or p.startswith(hidden_in))):
            continue
        if unixsock.is_socket(p):
            out.append(p)
    return out


_TMP_REL: dict = {}  # a path in the cell's /tmp -> relative to it (constants of spec.py: relpath once each)


def _tmp_rel(path: str) -> str:
    rel = _TMP_REL.get(path)
    if rel is None:
        from .spec import CELL_TMP
        rel = _TMP_REL[path] = os.path.relpath(path, CELL_TMP)
    return rel


# Where each tool keeps its cache under the cell's HOME (their defaults: nothing to configure).
CACHE_PATHS = {"pip": (".cache/pip",), "npm": (".npm",), "cargo": (".cargo/registry", ".cargo/git")}


def cache_dirs(fs, spec: CellSpec, state_root: str) -> list[tuple[str, str, str]]:
    """filesystem.cache: [(host dir, path in the cell, that path relative to the cell's
    /tmp: its mount point, made by the broker)]. The host dirs live under the
    state root (masked in every cell), so the cache is writable through its own mount
    and nowhere else; the broker creates them."""
    if fs.cache == "none":
        return []
    from .locks import worktree_key
    from .spec import CELL_HOME
    scope = f"worktree-{worktree_key(spec.worktree or spec.workdir)}" if fs.cache == "worktree" \
        else f"role-{spec.role}"
    base = os.path.join(state_root, "caches", scope)
    out = []
    for tool in fs.cache_tools:
        for rel in CACHE_PATHS[tool]:
            cell = os.path.join(CELL_HOME, rel)
            out.append((os.path.join(base, rel.replace("/", "-").lstrip(".")), cell, _tmp_rel(cell)))
    return out


# Name services that ask the network; a cell without network keeps the others (files, myhostname, ...).
NETWORK_NSS = ("dns", "resolve", "mdns", "mdns4", "mdns6", "mdns_minimal", "mdns4_minimal", "mdns6_minimal",
               "wins", "nis", "nisplus", "ldap", "sss")


UNREACHABLE_NAMESERVER = "192.0.2.1"


def _offline_resolver(policy, role: str, state_root: str) -> tuple[list, list, list]:
    """deny/loopback: name resolution fails at once, with "not found" rather than "try
    again" (which pip and npm retry for 10-70 s): the cell's /etc/nsswitch.conf looks
    hosts up in files, then dns, then files again, and its /etc/resolv.conf names a server
    no cell can reach (the query has no route: the kernel counts it). (clones, attaches,
    shared files): bound read-only over the host's (their real paths: /etc/resolv.conf is often a
    symlink into /run) from a copy under
    <state>/offline named by its content, written once for every cell that binds the same text: not two
    directories and two files made and removed on the state root's disk per cell (issue 29: on an ext4
    without a journal each new inode costs ~0.3 ms while many were deleted in the last 30 s)."""
    if policy.network.mode not in ("deny", "loopback"):
        return [], [], []
    why = f"# agnsup: role {role} has no network (network.mode = \"{policy.network.mode}\")\n"
    from .util.filememo import read_text
    host_text = read_text(NSSWITCH)  # one stat a cell while it keeps its identity
    texts = _OFFLINE_TEXTS.get((why, host_text))
    if texts is None:  # a pure function of the two: made once per role and nsswitch.conf's text
        if len(_OFFLINE_TEXTS) >= 16:
            _OFFLINE_TEXTS.clear()
        texts = _OFFLINE_TEXTS[(why, host_text)] = _offline_texts(why, host_text)
    clones, places, shared = [], [], []
    for name, text, digest in texts:
        target = realpath(os.path.join("/etc", name))
        if not isfile(target) or under(target, "/tmp"):
            continue
        source = os.path.join(state_root, "offline", f"{digest}-{name}")
        shared.append((source, text))
        clones.append(("clone", source, f"offline-{name}", True))
        places.append(("attach", target, f"offline-{name}"))
    return clones, places, shared


_OFFLINE_TEXTS: dict = {}  # (the role's line, nsswitch.conf's text) -> _offline_texts


def _offline_texts(why: str, host_text: str | None) -> list[tuple[str, str, str]]:
    """[(name under /etc, the cell's text, its digest's first 24 hex digits)] for _offline_resolver."""
    # A server no cell can reach (RFC 5737, documentation only): a query fails at once, and the kernel counts
    # it in the cell's namespace (Ip OutNoRoutes: the network hint's evidence, linux/netns.py).
    texts = {"resolv.conf": why + f"# {UNREACHABLE_NAMESERVER}: unreachable on purpose (a lookup fails at once)\n"
                                  f"nameserver {UNREACHABLE_NAMESERVER}\noptions timeout:1 attempts:1\n"}
    if host_text is not None:
        lines = host_text.splitlines()
        for i, line in enumerate(lines):
            key, colon, rest = line.partition(":")
            if colon and key.strip() == "hosts":
                kept = [w for w in rest.split() if w.split("[")[0] not in NETWORK_NSS and not w.startswith("[")]
                # dns asks the unreachable server (the kernel counts the try); `files` after it makes the
                # last answer "not found" (EAI_NONAME), never dns's "try again" (EAI_AGAIN), which clients retry
                lines[i] = "hosts: " + " ".join([*(kept or ["files"]), "dns", "files"])
        texts["nsswitch.conf"] = why + "\n".join(lines) + "\n"
    from .util.digest import sha256  # not hashlib: libcrypto, ~4 ms on every run of a role without network
    return [(name, text, sha256(text.encode()).hexdigest()[:24]) for name, text in texts.items()]


def _secret_trust(spec: CellSpec, tmpdir: str) -> tuple[list, list]:
    """A cell with secrets (agnsup/secrets.py): the bundle the broker writes in its /tmp (the host's system
    bundle + the controller CA's certificate) bound read-only over the host's system bundle, where clients that
    read no variable look. (clones, attaches); none when the host has no such file (the variables still point
    at the bundle)."""
    if not getattr(spec, "secrets", None):
        return [], []
    from .secrets import CA_BUNDLE_REL, SYSTEM_BUNDLE
    target = realpath(SYSTEM_BUNDLE)
    if not isfile(target) or under(target, "/tmp"):
        return [], []
    return [("clone", os.path.join(tmpdir, CA_BUNDLE_REL), "secret-ca", True)], [("attach", target, "secret-ca")]


def _home_config(fs, spec: CellSpec, home: str, wt: str) -> tuple[list, list, dict]:
    """(links, files, report) that put tool configuration where tools look: the cell's
    HOME. home_allow paths inside the user's home appear there too, as links to where
    the cell sees them (their real paths); toolconfig writes the filtered files."""
    from . import toolconfig
    from .spec import CELL_HOME
    cell_home = _tmp_rel(CELL_HOME)
    links, linked = [], set()
    for p in fs.home_allow:
        full = _expand(p, home)
        if under(full, home) and full != home and os.path.exists(full):
            rel = os.path.relpath(full, home)
            links.append((os.path.join(cell_home, rel), realpath(full)))
            linked.add(rel)
    include = next((realpath(os.path.join(home, r)) for r in (".gitconfig", os.path.join(".config", "git",
                                                                                                   "config"))
                    if r in linked), None)
    allowed = [realpath(_expand(p, home)) for p in fs.home_allow]

    def shown(path: str) -> bool:  # what of the home the cell sees: its worktree, home_allow, all of it (ro)
        real = realpath(path)
        return fs.home != "hidden" or under(real, wt) or any(under(real, a) for a in allowed)
    files, report = toolconfig.home_files(fs.home_config, home, wt, include, shown)
    files = [(os.path.join(cell_home, rel), text) for rel, text in files]
    # the generated .gitconfig includes a linked one; for the others the user's own file wins
    links = [(rel, t) for rel, t in links if not rel.endswith(os.sep + ".gitconfig") or not include
             or "git" not in fs.home_config]
    files = [(rel, text) for rel, text in files if rel not in {r for r, _ in links}]
    if spec.tool_env_dropped:
        report["env"] = {"taken": [], "dropped": [f"{k} (holds credentials)" for k in spec.tool_env_dropped]}
    return links, files, report


def _runtime_links(spec: CellSpec, tmpdir: str | None = None) -> list[tuple]:
    """@runtime in the cell is spec.RUNTIME_BIN, a directory in its /tmp linking agnsup's own commands
    (`tmpdir`: a reduced cell's /tmp is that directory itself)."""
    from .spec import CELL_TMP, RUNTIME_BIN, RUNTIME_COMMANDS, runtime_host_dir
    where = RUNTIME_BIN if tmpdir is None else tmpdir + RUNTIME_BIN[len(CELL_TMP):]
    if where not in spec.env.get("PATH", "").split(":"):
        return []
    rel = _tmp_rel(RUNTIME_BIN)
    return [(os.path.join(rel, c), os.path.join(runtime_host_dir(), c)) for c in RUNTIME_COMMANDS]


# Network modes that give the cell a namespace of its own with only lo up; allowlist
# and internal reach out only through the controller's proxy (agnsup/egress/).
NETNS_MODES = ("deny", "loopback", "allowlist", "internal")
POD_MODES = ("deny", "loopback")  # allowlist/internal keep a namespace per cell: its proxy listener is the cell's


def network_pod(policy, spec: CellSpec, net: str, conf: dict) -> bool:
    """Does the cell join its agent's pod (agnsup/pod.py: one network namespace for the agent's cells)? For
    network.mode deny and loopback, unless the role says network.pod = false; not for the run "default"
    (every call that names no run: unrelated commands at a shell would share one network). A normal user's
    cell of a pod joins the pod's user namespace instead of making its own (docs/isolation.md "Pods")."""
    return net in POD_MODES and bool(policy.network.get("pod", True)) and named_run(spec.run_id)
# The /dev/null class: devices every program may open for writing. The cell's own devpts and /dev/shm
# exist only in its namespace: their rules are added in the child (process/steps.py).
WRITABLE_DEVICES = ["/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom", "/dev/tty"]
def _confinement(policy, spec: CellSpec, wt: str, tmpdir: str, home: str, worktree_rw: bool, host: dict,
                 cache_writable=(), state_root: str = "") -> dict:
    from .linux.sys import CAP_NAMES
    iso, proc_ = policy.isolation, policy.process
    wanted = {"seccomp": iso.seccomp, "landlock": iso.landlock, "no_new_privs": iso.no_new_privs,
              "pid_namespace": iso.pid_namespace, "landlock_scopes": iso.landlock, "capabilities": True}
    for p in iso.require:
        if host.get(p):
            raise SetupError(f"role {spec.role} requires {p}, which is not available here: {host[p]}",
                             step="require")
    missing = [f"{p}: {host[p]}" for p, on in wanted.items() if on and host.get(p) and p != "capabilities"]
    if wanted["pid_namespace"] and host["pid_namespace"] and "pid_namespace" not in iso.get("reduced", ()):
        raise SetupError(f"role {spec.role} asks for a PID namespace: {host['pid_namespace']}", step="pid_namespace")
    root = host["_root"]
    out: dict = {"not_in_force": missing, "pid_namespace": bool(wanted["pid_namespace"]),
                 "no_new_privs": bool(wanted["no_new_privs"]), "require_limits": "limits" in iso.require}
    if spec.on_controller_death == "kill":
        # the kernel's dead-man switch: a PID namespace dies with its init, and the init
        # with the controller (PR_SET_PDEATHSIG); without PID namespaces, the leader only
        if host["pid_namespace"] is None:
            out["pid_namespace"], out["dies_with_controller"] = True, "namespace"
        else:
            out["dies_with_controller"] = "leader"
            missing.append(f"on_controller_death kill (the whole tree): {host['pid_namespace']}")
    if wanted["seccomp"] and not host["seccomp"]:
        out["seccomp_refuse"] = tuple(g for g, allowed in (("ptrace", iso.allow_ptrace), ("mount", iso.allow_mount))
                                      if not allowed)
    if wanted["landlock"] and not host["landlock"]:
        writable = [tmpdir] + ([wt] if worktree_rw else [])
        writable += [realpath(_expand(p, home)) for p in iso.writable] + list(cache_writable)
        out["landlock_writable"] = writable + WRITABLE_DEVICES
        out["landlock_abi"] = host["_abi"]
    uid = gid = None
    if proc_.user is not None:
        if not root:
            raise SetupError(f"role {spec.role} sets process.user: agnsup must run as root to change the "
                             "cell's uid", step="user")
        uid, gid = _ids(proc_.user, proc_.group, spec.role)
    out["uid"], out["gid"] = uid, gid
    if root and uid is None and not iso.host_root:
        # home = "ro" shows a mapped cell the invoking user's homes through its id map too (_home_ops)
        homes = invoking_homes() if policy.filesystem.home == "ro" else []
        out["mapped"] = _mapped(spec, [wt, state_root if cache_writable else "", *homes], host, missing,
                                "mapped_uid" in iso.require)
    if root:
        keep = [] if uid is not None else sorted(CAP_NAMES.index(c) for c in iso.capabilities)
        out["cap_keep"] = keep
        out["drop_caps"] = [c for c in range(host["_cap_last"] + 1) if c not in keep]
    else:
        # the capabilities a user namespace gives the child (for its mounts) leave the bounding set
        # too; the command, not root in there, has none after execve (capabilities(7))
        # (a reduced cell that has none of its namespaces has no user namespace either: nothing to drop)
        own = host.get("_own_namespaces", True)
        out["user_namespace"] = own
        out["drop_caps"] = list(range(host["_cap_last"] + 1)) if own else []
    return out


def _mapped(spec: CellSpec, idmapped: list[str], host: dict, missing: list, required: bool) -> dict | None:
    """A root controller's cell as uid 0 of the cells' user namespace, when this host can: the namespace
    (host["mapped_uid"]) and id-mapped mounts of the file systems in `idmapped` (the worktree's, the
    caches', a home = "ro" home's; host["_idmap"](path), probed once per device). Else None: the cell runs
    as host root, and why is named in not_in_force (refused when the role requires mapped_uid)."""
    why = host.get("mapped_uid", "the host's facts (linux/host.protections) do not say")
    probe = host.get("_idmap")
    for path in idmapped:
        if why is None and path and probe is not None:
            why = probe(path)
    if why is not None:
        if required:
            raise SetupError(f"role {spec.role} requires mapped_uid, which is not available here: {why}",
                             step="require")
        missing.append(f"mapped_uid (the cell runs as host root): {why}")
        return None
    from .linux.userns import cell_range
    uid, gid, count = cell_range()
    return {"uid": uid, "gid": gid, "count": count}


def _ids(user, group, role: str) -> tuple[int, int]:
    import grp
    import pwd
    try:
        pw = pwd.getpwnam(user) if isinstance(user, str) else pwd.getpwuid(user)
        uid, primary = pw.pw_uid, pw.pw_gid
    except KeyError:
        if isinstance(user, str):
            raise SetupError(f"role {role}: process.user {user!r} is not a user on this host", step="user") from None
        uid, primary = user, user
    if group is None:
        return uid, primary
    if isinstance(group, int):
        return uid, group
    try:
        return uid, grp.getgrnam(group).gr_gid
    except KeyError:
        raise SetupError(f"role {role}: process.group {group!r} is not a group on this host", step="user") from None


# -- reduced cells (isolation.reduced; docs/isolation.md, "Reduced cells") ------------------------------

NAMESPACE_PIECES = ("mount_namespace", "network_namespace", "pid_namespace")


REDUCIBLE_ORDER = ("mount_namespace", "network_namespace", "pid_namespace", "cgroup")  # policyfile.REDUCIBLE


def reduced_pieces(policy=None, host: dict | None = None, backend=None) -> list[str]:
    """The pieces a cell of `policy` (policy.Frozen; None: a role listing all four) runs without on this
    host: those its
    isolation.reduced lists that the host refuses (host["_namespaces"]() or process.namespaces.namespaces_refused;
    "cgroup" when `backend`, or host["backend"], has no tree). [] for a role that lists none, or on a full host. For
    `agnsup doctor`'s `reduced:` line; a cell's receipt has the same under `reduced`."""
    accepted = list(REDUCIBLE_ORDER if policy is None else policy.isolation.get("reduced", ()))
    if not accepted:
        return []
    host = dict(host or {})
    if "_namespaces" not in host:
        from .process.namespaces import namespaces_refused
        host["_namespaces"] = namespaces_refused
    backend = backend if backend is not None else host.get("backend")
    out = [p for p in NAMESPACE_PIECES if p in accepted and (_refused_here(host).get(p))]
    if "mount_namespace" in out and "pid_namespace" in accepted and "pid_namespace" not in out:
        out.append("pid_namespace")  # its /proc needs the mount namespace
    if "cgroup" in accepted and backend is not None and not backend.trees:
        out.append("cgroup")
    return [p for p in (*NAMESPACE_PIECES, "cgroup") if p in out]


def _refused_here(host: dict) -> dict:
    probe = host.get("_namespaces")
    return probe() if probe is not None else {}


def _reduced(policy, spec: CellSpec, host: dict) -> tuple[dict, dict]:
    """({piece: why} this cell runs without, the host facts as the rest of the compiler must see them).
    Asked of the host only when the role lists isolation.reduced (a probe once per controller process:
    process.namespaces.namespaces_refused); a role that lists none costs nothing here."""
    accepted = policy.isolation.get("reduced", ())
    if not any(p in accepted for p in NAMESPACE_PIECES):
        return {}, host
    refused = _refused_here(host)
    out = {p: refused[p] for p in NAMESPACE_PIECES if p in accepted and refused.get(p)}
    if "mount_namespace" in out and "pid_namespace" not in out and not refused.get("pid_namespace"):
        if policy.isolation.pid_namespace or spec.on_controller_death == "kill":
            if "pid_namespace" not in accepted:
                raise SetupError(f"role {spec.role} accepts running without a mount namespace, which this host "
                                 f"refuses ({out['mount_namespace']}), but not without the PID namespace that needs "
                                 "one (its /proc); fix: isolation.reduced also lists \"pid_namespace\"",
                                 step="pid_namespace")
            out["pid_namespace"] = "a PID namespace needs the mount namespace for its /proc"
    if not out:
        return {}, host
    host = dict(host)
    if "pid_namespace" in out:
        host["pid_namespace"] = out["pid_namespace"]
    if "mount_namespace" in out:
        host["mapped_uid"] = "no mount namespace (a reduced cell): its worktree cannot be id-mapped"
        host["_reversible"] = lambda *_: "no mount namespace (a reduced cell): no overlay of the worktree"
    # a normal user's cell makes its namespaces in a user namespace of its own: none to make, none needed
    pid_wanted = policy.isolation.pid_namespace or spec.on_controller_death == "kill"
    host["_own_namespaces"] = "mount_namespace" not in out or (
        policy.network.mode in NETNS_MODES and "network_namespace" not in out) or (
        pid_wanted and "pid_namespace" not in out)
    return out, host


def _reduced_notes(reduced: dict, conf: dict) -> None:
    for p, why in reduced.items():
        conf["not_in_force"].append(f"{p} (reduced: {REDUCED_LOSS[p]}): {why}")


def _reduced_network(spec: CellSpec, policy, reduced: dict, conf: dict) -> tuple[CellSpec, str]:
    """(the spec, the network the cell has): the role's mode, or "host" for a reduced cell without a
    network namespace of its own (whose proxy variables would point at the host's loopback: dropped)."""
    from .util.record import replace
    _reduced_notes(reduced, conf)
    mode = policy.network.mode
    if "network_namespace" not in reduced or mode not in NETNS_MODES:
        return spec, mode
    conf["not_in_force"].append(f"network.mode {mode!r} (the cell has the host's network instead)")
    if mode in ("allowlist", "internal"):
        from .egress import proxy_env
        drop = set(proxy_env(policy.network.proxy_port))
        spec = replace(spec, env={k: v for k, v in spec.env.items() if k not in drop},
                       env_sources={k: v for k, v in spec.env_sources.items() if k not in drop})
    return spec, "host"


def _reduced_plan(spec: CellSpec, policy, state_root: str, host: dict, reduced: dict) -> ExecutionPlan:
    """The plan of a cell without a mount namespace (isolation.reduced lists it, the host refuses it):
    no mount operations; its /tmp is its directory under the state root (HOME, TMPDIR, @runtime point
    there), the only place besides the worktree (rw) that Landlock lets it write."""
    from .util.record import replace
    from .spec import CELL_TMP
    fs = policy.filesystem
    wt = spec.worktree or spec.workdir
    cell_dir = os.path.join(state_root, "cells", spec.run_id, spec.cell_id)
    tmpdir = os.path.join(cell_dir, "tmp")
    home = os.path.expanduser("~")

    def moved(v: str) -> str:  # a path in the cell's /tmp -> the same under tmpdir
        return tmpdir + v[len(CELL_TMP):] if under(v, CELL_TMP) else v
    env = {k: (":".join(moved(d) for d in v.split(":")) if k == "PATH" else moved(v) if k in ("HOME", "TMPDIR")
               else v) for k, v in spec.env.items()}
    spec = replace(spec, env=env, exe=moved(spec.exe))
    devices = host_devices(fs, spec.role)
    conf = _confinement(policy, spec, wt, tmpdir, home, fs.worktree == "rw", host, [p for p, _ in devices],
                        state_root)
    changes = changes_mode(fs, spec, wt, state_root, host, policy.isolation, conf)
    lost = []
    if fs.worktree == "rw":
        lost.append("protected paths (.git/hooks, .git/config, .vscode, ...) are writable like the rest of the "
                    "worktree")
    if fs.cache != "none":
        lost.append(f"filesystem.cache = {fs.cache!r} (no mount for the caches: they die with the cell)")
    if fs.deny:
        lost.append("filesystem.deny (" + ", ".join(fs.deny) + ") is readable")
    lost.append("the host's unix sockets are reachable (none masked, /run not private)")
    if fs.home == "hidden":
        lost.append("filesystem.home = \"hidden\": the homes are readable")
    if host["landlock"] or not policy.isolation.landlock:
        lost.append("writes outside the worktree and the cell's /tmp: nothing but the uid's own permissions "
                    "holds them (no Landlock)")
    conf["not_in_force"].extend(f"{x} (reduced: no mount namespace)" for x in lost)
    return _plan(policy, spec, reduced, conf, home, wt, tmpdir,
                 cell_dir=cell_dir, tmpdir=tmpdir, mount_ops=[], mount_namespace=False, tmp_tmpfs=False,
                 deny_masked=[], caches=[], devices=devices, shm_max=0, protected=[],
                 protected_lifted=list(fs.writable_protected), changes=changes)
