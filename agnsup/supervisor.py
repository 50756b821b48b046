"""The process supervisor: the only module that creates processes.

spawn() forks one child and runs the cell recipe in it, in order:

    (born in the cell's cgroup2 directory by clone3(CLONE_INTO_CGROUP) where
    the kernel and a single-threaded controller allow it; else forked)
    close every fd but 0-2, the two pipes and the Landlock ruleset
    on_controller_death = kill: PR_SET_PDEATHSIG(SIGKILL) (the leader, or the
        PID namespace's init, dies with the controller; so does the namespace)
    new session and process group (setsid)
    join the cell's cgroups (every hierarchy it was not born in)
    default signal dispositions, empty signal mask
    not root: unshare a user namespace and map our own uid and gid to themselves in it
        (root: the namespaces stay the host's; a mapped cell joins the cells' user namespace
        only in confine, below, so it owns none of them)
    unshare the mount and IPC (and, unless the role has the host's network, network) namespaces
        (a root controller without CAP_NET_ADMIN: the network namespace is one cell_netns made,
        owned by a user namespace of the cell's own, with lo up already: joined by setns;
        a reduced cell, isolation.reduced: only those the host gives; none at all in a default container)
    build the mount namespace from the plan's operations (a reduced cell without one: none)
    bring loopback up in the new network namespace
    allowlist/internal roles: listen on the proxy port inside it and hand the
        listener to the controller (agnsup/egress/handoff.py)
    PID namespace roles: mount the namespace's own /proc, overwrite our
        argv and environment in memory (/proc/1/cmdline: "agnsup-init"), wait
        at the barrier, fork the command and stay as its init
        (linux/pidinit.py); the command continues below
    confine (docs/isolation.md), in this order because each step needs
    what the next one takes away:
        the last Landlock rules (the fresh /dev/shm, devpts and /tmp, stdio files and terminals)
        a mapped cell: setns into the cells' user namespace, then uid and gid 0 there (host
            BASE: docs/isolation.md, "Doors: identity"); PR_SET_PDEATHSIG re-armed
        capabilities: the bounding set, then uid/gid (process.user) or
            effective/permitted/inheritable/ambient, down to what the role keeps
        no_new_privs
        Landlock restrict_self
        the seccomp filter (last: it refuses mount and unshare)
    wait at the barrier until the controller has journaled our identity
    chdir, execve

The seccomp filter and the Landlock ruleset are built in the controller
before fork, so the child only makes a few system calls.

Any failure before execve is written to a close-on-exec pipe as
"step\\0errno\\0message" and the child exits without running the command: a
half-built cell never runs the payload. EOF on that pipe means execve worked.
If the controller dies while the child waits at the barrier, the child sees
EOF there and exits instead of running unrecorded.
"""
from __future__ import annotations

import errno
import os
import select
import signal
import time

from . import crashpoints
from .errors import CancelledBeforeStart, NotExecutable, NotFound, SetupError, exit_code
# Everything the child needs is imported here, before fork: after the mount
# namespace is built the package itself may be hidden (installed under /tmp or
# a masked path), so the child must not import anything.
from .linux import host, landlock, mounts, netns, pidfd, pidinit, proc, seccomp, userns
from .linux import sys as lsys
from .record import Record

_MAXFD = os.sysconf("SC_OPEN_MAX")
OOM_SETTLE = 1.0  # seconds the v1 OOM killer gets to take its victim before we take the cell


class Child(Record):
    pid: int
    pidfd: int
    identity: dict
    status_fd: int | None = None  # PID namespace: the init reports the command's status here
    cgroup_join: str = ""  # how it entered its cgroups (receipt: isolation.cgroup_join)
    barrier_fd: int | None = None  # written once the identity is journaled: then it may exec
    report_fd: int | None = None   # the child's setup error, or EOF once execve worked
    handoff: object = None         # allowlist/internal: egress.handoff.Handoff the listener comes back on
    egress_listener: object = None  # ... and the proxy's listener, made in the cell's namespace
    tmp_fd: int | None = None      # the cell's /tmp tmpfs (make_tmp), kept to measure it when the cell ends
    tmp_used: int | None = None    # ... bytes used then (collect)


class Outcome(Record):
    exit_code: int          # what the controller exits with (128+N for signal N)
    status: int | None      # the command's own exit status, if it exited
    signal: int | None      # the signal that killed the leader, if any
    reason: str             # exited | killed | timeout | cancelled | output_limit | oom | <error class>
    state: str              # the cell's terminal state
    cancel_reason: str | None = None
    kill_method: str | None = None
    leftover: list | None = None  # pids still in the cell after the leader ended

    @classmethod
    def of(cls, reason: str, status: int | None, sig: int | None, stop_signal: int = signal.SIGTERM,
           **more) -> "Outcome":
        """The one place a cell's exit status and terminal state are decided (cli.md):
        the command's own status; 128+N when signal N ended it; 124 for a timeout; a
        cancelled cell that exited by itself after the stop signal (SIGTERM; SIGINT
        for a Ctrl-C to `agnsup run`) still ends 128+that signal."""
        if reason == "timeout":
            code, state = 124, "timeout"
        elif reason == "cancelled":
            code, state = 128 + (sig if sig is not None else stop_signal), "cancelled"
        else:
            code = status if status is not None else 128 + sig
            # a broken limit (output_limit, oom) is a kill by the supervisor
            state = "killed" if reason in ("output_limit", "oom") or status is None else "exited"
        return cls(exit_code=code, status=status, signal=sig, reason=reason, state=state, **more)

    @classmethod
    def failed(cls, error: Exception, cancel_reason: str | None = None) -> "Outcome":
        """A cell that never ran its command."""
        if isinstance(error, CancelledBeforeStart):
            return cls(exit_code=exit_code(error), status=None, signal=None, reason="cancelled", state="cancelled",
                       cancel_reason=cancel_reason)
        return cls(exit_code=exit_code(error), status=None, signal=None, reason=type(error).__name__, state="failed")


class _Confinement(Record):
    """Built in the controller before fork; used by the child."""
    ruleset: object = None   # landlock.Ruleset
    filter: object = None    # seccomp.Filter
    ids: tuple | None = None # (uid, gid) outside: a user namespace of the cell's own maps them to themselves
    userns_fd: int | None = None  # a mapped cell: the cells' user namespace (cell_userns), kept by the controller
    premade: dict | None = None   # {mount key: detached mount fd} the controller made (the /tmp tmpfs)
    egress: object = None    # egress.handoff.Handoff: the socketpair the proxy listener comes back on
    init_name: tuple = ()    # PID namespace: pidinit.own_name_plan(), where the init overwrites its argv
    netns_fd: int | None = None  # a root controller without CAP_NET_ADMIN: the cell's netns (cell_netns)


