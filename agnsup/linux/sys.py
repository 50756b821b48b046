"""The few Linux system calls Python 3.11's `os` does not wrap, through ctypes.

We call `prctl`, `unshare`, `mount` and the new mount API (open_tree, move_mount,
mount_setattr) directly instead of depending on python-prctl, which needs the
libcap headers to build. Syscall numbers >= 424 are shared by every
architecture (the "unified" syscall table, see
linux/include/uapi/asm-generic/unistd.h), and the older ones (unshare, mount, prctl) go through glibc's own wrappers.

Every wrapper raises OSError with the real errno, so callers see the kernel's
own reason.
"""
from __future__ import annotations

import ctypes
import os

from . import proc

_libc = ctypes.CDLL(None, use_errno=True)

# unshare(2) flags, <linux/sched.h>
CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

# mount(2) flags, <linux/mount.h>
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18

# new mount API
OPEN_TREE_CLONE = 1
OPEN_TREE_CLOEXEC = os.O_CLOEXEC
AT_RECURSIVE = 0x8000
AT_EMPTY_PATH = 0x1000
AT_FDCWD = -100
MOVE_MOUNT_F_EMPTY_PATH = 0x4
MOVE_MOUNT_T_SYMLINKS = 0x10  # the target's last component followed when a symlink, as mount(2) does
MOUNT_ATTR_RDONLY = 0x1
MOUNT_ATTR_NOSUID = 0x2
MOUNT_ATTR_NODEV = 0x4
MOUNT_ATTR_NOEXEC = 0x8
MOUNT_ATTR_IDMAP = 0x00100000  # ids seen through the mount go through a user namespace's maps (5.12)

# prctl(2) options, <linux/prctl.h>
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36

# openat2(2) resolve flags, <linux/openat2.h>
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_BENEATH = 0x08

_SYS_OPENAT2 = 437
_SYS_OPEN_TREE = 428
_SYS_MOVE_MOUNT = 429
_SYS_MOUNT_SETATTR = 442

_syscall = _libc.syscall
_syscall.restype = ctypes.c_long


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def _check(ret: int, what: str, path: str | None = None) -> int:
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}", path)
    return ret


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def openat2(dfd: int, path: str, flags: int, mode: int = 0, resolve: int = 0) -> int:
    """openat2(2): with RESOLVE_BENEATH the kernel refuses (EXDEV) any resolution, `..` or
    symlink, that leaves `dfd`, atomically with the open (no check-then-open race)."""
    how = _OpenHow(flags | os.O_CLOEXEC, mode, resolve)
    return _check(_syscall(_SYS_OPENAT2, ctypes.c_int(dfd), os.fsencode(path), ctypes.byref(how),
                           ctypes.c_size_t(ctypes.sizeof(how))), "openat2", path)


def unshare(flags: int) -> None:
    _check(_libc.unshare(ctypes.c_int(flags)), "unshare")


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = lambda s: s.encode() if s is not None else None  # noqa: E731
    _check(_libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
           "mount", target)


MNT_DETACH = 2


def umount(target: str, flags: int = MNT_DETACH) -> None:
    _check(_libc.umount2(target.encode(), ctypes.c_int(flags)), "umount2", target)


def open_tree(path: str, flags: int, dfd: int = AT_FDCWD) -> int:
    """A detached copy of the mount at `path` (OPEN_TREE_CLONE), as an fd."""
    return _check(_syscall(_SYS_OPEN_TREE, ctypes.c_int(dfd), path.encode(), ctypes.c_uint(flags)),
                  "open_tree", path)


def move_mount_fd(fd: int, target: str, follow: bool = False, dfd: int = AT_FDCWD) -> None:
    """Attach the detached tree `fd` at `target` (relative to `dfd`: possibly inside another detached tree, Linux
    6.15+); `follow`: a symlink at `target` is followed, as mount(2) follows it (else the link itself is the point)."""
    _check(_syscall(_SYS_MOVE_MOUNT, ctypes.c_int(fd), b"", ctypes.c_int(dfd), target.encode(),
                    ctypes.c_uint(MOVE_MOUNT_F_EMPTY_PATH | (MOVE_MOUNT_T_SYMLINKS if follow else 0))),
           "move_mount", target)


