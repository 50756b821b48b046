"""Pydantic models of a role policy file (policies/*.toml).

Imported only when a policy file is validated (pydantic costs ~100 ms to
import): the validated form is cached as JSON under the state root and the
spawn path reads that. Every field says what it means; docs/policy.md
documents the file format from these descriptions.
"""
from __future__ import annotations

import re
from typing import Literal

from .secretkeys import looks_secret
from pydantic import BaseModel, ConfigDict, Field, field_validator

ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SIZE = re.compile(r"^\s*(\d+)\s*([KMGT]?)i?B?\s*$", re.IGNORECASE)


def parse_size(v) -> int | None:
    if v is None or isinstance(v, int):
        return v
    m = _SIZE.match(str(v))
    if not m:
        raise ValueError(f"not a size: {v!r} (use bytes or a number with K, M, G or T)")
    return int(m.group(1)) * 1024 ** "_KMGT".index((m.group(2) or "_").upper())


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RoleSection(_Strict):
    name: str = Field(description="The role's name, as given to --role; must match the file name.")
    description: str = Field("", description="One line for `agnsup doctor` and the docs.")


class EnvSection(_Strict):
    path: list[str] = Field(description="PATH inside the cell, in order. '@runtime' stands for the directory "
                            "of the interpreter running agnsup. Never taken from the host.")
    passthrough: list[str] = Field(default_factory=list, alias="pass",
                                   description="Host variables copied into the cell. Never PATH; never a "
                                   "secret-looking key (those need an explicit --env per call).")
    lang: str = Field("C.UTF-8", description="LANG inside the cell.")

    @field_validator("path")
    @classmethod
    def _absolute(cls, v: list[str]) -> list[str]:
        for d in v:
            if d != "@runtime" and not d.startswith("/"):
                raise ValueError(f"{d!r} is not an absolute directory")
            if ":" in d:
                raise ValueError(f"{d!r} holds ':'")
        return v

    @field_validator("passthrough")
    @classmethod
    def _no_path_no_secrets(cls, v: list[str]) -> list[str]:
        for k in v:
            if not ENV_KEY.match(k):
                raise ValueError(f"{k!r} is not a variable name")
            if k == "PATH":
                raise ValueError("a role can never pass PATH: the cell's PATH comes from env.path")
            if looks_secret(k):
                raise ValueError(f"{k} looks like a secret; pass it per call with --env {k}")
        return v


class FilesystemSection(_Strict):
    worktree: Literal["rw", "ro"] = Field("rw", description="Whether the cell may write its worktree.")
    root: Literal["ro", "rw"] = Field("ro", description="Everything outside the worktree and private /tmp: "
                                      "'ro' makes it read-only (recommended; required for cgroup containment).")
    deny: list[str] = Field(default_factory=list, description="Paths hidden inside the cell (~ is the invoking "
                            "user's home). The state root is always hidden. Every cell also gets a private /tmp "
                            "(its temp dir, where HOME and TMPDIR point) and a private /dev/shm.")


class NetworkSection(_Strict):
    mode: Literal["deny", "loopback", "host"] = Field("deny", description="'deny' and 'loopback': a network "
                                                      "namespace of the cell's own with only lo up; 'host': the host's network.")


class LimitsSection(_Strict):
    memory_max: int | None = Field(None, description="Memory limit of the cell's cgroup ('2G', bytes); none if unset.")
    pids_max: int | None = Field(None, description="Most processes and threads the cell may hold at once.")
    timeout: float | None = Field(None, description="Default wall-clock limit in seconds (--timeout overrides).")
    grace: float = Field(3.0, ge=0, description="Seconds between SIGTERM and SIGKILL when the cell is stopped.")

    @field_validator("memory_max", mode="before")
    @classmethod
    def _size(cls, v):
        return parse_size(v)


class GovernanceSection(_Strict):
    preset: str | None = Field(None, description="A preset (policies/presets/<name>.toml: standard, regulated, "
                               "readonly) whose settings this role inherits; keys the role sets win, except keys "
                               "the preset fixes.")
    mode: Literal["open", "locked", "readonly"] = Field("open", description="open: side effects allowed; locked: "
                                                        "only the tools in yellow_allow; readonly: none.")
    unparseable: Literal["deny", "flag"] | None = Field(None, description="Shell text that does not parse: 'deny' "
                                                         "refuses it, 'flag' allows it with a flag; unset: locked "
                                                         "denies, open and readonly flag.")
    kernel_enforced: Literal["flag", "deny"] = Field(
        "flag", description="A refusal the cell's kernel makes anyway (a network tool under network deny, a write "
        "under the read-only root, a read of a masked deny path): 'flag' allows it with a flag "
        "(*.kernel_enforced) under mode open; 'deny' refuses it early. Other modes always refuse.")
    allow_commands: list[str] = Field(default_factory=list, description="If not empty, only these programs may "
                                      "be started (by name).")
    deny_commands: list[str] = Field(default_factory=list, description="Programs this role may never start.")
    yellow_allow: list[str] = Field(default_factory=list, description="Side-effect tools a locked role allows.")


class QuotaSection(_Strict):
    max_cells_per_run: int | None = Field(None, ge=0, description="Most cells one run may start in its life "
                                          "(every cell the journal holds for the run; denied calls do not count).")
    max_concurrent_per_run: int | None = Field(None, ge=0, description="Most live cells one run may hold at once.")
    max_concurrent_per_agent: int | None = Field(None, ge=0, description="Most live cells one agent of a run may "
                                                 "hold at once.")
    max_run_seconds: float | None = Field(None, gt=0, description="Wall time of a run, from its first cell: no new "
                                          "cell starts after it.")


class Policy(_Strict):
    role: RoleSection = Field(description="Who this is.")
    env: EnvSection = Field(description="The environment, built from nothing.")
    filesystem: FilesystemSection = Field(default_factory=FilesystemSection, description="The mount namespace.")
    network: NetworkSection = Field(default_factory=NetworkSection, description="The network namespace.")
    limits: LimitsSection = Field(default_factory=LimitsSection, description="Cgroup and time limits.")
    governance: GovernanceSection = Field(default_factory=GovernanceSection, description="The text gate.")
    quota: QuotaSection = Field(default_factory=QuotaSection, description="Run quotas, judged from the journal.")