class _Step:
    name = "start"


def _child(plan, backend, place, barrier_r: int, err_w: int, stdio: tuple | None, conf: _Confinement,
           status_w: int | None, controller: int, born: bool = False, ctty=None, in_userns: bool = False) -> None:
    """Runs in the forked child; never returns. `ctty`: makes fd 0 the controlling terminal;
    `in_userns`: born in a user namespace of its own."""
    at = _Step()
    try:
        if plan.dies_with_controller:
            # the dead-man switch, first: the kernel SIGKILLs us when the controller's
            # forking thread dies (prctl(2)); had it died already, the barrier sees EOF
            at.name = "pdeathsig"
            lsys.prctl(lsys.PR_SET_PDEATHSIG, signal.SIGKILL)
        if stdio:
            for target, fd in enumerate(stdio):
                if fd is not None and fd != target:
                    os.dup2(fd, target)
        _close_all_but({barrier_r, err_w, status_w, conf.ruleset.fd if conf.ruleset else None,
                        conf.egress.child_fd() if conf.egress else None, conf.userns_fd, conf.netns_fd,
                        *(conf.premade or {}).values()})
        at.name = "setsid"
        os.setsid()
        if ctty is not None:
            at.name = "controlling_terminal"
            ctty()  # fd 0 (a pty) becomes the session's terminal; its foreground group is ours
        at.name = "cgroup"
        if place.node is not None and not born:  # born in its cgroup: the controller moves it into the rest
            backend.attach(place, 0)
        at.name = "signals"
        for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT, signal.SIGTERM, signal.SIGHUP,
                    signal.SIGQUIT, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        if conf.ids is not None:
            # not root: mount and network namespaces only inside a user namespace of our own, whose
            # maps we write ourselves (one id each, as `unshare -r` does; no newuidmap needed)
            if not in_userns:
                at.name = "user_namespace"
                lsys.unshare(lsys.CLONE_NEWUSER)
            at.name = "id_maps"
            uid, gid = conf.ids
            userns.write_id_maps("self", uid, gid, uid, gid)
        at.name = "unshare"
        # an IPC namespace for every cell: SysV shm/msg/sem and POSIX message queues are the namespace's own,
        # never the host's (issue 25); inside the user namespace for a normal user's cell. A reduced cell
        # (isolation.reduced, where the host refuses them) has none of them: no unshare at all
        own_netns = conf.netns_fd is not None
        flags = (lsys.CLONE_NEWNS | lsys.CLONE_NEWIPC if plan.mount_namespace else 0) | \
            (lsys.CLONE_NEWNET if plan.new_netns and not own_netns else 0)
        if flags:
            lsys.unshare(flags)
        if own_netns:
            at.name = "network_namespace"
            lsys.setns(conf.netns_fd, lsys.CLONE_NEWNET)  # its lo is up already
            os.close(conf.netns_fd)
        if plan.mount_namespace:
            at.name = "mounts"
            mounts.apply(plan.mount_ops, conf.userns_fd, conf.premade)
        if plan.new_netns and not own_netns:
            at.name = "loopback"
            netns.loopback_up()
        if conf.egress:
            at.name = "egress"
            conf.egress.in_child()
        crashpoints.hit("child_setup", controller)
        if plan.pid_namespace:
            at.name = "proc"
            lsys.mount("proc", "/proc", "proc", lsys.MS_NOSUID | lsys.MS_NODEV | lsys.MS_NOEXEC)
            at.name = "init_name"  # before the command exists: it never sees the controller's argv in /proc/1
            pidinit.take_own_name(conf.init_name, lsys.prctl)
            _barrier(at, barrier_r)
            at.name = "init"
            pidinit.block_signals()
            pid = os.fork()
            if pid:
                _be_init(pid, err_w, status_w, conf)
            signal.pthread_sigmask(signal.SIG_SETMASK, [])
            os.close(status_w)
        _confine(at, plan, conf)
        if not plan.pid_namespace:
            _barrier(at, barrier_r)
        at.name = "chdir"
        os.chdir(plan.spec.workdir)
        at.name = "exec"
        os.execve(plan.spec.exe, plan.spec.argv, plan.spec.env)
    except BaseException as e:  # noqa: BLE001 - anything here must become a report, never a return
        code = getattr(e, "errno", None) or 0
        msg = getattr(e, "strerror", None) or str(e)
        step = at.name
        try:
            os.write(err_w, f"{step}\0{code}\0{msg}".encode(errors="replace"))
        finally:
            os._exit(127 if step == "exec" and code == errno.ENOENT else 126 if step == "exec" else 125)


def _take_terminal():
    """TIOCSCTTY on fd 0, for the child: built here, so the child imports nothing."""
    import fcntl
    import termios
    return lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def _close_all_but(keep: set) -> None:
    low = 3
    for fd in sorted(k for k in keep if k is not None):
        os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, _MAXFD)


def _barrier(at: _Step, barrier_r: int) -> None:
    at.name = "barrier"
    if os.read(barrier_r, 1) != b"1":
        os._exit(125)  # the controller died before recording us: never run unrecorded
    os.close(barrier_r)


def _be_init(command: int, err_w: int, status_w: int, conf: _Confinement) -> None:
    """PID 1 of the cell's PID namespace, once the command is forked; never returns."""
    code = 125
    try:
        os.close(err_w)  # the command holds its own copy: EOF there still means its execve worked
        if conf.ruleset:
            conf.ruleset.close()
        # Non-dumpable: nothing in the cell can open /proc/1/mem or ptrace the
        # init, which keeps the capabilities the command drops.
        lsys.prctl(lsys.PR_SET_DUMPABLE, 0)
        code = pidinit.supervise(command, status_w)
    finally:
        os._exit(code)


