"""The guest half of scripts/v2lane: run as root inside the v2guest VM (../shared/tools/v2guest/run.sh).

    v2lane_guest.py --venv V --src S [--pytest ARGS] [--runs N] [--seed S] [--isolation-user UID] [--budget S]

Busybox PID 1 (pure cgroup v2, every controller at the root, no systemd): doctor, the chosen pytest
subset, `agnsup selftest --isolation` (as root, and with cells as an unprivileged uid), `agnsup selftest
--runs N`. Under systemd (run.sh --systemd): the same host checks as root, then as a normal user with its
own user@UID.service: where the cell's cgroup lives (inside a unit with Delegate=yes, or beside systemd's
slices), whether a cpu.max and a memory.max cell limit are in force, a cancel, the blackout run (SIGKILL of
the controller, then the janitor: nothing left) and the isolation probes.

Every step ends PASS, FAIL or ENV_BLOCKED with the evidence; nothing the guest cannot do counts as a pass.
--budget S (CI's time left): a step that would not end within S seconds is cut, and says so: BUDGET, with
what ran (all of it passed) and what did not; tests still to start when pytest's share ends are skipped
with a BUDGET reason (tests/conftest.py). BUDGET is not PASS, but no failure either.
Results: $V2GUEST_OUT/steps.json (and junit.xml, pytest.log, *.json of each step). Exit 0 only when every
step passed or was cut by the budget. Standard library only: it runs before anything is known about the guest.
"""
from __future__ import annotations

import argparse
import json
import os
import pwd
import resource
import shlex
import subprocess
import sys
import tempfile
import time
from contextlib import suppress

OUT = os.environ.get("V2GUEST_OUT", "/tmp")
STEPS: list[dict] = []
DEADLINE = float("inf")  # --budget: CLOCK_MONOTONIC second by which the last step must have ended
# what the steps after pytest take at most on a slow machine of this kind (measured at most 52 s and 154 s)
ISOLATION_S, BLACKOUT_RUN_S = 75, 180

# a busy loop that counts only its own CPU time (an emulated CPU spends more than that starting Python)
BUSY = ("import time\nc0, t0 = time.process_time(), time.monotonic()\n"
        "while time.process_time() - c0 < {cpu}: pass\nprint(time.monotonic() - t0)\n")
HOG = "b = bytearray(200 << 20)\nprint('allocated')\n"


def uptime() -> float:
    with open("/proc/uptime") as f:
        return float(f.read().split()[0])


def step(name: str, status: str, seconds: float, detail: str) -> dict:
    s = {"step": name, "status": status, "seconds": round(seconds, 1), "detail": detail}
    STEPS.append(s)
    print(f"=== v2lane step {name}: {status} in {s['seconds']} s: {detail}", flush=True)
    with open(os.path.join(OUT, "steps.json"), "w") as f:
        json.dump({"steps": STEPS, "facts": FACTS}, f, indent=1)
    return s


def left() -> float:
    """Seconds of --budget left (inf without one)."""
    return DEADLINE - time.monotonic()


def cut(name: str, detail: str) -> None:
    step(name, "BUDGET", 0, f"not run: {left():.0f} s of the time budget left; {detail}")


class Who:
    """root, or a normal user with a user session: how to run a command as them."""

    def __init__(self, name: str | None = None):
        self.name = name
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("AGNSUP_")}
        if name:
            pw = pwd.getpwnam(name)
            self.uid, self.home = pw.pw_uid, pw.pw_dir
            self.env.update(HOME=pw.pw_dir, USER=name, LOGNAME=name, XDG_RUNTIME_DIR=f"/run/user/{pw.pw_uid}",
                            DBUS_SESSION_BUS_ADDRESS=f"unix:path=/run/user/{pw.pw_uid}/bus")
            self.env.pop("XDG_STATE_HOME", None)
        else:
            self.uid, self.home = 0, "/root"
        self.label = name or "root"

    def argv(self, argv: list[str]) -> list[str]:
        return ["runuser", "-u", self.name, "--", *argv] if self.name else argv

    def run(self, argv, timeout=600, env=None, **kw) -> subprocess.CompletedProcess:
        e = {**self.env, **(env or {})}
        return subprocess.run(self.argv(argv), env=e, capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL, **kw)

    def popen(self, argv, env=None, **kw) -> subprocess.Popen:
        return subprocess.Popen(self.argv(argv), env={**self.env, **(env or {})}, stdin=subprocess.DEVNULL, **kw)


def last_line(cp) -> str:
    text = (cp.stderr or "").strip() or (cp.stdout or "").strip()
    return text.splitlines()[-1][:300] if text else f"exit {cp.returncode}, no output"


def json_of(cp):
    try:
        return json.loads(cp.stdout)
    except ValueError:
        return None


def save(name: str, cp) -> None:
    with open(os.path.join(OUT, name), "w") as f:
        f.write(cp.stdout or "")
        if cp.stderr:
            f.write("\n--- stderr\n" + cp.stderr)


# ----------------------------------------------------------------------------------------------- the steps

def s_doctor(agnsup: str, who: Who, tag: str) -> dict | None:
    t = uptime()
    cp = who.run([agnsup, "doctor", "--json"], timeout=300)
    save(f"doctor-{tag}.json", cp)
    rep = json_of(cp)
    if rep is None:
        step(f"doctor[{tag}]", "FAIL", uptime() - t, f"no JSON: {last_line(cp)}")
        return None
    cg = rep.get("cgroup", {})
    detail = (f"layout {cg.get('layout')}, v2 controllers {' '.join(cg.get('v2_controllers') or []) or '-'},"
              f" agnsup root {cg.get('agnsup_root', {}).get('v2', '-')}, does without {rep.get('does_without')}")
    ok = cp.returncode == 0 and cg.get("layout") == "v2"
    step(f"doctor[{tag}]", "PASS" if ok else "FAIL", uptime() - t, detail)
    return rep


