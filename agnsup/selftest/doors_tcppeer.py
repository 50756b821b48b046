"""Selftest gate for issue 25's follow-up door: agnsup's control endpoints on loopback TCP.

LOOPBACK_TCP_CONTROL: the selftest serves sandboxd's REST API in this process (its own
state root, worktree and Supervisor, on a free 127.0.0.1 port, no authentication, as the
standard defines it) and runs a cell of the selftest role with the host's network
(`network.mode = "host"`, as `networked`), which shares the host's loopback. The cell PUTs
a file into sandboxd's worktree through /v1/files. gRPC is left out here: the cell's
python has no grpc, and grpc's threads in this process would meet the cells' forks; its
calls go through the same check (linux/peer.py check_tcp), tests/test_doors_tcppeer.py
plays them. The probe exits 77 when it was served, 0 when refused (isolation.py's
convention); the gate also wants the refusal journaled and no file written. ENV_BLOCKED
when the cell cannot reach the host's loopback at all (nothing about the check was tested).
Wired into `agnsup selftest --isolation` by the lead (RUNNERS).
"""
from __future__ import annotations

import os
import shutil
import threading

from .isolation import _gate
from .probes import ESCAPED

# argv: REST address HOST:PORT; PUTs /v1/files/from-a-cell.txt; 77 when served, 0 when refused,
# 3 when the port could not be reached
P_PUT = r'''
import sys, urllib.request, urllib.error
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
req = urllib.request.Request("http://" + sys.argv[1] + "/v1/files/from-a-cell.txt", data=b"owned", method="PUT")
try:
    with opener.open(req, timeout=30) as r:
        print("SERVED", r.status)
        sys.exit(77)
except urllib.error.HTTPError as e:
    print("HTTP", e.code, e.read().decode(errors="replace"))
    sys.exit(0 if e.code == 403 else 77)
except OSError as e:
    print("UNREACHABLE", e)
    sys.exit(3)
'''


def gate_loopback_tcp_control(h) -> dict:
    name = "LOOPBACK_TCP_CONTROL"
    from ..doors.sandboxd.rest import Files, RestApp, server as rest_server
    from ..supervisor import Supervisor
    from .isolation import remove_state
    state = os.path.join(h.root, "tcp-control-state")
    workdir = os.path.join(h.root, "tcp-control-worktree")
    os.makedirs(workdir, exist_ok=True)
    sup = files = rest = thread = None
    try:
        sup = Supervisor(state, kind="sandboxd")
        files = Files(sup, role="executor", workdir=workdir, run_id="selftest-sandboxd")
        rest = rest_server(("127.0.0.1", 0), RestApp(files, {}))
        thread = threading.Thread(target=rest.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True)
        thread.start()
        role = h.role("selftest-host-network", ("network", "mode", '"host"'))
        res = h.probe(P_PUT, f"127.0.0.1:{rest.server_address[1]}", role=role)
        if "error" in res:
            return _gate(name, f"ENV_BLOCKED: the probe cell did not start: {res['error']}", res["error"])
        out = (res.get("stdout") or "").strip()
        written = os.path.exists(os.path.join(workdir, "from-a-cell.txt"))
        refused = [r for r in sup.ctl.journal.refusals() if r.get("entry") == "sandboxd"]
        if res["exit_code"] == ESCAPED or written:
            return _gate(name, "FAIL", f"a cell wrote into sandboxd's worktree through its REST port: {out}")
        if res["exit_code"] == 3:
            return _gate(name, "ENV_BLOCKED: the host-network cell could not reach the host's loopback (the peer "
                               "check was not tested)", out)
        if res["exit_code"] != 0 or not refused:
            return _gate(name, "FAIL", f"no refusal journaled (exit {res['exit_code']}): {out}")
        return _gate(name, "PASS", f"sandboxd's REST port refused the cell's socket and journaled it "
                                   f"(evidence: {'; '.join(refused[-1]['peer']['evidence'])})")
    except Exception as e:  # noqa: BLE001 - a gate reports, never raises
        return _gate(name, "FAIL", f"the gate itself failed: {type(e).__name__}: {e}")
    finally:
        if rest is not None:
            rest.shutdown()
            rest.server_close()
            thread.join(5)
        if files is not None:
            files.close()
        if sup is not None:
            sup.close()
        remove_state(state)
        shutil.rmtree(workdir, ignore_errors=True)


RUNNERS = {"LOOPBACK_TCP_CONTROL": gate_loopback_tcp_control}
