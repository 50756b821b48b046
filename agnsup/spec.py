"""The spec builder: a tool call plus a role becomes a CellSpec.

The environment is built from nothing. In order: PATH from the policy (the
host's PATH never reaches a cell, and the command is resolved on the cell's
PATH, not ours), HOME and TMPDIR inside the cell's private /tmp, LANG, the
cell identity and ownership token, host keys the role passes, the proxy
variables of an allowlist/internal role, and last the per-call `--env`
values. A secret-looking host key arrives only by an explicit `--env KEY` for
that call.
"""
from __future__ import annotations

import os
import sys

from .errors import NotFound, NotExecutable, UsageError
from .linux import host
from .linux.host import invoking_homes
from .linux.session import TOKEN_VAR  # the janitor reads the same name from /proc
from .util.record import Factory, Record
from .store.state import check_id

IDENTITY_VARS = ("AGNSUP_RUN_ID", "AGNSUP_AGENT_ID", "AGNSUP_CELL_ID", TOKEN_VAR)
CELL_HOME, CELL_TMP = "/tmp/home", "/tmp"
# @runtime: agnsup's own commands only, never its interpreter (a `python` or `pip` from
# agnsup's venv would shadow the user's). The broker links them into the cell's /tmp.
RUNTIME_BIN = "/tmp/.agnsup/bin"
RUNTIME_COMMANDS = ("agnsup",)
# What makes a directory the root of a project: the worktree of a cell started anywhere
# below it (docs/isolation.md "The worktree"). `.agnsup-worktree` marks one without a VCS.
ROOT_MARKERS = (".git", ".hg", ".agnsup-worktree")
# @venv: the project's own virtual environment, looked for in the worktree only.
VENV_DIRS = (".venv", "venv")
# A cell without network (deny, loopback): package managers give up at once instead of
# retrying a resolution that cannot succeed (npm 70 s, pip 10-40 s); --env overrides them.
OFFLINE_ENV = {"PIP_RETRIES": "0", "npm_config_fetch_retries": "0", "CARGO_NET_RETRY": "0"}


class CellSpec(Record):
    argv: list[str]
    exe: str
    role: str
    run_id: str
    agent_id: str
    cell_id: str
    workdir: str                   # where the command starts (its cwd)
    timeout: float | None
    lock_timeout: float | None
    env: dict[str, str]
    env_sources: dict[str, str]    # key -> policy | agnsup | host | call
    token: str
    on_controller_death: str = "kill"   # kill | keep: the request's, else the role's
    worktree: str = ""             # the writable, locked tree: workdir's enclosing project root
    venv: str | None = None        # the worktree's venv (.venv or venv), if any: what @venv names
    interpreter: list = Factory(list)  # what that venv's pyvenv.cfg names outside it (re-exposed read-only)
    tool_env_dropped: list = Factory(list)  # toolconfig.ENV_KEYS left out for holding credentials
    long_lived: bool = False       # request.long_lived: filesystem.changes "auto" runs it live
    changes: str | None = None     # request.changes: at_exit | live for this call, else the role's
    secrets: list = Factory(list)  # the cell's secrets by reference (secrets.SecretRef.table(): never a value)


def new_cell_id() -> str:
    return "c-" + os.urandom(4).hex()  # os.urandom is what `secrets` uses, without its imports


def build(call, policy) -> CellSpec:
    """The CellSpec of a request.CellRequest under a role's (policy.Frozen) policy."""
    host_env = os.environ if call.host_env is None else call.host_env
    run_id = check_id("run", call.run_id)
    agent_id = check_id("agent", call.agent_id)
    cell_id = check_id("cell", call.cell_id or new_cell_id())
    workdir = host.realpath(call.workdir or os.getcwd())
    if not host.isdir(workdir):
        raise UsageError(f"workdir {workdir} is not a directory")
    worktree = project_root(workdir)
    venv = find_venv(worktree)  # its interpreter is re-exposed even when the role's PATH leaves it out
    token = os.urandom(16).hex()

    env: dict[str, str] = {}
    src: dict[str, str] = {}

    def put(source: str, values: dict) -> None:
        for k, v in values.items():
            env[k], src[k] = v, source

    put("policy", {"PATH": ":".join(expand_path(policy.env.path, venv))})
    if venv is not None and "@venv" in policy.env.path:
        put("agnsup", {"VIRTUAL_ENV": venv})
    put("agnsup", {"HOME": CELL_HOME, "TMPDIR": CELL_TMP})
    put("policy", {"LANG": policy.env.lang})
    put("agnsup", dict(zip(IDENTITY_VARS, (run_id, agent_id, cell_id, token), strict=True)))
    if policy.network.mode in ("deny", "loopback"):
        put("agnsup", OFFLINE_ENV)
    put("host", {k: host_env[k] for k in policy.env.passthrough if k in host_env})
    from .toolconfig import host_env as tool_env
    tool_vars, tool_dropped = tool_env(policy.filesystem.home_config, host_env)
    put("host", tool_vars)
    if policy.network.mode in ("allowlist", "internal"):  # the only way out: the controller's proxy (egress/)
        from .egress import proxy_env
        put("agnsup", proxy_env(policy.network.proxy_port))
    for item in call.env:
        k, eq, v = item.partition("=")
        if not k or not k.replace("_", "a").isalnum() or k[0].isdigit():
            raise UsageError(f"--env {item!r}: expected KEY=VALUE or KEY")
        if k in IDENTITY_VARS:
            raise UsageError(f"--env {k}: the cell identity variables are set by agnsup")
        if not eq:
            if k not in host_env:
                raise UsageError(f"--env {k}: not set in this environment")
            v = host_env[k]
        put("call", {k: v})

    exe = resolve(call.argv[0], env["PATH"], workdir)
    return CellSpec(argv=list(call.argv), exe=exe, role=call.role, run_id=run_id, agent_id=agent_id,
                    cell_id=cell_id, workdir=workdir, timeout=call.timeout, lock_timeout=call.lock_timeout,
                    env=env, env_sources=src, token=token,
                    on_controller_death=call.on_controller_death or policy.process.on_controller_death,
                    worktree=worktree, venv=venv, interpreter=venv_interpreter(venv) if venv else [],
                    tool_env_dropped=tool_dropped, long_lived=getattr(call, "long_lived", False),
                    changes=getattr(call, "changes", None))


