"""Secrets that never enter a cell: declared by reference, resolved in the controller, put on the wire by its proxy.

A role (`[secrets.NAME]` in its policy file) or the runtime for one call (CLI `--secret`, the API's and
serve's `secrets`; never a model: not in any tool schema) names a secret by reference:

    [secrets.github]
    source = "env:GITHUB_TOKEN"     # env:NAME | file:/abs/path | command:/abs/prog ARG...
    env = "GITHUB_TOKEN"            # the cell variable that holds the placeholder (optional)
    hosts = ["api.github.com"]      # where it may go: HTTPS, port 443 unless host:PORT
    inject = "bearer"               # bearer | basic:USER | header:NAME | placeholder

The cell gets the placeholder `agnsup-secret:NAME`, never the value; the controller's egress proxy (egress/proxy.py)
terminates TLS for the listed hosts only and puts the value on requests to them (docs/isolation.md, "Secrets").

Pure, nothing heavy imported: loaded only when a cell has secrets. A value lives in a Secret, in the controller's
memory: no repr, message, CellSpec field, journal row or receipt holds it.
"""
from __future__ import annotations

import os
import re

from .errors import UsageError
from .util.record import Record

PLACEHOLDER_PREFIX = "agnsup-secret:"
NAME = re.compile(r"^[a-z0-9_-]{1,40}$")
KEYS = ("source", "env", "hosts", "inject")
INJECT = ("bearer", "basic:USER", "header:NAME", "placeholder")
SOURCES = ("env:NAME", "file:/abs/path", "command:/abs/prog ARG...")
COMMAND_TIMEOUT = 30.0  # seconds a command: source (a keyring helper) may take
MAX_VALUE = 64 * 1024
_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_HEADER = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")  # an HTTP token (RFC 9110)
_LABEL = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
# Headers the proxy owns or that frame the request: never a header:NAME injection.
_FRAMING = frozenset({"host", "content-length", "transfer-encoding", "connection", "upgrade", "te", "trailer",
                      "proxy-authorization", "proxy-connection", "keep-alive"})


class SecretRef(Record, frozen=True):
    """A secret by reference, parsed and checked: no value."""
    name: str
    source: str
    env: str | None
    hosts: tuple            # ((host, port), ...): HTTPS destinations
    inject: str             # bearer | basic:USER | header:NAME | placeholder
    where: str = ""         # where it was declared: "role ROLE" | "--secret" | "secrets" (the API, serve)

    @property
    def placeholder(self) -> str:
        return PLACEHOLDER_PREFIX + self.name

    def table(self) -> dict:
        """The declaration as plain data (the receipt's, the plan's): no value."""
        return {"name": self.name, "source": self.source, "env": self.env,
                "hosts": [host_text(h, p) for h, p in self.hosts], "inject": self.inject}


class Secret:
    """A resolved secret: its reference, its value (bytes) and its placeholder. Never printed."""
    __slots__ = ("ref", "value", "placeholder")

    def __init__(self, ref: SecretRef, value: bytes):
        self.ref, self.value, self.placeholder = ref, value, ref.placeholder

    def __repr__(self) -> str:
        return f"<Secret {self.ref.name} ({len(self.value)} bytes, from {self.ref.source.split(':', 1)[0]})>"

    __str__ = __repr__

    def __reduce__(self):  # never pickled, never copied across a process boundary
        raise TypeError("a Secret is never serialised")


def host_text(host: str, port: int) -> str:
    shown = f"[{host}]" if ":" in host else host
    return shown if port == 443 else f"{shown}:{port}"


def _bad(where: str, name: str, what: str) -> UsageError:
    return UsageError(f"{where}: secret {name!r}: {what}", what=what)


