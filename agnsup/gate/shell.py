"""Shell text -> Analysis, with tree-sitter-bash.

Why tree-sitter-bash and not bashlex: see docs/governance.md (45x faster on
the corpora, parses `time`, quoted heredoc delimiters and empty input that
bashlex rejects, MIT licensed where bashlex is GPLv3+, and it recovers from
errors: a line with a syntax error still yields the commands around it, so
`rm -rf / (` is denied by hardline and flagged unparseable).

Besides the programs, the walker follows what the shell makes obvious
("plumbing"): constant assignments earlier on the line (`R=/; rm -rf $R`),
command substitutions of constants (`"$(echo /)"`), and what `echo`,
`printf` and `cat <<<` write into a pipe, a here-string or a process
substitution that a later command reads (`echo / | xargs rm -rf`,
`xargs -a <(echo /) rm -rf`). Anything else stays unknown, and the checks
say so (hardline.unknown_operand).

This module is imported only when there is shell text to judge.
"""

from __future__ import annotations

import codecs
import re

import tree_sitter
import tree_sitter_bash

from . import unreadable
from .model import Analysis, Exec, prog_name

_PARSER: tree_sitter.Parser | None = None
# Syntax nesting (statements inside substitutions inside strings ...) the walker
# follows; deeper text is not judged but refused (gate.unjudgeable), never a crash.
MAX_NESTING = 60
# Values of a `for` loop over literal words that are each judged (beyond: unknown).
MAX_FOR_VALUES = 8


def _parser() -> tree_sitter.Parser:
    global _PARSER
    if _PARSER is None:
        _PARSER = tree_sitter.Parser(tree_sitter.Language(tree_sitter_bash.language()))
    return _PARSER


_EXPANSIONS = frozenset({"simple_expansion", "expansion", "command_substitution", "process_substitution",
                         "arithmetic_expansion"})
_UNESCAPE = re.compile(r"\\(.)", re.S)
_DQ_UNESCAPE = re.compile(r"\\([\\$`\"\n])")
_WRITE_OPS = frozenset({">", ">>", ">|", "&>", "&>>", "<>"})
# Node types with nothing inside that could run (the walker skips them without a look).
_LEAVES = frozenset({"word", "raw_string", "string_content", "number", "variable_name", "comment", "ansi_c_string",
                     "file_descriptor", "heredoc_start", "heredoc_end", "special_variable_name", ";", "&&", "||",
                     "|", "&", "(", ")", "{", "}", "$", "=", '"', "do", "done", "then", "fi", "if", "else",
                     "in", "for", "while", "case", "esac", "test_operator", "regex", "extglob_pattern"})
_READ_OPS = frozenset({"<"})


def _text(n) -> str:
    return n.text.decode("utf-8", "replace")


def _dq(s: str) -> str:
    return _DQ_UNESCAPE.sub(lambda m: "" if m.group(1) == "\n" else m.group(1), s)


def word_value(n, w: "_Walker | None" = None) -> tuple[str, bool]:
    """The word after quote removal, and whether it is free of expansions.

    With a walker, variables it knows (constant assignments earlier on the
    line) and substitutions of constants are replaced by their values. Other
    expansions keep their source text (`$HOME`, `${TMPDIR:-/tmp}`) so the
    sandbox can still expand the few variables it knows.
    """
    t = n.type
    if t == "word":
        s = _text(n)
        return (_UNESCAPE.sub(lambda m: "" if m.group(1) == "\n" else m.group(1), s) if "\\" in s else s), True
    if t == "raw_string":
        return _text(n)[1:-1], True
    if t in ("string", "translated_string"):
        subs = [c for c in n.children if c.type in _EXPANSIONS]
        if not subs or w is None:
            s = _text(n)
            inner = s[2:-1] if t == "translated_string" else s[1:-1]
            return _dq(inner), not subs
        raw, base = n.text, n.start_byte
        pos = base + (2 if t == "translated_string" else 1)
        out, lit = [], True
        for c in subs:
            out.append(_dq(raw[pos - base:c.start_byte - base].decode("utf-8", "replace")))
            v, ok = word_value(c, w)
            out.append(v)
            lit = lit and ok
            pos = c.end_byte
        out.append(_dq(raw[pos - base:len(raw) - 1].decode("utf-8", "replace")))
        return "".join(out), lit
    if t == "ansi_c_string":
        s = _text(n)[2:-1]
        try:
            return codecs.decode(s.encode("latin-1", "backslashreplace"), "unicode_escape"), True
        except (UnicodeDecodeError, ValueError):
            return s, True
    if t == "concatenation":
        parts = [word_value(c, w) for c in n.children]
        return "".join(p for p, _ in parts), all(lit for _, lit in parts)
    if w is not None and t in ("simple_expansion", "expansion", "command_substitution"):
        v = w.substitution(n) if t == "command_substitution" else w.variable(n)
        if v is not None:
            return v, True
    return _text(n), t not in _EXPANSIONS


