#!/usr/bin/env python3
"""Print the governance gate's figures on the labelled command corpora.

    python scripts/gate_corpus_report.py [--corpora DIR] [--verbose] [--json]
    python scripts/gate_corpus_report.py --before DIR      # the same figures for another checkout, side by side

Recall on the deny sets (dangerous_catastrophic.txt, dcg deny), false denials
on the allow sets (benign_hard_negatives.txt, dcg allow), per context, per
rule id and per dcg category, and single-threaded throughput. `--corpora`
defaults to the steering repository's ../shared/corpora when it exists, else
tests/data/corpora (the same files). `--code DIR` judges with the agnsup
package of another checkout (e.g. `git archive main | tar -x -C /tmp/base`);
`--before DIR` runs that in a subprocess and prints before/after columns.
The corpora are text only: nothing here executes a line of them.
"""

from __future__ import annotations

import collections
import csv
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared" / "corpora"
WORKTREE = "/workspace/project"
# Lines of dangerous_catastrophic.txt we deliberately allow (see docs/governance.md).
CATASTROPHIC_EXCEPTIONS = frozenset({"rm -rf ./build"})


def _use_code(code: Path) -> None:
    """Import agnsup from `code` instead of this checkout (or an editable install's finder)."""
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in getattr(f, "__module__", "")
                        and "editable" not in getattr(f, "__name__", "")]
    sys.path.insert(0, str(code))
    if (code / "policies").is_dir():  # a checkout before issue 30: the roles were a top-level directory
        import importlib.util
        spec = importlib.util.spec_from_file_location("agnsup.policies", code / "policies" / "__init__.py",
                                                      submodule_search_locations=[str(code / "policies")])
        mod = importlib.util.module_from_spec(spec)
        sys.modules["agnsup.policies"] = mod
        spec.loader.exec_module(mod)


def contexts() -> dict:
    from agnsup import governance, policy
    from agnsup.util import record
    from agnsup.gate import GateContext
    from agnsup.gate.programs import RECOMMENDED_DENY_COMMANDS

    def shipped(name: str):
        # The gate's context for a shipped role exactly as `agnsup run` builds it (writable /tmp, /dev/shm;
        # deny paths; preset), with a fixed home for the corpora.
        return record.replace(governance.context(policy.load(name), WORKTREE, None), home="/home/user")

    executor, networked = shipped("executor"), shipped("networked")
    return {
        # The shipped roles with their preset's kernel_enforced = "flag": what the cell's kernel refuses is flagged.
        "executor": executor,
        "networked": networked,
        # The same with kernel_enforced = "deny" (early refusal; what the regulated preset fixes).
        "executor, kernel_enforced deny": record.replace(executor, role="executor-early", kernel_enforced="deny"),
        # The text rules alone, independent of a cell's layout: everything writable, host network.
        "layout-free": GateContext(role="layout-free", mode="open", network="host", worktree=WORKTREE,
                                   writable=("/",), home="/home/user"),
        # layout-free plus the recommended git deny list (what dcg calls core.git).
        "git deny list": GateContext(role="executor-git", mode="open", network="host", worktree=WORKTREE,
                                     writable=("/",), home="/home/user", deny_commands=RECOMMENDED_DENY_COMMANDS),
    }


def lines(corpora: Path, name: str) -> list[str]:
    return [raw.replace("\\n", "\n") if "<<" in raw else raw
            for raw in (corpora / name).read_text(encoding="utf-8").splitlines() if raw.strip()]


def pct(a: int, b: int) -> str:
    return f"{a}/{b} ({100.0 * a / b:.1f}%)" if b else "0/0"


def figures(corpora: Path, verbose: bool = False) -> dict:
    """Everything the report prints, as plain data (also what --before compares)."""
    from agnsup.gate import judge_shell

    cat = lines(corpora, "dangerous_catastrophic.txt")
    ben = lines(corpora, "benign_hard_negatives.txt")
    dcg = [json.loads(x) for x in (corpora / "dcg_labeled_corpus.jsonl").read_text(encoding="utf-8").splitlines()]
    dcg = [r for r in dcg if r.get("expected") in ("allow", "deny")]
    deny_set = [("catastrophic", c) for c in cat if c not in CATASTROPHIC_EXCEPTIONS] + \
        [("dcg", r["command"]) for r in dcg if r["expected"] == "deny"]
    allow_set = [("benign", c) for c in ben] + [("dcg", r["command"]) for r in dcg if r["expected"] == "allow"]
    out: dict = {"contexts": {}}
    for label, ctx in contexts().items():
        caught: collections.Counter = collections.Counter()
        false: collections.Counter = collections.Counter()
        missed: list[str] = []
        false_lines: list[tuple[str, str]] = []
        per_corpus = collections.defaultdict(lambda: [0, 0, 0, 0])  # hit, total, false, total
        flagged = 0
        for src, c in deny_set:
            d = judge_shell(c, ctx)
            per_corpus[src][1] += 1
            if not d.allowed:
                caught[d.rule] += 1
                per_corpus[src][0] += 1
            else:
                missed.append(c)
                flagged += any(f.endswith(".kernel_enforced") for f in d.flags)
        for src, c in allow_set:
            d = judge_shell(c, ctx)
            per_corpus[src][3] += 1
            if not d.allowed:
                false[d.rule] += 1
                per_corpus[src][2] += 1
                false_lines.append((d.rule, c))
        by_cat = collections.defaultdict(lambda: [0, 0, 0, 0])
        for r in dcg:
            d = judge_shell(r["command"], ctx)
            b = by_cat[r["category"]]
            if r["expected"] == "deny":
                b[0] += not d.allowed
                b[1] += 1
            else:
                b[2] += not d.allowed
                b[3] += 1
        out["contexts"][label] = {"caught": dict(caught), "false": dict(false), "deny_total": len(deny_set),
                                  "allow_total": len(allow_set), "missed": missed, "false_lines": false_lines,
                                  "missed_kernel_flagged": flagged,
                                  "per_corpus": {k: list(v) for k, v in per_corpus.items()},
                                  "by_category": {k: list(v) for k, v in by_cat.items()}}
    with open(corpora / "network_exfil_variants.tsv", encoding="utf-8") as f:
        variants = list(csv.DictReader(f, delimiter="\t"))
    net = {}
    for label in ("executor", "executor, kernel_enforced deny", "networked"):
        ctx = contexts()[label]
        ds = [judge_shell(v["command"].replace("HOST", "127.0.0.1").replace("PORT", "4000"), ctx) for v in variants]
        net[label] = {"denied": sum(not d.allowed for d in ds), "total": len(ds),
                      "flagged": sum(d.allowed and bool(d.flags) for d in ds),
                      "rules": dict(collections.Counter(d.rule for d in ds if not d.allowed))}
    out["network_variants"] = net
    ctx = contexts()["executor"]
    batch = (ben + cat + [r["command"] for r in dcg]) * 10
    t = time.process_time()  # CPU time: other processes' load on a shared machine moves it far less
    for c in batch:
        judge_shell(c, ctx)
    out["lines_per_s"] = len(batch) / (time.process_time() - t)
    return out