def parse_host(text, where: str = "secret", name: str = "?") -> tuple[str, int]:
    """'api.example.org', 'api.example.org:8443', '10.0.0.5', '[::1]:8443' -> (host, port)."""
    import ipaddress
    if not isinstance(text, str) or not text:
        raise _bad(where, name, f"hosts: {text!r} is not a host name")
    if "/" in text or "@" in text:
        raise _bad(where, name, f"hosts: {text!r} is not a host name (HOST or HOST:PORT: no scheme, user or path)")
    host, port = text, 443
    if text.startswith("["):
        end = text.find("]")
        if end < 0 or (text[end + 1:] and not text[end + 1:].startswith(":")):
            raise _bad(where, name, f"hosts: {text!r} is not a host")
        host, rest = text[1:end], text[end + 1:]
        if rest:
            port = _port(rest[1:], text, where, name)
    elif text.count(":") == 1:
        host, p = text.split(":")
        port = _port(p, text, where, name)
    host = host.lower().rstrip(".") if host else host
    try:
        return str(ipaddress.ip_address(host)), port
    except ValueError:
        pass
    if "*" in host:
        raise _bad(where, name, f"hosts: {text!r}: a secret goes to named hosts, never a wildcard")
    labels = host.split(".")
    if not host or len(host) > 253 or not all(_LABEL.match(lab) for lab in labels) or labels[-1].isdigit():
        raise _bad(where, name, f"hosts: {text!r} is not a host name (a DNS name, an IP address, "
                   "optionally :PORT)")
    return host, port


def _port(p: str, text: str, where: str, name: str) -> int:
    if not p.isdigit() or not 0 < int(p) < 65536:
        raise _bad(where, name, f"hosts: {text!r}: the port must be a number from 1 to 65535")
    return int(p)


def _source(src, where: str, name: str) -> str:
    if not isinstance(src, str) or not src:
        raise _bad(where, name, f"source is required ({' | '.join(SOURCES)})")
    kind, _, rest = src.partition(":")
    if kind == "env" and _ENV_KEY.match(rest):
        return src
    if kind == "file" and rest.startswith("/"):
        return src
    if kind == "command" and rest.startswith("/") and rest.split() and rest.split()[0].startswith("/"):
        return src
    raise _bad(where, name, f"source {src!r} is not one of {' | '.join(SOURCES)}")


def _inject(v, where: str, name: str) -> str:
    if v is None:
        return "bearer"
    if not isinstance(v, str):
        raise _bad(where, name, f"inject must be one of {', '.join(INJECT)}")
    kind, colon, arg = v.partition(":")
    if v in ("bearer", "placeholder"):
        return v
    if kind == "basic" and colon and arg and ":" not in arg and arg.isprintable() and arg.strip() == arg:
        return v
    if kind == "header" and colon and _HEADER.match(arg):
        if arg.lower() in _FRAMING:
            raise _bad(where, name, f"inject {v!r}: {arg} is a header the proxy owns")
        return v
    raise _bad(where, name, f"inject {v!r} is not one of {', '.join(INJECT)}")


def parse_table(name, table, where: str = "secrets") -> SecretRef:
    """A `[secrets.NAME]` table of a policy file, or one entry of a call's `secrets` object: a SecretRef, or a
    UsageError (one line, naming `where` and the secret; never a value: a table holds none)."""
    if not isinstance(name, str) or not NAME.match(name):
        raise UsageError(f"{where}: {name!r} is not a secret name (1-40 of a-z, 0-9, _ and -)")
    if not isinstance(table, dict):
        raise _bad(where, name, "must be a table of " + ", ".join(KEYS))
    extra = sorted(set(table) - set(KEYS))
    if extra:
        raise _bad(where, name, f"unknown key(s) {', '.join(map(str, extra))} (known: {', '.join(KEYS)})")
    source = _source(table.get("source"), where, name)
    env = table.get("env")
    if env is not None and (not isinstance(env, str) or not _ENV_KEY.match(env)):
        raise _bad(where, name, f"env {env!r} is not a variable name")
    if env is not None and (env == "PATH" or env.startswith("AGNSUP_")):
        raise _bad(where, name, f"env {env}: set by agnsup")
    hosts = table.get("hosts")
    if isinstance(hosts, str):
        hosts = [hosts]
    if not isinstance(hosts, (list, tuple)) or not hosts:
        raise _bad(where, name, "hosts is required: where the secret may go (a list of HOST or HOST:PORT, HTTPS)")
    parsed = tuple(dict.fromkeys(parse_host(h, where, name) for h in hosts))
    return SecretRef(name=name, source=source, env=env, hosts=parsed, inject=_inject(table.get("inject"), where, name),
                     where=where)


_FLAG_KEY = re.compile(r",(?=(?:" + "|".join(KEYS) + r")=)")


