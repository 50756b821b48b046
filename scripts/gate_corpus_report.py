#!/usr/bin/env python3
"""Print the governance gate's figures on the corpora in tests/data/corpora/.

    python scripts/gate_corpus_report.py [--verbose]

Recall on deny sets (catastrophic, dcg deny), false-deny rate on allow sets
(hard negatives, dcg allow), per context and per dcg category, and batch
throughput. The corpora are text only: nothing here executes them.
"""

from __future__ import annotations

import collections
import csv
import dataclasses
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from agnsup import governance, policy  # noqa: E402
from agnsup.gate import GateContext, judge_shell  # noqa: E402
from agnsup.gate.policy import RECOMMENDED_DENY_COMMANDS  # noqa: E402

CORPORA = ROOT / "tests" / "data" / "corpora"

WORKTREE = "/workspace/project"


def role_context(name: str) -> GateContext:
    """The gate's context for a shipped role, exactly as `agnsup run` builds it
    (writable /tmp, /dev/shm; deny paths; preset), with a fixed home for the corpora."""
    return dataclasses.replace(governance.context(policy.load(name), WORKTREE, None), home="/home/user")


# The shipped executor role (network deny) and networked role (executor with the host network),
# with their preset's governance.kernel_enforced = "flag": what the cell's kernel refuses is flagged.
EXECUTOR = role_context("executor")
EXECUTOR_HOST = role_context("networked")
# The same roles with kernel_enforced = "deny" (early refusal; what the regulated preset fixes,
# and what every role did before the key existed).
EXECUTOR_EARLY = dataclasses.replace(EXECUTOR, role="executor-early", kernel_enforced="deny")
EXECUTOR_HOST_EARLY = dataclasses.replace(EXECUTOR_HOST, role="networked-early", kernel_enforced="deny")

# The text rules alone, independent of a cell's layout: everything writable.
LAYOUT_FREE = GateContext(role="layout-free", mode="open", network="host", worktree="/workspace/project",
                          writable=("/",), home="/home/user")
# An executor role with the recommended git deny list (what dcg calls core.git).
EXECUTOR_GIT = GateContext(role="executor-git", mode="open", network="host", worktree="/workspace/project",
                           writable=("/",),
                           home="/home/user", deny_commands=RECOMMENDED_DENY_COMMANDS)

# Lines of dangerous_catastrophic.txt we deliberately allow (see docs/governance.md).
CATASTROPHIC_EXCEPTIONS = frozenset({"rm -rf ./build"})


def kernel_flagged(d) -> bool:
    return any(f.endswith(".kernel_enforced") for f in d.flags)


def why_denied(rule: str, ctx: GateContext) -> str:
    """What a refusal of a benign line amounts to in a cell of this role."""
    if rule.startswith("network.") and ctx.network != "host":
        return "network use under network deny"
    if rule == "sandbox.path_escape" and "/" not in ctx.writable:
        return "write outside the cell's writable paths"
    if rule == "sandbox.deny_path":
        return "deny-path read"
    if rule.startswith("hardline."):
        return "hardline by choice"
    return "other"


def lines(name: str) -> list[str]:
    out = []
    for raw in (CORPORA / name).read_text(encoding="utf-8").splitlines():
        if raw.strip() or raw == "":
            out.append(raw.replace("\\n", "\n") if "<<" in raw else raw)
    return [x for x in out if x.strip()]


def dcg() -> list[dict]:
    return [json.loads(x) for x in (CORPORA / "dcg_labeled_corpus.jsonl").read_text(encoding="utf-8").splitlines()]


def pct(a: int, b: int) -> str:
    return f"{a}/{b} ({100.0 * a / b:.1f}%)" if b else "0/0"


