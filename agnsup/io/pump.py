"""The output pump: what a cell writes to the controller, bounded by the role.

With `limits.output_max` set, a cell never holds the controller's stdout or
stderr (nor, in capture mode, the log files): it writes into pipes (or, when
the controller's stdout is a terminal, a pty of its own) that the controller
drains from the supervisor's poll loop into the real destination, counting
bytes. The first byte past the cap is never delivered; the supervisor then
kills the cell's tree and the receipt says `output_limit`.

Writes to the destination never block the loop (a stalled reader of the
controller's stdout must not stall the timeout): the loop asks for POLLOUT
first and writes at most PIPE_BUF bytes to a pipe or terminal, which the
kernel accepts whole once POLLOUT is reported. Regular files take any size.
If the destination's reader went away (EPIPE), the cell's own pipe is closed
so the cell gets EPIPE/SIGPIPE on its next write, as it would have directly.

A live cell (request `stream` or `pty`) is always pumped, into its captured
files, and its pump keeps a Tape: the order of what it read, as (stream,
offset, length) entries over those files, which read_output serves. The data
itself is read back from the files (page cache), so the memory a chatty cell
costs is the index alone, and no chunk is ever lost to a ring: a reader that
comes late still gets everything from seq 0. Entries nobody has been handed
yet are merged (same stream, up to CHUNK_MAX), so the index grows with what
readers ask for, not with the cell's write calls. Input holds what the
supervisor writes to the cell's fd 0 (write_stdin).
"""
from __future__ import annotations

import errno
import fcntl
import os
import select
import stat
import struct
import time
from contextlib import suppress

from ..errors import StateError

PIPE_BUF = 4096
READ_SIZE = 262144      # one read of a full pipe, mostly
PIPE_SIZE = 1 << 20     # the cell's pipes (F_SETPIPE_SZ; the default unprivileged maximum)
SPLICE_SIZE = 1 << 20
SPLICE_ROUNDS = 8       # splices per wake-up before the loop looks at its other fds again
SPLICE_F_NONBLOCK = 2   # fcntl.h
READ_ROUNDS = 16        # reads gathered into one write (a pty gives 4 KiB a read)
CHUNK_MAX = 65536       # a Tape chunk never grows past this when entries are merged
STREAMS = ("stdout", "stderr", "tty")


class Stream:
    """One source the cell writes (a pipe or pty master) and where it goes.

    How it is written (`kind`): "file" (regular: takes any size at once), "nonblock"
    (a pipe or terminal, through our own O_NONBLOCK open file of it, or one that is
    non-blocking already: partial writes, EAGAIN, then POLLOUT), "socket" (send with
    MSG_DONTWAIT), "gated" (anything else: one PIPE_BUF write per POLLOUT, which the
    kernel takes whole). A pipe into a file or pipe is spliced: no copy through us."""

    def __init__(self, name: str, src: int, dst: int, own_dst: bool):
        self.name, self.src, self.dst, self.own_dst = name, src, dst, own_dst
        self.counted = True     # against the cap: what the cell writes, not what the user types
        self.capped = True      # False: the cell's output to the user's own file or pipe, pumped only because
                                # the cell could not reopen it (wiring.stdio): never capped, as when direct
        self.nonblock = True    # src is ours and O_NONBLOCK: it may be read until EAGAIN
        self.pending = b""
        self.eof = False
        self.bytes = 0          # delivered to the destination's queue (never past the cap)
        self.broken: str | None = None  # why the destination stopped taking bytes
        self.kind, self.out, self.own_out = _destination(dst)
        self.sock = None
        if self.kind == "socket":
            import socket
            self.sock = socket.socket(fileno=os.dup(dst))
        self.splice = _is_fifo(src) and (self.kind == "file" or (self.kind == "nonblock" and _is_fifo(self.out)))
        self.blocked = False    # splice: the destination is full, waiting for POLLOUT
        self.keys = False       # the user's terminal into the cell's pty: its end of input becomes the pty's
        self.last = b"\n"       # keys: the last byte handed on (is the cell's line empty?)

    def close_out(self) -> None:
        if self.own_out:
            os.close(self.out)
            self.own_out = False
        if self.sock is not None:
            self.sock.close()
            self.sock = None


