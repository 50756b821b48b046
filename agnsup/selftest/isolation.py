"""`agnsup selftest --isolation`: the fifteen gates of spec/isolation.md, proven on this host.

Each gate runs a small probe program inside a real cell, through the public
entry point (agnsup.tool.run_process), in a private state root (and so a
private cgroup root) that is removed at the end, even on failure (unless
--keep). A probe exits 77 when the forbidden thing worked and 0 when it was
refused (nsjail's convention); some gates are judged from the controller's
side as well (the host mount table, the receipt's counters, the bytes that
arrived). Every gate ends as PASS, FAIL with the evidence, or
`ENV_BLOCKED: <capability>` when this host lacks what the gate needs: never
a pass. A probe the governance gate refuses before it runs proved nothing
about the kernel, and is reported as such, not counted.

Probes are Python programs (python3 in the cell's PATH), not shell text, so
the text gate does not refuse them first; paths it would refuse on sight are
passed in two pieces and joined inside the cell.
"""
from __future__ import annotations

import functools
import json
import os
import secrets
import shutil
import socket
import sys
import tempfile
import threading
import time
from contextlib import suppress

from .probes import (CGROUP_ESCAPE, CONTROLLER_SIGNAL, ENVIRON_FORGE, ESCAPED, FORK_BOMB, MEMORY_HOG,
                     STATE_ROOT, TTY_INJECTION, WRITE_ESCAPE)


# Small limits for the limit gates: the host must stay usable while they run.
LIMITS = {"memory_max": '"64M"', "pids_max": "64", "output_max": '"1M"', "cpu_max": "0.5"}
OUTPUT_CAP = 1 << 20

# ------------------------------------------------------------------ probes
# (the probes tests/test_confinement.py runs as well are in probes.py)

P_ENV = r'''
import json, sys
env = open("/proc/self/environ", "rb").read()
print(json.dumps(sorted(kv.split(b"=", 1)[0].decode() for kv in env.split(b"\0") if kv)))
sys.exit(77 if sys.argv[1].encode() in env else 0)
'''

# argv: paths to try (each given as two pieces joined here)
P_READ = r'''
import os, sys
seen = []
args = sys.argv[1:]
for a, b in zip(args[::2], args[1::2]):
    p = a + b
    try:
        if os.path.isdir(p):
            names = os.listdir(p)
            if names:
                seen.append(f"listed {p}: {names[:5]}")
        else:
            with open(p, "rb") as f:
                if f.read(64):
                    seen.append(f"read {p}")
    except OSError as e:
        print("refused", p, e.strerror)
for s in seen:
    print(s)
sys.exit(77 if seen else 0)
'''

# argv: host address, port, token
P_NET = r'''
import socket, sys
host, port, token = sys.argv[1], int(sys.argv[2]), sys.argv[3].encode()
worked = []
for addr in (host, "1.1.1.1", "8.8.8.8"):
    s = socket.socket()
    s.settimeout(2)
    try:
        s.connect((addr, port if addr == host else 53))
        s.send(token)
        worked.append(f"tcp {addr}")
    except OSError as e:
        print("tcp", addr, "refused:", e.strerror or e)
    finally:
        s.close()
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for addr in (host, "1.1.1.1"):
    try:
        u.sendto(token, (addr, port if addr == host else 53))
        if addr == host and host.startswith("127."):
            # a host with only loopback: in the cell's own namespace 127.0.0.1 is the cell's, and a
            # datagram sent there left nothing; whether it reached the host, the host's listener tells
            print("udp", addr, "sent to the cell's own loopback (the host listener judges)")
        else:
            worked.append(f"udp sendto {addr}")
    except OSError as e:
        print("udp", addr, "refused:", e.strerror)
for w in worked:
    print("REACHED", w)
sys.exit(77 if worked else 0)
'''

# argv: the controller's pid and start time
P_PROCS = r'''
import os, sys
pid, start = sys.argv[1], sys.argv[2]
try:
    st = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    if st[19] == start:
        print("sees the controller, pid", pid)
        sys.exit(77)
except OSError:
    pass
print("visible pids:", sorted(int(p) for p in os.listdir("/proc") if p.isdigit())[:20])
sys.exit(0)
'''