def parse_flag(text: str) -> SecretRef:
    """The CLI spelling: `NAME:KEY=VAL,KEY=VAL`, hosts separated by `+`, e.g.
    `github:source=env:GH,hosts=api.github.com+uploads.github.com:8443,inject=bearer,env=GITHUB_TOKEN`.
    A comma splits only before a known key (a command: source may hold commas)."""
    if not isinstance(text, str):
        raise UsageError(f"--secret {text!r}: expected NAME:KEY=VALUE,...")
    name, colon, rest = text.partition(":")
    if not colon or not rest:
        raise UsageError(f"--secret {text!r}: expected NAME:source=...,hosts=HOST+HOST,inject=...,env=VAR")
    table: dict = {}
    for part in _FLAG_KEY.split(rest):
        key, eq, value = part.partition("=")
        if not eq or key not in KEYS:
            raise UsageError(f"--secret {name}: {part!r} is not KEY=VALUE with KEY one of {', '.join(KEYS)}")
        if key in table:
            raise UsageError(f"--secret {name}: {key} given twice")
        table[key] = value.split("+") if key == "hosts" else value
    return parse_table(name, table, "--secret")


def refs_of(role_tables: dict | None, call, role: str) -> list[SecretRef]:
    """The cell's secrets: the role's ([secrets.NAME], validated at load) and the call's (a dict name -> table,
    or CLI `--secret` strings). A call may not shadow a role's secret (UsageError)."""
    refs = [parse_table(n, dict(t.items()), f"role {role}") for n, t in (role_tables or {}).items()]
    mine = {r.name for r in refs}
    extra: list[SecretRef] = []
    if isinstance(call, dict):
        extra = [parse_table(n, t if not isinstance(t, dict) else dict(t), "secrets") for n, t in call.items()]
    elif call:
        extra = [parse_flag(t) for t in call]
    seen: set = set()
    for r in extra:
        if r.name in mine:
            raise UsageError(f"{r.where}: secret {r.name!r} is the role {role}'s: a call may not replace it")
        if r.name in seen:
            raise UsageError(f"{r.where}: secret {r.name!r} given twice")
        seen.add(r.name)
    return refs + extra


def check(refs: list[SecretRef], mode: str, judge) -> None:
    """Where the secrets may go, against the role (before anything starts): the role's traffic must go through
    the proxy (`mode` allowlist or internal), each host must pass its lists as the proxy judges a name, with no
    DNS: `judge(host, port)` -> a netpolicy.Verdict (Rules.match of the destination), and no two secrets may set
    the same env variable."""
    if not refs:
        return
    if mode not in ("allowlist", "internal"):
        raise UsageError(f"secret {refs[0].name!r}: secrets go out through the egress proxy: use an allowlist role "
                         f"(this role's network.mode is {mode!r})")
    envs: dict = {}
    for r in refs:
        for host, port in r.hosts:
            v = judge(host, port)
            if not v.allowed:
                raise UsageError(f"{r.where}: secret {r.name!r} may go to {host_text(host, port)}, which the role "
                                 f"does not allow: {v.reason}")
        if r.env is not None:
            if r.env in envs:
                raise UsageError(f"secrets {envs[r.env]!r} and {r.name!r} both set {r.env}")
            envs[r.env] = r.name


def resolve(refs: list[SecretRef], env=None, run=None) -> list[Secret]:
    """Each secret's value from its source, in the controller: `env` is the environment env: reads (default
    os.environ; serve passes its client's) and a command: runs with; `run(argv, timeout, env)` -> (status,
    stdout, stderr) runs a command: source (process.helpers.run_helper). UsageError (one line, never the value)
    when a source is missing, unreadable, empty, or its command fails."""
    env = os.environ if env is None else env
    out = []
    for r in refs:
        kind, _, rest = r.source.partition(":")
        what = f"{r.where}: secret {r.name!r}: source {r.source}"
        if kind == "env":
            if rest not in env:
                raise UsageError(f"{what}: {rest} is not set in the controller's environment")
            value = os.fsencode(env[rest])
        elif kind == "file":
            try:
                with open(rest, "rb") as f:
                    value = f.read(MAX_VALUE + 1)
            except OSError as e:
                raise UsageError(f"{what}: cannot be read ({e.strerror})") from None
        else:
            value = _command(rest, what, env, run)
        value = value.rstrip(b"\r\n") if len(value) <= MAX_VALUE else None
        if value is None:
            raise UsageError(f"{what}: longer than {MAX_VALUE} bytes")
        if not value:
            raise UsageError(f"{what}: empty")
        if any(c < 0x20 or c == 0x7f for c in value):
            raise UsageError(f"{what}: holds a control character (a value goes into an HTTP header)")
        if PLACEHOLDER_PREFIX.encode() in value:
            raise UsageError(f"{what}: holds a placeholder")
        out.append(Secret(r, value))
    return out


