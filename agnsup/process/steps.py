"""The cell leader's setup between fork and execve: STEPS, a table of named steps run in order by `child`.

Each step reads the Setup the controller built before fork (the seccomp filter and the Landlock ruleset
are built there, so the child only makes a few system calls) and does nothing where the plan does not ask
for it. Everything the child needs is imported here, before fork: after the mount namespace is built the
package itself may be hidden (installed under /tmp or a masked path), so the child imports nothing.

Any failure before execve is written to a close-on-exec pipe as "step\\0errno\\0message" and the child exits
without running the command: a half-built cell never runs the payload. EOF on that pipe means execve worked.
If the controller dies while the child waits at the barrier, the child sees EOF there and exits instead of
running unrecorded.
"""
from __future__ import annotations

import errno
import fcntl
import os
import select
import signal
import termios

import _signal

from ..util import crashpoints
from ..linux import landlock, mounts, netns, pidinit, proc, userns
from ..linux import sys as lsys
from ..util.record import Record

_MAXFD = os.sysconf("SC_OPEN_MAX")

# What of the plan (plan.ExecutionPlan) and of its spec the steps read: all a fork server is sent of them
# (forkserver.pack; a plan pickled whole is ~5.7 KB of a ~7.3 KB request, ~3x the objects to unpickle)
PLAN_FIELDS = ("mount_namespace", "new_netns", "pid_namespace", "dies_with_controller", "mount_ops", "devices",
               "drop_caps", "cap_keep", "uid", "gid", "no_new_privs", "spec")
SPEC_FIELDS = ("exe", "argv", "env", "workdir")
_PROC_FLAGS = lsys.MS_NOSUID | lsys.MS_NODEV | lsys.MS_NOEXEC


class Setup(Record):
    """Built in the controller before fork (spawn); used by the child."""
    plan: object = None
    backend: object = None
    place: object = None
    ruleset: object = None   # landlock.Ruleset
    filter: object = None    # seccomp.Filter
    ids: tuple | None = None # (uid, gid) outside: a user namespace of the cell's own maps them to themselves
    userns_fd: int | None = None  # a mapped cell: the cells' user namespace (cell_userns), kept by the controller
    premade: dict | None = None   # {mount key: detached mount fd} the controller made (the /tmp tmpfs)
    egress: object = None    # egress.handoff.Handoff: the socketpair the proxy listener comes back on
    init_name: tuple = ()    # PID namespace: pidinit.own_name_plan(), where the init overwrites its argv
    netns_fd: int | None = None  # a root controller without CAP_NET_ADMIN: the cell's netns (cell_netns); a pod's
    pod_userns: int | None = None  # a normal user's cell of a pod: the pod's user namespace, joined, not made
    netns_watch: int | None = None  # deny/loopback: our end of the pair the cell's netns goes to the controller on
    netns_shared: bool = False   # ... a namespace other cells use too (a pod): the counters at our start, not "1"
    # ... and once the pipes exist, just before fork:
    stdio: tuple | None = None   # the fds the child dup2s onto 0-2
    barrier_r: int | None = None  # "1" once the controller has journaled our identity; EOF: never run
    err_w: int | None = None      # the setup report
    status_w: int | None = None  # PID namespace: the init reports the command's status here
    controller: int = 0          # the controller's pid (crashpoints)
    born: bool = False           # born in its cgroup2 directory (clone3): it joins the rest itself (steps: "cgroup")
    ctty: bool = False           # fd 0 (a pty) becomes the controlling terminal
    parent_fd: int | None = None  # born in a fork server: a pidfd of the server, whose death must kill us
    in_userns: bool = False      # born in a user namespace of its own


def child(s: Setup, done: frozenset = frozenset()) -> None:
    """Runs in the forked child: STEPS in order (but those in `done`: a spare's, run by `park`); never returns."""
    step = "start"
    try:
        for step, run, _ in STEPS:
            if step not in done:
                run(s)
    except BaseException as e:  # noqa: BLE001 - anything here must become a report, never a return
        if isinstance(e, _NoCommand):
            step, e = "init", e.args[0]
        code = getattr(e, "errno", None) or 0
        msg = getattr(e, "strerror", None) or str(e)
        try:
            os.write(s.err_w, f"{step}\0{code}\0{msg}".encode(errors="replace"))
        finally:
            os._exit(127 if step == "exec" and code == errno.ENOENT else 126 if step == "exec" else 125)


def _pdeathsig(s: Setup) -> None:
    lsys.prctl(lsys.PR_SET_PDEATHSIG, signal.SIGKILL)
    if s.parent_fd is not None and select.select([s.parent_fd], [], [], 0)[0]:  # readable: the server exited
        raise OSError(errno.ESRCH, "the fork server died")


