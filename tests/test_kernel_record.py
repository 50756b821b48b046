"""The kernel's record of what the gate could not see, proven on real cells.

Each cell runs a program from a file (the text gate sees `python3 probe.py` and lets it run), so
what stops it is the kernel or the controller's proxy, never the gate: the receipt's
`kernel_record` says what was refused, from the kernel's own counters and the proxy's records,
`kernel_stopped` says the gate let it through (gate_rule null), and a class the kernel keeps no
count of says so instead of reporting 0.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import threading

import pytest

from agnsup.receipts import kernel_record
from agnsup.selftest.probes import FORK_BOMB, MEMORY_HOG
from conftest import Agnsup, write_role


def _receipt(path) -> dict:
    with open(path) as f:
        return json.load(f)


def _probe(worktree: str, name: str, text: str) -> str:
    with open(os.path.join(worktree, name), "w") as f:
        f.write(text)
    return name


@pytest.fixture
def tight(policy_dir, agnsup):
    write_role(policy_dir, "tight", limits__memory_max='"64M"', limits__pids_max="64", limits__cpu_max="0.5")
    agnsup.env["AGNSUP_POLICY_DIR"] = str(policy_dir)
    return "tight"


@pytest.mark.serial("a fork bomb")
def test_a_fork_bomb_the_gate_let_run_is_in_the_kernel_record_as_forks_refused_at_pids_max(
        agnsup, tight, worktree, tmp_path):
    rfile = tmp_path / "receipt.json"
    _probe(worktree, "bomb.py", FORK_BOMB)
    cp = agnsup("run", "--role", tight, "--cell", "bomb", "--receipt", str(rfile), "--workdir", worktree,
                "--timeout", "4", "--", "python3", "bomb.py", timeout=120)
    assert cp.returncode == 124, cp.err
    r = _receipt(rfile)
    assert r["governance"]["decision"]["allowed"]
    pids = r["kernel_record"]["pids"]
    assert pids["observable"] and pids["limit"] == 64 and pids["refused_forks"] > 0, pids
    assert pids["refused_forks"] == r["usage"]["pids_max_events"]
    stopped = [s for s in r["kernel_stopped"] if s["class"] == "pids"]
    assert stopped == [{"class": "pids", "what": stopped[0]["what"], "count": pids["refused_forks"],
                        "gate": "allowed", "gate_rule": None}]
    shown = agnsup("receipts", "--cell", "bomb", check=0).out
    assert f"kernel stopped pids: {stopped[0]['what']} x{pids['refused_forks']} (gate: no rule" in shown, shown


def test_a_memory_hog_is_in_the_kernel_record_as_oom_kills(agnsup, tight, worktree, tmp_path):
    rfile = tmp_path / "receipt.json"
    _probe(worktree, "hog.py", MEMORY_HOG)
    agnsup("run", "--role", tight, "--cell", "hog", "--receipt", str(rfile), "--workdir", worktree,
           "--timeout", "60", "--", "python3", "hog.py", timeout=120)
    r = _receipt(rfile)
    mem = r["kernel_record"]["memory"]
    assert r["reason"] == "oom" and mem["observable"] and mem["oom_kills"] >= 1, (r["reason"], mem)
    assert [s["class"] for s in r["kernel_stopped"]] == ["memory"]
    assert r["kernel_stopped"][0]["gate_rule"] is None and r["kernel_stopped"][0]["count"] == mem["oom_kills"]


WRITES = r'''
import errno, sys
for path in sys.argv[1:]:
    try:
        open(path, "w").write("x")
        print(path, "WRITTEN")
    except OSError as e:
        print(path, errno.errorcode[e.errno])
'''


def test_writes_outside_the_worktree_are_refused_and_the_receipt_says_they_are_not_counted(
        agnsup, worktree, tmp_path):
    rfile = tmp_path / "receipt.json"
    _probe(worktree, "writes.py", WRITES)
    targets = ["/etc/agnsup-kr-probe", "/usr/agnsup-kr-probe", "/var/tmp/agnsup-kr-probe",
               os.path.join(worktree, "inside")]
    cp = agnsup("run", "--cell", "writes", "--receipt", str(rfile), "--workdir", worktree, "--changes", "live",
                "--", "python3", "writes.py", *targets, check=0)
    got = dict(line.split() for line in cp.out.splitlines())
    assert got[targets[-1]] == "WRITTEN"
    for t in targets[:-1]:
        assert got[t] in ("EROFS", "EACCES", "EPERM"), (t, got)
        assert not os.path.exists(t)
    r = _receipt(rfile)
    w = r["kernel_record"]["writes"]
    # the refusals happened, and the receipt does not pretend to count them
    assert w["observable"] is False and "count" not in w and "not" in w["why"]
    assert "mount view (read-only root)" in w["enforced_by"] and any("landlock" in e for e in w["enforced_by"])
    assert not [s for s in r["kernel_stopped"] if s["class"] == "writes"]
    net = r["kernel_record"]["network"]
    assert net == {"mode": "deny", "observable": False, "why": net["why"]} and "ENETUNREACH" in net["why"]


CONNECT = r'''
import os, socket, sys
host, port = os.environ["HTTP_PROXY"].rsplit("/", 1)[1].split(":")
for dest in sys.argv[1:]:
    s = socket.create_connection((host, int(port)), timeout=20)
    s.sendall(f"CONNECT {dest} HTTP/1.1\r\nHost: {dest}\r\n\r\n".encode())
    print(dest, s.recv(100).split(b"\r\n")[0].decode())
    s.close()
'''


@pytest.fixture
def server():
    """A TCP server on the host's loopback that accepts and closes."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                c, _ = srv.accept()
            except OSError:
                return
            c.close()
    t = threading.Thread(target=serve, daemon=True)
    t.start()
    yield srv.getsockname()[1]
    stop.set()
    srv.close()
    t.join(5)


