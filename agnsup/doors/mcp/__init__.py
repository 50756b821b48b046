"""`agnsup mcp`: a Model Context Protocol server, one more front door over supervisor.Supervisor.

A coding agent (Claude Code, Codex, Cursor, Gemini CLI, ...) starts `agnsup mcp`
as an MCP server (stdio) and calls its tools. Every tool that runs something
asks the one Supervisor for a cell, so the command gets what `agnsup run` gives
it (policy, cgroup, namespaces, an environment from nothing, journal, receipt)
and this module starts no process of its own. Built on the official `mcp` SDK's
low-level Server (an optional extra, `agnsup[mcp]`; imported only by this
command), so the tools' JSON schemas are ours, generated from request.py.

Who decides what:

    run id    one per MCP session: --run-id, else mcp-XXXXXXXX (a new one per stdio server, or
              per streamable HTTP session)
    agent id  the MCP client's name (its initialize request), or --agent; a call may
              name its own (sub-agents sharing one connection)
    role      --role, fixed for the whole session: no tool takes one
    workdir   --workdir (default: the current directory); a call's workdir must lie
              inside it (a relative one is taken from it)

A refusal (governance denied, not found, a bad argument, an unknown id) is a
tool result with isError set and the error as errors.as_value gives it, a
denial's rule, reason and hint at the top; the protocol itself never fails for
it. The end of the session (stdin closed, the client gone, an HTTP DELETE of the
session, SIGTERM/SIGINT/SIGHUP) cancels every cell the session started (at the
server's end: and waits for their receipts); a cancelled tools/call request
cancels the cell it waits for.
"""
from __future__ import annotations

import json
import os
import signal
import sys

from ...errors import UsageError


def main(state_dir: str | None, role: str, workdir: str | None, run_id: str | None,
         agent_id: str | None, http: str | None = None) -> int:
    """`agnsup mcp`: serve one MCP session on stdio until the client closes it, or
    (--http) streamable HTTP on a Unix socket or loopback port until signalled."""
    import importlib.util
    from ... import policy
    from ...supervisor import Supervisor
    from ...store.state import StateRoot, check_id
    from .session import Sessions, new_run_id
    from .transport import http_token, listen, parse_listen, peer_checked, serve_http, serve_stdio
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
    listener = listen(where) if where else None
    sup = Supervisor(state_dir, kind="mcp")
    if where is not None:
        listener = peer_checked(listener, sup.ctl.journal)
    try:
        # stdio is one session: its run is --run-id or a new one; over HTTP, without
        # --run-id, each session gets a run of its own (ready says run_id null).
        sessions = Sessions(sup, role, workdir, run_id or (None if where else new_run_id()), agent_id)
        ready = {"ready": True, "transport": "http" if where else "stdio", "run_id": sessions.run_id, "role": role,
                 "workdir": workdir, "controller": sup.controller_id, "pid": os.getpid()}
        server = build_server(sessions)
        if where is None:
            print(json.dumps(ready), file=sys.stderr, flush=True)  # stdout is the protocol
            anyio.run(serve_stdio, server)
        else:
            anyio.run(serve_http, server, sessions, listener, http_token(where, listener, ready), ready)
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