def stat_of(fd: int) -> os.stat_result | None:
    """os.fstat(fd), or None when it fails (a descriptor that is not open)."""
    try:
        return os.fstat(fd)
    except OSError:
        return None


def _is_fifo(fd: int) -> bool:
    st = stat_of(fd)
    return st is not None and stat.S_ISFIFO(st.st_mode)


def _destination(fd: int) -> tuple[str, int, bool]:
    """(kind, the fd to write, whether that fd is ours to close) for destination `fd`."""
    st = stat_of(fd)
    if st is None:
        return "gated", fd, False
    if stat.S_ISREG(st.st_mode):
        return "file", fd, False
    if not os.get_blocking(fd):
        return "nonblock", fd, False  # ours already (a pty master)
    if stat.S_ISSOCK(st.st_mode):
        return "socket", fd, False
    # A pipe or terminal we share with the user: O_NONBLOCK on their open file would
    # change it for them too, so we open one of our own. Not major 5 (/dev/tty,
    # /dev/console, /dev/ptmx: reopening those names another terminal, or a new one).
    if stat.S_ISFIFO(st.st_mode) or (stat.S_ISCHR(st.st_mode) and os.major(st.st_rdev) != 5):
        try:
            own = os.open(f"/proc/self/fd/{fd}", os.O_WRONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
        except OSError:
            return "gated", fd, False
        return "nonblock", own, True
    return "gated", fd, False


class Pump:
    def __init__(self, cap: int | None, via: str, tape: "Tape | None" = None):
        self.cap, self.via = cap, via  # via: pipe | pty
        self.tape = tape        # a live cell: what read_output serves
        self.direct: list[str] = []  # streams the cell writes to the user's own file/pipe (not pumped)
        self.terminal: "UserTerminal | None" = None  # agnsup run at a terminal: its modes, its size
        self.draining = False
        self.streams: list[Stream] = []
        self.total = 0          # bytes the cell wrote that we read (up to cap + 1)
        self.overflowed = False
        self.incomplete = False

    def add(self, name: str, src: int, dst: int, own_dst: bool = False, counted: bool = True,
            nonblock: bool = True, capped: bool = True) -> None:
        """`nonblock=False`: src shares its open file with someone else (the user's terminal),
        whose O_NONBLOCK we must not change; it is read only after POLLIN."""
        if nonblock:
            os.set_blocking(src, False)
            if _is_fifo(src):
                with suppress(OSError):  # above /proc/sys/fs/pipe-max-size for this user: the default
                    fcntl.fcntl(src, fcntl.F_SETPIPE_SZ, PIPE_SIZE)  # fewer wake-ups per byte
        s = Stream(name, src, dst, own_dst)
        s.counted, s.nonblock, s.capped = counted, nonblock, capped
        self.streams.append(s)

    def add_keys(self, terminal: "UserTerminal", master: int) -> None:
        """What is typed at the user's `terminal` (raw) to the cell's pty `master` (ours to close):
        first what it held before it went raw, each of its ends of input as the pty's VEOF; an end of
        input later (a hangup) as end_of_input."""
        self.add("stdin", os.dup(terminal.fd), master, own_dst=True, counted=False, nonblock=False)
        s = self.streams[-1]
        s.keys = True
        if terminal.ahead:
            eof = end_of_input(master, b"\n")  # the VEOF byte: one per end, as the user's terminal had them
            self._take(s, b"".join(b + (eof if ended else b"") for b, ended in terminal.ahead))

    # -- the poll loop's view ---------------------------------------------
    def interest(self) -> dict[int, int]:
        """{fd: poll mask} this pump wants now."""
        want: dict[int, int] = {}
        for s in self.streams:
            if not s.counted and self.draining:
                continue  # the cell is gone: what the user types now has nowhere to go
            if s.pending or s.blocked:
                if s.kind != "file":
                    want[s.out] = want.get(s.out, 0) | select.POLLOUT
            elif not s.eof:
                want[s.src] = want.get(s.src, 0) | select.POLLIN
        return want

    def handle(self, fd: int, mask: int) -> None:
        """Move bytes for every stream `fd` belongs to."""
        for s in self.streams:
            if (s.pending or s.blocked) and fd == s.out and mask & (select.POLLOUT | select.POLLERR | select.POLLHUP):
                if s.blocked:
                    s.blocked = False
                    self._splice(s)
                else:
                    self._flush(s)
            elif not s.pending and not s.blocked and not s.eof and fd == s.src:
                if s.splice:
                    self._splice(s)
                    continue
                self._read(s)
                if s.pending and s.kind != "gated":
                    self._flush(s)  # never blocks: a file, or a non-blocking write

    def _read(self, s: Stream) -> None:
        # A pty hands out at most 4 KiB per read: gather a few reads into one write
        # (fewer polls and writes per byte); a blocking source is read once per POLLIN.
        parts: list[bytes] = []
        size, ended = 0, False
        for _ in range(READ_ROUNDS if s.nonblock else 1):
            try:
                b = os.read(s.src, READ_SIZE)
            except BlockingIOError:
                break
            except OSError as e:
                if e.errno != errno.EIO:  # EIO: a pty master whose slave is closed everywhere
                    raise
                b = b""
            if not b:
                ended = True
                break
            parts.append(b)
            size += len(b)
            if size >= READ_SIZE:
                break
        if ended and s.keys:
            parts.append(end_of_input(s.out, parts[-1][-1:] if parts else s.last))
        if parts:
            self._take(s, parts[0] if len(parts) == 1 else b"".join(parts))
        if ended:
            self._close_src(s)

    def _take(self, s: Stream, data: bytes) -> None:
        """Bytes read from the cell: what of them goes on (the cap), as `s.pending`."""
        if s.counted and s.capped:  # what the user types (not counted) is never capped
            if self.overflowed:
                return  # past the cap: read to let the writer die, deliver nothing
            room = None if self.cap is None else self.cap - self.total
            self.total += len(data)
            if room is not None and len(data) > room:
                data, self.overflowed = data[:room], True
        if s.keys and data:
            s.last = data[-1:]
        if s.broken is None:
            s.pending = memoryview(data)

    def _splice(self, s: Stream) -> None:
        """Pipe to file or pipe in the kernel, up to the cap; a few rounds, then back to the loop."""
        # With another stream of the cell open, one READ_SIZE a turn: the cap is shared, and
        # what the other stream wrote first must not lose its place to a 1 MiB splice.
        alone = not any(x is not s and x.counted and not x.eof for x in self.streams)
        for _ in range(SPLICE_ROUNDS if alone else 1):
            count = SPLICE_SIZE if alone else READ_SIZE
            if s.counted and s.capped and self.cap is not None:
                if self.overflowed or self.cap <= self.total:
                    self._read(s)  # at the cap: a byte more is the overflow; or EOF
                    return
                count = min(count, self.cap - self.total)
            try:
                n = os.splice(s.src, s.out, count, flags=SPLICE_F_NONBLOCK)
            except BlockingIOError:
                # our pipe is empty, or the destination (a pipe) is full: then wait for POLLOUT
                s.blocked = s.kind != "file" and _unread(s.src) > 0
                return
            except OSError as e:
                if e.errno == errno.EINVAL and s.bytes == 0:
                    s.splice = False  # this pair cannot splice (an O_APPEND file...): copy instead
                    return
                self._broken(s, e)
                return
            if n == 0:
                self._close_src(s)
                return
            if s.counted and s.capped:
                self.total += n
            if self.tape is not None:
                self.tape.add(s.name, s.bytes, n)
            s.bytes += n

    def _flush(self, s: Stream) -> None:
        while s.pending:
            try:
                if s.kind == "socket":
                    import socket
                    n = s.sock.send(s.pending, socket.MSG_DONTWAIT)
                else:
                    n = os.write(s.out, s.pending[:PIPE_BUF] if s.kind == "gated" else s.pending)
            except BlockingIOError:
                return
            except OSError as e:
                self._broken(s, e)
                return
            if self.tape is not None:
                self.tape.add(s.name, s.bytes, n)  # written to the captured file: now readable
            s.bytes += n
            s.pending = s.pending[n:]
            if s.kind == "gated":
                return  # one PIPE_BUF write per POLLOUT: never block the loop

    def _broken(self, s: Stream, e: OSError) -> None:
        # EPIPE: nobody reads the controller's stdout any more. Hand that on
        # to the cell: close its pipe so its next write fails the same way.
        s.broken = errno.errorcode.get(e.errno, str(e.errno))
        s.pending = b""
        s.blocked = False
        self._close_src(s)

    def _close_src(self, s: Stream) -> None:
        if not s.eof:
            s.eof = True
            os.close(s.src)
        if self.tape is not None and all(x.eof and not x.pending for x in self.streams if x.counted):
            self.tape.close()  # every writer is gone: nothing more will come

    # -- after the cell ended ---------------------------------------------
    def drain(self, timeout: float) -> None:
        """Deliver what is still in the pipes, until every writer is gone (EOF).

        Called after the cell's tree is dead, so EOF comes at once; without a
        cgroup a stray writer could hold a pipe open, hence the deadline."""
        self.draining = True
        deadline = time.monotonic() + timeout
        p = select.poll()
        while True:
            want = self.interest()
            if not want:
                return
            left = deadline - time.monotonic()
            if left <= 0:
                self.incomplete = True
                return
            for fd, mask in want.items():
                p.register(fd, mask)
            events = p.poll(int(left * 1000) + 1)
            for fd, _ in list(want.items()):
                p.unregister(fd)
            for fd, mask in events:
                self.handle(fd, mask)

    def close(self) -> None:
        if self.terminal is not None:
            self.terminal.restore()
        if self.tape is not None:
            self.tape.close()
        for s in self.streams:
            self._close_src(s)
            s.close_out()
            if s.own_dst:
                with suppress(OSError):
                    os.close(s.dst)
                s.own_dst = False

    def info(self) -> dict:
        out = {"via": self.via, "limit": self.cap, "bytes": sum(s.bytes for s in self.streams if s.counted),
               "exceeded": self.overflowed}
        for s in self.streams:
            out[s.name + "_bytes"] = s.bytes
            if s.broken:
                out[s.name + "_broken"] = s.broken
        if self.incomplete:
            out["incomplete"] = True
        if self.direct:
            out["direct"] = self.direct
        return out


def at_a_terminal(fd: int = 0) -> bool:
    """Our stdin (`fd`) is a terminal we may take over: in its foreground group (a background job,
    `agnsup run ... &`, would be stopped by SIGTTOU/SIGTTIN: it keeps the terminal as it is),
    or a terminal that is not our controlling one (no job control applies)."""
    if not os.isatty(fd):
        return False
    try:
        return os.tcgetpgrp(fd) == os.getpgrp()
    except OSError:
        return True


def _unread(fd: int) -> int:
    """Bytes waiting in the pipe `fd` (FIONREAD)."""
    import termios  # termios, tty, threading, array: only where a terminal or live I/O needs them (startup cost)
    try:
        return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0]
    except OSError:
        return 0