def main(verbose: bool = False) -> dict:
    figures: dict = {}
    cat = lines("dangerous_catastrophic.txt")
    ds = [judge_shell(c, EXECUTOR) for c in cat]
    denied = sum(not d.allowed for d in ds)
    hard = sum(d.check == "hardline" for d in ds)
    print("dangerous_catastrophic.txt (executor, network deny)")
    print(f"  denied by any check: {pct(denied, len(cat))}")
    print(f"  denied by hardline : {pct(hard, len(cat))}")
    miss = [c for c, d in zip(cat, ds) if d.check != "hardline"]
    print(f"  not hardline       : {miss}")
    lost = [c for c, d in zip(cat, ds) if d.allowed and not judge_shell(c, EXECUTOR_EARLY).allowed]
    print(f"  denied only with kernel_enforced deny: {lost}")
    figures["catastrophic"] = {"denied": denied, "hardline": hard, "total": len(cat), "not_hardline": miss,
                               "kernel_flagged_only": lost}

    ben = lines("benign_hard_negatives.txt")
    for label, ctx in (("executor, network deny", EXECUTOR), ("executor, kernel_enforced deny", EXECUTOR_EARLY),
                       ("networked, network host", EXECUTOR_HOST),
                       ("networked, kernel_enforced deny", EXECUTOR_HOST_EARLY), ("layout-free", LAYOUT_FREE)):
        ds = [judge_shell(c, ctx) for c in ben]
        fd = [(c, d.rule) for c, d in zip(ben, ds) if not d.allowed]
        kf = sum(d.allowed and kernel_flagged(d) for d in ds)
        kinds = collections.Counter(why_denied(r, ctx) for _c, r in fd)
        print(f"benign_hard_negatives.txt ({label}): false denials {pct(len(fd), len(ben))}: "
              + ", ".join(f"{n} {k}" for k, n in kinds.most_common())
              + (f"; allowed with a kernel_enforced flag: {kf}" if kf else ""))
        for c, r in fd:
            print(f"    {r:28s} {c[:90]!r}")
        figures[f"benign_{label.replace(' ', '_').replace('-', '_')}"] = {"false_denied": len(fd), "total": len(ben),
                                                        "kernel_flagged": kf, "cases": fd}

    rows = dcg()
    for label, ctx in (("layout-free", LAYOUT_FREE), ("git deny list", EXECUTOR_GIT),
                       ("networked, network host", EXECUTOR_HOST), ("executor, network deny", EXECUTOR),
                       ("executor, kernel_enforced deny", EXECUTOR_EARLY)):
        by = collections.defaultdict(lambda: [0, 0, 0, 0])  # deny_hit, deny_total, allow_fd, allow_total
        kernel_only = 0  # deny-labelled lines allowed with a kernel_enforced flag (the cell refuses them)
        for r in rows:
            if r["expected"] not in ("allow", "deny"):
                continue
            d = judge_shell(r["command"], ctx)
            b = by[r["category"]]
            if r["expected"] == "deny":
                b[0] += not d.allowed
                b[1] += 1
                kernel_only += d.allowed and kernel_flagged(d)
            else:
                b[2] += not d.allowed
                b[3] += 1
                if not d.allowed and verbose:
                    print(f"    false deny [{r['category']}] {d.rule}: {r['command'][:80]!r}")
        tot = [sum(b[i] for b in by.values()) for i in range(4)]
        print(f"dcg_labeled_corpus.jsonl ({label}): recall on deny {pct(tot[0], tot[1])}"
              + (f" (+{kernel_only} allowed with a kernel_enforced flag)" if kernel_only else "")
              + f", false-deny on allow {pct(tot[2], tot[3])}")
        for c in sorted(by):
            b = by[c]
            print(f"    {c:28s} deny recall {pct(b[0], b[1]):>16s}   allow false-deny {pct(b[2], b[3]):>16s}")
        figures[f"dcg_{label.replace(' ', '_').replace('-', '_')}"] = {"deny_hit": tot[0], "deny_total": tot[1],
                                                     "allow_false_denied": tot[2], "allow_total": tot[3],
                                                     "deny_kernel_flagged": kernel_only,
                                                     "by_category": {k: list(v) for k, v in by.items()}}

    with open(CORPORA / "network_exfil_variants.tsv", encoding="utf-8") as f:
        variants = list(csv.DictReader(f, delimiter="\t"))
    ds = [judge_shell(v["command"].replace("HOST", "127.0.0.1").replace("PORT", "4000"), EXECUTOR_EARLY)
          for v in variants]
    caught = sum(not d.allowed for d in ds)
    flagged = sum(d.allowed and bool(d.flags) for d in ds)
    print(f"network_exfil_variants.tsv (executor, kernel_enforced deny; advisory: the network namespace is the "
          f"guarantee): denied {pct(caught, len(ds))}, flagged but allowed {flagged}")
    dk = [judge_shell(v["command"].replace("HOST", "127.0.0.1").replace("PORT", "4000"), EXECUTOR) for v in variants]
    kf = sum(d.allowed and "network.kernel_enforced" in d.flags for d in dk)
    print(f"network_exfil_variants.tsv (executor as shipped, kernel_enforced flag): denied "
          f"{pct(sum(not d.allowed for d in dk), len(dk))}, flagged network.kernel_enforced {kf}, other flags "
          f"{sum(d.allowed and bool(d.flags) and 'network.kernel_enforced' not in d.flags for d in dk)}")
    if verbose:
        for v, d in zip(variants, ds):
            print(f"    {v['id']:24s} {d.rule:24s} {','.join(d.flags)}")
    figures["network_variants"] = {"denied": caught, "flagged": flagged, "total": len(ds), "kernel_flagged": kf}

    batch = (ben + cat + [r["command"] for r in rows]) * 20
    t = time.perf_counter()
    for c in batch:
        judge_shell(c, EXECUTOR)
    dt = time.perf_counter() - t
    print(f"batch: {len(batch)} lines in {dt:.2f}s = {len(batch) / dt:,.0f} lines/s")
    figures["batch_lines_per_s"] = len(batch) / dt
    return figures


if __name__ == "__main__":
    main(verbose="--verbose" in sys.argv)
