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
import secrets
import signal
import sys
import time

from ..errors import AgnsupError, UsageError, as_value
from ..request import tool_schema

# Seconds between the progress notifications of a call that waits for a cell
# (run_process, run_shell, wait); the first one comes as soon as the cell runs.
PROGRESS_INTERVAL = 1.0
READ_TIMEOUT = 5.0  # read_output's default wait: long enough for a slow line, short enough to poll
ENDED_WAIT = 2.0  # how long read_output waits, once the output ended, for the cell's result
CLIENT_GONE = "agnsup.client_gone"  # ASGI scope key: an event set when an HTTP client hung up on a call
# Options of a cell request the front door sets itself (role: the server's command
# line) or that make no sense for a call that waits for the end (stdin, pty, stream).
_SERVER_OWNED = ("role",)
_SPAWN_ONLY = ("stdin", "pty", "stream")

_AGENT = {"type": "string", "description": "Agent id of this call's cell within the session (default: the MCP "
                                           "client's name); cancel can stop one agent's cells."}
_CELL = {"type": "string", "description": "A cell id of this session (from spawn, ps or a result)."}


def _cell_tool(name: str, description: str, exclude: tuple[str, ...] = ()) -> dict:
    """A tool taking a cell request: the schema of request.tool_schema, less what the server owns."""
    s = tool_schema(name, description, exclude=_SERVER_OWNED + exclude)
    s["parameters"]["properties"]["agent_id"] = _AGENT
    return s


def _spawn_tool(name: str, description: str) -> dict:
    """spawn: a cell request with live I/O. Every spawned cell streams (read_output works on
    each); stdin and pty are the model's to ask for, described by request.py's help."""
    from ..request import CellRequest
    s = _cell_tool(name, description, _SPAWN_ONLY)
    opts = CellRequest.options()
    s["parameters"]["properties"].update(
        stdin={"type": "boolean", "description": opts["stdin"].help + " Default false."},
        pty={"type": "object", "description": opts["pty"].help,
             "properties": {"cols": {"type": "integer", "minimum": 1, "maximum": 65535},
                            "rows": {"type": "integer", "minimum": 1, "maximum": 65535}},
             "required": ["cols", "rows"], "additionalProperties": False})
    return s


def _shell_tool(name: str, description: str) -> dict:
    s = _cell_tool(name, description, _SPAWN_ONLY)
    props = s["parameters"]["properties"]
    del props["argv"]
    s["parameters"]["properties"] = {"command": {"type": "string", "minLength": 1, "description":
                                                 "One shell command line, run by sh -c and judged as shell text."},
                                     **props}
    s["parameters"]["required"] = ["command"]
    return s


def _plain_tool(name: str, description: str, props: dict, required: tuple[str, ...] = ()) -> dict:
    return {"name": name, "description": description,
            "parameters": {"type": "object", "properties": props, "required": list(required),
                           "additionalProperties": False}}


_RAN = ("Returns exit_code, state (exited, failed, timeout, cancelled, killed), reason, stdout, stderr "
        "(the first 64 KiB each; *_truncated says when there was more), cell_id and the receipt's path. A "
        "command's own non-zero exit is a result, not an error; a refusal (denied: rule, reason, hint) is a "
        "tool error. Long calls send progress notifications. What the command changed in the worktree lands when "
        "it ends and is recorded (changes: counts and paths): the diff tool shows it, undo takes it back.")