# argv: a directory inside the worktree
P_MOUNT = r'''
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
worked = []
for src, target, fstype, flags in ((b"tmpfs", sys.argv[1].encode(), b"tmpfs", 0), (b"tmpfs", b"/mnt", b"tmpfs", 0),
                                   (None, b"/", None, (1 << 20) | (1 << 14))):  # MS_SHARED | MS_REC
    if libc.mount(src, target, fstype, flags, None) == 0:
        worked.append(target.decode())
        print("mounted", target)
    else:
        print("mount", target, "refused, errno", ctypes.get_errno())
sys.exit(77 if worked else 0)
'''

# Writes far past the cap on both streams, and tries the controller's own stdout
# through /proc (a way around the pump): argv: marker
P_FLOOD = r'''
import os, sys
marker = sys.argv[1].encode()
try:
    with open(f"/proc/{os.getppid()}/fd/1", "wb") as f:
        f.write(marker)
    print("wrote the controller's stdout through /proc", file=sys.stderr, flush=True)
except OSError as e:
    print("refused /proc/ppid/fd/1:", e.strerror, file=sys.stderr, flush=True)
chunk = b"z" * 65536
while True:
    sys.stdout.buffer.write(chunk)
    sys.stderr.buffer.write(chunk[:4096])
'''


# ------------------------------------------------------------------ results

def _gate(name: str, status: str, evidence: str) -> dict:
    return {"gate": name, "status": status, "evidence": evidence.strip()[:2000]}


def _limited(name: str, res: dict, controller: str) -> tuple[dict | None, dict, dict]:
    """(the gate's verdict when the probe proved nothing about the `controller` limit, else None;
    the receipt; its usage). ENV_BLOCKED when the limit cannot be in force here."""
    blocked = f"ENV_BLOCKED: {controller} controller"
    if "error" in res:
        if "requires limits, which are not in force here" in str(res["error"]):
            return _gate(name, blocked, res["error"]), {}, {}
        return _judge(name, res, ""), {}, {}
    r = res["receipt_data"]
    if controller not in r["limits"]["applied"]:
        return _gate(name, blocked, f"no writable {controller} cgroup for the cell"), r, {}
    return None, r, r.get("usage", {})


def _judge(name: str, res: dict, what: str) -> dict:
    """PASS when the probe says refused (0), FAIL when it worked (77) or broke."""
    if "error" in res:
        if res.get("denied"):
            return _gate(name, "FAIL", f"the governance gate refused the probe before it ran, so the kernel "
                         f"was not tested (not counted): {res['error']}")
        return _gate(name, "FAIL", f"the probe could not run: {res['error']}")
    lines = (res.get("stdout", "") + res.get("stderr", "")).strip().splitlines()
    # what worked first: the table shows the start of the evidence
    out = "; ".join(sorted(lines, key=lambda line: line.startswith(("refused", "tcp", "udp", "mount", "TIOC"))))
    if res["exit_code"] == 0:
        return _gate(name, "PASS", f"{what}: refused. {out}")
    if res["exit_code"] == ESCAPED:
        return _gate(name, "FAIL", f"{what}: it worked. {out}")
    return _gate(name, "FAIL", f"probe ended {res['state']} ({res['reason']}), exit {res['exit_code']}: {out}")


