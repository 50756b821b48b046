"""The namespaces a host gives a cell: made for it by throwaway children (cell_userns, cell_netns), probed
once per controller process (namespaces_refused, idmap_refused), and the one line that names the fix when
the host refuses one (reduced_refusal, userns_refused, netns_refused)."""
from __future__ import annotations

import errno
import os

from ..errors import SetupError
from ..linux import host, netns, proc, userns
from ..linux import sys as lsys
from .helpers import probe
from .steps import REFUSABLE

# errnos of a refused user namespace (user_namespaces(7), clone(2)): a sysctl, an LSM, a seccomp
# filter (EPERM), user.max_user_namespaces reached (ENOSPC; EUSERS before 4.9), or no clone3 at all
USERNS_REFUSED = (errno.EPERM, errno.EACCES, errno.ENOSPC, errno.EUSERS, errno.ENOSYS)

# isolation.reduced's pieces in the schema's order (policyfile.REDUCIBLE; this layer may not import it or the
# compiler: tests/unit/test_reduced_policy.py holds the copies equal)
REDUCIBLE_ORDER = ("mount_namespace", "network_namespace", "pid_namespace", "cgroup")


def cell_netns() -> int:
    """A network namespace for one cell of a root controller that lacks CAP_NET_ADMIN, owned by a user
    namespace of its own (linux/netns.py), its lo up: an fd the child joins by setns. A throwaway child
    makes both, opens its own /proc/self/ns/net and sends us the fd (SCM_RIGHTS: we could not open its
    /proc entry ourselves, as its euid is the namespace's owner now and a container's root has no
    CAP_SYS_PTRACE), then exits; the fd keeps the namespace until the cell is in it. One fork per cell,
    only on such hosts."""
    ours, theirs = lsys.seqpacket_pair()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(ours)
            try:
                netns.own_user_and_net_namespace(userns.netns_owner())
                lsys.send_fds(theirs, b"1", [proc.ns("net")])
            except OSError as e:
                os.write(theirs, f"{e.errno or 0}\0{e.strerror or e}".encode(errors="replace"))
        finally:
            os._exit(0)
    os.close(theirs)
    try:
        answer, fds = lsys.recv_fds(ours, 4096)  # b"": it died before saying anything
    finally:
        os.close(ours)
        _let_go(pid)  # it exits by itself
    if answer == b"1" and len(fds) == 1:
        return fds[0]
    for fd in fds:
        os.close(fd)
    code, _, msg = answer.decode(errors="replace").partition("\0")
    raise _own_netns_error(int(code) if code.isdigit() else errno.EPERM, msg or "the helper exited")


def _own_netns_error(code: int, msg: str) -> OSError:
    """cell_netns's failure (and the pod keeper's, keeper_refusal): netns_refused names its fix."""
    return OSError(code, f"a network namespace of the cell's own: {msg}")


def netns_counters(fd: int) -> dict[str, int]:
    """The no-route counters of the network namespace `fd` names (linux/netns.py), for a cell that ended. Root
    reads them on this thread; a normal user's cell namespace is owned by the cell's user namespace, which
    only a single-threaded process may enter: a throwaway helper enters it, then the namespace, and reads."""
    if os.geteuid() == 0:
        return netns.counters_in(fd)

    def read() -> bytes:
        netns.enter_owner(fd)
        lsys.setns(fd, lsys.CLONE_NEWNET)
        return netns.encode(netns.counters_here())
    ok, said = probe(read)
    if not ok:
        raise OSError(errno.EPERM, said or "the helper exited")
    return netns.decode(said.encode())


_cell_userns: list[int] = []   # the fd of the cells' user namespace, made once per controller process
_idmap_by_dev: dict[int, str | None] = {}  # st_dev -> None (id-mapped mounts work there) or why not


def cell_userns() -> int:
    """The user namespace a root controller's mapped cells join (linux/userns.py: 0..65535 inside, the
    cells' range outside): made once per controller process and kept open, which keeps it alive. A
    throwaway child unshares it and waits; we write its maps (as host root: any range) and open
    /proc/CHILD/ns/user; the child exits. Every cell of this controller shares it: each still has its
    own mount, network, IPC and PID namespaces, Landlock domain and seccomp filter, and the namespace
    owns none of them (docs/isolation.md, "Doors: identity")."""
    if _cell_userns:
        return _cell_userns[0]
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
    try:
        if os.read(ready_r, 1) != b"1":  # EOF: it exited without a namespace
            raise OSError(errno.EPERM, "the throwaway child could not unshare a user namespace")
        userns.write_cell_maps(pid)
        fd = proc.ns("user", pid)
    finally:
        os.close(ready_r)
        os.close(done_w)  # it exits now; reaped without waiting for it (about 0.5 ms of a start)
        _let_go(pid)
    _cell_userns.append(fd)
    return fd


_userns_exited: list[int] = []  # throwaway children told to exit, not yet reaped


def _let_go(pid: int) -> None:
    """A throwaway child that exits by itself: reaped without waiting for it, now or later."""
    _userns_exited.append(pid)
    reap_exited()


