"""The tools `agnsup mcp` offers: their JSON schemas (a cell request's: request.py's) and the check of a call."""
from __future__ import annotations

from ...errors import UsageError
from ...request import CellRequest, tool_schema

READ_TIMEOUT = 5.0  # read_output's default wait: long enough for a slow line, short enough to poll
# Options of a cell request the front door sets itself (role: the server's command
# line) or that make no sense for a call that waits for the end (stdin, pty, stream).
_SERVER_OWNED = ("role",)
_SPAWN_ONLY = ("stdin", "pty", "stream")

_AGENT = {"type": "string", "description": "Agent id of this call's cell within the session (default: the MCP "
                                           "client's name); cancel can stop one agent's cells."}
_SIDE = {"type": "integer", "minimum": 1, "maximum": 65535}  # a terminal's cols or rows
_CELL = {"type": "string", "description": "A cell id of this session (from spawn, ps or a result)."}


def _cell_tool(name: str, description: str, exclude: tuple[str, ...] = ()) -> dict:
    """A tool taking a cell request: the schema of request.tool_schema, less what the server owns."""
    s = tool_schema(name, description, exclude=_SERVER_OWNED + exclude)
    s["parameters"]["properties"]["agent_id"] = _AGENT
    return s


def _spawn_tool(name: str, description: str) -> dict:
    """spawn: a cell request with live I/O. Every spawned cell streams (read_output works on
    each); stdin and pty are the model's to ask for, described by request.py's help."""
    s = _cell_tool(name, description, _SPAWN_ONLY)
    opts = CellRequest.options()
    s["parameters"]["properties"].update(
        stdin={"type": "boolean", "description": opts["stdin"].help + " Default false."},
        pty={"type": "object", "description": opts["pty"].help,
             "properties": {"cols": _SIDE, "rows": _SIDE},
             "required": ["cols", "rows"], "additionalProperties": False})
    return s


def _shell_tool(name: str, description: str) -> dict:
    s = _cell_tool(name, description, _SPAWN_ONLY)
    command = {"type": "string", "minLength": 1, "description": "One shell command line, run by sh -c and judged as "
                                                                "shell text."}
    props = {k: v for k, v in s["parameters"]["properties"].items() if k != "argv"}
    s["parameters"].update(required=["command"], properties={"command": command, **props})
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
                {"cell_id": _CELL, "cols": _SIDE, "rows": _SIDE}, ("cell_id", "cols", "rows")),
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
    _plain_tool("publish_port", "Publish a port of this agent's private network (its pod: the network its cells "
                "share while one of them lives, e.g. a server started with spawn) on the host's loopback, so the "
                "person at the host can open it (a preview): returns host_port and url (http://127.0.0.1:N/). Only "
                "127.0.0.1, never the network; journaled; it closes when the agent's last cell ends. Refused when "
                "no cell of the agent lives, the port is published already or the host port is taken.",
                {"port": {"type": "integer", "minimum": 1, "maximum": 65535,
                          "description": "The port the server listens on inside the pod (127.0.0.1 or ::1)."},
                 "host_port": {"type": "integer", "minimum": 0, "maximum": 65535,
                               "description": "The port on the host's loopback (default 0: a free one)."},
                 "agent_id": _AGENT}, ("port",)),
    _plain_tool("list_ports", "The published ports of this session's agents: pod_port, host_port, url, agent_id.",
                {}),
)}
READ_ONLY = {"wait", "ps", "receipt", "read_output", "diff", "list_ports"}


# -- what each tool returns: its outputSchema (MCP 2025-06-18 on: a client checks a result's structuredContent
# against it). The properties a model can rely on, with their JSON types; results may gain fields (no
# additionalProperties: false), so a field added later (a new key of tool.ended) is not a broken result. A
# refusal (isError) is errors.as_value's dict, which a client does not check against the tool's schema.
def _obj(props: dict, required: tuple[str, ...] = (), description: str | None = None) -> dict:
    return {"type": "object", **({"description": description} if description else {}), "properties": props,
            "required": list(required)}


def _t(*names: str, description: str | None = None) -> dict:
    return {"type": names[0] if len(names) == 1 else list(names), **({"description": description} if description
                                                                      else {})}


