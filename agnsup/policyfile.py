"""Pydantic models of a role policy file (agnsup/policies/*.toml).

Imported only when a policy file is validated (pydantic costs ~100 ms to
import): the validated form is cached as JSON under the state root and the
spawn path reads that. Every field says what it means; docs/policy.md
documents the file format from these descriptions.
"""
from __future__ import annotations

import re
from typing import Literal

from .util.secretkeys import looks_secret
from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator, model_validator

ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SIZE = re.compile(r"^\s*(\d+)\s*([KMGT]?)i?B?\s*$", re.IGNORECASE)


def parse_size(v) -> int | None:
    if v is None or isinstance(v, int):
        return v
    m = _SIZE.match(str(v))
    if not m:
        raise ValueError(f"not a size: {v!r} (use bytes or a number with K, M, G or T)")
    return int(m.group(1)) * 1024 ** "_KMGT".index((m.group(2) or "_").upper())


def _each(why_bad):
    """A list field's validator: why_bad(item) says what is wrong with one item, or None; the list is kept."""
    def validate(cls, v: list[str]) -> list[str]:
        for item in v:
            if (why := why_bad(item)) is not None:
                raise ValueError(why)
        return v
    return classmethod(validate)


def _known(known: tuple[str, ...], what: str):
    return _each(lambda name: None if name in known else f"unknown {what} {name!r} (known: {', '.join(known)})")


def _cell_dir(d: str) -> str | None:
    if d not in ("@runtime", "@venv") and not d.startswith("/"):
        return f"{d!r} is not an absolute directory"
    return f"{d!r} holds ':'" if ":" in d else None


def _passable(k: str) -> str | None:
    if not ENV_KEY.match(k):
        return f"{k!r} is not a variable name"
    if k == "PATH":
        return "a role can never pass PATH: the cell's PATH comes from env.path"
    return f"{k} looks like a secret; pass it per call with --env {k}" if looks_secret(k) else None


def _home_path(p: str) -> str | None:
    if not (p.startswith("/") or p.startswith("~/")):
        return f"{p!r} is not a path inside the home ('~/...' or absolute)"
    return f"{p!r} holds '..'" if ".." in p.split("/") else None


# Names the cell's minimal /dev makes itself (linux/mounts.py _dev): a role cannot bind a host node over them.
DEV_OWN = ("/dev/pts", "/dev/shm", "/dev/ptmx", "/dev/console", "/dev/fd", "/dev/stdin", "/dev/stdout", "/dev/stderr")


def _device_path(p: str) -> str | None:
    import os.path
    if not p.startswith("/dev/") or os.path.normpath(p) != p:
        return f"{p!r} is not a normalized path under /dev/ (a device node such as /dev/kvm)"
    if any(p == own or p.startswith(own + "/") for own in DEV_OWN):
        return f"{p!r} is the cell's own (its /dev makes {', '.join(DEV_OWN)}), not a host device to bind"
    return None


def _socket_path(p: str) -> str | None:
    if not p.startswith("/"):
        return f"{p!r} is not an absolute path"
    return f"{p!r} holds '..'" if ".." in p.split("/") else None


def _net_entry(e: str) -> None:
    from .netpolicy import parse_entry
    parse_entry(e)  # raises ValueError naming what is wrong


def _internal_entry(entry: str) -> str | None:
    import ipaddress
    if entry in INTERNAL_CATEGORIES:
        return None
    try:
        ipaddress.ip_network(entry, strict=False)
    except ValueError:
        return f"{entry!r} is neither a category ({', '.join(INTERNAL_CATEGORIES)}) nor an address or network"
    return None


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RoleSection(_Strict):
    name: str = Field(description="The role's name, as given to --role; must match the file name.")
    description: str = Field("", description="One line for `agnsup doctor` and the docs.")


