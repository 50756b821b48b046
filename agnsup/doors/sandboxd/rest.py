"""sandboxd's Filesystem & Runtime REST API (agent-sandbox spec/filesystem/v1), stdlib http.server.

    GET    /v1/health          {"status": "ok", "uptime_seconds": N}; 503 while shutting down
    GET    /v1/metadata        {"env": {SANDBOX_*: ...}} without secret-looking names
    GET    /v1/agnsup          agnsup's extension: role, run and agent ids, worktree, controller
    GET    /v1/files/{path}    a file's bytes, or a directory's listing {"path", "entries"}
    HEAD   /v1/files/{path}    the same headers, no body (404 when absent)
    PUT    /v1/files/{path}    write atomically (temp file + rename), parents created; ?mode=0644
    DELETE /v1/files/{path}    remove; ?recursive=true for a non-empty directory (else 409)

{path} is relative to the sandbox's worktree (a leading "/" or the worktree's
own absolute prefix is dropped, as the standard's server does), percent-decoded
whole (clients send "/" as %2F). It is resolved with symlinks and refused (403
PERMISSION_DENIED) unless it stays inside the worktree (and every open is
openat2 RESOLVE_BENEATH of the worktree's fd, so no symlink swapped in after the
check leads elsewhere); then the gate judges
it as the file tool it is (read_file, list_dir, write_file, delete_file) under
the server's role: deny paths, the worktree's writability, the role's mode (a
readonly role cannot PUT or DELETE). Every call, allowed or refused, is one
journal event `file.<op>` of the server's run (Journal.record_file_op).
Errors: {"code", "message"} (+ "rule", "hint" for a gate denial).
"""
from __future__ import annotations

import datetime
import errno
import http.server
import json
import os
import re
import secrets
import shutil
import stat
import time
import urllib.parse
from contextlib import suppress

MODE_RE = re.compile(r"^0[0-7]{3}$")
METADATA_PREFIX = "SANDBOX_"
# The standard's server withholds these markers from /v1/metadata even under the prefix.
SENSITIVE_MARKERS = ("TOKEN", "SECRET", "PASSWORD", "PASSWD", "CRED", "KEY", "AUTH", "BEARER", "PRIVATE", "CERT")
CHUNK = 1 << 16
MULTIPART_MAX = 64 << 20
JSON_MAX = 1 << 20  # a POST /v1/agnsup/processes body


class Refused(Exception):
    def __init__(self, status: int, code: str, message: str, **extra):
        super().__init__(message)
        self.status, self.code, self.message, self.extra = status, code, message, extra


