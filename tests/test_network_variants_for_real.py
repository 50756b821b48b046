"""The 47 network variants of tests/data/corpora/network_exfil_variants.tsv, run
for real inside cells of the shipped `executor` role (network deny), pointed at
listeners this test opens on the host (one TCP and one UDP port per variant, so
any packet names the variant that sent it): the listeners receive nothing.

The text gate is advisory: variants it refuses are run through a script file
in the worktree (`bash variant.sh`, which the gate allows: it cannot see into
files), so every variant reaches the kernel. A control cell of the `networked`
role (host network) runs the same scripts, and the listeners must hear from
it: otherwise "nothing received" would prove nothing.

Run with -s to print the per-variant table (docs/governance.md quotes it).
"""
import csv
import select
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from agnsup.gate import GateContext, judge_shell

CORPUS = Path(__file__).resolve().parent / "data" / "corpora" / "network_exfil_variants.tsv"
HOST = "127.0.0.1"
EXECUTOR_TEXT = GateContext(role="executor", mode="open", network="deny", worktree="/workspace/project",
                            writable=("/tmp", "/dev/shm"), home="/home/user")


def variants() -> list[dict]:
    with open(CORPUS, encoding="utf-8") as f:
        return list(csv.DictReader(f, delimiter="\t"))


def rewrite(command: str, port: int) -> str:
    c = command.replace("HOST", HOST).replace("PORT", str(port))
    return c.replace("\\n", "\n") if "<<" in c else c  # corpus convention: \n in a heredoc line is a newline


