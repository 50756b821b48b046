"""Probe programs shared by `agnsup selftest --isolation` and tests/test_confinement.py.

Each probe is the text of a small Python program, run inside a real cell as
`python3 -c PROBE ARG...`. It tries one forbidden thing and exits ESCAPED (77)
when the forbidden thing worked, 0 when it was refused (nsjail's convention);
any other exit means it could not try. What it saw goes to stdout, one line a
try. Probes are Python rather than shell text so the governance text gate lets
them through: what they test is what the kernel stops. A path that gate would
refuse on sight is passed in two pieces and joined inside the cell.

MEMORY_HOG and FORK_BOMB are the exception: they never stop by themselves,
and are judged from the receipt (the limit that stopped them, the counters).

The selftest and the tests run the same text, so what CI proves and what a
user's host reports are the same probe.
"""

ESCAPED = 77

# argv: none. prctl(PR_SET_MM) to point the environment at a forged block;
# prints "PR_SET_MM_MAP <ret> <error>" and "ENV_START <ret> <error>".
ENVIRON_FORGE = r'''
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
PR_SET_MM, PR_SET_MM_ENV_START, PR_SET_MM_MAP = 35, 10, 14
forged = ctypes.create_string_buffer(b"AGNSUP_CELL_TOKEN=forged\0")
start = ctypes.addressof(forged)
end = start + len(b"AGNSUP_CELL_TOKEN=forged\0")
f = open("/proc/self/stat").read().rsplit(")", 1)[1].split()
v = lambda n: int(f[n - 3])  # proc(5) numbers the fields from 1; f starts at field 3
class MmMap(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in ("start_code", "end_code", "start_data", "end_data", "start_brk",
                "brk", "start_stack", "arg_start", "arg_end", "env_start", "env_end", "auxv")] + \
               [("auxv_size", ctypes.c_uint32), ("exe_fd", ctypes.c_uint32)]
libc.sbrk.restype = ctypes.c_void_p
m = MmMap(v(26), v(27), v(45), v(46), v(47), libc.sbrk(0), v(28), v(48), v(49), start, end, 0, 0, 0xFFFFFFFF)
r1 = libc.prctl(PR_SET_MM, PR_SET_MM_MAP, ctypes.byref(m), ctypes.sizeof(m), 0)
e1 = ctypes.get_errno()
r2 = libc.prctl(PR_SET_MM, PR_SET_MM_ENV_START, ctypes.c_ulong(start), 0, 0)
e2 = ctypes.get_errno()
env = open("/proc/self/environ", "rb").read()
print("PR_SET_MM_MAP", r1, os.strerror(e1) if r1 else "ok", "ENV_START", r2, os.strerror(e2) if r2 else "ok")
sys.exit(77 if b"forged" in env or r1 == 0 or r2 == 0 else 0)
'''

# argv: none; stdin must be a terminal. TIOCSTI and TIOCLINUX on it, after
# making it the controlling terminal; prints "<ioctl> worked" or "<ioctl> <ERRNO>".
# A TIOCSTI refused with anything but EPERM (the filter's answer) counts as
# worked: the filter was not what stopped it, so the probe proved nothing.
TTY_INJECTION = r'''
import errno, fcntl, sys, termios
TIOCLINUX = 0x541C
try:
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)  # make the pty our controlling terminal, as a session leader may
except OSError as e:
    print("TIOCSCTTY", e.strerror)
worked = []
for name, req, arg in (("TIOCSTI", termios.TIOCSTI, b"x"), ("TIOCLINUX", TIOCLINUX, bytes([0]))):
    try:
        fcntl.ioctl(0, req, arg)
        worked.append(name)
        print(name, "worked")
    except OSError as e:
        print(name, errno.errorcode[e.errno])
        if name == "TIOCSTI" and e.errno != errno.EPERM:
            worked.append(name + " (not refused by the filter: " + errno.errorcode[e.errno] + ")")
sys.exit(77 if worked else 0)
'''