def test_destinations_the_proxy_refused_and_allowed_are_in_the_kernel_record(state, policy_dir, worktree, tmp_path,
                                                                             server):
    write_role(policy_dir, "onlypkg", network__mode='"allowlist"', network__allow='["pkg.test:*"]',
               network__allow_private="true")
    a = Agnsup(state, env={"AGNSUP_POLICY_DIR": str(policy_dir),
                           "AGNSUP_TEST_EGRESS_HOSTS": json.dumps({"pkg.test": "127.0.0.1"})})
    rfile = tmp_path / "receipt.json"
    _probe(worktree, "connect.py", CONNECT)
    cp = a("run", "--role", "onlypkg", "--cell", "net", "--receipt", str(rfile), "--workdir", worktree, "--",
           "python3", "connect.py", f"pkg.test:{server}", "blocked.test:443", "blocked.test:443", "other.test:80",
           check=0, timeout=120)
    out = dict(line.split(" ", 1) for line in cp.out.splitlines())
    assert " 200" in out[f"pkg.test:{server}"] and " 403" in out["blocked.test:443"], out
    r = _receipt(rfile)
    net = r["kernel_record"]["network"]
    assert net["observable"] and (net["attempts"], net["allowed"], net["refused"]) == (4, 1, 3), net
    assert [(d["name"], d["port"], d["count"]) for d in net["refused_destinations"]] == \
        [("blocked.test", 443, 2), ("other.test", 80, 1)]
    assert r["kernel_stopped"] == [{"class": "network", "what": "connections refused by the egress proxy",
                                    "count": 3, "gate": "allowed", "gate_rule": None}]


def test_a_cell_that_never_ran_reports_no_counters_as_zero():
    rec, stopped = kernel_record({"network": "deny", "network_namespace": True}, {"applied": {"pids": "v2:/x",
                                 "memory": "v2:/x"}, "pids_max": 64, "memory_max": 1}, {}, None, None)
    assert rec["pids"] == {"limit": 64, "observable": False, "why": "the cell never ran"}
    assert rec["memory"]["observable"] is False and stopped == []


def test_a_limit_no_hierarchy_holds_is_not_observable_rather_than_zero():
    rec, _ = kernel_record({"network": "host"}, {"applied": {}, "pids_max": 64}, {"pids_max_events": 0}, None, None)
    assert rec["pids"]["observable"] is False and "no pids hierarchy" in rec["pids"]["why"]
    assert rec["network"]["observable"] is False and "host network" in rec["network"]["why"]


def test_a_kernel_stop_the_gate_flagged_names_the_flag():
    decision = {"allowed": True, "rule": "allow.yellow_open", "flags": ["network.kernel_enforced"],
                "flagged": [{"rule": "network.kernel_enforced"}]}
    network = {"mode": "allowlist", "attempts": 2, "allowed": 0, "refused": 2, "failed": 0,
               "by_destination": [{"name": "x.test", "port": 443, "decision": "refused", "rule": "not_allowed",
                                   "count": 2, "bytes_up": 0, "bytes_down": 0}]}
    _, stopped = kernel_record({"network": "allowlist"}, {"applied": {}}, {"cpu_usage_usec": 1}, network, decision)
    assert stopped == [{"class": "network", "what": "connections refused by the egress proxy", "count": 2,
                        "gate": "flagged", "gate_rule": "network.kernel_enforced"}]


def test_check_explain_names_the_rule_and_the_setting_that_would_refuse_it(agnsup, worktree):
    out = agnsup.json("check", "--explain", "--json", "--workdir", worktree, "--", "curl", "https://example.com")
    k = out["kernel"]
    assert out["allowed"] and k["network"]["gate_rules"] == ["network.kernel_enforced"]
    assert k["network"]["refused_with"] == 'governance.kernel_enforced = "deny"'
    assert k["network"]["would_deny"].startswith("network.")
    assert k["pids"]["gate_rules"] == [] and "kernel_record" in k["pids"]["note"]
    out = agnsup.json("check", "--explain", "--json", "--workdir", worktree, "--", "touch", "/etc/x")
    assert out["kernel"]["writes"]["gate_rules"] == ["sandbox.kernel_enforced"]
    assert out["kernel"]["writes"]["would_deny"].startswith("sandbox.")
    text = agnsup("check", "--explain", "--workdir", worktree, "--", "python3", "bomb.py", check=0).out
    assert "kernel, pids: a fork past pids.max = 4096 fails; gate: no rule" in text