def s_pytest(venv: str, src: str, args: list[str], reserve: float) -> None:
    """`reserve`: seconds of the budget kept for the steps after pytest."""
    t = uptime()
    env = {**os.environ, "V2LANE_DEADLINE_MONO": str(DEADLINE - reserve)}
    with open(os.path.join(OUT, "pytest.log"), "w") as log:
        rc = subprocess.call([f"{venv}/bin/python", "-m", "pytest", f"--junitxml={OUT}/junit.xml",
                              "--durations=0", *args], cwd=src, stdout=log, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, env=env)
    counts, failed, cut_short = junit_counts(os.path.join(OUT, "junit.xml"))
    detail = counts + (f"; failed: {', '.join(failed)}" if failed else "") + (
        f"; {cut_short} not run (time budget)" if cut_short else "")
    step("pytest", "FAIL" if rc else "BUDGET" if cut_short else "PASS", uptime() - t, detail)


def junit_counts(path: str) -> tuple[str, list[str], int]:
    import xml.etree.ElementTree as ET
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return "no junit.xml", [], 0
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    n = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failed = [f"{tc.get('classname')}::{tc.get('name')}" for tc in root.iter("testcase")
              if tc.find("failure") is not None or tc.find("error") is not None]
    cut_short = sum((sk.get("message") or "").startswith("BUDGET") for sk in root.iter("skipped"))
    passed = n["tests"] - n["failures"] - n["errors"] - n["skipped"]
    return (f"{passed} passed, {n['failures']} failed, {n['errors']} errors, {n['skipped']} skipped",
            failed, cut_short)


def give_lo_a_host_address(addr: str = "192.0.2.1/32") -> None:
    """This guest has no network device, so no address but loopback; a user's host has one, and the
    doors about the host's own addresses (the proxy must refuse them: PROXY_HOST_ADDRESS) need one to be
    exercised rather than ENV_BLOCKED. A TEST-NET-1 address on the guest's lo: inside this VM only."""
    ip = "/usr/sbin/ip" if os.path.exists("/usr/sbin/ip") else "/sbin/ip"
    subprocess.run([ip, "addr", "add", addr, "dev", "lo"], capture_output=True)
    print(f"=== v2lane guest: lo also has {addr} (an address beyond loopback for the host-address doors)", flush=True)


