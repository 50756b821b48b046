"""The cell's seccomp filter: a classic BPF program assembled here, loaded with prctl.

Why our own BPF and not libseccomp (pyseccomp): the filter is a short deny
list, so a few dozen instructions assembled once per process (and cached)
cost microseconds, need no extra dependency, and the child only makes one
prctl(PR_SET_SECCOMP) call. libseccomp would cost a library load and a
filter compilation on every cell.

Every refused call returns EPERM (never SECCOMP_RET_KILL): programs see a
clean "Operation not permitted". clone3 is the exception: it returns ENOSYS
when namespace creation is refused, because its flags sit in a struct BPF
cannot read; glibc then falls back to clone(2), whose flags we can check
(the approach of Docker's and systemd's filters).

Arguments are compared on their low 32 bits only: ioctl's request and
prctl's option are `unsigned int` / `int` in the kernel, so checking 64 bits
would let a caller bypass the filter by setting high bits.

Groups (the role removes a group from the filter by allowing it):
  always      prctl(PR_SET_MM, ...), ioctl(TIOCSTI), ioctl(TIOCLINUX), io_uring_*,
              kexec_*, init_module/finit_module/delete_module, and what Docker's
              default profile refuses that no build or test job needs (issue 25):
              the keyrings (keyctl, add_key, request_key), userfaultfd,
              perf_event_open, bpf, open_by_handle_at, the host's clock, swap,
              accounting, quotas, reboot and kernel log, and legacy calls
              (uselib, lookup_dcookie, nfsservctl, vhangup, iopl/ioperm, vm86);
              personality(2) other than Docker's allowed personas (EPERM);
              socket/socketpair of a family other than AF_UNIX, AF_INET,
              AF_INET6, AF_NETLINK (EAFNOSUPPORT: AF_VSOCK, AF_PACKET, AF_ALG...);
              i386 socketcall's socket/socketpair (the family sits behind a
              pointer BPF cannot read: EAFNOSUPPORT)
  ptrace      ptrace, process_vm_readv/writev  (isolation.allow_ptrace lifts it;
              Landlock then still confines ptrace to the cell's own processes)
  mount       mount, umount2, pivot_root, setns, unshare, the new mount API,
              clone with CLONE_NEW* flags, clone3  (isolation.allow_mount lifts it)
"""
from __future__ import annotations

import ctypes
import errno
import functools
import os

from . import proc
from . import sys as lsys

# <linux/audit.h>
AUDIT_ARCH_X86_64 = 0xC000003E
AUDIT_ARCH_I386 = 0x40000003
AUDIT_ARCH_AARCH64 = 0xC00000B7
X32_SYSCALL_BIT = 0x40000000

PR_SET_MM = 35
TIOCSTI = 0x5412
TIOCLINUX = 0x541C
# clone(2) namespace flags (CLONE_NEWTIME shares its bit with CSIGNAL in clone's flags)
CLONE_NS_FLAGS = 0x7E020000

PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2
SECCOMP_RET_ALLOW = 0x7FFF0000
SECCOMP_RET_ERRNO = 0x00050000

# personality(2) values Docker's default profile allows (PER_LINUX, PER_LINUX32, UNAME26,
# PER_LINUX32|UNAME26, and the query 0xffffffff); READ_IMPLIES_EXEC, ADDR_NO_RANDOMIZE & co. are refused
PERSONALITIES = (0x0, 0x8, 0x20000, 0x20008, 0xFFFFFFFF)
# socket(2) families a cell may create (<linux/socket.h>): AF_UNIX, AF_INET, AF_INET6, and AF_NETLINK
# (glibc's getaddrinfo/getifaddrs ask NETLINK_ROUTE); every other family gets EAFNOSUPPORT
SOCKET_FAMILIES = (1, 2, 10, 16)
# socketcall(2)'s sub-calls (<linux/net.h>) whose family BPF cannot see: SYS_SOCKET, SYS_SOCKETPAIR
SOCKETCALL_CREATE = (1, 8)

