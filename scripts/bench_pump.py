"""The output pump's cost (run by scripts/bench pump): bytes a cell writes, bare against through agnsup.

    bench_pump.py AGNSUP_BIN [--mb 256] [--rounds 3]

The cell runs `head -c MB*2^20 /dev/zero`; its stdout goes to, in turn:

  socket   a socketpair we drain (agnsup pumps it: a socket is not the user's file or pipe)
  pty      a pty slave whose master we drain (agnsup pumps it through a pty of the cell's own)
  pipe     a pipe we drain (agnsup hands the cell that very pipe: no pump)
  capture  the Python API's capture mode, into the cell's log file (pumped: pipe -> file)

each with a role whose output cap is far above MB (so the cap is counted but never hit),
and the same `head` without agnsup into the same kind of destination ("bare"). Prints
the median MB/s of each and the ratio. Run as root; a private state root, removed at the end.
"""
from __future__ import annotations

import argparse
import os
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


def through(argv: list[str], kind: str, env: dict, size: int) -> float:
    """Seconds for argv to write `size` bytes into a destination of `kind` that we drain."""
    if kind == "socket":
        a, b = socket.socketpair()
        ours, theirs = os.dup(a.fileno()), os.dup(b.fileno())
        a.close()
        b.close()
    elif kind == "pty":
        ours, theirs = os.openpty()
        import tty
        tty.setraw(theirs)  # bytes as they come: count them, no \r added
    else:
        ours, theirs = os.pipe()
    got = []
    t = threading.Thread(target=lambda: got.append(_drain(ours, size)))
    t.start()
    start = time.monotonic()
    p = subprocess.Popen(argv, stdout=theirs, stdin=subprocess.DEVNULL, env=env)
    os.close(theirs)
    code = p.wait()
    t.join()
    took = time.monotonic() - start
    os.close(ours)
    assert code == 0, f"{argv}: exit {code}"
    assert got[0] == size, f"{argv} into a {kind}: {got[0]} bytes, wanted {size}"
    return took


def captured(state: str, workdir: str, role: str, size: int) -> float:
    from agnsup.tool import run_process
    start = time.monotonic()
    res = run_process(["head", "-c", str(size), "/dev/zero"], role=role, state_dir=state, workdir=workdir)
    took = time.monotonic() - start
    assert res["exit_code"] == 0, res
    with open(res["receipt"]) as f:
        import json
        out = json.load(f)["output"]
    assert out["stdout"]["bytes"] == size and out["via"] == "pipe", out
    return took


def bare_file(workdir: str, size: int) -> float:
    path = os.path.join(workdir, "bare.out")
    start = time.monotonic()
    with open(path, "wb") as f:
        subprocess.run(["head", "-c", str(size), "/dev/zero"], stdout=f, check=True)
    took = time.monotonic() - start
    os.unlink(path)
    return took


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("agnsup")
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    size = args.mb << 20
    root = tempfile.mkdtemp(prefix="agnsup-bench-pump.")
    state, policies, workdir = (os.path.join(root, d) for d in ("state", "policies", "wt"))
    os.makedirs(policies)
    os.makedirs(workdir)
    from agnsup.policy import find
    with open(find("executor")) as f:
        src = f.read().replace('name = "executor"', 'name = "bench-pump"')
    src = src.replace('output_max = "16M"', 'output_max = "64G"')
    with open(os.path.join(policies, "bench-pump.toml"), "w") as f:
        f.write(src)
    env = {**os.environ, "AGNSUP_STATE_DIR": state, "AGNSUP_POLICY_DIR": policies}
    os.environ.update(AGNSUP_POLICY_DIR=policies)
    cell = [args.agnsup, "run", "--role", "bench-pump", "--workdir", workdir, "--", "head", "-c", str(size), "/dev/zero"]
    bare = ["head", "-c", str(size), "/dev/zero"]
    times: dict[str, list[float]] = {}
    try:
        start = [args.agnsup, "run", "--role", "bench-pump", "--workdir", workdir, "--", "true"]
        subprocess.run(start, env=env, check=True)  # warm the policy cache
        for _ in range(args.rounds):
            times.setdefault("start", []).append(through(start, "socket", env, 0))
            for kind in ("socket", "pty", "pipe"):
                times.setdefault(f"{kind} bare", []).append(through(bare, kind, env, size))
                times.setdefault(f"{kind} agnsup", []).append(through(cell, kind, env, size))
            times.setdefault("capture bare", []).append(bare_file(workdir, size))
            times.setdefault("capture agnsup", []).append(captured(state, workdir, "bench-pump", size))
    finally:
        subprocess.run([args.agnsup, "cleanup", "--run", "default"], env=env, capture_output=True)
        shutil.rmtree(root, ignore_errors=True)
    t0 = statistics.median(times["start"])
    print(f"{args.mb} MiB from `head -c` per case, median of {args.rounds} rounds (MB/s = MiB/s); "
          f"`agnsup run -- true` takes {t0 * 1000:.0f} ms here, taken out of the net column:")
    for kind in ("socket", "pty", "pipe", "capture"):
        b = statistics.median(times[f"{kind} bare"])
        a = statistics.median(times[f"{kind} agnsup"])
        net = max(a - t0, 1e-3)
        print(f"  {kind:8s} bare {args.mb / b:6.0f} MB/s   agnsup {args.mb / a:6.0f} MB/s   "
              f"net {args.mb / net:6.0f} MB/s   net/bare {net / b:5.2f}x")


if __name__ == "__main__":
    sys.exit(main())
