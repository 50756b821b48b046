#!/usr/bin/env python3
"""stubborn-tree: a process tree that tries hard to outlive its supervisor.

Standard library only (it runs inside cells, under the cell's python3).

    stubborn_tree.py --heartbeat PATH [--secret-file PATH] [--term-wait S] [--stripped]

(or STUBBORN_HEARTBEAT=PATH in the environment). It:
- appends a heartbeat line to PATH every 100 ms;
- listens on a loopback TCP port;
- double-forks a `setsid` grandchild that ignores SIGTERM, heartbeats to
  PATH.gc and holds a second port;
- with --stripped, also starts a descendant that re-executes itself with an
  empty environment (no ownership token) and heartbeats to PATH.stripped;
- tries to read the decoy secret (env AGNSUP_CANARY_SECRET, and --secret-file);
- prints ONE JSON line: pid, pgid, sid, starttime, ports, grandchild, stripped,
  heartbeats, secret_env, secret_file; then keeps running;
- on SIGTERM waits --term-wait seconds (default 5) before it exits.
Host /tmp is hidden from cells: give paths inside the worktree.
"""
import json
import os
import signal
import socket
import sys
import time

BEAT = 0.1


def _stat_self() -> dict:
    with open("/proc/self/stat", "rb") as f:
        raw = f.read().decode(errors="replace")
    rest = raw[raw.rindex(")") + 2:].split()
    return {"pid": os.getpid(), "pgid": int(rest[2]), "sid": int(rest[3]), "starttime": int(rest[19])}


def _listen() -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    s.listen(8)
    return s


def _beat_forever(path: str, stop_after=None) -> None:
    n = 0
    while True:
        with open(path, "a") as f:
            f.write(f"{os.getpid()} {n} {time.time():.3f}\n")
        n += 1
        if stop_after is not None and stop_after():
            os._exit(0)
        time.sleep(BEAT)


def _grandchild(hb: str, w: int) -> None:
    """setsid, double fork: reparented away from the tree's normal shape."""
    os.setsid()
    if os.fork() != 0:
        os._exit(0)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    s = _listen()
    me = _stat_self()
    os.write(w, (json.dumps({**me, "port": s.getsockname()[1], "heartbeat": hb}) + "\n").encode())
    os.close(w)
    _beat_forever(hb)


def _stripped(hb: str, w: int) -> None:
    """Re-execute with an empty environment: no token, no cell variables."""
    os.set_inheritable(w, True)
    os.execve(sys.executable, [sys.executable, os.path.abspath(__file__), "--as-stripped", hb, str(w)], {})


def _read_line(r: int) -> dict:
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = os.read(r, 4096)
        if not chunk:
            break
        buf += chunk
    os.close(r)
    return json.loads(buf or b"null")


def main(argv: list[str]) -> None:
    if argv[:1] == ["--as-stripped"]:
        hb, w = argv[1], int(argv[2])
        os.write(w, (json.dumps({**_stat_self(), "heartbeat": hb, "env_keys": sorted(os.environ)}) + "\n").encode())
        os.close(w)
        _beat_forever(hb)
    opts = {"--heartbeat": os.environ.get("STUBBORN_HEARTBEAT"), "--secret-file": None, "--term-wait": "5"}
    stripped = False
    i = 0
    while i < len(argv):
        if argv[i] == "--stripped":
            stripped, i = True, i + 1
        elif argv[i] in opts and i + 1 < len(argv):
            opts[argv[i]], i = argv[i + 1], i + 2
        else:
            sys.exit(f"stubborn_tree: unknown argument {argv[i]!r}")
    hb = opts["--heartbeat"]
    if not hb:
        sys.exit("stubborn_tree: --heartbeat PATH (or STUBBORN_HEARTBEAT) is required")
    term_wait = float(opts["--term-wait"])

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        _grandchild(hb + ".gc", w)
    os.close(w)
    os.waitpid(pid, 0)
    gc = _read_line(r)

    st = None
    if stripped:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            _stripped(hb + ".stripped", w)
        os.close(w)
        st = _read_line(r)

    s = _listen()
    secret_env = os.environ.get("AGNSUP_CANARY_SECRET")
    secret_file = None
    if opts["--secret-file"]:
        try:
            with open(opts["--secret-file"]) as f:
                secret_file = f.read()
        except OSError as e:
            secret_file = {"error": e.strerror}

    term_at = []
    signal.signal(signal.SIGTERM, lambda n, f: term_at.append(time.monotonic()))
    me = _stat_self()
    print(json.dumps({**me, "ports": [s.getsockname()[1], gc["port"]], "grandchild": gc, "stripped": st,
                      "heartbeats": [hb, gc["heartbeat"]] + ([st["heartbeat"]] if st else []),
                      "secret_env": secret_env, "secret_file": secret_file,
                      "token_seen": "AGNSUP_CELL_TOKEN" in os.environ}), flush=True)
    _beat_forever(hb, stop_after=lambda: bool(term_at) and time.monotonic() - term_at[0] >= term_wait)


if __name__ == "__main__":
    main(sys.argv[1:])
