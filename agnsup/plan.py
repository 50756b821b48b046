"""The execution plan: what the compiler decided for one cell, as plain data.

The mount namespace as an ordered list of typed operations (executed only by linux/mounts.py), the
namespaces to create, the limits, the capabilities to drop, what the cell runs without. The broker, the
process package and the receipt read it; nothing writes it after compiler.compile_plan.
"""
from __future__ import annotations

from .spec import CellSpec
from .util.record import Factory, Record

# What each piece takes away, as the receipt's not_in_force says it.
REDUCED_LOSS = {
    "mount_namespace": "no mount namespace: no private /tmp (TMPDIR and HOME are a directory under the state root), "
                       "no read-only root, no hidden homes, deny paths or state root (the host's files are readable), "
                       "no IPC namespace; writes are held by Landlock alone",
    "network_namespace": "no network namespace: the cell has the host's network",
    "pid_namespace": "no PID namespace: the cell sees the host's processes; only the leader dies with the controller "
                     "(PR_SET_PDEATHSIG), what it started is left to the janitor",
    "cgroup": "no cgroup tree: tracked by session + token, no limits, no atomic tree kill",
}


class ExecutionPlan(Record):
    spec: CellSpec
    cell_dir: str                  # <state>/cells/<run>/<cell>
    tmpdir: str                    # the cell's private /tmp (inside cell_dir); as root only its staging: the
                                   # cell's /tmp is a tmpfs of limits.tmp_max filled from it (tmp_tmpfs)
    mount_ops: list[tuple]         # linux.mounts.MountOp tuples, in order
    new_netns: bool
    network: str
    limits: dict                   # memory_max, pids_max, cpu_weight, cpu_max, output_max, tmp_max
    grace: float
    timeout: float | None
    drop_caps: list[int]           # leave the bounding set (every capability but cap_keep)
    worktree_mode: str             # rw | ro
    policy_digest: str
    deny_masked: list[str] = Factory(list)
    # confinement of the command itself (docs/isolation.md)
    seccomp_refuse: tuple | None = None    # seccomp groups beyond "always"; None: no filter
    landlock_writable: list[str] | None = None  # host paths Landlock lets the cell write; None: no Landlock
    landlock_abi: int = 0
    landlock_log_tag: str | None = None  # the broker's audit reader names the cell's domain (linux/audit.py)
    no_new_privs: bool = False
    cap_keep: list[int] | None = None      # what a root cell keeps; None: agnsup is not root
    uid: int | None = None                 # run the cell as this uid/gid
    gid: int | None = None
    mapped: dict | None = None             # root controller: the cell is uid 0 of the cells' user namespace,
                                           # {"uid", "gid": host BASEs, "count"} (linux/userns.py)
    pid_namespace: bool = False
    user_namespace: bool = False           # not root: the cell's namespaces live in a user namespace of its own
    redact: dict | None = None             # governance.redact(_patterns) for returned output (agnsup/redact.py)
    dies_with_controller: str = ""         # how on_controller_death = kill is in force: "namespace" | "leader" | ""
    not_in_force: list[str] = Factory(list)  # wanted by the role, missing on this host
    require_limits: bool = False           # isolation.require "limits": refuse a cell whose limits are not in force
    home: str = "hidden"                   # filesystem.home
    home_hidden: list[str] = Factory(list)   # homes under an empty read-only tmpfs
    home_exposed: list[str] = Factory(list)  # re-exposed read-only inside them
    egress: dict | None = None             # allowlist/internal: the role's network table (for the receipt)
    egress_rules: object = None            # ... and as netpolicy.Rules, what the proxy judges by
    tmp_links: list[tuple] = Factory(list)  # (path inside the cell's /tmp, target): @runtime, home_allow in HOME
    tmp_files: list[tuple] = Factory(list)  # (path inside the cell's /tmp, text): toolconfig's HOME files
    shared_files: list[tuple] = Factory(list)  # (path under <state>/offline, text): what a mount step binds, the same
                                               # for many cells: written once (home.make), never removed per cell
    home_config: dict = Factory(dict)       # what of the user's tool configuration crossed (toolconfig)
    tmp_tmpfs: bool = False                 # root: /tmp is a tmpfs of limits.tmp_max the controller makes and
                                            # fills from tmpdir (process.leader.make_tmp); else the tmpdir itself
    caches: list[tuple] = Factory(list)     # (host dir under <state>/caches, path in the cell, that path inside
                                            # the cell's /tmp dir): filesystem.cache
    devices: list[tuple] = Factory(list)    # (path, "character" | "block"): filesystem.devices, bound in /dev
    shm_max: int = 0                        # bytes of the cell's /dev/shm
    protected: list[str] | str = Factory(list)  # worktree paths tools run on their own, bound read-only
                                                # (agnsup/protect.py); "all" when the worktree is read-only
    protected_lifted: list[str] = Factory(list)  # filesystem.writable_protected
    run_private: list[str] = Factory(list)  # /run (and a real /var/run) under an empty read-only tmpfs
    run_shown: list[str] = Factory(list)    # ... and what of the host's came back into it, read-only
    sockets_masked: list[str] = Factory(list)  # host sockets bound elsewhere, masked at cell start
    sockets_allowed: list[str] = Factory(list)  # filesystem.unix_sockets (real paths)
    changes: dict = Factory(dict)           # reversible cells (changes_mode): {"mode": "at_exit" | "live" | "none",
                                            # "why", "role": filesystem.changes, "keep", "keep_bytes", "layer"}
    mount_namespace: bool = True            # the cell's own mount (and IPC) namespace; False: a reduced cell
    reduced: list[str] = Factory(list)      # what this cell runs without (isolation.reduced the host refuses)
    reduced_accepted: list[str] = Factory(list)  # the role's isolation.reduced (what it would accept losing)
    network_pod: bool = False               # the cell joins its agent's pod's network namespace (agnsup/pod.py)

    def on_controller_death(self) -> dict:
        """What ends the cell when its controller dies, as the receipt says it (docs/isolation.md)."""
        mode = self.spec.on_controller_death
        if mode == "keep":
            return {"mode": "keep", "in_force": True, "how": "the tree outlives its controller; the janitor's "
                    "next run recovers it"}
        if self.dies_with_controller == "namespace":
            return {"mode": "kill", "in_force": True, "how": "the command runs under an init of its own in a PID "
                    "namespace; the init has PR_SET_PDEATHSIG(SIGKILL) towards the controller, and the kernel "
                    "kills everything in a namespace whose init dies"}
        return {"mode": "kill", "in_force": False, "how": "no PID namespace here: only the leader has "
                "PR_SET_PDEATHSIG(SIGKILL); what it started is left to the janitor's next run"}

    def isolation(self, backend, limits: dict, gaps: list[str]) -> dict:
        """The receipt's isolation section once the backend made the cell's place: what is in force, with
        the limits it set, and each one it could not (`gaps`) named as not in force."""
        out = {
            "cgroup_layout": backend.kind, "tracking": backend.tracking, "env_blocked": list(backend.env_blocked),
            "mount_namespace": True, "readonly_root": any(op[0] == "root" and op[3] for op in self.mount_ops),
            "private_tmp": True, "masked": self.deny_masked, "ipc_namespace": True,
            "network_namespace": self.new_netns, "network": self.network,
            "cap_sys_admin_dropped": 21 in self.drop_caps,
            "limits": limits,
            **self.protections(),  # seccomp, landlock, no_new_privs, capabilities, uid, pid_namespace
        }
        out["not_in_force"] = [*out["not_in_force"], *gaps]
        out.update(self.reduced_by(backend, out["not_in_force"]))  # isolation.reduced "cgroup"
        return out

    def reduced_by(self, backend, not_in_force: list[str]) -> dict:
        """The receipt's isolation `reduced` and `not_in_force` once the backend is known: a role that lists
        "cgroup" in isolation.reduced, on a backend without a tree (Untracked), runs without one, named."""
        if "cgroup" not in self.reduced_accepted or backend.trees:
            return {"reduced": self.reduced}
        return {"reduced": [*self.reduced, "cgroup"],
                "not_in_force": [*not_in_force, f"cgroup (reduced: {REDUCED_LOSS['cgroup']}): {backend.why}"]}

    def captures(self) -> bool:
        """The cell runs over an overlay of its worktree whose changes land when it ends (agnsup/changes.py)."""
        return self.changes.get("mode") == "at_exit"

    def cell_ids(self) -> tuple[int, int] | None:
        """The host (uid, gid) the cell's own files are owned by (its HOME, its stdio files): process.user's,
        or a mapped cell's uid 0 (host BASE); None: the controller's own."""
        if self.uid is not None:
            return self.uid, self.gid
        if self.mapped is not None:
            return self.mapped["uid"], self.mapped["gid"]
        return None

    def protections(self) -> dict:
        """What will be in force, for the receipt's isolation section."""
        from .linux.sys import CAP_NAMES
        return {
            "seccomp": self.seccomp_refuse is not None,
            "seccomp_refuses": ["always", *self.seccomp_refuse] if self.seccomp_refuse is not None else [],
            "landlock": self.landlock_writable is not None,
            "landlock_abi": self.landlock_abi or None,
            "landlock_scopes": self.landlock_writable is not None and self.landlock_abi >= 6,
            "landlock_writable": self.landlock_writable or [],
            "no_new_privs": self.no_new_privs,
            "capabilities_kept": None if self.cap_keep is None else [CAP_NAMES[c] for c in self.cap_keep],
            "uid": self.uid, "gid": self.gid,
            "mapped_uid": self.mapped is not None,
            "cell_host_uid": self.cell_ids()[0] if self.cell_ids() else None,
            "cell_host_gid": self.cell_ids()[1] if self.cell_ids() else None,
            "id_map": None if self.mapped is None else
            f"0 {self.mapped['uid']} {self.mapped['count']} (gid: 0 {self.mapped['gid']} {self.mapped['count']})",
            "worktree_idmapped": any(op[0] == "idclone" and op[2] == "worktree" for op in self.mount_ops),
            "pid_namespace": self.pid_namespace,
            "user_namespace": self.user_namespace,
            "on_controller_death": self.on_controller_death(),
            "not_in_force": self.not_in_force,
            "reduced": self.reduced,
            **({} if self.mount_namespace else {"mount_namespace": False, "private_tmp": False,
                                                "ipc_namespace": False, "readonly_root": False}),
            "home": self.home, "home_hidden": self.home_hidden, "home_exposed": self.home_exposed,
            "home_config": self.home_config,
            "caches": [{"host": h, "cell": c} for h, c, _ in self.caches],
            "protected": self.protected, "protected_lifted": self.protected_lifted,
            **self._dev(),
            "unix_sockets": {"run_private": self.run_private, "run_shown": self.run_shown,
                             "masked": self.sockets_masked, "allowed": self.sockets_allowed},
        }

    def _dev(self) -> dict:
        """The cell's /dev for the receipt: what it holds, and what each role device gives up."""
        from .linux.mounts import DEV_LINKS, DEV_NODES
        return {"dev": "minimal", "dev_nodes": [*DEV_NODES, *(p for p, _ in self.devices), "/dev/pts (its own)",
                                                 "/dev/shm (its own)", *(f"/dev/{n}" for n, _ in DEV_LINKS)],
                "dev_shm_max": self.shm_max,
                "devices": [{"path": p, "kind": kind, "gives_up": f"the cell can read and write {p} (a {kind} "
                             "device of the host): whatever that device reaches"} for p, kind in self.devices]}
