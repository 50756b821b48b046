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
"""
from __future__ import annotations

import errno
import os
import select
import stat

PIPE_BUF = 4096
READ_SIZE = 65536


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
    def __init__(self, cap: int | None, via: str):
        self.cap, self.via = cap, via  # via: pipe | pty
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
            s.bytes += n
            s.pending = s.pending[n:]
            if s.gate:
                return  # one PIPE_BUF write per POLLOUT: never block the loop

    def _close_src(self, s: Stream) -> None:
        if not s.eof:
            s.eof = True
            os.close(s.src)

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
