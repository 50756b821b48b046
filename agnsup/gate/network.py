"""Network: network tools at command position, and the SSRF guard for URLs.

A network tool counts only at command position (after unwrapping), so
`grep -r curl .` and `echo ssh` pass while `sudo curl`, `$(wget ...)` and
`bash -c 'nc ...'` do not. Under `network: deny` such commands are refused;
the network namespace is the guarantee, this check explains early. For a
command that runs in a cell (run_process, run_shell) under mode open with
governance.kernel_enforced = "flag", the refusal becomes the flag
`network.kernel_enforced`: the cell's namespace refuses the connection anyway.

URL arguments pass the SSRF guard: the host is normalised the way real
clients read it (decimal/hex/octal/short IPv4, IPv4-mapped IPv6, userinfo,
trailing dots, Unicode digits and full stops), resolved once, and every
address must be public. The address that was checked is returned as
`pinned`: the caller connects to it, never to a second resolution.
"""

from __future__ import annotations

import re
import unicodedata

from .commands import Analysis, Exec
from .paths import LazyRe
from .model import CELL_TOOLS, Finding, GateContext, deny, ok, ok_flagged

NET_TOOLS = frozenset({"curl", "wget", "nc", "ncat", "netcat", "ssh", "scp", "sftp", "rsync", "socat", "telnet",
                       "ftp"})
REMOTE_ONLY = frozenset({"rsync", "scp"})  # network only with a host:path or rsync:// operand
URL_KEYS = ("url", "uri", "urls", "endpoint")
METADATA_HOSTS = frozenset({"metadata.google.internal", "metadata", "metadata.goog", "instance-data",
                            "instance-data.ec2.internal", "metadata.azure.com", "metadata.packet.net"})
METADATA_IPS = frozenset({"169.254.169.254", "fd00:ec2::254", "100.100.100.200", "169.254.170.2",
                          "192.0.0.192", "169.254.169.123"})
HINT_NET = "Set `network: host` (or `loopback` for local services) in the role if it should reach the network."
KERNEL_HINT = (" The cell's network namespace refuses it anyway: under mode open, governance.kernel_enforced = "
               "'flag' lets it run with a flag.")
HINT_SSRF = ("Internal, loopback and metadata addresses are refused for URL fetches; use a role with "
             "`network: loopback` for local services.")
_REMOTE = LazyRe(r"^rsync://|^[^/:\s]+:")  # host:path, user@host:path, host::module
_DOTS = dict.fromkeys(map(ord, "\u3002\uff0e\uff61"), ".")


def _is_remote(ex: Exec) -> bool:
    return any(_REMOTE.match(a) and not a.startswith("-") for a in ex.args)


def _kernel_note(what: str, ex: Exec, ctx: GateContext) -> dict:
    return {"rule": "network.kernel_enforced", "evidence": ex.text,
            "reason": f"{what} under role '{ctx.role}''s network: {ctx.network}; allowed with a flag because the cell's own "
                      "network namespace (only lo up) refuses every connection that would leave it "
                      "(governance.kernel_enforced = 'flag')."}


