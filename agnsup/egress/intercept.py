"""Secrets on the wire: the proxy reads the cell's request to a secret's host and puts the value in.

A cell holds only a secret's placeholder (`agnsup-secret:NAME`). For a CONNECT (or
SOCKS5) to a host:port that one of the cell's secrets lists, the proxy, after the
usual judgement and TCP connect (proxy.py), terminates the cell's TLS with a leaf
of the controller's CA (ca.py), opens TLS upstream itself (system trust; SNI and
the hostname check = the requested name) and relays ONE HTTP/1.1 request:

    head     refused (403) if a placeholder is in the request line, or in a header
             when its secret does not list this destination; otherwise every
             placeholder in a header is replaced by its value (inside a `Basic`
             credential too: decoded, replaced, re-encoded), then the secrets of
             this destination inject theirs (bearer, basic:USER, header:NAME);
             `Connection: close` upstream, `Expect: 100-continue` answered here
    body     Content-Length or chunked, scanned as it streams (the decoded bytes,
             an overlap window of len(placeholder)-1 across reads and chunks): a
             placeholder is refused; the first BODY_HOLD bytes are held back with
             the head, so a small request is refused before anything went out; a
             later one aborts both connections (the upstream sees a cut request)
    response relayed until the upstream closes, with a secret's value (an
             upstream that echoes the request's headers) overwritten by as many
             `*`; the request asked for `Accept-Encoding: identity`, a gzip or
             deflate response is decoded here and a chunked one unframed (both
             relayed close-delimited: Decoder), any other coding refused (502,
             `secret.opaque_response`); then the cell's connection is closed
             (one request per connection: clients reconnect)

Everywhere else a placeholder is only looked for: a CONNECT or SOCKS5 name
(`where` dns), a plain http:// request's line, headers or body, to any host. Any
sighting is refused with rule `secret.exfiltration`, a connection record and an
event {name, host, port, where}. TLS to a host no secret lists stays an opaque
tunnel (proxy.py, unchanged): a placeholder inside it is invisible here and
worth nothing there, since only the proxy can turn it into the value.

Not served on an intercepted connection: HTTP/2 (ALPN offers http/1.1 only; a
client that insists fails its handshake), protocol upgrades (WebSocket: the
Upgrade header is dropped), a request that pipelines a second one (dropped with
the connection), a compressed request body (Content-Encoding: scanned as sent,
so a compressed placeholder is not seen, and is not replaced either).
"""
from __future__ import annotations

import base64
import binascii
import socket
import ssl
import zlib
from contextlib import suppress
from urllib.parse import unquote_to_bytes

HEAD_MAX = 64 * 1024        # the request head (the proxy's limit)
LINE_MAX = 8 * 1024         # a chunk-size or trailer line
BODY_HOLD = 64 * 1024       # body bytes held back with the head before anything goes upstream
BUF = 64 * 1024
RULE = "secret.exfiltration"
# Dropped from an intercepted request: hop-by-hop, or what we answer ourselves.
_DROP = frozenset({b"connection", b"keep-alive", b"proxy-connection", b"proxy-authorization", b"upgrade",
                   b"expect"})


class Exfiltration(Exception):
    """A placeholder where it may not go; `where`: url | header | body | dns."""

    def __init__(self, name: str, where: str):
        super().__init__(f"the placeholder of secret {name!r} in the request's {_WHERE[where]}")
        self.name, self.where = name, where


_WHERE = {"url": "URL", "header": "headers (a destination the secret does not list)", "body": "body",
          "dns": "destination name"}


class Answered(Exception):
    """The connection ended here, the cell answered already (proxy.py records it as refused or failed)."""

    def __init__(self, decision: str, rule: str, reason: str):
        super().__init__(reason)
        self.decision, self.rule, self.reason = decision, rule, reason


class BadRequest(ValueError):
    """A request the interception cannot frame (answered 400)."""


def norm_host(host: str) -> str:
    host = host.strip().lower().rstrip(".")
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def _authority(text: str) -> tuple[str, int | None] | None:
    """'name', 'name:port', '[v6]:port' -> (normalised host, port or None); None if it is none of them."""
    t = text.strip().lower()
    if t.startswith("["):
        end = t.find("]")
        if end < 0:
            return None
        h, rest = t[:end + 1], t[end + 1:]
    else:
        h, colon, p = t.partition(":")
        rest = colon + p
    if rest and not (rest[:1] == ":" and rest[1:].isdigit()):
        return None
    return norm_host(h), int(rest[1:]) if rest else None


