"""Receipts: the JSON account of one cell (or one recovery), written when it ends.

A receipt is built from what was recorded and observed, never from constants:
the chain is the trace each stage appended, the isolation is what the backend
really set up, the pids are those the kernel reported.
"""
from __future__ import annotations

import json
import os
import time

RECEIPT_VERSION = 1
MAX_RETURNED_OUTPUT = 64 * 1024  # captured output a caller gets back (tool.ended); redaction counts cover it


def cell_receipt(cell, outcome, usage: dict, released: list, error: str | None = None, drafted=None) -> dict:
    """`drafted`: the cell's Draft, made while its command ran: those fields' values are the very objects it encoded."""
    from .io.wiring import output_info  # lazy: tool.py imports this module for a constant
    spec, plan = cell.spec, cell.plan
    r = {
        "kind": "cell", "version": RECEIPT_VERSION,
        "run_id": spec.run_id, "agent_id": spec.agent_id, "cell_id": spec.cell_id,
        "role": spec.role, "policy_digest": plan.policy_digest if plan else None,
        "controller": cell.controller_id, "boot_id": cell.boot_id,
        "governance": {"decision": cell.decision, "trail": cell.trail},
        "chain": cell.trace,
        "argv": spec.argv, "exe": spec.exe, "workdir": spec.workdir, "worktree": spec.worktree, "venv": spec.venv,
        "env_keys": sorted(spec.env), "env": redacted_env(spec), "env_sources": spec.env_sources,
        "cgroup": cell.place.paths() or None if cell.place else None,
        "cgroup_inode": cell.place.inode if cell.place else None,
        "isolation": cell.isolation,
        "reduced": (cell.isolation or {}).get("reduced", []),  # isolation.reduced pieces this cell ran without
        "limits": {**(plan.limits if plan else {}), "applied": cell.place.limits if cell.place else {},
                   "timeout": plan.timeout if plan else None, "grace": plan.grace if plan else None},
        "pids": {"leader": cell.identity.get("pid"), "pgid": cell.identity.get("pgid"),
                 "starttime": cell.identity.get("starttime"), "pidfd_ino": cell.identity.get("pidfd_ino"),
                 "left_after_leader": outcome.leftover},
        "started_at": cell.started_at, "ended_at": time.time(),
        "state": outcome.state, "reason": outcome.reason, "exit_code": outcome.exit_code,
        "exit_status": outcome.status, "signal": outcome.signal, "cancel_reason": outcome.cancel_reason,
        "kill_method": outcome.kill_method,
        "usage": usage, "released": released,
        "output": output_info(cell),
    }
    if drafted is not None:
        r.update((k, v) for k, (v, _) in drafted.fields.items())
    r.update(argv_b64(spec.argv))
    if getattr(cell, "protected", None) is not None:  # protect.settle: what the cell planted, what it changed
        r["protected"] = cell.protected
    if getattr(cell, "changes", None) is not None:  # reversible cells: what landed, the record, or why live
        r["changes"] = cell.changes
    if cell.network is not None:  # allowlist/internal: every connection the proxy was asked for
        r["network"] = cell.network
    r["kernel_record"], r["kernel_stopped"] = kernel_record(cell.isolation or {}, r["limits"], usage, cell.network,
                                                            cell.decision, getattr(cell, "landlock_audit", None),
                                                            getattr(cell, "net_tries", None))
    if getattr(spec, "secrets", None):  # issue 32: which secrets went where, how often, refused (no value)
        r["secrets"] = getattr(cell, "secret_summary", None) or [
            {"name": t["name"], "inject": t["inject"], "hosts": list(t["hosts"]), "env": t.get("env"),
             "source": t["source"].split(":", 1)[0], "used": [], "refused": 0} for t in spec.secrets]
    scrubbed = getattr(cell, "scrubbed", None)  # {name: count}: its capture files, scrubbed when it ended
    if scrubbed is not None:
        for s in r["secrets"]:
            s["scrubbed"] = scrubbed.get(s["name"], 0)
    held = getattr(cell, "secrets", None) or []
    if plan is not None and (getattr(plan, "redact", None) or held) and cell.capture:
        # What each redaction rule takes out of the output a caller gets back (tool.ended); a cell's secret
        # values are always taken out (redact.secret.<name>), whatever the role's rules.
        from .redact import receipt_section
        r["output"]["redaction"] = receipt_section(plan.redact or {"rules": [], "patterns": {}}, spec.env,
                                                   plan.cell_dir, MAX_RETURNED_OUTPUT, literals=_literals(held))
        if scrubbed and any(scrubbed.values()):  # the files now hold `*` where a value was: that value's redaction
            counts = r["output"]["redaction"]["counts"]
            for name, n in scrubbed.items():
                if n:
                    counts[f"redact.secret.{name}"] = counts.get(f"redact.secret.{name}", 0) + n
            r["output"]["redaction"]["counts"] = dict(sorted(counts.items()))
    r["limits"]["not_in_force"] = not_in_force(r["limits"])
    r["limits_hit"] = limits_hit(usage, r["output"])
    if error:
        r["error"] = error
    r["duration"] = round(r["ended_at"] - (cell.started_at or cell.created_at), 6)
    return r


