"""The inside half of v2lane's `pod` step: run by the image's own entrypoint in a container that containerd +
runc started (`ctr run`, a private cgroup namespace), in the pure cgroup-v2 guest. scripts/v2lane_guest.py
(s_pod) starts the container and reads what this prints.

    agnsup-entrypoint python3 /xchg/v2lane_pod_probe.py --xchg /xchg [--isolation]

It checks, as the node's pod would see it: `agnsup doctor` (layout v2, the container named), a cell whose
cgroup is its own below the container's (the cell's /proc/self/cgroup, in the container's cgroup namespace),
memory_max (a hog stopped with reason oom), pids_max (a fork bomb held at its limit), cancel of a running cell
(the guest, outside, reads the cell's cgroup from the node's side while it runs: /xchg/k1.pid, /xchg/k1.seen),
and optionally `agnsup selftest --isolation`. One JSON object per line on stdout: {"check", "ok", "detail", ...};
the last line is {"done": true}. Standard library only (the image's python3), never raises out of a check.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from contextlib import suppress

AGNSUP = "agnsup"
HOG = "b = bytearray(200 << 20)\nprint('allocated')\n"
# the selftest's fork bomb (agnsup/selftest/probes.py), from a file: the text gate refuses it on a command line
FORK_BOMB = ("import os, time\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n"
             "        time.sleep(0.02)\n")


def emit(check: str, ok: bool | None, detail: str, **extra) -> None:
    """ok None: the container cannot do it and says so (ENV_BLOCKED on the guest's side)."""
    print(json.dumps({"check": check, "ok": ok, "detail": detail, **extra}), flush=True)


def run(argv, timeout=600, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL, **kw)


def last_line(cp) -> str:
    text = (cp.stderr or "").strip() or (cp.stdout or "").strip()
    return text.splitlines()[-1][:300] if text else f"exit {cp.returncode}, no output"


def receipt(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def cell(wt: str, role: str, argv: list[str], name: str, extra=(), timeout=600):
    rfile = os.path.join(wt, f"receipt-{name}.json")
    cp = run([AGNSUP, "run", "--role", role, "--cell", name, "--receipt", rfile, "--workdir", wt, *extra, "--",
              *argv], timeout=timeout)
    return cp, receipt(rfile)


def c_doctor(xchg: str) -> None:
    cp = run([AGNSUP, "doctor", "--json"], timeout=600)
    with open(os.path.join(xchg, "doctor-pod.json"), "w") as f:
        f.write(cp.stdout + ("\n--- stderr\n" + cp.stderr if cp.stderr else ""))
    try:
        rep = json.loads(cp.stdout)
    except ValueError:
        return emit("doctor", False, f"no JSON: {last_line(cp)}")
    cg = rep.get("cgroup", {})
    host = rep.get("host") or {}
    weaker = {k: v for k, v in (host.get("guarantees") or {}).items() if v != "in force"}
    detail = (f"exit {cp.returncode}, ok {rep.get('ok')}, status {rep.get('status', '-')}, layout {cg.get('layout')},"
              f" v2 controllers {' '.join(cg.get('v2_controllers') or []) or '-'}, agnsup root "
              f"{cg.get('agnsup_root', {}).get('v2', '-')}, host {host.get('kind')}, container {host.get('container')},"
              f" not in force {weaker or 'none'}, does without {rep.get('does_without')}")
    # a doctor that says the container runs cells with all its guarantees; the host line names the container
    ok = (cp.returncode == 0 and rep.get("ok") is not False and cg.get("layout") == "v2" and bool(host.get("container"))
          and not weaker)
    emit("doctor", ok, detail)


def c_cgroup(wt: str) -> None:
    own = open("/proc/self/cgroup").read().strip()
    cp, r = cell(wt, "executor", ["sh", "-c", "grep Seccomp_filters /proc/self/status; cat /proc/self/cgroup"],
                 "where")
    if r is None or cp.returncode != 0:
        return emit("cell_cgroup", False, f"`agnsup run -- cat /proc/self/cgroup`: {last_line(cp)}")
    inside = cp.stdout.strip().splitlines()[-1] if cp.stdout.strip() else ""
    rel = inside[3:] if inside.startswith("0::") else ""
    # its own: below the container's root (the namespace's "/"), not the entrypoint's leaf, not the root itself
    ok = rel.startswith("/") and rel not in ("/", own[3:]) and r["isolation"].get("tracking") == "cgroup" or (
        rel.startswith("/") and rel not in ("/", own[3:]) and bool((r.get("cgroup") or {}).get("v2")))
    filters = next((x.split()[-1] for x in cp.stdout.splitlines() if x.startswith("Seccomp_filters")), "?")
    emit("cell_cgroup", ok, f"cell {inside}, seccomp filters on the cell {filters}, the probe's own {own}, receipt cgroup {(r.get('cgroup') or {}).get('v2')},"
         f" tracking {r['isolation'].get('tracking')}, not_in_force {r['isolation'].get('not_in_force')}")


def c_memory(wt: str) -> None:
    cp, r = cell(wt, "small", ["python3", "-c", HOG], "hog")
    if r is None:
        return emit("memory_max", False, f"the hog did not run: {last_line(cp)}")
    ok = r.get("reason") == "oom" and "allocated" not in cp.stdout
    emit("memory_max", ok, f"200 MB in a 64M cell: reason {r.get('reason')}, exit {r.get('exit_code')}, "
         f"applied {r['limits'].get('applied', {}).get('memory')}, limits_hit {r.get('limits_hit')}")


def c_pids(wt: str) -> None:
    with open(os.path.join(wt, "bomb.py"), "w") as f:
        f.write(FORK_BOMB)
    cp, r = cell(wt, "tight", ["python3", "bomb.py"], "bomb", extra=("--timeout", "6"))
    if r is None:
        return emit("pids_max", False, f"the bomb did not run: {last_line(cp)}")
    events = (r.get("usage") or {}).get("pids_max_events")
    ok = r.get("reason") == "timeout" and "pids" in (r.get("limits_hit") or []) and bool(events)
    emit("pids_max", ok, f"fork bomb at pids_max 32 for 6 s: reason {r.get('reason')}, pids_max_events {events}, "
         f"applied {r['limits'].get('applied', {}).get('pids')}, limits_hit {r.get('limits_hit')}, "
         f"controller exit {cp.returncode}")


def pids_of(pattern: str) -> list[int]:
    out = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            with suppress(OSError), open(f"/proc/{p}/cmdline", "rb") as f:
                if f.read().replace(b"\0", b" ").strip() == pattern.encode():
                    out.append(int(p))
    return out


def c_cancel(wt: str, xchg: str) -> None:
    ctl = subprocess.Popen([AGNSUP, "run", "--cell", "k1", "--workdir", wt, "--", "sleep", "3217"],
                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        pids = []
        while time.monotonic() < deadline and ctl.poll() is None and not pids:
            pids = pids_of("sleep 3217")
            time.sleep(0.2)
        if not pids:
            return emit("cancel", False, f"the cell never ran: exit {ctl.poll()}")
        inside = open(f"/proc/{pids[0]}/cgroup").read().strip()
        with open(os.path.join(xchg, "k1.pid.new"), "w") as f:  # the node looks at the cell while it lives
            f.write(f"{inside}\n")
        os.rename(os.path.join(xchg, "k1.pid.new"), os.path.join(xchg, "k1.pid"))
        seen = os.path.join(xchg, "k1.seen")
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not os.path.exists(seen):
            time.sleep(0.2)
        cc = run([AGNSUP, "cancel", "--cell", "k1", "--grace", "0", "--json"], timeout=300)
        rc = ctl.wait(120)
        rec = []
        with suppress(ValueError):
            rec = json.loads(run([AGNSUP, "receipts", "--json"], timeout=120).stdout)
        k1 = next((x for x in rec if x.get("cell_id") == "k1"), {})
        left = pids_of("sleep 3217")
        ok = cc.returncode == 0 and k1.get("state") == "cancelled" and not left
        emit("cancel", ok, f"cell {inside}; cancel exit {cc.returncode}, controller exit {rc}, receipt state "
             f"{k1.get('state')}, sleep left {left or 'none'}")
    finally:
        if ctl.poll() is None:
            ctl.kill()  # our own controller
            ctl.wait()


# a door the pod's runtime holds for every process in it, the selftest's own included, so the selftest cannot
# plant what it would look for: named, not failed (containerd's default profile refuses add_key and keyctl)
RUNTIME_HELD = {"KEYRING": "add_key: Operation not permitted"}


def c_isolation(xchg: str) -> None:
    # another user's home with something in it (OTHER_HOMES looks for one), in the container's own /etc/passwd
    run(["useradd", "-m", "v2lane-other"], timeout=60)
    with open("/home/v2lane-other/notes.txt", "w") as f:
        f.write("another user's file\n")
    # the scratch root on the pod's volume (an emptyDir: tmpfs here) rather than the image's overlayfs, which
    # refuses id-mapped mounts (ROOT_ONLY_FILES) and an overlay upper (WORKTREE_DESTROYED)
    env = {**os.environ, "AGNSUP_SELFTEST_DIR": os.environ.get("V2LANE_POD_SCRATCH", "/var/tmp")}
    cp = run([AGNSUP, "selftest", "--isolation", "--json"], timeout=900, env=env)
    with open(os.path.join(xchg, "isolation-pod.json"), "w") as f:
        f.write(cp.stdout + ("\n--- stderr\n" + cp.stderr if cp.stderr else ""))
    try:
        rep = json.loads(cp.stdout)
    except ValueError:
        return emit("isolation", False, f"no JSON: {last_line(cp)}")
    doors = rep.get("doors", [])
    bad = [f"{g['gate']}={g['status']}" for g in rep.get("gates", []) if g["status"] != "PASS"]
    held_by_runtime = [f"{d['door']} (the runtime refuses it to the selftest too: {RUNTIME_HELD[d['door']]})"
                       for d in doors if d["door"] in RUNTIME_HELD and d["status"].startswith("ENV_BLOCKED")
                       and RUNTIME_HELD[d["door"]] in d["status"]]
    bad += [f"{d['door']}={d['status']}" for d in doors if d["status"] != "HELD"
            and not any(x.startswith(d["door"] + " ") for x in held_by_runtime)]
    ok = True if cp.returncode in (0, 1) and not bad and all(g["status"] == "PASS" for g in rep.get("gates", [])) else (
        None if bad and all("ENV_BLOCKED" in b for b in bad) else False)
    good = sum(g["status"] == "PASS" for g in rep.get("gates", []))
    held = sum(d["status"] == "HELD" for d in doors)
    emit("isolation", ok, f"{good}/{len(rep.get('gates', []))} gates PASS, {held}/{len(doors)} doors HELD, exit "
         f"{cp.returncode}" + (f"; not testable here: {'; '.join(held_by_runtime)}" if held_by_runtime else "")
         + (f"; {' '.join(bad)}" if bad else ""))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--xchg", required=True)
    ap.add_argument("--isolation", action="store_true")
    a = ap.parse_args()
    wt = os.environ.get("V2LANE_POD_WORKDIR", "/workspace")
    status = open("/proc/self/status").read()
    caps = next((x.split()[1] for x in status.splitlines() if x.startswith("CapEff:")), "?")
    seccomp = next((x.split()[1] for x in status.splitlines() if x.startswith("Seccomp:")), "?")
    emit("container", True, f"cgroup {open('/proc/self/cgroup').read().strip()}, CapEff {caps}, Seccomp {seccomp}, "
         f"/sys/fs/cgroup controllers [{open('/sys/fs/cgroup/cgroup.controllers').read().strip()}], subtree_control "
         f"[{open('/sys/fs/cgroup/cgroup.subtree_control').read().strip()}], uid {os.getuid()}")
    checks = [("doctor", lambda: c_doctor(a.xchg)), ("cell_cgroup", lambda: c_cgroup(wt)), ("memory_max", lambda: c_memory(wt)),
              ("pids_max", lambda: c_pids(wt)), ("cancel", lambda: c_cancel(wt, a.xchg))]
    if a.isolation:
        checks.append(("isolation", lambda: c_isolation(a.xchg)))
    for name, fn in checks:
        t0 = time.monotonic()
        try:
            fn()
        except Exception as e:  # a check that breaks says so and the next one runs
            emit(name, False, f"the check broke: {type(e).__name__}: {e}")
        print(json.dumps({"timing": name, "seconds": round(time.monotonic() - t0, 1)}), flush=True)
    print(json.dumps({"done": True}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