# -- Landlock denials through audit (Landlock ABI 7; the host's audit enabled) --------------------

def _audit_enabled() -> int | None:
    import struct
    try:
        s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 9)
    except OSError:
        return None
    with s:
        s.bind((0, 0))
        s.send(struct.pack("=IHHII", 16, 1000, 1, 1, 0))
        s.settimeout(2)
        d = s.recv(65536)
        return struct.unpack_from("=I", d, 20)[0] if struct.unpack_from("=H", d, 4)[0] == 1000 else None


def _audit_set(enabled: int) -> None:
    import struct
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 9) as s:
        s.bind((0, 0))
        body = struct.pack("=11I", 1, enabled, 0, 0, 0, 0, 0, 0, 0, 0, 0)  # mask AUDIT_STATUS_ENABLED
        s.send(struct.pack("=IHHII", 16 + len(body), 1001, 1 | 4, 2, 0) + body)
        s.settimeout(2)
        s.recv(65536)


@pytest.fixture
def audit_root(state, policy_dir, worktree):
    """Root, Landlock ABI 7, the audit status readable; a role whose root is read-write (Landlock is then
    what refuses writes outside the worktree); an agnsup told to read audit without an auditd."""
    from agnsup.linux import landlock
    if os.geteuid() != 0 or landlock.abi() < 7 or _audit_enabled() is None:
        pytest.skip("ENV_BLOCKED: root, Landlock ABI 7 and the audit netlink socket")
    write_role(policy_dir, "rwroot", filesystem__root='"rw"')
    _probe(worktree, "writes.py", WRITES)
    return Agnsup(state, env={"AGNSUP_POLICY_DIR": str(policy_dir), "AGNSUP_TEST_AUDIT": "1"})


@pytest.fixture
def audit_on():
    """The host's audit enabled for the test (no rule is added: only Landlock's own records flow),
    the status it had put back."""
    before = _audit_enabled()
    if not before:
        _audit_set(1)
    yield
    if not before:
        _audit_set(0)
    assert _audit_enabled() == before


def test_with_the_hosts_audit_off_the_receipt_says_so(audit_root, worktree, tmp_path):
    if _audit_enabled():
        pytest.skip("ENV_BLOCKED: the host's audit is on")
    rfile = tmp_path / "receipt.json"
    audit_root("run", "--role", "rwroot", "--cell", "off", "--receipt", str(rfile), "--workdir", worktree,
               "--changes", "live", "--", "python3", "writes.py", "/var/tmp/agnsup-kr-off", check=0)
    w = _receipt(rfile)["kernel_record"]["writes"]
    assert w["observable"] is False and w["why"].startswith("the host's audit is disabled: ")


def test_landlock_denials_are_counted_per_cell_from_the_audit_log(audit_root, audit_on, worktree, tmp_path):
    tag = os.urandom(3).hex()
    mine = [f"/var/tmp/agnsup-kr-{tag}", f"/etc/agnsup-kr-{tag}", f"/opt/agnsup-kr-{tag}"]
    other = [f"/var/tmp/agnsup-kr-other-{tag}-{i}" for i in range(5)]
    # another cell (its own worktree: not queued behind this one's lock) refuses writes, and stays
    # alive, its audit reader with it, until this cell has refused its own
    owt = tmp_path / "other-wt"
    owt.mkdir()
    _probe(str(owt), "wait.py", WRITES + "import os, time\nwhile not os.path.exists('stop'):\n    time.sleep(0.05)\n")
    p = audit_root.popen("run", "--role", "rwroot", "--cell", "other", "--receipt", str(tmp_path / "other.json"),
                         "--workdir", str(owt), "--changes", "live", "--timeout", "60", "--", "python3", "-u",
                         "wait.py", *other, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    try:
        lines = [p.stdout.readline().decode() for _ in other]
        cp = audit_root("run", "--role", "rwroot", "--cell", "mine", "--receipt", str(tmp_path / "mine.json"),
                        "--workdir", worktree, "--changes", "live", "--", "python3", "writes.py", *mine, check=0)
    finally:
        (owt / "stop").write_text("")
        out, err = p.communicate(timeout=60)
    for line in cp.out.splitlines() + lines:
        path, what = line.split()
        assert what == "EACCES", (line, cp.err, err)
        assert not os.path.exists(path)
    for cell, paths in (("mine", mine), ("other", other)):
        r = _receipt(tmp_path / f"{cell}.json")
        w = r["kernel_record"]["writes"]
        assert w["observable"] and w["landlock_denials"] == len(paths), (cell, w)
        assert w["kernel_count"] == len(paths) and w["by_class"] == {"fs.make_reg": len(paths)}, (cell, w)
        assert sorted(x["path"] for x in w["paths"]) == sorted({os.path.dirname(x) for x in paths}), (cell, w)
        assert {"class": "writes", "what": "file system writes refused by Landlock", "count": len(paths),
                "gate": "allowed", "gate_rule": None} in r["kernel_stopped"]
