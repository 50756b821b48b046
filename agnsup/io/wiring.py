"""The cell's stdio: which descriptors it gets as fds 0-2, and the pump between them and their destination.

`stdio(cell)` reads what the cell asks (capture, stream, stdin, pty; the plan's
output cap and cell ids) and sets its `input`, `terminal` and `controlling_tty`
(a broker.Cell); the pump itself is pump.py.

"The caller's stdio" is the controller's own fds 0-2 (`agnsup run`), or
`cell.caller_stdio`: the descriptors a `run` handed to serve with its call
(doors/handoff.py), decided on exactly as the controller's own would be; the
cell then gets copies of them where it would have inherited ours.
"""
from __future__ import annotations

import fcntl
import os
import stat

from ..util.digest import file_sha256
from .pump import Input, Pump, Tape, UserTerminal, at_a_terminal, set_winsize, stat_of


def stdio(cell) -> tuple:
    """(the child's fds 0-2, None meaning inherit; the output pump or None).

    Without an output cap the cell writes its destination directly: the
    controller's stdio (run) or the log files (capture). With a cap it
    writes pipes the supervisor pumps, counting bytes; a terminal on the
    controller's side becomes a pty of the cell's own, so isatty() still
    holds for the command but it never holds the user's terminal for output.
    A live cell (stream, pty) is always pumped into its log files, keeping a
    Tape; `stdin` makes fd 0 a pipe whose write end is `cell.input`."""
    cap = cell.plan.limits.get("output_max")
    io = cell.caller_stdio or (0, 1, 2)  # the caller's fds 0-2
    child: list = [None, None, None]
    owned: list[int] = []  # closed here if anything fails
    try:
        if cell.stdin and cell.pty is None:
            r, w = os.pipe()
            owned += (r, w)
            child[0] = r
            cell.input = Input(w, tty=False)
        elif cell.capture:
            child[0] = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
            owned.append(child[0])
        if cell.capture:
            d = cell.plan.cell_dir
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
            dst = {1: os.open(os.path.join(d, "stdout"), flags, 0o600)}
            owned.append(dst[1])
            dst[2] = os.open(os.path.join(d, "stderr"), flags, 0o600)
            owned.append(dst[2])
            if cap is None and not cell.stream:
                _cell_owns(cell.plan, dst[1], dst[2])  # a shell reopens them (/dev/stdout)
                child[1], child[2] = dst[1], dst[2]
                return tuple(child), None
        else:
            # At a terminal the cell gets a pty of its own as stdin and controlling
            # terminal (prompts: ssh, git, sudo, gpg), pumped to and from the user's.
            cell.controlling_tty = not cell.stdin and at_a_terminal(io[0])
            # A cell that is not host root (mapped, process.user) could not reopen a file or pipe
            # of the user's that only its owner may write by path (/dev/stdout is /proc/self/fd/1,
            # a permission check on the inode): it writes a pipe of its own, pumped there, never capped.
            ids = cell.plan.cell_ids()
            closed = [] if ids is None else [n for n in (1, 2) if _users_own(io[n]) and not _reopenable(io[n], ids)]
            if cap is None and not cell.controlling_tty and not closed:
                return _inherit(cell, child, owned, io), None
            dst = {1: io[1], 2: io[2]}
        # A file, /dev/null or a pipe the user gave is theirs: the cell gets that very
        # descriptor (no pump, nothing to cap; 2>&1 stays one descriptor, in order).
        direct = [] if cell.capture else [n for n in (1, 2) if _users_own(io[n]) and n not in closed]
        if len(direct) == 2 and not cell.controlling_tty:
            return _inherit(cell, child, owned, io), None
        pump = _pump(cell, cap, child, dst, owned, direct, [] if cell.capture else closed, io)
        _cell_owns(cell.plan, *{fd for fd in child if fd is not None and fd not in (0, 1, 2)})
        return _inherit(cell, child, owned, io, True), pump
    except BaseException:
        for end in (cell.input, cell.terminal):  # one Input when a pty cell takes `stdin`: closing is idempotent
            if end is not None:
                if end.fd in owned:
                    owned.remove(end.fd)
                end.close()
        cell.input = cell.terminal = None
        for fd in owned:
            os.close(fd)
        raise