def _literals(held) -> list:
    if not held:
        return []
    from .secrets import redaction_rules
    return redaction_rules(held)


def recovered_receipt(row, entry: dict, chain: list[dict], janitor: str, recovery_path: str, now: float) -> dict:
    """The cell receipt of a cell the janitor recovered (its controller died first):
    what the journal holds of it (the chain as each stage journaled it, ids, argv,
    the leader), state `recovered`, and what the janitor killed and spared and why,
    with a pointer to the recovery receipt. Never built from constants: a field the
    journal did not hold is None."""
    argv = json.loads(row["argv"]) if row["argv"] else []
    r = {"kind": "cell", "version": RECEIPT_VERSION, "run_id": row["run_id"], "agent_id": row["agent_id"],
         "cell_id": row["cell_id"], "role": row["role"], "controller": row["controller_id"],
         "boot_id": row["boot_id"], "chain": chain, "argv": argv, "exe": row["exe"], "workdir": row["worktree"],
         "cgroup": entry.get("cgroup"), "cgroup_inode": row["cgroup_ino"],
         "pids": {"leader": row["pid"], "pgid": row["pgid"], "starttime": row["starttime"],
                  "pidfd_ino": row["pidfd_ino"]},
         "started_at": row["started_at"], "ended_at": now, "state": "recovered", "reason": entry.get("reason"),
         "exit_code": None, "exit_status": None, "signal": None, "cancel_reason": row["cancel_reason"],
         "state_before": entry.get("state_before"),
         "recovery": {"janitor": janitor, "receipt": recovery_path, "killed": entry.get("killed", []),
                      "spared": entry.get("spared", []), "released": entry.get("released", []),
                      "notes": entry.get("notes", [])}}
    # what a reduced cell ran without (isolation.reduced), as its journaled backend stage said it
    r["reduced"] = next(((st.get("isolation") or {}).get("reduced") or [] for st in chain
                         if isinstance(st, dict) and st.get("stage") == "backend"), [])
    r.update(argv_b64(argv))
    if entry.get("protected") is not None:  # protect.settle_cell, by the janitor
        r["protected"] = entry["protected"]
    if entry.get("changes") is not None:  # janitor._commit_changes: what the cell left, committed
        r["changes"] = entry["changes"]
    r["duration"] = round(now - (row["started_at"] or row["created_at"]), 6)
    return r


def argv_b64(argv: list[str]) -> dict:
    """{"argv_b64": argv as base64 of the exact bytes} when some argument is not UTF-8:
    `argv` then holds surrogate escapes (\\udcff) that only Python maps back, and a
    receipt must let any reader recover what ran. {} when argv is all UTF-8."""
    try:
        for a in argv:
            a.encode()
        return {}
    except UnicodeEncodeError:
        import base64  # here, not above: 1 ms of the run path for an argv that is almost never needed
        return {"argv_b64": [base64.b64encode(os.fsencode(a)).decode() for a in argv]}


def redacted_env(spec) -> dict[str, str]:
    """The environment for a receipt: secret-looking values and the token hidden."""
    from .linux.session import TOKEN_VAR
    from .util.secretkeys import looks_secret
    return {k: ("<redacted>" if k == TOKEN_VAR or looks_secret(k) else v) for k, v in spec.env.items()}


