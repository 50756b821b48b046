"""Network: network tools at command position, where they connect, and the SSRF guard for URLs.

A network tool counts only at command position (after unwrapping), so
`grep -r curl .` and `echo ssh` pass while `sudo curl`, `$(wget ...)` and
`bash -c 'nc ...'` do not. Network tools are HTTP and socket clients, remote
shells and copies, DNS lookups (`dig`, `nslookup`, `host`), TLS clients
(`openssl s_client`), tunnels (`ngrok`, `cloudflared`, `chisel`, `frpc`,
`ssh -R/-D`) and cloud CLIs that upload (`aws s3 cp` to a bucket, `gsutil
cp`, `az storage blob upload`).

Under `network: deny` such commands are refused; the network namespace is
the guarantee, this check explains early. For a command that runs in a cell
(run_process, run_shell) under mode open with governance.kernel_enforced =
"flag", the refusal becomes the flag `network.kernel_enforced`: the cell's
namespace refuses the connection anyway.

Under `network: host` nothing in the kernel stands between the cell and the
host's own services, so the text decides: every destination a client names
(URLs, `host:port`, `user@host`, `/dev/tcp/HOST/PORT`, proxies and curl's
`--resolve`) gets the same judgement as a URL argument: loopback,
link-local, private, metadata and other non-public addresses are refused
unless the role lists them in `network.allow_internal`; tunnels are refused
unless `network.tunnels = "allow"`; a DNS lookup with data in the name is
refused (exfiltration); uploads are flagged.

URL arguments pass the SSRF guard: the host is normalised the way real
clients read it (decimal/hex/octal/short IPv4, IPv4-mapped IPv6, userinfo,
trailing dots, Unicode digits and full stops), resolved once, and every
address must be public. The address that was checked is returned as
`pinned`: the caller connects to it, never to a second resolution.

The address functions at the top (`host_address`, `classify_address`, `internal_allowed`) are pure and public:
the egress proxy classifies with the same code.
"""

from __future__ import annotations

import re

from ..netpolicy import METADATA_HOSTS, classify_address, host_address, internal_allowed, normalise_host
from .model import CELL_TOOLS, Analysis, Exec, Finding, GateContext, deny, ok, ok_flagged
from .paths import LazyRe

# --- programs --------------------------------------------------------------------

NET_TOOLS = frozenset({"curl", "wget", "nc", "ncat", "netcat", "ssh", "scp", "sftp", "rsync", "socat", "telnet",
                       "ftp", "lftp", "http", "https", "xh", "aria2c", "lynx", "links", "w3m", "elinks"})
REMOTE_ONLY = frozenset({"rsync", "scp"})  # network only with a host:path or rsync:// operand
DNS_TOOLS = frozenset({"dig", "nslookup", "host", "drill", "kdig", "delv"})
TUNNELS = frozenset({"ngrok", "cloudflared", "chisel", "frpc", "frps", "bore", "lt", "localtunnel", "sshuttle",
                     "pagekite", "pagekite.py", "zrok", "inlets", "tmate", "gost", "rathole"})
URL_KEYS = ("url", "uri", "urls", "endpoint")
HINT_NET = "Set `network: host` (or `loopback` for local services) in the role if it should reach the network."
KERNEL_HINT = (" The cell's network namespace refuses it anyway: under mode open, governance.kernel_enforced = "
               "'flag' lets it run with a flag.")
HINT_SSRF = ("Internal, loopback and metadata addresses are refused; list the category or network in the role's "
             "network.allow_internal (e.g. [\"loopback\"] or [\"10.1.0.0/16\"]) if it should reach them.")
HINT_TUNNEL = ("A tunnel publishes the host's services or relays traffic past the role's network rules; set "
               "network.tunnels = 'allow' in the role if it should open one.")
HINT_DOWNLOAD = ("Download the file first, read it (or have it reviewed), then run the file; or set "
                 "network.download_exec = 'allow' in the role if it should run what a server sends.")
HINT_DNS = ("Data in a DNS name leaves the host through any resolver; write the name literally (short labels) if "
            "this is a real lookup.")
_REMOTE = LazyRe(r"^rsync://|^[^/:\s]+:")  # host:path, user@host:path, host::module