def _inherit(cell, child: list, owned: list, io: tuple, made: bool = False) -> tuple | None:
    """The child's fds 0-2 where the empty places are the caller's: inherited from the controller (None), or
    copies of a handed-over caller's descriptors (closed with the rest after the spawn: broker._launch).
    `made`: `child` holds descriptors made for the cell (a pump's), returned even when nothing is inherited."""
    if cell.caller_stdio is None:
        return tuple(child) if made or cell.stdin else None
    for n in (0, 1, 2):
        if child[n] is None:
            child[n] = os.dup(io[n])
            owned.append(child[n])
    return tuple(child)


def close(cell) -> None:
    """The cell's live I/O ends (the tree is dead): the supervisor's ends of its stdin and terminal, the pump."""
    for end in (cell.input, cell.terminal, cell.pump):
        if end is not None:
            end.close()


def output_info(cell) -> dict:
    """The receipt's `output`: captured or passed through, how (the pump's account, or direct), and
    the captured files' sizes and digests."""
    out = {"mode": "captured" if cell.capture else "passthrough"}
    out.update(cell.pump.info() if cell.pump is not None else {"via": "direct", "limit": None})
    if not cell.capture:
        return out
    for name in ("stdout", "stderr"):
        p = os.path.join(cell.plan.cell_dir, name)
        try:
            with open(p, "rb") as f:
                size, digest = file_sha256(f)
            out[name] = {"bytes": size, "sha256": digest, "path": p}
        except OSError:
            out[name] = None
    return out


def _pump(cell, cap: int | None, child: list, dst: dict, owned: list, direct: list, closed: list = (),
          io: tuple = (0, 1, 2)) -> object:
    """The pump between the cell's pipes (or pty) and `dst`; fills `child` with the cell's ends.
    `closed`: the user's own descriptors pumped only because the cell could not reopen them (uncapped).
    `io`: the caller's fds 0-2."""
    tape = None
    if cell.stream:
        d = cell.plan.cell_dir
        tape = Tape({"stdout": os.path.join(d, "stdout"), "stderr": os.path.join(d, "stderr"),
                     "tty": os.path.join(d, "stdout")})
    ttys = [] if cell.capture else [n for n in (1, 2) if os.isatty(io[n])]
    pump = Pump(cap, "pty" if ttys or cell.pty or cell.controlling_tty else "pipe", tape)
    pump.direct = ["stdout" if n == 1 else "stderr" for n in direct]
    try:
        return _fill_pump(cell, pump, ttys, child, dst, owned, direct, closed, io)
    except BaseException:
        pump.close()
        raise


def _fill_pump(cell, pump, ttys: list, child: list, dst: dict, owned: list, direct: list, closed=(),
               io: tuple = (0, 1, 2)) -> object:
    if cell.pty is not None:
        # the cell's whole terminal: what it writes lands in the stdout file, stderr stays empty
        master, slave = _cell_pty(None, cell.pty, raw_output=False)
        child[0] = child[1] = child[2] = slave
        owned.append(slave)
        pump.add("tty", master, dst[1], own_dst=True)
        owned.remove(dst[1])
        cell.terminal = Input(os.dup(master), tty=True)  # resize; and write_stdin with `stdin`
        if cell.stdin:
            cell.input = cell.terminal
        os.close(dst[2])
        owned.remove(dst[2])
        return pump
    if cell.controlling_tty:
        master, slave = _cell_pty(io[0], raw_output=False, suspend=False)
        child[0] = slave
        for n in ttys:
            child[n] = slave
        owned.append(slave)
        pump.add("tty", master, io[ttys[0] if ttys else 0])  # fd 0 of a terminal is open read-write
        pump.terminal = UserTerminal(io[0], os.dup(master))
        pump.add_keys(pump.terminal, os.dup(master))
    elif ttys:
        master, slave = _cell_pty(io[ttys[0]])
        for n in ttys:
            child[n] = slave
        owned.append(slave)
        pump.add("tty", master, io[ttys[0]])
    if not cell.capture and not ttys and not direct and _same_file(io[1], io[2]):
        r, w = os.pipe()  # one destination (2>&1 to a socket...): one pipe, so the order holds
        child[1] = child[2] = w
        owned.append(w)
        pump.add("stdout", r, io[1], capped=1 not in closed)
    for n, name in ((1, "stdout"), (2, "stderr")):
        if child[n] is None and n not in direct:
            r, w = os.pipe()  # both close-on-exec; the child dup2s w onto n
            child[n] = w
            owned.append(w)
            pump.add(name, r, dst[n], own_dst=cell.capture, capped=n not in closed)
            if cell.capture:
                owned.remove(dst[n])
    return pump