def dumps(receipt: dict, drafted: "Draft | None" = None) -> str:
    """A cell receipt as its controller writes it, once for both places: the file `receipt.json` (one line)
    and the journal's receipts row (Journal.conclude_cell), so `agnsup verify` finds them byte for byte the
    same. Keys sorted, through the C encoder (indent=2 is the pure-Python one: ~0.3 ms a cell of `true`).
    `drafted`: the texts Draft encoded while the command ran, reused for the fields that still hold the values it
    encoded; the text is json.dumps(receipt, sort_keys=True) byte for byte all the same
    (tests/unit/test_receipt_draft.py)."""
    if drafted is None:
        return json.dumps(receipt, sort_keys=True)
    enc = _encoder()
    texts = {k: t for k, (v, t) in drafted.fields.items() if receipt.get(k) is v}
    if "chain" in texts and "isolation" in receipt:
        isolation = texts["isolation"] = enc(receipt["isolation"])  # the top-level field's, encoded anyway
        if isolation != drafted.isolation or len(receipt["chain"]) != drafted.stages:  # the chain's backend stage
            del texts["chain"]                                                       # holds that dict: changed
    return "{" + ", ".join(f"{enc(k)}: {texts[k] if k in texts else enc(receipt[k])}" for k in sorted(receipt)) + "}"


class Draft:
    """What of a cell's receipt is fixed once its command runs, encoded then (on the thread that waits for it, while
    it runs: off the path from its exit to its result): {field: (value, text)}, and the isolation's text as it was
    (the chain's backend stage holds the cell's isolation dict, which the end may still change: a change layer the
    kernel refused adds its `not_in_force`; dumps then encodes the chain again, as it does when a stage was added)."""

    def __init__(self, cell):
        spec = cell.spec
        enc = _encoder()
        values = {"governance": {"decision": cell.decision, "trail": cell.trail}, "chain": cell.trace,
                  "env": redacted_env(spec), "env_keys": sorted(spec.env), "env_sources": spec.env_sources,
                  "argv": spec.argv}
        self.fields = {k: (v, enc(v)) for k, v in values.items()}
        self.isolation = enc(cell.isolation)
        self.stages = len(cell.trace)


_ENCODER = None


def _encoder():
    """json.dumps(x, sort_keys=True)'s encoder, made once (json.dumps makes one per call when sort_keys is given)."""
    global _ENCODER
    if _ENCODER is None:
        _ENCODER = json.JSONEncoder(sort_keys=True).encode
    return _ENCODER


def _tmp(path: str) -> str:
    return f"{path}.{os.getpid()}.tmp"


reserved_name = _tmp  # what reserve makes (a controller's cell spare holds it: broker.spare_files)


def reserve(path: str) -> int | None:
    """Make the file `write` will fill and rename, ahead of time: a controller calls it while the cell runs, so
    that the receipt's new inode is not made at the cell's end, on its caller's path (a new inode on a busy ext4
    without a journal waited ~0.4 ms here, an existing file's rewrite ~0.07). Returns it open (empty) for
    `write(fd=)`, or None: the end then opens nothing, and truncates nothing (linux.fs.open_empty: ext4 would
    flush it at its close). Best effort: write makes it when it is not there."""
    from .linux.fs import open_empty
    try:
        return open_empty(_tmp(path), 0o666, os.O_NOFOLLOW)
    except OSError:
        return None


def discard_reserved(path: str) -> None:
    """Remove what `reserve` (or a `write` cut short) left for `path`: a dead controller's empty file. Only for
    a cell whose controller is dead (the janitor's), where no writer is left."""
    folder, name = os.path.split(path)
    try:
        names = os.listdir(folder or ".")
    except OSError:
        return
    for n in names:
        if n.startswith(name + ".") and n.endswith(".tmp"):
            try:
                os.unlink(os.path.join(folder, n))
            except OSError:
                pass