class Files:
    """The worktree confinement, the gate's judgement and the journal record of one file call."""

    def __init__(self, sup, *, role: str, workdir: str, run_id: str):
        from ... import policy
        self.sup, self.role, self.workdir, self.run_id = sup, role, workdir, run_id
        self.policy = policy.load(role, sup.state.path)
        # Every open goes through this fd with openat2(RESOLVE_BENEATH): the realpath check in
        # resolve() explains a refusal, the kernel enforces it at the open itself, so a symlink
        # swapped in between the two cannot lead the server (root, outside every cell) elsewhere.
        self.root_fd = os.open(workdir, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)

    def close(self) -> None:
        os.close(self.root_fd)

    def open(self, rel: str, flags: int, mode: int = 0) -> int:
        """An fd for `rel`, resolved by the kernel beneath the worktree (EXDEV: it left it)."""
        from ...linux import sys as lsys
        try:
            return lsys.openat2(self.root_fd, rel, flags, mode, lsys.RESOLVE_BENEATH | lsys.RESOLVE_NO_MAGICLINKS)
        except OSError as e:
            if e.errno in (errno.EXDEV, errno.ELOOP):
                raise Refused(403, "PERMISSION_DENIED", f"{rel!r} resolves outside the sandbox's worktree "
                              f"{self.workdir}", rule="sandboxd.path_escape") from None
            raise

    def parent(self, rel: str, create: bool) -> tuple[int, str]:
        """(an O_PATH fd of rel's directory, beneath the worktree; rel's last name). With `create`
        the missing directories are made one by one, each opened beneath before the next."""
        head, name = os.path.split(rel)
        parts = [p for p in head.split("/") if p not in ("", ".")]
        for i in range(1, len(parts) + 1 if create else 0):
            try:
                os.close(self.open("/".join(parts[:i]), os.O_PATH | os.O_DIRECTORY))
            except FileNotFoundError:
                up = self.open("/".join(parts[:i - 1]) or ".", os.O_PATH | os.O_DIRECTORY)
                try:
                    os.mkdir(parts[i - 1], 0o755, dir_fd=up)
                except FileExistsError:
                    pass
                finally:
                    os.close(up)
        return self.open("/".join(parts) or ".", os.O_PATH | os.O_DIRECTORY), name

    def resolve(self, raw: str) -> tuple[str, str]:
        """(the sandbox-relative path as given, the resolved absolute path inside the worktree)."""
        if "\0" in raw:
            raise Refused(400, "INVALID_ARGUMENT", "the path contains a NUL byte")
        rel = os.path.normpath(raw) if raw else "."
        root = self.workdir
        if rel == root:
            rel = "."
        elif rel.startswith(root.rstrip("/") + "/"):
            rel = rel[len(root.rstrip("/")) + 1:]
        rel = rel.lstrip("/") or "."  # an absolute path is the sandbox's, as the standard's server reads it
        resolved = os.path.realpath(os.path.join(root, rel))
        if resolved != root and not resolved.startswith(root.rstrip("/") + "/"):
            raise Refused(403, "PERMISSION_DENIED", f"{raw!r} resolves to {resolved}, outside the sandbox's worktree "
                          f"{root}: path traversal outside the sandbox root is forbidden", rule="sandboxd.path_escape")
        return rel, resolved

    def judge(self, tool: str, path: str) -> None:
        """The gate's path checks for `tool` on `path` (raises Refused on a denial; the gate journals nothing)."""
        from ... import governance
        decision, _trail = governance.decide(tool, {"path": path}, self.policy, self.workdir, self.sup.state.path)
        if not decision.allowed:
            raise Refused(403, "PERMISSION_DENIED", f"denied by {decision.rule}: {decision.reason}",
                          rule=decision.rule, hint=decision.hint)

    def record(self, op: str, raw: str, status: int, **data) -> None:
        self.sup.ctl.journal.record_file_op(self.run_id, op, path=raw, status=status, role=self.role, **data)


def _entry(dir_fd: int, name: str) -> dict | None:
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return None  # gone between listing and stat
    kind = "directory" if stat.S_ISDIR(st.st_mode) else "file" if stat.S_ISREG(st.st_mode) else "other"
    return {"name": name, "size": st.st_size, "type": kind, "mode": f"{stat.S_IMODE(st.st_mode):04o}",
            "modified_at": datetime.datetime.fromtimestamp(st.st_mtime, datetime.timezone.utc)
            .isoformat().replace("+00:00", "Z")}


def write_atomically(dir_fd: int, name: str, body, length: int, mode: int) -> int:
    """Write `length` bytes of `body` to a new temp file in `dir_fd`, then rename it over `name`
    (a symlink named `name` is replaced, never followed)."""
    tmp = f".sandboxd-{secrets.token_hex(8)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    done = 0
    try:
        with os.fdopen(fd, "wb") as f:
            while done < length:
                chunk = body.read(min(CHUNK, length - done))
                if not chunk:
                    raise Refused(400, "INVALID_ARGUMENT", f"the body ended after {done} of {length} bytes")
                f.write(chunk)
                done += len(chunk)
            os.fchmod(f.fileno(), mode)
        os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise
    return done


