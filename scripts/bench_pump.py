"""The output pump's cost (run by scripts/bench pump): bytes a cell writes, bare against through agnsup.

    bench_pump.py AGNSUP_BIN [--base OTHER_AGNSUP_BIN] [--mb 256] [--rounds 3]

The cell runs `head -c MB*2^20 /dev/zero`; its stdout goes to, in turn:

  socket   a socketpair we drain (agnsup pumps it: a socket is not the user's file or pipe)
  pty      a pty slave whose master we drain (agnsup pumps it through a pty of the cell's own)
  pipe     a pipe we drain (the cell gets that very pipe, no pump, when it may reopen it by path;
           a cell mapped to another uid, as agnsup as root runs it, may not: pumped, pipe -> pipe, uncapped)
  file     a regular file of ours, mode 0644 (`agnsup run ... > out`): the same rule as a pipe (as root,
           pumped: pipe -> file, spliced, uncapped)
  capture  the Python API's capture mode, into the cell's log file (pumped: pipe -> file; the
           receipt's sha256 of it included)

each with a role whose output cap is far above MB (so the cap is counted but never hit),
and the same `head` without agnsup into the same kind of destination ("bare"). Prints
the median MB/s of each and the ratio. "net" takes out the fixed cost of a cell measured
in the same rounds: `agnsup run -- true` (socket, pty, pipe, file), run_process(["true"]) in the
same process (capture). The capture case runs in the build's own interpreter (the console
script's), timed inside it. `--base`: another build (e.g. main's), measured in the same
rounds, interleaved, on its own state root. Ends with the goal line of issue 29 (net >= 800 MB/s
per destination; a pty is bounded by its line discipline, which bare shows: no goal).
Run as root; private state roots, removed at the end.
"""
from __future__ import annotations

import argparse
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time


def _drain(fd: int, want: int) -> int:
    got = 0
    while True:
        try:
            b = os.read(fd, 1 << 20)
        except OSError:  # EIO: a pty master whose slave is closed everywhere
            break
        if not b:
            break
        got += len(b)
    return got


def _cpu(who: int) -> float:
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


def through(argv: list[str], kind: str, env: dict, size: int) -> tuple[float, float]:
    """(seconds, CPU seconds of argv's tree) for argv to write `size` bytes into a destination of `kind`
    that we drain (our draining thread's CPU is not counted: the same reader for bare and agnsup)."""
    if kind == "socket":
        a, b = socket.socketpair()
        ours, theirs = os.dup(a.fileno()), os.dup(b.fileno())
        a.close()
        b.close()
    elif kind == "pty":
        ours, theirs = os.openpty()
        import tty
        tty.setraw(theirs)  # bytes as they come: count them, no \r added
    elif kind == "file":
        return _into_file(argv, env, size)
    else:
        ours, theirs = os.pipe()
    got = []
    t = threading.Thread(target=lambda: got.append(_drain(ours, size)))
    t.start()
    start, cpu = time.monotonic(), _cpu(resource.RUSAGE_CHILDREN)
    p = subprocess.Popen(argv, stdout=theirs, stdin=subprocess.DEVNULL, env=env)
    os.close(theirs)
    code = p.wait()
    cpu = _cpu(resource.RUSAGE_CHILDREN) - cpu
    t.join()
    took = time.monotonic() - start
    os.close(ours)
    assert code == 0, f"{argv}: exit {code}"
    assert got[0] == size, f"{argv} into a {kind}: {got[0]} bytes, wanted {size}"
    return took, cpu


def _into_file(argv: list[str], env: dict, size: int) -> tuple[float, float]:
    """through() for a regular file of ours as argv's stdout (in the bench's temp dir: page cache, like bare)."""
    fd, path = tempfile.mkstemp(prefix="agnsup-bench-pump-file.", dir=os.environ.get("TMPDIR", "/var/tmp"))
    os.fchmod(fd, 0o644)
    try:
        start, cpu = time.monotonic(), _cpu(resource.RUSAGE_CHILDREN)
        code = subprocess.run(argv, stdout=fd, stdin=subprocess.DEVNULL, env=env).returncode
        cpu = _cpu(resource.RUSAGE_CHILDREN) - cpu
        took = time.monotonic() - start
        got = os.fstat(fd).st_size
    finally:
        os.close(fd)
        os.unlink(path)
    assert code == 0, f"{argv}: exit {code}"
    assert got == size, f"{argv} into a file: {got} bytes, wanted {size}"
    return took, cpu


CAPTURE = """
import json, os, resource, sys, time
from agnsup.tool import run_process
state, workdir, role, size = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
def cpu():
    return sum(r.ru_utime + r.ru_stime for r in map(resource.getrusage, (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)))
took = []
for argv in (["true"], ["true"], ["head", "-c", str(size), "/dev/zero"]):  # the first pays imports and the role
    start, c = time.monotonic(), cpu()
    res = run_process(argv, role=role, state_dir=state, workdir=workdir)
    took.append((time.monotonic() - start, cpu() - c))
    assert res["exit_code"] == 0, res
with open(res["receipt"]) as f:
    out = json.load(f)["output"]
assert out["stdout"]["bytes"] == size and out["via"] == "pipe", out
print(json.dumps(took))
"""


def interpreter(agnsup: str) -> str:
    """The Python a console script runs with (its #! line), or this one."""
    with open(agnsup, "rb") as f:
        first = f.readline().decode(errors="replace")
    return first[2:].strip().split()[0] if first.startswith("#!") else sys.executable