# Options with a separate value, per client, so values are not read as destinations.
_CURL_VALUE = frozenset(
    "-A -b -c -C -d -D -e -E -F -H -K -m -o -P -Q -r -T -u -U -w -X -y -Y -z -t "
    "--data --data-raw --data-binary --data-urlencode --data-ascii --header --user-agent --referer --cookie "
    "--cookie-jar --output --upload-file --user --proxy-user --write-out --request --max-time --connect-timeout "
    "--retry --retry-delay --retry-max-time --limit-rate --max-filesize --range --cert --key --cacert --capath "
    "--config --form --form-string --interface --dns-servers --local-port --output-dir --continue-at "
    "--dump-header --speed-limit --speed-time --expect100-timeout --keepalive-time --max-redirs --oauth2-bearer "
    "--aws-sigv4 --json --variable --trace --trace-ascii --stderr --unix-socket --abstract-unix-socket --noproxy "
    "--netrc-file --cert-type --key-type --pass --ciphers --tls-max --create-file-mode --etag-save --etag-compare "
    "--telnet-option --quote --mail-from --mail-rcpt --proto --proto-redir --happy-eyeballs-timeout-ms".split())
_CURL_DEST = frozenset({"-x", "--proxy", "--preproxy", "--socks4", "--socks4a", "--socks5", "--socks5-hostname",
                        "--url"})
_WGET_VALUE = frozenset("-O -o -a -P -t -T -w -e -U -Q -l -A -R -D -I -X -i -B --header --user --password "
                        "--post-data --post-file --output-document --directory-prefix --tries --timeout --wait "
                        "--user-agent --referer --limit-rate --quota --level --bind-address --input-file".split())
_NC_VALUE = frozenset("-I -i -M -m -O -P -p -q -s -T -V -W -w -X -g -G -o -e -c --exec --sh-exec --lua-exec "
                      "--proxy-type --proxy-auth --source-port --source --wait --idle-timeout".split())
_NC_DEST = frozenset({"-x", "--proxy"})
_SSH_VALUE = frozenset("-B -b -c -E -e -F -I -i -l -m -O -o -p -Q -S -P".split())
_SSH_DEST = frozenset({"-J", "-W"})
_SSH_TUNNEL = frozenset({"-R", "-D", "-w"})
_SOCAT_CONNECT = LazyRe(r"^(?:tcp[46]?|tcp[46]?-connect|udp[46]?|udp[46]?-sendto|udp[46]?-connect|openssl|"
                        r"openssl-connect|ssl|socks4a?|socks5|proxy|proxy-connect|sctp-connect|dccp-connect):"
                        r"([^,]+)", re.I)
_HTTPIE = frozenset({"http", "https", "xh", "xhs"})
_SHORTHAND_LOCAL = LazyRe(r"^:\d*(/.*)?$")  # httpie: `:8080/x` is localhost:8080


def _is_remote(ex: Exec) -> bool:
    return any(_REMOTE.match(a) and not a.startswith("-") for a in ex.args)


def _upload(ex: Exec) -> str:
    """What a cloud CLI uploads to ("" if this is no upload): `aws s3 cp x s3://b`, `gsutil cp`, ..."""
    prog, args = ex.prog, ex.args
    ops = [a for a in args if not a.startswith("-")]
    if prog == "aws" and ops[:1] == ["s3"] and ops[1:2] in (["cp"], ["mv"], ["sync"]) and len(ops) >= 4:
        if ops[-1].startswith("s3://") and not ops[2].startswith("s3://"):
            return ops[-1]
    if prog == "aws" and ops[:2] == ["s3api", "put-object"]:
        return "s3api put-object"
    if prog == "gsutil" and ops[:1] in (["cp"], ["mv"], ["rsync"]) and len(ops) >= 3:
        if ops[-1].startswith("gs://") and not ops[1].startswith("gs://"):
            return ops[-1]
    if prog == "gcloud" and ops[:1] == ["storage"] and ops[1:2] in (["cp"], ["mv"], ["rsync"]) and len(ops) >= 4:
        if ops[-1].startswith("gs://") and not ops[2].startswith("gs://"):
            return ops[-1]
    if prog == "az" and ops[:1] == ["storage"] and len(ops) >= 3 and ops[2].startswith("upload"):
        return f"az storage {ops[1]} {ops[2]}"
    if prog == "azcopy" and ops[:1] in (["copy"], ["cp"], ["sync"]) and len(ops) >= 3 and "://" in ops[-1]:
        return ops[-1]
    if prog == "rclone" and ops[:1] in (["copy"], ["sync"], ["move"], ["copyto"], ["moveto"]) and len(ops) >= 3:
        if ":" in ops[-1] and not ops[-1].startswith("/") and ":" not in ops[1]:
            return ops[-1]
    return ""