class Harness:
    """A private state root, worktree and policy directory; cleaned up at the end."""

    def __init__(self, keep: bool, user: int | None = None):
        self.user = user  # run every probe cell as this uid ([process] user), not as the caller
        self.keep = keep
        # AGNSUP_SELFTEST_DIR: where the scratch root goes (default /var/tmp; the guest lane's is a tmpfs,
        # since its /var/tmp, 9p under an overlay, refuses the id-mapped mounts a real disk allows)
        self.root = tempfile.mkdtemp(prefix="agnsup-selftest-", dir=os.environ.get("AGNSUP_SELFTEST_DIR", "/var/tmp"))
        self.state = os.path.join(self.root, "state")
        self.worktree = os.path.join(self.root, "worktree")
        self.policies = os.path.join(self.root, "policies")
        self.outside = os.path.join(self.root, "outside")
        for d in (self.worktree, self.policies, self.outside):
            os.makedirs(d)
        os.chmod(self.root, 0o755)
        os.chmod(self.outside, 0o777)  # writable by anyone: only the sandbox may stop the cell
        self.token = secrets.token_hex(8)
        self._saved_env = {k: os.environ.get(k) for k in ("AGNSUP_POLICY_DIR", "AGNSUP_STATE_DIR")}
        os.environ["AGNSUP_POLICY_DIR"] = self.policies
        self.n = 0
        if user is not None:
            os.chown(self.worktree, user, user)  # the cell's worktree must be its own to write
        self._write_roles()

    def _write_roles(self) -> None:
        from ..policy import find
        with open(find("executor")) as f:
            base = f.read()
        # selftest-limits requires its limits: where the host cannot hold them the hog and the bomb never
        # run unbounded on it (the refusal is the gate's ENV_BLOCKED evidence)
        for name, limits, extra in (("selftest", {}, {}), ("selftest-limits", LIMITS, {"require": '["limits"]'}),
                                    ("selftest-output", {"output_max": LIMITS["output_max"]}, {}),
                                    ("selftest-pidns", {}, {"pid_namespace": "true"})):
            src = base.replace('name = "executor"', f'name = "{name}"')
            for key, value in limits.items():
                src = _set_key(src, "limits", key, value)
            for key, value in extra.items():
                src = _set_key(src, "isolation", key, value)
            if self.user is not None:
                src = _set_key(src, "process", "user", str(self.user))
            with open(os.path.join(self.policies, name + ".toml"), "w") as f:
                f.write(src)

    def run(self, argv: list[str], role: str = "selftest", timeout: float = 60, capture: bool = True,
            workdir: str | None = None) -> dict:
        from ..errors import AgnsupError, Denied
        from ..tool import run_process
        self.n += 1
        try:
            res = run_process(argv, role=role, run_id="selftest", cell_id=f"probe-{self.n}", state_dir=self.state,
                              workdir=workdir or self.worktree, timeout=timeout, capture=capture, entry="selftest")
        except AgnsupError as e:
            return {"error": e.message, "denied": isinstance(e, Denied), "exit_code": e.exit_code}
        with open(res["receipt"]) as f:
            res["receipt_data"] = json.load(f)
        return res

    def role(self, name: str, *keys: tuple[str, str, str]) -> str:
        """A copy of the selftest role named `name` with each (section, key, value) set; returns the name."""
        with open(os.path.join(self.policies, "selftest.toml")) as f:
            src = f.read().replace('name = "selftest"', f'name = "{name}"')
        for section, key, value in keys:
            src = _set_key(src, section, key, value)
        with open(os.path.join(self.policies, name + ".toml"), "w") as f:
            f.write(src)
        return name

    def read_canary(self, path: str) -> dict:
        """Write a 0600 file holding the token at `path` (as the caller), let a cell try to read it, remove it."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, self.token.encode())
            os.close(fd)
            return self.probe(P_READ, os.path.dirname(path) + "/", os.path.basename(path))  # in two pieces
        finally:
            os.unlink(path)

    def probe(self, code: str, *args: str, **kw) -> dict:
        return self.run(["python3", "-c", code, *args], **kw)

    def close(self) -> None:
        for k, v in self._saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if not self.keep:
            remove_state(self.state)
            shutil.rmtree(self.root, ignore_errors=True)


def _set_key(src: str, section: str, key: str, value: str) -> str:
    """Set `key = value` in [section] of a TOML text, adding the line or the section as needed."""
    lines = src.splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip() == f"[{section}]"), None)
    if start is None:
        return src.rstrip("\n") + f"\n\n[{section}]\n{key} = {value}\n"
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("[")), len(lines))
    for i in range(start + 1, end):
        if lines[i].split("=")[0].strip() == key:
            lines[i] = f"{key} = {value}"
            return "\n".join(lines) + "\n"
    lines.insert(start + 1, f"{key} = {value}")
    return "\n".join(lines) + "\n"


def remove_state(state: str) -> list[str]:
    """Kill whatever is left in this state root's own cgroup tree and remove it (ours alone:
    the tree's name is derived from the state root)."""
    from .. import backend
    return backend.choose(state).purge()