class Listeners:
    """One TCP and one UDP socket per variant on the host; records who was heard."""

    def __init__(self, ids: list[str]):
        self.by_fd: dict[int, tuple[str, socket.socket]] = {}
        self.port: dict[str, int] = {}
        self.heard: dict[str, list[str]] = {}
        for vid in ids:
            tcp, udp = self._pair()
            self.port[vid] = tcp.getsockname()[1]
            for s in (tcp, udp):
                self.by_fd[s.fileno()] = (vid, s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    @staticmethod
    def _pair():
        for _ in range(50):
            tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            tcp.bind(("0.0.0.0", 0))  # every host address: any route out of the cell counts
            udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            try:
                udp.bind(("0.0.0.0", tcp.getsockname()[1]))
            except OSError:
                tcp.close()
                udp.close()
                continue
            tcp.listen(16)
            return tcp, udp
        raise RuntimeError("no free TCP+UDP port pair")

    def _loop(self):
        while not self._stop.is_set():
            r, _, _ = select.select(list(self.by_fd), [], [], 0.1)
            for fd in r:
                vid, s = self.by_fd[fd]
                if s.type == socket.SOCK_STREAM:
                    conn, peer = s.accept()
                    self.heard.setdefault(vid, []).append(f"tcp from {peer[0]}")
                    conn.close()  # close at once: clients waiting for a reply fail fast
                else:
                    data, peer = s.recvfrom(65536)
                    self.heard.setdefault(vid, []).append(f"udp {len(data)} bytes from {peer[0]}")

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        time.sleep(0.5)  # late packets still count
        self._stop.set()
        self._thread.join(5)
        for _, s in self.by_fd.values():
            s.close()


def _prepare(base: Path, vid: str, command: str) -> str:
    d = base / vid
    d.mkdir()
    (d / "variant.sh").write_text(command + "\n")
    return str(d)


def _run_executor_cell(agnsup, wt: str, command: str, direct: bool):
    argv = ["bash", "-c", command] if direct else ["bash", "variant.sh"]
    return agnsup("run", "--role", "executor", "--workdir", wt, "--timeout", "30", "--", *argv, timeout=120)


def test_the_47_network_variants_reach_nothing_from_a_network_denied_cell(agnsup, tmp_path):
    rows = variants()
    assert len(rows) == 47
    ids = [r["id"] for r in rows]
    with Listeners(ids) as lis:
        cmds = {r["id"]: rewrite(r["command"], lis.port[r["id"]]) for r in rows}
        gate = {vid: judge_shell(c, EXECUTOR_TEXT) for vid, c in cmds.items()}
        base = tmp_path / "cells"
        base.mkdir()
        wts = {vid: _prepare(base, vid, cmds[vid]) for vid in ids}
        # a variant the gate lets through is submitted as is (what an agent would send);
        # one it refuses goes through the script file, so the kernel still sees it
        with ThreadPoolExecutor(4) as pool:
            runs = dict(zip(ids, pool.map(lambda v: _run_executor_cell(agnsup, wts[v], cmds[v], gate[v].allowed),
                                          ids)))
    for vid, cp in runs.items():
        assert cp.returncode not in (125, 126), f"{vid}: agnsup refused or failed: {cp.err}"
    detected = [v for v in ids if not gate[v].allowed]
    flagged = [v for v in ids if gate[v].allowed and gate[v].flags]
    print(f"\ntext gate (executor, advisory): denied {len(detected)}/47, flagged {len(flagged)}/47 more")
    print(f"kernel (executor cells): {47 - len(lis.heard)}/47 reached nothing")
    for vid in ids:
        print(f"  {vid:24s} gate {gate[vid].rule:24s} exit {runs[vid].returncode:3d}  heard {lis.heard.get(vid, [])}")
    assert lis.heard == {}, f"the host's listeners heard from a network-denied cell: {lis.heard}"


# Programs a control variant needs, to tell "the harness is broken" from "the tool is not installed".
NEEDS = {"python": "python3", "perl": "perl", "node": "node", "gawk": "gawk", "tclsh": "tclsh",
         "openssl": "openssl", "busybox": "busybox", "socat": "socat", "curl": "curl", "wget": "wget",
         "git": "git", "pip": "pip", "npm": "npm", "ssh": "ssh", "psql": "psql", "redis": "redis-cli",
         "sqlite": "sqlite3", "vim": "vim", "gdb": "gdb", "tar": "tar", "make": "make"}
CONTROL_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def _installed(vid: str) -> bool:
    import shutil
    for key, prog in NEEDS.items():
        if vid.startswith(key) or (key in vid and vid.split("_")[0] == key):
            return shutil.which(prog, path=CONTROL_PATH) is not None
    return True  # bash builtins, and variants built on curl/wget checked via their prefix


def test_the_same_variants_do_reach_the_listeners_from_a_cell_with_the_host_network(agnsup, tmp_path):
    """The control: without the network namespace the harness hears the variants,
    so the empty result above is the namespace's doing."""
    rows = variants()
    ids = [r["id"] for r in rows]
    with Listeners(ids) as lis:
        base = tmp_path / "control"
        base.mkdir()
        lines = []
        for r in rows:
            d = _prepare(base, r["id"], rewrite(r["command"], lis.port[r["id"]]))
            lines.append(f"(cd {d} && timeout 20 bash variant.sh) >/dev/null 2>&1 </dev/null")
        (base / "all.sh").write_text("\n".join(lines) + "\n")
        cp = agnsup("run", "--role", "networked", "--workdir", str(base), "--timeout", "280", "--",
                    "bash", "all.sh", timeout=290)
        assert cp.returncode not in (124, 125, 126), cp.err  # the last variant's own exit status otherwise
    heard = set(lis.heard)
    expected = {v for v in ids if _installed(v)}
    print(f"\ncontrol (networked cell): {len(heard)}/47 variants reached the host listeners; "
          f"not heard: {sorted(set(ids) - heard)}")
    assert {"bash_devtcp_redirect", "bash_devudp", "python_socket"} <= heard
    # every variant whose program is installed connects; Debian 12's busybox wget
    # dies of SIGSEGV on this request (exit 139), on the host as in a cell
    assert expected - heard <= {"busybox_wget"}, sorted(expected - heard)


@pytest.mark.parametrize("vid", ["bash_devtcp_redirect", "bash_devudp", "curl_sh_c", "socat"])
def test_the_text_gate_refuses_the_plain_network_variants_early(vid):
    (row,) = [r for r in variants() if r["id"] == vid]
    d = judge_shell(rewrite(row["command"], 4000), EXECUTOR_TEXT)
    assert not d.allowed and d.rule.startswith("network.")
