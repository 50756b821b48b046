"""The proxy's listening socket, made inside the cell's namespace and handed out.

A socket belongs to the network namespace it was created in (network_namespaces(7)),
whichever process later holds it. So the child, once it has its own namespace
with lo up, creates the listener there and passes it to the controller over a
SOCK_SEQPACKET socketpair with SCM_RIGHTS (unix(7)), then closes its copy.
The controller then accepts connections that come from inside the cell and
dials out from its own (the host's) namespace.

The socketpair is made before fork; the child keeps only its end (the
supervisor's close-every-fd step spares it), the controller closes that end
after fork. The controller reads the listener only once the command has
executed: by then the child sent it (before the barrier), and the wait does
not serialise the child's setup with the controller's identity commit.
"""
from __future__ import annotations

import socket

from . import PROXY_HOST

BACKLOG = 512  # connections the cell may open before the controller accepts them


class Handoff:
    def __init__(self, port: int):
        self.port = port
        # Python makes both ends close-on-exec (PEP 446): the command never inherits them.
        self.ours, self.theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)

    def child_fd(self) -> int:
        """The fd the child keeps across its close-every-fd step."""
        return self.theirs.fileno()

    def in_child(self) -> None:
        """In the child, inside its new network namespace with lo up: listen, send, close.
        The controller's end was closed by the child's fd sweep: forget it, never close it
        (its number may belong to a new socket by now)."""
        if self.ours is not None:  # None: born in a fork server, which never had the controller's end
            self.ours.detach()
        lst = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            lst.bind((PROXY_HOST, self.port))
            lst.listen(BACKLOG)
            socket.send_fds(self.theirs, [b"L"], [lst.fileno()])
        finally:
            lst.close()
            self.theirs.close()

    def after_fork(self) -> None:
        """In the controller, right after fork: only the child keeps its end."""
        self.theirs.close()

    def receive(self) -> socket.socket:
        """In the controller, after the command executed: the listener the child sent."""
        try:
            _msg, fds, _flags, _addr = socket.recv_fds(self.ours, 16, 1, socket.MSG_DONTWAIT)
        except BlockingIOError:
            fds = []
        finally:
            self.ours.close()
        if not fds:
            raise OSError("the cell sent no proxy listener")
        return socket.socket(fileno=fds[0])

    def close(self) -> None:
        """Undo (a failed start): a listener still in flight is closed with the socket."""
        for s in (self.ours, self.theirs):
            if s.fileno() != -1:
                s.close()