def _openssl_client(ex: Exec) -> bool:
    return ex.prog == "openssl" and bool(ex.args) and ex.args[0] in ("s_client", "s_time")


def _tunnel(ex: Exec) -> str:
    """Why this command is a tunnel, or ""."""
    if ex.prog in TUNNELS:
        return f"`{ex.prog}` opens a tunnel"
    if ex.prog == "ssh":
        for i, a in enumerate(ex.args):
            if a == "--":
                break
            if a in _SSH_TUNNEL or (a[:2] in _SSH_TUNNEL and len(a) > 2 and not a.startswith("--")):
                return f"`ssh {a[:2]}` forwards a port or a SOCKS proxy through the connection"
            if a == "-o" and i + 1 < len(ex.args) and ex.args[i + 1].split("=", 1)[0].lower() in (
                    "remoteforward", "dynamicforward", "tunnel"):
                return f"`ssh -o {ex.args[i + 1]}` forwards through the connection"
    return ""


def network_kind(ex: Exec) -> str:
    """"" or what kind of network use this command is: client, dns, tls, tunnel, upload."""
    p = ex.prog
    if p in ("--help", "--version") or (ex.args and all(a in ("--help", "-h", "--version", "-V", "version", "help")
                                                         for a in ex.args)):
        return ""
    if _tunnel(ex):
        return "tunnel"
    if p in NET_TOOLS and (p not in REMOTE_ONLY or _is_remote(ex)):
        return "client"
    if p in DNS_TOOLS and ex.args:
        return "dns"
    if _openssl_client(ex):
        return "tls"
    if p in ("aws", "gsutil", "gcloud", "az", "azcopy", "rclone") and _upload(ex):
        return "upload"
    if _fetches(ex):
        return "fetch"
    return ""


_PKG_FETCH = {"npm": ("install", "i", "ci", "add", "update", "up", "upgrade"), "pnpm": ("install", "i", "add",
              "update", "up"), "yarn": ("", "install", "add", "upgrade"),
              "cargo": ("fetch", "install", "update", "search", "publish"), "go": ("get", "mod", "install")}
_GIT_REMOTE = LazyRe(r"^(?:https?|ssh|git|ftps?)://|^[^/\s@]+@[^/\s:]+:")


def _fetches(ex: Exec) -> bool:
    """A package manager or git about to download (pip install, npm install, git clone
    https://..., cargo fetch): network use the tool's name alone does not show."""
    p, args = ex.prog, list(ex.args)
    if p.startswith("python") and args[:2] == ["-m", "pip"]:
        p, args = "pip", args[2:]
    elif p == "uv" and args[:1] == ["pip"]:
        p, args = "pip", args[1:]
    words = [a for a in args if not a.startswith("-")]
    sub = words[0] if words else ""
    if p == "pip" or (p.startswith("pip3") and p[4:].replace(".", "").isdigit()):
        if sub not in ("install", "download", "wheel") or "--no-index" in args:
            return False
        if any(a in ("-r", "--requirement", "-c", "--constraint") or a.startswith(("--requirement=", "-r"))
               for a in args):
            return True
        operands = words[1:]
        return not operands or not all(o.startswith((".", "/", "~")) or o.endswith((".whl", ".tar.gz", ".zip"))
                                       for o in operands)
    if p in _PKG_FETCH:
        if "--offline" in args or "--path" in args or (p == "go" and sub == "mod" and words[1:2] != ["download"]):
            return False
        return sub in _PKG_FETCH[p]
    if p == "git" and sub in ("clone", "fetch", "pull", "push", "ls-remote"):
        return any(_GIT_REMOTE.match(w) for w in words[1:])
    return False


def _positionals(args: list[str], with_value: frozenset[str], dests: frozenset[str]) -> tuple[list[str], list[str]]:
    """(positional words, values of destination options) of a client's arguments."""
    pos, dest, i = [], [], 0
    while i < len(args):
        a = args[i]
        if a == "--":
            pos += args[i + 1:]
            break
        if a.startswith("--") and "=" in a:
            name, _, v = a.partition("=")
            if name in dests:
                dest.append(v)
        elif a in dests and i + 1 < len(args):
            dest.append(args[i + 1])
            i += 1
        elif a in with_value:
            i += 1
        elif len(a) > 2 and a[:2] in dests and not a.startswith("--"):
            dest.append(a[2:])  # -x10.0.0.1:3128
        elif not a.startswith("-") or a == "-":
            pos.append(a)
        i += 1
    return pos, dest