def mount_setattr(path: str, attr_set: int = 0, attr_clr: int = 0, propagation: int = 0,
                  recursive: bool = True, fd: int | None = None, userns_fd: int = 0) -> None:
    """`userns_fd` with MOUNT_ATTR_IDMAP: id-map a detached mount (`fd`) through that user namespace."""
    attr = _MountAttr(attr_set, attr_clr, propagation, userns_fd)
    flags = AT_RECURSIVE if recursive else 0
    if fd is not None:
        dfd, p, flags = fd, b"", flags | AT_EMPTY_PATH
    else:
        dfd, p = AT_FDCWD, path.encode()
    _check(_syscall(_SYS_MOUNT_SETATTR, ctypes.c_int(dfd), p, ctypes.c_uint(flags),
                    ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr))), "mount_setattr", path)


def prctl(option: int, arg2: int = 0, arg3: int = 0, arg4: int = 0, arg5: int = 0) -> int:
    return _check(_libc.prctl(ctypes.c_int(option), ctypes.c_ulong(arg2), ctypes.c_ulong(arg3),
                              ctypes.c_ulong(arg4), ctypes.c_ulong(arg5)), "prctl")


def drop_bounding_caps(caps: list[int]) -> None:
    """Remove capabilities from the bounding set: after execve a root process
    can no longer gain them (capabilities(7), "Capability bounding set")."""
    for cap in caps:
        prctl(PR_CAPBSET_DROP, cap)


# capabilities(7): names as in <linux/capability.h>, without the CAP_ prefix
CAP_NAMES = ("CHOWN", "DAC_OVERRIDE", "DAC_READ_SEARCH", "FOWNER", "FSETID", "KILL", "SETGID", "SETUID",
             "SETPCAP", "LINUX_IMMUTABLE", "NET_BIND_SERVICE", "NET_BROADCAST", "NET_ADMIN", "NET_RAW",
             "IPC_LOCK", "IPC_OWNER", "SYS_MODULE", "SYS_RAWIO", "SYS_CHROOT", "SYS_PTRACE", "SYS_PACCT",
             "SYS_ADMIN", "SYS_BOOT", "SYS_NICE", "SYS_RESOURCE", "SYS_TIME", "SYS_TTY_CONFIG", "MKNOD",
             "LEASE", "AUDIT_WRITE", "AUDIT_CONTROL", "SETFCAP", "MAC_OVERRIDE", "MAC_ADMIN", "SYSLOG",
             "WAKE_ALARM", "BLOCK_SUSPEND", "AUDIT_READ", "PERFMON", "BPF", "CHECKPOINT_RESTORE")
PR_SET_DUMPABLE = 4
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
_LINUX_CAPABILITY_VERSION_3 = 0x20080522


def cap_last_cap() -> int:
    try:
        return int(proc.sysctl("kernel/cap_last_cap") or "")
    except ValueError:
        return len(CAP_NAMES) - 1


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def set_caps(keep: list[int]) -> None:
    """Effective, permitted and inheritable become `keep`, ambient becomes empty.

    With the bounding set already reduced to `keep`, a root process keeps
    exactly `keep` across execve (capabilities(7), "Transformation of
    capabilities during execve")."""
    mask = 0
    for c in keep:
        mask |= 1 << c
    hdr = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)(_CapData(mask & 0xFFFFFFFF, mask & 0xFFFFFFFF, mask & 0xFFFFFFFF),
                          _CapData(mask >> 32, mask >> 32, mask >> 32))
    _check(_libc.capset(ctypes.byref(hdr), data), "capset")
    prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)


def set_no_new_privs() -> None:
    prctl(PR_SET_NO_NEW_PRIVS, 1)


AF_INET = 2
SOCK_DGRAM = 2
SOCK_CLOEXEC = os.O_CLOEXEC


def inet_dgram_socket() -> int:
    """A bare AF_INET datagram socket fd, for interface ioctls (the `socket`
    module costs ~5 ms of imports for what is one system call here)."""
    return _check(_libc.socket(ctypes.c_int(AF_INET), ctypes.c_int(SOCK_DGRAM | SOCK_CLOEXEC), ctypes.c_int(0)),
                  "socket")