# ------------------------------------------------------------------ the gates

def gate_host_env_leak(h: Harness) -> dict:
    canary = "AGNSUP_SELFTEST_CANARY"
    os.environ[canary] = h.token
    try:
        res = h.probe(P_ENV, h.token)
    finally:
        os.environ.pop(canary, None)
    g = _judge("HOST_ENV_LEAK", res, "the host variable reaching the cell")
    if g["status"] == "PASS":
        keys = json.loads(res["stdout"])
        declared = res["receipt_data"]["env_keys"]
        if keys != declared:
            return _gate("HOST_ENV_LEAK", "FAIL", f"/proc/self/environ holds {keys}, the receipt declares {declared}")
        g["evidence"] = f"/proc/self/environ equals the declared set ({len(keys)} keys); the host canary is absent"
    return g


def gate_home_visibility(h: Harness) -> dict:
    home = os.path.expanduser("~")
    if not os.path.isdir(home) or home == "/":
        return _gate("HOME_VISIBILITY", "ENV_BLOCKED: a home directory", f"HOME is {home!r}")
    res = h.read_canary(os.path.join(home, f".agnsup-selftest-{h.token}"))
    return _judge("HOME_VISIBILITY", res, f"reading a file in the invoking user's home {home}")


CREDENTIALS = ("~/.ssh", "~/.aws", "~/.config/gcloud", "~/.docker", "~/.netrc", "~/.kube", "~/.gnupg", "/etc/shadow")


def gate_credential_visibility(h: Harness) -> dict:
    paths = [os.path.expanduser(p) for p in CREDENTIALS]
    args = [a for p in paths for a in (os.path.dirname(p) + "/", os.path.basename(p))]
    present = [p for p in paths if os.path.exists(p)]
    g = _judge("CREDENTIAL_VISIBILITY", h.probe(P_READ, *args), "reading credentials")
    g["evidence"] += f" (present on this host: {', '.join(present) or 'none'})"
    return g


def gate_state_root(h: Harness) -> dict:
    h.run(["true"])  # the journal exists now
    half = len(h.state) // 2
    return _judge("STATE_ROOT_VISIBLE", h.probe(STATE_ROOT, h.state[:half], h.state[half:]),
                  "reading or writing the state root")


def gate_project_escape(h: Harness) -> dict:
    name = f"escape-{h.token}"
    link = os.path.join(h.worktree, "link-out")
    os.symlink(h.outside, link)
    try:
        targets = [os.path.join(h.outside, name + "-abs"), os.path.join(h.worktree, "..", "outside", name + "-dotdot"),
                   os.path.join(link, name + "-symlink"), f"/var/tmp/{name}-vartmp", f"/etc/{name}"]
        res = h.probe(WRITE_ESCAPE, *targets)
    finally:
        os.unlink(link)
    landed = [t for t in targets if os.path.exists(t)]
    for t in landed:
        os.unlink(t)
    g = _judge("PROJECT_ESCAPE", res, "writing outside the worktree and /tmp")
    if landed and g["status"] == "PASS":
        g = _gate("PROJECT_ESCAPE", "FAIL", f"files appeared on the host: {landed}")
    return g


def _host_address() -> str | None:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the outgoing address
        return s.getsockname()[0]
    except OSError:
        return None
    finally:
        s.close()