def _same_origin(target: bytes, hosts: list[bytes], host: str, port: int) -> None:
    """The request names the destination it was intercepted for, in its one Host header and in an absolute-form
    target: else a front end shared by many names (a CDN) could route the value to another (domain fronting)."""
    named = [h.decode("latin-1") for h in hosts]
    if target[:1] != b"/" and target != b"*":
        scheme, sep, after = target.decode("latin-1").partition("://")
        if not sep or scheme.lower() != "https":
            raise BadRequest("a request target that is neither a path nor an https:// URL")
        named.append(after.split("/", 1)[0].split("?", 1)[0])
    if len(hosts) != 1:
        raise BadRequest("a request without exactly one Host header")
    want = norm_host(host)
    for text in named:
        a = _authority(text)
        if a is None or a[0] != want or a[1] not in (None, port):
            raise BadRequest(f"the request names {text.strip()!r}, not {want}:{port} it was sent to (a secret's value "
                             "goes only to the host it lists)")


class Secrets:
    """One cell's secrets, as the proxy uses them: who is intercepted, what is replaced, what is refused."""

    def __init__(self, secrets):
        self.secrets = list(secrets)
        self.dest: dict[tuple[str, int], list] = {}
        for s in self.secrets:
            if any(c in s.value for c in (b"\r", b"\n", b"\0")):
                # would split a header: never put on the wire (the message names the secret, not the value)
                raise ValueError(f"secret {s.ref.name!r}: its value holds a line break or NUL")
            for h, p in s.ref.hosts:
                self.dest.setdefault((norm_host(h), int(p)), []).append(s)
        # (needle, secret name): the placeholder, and its %-encoded colon for URLs
        self.needles = [(s.placeholder.encode(), s.ref.name) for s in self.secrets]
        self.window = max((len(n) for n, _ in self.needles), default=1) - 1

    def intercepts(self, host: str | None, port: int | None) -> list:
        """The secrets that list host:port (the CONNECT/SOCKS name as requested); [] = a plain tunnel."""
        if host is None or port is None:
            return []
        return self.dest.get((norm_host(host), port), [])

    def find(self, data: bytes) -> str | None:
        """The name of the first secret whose placeholder is in `data` (case-insensitive), or None."""
        low = data.lower()
        for needle, name in self.needles:
            if needle in low:
                return name
        return None

    def check_name(self, text: str) -> None:
        """A CONNECT or SOCKS5 target, or a plain request's host: no placeholder (DNS labels are case-blind)."""
        raw = text.encode("utf-8", "replace")
        name = self.find(raw) or self.find(_unquote(raw))
        if name:
            raise Exfiltration(name, "dns")

    def check_plain(self, head: bytes) -> None:
        """A plain http:// request head: a placeholder anywhere in it is refused (nothing is substituted)."""
        line, _, headers = head.partition(b"\r\n")
        name = self.find(line) or self.find(_unquote(line))
        if name:
            raise Exfiltration(name, "url")
        for h in headers.split(b"\r\n"):
            name = self.find(h) or self.find(_basic_decoded(h))
            if name:
                raise Exfiltration(name, "header")

    def scanner(self) -> "Scanner":
        return Scanner(self)

    # -- the intercepted request's head ------------------------------------------------
    def rewrite_head(self, head: bytes, host: str, port: int) -> tuple[bytes, set, dict]:
        """(the head to send upstream, names of the secrets put in, framing) for a request to host:port.
        `head`: the request line and headers without the blank line. Raises Exfiltration, BadRequest."""
        line, _, rest = head.partition(b"\r\n")
        parts = line.split(b" ")
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
            raise BadRequest("not an HTTP/1.x request")
        name = self.find(line) or self.find(_unquote(line))
        if name:
            raise Exfiltration(name, "url")
        here = {s.ref.name: s for s in self.intercepts(host, port)}
        used: set[str] = set()
        out: list[bytes] = []
        lines = rest.split(b"\r\n") if rest else []
        _same_origin(parts[1], [h.split(b":", 1)[1] for h in lines if h.split(b":", 1)[0].lower() == b"host"],
                     host, port)
        for h in lines:
            if h[:1] in (b" ", b"\t"):
                raise BadRequest("obsolete header line folding")
            if b":" not in h:
                raise BadRequest("a header line without a colon")
            key = h.split(b":", 1)[0]
            if key != key.strip() or not key:  # RFC 9112 5.1: a server MUST reject it; two parsers could differ
                raise BadRequest("whitespace before a header's colon")
            key = key.lower()
            if key in _DROP:
                continue
            if key == b"accept-encoding":  # the response must be one the Masker can read: identity
                continue
            h = self._substitute(h, key, here, used)
            out.append(h)
        out.append(b"Accept-Encoding: identity")
        for s in here.values():
            inj = s.ref.inject
            if inj == "placeholder":
                continue
            if inj == "bearer":
                hname, value = b"Authorization", b"Bearer " + s.value
            elif inj.startswith("basic:"):
                hname = b"Authorization"
                value = b"Basic " + base64.b64encode(inj[6:].encode() + b":" + s.value)
            elif inj.startswith("header:"):
                hname, value = inj[7:].encode(), s.value
            else:
                raise ValueError(f"secret {s.ref.name!r}: unknown inject {inj!r}")
            low = hname.lower()
            out = [h for h in out if h.split(b":", 1)[0].strip().lower() != low]
            out.append(hname + b": " + value)
            used.add(s.ref.name)
        framing = _framing(out)
        return b"\r\n".join([line, *out, b"Connection: close"]) + b"\r\n\r\n", used, framing

    def _substitute(self, h: bytes, key: bytes, here: dict, used: set) -> bytes:
        """One header line: each placeholder replaced if its secret lists this destination, else refused."""
        for needle, name in self.needles:
            if needle in h.lower():
                if name not in here or needle not in h:  # another host's, or a case-mangled one
                    raise Exfiltration(name, "header")
                h = h.replace(needle, here[name].value)
                used.add(name)
        if key in (b"authorization",):
            k, _, v = h.partition(b":")
            scheme, _, cred = v.strip().partition(b" ")
            if scheme.lower() == b"basic":
                try:
                    plain = base64.b64decode(cred.strip(), validate=True)
                except (binascii.Error, ValueError):
                    return h
                changed = plain
                for needle, name in self.needles:
                    if needle in changed.lower():
                        if name not in here or needle not in changed:
                            raise Exfiltration(name, "header")
                        changed = changed.replace(needle, here[name].value)
                        used.add(name)
                if changed != plain:
                    h = k + b": " + scheme + b" " + base64.b64encode(changed)
        return h


