"""A cell's leader: spawned into its place and held at the barrier (spawn), let exec once its identity is
journaled (release) or never (abandon), reaped once its tree is dead (collect). Its setup between fork and
execve is steps.STEPS; how it is born, clone.new."""
from __future__ import annotations

import errno
import os
import signal
from contextlib import suppress

from ..errors import NotExecutable, NotFound, SetupError
from ..linux import host, landlock, netns, pidfd, pidinit, proc, seccomp
from ..linux import sys as lsys
from ..util.record import Record
from . import clone, namespaces
from .helpers import read_all, shelve, tmp_entries
from .steps import Setup, child as run_steps


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
    netns_watch: int | None = None  # deny/loopback: the child sends its netns here (steps._netns_watch)
    netns_fd: int | None = None    # ... then the cell's netns, held until it ended (its counters: netns_tries)
    netns_base: dict | None = None  # ... the counters at its start in a shared netns (a fresh one starts at 0)
    netns_why: str | None = None   # ... or why we hold none
    reap_channel: int | None = None  # born in a fork server: its parent, which reaps it when asked here (_wait)
    reap_asked: bool = False         # ... asked already (ask_reap), the answer read by _wait


def spawn(plan, backend, place, stdio: tuple | None = None, forker=None, ctty: bool = False,
          netns_fd: int | None = None, tmp_spare: "TmpSpare | None" = None,
          mount_spare: "MountSpare | None" = None, spare=None) -> Child:
    """Fork the cell leader into `place` and hold it at the barrier.

    Returns with the child's identity; the caller journals it and then lets the
    command run with `release(plan, child)`, or never with `abandon(child)`.
    `forker`: a Supervisor's (supervisor._Forker): the leader is born in its fork server
    (process/forkserver.py), not in this threaded process; None: forked here (a one-cell controller).
    `ctty`: fd 0 is a pty that becomes the cell's controlling terminal (TIOCSCTTY). `netns_fd`: the network
    namespace the cell joins instead of making its own (its pod's, agnsup/pod.py), or (that, the user
    namespace a normal user's cell joins instead of making its own); spawn closes them. `tmp_spare`: the
    controller's TmpSpare (a Supervisor's), the cell's /tmp taken from it when one with its entries is ready;
    `mount_spare`: its MountSpare, the /dev, hides and masks made ahead that the cell's plan asks for.
    `spare`: a cellspare.Spare the broker took for this cell: its parked leader, born in `place`, gets the Setup
    instead of a new leader being cloned."""
    namespaces.reap_exited()
    netns_fd, pod_userns = netns_fd if isinstance(netns_fd, tuple) else (netns_fd, None)
    try:
        s = _prepare(plan, backend, place, netns_fd, pod_userns, tmp_spare, mount_spare,
                     terminal=any(fd is not None and os.isatty(fd) for fd in stdio or ()))
    except BaseException as e:
        for fd in (netns_fd, pod_userns):
            if fd is not None:
                os.close(fd)
        if isinstance(e, OSError):
            raise _failed("confinement", e, plan) from None
        raise
    s.stdio, s.controller, s.ctty = stdio, os.getpid(), ctty
    s.barrier_r, barrier_w = os.pipe()
    err_r, s.err_w = os.pipe()
    status_r = channel = None
    watch_r, s.netns_watch = lsys.seqpacket_pair() if watches_netns(plan) else (None, None)
    s.in_userns = s.ids is not None and plan.pid_namespace
    cgroup2 = backend.clone_dir(place) if place.node else None

    def fork() -> tuple[int, int | None, bool]:
        pid, fd, s.born = clone.new(cgroup2, plan.pid_namespace, s.in_userns, s.pod_userns)
        if pid == 0:
            os.close(barrier_w)
            os.close(err_r)
            for fd in (status_r, watch_r):
                if fd is not None:
                    os.close(fd)
            run_steps(s)
        return pid, fd, s.born

    try:
        if plan.pid_namespace:
            status_r, s.status_w = os.pipe()
        if spare is not None:  # parked in its cell's directories, its early steps done (process/cellspare.py)
            from .forkserver import bind
            lead = spare.lead
            pid, fd, born, channel = spare.bound()
            s.born = born
            try:
                bind(lead, s)
            except OSError:
                os.close(channel)  # the server reaps it
                os.close(fd)
                raise
        elif forker is not None:  # a Supervisor's: born in its fork server (process/forkserver.py)
            pid, fd, born, channel = forker.spawn(s, cgroup2)
        else:
            pid, fd, born = fork()
    except OSError as e:
        for fd in (barrier_w, err_r, status_r, watch_r):
            if fd is not None:
                os.close(fd)
        _close_setup(s)
        from .forkserver import ServerGone  # (a Supervisor's spawn loaded it already)
        if isinstance(e, ServerGone):
            raise SetupError(f"cell setup failed at step 'fork_server': {e.strerror}", step="fork_server",
                             errno=e.errno) from None
        if s.ids is not None and e.errno in namespaces.USERNS_REFUSED:
            raise namespaces.userns_refused(e.strerror or str(e), e.errno) from None
        raise _failed("pid_namespace", e, plan) from None
    _close_setup(s, forked=True)
    child = Child(pid=pid, pidfd=fd, identity={}, status_fd=status_r, barrier_fd=barrier_w, report_fd=err_r,
                  cgroup_join=(clone.JOIN_FORK if not born else clone.JOIN_CLONE3_USERNS if s.in_userns
                               else clone.JOIN_CLONE3), handoff=s.egress,
                  tmp_fd=(s.premade or {}).get("tmp"), netns_watch=watch_r, reap_channel=channel)
    try:
        if born and s.in_userns:
            # Born in a user namespace of its own, the child cannot join its v1 hierarchies itself: moved here
            # (cgroup.procs: the kernel's global lock, which may wait an RCU grace period, overlapping the child's
            # setup). Before the barrier, so the command still never runs outside any of its cgroups. Any other
            # born child joins them itself, by `tasks` (steps: "cgroup").
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
    report = read_all(child.report_fd)
    child.report_fd = None
    if report:
        _wait(child)
        _close(child)
        raise _child_error(plan, report)
    _hold_netns(child)
    if child.handoff:
        try:
            child.egress_listener = child.handoff.receive()  # sent before the barrier: already queued
        except OSError as e:
            # cannot happen once the command executed; if it does, the command never runs unserved
            pidfd.send(child.pidfd, signal.SIGKILL)
            _wait(child)
            os.close(child.pidfd)
            raise SetupError(f"cell setup failed at step 'egress': {e}", step="egress") from None


