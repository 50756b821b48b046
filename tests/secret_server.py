"""A local HTTPS server that checks a credential: the far end of the secrets tests (tests/test_secrets_clients.py).

`SecretSite(tmp)` makes a throwaway CA (EC P-256, `cryptography`), a server certificate it signs for the test
names (api.secret.test, other.secret.test; the tests map them to 127.0.0.1 with AGNSUP_TEST_EGRESS_HOSTS), and an
HTTPS server on 127.0.0.1 (a free port) that answers only a request carrying the token `site.token`, in any of:

- `Authorization: Bearer TOKEN`
- `Authorization: Basic b64(USER:TOKEN)` (any user)
- `X-Api-Key: TOKEN` (the header `HEADER`)

and 401 (with a Basic challenge, which git needs to send the credential of its URL) otherwise. It logs every
request it received (`site.log`: method, host, path, headers, body) for the test to inspect. It serves:

- `/hello`: a line of text;
- `/big?n=BYTES`: that many zero bytes;
- `/echo`: the request's headers, as a careless (or debugging) server sends them back (`?gzip`: compressed; `?br`: marked brotli;
  `?chunked`: in 3-byte chunks);
- `/git/repo.git/...`: a git repository over smart HTTP (`git http-backend` run as CGI);
- `/simple/<pkg>/` and `/packages/<wheel>`: a PEP 503 simple index with one small wheel written here;
- `/npm/<pkg>` and its tarball: an npm registry with that one package.

The same handler also listens for plain HTTP (`site.http_port`): where a placeholder must never be sent.

The token lives in this process's memory only (never in a file). `site.ca_bundle` is a file with the system
bundle and the test CA: the controller's own `SSL_CERT_FILE`, so the proxy trusts this server.
"""
from __future__ import annotations

import base64
import datetime
import hashlib
import http.server
import ipaddress
import json
import os
import ssl
import subprocess
import threading
import zipfile
from dataclasses import dataclass, field

NAMES = ("api.secret.test", "other.secret.test")
HEADER = "X-Api-Key"
PKG = "agnsup-secret-pkg"
WHEEL = "agnsup_secret_pkg-1.0-py3-none-any.whl"
HELLO = b"hello from api.secret.test\n"
SYSTEM_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
GIT_BACKEND = "/usr/lib/git-core/git-http-backend"


@dataclass
class Request:
    method: str
    host: str
    path: str
    headers: dict[str, str]
    body: bytes
    status: int = 0
    auth: str = ""      # bearer | basic | header | "" (which credential form matched)

    def text(self) -> str:
        """Everything the server received, for a search (a Basic credential decoded too)."""
        lines = [f"{self.method} {self.path}", *(f"{k}: {v}" for k, v in self.headers.items())]
        scheme, _, cred = self.headers.get("Authorization", "").partition(" ")
        if scheme.lower() == "basic":
            try:
                lines.append(base64.b64decode(cred).decode("latin-1"))
            except ValueError:
                pass
        return "\n".join([*lines, self.body.decode("latin-1")])


