"""Per-cell latency of an MCP `run_process` of `true` against `agnsup serve`'s `run` (run by scripts/bench).

    bench_mcp.py AGNSUP_BIN [--cells 200]

One `agnsup serve` and one `agnsup mcp` (driven by the mcp SDK's own stdio
client, as a coding agent would) over one private state root, the calls
interleaved (serve, MCP, serve, MCP, ...) so both see the same machine load;
a plain fork/exec of /bin/true in the same loop is the floor. Each sample is
one request's round trip: a whole cell (policy, cgroup, namespaces, journal,
receipt) and its result. Needs root (cgroups) and the `mcp` extra.
"""
from __future__ import annotations

import argparse
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


def summary(xs: list[float]) -> dict:
    q = statistics.quantiles(xs, n=4)
    return {"median_ms": statistics.median(xs) * 1e3, "p25_ms": q[0] * 1e3, "p75_ms": q[2] * 1e3,
            "mean_ms": statistics.fmean(xs) * 1e3, "n": len(xs)}


async def bench(agnsup: str, env: dict, wt: str, ncells: int) -> dict:
    from mcp import ClientSession, StdioServerParameters, stdio_client
    from agnsup.doors.serve import Client
    srv = subprocess.Popen([agnsup, "serve"], env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    ready = json.loads(srv.stdout.readline())
    samples: dict[str, list[float]] = {"fork/exec /bin/true": [], "serve run": [], "mcp run_process": []}
    if BWRAP:
        samples["bwrap --unshare-all true"] = []
    params = StdioServerParameters(command=agnsup, args=["mcp", "--workdir", wt, "--run-id", "mcp-bench"], env=env)
    try:
        with Client(ready["socket"]) as c, open(os.devnull, "w") as err:
            async with stdio_client(params, errlog=err) as (read, write), ClientSession(read, write) as s:
                await s.initialize()
                c.call("run", argv=["true"], workdir=wt, run_id="warm")
                await s.call_tool("run_process", {"argv": ["true"]})
                for _ in range(ncells):
                    t0 = time.perf_counter()
                    subprocess.run(["/bin/true"], check=True)
                    samples["fork/exec /bin/true"].append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    r = c.call("run", argv=["true"], workdir=wt, run_id="serve-bench")
                    samples["serve run"].append(time.perf_counter() - t0)
                    assert r["exit_code"] == 0, r
                    t0 = time.perf_counter()
                    res = await s.call_tool("run_process", {"argv": ["true"]})
                    samples["mcp run_process"].append(time.perf_counter() - t0)
                    assert not res.is_error and res.structured_content["exit_code"] == 0, res
                    if BWRAP:
                        t0 = time.perf_counter()
                        subprocess.run(BWRAP, check=True)
                        samples["bwrap --unshare-all true"].append(time.perf_counter() - t0)
    finally:
        srv.terminate()
        srv.wait(60)
    return {name: summary(xs) for name, xs in samples.items()}


def main() -> int:
    import anyio
    ap = argparse.ArgumentParser()
    ap.add_argument("agnsup")
    ap.add_argument("--cells", type=int, default=200)
    a = ap.parse_args()
    with scratch(a.agnsup, "mcp") as (env, wt):
        res = anyio.run(bench, a.agnsup, env, wt, a.cells)
    serve = res["serve run"]["median_ms"]
    bw = res.get("bwrap --unshare-all true", {}).get("median_ms")
    print(f"{'per cell, interleaved':24} {'median ms':>10} {'p25':>8} {'p75':>8} {'x serve':>8} {'x bwrap':>8}   "
          f"(n={a.cells}, load {os.getloadavg()[0]:.1f})")
    for name, r in res.items():
        xb = f"{r['median_ms'] / bw:8.2f}" if bw else f"{'':8}"
        print(f"{name:24} {r['median_ms']:10.2f} {r['p25_ms']:8.2f} {r['p75_ms']:8.2f} {r['median_ms'] / serve:8.2f} {xb}")
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
