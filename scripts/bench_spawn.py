#!/usr/bin/env python3
"""Spawn cost, interleaved: every round runs each command once, in turn.

hyperfine runs one command's N runs, then the next command's: on a shared
machine whose load drifts over minutes, that biases the ratios. Here every
command sees the same moments. Medians (and the lower quartile, closer to a
quiet machine) in milliseconds and as a multiple of the bwrap line.

    bench_spawn.py ROUNDS NAME=COMMAND ...
"""
import os
import shlex
import shutil
import statistics
import sys
import time


def run(argv: list[str], actions: list) -> float:
    """Milliseconds from posix_spawn to the reaped exit (no shell, no subprocess module overhead)."""
    t = time.perf_counter()
    pid = os.posix_spawn(argv[0], argv, os.environ, file_actions=actions)
    _, status = os.waitpid(pid, 0)
    elapsed = (time.perf_counter() - t) * 1000
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{argv}: exit {os.waitstatus_to_exitcode(status)}")
    return elapsed


def main() -> None:
    rounds = int(sys.argv[1])
    cmds = [arg.partition("=")[::2] for arg in sys.argv[2:]]
    times: dict[str, list[float]] = {name: [] for name, _ in cmds}
    actions = [(os.POSIX_SPAWN_OPEN, fd, os.devnull, os.O_RDWR, 0) for fd in (0, 1, 2)]
    argvs = {}
    for name, cmd in cmds:
        argv = shlex.split(cmd)
        argv[0] = shutil.which(argv[0]) or argv[0]
        argvs[name] = argv
        run(argv, actions)  # warm-up
    for _ in range(rounds):
        for name, _ in cmds:
            times[name].append(run(argvs[name], actions))
    bw = statistics.median(times["bwrap"]) if "bwrap" in times else None
    bwq = statistics.quantiles(times["bwrap"], n=4)[0] if "bwrap" in times else None
    print(f"{'command (interleaved, ' + str(rounds) + ' rounds)':40} {'median ms':>10} {'x bwrap':>8} {'p25 ms':>8} {'x bwrap':>8}")
    for name, ts in times.items():
        med, q1 = statistics.median(ts), statistics.quantiles(ts, n=4)[0]
        print(f"{name:40} {med:10.2f} {med / bw if bw else 0:8.2f} {q1:8.2f} {q1 / bwq if bwq else 0:8.2f}")


if __name__ == "__main__":
    main()
