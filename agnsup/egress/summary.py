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