def check_commands(an: Analysis, ctx: GateContext, tool: str) -> tuple[Finding | None, list[dict]]:
    """The first denial (or None), and the kernel-backed refusals flagged instead."""
    # Under deny the cell's network namespace refuses what these rules refuse:
    # with kernel_enforced = "flag" (mode open) they become flags.
    backed = ctx.kernel is not None and tool in CELL_TOOLS and ctx.kernel.netns
    kernel = backed and ctx.flags_kernel_enforced(tool)
    hint = HINT_NET + (KERNEL_HINT if backed else "")
    notes: list[dict] = []
    for ex in an.execs:
        if ctx.egress is not None:  # allowlist/internal: the proxy's own matcher (gate/egress.py)
            from .egress import check_exec
            f = check_exec(ex, ctx, tool, notes)
            if f:
                return f, notes
        net = ex.prog in NET_TOOLS and (ex.prog not in REMOTE_ONLY or _is_remote(ex))
        dev = next((t for _op, t, _l in ex.redirects if t.startswith(("/dev/tcp/", "/dev/udp/"))), "")
        if ctx.network == "deny" or (ctx.egress is not None and dev):  # /dev/tcp never goes through a proxy
            if net and ctx.network == "deny":
                if kernel:
                    notes.append(_kernel_note(f"`{ex.prog}` reaches the network", ex, ctx))
                    continue
                return deny("network.command",
                            f"`{ex.prog}` reaches the network, and role '{ctx.role}' has network: deny.",
                            hint, ex.text), notes
            if dev:
                if kernel:
                    notes.append(_kernel_note(f"redirection to {dev} opens a network connection", ex, ctx))
                    continue
                return deny("network.dev_tcp",
                            f"redirection to {dev} opens a network connection, and role '{ctx.role}' has "
                            f"network: {ctx.network}.", hint, ex.text), notes
        elif net and ctx.network == "host" and ex.prog in ("curl", "wget", "http", "xh"):
            for a in ex.args:
                if "://" in a:
                    # With the host's network, loopback and private services are the role's to
                    # reach; only cloud metadata (credentials) is refused in shell commands.
                    f = check_url(a, ctx, resolve=False)
                    if not f.allowed and f.rule == "network.ssrf_metadata":
                        return f, notes
    return None, notes


# --- SSRF guard -----------------------------------------------------------------

def _ipv4_number(part: str) -> int | None:
    """One dotted part as inet_aton/WHATWG read it: 0x.. hex, 0.. octal, else decimal."""
    if not part:
        return None
    try:
        if part[:2].lower() == "0x":
            return int(part[2:] or "0", 16)
        if len(part) > 1 and part[0] == "0":
            return int(part[1:], 8)
        return int(part, 10)
    except ValueError:
        return None


def parse_ipv4(host: str) -> str | None:
    """`2130706433`, `0x7f000001`, `0177.0.0.1`, `127.1` -> "127.0.0.1"; None if not IPv4-like."""
    parts = host.split(".")
    if len(parts) > 4:
        return None
    nums = [_ipv4_number(p) for p in parts]
    if any(n is None for n in nums):
        return None
    *head, last = nums
    if any(n > 255 for n in head) or last >= 256 ** (5 - len(nums)):
        return None
    value = last
    for i, n in enumerate(head):
        value += n << (8 * (3 - i))
    return ".".join(str((value >> s) & 255) for s in (24, 16, 8, 0))


def normalise_host(url: str) -> tuple[str, str, list[str]]:
    """(scheme, host, [hosts as other clients could read the URL])."""
    from urllib.parse import urlsplit

    u = unicodedata.normalize("NFKC", url.strip().translate(_DOTS))
    hosts = []
    scheme = ""
    for variant in (u.replace("\\", "/"), u):  # WHATWG reads `\` as `/`; curl does not
        try:
            sp = urlsplit(variant if "://" in variant else "http://" + variant)
            h = sp.hostname or ""
            scheme = scheme or sp.scheme
        except ValueError:
            h = ""
        h = h.rstrip(".").lower()
        if h and h not in hosts:
            hosts.append(h)
    return scheme, (hosts[0] if hosts else ""), hosts


def unmapped(ip):
    """The IPv4 address an IPv4-mapped, 6to4 or NAT64 (64:ff9b::/96) address carries; else `ip`."""
    import ipaddress

    if ip.version == 6:
        mapped = ip.ipv4_mapped or ip.sixtofour
        if mapped is None and ip in ipaddress.ip_network("64:ff9b::/96"):
            mapped = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        if mapped is not None:
            return mapped
    return ip


def classify(ip) -> str:
    """"" for a public address, else why not."""
    ip = unmapped(ip)
    s = str(ip)
    if s in METADATA_IPS:
        return "metadata"
    for name in ("loopback", "link_local", "private", "multicast", "unspecified", "reserved"):
        if getattr(ip, f"is_{name}"):
            return name.replace("_", "-")
    if not ip.is_global:
        return "non-global"
    return ""