class EnvSection(_Strict):
    path: list[str] = Field(description="PATH inside the cell, in order. '@venv' stands for the bin directory of "
                            "the worktree's own virtual environment (.venv or venv holding pyvenv.cfg; left out when "
                            "there is none; VIRTUAL_ENV is then set to it), '@runtime' for a directory holding only "
                            "agnsup's own commands (never its interpreter). Never taken from the host.")
    passthrough: list[str] = Field(default_factory=list, alias="pass",
                                   description="Host variables copied into the cell. Never PATH; never a "
                                   "secret-looking key (those need an explicit --env per call).")
    lang: str = Field("C.UTF-8", description="LANG inside the cell.")

    _absolute = field_validator("path")(_each(_cell_dir))
    _no_path_no_secrets = field_validator("passthrough")(_each(_passable))


class FilesystemSection(_Strict):
    worktree: Literal["rw", "ro"] = Field("rw", description="Whether the cell may write its worktree.")
    root: Literal["ro", "rw"] = Field("ro", description="Everything outside the worktree and private /tmp: "
                                      "'ro' makes it read-only (recommended; required for cgroup containment).")
    deny: list[str] = Field(default_factory=list, description="Paths hidden inside the cell (~ is the invoking "
                            "user's home). The state root is always hidden. Every cell also gets a private /tmp "
                            "(its temp dir, where HOME and TMPDIR point) and a minimal /dev of its own "
                            "(filesystem.devices).")
    home: Literal["hidden", "ro"] = Field("hidden", description="The invoking user's home (the real uid's passwd "
                                          "home, $HOME, and SUDO_USER's home under sudo): 'hidden' puts it under "
                                          "an empty read-only tmpfs, re-exposing read-only only the worktree (with "
                                          "its own mode), the Python runtime running agnsup and home_allow; 'ro' "
                                          "leaves it visible, never writable.")
    home_allow: list[str] = Field(default_factory=list, description="Paths inside the hidden home the cell may "
                                  "read (files or directories, '~/...' or absolute), re-exposed read-only at "
                                  "their real paths; deny paths stay hidden even here.")

    home_config: list[Literal["git", "pip", "npm"]] = Field(
        default_factory=lambda: ["git", "pip", "npm"], description="Tool configuration of the user's home the "
        "cell's HOME gets, filtered (agnsup/toolconfig.py): git's user.name/email (and safe.directory = the "
        "worktree), pip's index and install keys, npm's registry lines, and the PIP_*/NPM_CONFIG_REGISTRY "
        "variables of those keys; never a key that holds credentials or a URL with a user or password in it.")

    cache: Literal["none", "worktree", "role"] = Field(
        "none", description="Persistent package caches under the state root (<state>/caches/), mounted writable "
        "where the tools look in the cell's HOME and writable nowhere else: 'worktree' one per worktree (cells of "
        "one project share it), 'role' one per role, 'none' caches die with the cell.")
    cache_tools: list[Literal["pip", "npm", "cargo"]] = Field(
        default_factory=lambda: ["pip", "npm", "cargo"], description="The caches filesystem.cache keeps: pip "
        "(~/.cache/pip), npm (~/.npm), cargo (~/.cargo/registry and ~/.cargo/git).")

    devices: list[str] = Field(default_factory=list, description="Host device nodes the cell's minimal /dev "
                               "also gets, at the same path ('/dev/kvm', '/dev/dri/renderD128'): each must exist and "
                               "be a character or block device when a cell starts; the cell may read and write it "
                               "(Landlock too), and the receipt says so.")
    writable_protected: list[str] = Field(
        default_factory=list, description="Worktree paths that tools run on their own which this role may write "
        "anyway (agnsup/protect.py LIFTABLE: '.vscode', '.git/hooks', '.git/config', '.mcp.json', ...); by "
        "default a role that writes its worktree gets them read-only, and what the cell created there is moved "
        "out after it. The receipt lists every lifted file the cell changed.")
    unix_sockets: list[str] = Field(default_factory=list, description="Host Unix sockets (absolute paths) the "
                                    "cell may connect to, as sandbox-runtime's allowUnixSockets. Every other "
                                    "pathname socket of the host is out of reach: the cell's /run is an empty "
                                    "read-only tmpfs and each socket bound elsewhere is masked at cell start. A "
                                    "listed path that is not an existing socket refuses the cell.")

    changes: Literal["auto", "at_exit", "live"] = Field(
        "auto", description="Reversible cells (docs/architecture.md): 'at_exit' runs the cell over an overlay of "
        "its worktree and its changes land in the worktree when it ends (whatever the ending), each kept as a "
        "record `agnsup diff` shows and `agnsup undo` reverses; 'live' writes go straight to the worktree, seen "
        "by others as they happen and not captured; 'auto' is at_exit for calls that are waited for (run, the "
        "API's run, MCP run_process/run_shell, serve, sandboxd exec) and live for long-lived cells (spawn, "
        "sandboxd background processes). A read-only worktree has nothing to capture. Where the state root "
        "cannot hold an overlay's upper layer the cell runs live and the receipt says why "
        "(isolation.require = [\"reversible\"] refuses it instead).")
    changes_keep: int = Field(200, ge=0, description="Most change records kept per state root; past it the "
                              "oldest are dropped after each commit (0: none kept).")
    changes_keep_bytes: int = Field(2 * 1024 ** 3, ge=0, description="Most bytes of pre-images the change "
                                    "records of a state root keep ('2G'); past it the oldest are dropped.")

    @field_validator("changes_keep_bytes", mode="before")
    @classmethod
    def _keep_size(cls, v):
        if isinstance(v, bool):
            raise ValueError(f"not a size: {v!r}")
        return parse_size(v)

    _home_paths = field_validator("home_allow")(_each(_home_path))
    _device_paths = field_validator("devices")(_each(_device_path))
    _socket_paths = field_validator("unix_sockets")(_each(_socket_path))

    @field_validator("writable_protected")
    @classmethod
    def _liftable(cls, v: list[str]) -> list[str]:
        from .protect import LIFTABLE
        for p in v:
            if p.rstrip("/") not in LIFTABLE:
                raise ValueError(f"{p!r} is not a protected path (one of: {', '.join(LIFTABLE)})")
        return [p.rstrip("/") for p in v]

    @model_validator(mode="after")
    def _allow_needs_hidden(self):
        if self.home_allow and self.home != "hidden":
            raise ValueError(f"home_allow applies to a hidden home, but home is {self.home!r}")
        return self