class Scanner:
    """Placeholders in a byte stream fed in pieces: keeps the last len(placeholder)-1 bytes."""

    def __init__(self, secrets: Secrets):
        self.secrets = secrets
        self.tail = b""

    def feed(self, data: bytes) -> None:
        if not data:
            return
        joined = self.tail + data
        name = self.secrets.find(joined)
        if name:
            raise Exfiltration(name, "body")
        w = self.secrets.window
        self.tail = joined[-w:] if w else b""


class Masker:
    """A response stream with every secret value overwritten by as many `*` (lengths, so Content-Length and
    chunk sizes, stay right): an upstream that echoes a request's headers (an error page, a debug endpoint)
    must not hand the value to the cell. Only an end of a read that could begin a value waits for the next
    read (a streamed response is not held back otherwise). It reads what Decoder gives it: a body decoded and
    unframed where it was compressed or chunked."""

    def __init__(self, values: list[bytes]):
        self.values = sorted({v for v in values if v}, key=len, reverse=True)
        self.buf = b""
        self.masked = 0

    def feed(self, data: bytes) -> bytes:
        buf = self.buf + data
        for v in self.values:
            if v in buf:
                self.masked += buf.count(v)
                buf = buf.replace(v, b"*" * len(v))
        cut = len(buf) - max((_partial(buf, v) for v in self.values), default=0)
        self.buf = buf[cut:]
        return buf[:cut]

    def flush(self) -> bytes:
        out, self.buf = self.buf, b""
        return out


def _partial(buf: bytes, v: bytes) -> int:
    """The length of the longest end of `buf` that is a beginning of `v` (shorter than v)."""
    start = max(0, len(buf) - len(v) + 1)
    i = buf.find(v[:1], start)
    while i >= 0:
        if v.startswith(buf[i:]):
            return len(buf) - i
        i = buf.find(v[:1], i + 1)
    return 0