def reap_exited() -> None:
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
    ours = proc.ns_id("mnt")
    tries = (("mount_namespace", _mount_namespace_probe),
             ("pid_namespace", lambda: _pid_namespace_probe(ours)),
             ("network_namespace", _netns_with_loopback))

    def in_the_child() -> bytes:
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
        return "\n".join(out).encode(errors="replace")

    ok, got = probe(in_the_child)
    for line in got.splitlines() if ok else ():
        name, _, why = line.partition("\0")
        _ns_refused[name] = why or None
    for name, _ in tries:
        _ns_refused.setdefault(name, "the probe child reported nothing")
    return dict(_ns_refused)


def _mount_namespace_probe() -> None:
    """In namespaces_refused's child: a mount namespace (private from here on: nothing reaches the host's)
    and a tmpfs by the new mount API, as a cell's /tmp is made."""
    lsys.unshare(lsys.CLONE_NEWNS | lsys.CLONE_NEWIPC)
    lsys.mount_setattr("/", propagation=lsys.MS_PRIVATE)
    os.close(lsys.fsmount_new("tmpfs", {"size": "4096"}))


def _pid_namespace_probe(host_mnt_ns: str) -> None:
    """A PID namespace, and (in the private mount namespace _mount_namespace_probe made, when it could) its
    own /proc mounted by its PID 1, as a cell's init does: a container engine's masked /proc files make the
    kernel refuse that mount in a user namespace (mount_too_revealing)."""
    lsys.unshare(lsys.CLONE_NEWPID)
    if proc.ns_id("mnt") == host_mnt_ns:
        return  # no mount namespace here: the cell's PID namespace goes with it (compiler._reduced)
    _, err = probe(_mount_proc)
    if err:
        raise OSError(errno.EPERM, f"its own /proc: {err}")


def _mount_proc() -> bytes | None:
    """In the new PID namespace's PID 1: its own /proc; why not, if the kernel refused it."""
    try:
        lsys.mount("proc", "/proc", "proc", lsys.MS_NOSUID | lsys.MS_NODEV | lsys.MS_NOEXEC)
    except OSError as e:
        return (e.strerror or str(e)).encode(errors="replace")
    return None


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
    if code not in (errno.EPERM, errno.EACCES, errno.ENOSYS) or step not in REFUSABLE:
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



def userns_refused(msg: str, code: int | None) -> SetupError:
    """The one line for a normal user whose cells cannot have a user namespace here, with the fix."""
    blocked = userns.blocked_by_sysctl()
    fix = "; ".join(blocked) if blocked else ("something refuses unprivileged user namespaces here (an LSM such "
                                             "as AppArmor, or a seccomp filter: a container needs its runtime's "
                                             "user-namespace support); or run agnsup as root")
    return SetupError(f"cell setup failed at step 'user_namespace': {msg}: a normal user's cell gets its mount, "
                      f"network and PID namespaces only inside a user namespace of its own; fix: {fix}; or accept "
                      'a reduced cell: isolation.reduced = ["mount_namespace", "network_namespace", "pid_namespace"] '
                      "(docs/hosts.md)", step="user_namespace", errno=code)


def keeper_refusal(step: str, code: int, msg: str, own_userns: bool, netns_owner: int | None) -> SetupError | None:
    """A pod's keeper (process/keeper.py) makes its namespaces before any cell of the pod does: when the host
    refuses them, the line a cell of its own would have given, with its fix (not "the pod's keeper: ..."):
    a normal user's refused user namespace (userns_refused), a root controller's without CAP_NET_ADMIN refused
    network namespace of its own (netns_refused, as cell_netns's), a root controller's refused unshare (the
    'unshare' step's reduced_refusal; also without CAP_NET_ADMIN when the mount namespace is refused too: a
    cell of its own stops at its mounts before its network, e.g. a container without CAP_SYS_ADMIN). None: not
    a refusal (the keeper's own error then)."""
    if step == "user_namespace" and own_userns and code in USERNS_REFUSED:
        return userns_refused(msg, code)
    if step != "network_namespace" or own_userns:
        return None
    netns_only = netns_owner is not None and not namespaces_refused().get("mount_namespace")
    refused = None if netns_only else reduced_refusal("unshare", msg, code)
    if refused is None and netns_owner is not None:
        return netns_refused(_own_netns_error(code, msg))
    return refused


def netns_refused(e: OSError) -> SetupError:
    """The one line for a root controller without CAP_NET_ADMIN whose cells cannot have a user namespace
    of their own to own their network namespace, with both fixes."""
    return SetupError(f"cell setup failed at step 'network_namespace': {e.strerror or e}: a cell's loopback needs "
                      "CAP_NET_ADMIN, which this controller lacks, or a user namespace of the cell's own, which "
                      "this host refuses; fix: give agnsup CAP_NET_ADMIN (a container: --cap-add NET_ADMIN), or "
                      'accept a reduced cell: isolation.reduced = ["network_namespace"] (docs/hosts.md)',
                      step="network_namespace", errno=e.errno)


