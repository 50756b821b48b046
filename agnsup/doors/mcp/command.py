"""The command `agnsup mcp`: main, on stdio or streamable HTTP (the listener, its peer check, the token)."""
from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import sys
from urllib.parse import quote

from ...errors import UsageError

async def _until_signalled(stop) -> None:
    """Call stop() at the first SIGTERM, SIGINT or SIGHUP."""
    import anyio
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        async for _ in signals:
            stop()
            return


async def _serve_stdio(server) -> None:
    import anyio
    from mcp.server.stdio import stdio_server
    async with anyio.create_task_group() as tg:
        tg.start_soon(_until_signalled, tg.cancel_scope.cancel)
        async with stdio_server() as (read, write):
            await server.run(read, write, server.create_initialization_options())
        tg.cancel_scope.cancel()  # the client closed the session


def parse_listen(addr: str) -> tuple[str, str | int]:
    """--http ADDR -> ("unix", path) or (host, port): a Unix socket, or a loopback port
    (anything else would offer this user's cells to the network)."""
    if addr.startswith("unix:"):
        path = addr[len("unix:"):]
        if not path:
            raise UsageError("--http unix:PATH: the socket path is missing")
        return "unix", os.path.abspath(path)
    host, sep, port = addr.rpartition(":")
    host = host.strip("[]")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise UsageError(f"--http {addr!r}: give HOST:PORT (a loopback address) or unix:PATH")
    if host not in ("127.0.0.1", "localhost", "::1"):
        raise UsageError(f"--http {addr!r}: only a loopback address (127.0.0.1, ::1, localhost) or unix:PATH; "
                         "a wider address would offer this user's cells to the network")
    return host, int(port)


def _http_token(where: tuple[str, str | int], listener, ready: dict) -> str | None:
    """The bearer token of a loopback port (None on a Unix socket); `ready` gets the URL (and a new token, with
    the URL that carries it). Every local user can reach a loopback port: the token is the key to this user's
    cells; a header or the URL's query carries it (_has_token)."""
    if where[0] == "unix":
        ready.update(socket=where[1], url="http://localhost/mcp")
        return None
    token = os.environ.get("AGNSUP_MCP_TOKEN") or secrets.token_urlsafe(24)
    host = f"[{where[0]}]" if ":" in where[0] else where[0]
    url = f"http://{host}:{listener.getsockname()[1]}/mcp"
    # a token it made is printed, as is the URL that carries it for a client that cannot send headers
    ready.update(url=url, **({} if os.environ.get("AGNSUP_MCP_TOKEN") else
                             {"token": token, "url_with_token": f"{url}?token={quote(token, safe='')}"}))
    return token


def _listener(where: tuple[str, str | int]):
    if where[0] == "unix":
        from ..serve import listen_unix
        return listen_unix(where[1], "agnsup mcp")
    host, port = where
    family = socket.AF_INET6 if host == "::1" else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(("127.0.0.1" if host == "localhost" else host, port))
    except OSError as e:
        s.close()
        raise UsageError(f"--http {host}:{port}: cannot listen: {e.strerror}") from None
    s.listen(64)
    return s


