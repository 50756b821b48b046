"""Egress by name: the controller's proxy, the only way out of an allowlist cell.

A cell of a role with `network.mode = "allowlist"` or `"internal"` has its
own network namespace with only loopback up, like a `deny` cell. Its only way
out is a proxy the controller serves (HTTP CONNECT, absolute-URI HTTP and
SOCKS5 on one port), judged by the shared matcher in agnsup/netpolicy.py:

    child, after unshare(CLONE_NEWNET) and lo up     (handoff.Handoff.in_child)
        listen on 127.0.0.1:PORT inside its own namespace, send the listening
        socket to the controller over a socketpair (SCM_RIGHTS, unix(7)),
        close its own copy; the command never holds it
    controller, once the command executed           (handoff.Handoff.receive)
        accept on that socket: each connection is born in the cell's
        namespace; the proxy's outbound socket is the controller's, in the
        host's namespace                              (proxy.Proxy)

Fail closed: the controller holds the only copy of the listener, so when it
dies (however it dies) the kernel closes it, every proxied connection with
it, and a new connect() from the cell is refused: the cell loses the network,
never gains it. Nothing is named (no veth, no bind mount, no file), so the
janitor has nothing to clean. No setns() into a namespace the controller may
not own: it works for an unprivileged controller too.

This package is imported only for roles that use the proxy: `socket` and
`threading` stay off the run path of every other role
(tests/test_startup_cost.py).
"""
from __future__ import annotations

PROXY_HOST = "127.0.0.1"


def proxy_env(port: int) -> dict[str, str]:
    """The variables that point a cell's clients at the proxy (both spellings:
    curl reads only the lower-case http_proxy, others only upper case). The
    cell has no DNS: ALL_PROXY is socks5h, so a SOCKS client hands the proxy
    the name, never resolves it itself."""
    http = f"http://{PROXY_HOST}:{port}"
    env = {"HTTP_PROXY": http, "HTTPS_PROXY": http, "ALL_PROXY": f"socks5h://{PROXY_HOST}:{port}",
           "NO_PROXY": "localhost,127.0.0.1"}
    return {**env, **{k.lower(): v for k, v in env.items()}}


def serve(listener, rules, journal_path: str, run_id: str, cell_id: str, secrets=None, authority=None):
    """The proxy for one cell, accepting on `listener` from now on (the broker's start hook);
    `rules`: the role's netpolicy.Rules, compiled into the plan (compiler.py); `secrets` (secrets.Secret
    values) and `authority` (ca.Authority): the cell's secrets, put on requests to their hosts only."""
    from .proxy import Proxy, resolver_from_env
    from .sink import JournalSink
    resolve, how = resolver_from_env()
    more = {"secrets": secrets, "authority": authority} if secrets else {}  # none: today's proxy
    return Proxy(listener, rules, resolve, JournalSink(journal_path, run_id, cell_id), how, **more).start()


def secret_section(proxy, refs: list[dict]) -> list[dict]:
    """The receipt's `secrets` section: per secret its name, inject, hosts, env and what the proxy saw
    (`used`: [{host, port, count}], `refused`: exfiltration attempts): never a value."""
    seen = {}
    if proxy is not None and hasattr(proxy, "secret_summary"):
        seen = {s["name"]: s for s in proxy.secret_summary()}
    return [{"name": r["name"], "inject": r["inject"], "hosts": list(r["hosts"]), "env": r.get("env"),
             "source": r["source"].split(":", 1)[0],
             "used": list(seen.get(r["name"], {}).get("used", [])),
             "refused": int(seen.get(r["name"], {}).get("refused", 0))} for r in refs]


def receipt_section(proxy, network: dict, listener=None) -> dict:
    """The receipt's `network` section (the broker's finish hook): the lists and every connection. The proxy is
    closed (and every connection it still relays); one that never started leaves `listener` to close here."""
    if proxy is None and listener is not None:
        listener.close()  # the proxy never started: nobody serves the cell
    out = {"mode": network["mode"], "proxy": f"{PROXY_HOST}:{network['proxy_port']}",
           "allow": list(network.get("allow") or []), "deny": list(network.get("deny") or []),
           "allow_private": bool(network.get("allow_private")), "resolver": proxy.resolver_name if proxy else None}
    out.update(proxy.stop() if proxy is not None else {"attempts": 0, "connections": []})
    if proxy is not None and proxy.sink is not None and proxy.sink.error:
        out["journal_error"] = proxy.sink.error
    return out