# network.allow_internal categories: what agnsup.netpolicy.classify_address returns for a non-public address.
INTERNAL_CATEGORIES = ("loopback", "link-local", "private", "metadata", "multicast", "unspecified", "reserved",
                       "non-global")
# governance.git_allow names: agnsup.gate.git.RULES (kept here as names so validation needs no gate import).
GIT_RULES = ("force_push", "remote_delete", "reset_hard", "clean", "discard_worktree", "branch_force_delete",
             "stash_drop", "history_rewrite", "reflog_expire", "gc_prune", "update_ref_delete")
# governance.redact rule sets: agnsup/redact.py RULE_SETS.
REDACT_SETS = ("host_secrets", "key_formats", "bearer_tokens", "private_keys")


class NetworkSection(_Strict):
    mode: Literal["deny", "loopback", "host", "allowlist", "internal"] = Field(
        "deny", description="'deny' and 'loopback': a network namespace of the cell's own with only lo up; "
        "'host': the host's network; 'allowlist' and 'internal': the cell's own namespace whose only way out "
        "is the controller's proxy on its loopback, to the destinations in allow (internal: private ones only).")
    allow: list[str] = Field(default_factory=list, description="allowlist/internal: destinations the proxy "
                             "connects to: 'example.org', '*.example.org' (the names below it), '*' (any), an "
                             "IP or CIDR (for IP-literal requests), each optionally ':port' or ':*' (default "
                             "80 and 443).")
    deny: list[str] = Field(default_factory=list, description="allowlist/internal: destinations refused even "
                            "when allow lists them (same syntax).")
    allow_private: StrictBool = Field(False, description="allowlist: a listed destination may also resolve to "
                                      "a loopback, private, link-local or CGNAT address of the host's network "
                                      "(metadata, multicast and 0.0.0.0 never).")
    proxy_port: int = Field(3128, ge=1024, le=65535, description="allowlist/internal: the port of the proxy "
                            "(HTTP and SOCKS5) on the cell's own loopback, 127.0.0.1.")
    allow_internal: list[str] = Field(default_factory=list, description="With mode host: non-public destinations "
                                      "that shell commands and URL arguments may reach anyway: categories (loopback, "
                                      "link-local, private, metadata, multicast, unspecified, reserved, non-global) "
                                      "or addresses and networks ('10.1.0.0/16', '::1'). Empty: public only.")
    tunnels: Literal["deny", "allow"] = Field("deny", description="With mode host: 'deny' refuses tunnels (ngrok, "
                                              "cloudflared, chisel, frpc, ssh -R/-D, ...), 'allow' runs them.")
    pod: StrictBool = Field(True, description="deny/loopback: the agent's cells of a named run share one "
                            "network namespace (its pod: a server one cell started is reachable on localhost from "
                            "the agent's later cells, never from the host or another agent); false: a namespace "
                            "per cell.")
    download_exec: Literal["deny", "allow"] = Field(
        "deny", description="Code downloaded and run as it arrives (curl ... | sh, bash <(curl ...), sh -c "
        "\"$(curl ...)\", iex (iwr ...)) is flagged network.download_exec in every mode; with mode host 'deny' "
        "refuses it, 'allow' runs it with the flag.")

    _entries = field_validator("allow", "deny")(_each(_net_entry))

    @model_validator(mode="after")
    def _lists_need_proxy(self):
        from .netpolicy import MODES
        if self.mode not in MODES:
            for key in ("allow", "deny"):
                if getattr(self, key):
                    raise ValueError(f"network.{key} applies to mode 'allowlist' or 'internal', not {self.mode!r}")
            if self.allow_private:
                raise ValueError(f"network.allow_private applies to mode 'allowlist', not {self.mode!r}")
        return self

    _internal = field_validator("allow_internal")(_each(_internal_entry))


