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
import os
import select
import stat

PIPE_BUF = 4096
READ_SIZE = 65536
CHUNK_MAX = 65536       # a Tape chunk never grows past this when entries are merged
STREAMS = ("stdout", "stderr", "tty")


class Stream:
    """One source the cell writes (a pipe or pty master) and where it goes."""

    def __init__(self, name: str, src: int, dst: int, own_dst: bool):
        self.name, self.src, self.dst, self.own_dst = name, src, dst, own_dst
        self.pending = b""
        self.eof = False
        self.bytes = 0          # delivered to the destination's queue (never past the cap)
        self.broken: str | None = None  # why the destination stopped taking bytes
        try:
            regular = stat.S_ISREG(os.fstat(dst).st_mode)
        except OSError:
            regular = False
        self.chunk = READ_SIZE if regular else PIPE_BUF
        self.gate = not regular  # regular files are always "ready": no POLLOUT round trip


class Pump:
    def __init__(self, cap: int | None, via: str, tape: "Tape | None" = None):
        self.cap, self.via = cap, via  # via: pipe | pty
        self.tape = tape        # a live cell: what read_output serves
        self.streams: list[Stream] = []
        self.total = 0          # bytes the cell wrote that we read (up to cap + 1)
        self.overflowed = False
        self.incomplete = False

    def add(self, name: str, src: int, dst: int, own_dst: bool = False) -> None:
        os.set_blocking(src, False)
        self.streams.append(Stream(name, src, dst, own_dst))

    # -- the poll loop's view ---------------------------------------------
    def interest(self) -> dict[int, int]:
        """{fd: poll mask} this pump wants now."""
        want: dict[int, int] = {}
        for s in self.streams:
            if s.pending:
                if s.gate:
                    want[s.dst] = want.get(s.dst, 0) | select.POLLOUT
            elif not s.eof:
                want[s.src] = select.POLLIN
        return want

    def owns(self, fd: int) -> bool:
        return any(fd in (s.src, s.dst) for s in self.streams)

    def handle(self, fd: int, mask: int) -> None:
        """Move bytes for every stream `fd` belongs to."""
        for s in self.streams:
            if s.pending and fd == s.dst and mask & (select.POLLOUT | select.POLLERR | select.POLLHUP):
                self._flush(s)
            elif not s.pending and not s.eof and fd == s.src:
                self._read(s)
                if s.pending and not s.gate:
                    self._flush(s)

    def _read(self, s: Stream) -> None:
        try:
            data = os.read(s.src, READ_SIZE)
        except BlockingIOError:
            return
        except OSError as e:
            if e.errno != errno.EIO:  # EIO: a pty master whose slave is closed everywhere
                raise
            data = b""
        if not data:
            self._close_src(s)
            return
        if self.overflowed:
            return  # past the cap: read to let the writer die, deliver nothing
        room = None if self.cap is None else self.cap - self.total
        self.total += len(data)
        if room is not None and len(data) > room:
            data = data[:room]
            self.overflowed = True
        if s.broken is None:
            s.pending = data

    def _flush(self, s: Stream) -> None:
        while s.pending:
            try:
                n = os.write(s.dst, s.pending[:s.chunk])
            except BlockingIOError:
                return
            except OSError as e:
                # EPIPE: nobody reads the controller's stdout any more. Hand that on
                # to the cell: close its pipe so its next write fails the same way.
                s.broken = errno.errorcode.get(e.errno, str(e.errno))
                s.pending = b""
                self._close_src(s)
                return
            if self.tape is not None:
                self.tape.add(s.name, s.bytes, n)  # written to the captured file: now readable
            s.bytes += n
            s.pending = s.pending[n:]
            if s.gate:
                return  # one PIPE_BUF write per POLLOUT: never block the loop

    def _close_src(self, s: Stream) -> None:
        if not s.eof:
            s.eof = True
            os.close(s.src)
        if self.tape is not None and all(x.eof and not x.pending for x in self.streams):
            self.tape.close()  # every writer is gone: nothing more will come

    # -- after the cell ended ---------------------------------------------
    def drain(self, timeout: float) -> None:
        """Deliver what is still in the pipes, until every writer is gone (EOF).

        Called after the cell's tree is dead, so EOF comes at once; without a
        cgroup a stray writer could hold a pipe open, hence the deadline."""
        import time
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
        if self.tape is not None:
            self.tape.close()
        for s in self.streams:
            self._close_src(s)
            if s.own_dst:
                try:
                    os.close(s.dst)
                except OSError:
                    pass
                s.own_dst = False

    def info(self) -> dict:
        out = {"via": self.via, "limit": self.cap, "bytes": sum(s.bytes for s in self.streams),
               "exceeded": self.overflowed}
        for s in self.streams:
            out[s.name + "_bytes"] = s.bytes
            if s.broken:
                out[s.name + "_broken"] = s.broken
        if self.incomplete:
            out["incomplete"] = True
        return out


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
            if last >= self.handed and self.kind[last] == k and self.offset[last] + self.length[last] == offset \
                    and self.length[last] + n <= CHUNK_MAX:
                self.length[last] += n
            else:
                self.kind.append(k)
                self.offset.append(offset)
                self.length.append(n)
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

    EOT = b"\x04"  # a pty's default VEOF: at the start of a line, read() returns 0 (termios(3))

    def __init__(self, fd: int, tty: bool):
        import threading
        self.fd: int | None = fd
        self.tty = tty
        self.turn = threading.Lock()
        self.fd_lock = threading.Lock()
        self.eof = False
        os.set_blocking(fd, False)

    def write(self, data: bytes, eof: bool = False) -> None:
        """All of `data` (waiting while the cell does not read), then EOF if asked.
        Raises BrokenPipeError once the cell's end is closed or the cell ended."""
        with self.turn:
            if self.eof:
                raise BrokenPipeError(errno.EPIPE, "stdin was already closed (eof)")
            view = memoryview(data + (self.EOT if eof and self.tty else b""))
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
    import fcntl
    import struct
    import termios
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
