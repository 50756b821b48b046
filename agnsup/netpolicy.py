"""Where a cell may connect: the one matcher the gate and the egress proxy share.

A role with `network.mode = "allowlist"` or `"internal"` lists destinations
(docs/policy.md, "Network modes"):

    allow = ["example.org", "*.example.org", "example.net:443", "10.0.0.0/8"]
    deny  = ["private.example.org"]      # wins over allow
    allow_private = false

A destination is judged in two steps, by the same code wherever it is asked
(the text gate for URLs in a command, the controller's proxy for each
connection the cell opens):

1. **The lists** (`match`). The requested host is normalised the way clients
   read it (agnsup/gate/network.py: decimal/hex/octal/short IPv4, IPv4-mapped
   IPv6, brackets, trailing dots, full-width dots). An IP literal is an
   *address* and matches only address entries (an IP or a CIDR) or `*`; a
   name matches name entries (`example.org`, `*.example.org` for the names
   below it, `*` for any). An entry without a port allows 80 and 443; `:N`
   one port, `:*` any. A deny entry that matches refuses, whatever allows.
2. **The address** (`judge_addresses`), after the proxy resolved the name
   once. Every answer must be acceptable, or the name is refused (a listed
   name that also answers with a private address is a DNS-rebinding tell):
   `allowlist` accepts public addresses, and with `allow_private` also
   loopback, private, link-local (not metadata) and CGNAT ones; `internal`
   accepts only those non-public ones, never the public internet. Metadata,
   multicast, unspecified (0.0.0.0/8, `::`) and reserved addresses are never
   accepted: metadata hands out credentials, and connecting to 0.0.0.0 reaches
   the host's loopback. Nor is any non-loopback address of the controller's
   host (`own`: its interfaces' addresses, linux/hostaddrs.py), whatever its
   class and `allow_private`: the proxy runs on the host, so such an address
   reaches the host's own services (issue 25). The host's loopback stays a
   class of its own, opened only by `allow_private`.

Each verdict names the rule that decided: `allow:<entry>`, `deny:<entry>`,
`unlisted`, `address:<class>`, `malformed`. Imports nothing heavy: the
policy models validate entries with `parse_entry`, the gate and the proxy
judge with `Rules`.
"""
from __future__ import annotations

import re
from contextlib import suppress

from .util.lazy import LazyModule
from .util.record import Record

# Loaded by the first call that parses a URL, an address or a Unicode name (never by an argv call of a role
# without network lists): agnsup/util/lazy.py.
ipaddress = LazyModule("ipaddress")
unicodedata = LazyModule("unicodedata")
_urlparse = LazyModule("urllib.parse")

DEFAULT_PORTS = (80, 443)
MODES = ("allowlist", "internal")  # the network modes that go through the proxy
# Address classes (address_class) and who may reach them.
NEVER_CLASSES = frozenset({"metadata", "multicast", "unspecified", "reserved", "malformed"})
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789-_.")


class Entry(Record, frozen=True):
    """One allow or deny entry, parsed."""
    text: str            # as written in the role
    kind: str            # "any" | "name" | "suffix" | "net"
    value: object        # name, suffix (".example.org"), or an ipaddress network
    ports: tuple | None  # None: any port


class Verdict(Record, frozen=True):
    allowed: bool
    rule: str            # allow:<entry> | deny:<entry> | unlisted | address:<class> | malformed
    reason: str = ""


def _ports(text: str, where: str) -> tuple | None:
    if text == "*":
        return None
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ValueError(f"{where}: port {text!r} is not a number from 1 to 65535 (or *)")
    return (int(text),)


def _ip(text: str):
    try:
        return ipaddress.ip_network(text, strict=False)
    except ValueError:
        return None