class LimitsSection(_Strict):
    memory_max: int | None = Field(None, description="Memory limit of the cell's cgroup ('2G', bytes, at least 1); "
                                   "none if unset.")
    pids_max: int | None = Field(None, description="Most processes and threads the cell may hold at once "
                                 "(1-4194304); none if unset.")
    cpu_weight: int | None = Field(None, ge=1, le=10000, description="CPU share against the other cells when the "
                                   "CPU is contended (1-10000, 100 = an even share): v2 cpu.weight, v1 cpu.shares.")
    cpu_max: float | None = Field(None, gt=0, description="Most CPUs the cell may use at once (1.5 = one and a half "
                                  "cores): v2 cpu.max, v1 cpu.cfs_quota_us over a 100 ms period; none if unset.")
    output_max: int | None = Field(None, ge=0, description="Most bytes the cell may write to the controller, stdout "
                                   "and stderr together ('16M', bytes); past it the cell is killed and the receipt "
                                   "says output_limit. Unset: the cell writes the controller's stdio directly.")
    shm_max: int | None = Field(None, ge=4096, description="Size of the cell's private /dev/shm ('256M', bytes); "
                                "unset: half of memory_max, or 64M without it. Writes past it fail with ENOSPC.")
    tmp_max: int = Field(512 * 1024 * 1024, description="Size of the cell's /tmp ('512M', bytes, at least 64K): "
                         "a tmpfs of its own, not on the state root's file system; a write past it fails with "
                         "ENOSPC, and the receipt's usage.tmp_bytes says what was used (agnsup as root: a normal "
                         "user's controller cannot measure it).")
    timeout: float | None = Field(None, description="Default wall-clock limit in seconds, > 0 (--timeout "
                                  "overrides); none if unset.")
    grace: float = Field(3.0, ge=0, description="Seconds between SIGTERM and SIGKILL when the cell is stopped.")

    @field_validator("memory_max", "output_max", "shm_max", "tmp_max", mode="before")
    @classmethod
    def _size(cls, v):
        return parse_size(v)

    @field_validator("tmp_max")
    @classmethod
    def _tmp_size(cls, v):
        if isinstance(v, bool) or not 64 * 1024 <= v < 2 ** 63:
            raise ValueError(f"must be at least 64K, not {v!r}")
        return v

    # A value the kernel would refuse, or one that would not be applied (0 reads as
    # "no limit" further down) while the receipt said it was, is refused here, naming
    # the file and key (policy.validate), not at cell setup as "[Errno 22]".
    @field_validator("memory_max", "pids_max")
    @classmethod
    def _at_least_one(cls, v, info):
        if v is None:
            return v
        top = 4194304 if info.field_name == "pids_max" else 2 ** 63 - 1  # PID_MAX_LIMIT; the kernel's page counter
        if isinstance(v, bool) or not 1 <= v <= top:
            raise ValueError(f"must be between 1 and {top}, not {v!r} (leave the key out for no limit)")
        return v

    @field_validator("timeout")
    @classmethod
    def _positive(cls, v):
        if v is not None and (isinstance(v, bool) or not 0 < v < float("inf")):
            raise ValueError(f"must be a number of seconds > 0, not {v!r} (leave the key out for no timeout)")
        return v