# --- what echo / printf / cat print ------------------------------------------------

_ECHO_ESC = re.compile(r"\\(0[0-7]{0,3}|x[0-9a-fA-F]{1,2}|[abefnrtv\\c])")
_ECHO_MAP = {"a": "\a", "b": "\b", "e": "\x1b", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v", "\\": "\\"}
_PRINTF_SPEC = re.compile(r"%(%|[-+ #0]*\d*(?:\.\d+)?([sbdiuc]))")


def _escapes(s: str) -> str | None:
    """echo -e / printf escapes; None when `\\c` cuts the output (kept simple: unknown)."""
    def sub(m: re.Match) -> str:
        e = m.group(1)
        if e == "c":
            raise ValueError
        if e[0] == "0":
            return chr(int(e[1:] or "0", 8))
        if e[0] == "x":
            return chr(int(e[1:], 16))
        return _ECHO_MAP[e]
    try:
        return _ECHO_ESC.sub(sub, s)
    except ValueError:
        return None


def echo_output(args: list[str]) -> str | None:
    """What bash's builtin echo writes (options -n, -e, -E)."""
    newline, esc, i = True, False, 0
    while i < len(args) and len(args[i]) > 1 and args[i][0] == "-" and set(args[i][1:]) <= set("neE"):
        newline = newline and "n" not in args[i]
        esc = ("e" in args[i]) or (esc and "E" not in args[i])
        i += 1
    s = " ".join(args[i:])
    if esc:
        s = _escapes(s)
        if s is None:
            return None
    return s + ("\n" if newline else "")


def printf_output(args: list[str]) -> str | None:
    """What printf FORMAT ARGS writes, for the conversions %s %b %d %i %u %c %% (bash reuses the
    format while arguments remain); None for anything else (-v VAR, %x, %f, ...)."""
    if not args or args[0].startswith("-"):
        return None
    fmt, rest = args[0], list(args[1:])
    out: list[str] = []
    for _round in range(64):
        used, pos = 0, 0
        for m in _PRINTF_SPEC.finditer(fmt):
            lit = _escapes(fmt[pos:m.start()].replace("%%", "%"))
            if lit is None:
                return None
            out.append(lit)
            pos = m.end()
            if m.group(1) == "%":
                out.append("%")
                continue
            a = rest.pop(0) if rest else ""
            used += 1
            conv = m.group(2)
            if conv in "diu":
                try:
                    a = str(int(a or "0", 0))
                except ValueError:
                    return None
            elif conv == "c":
                a = a[:1]
            elif conv == "b":
                a = _escapes(a)
                if a is None:
                    return None
            out.append(a)
        if "%" in fmt[pos:].replace("%%", ""):
            return None  # a conversion this reader does not know
        tail = _escapes(fmt[pos:].replace("%%", "%"))
        if tail is None:
            return None
        out.append(tail)
        if not rest or not used:
            return "".join(out)
    return None


class _Walker:
    def __init__(self, an: Analysis, depth: int, unwrap):
        self.an = an
        self.unwrap = unwrap  # commands.unwrap: each command found goes back to it
        self.depth = depth
        self.cwd: str | None = None
        self.next_loop = 0
        # Variables assigned earlier on the line: value, or None when assigned something unknown.
        self.vars: dict[str, str | None] = {}
        # Text of process substitutions (`<(echo /)`) whose output is a constant -> that output.
        self.psubs: dict[str, str] = {}
        self.nesting = 0

    def _deeper(self, n) -> bool:
        """Count one more level of nesting; False (and unjudgeable) past MAX_NESTING."""
        if self.nesting >= MAX_NESTING:
            if not self.an.unjudgeable:
                line, col = n.start_point
                self.an.unjudgeable.append(f"the shell text nests more than {MAX_NESTING} levels deep "
                                           f"(line {line + 1}, column {col + 1}), deeper than the gate follows")
            return False
        self.nesting += 1
        return True

    # -- values -------------------------------------------------------------
    def variable(self, n) -> str | None:
        """`$R`, `${R}`, `${R:-x}` for a variable assigned a constant earlier on the line."""
        kids = [c for c in n.children if c.type not in ("$", "${", "}")]
        if not kids or kids[0].type != "variable_name":
            return None
        value = self.vars.get(_text(kids[0]))
        if len(kids) == 1 or value is None:
            return value
        op = kids[1].type if not kids[1].is_named else ""
        if op not in (":-", "-", ":=", "=", ":?", "?") or len(kids) > 3:
            return None  # ${R/a/b}, ${R#x}, ...: not followed
        if value or op in ("-", "=", "?"):
            return value
        if op in (":-", ":=") and len(kids) == 3:
            v, lit = word_value(kids[2], self)
            return v if lit else None
        return None

    def substitution(self, n) -> str | None:
        """The output of `$(...)` / `` `...` `` when it is a constant (trailing newlines removed)."""
        body = [c for c in n.children if c.is_named]
        if len(body) != 1 or not self._deeper(n):
            return None
        try:
            out = self.output(body[0], None)
        finally:
            self.nesting -= 1
        return out.rstrip("\n") if out is not None else None

    def output(self, n, pipe_in: str | None) -> str | None:
        """What a statement writes to stdout, when the line makes it obvious: echo, printf,
        cat of a here-string / heredoc / pipe, `true`; None when it is not known."""
        stdin = pipe_in
        if n.type == "redirected_statement":
            body = n.child_by_field_name("body")
            for c in n.children:
                if c.type == "file_redirect":
                    return "" if any(k.type in _WRITE_OPS for k in c.children) and body is not None else None
                if c.type == "herestring_redirect":
                    arg = next((k for k in c.children if k.is_named), None)
                    stdin = word_value(arg, self)[0] + "\n" if arg is not None else None
                elif c.type == "heredoc_redirect":  # `cat <<EOF | python3 -`: the heredoc is what cat writes
                    hd = next((k for k in c.children if k.type == "heredoc_body"), None)
                    if hd is None:
                        return None
                    stdin = _text(hd)
                    if any(k.type == "<<-" for k in c.children):
                        stdin = "\n".join(line.lstrip("\t") for line in stdin.split("\n"))
            n = body
        if n is None or n.type != "command":
            return None
        words: list[str] = []
        for i, c in enumerate(n.children):
            if c.type == "command_name" or n.field_name_for_child(i) == "argument":
                v, lit = word_value(c.children[0] if c.type == "command_name" and c.children else c, self)
                if not lit:
                    return None
                words.append(v)
            elif c.type == "herestring_redirect":
                arg = next((k for k in c.children if k.is_named), None)
                stdin = word_value(arg, self)[0] + "\n" if arg is not None else None
            elif c.type in ("file_redirect", "heredoc_redirect", "variable_assignment"):
                return None
        if not words:
            return None
        prog = prog_name(words[0])
        if prog == "echo":
            return echo_output(words[1:])
        if prog == "printf":
            return printf_output(words[1:])
        if prog == "cat" and all(a == "-" for a in words[1:]):
            return stdin
        if prog in ("true", ":"):
            return ""
        if prog == "tee":
            return stdin  # tee passes what it reads on
        return None

    def assign(self, n) -> None:
        """`R=/` (or `export R=/`) as a statement: later `$R` on the line is `/`."""
        name = n.child_by_field_name("name")
        if name is None or name.type != "variable_name":
            return
        value = n.child_by_field_name("value")
        append = any(c.type == "+=" for c in n.children)
        key = _text(name)
        if value is None:
            v, lit = "", True
        elif value.type == "array":
            v, lit = "", False
        else:
            v, lit = word_value(value, self)
        if append:
            old = self.vars.get(key)
            self.vars[key] = old + v if (lit and old is not None) else None
        else:
            self.vars[key] = v if lit else None

    # -- statements ---------------------------------------------------------
    def visit(self, n, bg: bool = False, loop: int | None = None, pipe_in: str | None = None) -> None:
        if not self._deeper(n):
            return  # too deep: _deeper recorded why the rest is not judged
        try:
            self._visit(n, bg, loop, pipe_in)
        finally:
            self.nesting -= 1

    def _visit(self, n, bg, loop, pipe_in) -> None:
        t = n.type
        if t in _LEAVES:
            return
        if t == "command":
            self.command(n, [], bg, loop, pipe_in)
        elif t == "redirected_statement":
            body = n.child_by_field_name("body")
            redirects, stdin = self.redirects(n, bg, loop)
            if body is not None and body.type == "command":
                self.command(body, redirects, bg, loop, stdin if stdin is not None else pipe_in,
                             text=_text(n)[:200])
            else:
                if redirects:
                    self.an.execs.append(Exec([":"], [True], (), redirects, bg, loop, self.cwd, _text(n)[:200]))
                if body is not None:  # a loop gets what it reads: `while read d; do ...; done < <(echo /)`
                    self.visit(body, bg, loop, stdin if body.type == "while_statement" else None)
            # tree-sitter-bash hangs what follows a heredoc's start on its line (`cat <<EOF | python3 -`,
            # `cat <<EOF && rm -rf /`) inside the heredoc_redirect: a pipe there reads what the statement writes.
            for c in (n.children if stdin is not None else ()):  # only a heredoc or here-string sets stdin
                if c.type == "heredoc_redirect":
                    for k in c.children:
                        if k.is_named and k.type not in ("heredoc_start", "heredoc_body", "heredoc_end", "word",
                                                         "file_redirect", "herestring_redirect"):
                            self.visit(k, bg, loop, self.output(n, None) if k.type == "pipeline" else None)
        elif t == "pipeline":
            prev: str | None = pipe_in
            kids = n.children
            first = len(self.an.execs)
            for i, c in enumerate(kids):
                if not c.is_named:
                    continue
                cbg = bg or (i + 1 < len(kids) and kids[i + 1].type == "&")
                before = len(self.an.execs)
                self.visit(c, cbg, loop, prev)
                if prev is None and before > first:  # `... | base64 -d | sh`: code the line does not show
                    unreadable.piped(self.an, self.an.execs[first:before], self.an.execs[before:], _text(n)[:200])
                prev = self.output(c, prev)
        elif t == "list" and pipe_in is not None:  # `cat <<EOF | python3 - && x`: the pipe feeds the first
            kids = [c for c in n.children if c.is_named]
            for i, c in enumerate(kids):
                self.visit(c, bg, loop, pipe_in if i == 0 else None)
        elif t == "variable_assignment":
            self._children(n, bg, loop)
            self.assign(n)
        elif t == "declaration_command":
            self._children(n, bg, loop)
            for c in n.children:
                if c.type == "variable_assignment":
                    self.assign(c)
                elif c.type == "variable_name":
                    self.vars.setdefault(_text(c), None)
        elif t == "unset_command":
            for c in n.children:
                if c.type == "variable_name":
                    self.vars[_text(c)] = ""
        elif t == "for_statement":
            self.for_loop(n, bg, loop)
        elif t == "function_definition":
            self.function(n, bg, loop)
        elif t in ("while_statement", "until_statement"):
            self.while_loop(n, bg, loop, pipe_in)
        elif t == "process_substitution":
            self._children(n, bg, loop)
            body = [c for c in n.children if c.is_named]
            if len(body) == 1:
                out = self.output(body[0], None)
                if out is not None:
                    self.psubs[_text(n)] = out
        else:
            self._children(n, bg, loop)

    def _children(self, n, bg, loop) -> None:
        kids = n.children
        for i, c in enumerate(kids):
            cbg = bg or (i + 1 < len(kids) and kids[i + 1].type == "&")
            self.visit(c, cbg, loop)

    def redirects(self, n, bg, loop) -> tuple[list[tuple[str, str, bool]], str | None]:
        out: list[tuple[str, str, bool]] = []
        stdin: str | None = None
        for c in n.children:
            if c.type == "file_redirect":
                op = next((k.type for k in c.children if not k.is_named), "")
                dest = c.child_by_field_name("destination")
                if dest is not None:
                    if dest.type in ("number",) and op in (">&", "<&"):
                        continue  # fd duplication, not a file
                    val, lit = word_value(dest, self)
                    if op == ">&" and val == "-":
                        continue
                    out.append((op, val, lit))
                    self.visit(dest, bg, loop)
                    if op == "<" and dest.type == "process_substitution" and val in self.psubs:
                        stdin = self.psubs[val]  # `xargs rm -rf < <(echo /)`: the line shows what it reads
            elif c.type == "heredoc_redirect":
                body = next((k for k in c.children if k.type == "heredoc_body"), None)
                start = next((k for k in c.children if k.type == "heredoc_start"), None)
                text = _text(body) if body is not None else ""
                if any(k.type == "<<-" for k in c.children):
                    text = "\n".join(line.lstrip("\t") for line in text.split("\n"))
                stdin = text
                quoted = start is not None and _text(start)[:1] in ("'", '"', "\\")
                if body is not None and not quoted:
                    self.visit(body, bg, loop)  # $(...) in an unquoted heredoc runs
            elif c.type == "herestring_redirect":
                arg = next((k for k in c.children if k.is_named), None)
                if arg is not None:
                    stdin = word_value(arg, self)[0] + "\n"
                    self.visit(arg, bg, loop)
        return out, stdin

    def command(self, n, redirects, bg, loop, stdin: str | None = None, text: str = "") -> None:
        words: list[str] = []
        lits: list[bool] = []
        own_redirects, own_stdin = self.redirects(n, bg, loop)
        redirects = redirects + own_redirects
        stdin = own_stdin if own_stdin is not None else stdin
        for i, c in enumerate(n.children):
            if c.type == "command_name":
                w = c.children[0] if c.children else c
                v, lit = word_value(w, self)
                words.append(v)
                lits.append(lit)
                self.visit(w, bg, loop)
            elif n.field_name_for_child(i) == "argument":
                v, lit = word_value(c, self)
                if lit and c.type in ("simple_expansion", "expansion") and any(ch in v for ch in " \t\n"):
                    parts = v.split()  # an unquoted known variable splits into words
                    words.extend(parts)
                    lits.extend([True] * len(parts))
                else:
                    words.append(v)
                    lits.append(lit)
                self.visit(c, bg, loop)
            elif c.type == "variable_assignment":
                self._children(c, bg, loop)  # `R=/ cmd`: the value's substitutions run; R is not set for later
        text = text or _text(n)[:200]
        if not words:
            if redirects:
                self.an.execs.append(Exec([":"], [True], (), redirects, bg, loop, self.cwd, text))
            return
        before = len(self.an.execs)
        self.unwrap(words, lits, self.an, self.depth, redirects=redirects, background=bg, loop=loop,
               cwd=self.cwd, text=text, stdin_code=stdin, files=self.psubs)
        for ex in self.an.execs[before:]:
            if ex.prog in ("cd", "pushd"):
                self.chdir(ex)
            elif ex.prog == "read":
                for a in ex.args:
                    if not a.startswith("-"):
                        self.vars[a] = None

    def chdir(self, ex: Exec) -> None:
        args = [a for a in ex.args if not a.startswith("-")]
        if not args:
            self.cwd = "~"
        elif not ex.literal[-1] or args[0] == "-":
            self.cwd = "\0unknown"
        elif args[0].startswith(("/", "~")) or self.cwd is None:
            self.cwd = args[0]
        else:
            self.cwd = self.cwd.rstrip("/") + "/" + args[0]

    def for_loop(self, n, bg, loop) -> None:
        var = n.child_by_field_name("variable")
        body = n.child_by_field_name("body")
        values = [c for i, c in enumerate(n.children) if n.field_name_for_child(i) == "value"]
        if var is None or body is None:
            self._children(n, bg, loop)
            return
        name = _text(var)
        for c in values:
            self.visit(c, bg, loop)
        words = [word_value(c, self) for c in values]
        known = [v for v, lit in words if lit]
        # the body is judged once per value when all are known (and few), else once with the variable unknown
        for v in known if values and len(known) == len(values) <= MAX_FOR_VALUES else [None]:
            self.vars[name] = v
            self.visit(body, bg, loop)

    def function(self, n, bg, loop) -> None:
        name_node = n.child_by_field_name("name")
        body = n.child_by_field_name("body")
        if name_node is not None and body is not None:
            name = _text(name_node)
            calls_self = any(_cmd_name(c) == name for c in _descendants(body, "command"))
            spawns = any(c.type in ("&", "pipeline") for c in _descendants_any(body))
            if calls_self and spawns:
                self.an.fork_bomb = self.an.fork_bomb or _text(n)[:200]
            self.visit(body, bg, loop)

    def while_loop(self, n, bg, loop, stdin: str | None = None) -> None:
        cond = [c for i, c in enumerate(n.children) if n.field_name_for_child(i) == "condition" and c.is_named]
        body = n.child_by_field_name("body")
        if stdin is not None and body is not None and n.type == "while_statement":
            if self.read_loop(cond, body, bg, loop, stdin):
                return
        forever = False
        if len(cond) == 1 and cond[0].type == "command":
            name = _cmd_name(cond[0])
            forever = (name in ("true", ":") if n.type == "while_statement" else name == "false")
            forever = forever and len([c for c in cond[0].children if c.is_named]) == 1
        if forever and body is not None:
            exits = any(_cmd_name(c) in ("break", "exit", "return") for c in _descendants(body, "command"))
            if not exits:
                self.next_loop += 1
                lid = self.depth * 1000 + self.next_loop
                self.an.loops[lid] = any(c.type == "&" for c in _descendants_any(body))
                for c in cond:
                    self.visit(c, bg, lid)
                self.visit(body, bg, lid)
                return
        self._children(n, bg, loop)

    def read_loop(self, cond, body, bg, loop, stdin: str) -> bool:
        """`while read [-r] VAR...; do BODY; done` over known lines (a here-string, `< <(echo /)`, `echo / |`):
        the body is judged once per line (at most MAX_FOR_VALUES) with the variables set as read(1) sets them."""
        if len(cond) != 1 or cond[0].type != "command" or _cmd_name(cond[0]) != "read":
            return False
        words = [word_value(c)[0] for i, c in enumerate(cond[0].children)
                 if cond[0].field_name_for_child(i) == "argument"]
        if any(w.startswith("-") and w != "-r" for w in words):
            return False  # -d, -a, -n ...: read differently
        names = [w for w in words if w != "-r"] or ["REPLY"]
        lines = [x for x in stdin.split("\n") if x.strip()]
        if not lines or len(lines) > MAX_FOR_VALUES:
            return False
        for line in lines:
            parts = line.split(None, len(names) - 1) if names != ["REPLY"] else [line]
            for k, name in enumerate(names):
                self.vars[name] = parts[k] if k < len(parts) else ""
            self.visit(body, bg, loop)
        return True


def _cmd_name(cmd) -> str:
    for c in cmd.children:
        if c.type == "command_name":
            return prog_name(word_value(c.children[0] if c.children else c)[0])
    return ""


def _descendants_any(n):
    stack = list(n.children)
    while stack:
        c = stack.pop()
        yield c
        stack.extend(c.children)


def _descendants(n, typ):
    return (c for c in _descendants_any(n) if c.type == typ)


def _error_location(root, text: str) -> str:
    for c in _descendants_any(root):
        if c.type == "ERROR" or c.is_missing:
            line, col = c.start_point
            near = text.encode("utf-8", "surrogatepass")[c.start_byte:c.start_byte + 20].decode("utf-8", "replace")
            return f"line {line + 1}, column {col + 1}" + (f" near {near!r}" if near.strip() else "")
    return "end of input"


def analyze(text: str, depth: int, unwrap) -> Analysis:
    an = Analysis(parsed_shell=True)
    if not text.strip():
        return an
    root = _parser().parse(text.encode("utf-8", "surrogatepass")).root_node
    if root.has_error:
        an.unparseable.append(f"the shell text does not parse ({_error_location(root, text)})")
    _Walker(an, depth, unwrap).visit(root)
    return an