SCHEMAS = {s["name"]: s for s in (
    _cell_tool("run_process", "Run one command (an argv list, no shell) as a supervised, isolated cell of this "
               "session and wait for it. The command gets an environment built from nothing, a private /tmp and "
               "the server's role's filesystem, network and resource limits. " + _RAN, _SPAWN_ONLY),
    _shell_tool("run_shell", "Run one shell command line (pipes, redirections, &&) with sh -c as a supervised, "
                "isolated cell of this session and wait for it; the governance gate judges the whole line as "
                "shell text. " + _RAN),
    _spawn_tool("spawn", "Start one command (an argv list) as a cell of this session and return at once with "
                "its cell_id and pid; then read_output, write_stdin (with stdin: true), signal, wait, receipt or "
                "cancel with that cell_id. For servers, watchers, interactive programs and long builds. Its writes "
                "reach the worktree as they happen and are not recorded: undo cannot take them back."),
    _plain_tool("read_output", "Read a spawned cell's output incrementally: the chunks from seq `since` on, in "
                "order, as text (stream stdout, stderr, or tty for a pty cell); call again with since = next. "
                "Waits up to timeout seconds for output; ended: true once all output was read and the cell's "
                "streams closed (then exit_code and state say how it ended).",
                {"cell_id": _CELL,
                 "since": {"type": "integer", "minimum": 0, "description": "First chunk to return (default 0)."},
                 "timeout": {"type": "number", "minimum": 0, "description":
                             f"Seconds to wait for a chunk (default {READ_TIMEOUT:g}; 0: do not wait)."},
                 "max_bytes": {"type": "integer", "minimum": 1, "description":
                               "Return at most this many bytes (but always one chunk, up to 64 KiB)."}},
                ("cell_id",)),
    _plain_tool("write_stdin", "Write text to the stdin of a cell spawned with stdin: true (waits while it does "
                "not read); eof: true closes it afterwards (on a pty: ^D).",
                {"cell_id": _CELL, "text": {"type": "string", "description": "What to write (UTF-8)."},
                 "eof": {"type": "boolean", "description": "Close stdin after writing (default false)."}},
                ("cell_id",)),
    _plain_tool("resize", "Set the terminal size of a cell spawned with pty (it gets SIGWINCH).",
                {"cell_id": _CELL, "cols": {"type": "integer", "minimum": 1, "maximum": 65535},
                 "rows": {"type": "integer", "minimum": 1, "maximum": 65535}}, ("cell_id", "cols", "rows")),
    _plain_tool("signal", "Send a spawned cell INT or TERM (to its process group, like ^C in a terminal) or KILL "
                "(the whole tree, daemons included; the cell ends killed).",
                {"cell_id": _CELL, "sig": {"type": "string", "enum": ["INT", "TERM", "KILL"]}},
                ("cell_id", "sig")),
    _plain_tool("wait", "Wait for a cell of this session to end and return its result (as run_process does); "
                "with timeout, {pending: true} when it still runs then. Sends progress notifications.",
                {"cell_id": _CELL, "timeout": {"type": "number", "minimum": 0, "description":
                                               "Seconds to wait at most (default: until it ends)."}}, ("cell_id",)),
    _plain_tool("cancel", "Stop cells of this session: one cell (cell_id), one agent's cells (agent_id), or every "
                "live cell (run: true; the session then refuses new cells). SIGTERM, a grace period, then SIGKILL "
                "of the whole tree, daemons included. Returns cancelled (a count) and the cells.",
                {"cell_id": _CELL, "agent_id": _AGENT,
                 "run": {"type": "boolean", "description": "Cancel the whole session's run."},
                 "grace": {"type": "number", "minimum": 0,
                           "description": "Seconds between SIGTERM and SIGKILL (default: the role's)."}}),
    _plain_tool("ps", "The cells of this session: cell_id, agent_id, state, exit_code, argv, pid, ... (live ones; "
                "all: true for ended ones too).",
                {"all": {"type": "boolean", "description": "Include ended cells."}}),
    _plain_tool("receipt", "The receipt of an ended cell of this session: what ran, under which policy and "
                "isolation, how it ended, its resource usage and the decision that let it run.",
                {"cell_id": _CELL}, ("cell_id",)),
    _plain_tool("diff", "What an ended cell of this session changed in the worktree (files created, modified, "
                "deleted, mode changes, symlinks, directories, .git included), whatever command did it: entries "
                "[{path, change, before, after}] with a unified diff of each text file (diff) or its sizes when "
                "binary; stat: true gives added/removed line counts instead of the text. Also takes an undo's "
                "record id (undo-...). Refused (as an error) for a cell that changed nothing or ran live.",
                {"cell_id": {"type": "string", "description": "A cell id of this session, or an undo record id "
                                                              "(undo-...) from undo."},
                 "stat": {"type": "boolean", "description": "Line counts per file instead of the diff text "
                                                            "(default false)."}}, ("cell_id",)),
    _plain_tool("undo", "Put back what cells of this session changed in the worktree, exactly as before they ran: "
                "one cell (cell_id), one agent's cells (agent_id) or every cell of the session (run: true), newest "
                "first. Returns undone and records: each new undo record has an id (undo-...); undo that id to "
                "redo. Refused, with nothing touched, when a later cell or something outside agnsup changed the "
                "same paths since (error_type ChangeConflict, exit_code 75, naming them; force: true overwrites "
                "their change), or when there is nothing to undo (NotReversible).",
                {"cell_id": {"type": "string", "description": "A cell id of this session, or an undo record id "
                                                              "(undo-...) to redo what it undid."},
                 "agent_id": {"type": "string", "description": "Undo every cell of this agent in this session."},
                 "run": {"type": "boolean", "description": "Undo every cell of this session with changes kept."},
                 "force": {"type": "boolean", "description": "Undo even over a later change to the same paths "
                                                             "(default false)."}}),
)}
READ_ONLY = {"wait", "ps", "receipt", "read_output", "diff"}
DIFF_TEXT_MAX = 64 * 1024  # the diff text one tool result carries (run_process bounds stdout alike)