def setns(fd: int, nstype: int) -> None:
    _check(_libc.setns(ctypes.c_int(fd), ctypes.c_int(nstype)), "setns")


# clone3(2), <linux/sched.h>
_SYS_CLONE3 = 435
CLONE_PIDFD = 0x1000
CLONE_PARENT = 0x00008000  # the new child's parent is the caller's parent
CLONE_INTO_CGROUP = 0x200000000
_SIGCHLD = 17


class _CloneArgs(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in (
        "flags", "pidfd", "child_tid", "parent_tid", "exit_signal", "stack", "stack_size", "tls", "set_tid",
        "set_tid_size", "cgroup")]


# Through a PyDLL the GIL stays held across the call, as os.fork holds it
# across fork(): no other Python thread runs while the address space is copied.
_pyapi = ctypes.PyDLL(None, use_errno=True)
_pyapi.syscall.restype = ctypes.c_long
for _name in ("PyOS_BeforeFork", "PyOS_AfterFork_Parent", "PyOS_AfterFork_Child"):
    getattr(_pyapi, _name).restype = None


def clone3_into_cgroup(cgroup_fd: int | None, flags: int = 0, exit_signal: int | None = None) -> tuple[int, int]:
    """fork(), the child born inside the cgroup2 directory open as `cgroup_fd`.

    Returns (pid, pidfd) in the parent and (0, -1) in the child. Moving a
    process in by writing cgroup.procs takes cgroup_threadgroup_rwsem for
    writing, which waits for an RCU grace period when the lock was idle (6-16
    ms on this kernel); CLONE_INTO_CGROUP takes only its read side. `flags`
    may add namespaces (CLONE_NEWPID; with CLONE_NEWUSER a normal user's child is PID 1 of a PID
    namespace its own user namespace owns). Python has no clone3, so this is the
    raw system call with what os.fork does around fork(): PyOS_BeforeFork,
    then PyOS_AfterFork_Child or _Parent. It bypasses glibc's fork(), whose
    handlers keep malloc's locks consistent for a child of a threaded
    process: call it only from a single-threaded process (the supervisor
    checks). Only the supervisor calls this (tests/test_architecture.py)."""
    pidfd = ctypes.c_int(-1)
    into = CLONE_INTO_CGROUP if cgroup_fd is not None else 0  # None: born in the caller's cgroup
    args = _CloneArgs(flags=flags | into | CLONE_PIDFD, pidfd=ctypes.addressof(pidfd),
                      exit_signal=_SIGCHLD if exit_signal is None else exit_signal, cgroup=cgroup_fd or 0)
    _pyapi.PyOS_BeforeFork()
    ret = _pyapi.syscall(ctypes.c_long(_SYS_CLONE3), ctypes.byref(args), ctypes.c_size_t(ctypes.sizeof(args)))
    if ret == 0:
        _pyapi.PyOS_AfterFork_Child()
        return 0, -1
    err = ctypes.get_errno()
    _pyapi.PyOS_AfterFork_Parent()
    if ret < 0:
        raise OSError(err, f"clone3: {os.strerror(err)}")
    return ret, pidfd.value


# fsopen(2) / fsconfig(2) / fsmount(2): a new file system instance as a detached mount, made by the controller
_SYS_FSOPEN = 430
_SYS_FSCONFIG = 431
_SYS_FSMOUNT = 432
FSOPEN_CLOEXEC = 0x1
FSCONFIG_SET_FLAG = 0
FSCONFIG_SET_STRING = 1
FSCONFIG_CMD_CREATE = 6
FSMOUNT_CLOEXEC = 0x1