class UserTerminal:
    """The terminal `agnsup run` was started from, while a cell uses a pty of its own through it:
    raw mode here (every key goes to the cell's pty, whose line discipline does the rest),
    its size copied to the cell's pty, its modes restored however the cell ends.

    `ahead`: what the terminal held before it went raw, as (bytes, ended) pieces: a line, or a
    partial line or nothing `ended` by the terminal's end of input (VEOF). A wrapper whose own input
    is at end of file (script(1), expect, a CI runner) types VEOF at once, while this terminal is
    still canonical; going raw would turn that pending end of input into a NUL byte (n_tty keeps it
    as a 0 in its buffer), so the cell got ^@ and never end of file. It is read first, as canonical
    lines, with VEOF disabled meanwhile so one typed then stays a byte the raw read hands on."""

    def __init__(self, fd: int, cell_master: int | None):
        import termios
        import tty
        self.fd, self.master, self.saved = fd, cell_master, None
        self.ahead: list[tuple[bytes, bool]] = []
        try:
            self.saved = termios.tcgetattr(fd)
            if self.saved[3] & termios.ICANON:
                self.ahead = _canonical_lines(fd, self.saved)
            tty.setraw(fd, termios.TCSANOW)
        except BaseException:
            self.restore()
            raise

    def follow_size(self) -> None:
        """SIGWINCH here: the cell's pty takes our size (and the kernel sends it SIGWINCH)."""
        import termios
        if self.master is None:
            return
        with suppress(OSError):
            fcntl.ioctl(self.master, termios.TIOCSWINSZ, fcntl.ioctl(self.fd, termios.TIOCGWINSZ, b"\0" * 8))

    def restore(self) -> None:
        import termios
        if self.saved is not None:
            with suppress(OSError, termios.error):  # the terminal went away (hangup, EIO): nothing to restore
                termios.tcsetattr(self.fd, termios.TCSADRAIN, self.saved)
            self.saved = None
        if self.master is not None:
            os.close(self.master)
            self.master = None