def abandon(child: Child, read_report: bool = False) -> bytes:
    """The command must never run: the child sees EOF at the barrier and exits
    without exec; reaped here. Returns its setup report if `read_report`."""
    os.close(child.barrier_fd)
    report = read_all(child.report_fd) if read_report else os.close(child.report_fd)
    with suppress(ChildProcessError):
        _wait(child)
    _close(child)
    return report or b""


def _wait(child: Child):
    """Reap the leader (waiting for its exit): its waitid result as (si_code, si_status); None when it was born
    in a fork server that is gone and the kernel cannot say how it ended (before 6.15: collect says SIGKILL,
    which PR_SET_PDEATHSIG sent it; a "keep" leader that outlived its server ends unknown there)."""
    if child.reap_channel is None:
        info = os.waitid(os.P_PIDFD, child.pidfd, os.WEXITED)
        return info.si_code, info.si_status
    from .forkserver import reap  # loaded by a Supervisor only: `agnsup run` never has a channel
    channel, child.reap_channel = child.reap_channel, None
    info = reap(channel, child.reap_asked)
    if info is None:  # the server is gone: pidfs may still know how the leader ended (6.15+)
        status = _reaped_elsewhere(child.pidfd)
        if status is not None:
            info = (os.CLD_EXITED, os.WEXITSTATUS(status)) if os.WIFEXITED(status) else \
                (os.CLD_KILLED, os.WTERMSIG(status))
    return info


REAPED_ELSEWHERE = 5.0  # seconds a leader whose fork server died is waited for to be reaped by its new parent


