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
from .linux.session import TOKEN_VAR  # the janitor reads the same name from /proc
from .record import Record
from .state import check_id

IDENTITY_VARS = ("AGNSUP_RUN_ID", "AGNSUP_AGENT_ID", "AGNSUP_CELL_ID", TOKEN_VAR)
CELL_HOME, CELL_TMP = "/tmp/home", "/tmp"


class CellSpec(Record):
    argv: list[str]
    exe: str
    role: str
    run_id: str
    agent_id: str
    cell_id: str
    workdir: str
    timeout: float | None
    lock_timeout: float | None
    env: dict[str, str]
    env_sources: dict[str, str]    # key -> policy | agnsup | host | call
    token: str
    on_controller_death: str = "kill"   # kill | keep: the request's, else the role's


def new_cell_id() -> str:
    return "c-" + os.urandom(4).hex()  # os.urandom is what `secrets` uses, without its imports


def build(call, policy) -> CellSpec:
    """The CellSpec of a request.CellRequest under a role's (policy.Frozen) policy."""
    host_env = os.environ if call.host_env is None else call.host_env
    run_id = check_id("run", call.run_id)
    agent_id = check_id("agent", call.agent_id)
    cell_id = check_id("cell", call.cell_id or new_cell_id())
    workdir = os.path.realpath(call.workdir or os.getcwd())
    if not os.path.isdir(workdir):
        raise UsageError(f"workdir {workdir} is not a directory")
    token = os.urandom(16).hex()

    env: dict[str, str] = {}
    src: dict[str, str] = {}

    def put(k, v, s):
        env[k], src[k] = v, s

    runtime = os.path.dirname(sys.executable)
    put("PATH", ":".join(runtime if d == "@runtime" else d for d in policy.env.path), "policy")
    put("HOME", CELL_HOME, "agnsup")
    put("TMPDIR", CELL_TMP, "agnsup")
    put("LANG", policy.env.lang, "policy")
    put("AGNSUP_RUN_ID", run_id, "agnsup")
    put("AGNSUP_AGENT_ID", agent_id, "agnsup")
    put("AGNSUP_CELL_ID", cell_id, "agnsup")
    put(TOKEN_VAR, token, "agnsup")
    for k in policy.env.passthrough:
        if k in host_env:
            put(k, host_env[k], "host")
    if policy.network.mode in ("allowlist", "internal"):  # the only way out: the controller's proxy (egress/)
        from .egress import proxy_env
        for k, v in proxy_env(policy.network.proxy_port).items():
            put(k, v, "agnsup")
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
        put(k, v, "call")

    exe = resolve(call.argv[0], env["PATH"], workdir)
    return CellSpec(argv=list(call.argv), exe=exe, role=call.role, run_id=run_id, agent_id=agent_id,
                    cell_id=cell_id, workdir=workdir, timeout=call.timeout, lock_timeout=call.lock_timeout,
                    env=env, env_sources=src, token=token,
                    on_controller_death=call.on_controller_death or policy.process.on_controller_death)


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
        full = os.path.join(d, cmd)
        if os.path.isfile(full):
            if os.access(full, os.X_OK):
                return full
            found_noexec = found_noexec or full
    if found_noexec:
        raise NotExecutable(f"{cmd}: {found_noexec} is not executable")
    raise NotFound(f"{cmd}: command not found on the cell's PATH ({path})")
