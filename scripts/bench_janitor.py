"""Benchmark of the startup janitor (run by scripts/bench).

    bench_janitor.py AGNSUP_BIN [--sizes "100x10 100x20 50x20"] [--runs 3]

1. the /proc scan the janitor makes once per kill round (every process: stat
   and the ownership token from environ), per host process, on this host as
   it is and with 1,000 more idle processes (outside agnsup);
2. orphans made for real: CELLS `agnsup run` controllers, each with a cell of
   PROCS processes (a shell that starts PROCS-1 sleeps, then execs a sleep),
   all SIGKILLed at once with their cells alive; then `agnsup janitor` as an
   operator runs it, timed from its exec to its exit, and the in-process time
   its recovery receipt records (janitor start -> every process killed and
   verified, every cgroup empty and removed, the journal converged). Checked
   after each run: no cgroup directory and no process left.
Needs root (cgroups). Private state roots under /var/tmp, removed at the end.
"""
from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from agnsup.linux import cgroup, session

SETTLE = 3.0


def scan_cost(reps: int = 5) -> tuple[int, float, float]:
    """(processes, ms, us per process) of one janitor /proc scan, best of `reps`."""
    best, n = None, 0
    for _ in range(reps):
        t0 = time.perf_counter()
        n = len(session.Snapshot.take().procs)
        t = time.perf_counter() - t0
        best = t if best is None or t < best else best
    return n, best * 1000, best / n * 1e6


def orphans(agnsup: str, state: str, wt: str, layout, cells: int, per: int):
    """`cells` controllers with `per` processes each in their cell, then SIGKILL every controller."""
    env = {**os.environ, "AGNSUP_STATE_DIR": state}
    base = cgroup.base_node(layout, state)
    payload = f"i=1; while [ $i -lt {per} ]; do sleep 3600 & i=$((i+1)); done; exec sleep 3600"
    ctls = []
    logs = os.path.join(wt, "stderr")  # beside the worktrees: what a controller that ended early said
    os.makedirs(logs, exist_ok=True)
    for i in range(cells):
        d = os.path.join(wt, f"j{i}")
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(logs, f"c{i}"), "wb") as err:
            ctls.append(subprocess.Popen([agnsup, "run", "--workdir", d, "--run-id", "jbench", "--cell", f"c{i}",
                                          "--", "sh", "-c", payload], env=env, stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, stderr=err))

    def said(c) -> str:
        with open(os.path.join(logs, f"c{ctls.index(c)}"), "rb") as f:
            lines = f.read().decode(errors="replace").strip().splitlines()
        return lines[-1] if lines else "(nothing on stderr)"
    want, deadline = cells * per, time.monotonic() + 300
    try:
        while True:
            n = len(cgroup.procs(base.primary[1])) if base.primary else 0
            ended = [c for c in ctls if c.poll() is not None]
            if ended:
                raise SystemExit(f"bench: {len(ended)} controller(s) ended before the kill (exit "
                                 f"{[c.returncode for c in ended[:5]]}; the first said: {said(ended[0])})")
            if n >= want:
                break
            if time.monotonic() > deadline:
                raise SystemExit(f"bench: only {n} of {want} cell processes after 300 s")
            time.sleep(0.2)
    except BaseException:
        for c in ctls:  # never leave the others running: each ends its cell (TERM, grace, kill)
            if c.poll() is None:
                c.send_signal(signal.SIGTERM)
        for c in ctls:
            c.wait()
        raise
    for c in ctls:
        c.send_signal(signal.SIGKILL)  # our own children: no shutdown hook runs
    for c in ctls:
        c.wait()
    ended = [c.returncode for c in ctls if c.returncode != -signal.SIGKILL]
    if ended:  # ended by itself between the last count and the kill: its cell is no orphan
        raise SystemExit(f"bench: {len(ended)} controller(s) ended before the kill (exit {ended[:5]})")
    time.sleep(SETTLE)  # let the burst of 100 controller starts die down: time the janitor, not the setup
    return base, want


def janitor(agnsup: str, state: str, base) -> tuple[float, float, int, int]:
    """(wall s, in-process s, cells recovered, processes killed) of one `agnsup janitor`."""
    t0 = time.perf_counter()
    cp = subprocess.run([agnsup, "janitor"], env={**os.environ, "AGNSUP_STATE_DIR": state},
                        capture_output=True, check=True, text=True)
    wall = time.perf_counter() - t0
    path = cp.stdout.strip().splitlines()[-1].removeprefix("receipt: ")
    with open(path) as f:
        rec = json.load(f)
    cells = [c for ctl in rec["controllers"] for c in ctl["cells"]]
    left = [d for p in base.paths.values() for d in cgroup.walk(p) if d != p]
    if left or (base.primary and cgroup.procs(base.primary[1])):
        raise SystemExit(f"bench: the janitor left cgroups or processes: {left[:5]}")
    return (wall, rec["duration"], sum(c["final_state"] == "recovered" for c in cells),
            sum(len(c["killed"]) for c in cells))


def main(argv: list[str]) -> None:
    agnsup, sizes, runs = argv[0], "100x10 100x20 50x20".split(), 3
    rest = argv[1:]
    while rest:
        if rest[0] == "--sizes" and len(rest) > 1:
            sizes, rest = rest[1].split(), rest[2:]
        elif rest[0] == "--runs" and len(rest) > 1:
            runs, rest = int(rest[1]), rest[2:]
        else:
            raise SystemExit(f"bench_janitor: unknown argument {rest[0]!r}")
    layout = cgroup.detect_layout()

    print("The janitor's /proc scan (every process: stat + environ token), best of 5:")
    print(f"{'host processes':>15} {'scan ms':>8} {'us/process':>11}")
    print("{:15d} {:8.2f} {:11.2f}".format(*scan_cost()))
    extra = [subprocess.Popen(["sleep", "3600"], start_new_session=True) for _ in range(1000)]
    try:
        time.sleep(0.5)
        print("{:15d} {:8.2f} {:11.2f}   (+1000 idle sleeps outside agnsup)".format(*scan_cost()))
    finally:
        for p in extra:
            p.kill()
        for p in extra:
            p.wait()

    print()
    print(f"Janitor: orphaned cells of SIGKILLed controllers ({layout.kind} cgroups), {runs} run(s), medians")
    print(f"{'cells x procs':14} {'processes':>9} {'janitor ms':>11} {'in-process ms':>14} {'us/process':>11} "
          f"{'killed':>7}")
    with tempfile.TemporaryDirectory(dir="/var/tmp", prefix="agnsup-bench-jan-wt.") as wt:
        for size in sizes:
            cells, per = map(int, size.split("x"))
            walls, durs, kills = [], [], []
            for _ in range(runs):
                with tempfile.TemporaryDirectory(dir="/var/tmp", prefix="agnsup-bench-jan.") as state:
                    base, want = orphans(agnsup, state, wt, layout, cells, per)
                    wall, dur, recovered, killed = janitor(agnsup, state, base)
                    if recovered != cells:
                        raise SystemExit(f"bench: recovered {recovered} of {cells} cells")
                    walls.append(wall)
                    durs.append(dur)
                    kills.append(killed)
                    for p in base.paths.values():
                        cgroup.remove_if_empty(p)
            w, d = statistics.median(walls), statistics.median(durs)
            print(f"{size:14} {want:9d} {w * 1000:11.1f} {d * 1000:14.1f} {d / want * 1e6:11.1f} "
                  f"{min(kills):7d}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