def _reaped_elsewhere(fd: int) -> int | None:
    """The wait status of a leader whose fork server died, once its new parent (init, a subreaper) reaped it:
    pidfd.exit_status, asked for up to REAPED_ELSEWHERE s after its exit (an init may reap late: this project's
    VMs' reaps orphans every ~1.5 s); None when the kernel cannot say."""
    import select
    import time
    select.select([fd], [], [])  # its exit (a leader the server left: PR_SET_PDEATHSIG, or the barrier's EOF)
    deadline = time.monotonic() + REAPED_ELSEWHERE
    while True:
        status = pidfd.exit_status(fd)
        if status is None:
            with suppress(ChildProcessError):  # we are its new parent (a subreaper): ours to reap
                info = os.waitid(os.P_PIDFD, fd, os.WEXITED | os.WNOHANG)
                if info is not None:
                    return (info.si_status << 8) if info.si_code == os.CLD_EXITED else info.si_status
        if status is not None or time.monotonic() > deadline:
            return status
        time.sleep(0.01)


def watches_netns(plan) -> bool:
    """A cell without network (deny, loopback) in a netns of its own: the controller holds that namespace, to
    tell a failure that tried to reach out from one that did not (tool.network_hint)."""
    return bool(plan.new_netns) and plan.network in ("deny", "loopback")


NETNS_MESSAGE = 1 << 16  # bytes of the leader's netns message: /proc/net/snmp and snmp6 are ~1.3 and ~3.2 KB


def _hold_netns(child: Child) -> None:
    """Once the command executed: the cell's network namespace, which the child sent before the barrier
    (SCM_RIGHTS: already queued, whatever the cell did since; the fd in flight kept the namespace, and now
    ours keeps it and its counters after the cell's last process left it). No /proc/PID/ns/net: by now
    the child may have other ids, which a controller without CAP_SYS_PTRACE could not open it through."""
    if child.netns_watch is None:
        return
    try:
        said, fds = lsys.recv_fds(child.netns_watch, NETNS_MESSAGE, wait=False)  # a pod's: ~4.5 KB of text
        for extra in fds[1:]:
            os.close(extra)
        fd = fds[0] if fds else None
        if fd is not None:
            child.netns_fd = fd
            child.netns_base = None if said == b"1" else netns.from_raw(said)
        else:
            child.netns_why = "the cell sent no network namespace"
    except OSError as e:
        child.netns_why = f"the cell's network namespace could not be held: {e.strerror or e}"
    finally:
        os.close(child.netns_watch)
        child.netns_watch = None


def netns_tries(child: Child, read: bool) -> dict | None:
    """Once the cell's tree is dead: what it tried that had no route out of its network namespace
    (linux/netns.py: {"no_route", "ipv4_no_route", "ipv6_no_route"}), when `read` (a failed cell: the
    counters are read only then); {"why": ...} when they could not be read; None when not asked or no
    namespace was held. The namespace is let go either way."""
    fd, child.netns_fd = child.netns_fd, None
    try:
        if not read:
            return None
        if fd is None:
            return {"why": child.netns_why} if child.netns_why else None
        try:
            return netns.tried(namespaces.netns_counters(fd), child.netns_base)
        except OSError as e:
            return {"why": f"the counters of the cell's network namespace could not be read: {e.strerror or e}"}
    finally:
        if fd is not None:
            os.close(fd)


def _close(child: Child) -> None:
    """What the controller holds of a leader that never ran its command."""
    if child.reap_channel is not None:  # not reaped here: the server reaps it when it exits
        os.close(child.reap_channel)
        child.reap_channel = None
    for fd in (child.netns_watch, child.netns_fd):
        if fd is not None:
            os.close(fd)
    child.netns_watch = child.netns_fd = None
    if child.status_fd is not None:
        os.close(child.status_fd)
    if child.handoff:
        child.handoff.close()
    if child.pidfd is not None:
        os.close(child.pidfd)
    _close_tmp(child)


def _close_tmp(child: Child) -> None:
    if child.tmp_fd is not None:
        os.close(child.tmp_fd)
        child.tmp_fd = None


def ask_reap(child: Child) -> None:
    """The leader has exited: a fork server's child is reaped by the server, asked here so that its round trip
    overlaps the caller's work until `collect` reads the answer. Only where its pid needs no keeping meanwhile (the
    caller's say: Controller.finish)."""
    if child.reap_channel is not None and not child.reap_asked:
        from .forkserver import ask_reap as ask
        child.reap_asked = ask(child.reap_channel)