def _users_own(fd: int) -> bool:
    """The controller's `fd` is a regular file, /dev/null or a pipe: handed to the cell as it is."""
    st = stat_of(fd)
    if st is None:
        return False
    if stat.S_ISREG(st.st_mode) or stat.S_ISFIFO(st.st_mode):
        return True
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == os.stat(os.devnull).st_rdev


def _reopenable(fd: int, ids: tuple[int, int]) -> bool:
    """Could a cell running as host `ids` open the controller's `fd` for writing by path (/dev/stdout)?"""
    st = stat_of(fd)
    return st is not None and (bool(st.st_mode & 0o002) or (st.st_uid == ids[0] and bool(st.st_mode & 0o200)) or
                               (st.st_gid == ids[1] and bool(st.st_mode & 0o020)))


def _same_file(a: int, b: int) -> bool:
    x, y = stat_of(a), stat_of(b)
    return x is not None and y is not None and (x.st_dev, x.st_ino) == (y.st_dev, y.st_ino)


def _cell_pty(like: int | None, size: dict | None = None, raw_output: bool = True,
              suspend: bool = True) -> tuple[int, int]:
    """A pty for the cell, sized like the controller's terminal `like` or `size` ({"cols", "rows"}).

    `raw_output`: output post-processing off (no ONLCR) so bytes reach the real
    terminal unchanged, and it does its own processing there. A pty that is the
    cell's whole terminal (request `pty`) keeps a terminal's defaults.
    `suspend=False`: no ^Z (VSUSP): nothing above the cell does job control, so a
    stopped cell would hang the user's raw terminal."""
    import termios  # only for a cell that gets a pty (startup cost)
    master, slave = os.openpty()
    if raw_output or not suspend:
        attrs = termios.tcgetattr(slave)
        if raw_output:
            attrs[1] &= ~termios.OPOST
        if not suspend:
            attrs[6][termios.VSUSP] = b"\0"  # _POSIX_VDISABLE on Linux
        termios.tcsetattr(slave, termios.TCSANOW, attrs)
    try:
        if size is not None:
            set_winsize(master, size["cols"], size["rows"])
        else:
            fcntl.ioctl(master, termios.TIOCSWINSZ, fcntl.ioctl(like, termios.TIOCGWINSZ, b"\0" * 8))
    except OSError:
        if size is not None:
            os.close(master)
            os.close(slave)
            raise
    return master, slave


def _cell_owns(plan, *fds: int) -> None:
    """The cell's ends of its stdio (capture files, its pty slave, the pump's pipes) become its own, as
    login(1) chowns a tty: a shell reopens them by path (`echo x > /dev/stdout` opens /proc/self/fd/1,
    a permission check against the inode), and a cell that is not host root (process.user, a mapped
    cell) would be refused a root-owned 0600 one. Never the user's own descriptors (handed on as they are)."""
    ids = plan.cell_ids()
    if ids is None:
        return
    for fd in fds:
        st = os.fstat(fd)
        # only what the controller made for this cell: a file, a pipe, a pty slave (Unix98 majors 136-143);
        # never a shared device such as /dev/null
        if stat.S_ISREG(st.st_mode) or stat.S_ISFIFO(st.st_mode) or \
                (stat.S_ISCHR(st.st_mode) and 136 <= os.major(st.st_rdev) <= 143):
            os.fchown(fd, *ids)
