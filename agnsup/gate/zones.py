"""Zones: what kind of effect a tool has, and what the mode allows.

green  = reads only (always allowed);
yellow = side effects (open: allowed; locked: only tools in yellow_allow;
         readonly: denied);
red    = delegation, starting agents (always flagged "audited"; open allows,
         locked needs the tool in yellow_allow, readonly denies).
Unknown tools are yellow: an unknown effect is treated as a side effect.
"""

from __future__ import annotations

from .model import Finding, GateContext, deny, ok

GREEN = frozenset({"read_file", "read", "view", "view_file", "cat", "list", "list_files", "list_dir", "ls",
                   "grep", "glob", "search", "find", "find_files", "stat", "web_search", "search_web", "tree",
                   "read_many_files", "glob_files", "search_files", "code_search"})
FETCH = frozenset({"fetch", "web_fetch", "webfetch", "http_get", "http_request", "fetch_url", "browse"})
RED = frozenset({"spawn_agent", "delegate", "delegate_task", "start_agent", "run_agent", "create_agent",
                 "handoff", "task", "subagent"})


def zone_of(tool: str, args: dict) -> str:
    t = tool.lower()
    if t in RED or "agent" in t or t.startswith(("delegate", "spawn")):
        return "red"
    if t in GREEN:
        return "green"
    if t in FETCH:
        method = str(args.get("method", "GET")).upper()
        return "green" if method in ("GET", "HEAD") else "yellow"
    return "yellow"


def check(tool: str, zone: str, ctx: GateContext) -> Finding:
    if zone == "green":
        return ok("allow.green", "read-only tool")
    listed = tool in ctx.yellow_allow
    if ctx.mode == "readonly":
        return deny(f"zone.{zone}_readonly",
                    f"{tool} has side effects ({zone} zone) and role '{ctx.role}' is readonly.",
                    "Use a role with mode open (or locked with the tool in yellow_allow).")
    if ctx.mode == "locked" and not listed:
        return deny(f"zone.{zone}_locked",
                    f"{tool} has side effects ({zone} zone) and role '{ctx.role}' is locked without "
                    f"{tool!r} in yellow_allow.",
                    f"Add {tool!r} to the role's yellow_allow, or use mode open.")
    if ctx.mode not in ("open", "locked"):
        return deny("zone.unknown_mode", f"role '{ctx.role}' has an unknown mode {ctx.mode!r}.",
                    "Set mode to open, locked or readonly.")
    rule = "allow.red_audited" if zone == "red" else ("allow.yellow_listed" if ctx.mode == "locked"
                                                      else "allow.yellow_open")
    return ok(rule, flags=("audited",) if zone == "red" else ())
