"""Benchmarks of cancel and of the serve controller (run by scripts/bench).

    bench_cells.py AGNSUP_BIN [--procs 1000] [--cells 1000] [--rounds 3] [--cancel-only]

1. cancel: one cell holding PROCS processes that ignore SIGTERM, half of them
   double-forked `setsid` daemons (reparented out of the tree, still in the cgroup); time
   from `agnsup cancel --cell C --grace 0` being called to its return (it
   returns once the cgroup is empty, removed and the receipt written); against
   the raw kernel floor for the same tree started the same way: `1` written to
   its cgroup.kill from this process, then poll(2) on cgroup.events until
   `populated 0`. ROUNDS of each, alternating; medians and their ratio.
2. serve: CELLS sequential short cells (`true`) through one `agnsup serve`
   over its socket, per-cell time against a plain fork/exec of /bin/true in
   the same run (compare the ratio; this machine is shared and noisy).
Needs root (cgroups). Uses a private state root, removed at the end.
"""
from __future__ import annotations

import errno
import json
import os
import statistics
import subprocess
import sys
import time

from scratch import scratch

# the kernel's cost of a comparable set of namespaces (issue 29's yardstick), when bubblewrap is installed
BWRAP = (["bwrap", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--unshare-all", "true"]
         if any(os.access(os.path.join(d, "bwrap"), os.X_OK) for d in os.environ.get("PATH", "").split(os.pathsep))
         else None)


def _wait(cond, timeout, what):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise SystemExit(f"bench: timed out waiting for {what}")
        time.sleep(0.05)


def _big_cell(agnsup: str, env: dict, wt: str, nprocs: int, cell: str):
    """(controller, its cell's v2 cgroup directory, processes in it) of a cell holding `nprocs` processes."""
    half = nprocs // 2
    # leader + `half` children + `half` daemons (each `setsid sh -c 'sleep &'` exits at once)
    # SIGTERM ignored (inherited across exec), so the kill after the grace does the work
    script = (f"trap '' TERM; i=0; while [ $i -lt {half} ]; do sleep 1000 & setsid sh -c 'sleep 1000 &' ; "
              "i=$((i+1)); done; echo up; wait")
    p = subprocess.Popen([agnsup, "run", "--run-id", "bench", "--cell", cell, "--workdir", wt, "--",
                          "sh", "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert p.stdout.readline() == b"up\n", "the tree did not start"
    row = [c for c in json.loads(subprocess.check_output([agnsup, "ps", "--json"], env=env))
           if c["cell_id"] == cell][0]
    cg = row["cgroup"].get("v2") or next(iter(row["cgroup"].values()))

    def count():
        n = 0
        for d, _, _ in os.walk(cg):
            with open(os.path.join(d, "cgroup.procs")) as f:
                n += len(f.read().split())
        return n

    _wait(lambda: count() >= nprocs, 120, f"{nprocs} processes in {cg}")
    return p, cg, count()


def cancel_once(agnsup: str, env: dict, wt: str, nprocs: int, cell: str) -> dict:
    """`agnsup cancel --cell C --grace 0`: call to return (the cgroup empty and removed, the receipt written)."""
    p, cg, n = _big_cell(agnsup, env, wt, nprocs, cell)
    t0 = time.monotonic()
    out = json.loads(subprocess.check_output([agnsup, "cancel", "--cell", cell, "--grace", "0", "--json"], env=env))
    took = time.monotonic() - t0
    p.wait(60)
    p.stdout.close()
    assert out["cancelled"] == 1 and out["cells"][0]["empty"] and not os.path.exists(cg), out
    return {"processes": n, "cancel_s": took, "kill": out["cells"][0]["kill"]}


def raw_kill_once(agnsup: str, env: dict, wt: str, nprocs: int, cell: str) -> dict:
    """The kernel's floor for the same tree, started the same way: from this process, `1` into the cell's
    cgroup.kill, then poll(2) on its cgroup.events until it says `populated 0` (the verify)."""
    import select
    p, cg, n = _big_cell(agnsup, env, wt, nprocs, cell)
    events = os.open(os.path.join(cg, "cgroup.events"), os.O_RDONLY | os.O_CLOEXEC)
    try:
        poller = select.poll()
        poller.register(events, select.POLLPRI | select.POLLERR)
        t0 = time.monotonic()
        with open(os.path.join(cg, "cgroup.kill"), "w") as f:
            f.write("1")
        while True:
            try:
                if b"populated 0" in os.pread(events, 4096, 0):
                    break
            except OSError as e:  # ENODEV: its controller saw it empty and removed it first
                if e.errno != errno.ENODEV:
                    raise
                break
            poller.poll(1000)  # the kernel notifies on every change of populated (kernfs_notify)
        took = time.monotonic() - t0
    finally:
        os.close(events)
    p.wait(60)  # its controller sees the tree gone and concludes the cell (not timed)
    p.stdout.close()
    return {"processes": n, "raw_s": took}


def bench_cancel(agnsup: str, env: dict, wt: str, nprocs: int, rounds: int = 3) -> dict:
    """`rounds` of each, alternating (the order flips every round): agnsup cancel vs the raw kill + verify."""
    cancels, raws, n, kill = [], [], 0, None
    for i in range(rounds):
        order = ("cancel", "raw") if i % 2 == 0 else ("raw", "cancel")
        for what in order:
            if what == "cancel":
                c = cancel_once(agnsup, env, wt, nprocs, f"big{i}")
                cancels.append(c["cancel_s"])
                n, kill = c["processes"], c["kill"]
            else:
                raws.append(raw_kill_once(agnsup, env, wt, nprocs, f"raw{i}")["raw_s"])
    c, r = statistics.median(cancels), statistics.median(raws)
    return {"processes": n, "cancel_s": c, "raw_s": r, "ratio": c / r, "kill": kill, "rounds": rounds,
            "cancels": cancels, "raws": raws}


def bench_serve(agnsup: str, env: dict, wt: str, ncells: int) -> dict:
    from agnsup.doors.serve import Client
    srv = subprocess.Popen([agnsup, "serve"], env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    ready = json.loads(srv.stdout.readline())
    per, bw = [], []
    try:
        with Client(ready["socket"]) as c:
            c.call("run", argv=["true"], workdir=wt, run_id="warm")
            for i in range(ncells):
                t0 = time.perf_counter()
                r = c.call("run", argv=["true"], workdir=wt, run_id="serve-bench")
                per.append(time.perf_counter() - t0)
                assert r["exit_code"] == 0, r
                if BWRAP:  # the goal's yardstick (issue 29: a serve cell <= 2x bwrap), in the same loop
                    t0 = time.perf_counter()
                    subprocess.run(BWRAP, check=True)
                    bw.append(time.perf_counter() - t0)
    finally:
        srv.terminate()
        srv.wait(60)
        srv.stdout.close()
    plain = []
    for _ in range(ncells):
        t0 = time.perf_counter()
        subprocess.run(["/bin/true"], check=True)
        plain.append(time.perf_counter() - t0)
    return {"cells": ncells, "serve_median_ms": statistics.median(per) * 1000,
            "serve_mean_ms": statistics.mean(per) * 1000, "fork_exec_median_ms": statistics.median(plain) * 1000,
            "ratio": statistics.median(per) / statistics.median(plain),
            "bwrap_median_ms": statistics.median(bw) * 1000 if bw else None,
            "x_bwrap": statistics.median(per) / statistics.median(bw) if bw else None}


def main(argv: list[str]) -> None:
    agnsup = argv[0]
    nprocs = int(argv[argv.index("--procs") + 1]) if "--procs" in argv else 1000
    ncells = int(argv[argv.index("--cells") + 1]) if "--cells" in argv else 1000
    rounds = int(argv[argv.index("--rounds") + 1]) if "--rounds" in argv else 3
    with scratch(agnsup, "cells") as (env, wt):
        c = bench_cancel(agnsup, env, wt, nprocs, rounds)
        print(f"cancel, grace 0: {c['processes']} processes (half setsid daemons) gone, cgroup removed, "
              f"receipt written in {c['cancel_s'] * 1000:.0f} ms ({c['kill']}); raw cgroup.kill + populated 0 "
              f"of the same tree {c['raw_s'] * 1000:.0f} ms; ratio {c['ratio']:.2f}x (medians of {c['rounds']} "
              "alternating rounds)")
        if "--cancel-only" in argv:
            return
        s = bench_serve(agnsup, env, wt, ncells)
        print(f"serve: {s['cells']} sequential cells, median {s['serve_median_ms']:.2f} ms/cell "
              f"(mean {s['serve_mean_ms']:.2f}); plain fork/exec of /bin/true {s['fork_exec_median_ms']:.2f} ms; "
              f"ratio {s['ratio']:.1f}x")
        if s["bwrap_median_ms"] is not None:
            print(f"serve: bwrap --unshare-all true in the same loop {s['bwrap_median_ms']:.2f} ms; serve cell "
                  f"{s['x_bwrap']:.2f}x bwrap (load {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main(sys.argv[1:])