# -- argument checks ------------------------------------------------------------
_JSON_TYPES = {"string": (str,), "number": (int, float), "integer": (int,), "boolean": (bool,),
               "array": (list,), "object": (dict,)}


def check_arguments(name: str, arguments) -> dict:
    """The call's arguments against the tool's schema (keys and JSON types): a
    UsageError naming the argument. Values' ranges are CellRequest.make's to check."""
    schema = SCHEMAS.get(name)
    if schema is None:
        raise UsageError(f"unknown tool {name!r} (known: {', '.join(SCHEMAS)})")
    args = {} if arguments is None else arguments
    if not isinstance(args, dict):
        raise UsageError(f"arguments must be an object, not {type(args).__name__}")
    props = schema["parameters"]["properties"]
    extra = sorted(set(args) - set(props))
    if extra:
        raise UsageError(f"{name}: unknown argument(s) {', '.join(extra)} (known: {', '.join(props)})")
    for key in schema["parameters"]["required"]:
        if key not in args:
            raise UsageError(f"{name}: {key} is required ({props[key]['description']})")
    for key, value in args.items():
        want = props[key].get("type")
        ok = value is None or want is None or (isinstance(value, _JSON_TYPES[want])
                                               and not (isinstance(value, bool) and want in ("number", "integer")))
        if not ok:
            raise UsageError(f"{name}: {key} must be a{'n' if want[0] in 'aeio' else ''} {want}, not {value!r}")
    return dict(args)


def agent_name(client_name: str | None) -> str:
    """An agent id (state.check_id's alphabet) from an MCP client's name: "Claude Code" -> claude-code."""
    allowed = set("abcdefghijklmnopqrstuvwxyz0123456789._-")
    name = "".join(c if c in allowed else "-" for c in (client_name or "").strip().lower())
    name = name.lstrip("._-")[:64].rstrip("-")
    return name or "mcp-client"