def write(path: str, receipt: dict, compact: bool = False, text: str | None = None, fd: int | None = None) -> None:
    """Atomically. `compact`: one line, through the C encoder (indenting is pure
    Python: ~100 ms for a recovery receipt of 1,000 processes). `text`: the
    receipt already encoded (dumps), written as it is. `fd`: what reserve(path)
    returned, written into and closed here, whatever happens."""
    tmp = _tmp(path)  # reserve() may have made it: then rewritten, not created
    if text is None:
        text = (json.dumps(receipt, sort_keys=True, separators=(",", ":")) if compact else
                json.dumps(receipt, indent=2, sort_keys=True))
    if fd is not None:  # reserve's, empty: written from its start
        try:
            _fill(fd, text)
            os.replace(tmp, path)
            return
        except FileNotFoundError:
            pass  # its file was removed meanwhile: made again below
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
    try:
        fd = os.open(tmp, flags, 0o666)
    except FileNotFoundError:  # its directory first (a cell's exists: its output files are in it)
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        fd = os.open(tmp, flags, 0o666)
    _fill(fd, text)
    os.replace(tmp, path)


def _fill(fd: int, text: str) -> None:
    """`text` and a newline into the open file `fd`, which is closed here."""
    try:
        data = (text + "\n").encode()
        while data:
            data = data[os.write(fd, data):]
    finally:
        os.close(fd)


_RESOURCE = {"memory_max": "memory", "pids_max": "pids", "cpu_weight": "cpu", "cpu_max": "cpu"}


def not_in_force(limits: dict) -> list[str]:
    """The role's limits no hierarchy holds on this host (a receipt never reports a
    limit as if it were applied): the keys whose resource is not in `applied`."""
    applied = limits.get("applied") or {}
    return sorted(k for k, res in _RESOURCE.items() if limits.get(k) is not None and res not in applied)


def limits_hit(usage: dict, output: dict) -> list[str]:
    """Which limits the cell ran into, from the kernel's own counters (and the pump's):
    memory (the OOM killer acted), pids (a fork was refused at pids.max), cpu (the
    quota throttled it), output (it wrote past output_max)."""
    seen = {"memory": usage.get("oom_kills"), "pids": usage.get("pids_max_events"),
            "cpu": usage.get("cpu_nr_throttled"), "output": output.get("exceeded")}
    return [limit for limit, counter in seen.items() if counter]


# -- the kernel's record: what the kernel refused in the cell, whatever the gate said ----------------
#
# The gate judges text before a cell runs; the kernel refuses what the cell really does. The receipt's
# `kernel_record` holds, per class, what the kernel (or the controller's proxy, which is the cell's only
# way out under allowlist/internal) refused, from counters it keeps anyway, read when the cell ends:
# nothing is traced or added to the run path. A class whose refusals leave no count says so
# ("observable": false) with why, never 0. `kernel_stopped` lists what the kernel stopped in a cell the
# gate let run, with the gate rule that bears on that class (a flag it raised) or null: the gate never saw it.

# Gate rules that bear on each class: a flag of the cell's decision that starts with one of these
# is the rule that saw it coming (`agnsup check --explain` says which rule would have refused it).
KERNEL_CLASSES = {
    "network": ("network.", "exfil.", "net.", "egress."),
    "writes": ("sandbox.", "hardline.system_file_write", "hardline.block_device_write", "hardline.rm_root",
               "hardline.chmod_system", "hardline.unknown_operand"),
    "pids": ("hardline.fork_bomb", "hardline.resource_exhaustion", "hardline.unbounded_loop"),
    "memory": ("hardline.resource_exhaustion",),
}
WRITES_NOT_OBSERVABLE = (
    "a write the mount view (EROFS) or Landlock (EACCES) refuses fails inside the cell and the kernel keeps "
    "no count of it; seeing each one would take ptrace or seccomp user notification on every file system "
    "call. Landlock (ABI 7) logs its denials to the audit subsystem, which agnsup reads only as root, "
    "where an audit daemon runs and the host's audit is enabled (docs/governance.md)")
NETNS_NOT_OBSERVABLE = (
    "the cell's own network namespace has only lo up: a connection that would leave it fails inside the "
    "cell (ENETUNREACH); the kernel counts it (Ip/Ip6 OutNoRoutes), read only when the cell fails")