# "limits": every limit the role sets (memory_max, pids_max, cpu_weight, cpu_max) is in force here
# "mapped_uid": a root controller's cell is uid 0 of a user namespace, an unprivileged uid on the host
# "reversible": a cell that writes its worktree captures its changes (filesystem.changes; a long-lived cell too)
PROTECTIONS = ("seccomp", "landlock", "landlock_scopes", "no_new_privs", "pid_namespace", "capabilities", "limits",
               "mapped_uid", "reversible")
# isolation.reduced: what an operator accepts losing WHERE THE HOST REFUSES IT (a default container's seccomp
# profile, a locked-down CI runner): never where it is available (docs/isolation.md, "Reduced cells")
REDUCIBLE = ("mount_namespace", "network_namespace", "pid_namespace", "cgroup")


class IsolationSection(_Strict):
    seccomp: StrictBool = Field(True, description="Load the per-cell seccomp filter: refuses prctl(PR_SET_MM), "
                          "TIOCSTI/TIOCLINUX, io_uring, kexec, module loading, and (unless allowed below) "
                          "ptrace and mount/namespace calls, with EPERM.")
    landlock: StrictBool = Field(True, description="Apply a Landlock domain: writes only beneath the worktree (when "
                           "rw), the private /tmp, /dev/shm, its own devpts, /dev/null-class devices, "
                           "filesystem.devices and isolation.writable; "
                           "no signal to, or abstract-socket connect to, a process outside the cell.")
    no_new_privs: StrictBool = Field(True, description="Set no_new_privs: setuid and file-capability binaries gain "
                               "nothing. Required by seccomp and landlock.")
    pid_namespace: StrictBool = Field(False, description="A PID namespace of the cell's own, with a small init as "
                                "PID 1 that forwards signals, reaps orphans and passes the command's status on.")
    allow_ptrace: StrictBool = Field(False, description="Let the seccomp filter pass ptrace and process_vm_*; "
                               "Landlock still refuses ptrace of any process outside the cell.")
    allow_mount: StrictBool = Field(False, description="Let the seccomp filter pass mount, umount2, pivot_root, "
                              "setns, unshare, clone with CLONE_NEW* flags, clone3 and the new mount API.")
    capabilities: list[str] = Field(default_factory=list, description="Capabilities a root cell keeps "
                                    "(names as in capabilities(7), with or without CAP_); every other one "
                                    "leaves the bounding, effective, permitted, inheritable and ambient sets. "
                                    "A cell with process.user set keeps none.")
    writable: list[str] = Field(default_factory=list, description="Extra absolute paths Landlock lets the cell "
                                "write beneath (~ is the invoking user's home); the mount namespace must also "
                                "leave them writable.")
    host_root: StrictBool = Field(False, description="Run a root controller's cell as host uid 0 (its "
                                  "capabilities then act on every file of the host). Default false: the cell is uid 0 "
                                  "of a user namespace mapping 0-65535 to an unprivileged host range, with the "
                                  "worktree and caches id-mapped, so root-owned 0600 files and other users' files "
                                  "stay closed to it. Ignored when agnsup is not root or process.user is set.")
    require: list[str] = Field(default_factory=list, description="Protections that must be in force or the cell "
                               "does not start (exit 125): " + ", ".join(PROTECTIONS) + ".")
    reduced: list[str] = Field(default_factory=list, description="What the operator accepts losing where this host "
                               "refuses it (" + ", ".join(REDUCIBLE) + "): a cell then runs without that piece, "
                               "and its receipt names it (top-level `reduced`, isolation.not_in_force); where the "
                               "host offers a piece the cell gets it all the same. Unlisted, a refused piece "
                               "refuses the cell (exit 125), naming the piece and both fixes. docs/isolation.md, "
                               "\"Reduced cells\".")

    @field_validator("capabilities")
    @classmethod
    def _known_caps(cls, v: list[str]) -> list[str]:
        from .linux.sys import CAP_NAMES
        out = []
        for c in v:
            name = c.upper().removeprefix("CAP_")
            if name not in CAP_NAMES:
                raise ValueError(f"{c!r} is not a capability name (capabilities(7))")
            out.append(name)
        return out

    _absolute_paths = field_validator("writable")(_each(
        lambda p: None if p.startswith("/") or p == "~" or p.startswith("~/") else f"{p!r} is not an absolute path"))
    _known_protections = field_validator("require")(_each(
        lambda p: None if p in PROTECTIONS else f"{p!r} is not a protection (one of: {', '.join(PROTECTIONS)})"))
    _known_reducible = field_validator("reduced")(_each(
        lambda p: None if p in REDUCIBLE else f"{p!r} is not a piece a cell can run without (one of: "
        f"{', '.join(REDUCIBLE)})"))

    @model_validator(mode="after")
    def _consistent(self):
        needs = {"seccomp": self.seccomp, "landlock": self.landlock, "landlock_scopes": self.landlock,
                 "no_new_privs": self.no_new_privs, "pid_namespace": self.pid_namespace, "capabilities": True,
                 "limits": True, "mapped_uid": not self.host_root, "reversible": True}
        for p in self.require:
            if not needs[p]:
                key = "landlock" if p == "landlock_scopes" else p
                raise ValueError(f"require lists {p!r} but isolation.{key} is false")
        if "pid_namespace" in self.require and "pid_namespace" in self.reduced:
            raise ValueError("require and reduced both list 'pid_namespace': a role either needs it or accepts "
                             "running without it")
        if (self.seccomp or self.landlock) and not self.no_new_privs:
            raise ValueError("seccomp and landlock need no_new_privs = true (the cell drops CAP_SYS_ADMIN)")
        return self