_ID, _IDS = _t("string"), {"type": "array", "items": {"type": "string"}}
_RESULT = _obj({  # tool.ended's result (supervisor.journal_result before the receipt), or pending / client_gone
    "run_id": _ID, "agent_id": _ID, "cell_id": _ID,
    "exit_code": _t("integer", "null", description="The command's exit code (124 timeout, 137 killed, ...)."),
    "state": _t("string", description="exited, failed, timeout, cancelled, killed (running while it runs)."),
    "reason": _t("string", "null"), "receipt": _t("string", "null", description="The receipt file's path."),
    "stdout": _t("string"), "stderr": _t("string"), "stdout_truncated": _t("boolean"),
    "stderr_truncated": _t("boolean"), "network_hint": _t("string"),
    "network_refused": {"type": "array", "description": "Connections the proxy refused: host, port, rule and "
                        "the role key that would allow it.",
                        "items": _obj({"host": _ID, "port": _t("integer", "null"), "rule": _ID,
                                       "allow_key": _t("string", "null")}, ("host", "port", "rule"))},
    "changes": _t("object", description="What it changed in the worktree (counts, paths, the record)."),
    "pending": _t("boolean", description="wait's timeout passed: the cell still runs."),
    "client_gone": _t("boolean")}, ("run_id", "cell_id"))
_HANDLE = _obj({"cell_id": _ID, "run_id": _ID, "agent_id": _ID, "pid": _t("integer", "null"),
                "cgroup": _t("string", "null"), "controller": _ID,
                "state": {"type": "string", "enum": ["running", "waiting"],
                          "description": "waiting: queued behind a worktree lock"}}, ("cell_id", "run_id", "state"))
_CHUNK = _obj({"seq": _t("integer"), "stream": {"type": "string", "enum": ["stdout", "stderr", "tty"]},
               "text": _t("string")}, ("seq", "stream", "text"))
_PORT = _obj({"run_id": _ID, "agent_id": _ID, "pod_port": _t("integer"), "host": _ID, "host_port": _t("integer"),
              "address": _ID, "url": _t("string"), "pid": _t("integer"), "published_at": _t("number"),
              "by": _t("string", "null")}, ("run_id", "agent_id", "pod_port", "host_port", "url"))
OUTPUT_SCHEMAS = {
    "run_process": _RESULT, "run_shell": _RESULT, "wait": _RESULT, "spawn": _HANDLE,
    "read_output": _obj({"chunks": {"type": "array", "items": _CHUNK}, "next": _t("integer"),
                         "ended": _t("boolean"), "exit_code": _t("integer", "null"), "state": _t("string")},
                        ("chunks", "next", "ended")),
    "write_stdin": _obj({"cell_id": _ID, "written": _t("integer"), "eof": _t("boolean")},
                        ("cell_id", "written", "eof")),
    "resize": _obj({"cell_id": _ID, "cols": _SIDE, "rows": _SIDE}, ("cell_id", "cols", "rows")),
    "signal": _obj({"cell_id": _ID, "sent": {"type": "string", "enum": ["INT", "TERM", "KILL"]}},
                   ("cell_id", "sent")),
    "cancel": _obj({"cancelled": _t("integer"), "cells": {"type": "array"}, "scope": _t("string"),
                    "reason": _t("string", "null"), "grace": _t("number", "null")}, ("cancelled", "cells")),
    "ps": _obj({"run_id": _ID, "cells": {"type": "array", "items": _obj({"cell_id": _ID, "agent_id": _ID,
                                                                         "state": _t("string")})}},
               ("run_id", "cells")),
    "receipt": _obj({"cell_id": _ID, "run_id": _ID, "exit_code": _t("integer", "null"), "state": _t("string"),
                     "pending": _t("boolean", description="No receipt yet: the cell still runs.")}, ("cell_id",)),
    "diff": _obj({"record": _ID, "kind": _t("string"), "state": _t("string"), "counts": _t("object"),
                  "entries": {"type": "array", "items": _obj({"path": _ID, "change": _t("string")},
                                                             ("path", "change"))},
                  "truncated": _t("boolean"), "now": _t("object")}, ("record", "entries")),
    "undo": _obj({"undone": _IDS, "records": {"type": "array", "items": _t("object")}}, ("undone", "records")),
    "publish_port": _PORT,
    "list_ports": _obj({"run_id": _ID, "ports": {"type": "array", "items": _PORT}}, ("run_id", "ports")),
}


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