def collect(child: Child) -> tuple[int | None, int | None]:
    """Reap the leader once its tree is dead: (exit status, killing signal) of the command.

    A PID namespace's init reported the command's own status on its pipe before its exit: then its own waitid
    status says nothing more, and a fork server's child is left for the server to reap (asked, its answer not
    waited for: no round trip to another process on the cell's path). Without a report (the init was killed)
    its status is the cell's, read from the server as before."""
    report = None
    if child.status_fd is not None:  # a PID-namespace init: the command's own status
        fd, child.status_fd = child.status_fd, None
        report = pidinit.command_status(fd)
    if report is not None and child.reap_channel is not None:
        from .forkserver import ask_reap as ask  # (a Supervisor's: loaded by its spawn)
        channel, child.reap_channel = child.reap_channel, None
        if not child.reap_asked:
            ask(channel)
        os.close(channel)  # the server reaps it all the same; its answer goes nowhere
        info = None
    else:
        info = _wait(child)
    os.close(child.pidfd)
    if child.tmp_fd is not None:  # the bytes in use on the cell's /tmp tmpfs
        sv = os.fstatvfs(child.tmp_fd)
        child.tmp_used = (sv.f_blocks - sv.f_bfree) * sv.f_frsize
        _close_tmp(child)
    if report is not None:
        return report
    status = sig = None
    if info is None:  # its fork server died and the kernel killed it (PR_SET_PDEATHSIG): SIGKILL
        sig = signal.SIGKILL
    elif info[0] == os.CLD_EXITED:
        status = info[1]
    else:
        sig = info[1]
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
        return namespaces.userns_refused(msg, code)
    if step == "proc" and code == errno.EPERM and os.geteuid() != 0:
        # the kernel mounts a new proc in a user namespace only where one is fully visible already
        # (mount_too_revealing): a container engine's masks over /proc files (/proc/keys, ...) forbid it
        return SetupError(f"cell setup failed at step 'proc': {msg}: a normal user's cell mounts its PID "
                          "namespace's own /proc, which the kernel refuses while files of /proc are masked (a "
                          "container engine's masked paths); fix: run the container with --security-opt "
                          "systempaths=unconfined (Kubernetes: securityContext.procMount: Unmasked), run agnsup as "
                          'root, or accept a reduced cell: isolation.reduced = ["pid_namespace"] (docs/hosts.md)',
                          step=step, errno=code)
    if os.geteuid() == 0 and (refused := namespaces.reduced_refusal(step, msg, code, plan)) is not None:
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


def _failed(step: str, e: OSError, plan) -> SetupError:
    """The controller's own step `step` failed: the host refuses a namespace (reduced_refusal), or another cause."""
    return namespaces.reduced_refusal(step, e.strerror or str(e), e.errno, plan) or \
        SetupError(f"cell setup failed at step {step!r}: {e.strerror or e}", step=step, errno=e.errno)


def _prepare(plan, backend, place, netns_fd: int | None = None, pod_userns: int | None = None,
             tmp_spare: "TmpSpare | None" = None, mount_spare: "MountSpare | None" = None,
             terminal: bool = False) -> Setup:
    """What the child needs that the controller builds before fork (steps.Setup); `terminal`: its stdio holds one."""
    # first: closed whatever fails below
    s = Setup(plan=plan, backend=backend, place=place, netns_fd=netns_fd, pod_userns=pod_userns,
              netns_shared=netns_fd is not None)  # a pod's: the hint counts what this cell added
    if plan.seccomp_refuse is not None:
        s.filter = seccomp.build(plan.seccomp_refuse)
    if plan.landlock_writable is not None:
        s.ruleset = landlock.build(plan.landlock_writable, plan.landlock_abi, log_tag=plan.landlock_log_tag)
    if plan.user_namespace:
        s.ids = (os.getuid(), os.getgid())
    if plan.pid_namespace:
        s.init_name = pidinit.own_name_plan()
    if plan.mapped is not None:
        s.userns_fd = namespaces.cell_userns()
    if plan.tmp_tmpfs:
        s.premade = {"tmp": make_tmp(plan, tmp_spare)}
        if mount_spare is not None:
            s.premade.update(mount_spare.take(plan, terminal))
    if plan.egress is not None:
        from ..egress.handoff import Handoff  # imports socket: only for roles that use the proxy
        s.egress = Handoff(plan.egress["proxy_port"])
    if plan.new_netns and s.netns_fd is None and s.ids is None and not host.net_admin():
        try:
            s.netns_fd = namespaces.cell_netns()
        except BaseException as e:
            _close_setup(s)
            if isinstance(e, OSError):
                raise namespaces.netns_refused(e) from None
            raise
    return s


