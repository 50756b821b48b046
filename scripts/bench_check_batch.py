#!/usr/bin/env python3
"""Throughput of `agnsup check --batch`, this checkout against another, interleaved.

    python scripts/bench_check_batch.py [--before DIR] [--rounds 5] [--lines 20000] [--role executor]

The input is the corpus mix (benign hard negatives, catastrophic lines, dcg
commands; ../shared/corpora or tests/data/corpora) repeated to --lines lines.
Each round runs every build once, so both see the same machine load (this
machine is shared: compare within one run). A build is judged through the
real CLI (`agnsup.doors.cli`), in a fresh interpreter, with its own state root;
the time includes the interpreter start and imports. Two rates per build:
by wall time, and by the CPU time the child used (getrusage): the second
moves far less with the load other processes put on the machine. The corpora are text
only: nothing here executes a line of them.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared" / "corpora"

# Runs agnsup's click CLI from the checkout given as argv[1] (not from an editable install's finder).
LAUNCH = r"""
import importlib.util, sys
code = sys.argv.pop(1)
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in getattr(f, "__module__", "")
                    and "editable" not in getattr(f, "__name__", "")]
sys.path.insert(0, code)
import os
if os.path.isdir(code + "/policies"):  # a checkout before issue 30: the roles were a top-level directory
    spec = importlib.util.spec_from_file_location("agnsup.policies", code + "/policies/__init__.py",
                                                  submodule_search_locations=[code + "/policies"])
    mod = importlib.util.module_from_spec(spec); sys.modules["agnsup.policies"] = mod; spec.loader.exec_module(mod)
try:
    from agnsup.doors.cli import main
except ImportError:  # before issue 30's folders
    from agnsup.cli import main
main(prog_name="agnsup")
"""


def corpus_mix(corpora: Path, n: int) -> list[str]:
    out: list[str] = []
    for name in ("benign_hard_negatives.txt", "dangerous_catastrophic.txt"):
        out += [x for x in (corpora / name).read_text(encoding="utf-8").splitlines() if x.strip()]
    for x in (corpora / "dcg_labeled_corpus.jsonl").read_text(encoding="utf-8").splitlines():
        c = json.loads(x)["command"]
        out += [c.replace("\n", " ")] if c.strip() else []
    reps = -(-n // len(out))
    return (out * reps)[:n]


def _child_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def run(code: Path, batch: str, role: str, state: str, wt: str) -> tuple[float, float, int]:
    cpu = _child_cpu()
    t = time.perf_counter()
    cp = subprocess.run([sys.executable, "-c", LAUNCH, str(code), "--state-dir", state, "check", "--role", role,
                         "--workdir", wt, "--batch", batch], capture_output=True, text=True)
    dt = time.perf_counter() - t
    cpu = _child_cpu() - cpu
    if cp.returncode not in (0, 126):
        raise SystemExit(f"{code}: exit {cp.returncode}: {cp.stderr[-2000:]}")
    return dt, cpu, len(cp.stdout.splitlines())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", type=Path, default=None)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--lines", type=int, default=20000)
    ap.add_argument("--role", default="executor")
    ap.add_argument("--corpora", type=Path, default=SHARED if SHARED.is_dir() else ROOT / "tests" / "data" / "corpora")
    a = ap.parse_args()
    builds = ([("before", a.before.resolve())] if a.before else []) + [("after", ROOT)]
    with tempfile.TemporaryDirectory(prefix="agnsup-bench-batch-") as tmp:
        batch = os.path.join(tmp, "batch.txt")
        lines = corpus_mix(a.corpora, a.lines)
        Path(batch).write_text("\n".join(lines) + "\n", encoding="utf-8")
        wt = os.path.join(tmp, "wt")
        os.mkdir(wt)
        rates: dict[str, list[float]] = {name: [] for name, _ in builds}
        cpu_rates: dict[str, list[float]] = {name: [] for name, _ in builds}
        for _ in range(a.rounds):
            for name, code in builds:
                state = tempfile.mkdtemp(dir=tmp)
                dt, cpu, n = run(code, batch, a.role, state, wt)
                if n != len(lines):
                    raise SystemExit(f"{name}: {n} decisions for {len(lines)} lines")
                rates[name].append(n / dt)
                cpu_rates[name].append(n / cpu)
    print(f"{len(lines)} lines, role {a.role}, {a.rounds} interleaved rounds (lines/s, whole CLI invocation; "
          f"load average {os.getloadavg()[0]:.1f})")
    for name, code in builds:
        r, c = rates[name], cpu_rates[name]
        print(f"  {name:7s} {code}: wall median {statistics.median(r):,.0f} (min {min(r):,.0f}, max {max(r):,.0f}); "
              f"CPU median {statistics.median(c):,.0f} (max {max(c):,.0f})")


if __name__ == "__main__":
    main()