def destinations(ex: Exec) -> list[str]:
    """The destinations a network client names, as URLs or `host[:port]` words."""
    p, args = ex.prog, ex.args
    out: list[str] = []
    if p == "curl" or p in ("wget", "aria2c", "lynx", "links", "w3m", "elinks"):
        pos, dest = _positionals(args, _CURL_VALUE if p == "curl" else _WGET_VALUE,
                                 _CURL_DEST if p == "curl" else frozenset())
        out += pos + dest
        out += [a for a in args if "://" in a and a not in out]
        for i, a in enumerate(args):  # --resolve host:port:addr, --connect-to h1:p1:h2:p2 pin the address
            v = args[i + 1] if a in ("--resolve", "--connect-to") and i + 1 < len(args) else (
                a.split("=", 1)[1] if a.startswith(("--resolve=", "--connect-to=")) else "")
            parts = v.split(":")
            if a.startswith("--resolve") and len(parts) >= 3:
                out += [x.strip("[]") for x in ":".join(parts[2:]).split(",") if x]
            elif a.startswith("--connect-to") and len(parts) >= 4 and parts[2]:
                out.append(parts[2])
    elif p in _HTTPIE:
        pos, _ = _positionals(args, frozenset({"--auth", "-a", "--output", "-o", "--session", "--verify", "--cert",
                                               "--cert-key", "--timeout", "--proxy", "--max-redirects"}),
                              frozenset())
        pos = [w for w in pos if w.upper() not in ("GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS")]
        if pos:
            out.append("localhost" + pos[0] if _SHORTHAND_LOCAL.match(pos[0]) else pos[0])
    elif p in ("nc", "ncat", "netcat", "telnet"):
        if any(a in ("-l", "--listen") or (a.startswith("-") and not a.startswith("--") and "l" in a[1:])
               for a in args if a.startswith("-")):
            return []  # listening: the host operand is the address to bind
        pos, dest = _positionals(args, _NC_VALUE, _NC_DEST)
        out += pos[:1] + dest
    elif p == "socat":
        out += [m.group(1).rsplit(":", 1)[0] for m in map(_SOCAT_CONNECT.match, args) if m]  # host[:port]
    elif p in ("ssh", "sftp", "ftp", "lftp"):
        pos, dest = _positionals(args, _SSH_VALUE | {"-L", "-R", "-D", "-w"}, _SSH_DEST)
        out += pos[:1] + [d for x in dest for d in x.split(",")]
    elif p in ("scp", "rsync"):
        pos, dest = _positionals(args, _SSH_VALUE | {"-e", "--rsh"}, _SSH_DEST)
        for w in pos:
            if w.startswith(("rsync://", "scp://", "sftp://")):
                out.append(w)
            elif _REMOTE.match(w):
                out.append(w.split(":", 1)[0] if not w.startswith("[") else w.split("]", 1)[0] + "]")
        out += dest
    elif _openssl_client(ex):
        host = ""
        for i, a in enumerate(args):
            nxt = args[i + 1] if i + 1 < len(args) else ""
            if a in ("-connect", "--connect", "-host"):
                host = nxt
            elif a == "-proxy":
                out.append(nxt)
        out.append(host or "localhost:4433")  # s_client's default peer
    return [w for w in out if w]


def _dev_tcp(ex: Exec) -> str:
    return next((t for _op, t, _l in ex.redirects if t.startswith(("/dev/tcp/", "/dev/udp/"))), "")


_LABEL_DATA = LazyRe(r"[A-Za-z0-9+/=_-]{32,}")
_EXPANSION_LABEL = LazyRe(r"\$\{?\w+\}?[.\w-]*\.")


def dns_exfil_name(word: str, literal: bool) -> bool:
    """Whether a name given to a DNS lookup carries data: a substitution or variable as a
    label (`$(cat f | base64).evil.com`, `$D.evil.com`), or a long encoded label."""
    if not literal:
        return "$(" in word or "`" in word or bool(_EXPANSION_LABEL.search(word))
    labels = word.rstrip(".").split(".")
    return len(word) > 120 or any(_LABEL_DATA.fullmatch(lb) and not lb.startswith("xn--")
                                  and any(ch.isdigit() for ch in lb) for lb in labels)