def gate_network(h: Harness) -> dict:
    addr = _host_address() or "127.0.0.1"
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("0.0.0.0", 0))
    srv.listen(8)
    srv.settimeout(0.2)
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("0.0.0.0", srv.getsockname()[1]))
    udp.settimeout(0.2)
    got: list[str] = []
    done = threading.Event()

    def listen():
        while not done.is_set():
            for s in (srv, udp):
                with suppress(socket.timeout, OSError):
                    if s is srv:
                        c, peer = srv.accept()
                        got.append(f"tcp from {peer}")
                        c.close()
                    else:
                        _, peer = udp.recvfrom(100)
                        got.append(f"udp from {peer}")

    t = threading.Thread(target=listen, daemon=True)
    t.start()
    try:
        res = h.probe(P_NET, addr, str(srv.getsockname()[1]), h.token)
        time.sleep(0.5)
    finally:
        done.set()
        t.join(5)
        srv.close()
        udp.close()
    g = _judge("NETWORK_EGRESS_NONE", res, f"reaching the host ({addr}) and the internet")
    if got:
        g = _gate("NETWORK_EGRESS_NONE", "FAIL", f"the host listener was reached: {got}")
    return g


def gate_cgroup_escape(h: Harness) -> dict:
    return _judge("CGROUP_ESCAPE", h.probe(CGROUP_ESCAPE), "writing its pid into a cgroup.procs above its own")


def gate_environ_forge(h: Harness) -> dict:
    return _judge("ENVIRON_FORGE", h.probe(ENVIRON_FORGE), "rewriting /proc/self/environ with prctl(PR_SET_MM)")


def gate_controller_signal(h: Harness) -> dict:
    return _judge("CONTROLLER_SIGNAL", h.probe(CONTROLLER_SIGNAL, "ppid:0", f"{os.getpid()}:0", "1:0"),
                  "signalling the controller and host processes")


def gate_host_processes(h: Harness) -> dict:
    from ..linux import proc
    try:
        from ..policyfile import Policy
        knows_pidns = "isolation" in Policy.model_fields
    except ImportError:
        knows_pidns = False
    if not knows_pidns:
        return _gate("HOST_PROCESS_VISIBILITY", "FAIL", "this agnsup has no role key for a PID namespace "
                     "(isolation.pid_namespace): a cell sees every host process")
    res = h.probe(P_PROCS, str(os.getpid()), str(proc.stat(os.getpid()).starttime), role="selftest-pidns")
    return _judge("HOST_PROCESS_VISIBILITY", res, "seeing the controller from a PID-namespace role")


def gate_tty_injection(h: Harness) -> dict:
    """The cell's stdin is a terminal (as under an interactive `agnsup run`): a pty of ours."""
    master, slave = os.openpty()
    saved = [os.dup(n) for n in (0, 1, 2)]
    out = tempfile.TemporaryFile()
    try:
        os.dup2(slave, 0)
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
        res = h.probe(TTY_INJECTION, capture=False)
    finally:
        for n, fd in enumerate(saved):
            os.dup2(fd, n)
            os.close(fd)
        os.close(slave)
        os.close(master)
    out.seek(0)
    res["stdout"] = out.read().decode(errors="replace")
    out.close()
    return _judge("TTY_INJECTION", res, "pushing input into the terminal (TIOCSTI / TIOCLINUX)")


def _mountinfo() -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return sorted(" ".join(line.split()[3:5]) for line in f)


def gate_mount_leak(h: Harness) -> dict:
    target = os.path.join(h.worktree, f"mnt-{h.token}")
    os.mkdir(target)
    before = _mountinfo()
    res = h.probe(P_MOUNT, target)
    after = _mountinfo()
    changed = sorted(set(before) ^ set(after))
    ours = [m for m in changed if h.root in m or "/mnt" in m.split()[-1]]
    inside = "the cell could mount in its own namespace" if res.get("exit_code") == ESCAPED else "mounts refused inside"
    if "error" in res:
        return _judge("MOUNT_LEAK", res, "")
    if ours:
        return _gate("MOUNT_LEAK", "FAIL", f"the host mount table gained {ours}")
    note = f" (other host mount changes meanwhile, not from this cell: {changed[:3]})" if changed else ""
    return _gate("MOUNT_LEAK", "PASS", f"host mount table unchanged by the cell; {inside}{note}")