NETNS_SOURCE = ("the cell's network namespace: Ip OutNoRoutes (/proc/net/snmp) and Ip6OutNoRoutes "
                "(/proc/net/snmp6), over the cell's life; connections and DNS queries that had no route out")
HOST_NOT_OBSERVABLE = "host network: the kernel refuses no destination; the gate's judgement is the only one"


def gate_rules(decision: dict | None, cls: str) -> list[str]:
    """The rules of the gate's decision (flags and flagged notes) that bear on a kernel class."""
    if not decision:
        return []
    seen = list(decision.get("flags") or []) + [n.get("rule", "") for n in decision.get("flagged") or []]
    if not decision.get("allowed", True):
        seen.append(decision.get("rule") or "")
    return sorted({r for r in seen if r and r.startswith(KERNEL_CLASSES[cls])})


def kernel_record(isolation: dict, limits: dict, usage: dict, network: dict | None,
                  decision: dict | None, landlock: dict | None = None,
                  net_tries: dict | None = None) -> tuple[dict, list[dict]]:
    """(kernel_record, kernel_stopped) for a cell receipt; see above. `usage`: the cgroup's counters
    ({} for a cell that never ran); `network`: the receipt's proxy section (None without a proxy);
    `landlock`: the cell's Landlock denials read from the audit log (linux/audit.py), or {"why"}
    the host gave none, or None: not tried (no audit daemon, not root, Landlock ABI < 7); `net_tries`: a failed
    deny/loopback cell's no-route counts (process.leader.netns_tries), {"why"} unread, or None: not read."""
    applied = limits.get("applied") or {}
    ran = bool(usage)
    rec: dict = {}
    mode = isolation.get("network")
    if network is not None:
        refused = [{"name": d["name"], "port": d.get("port"), "rule": d["rule"], "count": d["count"]}
                   for d in network.get("by_destination") or [] if d["decision"] == "refused"]
        rec["network"] = {"mode": network.get("mode"), "observable": True, "source": "the controller's egress proxy",
                          "attempts": network.get("attempts", 0), "allowed": network.get("allowed", 0),
                          "refused": network.get("refused", 0), "failed": network.get("failed", 0),
                          "refused_destinations": sorted(refused, key=lambda d: -d["count"])}
    elif isolation.get("network_namespace") and net_tries and "no_route" in net_tries:
        rec["network"] = {"mode": mode, "observable": True, "source": NETNS_SOURCE, **net_tries}
    elif isolation.get("network_namespace"):
        why = f"{net_tries['why']}; " if net_tries and net_tries.get("why") else ""
        rec["network"] = {"mode": mode, "observable": False, "why": why + NETNS_NOT_OBSERVABLE}
    else:
        rec["network"] = {"mode": mode, "observable": False, "why": HOST_NOT_OBSERVABLE}
    by = [w for w, on in (("mount view (read-only root)", isolation.get("readonly_root")),
                          (f"landlock ABI {isolation.get('landlock_abi')}", isolation.get("landlock"))) if on]
    if landlock and "denials" in landlock:
        rec["writes"] = {"enforced_by": by, "observable": True, "source": "audit: Landlock's own records (ABI 7)",
                         "landlock_denials": landlock["denials"],
                         **{k: landlock[k] for k in ("by_class", "paths", "kernel_count", "lower_bound", "lost")
                            if k in landlock},
                         "not_counted": "writes the read-only mount view refuses (EROFS) before Landlock is asked"}
    else:
        why = f"{landlock['why']}: " if landlock and landlock.get("why") else ""
        rec["writes"] = {"enforced_by": by, "observable": False, "why": why + WRITES_NOT_OBSERVABLE}
    v1 = not str(applied.get("memory", "")).startswith("v2")
    for cls, key, limit, source in (("pids", "pids_max_events", "pids_max", "pids.events max"),
                                    ("memory", "oom_kills", "memory_max",
                                     "memory.oom_control oom_kill" if v1 else "memory.events oom_kill")):
        res = cls
        if res not in applied:
            rec[cls] = {"limit": None, "observable": False, "why": f"no {res} hierarchy holds the cell's limit here"}
        elif not ran or usage.get(key) is None:
            rec[cls] = {"limit": limits.get(limit), "observable": False,
                        "why": "the cell never ran" if not ran else f"this kernel has no {source} counter"}
        else:
            rec[cls] = {"limit": limits.get(limit), "observable": True, "source": source,
                        ("refused_forks" if cls == "pids" else "oom_kills"): usage[key]}
    stopped = []
    net = rec["network"]
    if net.get("refused"):
        stopped.append(("network", "connections refused by the egress proxy", net["refused"]))
    if net.get("no_route"):
        stopped.append(("network", "packets with no route out of the cell's network namespace (connections, "
                        "DNS queries)", net["no_route"]))
    if rec["writes"].get("landlock_denials"):
        stopped.append(("writes", "file system writes refused by Landlock", rec["writes"]["landlock_denials"]))
    if rec["pids"].get("refused_forks"):
        stopped.append(("pids", "forks refused at pids.max (the processes were never created)",
                        rec["pids"]["refused_forks"]))
    if rec["memory"].get("oom_kills"):
        stopped.append(("memory", "processes killed by the OOM killer at memory.max", rec["memory"]["oom_kills"]))
    allowed = (decision or {}).get("allowed", True)
    kernel_stopped = []
    for cls, what, count in stopped:
        rules = gate_rules(decision, cls)
        kernel_stopped.append({"class": cls, "what": what, "count": count,
                               "gate": "flagged" if rules and allowed else "allowed" if allowed else "denied",
                               "gate_rule": rules[0] if rules else None})
    return rec, kernel_stopped