# -- the session ----------------------------------------------------------------
class Session:
    """One MCP session: its run, role and workdir, over one Supervisor."""

    def __init__(self, sup, run_id: str, role: str, workdir: str, agent_id: str | None = None):
        self.sup, self.run_id, self.role, self.workdir, self.agent_id = sup, run_id, role, workdir, agent_id
        self.started: list[str] = []  # the cells this session started: its end cancels the live ones

    def _workdir(self, given: str | None) -> str:
        if given is None:
            return self.workdir
        path = os.path.realpath(os.path.join(self.workdir, given))
        if path != self.workdir and not path.startswith(self.workdir.rstrip("/") + "/"):
            raise UsageError(f"workdir: {given!r} is outside this server's workdir {self.workdir}")
        return path

    def spawn(self, argv, args: dict, client: str | None, shell: bool = False, notify=None) -> dict:
        """A cell of this session (blocking: the caller runs it in a thread)."""
        opts = dict(args)
        opts["agent_id"] = opts.pop("agent_id", None) or self.agent_id or agent_name(client)
        opts["workdir"] = self._workdir(opts.get("workdir"))
        h = self.sup.spawn(argv, run_id=self.run_id, role=self.role, entry="mcp", capture=True, shell=shell,
                           notify=notify, **opts)
        self.started.append(h["cell_id"])
        return h

    def cancel(self, cell_id=None, agent_id=None, run: bool = False, grace=None) -> dict:
        if sum(x is not None for x in (cell_id, agent_id, run or None)) != 1:
            raise UsageError("cancel: give exactly one of cell_id, agent_id or run: true")
        if grace is not None and (isinstance(grace, bool) or grace < 0):
            raise UsageError(f"cancel: grace must be a number of seconds >= 0, not {grace!r}")
        if run and not self.sup.list(self.run_id, include_ended=True):
            return {"cancelled": 0, "cells": []}  # nothing ran yet: the run is not in the journal
        return self.sup.cancel(cell_id=cell_id, run_id=self.run_id, agent_id=agent_id, grace=grace)

    def cells(self, include_ended: bool) -> list[dict]:
        return self.sup.list(self.run_id, include_ended)

    def receipt(self, cell_id: str) -> dict:
        rec = self.sup.receipt(self.run_id, cell_id)
        return rec if rec is not None else {"cell_id": cell_id, "pending": True}

    def diff(self, cell_id: str, stat: bool = False) -> dict:
        """What a cell of this session (or an undo record) changed, its diff text bounded."""
        d = self.sup.diff(cell_id, self.run_id, stat)
        room = DIFF_TEXT_MAX
        for e in d.get("entries") or []:
            text = e.get("diff")
            if isinstance(text, str) and len(text) > room:
                e["diff"], e["diff_truncated"] = text[:room], True
                d["truncated"] = True
            room -= len(e.get("diff") or "")
            room = max(room, 0)
        return d

    def undo(self, cell_id=None, agent_id=None, run: bool = False, force: bool = False) -> dict:
        if sum(x is not None for x in (cell_id, agent_id, run or None)) != 1:
            raise UsageError("undo: give exactly one of cell_id, agent_id or run: true")
        return self.sup.undo(cell_id=cell_id, run_id=self.run_id, agent_id=agent_id, force=bool(force))

    def end(self) -> None:
        """The session is over: cancel the cells it started that still run."""
        for cell_id in self.started:
            if self.sup.wait(self.run_id, cell_id, 0) is None:
                self.sup.cancel(cell_id=cell_id, run_id=self.run_id)


class Sessions:
    """The sessions of one server. stdio has one; streamable HTTP has one per
    Mcp-Session-Id, each with a run of its own unless --run-id names one for all."""

    def __init__(self, sup, role: str, workdir: str, run_id: str | None, agent_id: str | None):
        import threading
        self.sup, self.role, self.workdir, self.agent_id = sup, role, workdir, agent_id
        self.run_id = run_id  # None: a new mcp-XXXXXXXX per session
        self._by_id: dict[str | None, Session] = {}
        self._lock = threading.Lock()

    def get(self, session_id: str | None) -> Session:
        with self._lock:
            s = self._by_id.get(session_id)
            if s is None:
                s = self._by_id[session_id] = Session(self.sup, self.run_id or new_run_id(), self.role,
                                                      self.workdir, self.agent_id)
            return s

    def end(self, session_id: str | None) -> None:
        with self._lock:
            s = self._by_id.pop(session_id, None)
        if s is not None:
            s.end()


def new_run_id() -> str:
    return f"mcp-{secrets.token_hex(4)}"