# Syscall numbers per audit arch. 424 and above are the same on every
# architecture (asm-generic/unistd.h: io_uring 425-427, open_tree 428,
# move_mount 429, fsopen 430, fsconfig 431, fsmount 432, fspick 433,
# clone3 435, mount_setattr 442, quotactl_fd 443, open_tree_attr 467).
_UNIFIED_MOUNT = [428, 429, 430, 431, 432, 433, 442, 467]
_IO_URING = [425, 426, 427]
_CLONE3 = 435
# What Docker's default profile refuses and no build or test job needs (issue 25), by group:
#   keyrings       keyctl add_key request_key (the kernel's keyrings are not namespaced: a root cell reads
#                  and plants keys in root's user keyring; a normal user's cell reaches the session keyring)
#   kernel memory  userfaultfd (stalls kernel copies: the exploit writer's race widener), perf_event_open,
#                  bpf
#   file handles   open_by_handle_at (the "shocker" escape: a handle names any inode of the filesystem,
#                  past every mount; name_to_handle_at only makes handles and stays allowed)
#   the host       settimeofday clock_settime(64) stime clock_adjtime(64), swapon swapoff, acct, quotactl
#                  quotactl_fd, reboot, syslog (the kernel log: addresses, other tenants' messages)
#   legacy         uselib lookup_dcookie nfsservctl vhangup iopl ioperm vm86 vm86old, fanotify_init
# adjtimex stays allowed: glibc's ntp_gettime reads the clock state with it; setting needs CAP_SYS_TIME.
TABLES = {
    AUDIT_ARCH_X86_64: {
        "always": [246, 320, 175, 313, 176] + _IO_URING     # kexec_load, kexec_file_load, modules
        + [250, 248, 249]                                    # keyrings
        + [323, 298, 321]                                    # userfaultfd perf_event_open bpf
        + [304]                                              # open_by_handle_at
        + [164, 227, 305, 167, 168, 163, 179, 443, 169, 103]  # the host's clock, swap, acct, quota, reboot, log
        + [134, 212, 180, 153, 172, 173, 300],               # legacy, fanotify_init
        "ptrace": [101, 310, 311],
        "mount": [165, 166, 155, 308, 272] + _UNIFIED_MOUNT,  # mount umount2 pivot_root setns unshare
        "prctl": 157, "ioctl": 16, "clone": 56, "personality": 135, "socket": [41, 53],
    },
    AUDIT_ARCH_I386: {
        "always": [283, 128, 350, 129] + _IO_URING
        + [288, 286, 287]
        + [374, 336, 357]
        + [342]
        + [79, 264, 404, 25, 343, 405, 87, 115, 51, 131, 443, 88, 103]
        + [86, 253, 169, 111, 110, 101, 166, 113, 338],
        "ptrace": [26, 347, 348],
        "mount": [21, 22, 52, 217, 346, 310] + _UNIFIED_MOUNT,  # mount umount umount2 pivot_root setns unshare
        "prctl": 172, "ioctl": 54, "clone": 120, "personality": 136, "socket": [359, 360], "socketcall": 102,
    },
    AUDIT_ARCH_AARCH64: {
        "always": [104, 294, 105, 273, 106] + _IO_URING
        + [219, 217, 218]
        + [282, 241, 280]
        + [265]
        + [170, 112, 266, 224, 225, 89, 60, 443, 142, 116]
        + [18, 42, 58, 262],                                 # no uselib, iopl, ioperm, vm86 here
        "ptrace": [117, 270, 271],
        "mount": [40, 39, 41, 268, 97] + _UNIFIED_MOUNT,
        "prctl": 167, "ioctl": 29, "clone": 220, "personality": 92, "socket": [198, 199],
    },
}
# The native arch, and the compat arch whose calls a native process can also make
_NATIVE = {"x86_64": (AUDIT_ARCH_X86_64, AUDIT_ARCH_I386), "aarch64": (AUDIT_ARCH_AARCH64, None)}

GROUPS = ("always", "ptrace", "mount")

# classic BPF opcodes, <linux/filter.h>
_LD_W_ABS = 0x20
_JEQ_K = 0x15
_JGE_K = 0x35
_JSET_K = 0x45
_RET_K = 0x06
# offsets in struct seccomp_data {int nr; u32 arch; u64 ip; u64 args[6];}
_NR, _ARCH = 0, 4


def _arg_lo(i: int) -> int:
    return 16 + 8 * i  # the low 32 bits of args[i] on a little-endian machine


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def supported() -> str | None:
    """None when this host can load the filter, else why not."""
    arch = os.uname().machine
    if arch not in _NATIVE:
        return f"no syscall table for {arch}"
    status = proc.status()
    if status is None:
        return "cannot read /proc/self/status"
    return None if "Seccomp_filters" in status else "kernel without seccomp filters (CONFIG_SECCOMP_FILTER)"


class _Asm:
    """Instructions with symbolic jump targets, resolved at the end."""

    def __init__(self):
        self.ins: list[list] = []
        self.labels: dict[str, int] = {}

    def label(self, name: str) -> None:
        self.labels[name] = len(self.ins)

    def op(self, code: int, k: int, jt: str | None = None, jf: str | None = None) -> None:
        self.ins.append([code, jt, jf, k])

    def assemble(self) -> list[tuple[int, int, int, int]]:
        out = []
        for i, (code, jt, jf, k) in enumerate(self.ins):
            offs = []
            for target in (jt, jf):
                off = 0 if target is None else self.labels[target] - i - 1
                if not 0 <= off <= 255:
                    raise ValueError(f"BPF jump out of range ({off})")
                offs.append(off)
            out.append((code, offs[0], offs[1], k))
        return out