class Handler(http.server.BaseHTTPRequestHandler):
    server_version = "agnsup-sandboxd"
    protocol_version = "HTTP/1.1"
    app = None  # RestApp, set per server class
    refused: str | None = None  # this connection's peer refusal (RestApp.peer_refusal), answered to every request

    def handle(self) -> None:
        """Once per connection, before any request is read: the peer check (a cell's socket gets 403)."""
        if self.app is not None:
            self.refused = self.app.peer_refusal(self.client_address, self.connection.getsockname())
        super().handle()

    def log_message(self, format, *args):  # noqa: A002 - http.server's name
        pass  # the journal is the record; stderr stays quiet

    def _send(self, status: int, body: bytes = b"", ctype: str | None = None, head: bool = False,
              length: int | None = None) -> None:
        self.send_response(status)
        if ctype:
            self.send_header("Content-Type", ctype)
        if status != 204:
            self.send_header("Content-Length", str(len(body) if length is None else length))
        self.end_headers()
        if body and not head:
            self.wfile.write(body)

    def _json(self, status: int, obj, head: bool = False) -> None:
        self._send(status, json.dumps(obj).encode(), "application/json", head)

    def _error(self, e: Refused, head: bool = False) -> None:
        if self.command in ("PUT", "POST"):
            self.close_connection = True  # an unread body would be taken for the next request on this connection
        self._json(e.status, {"code": e.code, "message": e.message, **{k: v for k, v in e.extra.items() if v}}, head)

    def _route(self) -> None:
        method = self.command  # the request line's method, as http.server dispatched it to do_<method>
        url = urllib.parse.urlsplit(self.path)
        query = urllib.parse.parse_qs(url.query)
        app = self.app
        try:
            if self.refused is not None:
                self.close_connection = True
                raise Refused(403, "PERMISSION_DENIED", self.refused, rule="sandboxd.peer")
            if url.path.startswith("/v1/files/") or url.path == "/v1/files":
                raw = urllib.parse.unquote(url.path[len("/v1/files/"):]) if url.path != "/v1/files" else ""
                return app.files_call(self, method, raw, query)
            if url.path == "/v1/agnsup/processes" or url.path.startswith("/v1/agnsup/processes/"):
                return app.processes_call(self, method, url.path[len("/v1/agnsup/processes"):])
            if method not in ("GET", "HEAD"):
                raise Refused(405, "METHOD_NOT_ALLOWED", f"{method} {url.path}: not allowed")
            if url.path == "/v1/health":
                if app.stopping:
                    raise Refused(503, "UNAVAILABLE", "sandboxd is shutting down")
                return self._json(200, {"status": "ok", "uptime_seconds": int(time.monotonic() - app.started)},
                                  method == "HEAD")
            if url.path == "/v1/metadata":
                return self._json(200, {"env": app.metadata_env()}, method == "HEAD")
            if url.path == "/v1/agnsup":
                return self._json(200, app.about(), method == "HEAD")
            raise Refused(404, "NOT_FOUND", f"no endpoint {url.path}")
        except Refused as e:
            self._error(e, method == "HEAD")

    do_GET = do_HEAD = do_PUT = do_DELETE = do_POST = _route