# the steps a spare leader (process/cellspare.py) runs before any plan exists, in `park`: none reads the plan (a spare
# is made only for plans that die with the controller: its key)
PARKED = frozenset({"pdeathsig", "setsid", "cgroup", "signals"})


def park(s: Setup, lead: int) -> None:
    """A spare leader's first steps (PARKED), with only its place, its backend and the fork server's pidfd: the
    parent-death signal against the server, every fd but `lead` (its Setup comes there) and the server's pidfd
    closed (nothing of the server's, which holds other cells' channels and leaders' pidfds, stays with it while
    it waits), a session of its own, the rest of its cgroups (v1 `tasks`), the default signals."""
    _pdeathsig(s)
    low = 3
    for fd in sorted((lead, s.parent_fd)):
        if fd > low:
            os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, _MAXFD)
    os.setsid()
    if s.place.node is not None:
        s.backend.attach(s.place, 0, born=s.born, alone=True)
    _signals(s)


def _stdio(s: Setup) -> None:
    for target, fd in enumerate(s.stdio or ()):
        if fd is not None and fd != target:
            os.dup2(fd, target)
    keep = {s.barrier_r, s.err_w, s.status_w, s.parent_fd, s.ruleset.fd if s.ruleset else None,
            s.egress.child_fd() if s.egress else None, s.userns_fd, s.netns_fd, s.pod_userns, s.netns_watch,
            *(s.premade or {}).values()}
    low = 3
    for fd in sorted(k for k in keep if k is not None):
        if fd > low:  # adjacent kept fds: no range between them (a system call that fails with EINVAL)
            os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, _MAXFD)


# the signals the leader sets to their defaults (those the interpreter or the controller may have changed), as ints
_DEFAULTED = tuple(int(sig) for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT, signal.SIGTERM, signal.SIGHUP,
                                        signal.SIGQUIT, signal.SIGCHLD))


def _signals(s: Setup) -> None:
    # the C module's functions, the same system calls: the signal module's wrappers turn every answer into an
    # enum member (Handlers, Signals), whose Python the leader would run cold: ~15 copy-on-write faults, ~0.05 ms
    for sig in _DEFAULTED:
        _signal.signal(sig, _signal.SIG_DFL)
    _signal.pthread_sigmask(_signal.SIG_SETMASK, ())


def _unshare(s: Setup) -> None:
    # an IPC namespace for every cell: SysV shm/msg/sem and POSIX message queues are the namespace's own,
    # never the host's (issue 25); inside the user namespace for a normal user's cell. A reduced cell
    # (isolation.reduced, where the host refuses them) has none of them: no unshare at all
    flags = (lsys.CLONE_NEWNS | lsys.CLONE_NEWIPC if s.plan.mount_namespace else 0) | \
        (lsys.CLONE_NEWNET if s.plan.new_netns and s.netns_fd is None else 0)
    if flags:
        lsys.unshare(flags)


def _user_namespace(s: Setup) -> None:
    if s.pod_userns is None:
        lsys.unshare(lsys.CLONE_NEWUSER)
        return
    lsys.setns(s.pod_userns, lsys.CLONE_NEWUSER)  # its owner's euid: every capability in it (user_namespaces(7))


def _network_namespace(s: Setup) -> None:
    if s.netns_fd is not None:  # a root controller without CAP_NET_ADMIN: one cell_netns made, its lo up
        lsys.setns(s.netns_fd, lsys.CLONE_NEWNET)
        os.close(s.netns_fd)


def _netns_watch(s: Setup) -> None:
    """The cell's network namespace exists: send it to the controller (SCM_RIGHTS), which holds it from the
    command's exec on, however soon the command ends: the network hint reads its counters. In a namespace
    other cells share, the message is its counters now (the cell's share is what it adds), as the kernel's text:
    the controller parses it (netns.raw_here)."""
    if s.netns_watch is None:
        return
    try:  # evidence for a hint, never a reason for the cell not to run: the controller says what it lacks
        fd = proc.ns("net")
        try:
            lsys.send_fds(s.netns_watch, netns.raw_here() if s.netns_shared else b"1", [fd])
        finally:
            os.close(fd)
    except OSError:
        pass
    finally:
        os.close(s.netns_watch)
        s.netns_watch = None


def _egress(s: Setup) -> None:
    if s.egress:  # listen on the proxy port in the cell's namespace, hand the listener over (egress/handoff.py)
        s.egress.in_child()
    crashpoints.hit("child_setup", s.controller)