def _confine(at: _Step, plan, conf: _Confinement) -> None:
    """The command's own confinement, after the mount namespace is built (docs/isolation.md)."""
    if conf.ruleset:
        at.name = "landlock_rules"
        if plan.mount_namespace:  # a reduced cell without one: these are the host's, never writable to it
            conf.ruleset.allow_path("/dev/shm")  # a fresh tmpfs: its inode exists only here
            conf.ruleset.allow_path("/dev/pts")  # the cell's own devpts instance (ptmx and the ptys made in it)
            conf.ruleset.allow_path("/tmp")      # the same for the /tmp tmpfs (else: the tmpdir clone, allowed)
        for path, _ in plan.devices:         # a mapped cell's role devices are nodes made in its own /dev
            conf.ruleset.allow_path(path)
        for op in plan.mount_ops:            # the worktree's overlay root is a new inode (reversible cells)
            if op[0] == "overlay":
                conf.ruleset.allow_path(op[1])
        landlock.allow_stdio(conf.ruleset)
    if conf.userns_fd is not None:
        # Root of a user namespace that owns none of the cell's namespaces: host uid BASE, whose
        # capabilities act only on inodes whose owner the namespace maps (user_namespaces(7)). setns
        # gives every capability in the namespace and a full bounding set, so the bounding-set and
        # capset steps below come after it; setres[ug]id(0) keeps them (0 is the namespace's root).
        at.name = "cell_user"
        lsys.setns(conf.userns_fd, lsys.CLONE_NEWUSER)
        os.setgroups([])
        os.setresgid(0, 0, 0)
        os.setresuid(0, 0, 0)
        if plan.dies_with_controller and not plan.pid_namespace:
            # a credential change clears PR_SET_PDEATHSIG (commit_creds): the leader carries it again;
            # had the controller died in between, the barrier that follows sees EOF
            lsys.prctl(lsys.PR_SET_PDEATHSIG, signal.SIGKILL)
    at.name = "capabilities"
    lsys.drop_bounding_caps(plan.drop_caps)
    if plan.uid is not None:
        at.name = "user"
        os.setgroups([])
        os.setgid(plan.gid)
        os.setuid(plan.uid)  # from root to another uid: every capability set empties (capabilities(7))
    elif plan.cap_keep is not None:
        lsys.set_caps(plan.cap_keep)
    if plan.no_new_privs:
        at.name = "no_new_privs"
        lsys.set_no_new_privs()
    if conf.ruleset:
        at.name = "landlock"
        conf.ruleset.restrict_self()
    if conf.filter:
        at.name = "seccomp"
        conf.filter.load()


def _prepare(plan) -> _Confinement:
    conf = _Confinement()
    if plan.seccomp_refuse is not None:
        conf.filter = seccomp.build(plan.seccomp_refuse)
    if plan.landlock_writable is not None:
        conf.ruleset = landlock.build(plan.landlock_writable, plan.landlock_abi, log_tag=plan.landlock_log_tag)
    if plan.user_namespace:
        conf.ids = (os.getuid(), os.getgid())
    if plan.pid_namespace:
        conf.init_name = pidinit.own_name_plan()
    if plan.mapped is not None:
        conf.userns_fd = cell_userns()
    if plan.tmp_tmpfs:
        conf.premade = {"tmp": make_tmp(plan)}
    if plan.egress is not None:
        from .egress.handoff import Handoff  # imports socket: only for roles that use the proxy
        conf.egress = Handoff(plan.egress["proxy_port"])
    if plan.new_netns and conf.ids is None and not host.net_admin():
        try:
            conf.netns_fd = cell_netns()
        except BaseException as e:
            _close_conf(conf)
            if isinstance(e, OSError):
                raise _netns_refused(e) from None
            raise
    return conf


def _netns_refused(e: OSError) -> SetupError:
    """The one line for a root controller without CAP_NET_ADMIN whose cells cannot have a user namespace
    of their own to own their network namespace, with both fixes."""
    return SetupError(f"cell setup failed at step 'network_namespace': {e.strerror or e}: a cell's loopback needs "
                      "CAP_NET_ADMIN, which this controller lacks, or a user namespace of the cell's own, which "
                      "this host refuses; fix: give agnsup CAP_NET_ADMIN (a container: --cap-add NET_ADMIN), or "
                      'accept a reduced cell: isolation.reduced = ["network_namespace"] (docs/hosts.md)',
                      step="network_namespace", errno=e.errno)


def _close_conf(conf: _Confinement) -> None:
    """The controller's copies of what it made for a child (after the fork, or when there is none)."""
    if conf.ruleset:
        conf.ruleset.close()
    if conf.egress:
        conf.egress.close()
    for premade in (conf.premade or {}).values():
        os.close(premade)
    if conf.netns_fd is not None:
        os.close(conf.netns_fd)
        conf.netns_fd = None


