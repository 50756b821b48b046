"""The MCP server of `agnsup mcp`: the SDK's low-level Server; a tools/call is a Call, a method a tool."""
from __future__ import annotations

import json
import sys
import time

import anyio
import mcp_types as types
from anyio import to_thread
from mcp.server import Server

from ...errors import AgnsupError, UsageError, as_value
from .session import Session, Sessions
from .tools import OUTPUT_SCHEMAS, READ_ONLY, READ_TIMEOUT, SCHEMAS, check_arguments

PROGRESS_INTERVAL = 1.0  # seconds between a waiting call's progress notes (the first as soon as the cell runs)
ENDED_WAIT = 2.0  # how long read_output waits, once the output ended, for the cell's result
CLIENT_GONE = "agnsup.client_gone"  # ASGI scope key: an event set when an HTTP client hung up on a call


def _result(value, error: bool = False):
    """A result: its JSON as text and, unless a refusal, as structured content (the tool's outputSchema).
    A refusal's JSON is text only: the TypeScript SDK's client (the Inspector's, Claude Code's) checks an
    error's structured content against the tool's outputSchema as well, and an error is not a result."""
    return types.CallToolResult(content=[types.TextContent(text=json.dumps(value, default=str))],
                                structured_content=None if error else value, is_error=error)


def _refusal(e: AgnsupError):
    value = as_value(e)
    d = value.get("decision")
    if d:  # a denial: its rule, reason and hint where a model looks first
        value.update(rule=d.get("rule"), reason=d.get("reason"), hint=d.get("hint"))
    # an undo's refusal: what is in the way, when said; a lock wait given up: who held it, how long it waited
    value.update({key: e.details[key] for key in ("conflicts", "later", "paths", "holder", "waited")
                  if key in e.details})
    return _result(value, error=True)


def _held_by(line: str) -> str:
    """Who holds the lock, from Supervisor.spawn's waiting line ("... lock (held by X)")."""
    head, _, held = line.rpartition("(held by ")
    return held[:-1] if head and held.endswith(")") else "another cell"


