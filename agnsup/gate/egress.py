"""Network allowlists in the text gate: the same lists, judged by the same matcher.

Under `network.mode = "allowlist"` or `"internal"` the cell reaches out only
through the controller's proxy, which judges every connection with
agnsup/netpolicy.py. The gate judges the destinations a command names with
that very matcher, so the two cannot disagree: a URL (or a curl/wget host
operand) whose host the lists refuse, or whose IP literal is an address the
role may not reach, is

  * flagged `network.kernel_enforced` for a cell tool under mode open with
    governance.kernel_enforced = "flag" (the proxy refuses it anyway), or
  * denied with rule `network.egress` (kernel_enforced = "deny", modes locked
    and readonly).

Names are not resolved here (the proxy resolves once per connection and
judges the answer); URL arguments of tools that run in no cell are resolved
and judged in full (check_url).
"""
from __future__ import annotations

from urllib.parse import urlsplit

from ..netpolicy import normalise_host
from .model import CELL_TOOLS, Exec, Finding, GateContext, deny, ok

# Programs whose URL operands are destinations the cell would connect to.
FETCHERS = frozenset({"curl", "wget", "git", "pip", "pip3", "uv", "npm", "npx", "yarn", "pnpm", "go", "cargo",
                      "http", "xh", "aria2c", "gem", "bundle", "composer", "apt-get", "apt", "docker", "helm"})
BARE_HOST = frozenset({"curl", "wget", "http", "xh"})  # `curl example.org` fetches http://example.org
SCHEME_PORTS = {"http": 80, "https": 443, "git": 9418, "ssh": 22, "ftp": 21, "ws": 80, "wss": 443,
                "git+https": 443, "git+http": 80, "git+ssh": 22}
HINT = ("Add the host to network.allow in the role (docs/policy.md, \"Network modes\"), or remove it from "
        "network.deny.")


def destination_of(text: str) -> tuple[str, int] | None:
    """(host, port) a URL or bare `host[:port][/path]` operand names; None if it names none."""
    scheme, host, _ = normalise_host(text)
    if not host:
        return None
    try:
        sp = urlsplit(text if "://" in text else "http://" + text)
        port = sp.port
    except ValueError:
        port = None
    return host, port or SCHEME_PORTS.get(scheme, 443)


def judge(text: str, ctx: GateContext, resolver=None):
    """The shared matcher's verdict on one URL/host operand (None: it names no host)."""
    d = destination_of(text)
    if d is None:
        return None
    verdict, _dest, addrs = ctx.egress.judge(d[0], d[1], resolver)
    return verdict, d, addrs


def _operands(ex: Exec) -> list[str]:
    out = [a for a in ex.args if "://" in a and not a.startswith("-")]
    if ex.prog in BARE_HOST and not out:
        out = [a for a in ex.args if not a.startswith("-") and "." in a][:1]
    return out


def check_exec(ex: Exec, ctx: GateContext, tool: str, notes: list[dict]) -> Finding | None:
    """A denial for one program under an allowlist role, or None (refusals the proxy makes
    anyway are appended to `notes` as network.kernel_enforced when the role flags them)."""
    if ex.prog not in FETCHERS:
        return None
    backed = ctx.kernel is not None and tool in CELL_TOOLS and ctx.kernel.netns
    flag = backed and ctx.flags_kernel_enforced(tool)
    for operand in _operands(ex):
        j = judge(operand, ctx)
        if j is None or j[0].allowed:
            continue
        v, (host, port), _ = j
        why = f"`{ex.prog}` names {host}:{port}, which role '{ctx.role}''s network lists refuse ({v.rule})"
        if flag:
            notes.append({"rule": "network.kernel_enforced", "evidence": ex.text, "egress_rule": v.rule,
                          "reason": why + "; allowed with a flag because the controller's proxy, the cell's only "
                                          "way out, refuses it anyway (governance.kernel_enforced = 'flag')."})
            continue
        return deny("network.egress", why + ".", HINT, ex.text)
    return None


def check_url(url: str, ctx: GateContext, resolver) -> Finding:
    """A URL a tool fetches itself (in no cell): the lists, then every resolved address."""
    j = judge(url, ctx, resolver)
    if j is None:
        return deny("network.ssrf", f"the URL {url!r} has no host that can be checked.", HINT, url)
    v, (host, port), addrs = j
    if not v.allowed:
        return deny("network.egress", f"{host}:{port} is refused by role '{ctx.role}''s network lists "
                    f"({v.rule}{': ' + v.reason if v.reason else ''}).", HINT, url)
    return ok("network.pass", pinned=str(addrs[0]) if addrs else "")