# argv: PID:SIGNAL pairs; PID "ppid" is the cell's parent (the controller or
# its PID-namespace init); a pid named twice is tried once. Signal 0 asks the
# kernel whether we may signal and delivers nothing. Prints "signalled <pid>"
# or "refused <pid> <error>".
CONTROLLER_SIGNAL = r'''
import os, sys
worked, tried = [], set()
for arg in sys.argv[1:]:
    who, sig = arg.split(":")
    pid = os.getppid() if who == "ppid" else int(who)
    if pid in tried:
        continue  # the parent may be the pid given as well
    tried.add(pid)
    try:
        os.kill(pid, int(sig))
        if pid == 1 and os.getpid() < 1000 and open("/proc/1/cmdline", "rb").read().startswith(b"agnsup"):
            continue  # our own PID-namespace init
        worked.append(pid)
        print("signalled", pid)
    except OSError as e:
        print("refused", pid, e.strerror)
sys.exit(77 if worked else 0)
'''

# argv: none. Writes its pid into every cgroup.procs (and v1 tasks) above its
# own cell: the nearest ancestors (agnsup's own agent, run and root directories)
# first, the hierarchy roots last, and stops at the first one that works.
# Prints "ESCAPED to <file>" or "tried <n> targets; last error: <error>"; exits
# 3 when there was nothing to try.
CGROUP_ESCAPE = r'''
import os, sys
me = str(os.getpid())
targets = []
for line in open("/proc/self/cgroup"):
    _, ctrls, path = line.rstrip("\n").split(":", 2)
    if ctrls == "":
        mnt = "/sys/fs/cgroup/unified" if os.path.isdir("/sys/fs/cgroup/unified") else "/sys/fs/cgroup"
    else:
        ctrl = [c for c in ctrls.split(",") if not c.startswith("name=")]
        if not ctrl:
            continue
        mnt = "/sys/fs/cgroup/" + ctrl[0]
    parts = path.strip("/").split("/")
    for i in range(len(parts) - 1, -1, -1):
        d = os.path.join(mnt, *parts[:i])
        targets += [os.path.join(d, "cgroup.procs"), os.path.join(d, "tasks")]
targets.sort(key=lambda t: -t.count("/"))
tried, last = 0, ""
for t in targets:
    if not os.path.exists(t):
        continue
    tried += 1
    try:
        with open(t, "w") as f:
            f.write(me)
        print("ESCAPED to", t)
        sys.exit(77)
    except OSError as e:
        last = e.strerror
print("tried", tried, "targets; last error:", last)
sys.exit(0 if tried else 3)
'''

# argv: files to create and write. Prints "WROTE <path>" or "refused <path> <error>".
WRITE_ESCAPE = r'''
import sys
worked = []
for p in sys.argv[1:]:
    try:
        with open(p, "w") as f:
            f.write("escaped")
        worked.append(p)
        print("WROTE", p)
    except OSError as e:
        print("refused", p, e.strerror)
sys.exit(77 if worked else 0)
'''

# argv: the state root in two pieces (joined here). Lists it and opens
# journal.db and a new file agnsup-probe in it for writing: straight, through
# the controller's root and through init's root; and lists the controller's
# working directory. Prints what worked and what was refused.
STATE_ROOT = r'''
import os, sys
state = sys.argv[1] + sys.argv[2]
ppid = os.getppid()
worked = []
for d in (state, f"/proc/{ppid}/root" + state, "/proc/1/root" + state, f"/proc/{ppid}/cwd"):
    try:
        names = os.listdir(d)
        if names:
            worked.append(f"listed {d}: {names[:5]}")
    except OSError as e:
        print("refused listing", d, e.strerror)
    if d.endswith("/cwd"):
        continue
    for name in ("journal.db", "agnsup-probe"):
        try:
            with open(d + "/" + name, "ab"):
                worked.append(f"opened {d}/{name} for writing")
        except OSError as e:
            print("refused", d + "/" + name, e.strerror)
for w in worked:
    print(w)
sys.exit(77 if worked else 0)
'''

# argv: none. Allocates 4 MiB at a time until the memory limit stops it.
MEMORY_HOG = "a = []\nwhile True:\n    a.append(b'\\x01' * (4 << 20))\n"

# argv: none; run from a file (the governance text gate refuses a fork loop on a
# command line). Every process forks as fast as the kernel lets it, backing off
# a little after a refused fork (the machine is shared).
FORK_BOMB = (
    "import os, time\n"
    "while True:\n"
    "    try:\n"
    "        os.fork()\n"
    "    except OSError:\n"
    "        time.sleep(0.02)\n"
)