def selftest_scratch(path: str = "/var/tmp/agnsup-selftest-scratch") -> str:
    """A tmpfs for the isolation selftest's scratch root: this guest's /var/tmp is the host's disk over 9p
    under an overlay, which refuses id-mapped mounts (a root controller's cells would run as host root,
    the ROOT_ONLY_FILES door ENV_BLOCKED); a user's disk (ext4, xfs, btrfs) or tmpfs allows them."""
    if not os.path.ismount(path):
        os.makedirs(path, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=0755,size=256m", "tmpfs", path], check=True)
    return path


def s_isolation(agnsup: str, who: Who, tag: str, cell_uid: int | None = None) -> None:
    if left() < ISOLATION_S:
        return cut(f"isolation[{tag}]", f"it takes up to {ISOLATION_S} s")
    t = uptime()
    extra = ["--user", str(cell_uid)] if cell_uid is not None else []
    cp = who.run([agnsup, "selftest", "--isolation", *extra, "--json"], timeout=900,
                 env={"AGNSUP_SELFTEST_DIR": selftest_scratch()})
    save(f"isolation-{tag}.json", cp)
    rep = json_of(cp)
    if rep is None:
        step(f"isolation[{tag}]", "FAIL", uptime() - t, f"no JSON: {last_line(cp)}")
        return
    doors = rep.get("doors", [])
    bad = [f"{g['gate']}={g['status']}" for g in rep["gates"] if g["status"] != "PASS"]
    bad += [f"{d['door']}={d['status']}" for d in doors if d["status"] != "HELD"]
    status = "PASS" if cp.returncode == 0 and rep.get("ok") and not bad else (
        "ENV_BLOCKED" if bad and all("ENV_BLOCKED" in b for b in bad) else "FAIL")
    good = sum(g["status"] == "PASS" for g in rep["gates"])
    held = sum(d["status"] == "HELD" for d in doors)
    step(f"isolation[{tag}]", status, uptime() - t, f"{good}/{len(rep['gates'])} gates PASS, {held}/{len(doors)} "
         "doors HELD" + (f"; {' '.join(bad)}" if bad else ""))


def s_blackout(agnsup: str, who: Who, tag: str, runs: int, seed: int) -> None:
    asked = runs
    if DEADLINE < float("inf"):  # (inf // 180 is nan)
        runs = min(runs, int(left() // BLACKOUT_RUN_S))
    if runs < 1:
        return cut(f"blackout[{tag}]", f"a run takes up to {BLACKOUT_RUN_S} s")
    t = uptime()
    cp = who.run([agnsup, "selftest", "--runs", str(runs), "--seed", str(seed), "--json"], timeout=600 + 300 * runs)
    save(f"blackout-{tag}.json", cp)
    rep = json_of(cp)
    if rep is None:
        step(f"blackout[{tag}]", "FAIL", uptime() - t, f"no JSON: {last_line(cp)}")
        return
    res = rep.get("results", [])
    per = []
    for r in res:
        bad = [f"{g}={v['status']}" for g, v in r.get("gates", {}).items() if v["status"] != "PASS"]
        per.append(f"seed {r.get('seed')} {r.get('status')} {r.get('seconds', 0):.0f}s" + (f" ({' '.join(bad)})" if bad else ""))
    # a run whose only non-PASS gates are ENV_BLOCKED (e.g. the PID-reuse trap as a normal user) failed nothing
    blocked = [r for r in res if r.get("status") == "ENV_BLOCKED" or (
        not r.get("error") and r.get("gates") and
        all(v["status"] == "PASS" or v["status"].startswith("ENV_BLOCKED") for v in r["gates"].values()))]
    status = "PASS" if cp.returncode == 0 and rep.get("status") == "PASS" else (
        "ENV_BLOCKED" if res and len(blocked) == len(res) else "FAIL")
    if status == "PASS" and runs < asked:
        status, per = "BUDGET", [*per, f"{asked - runs} of {asked} runs not run (time budget)"]
    step(f"blackout[{tag}]", status, uptime() - t, "; ".join(per) or last_line(cp))


def _role(policy_dir: str, name: str, limits: dict) -> None:
    """A copy of the packaged executor role with some [limits] keys replaced."""
    import re
    src = open(os.path.join(SRC, "agnsup", "policies", "executor.toml")).read().replace('name = "executor"', f'name = "{name}"')
    for key, value in limits.items():
        src, n = re.subn(rf"(?m)^{key} = .*$", f"{key} = {value}", src)
        if not n:
            src = src.replace("[limits]\n", f"[limits]\n{key} = {value}\n", 1)
    with open(os.path.join(policy_dir, f"{name}.toml"), "w") as f:
        f.write(src)


def _scratch(who: Who, prefix: str) -> str:
    d = tempfile.mkdtemp(prefix=prefix, dir="/var/tmp")
    os.chown(d, who.uid, -1)
    return d


def _cell(agnsup, who, env, wt, role, argv, timeout=600):
    rfile = os.path.join(wt, f"receipt-{role}.json")
    cp = who.run([agnsup, "run", "--role", role, "--receipt", rfile, "--workdir", wt, "--", *argv],
                 env=env, timeout=timeout)
    try:
        with open(rfile) as f:
            return cp, json.load(f)
    except (OSError, ValueError):
        return cp, None


def _unit_of(cgroup_dir: str, who: Who) -> tuple[str | None, str]:
    """The systemd unit whose cgroup holds `cgroup_dir`, and its Delegate= setting."""
    rel = cgroup_dir[len("/sys/fs/cgroup"):]
    parts = [p for p in rel.split("/") if p]
    for i in range(len(parts), 0, -1):
        if parts[i - 1].endswith((".service", ".scope")):
            unit = parts[i - 1]
            user_side = who.name and any(p.startswith("user@") for p in parts[:i - 1])
            cmd = ["systemctl", *(["--user"] if user_side else []), "show", "-p", "Delegate", "--value", unit]
            cp = who.run(cmd, timeout=60) if user_side else subprocess.run(cmd, capture_output=True, text=True)
            return unit, cp.stdout.strip()
    return None, ""


def s_cells(agnsup: str, who: Who, tag: str) -> None:
    """Where the cell's cgroup lives, and whether cpu.max / memory.max are in force (or named as not)."""
    state = _scratch(who, f"v2lane-state-{tag}.")
    wt = _scratch(who, f"v2lane-wt-{tag}.")
    pol = _scratch(who, f"v2lane-pol-{tag}.")
    _role(pol, "half", {"cpu_max": "0.5"})
    _role(pol, "small", {"memory_max": '"64M"'})
    env = {"AGNSUP_STATE_DIR": state, "AGNSUP_POLICY_DIR": pol}

    t = uptime()
    cp, r = _cell(agnsup, who, env, wt, "executor", ["cat", "/proc/self/cgroup"], timeout=300)
    if r is None or cp.returncode != 0:
        step(f"run[{tag}]", "FAIL", uptime() - t, f"`agnsup run -- cat /proc/self/cgroup`: {last_line(cp)}")
        for name in ("unit", "cpu_max", "memory_max", "cancel"):
            step(f"{name}[{tag}]", "FAIL", 0, "not reached: no cell starts here")
        return
    step(f"run[{tag}]", "PASS", uptime() - t, f"cell cgroup {cp.stdout.strip().splitlines()[-1]}, "
         f"tracking {r['isolation'].get('tracking')}, env_blocked {r['isolation'].get('env_blocked')}")

    v2 = (r.get("cgroup") or {}).get("v2")  # the unit is looked at while a cell lives (cancel, below):
    # agnsup's transient scope is collected by systemd once nothing is left in it

    t = uptime()
    cp, r = _cell(agnsup, who, env, wt, "half", ["python3", "-c", BUSY.format(cpu=1.0)])
    try:
        wall = float(cp.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        wall = None
    if r is None or wall is None:
        step(f"cpu_max[{tag}]", "FAIL", uptime() - t, f"the busy cell did not run: {last_line(cp)}")
    else:
        applied = r["limits"].get("applied", {}).get("cpu")
        named = [n for n in r["isolation"].get("not_in_force", []) if "cpu" in str(n)]
        held = wall >= 2.0 * 0.8  # 1 s of CPU at 50 % of a CPU takes 2 s of wall time at least
        what = (f"1 s of CPU took {wall:.2f} s at cpu_max 0.5; applied {applied or '-'}, "
                f"throttled {r['usage'].get('cpu_nr_throttled')}, limits_hit {r['limits_hit']}, not_in_force {named}")
        if held and applied:
            status = "PASS"
        elif not held and named:
            status = "ENV_BLOCKED"  # named honestly: not in force, and the receipt says so
        elif applied and not held:
            status, what = "FAIL", "reported as applied but not in force: " + what
        else:
            status, what = "FAIL", "silently dropped: " + what
        step(f"cpu_max[{tag}]", status, uptime() - t, what)

    t = uptime()
    cp, r = _cell(agnsup, who, env, wt, "small", ["python3", "-c", HOG])
    if r is None:
        step(f"memory_max[{tag}]", "FAIL", uptime() - t, f"the hog did not run: {last_line(cp)}")
    else:
        ok = r.get("reason") == "oom" and "allocated" not in cp.stdout
        step(f"memory_max[{tag}]", "PASS" if ok else "FAIL", uptime() - t,
             f"200 MB in a 64M cell: reason {r.get('reason')}, exit {r.get('exit_code')}, limits_hit {r['limits_hit']}")

    t = uptime()
    ctl = who.popen([agnsup, "run", "--cell", "k1", "--workdir", wt, "--", "sleep", "300"], env=env,
                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    detail, status = "", "FAIL"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and ctl.poll() is None:
            ps = json_of(who.run([agnsup, "ps", "--json"], env=env, timeout=120)) or []
            if any(c.get("cell_id") == "k1" and c.get("state") == "running" for c in ps):
                break
            time.sleep(0.2)
        t_unit = uptime()
        pids = subprocess.run(["pgrep", "-u", str(who.uid), "-f", "^sleep 300"], capture_output=True,
                              text=True).stdout.split()
        try:
            with open(f"/proc/{pids[0]}/cgroup") as f:
                live = "/sys/fs/cgroup" + next(x for x in f.read().splitlines() if x.startswith("0::"))[3:]
        except (IndexError, OSError, StopIteration):
            live = None
        unit, delegate = _unit_of(live, who) if live else (None, "")
        if live is None:
            step(f"unit[{tag}]", "FAIL", uptime() - t_unit, f"no live cell to look at (first cell's cgroup {v2})")
        elif unit is None:
            step(f"unit[{tag}]", "FAIL", uptime() - t_unit, f"{live} is beside systemd's slices, in no unit of its own")
        else:
            step(f"unit[{tag}]", "PASS" if delegate == "yes" else "FAIL", uptime() - t_unit,
                 f"{live} is in {unit} (Delegate={delegate or '?'})")
        cc = who.run([agnsup, "cancel", "--cell", "k1", "--grace", "0", "--json"], env=env, timeout=300)
        rc = ctl.wait(120)
        rec = json_of(who.run([agnsup, "receipts", "--json"], env=env, timeout=120)) or []
        k1 = next((x for x in rec if x.get("cell_id") == "k1"), {})
        left = subprocess.run(["pgrep", "-u", str(who.uid), "-f", "sleep 300"], capture_output=True, text=True).stdout.split()
        ok = cc.returncode == 0 and k1.get("state") == "cancelled" and not left
        status = "PASS" if ok else "FAIL"
        detail = (f"cancel exit {cc.returncode} ({(json_of(cc) or {}).get('cancelled')} cancelled), controller exit {rc},"
                  f" receipt state {k1.get('state')}, sleep left {left or 'none'}")
    except subprocess.TimeoutExpired as e:
        detail = f"timed out: {e}"
    finally:
        if ctl.poll() is None:
            ctl.kill()  # our own controller
            ctl.wait()
    step(f"cancel[{tag}]", status, uptime() - t, detail)
    who.run([agnsup, "cleanup", "--run", "default"], env=env, timeout=300)


# ----------------------------------------------------------------------------------------- the user session

def make_user(venv: str) -> Who:
    uid = 4242
    while True:
        try:
            pwd.getpwuid(uid)
        except KeyError:
            try:
                pwd.getpwnam(f"v2l{uid}")
            except KeyError:
                break
        uid += 1
    name = f"v2l{uid}"
    subprocess.run(["useradd", "-m", "-u", str(uid), "-U", "-s", "/bin/bash", name], check=True)
    # the interpreter and the tree may sit under a root-only home: o+x on their directories (guest overlay only)
    for p in (os.path.realpath(f"{venv}/bin/python"), venv, SRC):
        d = p if os.path.isdir(p) else os.path.dirname(p)
        while d != "/":
            mode = os.stat(d).st_mode
            if not mode & 0o001:
                os.chmod(d, mode | 0o001)
            d = os.path.dirname(d)
    return Who(name)


def start_session(who: Who) -> str:
    t = uptime()
    cp = subprocess.run(["systemctl", "start", f"user@{who.uid}.service"], capture_output=True, text=True, timeout=120)
    u = f"/sys/fs/cgroup/user.slice/user-{who.uid}.slice/user@{who.uid}.service"
    try:
        owner = pwd.getpwuid(os.stat(u).st_uid).pw_name
        ctrls = open(f"{u}/cgroup.controllers").read().strip()
    except OSError as e:
        owner, ctrls = "?", str(e)
    ok = cp.returncode == 0 and owner == who.name
    step("user_session", "PASS" if ok else "FAIL", uptime() - t,
         f"user@{who.uid}.service: {last_line(cp) if cp.returncode else 'active'}; {u} owned by {owner}, controllers [{ctrls}]")
    return u


def s_unshare(who: Who) -> None:
    t = uptime()
    cp = who.run(["unshare", "-Urm", "--", "sh", "-c", "id -u; cat /proc/self/uid_map"], timeout=60)
    ok = cp.returncode == 0 and cp.stdout.split()[:1] == ["0"]
    step("userns[user]", "PASS" if ok else "FAIL", uptime() - t,
         f"unshare -Urm as {who.name}: " + (" ".join(cp.stdout.split()) if ok else last_line(cp)))


SCOPE_PROBE = r"""
import json, os, subprocess, sys
rel = open("/proc/self/cgroup").read().split("::")[1].strip()
d = "/sys/fs/cgroup" + rel
own = {f: os.stat(os.path.join(d, f)).st_uid == os.getuid() for f in ("", "cgroup.procs", "cgroup.subtree_control", "cgroup.threads")}
cp = subprocess.run([sys.argv[1], "doctor", "--json"], capture_output=True, text=True,
                    env={**os.environ, "AGNSUP_CGROUP_BASE": rel})
try:
    layout = json.loads(cp.stdout)["cgroup"]["layout"]
except (ValueError, KeyError):
    layout = "no JSON: " + (cp.stderr.strip().splitlines() or ["?"])[-1]
print(json.dumps({"cgroup": rel, "owned": all(own.values()), "controllers": open(d + "/cgroup.controllers").read().split(),
                  "doctor_layout_with_base": layout}))
"""


def s_scope(agnsup: str, venv: str, who: Who, tag: str) -> None:
    """A transient scope with Delegate=yes, as phase B would ask systemd for one: its cost, what it
    gives, and what doctor says with AGNSUP_CGROUP_BASE naming it."""
    user = ["--user"] if who.name else []
    run = ["systemd-run", *user, "--scope", "--quiet", "--collect", "-p", "Delegate=yes", "--"]
    costs = []
    for _ in range(3):
        t0 = time.monotonic()
        cp = who.run([*run, "/bin/true"], timeout=120)
        costs.append(time.monotonic() - t0)
    t = uptime()
    cp = who.run([*run, f"{venv}/bin/python", "-c", SCOPE_PROBE, agnsup], timeout=300)
    got = json_of(cp)
    cost = sorted(costs)[1]
    if got is None:
        step(f"scope[{tag}]", "FAIL", uptime() - t, f"systemd-run {' '.join(user)} --scope -p Delegate=yes: {last_line(cp)}")
        return
    step(f"scope[{tag}]", "PASS" if got["owned"] else "FAIL", uptime() - t,
         f"systemd-run {' '.join(user)} --scope -p Delegate=yes /bin/true: {cost * 1000:.0f} ms (median of 3);"
         f" {got['cgroup']} owned: {got['owned']}, controllers [{' '.join(got['controllers'])}]")
    ok = got["doctor_layout_with_base"] == "v2"
    step(f"doctor_in_scope[{tag}]", "PASS" if ok else "FAIL", 0,
         f"AGNSUP_CGROUP_BASE={got['cgroup']} agnsup doctor: layout {got['doctor_layout_with_base']}")


# ------------------------------------------------------------------------------------------------ the pod

POD = "/tmp/v2lane-pod"        # containerd's root, state, socket and the pod's volumes: a tmpfs in guest memory
POD_ID = "agnsup-pod"
# cgroupfs-driver kubelet layout: /kubepods/<qos>/pod<uid>/<container>
POD_CGROUP = f"/kubepods/burstable/pod-v2lane/{POD_ID}"
POD_MEMORY = 1 << 30           # the container's memory limit (a pod's resources.limits.memory)
POD_S = 600                    # what the step takes at most here: import ~140 s, the probe's checks, the variants
# the recipe as a node runs it: containerd's default seccomp profile (Kubernetes' RuntimeDefault), the added
# capabilities, a private cgroup namespace and the cgroup2 mount read-only as the CRI plugin mounts it (the
# entrypoint remounts it read-write: CAP_SYS_ADMIN over the container's own cgroup namespace), the pod's own
# network namespace with only lo (no CNI here), an emptyDir-like volume for the state root and the workspace.
POD_NETNS = "v2lane-pod"       # the pod's network namespace, made as a CNI plugin would: lo up and an address
POD_FLAGS = ["--with-ns", "cgroup:", "--seccomp",
             "--mount", "type=cgroup,src=cgroup,dst=/sys/fs/cgroup,options=ro:nosuid:nodev:noexec"]


def ctr(*argv, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run(["ctr", "-a", f"{POD}/containerd.sock", *argv], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def _pod_engine(image: str) -> tuple[subprocess.Popen | None, str | None]:
    """containerd of its own (root, state, socket under POD), the image imported: (containerd, image ref)."""
    t = uptime()
    os.makedirs(POD, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=0700,size=3g", "tmpfs", POD], check=True)
    with open(f"{POD}/hosts", "w") as f:
        f.write("127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n")
    with open(f"{POD}/config.toml", "w") as f:
        f.write(f'version = 2\nroot = "{POD}/root"\nstate = "{POD}/state"\n'
                # the CRI plugin is the kubelet's door; ctr talks to containerd's own API
                'disabled_plugins = ["io.containerd.grpc.v1.cri"]\n'
                f'[grpc]\n  address = "{POD}/containerd.sock"\n[ttrpc]\n  address = "{POD}/containerd.sock.ttrpc"\n')
    log = open(f"{POD}/containerd.log", "w")
    cd = subprocess.Popen(["containerd", "--config", f"{POD}/config.toml"], stdout=log, stderr=subprocess.STDOUT,
                          stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and cd.poll() is None and not os.path.exists(f"{POD}/containerd.sock"):
        time.sleep(0.2)
    v = ctr("version", timeout=120)
    if v.returncode != 0:
        step("engine[pod]", "FAIL", uptime() - t, f"containerd did not answer: {last_line(v)} (log {POD}/containerd.log)")
        return cd, None
    up = uptime() - t
    t1 = uptime()
    imp = ctr("images", "import", image, timeout=1200)
    ref = ctr("images", "ls", "-q").stdout.split()
    ref = next((r for r in ref if "agnsup" in r), ref[0] if ref else None)
    if imp.returncode != 0 or not ref:
        step("engine[pod]", "FAIL", uptime() - t, f"ctr images import {image}: {last_line(imp)}")
        return cd, None
    runc = subprocess.run(["runc", "--version"], capture_output=True, text=True).stdout.split("\n")[0]
    server = next((x.split()[-1] for x in v.stdout.splitlines() if "Version:" in x), "?")
    step("engine[pod]", "PASS", uptime() - t,
         f"containerd {server} up in {up:.1f} s, {runc}; {ref} imported and unpacked in {uptime() - t1:.1f} s "
         f"from {image} ({os.path.getsize(image) >> 20} MB)")
    return cd, ref


def _pod_netns() -> str:
    """The pod's network namespace as a CNI plugin leaves it: lo up, and an address that is not loopback's
    (TEST-NET-2, in guest memory only), so that the door about the host's own addresses is exercised."""
    ip = "/usr/sbin/ip" if os.path.exists("/usr/sbin/ip") else "/sbin/ip"
    for argv in (["netns", "add", POD_NETNS], ["-n", POD_NETNS, "link", "set", "lo", "up"],
                 ["-n", POD_NETNS, "addr", "add", "198.51.100.7/32", "dev", "lo"]):
        subprocess.run([ip, *argv], check=True, capture_output=True)
    return f"/run/netns/{POD_NETNS}"


def _pod_argv(ref: str, cid: str, caps: list[str], volumes: dict[str, str], env: dict[str, str], argv: list[str],
              netns: str = ""):
    out = ["run", "--rm", *POD_FLAGS, *(["--with-ns", f"network:{netns}"] if netns else []), "--cgroup", POD_CGROUP.replace(POD_ID, cid),
           "--memory-limit", str(POD_MEMORY)]
    for c in caps:
        out += ["--cap-add", f"CAP_{c}"]
    for dst, src in volumes.items():
        out += ["--mount", f"type=bind,src={src},dst={dst},options=rbind:rw"]
    for k, v in env.items():
        out += ["--env", f"{k}={v}"]
    # the kubelet writes each container's /etc/hosts (localhost); ctr does not, and this image has none
    out += ["--mount", f"type=bind,src={POD}/hosts,dst=/etc/hosts,options=rbind:ro"]
    # ctr's COMMAND replaces the image's ENTRYPOINT too (a pod's `command:`): name the entrypoint
    return [*out, ref, cid, "/usr/local/bin/agnsup-entrypoint", *argv]


def _volumes(tag: str) -> dict[str, str]:
    vols = {}
    for dst in ("/var/lib/agnsup", "/workspace", "/var/tmp/agnsup-selftest"):  # emptyDir-like: the node's tmpfs, not the image's overlayfs
        src = f"{POD}/vol-{tag}{dst.replace('/', '-')}"
        os.makedirs(src, exist_ok=True)
        vols[dst] = src
    return vols


def _node_view(xchg: str, results: dict) -> None:
    """From the node: while the probe's k1 cell lives, where its process is in the node's cgroup tree."""
    import threading

    def watch():
        deadline = time.monotonic() + POD_S
        while time.monotonic() < deadline and not os.path.exists(f"{xchg}/k1.pid"):
            time.sleep(0.2)
        try:
            pids = [p for p in os.listdir("/proc") if p.isdigit() and
                    open(f"/proc/{p}/cmdline", "rb").read() == b"sleep\x003217\x00"]
            node = open(f"/proc/{pids[0]}/cgroup").read().strip()[3:] if pids else None
        except OSError as e:
            node = None
            results["error"] = str(e)
        results["node"] = node
        if node:
            d = "/sys/fs/cgroup" + node
            results["cell_memory_max"] = open(f"{d}/memory.max").read().strip() if os.path.exists(f"{d}/memory.max") else "-"
            c = "/sys/fs/cgroup" + POD_CGROUP
            results["container_memory_max"] = open(f"{c}/memory.max").read().strip()
        open(f"{xchg}/k1.seen", "w").close()

    th = threading.Thread(target=watch, daemon=True)
    th.start()
    results["thread"] = th


def _pod_probe(ref: str, caps: list[str], isolation: bool) -> None:
    xchg = f"{POD}/xchg"
    os.makedirs(f"{xchg}/policies", exist_ok=True)
    import shutil
    shutil.copy(os.path.join(SRC, "scripts", "v2lane_pod_probe.py"), xchg)
    _role(f"{xchg}/policies", "small", {"memory_max": '"64M"'})
    _role(f"{xchg}/policies", "tight", {"pids_max": "32"})
    seen: dict = {}
    _node_view(xchg, seen)
    argv = _pod_argv(ref, POD_ID, caps, {**_volumes("main"), "/xchg": xchg},
                     {"AGNSUP_POLICY_DIR": "/xchg/policies", "V2LANE_POD_SCRATCH": "/var/tmp/agnsup-selftest"},
                     ["python3", "/xchg/v2lane_pod_probe.py", "--xchg", "/xchg", *(["--isolation"] if isolation else [])],
                     netns=_pod_netns())
    with open(os.path.join(OUT, "pod-ctr-run.txt"), "w") as f:
        f.write(shlex.join(["ctr", "-a", f"{POD}/containerd.sock", *argv]) + "\n")
    t = uptime()
    err = open(os.path.join(OUT, "pod-stderr.txt"), "w")  # the entrypoint's doctor, the container's stderr
    p = subprocess.Popen(["ctr", "-a", f"{POD}/containerd.sock", *argv], stdout=subprocess.PIPE, stderr=err,
                         stdin=subprocess.DEVNULL, text=True)
    import threading
    timer = threading.Timer(POD_S, lambda: ctr("task", "kill", "-s", "SIGKILL", POD_ID))  # a probe that hangs
    timer.start()
    got, pending, done = [], {}, False
    with open(os.path.join(OUT, "pod-probe.jsonl"), "w") as log:
        for line in p.stdout:
            log.write(line)
            log.flush()
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            if "check" in ev:
                pending = ev
                if ev["check"] == "container":
                    step("container[pod]", "PASS", uptime() - t, ev["detail"])
            elif "timing" in ev and pending:
                status = "PASS" if pending["ok"] else "ENV_BLOCKED" if pending["ok"] is None else "FAIL"
                step(f"{pending['check']}[pod]", status, ev["seconds"], pending["detail"])
                got.append(pending["check"])
                pending = {}
            elif ev.get("done"):
                done = True
    rc = p.wait()
    timer.cancel()
    if not done:
        step("probe[pod]", "FAIL", uptime() - t, f"the probe did not finish (ctr run exit {rc}, after {got or 'nothing'});"
             f" the container's stderr: {(open(os.path.join(OUT, 'pod-stderr.txt')).read().strip().splitlines() or ['-'])[-1][:300]}")
    th = seen.pop("thread")
    th.join(5)
    node, inside = seen.get("node"), None
    with suppress(OSError):
        inside = open(f"{xchg}/k1.pid").read().strip()
    # the cell's own cgroup, below the container's and not the entrypoint's leaf; the container sees the same
    # cgroup at the path relative to its namespace's root (the container's cgroup)
    ok = bool(node and inside) and node == POD_CGROUP + inside[3:] and not node.startswith(POD_CGROUP + "/init")
    step("node_view[pod]", "PASS" if ok else "FAIL", 0,
         f"the cell `sleep 3217`: {inside or '-'} in the container, {node or seen.get('error') or 'not found'} on the node"
         f" (the container is {POD_CGROUP}, memory.max {seen.get('container_memory_max', '-')}; the cell's memory.max "
         f"{seen.get('cell_memory_max', '-')})")


# what a node gives without the recipe, measured each run (docs/hosts.md's table): (tag, added capabilities)
# (tag, added capabilities, the role: the shipped `reduced` role opts into what such a container refuses)
POD_VARIANTS = [("sysadmin", ["SYS_ADMIN"], "executor"), ("default", [], "executor"), ("reduced", [], "reduced")]


def _pod_variants(ref: str) -> None:
    """`agnsup run -- true` in containers with fewer capabilities: it runs, or it refuses in one line that names
    the step (exit 125); never a hang or a silent success without its isolation."""
    t = uptime()
    seen, bad = [], []
    for tag, caps, role in POD_VARIANTS:
        cid = f"{POD_ID}-{tag}"
        vols = _volumes(tag)
        # one cell each: the entrypoint's doctor without its probe cells (doctor[pod] proves those)
        argv = _pod_argv(ref, cid, caps, vols, {"AGNSUP_ENTRYPOINT_DOCTOR": "no-probe"},
                         ["agnsup", "run", "--role", role, "--receipt", "/workspace/receipt.json", "--", "true"])
        try:
            cp = subprocess.run(["ctr", "-a", f"{POD}/containerd.sock", *argv], capture_output=True, text=True,
                                timeout=300, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            ctr("task", "kill", "-s", "SIGKILL", cid)
            bad.append(tag)
            seen.append(f"{tag}: timed out")
            continue
        save(f"pod-variant-{tag}.txt", cp)
        lines = [x for x in cp.stderr.splitlines() if not x.startswith(" ") and x.strip()]
        refusal = next((x for x in reversed(lines) if "cell setup failed" in x or "agnsup:" in x), "")
        caps_s = ("+".join(caps) or "no added capabilities") + f", role {role}"
        try:  # the receipt, from the node's side of the pod's volume
            with open(os.path.join(vols["/workspace"], "receipt.json")) as f:
                r = json.load(f)
            without = f" (reduced {r.get('reduced') or []}, not_in_force {r['isolation'].get('not_in_force') or []})"
        except (OSError, ValueError, KeyError):
            without = ""
        if cp.returncode == 0:
            seen.append(f"{caps_s}: runs{without}")
        elif cp.returncode == 125 and refusal:
            seen.append(f"{caps_s}: exit 125, {refusal[:600]}")
        else:
            bad.append(tag)
            seen.append(f"{caps_s}: exit {cp.returncode}, {last_line(cp)}")
    FACTS["pod_variants"] = seen
    step("variants[pod]", "FAIL" if bad else "PASS", uptime() - t, "; ".join(seen))


def s_pod(image: str, caps: list[str], isolation: bool, variants: bool) -> None:
    """The pod's node stack: containerd + runc (`ctr run`, what a Kubernetes node runs) start the agnsup image
    with a private cgroup namespace on this pure cgroup-v2 kernel; inside, through the image's entrypoint,
    scripts/v2lane_pod_probe.py checks doctor, a cell's own cgroup, memory_max, pids_max and cancel (and the
    isolation selftest), while the node looks at the cell's cgroup from outside."""
    if not image or not os.path.exists(image):
        return step("engine[pod]", "ENV_BLOCKED", 0, f"no image tar ({image or 'none given'}): scripts/v2lane --pod-image"
                    " PATH, or `python -m tests.containers save PATH` on the host")
    if left() < POD_S:
        return cut("pod", f"it takes up to {POD_S} s")
    missing = [b for b in ("containerd", "ctr", "runc", "containerd-shim-runc-v2")
               if not any(os.access(os.path.join(d, b), os.X_OK) for d in os.environ["PATH"].split(":"))]
    if missing:
        return step("engine[pod]", "ENV_BLOCKED", 0, f"not installed on the host: {' '.join(missing)} (scripts/test.sh)")
    cd, ref = None, None
    try:
        cd, ref = _pod_engine(image)
        if ref:
            _pod_probe(ref, caps, isolation)
            if variants:
                _pod_variants(ref)
    finally:
        for cid in (POD_ID, *(f"{POD_ID}-{v[0]}" for v in POD_VARIANTS)):
            if cd is not None and cd.poll() is None:
                ctr("task", "kill", "-s", "SIGKILL", cid, timeout=60)
                ctr("task", "rm", "-f", cid, timeout=60)
                ctr("containers", "rm", cid, timeout=60)
        subprocess.run(["ip", "netns", "del", POD_NETNS], capture_output=True)
        if cd is not None and cd.poll() is None:
            cd.terminate()  # our own containerd
            try:
                cd.wait(60)
            except subprocess.TimeoutExpired:
                cd.kill()
                cd.wait()
        for name in ("containerd.log", "xchg/doctor-pod.json", "xchg/isolation-pod.json"):
            if os.path.exists(f"{POD}/{name}"):
                subprocess.run(["cp", f"{POD}/{name}", os.path.join(OUT, "pod-" + os.path.basename(name))])


# ------------------------------------------------------------------------------------------------------ main

FACTS: dict = {}
SRC = ""


def main() -> int:
    global SRC, DEADLINE
    ap = argparse.ArgumentParser()
    ap.add_argument("--venv", required=True)
    ap.add_argument("--src", required=True)
    ap.add_argument("--pytest", default="", help="pytest arguments, one shell-quoted string ('' skips pytest)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--seed", type=int, default=5150)
    ap.add_argument("--isolation-user", type=int, default=65534)
    ap.add_argument("--budget", type=float, default=0, help="seconds every step must end within (0: no bound)")
    ap.add_argument("--pod", default="", metavar="IMAGE_TAR", help="the pod step, with this image (a `docker save`)")
    ap.add_argument("--pod-caps", default="SYS_ADMIN", help="capabilities the pod's container adds")
    ap.add_argument("--pod-only", action="store_true", help="only the pod step")
    a = ap.parse_args()
    SRC = a.src
    if a.budget > 0:
        DEADLINE = time.monotonic() + a.budget
    agnsup = f"{a.venv}/bin/agnsup"
    init = open("/proc/1/comm").read().strip()
    FACTS.update(kernel=os.uname().release, pid1=init, nofile_soft=resource.getrlimit(resource.RLIMIT_NOFILE)[0],
                 cgroup=open("/proc/self/cgroup").read().strip(),
                 root_subtree_control=open("/sys/fs/cgroup/cgroup.subtree_control").read().strip(),
                 cpus=os.cpu_count())
    print(f"=== v2lane guest: {FACTS}", flush=True)
    root = Who()
    os.chdir(a.src)
    give_lo_a_host_address()
    if a.pod_only:
        s_pod(a.pod, [c for c in a.pod_caps.split(",") if c], isolation=True, variants=True)
    elif init != "systemd":
        s_doctor(agnsup, root, "root")
        if a.pytest:
            s_pytest(a.venv, a.src, shlex.split(a.pytest), reserve=2 * ISOLATION_S + BLACKOUT_RUN_S * min(a.runs, 1)
                     + (POD_S if a.pod else 0))
        s_isolation(agnsup, root, "root")
        if a.isolation_user >= 0:
            make_user(a.venv)  # only for the o+x on the interpreter's path; the cells run as the uid given
            s_isolation(agnsup, root, f"uid{a.isolation_user}", a.isolation_user)
        if a.runs:
            s_blackout(agnsup, root, "root", a.runs, a.seed)
        if a.pod:
            s_pod(a.pod, [c for c in a.pod_caps.split(",") if c], isolation=True, variants=True)
    else:
        for who, tag in ((root, "systemd-root"), (None, "user")):
            if who is None:  # a normal user in a session of its own
                who = make_user(a.venv)
                start_session(who)
                s_unshare(who)
            s_doctor(agnsup, who, tag)
            s_scope(agnsup, a.venv, who, tag)
            s_cells(agnsup, who, tag)
            s_isolation(agnsup, who, tag)
            if a.runs:
                s_blackout(agnsup, who, tag, 1, a.seed)
    bad = [s for s in STEPS if s["status"] not in ("PASS", "BUDGET")]
    cut_short = sum(s["status"] == "BUDGET" for s in STEPS)
    print(f"=== v2lane guest: {sum(s['status'] == 'PASS' for s in STEPS)}/{len(STEPS)} steps PASS"
          + (f", {cut_short} cut by the time budget" if cut_short else ""), flush=True)
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