def program(groups: tuple[str, ...], native: str | None = None) -> list[tuple[int, int, int, int]]:
    """The filter as (code, jt, jf, k) tuples, refusing `groups` (plus "always")."""
    arches = [a for a in _NATIVE[native or os.uname().machine] if a is not None]
    groups = tuple(g for g in GROUPS if g == "always" or g in groups)
    a = _Asm()
    a.op(_LD_W_ABS, _ARCH)
    for arch in arches:
        a.op(_JEQ_K, arch, jt=f"arch{arch}")
    a.op(_RET_K, SECCOMP_RET_ERRNO | errno.EPERM)  # an arch we have no table for: refuse everything
    for arch in arches:
        t = TABLES[arch]
        a.label(f"arch{arch}")
        a.op(_LD_W_ABS, _NR)
        if arch == AUDIT_ARCH_X86_64:
            a.op(_JGE_K, X32_SYSCALL_BIT, jt="deny")  # the x32 ABI: same arch, other numbers
        for g in groups:
            for nr in t[g]:
                a.op(_JEQ_K, nr, jt="deny")
        a.op(_JEQ_K, t["prctl"], jt=f"prctl{arch}")
        a.op(_JEQ_K, t["ioctl"], jt=f"ioctl{arch}")
        a.op(_JEQ_K, t["personality"], jt="personality")
        for nr in t["socket"]:
            a.op(_JEQ_K, nr, jt="socket")
        if "socketcall" in t:
            a.op(_JEQ_K, t["socketcall"], jt="socketcall")
        if "mount" in groups:
            a.op(_JEQ_K, t["clone"], jt=f"clone{arch}")
            a.op(_JEQ_K, _CLONE3, jt="enosys")
        a.op(_RET_K, SECCOMP_RET_ALLOW)
        a.label(f"prctl{arch}")
        a.op(_LD_W_ABS, _arg_lo(0))
        a.op(_JEQ_K, PR_SET_MM, jt="deny")
        a.op(_RET_K, SECCOMP_RET_ALLOW)
        a.label(f"ioctl{arch}")
        a.op(_LD_W_ABS, _arg_lo(1))
        a.op(_JEQ_K, TIOCSTI, jt="deny")
        a.op(_JEQ_K, TIOCLINUX, jt="deny")
        a.op(_RET_K, SECCOMP_RET_ALLOW)
        if "mount" in groups:
            a.label(f"clone{arch}")
            a.op(_LD_W_ABS, _arg_lo(0))
            a.op(_JSET_K, CLONE_NS_FLAGS, jt="deny")
            a.op(_RET_K, SECCOMP_RET_ALLOW)
    # argument checks every arch shares: the argument's place in seccomp_data does not depend on the arch
    a.label("personality")
    a.op(_LD_W_ABS, _arg_lo(0))
    for persona in PERSONALITIES:
        a.op(_JEQ_K, persona, jt="allow")
    a.op(_RET_K, SECCOMP_RET_ERRNO | errno.EPERM)
    a.label("socket")
    a.op(_LD_W_ABS, _arg_lo(0))
    for family in SOCKET_FAMILIES:
        a.op(_JEQ_K, family, jt="allow")
    a.op(_RET_K, SECCOMP_RET_ERRNO | errno.EAFNOSUPPORT)
    if any("socketcall" in TABLES[arch] for arch in arches):
        # The family is behind socketcall's pointer: socket creation through it is refused whatever the
        # family (int 0x80 from a 64-bit process would otherwise make an AF_VSOCK socket). glibc built
        # for kernels >= 4.3 and musl use the direct socket(2) on i386; the other sub-calls pass.
        a.label("socketcall")
        a.op(_LD_W_ABS, _arg_lo(0))
        for call in SOCKETCALL_CREATE:
            a.op(_JEQ_K, call, jt="eafnosupport")
        a.op(_RET_K, SECCOMP_RET_ALLOW)
        a.label("eafnosupport")
        a.op(_RET_K, SECCOMP_RET_ERRNO | errno.EAFNOSUPPORT)
    a.label("allow")
    a.op(_RET_K, SECCOMP_RET_ALLOW)
    a.label("deny")
    a.op(_RET_K, SECCOMP_RET_ERRNO | errno.EPERM)
    a.label("enosys")
    a.op(_RET_K, SECCOMP_RET_ERRNO | errno.ENOSYS)
    return a.assemble()


class Filter:
    """A filter ready to load: built in the controller before fork, so the
    child only calls prctl(2)."""

    def __init__(self, groups: tuple[str, ...]):
        ins = program(groups)
        self.groups = groups
        self._array = (_SockFilter * len(ins))(*(_SockFilter(*i) for i in ins))
        self._prog = _SockFprog(len(ins), ctypes.cast(self._array, ctypes.POINTER(_SockFilter)))

    def __len__(self) -> int:
        return self._prog.len

    def load(self) -> None:
        """Install on the calling thread; needs no_new_privs (or CAP_SYS_ADMIN)."""
        lsys.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(self._prog))


@functools.lru_cache(maxsize=8)
def build(groups: tuple[str, ...]) -> Filter:
    return Filter(groups)