def make_ca(names=NAMES):
    """(ca_cert_pem, leaf_cert_pem, leaf_key_pem): a throwaway CA and a leaf for `names` (and 127.0.0.1)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID, ExtendedKeyUsageOID

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "agnsup secrets test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                       crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    san = [x509.DNSName(n) for n in names] + [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    leaf = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(san), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    return (ca.public_bytes(pem), leaf.public_bytes(pem),
            key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))


def write_wheel(path: str) -> None:
    """A tiny pure-Python wheel of PKG."""
    top = "agnsup_secret_pkg"
    info = f"{top}-1.0.dist-info"
    files = {f"{top}/__init__.py": b"VALUE = 1\n",
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {PKG}\nVersion: 1.0\n".encode(),
             f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}

    def digest(d: bytes) -> str:
        return base64.urlsafe_b64encode(hashlib.sha256(d).digest()).rstrip(b"=").decode()
    record = "".join(f"{n},sha256={digest(d)},{len(d)}\n" for n, d in files.items()) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for n, d in files.items():
            z.writestr(n, d)
        z.writestr(f"{info}/RECORD", record)


def make_repo(bare: str, work: str) -> None:
    """A bare git repository with one commit (README), exported to http-backend."""
    g = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "init.defaultBranch=main"]
    subprocess.run([*g, "init", "-q", work], check=True)
    with open(os.path.join(work, "README"), "w") as f:
        f.write("cloned with an injected credential\n")
    subprocess.run([*g, "-C", work, "add", "README"], check=True)
    subprocess.run([*g, "-C", work, "commit", "-qm", "one"], check=True)
    subprocess.run([*g, "clone", "-q", "--bare", work, bare], check=True)
    with open(os.path.join(bare, "git-daemon-export-ok"), "w"):
        pass


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: "_Server"

    def log_message(self, *a):
        pass

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = b""
            while True:
                n = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if n == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return out
                out += self.rfile.read(n)
                self.rfile.readline()
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _auth(self) -> str:
        token = self.server.site.token
        a = self.headers.get("Authorization", "")
        scheme, _, cred = a.partition(" ")
        if scheme.lower() == "bearer" and cred == token:
            return "bearer"
        if scheme.lower() == "basic":
            try:
                user, _, pw = base64.b64decode(cred, validate=True).decode().partition(":")
            except ValueError:
                pw = ""
            if pw == token:
                return "basic"
        if self.headers.get(HEADER) == token:
            return "header"
        return ""

    def _send(self, status: int, body: bytes, ctype="text/plain", extra=()) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in extra:
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _handle(self) -> None:
        body = self._body()
        req = Request(self.command, self.headers.get("Host", ""), self.path, dict(self.headers.items()), body)
        req.auth = self._auth()
        site = self.server.site
        with site.lock:
            site.log.append(req)
        if not req.auth:
            req.status = 401
            return self._send(401, b"credential required\n", extra=[("WWW-Authenticate", 'Basic realm="secret"')])
        path, _, query = self.path.partition("?")
        req.status = 200
        if path == "/hello":
            return self._send(200, HELLO)
        if path == "/big":  # ?n=BYTES of zeros, streamed (a download through the proxy)
            n = int(query.partition("n=")[2] or 0)
            self.send_response(200)
            self.send_header("Content-Length", str(n))
            self.end_headers()
            block = b"\0" * 65536
            while n > 0:
                self.wfile.write(block[:n])
                n -= len(block)
            return
        if path == "/echo":  # a server that echoes what it got (httpbin's /headers): the value comes back
            text = "".join(f"{k}: {v}\n" for k, v in req.headers.items()).encode()
            if query == "gzip":  # ... compressed whatever the client accepts (httpbin's /gzip)
                import gzip
                return self._send(200, gzip.compress(text), extra=[("Content-Encoding", "gzip")])
            if query == "br":  # ... in a coding the proxy cannot read (these bytes are not brotli: never decoded)
                return self._send(200, b"\x1b" + text, extra=[("Content-Encoding", "br")])
            if query == "chunked":  # ... in 3-byte chunks: a value split by the chunk framing
                self.send_response(200)
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                self.wfile.write(b"".join(b"%x\r\n%s\r\n" % (len(text[i:i + 3]), text[i:i + 3])
                                          for i in range(0, len(text), 3)) + b"0\r\n\r\n")
                return
            return self._send(200, text)
        if path == f"/simple/{PKG}/" or path == "/simple/":
            html = f'<html><body><a href="/packages/{WHEEL}">{WHEEL}</a></body></html>\n'
            return self._send(200, html.encode(), "text/html")
        if path == f"/packages/{WHEEL}":
            with open(site.wheel, "rb") as f:
                return self._send(200, f.read(), "application/octet-stream")
        if path == f"/npm/{PKG}":  # an npm registry's packument; its tarball on the same registry
            tgz = site.npm_tarball()
            url = f"https://{self.headers.get('Host')}/npm/{PKG}/-/{PKG}-1.0.0.tgz"
            dist = {"tarball": url, "shasum": hashlib.sha1(tgz).hexdigest(),
                    "integrity": "sha512-" + base64.b64encode(hashlib.sha512(tgz).digest()).decode()}
            doc = {"name": PKG, "dist-tags": {"latest": "1.0.0"},
                   "versions": {"1.0.0": {"name": PKG, "version": "1.0.0", "dist": dist}}}
            return self._send(200, json.dumps(doc).encode(), "application/json")
        if path == f"/npm/{PKG}/-/{PKG}-1.0.0.tgz":
            return self._send(200, site.npm_tarball(), "application/octet-stream")
        if path.startswith("/git/"):
            return self._git(path[len("/git"):], query, body)
        req.status = 404
        self._send(404, b"not here\n")

    def _git(self, path_info: str, query: str, body: bytes) -> None:
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "GIT_PROJECT_ROOT": self.server.site.git_root,
               "GIT_HTTP_EXPORT_ALL": "1", "GIT_CONFIG_COUNT": "1", "GIT_CONFIG_KEY_0": "http.receivepack",
               "GIT_CONFIG_VALUE_0": "true", "PATH_INFO": path_info, "QUERY_STRING": query,
               "REQUEST_METHOD": self.command, "REMOTE_USER": "secret", "REMOTE_ADDR": "127.0.0.1",
               "CONTENT_TYPE": self.headers.get("Content-Type", ""), "CONTENT_LENGTH": str(len(body)),
               "GATEWAY_INTERFACE": "CGI/1.1", "SERVER_PROTOCOL": "HTTP/1.1"}
        if self.headers.get("Content-Encoding"):
            env["HTTP_CONTENT_ENCODING"] = self.headers["Content-Encoding"]
        if self.headers.get("Git-Protocol"):
            env["GIT_PROTOCOL"] = self.headers["Git-Protocol"]
        cp = subprocess.run([GIT_BACKEND], input=body, env=env, capture_output=True, timeout=60)
        head, _, out = cp.stdout.partition(b"\r\n\r\n")
        if not _:
            head, _, out = cp.stdout.partition(b"\n\n")
        status, extra, ctype = 200, [], "application/octet-stream"
        for line in head.decode("latin-1").splitlines():
            k, _, v = line.partition(":")
            k, v = k.strip(), v.strip()
            if k.lower() == "status":
                status = int(v.split()[0])
            elif k.lower() == "content-type":
                ctype = v
            elif k and k.lower() != "content-length":
                extra.append((k, v))
        self._send(status, out, ctype, extra)

    do_GET = do_POST = do_PUT = do_HEAD = _handle


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    site: "SecretSite"


@dataclass
class SecretSite:
    """The running server; `token` is the credential it wants (a canary: set it per test)."""
    dir: str
    token: str = ""
    log: list[Request] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self):
        os.makedirs(self.dir, exist_ok=True)
        ca, cert, key = make_ca()
        self.ca_pem = ca
        self.ca_file = os.path.join(self.dir, "test-ca.pem")
        with open(self.ca_file, "wb") as f:
            f.write(ca)
        self.ca_bundle = os.path.join(self.dir, "controller-trust.pem")
        with open(self.ca_bundle, "wb") as f:
            if os.path.exists(SYSTEM_BUNDLE):
                with open(SYSTEM_BUNDLE, "rb") as s:
                    f.write(s.read().rstrip(b"\n") + b"\n")
            f.write(ca)
        certfile, keyfile = os.path.join(self.dir, "leaf.pem"), os.path.join(self.dir, "leaf.key")
        with open(certfile, "wb") as f:
            f.write(cert)
        with open(os.open(keyfile, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
            f.write(key)
        self.wheel = os.path.join(self.dir, WHEEL)
        write_wheel(self.wheel)
        self.git_root = os.path.join(self.dir, "git")
        os.makedirs(self.git_root, exist_ok=True)
        if os.path.exists(GIT_BACKEND):
            make_repo(os.path.join(self.git_root, "repo.git"), os.path.join(self.dir, "repo-work"))
        self._srv = _Server(("127.0.0.1", 0), _Handler)
        self._srv.site = self
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(certfile, keyfile)
        ctx.set_alpn_protocols(["http/1.1"])
        self._srv.socket = ctx.wrap_socket(self._srv.socket, server_side=True)
        self.port = self._srv.server_address[1]
        self._plain = _Server(("127.0.0.1", 0), _Handler)  # plain http://, where a placeholder must never go
        self._plain.site = self
        self.http_port = self._plain.server_address[1]
        for srv in (self._srv, self._plain):
            threading.Thread(target=srv.serve_forever, daemon=True).start()

    def npm_tarball(self) -> bytes:
        """The npm package PKG 1.0.0 (package/package.json, package/index.js), gzipped tar."""
        import gzip
        import io
        import tarfile
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as t:
            for name, data in (("package/package.json", json.dumps({"name": PKG, "version": "1.0.0"}).encode()),
                               ("package/index.js", b"module.exports = 1;\n")):
                info = tarfile.TarInfo(name)
                info.size, info.mtime, info.mode = len(data), 0, 0o644
                t.addfile(info, io.BytesIO(data))
        return gzip.compress(buf.getvalue(), mtime=0)

    def new_repo(self, name: str) -> str:
        """Another bare repository `name`.git (a test that pushes gets its own); its path."""
        bare = os.path.join(self.git_root, f"{name}.git")
        make_repo(bare, os.path.join(self.dir, f"{name}-work"))
        return bare

    def url(self, path="/hello", host=NAMES[0]) -> str:
        return f"https://{host}:{self.port}{path}"

    def reset(self, token: str) -> None:
        with self.lock:
            self.log.clear()
            self.token = token

    def seen(self) -> list[Request]:
        with self.lock:
            return list(self.log)

    def close(self) -> None:
        for srv in (self._srv, self._plain):
            srv.shutdown()
            srv.server_close()
