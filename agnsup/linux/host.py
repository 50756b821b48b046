"""What this host offers a cell, probed once per process: {protection: None, or why not}.

The policy compiler takes this as an argument (it never probes the kernel
itself); `agnsup doctor` shows it, and proves seccomp and Landlock in a
throwaway child on top."""
from __future__ import annotations

import os
import pwd
from _thread import _local  # threading.local itself: `threading` (and contextvars, ~0.25 ms) is not on run's path
from contextlib import contextmanager, suppress
from stat import S_ISDIR, S_ISLNK, S_ISREG

from ..errors import SetupError

from . import proc

_cache: dict = {}


def protections() -> dict:
    """{"seccomp"|"landlock"|"landlock_scopes"|"no_new_privs"|"pid_namespace"|"capabilities":
    None when available, else why not; "_abi": the Landlock ABI; "_root": euid 0;
    "_cap_last": the highest capability number this kernel knows}."""
    if not _cache:
        from . import landlock, seccomp
        from .sys import cap_last_cap
        abi = landlock.abi()
        root = os.geteuid() == 0
        _cache.update({
            "seccomp": seccomp.supported(),
            "landlock": None if abi >= 1 else "no Landlock in this kernel (or it is disabled)",
            "landlock_scopes": None if abi >= 6 else f"Landlock ABI {abi} < 6 has no signal/socket scopes",
            "no_new_privs": None,
            "pid_namespace": None,  # root; a normal user's: asked again at each call (below)
            "capabilities": None,  # a root cell drops them; any other uid has none to drop
            "mapped_uid": _mapped_uid(root),
            "_abi": abi, "_root": root, "_cap_last": cap_last_cap(),
        })
    if _cache["_root"]:
        return _cache
    return {**_cache, "pid_namespace": _userns_pid()}


def _mapped_uid(root: bool) -> str | None:
    """Why a root controller's cells cannot run as uid 0 of the cells' user namespace here (None: they
    can; a normal user's cells run as that user already, never as host root). The file systems are asked
    per device when a plan is made (process.namespaces.idmap_refused); the namespace itself when it is made."""
    if not root:
        return None
    most = proc.sysctl("user/max_user_namespaces")
    if most is None:
        return "no user namespaces in this kernel"
    return "user.max_user_namespaces = 0 (sysctl -w user.max_user_namespaces=15000)" if most == "0" else None


def _userns_pid() -> str | None:
    """Why a normal user's cell cannot have a PID namespace here (None: it can). It is born in a user
    namespace of its own and PID 1 of a new PID namespace by one clone3 (process/clone.py)."""
    from . import userns
    blocked = userns.blocked_by_sysctl()
    return f"no user namespace for a normal user: {blocked[0]}" if blocked else None


CAP_NET_ADMIN = 12
_net_admin: list = []  # [bool], once known


def net_admin() -> bool:
    """Does this process hold CAP_NET_ADMIN (its effective set, /proc/self/status CapEff)? Read once per
    process. A root controller without it (Docker's recipe adds SYS_ADMIN only) cannot bring up the
    loopback of a network namespace its own user namespace owns: its cells' network namespaces are then
    owned by a user namespace of their own (process.namespaces.cell_netns)."""
    if not _net_admin:
        try:
            eff = int((proc.status() or {}).get("CapEff", "0"), 16)
        except ValueError:
            eff = 0
        _net_admin.append(bool(eff >> CAP_NET_ADMIN & 1))
    return _net_admin[0]


# --- homes: the password database's and the invoking user's (what no cell may read) ---