class RestApp:
    def __init__(self, files: Files, about: dict, processes=None):
        self.files, self._about, self.processes = files, about, processes
        self.started = time.monotonic()
        self.stopping = False

    def about(self) -> dict:
        return dict(self._about)

    def peer_refusal(self, client: tuple, server: tuple) -> str | None:
        """None for a trusted client; the journaled refusal line for a process of an agnsup cell."""
        from ..serve import tcp_peer_refusal
        return tcp_peer_refusal(client[:2], server[:2], self.files.sup.ctl.journal, "sandboxd")

    def metadata_env(self) -> dict:
        from ...util.secretkeys import looks_secret
        return {k: v for k, v in os.environ.items() if k.startswith(METADATA_PREFIX)
                and not any(m in k.upper() for m in SENSITIVE_MARKERS) and not looks_secret(k)}

    def files_call(self, h: Handler, method: str, raw: str, query: dict) -> None:
        """One file call: resolve, judge, act; the journal record is committed before the answer goes out."""
        op = {"GET": "read", "HEAD": "stat", "PUT": "write", "DELETE": "delete"}.get(method)
        head = method == "HEAD"
        if op is None:
            return h._error(Refused(405, "METHOD_NOT_ALLOWED", f"{method} /v1/files: not allowed"))
        data: dict = {}
        try:
            rel, path = self.files.resolve(raw)
            data["resolved"] = path
            reply = getattr(self, "_" + op)(h, rel, path, query, data)
        except (Refused, OSError) as e:
            if isinstance(e, OSError):
                e = _refusal_of(e, raw, op)
            data.update(code=e.code, **({"rule": e.extra["rule"]} if e.extra.get("rule") else {}))
            self.files.record(op, raw, e.status, **data)
            return h._error(e, head)
        self.files.record(op, raw, reply[0], **data)
        reply[1](head)

    def _read(self, h: Handler, rel: str, path: str, query: dict, data: dict):
        fs = self.files
        try:
            # O_NONBLOCK: opening a FIFO must not hang the call (refused below); no effect on files
            fd = fs.open(rel, os.O_RDONLY | os.O_NONBLOCK)
        except FileNotFoundError:
            fs.judge("read_file", path)  # a deny path is refused as one, present or not
            raise Refused(404, "NOT_FOUND", f"{rel}: path does not exist within the sandbox") from None
        try:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                fs.judge("list_dir", path)
                entries = [e for n in sorted(os.listdir(fd)) if (e := _entry(fd, n)) is not None]
                data.update(type="directory", entries=len(entries))
                return 200, lambda head: h._json(200, {"path": rel, "entries": entries}, head)
            if not stat.S_ISREG(st.st_mode):
                raise Refused(400, "INVALID_ARGUMENT", f"{rel}: not a regular file or a directory")
            fs.judge("read_file", path)
        except BaseException:
            os.close(fd)
            raise
        f = os.fdopen(fd, "rb", buffering=0)
        data.update(type="file", bytes=st.st_size)
        return 200, lambda head: _send_file(h, f, st.st_size, head)

    _stat = _read  # HEAD: the same answer without its body

    def _write(self, h: Handler, rel: str, path: str, query: dict, data: dict):
        mode = (query.get("mode") or ["0644"])[-1]
        if not MODE_RE.match(mode):
            raise Refused(400, "INVALID_ARGUMENT", f"mode {mode!r}: must be octal permission bits like 0644")
        if rel == "." or os.path.isdir(path):
            raise Refused(400, "INVALID_ARGUMENT", f"{rel}: target path is a directory")
        if "chunked" in (h.headers.get("Transfer-Encoding") or "").lower():
            raise Refused(411, "INVALID_ARGUMENT", "send the body with a Content-Length (chunked uploads are not "
                          "supported)")
        try:
            length = int(h.headers.get("Content-Length") or "")
        except ValueError:
            raise Refused(411, "INVALID_ARGUMENT", "a PUT needs a Content-Length") from None
        body = h.rfile
        ctype = h.headers.get("Content-Type") or ""
        if ctype.split(";")[0].strip().lower() == "multipart/form-data":
            body, length = _file_part(ctype, h.rfile, length)
        self.files.judge("write_file", path)
        dir_fd, name = self.files.parent(rel, create=True)
        try:
            data.update(bytes=write_atomically(dir_fd, name, body, length, int(mode, 8)), mode=mode)
        except IsADirectoryError:
            raise Refused(400, "INVALID_ARGUMENT", f"{rel}: target path is a directory") from None
        finally:
            os.close(dir_fd)
        return 204, lambda head: h._send(204)

    def _delete(self, h: Handler, rel: str, path: str, query: dict, data: dict):
        recursive = (query.get("recursive") or ["false"])[-1].lower() in ("true", "1")
        if rel == ".":
            raise Refused(403, "PERMISSION_DENIED", "the sandbox's worktree itself cannot be deleted")
        try:
            dir_fd, name = self.files.parent(rel, create=False)
        except FileNotFoundError:
            raise Refused(404, "NOT_FOUND", f"{rel}: path does not exist within the sandbox") from None
        try:
            try:
                st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                raise Refused(404, "NOT_FOUND", f"{rel}: path does not exist within the sandbox") from None
            self.files.judge("delete_file", path)
            if stat.S_ISDIR(st.st_mode):
                if recursive:
                    shutil.rmtree(name, dir_fd=dir_fd)
                else:
                    try:
                        os.rmdir(name, dir_fd=dir_fd)
                    except OSError as e:
                        if e.errno != errno.ENOTEMPTY:
                            raise
                        raise Refused(409, "CONFLICT", f"{rel}: directory not empty (use ?recursive=true)") from None
                data.update(type="directory", recursive=recursive)
            else:
                os.unlink(name, dir_fd=dir_fd)  # a symlink itself, never what it names
                data.update(type="file")
        finally:
            os.close(dir_fd)
        return 204, lambda head: h._send(204)


    def processes_call(self, h: Handler, method: str, rest: str) -> None:
        """agnsup's extension for a process that outlives the call that started it, reachable with the client
        package's public `connector.send_request` (docs/sandboxd.md "Client recipe"):

            POST /v1/agnsup/processes               {"command": [...], "env_vars": {}, "cwd": ""} -> 201 status
            GET  /v1/agnsup/processes/N             {"process_id", "run_id", "cell_id", "running"[, "exit_code",
                                                     "state", "reason", "receipt"]}
            GET  /v1/agnsup/processes/N/output      NDJSON, chunked, as it comes: {"stdout": text} |
                                                     {"stderr": text} ..., then the status once it ended
            POST /v1/agnsup/processes/N/signal      {"signal": "SIGTERM" | "SIGINT" | "SIGKILL"} -> 204
        """
        from ...errors import AgnsupError
        svc = self.processes
        try:
            if svc is None:
                raise Refused(404, "NOT_FOUND", "no process service on this server")
            parts = [x for x in rest.split("/") if x]
            if not parts:
                if method != "POST":
                    raise Refused(405, "METHOD_NOT_ALLOWED", f"{method} /v1/agnsup/processes: not allowed (POST)")
                p = svc.start_detached(_json_body(h))
                return h._json(201, svc.status(p))
            if not parts[0].isdigit() or len(parts) > 2 or (len(parts) == 2 and parts[1] not in ("output", "signal")):
                raise Refused(404, "NOT_FOUND", f"no endpoint /v1/agnsup/processes{rest}")
            want = {1: "GET", 2: "GET" if parts[-1] == "output" else "POST"}[len(parts)]
            if method != want:
                raise Refused(405, "METHOD_NOT_ALLOWED", f"{method} /v1/agnsup/processes{rest}: not allowed ({want})")
            p = svc.detached_process(int(parts[0]))
            if len(parts) == 1:
                return h._json(200, svc.status(p))
            if parts[1] == "signal":
                body = _json_body(h)
                svc.signal_detached(p, str(body.get("signal", "")) if isinstance(body, dict) else "")
                return h._send(204)
            return _send_events(h, svc.events(p))
        except AgnsupError as e:
            from .process import status_of
            code = status_of(e)
            http = {"PERMISSION_DENIED": 403, "NOT_FOUND": 404, "INVALID_ARGUMENT": 400, "UNAVAILABLE": 503,
                    "FAILED_PRECONDITION": 409, "CANCELLED": 409}.get(code.name, 500)
            rule = (e.details.get("decision") or {}).get("rule")
            h._error(Refused(http, code.name, e.message, rule=rule, hint=(e.details.get("decision") or {}).get("hint")))
        except Refused as e:
            h._error(e)


