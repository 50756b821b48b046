#!/usr/bin/env python3
"""Soak: N sequential `true` cells through one long-lived controller; what it holds
at the start, after warm-up and at the end (issue 12 item 17).

    bench_soak.py api   N    in-process Supervisor: spawn + wait
    bench_soak.py serve N    an `agnsup serve` subprocess, through its socket (run op)

Prints one JSON object per mode: RSS (kB), open fds, threads of the controller;
cgroup directories under the state root's cgroup tree; cell temp dirs left;
journal size (db + WAL, bytes) and rows; and the RSS growth per cell after
warm-up. Uses a private state root under /var/tmp (removed at the end).
"""
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time

WARMUP = 100


def _status(pid: int) -> dict:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "Threads"):
                out[k] = int(v.split()[0])
    out["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    return out


def _disk(state: str) -> dict:
    from agnsup import backend
    from agnsup.linux import cgroup
    root = backend.choose(state).root()
    cgroups = len(list(cgroup.walk(root.dir))) - 1 if root is not None and root.dir else 0
    tmps = 0
    cells = os.path.join(state, "cells")
    for run in os.listdir(cells) if os.path.isdir(cells) else []:
        for c in os.listdir(os.path.join(cells, run)):
            tmps += os.path.isdir(os.path.join(cells, run, c, "tmp"))
    size = sum(os.path.getsize(os.path.join(state, n)) for n in ("journal.db", "journal.db-wal")
               if os.path.exists(os.path.join(state, n)))
    db = sqlite3.connect(os.path.join(state, "journal.db"))
    rows = {t: db.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in ("cells", "events", "receipts")}
    db.close()
    return {"cgroups": cgroups, "tmp_dirs": tmps, "journal_bytes": size, "journal_rows": rows}


def soak(mode: str, n: int, state: str, wt: str) -> dict:
    samples = {}
    if mode == "api":
        from agnsup.supervisor import Supervisor
        sup = Supervisor(state)
        pid = os.getpid()

        def one():
            h = sup.spawn(["true"], workdir=wt, capture=False)
            assert sup.wait(h["run_id"], h["cell_id"])["exit_code"] == 0
        close = sup.close
    else:
        from agnsup.doors.serve import Client
        sock = os.path.join(state, "agnsup.sock")
        agnsup = os.path.join(os.path.dirname(sys.executable), "agnsup")
        proc = subprocess.Popen([agnsup, "--state-dir", state, "serve", "--socket", sock], stdout=subprocess.PIPE)
        assert json.loads(proc.stdout.readline())["ready"]
        pid = proc.pid
        client = Client(sock)

        def one():
            r = client.call("run", argv=["true"], workdir=wt)
            assert r["exit_code"] == 0, r  # Client.call raises the error a failed call carries

        def close():
            client.call("shutdown")
            client.close()
            proc.wait(30)
    t0 = time.monotonic()
    for i in range(n):
        if i in (0, min(WARMUP, n - 1)):
            samples["start" if i == 0 else "warm"] = {**_status(pid), "cells": i}
        one()
    samples["end"] = {**_status(pid), "cells": n, "seconds": round(time.monotonic() - t0, 1)}
    disk = _disk(state)
    close()
    warm, end = samples["warm"], samples["end"]
    per_cell = (end["VmRSS"] - warm["VmRSS"]) * 1024 / max(1, end["cells"] - warm["cells"])
    return {"mode": mode, "cells": n, **samples, **disk, "rss_bytes_per_cell_after_warmup": round(per_cell, 1),
            "journal_bytes_per_cell": round(disk["journal_bytes"] / n, 1)}


def main() -> None:
    mode, n = sys.argv[1], int(sys.argv[2])
    top = tempfile.mkdtemp(prefix="agnsup-soak-", dir="/var/tmp")
    state, wt = os.path.join(top, "state"), os.path.join(top, "wt")
    os.makedirs(wt)
    try:
        print(json.dumps(soak(mode, n, state, wt)), flush=True)
    finally:
        from agnsup import backend
        backend.choose(state).purge()
        shutil.rmtree(top, ignore_errors=True)


if __name__ == "__main__":
    main()