class ProcessSection(_Strict):
    user: int | str | None = Field(None, description="Run the cell as this uid or user name (agnsup must run "
                                   "as root); unset: the controller's own uid. It keeps no capabilities "
                                   "(isolation.capabilities is for root cells).")
    group: int | str | None = Field(None, description="The cell's gid or group name; unset: the user's primary "
                                    "group (or the uid's number when the user has no passwd entry).")
    on_controller_death: Literal["kill", "keep"] = Field(
        "kill", description="'kill': the cell dies with its controller at once (its command runs under an init "
        "of its own in a PID namespace that the kernel kills, with everything in it, when the controller dies: "
        "PR_SET_PDEATHSIG); 'keep': the tree outlives a dead controller until the janitor's next run "
        "(`agnsup run --on-controller-death` overrides it per cell).")

    @field_validator("user", "group")
    @classmethod
    def _id(cls, v):
        if isinstance(v, bool):
            raise ValueError("not a user or group")
        if isinstance(v, int) and not 0 <= v < 2 ** 32 - 1:
            raise ValueError(f"{v} is not a valid id")
        if isinstance(v, str) and not re.match(r"^[a-z_][a-z0-9_.-]*\$?$", v):
            raise ValueError(f"{v!r} is not a user or group name")
        return v


class GovernanceSection(_Strict):
    preset: str | None = Field(None, description="A preset (policies/presets/<name>.toml: standard, regulated, "
                               "readonly) whose settings this role inherits; keys the role sets win, except keys "
                               "the preset fixes.")
    mode: Literal["open", "locked", "readonly"] = Field("open", description="open: side effects allowed; locked: "
                                                        "only the tools in yellow_allow; readonly: none.")
    unparseable: Literal["deny", "flag"] | None = Field(None, description="Shell text that does not parse: 'deny' "
                                                         "refuses it, 'flag' allows it with a flag; unset: locked "
                                                         "denies, open and readonly flag.")
    unreadable: Literal["deny", "flag"] | None = Field(
        None, description="Code decoded at run time and run (base64 -d | sh, sh -c \"$(xxd -r ...)\", "
        "exec(bytes.fromhex(...)), pwsh -EncodedCommand): 'deny' refuses it (gate.unreadable_code), 'flag' allows "
        "it with that flag; unset: locked and readonly deny, open flags.")
    kernel_enforced: Literal["flag", "deny"] = Field(
        "flag", description="A refusal the cell's kernel makes anyway (a network tool under network deny, a write "
        "under the read-only root, a read of a masked deny path): 'flag' allows it with a flag "
        "(*.kernel_enforced) under mode open; 'deny' refuses it early. Other modes always refuse.")
    unknown_operands: Literal["flag", "deny"] = Field(
        "flag", description="An operand of a destructive command (rm -r, find -delete, chmod -R, dd of=, shred) "
        "known only at run time ($DIR, $(cmd), xargs input): 'flag' allows it with the flag "
        "hardline.unknown_operand, 'deny' refuses it.")
    git_allow: list[str] = Field(default_factory=list, description="git rules (force_push, remote_delete, "
                                 "reset_hard, clean, discard_worktree, branch_force_delete, stash_drop, "
                                 "history_rewrite, reflog_expire, gc_prune, update_ref_delete) this role may run; "
                                 "'*' allows all. Empty: all refused.")
    redact: list[str] = Field(default_factory=list, description="Rule sets applied to the output a caller gets back "
                              "(host_secrets, key_formats, bearer_tokens, private_keys); each redaction is counted "
                              "in the receipt by rule id.")
    redact_patterns: dict[str, str] = Field(default_factory=dict, description="More redaction rules: name -> regular "
                                            "expression; a match is redacted as rule redact.role.<name>.")
    allow_commands: list[str] = Field(default_factory=list, description="If not empty, only these programs may "
                                      "be started (by name).")
    deny_commands: list[str] = Field(default_factory=list, description="Programs this role may never start.")
    yellow_allow: list[str] = Field(default_factory=list, description="Side-effect tools a locked role allows.")

    _git = field_validator("git_allow")(_known(GIT_RULES + ("*",), "git rule"))
    _redact = field_validator("redact")(_known(REDACT_SETS, "redaction rule set"))

    @field_validator("redact_patterns")
    @classmethod
    def _patterns(cls, v: dict[str, str]) -> dict[str, str]:
        for name, pattern in v.items():
            if not re.fullmatch(r"[A-Za-z0-9_]+", name):
                raise ValueError(f"pattern name {name!r}: use letters, digits and _")
            try:
                if re.compile(pattern).match(""):
                    raise ValueError(f"pattern {name!r} matches the empty string")
            except re.error as e:
                raise ValueError(f"pattern {name!r} is not a regular expression: {e}") from None
        return v