def _peer_checked(listener, journal):
    """The listener with the peer check of every agnsup control socket (serve.peer_refusal; on a loopback port
    serve.tcp_peer_refusal, before the bearer token is looked at): a process of an agnsup cell gets one 403 answer
    carrying the refusal line, journaled, and its connection is closed before uvicorn sees it (serve.refuse: what
    it writes after the answer is first read and dropped for a second, so that a late request does not lose the
    answer). asyncio accepts through this object's accept() (loop.create_server(sock=)), and a non-blocking accept
    with nothing left raises BlockingIOError as before."""

    class CheckedListener(socket.socket):
        def accept(self):
            from ..serve import peer_refusal, refuse, tcp_peer_refusal
            while True:
                conn, addr = super().accept()
                if self.family == socket.AF_UNIX:
                    refused = peer_refusal(conn, journal, "mcp")
                else:
                    # the bearer token authenticates other local users: only cells are refused here
                    refused = tcp_peer_refusal(addr[:2], conn.getsockname()[:2], journal, "mcp", others_refused=False)
                if refused is None:
                    return conn, addr
                body = json.dumps({"ok": False, "error": refused, "error_type": "Denied", "exit_code": 126}).encode()
                refuse(conn, b"HTTP/1.1 403 Forbidden\r\nContent-Type: application/json\r\nConnection: close\r\n"
                       b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    return CheckedListener(fileno=listener.detach())


def _has_token(scope, want: bytes, token: bytes) -> bool:
    """The request carries the token: `Authorization: Bearer TOKEN`, or `?token=TOKEN` in its URL for a client
    that cannot send headers (the URL is then as secret as the header; the access log is off)."""
    import hmac
    from urllib.parse import parse_qs
    if hmac.compare_digest(dict(scope["headers"]).get(b"authorization", b""), want):
        return True
    given = parse_qs(scope.get("query_string", b"")).get(b"token", [])
    return len(given) == 1 and hmac.compare_digest(given[0], token)


def _bearer(app, token: str):
    """The ASGI app behind a bearer token (a header, or the URL's query): a loopback port is open to every
    local user."""
    want, raw = f"Bearer {token}".encode(), token.encode()

    async def guarded(scope, receive, send):
        if scope["type"] == "http" and not _has_token(scope, want, raw):
            await send({"type": "http.response.start", "status": 401,
                        "headers": [(b"content-type", b"text/plain"), (b"www-authenticate", b"Bearer")]})
            await send({"type": "http.response.body", "body": b"agnsup mcp: missing or wrong bearer token\n"})
            return
        await app(scope, receive, send)
    return guarded


def _ending_sessions(app, sessions):
    """The ASGI app, plus the ends a stdio session has by itself: a client's DELETE of its session cancels the cells
    that session started, and a client that hangs up on a call's response stream is marked in the request's scope
    (CLIENT_GONE: an event the waiting call watches), so the call's cell is cancelled as on stdio."""
    import anyio
    from anyio import to_thread
    from .server import CLIENT_GONE

    async def app_(scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "POST":
            gone = scope[CLIENT_GONE] = anyio.Event()

            async def receive_():  # the SSE response listens for the disconnect; we hear it too
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    gone.set()
                return msg
            await app(scope, receive_, send)
            return
        await app(scope, receive, send)
        if scope["type"] == "http" and scope["method"] == "DELETE":
            sid = dict(scope["headers"]).get(b"mcp-session-id")
            if sid:
                await to_thread.run_sync(sessions.end, sid.decode(errors="replace"))
    return app_


async def _serve_http(server, sessions, listener, token: str | None, ready: dict) -> None:
    """Streamable HTTP on `listener` until SIGTERM/SIGINT/SIGHUP; then the caller ends the cells."""
    import contextlib
    import anyio
    import uvicorn
    from mcp.server.transport_security import TransportSecuritySettings
    unix = listener.family == socket.AF_UNIX
    # DNS rebinding protection for a TCP port (a browser page could reach it); a Unix
    # socket is out of a browser's reach, and its clients send any Host.
    security = (TransportSecuritySettings(enable_dns_rebinding_protection=False) if unix else None)
    app = _ending_sessions(server.streamable_http_app(host="127.0.0.1", transport_security=security), sessions)
    if token:
        app = _bearer(app, token)

    class Web(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):  # ours: uvicorn would re-raise the signal before the cells are cancelled
            yield

    web = Web(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on"))

    def stop() -> None:
        web.should_exit = True

    async def announce():
        while not web.started:
            await anyio.sleep(0.01)
        print(json.dumps(ready), flush=True)

    async with anyio.create_task_group() as tg:
        tg.start_soon(_until_signalled, stop)
        tg.start_soon(announce)
        await web.serve(sockets=[listener])
        tg.cancel_scope.cancel()


def main(state_dir: str | None, role: str, workdir: str | None, run_id: str | None,
         agent_id: str | None, http: str | None = None) -> int:
    """`agnsup mcp`: serve one MCP session on stdio until the client closes it, or
    (--http) streamable HTTP on a Unix socket or loopback port until signalled."""
    import importlib.util
    from ... import policy
    from ...supervisor import Supervisor
    from ...store.state import StateRoot, check_id
    from .session import Sessions, new_run_id
    if run_id:
        check_id("run", run_id)
    if agent_id:
        check_id("agent", agent_id)
    workdir = os.path.realpath(workdir or os.getcwd())
    if not os.path.isdir(workdir):
        raise UsageError(f"--workdir {workdir}: not a directory")
    where = parse_listen(http) if http else None
    if where is not None and where[0] == "unix":
        from ..serve import socket_place
        socket_place(where[1], StateRoot(state_dir).path, f"--http {http}")
    policy.load(role, StateRoot(state_dir).path)  # an unknown role fails now, not at the first call
    if importlib.util.find_spec("mcp") is None:
        raise UsageError("agnsup mcp needs the mcp extra: pip install 'agnsup[mcp]'")
    import anyio
    from .server import build_server
    listener = _listener(where) if where else None
    sup = Supervisor(state_dir, kind="mcp")
    if where is not None:
        listener = _peer_checked(listener, sup.ctl.journal)
    try:
        # stdio is one session: its run is --run-id or a new one; over HTTP, without
        # --run-id, each session gets a run of its own (ready says run_id null).
        sessions = Sessions(sup, role, workdir, run_id or (None if where else new_run_id()), agent_id)
        ready = {"ready": True, "transport": "http" if where else "stdio", "run_id": sessions.run_id, "role": role,
                 "workdir": workdir, "controller": sup.controller_id, "pid": os.getpid()}
        if where is None:
            print(json.dumps(ready), file=sys.stderr, flush=True)  # stdout is the protocol
            anyio.run(_serve_stdio, build_server(sessions))
        else:
            token = _http_token(where, listener, ready)
            anyio.run(_serve_http, build_server(sessions), sessions, listener, token, ready)
    finally:
        # The session is over: cancel its live cells and wait for their receipts. A
        # client that closed stdin may send SIGTERM a moment later (the SDK's stdio
        # client does after 2 s); that must not cut this short and orphan the cells.
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        sup.close()
        if listener is not None:
            listener.close()
            if where[0] == "unix" and os.path.lexists(where[1]):
                os.unlink(where[1])
    return 0