def captured(python: str, env: dict, state: str, workdir: str, role: str, size: int) -> tuple:
    """((seconds, CPU seconds) of run_process(["true"]), (the same) of the capture of `size` bytes),
    in-process in `python` (CPU: its own, all threads, and the cells it reaped)."""
    out = subprocess.run([python, "-c", CAPTURE, state, workdir, role, str(size)], env=env, check=True,
                         stdout=subprocess.PIPE, text=True).stdout
    import json
    _, t0, t = json.loads(out.splitlines()[-1])
    return t0, t


def bare_file(workdir: str, size: int) -> tuple[float, float]:
    path = os.path.join(workdir, "bare.out")
    start, cpu = time.monotonic(), _cpu(resource.RUSAGE_CHILDREN)
    with open(path, "wb") as f:
        subprocess.run(["head", "-c", str(size), "/dev/zero"], stdout=f, check=True)
    took, cpu = time.monotonic() - start, _cpu(resource.RUSAGE_CHILDREN) - cpu
    os.unlink(path)
    return took, cpu


GOAL = 800  # MB/s through the pump (issue 29), net of the cell's fixed cost


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("agnsup")
    ap.add_argument("--base", help="another build's agnsup, measured in the same rounds (interleaved)")
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", default="socket,pty,pipe,file,capture", help="the destinations to measure, comma-separated")
    args = ap.parse_args()
    kinds = [k for k in ("socket", "pty", "pipe", "file", "capture") if k in args.only.split(",")]
    size = args.mb << 20
    builds = {"agnsup": args.agnsup} if not args.base else {"base": args.base, "new": args.agnsup}
    root = tempfile.mkdtemp(prefix="agnsup-bench-pump.")
    policies, workdir = (os.path.join(root, d) for d in ("policies", "wt"))
    os.makedirs(policies)
    os.makedirs(workdir)
    from agnsup.policy import find
    with open(find("executor")) as f:
        src = f.read().replace('name = "executor"', 'name = "bench-pump"')
    src = src.replace('output_max = "16M"', 'output_max = "64G"')
    with open(os.path.join(policies, "bench-pump.toml"), "w") as f:
        f.write(src)
    envs = {b: {**os.environ, "AGNSUP_STATE_DIR": os.path.join(root, "state-" + b), "AGNSUP_POLICY_DIR": policies}
            for b in builds}
    bare = ["head", "-c", str(size), "/dev/zero"]
    times: dict[str, list[float]] = {}

    def cell(b: str, *argv: str) -> list[str]:
        return [builds[b], "run", "--role", "bench-pump", "--workdir", workdir, "--", *argv]

    def add(key: str, t: tuple[float, float]) -> None:
        times.setdefault(key, []).append(t[0])
        times.setdefault("cpu " + key, []).append(t[1])

    try:
        for b in builds:
            subprocess.run(cell(b, "true"), env=envs[b], check=True)  # warm the policy cache
        for _ in range(args.rounds):
            for b in builds:
                add(f"start {b}", through(cell(b, "true"), "socket", envs[b], 0))
            for kind in (k for k in kinds if k != "capture"):
                add(f"{kind} bare", through(bare, kind, dict(os.environ), size))
                for b in builds:
                    add(f"{kind} {b}", through(cell(b, *bare), kind, envs[b], size))
            if "capture" not in kinds:
                continue
            add("capture bare", bare_file(workdir, size))
            for b in builds:
                t0, t = captured(interpreter(builds[b]), envs[b], envs[b]["AGNSUP_STATE_DIR"], workdir,
                                 "bench-pump", size)
                add(f"capture start {b}", tuple(t0))
                add(f"capture {b}", tuple(t))
    finally:
        for b in builds:
            subprocess.run([builds[b], "cleanup", "--run", "default"], env=envs[b], capture_output=True)
        shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{args.mb} MiB from `head -c` per case, median of {args.rounds} rounds (MB/s = MiB/s; CPU: ms of the "
          f"writer's tree per 100 MiB, the cell's fixed CPU taken out: what load on the machine changes least), load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; net: less the cell's fixed cost, "
          + ", ".join(f"{b} `agnsup run -- true` {med['start ' + b] * 1000:.0f} ms, "
                      f"run_process(true) {med.get('capture start ' + b, 0) * 1000:.0f} ms" for b in builds) + ":")
    goal: dict[str, list[str]] = {}
    for kind in kinds:
        bt = med[f"{kind} bare"]
        per = 100 / args.mb * 1000  # CPU seconds -> ms per 100 MiB
        line = f"  {kind:8s} bare {args.mb / bt:6.0f} MB/s CPU {med[f'cpu {kind} bare'] * per:4.0f}"
        for b in builds:
            a = med[f"{kind} {b}"]
            fixed = ("capture start " if kind == "capture" else "start ") + b
            net = max(a - med[fixed], 1e-3)
            cpu = max(med[f"cpu {kind} {b}"] - med["cpu " + fixed], 0)
            line += f"   {b} {args.mb / a:6.0f} net {args.mb / net:6.0f} MB/s ({net / bt:4.2f}x bare) CPU {cpu * per:4.0f}"
            goal.setdefault(b, []).append(
                f"{kind} bounded by its line discipline (bare {args.mb / bt:.0f} MB/s), no goal" if kind == "pty" else
                f"{kind} {args.mb / net:.0f} {'met' if args.mb / net >= GOAL else 'NOT met'}")
        print(line)
    for b, parts in goal.items():
        print(f"goal (issue 29) >= {GOAL} MB/s through the pump, net, {b}: " + "; ".join(parts))


if __name__ == "__main__":
    sys.exit(main())