# The governance key that turns a flag of a class into a refusal (`agnsup check --explain`).
_STRICTER = {"kernel_enforced": ("governance.kernel_enforced", "deny"),
             "unknown_operand": ("governance.unknown_operands", "deny")}


def kernel_explain(policy, decision: dict, strict: dict) -> dict:
    """For `agnsup check --explain`: per kernel class, what the kernel refuses in a cell of the role
    whatever the text says, the gate rules that bear on the command in that class (flags of
    `decision`), and, where the role lets such a flag through, the setting that refuses it and the
    rule that then decides (`strict`: the decision under those settings). A class with no rule is
    one only the receipt's kernel_record can show."""
    net, fs, lim = policy.network.mode, policy.filesystem, policy.limits
    kernel = {
        "network": {"deny": "the cell's own network namespace (only lo up) refuses every connection that leaves it",
                    "loopback": "the cell's own network namespace (only lo up) refuses every connection that leaves it",
                    "allowlist": "only the controller's egress proxy leads out; it refuses what the role's lists do "
                                 "not allow and records every attempt (kernel_record.network)",
                    "internal": "only the controller's egress proxy leads out; it refuses what the role's lists do not "
                                "allow and records every attempt (kernel_record.network)",
                    "host": "nothing: the cell has the host's network"}.get(net, net),
        "writes": ("outside the worktree, /tmp and /dev/shm the mount view is read-only and Landlock (where the "
                   "kernel has it) refuses writes" if fs.root == "ro" else "the root is writable: only Landlock "
                   "(where the kernel has it) refuses writes outside the worktree")
                  + ("; the worktree is read-only too" if fs.worktree != "rw" else ""),
        "pids": f"a fork past pids.max = {lim.pids_max} fails" if lim.pids_max else "no pids limit",
        "memory": f"the OOM killer ends the cell past memory.max = {lim.memory_max}" if lim.memory_max
                  else "no memory limit",
    }
    out = {}
    for cls, what in kernel.items():
        rules = gate_rules(decision, cls)
        e: dict = {"kernel": what, "gate_rules": rules}
        for r in rules:
            key = next((k for k in _STRICTER if r.endswith(k)), None)
            if key and decision.get("allowed"):
                setting, value = _STRICTER[key]
                e["refused_with"] = f"{setting} = \"{value}\""
                if not strict.get("allowed") and strict.get("rule", "").startswith(KERNEL_CLASSES[cls]):
                    e["would_deny"] = strict["rule"]
                break
        if not rules:
            e["note"] = ("no gate rule sees this in the command's text: only the receipt's kernel_record shows "
                         "what the kernel refused")
        out[cls] = e
    return out