def parse_entry(text: str) -> Entry:
    """`example.org`, `*.example.org`, `*`, `10.0.0.0/8`, `[::1]:443`, each with an optional
    `:port` or `:*`. ValueError names what is wrong (the policy validator shows it)."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"{text!r} is not a destination (a name, *.name, an IP or CIDR, optionally :port)")
    raw = text.strip().lower()
    ports: tuple | None = DEFAULT_PORTS
    if raw.startswith("["):  # [v6] or [v6]:port
        host, sep, rest = raw[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ValueError(f"{text!r}: an IPv6 entry is [address] or [address]:port")
        if rest:
            ports = _ports(rest[1:], repr(text))
    elif raw.count(":") == 1:
        host, _, port = raw.partition(":")
        ports = _ports(port, repr(text))
    else:
        host = raw  # a name, or an IPv6 address/CIDR without a port
    if host == "*":
        return Entry(text, "any", None, ports)
    net = _ip(host)
    if net is not None:
        return Entry(text, "net", net, ports)
    suffix = host.startswith("*.")
    name = host[2:] if suffix else host
    name = _idna(name.rstrip("."))
    labels = name.split(".")
    if not name or "*" in name or any(not lab for lab in labels) or not set(name) <= _NAME_CHARS:
        raise ValueError(f"{text!r} is not a host name, *.name, *, an IP or a CIDR")
    if all(lab.isdigit() for lab in labels) or looks_numeric(name):
        raise ValueError(f"{text!r} reads as a malformed IP address")
    return Entry(text, "suffix", "." + name, ports) if suffix else Entry(text, "name", name, ports)


def _idna(name: str) -> str:
    if name.isascii():
        return name
    try:
        return name.encode("idna").decode("ascii")
    except UnicodeError:
        return name  # refused by the character check


def looks_numeric(host: str) -> bool:
    """Digits, dots and hex: what inet_aton or a URL parser may read as an IPv4 address."""
    return bool(host) and set(host) <= set("0123456789abcdefx.") and (host[0].isdigit())


# --- hosts as clients read them (the gate's URL guard and the proxy alike) ---

_DOTS = dict.fromkeys(map(ord, "\u3002\uff0e\uff61"), ".")

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
    value = last + sum(n << (8 * (3 - i)) for i, n in enumerate(head))
    return ".".join(str((value >> s) & 255) for s in (24, 16, 8, 0))


def normalise_host(url: str) -> tuple[str, str, list[str]]:
    """(scheme, host, [hosts as other clients could read the URL]); hosts lower-cased,
    without brackets' content changed, trailing dots dropped. A word without `://`
    is read as `http://word` (`user@10.0.0.1:22`, `[::1]:80`, `localhost`)."""
    u = unicodedata.normalize("NFKC", url.strip().translate(_DOTS))
    hosts = []
    scheme = ""
    for variant in (u.replace("\\", "/"), u):  # WHATWG reads `\` as `/`; curl does not
        try:
            sp = _urlparse.urlsplit(variant if "://" in variant else "http://" + variant)
            h = sp.hostname or ""
            scheme = scheme or sp.scheme
        except ValueError:
            h = ""
        h = h.rstrip(".").lower()
        if h and h not in hosts:
            hosts.append(h)
        if "%" in h:
            # WHATWG and curl's URL parser percent-decode the host: `%31%32%37.0.0.1` is 127.0.0.1.
            d = unicodedata.normalize("NFKC", _urlparse.unquote(h, errors="replace").translate(_DOTS))
            d = d.rstrip(".").lower()
            if d and d not in hosts:
                hosts.append(d)
    return scheme, (hosts[0] if hosts else ""), hosts


# What classify_address returns: "public", or why an address is not.
CATEGORIES = ("public", "loopback", "link-local", "private", "metadata", "multicast", "unspecified", "reserved",
              "non-global")
METADATA_HOSTS = frozenset({"metadata.google.internal", "metadata", "metadata.goog", "instance-data",
                            "instance-data.ec2.internal", "metadata.azure.com", "metadata.packet.net"})
METADATA_IPS = frozenset({"169.254.169.254", "fd00:ec2::254", "100.100.100.200", "169.254.170.2",
                          "192.0.0.192", "169.254.169.123"})
_IPV4ISH = re.compile(r"[0-9a-fx.]+")


def host_address(host: str):
    """The address a host names without DNS: an IP literal in any spelling inet_aton or
    WHATWG accept, `localhost` (and `*.localhost`) as 127.0.0.1. Returns an
    ipaddress object, None for a name that needs resolving, or "malformed"."""
    bare = host.strip("[]").split("%", 1)[0]
    with suppress(ValueError):
        return ipaddress.ip_address(bare)
    if bare and _IPV4ISH.fullmatch(bare):
        v4 = parse_ipv4(bare)
        if v4:
            return ipaddress.IPv4Address(v4)
        if re.fullmatch(r"[0-9.]+", bare) or bare.startswith("0x"):
            return "malformed"
    if bare == "localhost" or bare.endswith(".localhost"):
        return ipaddress.IPv4Address("127.0.0.1")
    return None


def unmapped(ip):
    """The IPv4 address an IPv4-mapped, 6to4 or NAT64 (64:ff9b::/96) address carries; else `ip`."""
    if ip.version == 6:
        mapped = ip.ipv4_mapped or ip.sixtofour
        if mapped is None and ip in ipaddress.ip_network("64:ff9b::/96"):
            mapped = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        if mapped is not None:
            return mapped
    return ip


def classify_address(ip) -> str:
    """One of CATEGORIES for an address (an ipaddress object or its text); IPv4-mapped,
    6to4 and NAT64 addresses are judged as the IPv4 address they carry (the egress
    proxy's netpolicy.address_class judges the same way)."""
    if isinstance(ip, str):
        ip = ipaddress.ip_address(ip.strip("[]").split("%", 1)[0])
    ip = unmapped(ip)
    if str(ip) in METADATA_IPS:
        return "metadata"
    # Most specific first: Python's is_private also holds 0.0.0.0/8 and 240.0.0.0/4.
    for name in ("loopback", "link_local", "unspecified", "multicast", "reserved", "private"):
        if getattr(ip, f"is_{name}"):
            return name.replace("_", "-")
    return "public" if ip.is_global else "non-global"


def internal_allowed(ip, category: str, allow: tuple[str, ...] | list[str]) -> bool:
    """Whether `allow` (network.allow_internal: categories, addresses, networks) admits this
    non-public address. "metadata" must be named itself: "link-local" does not cover it."""
    if category in allow:
        return True
    for entry in allow:
        if entry in CATEGORIES:
            continue
        try:
            net = ipaddress.ip_network(entry, strict=False)
        except ValueError:
            continue
        if ip.version == net.version and ip in net:
            return True
    return False


class Destination(Record, frozen=True):
    """A requested host, normalised: a name or an address (never both)."""
    host: str            # as requested
    name: str = ""       # normalised name (lower case, IDNA, no trailing dot)
    address: object = None  # ipaddress address, for an IP literal (or localhost)
    malformed: str = ""  # why it is neither


def destination(host: str) -> Destination:
    """What a client would connect to for `host` (a bare host, `[v6]`, no port)."""
    bare = host.strip()
    if bare.startswith("[") and bare.endswith("]"):
        bare = bare[1:-1]
    if "%" in bare:
        return Destination(host, malformed="an IPv6 zone index names an interface of the host")
    with suppress(ValueError):
        return Destination(host, address=ipaddress.ip_address(bare))
    _scheme, norm, _all = normalise_host("[" + bare + "]" if ":" in bare else bare)
    norm = _idna(norm)
    with suppress(ValueError):
        return Destination(host, address=ipaddress.ip_address(norm.strip("[]")))
    if looks_numeric(norm):
        v4 = parse_ipv4(norm)
        if v4 is None:
            return Destination(host, malformed=f"{host!r} is a malformed IP address")
        return Destination(host, address=ipaddress.IPv4Address(v4))
    if norm == "localhost" or norm.endswith(".localhost"):
        # RFC 6761: always the loopback, whatever a resolver says
        return Destination(host, name=norm, address=ipaddress.IPv4Address("127.0.0.1"))
    if not norm or not set(norm) <= _NAME_CHARS or any(not lab for lab in norm.split(".")):
        return Destination(host, malformed=f"{host!r} is not a host name")
    return Destination(host, name=norm)


def address_class(ip) -> str:
    """"" for a public address, else its class: loopback, private, link-local, cgnat,
    metadata, multicast, unspecified, reserved, non-global. IPv4-mapped, 6to4 and
    NAT64 forms are judged as the IPv4 address they carry."""
    ip = unmapped(ip)
    if ip.version == 4 and ip in ipaddress.IPv4Network("0.0.0.0/8") or ip.is_unspecified:
        return "unspecified"  # connecting to 0.0.0.0 reaches the host's own loopback
    if ip.version == 4 and ip in ipaddress.IPv4Network("100.64.0.0/10"):
        return "cgnat"
    c = classify_address(ip)
    return "" if c == "public" else c


class Rules(Record, frozen=True):
    """A role's network lists, parsed once (from the validated policy's `network` table)."""
    mode: str = "allowlist"
    allow: tuple = ()
    deny: tuple = ()
    allow_private: bool = False
    port: int = 0        # the proxy's port on the cell's loopback (0: no proxy)

    @classmethod
    def of(cls, network: dict) -> "Rules":
        return cls(mode=network.get("mode", "allowlist"),
                   allow=tuple(parse_entry(e) for e in network.get("allow") or ()),
                   deny=tuple(parse_entry(e) for e in network.get("deny") or ()),
                   allow_private=bool(network.get("allow_private")), port=int(network.get("proxy_port") or 0))

    def match(self, dest: Destination, port: int) -> Verdict:
        """Step 1: the lists. Deny wins; an address matches only address entries and `*`."""
        if dest.malformed:
            return Verdict(False, "malformed", dest.malformed)
        for e in self.deny:
            if _matches(e, dest, port):
                return Verdict(False, f"deny:{e.text}", f"{_show(dest, port)} matches the deny entry {e.text!r}")
        for e in self.allow:
            if _matches(e, dest, port):
                return Verdict(True, f"allow:{e.text}", "")
        return Verdict(False, "unlisted", f"{_show(dest, port)} is not in the role's network.allow")

    def judge_addresses(self, addresses, own=frozenset()) -> Verdict:
        """Step 2: every address a name resolved to (or the literal) must be acceptable.
        `own`: the addresses of the controller's host, refused unless loopback."""
        if not addresses:
            return Verdict(False, "address:none", "resolved to no address")
        for a in addresses:
            why = address_class(a)
            if why != "loopback" and _unmapped(a) in own:
                return Verdict(False, "address:host", f"{a} is an address of the controller's host, never "
                               "reachable through the proxy")
            if why in NEVER_CLASSES:
                return Verdict(False, f"address:{why}", f"{a} is a {why} address, never reachable through the proxy")
            if self.mode == "internal":
                if not why:
                    return Verdict(False, "address:public", f"{a} is a public address; network.mode = 'internal' "
                                   "reaches only private destinations")
            elif why and not self.allow_private:
                return Verdict(False, f"address:{why}", f"{a} is a {why} address; set network.allow_private = "
                               "true to reach it")
        return Verdict(True, "address:ok")

    def judge(self, host: str, port: int, resolve=None, own=frozenset()) -> tuple[Verdict, Destination, list]:
        """Both steps for one connection: (verdict, destination, addresses judged).
        `resolve(name, port)` -> address strings, called once, only for a listed name;
        `own`: the host's own addresses (the proxy passes linux.hostaddrs.local_addresses())."""
        dest = destination(host)
        v = self.match(dest, port)
        if not v.allowed:
            return v, dest, []
        if dest.address is not None:
            addrs = [dest.address]
        elif resolve is None:
            return v, dest, []
        else:
            try:
                addrs = [ipaddress.ip_address(a.split("%", 1)[0]) for a in dict.fromkeys(resolve(dest.name, port))]
            except (OSError, UnicodeError, ValueError) as e:
                return Verdict(False, "unresolved", f"{dest.name} could not be resolved ({e})"), dest, []
        a = self.judge_addresses(addrs, own)
        if not a.allowed:
            return Verdict(False, a.rule, f"{_show(dest, port)}: {a.reason}"), dest, addrs
        return v, dest, addrs


def _matches(e: Entry, dest: Destination, port: int) -> bool:
    if e.ports is not None and port not in e.ports:
        return False
    if e.kind == "any":
        return True
    if dest.name and not (dest.name == "localhost" or dest.name.endswith(".localhost")):
        if e.kind == "name":
            return dest.name == e.value
        if e.kind == "suffix":
            return dest.name.endswith(e.value)
        return False
    if e.kind == "net" and dest.address is not None:
        a = unmapped(dest.address)
        return a.version == e.value.version and a in e.value
    return False


def _unmapped(ip):
    return unmapped(ip)


def _show(dest: Destination, port: int) -> str:
    host = dest.name or (str(dest.address) if dest.address is not None else dest.host)
    return f"{host}:{port}"