class Reader:
    """Buffered reads from a recv(n) callable: lines, heads, and exactly-n streams."""

    def __init__(self, recv, early: bytes = b""):
        self.recv, self.buf = recv, bytearray(early)

    def _fill(self) -> None:
        data = self.recv(BUF)
        if not data:
            raise ConnectionAbortedError("the connection closed inside a request")
        self.buf += data

    def head(self, limit: int = HEAD_MAX) -> bytes:
        """Up to the blank line (returned without it)."""
        while True:
            i = self.buf.find(b"\r\n\r\n")
            if i >= 0:
                out = bytes(self.buf[:i])
                del self.buf[:i + 4]
                return out
            if len(self.buf) > limit:
                raise BadRequest("request head too long")
            self._fill()

    def line(self, limit: int = LINE_MAX) -> bytes:
        while True:
            i = self.buf.find(b"\n")
            if i >= 0:
                out = bytes(self.buf[:i + 1])
                del self.buf[:i + 1]
                return out
            if len(self.buf) > limit:
                raise BadRequest("a chunk line too long")
            self._fill()

    def some(self, n: int) -> bytes:
        if not self.buf:
            self._fill()
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out


def _framing(headers: list[bytes]) -> dict:
    """{"length": N} or {"chunked": True} from the headers (RFC 9112 6.3; both, or a coding other
    than chunked last, is refused: a proxy and a server that frame differently smuggle requests)."""
    te = [h.split(b":", 1)[1].strip().lower() for h in headers if h.split(b":", 1)[0].strip().lower()
          == b"transfer-encoding"]
    cl = {h.split(b":", 1)[1].strip() for h in headers if h.split(b":", 1)[0].strip().lower() == b"content-length"}
    if te:
        if cl:
            raise BadRequest("both Transfer-Encoding and Content-Length")
        codings = [c.strip() for c in b",".join(te).split(b",") if c.strip()]
        if not codings or codings[-1] != b"chunked" or codings.count(b"chunked") != 1:
            raise BadRequest("a Transfer-Encoding other than chunked")
        return {"chunked": True}
    if len(cl) > 1:
        raise BadRequest("conflicting Content-Length headers")
    if cl:
        v = next(iter(cl))
        if not v.isdigit():
            raise BadRequest("a bad Content-Length")
        return {"length": int(v)}
    return {"length": 0}


def stream_body(reader: Reader, framing: dict, scanner: Scanner, send) -> int:
    """Relay one request body from `reader` to `send`, as framed, scanning what it carries; bytes sent."""
    sent = 0

    def out(data: bytes, scanned: bytes | None = None) -> None:
        nonlocal sent
        scanner.feed(data if scanned is None else scanned)
        send(data)
        sent += len(data)

    def exactly(left: int) -> None:
        while left:
            data = reader.some(min(left, BUF))
            out(data)
            left -= len(data)

    if not framing.get("chunked"):
        exactly(framing["length"])
        return sent
    while True:
        size_line = reader.line()
        try:
            size = int(size_line.split(b";", 1)[0].strip(), 16)
        except ValueError:
            raise BadRequest("a bad chunk size") from None
        if size < 0:
            raise BadRequest("a bad chunk size")
        out(size_line, scanned=size_line.partition(b";")[2])  # chunk extensions are the body's too
        if size == 0:
            while True:  # trailers, up to the blank line
                t = reader.line()
                out(t)
                if t in (b"\r\n", b"\n"):
                    return sent
        exactly(size)
        end = reader.line()
        if end not in (b"\r\n", b"\n"):
            raise BadRequest("a chunk longer than its size")
        out(end, scanned=b"")


class Held:
    """Sends to `sink` once more than BODY_HOLD bytes came (or at flush): until then, a refusal sends nothing."""

    def __init__(self, sink, first: bytes):
        self.sink, self.buf, self.started = sink, bytearray(first), False
        self.limit = len(first) + BODY_HOLD

    def __call__(self, data: bytes) -> None:
        if self.started:
            self.sink(data)
            return
        self.buf += data
        if len(self.buf) > self.limit:
            self.flush()

    def flush(self) -> None:
        if not self.started:
            self.started = True
            self.sink(bytes(self.buf))
            self.buf = bytearray()