def _after_credentials(s: Setup) -> None:
    """The leader has taken the command's credentials (cell_user, user), and a credential change clears the
    parent-death signal and makes a process dumpable again (commit_creds): the signal is set again here for every
    cell that dies with its controller (the init of a PID namespace, or a leader without one), and a PID
    namespace's init is made non-dumpable again, before it is confined further and starts the command. Had the
    controller died in between, the barrier sees EOF (and had the fork server: _pdeathsig)."""
    if s.plan.dies_with_controller:
        _pdeathsig(s)
    if s.plan.pid_namespace:
        # Non-dumpable: nothing in the cell (the command runs with the init's own uid) can open /proc/1/mem, read
        # its /proc links or ptrace it: PTRACE_MODE_READ of a non-dumpable process needs CAP_SYS_PTRACE over its
        # mm's user namespace, the host's (ptrace(2))
        lsys.prctl(lsys.PR_SET_DUMPABLE, 0)


def _landlock(s: Setup) -> None:
    s.ruleset.restrict_self()  # the domain's record keeps its creator's comm: the log tag (landlock.Ruleset)
    if s.plan.pid_namespace:
        pidinit.take_own_name(s.init_name, lsys.prctl, comm_only=True)  # /proc/1/comm "agnsup-init" again


class _NoCommand(Exception):
    """posix_spawn could not make the command's process (pids.max, RLIMIT_NPROC, memory): reported at step "init",
    as a failed fork of it was, not as an error of the command's execve."""


def _exec(s: Setup) -> None:
    """The command: execve. In a PID namespace we are its init: the command is started by posix_spawn(3)
    (glibc's vfork and execve: nothing of this interpreter is copied or runs in the child; it returns only once
    the execve worked, else raises its error), and we stay its init (linux/pidinit.py), never returning. The
    command gets an empty signal mask and the signals the init waits for at their defaults, and inherits all
    else of ours: namespaces, cgroups, credentials, capabilities, no_new_privs, the Landlock domain, the seccomp
    filter, cwd, umask, rlimits, session, fds 0-2 (every other fd here is close-on-exec)."""
    spec = s.plan.spec
    if not s.plan.pid_namespace:
        os.execve(spec.exe, spec.argv, spec.env)
    pidinit.block_signals()  # nothing is lost between the spawn and sigwaitinfo
    try:
        pid = os.posix_spawn(spec.exe, spec.argv, spec.env, setsigmask=(), setsigdef=pidinit.WAITED)
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.ENOMEM):
            raise _NoCommand(e) from None
        raise
    code = 125
    try:
        os.close(s.err_w)  # the command's copy closed at its execve (close-on-exec): EOF there means it ran
        code = pidinit.supervise(pid, s.status_w)
    finally:
        os._exit(code)


def _landlock_rules(s: Setup) -> None:
    """The last Landlock rules: what exists only in the cell's namespace (docs/isolation.md)."""
    if not s.ruleset:
        return
    plan = s.plan
    if plan.mount_namespace:  # a reduced cell without one: these are the host's, never writable to it
        s.ruleset.allow_path("/dev/shm")  # a fresh tmpfs: its inode exists only here
        s.ruleset.allow_path("/dev/pts")  # the cell's own devpts instance (ptmx and the ptys made in it)
        s.ruleset.allow_path("/tmp")      # the same for the /tmp tmpfs (else: the tmpdir clone, allowed)
    for path, _ in plan.devices:          # a mapped cell's role devices are nodes made in its own /dev
        s.ruleset.allow_path(path)
    for op in plan.mount_ops:             # the worktree's overlay root is a new inode (reversible cells)
        if op[0] == "overlay":
            s.ruleset.allow_path(op[1])
    landlock.allow_stdio(s.ruleset)


def _cell_user(s: Setup) -> None:
    if s.userns_fd is None:
        return
    # Root of a user namespace that owns none of the cell's namespaces: host uid BASE, whose
    # capabilities act only on inodes whose owner the namespace maps (user_namespaces(7)). setns
    # gives every capability in the namespace and a full bounding set, so the bounding-set and
    # capset steps below come after it; setres[ug]id(0) keeps them (0 is the namespace's root).
    lsys.setns(s.userns_fd, lsys.CLONE_NEWUSER)
    os.setgroups([])
    os.setresgid(0, 0, 0)
    os.setresuid(0, 0, 0)  # (which clears the parent-death signal: set again at "after_credentials")


def _capabilities(s: Setup) -> None:
    lsys.drop_bounding_caps(s.plan.drop_caps)
    if s.plan.uid is None and s.plan.cap_keep is not None:
        lsys.set_caps(s.plan.cap_keep)  # effective/permitted/inheritable/ambient: what the role keeps


def _user(s: Setup) -> None:
    if s.plan.uid is not None:
        os.setgroups([])
        os.setgid(s.plan.gid)
        os.setuid(s.plan.uid)  # from root to another uid: every capability set empties (capabilities(7))


