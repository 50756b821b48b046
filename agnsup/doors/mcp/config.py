"""`agnsup mcp config CLIENT`: the one line (or file snippet) that registers this agnsup with an MCP client.

Clients start a stdio server with the environment and PATH of their own, not of the shell that installed
agnsup: the command is the absolute path of the running agnsup (the venv's console script, or
`/abs/venv/bin/python -m agnsup` when run that way), and the worktree and the state root are absolute too.
Each client's syntax was checked with its real CLI (tests/e2e/test_mcp_clients.py runs the printed line and
parses the file the client wrote):

    claude   claude mcp add NAME -- CMD ARGS...      ~/.claude.json (scope local: this project; -s user, -s project)
    codex    codex mcp add NAME -- CMD ARGS...       $CODEX_HOME/config.toml [mcp_servers.NAME]
    gemini   gemini mcp add NAME CMD ARGS...         .gemini/settings.json (scope project; -s user)
    cursor, json   {"mcpServers": {NAME: {"command", "args"}}}: ~/.cursor/mcp.json, a project's .mcp.json
    http     the `agnsup mcp --http` line, its URL with the token as a header and in the query
"""
from __future__ import annotations

import os
import shlex
import sys

from ...errors import UsageError

CLIENTS = ("claude", "codex", "gemini", "cursor", "json", "http")
HTTP_ADDR = "127.0.0.1:8765"


def own_command(argv0: str | None = None, executable: str | None = None) -> list[str]:
    """How to start the agnsup that is running now, from anywhere: the console script's absolute path, or
    `python -m agnsup` when this process was started that way (argv[0] is then agnsup/__main__.py). The
    venv's python is kept as invoked (not resolved: the symlink is what makes it the venv's)."""
    argv0 = sys.argv[0] if argv0 is None else argv0
    executable = sys.executable if executable is None else executable
    path = os.path.abspath(argv0) if argv0 else ""
    if os.path.basename(path) == "__main__.py" or not (os.path.isfile(path) and os.access(path, os.X_OK)):
        return [os.path.abspath(executable), "-m", "agnsup"]
    return [path]


def server_args(role: str | None, workdir: str, state_dir: str | None, agent_id: str | None,
                http: str | None = None) -> list[str]:
    """`[--state-dir D] mcp [--http A] --role R --workdir W [--agent A]`, every path absolute."""
    args = ["--state-dir", os.path.abspath(state_dir)] if state_dir else []
    args.append("mcp")
    if http:
        args += ["--http", http]
    if role:
        args += ["--role", role]
    args += ["--workdir", os.path.abspath(workdir)]
    if agent_id:
        args += ["--agent", agent_id]
    return args


def registration(client: str, command: list[str], args: list[str], name: str = "agnsup",
                 token: str | None = None, http: str = HTTP_ADDR) -> dict:
    """{"client", "name", "command", "args", "lines" (what to paste), "argv" (the client's command, when it
    has one), "file" (where it lands), "snippet" (a file's JSON), "notes"}. `args`: server_args without
    --http; for http, `token` is the server's (AGNSUP_MCP_TOKEN)."""
    if client not in CLIENTS:
        raise UsageError(f"mcp config: unknown client {client!r} (known: {', '.join(CLIENTS)})")
    if not name or any(c.isspace() for c in name):
        raise UsageError(f"mcp config: --name {name!r}: one word (the server's name in the client)")
    full = command + args
    out: dict = {"client": client, "name": name, "command": command[0], "args": full[1:]}
    if client == "claude":
        out.update(argv=["claude", "mcp", "add", name, "--", *full], file="~/.claude.json",
                   notes=["scope local (this project, private to you) by default; `-s user` for every project, "
                          "`-s project` writes .mcp.json (Claude Code asks to approve it on first use)",
                          "check: claude mcp get " + name])
    elif client == "codex":
        out.update(argv=["codex", "mcp", "add", name, "--", *full], file="$CODEX_HOME/config.toml",
                   notes=["written to [mcp_servers." + name + "] of ~/.codex/config.toml (or $CODEX_HOME)",
                          "check: codex mcp get " + name])
    elif client == "gemini":
        # gemini's `mcp add` parses options after the command as its own: `--` keeps --role etc. the server's
        out.update(argv=["gemini", "mcp", "add", name, full[0], "--", *full[1:]], file=".gemini/settings.json",
                   notes=["scope project (./.gemini/settings.json) by default; `-s user` for ~/.gemini/settings.json",
                          "Gemini CLI starts no MCP server in a folder it does not trust: trust the project "
                          "(`/permissions` in gemini, or ~/.gemini/trustedFolders.json), or add --trust to "
                          "skip the tool-call confirmations too", "check: gemini mcp list"])
    elif client in ("json", "cursor"):
        out.update(file=".mcp.json" if client == "json" else "~/.cursor/mcp.json",
                   snippet={"mcpServers": {name: {"command": full[0], "args": full[1:]}}},
                   notes=(["a project's .mcp.json (Claude Code: it asks to approve a project server on first "
                           "use, or `claude mcp reset-project-choices`; Gemini CLI reads the same mcpServers "
                           "form from .gemini/settings.json)"] if client == "json" else
                          ["Cursor: ~/.cursor/mcp.json (every project) or .cursor/mcp.json (this one)"]))
    else:
        return _http(out, command, args, name, token, http)
    out["lines"] = [shlex.join(out["argv"])] if "argv" in out else _json_lines(out["snippet"])
    return out


def _json_lines(snippet: dict) -> list[str]:
    import json
    return json.dumps(snippet, indent=2).splitlines()


def _http(out: dict, command: list[str], args: list[str], name: str, token: str | None, http: str) -> dict:
    """The server's line (with its token) and the URL: with a header, or the token in the query for a client
    that cannot send headers."""
    if token is None:
        import secrets
        token = secrets.token_urlsafe(24)
    i = args.index("mcp") + 1
    server = command + args[:i] + ["--http", http] + args[i:]
    url = f"http://{http}/mcp"
    out.update(command=server[0], args=server[1:], env={"AGNSUP_MCP_TOKEN": token}, url=url,
               url_with_token=f"{url}?token={token}", headers={"Authorization": f"Bearer {token}"}, token=token,
               argv=["claude", "mcp", "add", "--transport", "http", name, url, "--header",
                     f"Authorization: Bearer {token}"],
               notes=["start the server first (it prints the same url on start); loopback only: every local "
                      "user can reach the port, the token is the key", "a client that cannot send headers: "
                      "the url_with_token (the token in the query, as secret as the header)"])
    out["lines"] = ["AGNSUP_MCP_TOKEN=" + shlex.quote(token) + " " + shlex.join(server),
                    shlex.join(out["argv"]), out["url_with_token"]]
    return out