def _canonical_lines(fd: int, modes: list) -> list[tuple[bytes, bool]]:
    """The complete lines and ends of input waiting on the canonical terminal `fd` (see UserTerminal)."""
    import termios
    cc = modes[6]
    quiet = [*modes[:6], list(cc)]
    quiet[6][termios.VEOF] = b"\0"  # _POSIX_VDISABLE: a ^D from now on is a byte, read raw later
    termios.tcsetattr(fd, termios.TCSANOW, quiet)
    ends = {b"\n", cc[termios.VEOL], cc[termios.VEOL2]}
    lines = []
    p = select.poll()
    p.register(fd, select.POLLIN)
    # canonical: POLLIN only for a whole line or an end of input, and a read returns one of them
    while p.poll(0) and len(lines) < 4096:
        try:
            b = os.read(fd, 4096)
        except OSError:
            break
        lines.append((b, not b or b[-1:] not in ends))  # a partial line or nothing: ended by VEOF
        if not b and select.POLLHUP & dict(p.poll(0)).get(fd, 0):
            break  # hung up: reads return 0 for ever
    return lines


def end_of_input(pty: int, last: bytes) -> bytes:
    """What the cell's pty `pty` needs to read end of file after `last`, the last byte written to it.

    VEOF at the start of a line; after a partial line twice (the first hands the line to the
    reader, the second is the end of file: termios(3) "EOF"). A pty the cell set raw has no end of
    input: VEOF once, the byte such programs (shells, REPLs) take for it. VEOF disabled: nothing."""
    import termios
    try:
        iflag, lflag, cc = (a := termios.tcgetattr(pty))[0], a[3], a[6]
    except (OSError, termios.error):
        return b""
    eof = cc[termios.VEOF]
    if eof == b"\0":
        return b""
    if not lflag & termios.ICANON:
        return eof
    ends = {b"", b"\n", eof, cc[termios.VEOL], cc[termios.VEOL2], cc[termios.VKILL]}
    if lflag & termios.ISIG:
        ends |= {cc[termios.VINTR], cc[termios.VQUIT], cc[termios.VSUSP]}  # they flush the line
    if iflag & termios.ICRNL and not iflag & termios.IGNCR:
        ends.add(b"\r")
    ends.discard(b"\0")  # a disabled one
    return eof if last in ends else eof + eof


