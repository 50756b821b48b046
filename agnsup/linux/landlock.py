"""The cell's Landlock domain, through the three landlock syscalls (ctypes).

Landlock confines *writes* here: the ruleset handles every write-class
filesystem right (write, truncate, create, remove, rename/link across
directories) and grants them only beneath the paths the role allows (the
worktree when it is rw, the cell's private /tmp, /dev/shm, its own devpts,
the /dev/null class of devices, the cell's own stdio files and terminals).
Reads are not handled: what the cell may read is what its mount namespace
shows. Rules bind inodes, not mount points
(Documentation/userspace-api/landlock.rst), so a ruleset built
in the controller from host paths still holds inside the cell's private
mount namespace, and it holds even if a mount were left writable by mistake:
/sys/fs/cgroup and the state root get no rule at all.

Scopes (ABI 6): LANDLOCK_SCOPE_SIGNAL and LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET
keep a cell from signalling, or connecting to the abstract unix sockets of,
any process outside its domain (the controller, the host). A Landlock domain
also refuses ptrace of any process outside it.

Why not the `landlock` PyPI package: it covers file rules but not scopes,
and three syscalls are less code than an adapter.
"""
from __future__ import annotations

import ctypes
import os
import stat

from .sys import _check, _syscall, prctl  # one libc binding and one errno check for every syscall

_SYS_CREATE_RULESET = 444
_SYS_ADD_RULE = 445
_SYS_RESTRICT_SELF = 446
CREATE_RULESET_VERSION = 1
RULE_PATH_BENEATH = 1

# LANDLOCK_ACCESS_FS_*, <linux/landlock.h>
EXECUTE, WRITE_FILE, READ_FILE, READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
REMOVE_DIR, REMOVE_FILE, MAKE_CHAR, MAKE_DIR = 1 << 4, 1 << 5, 1 << 6, 1 << 7
MAKE_REG, MAKE_SOCK, MAKE_FIFO, MAKE_BLOCK, MAKE_SYM = 1 << 8, 1 << 9, 1 << 10, 1 << 11, 1 << 12
REFER = 1 << 13      # ABI 2
TRUNCATE = 1 << 14   # ABI 3
SCOPE_ABSTRACT_UNIX_SOCKET = 1 << 0  # ABI 6
SCOPE_SIGNAL = 1 << 1                # ABI 6
LOG_NEW_EXEC_ON = 1 << 1             # ABI 7: landlock_restrict_self flag, denials after an execve are audited
_PR_SET_NAME = 15

_WRITE_V1 = (WRITE_FILE | REMOVE_DIR | REMOVE_FILE | MAKE_CHAR | MAKE_DIR | MAKE_REG | MAKE_SOCK | MAKE_FIFO
             | MAKE_BLOCK | MAKE_SYM)
_FILE_RIGHTS = EXECUTE | WRITE_FILE | READ_FILE | TRUNCATE  # the rights a rule on a non-directory may carry


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]




def abi() -> int:
    """The kernel's Landlock ABI version; 0 when Landlock is absent or disabled."""
    v = _syscall(_SYS_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(CREATE_RULESET_VERSION))
    return int(v) if v > 0 else 0


def handled_writes(version: int) -> int:
    return _WRITE_V1 | (REFER if version >= 2 else 0) | (TRUNCATE if version >= 3 else 0)


class Ruleset:
    """A ruleset fd built in the controller; the child adds its last rules
    (mounts that only exist in its namespace), then restricts itself."""

    def __init__(self, version: int, scopes: bool = True, log_tag: str | None = None):
        self.version = version
        # ABI 7, a controller reading the audit log (linux/audit.py): the creator's comm names the
        # domain in its audit record, and denials after the execve are logged
        self.log_tag = log_tag if version >= 7 else None
        self.handled = handled_writes(version)
        self.scoped = (SCOPE_SIGNAL | SCOPE_ABSTRACT_UNIX_SOCKET) if scopes and version >= 6 else 0
        attr = _RulesetAttr(self.handled, 0, self.scoped)
        size = ctypes.sizeof(_RulesetAttr) if version >= 6 else 16 if version >= 4 else 8
        self.fd = _check(_syscall(_SYS_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size),
                                  ctypes.c_uint32(0)), "landlock_create_ruleset")

    def allow_fd(self, fd: int, is_dir: bool, what: str = "") -> None:
        rights = self.handled if is_dir else self.handled & _FILE_RIGHTS
        rule = _PathBeneath(rights, fd)
        _check(_syscall(_SYS_ADD_RULE, ctypes.c_int(self.fd), ctypes.c_int(RULE_PATH_BENEATH), ctypes.byref(rule),
                        ctypes.c_uint32(0)), "landlock_add_rule", what)

    def allow_path(self, path: str, missing_ok: bool = True) -> bool:
        """Grant the handled writes beneath `path` (a directory) or on it (a file)."""
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except FileNotFoundError:
            if missing_ok:
                return False
            raise
        try:
            self.allow_fd(fd, stat.S_ISDIR(os.fstat(fd).st_mode), path)
        finally:
            os.close(fd)
        return True

    def restrict_self(self) -> None:
        """Enter the domain (needs no_new_privs or CAP_SYS_ADMIN); closes the fd."""
        flags = 0
        if self.log_tag:
            name = ctypes.create_string_buffer(self.log_tag.encode()[:15])
            prctl(_PR_SET_NAME, ctypes.addressof(name))  # until the execve: the domain's record keeps it
            flags = LOG_NEW_EXEC_ON
        try:
            _check(_syscall(_SYS_RESTRICT_SELF, ctypes.c_int(self.fd), ctypes.c_uint32(flags)),
                   "landlock_restrict_self")
        finally:
            os.close(self.fd)
            self.fd = -1

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def build(writable: list[str], version: int, scopes: bool = True, log_tag: str | None = None) -> Ruleset:
    rs = Ruleset(version, scopes, log_tag)
    try:
        for p in writable:
            rs.allow_path(p)
    except BaseException:
        rs.close()
        raise
    return rs


def allow_stdio(rs: Ruleset) -> None:
    """In the child: the regular files and terminals it was given as stdio stay
    writable when reopened through /dev/stdout or /proc/self/fd (shells do
    `>/dev/stderr`). A terminal of the controller's lives on the host's devpts,
    which the cell's /dev no longer shows: this rule is its only one."""
    for fd in (0, 1, 2):
        try:
            st = os.fstat(fd)
        except OSError:
            continue
        if (stat.S_ISREG(st.st_mode) and fd) or stat.S_ISCHR(st.st_mode):
            rs.allow_fd(fd, False, f"fd {fd}")