def _close_setup(s: Setup, forked: bool = False) -> None:
    """The controller's copies of what it made for the child: once it is forked (the /tmp tmpfs it keeps, to
    measure it when the cell ends; the egress handoff waits for the listener), or when there is none."""
    for fd in (s.barrier_r, s.err_w, s.status_w, s.netns_fd, s.netns_watch, s.pod_userns,
               *(fd for key, fd in (s.premade or {}).items() if not (forked and key == "tmp"))):
        if fd is not None:
            os.close(fd)
    if s.ruleset:
        s.ruleset.close()
    if s.egress:
        s.egress.after_fork() if forked else s.egress.close()


def make_tmp(plan, spare: "TmpSpare | None" = None) -> int:
    """The cell's /tmp: a tmpfs of limits.tmp_max (off the state root's disk; a write past it fails
    with ENOSPC), owned by the cell's ids, filled with a copy of the staging tmpdir the broker made
    (HOME, @runtime links, cache mount points); a detached mount the child attaches at /tmp. Made here,
    in the controller, so the controller can still measure it once the cell's namespace is gone.
    `spare`: a controller of many cells' TmpSpare: its tmpfs made ahead with exactly these entries, if it has
    one, instead of a new one (then only the staging tmpdir is merged into it, as below)."""
    key = _tmp_key(plan)
    fd = spare.take(key) if spare is not None else None
    if fd is None:
        fd = _new_tmp(key)
    try:
        from ..linux import mounts
        mounts.copy_tree(plan.tmpdir, fd, merge=True)  # what home.make staged on disk for a mount step too
    except BaseException:
        os.close(fd)
        raise
    return fd


def _tmp_key(plan) -> tuple:
    """Everything a cell's new /tmp tmpfs is made from before the staging tmpdir is merged: its size, owner and
    entries (tmp_entries: every path, mode, link target and file content; the modes carry the umask)."""
    return (str(plan.limits["tmp_max"]), plan.cell_ids(), tuple(tmp_entries(plan)))


def _new_tmp(key: tuple) -> int:
    size, ids, entries = key
    opts = {"size": size, "mode": "1777"}
    if ids is not None:
        opts.update(uid=str(ids[0]), gid=str(ids[1]))
    fd = lsys.fsmount_new("tmpfs", opts, lsys.MOUNT_ATTR_NOSUID | lsys.MOUNT_ATTR_NODEV)
    try:
        _fill_tmp(entries, fd, ids)
    except BaseException:
        os.close(fd)
        raise
    return fd


class _Spare:
    """Detached mounts a controller of many cells made ahead, by key, in the order made: at most SLOTS kept (the
    oldest let go), each taken once; `close` lets what is left go (a detached mount is freed with its last
    descriptor; a killed controller's go with it)."""

    SLOTS = 4

    def __init__(self):
        import threading
        self._guard = threading.Lock()
        self._ready: dict = {}  # key -> what was made (_fd: its descriptor), in the order made
        self.closed = False

    @staticmethod
    def _fd(made) -> int:
        return made

    def _pop(self, key):
        with self._guard:
            return self._ready.pop(key, None)

    def _wanted(self, key) -> bool:
        with self._guard:
            return not self.closed and key not in self._ready

    def _keep(self, key, made) -> None:
        with self._guard:
            drop = shelve(self._ready, key, made, self.SLOTS, self.closed)
        for old in drop:
            os.close(self._fd(old))

    def close(self) -> None:
        with self._guard:
            self.closed = True
            made, self._ready = list(self._ready.values()), {}
        for old in made:
            os.close(self._fd(old))