def _json_body(h: Handler):
    try:
        length = int(h.headers.get("Content-Length") or "0")
    except ValueError:
        raise Refused(411, "INVALID_ARGUMENT", "a POST needs a Content-Length") from None
    if length > JSON_MAX:
        raise Refused(413, "INVALID_ARGUMENT", f"a JSON body is at most {JSON_MAX} bytes")
    try:
        return json.loads(h.rfile.read(length) or b"{}")
    except ValueError as e:
        raise Refused(400, "INVALID_ARGUMENT", f"the body is not JSON: {e}") from None


def _send_events(h: Handler, events) -> None:
    """One JSON object a line, each line its own HTTP chunk, written as it comes (a client reading
    lines gets each at once: without chunks, requests' iter_lines waits for 512 bytes or the end)."""
    h.send_response(200)
    h.send_header("Content-Type", "application/x-ndjson")
    h.send_header("Transfer-Encoding", "chunked")
    h.end_headers()
    try:
        for ev in events:
            if ev is None:  # a quiet process: stop reading it for a reader that went away
                if _peer_closed(h.connection):
                    h.close_connection = True
                    return
                continue
            line = json.dumps(ev).encode() + b"\n"
            h.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
            h.wfile.flush()
        h.wfile.write(b"0\r\n\r\n")
    except (BrokenPipeError, ConnectionResetError):
        h.close_connection = True  # the reader went away; the process goes on (POST .../signal stops it)


