"""The policy compiler: role policy + CellSpec -> ExecutionPlan.

The plan is plain data: the mount namespace as an ordered list of typed
operations (executed only by linux/mounts.py), the namespaces to create, the
limits, the capabilities to drop. The backend re-checks it; a plan that
cannot be honoured fails before the command runs.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from .errors import UsageError
from .spec import CellSpec

CAP_SYS_ADMIN = 21


@dataclass
class ExecutionPlan:
    spec: CellSpec
    cell_dir: str                  # <state>/cells/<run>/<cell>
    tmpdir: str                    # the cell's private /tmp (inside cell_dir)
    mount_ops: list[tuple]         # linux.mounts.MountOp tuples, in order
    new_netns: bool
    network: str
    limits: dict                   # memory_max, pids_max
    grace: float
    timeout: float | None
    drop_caps: list[int]
    worktree_mode: str             # rw | ro
    policy_digest: str
    deny_masked: list[str] = field(default_factory=list)
    quota: dict = field(default_factory=dict)   # run quotas, judged by the broker (governance.admit)


def _expand(path: str, home: str) -> str:
    return os.path.join(home, path[2:]) if path == "~" or path.startswith("~/") else path


def compile_plan(spec: CellSpec, policy: dict, state_root: str) -> ExecutionPlan:
    fs = policy["filesystem"]
    wt = spec.workdir
    state_real = os.path.realpath(state_root)
    if wt == state_real or wt.startswith(state_real + "/"):
        raise UsageError(f"workdir {wt} is inside the state root {state_real}, which cells never see")
    cell_dir = os.path.join(state_root, "cells", spec.run_id, spec.cell_id)
    tmpdir = os.path.join(cell_dir, "tmp")
    home = os.path.expanduser("~")
    deny = [os.path.realpath(_expand(p, home)) for p in fs.get("deny", [])]
    ops: list[tuple] = [("clone", tmpdir, "tmp", False), ("clone", wt, "worktree", fs["worktree"] == "ro")]
    ops.append(("root", "/", "", fs["root"] == "ro"))
    ops.append(("tmpfs", "/dev/shm"))
    ops.append(("attach", "/tmp", "tmp"))
    ops.append(("attach", wt, "worktree"))
    # Masks go last so they also cover a deny path or the state root that
    # happens to lie inside the re-attached worktree.
    masked = [p for p in deny if os.path.lexists(p)] + [state_real]
    ops.extend(("mask", p) for p in masked)
    lim = policy["limits"]
    timeout = spec.timeout if spec.timeout is not None else lim.get("timeout")
    return ExecutionPlan(
        spec=spec, cell_dir=cell_dir, tmpdir=tmpdir, mount_ops=ops,
        new_netns=policy["network"]["mode"] in ("deny", "loopback"), network=policy["network"]["mode"],
        limits={"memory_max": lim.get("memory_max"), "pids_max": lim.get("pids_max")},
        grace=float(lim.get("grace", 3.0)), timeout=timeout,
        drop_caps=[CAP_SYS_ADMIN] if os.geteuid() == 0 else [], worktree_mode=fs["worktree"],
        policy_digest=policy.get("_digest", ""), deny_masked=masked, quota=dict(policy.get("quota") or {}))
