"""The egress proxy's cost (run by scripts/bench): the same work on host network and through the proxy.

    bench_egress.py AGNSUP_BIN [--mb 50] [--rounds 5] [--conns 200]

A server on the host's loopback serves MB megabytes and a tiny page. Each
round runs two cells back to back (order alternating):

  host    role networked: curl downloads straight from 127.0.0.1
  proxy   an allowlist role (allow 127.0.0.1:*, allow_private): curl goes
          through the controller's proxy (HTTP_PROXY on the cell's loopback)

and, in the same cells, CONNS sequential connections each fetching the tiny
page (Python sockets: connect, request, read the reply, close), direct
against through the proxy (absolute-URI GET); then `agnsup run -- true` of a
deny role against an allowlist role (what starting the proxy adds). Prints
medians: MB/s of the download, milliseconds per connection and per start. Run as root; a
private state root, removed at the end.
"""
from __future__ import annotations

import http.server
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROLE = """[role]
name = "bench-egress"
[env]
path = ["/usr/local/bin", "/usr/bin", "/bin", "@runtime"]
[network]
mode = "allowlist"
allow = ["127.0.0.1:*"]
allow_private = true
[limits]
output_max = "16M"
"""

CLIENT = r"""
import json, os, socket, subprocess, sys, time
port, size, n, via = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
proxy = via == "proxy"
curl = ["curl", "-s", "-o", "/dev/null", "-w", "%{time_total} %{size_download}"]
curl += ["--noproxy", "", "-x", "http://127.0.0.1:3128"] if proxy else ["--noproxy", "*"]
t, got = subprocess.run(curl + [f"http://127.0.0.1:{port}/big"], capture_output=True, text=True,
                        check=True).stdout.split()
assert int(got) == size, got
req = (f"GET http://127.0.0.1:{port}/tiny HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n" if proxy
       else "GET /tiny HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n").encode()
addr = ("127.0.0.1", 3128) if proxy else ("127.0.0.1", port)
times = []
for _ in range(n):
    t0 = time.perf_counter()
    s = socket.create_connection(addr)
    s.sendall(req)
    data = b""
    while b"tiny!" not in data:
        b = s.recv(4096)
        if not b: break
        data += b
    s.close()
    assert b"tiny!" in data, data
    times.append(time.perf_counter() - t0)
print(json.dumps({"download_s": float(t), "conn_ms": [x * 1000 for x in times]}))
"""


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    big = b""

    def log_message(self, *a):
        pass

    def do_GET(self):
        body = self.big if self.path == "/big" else b"tiny!"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)
        self.close_connection = True


def main() -> None:
    import argparse
    ap = argparse.ArgumentParser()
    ap.add_argument("agnsup")
    ap.add_argument("--mb", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--conns", type=int, default=200)
    a = ap.parse_args()
    size = a.mb * 1024 * 1024
    _Handler.big = os.urandom(1024 * 1024) * a.mb
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    port = srv.server_address[1]
    top = tempfile.mkdtemp(prefix="agnsup-bench-egress.", dir="/var/tmp")
    try:
        pol = os.path.join(top, "policies")
        os.makedirs(pol)
        with open(os.path.join(pol, "bench-egress.toml"), "w") as f:
            f.write(ROLE)
        env = {**os.environ, "AGNSUP_STATE_DIR": os.path.join(top, "state"), "AGNSUP_POLICY_DIR": pol}
        res: dict[str, list] = {"host": [], "proxy": []}
        for i in range(a.rounds):
            for via in (("host", "proxy") if i % 2 == 0 else ("proxy", "host")):
                role = "networked" if via == "host" else "bench-egress"
                cp = subprocess.run([a.agnsup, "run", "--role", role, "--workdir", top, "--", sys.executable, "-c",
                                     CLIENT, str(port), str(size), str(a.conns), via], env=env, capture_output=True,
                                    text=True, timeout=600)
                if cp.returncode:
                    raise SystemExit(f"bench: the {via} cell failed: {cp.stderr.strip()}")
                res[via].append(json.loads(cp.stdout))
        start: dict[str, list] = {"host": [], "proxy": []}
        for i in range(a.rounds * 4):  # what the proxy adds to a cell's start: `run -- true`, interleaved
            for via in (("host", "proxy") if i % 2 == 0 else ("proxy", "host")):
                role = "executor" if via == "host" else "bench-egress"
                t0 = time.perf_counter()
                subprocess.run([a.agnsup, "run", "--role", role, "--workdir", top, "--", "true"], env=env,
                               check=True, timeout=60)
                start[via].append((time.perf_counter() - t0) * 1000)
        dl = {v: statistics.median(size / r["download_s"] / 1e6 for r in rs) for v, rs in res.items()}
        conn = {v: statistics.median(ms for r in rs for ms in r["conn_ms"]) for v, rs in res.items()}
        print(f"{a.mb} MB download over loopback (curl in a cell), {a.rounds} rounds, medians:")
        print(f"  {'host network':22} {dl['host']:9.0f} MB/s")
        print(f"  {'through the proxy':22} {dl['proxy']:9.0f} MB/s   ({dl['proxy'] / dl['host']:.2f} x host)")
        print(f"connection setup + one tiny request, {a.conns} sequential per round, median per connection:")
        print(f"  {'host network':22} {conn['host']:9.3f} ms")
        print(f"  {'through the proxy':22} {conn['proxy']:9.3f} ms   (+{conn['proxy'] - conn['host']:.3f} ms)")
        st = {v: statistics.median(x) for v, x in start.items()}
        print(f"agnsup run -- true, {len(start['host'])} runs each, median:")
        print(f"  {'executor (deny)':22} {st['host']:9.1f} ms")
        print(f"  {'allowlist (proxy)':22} {st['proxy']:9.1f} ms   (+{st['proxy'] - st['host']:.1f} ms)")
    finally:
        srv.shutdown()
        shutil.rmtree(top, ignore_errors=True)


if __name__ == "__main__":
    main()