def _kernel_note(what: str, ex: Exec, ctx: GateContext) -> dict:
    return {"rule": "network.kernel_enforced", "evidence": ex.text,
            "reason": f"{what} under role '{ctx.role}''s network: {ctx.network}; allowed with a flag because "
                      "the cell's own network namespace (only lo up) refuses every connection that would leave it "
                      "(governance.kernel_enforced = 'flag')."}


_WHAT = {"client": "reaches the network", "dns": "looks names up over the network (DNS)",
         "tls": "opens a TLS connection", "tunnel": "opens a tunnel", "upload": "uploads to cloud storage",
         "fetch": "downloads packages or repositories over the network"}


def check_commands(an: Analysis, ctx: GateContext, tool: str) -> tuple[Finding | None, list[dict], tuple[str, ...]]:
    """The first denial (or None), the kernel-backed refusals flagged instead, and advisory flags."""
    # Under deny the cell's network namespace refuses what these rules refuse:
    # with kernel_enforced = "flag" (mode open) they become flags.
    backed = ctx.kernel is not None and tool in CELL_TOOLS and ctx.kernel.netns
    kernel = backed and ctx.flags_kernel_enforced(tool)
    hint = HINT_NET + (KERNEL_HINT if backed else "")
    notes: list[dict] = []
    flags: list[str] = []
    for ex in an.execs:
        if ctx.egress is not None:  # allowlist/internal: the proxy's own matcher (gate/egress.py)
            from .egress import check_exec  # a role with lists (allowlist, internal) only
            f = check_exec(ex, ctx, tool, notes)
            if f:
                return f, notes, ()
        kind = network_kind(ex)
        dev = _dev_tcp(ex)
        if ctx.network == "deny" or (ctx.egress is not None and dev):  # /dev/tcp never goes through a proxy
            if kind and ctx.network == "deny":
                if kernel:
                    notes.append(_kernel_note(f"`{ex.prog}` {_WHAT[kind]}", ex, ctx))
                    continue
                return deny("network.command",
                            f"`{ex.prog}` {_WHAT[kind]}, and role '{ctx.role}' has network: deny.",
                            hint, ex.text), notes, ()
            if dev:
                if kernel:
                    notes.append(_kernel_note(f"redirection to {dev} opens a network connection", ex, ctx))
                    continue
                return deny("network.dev_tcp",
                            f"redirection to {dev} opens a network connection, and role '{ctx.role}' has "
                            f"network: {ctx.network}.", hint, ex.text), notes, ()
        elif ctx.network == "host":
            # With the host's network nothing in the kernel keeps the cell off the host's own
            # services: the text judges every destination as the SSRF guard judges a URL.
            if kind == "tunnel" and ctx.tunnels != "allow":
                return deny("network.tunnel", f"{_tunnel(ex)}, and role '{ctx.role}' does not allow tunnels "
                            "(network.tunnels).", HINT_TUNNEL, ex.text), notes, ()
            if kind == "dns":
                for w, lit in zip(ex.args, ex.literal[1:]):
                    if not w.startswith(("-", "+", "@")) and dns_exfil_name(w, lit):
                        return deny("network.dns_exfil", f"the name {w[:80]!r} given to `{ex.prog}` carries data "
                                    "(a substitution or an encoded label): DNS lookups are an exfiltration channel.",
                                    HINT_DNS, ex.text), notes, ()
            if kind == "upload" and "network.upload" not in flags:
                flags.append("network.upload")
            targets = destinations(ex) if kind in ("client", "tls") else []
            if dev:
                targets.append(dev.split("/")[3] if dev.count("/") >= 3 else "")
            for t in targets:
                f = check_destination(t, ctx, ex.text or t)
                if f is not None:
                    return f, notes, ()
    return None, notes, tuple(flags)


# --- destinations and the SSRF guard ---------------------------------------------------

def judge_host(h: str, addrs: list, ctx: GateContext, evidence: str, what: str) -> Finding | None:
    """The shared destination judgement: a metadata name or address, or a non-public
    address the role does not list in network.allow_internal, is refused."""
    if h in METADATA_HOSTS and "metadata" not in ctx.allow_internal:
        return deny("network.ssrf_metadata", f"{h} is a cloud metadata endpoint ({what}).", HINT_SSRF, evidence)
    named = h.strip("[]")
    for a in addrs:
        why = classify_address(a)
        if why == "public" or internal_allowed(a, why, ctx.allow_internal):
            continue
        if why == "metadata":
            which = named if named == str(a) else f"{named} ({a})"
            return deny("network.ssrf_metadata", f"{which} is a cloud metadata address ({what}).", HINT_SSRF,
                        evidence)
        which = f"{named} is a {why} address" if named == str(a) else f"{named} is {a}, a {why} address"
        return deny("network.ssrf", f"{which} ({what}), and role '{ctx.role}' does not list it in "
                    "network.allow_internal; only public addresses may be reached.", HINT_SSRF, evidence)
    return None