class QuotaSection(_Strict):
    max_cells_per_run: int | None = Field(None, ge=0, description="Most cells one run may start in its life "
                                          "(every cell the journal holds for the run; denied calls do not count).")
    max_concurrent_per_run: int | None = Field(None, ge=0, description="Most live cells one run may hold at once.")
    max_concurrent_per_agent: int | None = Field(None, ge=0, description="Most live cells one agent of a run may "
                                                 "hold at once.")
    max_run_seconds: float | None = Field(None, gt=0, description="Wall time of a run, from its first cell: no new "
                                          "cell starts after it.")


class SecretSection(_Strict):
    source: str = Field(description="Where the value comes from, read by the controller when a cell starts: "
                        "'env:NAME' (the controller's environment; serve: its client's), 'file:/abs/path' (trailing "
                        "newlines dropped), 'command:/abs/prog ARG...' (its stdout; a keyring helper). Never "
                        "the value itself.")
    env: str | None = Field(None, description="The cell variable that holds the placeholder "
                            "'agnsup-secret:NAME' (never the value).")
    hosts: list[str] = Field(description="Where the value may go: HTTPS hosts, 'name' or 'name:PORT' (443 by "
                             "default), each allowed by network.allow; no wildcards.")
    inject: str = Field("bearer", description="How the proxy puts it on requests to those hosts: 'bearer' "
                        "(Authorization: Bearer VALUE), 'basic:USER' (Authorization: Basic of USER:VALUE), "
                        "'header:NAME' (NAME: VALUE), 'placeholder' (only where the placeholder appears in a "
                        "header, a Basic credential too). In every mode the placeholder in a header of a request "
                        "to a listed host is replaced.")

    @model_validator(mode="after")
    def _parsed(self):
        from .errors import UsageError
        from .secrets import parse_table
        try:
            parse_table("x", self.model_dump(exclude_none=True), "secret")
        except UsageError as e:
            raise ValueError(e.details.get("what", e.message)) from None
        return self


