"""`agnsup receipts`: a cell's connections in a few lines (`--json` has every field)."""
from __future__ import annotations

SHOWN = 10  # destinations listed per cell; the rest are counted


def size(n: int) -> str:
    """`n` bytes for a reader: "512 B", "1.5 KiB", ... "3.0 GiB" (also the CLI's change summaries)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def lines(net: dict) -> list[str]:
    out = [f"network {net['mode']}: {net.get('attempts', 0)} connections ({net.get('allowed', 0)} allowed, "
           f"{net.get('refused', 0)} refused, {net.get('failed', 0)} failed), {size(net.get('bytes_up', 0))} up, "
           f"{size(net.get('bytes_down', 0))} down"]
    by = sorted(net.get("by_destination") or [], key=lambda d: (d["decision"] == "allowed", -d["count"]))
    for d in by[:SHOWN]:
        port = f":{d['port']}" if d.get("port") is not None else ""
        what = f"{d['decision']} {d['name']}{port} ({d['rule']})"
        out.append(f"{what} x{d['count']}" + (f", {size(d['bytes_down'])} down" if d["bytes_down"] else ""))
    if len(by) > SHOWN:
        out.append(f"... {len(by) - SHOWN} more destinations (agnsup receipts --json)")
    return out


# --- refusals spoken where the user looks (tool.ended: the result's network_refused, the CLI's line) ---------
# The proxy's rule for a refused connection (netpolicy.Rules' verdicts) -> what in the role would allow it.
# None: no key does (a class of address never reachable through the proxy, a protocol it does not serve, a limit).
_PRIVATE = ("private", "loopback", "link-local", "cgnat", "non-global")
REFUSALS_SHOWN = 3  # destinations named on the CLI's one line; the result lists up to SHOWN


def allow_key(rule: str, host: str, port: int | None, mode: str = "allowlist") -> str | None:
    """The role key (and value) that would let the proxy make this connection, or None."""
    if rule == "unlisted":
        return f"network.allow += [\"{allow_entry(host, port)}\"]"
    if rule.startswith("deny:"):
        return f"network.deny without \"{rule[5:]}\""
    if rule.startswith("address:"):
        cls = rule[8:]
        if cls in _PRIVATE and mode != "internal":
            return "network.allow_private = true"
        if cls == "public" and mode == "internal":
            return "network.mode = \"allowlist\""
    return None


def allow_entry(host: str, port: int | None) -> str:
    """The network.allow entry for exactly this destination: an entry without a port allows 80 and 443."""
    h = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return h if port in (80, 443, None) else f"{h}:{port}"


def refused(net: dict | None) -> list[dict]:
    """The receipt's `network` section -> the result's network_refused: each destination the proxy refused
    (not a connection that failed: a name that does not resolve, a server that does not answer), with the key
    that would allow it; most refused first, at most SHOWN."""
    if not net:
        return []
    out = []
    by = sorted((d for d in net.get("by_destination") or [] if d.get("decision") == "refused"),
                key=lambda d: -d.get("count", 0))
    for d in by[:SHOWN]:
        host, port, rule = d.get("name") or "", d.get("port"), d.get("rule") or ""
        out.append({"host": host, "port": port, "rule": rule, "allow_key": allow_key(rule, host, port,
                                                                                      net.get("mode", "allowlist"))})
    return out


def refused_line(cell_id: str, refusals: list[dict]) -> str | None:
    """One stderr line for the CLI: `agnsup: cell C: the proxy refused pypi.org:443 (address:private):
    network.allow_private = true allows it` (the first REFUSALS_SHOWN, then how many more)."""
    if not refusals:
        return None
    parts = []
    for r in refusals[:REFUSALS_SHOWN]:
        where = f"{allow_entry(r['host'], None) if ':' in r['host'] else r['host']}" + \
            (f":{r['port']}" if r["port"] is not None else "")
        fix = f"{r['allow_key']} allows it" if r["allow_key"] else "no role key allows it"
        parts.append(f"{where} ({r['rule']}): {fix}")
    more = f"; {len(refusals) - REFUSALS_SHOWN} more (agnsup receipts)" if len(refusals) > REFUSALS_SHOWN else ""
    return f"agnsup: cell {cell_id}: the proxy refused " + "; ".join(parts) + more