def _command(text: str, what: str, env, run) -> bytes:
    import shlex
    try:
        argv = shlex.split(text)
    except ValueError as e:
        raise UsageError(f"{what}: not a command line ({e})") from None
    if not os.access(argv[0], os.X_OK) or os.path.isdir(argv[0]):
        raise UsageError(f"{what}: {argv[0]} is not an executable file")
    status, out, _err = run(argv, COMMAND_TIMEOUT, dict(env))
    if status != 0:  # its stderr is not quoted: a helper may print what it was asked for
        raise UsageError(f"{what}: exited {status}" + (f" or did not finish within {COMMAND_TIMEOUT:g} s"
                                                         if status == 127 else ""))
    return os.fsencode(out)


def cell_env(refs: list[SecretRef]) -> dict[str, str]:
    """The cell's placeholder variables (secret.env -> agnsup-secret:NAME)."""
    return {r.env: r.placeholder for r in refs if r.env}


def apply(spec, refs: list[SecretRef], cell_tmp: str) -> None:
    """Put the secrets on a CellSpec: the placeholders and the trust knobs in its environment (a per-call --env
    of the same name is refused), their references (no value) in spec.secrets. `cell_tmp`: the cell's /tmp."""
    placeholders = cell_env(refs)
    for k in placeholders:
        if spec.env_sources.get(k) == "call":
            raise UsageError(f"--env {k}: the secret {next(r.name for r in refs if r.env == k)!r} sets it "
                             "(to its placeholder)")
    bundle, cert = os.path.join(cell_tmp, CA_BUNDLE_REL), os.path.join(cell_tmp, CA_CERT_REL)
    for k, v in {**trust_env(bundle, cert), **placeholders}.items():
        spec.env[k], spec.env_sources[k] = v, "secret" if k in placeholders else "agnsup"
    spec.secrets = [r.table() for r in refs]


# The variables that point the cell's clients at the bundle holding the controller's CA (docs/isolation.md).
CA_ENV = ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "GIT_SSL_CAINFO", "PIP_CERT")
SYSTEM_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
CA_BUNDLE_REL = os.path.join(".agnsup", "ca", "ca-certificates.crt")  # in the cell's /tmp (its own dir)
CA_CERT_REL = os.path.join(".agnsup", "ca", "agnsup-ca.pem")


def trust_env(bundle: str, ca_cert: str) -> dict[str, str]:
    """The cell's trust knobs: every client's bundle variable at `bundle` (the system's + the controller CA),
    NODE_EXTRA_CA_CERTS at the CA alone, and Node's own fetch through the proxy variables (Node >= 22.21/24)."""
    return {**{k: bundle for k in CA_ENV}, "NODE_EXTRA_CA_CERTS": ca_cert, "NODE_USE_ENV_PROXY": "1"}


def bundle_text(ca_pem: bytes, system: str = SYSTEM_BUNDLE) -> bytes:
    """The cell's bundle: the host's system bundle (when present) and the controller CA's certificate."""
    try:
        with open(system, "rb") as f:
            base = f.read()
    except OSError:
        base = b""
    if base and not base.endswith(b"\n"):
        base += b"\n"
    return base + ca_pem


def redaction_rules(secrets: list[Secret]) -> list[tuple[str, str]]:
    """(rule id, value) the cell's returned output is redacted of (redact.py), longest value first."""
    rules = [(f"redact.secret.{s.ref.name}", s.value.decode(errors="replace")) for s in secrets]
    return sorted(rules, key=lambda r: len(r[1]), reverse=True)


# The values of the cells this controller started, by (run_id, cell_id), while it may still return their
# output (redact.for_receipt): memory only, dropped with the process (the oldest past _KEEP).
_LIVE: dict = {}
_KEEP = 4096


def remember(run_id: str, cell_id: str, secrets: list[Secret]) -> None:
    if secrets:
        _LIVE[(run_id, cell_id)] = list(secrets)
        while len(_LIVE) > _KEEP:
            _LIVE.pop(next(iter(_LIVE)))


def held(run_id: str, cell_id: str) -> list[Secret]:
    return list(_LIVE.get((run_id, cell_id), ()))


def forget(run_id: str, cell_id: str) -> None:
    _LIVE.pop((run_id, cell_id), None)