class TLSServer:
    """The cell's side of an intercepted connection: TLS through memory BIOs over a blocking socket,
    so bytes the cell sent right behind its CONNECT (already read by the proxy) are not lost."""

    def __init__(self, sock: socket.socket, ctx: ssl.SSLContext, early: bytes = b""):
        self.sock = sock
        self.inc, self.out = ssl.MemoryBIO(), ssl.MemoryBIO()
        if early:
            self.inc.write(early)
        self.obj = ctx.wrap_bio(self.inc, self.out, server_side=True)

    def _flush(self) -> None:
        data = self.out.read()
        if data:
            self.sock.sendall(data)

    def _io(self, fn, *args):
        while True:
            try:
                r = fn(*args)
            except ssl.SSLWantReadError:
                self._flush()
                data = self.sock.recv(BUF)
                if data:
                    self.inc.write(data)
                else:
                    self.inc.write_eof()
                continue
            self._flush()
            return r

    def handshake(self) -> None:
        self._io(self.obj.do_handshake)

    def recv(self, n: int) -> bytes:
        try:
            return self._io(self.obj.read, n)
        except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
            return b""

    def sendall(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            n = self._io(self.obj.write, view[:16384])
            view = view[n:]

    def close_notify(self) -> None:
        try:
            self.obj.unwrap()
        except (ssl.SSLError, OSError):
            pass
        try:
            self._flush()
        except OSError:
            pass


def refusal(status: int, rule: str, reason: str) -> bytes:
    body = f"agnsup egress: refused by {rule}: {reason}\n".encode()
    text = {400: "Bad Request", 403: "Forbidden", 502: "Bad Gateway", 431: "Request Header Fields Too Large"}
    return (f"HTTP/1.1 {status} {text.get(status, 'Refused')}\r\nContent-Type: text/plain\r\nX-Agnsup-Rule: {rule}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body


def _forms(s) -> list[bytes]:
    """The forms of a secret's value a response could echo: as it is, and the Basic credential we made."""
    out = [s.value]
    if s.ref.inject.startswith("basic:"):
        out.append(base64.b64encode(s.ref.inject[6:].encode() + b":" + s.value))
    return out


def _unquote(b: bytes) -> bytes:
    try:
        return unquote_to_bytes(b)
    except (ValueError, TypeError):
        return b


def _basic_decoded(h: bytes) -> bytes:
    """The decoded credential of an `Authorization: Basic` line (b"" otherwise)."""
    k, _, v = h.partition(b":")
    if k.strip().lower() not in (b"authorization", b"proxy-authorization"):
        return b""
    scheme, _, cred = v.strip().partition(b" ")
    if scheme.lower() != b"basic":
        return b""
    try:
        return base64.b64decode(cred.strip(), validate=True)
    except (binascii.Error, ValueError):
        return b""


# -- one connection (the proxy's thread) -------------------------------------------------------------
def serve_tls(proxy, client: socket.socket, upstream: socket.socket, early: bytes, rec: dict, host: str,
              port: int, timeouts: tuple[float, float]) -> None:
    """An intercepted CONNECT/SOCKS5: the cell's TLS ends here, one request goes upstream over our TLS.
    `timeouts`: (the cell's handshake and request head, the upstream's TLS handshake). Raises Answered
    for a refusal, OSError/ValueError for a broken connection."""
    handshake_timeout, connect_timeout = timeouts
    rec["intercepted"] = True
    name = norm_host(host)
    cell = TLSServer(client, proxy.authority.server_context(name), early)
    client.settimeout(handshake_timeout)
    cell.handshake()
    reader = Reader(cell.recv)
    up = None
    try:
        try:
            head = reader.head()
            new_head, used, framing = proxy.secrets.rewrite_head(head, host, port)
        except (Exfiltration, BadRequest) as e:
            cell.sendall(_refusal_for(proxy, rec, e, host, port))
            cell.close_notify()
            raise Answered("refused", rec["rule"], rec["reason"]) from None
        if any(h.lower().startswith(b"expect:") and b"100-continue" in h.lower() for h in head.split(b"\r\n")):
            cell.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
        client.settimeout(None)
        upstream.settimeout(connect_timeout)  # for the handshake; then as long as the response takes
        try:
            up = proxy.upstream_context().wrap_socket(upstream, server_hostname=name)
            up.settimeout(None)
        except (ssl.SSLError, ssl.CertificateError) as e:
            reason = f"TLS to {name}:{port}: {getattr(e, 'verify_message', None) or e}"
            with suppress(OSError, ValueError):
                cell.sendall(refusal(502, "tls", reason))
                cell.close_notify()
            raise Answered("failed", "tls", reason) from None
        proxy._track(rec["seq"], up)

        def send(data: bytes) -> None:
            up.sendall(data)
            rec["bytes_up"] += len(data)

        held = Held(send, new_head)
        try:
            stream_body(reader, framing, proxy.secrets.scanner(), held)
        except (Exfiltration, BadRequest) as e:
            if held.started:  # part of the request went out: cut both connections, no answer to make
                _refusal_for(proxy, rec, e, host, port)
                rec["reason"] += " (the request was cut: part of it had gone upstream)"
                raise Answered("refused", rec["rule"], rec["reason"]) from None
            cell.sendall(_refusal_for(proxy, rec, e, host, port))
            cell.close_notify()
            raise Answered("refused", rec["rule"], rec["reason"]) from None
        held.flush()
        for n in used:
            proxy._note_use(n, name, port)
        mask = Masker([v for s in proxy.secrets.secrets for v in _forms(s)])
        tell = CloseHead()
        plain = Decoder(head_request=new_head.startswith(b"HEAD "))
        while True:  # the response, until the upstream closes: as it is (decoded: Decoder), but for an echoed
            try:     # value and its connection option (CloseHead)
                data = up.recv(BUF)
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                data = b""
            try:
                for seen in plain.pieces(data):
                    out = mask.feed(seen)
                    out = tell(out) if out else b""
                    if out:
                        cell.sendall(out)
                        rec["bytes_down"] += len(out)
            except Opaque as e:
                rec.update(decision="refused", rule=OPAQUE, reason=str(e))
                if not tell.done:  # the final head was held: nothing of this response went out
                    with suppress(OSError, ValueError):
                        cell.sendall(refusal(502, OPAQUE, str(e)))
                        cell.close_notify()
                else:
                    rec["reason"] += " (the response was cut: part of it had gone to the cell)"
                raise Answered("refused", OPAQUE, rec["reason"]) from None
            if not data:
                out = mask.flush()
                out = (tell(out) if out else b"") + tell.rest()
                if out:
                    cell.sendall(out)
                    rec["bytes_down"] += len(out)
                break
        if mask.masked:
            rec["masked"] = mask.masked
        cell.close_notify()
    finally:
        if up is not None:
            with suppress(OSError, ValueError):
                up.close()


OPAQUE = "secret.opaque_response"
_DECODABLE = {b"gzip": 47, b"x-gzip": 47, b"deflate": 15}  # zlib wbits (47: a gzip header, 15: zlib)
MAX_INFLATE = 1 << 20  # decoded bytes per step of a compressed response (a bomb from the host stays bounded)


class Opaque(Exception):
    """A response in an encoding the proxy cannot look into (br, zstd, compress, stacked codings)."""


class Decoder:
    """The response as the Masker must see it: a final head with Content-Encoding gzip/x-gzip/deflate has the
    body decoded here (its framing undone: Content-Length, chunked or until close) and relayed uncompressed,
    close-delimited (Content-Encoding, Content-Length and Transfer-Encoding dropped; CloseHead adds
    `Connection: close`). Any other coding raises Opaque before a byte of that response went out. A chunked
    response without a coding is unframed the same way (a value split by the chunk framing would pass the
    Masker, which reads the stream). Any other response passes as it is; interim 1xx heads too."""

    def __init__(self, head_request: bool = False):
        self.buf, self.done, self.z, self.head_request = b"", False, None, head_request
        self.left = None     # Content-Length bytes still to come; None: chunked or until close
        self.chunked = False
        self.chunk = 0       # bytes left in the current chunk
        self.ended = False   # the body's framing ended (what follows is ignored)
        self.pend = b""      # a chunk-size line not complete yet
        self.unframing = False  # the body is unframed (chunked) and/or decoded here
        self.pending = b""      # compressed bytes read, not decoded yet (drain)
        self.started = False    # the first deflate bytes seen (zlib-wrapped or raw)

    def __call__(self, data: bytes) -> bytes:
        if self.done and not self.unframing:
            return data
        self.buf += data
        out = b""
        if not self.done:
            out, lines, self.buf = _final_head(self.buf)
            if lines is None:
                if len(self.buf) > HEAD_MAX:
                    raise Opaque("a response head past the proxy's limit")
                return out
            self.done = True
            status = lines[0].split(b" ", 2)
            codings = [c.strip().lower() for h in lines[1:] if h.split(b":", 1)[0].strip().lower()
                       == b"content-encoding" for c in h.split(b":", 1)[1].split(b",")]
            codings = [c for c in codings if c and c != b"identity"]
            fr = {h.split(b":", 1)[0].strip().lower(): h.split(b":", 1)[1].strip() for h in lines[1:] if b":" in h}
            te = fr.get(b"transfer-encoding", b"").lower()
            code = status[1] if len(status) > 1 else b""
            if not codings and (not te or self.head_request or code in (b"204", b"304")):
                out, self.buf = out + b"\r\n".join(lines) + b"\r\n\r\n" + self.buf, b""
                return out
            if codings and (len(codings) != 1 or codings[0] not in _DECODABLE):
                raise Opaque(f"a response in Content-Encoding {b', '.join(codings).decode(errors='replace')}, "
                             "which the proxy cannot look into for a secret's value")
            self.unframing = True  # chunked (a value split by the framing would pass the Masker), or coded
            if codings:
                self.wbits = _DECODABLE[codings[0]]
                self.z = zlib.decompressobj(self.wbits)
            if self.head_request or code in (b"204", b"304"):
                self.left = 0
            elif te:
                self.chunked = True
            elif fr.get(b"content-length", b"").isdigit():
                self.left = int(fr[b"content-length"])
            kept = [h for h in lines[1:] if h.split(b":", 1)[0].strip().lower()
                    not in (b"content-encoding", b"content-length", b"transfer-encoding")]
            out += b"\r\n".join([lines[0], *kept]) + b"\r\n\r\n"
        body, self.buf = self._unframe(self.buf), b""
        return out + self._inflate(body)

    def _unframe(self, buf: bytes) -> bytes:
        if self.ended:
            return b""
        if not self.chunked:
            if self.left is None:
                return buf
            buf = buf[:self.left]
            self.left -= len(buf)
            self.ended = self.left == 0
            return buf
        out, buf, self.pend = b"", self.pend + buf, b""
        while buf:
            if self.chunk > 0:
                piece = buf[:self.chunk]
                out, buf, self.chunk = out + piece, buf[len(piece):], self.chunk - len(piece)
                if not self.chunk:
                    self.chunk = -2  # its CRLF
                continue
            if self.chunk < 0:
                skip = min(-self.chunk, len(buf))
                buf, self.chunk = buf[skip:], self.chunk + skip
                continue
            end = buf.find(b"\r\n")
            if end < 0:
                if len(buf) > LINE_MAX:
                    raise Opaque("a chunk-size line past the proxy's limit")
                self.pend = buf  # the rest of the line comes with the next read
                return out
            size = buf[:end].split(b";", 1)[0].strip()
            try:
                n = int(size, 16)
            except ValueError:
                raise Opaque("a malformed chunked response") from None
            buf = buf[end + 2:]
            if n == 0:  # trailers are dropped with the framing
                self.ended = True
                return out
            self.chunk = n
        return out

    def _inflate(self, data: bytes) -> bytes:
        if self.z is None:  # chunked only: the body as it is, its framing undone
            return data
        if data and self.wbits == 15 and not self.started:  # deflate: zlib-wrapped, or raw (old IIS)
            self.started = True
            if len(data) >= 2 and not (data[0] & 0x0F == 8 and (data[0] << 8 | data[1]) % 31 == 0):
                self.z = zlib.decompressobj(-15)
        self.pending += data
        return self.drain()

    def drain(self) -> bytes:
        """At most MAX_INFLATE more decoded bytes of what was read, b"" when nothing is pending: one read of a
        compressed response never expands in memory past that at once (the relay drains, pieces())."""
        out = b""
        try:
            while self.pending and not out:
                data, self.pending = self.pending, b""
                out = self.z.decompress(data, MAX_INFLATE)
                if not self.z.eof:
                    self.pending = self.z.unconsumed_tail
                elif self.z.unused_data and self.wbits == 47:  # gzip members may follow one another (RFC 1952)
                    self.pending = self.z.unused_data
                    self.z = zlib.decompressobj(47)
                # (what follows the end of a deflate stream is not the body: dropped)
        except zlib.error as e:
            raise Opaque(f"a compressed response that does not decode ({e})") from None
        return out

    def pieces(self, data: bytes):
        """What `data` (b"": the upstream closed) gives the cell, in pieces of at most MAX_INFLATE decoded bytes
        (the heads in the first)."""
        if data:
            yield self(data)
        while self.pending:
            yield self.drain()
        if not data:
            yield self.rest()

    def rest(self) -> bytes:
        """At the upstream's close: what the decompressor still holds."""
        if self.z is None:
            return b""
        out = b""
        while self.pending:
            out += self.drain()
        try:
            return out + self.z.flush()
        except zlib.error as e:
            raise Opaque(f"a compressed response that does not decode ({e})") from None


def _final_head(buf: bytes) -> tuple[bytes, list[bytes] | None, bytes]:
    """A response stream's heads: (the interim 1xx heads at its front, as they are; the final head's lines, None
    while it is incomplete; what follows it, or the incomplete rest)."""
    out = b""
    while True:
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            return out, None, buf
        head, buf = buf[:end], buf[end + 4:]
        lines = head.split(b"\r\n")
        status = lines[0].split(b" ", 2)
        if len(status) > 1 and status[1][:1] == b"1" and status[1] != b"101":
            out += head + b"\r\n\r\n"
            continue
        return out, lines, buf


class CloseHead:
    """The response's final head gets `Connection: close` (its own connection options dropped): the proxy
    closes the cell's connection after one response, and a client that would reuse it (libcurl: git's
    push of a pack past its post buffer, streamed from a callback, cannot be resent) must know. Interim
    1xx heads, and what follows the final head, pass as they are; a head past HEAD_MAX passes unchanged."""

    def __init__(self):
        self.buf, self.done = b"", False

    def __call__(self, data: bytes) -> bytes:
        if self.done:
            return data
        out, lines, self.buf = _final_head(self.buf + data)
        if lines is None:
            if len(self.buf) > HEAD_MAX:
                self.done = True
                out, self.buf = out + self.buf, b""
            return out
        kept = [h for h in lines[1:] if h.split(b":", 1)[0].strip().lower() not in (b"connection", b"keep-alive")]
        out += b"\r\n".join([lines[0], *kept, b"Connection: close"]) + b"\r\n\r\n" + self.buf
        self.buf, self.done = b"", True
        return out

    def rest(self) -> bytes:
        """What is still held (a head the upstream never finished), as it came."""
        out, self.buf = self.buf, b""
        return out


def serve_plain(proxy, client: socket.socket, upstream: socket.socket, first: bytes, rec: dict) -> None:
    """A plain http:// request while the cell has secrets: its head was checked (proxy._http); the body
    is scanned as it streams, then the response relayed. One request: what follows it is dropped."""
    head, _, early = first.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    kept = [h for h in lines[1:] if h.split(b":", 1)[0].strip().lower() != b"expect"]
    if len(kept) < len(lines) - 1:  # the head is held back with the body's start: answer 100 here
        head = b"\r\n".join([lines[0], *kept])
        client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
    try:
        framing = _framing(kept)
    except BadRequest as e:
        with suppress(OSError):
            client.sendall(_refusal_for(proxy, rec, e, rec.get("name") or "", rec.get("port") or 80))
        raise Answered("refused", rec["rule"], rec["reason"]) from None
    client.settimeout(None)
    upstream.settimeout(None)

    def send(data: bytes) -> None:
        upstream.sendall(data)
        rec["bytes_up"] += len(data)

    held = Held(send, head + b"\r\n\r\n")
    try:
        stream_body(Reader(client.recv, early), framing, proxy.secrets.scanner(), held)
    except (Exfiltration, BadRequest) as e:
        answer = _refusal_for(proxy, rec, e, rec.get("name") or "", rec.get("port") or 80)
        if held.started:
            rec["reason"] += " (the request was cut: part of it had gone upstream)"
        else:
            with suppress(OSError, ValueError):
                client.sendall(answer)
        raise Answered("refused", rec["rule"], rec["reason"]) from None
    held.flush()
    tell = CloseHead()
    while True:  # the response, until the upstream closes (its head saying so: CloseHead)
        data = upstream.recv(BUF)
        out = tell(data) if data else tell.rest()
        if out:
            client.sendall(out)
            rec["bytes_down"] += len(out)
        if not data:
            break


def _refusal_for(proxy, rec: dict, e: Exception, host: str, port: int) -> bytes:
    """Record the refusal on `rec` (and the event, for a placeholder); the HTTP answer to send."""
    if isinstance(e, Exfiltration):
        rec.update(decision="refused", rule=RULE, reason=str(e))
        proxy._exfiltration(e.name, host, port, e.where)
        return refusal(403, RULE, str(e))
    rec.update(decision="refused", rule="protocol", reason=str(e))
    return refusal(400, "protocol", str(e))