def fsmount_new(fstype: str, options: dict[str, str], attrs: int = 0) -> int:
    """A fresh `fstype` with `options` (fsconfig strings: size, mode, uid...; a value of None sets a flag
    option such as overlay's userxattr), as a detached mount fd
    with mount attributes `attrs` (MOUNT_ATTR_*); move_mount_fd attaches it, possibly in another mount
    namespace (the cell's), and the fd keeps the file system reachable after that namespace is gone."""
    fs = _check(_syscall(_SYS_FSOPEN, fstype.encode(), ctypes.c_uint(FSOPEN_CLOEXEC)), "fsopen", fstype)
    try:
        for key, value in options.items():
            if value is None:
                _check(_syscall(_SYS_FSCONFIG, ctypes.c_int(fs), ctypes.c_uint(FSCONFIG_SET_FLAG), key.encode(), None,
                                ctypes.c_int(0)), f"fsconfig {key}", fstype)
                continue
            _check(_syscall(_SYS_FSCONFIG, ctypes.c_int(fs), ctypes.c_uint(FSCONFIG_SET_STRING), key.encode(),
                            str(value).encode(), ctypes.c_int(0)), f"fsconfig {key}={value}", fstype)
        _check(_syscall(_SYS_FSCONFIG, ctypes.c_int(fs), ctypes.c_uint(FSCONFIG_CMD_CREATE), None, None,
                        ctypes.c_int(0)), "fsconfig create", fstype)
        return _check(_syscall(_SYS_FSMOUNT, ctypes.c_int(fs), ctypes.c_uint(FSMOUNT_CLOEXEC), ctypes.c_uint(attrs)),
                      "fsmount", fstype)
    finally:
        os.close(fs)


# Descriptors passed over a Unix socket (unix(7), SCM_RIGHTS): the one way agnsup hands a namespace from one of
# its processes to another (the cell's child to its controller: process/leader.py; a throwaway helper to a
# root controller without CAP_NET_ADMIN: process.namespaces.cell_netns; a pod's keeper to whoever joins it:
# process/keeper.py). `_socket`, not `socket` (its Python layer is not needed; the run path imports it anyway).
def seqpacket_pair() -> tuple[int, int]:
    """socketpair(AF_UNIX, SOCK_SEQPACKET), close-on-exec: two fds, each end keeps message boundaries."""
    import _socket
    a, b = _socket.socketpair(_socket.AF_UNIX, _socket.SOCK_SEQPACKET)
    return a.detach(), b.detach()


def _unix(fd: int):
    """A socket object over the AF_UNIX socket `fd` (detach it after use). Its family and type named: without
    them the socket module asks the kernel for them (getsockname, two getsockopt) on every message; SCM_RIGHTS
    exists only on AF_UNIX, and neither sendmsg nor recvmsg of a connected socket reads the type."""
    import _socket
    return _socket.socket(_socket.AF_UNIX, _socket.SOCK_SEQPACKET, 0, fd)


def send_fds(sock, data: bytes, fds: list[int]) -> None:
    """One message `data` (not empty) carrying copies of `fds`, on `sock` (an fd, or a socket object)."""
    import _socket
    import struct
    s = _unix(sock) if isinstance(sock, int) else sock
    try:
        s.sendmsg([data], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, struct.pack(f"{len(fds)}i", *fds))])
    finally:
        if s is not sock:
            s.detach()


def recv_fds(sock, size: int = 256, max_fds: int = 1, wait: bool = True) -> tuple[bytes, list[int]]:
    """(data, fds) of one message on `sock` (an fd, or a socket object, whose timeout holds), the fds
    close-on-exec; b"" and []: the other end closed without a word, or (`wait` False) nothing queued yet."""
    import _socket
    import struct
    s = _unix(sock) if isinstance(sock, int) else sock
    fds: list[int] = []
    try:
        flags = _socket.MSG_CMSG_CLOEXEC | (0 if wait else _socket.MSG_DONTWAIT)
        data, ancillary, _flags, _addr = s.recvmsg(size, _socket.CMSG_SPACE(4 * max_fds), flags)
    except (BlockingIOError, InterruptedError):
        return b"", []
    finally:
        if s is not sock:
            s.detach()
    for level, kind, raw in ancillary:
        if (level, kind) == (_socket.SOL_SOCKET, _socket.SCM_RIGHTS):
            fds += struct.unpack(f"{len(raw) // 4}i", raw[:len(raw) // 4 * 4])
    return data, fds