class TmpSpare(_Spare):
    """A controller of many cells (the Supervisor) makes the next cell's /tmp tmpfs ahead, after a cell's result
    and off the request's path: a new tmpfs (never one a cell had: each is taken once, by one cell) filled from
    that cell's key (_tmp_key: size, owner, every entry and its content). A cell takes it only when its own key,
    computed from its own plan at its start, is equal: a role, home config, tool file, umask or limit changed in
    between gives another key, and the cell's tmpfs is made on its path as before. At most SLOTS keys are kept
    (a controller serving several roles)."""

    def take(self, key: tuple) -> int | None:
        return self._pop(key)

    def refill(self, plan) -> None:
        """A tmpfs for the next cell with `plan`'s key, unless one is ready. Best effort: a failure makes none."""
        if not getattr(plan, "tmp_tmpfs", False):
            return
        try:
            key = _tmp_key(plan)
            if not self._wanted(key):
                return
            fd = _new_tmp(key)
        except (OSError, ValueError):
            return
        self._keep(key, fd)


class MountSpare(_Spare):
    """A controller of many cells (the Supervisor) makes what a cell's dev, hide, empty and mask steps mount ahead,
    after a cell's result and off the request's path (linux.mounts.make_ahead: each a new detached mount, never one
    a cell had: each is taken once, by one cell, and its /dev/shm and devpts are its own). A cell takes those whose
    key (mounts.ahead_key: the step as its own plan says it) is ready; the leader attaches one only where its own
    look at the host agrees (mounts.apply), else mounts as before. At most SLOTS are kept (keys of other plans are
    dropped oldest first), at most PER_CELL go to one cell (a request's descriptors: forkserver.MAX_FDS)."""

    SLOTS = 96
    PER_CELL = 32
    no_dev = False  # the kernel cannot make a /dev ahead (before 6.15 nothing mounts inside a detached mount)

    @staticmethod
    def _fd(made) -> int:
        return made[1]  # (apply's name for it, the detached mount)

    @staticmethod
    def _keys(plan) -> list[tuple]:
        if not (getattr(plan, "tmp_tmpfs", False) and plan.mount_namespace and not plan.user_namespace):
            return []  # a root controller's cells only (the leader mounts as root in the host's user namespace)
        from ..linux import mounts
        return [k for k in map(mounts.ahead_key, plan.mount_ops) if k is not None][:MountSpare.PER_CELL]

    def take(self, plan, terminal: bool = False) -> dict[str, int]:
        """{apply's name: fd} of what is ready for `plan`'s steps, each taken out of the spare; no /dev for a cell
        whose stdio holds a terminal (its leader makes one with /dev/console: one left unused there would be
        unmounted on its path, an RCU grace period)."""
        keys = [k for k in self._keys(plan) if not (terminal and k[0] == "dev")]
        return {name: fd for name, fd in filter(None, map(self._pop, keys))}

    def refill(self, plan) -> None:
        """What `plan`'s steps mount, made for the next cell, where not ready. Best effort: a failure makes none."""
        from ..linux import mounts
        for key in self._keys(plan):
            if (self.no_dev and key[0] == "dev") or not self._wanted(key):
                continue
            try:
                made = mounts.make_ahead(key)
            except (OSError, ValueError):
                self.no_dev = self.no_dev or key[0] == "dev"  # the hides and masks need no 6.15
                continue
            if made is not None:
                self._keep(key, made)


def _fill_tmp(entries, fd: int, ids: tuple | None) -> None:
    """The tmpfs's entries (tmp_entries: HOME, links, tool files, cache mount points), written straight into
    it (home.make staged none of them on disk); make_tmp then merges what else the broker put in the staging
    tmpdir (a secret cell's CA files: broker._trust)."""
    for e in entries:
        kind, rel = e[0], e[1]
        if kind == "dir":
            os.mkdir(rel, e[2], dir_fd=fd)
            os.chmod(rel, e[2], dir_fd=fd)  # exactly the mode, as copy_tree gave it from disk
        elif kind == "link":
            os.symlink(e[2], rel, dir_fd=fd)
        else:
            out = os.open(rel, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=fd)
            try:
                os.write(out, e[3])
                os.fchmod(out, e[2])
            finally:
                os.close(out)
        if ids is not None and kind != "link":  # home.make leaves its links the controller's, as made
            os.chown(rel, *ids, dir_fd=fd, follow_symlinks=False)