def under(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


def prefixes(tops) -> tuple[str, ...]:
    """What a path under one of `tops` (and not one of them) starts with: any(under(p, t) for t in tops) is
    `p in set(tops) or p.startswith(prefixes(tops))`, one C call for a list asked of many paths."""
    return tuple(t.rstrip("/") + "/" for t in tops)


def in_private_dir(path: str) -> bool:
    """Under a directory every cell gets a fresh one of (its /tmp, its /dev/shm)."""
    return under(path, "/tmp") or under(path, "/dev/shm")


def outermost(paths) -> list[str]:
    out: list[str] = []
    for p in sorted(set(paths), key=len):
        if not any(under(p, q) for q in out):
            out.append(p)
    return out


# A "home" holding one of these, or inside one of the OS trees (system users have
# homes like /usr/sbin or /dev), is the system, not a home: hiding it would hide the OS.
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib64", "/etc", "/dev", "/proc", "/sys", "/tmp", "/var", "/run")
OS_TREES = ("/usr", "/bin", "/sbin", "/lib", "/lib64", "/etc", "/dev", "/proc", "/sys")


_passwd_cache: dict = {}


def passwd_homes(passwd: str = "/etc/passwd") -> list[str]:
    """Every home /etc/passwd names (absolute, as written, normalized), read again only when the file
    changes (a long-lived controller sees a user added later). The file, not getpwall(3): NSS enumeration
    can walk a whole LDAP directory on every cell; a directory's users' homes are not listed here (their
    parent, /home as a rule, is refused as a worktree all the same)."""
    memo = getattr(_look, "memo", None)
    key = memo.get(("passwd", passwd)) if memo is not None else None  # one stat a cell (one_look)
    if key is None:
        try:
            st = os.stat(passwd)
            key = (passwd, st.st_ino, st.st_mtime_ns, st.st_size)
        except OSError:
            return []
        if memo is not None:
            memo[("passwd", passwd)] = key
    if _passwd_cache.get("key") != key:
        homes = []
        with suppress(OSError), open(passwd, errors="replace") as f:
            for line in f:
                fields = line.split(":")
                if len(fields) > 6 and fields[5].startswith("/"):
                    homes.append(os.path.normpath(fields[5]))
        _passwd_cache.update(key=key, homes=homes, real=None)
    return _passwd_cache["homes"]


def all_homes() -> list[str]:
    """Every home of the password database (real paths, existing directories), and /root: hidden from
    every cell like the invoking user's (issue 25, door 5). Homes that are the system (a system user's
    /usr/sbin, /dev, /var, "/") are skipped here, never refused: only the invoking user's own refuses
    (invoking_homes). Homes under /tmp or /dev/shm are out of sight already (each cell's are its own)."""
    entries = passwd_homes()
    if _passwd_cache.get("real") is None:  # computed once per change of the file, like the list
        homes = []
        for h in [*entries, "/root"]:
            if h == "/" or any(under(h, d) for d in OS_TREES) or not os.path.isdir(h):
                continue  # the system's users (most of the file), or no home: no realpath for them
            real = os.path.realpath(h)
            if real == "/" or in_private_dir(real) or not os.path.isdir(real):
                continue
            if any(under(d, real) for d in SYSTEM_DIRS) or any(under(real, d) for d in OS_TREES):
                continue
            homes.append(real)
        _passwd_cache["real"] = outermost(homes)
    return list(_passwd_cache["real"])


# --- one look per cell: what a cell's prepare asks of the host several times, asked once ---

_look = _local()  # .memo: the current look's memo, each thread its own


@contextmanager
def one_look():
    """Within it (tool.prepare: one cell's spec, gate and plan, a millisecond or two), the invoking user's homes
    and the real paths asked through `realpath` are looked up once and remembered; outside it, every call looks
    again. Nothing is kept from one cell to the next: a home or a symlink changed between two cells is seen by
    the second (the child mounts by path later anyway: the window is the one every cell already had between
    its plan and its mounts). Each thread preparing a cell has its own."""
    outer = getattr(_look, "memo", None)
    _look.memo = {"walk": {}, "mode": {}}
    try:
        yield
    finally:
        _look.memo = outer


def realpath(path: str) -> str:
    """os.path.realpath; within one_look() each component is looked at once in the cell (issue 29, sixth round):
    /var, /var/tmp, the state root's and the worktree's parents are one lstat each, whoever asks."""
    memo = getattr(_look, "memo", None)
    if memo is None or not path.startswith("/"):
        return os.path.realpath(path)
    key = ("real", path)
    found = memo.get(key)
    if found is None:
        found = memo[key] = os.path.normpath(_walk("/", path[1:], memo["walk"], {}, memo["mode"])[0])
    return found


def _mode(path: str) -> int | None:
    """Within one_look(), the st_mode the walk saw for `path` when it is a real path it walked (no symlink: lstat
    and stat agree; 0: not there); None: not known, look."""
    memo = getattr(_look, "memo", None)
    return None if memo is None else memo["mode"].get(path)


def stat_mode(path: str) -> int:
    """os.stat(path).st_mode (OSError when it cannot be looked at), from one_look()'s walk for a real path it
    walked."""
    mode = _mode(path)
    if mode is None:
        return os.stat(path).st_mode
    if not mode:
        raise FileNotFoundError(path)
    return mode


def isdir(path: str) -> bool:
    """os.path.isdir, answered from one_look()'s walk for a real path it walked."""
    mode = _mode(path)
    return os.path.isdir(path) if mode is None else S_ISDIR(mode)


def isfile(path: str) -> bool:
    """os.path.isfile, answered from one_look()'s walk for a real path it walked."""
    mode = _mode(path)
    return os.path.isfile(path) if mode is None else S_ISREG(mode)


def exists(path: str) -> bool:
    """os.path.exists (and lexists: a walked real path is no symlink), answered from one_look()'s walk for a
    real path it walked."""
    mode = _mode(path)
    return os.path.exists(path) if mode is None else mode != 0


def lexists(path: str) -> bool:
    """os.path.lexists, answered from one_look()'s walk for a real path it walked (no symlink there)."""
    mode = _mode(path)
    return os.path.lexists(path) if mode is None else mode != 0


def _walk(path: str, rest: str, known: dict, seen: dict, modes: dict) -> tuple[str, bool]:
    """posixpath._joinrealpath (CPython 3.11, non-strict), for absolute paths, with `known`: {a resolved
    directory + "/" + one name: what it resolves to}, filled as the walk goes (a name that is no symlink, or
    does not exist: itself; a symlink: its target's real path once fully resolved), and `modes`: {such a name
    that is no symlink: its lstat's st_mode, 0 when it could not be looked at}. A symlink loop gives what
    realpath gives (the rest joined to the looping name) and none of its names is kept."""
    if rest.startswith("/"):
        rest, path = rest[1:], "/"
    while rest:
        name, _, rest = rest.partition("/")
        if not name or name == ".":
            continue
        if name == "..":
            path = os.path.dirname(path) if path != "/" else "/"
            continue
        newpath = path + name if path == "/" else path + "/" + name
        hit = known.get(newpath)
        if hit is not None:
            path = hit
            continue
        try:
            mode = os.lstat(newpath).st_mode
        except OSError:
            mode = 0  # not there (or not to be looked at): realpath goes on with the name as it is
        if not S_ISLNK(mode):
            known[newpath] = path = newpath
            modes[newpath] = mode
            continue
        if newpath in seen:
            path = seen[newpath]
            if path is not None:
                continue
            return os.path.join(newpath, rest), False  # a loop
        seen[newpath] = None
        path, ok = _walk(path, os.readlink(newpath), known, seen, modes)
        if not ok:
            return os.path.join(path, rest), False
        seen[newpath] = known[newpath] = path
    return path, True


def invoking_homes(env=None) -> list[str]:
    """The homes a cell must not read (real paths, outermost only): the real uid's
    passwd home, $HOME, and when root runs agnsup through sudo, SUDO_USER's home
    (that human's keys and tokens are what a root cell would otherwise read). An
    environment variable here can only add a hidden path, never remove one. A home
    of "/" is the filesystem the role already shows, not a home: skipped. Within
    one_look() (env None: this process's environment), computed once."""
    memo = getattr(_look, "memo", None) if env is None else None
    if memo is None:
        return _invoking_homes(os.environ if env is None else env)
    found = memo.get("homes")
    if found is None:
        try:
            found = memo["homes"] = _invoking_homes(os.environ)
        except SetupError as e:
            found = memo["homes"] = e
    if isinstance(found, SetupError):
        raise found
    return list(found)


def _invoking_homes(env) -> list[str]:
    found = []
    with suppress(KeyError):
        found.append(pwd.getpwuid(os.getuid()).pw_dir)
    found.append(env.get("HOME") or "")
    if os.getuid() == 0 and env.get("SUDO_USER"):
        with suppress(KeyError):
            found.append(pwd.getpwnam(env["SUDO_USER"]).pw_dir)
    homes = []
    for h in found:
        if not h.startswith("/"):
            continue
        real = realpath(h)
        if real == "/" or not isdir(real):
            continue
        held = [f"holds {d}" for d in SYSTEM_DIRS if under(d, real)] + [f"is inside {d}" for d in OS_TREES
                                                                          if under(real, d)]
        if held:
            raise SetupError(f"the invoking user's home {real} {held[0]}: hiding it would hide the system; "
                             "set filesystem.home = \"ro\" in the role to run with it visible", step="home")
        homes.append(real)
    return outermost(homes)


def invoking_homes_safe(env=None) -> list[str]:
    """invoking_homes, or none where the home is the system (compile_plan says so itself)."""
    try:
        return invoking_homes(env)
    except SetupError:
        return []