def _cell(fig: dict | None, label: str, key: str, rule: str | None = None) -> str:
    if fig is None or label not in fig["contexts"]:
        return "-"
    c = fig["contexts"][label]
    if rule is None:
        n = sum(c[key].values())
        return pct(n, c["deny_total" if key == "caught" else "allow_total"])
    return str(c[key].get(rule, 0))


def print_report(after: dict, before: dict | None = None, verbose: bool = False) -> None:
    both = before is not None
    for label, c in after["contexts"].items():
        print(f"\n## {label}")
        head = "| rule | " + ("caught before | caught after | false denials before | false denials after |"
                              if both else "caught (deny-labelled) | false denials (allow-labelled) |")
        print(head)
        print("|" + "---|" * (head.count("|") - 1))
        rules = set(c["caught"]) | set(c["false"])
        if both and label in before["contexts"]:
            rules |= set(before["contexts"][label]["caught"]) | set(before["contexts"][label]["false"])
        for rule in sorted(rules):
            if both:
                print(f"| `{rule}` | {_cell(before, label, 'caught', rule)} | {_cell(after, label, 'caught', rule)} "
                      f"| {_cell(before, label, 'false', rule)} | {_cell(after, label, 'false', rule)} |")
            else:
                print(f"| `{rule}` | {c['caught'].get(rule, 0)} | {c['false'].get(rule, 0)} |")
        if both:
            print(f"| **recall / false denials** | {_cell(before, label, 'caught')} | {_cell(after, label, 'caught')} "
                  f"| {_cell(before, label, 'false')} | {_cell(after, label, 'false')} |")
        else:
            print(f"| **recall / false denials** | {_cell(after, label, 'caught')} | {_cell(after, label, 'false')} |")
        for src, (hit, tot, fd, atot) in sorted(c["per_corpus"].items()):
            b = before["contexts"].get(label, {}).get("per_corpus", {}).get(src) if both else None
            was = f" (before: {pct(b[0], b[1])}, {pct(b[2], b[3])})" if b else ""
            print(f"  {src}: recall {pct(hit, tot)}, false denials {pct(fd, atot)}{was}")
        if c["missed_kernel_flagged"]:
            print(f"  deny-labelled lines allowed with a *.kernel_enforced flag (the cell refuses them): "
                  f"{c['missed_kernel_flagged']}")
        if verbose:
            for line in c["missed"]:
                print(f"    missed: {line[:100]!r}")
            for rule, line in c["false_lines"]:
                print(f"    false deny {rule:28s} {line[:90]!r}")
            for cat in sorted(c["by_category"]):
                b = c["by_category"][cat]
                print(f"    dcg {cat:28s} deny recall {pct(b[0], b[1]):>16s}   allow false-deny {pct(b[2], b[3]):>16s}")
    print("\n## network_exfil_variants.tsv (advisory: the network namespace is the guarantee)")
    for label, n in after["network_variants"].items():
        b = before["network_variants"].get(label) if both else None
        was = f" (before: denied {b['denied']}, flagged {b['flagged']})" if b else ""
        print(f"  {label}: denied {pct(n['denied'], n['total'])}, allowed with flags {n['flagged']}{was}")
    was = f" (before: {before['lines_per_s']:,.0f})" if both else ""
    print(f"\nthroughput, in process, executor, by CPU time: {after['lines_per_s']:,.0f} lines/s{was}")


def main(argv: list[str]) -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpora", type=Path, default=SHARED if SHARED.is_dir() else ROOT / "tests" / "data" / "corpora")
    ap.add_argument("--code", type=Path, default=None, help="judge with the agnsup package under this directory")
    ap.add_argument("--before", type=Path, default=None, help="another checkout to compare with")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--verbose", action="store_true")
    a = ap.parse_args(argv)
    if a.code:
        _use_code(a.code.resolve())
    else:
        sys.path.insert(0, str(ROOT))
    before = None
    if a.before:
        cp = subprocess.run([sys.executable, __file__, "--code", str(a.before), "--corpora", str(a.corpora), "--json"],
                            check=True, capture_output=True, text=True)
        before = json.loads(cp.stdout)
    after = figures(a.corpora.resolve(), a.verbose)
    if a.json:
        print(json.dumps(after))
        return
    print(f"corpora: {a.corpora.resolve()}")
    print_report(after, before, a.verbose)


if __name__ == "__main__":
    main(sys.argv[1:])
