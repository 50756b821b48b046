"""Per-cell latency of sandboxd's Execute of `true` against `agnsup serve`'s run, interleaved (run by scripts/bench).

    bench_sandboxd.py AGNSUP_BIN [--cells 300]

One `agnsup serve` and one `agnsup sandboxd` on one state root and worktree;
every round runs one cell through each, in turn (serve's `run` over its
socket, sandboxd's gRPC Execute; which goes first alternates), so both see the
same moments of this shared machine; plus a plain fork/exec of /bin/true.
Medians and p25 in ms.
Needs root (cgroups) and the k8s extra in AGNSUP_BIN's environment.
"""
from __future__ import annotations

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


def main(argv: list[str]) -> None:
    agnsup = argv[0]
    ncells = int(argv[argv.index("--cells") + 1]) if "--cells" in argv else 300
    import grpc

    from agnsup.doors.sandboxd import proto
    from agnsup.doors.serve import Client
    pb = proto.messages()
    with scratch(agnsup, "sandboxd") as (env, wt):
        procs = []
        try:
            serve = subprocess.Popen([agnsup, "serve"], env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
            procs.append(serve)
            sock = json.loads(serve.stdout.readline())["socket"]
            sbx = subprocess.Popen([agnsup, "sandboxd", "--grpc", "127.0.0.1:0", "--rest", "127.0.0.1:0",
                                    "--workdir", wt], env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
            procs.append(sbx)
            ready = json.loads(sbx.stdout.readline())
            channel = grpc.insecure_channel(ready["grpc"])
            execute = channel.unary_unary(f"/{proto.SERVICE}/Execute", request_serializer=pb.ExecuteRequest.SerializeToString,
                                          response_deserializer=pb.ExecuteResponse.FromString)
            request = pb.ExecuteRequest(config=pb.ProcessConfig(command=["true"]))
            times: dict[str, list[float]] = {"agnsup serve (run op)": [], "agnsup sandboxd (Execute)": [],
                                             "fork/exec /bin/true": []}
            with Client(sock) as c:
                c.call("run", argv=["true"], workdir=wt, run_id="warm")
                assert execute(request).exit_code == 0
                def serve_one():
                    assert c.call("run", argv=["true"], workdir=wt, run_id="bench-serve")["exit_code"] == 0

                def execute_one():
                    assert execute(request).exit_code == 0

                cases = [("agnsup serve (run op)", serve_one), ("agnsup sandboxd (Execute)", execute_one),
                         ("fork/exec /bin/true", lambda: subprocess.run(["/bin/true"], check=True))]
                if BWRAP:  # the goal's yardstick (issue 29: a cell <= 2x bwrap), in the same rounds
                    times["bwrap --unshare-all true"] = []
                    cases.append(("bwrap --unshare-all true", lambda: subprocess.run(BWRAP, check=True)))
                for i in range(ncells):
                    # The order alternates: a cell's controller may still be finishing the previous one
                    # (a first-in-the-round penalty measured at 5-10 ms here), so neither is always first.
                    for name, fn in (cases if i % 2 == 0 else [cases[1], cases[0], *cases[2:]]):
                        t0 = time.perf_counter()
                        fn()
                        times[name].append(time.perf_counter() - t0)
            channel.close()
            base = statistics.median(times["agnsup serve (run op)"])
            bw = statistics.median(times["bwrap --unshare-all true"]) if BWRAP else None
            print(f"{'per cell, ' + str(ncells) + ' interleaved rounds':34} {'median ms':>10} {'p25 ms':>8} "
                  f"{'x serve':>8} {'x bwrap' if bw else '':>8}   (load {os.getloadavg()[0]:.1f})")
            for name, ts in times.items():
                med = statistics.median(ts)
                xb = f"{med / bw:8.2f}" if bw else ""
                print(f"{name:34} {med * 1000:10.2f} {statistics.quantiles(ts, n=4)[0] * 1000:8.2f} "
                      f"{med / base:8.2f} {xb}")
        finally:
            for p in procs:
                if p.poll() is None:
                    p.terminate()
                    p.wait(60)
                p.stdout.close()


if __name__ == "__main__":
    main(sys.argv[1:])