def _peer_closed(sock) -> bool:
    """The client closed its end (readable, and a peek reads nothing)."""
    import select
    import socket
    try:
        if not select.select([sock], [], [], 0)[0]:
            return False
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def _refusal_of(e: OSError, raw: str, op: str) -> Refused:
    """The answer for what the kernel said: a file standing where a directory should be is a
    missing path (a write: a bad one), EACCES/EPERM is 403, the rest is the server's failure."""
    what = f"{raw}: {e.strerror or e}"
    if isinstance(e, NotADirectoryError) or (isinstance(e, FileExistsError) and op == "write"):
        return Refused(400, "INVALID_ARGUMENT", what) if op == "write" else Refused(404, "NOT_FOUND", what)
    if isinstance(e, FileNotFoundError):
        return Refused(404, "NOT_FOUND", what)
    if isinstance(e, PermissionError):
        return Refused(403, "PERMISSION_DENIED", what)
    return Refused(500, "INTERNAL", what)


def _file_part(ctype: str, rfile, length: int):
    """The `file` part of a multipart/form-data body (the standard accepts one besides raw bytes):
    parsed in memory, so bounded by MULTIPART_MAX; raw bytes stream to disk at any size."""
    if length > MULTIPART_MAX:
        raise Refused(413, "INVALID_ARGUMENT", f"a multipart upload is at most {MULTIPART_MAX} bytes: send larger "
                      "files as raw bytes (application/octet-stream)")
    import email.parser
    import email.policy
    import io
    raw = rfile.read(length)
    msg = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
        b"Content-Type: " + ctype.encode("latin-1") + b"\r\n\r\n" + raw)
    for part in msg.iter_parts() if msg.is_multipart() else ():
        if part.get_param("name", header="content-disposition") == "file":
            content = part.get_payload(decode=True) or b""
            return io.BytesIO(content), len(content)
    raise Refused(400, "INVALID_ARGUMENT", "a multipart upload needs a part named 'file'")


def _send_file(h: Handler, f, size: int, head: bool) -> None:
    with f:
        h.send_response(200)
        h.send_header("Content-Type", "application/octet-stream")
        h.send_header("Content-Length", str(size))
        h.end_headers()
        left = 0 if head else size
        while left > 0:
            chunk = f.read(min(CHUNK, left))
            if not chunk:
                break
            h.wfile.write(chunk)
            left -= len(chunk)
        if left:  # the file shrank while it was sent: the client must not take a short body for the file
            h.close_connection = True


def server(addr: tuple[str, int], app: RestApp) -> http.server.ThreadingHTTPServer:
    import socket
    handler = type("SandboxdHandler", (Handler,), {"app": app})
    family = socket.AF_INET6 if ":" in addr[0] else socket.AF_INET
    cls = type("SandboxdHTTPServer", (http.server.ThreadingHTTPServer,), {"address_family": family})
    srv = cls(addr, handler)
    srv.daemon_threads = True
    return srv