class Tape:
    """The order of a live cell's output: (stream, offset, length) over its captured files.

    Appended by the pump (the cell's supervising thread), read by any thread
    (Supervisor.read_output). seq is the entry's index; entries are never
    dropped, so `since` may be anything from 0."""

    def __init__(self, files: dict[str, str]):
        import threading
        from array import array
        self.files = files                  # stream name -> captured file it is written to
        self.cond = threading.Condition()
        self.kind = bytearray()             # STREAMS index per entry
        self.offset = array("q")
        self.length = array("q")
        self.handed = 0                     # entries below this were given to a reader: never merged again
        self.closed = False

    def add(self, stream: str, offset: int, n: int) -> None:
        k = STREAMS.index(stream)
        with self.cond:
            last = len(self.kind) - 1
            if last >= self.handed and self.kind[last] == k and self.offset[last] + self.length[last] == offset:
                grow = min(n, CHUNK_MAX - self.length[last])
                self.length[last] += grow
                offset, n = offset + grow, n - grow
            while n > 0:  # a splice moves up to 1 MiB: chunks stay at most CHUNK_MAX
                piece = min(n, CHUNK_MAX)
                self.kind.append(k)
                self.offset.append(offset)
                self.length.append(piece)
                offset, n = offset + piece, n - piece
            self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()

    def read(self, since: int = 0, timeout: float | None = None, max_bytes: int | None = None) -> dict:
        """Chunks with seq >= since, waiting up to `timeout` (None: forever) for one.

        At least one chunk comes back when there is one, even past max_bytes
        (a chunk is at most CHUNK_MAX bytes). `ended`: the cell's output
        streams are closed and this read reached the end."""
        with self.cond:
            self.cond.wait_for(lambda: self.closed or len(self.kind) > since, timeout)
            total = len(self.kind)
            end, budget = since, 0
            while end < total and (max_bytes is None or end == since or budget + self.length[end] <= max_bytes):
                budget += self.length[end]
                end += 1
            self.handed = max(self.handed, end)
            entries = [(i, STREAMS[self.kind[i]], self.offset[i], self.length[i]) for i in range(since, end)]
            ended = self.closed and end >= total
        chunks = []
        fds: dict[str, int] = {}
        try:
            for seq, stream, off, n in entries:
                if stream not in fds:
                    fds[stream] = os.open(self.files[stream], os.O_RDONLY | os.O_CLOEXEC)
                chunks.append({"seq": seq, "stream": stream, "data": os.pread(fds[stream], n, off)})
        except OSError as e:
            raise StateError(f"the captured output is gone ({self.files.get(stream)}: {e.strerror})") from None
        finally:
            for fd in fds.values():
                os.close(fd)
        return {"chunks": chunks, "next": max(end, since), "ended": ended}