class Call:
    """One tools/call: its request context and session; a method a tool, named as it."""

    def __init__(self, ctx, session: Session):
        self.ctx, self.s = ctx, session
        self.queued = ""  # the cell this call started is queued behind another agent's worktree lock: who holds it

    async def progress(self, done: float, message: str) -> None:
        try:
            await self.ctx.session.report_progress(done, None, message)
        except Exception:  # noqa: BLE001 - progress is best effort; the result is what counts
            pass

    async def cancel_cell(self, cell_id: str) -> None:
        with anyio.CancelScope(shield=True):
            await to_thread.run_sync(lambda: self.s.sup.cancel(cell_id=cell_id, run_id=self.s.run_id))

    async def wait_for(self, cell_id: str, timeout: float | None, cancel_on_abort: bool):
        """The cell's result, sending progress while it runs; {pending} after `timeout`. If the request is cancelled
        (the client gave up, or went away) and this call started the cell, the cell is cancelled too."""
        gone = getattr(self.ctx.request, "scope", {}).get(CLIENT_GONE)  # HTTP only
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        try:
            while True:
                if gone is not None and gone.is_set():  # nobody will read the result: end as if cancelled
                    if cancel_on_abort:
                        await self.cancel_cell(cell_id)
                    return {"cell_id": cell_id, "run_id": self.s.run_id, "client_gone": True}
                step = PROGRESS_INTERVAL if deadline is None else max(0.0, min(PROGRESS_INTERVAL,
                                                                              deadline - time.monotonic()))
                res = await to_thread.run_sync(self.s.sup.wait, self.s.run_id, cell_id, step, abandon_on_cancel=True)
                if res is not None:
                    return res
                elapsed = time.monotonic() - start
                if deadline is not None and time.monotonic() >= deadline:
                    return {"cell_id": cell_id, "run_id": self.s.run_id, "pending": True}
                if self.queued and await to_thread.run_sync(self._started, cell_id):
                    self.queued = ""
                await self.progress(elapsed, f"cell {cell_id} waiting for the worktree lock held by {self.queued} "
                                    f"for {elapsed:.0f} s" if self.queued else f"cell {cell_id} running for "
                                    f"{elapsed:.0f} s")
        except anyio.get_cancelled_exc_class():
            if cancel_on_abort:
                await self.cancel_cell(cell_id)
            raise

    async def start(self, argv, args, shell=False, cancel_on_abort=False) -> dict:
        info = getattr(self.ctx.session.client_params, "client_info", None)
        name, started = getattr(info, "name", None), []  # started: the handle, even if cancelled while spawning
        heard: list[str] = []

        def notify(line: str) -> None:  # a worktree lock wait, from the spawning thread
            heard.append(line)
            try:
                anyio.from_thread.run(self.progress, 0, line)
            except BaseException:  # noqa: BLE001 - a request cancelled meanwhile: the cell is in `started`
                pass

        def spawn_cell() -> dict:
            started.append(self.s.spawn(argv, args, name, shell=shell, notify=notify))
            return started[0]
        try:
            h = await to_thread.run_sync(spawn_cell)
            if h["state"] == "waiting":  # nothing started: the waiting line (notify) said who holds the lock
                self.queued = _held_by(heard[-1]) if heard else "another cell"
            else:
                await self.progress(0, f"cell {h['cell_id']} started (pid {h['pid']})")
            return h
        except anyio.get_cancelled_exc_class():
            if cancel_on_abort and started:
                await self.cancel_cell(started[0]["cell_id"])
            raise

    def _started(self, cell_id: str) -> bool:
        """Has the queued cell got its lock? (One that gave up, or ended, is not listed: its result is next.)"""
        return any(c["cell_id"] == cell_id and c["state"] in ("starting", "running")
                   for c in self.s.sup.list(self.s.run_id))

    async def run_process(self, args):
        h = await self.start(args.pop("argv"), args, cancel_on_abort=True)
        return await self.wait_for(h["cell_id"], None, cancel_on_abort=True)

    async def run_shell(self, args):
        h = await self.start(["sh", "-c", args.pop("command")], args, shell=True, cancel_on_abort=True)
        return await self.wait_for(h["cell_id"], None, cancel_on_abort=True)

    async def spawn(self, args):
        return await self.start(args.pop("argv"), {**args, "stream": True, "long_lived": True})

    async def read_output(self, args):
        cell_id, s, timeout = args["cell_id"], self.s, args.get("timeout", READ_TIMEOUT)

        def read():
            out = s.sup.read_output(s.run_id, cell_id, args.get("since", 0), timeout, args.get("max_bytes"))
            # redacted by the Supervisor; a chunk can end inside a UTF-8 sequence: those bytes come back as U+FFFD
            out["chunks"] = [{"seq": c["seq"], "stream": c["stream"], "text": c["data"].decode(errors="replace")}
                             for c in out["chunks"]]
            if out["ended"]:  # the receipt follows the streams' end closely (unless the cell closed them early)
                res = s.sup.wait(s.run_id, cell_id, ENDED_WAIT)
                if res is not None:
                    out.update(exit_code=res["exit_code"], state=res["state"])
            return out
        return await to_thread.run_sync(read, abandon_on_cancel=True)

    async def write_stdin(self, args):
        data, eof = args.get("text", "").encode(), bool(args.get("eof"))
        await to_thread.run_sync(lambda: self.s.sup.write_stdin(self.s.run_id, args["cell_id"], data, eof),
                                 abandon_on_cancel=True)
        return {"cell_id": args["cell_id"], "written": len(data), "eof": eof}

    async def signal(self, args):
        await to_thread.run_sync(self.s.sup.signal, self.s.run_id, args["cell_id"], args["sig"])
        return {"cell_id": args["cell_id"], "sent": args["sig"]}

    async def resize(self, args):
        await to_thread.run_sync(self.s.sup.resize, self.s.run_id, args["cell_id"], args["cols"], args["rows"])
        return {"cell_id": args["cell_id"], "cols": args["cols"], "rows": args["rows"]}

    async def wait(self, args):
        timeout = args.get("timeout")
        if timeout is not None and timeout < 0:
            raise UsageError(f"wait: timeout must be >= 0, not {timeout!r}")
        return await self.wait_for(args["cell_id"], timeout, cancel_on_abort=False)

    async def cancel(self, args):
        return await to_thread.run_sync(lambda: self.s.cancel(args.get("cell_id"), args.get("agent_id"),
                                                              bool(args.get("run")), args.get("grace")))

    async def ps(self, args):
        return {"run_id": self.s.run_id,
                "cells": await to_thread.run_sync(self.s.sup.list, self.s.run_id, bool(args.get("all")))}

    async def receipt(self, args):
        return await to_thread.run_sync(self.s.receipt, args["cell_id"])

    async def diff(self, args):
        return await to_thread.run_sync(lambda: self.s.diff(args["cell_id"], bool(args.get("stat"))))

    async def undo(self, args):
        return await to_thread.run_sync(lambda: self.s.undo(args.get("cell_id"), args.get("agent_id"),
                                                            bool(args.get("run")), bool(args.get("force"))))

    async def publish_port(self, args):
        from .session import agent_name
        info = getattr(self.ctx.session.client_params, "client_info", None)
        agent = args.get("agent_id") or self.s.agent_id or agent_name(getattr(info, "name", None))
        return await to_thread.run_sync(lambda: self.s.sup.publish_port(self.s.run_id, agent, args["port"],
                                                                         args.get("host_port")))

    async def list_ports(self, args):
        return {"run_id": self.s.run_id, "ports": await to_thread.run_sync(self.s.sup.list_ports, self.s.run_id)}


def build_server(sessions: Sessions):
    """The SDK's low-level Server with our tools."""
    assert all(callable(getattr(Call, name, None)) and name in OUTPUT_SCHEMAS for name in SCHEMAS)

    def of(ctx) -> Session:
        """The call's session: streamable HTTP names it in a header of each request."""
        headers = getattr(ctx.request, "headers", None)
        return sessions.get(headers.get("mcp-session-id") if headers is not None else None)

    async def on_list_tools(ctx, params):
        return types.ListToolsResult(tools=[
            types.Tool(name=n, description=s["description"], input_schema=s["parameters"],
                       output_schema=OUTPUT_SCHEMAS[n],
                       annotations=types.ToolAnnotations(read_only_hint=n in READ_ONLY,
                                                         destructive_hint=n not in READ_ONLY))
            for n, s in SCHEMAS.items()])

    async def on_call_tool(ctx, params):
        try:
            args = check_arguments(params.name, params.arguments)
            return _result(await getattr(Call(ctx, of(ctx)), params.name)(args))
        except AgnsupError as e:
            return _refusal(e)
        except Exception as e:  # noqa: BLE001 - a bug of ours: one line to the model, the traceback to stderr
            import traceback
            traceback.print_exc(file=sys.stderr)
            return _refusal(AgnsupError(f"agnsup mcp: {params.name} failed: {type(e).__name__}: {e}"))

    from ... import __version__
    return Server("agnsup", version=__version__,
                  instructions=f"Every command runs as an isolated, supervised agnsup cell under role "
                               f"{sessions.role!r} in {sessions.workdir}.",
                  on_list_tools=on_list_tools, on_call_tool=on_call_tool)
