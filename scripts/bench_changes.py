#!/usr/bin/env python3
"""What capturing a cell's changes costs (issue 26), before against after in one run (run by scripts/bench).

    bench_changes.py AFTER_BIN --before BEFORE_BIN [--files 100000] [--rounds 40] [--heavy-rounds 5]
                     [--python PY]

BEFORE_BIN is an install without capture (main before issue 26), AFTER_BIN one with it; each gets a state
root of its own (their journals may differ in schema). Every round runs each case once per side, the
order of the sides alternating, so both see the same moments of a shared machine's load:

  true      `agnsup run -- true` in a worktree of FILES files (the overlay's set-up and an empty commit)
  write 1M  a cell writing 1 MB of new bytes (/dev/urandom) into one file of that worktree (created once,
            then rewritten: each commit keeps the 1 MB pre-image in the record)
  (these two also for the after build with capture off, role `changes = "live"`: what the build adds that
  is not the capture)
  pytest    a real small project's test suite (more-itertools' sdist, ~660 tests) in its own worktree,
            run by PY (an interpreter with pytest: this checkout's .venv), warm (its __pycache__ made)
  npm       `npm install --offline` of lodash's tarball (1,058 files, 5 MB) into a fresh node_modules
            (removed by the script, outside any cell, between runs)

The two heavy cases (pytest, npm) run HEAVY rounds. Then the space: the after-side's change records,
against the worktree's size, and one more 1 MB cell's record alone. Downloads the two packages once into
/var/tmp/agnsup-bench-data with pip and npm (their ordinary clients). Run as root; prints medians and
lower quartiles in milliseconds and after/before ratios.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

DATA = "/var/tmp/agnsup-bench-data"
MORE_ITERTOOLS = "more-itertools==10.5.0"
LODASH = "lodash@4.17.21"


def fetch(py: str) -> tuple[str, str]:
    """The two packages' archives, downloaded once."""
    os.makedirs(DATA, exist_ok=True)
    sdist = os.path.join(DATA, "more-itertools-10.5.0.tar.gz")
    if not os.path.exists(sdist):
        subprocess.run([py, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", MORE_ITERTOOLS,
                        "-d", DATA], check=True)
    tgz = os.path.join(DATA, "lodash-4.17.21.tgz")
    if not os.path.exists(tgz):
        subprocess.run(["npm", "pack", "-q", LODASH], cwd=DATA, check=True, capture_output=True)
    return sdist, tgz


def make_worktree(root: str, files: int) -> None:
    """FILES small files in directories of 100, and the marker that makes `root` a worktree."""
    os.makedirs(root)
    open(os.path.join(root, ".agnsup-worktree"), "w").close()
    for i in range(files):
        d = os.path.join(root, f"d{i // 100:04d}")
        if i % 100 == 0:
            os.mkdir(d)
        with open(os.path.join(d, f"f{i % 100:02d}.txt"), "w") as f:
            f.write(f"file {i}\n")


def du(path: str) -> int:
    """Bytes allocated under `path` (st_blocks), hard links once."""
    seen, total = set(), 0
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            st = os.lstat(os.path.join(dirpath, name))
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total


class Side:
    def __init__(self, name: str, binary: str, state: str):
        self.name, self.binary, self.state = name, binary, state
        self.env = {**os.environ, "AGNSUP_STATE_DIR": state}
        self.role: list[str] = []

    def run(self, args: list[str], check: bool = True) -> float:
        """Milliseconds from posix_spawn to the reaped exit of `agnsup ARGS` (output to /dev/null)."""
        argv = [self.binary, *args[:1], *self.role, *args[1:]]
        actions = [(os.POSIX_SPAWN_OPEN, fd, os.devnull, os.O_RDWR, 0) for fd in (0, 1, 2)]
        t = time.perf_counter()
        pid = os.posix_spawn(argv[0], argv, self.env, file_actions=actions)
        _, status = os.waitpid(pid, 0)
        elapsed = (time.perf_counter() - t) * 1000
        code = os.waitstatus_to_exitcode(status)
        if check and code != 0:
            cp = subprocess.run(argv, env=self.env, capture_output=True, text=True)
            raise SystemExit(f"{self.name}: {' '.join(args)}: exit {code}\n{cp.stderr[-2000:]}")
        return elapsed

    def receipts(self) -> list[dict]:
        cp = subprocess.run([self.binary, "receipts", "--json"], env=self.env, capture_output=True, text=True,
                            check=True)
        return json.loads(cp.stdout)


def interleave(sides: list[Side], rounds: int, case: list[str], reset=None) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {s.name: [] for s in sides}
    for s in sides:  # warm-up (policy cache, journal, __pycache__)
        if reset:
            reset()
        s.run(case)
    for r in range(rounds):
        for s in (sides if r % 2 == 0 else sides[::-1]):
            if reset:
                reset()
            times[s.name].append(s.run(case))
    return times