class Policy(_Strict):
    role: RoleSection = Field(description="Who this is.")
    env: EnvSection = Field(description="The environment, built from nothing.")
    filesystem: FilesystemSection = Field(default_factory=FilesystemSection, description="The mount namespace.")
    network: NetworkSection = Field(default_factory=NetworkSection, description="The network namespace.")
    limits: LimitsSection = Field(default_factory=LimitsSection, description="Cgroup and time limits.")
    governance: GovernanceSection = Field(default_factory=GovernanceSection, description="The text gate.")
    isolation: IsolationSection = Field(default_factory=IsolationSection, description="Kernel confinement "
                                        "of the cell's process: seccomp, Landlock, capabilities, PID namespace.")
    process: ProcessSection = Field(default_factory=ProcessSection, description="Who the cell runs as.")
    quota: QuotaSection = Field(default_factory=QuotaSection, description="Run quotas, judged from the journal.")
    secrets: dict[str, SecretSection] = Field(default_factory=dict, description="Credentials the cell uses but "
                                              "never sees, by name (1-40 of a-z, 0-9, _, -): the cell gets the "
                                              "placeholder, the controller's proxy puts the value on requests to "
                                              "the listed hosts (docs/isolation.md, \"Secrets\").")

    @field_validator("secrets")
    @classmethod
    def _secret_names(cls, v: dict) -> dict:
        from .secrets import NAME
        for name in v:
            if not NAME.match(name):
                raise ValueError(f"{name!r} is not a secret name (1-40 of a-z, 0-9, _ and -)")
        return v

    @model_validator(mode="after")
    def _secrets_go_through_the_proxy(self):
        if not self.secrets:
            return self
        from .errors import UsageError
        from .netpolicy import Rules, destination
        from .secrets import check, parse_table
        try:
            refs = [parse_table(n, t.model_dump(exclude_none=True), f"secrets.{n}") for n, t in self.secrets.items()]
            rules = Rules.of(self.network.model_dump())
            check(refs, self.network.mode, lambda host, port: rules.match(destination(host), port))
        except UsageError as e:
            raise ValueError(e.message) from None
        return self

    @model_validator(mode="after")
    def _proxy_cannot_be_bypassed(self):
        from .netpolicy import MODES
        kept = {"NET_ADMIN", "SYS_ADMIN"} & set(self.isolation.capabilities)
        if self.network.mode in MODES and kept:
            raise ValueError(f"network.mode {self.network.mode!r} needs a cell that cannot rewire its network "
                             f"namespace, but isolation.capabilities keeps {', '.join(sorted(kept))}")
        return self

    @model_validator(mode="after")
    def _reversible_needs_capture(self):
        if "reversible" in self.isolation.require and self.filesystem.changes == "live":
            raise ValueError('isolation.require lists "reversible" but filesystem.changes is "live" (writes are '
                             'never captured): use "auto" or "at_exit"')
        return self