class Input:
    """The supervisor's end of a cell's fd 0: a pipe's write end, or a pty master (a dup of it,
    so the pump closing its own copy never leaves this one pointing at a reused fd number).

    Writers take turns (`turn`); the fd itself is used and closed only under
    `fd_lock`, held for one non-blocking call at a time, so close() and resize()
    never wait for a writer the cell does not read from."""

    def __init__(self, fd: int, tty: bool):
        import threading
        self.fd: int | None = fd
        self.tty = tty
        self.turn = threading.Lock()
        self.fd_lock = threading.Lock()
        self.eof = False
        self.last = b"\n"  # a pty: the last byte written (is the cell's line empty? end_of_input)
        os.set_blocking(fd, False)

    def write(self, data: bytes, eof: bool = False) -> None:
        """All of `data` (waiting while the cell does not read), then EOF if asked.
        Raises BrokenPipeError once the cell's end is closed or the cell ended."""
        with self.turn:
            if self.eof:
                raise BrokenPipeError(errno.EPIPE, "stdin was already closed (eof)")
            if eof and self.tty:  # a pty has no end of file of its own: its VEOF at the start of a line
                with self.fd_lock:
                    if self.fd is not None:
                        data = data + end_of_input(self.fd, data[-1:] or self.last)
            view = memoryview(data)
            while True:
                with self.fd_lock:
                    if self.fd is None:
                        raise BrokenPipeError(errno.EPIPE, "the cell ended")
                    try:
                        n = os.write(self.fd, view) if view else 0
                    except BlockingIOError:
                        n = None
                    except OSError as e:
                        if e.errno == errno.EIO:  # a pty whose cell side is closed everywhere
                            raise BrokenPipeError(errno.EPIPE, "the cell's terminal is closed") from None
                        raise
                    if n is not None:
                        view = view[n:]
                    if not view:
                        if data:
                            self.last = data[-1:]
                        if eof and not self.tty:
                            self.eof = True
                            self._close()
                        return
                    fd = self.fd
                p = select.poll()
                p.register(fd, select.POLLOUT)
                p.poll(200)  # bounded: a close() meanwhile is seen on the next turn

    def resize(self, cols: int, rows: int) -> None:
        with self.fd_lock:
            if self.fd is None:
                raise BrokenPipeError(errno.EPIPE, "the cell ended")
            set_winsize(self.fd, cols, rows)

    def _close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def close(self) -> None:
        with self.fd_lock:
            self._close()


def set_winsize(fd: int, cols: int, rows: int) -> None:
    """TIOCSWINSZ: the kernel sends SIGWINCH to the terminal's foreground process group."""
    import termios
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