def expand_path(entries, venv: str | None) -> list[str]:
    """env.path with its placeholders: @venv is the worktree venv's bin (dropped when
    there is none), @runtime the directory of agnsup's own commands."""
    out = []
    for d in entries:
        if d == "@venv":
            if venv is not None:
                out.append(os.path.join(venv, "bin"))
        elif d == "@runtime":
            out.append(RUNTIME_BIN)
        else:
            out.append(d)
    return out


def runtime_host_dir() -> str:
    """Where agnsup's own commands live on the host (the @runtime links point there)."""
    return os.path.dirname(sys.executable)


def project_root(workdir: str) -> str:
    """The worktree of a cell started in `workdir`: the nearest enclosing directory
    holding a ROOT_MARKERS entry, else workdir itself. Never climbs to "/" or to a
    directory that is or holds an invoking user's home (a dotfiles repository in the
    home must not make the whole home the writable worktree)."""
    try:
        homes = invoking_homes()
    except Exception:  # noqa: BLE001 - compile_plan reports a bad home; here it only stops the climb
        homes = []
    d = workdir
    while True:
        if any(os.path.lexists(os.path.join(d, m)) for m in ROOT_MARKERS):
            if d == workdir:
                return d
            if d == "/" or any(h == d or h.startswith(d.rstrip("/") + "/") for h in homes):
                return workdir
            return d
        parent = os.path.dirname(d)
        if parent == d:
            return workdir
        d = parent


def find_venv(worktree: str) -> str | None:
    for name in VENV_DIRS:
        d = os.path.join(worktree, name)
        if os.path.isfile(os.path.join(d, "pyvenv.cfg")) and os.path.isdir(os.path.join(d, "bin")):
            return d
    return None


def venv_interpreter(venv: str) -> list[str]:
    """The interpreter prefixes a venv's pyvenv.cfg names (home, executable,
    base-executable): the venv's python is a symlink into one of them, often inside
    the hidden home (pyenv, uv, conda), so the compiler re-exposes them read-only.
    pyvenv.cfg lies in the worktree, which an earlier cell may have written: only a
    directory holding a Python standard library (lib/python3.*/os.py) counts, so it
    can name an interpreter tree but never, say, ~/.config/gh."""
    found = []
    try:
        with open(os.path.join(venv, "pyvenv.cfg"), errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    for line in lines:
        key, eq, value = line.partition("=")
        key, value = key.strip().lower(), value.strip()
        if not eq or not value.startswith("/") or key not in ("home", "executable", "base-executable"):
            continue
        d = value if key == "home" else os.path.dirname(value)
        prefix = os.path.dirname(d) if os.path.basename(d) == "bin" else d
        for p in (prefix, os.path.realpath(prefix)):
            if p not in found and p != "/" and _has_stdlib(p):
                found.append(p)
    return found


def _has_stdlib(prefix: str) -> bool:
    try:
        names = os.listdir(os.path.join(prefix, "lib"))
    except OSError:
        return False
    return any(n.startswith("python3") and os.path.isfile(os.path.join(prefix, "lib", n, "os.py")) for n in names)


def resolve(cmd: str, path: str, cwd: str) -> str:
    """Find `cmd` on the cell's PATH (execvp(3) semantics, without the host's PATH)."""
    if "/" in cmd:
        full = os.path.normpath(os.path.join(cwd, cmd))
        if not os.path.exists(full):
            raise NotFound(f"{cmd}: no such file")
        if os.path.isdir(full) or not os.access(full, os.X_OK):
            raise NotExecutable(f"{cmd}: not executable")
        return full
    found_noexec = None
    for d in path.split(":"):
        if not d:
            continue
        if d == RUNTIME_BIN:  # linked into the cell's /tmp by the broker
            if cmd in RUNTIME_COMMANDS and os.access(os.path.join(runtime_host_dir(), cmd), os.X_OK):
                return os.path.join(d, cmd)
            continue
        full = os.path.join(d, cmd)
        if os.path.isfile(full):
            if os.access(full, os.X_OK):
                return full
            found_noexec = found_noexec or full
    if found_noexec:
        raise NotExecutable(f"{cmd}: {found_noexec} is not executable")
    raise NotFound(f"{cmd}: command not found on the cell's PATH ({path})")