def table(title: str, times: dict[str, list[float]], goal: str) -> None:
    b = times["before"]
    mb, qb = statistics.median(b), statistics.quantiles(b, n=4)[0]
    for name, a in times.items():
        if name == "before":
            continue
        ma, qa = statistics.median(a), statistics.quantiles(a, n=4)[0]
        label = title if name == "after" else f"  the same, {name}"
        print(f"{label:44} {mb:9.2f} {ma:9.2f} {ma - mb:+8.2f} {ma / mb:6.3f}   {qb:9.2f} {qa:9.2f} {qa - qb:+8.2f}"
              f"   {goal if name == 'after' else ''}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("after")
    ap.add_argument("--before", required=True)
    ap.add_argument("--files", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--heavy-rounds", type=int, default=5)
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--only", default="true,write,pytest,npm")
    o = ap.parse_args()
    only = set(o.only.split(","))
    sdist, tgz = fetch(o.python)
    base = tempfile.mkdtemp(prefix="agnsup-bench-changes.", dir="/var/tmp")
    try:
        sides = [Side("before", o.before, os.path.join(base, "state-before")),
                 Side("after", o.after, os.path.join(base, "state-after"))]
        # the after build with capture off (role changes = "live"): what the build adds that is not capture
        live = Side("after, changes=live", o.after, os.path.join(base, "state-live"))
        pol = os.path.join(base, "policies")
        os.makedirs(pol)
        try:
            import importlib.resources
            src = (importlib.resources.files("agnsup.policies") / "executor.toml").read_text()
            src = src.replace('name = "executor"', 'name = "bench-live"')
            src = "\n".join('changes = "live"' if line.startswith("changes = ") else line for line in src.splitlines())
            with open(os.path.join(pol, "bench-live.toml"), "w") as f:
                f.write(src + "\n")
            live.env["AGNSUP_POLICY_DIR"] = pol
            live.role = ["--role", "bench-live"]
            three = [*sides, live] if 'changes = "live"' in src else sides
        except (ImportError, FileNotFoundError):
            three = sides
        big = os.path.join(base, "big")
        t = time.perf_counter()
        make_worktree(big, o.files)
        print(f"worktree of {o.files:,} files made in {time.perf_counter() - t:.1f} s ({du(big) / 1e6:.0f} MB); "
              f"{o.rounds} rounds, heavy cases {o.heavy_rounds}; load {os.getloadavg()[0]:.2f}")
        print(f"{'case (medians, then lower quartiles, ms)':44} {'before':>9} {'after':>9} {'delta':>8} {'ratio':>6}"
              f"   {'p25 bef':>9} {'p25 aft':>9} {'delta':>8}   goal")
        if "true" in only:
            table("agnsup run -- true, 100k-file worktree".replace("100k", f"{o.files // 1000}k"),
                  interleave(three, o.rounds, ["run", "--workdir", big, "--", "true"]), "<= +5 ms")
        if "write" in only:
            table("a cell writing 1 MB in one file",
                  interleave(three, o.rounds, ["run", "--workdir", big, "--", "sh", "-c",
                                               "head -c 1048576 /dev/urandom > one.bin"]), "<= +10 ms")
        if "pytest" in only:
            proj = os.path.join(base, "pyproj")
            os.makedirs(proj)
            with tarfile.open(sdist) as tf:
                tf.extractall(proj, filter="data")
            proj = os.path.join(proj, os.listdir(proj)[0])
            open(os.path.join(proj, ".agnsup-worktree"), "w").close()
            table("pytest of more-itertools (~660 tests)",
                  interleave(sides, o.heavy_rounds, ["run", "--workdir", proj, "--", o.python, "-m", "pytest", "-q",
                                                     "-p", "no:cacheprovider", "tests"]), "<= 1.05x")
        if "npm" in only:
            js = os.path.join(base, "jsproj")
            os.makedirs(js)
            open(os.path.join(js, ".agnsup-worktree"), "w").close()

            def reset():
                for p in ("node_modules", "package-lock.json"):
                    shutil.rmtree(os.path.join(js, p), ignore_errors=True)
                    if os.path.exists(os.path.join(js, p)):
                        os.unlink(os.path.join(js, p))
                with open(os.path.join(js, "package.json"), "w") as f:
                    f.write('{"name": "bench", "version": "1.0.0", "private": true}\n')

            table("npm install --offline lodash (1,058 files)",
                  interleave(sides, o.heavy_rounds, ["run", "--workdir", js, "--", "npm", "install", "--offline",
                                                     "--no-audit", "--no-fund", tgz], reset=reset), "<= 1.05x")

        after = sides[1]
        modes: dict[str, int] = {}
        for r in after.receipts():
            m = (r.get("changes") or {}).get("mode", "none")
            modes[m] = modes.get(m, 0) + 1
        print(f"\nafter-side receipts by changes.mode: {modes}")
        changes = os.path.join(after.state, "changes")
        if os.path.isdir(changes):
            total = du(changes)
            before_one = total
            after.run(["run", "--workdir", big, "--", "sh", "-c", "head -c 1048576 /dev/urandom > one.bin"])
            one = du(changes) - before_one
            print(f"space: worktree {du(big) / 1e6:.1f} MB; every change record of the after side "
                  f"{total / 1e6:.1f} MB; one more 1 MB cell's record {one / 1e6:.2f} MB")
        else:
            print("space: no change records under the after side's state root (capture not in this build?)")
    finally:
        for s in (*sides, live):
            subprocess.run([s.binary, "cleanup", "--run", "default"], env=s.env, capture_output=True)
            try:  # the state roots' cgroup trees (as the tests' fixtures do)
                from agnsup import backend
                backend.choose(s.state).purge()
            except Exception as e:  # noqa: BLE001 - best effort, said
                print(f"note: cgroups of {s.state} not purged: {e}", file=sys.stderr)
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