def check_url(url: str, ctx: GateContext, *, resolve: bool = True, resolver=None) -> Finding:
    import ipaddress

    scheme, host, hosts = normalise_host(url)
    if scheme not in ("http", "https"):
        return deny("network.url_scheme", f"URL scheme {scheme or '(none)'}:// is not fetched; only http and https.",
                    "Fetch files with a read tool instead of a URL.", url)
    if not host:
        return deny("network.ssrf", f"the URL {url!r} has no host that can be checked.", HINT_SSRF, url)
    if ctx.network == "deny" and resolve:
        return deny("network.url", f"role '{ctx.role}' has network: deny, so no URL is fetched.", HINT_NET, url)
    if ctx.egress is not None and resolve:
        from .egress import check_url as check_listed
        one = resolver or _resolve
        return check_listed(url, ctx, lambda name, _port: one(name))
    pinned = ""
    for h in hosts:
        if h in METADATA_HOSTS:
            return deny("network.ssrf_metadata", f"{h} is a cloud metadata endpoint.", HINT_SSRF, url)
        addrs: list = []
        bare = h.strip("[]").split("%", 1)[0]
        try:
            addrs = [ipaddress.ip_address(bare)]
        except ValueError:
            v4 = parse_ipv4(bare) if re.fullmatch(r"[0-9a-fx.]+", bare) and bare[-1:] != "" else None
            if v4:
                addrs = [ipaddress.IPv4Address(v4)]
            elif re.fullmatch(r"[0-9.]+", bare) or (re.fullmatch(r"[0-9a-fx.]+", bare) and bare.startswith("0x")):
                return deny("network.ssrf", f"the host {h!r} is a malformed IP address.", HINT_SSRF, url)
            elif bare == "localhost" or bare.endswith(".localhost"):
                addrs = [ipaddress.IPv4Address("127.0.0.1")]
            elif not resolve:
                continue  # shell commands: names are not resolved (kernel namespace decides)
            else:
                try:
                    addrs = [ipaddress.ip_address(a.split("%", 1)[0]) for a in (resolver or _resolve)(bare)]
                except OSError as e:
                    return deny("network.ssrf_unresolved", f"{bare} could not be resolved ({e}), so it cannot be "
                                "checked.", HINT_SSRF, url)
                if not addrs:
                    return deny("network.ssrf_unresolved", f"{bare} resolved to no address.", HINT_SSRF, url)
        for a in addrs:
            why = classify(a)
            if ctx.network == "loopback":
                if why != "loopback":
                    return deny("network.url", f"{h} ({a}) is not a loopback address, and role '{ctx.role}' has "
                                "network: loopback.", HINT_NET, url)
            elif why == "metadata":
                return deny("network.ssrf_metadata", f"{h} ({a}) is a cloud metadata address.", HINT_SSRF, url)
            elif why:
                return deny("network.ssrf", f"{h} resolves to {a}, a {why} address; URL fetches may only reach "
                            "public addresses.", HINT_SSRF, url)
        if addrs and h == host:
            pinned = str(addrs[0])
    return ok("network.pass", pinned=pinned)


def _resolve(host: str) -> list[str]:
    import socket

    return list(dict.fromkeys(ai[4][0] for ai in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)))


def check(tool: str, args: dict, an: Analysis | None, ctx: GateContext, resolver=None) -> Finding:
    notes: list[dict] = []
    if an is not None:
        f, notes = check_commands(an, ctx, tool)
        if f:
            return f
    pinned = ""
    for key in URL_KEYS:
        v = args.get(key)
        for url in ([v] if isinstance(v, str) else [x for x in v if isinstance(x, str)] if isinstance(v, list) else []):
            # URL arguments are fetched by the tool itself, in no cell: never kernel-backed.
            f = check_url(url, ctx, resolver=resolver)
            if not f.allowed:
                return f
            pinned = pinned or f.pinned
    flags = tuple(sorted(an.flags & {"network_in_code"})) if an is not None else ()
    if notes:
        return ok_flagged(notes, flags, pinned)
    return ok("network.pass", flags=flags, pinned=pinned)