# -- the MCP server ---------------------------------------------------------------
def build_server(sessions: Sessions):
    """The SDK's low-level Server with our tools (imports the `mcp` extra)."""
    import anyio
    import mcp_types as types
    from mcp.server import Server
    from anyio import to_thread

    def result(value, error: bool = False):
        return types.CallToolResult(content=[types.TextContent(text=json.dumps(value, default=str))],
                                    structured_content=value if isinstance(value, dict) else {"items": value},
                                    is_error=error)

    def refusal(e: AgnsupError):
        value = as_value(e)
        d = value.get("decision")
        if d:  # a denial: its rule, reason and hint where a model looks first
            value.update(rule=d.get("rule"), reason=d.get("reason"), hint=d.get("hint"))
        for key in ("conflicts", "later", "paths"):  # an undo's refusal: what is in the way, when said
            if key in e.details:
                value[key] = e.details[key]
        return result(value, error=True)

    def of(ctx) -> Session:
        """The call's session: streamable HTTP names it in a header of each request."""
        headers = getattr(ctx.request, "headers", None)
        return sessions.get(headers.get("mcp-session-id") if headers is not None else None)

    def client_name(ctx) -> str | None:
        params = ctx.session.client_params
        info = getattr(params, "client_info", None)
        return getattr(info, "name", None)

    async def progress(ctx, done: float, message: str) -> None:
        try:
            await ctx.session.report_progress(done, None, message)
        except Exception:  # noqa: BLE001 - progress is best effort; the result is what counts
            pass

    async def wait_for(ctx, cell_id: str, timeout: float | None, cancel_on_abort: bool):
        """The cell's result, sending progress while it runs; {pending} after `timeout`.
        If the request is cancelled (the client gave up, or went away) and this call
        started the cell, the cell is cancelled too."""
        session = of(ctx)
        gone = getattr(ctx.request, "scope", {}).get(CLIENT_GONE)  # HTTP only
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        try:
            while True:
                if gone is not None and gone.is_set():  # nobody will read the result: end as if cancelled
                    if cancel_on_abort:
                        await cancel_cell(session, cell_id)
                    return {"cell_id": cell_id, "run_id": session.run_id, "client_gone": True}
                step = PROGRESS_INTERVAL if deadline is None else max(0.0, min(PROGRESS_INTERVAL,
                                                                              deadline - time.monotonic()))
                res = await to_thread.run_sync(session.sup.wait, session.run_id, cell_id, step,
                                               abandon_on_cancel=True)
                if res is not None:
                    return res
                elapsed = time.monotonic() - start
                if deadline is not None and time.monotonic() >= deadline:
                    return {"cell_id": cell_id, "run_id": session.run_id, "pending": True}
                await progress(ctx, elapsed, f"cell {cell_id} running for {elapsed:.0f} s")
        except anyio.get_cancelled_exc_class():
            if cancel_on_abort:
                await cancel_cell(session, cell_id)
            raise

    async def cancel_cell(session: Session, cell_id: str) -> None:
        with anyio.CancelScope(shield=True):
            await to_thread.run_sync(lambda: session.sup.cancel(cell_id=cell_id, run_id=session.run_id))

    async def start(ctx, argv, args, shell=False, cancel_on_abort=False) -> dict:
        name, session = client_name(ctx), of(ctx)
        started: list[dict] = []  # the handle, even if the request is cancelled while the spawn runs

        def notify(line: str) -> None:  # a worktree lock wait, from the spawning thread
            try:
                anyio.from_thread.run(progress, ctx, 0, line)
            except BaseException:  # noqa: BLE001 - a request cancelled meanwhile: the cell is in `started`
                pass

        def spawn_cell() -> dict:
            started.append(session.spawn(argv, args, name, shell=shell, notify=notify))
            return started[0]
        try:
            h = await to_thread.run_sync(spawn_cell)
            await progress(ctx, 0, f"cell {h['cell_id']} started (pid {h['pid']})")
            return h
        except anyio.get_cancelled_exc_class():
            if cancel_on_abort and started:
                await cancel_cell(session, started[0]["cell_id"])
            raise

    async def run_process(ctx, args):
        h = await start(ctx, args.pop("argv"), args, cancel_on_abort=True)
        return await wait_for(ctx, h["cell_id"], None, cancel_on_abort=True)

    async def run_shell(ctx, args):
        h = await start(ctx, ["sh", "-c", args.pop("command")], args, shell=True, cancel_on_abort=True)
        return await wait_for(ctx, h["cell_id"], None, cancel_on_abort=True)

    async def spawn(ctx, args):
        return await start(ctx, args.pop("argv"), {**args, "stream": True, "long_lived": True})

    async def read_output(ctx, args):
        cell_id, session = args["cell_id"], of(ctx)
        timeout = args.get("timeout", READ_TIMEOUT)

        def read():
            out = session.sup.read_output(session.run_id, cell_id, args.get("since", 0), timeout,
                                          args.get("max_bytes"))
            # redacted by the Supervisor; a chunk can end inside a UTF-8 sequence: those bytes come back as U+FFFD
            out["chunks"] = [{"seq": c["seq"], "stream": c["stream"], "text": c["data"].decode(errors="replace")}
                             for c in out["chunks"]]
            if out["ended"]:  # the receipt follows the streams' end closely (unless the cell closed them early)
                res = session.sup.wait(session.run_id, cell_id, ENDED_WAIT)
                if res is not None:
                    out.update(exit_code=res["exit_code"], state=res["state"])
            return out
        return await to_thread.run_sync(read, abandon_on_cancel=True)

    async def write_stdin(ctx, args):
        data, session = args.get("text", "").encode(), of(ctx)
        await to_thread.run_sync(lambda: session.sup.write_stdin(session.run_id, args["cell_id"], data,
                                                                 bool(args.get("eof"))), abandon_on_cancel=True)
        return {"cell_id": args["cell_id"], "written": len(data), "eof": bool(args.get("eof"))}

    async def signal_(ctx, args):
        session = of(ctx)
        await to_thread.run_sync(session.sup.signal, session.run_id, args["cell_id"], args["sig"])
        return {"cell_id": args["cell_id"], "sent": args["sig"]}

    async def resize(ctx, args):
        session = of(ctx)
        await to_thread.run_sync(session.sup.resize, session.run_id, args["cell_id"], args["cols"], args["rows"])
        return {"cell_id": args["cell_id"], "cols": args["cols"], "rows": args["rows"]}

    async def wait(ctx, args):
        timeout = args.get("timeout")
        if timeout is not None and timeout < 0:
            raise UsageError(f"wait: timeout must be >= 0, not {timeout!r}")
        return await wait_for(ctx, args["cell_id"], timeout, cancel_on_abort=False)

    async def cancel(ctx, args):
        session = of(ctx)
        return await to_thread.run_sync(lambda: session.cancel(args.get("cell_id"), args.get("agent_id"),
                                                               bool(args.get("run")), args.get("grace")))

    async def ps(ctx, args):
        session = of(ctx)
        return {"run_id": session.run_id,
                "cells": await to_thread.run_sync(session.cells, bool(args.get("all")))}

    async def receipt(ctx, args):
        return await to_thread.run_sync(of(ctx).receipt, args["cell_id"])

    async def diff(ctx, args):
        session = of(ctx)
        return await to_thread.run_sync(lambda: session.diff(args["cell_id"], bool(args.get("stat"))))

    async def undo(ctx, args):
        session = of(ctx)
        return await to_thread.run_sync(lambda: session.undo(args.get("cell_id"), args.get("agent_id"),
                                                             bool(args.get("run")), bool(args.get("force"))))

    handlers = {"run_process": run_process, "run_shell": run_shell, "spawn": spawn, "wait": wait,
                "read_output": read_output, "write_stdin": write_stdin, "resize": resize, "signal": signal_,
                "cancel": cancel, "ps": ps, "receipt": receipt, "diff": diff, "undo": undo}
    assert set(handlers) == set(SCHEMAS)

    async def on_list_tools(ctx, params):
        return types.ListToolsResult(tools=[
            types.Tool(name=n, description=s["description"], input_schema=s["parameters"],
                       annotations=types.ToolAnnotations(read_only_hint=n in READ_ONLY,
                                                         destructive_hint=n not in READ_ONLY))
            for n, s in SCHEMAS.items()])

    async def on_call_tool(ctx, params):
        try:
            args = check_arguments(params.name, params.arguments)
            return result(await handlers[params.name](ctx, args))
        except AgnsupError as e:
            return refusal(e)
        except Exception as e:  # noqa: BLE001 - a bug of ours: one line to the model, the traceback to stderr
            import traceback
            traceback.print_exc(file=sys.stderr)
            return refusal(AgnsupError(f"agnsup mcp: {params.name} failed: {type(e).__name__}: {e}"))

    from .. import __version__
    return Server("agnsup", version=__version__,
                  instructions=f"Every command runs as an isolated, supervised agnsup cell under role "
                               f"{sessions.role!r} in {sessions.workdir}.",
                  on_list_tools=on_list_tools, on_call_tool=on_call_tool)


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