def gate_oom(h: Harness) -> dict:
    res = h.probe(MEMORY_HOG, role="selftest-limits", timeout=120)
    verdict, r, u = _limited("OOM_OUTSIDE_CELL", res, "memory")
    if verdict:
        return verdict
    peak = u.get("memory_max_usage") or u.get("memory_peak") or 0
    ev = (f"reason {r['reason']}, state {r['state']}, cell oom_kills {u.get('oom_kills')}, "
          f"peak {peak} of {64 << 20}")
    if r["reason"] == "oom" and r["state"] == "killed" and (u.get("oom_kills") or 0) >= 1 and peak <= 64 << 20:
        return _gate("OOM_OUTSIDE_CELL", "PASS", "the OOM killer acted inside the cell's cgroup only: " + ev)
    return _gate("OOM_OUTSIDE_CELL", "FAIL", ev)


def gate_fork_bomb(h: Harness) -> dict:
    from ..linux import cgroup
    from ..process.helpers import probe
    with open(os.path.join(h.worktree, "bomb.py"), "w") as f:
        f.write(FORK_BOMB)  # from a file: the text gate refuses a fork loop on the command line
    cell_no = h.n + 1
    base = cgroup.base_node(cgroup.detect_layout(), h.state)
    node = cgroup.scope_node(base, "selftest", "default", f"probe-{cell_no}")
    counter = os.path.join(node.paths.get("pids") or node.paths.get("v2", "/nonexistent"), "pids.current")
    stats = {"most": 0, "host_forks": 0, "slowest": 0.0}
    done = threading.Event()

    def watch():
        while not done.is_set():
            with suppress(OSError, ValueError), open(counter) as f:
                stats["most"] = max(stats["most"], int(f.read()))
            t0 = time.monotonic()
            ok, _ = probe(lambda: None)  # the host can still start a process
            stats["slowest"] = max(stats["slowest"], time.monotonic() - t0)
            stats["host_forks"] += ok
            done.wait(0.2)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    try:
        res = h.run(["python3", "bomb.py"], role="selftest-limits", timeout=5)
    finally:
        done.set()
        t.join(30)
    verdict, r, u = _limited("FORK_BOMB_OUTSIDE_CELL", res, "pids")
    if verdict:
        return verdict
    ev = (f"ended {r['reason']} after {r['duration']:.1f} s, pids_max_events {u.get('pids_max_events')}, "
          f"most processes seen {stats['most']} (limit 64), host forks meanwhile {stats['host_forks']} "
          f"(slowest {stats['slowest'] * 1000:.0f} ms)")
    if (u.get("pids_max_events") or 0) > 0 and stats["most"] <= 64 and stats["host_forks"] > 0 \
            and r["reason"] == "timeout":
        return _gate("FORK_BOMB_OUTSIDE_CELL", "PASS", "the bomb stopped at the pids limit: " + ev)
    return _gate("FORK_BOMB_OUTSIDE_CELL", "FAIL", ev)


def gate_output_limit(h: Harness) -> dict:
    marker = f"selftest-bypass-{h.token}"
    # our own stdout during the probe is a file we can read back: the /proc route lands there
    out = tempfile.TemporaryFile()
    saved = os.dup(1)
    try:
        sys.stdout.flush()
        os.dup2(out.fileno(), 1)
        res = h.probe(P_FLOOD, marker, role="selftest-output", timeout=120)
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    out.seek(0)
    bypassed = marker.encode() in out.read()
    out.close()
    if "error" in res:
        return _judge("OUTPUT_LIMIT_BYPASS", res, "")
    r = res["receipt_data"]
    o = r["output"]
    sizes = sum((o.get(n) or {}).get("bytes", 0) for n in ("stdout", "stderr"))
    ev = (f"reason {r['reason']}, state {r['state']}, delivered {sizes} bytes of a {o.get('limit')} cap"
          f"{'; it wrote the controller stdout through /proc/PPID/fd/1' if bypassed else ''}")
    if r["reason"] == "output_limit" and r["state"] == "killed" and sizes == OUTPUT_CAP and not bypassed:
        return _gate("OUTPUT_LIMIT_BYPASS", "PASS", "the cell was stopped at the cap: " + ev)
    return _gate("OUTPUT_LIMIT_BYPASS", "FAIL", ev)