def cell_netns() -> int:
    """A network namespace for one cell of a root controller that lacks CAP_NET_ADMIN, owned by a user
    namespace of its own (linux/netns.py), its lo up: an fd the child joins by setns. A throwaway child
    makes both, opens its own /proc/self/ns/net and sends us the fd (SCM_RIGHTS: we could not open its
    /proc entry ourselves, as its euid is the namespace's owner now and a container's root has no
    CAP_SYS_PTRACE), then exits; the fd keeps the namespace until the cell is in it. One fork per cell,
    only on such hosts."""
    import _socket  # not `socket` (tens of ms of imports on a busy host): a socketpair and SCM_RIGHTS
    import struct
    ours, theirs = _socket.socketpair(_socket.AF_UNIX, _socket.SOCK_SEQPACKET)
    pid = os.fork()
    if pid == 0:
        try:
            ours.close()
            try:
                netns.own_user_and_net_namespace(userns.netns_owner())
                fd = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
                theirs.sendmsg([b"1"], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, struct.pack("i", fd))])
            except OSError as e:
                theirs.send(f"{e.errno or 0}\0{e.strerror or e}".encode(errors="replace"))
        finally:
            os._exit(0)
    theirs.close()
    fds: list[int] = []
    try:
        # b"": it died before saying anything
        answer, ancillary, _flags, _addr = ours.recvmsg(4096, _socket.CMSG_SPACE(4), _socket.MSG_CMSG_CLOEXEC)
        for level, kind, data in ancillary:
            if (level, kind) == (_socket.SOL_SOCKET, _socket.SCM_RIGHTS):
                fds += struct.unpack(f"{len(data) // 4}i", data[:len(data) // 4 * 4])
    finally:
        ours.close()
        _userns_exited.append(pid)  # it exits by itself: reaped without waiting, as cell_userns's helper
        _reap_exited_userns_children()
    if answer == b"1" and len(fds) == 1:
        return fds[0]
    for fd in fds:
        os.close(fd)
    code, _, msg = answer.decode(errors="replace").partition("\0")
    raise OSError(int(code) if code.isdigit() else errno.EPERM,
                  f"a network namespace of the cell's own: {msg or 'the helper exited'}")


def make_tmp(plan) -> int:
    """The cell's /tmp: a tmpfs of limits.tmp_max (off the state root's disk; a write past it fails
    with ENOSPC), owned by the cell's ids, filled with a copy of the staging tmpdir the broker made
    (HOME, @runtime links, cache mount points); a detached mount the child attaches at /tmp. Made here,
    in the controller, so the controller can still measure it once the cell's namespace is gone."""
    ids = plan.cell_ids()
    opts = {"size": str(plan.limits["tmp_max"]), "mode": "1777"}
    if ids is not None:
        opts.update(uid=str(ids[0]), gid=str(ids[1]))
    fd = lsys.fsmount_new("tmpfs", opts, lsys.MOUNT_ATTR_NOSUID | lsys.MOUNT_ATTR_NODEV)
    try:
        mounts.copy_tree(plan.tmpdir, fd)
    except BaseException:
        os.close(fd)
        raise
    return fd


def tmp_bytes(fd: int) -> int:
    """Bytes in use on the tmpfs open as `fd`."""
    sv = os.fstatvfs(fd)
    return (sv.f_blocks - sv.f_bfree) * sv.f_frsize


_cell_userns: list[int] = []   # the fd of the cells' user namespace, made once per controller process
_idmap_by_dev: dict[int, str | None] = {}  # st_dev -> None (id-mapped mounts work there) or why not


def _userns_child() -> tuple[int, int, int]:
    """(pid, ready_r, done_w) of a child that unshares a user namespace, says so on ready_r and waits
    for done_w to close."""
    ready_r, ready_w = os.pipe()
    done_r, done_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(ready_r)
            os.close(done_w)
            lsys.unshare(lsys.CLONE_NEWUSER)
            os.write(ready_w, b"1")
            os.read(done_r, 1)  # EOF: the controller has the fd (or gave up, or exited)
        finally:
            os._exit(0)
    os.close(ready_w)
    os.close(done_r)
    return pid, ready_r, done_w


def cell_userns() -> int:
    """The user namespace a root controller's mapped cells join (linux/userns.py: 0..65535 inside, the
    cells' range outside): made once per controller process and kept open, which keeps it alive. A
    throwaway child unshares it and waits; we write its maps (as host root: any range) and open
    /proc/CHILD/ns/user; the child exits. Every cell of this controller shares it: each still has its
    own mount, network, IPC and PID namespaces, Landlock domain and seccomp filter, and the namespace
    owns none of them (docs/isolation.md, "Doors: identity")."""
    if _cell_userns:
        return _cell_userns[0]
    pid, ready_r, done_w = _userns_child()
    try:
        if os.read(ready_r, 1) != b"1":  # EOF: it exited without a namespace
            raise OSError(errno.EPERM, "the throwaway child could not unshare a user namespace")
        userns.write_cell_maps(pid)
        fd = os.open(f"/proc/{pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        os.close(ready_r)
        os.close(done_w)  # it exits now; reaped without waiting for it (about 0.5 ms of a start)
        _userns_exited.append(pid)
        _reap_exited_userns_children()
    _cell_userns.append(fd)
    return fd


_userns_exited: list[int] = []  # throwaway children told to exit, not yet reaped


def _reap_exited_userns_children() -> None:
    """Reap the throwaway children that have exited (WNOHANG): each cell_userns call, and spawn, try."""
    for pid in list(_userns_exited):
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done = pid
        if done:
            _userns_exited.remove(pid)


def idmap_refused(path: str) -> str | None:
    """Why a mount of `path`'s file system cannot be id-mapped through the cells' user namespace, or
    None when it can: tried once per device on a detached clone (no mount namespace needed)."""
    try:
        dev = os.stat(path).st_dev
    except OSError as e:
        return f"{path}: {e.strerror}"
    if dev not in _idmap_by_dev:
        try:
            ns = cell_userns()
            fd = lsys.open_tree(path, lsys.OPEN_TREE_CLONE | lsys.OPEN_TREE_CLOEXEC)
            try:
                lsys.mount_setattr(path, attr_set=lsys.MOUNT_ATTR_IDMAP, fd=fd, userns_fd=ns, recursive=False)
            finally:
                os.close(fd)
            _idmap_by_dev[dev] = None
        except OSError as e:
            _idmap_by_dev[dev] = f"the file system of {path} cannot be id-mapped here ({e.strerror or e})"
    return _idmap_by_dev[dev]


_ns_refused: dict = {}  # namespaces_refused(), once per controller process


def namespaces_refused() -> dict:
    """{"mount_namespace" | "network_namespace" | "pid_namespace": None when this host gives a cell one, else
    why not}: tried once per controller process in one throwaway child, the way a cell makes them (a normal
    user's inside a user namespace of its own; the mount namespace with the new mount API a cell's /tmp is
    made with). Asked only for a role that lists isolation.reduced, or to name the fix of a refused cell:
    a full host's `agnsup run` never pays for it."""
    if _ns_refused:
        return dict(_ns_refused)
    root = os.geteuid() == 0
    # in this order: the network's own user namespace (a root controller without CAP_NET_ADMIN) comes last
    tries = (("mount_namespace", _mount_namespace_probe),
             ("pid_namespace", _pid_namespace_probe),
             ("network_namespace", _netns_with_loopback))
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            global _host_mnt_ns
            _host_mnt_ns = os.readlink("/proc/self/ns/mnt")
            out = []
            try:
                if not root:
                    lsys.unshare(lsys.CLONE_NEWUSER)
                    userns.write_id_maps("self", os.getuid(), os.getgid(), os.getuid(), os.getgid())
                first = None
            except OSError as e:
                first = f"no user namespace for a normal user's cell: {e.strerror or e}"
            for name, fn in tries:
                why = first
                if why is None:
                    try:
                        fn()
                    except OSError as e:
                        why = e.strerror or str(e)
                out.append(f"{name}\0{why or ''}")
            os.write(w, "\n".join(out).encode(errors="replace"))
        finally:
            os._exit(0)
    os.close(w)
    got = _read_all(r).decode(errors="replace")
    _reap(pid)
    for line in got.splitlines():
        name, _, why = line.partition("\0")
        _ns_refused[name] = why or None
    for name, _ in tries:
        _ns_refused.setdefault(name, "the probe child reported nothing")
    return dict(_ns_refused)


# The child steps where a host that refuses namespaces stops a cell whose role does not accept running without them.
# isolation.reduced's pieces in the schema's order (models.REDUCIBLE; this layer may not import it or the
# compiler: tests/unit/test_reduced_policy.py holds the copies equal)
REDUCIBLE_ORDER = ("mount_namespace", "network_namespace", "pid_namespace", "cgroup")
_REFUSABLE_STEPS = frozenset({"unshare", "pid_namespace", "confinement", "mounts", "proc"})


def _mount_namespace_probe() -> None:
    """In namespaces_refused's child: a mount namespace (private from here on: nothing reaches the host's)
    and a tmpfs by the new mount API, as a cell's /tmp is made."""
    lsys.unshare(lsys.CLONE_NEWNS | lsys.CLONE_NEWIPC)
    lsys.mount_setattr("/", propagation=lsys.MS_PRIVATE)
    os.close(lsys.fsmount_new("tmpfs", {"size": "4096"}))


def _pid_namespace_probe() -> None:
    """A PID namespace, and (in the private mount namespace _mount_namespace_probe made, when it could) its
    own /proc mounted by its PID 1, as a cell's init does: a container engine's masked /proc files make the
    kernel refuse that mount in a user namespace (mount_too_revealing)."""
    lsys.unshare(lsys.CLONE_NEWPID)
    if os.readlink("/proc/self/ns/mnt") == _host_mnt_ns:
        return  # no mount namespace here: the cell's PID namespace goes with it (compiler._reduced)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            os.close(r)
            lsys.mount("proc", "/proc", "proc", lsys.MS_NOSUID | lsys.MS_NODEV | lsys.MS_NOEXEC)
        except OSError as e:
            os.write(w, (e.strerror or str(e)).encode(errors="replace"))
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    err = _read_all(r).decode(errors="replace")
    _reap(pid)
    if err:
        raise OSError(errno.EPERM, f"its own /proc: {err}")


_host_mnt_ns = ""  # the mount namespace the probe child started in (set in it)


def _netns_with_loopback() -> None:
    """A network namespace whose lo comes up, made as a cell's is: a root controller without CAP_NET_ADMIN
    makes it owned by a user namespace of its own (cell_netns, linux/netns.py)."""
    if os.geteuid() == 0 and not host.net_admin():
        netns.own_user_and_net_namespace(userns.netns_owner())
        return
    lsys.unshare(lsys.CLONE_NEWNET)
    try:
        netns.loopback_up()
    except OSError as e:
        raise OSError(e.errno, f"bringing lo up in a new network namespace: {e.strerror}") from None


def reduced_refusal(step: str, msg: str, code: int | None, plan=None) -> SetupError | None:
    """The one line for a cell the host refuses a namespace (Docker's default seccomp profile, a missing
    CAP_SYS_ADMIN, gVisor, a locked-down runner) whose role does not accept running without it: the piece,
    and both fixes, the container's flag or isolation.reduced (docs/isolation.md, "Reduced cells"). None when
    `step`/`code` is not such a refusal, or when the host gives every namespace (another cause)."""
    if code not in (errno.EPERM, errno.EACCES, errno.ENOSYS) or step not in _REFUSABLE_STEPS:
        return None
    refused = [p for p, why in namespaces_refused().items() if why]
    if not refused:
        return None
    accepted = set(getattr(plan, "reduced_accepted", ()) or ())
    pieces = [p for p in refused if p not in accepted] or refused
    root = os.geteuid() == 0
    why = ("the container's seccomp profile or a missing CAP_SYS_ADMIN refuses namespaces" if root else
           "namespaces are refused to this user here (no user namespace: a sysctl, an LSM, or a seccomp profile)")
    flag = ("run the container with --cap-add SYS_ADMIN (deploy/Dockerfile)" if root else
            "let this user create user namespaces (see `agnsup doctor`), or run agnsup as root")
    listed = ", ".join(f'"{p}"' for p in sorted(set(pieces) | accepted, key=REDUCIBLE_ORDER.index))
    return SetupError(f"cell setup failed at step {step!r}: {msg} ({why}); fix: {flag}, or accept a reduced cell: "
                      f"isolation.reduced = [{listed}] (docs/hosts.md)", step=step, errno=code)



def spawn(plan, backend, place, stdio: tuple | None = None, forker=None, ctty: bool = False) -> Child:
    """Fork the cell leader into `place` and hold it at the barrier.

    Returns with the child's identity; the caller journals it and then lets the
    command run with `release(plan, child)`, or never with `abandon(child)`.
    `forker(fn)`: run the fork in a thread that lives as long as the controller
    (service.Supervisor): PR_SET_PDEATHSIG fires when the *thread* that forked
    the cell exits (prctl(2)), and a serve request's thread ends with its connection.
    `ctty`: fd 0 is a pty that becomes the cell's controlling terminal (TIOCSCTTY)."""
    take_terminal = _take_terminal() if ctty else None
    if _userns_exited:
        _reap_exited_userns_children()
    try:
        conf = _prepare(plan)
    except OSError as e:
        raise reduced_refusal("confinement", e.strerror or str(e), e.errno, plan) or \
            SetupError(f"cell setup failed at step 'confinement': {e.strerror or e}", step="confinement",
                       errno=e.errno) from None
    barrier_r, barrier_w = os.pipe()
    err_r, err_w = os.pipe()
    status_r = status_w = None
    controller = os.getpid()
    fd = None
    born = False

    def fork() -> tuple[int, int | None, bool]:
        path = backend.clone_dir(place) if place.node else None
        # a normal user's PID namespace: only a user namespace of its own, made in the same clone3,
        # lets it have one (the controller cannot unshare(CLONE_NEWPID) for it)
        userns_pid = conf.ids is not None and plan.pid_namespace
        flags = (lsys.CLONE_NEWPID if plan.pid_namespace else 0) | (lsys.CLONE_NEWUSER if userns_pid else 0)
        pid, fd = _clone_into_cgroup(path, flags) if path is not None else (None, None)
        born = pid is not None  # born in v2; the controller moves it into the other hierarchies
        if pid is None and userns_pid:
            # born in our cgroup (the child joins its own); EPERM here: no user namespace for us
            if len(os.listdir("/proc/self/task")) == 1:
                pid, fd = lsys.clone3_into_cgroup(None, flags)
                fd = fd if pid else None
            else:
                pid, fd = _clone3_from_a_forked_child(flags), None
        elif pid is None:
            pid = _fork_into_new_pid_namespace() if plan.pid_namespace else os.fork()
        if pid == 0:
            os.close(barrier_w)
            os.close(err_r)
            if status_r is not None:
                os.close(status_r)
            _child(plan, backend, place, barrier_r, err_w, stdio, conf, status_w, controller, born, take_terminal,
                   userns_pid)
        return pid, fd, born

    try:
        if plan.pid_namespace:
            status_r, status_w = os.pipe()
        pid, fd, born = forker(fork) if forker is not None else fork()
    except OSError as e:
        for fd in (barrier_r, barrier_w, err_r, err_w, status_r, status_w):
            if fd is not None:
                os.close(fd)
        _close_conf(conf)
        if conf.ids is not None and e.errno in _USERNS_REFUSED:
            raise _userns_refused(e.strerror or str(e), e.errno) from None
        raise reduced_refusal("pid_namespace", e.strerror or str(e), e.errno, plan) or \
            SetupError(f"cell setup failed at step 'pid_namespace': {e.strerror or e}", step="pid_namespace",
                       errno=e.errno) from None
    os.close(barrier_r)
    os.close(err_w)
    if status_w is not None:
        os.close(status_w)
    if conf.ruleset:
        conf.ruleset.close()
    if conf.egress:
        conf.egress.after_fork()
    if conf.netns_fd is not None:
        os.close(conf.netns_fd)
    child = Child(pid=pid, pidfd=fd, identity={}, status_fd=status_r, barrier_fd=barrier_w, report_fd=err_r,
                  cgroup_join=_JOIN_CLONE3 if born else _JOIN_FORK, handoff=conf.egress,
                  tmp_fd=(conf.premade or {}).get("tmp"))
    try:
        if born:
            # A v1 cgroup.procs write may wait for an RCU grace period (the same
            # cgroup_threadgroup_rwsem): made here, it overlaps the child's own
            # setup instead of adding to it. Done before the barrier, so the
            # command still never runs outside any of its cgroups.
            backend.attach(place, pid, born=True)
        if child.pidfd is None:
            child.pidfd = os.pidfd_open(pid)
        st = proc.stat(pid)
        child.identity = {"pid": pid, "pidfd_ino": pidfd.inode(child.pidfd) if pidfd.has_pidfs() else None,
                          "starttime": st.starttime if st else None, "pgid": pid, "boot_id": proc.boot_id()}
    except BaseException as e:
        # A child that failed its own setup meanwhile (gone: no such process to
        # move) has written why: that is the error.
        report = abandon(child, read_report=isinstance(e, ProcessLookupError))
        if report:
            raise _child_error(plan, report) from None
        raise
    return child


def release(plan, child: Child) -> None:
    """The identity is journaled: let the command exec. Returns once execve
    succeeded; raises the child's own error if its setup failed."""
    try:
        os.write(child.barrier_fd, b"1")
    except BrokenPipeError:
        pass  # it failed its setup and left: its report says why
    finally:
        os.close(child.barrier_fd)
        child.barrier_fd = None
    report = _read_all(child.report_fd)
    child.report_fd = None
    if report:
        os.waitid(os.P_PIDFD, child.pidfd, os.WEXITED)
        os.close(child.pidfd)
        _close_tmp(child)
        if child.status_fd is not None:
            os.close(child.status_fd)
        if child.handoff:
            child.handoff.close()
        raise _child_error(plan, report)
    if child.handoff:
        try:
            child.egress_listener = child.handoff.receive()  # sent before the barrier: already queued
        except OSError as e:
            # cannot happen once the command executed; if it does, the command never runs unserved
            pidfd.send(child.pidfd, signal.SIGKILL)
            os.waitid(os.P_PIDFD, child.pidfd, os.WEXITED)
            os.close(child.pidfd)
            raise SetupError(f"cell setup failed at step 'egress': {e}", step="egress") from None


def abandon(child: Child, read_report: bool = False) -> bytes:
    """The command must never run: the child sees EOF at the barrier and exits
    without exec; reaped here. Returns its setup report if `read_report`."""
    os.close(child.barrier_fd)
    report = _read_all(child.report_fd) if read_report else os.close(child.report_fd)
    if child.status_fd is not None:
        os.close(child.status_fd)
    if child.handoff:
        child.handoff.close()
    if child.pidfd is not None:
        os.close(child.pidfd)
    _close_tmp(child)
    _reap(child.pid)
    return report or b""


def _close_tmp(child: Child) -> None:
    if child.tmp_fd is not None:
        os.close(child.tmp_fd)
        child.tmp_fd = None


def collect(child: Child) -> tuple[int | None, int | None]:
    """Reap the leader once its tree is dead: (exit status, killing signal) of the command."""
    info = os.waitid(os.P_PIDFD, child.pidfd, os.WEXITED)
    os.close(child.pidfd)
    if child.tmp_fd is not None:
        child.tmp_used = tmp_bytes(child.tmp_fd)
        _close_tmp(child)
    status = sig = None
    if info.si_code == os.CLD_EXITED:
        status = info.si_status
    else:
        sig = info.si_status
    if child.status_fd is not None:  # a PID-namespace init: the command's own status
        status, sig = pidinit.command_status(child.status_fd, status, sig)
    return status, sig


def _child_error(plan, report: bytes) -> Exception:
    """The error a child reported on the close-on-exec pipe ("step\\0errno\\0message")."""
    step, code, msg = (report.decode(errors="replace").split("\0") + ["", ""])[:3]
    code = int(code or 0)
    if step == "exec":
        exe = plan.spec.exe
        if code == errno.ENOENT:
            interp = _interpreter(exe)
            if interp is not None:  # the file is there: its #! interpreter is not (in the cell's view)
                return NotFound(f"{plan.spec.argv[0]}: its interpreter {interp} (the #! line of {exe}) "
                                "was not found", step=step)
            return NotFound(f"{plan.spec.argv[0]}: {exe}: {msg}", step=step)
        return NotExecutable(f"{plan.spec.argv[0]}: {exe}: {msg}", step=step)
    if step == "user_namespace":
        return _userns_refused(msg, code)
    if step == "proc" and code == errno.EPERM and os.geteuid() != 0:
        # the kernel mounts a new proc in a user namespace only where one is fully visible already
        # (mount_too_revealing): a container engine's masks over /proc files (/proc/keys, ...) forbid it
        return SetupError(f"cell setup failed at step 'proc': {msg}: a normal user's cell mounts its PID "
                          "namespace's own /proc, which the kernel refuses while files of /proc are masked (a "
                          "container engine's masked paths); fix: run the container with --security-opt "
                          "systempaths=unconfined (Kubernetes: securityContext.procMount: Unmasked), run agnsup as "
                          'root, or accept a reduced cell: isolation.reduced = ["pid_namespace"] (docs/hosts.md)',
                          step=step, errno=code)
    if os.geteuid() == 0 and (refused := reduced_refusal(step, msg, code, plan)) is not None:
        return refused
    if code == errno.EPERM and step in ("unshare", "mount", "userns") and os.geteuid() != 0:
        # what is needed, not only what failed (issue 12 item 11)
        return SetupError(f"cell setup failed at step {step!r}: {msg}: a cell's private mount namespace needs "
                          f"CAP_SYS_ADMIN, which uid {os.geteuid()} lacks here; run agnsup as root (sudo), or see "
                          "`agnsup doctor` and docs/hosts.md for unprivileged hosts", step=step, errno=code)
    return SetupError(f"cell setup failed at step {step!r}: {msg}", step=step, errno=code)


def _interpreter(exe: str) -> str | None:
    """The interpreter a script's #! line names, if `exe` is one."""
    try:
        with open(exe, "rb") as f:
            head = f.read(256)
    except OSError:
        return None
    if not head.startswith(b"#!"):
        return None
    words = head[2:].split(b"\n", 1)[0].split()
    return words[0].decode(errors="replace") if words else None


_JOIN_CLONE3 = "clone3(CLONE_INTO_CGROUP) for v2, cgroup.procs by the controller for v1"
_JOIN_FORK = "fork, cgroup.procs by the child"


# clone3 failures that mean "not here" (old kernel, seccomp of a container,
# no cgroup2 delegation): fork and write cgroup.procs instead.
_CLONE3_UNAVAILABLE = (errno.ENOSYS, errno.EPERM, errno.EINVAL, errno.E2BIG, errno.EOPNOTSUPP, errno.EBUSY,
                       errno.EACCES)


# errnos of a refused user namespace (user_namespaces(7), clone(2)): a sysctl, an LSM, a seccomp
# filter (EPERM), user.max_user_namespaces reached (ENOSPC; EUSERS before 4.9), or no clone3 at all
_USERNS_REFUSED = (errno.EPERM, errno.EACCES, errno.ENOSPC, errno.EUSERS, errno.ENOSYS)


def _userns_refused(msg: str, code: int | None) -> SetupError:
    """The one line for a normal user whose cells cannot have a user namespace here, with the fix."""
    blocked = userns.blocked_by_sysctl()
    fix = "; ".join(blocked) if blocked else ("something refuses unprivileged user namespaces here (an LSM such "
                                             "as AppArmor, or a seccomp filter: a container needs its runtime's "
                                             "user-namespace support); or run agnsup as root")
    return SetupError(f"cell setup failed at step 'user_namespace': {msg}: a normal user's cell gets its mount, "
                      f"network and PID namespaces only inside a user namespace of its own; fix: {fix}; or accept "
                      'a reduced cell: isolation.reduced = ["mount_namespace", "network_namespace", "pid_namespace"] '
                      "(docs/hosts.md)", step="user_namespace", errno=code)


def _clone_into_cgroup(path: str | None, flags: int) -> tuple[int | None, int | None]:
    """(pid, pidfd) of a child born in the cgroup2 directory `path` (None: in ours) with the
    namespaces `flags` asks for, (0, None) in that child, or (None, None) when clone3 cannot be used
    here and the caller must fork. Only for a single-threaded controller: the raw clone3
    skips glibc's fork handlers (linux/sys.py)."""
    if len(os.listdir("/proc/self/task")) != 1:
        return None, None
    cgfd = os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC) if path is not None else None
    try:
        pid, pidfd = lsys.clone3_into_cgroup(cgfd, flags)
    except OSError as e:
        if e.errno in _CLONE3_UNAVAILABLE:
            return None, None
        raise
    finally:
        if cgfd is not None:
            os.close(cgfd)
    return pid, (pidfd if pid else None)


def _clone3_from_a_forked_child(flags: int) -> int:
    """clone3(flags | CLONE_PARENT) from a throwaway child of ours, for a threaded controller (serve):
    the raw clone3 is safe only in a single-threaded process, and fork() makes one. CLONE_PARENT makes
    the new process our child, as if we had cloned it (we wait for it, its exit signal is ours, its
    PR_SET_PDEATHSIG follows our forking thread); the throwaway child writes its pid back and exits.
    Returns the pid here and 0 in the new process; raises the clone3 error here."""
    r, w = os.pipe()
    middle = os.fork()
    if middle == 0:
        os.close(r)
        try:
            # exit_signal 0: with CLONE_PARENT the kernel takes ours (SIGCHLD), and refuses any other
            pid, _ = lsys.clone3_into_cgroup(None, flags | lsys.CLONE_PARENT, exit_signal=0)
        except OSError as e:
            os.write(w, f"-{e.errno}".encode())
            os._exit(1)
        if pid == 0:
            os.close(w)
            return 0
        os.write(w, str(pid).encode())
        os._exit(0)
    os.close(w)
    try:
        answer = _read_all(r)  # closes r
    finally:
        os.waitpid(middle, 0)
    n = int(answer or -errno.ECHILD)
    if n < 0:
        raise OSError(-n, f"clone3: {os.strerror(-n)}")
    return n


def _fork_into_new_pid_namespace() -> int:
    """fork(), the child becoming PID 1 of a new PID namespace.

    unshare(CLONE_NEWPID) only changes where the caller's *next* child goes
    (pid_namespaces(7)); setns back to our own namespace right after the fork
    keeps every later fork of this controller where it was."""
    own = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
    try:
        lsys.unshare(lsys.CLONE_NEWPID)
        try:
            pid = os.fork()
        except BaseException:
            lsys.setns(own, lsys.CLONE_NEWPID)
            raise
    except BaseException:
        os.close(own)
        raise
    if pid == 0:
        os.close(own)
        return 0
    try:
        lsys.setns(own, lsys.CLONE_NEWPID)
    finally:
        os.close(own)
    return pid


def _read_all(fd: int) -> bytes:
    chunks = []
    try:
        while True:
            b = os.read(fd, 4096)
            if not b:
                return b"".join(chunks)
            chunks.append(b)
    finally:
        os.close(fd)


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass


class Waiter:
    """Waits for the leader; honours a timeout, stop requests and broken limits
    by stopping the tree (reaper.Tree: SIGTERM, then the kill when the grace
    period ends). Returns once the leader has exited, unreaped: its pid, the
    cell's session id, stays ours until `collect`, after the rest is reaped."""

    def __init__(self, child: Child, tree, grace: float, timeout: float | None, wake_fd: int | None = None,
                 pump=None, oom_fd: int | None = None):
        self.child, self.tree, self.grace, self.timeout = child, tree, grace, timeout
        self.wake_fd = wake_fd
        self.pump = pump        # output.Pump: the cell's stdout/stderr, counted against the cap
        self.oom_fd = oom_fd    # eventfd the v1 OOM killer signals (CgroupBackend.create)
        self._oom_at: float | None = None
        self.reason: str | None = None      # why we stopped it (first reason wins), None: it ended by itself
        self.cancel_reason: str | None = None
        self.term_sent_at: float | None = None
        self.stop_signal: int = signal.SIGTERM  # what the tree got first
        self.kill_method: str | None = None

    def request_stop(self, reason: str, cancel_reason: str | None = None, sig: int = signal.SIGTERM) -> None:
        """Send `sig` (SIGTERM) to the whole tree now; SIGKILL it when the grace period
        ends. First reason wins."""
        if self.reason is None:
            self.reason = reason
            self.cancel_reason = cancel_reason
        if self.term_sent_at is None:
            self.term_sent_at = time.monotonic()
            self.stop_signal = sig
            self.tree.term(sig)
            crashpoints.hit("cancel_grace")

    def stop_now(self, reason: str) -> None:
        """Kill the whole tree at once, no grace: the cell broke a limit. First reason wins."""
        if self.reason is None:
            self.reason = reason
        self._kill_tree()

    def grace_until(self) -> float | None:
        """When a stop in progress must have killed the rest (monotonic), else None."""
        return self.term_sent_at + self.grace if self.term_sent_at is not None else None

    def _on_oom(self) -> None:
        try:
            os.read(self.oom_fd, 8)
        except BlockingIOError:
            return
        # v1 has no memory.oom.group: the OOM killer takes one process, we take the rest.
        # The kernel notifies before it picks its victim (mem_cgroup_oom_notify precedes
        # out_of_memory), so we let it act first (the receipt then shows its kill in
        # oom_kills) and kill the rest once the counter moves, or OOM_SETTLE later.
        if self._oom_at is None:
            self._oom_at = time.monotonic()

    def _oom_due(self, now: float) -> bool:
        if self._oom_at is None or self.reason is not None:
            return False
        return now >= self._oom_at + OOM_SETTLE or (self.tree.oom_kills() or 0) > 0

    def wait(self, poll_wake=None) -> "Waiter":
        """Block until the leader exits; `poll_wake()` is called when wake_fd is readable.

        The same loop pumps the cell's output (if the role caps it) and watches
        the v1 OOM eventfd."""
        start = time.monotonic()
        p = select.poll()
        p.register(self.child.pidfd, select.POLLIN)
        if self.wake_fd is not None:
            p.register(self.wake_fd, select.POLLIN)
        if self.oom_fd is not None:
            p.register(self.oom_fd, select.POLLIN)
        pumped: dict[int, int] = {}
        while True:
            if self.pump is not None:
                pumped = _sync_poll(p, pumped, self.pump.interest())
            now = time.monotonic()
            deadlines = []
            if self.timeout and self.term_sent_at is None:
                deadlines.append(start + self.timeout)
            if self.term_sent_at is not None:
                deadlines.append(self.term_sent_at + self.grace)
            if self._oom_at is not None and self.reason is None:
                deadlines.append(now + 0.02)  # look at the OOM counter again shortly
            wait_ms = None if not deadlines else max(0, int((min(deadlines) - now) * 1000) + 1)
            events = p.poll(wait_ms)
            for fd, mask in events:
                if fd == self.wake_fd and poll_wake:
                    poll_wake()
                elif fd == self.oom_fd:
                    self._on_oom()
                elif fd in pumped:
                    self.pump.handle(fd, mask)
            if self.pump is not None and self.pump.overflowed:
                self.stop_now("output_limit")
            if self._oom_due(time.monotonic()):
                self.stop_now("oom")
            if any(fd == self.child.pidfd for fd, _ in events):
                return self
            now = time.monotonic()
            if self.timeout and self.term_sent_at is None and now >= start + self.timeout:
                self.request_stop("timeout")
            elif self.term_sent_at is not None and now >= self.term_sent_at + self.grace:
                self._kill_tree()

    def _kill_tree(self) -> None:
        if self.kill_method is None:
            crashpoints.hit("cancel_frozen")
            self.kill_method = self.tree.kill()


def _sync_poll(p, current: dict[int, int], want: dict[int, int]) -> dict[int, int]:
    """Make the poll object's registrations for the pump equal `want`."""
    for fd in current.keys() - want.keys():
        p.unregister(fd)
    for fd, mask in want.items():
        if current.get(fd) != mask:
            p.register(fd, mask)
    return want


def probe(fn) -> tuple[bool, str]:
    """Run `fn()` in a throwaway child, never a cell: (succeeded, error text).
    `agnsup doctor` proves a kernel feature works here by using it once."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            fn()
            os._exit(0)
        except BaseException as e:  # noqa: BLE001
            try:
                os.write(w, str(e).encode(errors="replace")[:500])
            finally:
                os._exit(1)
    os.close(w)
    err = _read_all(r)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0, err.decode(errors="replace")


def run_helper(argv: list[str], timeout: float, env: dict | None = None) -> tuple[int, str, str]:
    """Run one host helper by absolute path (never through PATH), with only the environment `env`
    (default: LC_ALL=C) and no stdin: (exit status, stdout, stderr). For the backends' one-time set-up (busctl: agnsup's
    systemd unit), never for a cell."""
    import subprocess
    if not os.path.isabs(argv[0]):
        raise ValueError(f"helper {argv[0]!r} is not an absolute path")
    try:
        cp = subprocess.run(argv, env=env if env is not None else {"LC_ALL": "C"}, stdin=subprocess.DEVNULL, capture_output=True,
                            timeout=timeout, text=True)
    except (OSError, subprocess.TimeoutExpired) as e:
        return 127, "", str(e)
    return cp.returncode, cp.stdout, cp.stderr