def _listener(where: tuple[str, str | int]):
    import socket
    if where[0] == "unix":
        from .serve import listen_unix
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
    """The listener with the peer check of every agnsup control socket
    (serve.peer_refusal; on a loopback port serve.tcp_peer_refusal, before the bearer
    token is looked at): a process of an agnsup cell gets one 403 answer carrying
    the refusal line, journaled, and its connection is closed before uvicorn sees
    it. asyncio accepts through this object's accept() (loop.create_server(sock=)),
    and a non-blocking accept with nothing left raises BlockingIOError as before."""
    import socket

    class CheckedListener(socket.socket):
        def accept(self):
            from .serve import peer_refusal, tcp_peer_refusal
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
                try:
                    conn.sendall(b"HTTP/1.1 403 Forbidden\r\nContent-Type: application/json\r\nConnection: close\r\n"
                                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
                except OSError:
                    pass
                conn.close()
    checked = CheckedListener(fileno=listener.detach())
    return checked


def _bearer(app, token: str):
    """The ASGI app behind a bearer token: a loopback port is open to every local user."""
    import hmac
    want = f"Bearer {token}".encode()

    async def guarded(scope, receive, send):
        if scope["type"] == "http" and not hmac.compare_digest(dict(scope["headers"]).get(b"authorization", b""),
                                                               want):
            await send({"type": "http.response.start", "status": 401,
                        "headers": [(b"content-type", b"text/plain"), (b"www-authenticate", b"Bearer")]})
            await send({"type": "http.response.body", "body": b"agnsup mcp: missing or wrong bearer token\n"})
            return
        await app(scope, receive, send)
    return guarded


def _ending_sessions(app, sessions: Sessions):
    """The ASGI app, plus the ends a stdio session has by itself: a client's DELETE of
    its session cancels the cells that session started, and a client that hangs up on
    a call's response stream is marked in the request's scope (CLIENT_GONE: an event
    the waiting call watches), so the call's cell is cancelled as on stdio."""
    import anyio
    from anyio import to_thread

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


async def _serve_http(sessions: Sessions, listener, token: str | None, ready: dict) -> None:
    """Streamable HTTP on `listener` until SIGTERM/SIGINT/SIGHUP; then the caller ends the cells."""
    import contextlib
    import socket
    import anyio
    import uvicorn
    from mcp.server.transport_security import TransportSecuritySettings
    unix = listener.family == socket.AF_UNIX
    # DNS rebinding protection for a TCP port (a browser page could reach it); a Unix
    # socket is out of a browser's reach, and its clients send any Host.
    security = (TransportSecuritySettings(enable_dns_rebinding_protection=False) if unix else None)
    app = _ending_sessions(build_server(sessions).streamable_http_app(host="127.0.0.1", transport_security=security),
                           sessions)
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
    from .. import policy
    from ..supervisor import Supervisor
    from ..store.state import StateRoot, check_id
    if run_id:
        check_id("run", run_id)
    if agent_id:
        check_id("agent", agent_id)
    workdir = os.path.realpath(workdir or os.getcwd())
    if not os.path.isdir(workdir):
        raise UsageError(f"--workdir {workdir}: not a directory")
    where = parse_listen(http) if http else None
    if where is not None and where[0] == "unix":
        from .serve import socket_place
        socket_place(where[1], StateRoot(state_dir).path, f"--http {http}")
    policy.load(role, StateRoot(state_dir).path)  # an unknown role fails now, not at the first call
    if importlib.util.find_spec("mcp") is None:
        raise UsageError("agnsup mcp needs the mcp extra: pip install 'agnsup[mcp]'")
    import anyio
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
            token = None
            if where[0] == "unix":
                ready.update(socket=where[1], url="http://localhost/mcp")
            else:
                # Every local user can reach a loopback port: the token is the key to this user's cells.
                token = os.environ.get("AGNSUP_MCP_TOKEN") or secrets.token_urlsafe(24)
                port = listener.getsockname()[1]
                host = f"[{where[0]}]" if ":" in where[0] else where[0]
                ready.update(url=f"http://{host}:{port}/mcp",
                             **({} if os.environ.get("AGNSUP_MCP_TOKEN") else {"token": token}))
            anyio.run(_serve_http, sessions, listener, token, ready)
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