def check_destination(word: str, ctx: GateContext, evidence: str) -> Finding | None:
    """A destination named in a shell command (URL or host[:port]), judged without DNS."""
    if not word or "$" in word or "`" in word:
        return None  # known only at run time
    _scheme, host, hosts = normalise_host(word if "://" in word or not _bare_ipv6(word) else f"[{word}]")
    for h in hosts:
        a = host_address(h)
        if a == "malformed":
            continue  # a word that is no address (curl reads it as a name and fails)
        f = judge_host(h, [a] if a is not None else [], ctx, evidence, "in a shell command")
        if f is not None:
            return f
    return None


def _bare_ipv6(w: str) -> bool:
    return w.count(":") >= 2 and "://" not in w and not w.startswith("[") and "/" not in w


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
        one = resolver or _resolve
        from .egress import check_url as check_listed
        return check_listed(url, ctx, lambda name, _port: one(name))
    pinned = ""
    for h in hosts:
        a = host_address(h)
        if a == "malformed":
            return deny("network.ssrf", f"the host {h!r} is a malformed IP address.", HINT_SSRF, url)
        if h in METADATA_HOSTS and "metadata" not in ctx.allow_internal:
            return deny("network.ssrf_metadata", f"{h} is a cloud metadata endpoint.", HINT_SSRF, url)
        addrs: list = [a] if a is not None else []
        if a is None and h not in METADATA_HOSTS:
            if not resolve:
                continue  # names are not resolved here
            bare = h.strip("[]")
            try:
                addrs = [ipaddress.ip_address(x.split("%", 1)[0]) for x in (resolver or _resolve)(bare)]
            except OSError as e:
                return deny("network.ssrf_unresolved", f"{bare} could not be resolved ({e}), so it cannot be "
                            "checked.", HINT_SSRF, url)
            if not addrs:
                return deny("network.ssrf_unresolved", f"{bare} resolved to no address.", HINT_SSRF, url)
        if ctx.network == "loopback":
            for x in addrs:
                if classify_address(x) != "loopback":
                    return deny("network.url", f"{h} ({x}) is not a loopback address, and role '{ctx.role}' has "
                                "network: loopback.", HINT_NET, url)
        else:
            f = judge_host(h, addrs, ctx, url, "URL fetch")
            if f is not None:
                return f
        if addrs and h == host:
            pinned = str(addrs[0])
    return ok("network.pass", pinned=pinned)


def _resolve(host: str) -> list[str]:
    import socket

    return list(dict.fromkeys(ai[4][0] for ai in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)))


def check(tool: str, args: dict, an: Analysis | None, ctx: GateContext, resolver=None) -> Finding:
    notes: list[dict] = []
    extra: tuple[str, ...] = ()
    if an is not None:
        f, notes, extra = check_commands(an, ctx, tool)
        if f:
            return f
        if an.downloads:  # `curl ... | sh` (gate/unreadable.py): code no one has read, from the network
            why, evidence = an.downloads[0]
            if ctx.network == "host" and ctx.download_exec != "allow":
                return deny("network.download_exec", f"{why}, and role '{ctx.role}' has network: host with "
                            "network.download_exec = 'deny'.", HINT_DOWNLOAD, evidence)
            extra += ("network.download_exec",)
    pinned = ""
    for key in URL_KEYS:
        v = args.get(key)
        for url in ([v] if isinstance(v, str) else [x for x in v if isinstance(x, str)] if isinstance(v, list) else []):
            # URL arguments are fetched by the tool itself, in no cell: never kernel-backed.
            f = check_url(url, ctx, resolver=resolver)
            if not f.allowed:
                return f
            pinned = pinned or f.pinned
    flags = (tuple(sorted(an.flags & {"network_in_code"})) if an is not None else ()) + extra
    if notes:
        return ok_flagged(notes, flags, pinned)
    return ok("network.pass", flags=flags, pinned=pinned)
