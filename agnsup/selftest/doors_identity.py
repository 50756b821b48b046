"""Isolation gates for issue 25's identity doors (docs/isolation.md, "Doors: identity"): a cell is not host
root, every home is hidden, /tmp is a capped tmpfs. Each runs a probe in a real cell through the
isolation selftest's Harness; PASS when the door held, FAIL with what the cell did, ENV_BLOCKED when
this host cannot test it.

OTHER_HOMES never writes into another user's home: it compares what the host lists in each other home
with what a cell lists there (a hidden home shows at most the mount points of what is re-exposed in it);
ENV_BLOCKED when no other home on this host has anything in it to see.
"""
from __future__ import annotations

import os

from .isolation import Harness, _gate, _judge

P_LIST = r'''
import json, os, sys
out = {}
for p in sys.argv[1:]:
    try:
        out[p] = sorted(os.listdir(p))
    except OSError as e:
        out[p] = "refused: " + e.strerror
print(json.dumps(out))
'''

P_TMP_FILL = r'''
import os, sys
with open("/proc/self/mountinfo") as f:
    fstype = [l.split(" - ")[1].split()[0] for l in f if l.split()[4] == "/tmp"][-1]
print("/tmp is", fstype)
try:
    with open("/tmp/fill", "wb") as f:
        for _ in range(int(sys.argv[1])):
            f.write(b"x" * 65536)
            f.flush()
    print("wrote", sys.argv[1], "x 64K past limits.tmp_max")
    sys.exit(77)
except OSError as e:
    print("refused", e.strerror)
    sys.exit(0 if fstype == "tmpfs" else 77)
'''

TMP_CAP = 1024 * 1024  # the gate's limits.tmp_max


def gate_root_only_files(h: Harness) -> dict:
    """A root-owned 0600 file outside every home (in the selftest's own directory under /var/tmp)."""
    if os.geteuid() != 0:
        return _gate("ROOT_ONLY_FILES", "ENV_BLOCKED: agnsup as root (only root can make a root-owned file)",
                     f"the selftest runs as uid {os.geteuid()}")
    path = os.path.join(h.root, f"root-only-{h.token}")
    res = h.read_canary(path)
    g = _judge("ROOT_ONLY_FILES", res, f"reading a root-owned 0600 file ({path})")
    if "receipt_data" in res:
        iso = res["receipt_data"]["isolation"]
        g["evidence"] += f" (cell host uid {iso.get('cell_host_uid', iso.get('uid'))}, " \
                         f"mapped_uid {iso.get('mapped_uid')})"
        why = [n for n in iso.get("not_in_force", []) if n.startswith("mapped_uid")]
        if g["status"] == "FAIL" and why:
            # this host cannot map the cell (its worktree's file system refuses id-mapped mounts): the door
            # is open here, named as what the host lacks, never as held
            g["status"] = f"ENV_BLOCKED: {why[0]}"
    return g


def _other_homes() -> dict[str, int]:
    """{home: entries the host lists in it} for every hidden home but the invoking user's, with something in it."""
    from ..linux.host import all_homes, invoking_homes
    mine = invoking_homes()
    out = {}
    for home in all_homes():
        if home in mine:
            continue
        try:
            n = len(os.listdir(home))
        except OSError:
            continue
        if n:
            out[home] = n
    return out


def gate_other_homes(h: Harness) -> dict:
    import json
    homes = _other_homes()
    if not homes:
        return _gate("OTHER_HOMES", "ENV_BLOCKED: another home with something in it",
                     "no home of the password database but the invoking user's has entries to look for")
    res = h.probe(P_LIST, *homes)
    if "error" in res or res["exit_code"] != 0:
        return _judge("OTHER_HOMES", res, "listing other homes")
    seen = json.loads(res["stdout"])
    shown = {p: names for p, names in seen.items() if isinstance(names, list) and names}
    if shown:
        return _gate("OTHER_HOMES", "FAIL", "the cell lists other homes: " + "; ".join(
            f"{p}: {names[:5]} (host: {homes[p]} entries)" for p, names in shown.items()))
    return _gate("OTHER_HOMES", "PASS", "every other home is empty or closed in the cell: " + "; ".join(
        f"{p} (host: {homes[p]} entries, cell: {seen[p] or 'empty'})" for p in homes))


def gate_tmp_fill(h: Harness) -> dict:
    """/tmp capped by limits.tmp_max (1M here), a tmpfs, not the state root's disk; the receipt counts it
    (a root controller's cells: a normal user's controller cannot measure its cells' /tmp)."""
    role = h.role("selftest-tmp", ("limits", "tmp_max", '"1M"'))
    res = h.probe(P_TMP_FILL, str(2 * TMP_CAP // 65536), role=role)
    g = _judge("TMP_FILL", res, "writing 2M into a /tmp capped at 1M")
    if g["status"] == "PASS" and os.geteuid() == 0:
        used = res["receipt_data"].get("usage", {}).get("tmp_bytes")
        if used is None or not 0 < used <= TMP_CAP:
            return _gate("TMP_FILL", "FAIL", f"the receipt does not count /tmp: usage.tmp_bytes = {used!r}")
        g["evidence"] += f" (receipt usage.tmp_bytes {used})"
    return g


RUNNERS = {"ROOT_ONLY_FILES": gate_root_only_files, "OTHER_HOMES": gate_other_homes, "TMP_FILL": gate_tmp_fill}