def _barrier(s: Setup) -> None:
    if os.read(s.barrier_r, 1) != b"1":
        os._exit(125)  # the controller died before recording us: never run unrecorded
    os.close(s.barrier_r)


REFUSED = True  # a host that refuses namespaces stops a cell here (namespaces.reduced_refusal)

STEPS = (  # (the name a failure reports, the step, REFUSED), in order; a step the plan does not ask for does nothing
    # on_controller_death = kill, first: the kernel SIGKILLs us when the controller's forking thread dies
    # (prctl(2)); had it died already, the barrier sees EOF
    # (born in a fork server: its thread's death kills us; had it died already, we leave now: our parent is then
    # another process, whose death kills nobody)
    ("pdeathsig", lambda s: s.plan.dies_with_controller and _pdeathsig(s), False),
    ("stdio", _stdio, False),                    # fds 0-2; close every other fd but the pipes and the ruleset
    ("setsid", lambda s: os.setsid(), False),    # new session and process group
    # fd 0 (a pty): its foreground group is ours
    ("controlling_terminal", lambda s: s.ctty and fcntl.ioctl(0, termios.TIOCSCTTY, 0), False),
    # join the cell's cgroups: every hierarchy it was not born in (alone: we have one thread, so a v1 hierarchy's
    # `tasks` moves the whole of us, without the kernel's global lock and its grace period). Born in a user
    # namespace of its own (a normal user's clone3), it may not write the host's files: the controller moves it
    ("cgroup", lambda s: s.place.node is not None and not (s.born and s.in_userns)
     and s.backend.attach(s.place, 0, born=s.born, alone=True), False),
    ("signals", _signals, False),                # default dispositions, empty mask
    # not root: mount and network namespaces only inside a user namespace of our own, whose maps we write
    # ourselves (one id each, as `unshare -r` does; no newuidmap needed). Root: the namespaces stay the
    # host's; a mapped cell joins the cells' user namespace only at "cell_user", so it owns none of them
    # A normal user's cell of a pod joins the pod's user namespace (the keeper made it with these maps) instead
    ("user_namespace", lambda s: s.ids is not None and not s.in_userns and _user_namespace(s), False),
    ("id_maps", lambda s: s.ids is not None and s.pod_userns is None and userns.write_id_maps("self", *s.ids, *s.ids),
     False),
    ("unshare", _unshare, REFUSED),              # mount and IPC (and, unless the host's network, network)
    ("network_namespace", _network_namespace, False),
    ("netns_watch", _netns_watch, False),        # deny/loopback: the namespace to the controller (the hint)
    ("mounts", lambda s: s.plan.mount_namespace and mounts.apply(s.plan.mount_ops, s.userns_fd, s.premade), REFUSED),
    ("loopback", lambda s: s.plan.new_netns and s.netns_fd is None and netns.loopback_up(), False),
    ("egress", _egress, False),                  # allowlist/internal roles: the proxy's listener
    # PID namespace roles: its own /proc; "agnsup-init" in /proc/1/cmdline before the command exists (it never
    # sees the controller's argv there). We are the namespace's init: confined below exactly as the command will
    # be (it inherits all of it), we start the command at "exec" and stay its init
    ("proc", lambda s: s.plan.pid_namespace and lsys.mount("proc", "/proc", "proc", _PROC_FLAGS), REFUSED),
    ("init_name", lambda s: s.plan.pid_namespace and pidinit.take_own_name(s.init_name, lsys.prctl), False),
    # confine (docs/isolation.md), in this order because each step needs what the next one takes away
    ("landlock_rules", _landlock_rules, False),  # the fresh /dev/shm, devpts and /tmp, stdio files, terminals
    ("cell_user", _cell_user, False),            # a mapped cell: uid and gid 0 in the cells' user namespace
    ("capabilities", _capabilities, False),      # the bounding set; no process.user: down to what the role keeps
    ("user", _user, False),                      # process.user: its uid and gid
    ("after_credentials", _after_credentials, False),  # the parent-death signal again; an init: non-dumpable
    ("no_new_privs", lambda s: s.plan.no_new_privs and lsys.set_no_new_privs(), False),
    ("landlock", lambda s: s.ruleset and _landlock(s), False),
    ("seccomp", lambda s: s.filter and s.filter.load(), False),  # last: it refuses mount and unshare
    ("barrier", _barrier, False),                # until our identity is journaled: no command before that
    ("chdir", lambda s: os.chdir(s.plan.spec.workdir), False),
    ("exec", _exec, False),
)

# Where a host that refuses namespaces stops a cell: the steps marked REFUSED, and the controller's own
# two before the child exists, building the confinement (spawn's prepare) and the clone of its PID namespace.
REFUSABLE = frozenset({"confinement", "pid_namespace", *(name for name, _, refused in STEPS if refused)})
