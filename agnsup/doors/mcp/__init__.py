"""`agnsup mcp`: a Model Context Protocol server, one more front door over supervisor.Supervisor.

A coding agent (Claude Code, Codex, Cursor, Gemini CLI, ...) starts `agnsup mcp`
as an MCP server (stdio) and calls its tools. Every tool that runs something
asks the one Supervisor for a cell, so the command gets what `agnsup run` gives
it (policy, cgroup, namespaces, an environment from nothing, journal, receipt)
and this module starts no process of its own. Built on the official `mcp` SDK's
low-level Server (an optional extra, `agnsup[mcp]`; imported only by this
command), so the tools' JSON schemas are ours, generated from request.py, and
so are their outputSchemas (tools.py). `agnsup mcp config CLIENT` (config.py)
prints the line that registers this agnsup with a client.

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