RUNNERS = {"HOST_ENV_LEAK": gate_host_env_leak, "HOME_VISIBILITY": gate_home_visibility,
           "CREDENTIAL_VISIBILITY": gate_credential_visibility, "STATE_ROOT_VISIBLE": gate_state_root,
           "PROJECT_ESCAPE": gate_project_escape, "NETWORK_EGRESS_NONE": gate_network,
           "CGROUP_ESCAPE": gate_cgroup_escape, "ENVIRON_FORGE": gate_environ_forge,
           "CONTROLLER_SIGNAL": gate_controller_signal, "HOST_PROCESS_VISIBILITY": gate_host_processes,
           "TTY_INJECTION": gate_tty_injection, "MOUNT_LEAK": gate_mount_leak, "OOM_OUTSIDE_CELL": gate_oom,
           "FORK_BOMB_OUTSIDE_CELL": gate_fork_bomb, "OUTPUT_LIMIT_BYPASS": gate_output_limit}
GATES = tuple(RUNNERS)  # the gates' names, in spec/isolation.md's order


DOOR_MODULES = ("doors_sockets", "doors_tcppeer", "doors_kernel", "doors_dev", "doors_identity", "doors_autoexec",
                "doors_worktree")


@functools.lru_cache(maxsize=1)
def door_runners() -> dict:
    """The doors a peer sandbox closes (issue 25; docs/isolation.md "Doors"), each judged like a gate:
    PASS is reported HELD, FAIL is OPEN. Imported when asked for: the door modules use this one's Harness."""
    import importlib
    out: dict = {}
    for name in DOOR_MODULES:
        out.update(importlib.import_module(f"{__package__}.{name}").RUNNERS)
    return out


DOOR_STATUS = {"PASS": "HELD", "FAIL": "OPEN"}


def _run_each(h: Harness, names, runners: dict) -> list[dict]:
    results = []
    for name in names:
        try:
            results.append(runners[name](h))
        except Exception as e:  # noqa: BLE001 - one broken gate must not hide the others
            results.append(_gate(name, "FAIL", f"the selftest itself failed: {type(e).__name__}: {e}"))
    return results


def run_gates(keep: bool = False, only: list[str] | None = None, user: int | None = None) -> dict:
    """Run the gates and the doors (all, or `only`) and return {"gates": [...], "doors": [...], "ok": bool}."""
    h = Harness(keep, user)
    try:
        gates = _run_each(h, [n for n in only or GATES if n in RUNNERS], RUNNERS)
        doors = _run_each(h, [n for n in only or door_runners() if n in door_runners()], door_runners())
    finally:
        h.close()
    doors = [{"door": d.pop("gate"), **d, "status": DOOR_STATUS.get(d["status"], d["status"])} for d in doors]
    return {"gates": gates, "doors": doors,
            "ok": all(g["status"] == "PASS" for g in gates) and all(d["status"] == "HELD" for d in doors),
            "uid": os.geteuid(), "cell_uid": user, "root": h.root, "kept": keep}


def format_table(report: dict) -> str:
    width = max(len(g) for g in GATES + tuple(door_runners()))
    lines = []
    for kind, key, good in (("gate", "gates", "PASS"), ("door", "doors", "HELD")):
        rows = report.get(key) or []
        if not rows:
            continue
        lines.append(f"{kind:{width}}  status")
        for g in rows:
            lines.append(f"{g[kind]:{width}}  {g['status']}")
            if g["status"] != good or g["evidence"]:
                lines.append(f"{'':{width}}    {' '.join(g['evidence'].split())[:300]}")  # one line each
        lines.append(f"{sum(g['status'] == good for g in rows)}/{len(rows)} {key} "
                     f"{'pass' if key == 'gates' else 'held'}")
    if report["kept"]:
        lines.append(f"kept {report['root']}")
    return "\n".join(lines)


def main(as_json: bool = False, keep: bool = False, user: int | None = None) -> int:
    report = run_gates(keep=keep, user=user)
    text = json.dumps(report, indent=2, sort_keys=True) if as_json else format_table(report)
    sys.stdout.write(text + "\n")
    return 0 if report["ok"] else 1
