"""Shell text -> Analysis, with tree-sitter-bash.

Why tree-sitter-bash and not bashlex: see docs/governance.md (45x faster on
the corpora, parses `time`, quoted heredoc delimiters and empty input that
bashlex rejects, MIT licensed where bashlex is GPLv3+, and it recovers from
errors: a line with a syntax error still yields the commands around it, so
`rm -rf / (` is denied by hardline and flagged unparseable).

This module is imported only when there is shell text to judge.
"""

from __future__ import annotations

import codecs
import re

import tree_sitter
import tree_sitter_bash

from .commands import Analysis, Exec, prog_name, unwrap

_PARSER: tree_sitter.Parser | None = None


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
_READ_OPS = frozenset({"<"})


def _text(n) -> str:
    return n.text.decode("utf-8", "replace")


def word_value(n) -> tuple[str, bool]:
    """The word after quote removal, and whether it is free of expansions.

    Expansions keep their source text (`$HOME`, `${TMPDIR:-/tmp}`) so the
    sandbox can still expand the few variables it knows.
    """
    t = n.type
    if t == "word":
        s = _text(n)
        return (_UNESCAPE.sub(lambda m: "" if m.group(1) == "\n" else m.group(1), s) if "\\" in s else s), True
    if t == "raw_string":
        return _text(n)[1:-1], True
    if t in ("string", "translated_string"):
        s = _text(n)
        inner = s[2:-1] if t == "translated_string" else s[1:-1]
        lit = not any(c.type in _EXPANSIONS for c in n.children)
        return _DQ_UNESCAPE.sub(lambda m: "" if m.group(1) == "\n" else m.group(1), inner), lit
    if t == "ansi_c_string":
        s = _text(n)[2:-1]
        try:
            return codecs.decode(s.encode("latin-1", "backslashreplace"), "unicode_escape"), True
        except (UnicodeDecodeError, ValueError):
            return s, True
    if t == "concatenation":
        parts = [word_value(c) for c in n.children]
        return "".join(p for p, _ in parts), all(lit for _, lit in parts)
    if t in _EXPANSIONS:
        return _text(n), False
    return _text(n), True


class _Walker:
    def __init__(self, an: Analysis, depth: int):
        self.an = an
        self.depth = depth
        self.cwd: str | None = None
        self.next_loop = 0

    # -- statements ---------------------------------------------------------
    def visit(self, n, bg: bool = False, loop: int | None = None) -> None:
        t = n.type
        if t == "command":
            self.command(n, [], bg, loop)
        elif t == "redirected_statement":
            body = n.child_by_field_name("body")
            redirects, stdin = self.redirects(n, bg, loop)
            if body is not None and body.type == "command":
                self.command(body, redirects, bg, loop, stdin, text=_text(n)[:200])
            else:
                if redirects:
                    self.an.execs.append(Exec([":"], [True], (), redirects, bg, loop, self.cwd, _text(n)[:200]))
                if body is not None:
                    self.visit(body, bg, loop)
        elif t == "function_definition":
            self.function(n, bg, loop)
        elif t in ("while_statement", "until_statement"):
            self.while_loop(n, bg, loop)
        elif t in ("heredoc_body",):
            for c in n.children:
                self.visit(c, bg, loop)
        else:
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
                    val, lit = word_value(dest)
                    if op == ">&" and val == "-":
                        continue
                    out.append((op, val, lit))
                    self.visit(dest, bg, loop)
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
                    stdin = word_value(arg)[0]
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
                v, lit = word_value(w)
                words.append(v)
                lits.append(lit)
                self.visit(w, bg, loop)
            elif n.field_name_for_child(i) == "argument":
                v, lit = word_value(c)
                words.append(v)
                lits.append(lit)
                self.visit(c, bg, loop)
            elif c.type == "variable_assignment":
                self.visit(c, bg, loop)
        text = text or _text(n)[:200]
        if not words:
            if redirects:
                self.an.execs.append(Exec([":"], [True], (), redirects, bg, loop, self.cwd, text))
            return
        before = len(self.an.execs)
        unwrap(words, lits, self.an, self.depth, redirects=redirects, background=bg, loop=loop,
               cwd=self.cwd, text=text, stdin_code=stdin)
        for ex in self.an.execs[before:]:
            if ex.prog in ("cd", "pushd"):
                self.chdir(ex)

    def chdir(self, ex: Exec) -> None:
        args = [a for a in ex.args if not a.startswith("-")]
        if not args:
            self.cwd = "~"
        elif not ex.literal[-1] or args[0] == "-":
            self.cwd = "\0unknown"
        elif args[0].startswith(("/", "~")) or self.cwd is None:
            self.cwd = args[0] if args[0].startswith(("/", "~")) else args[0]
        else:
            self.cwd = self.cwd.rstrip("/") + "/" + args[0]

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

    def while_loop(self, n, bg, loop) -> None:
        cond = [c for i, c in enumerate(n.children) if n.field_name_for_child(i) == "condition" and c.is_named]
        body = n.child_by_field_name("body")
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
        for c in n.children:
            self.visit(c, bg, loop)


def _index(parent, child) -> int:
    for i, c in enumerate(parent.children):
        if c.id == child.id:
            return i
    return -1


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
            near = text.encode()[c.start_byte:c.start_byte + 20].decode("utf-8", "replace")
            return f"line {line + 1}, column {col + 1}" + (f" near {near!r}" if near.strip() else "")
    return "end of input"


def analyze(text: str, depth: int = 0) -> Analysis:
    an = Analysis(parsed_shell=True)
    if not text.strip():
        return an
    root = _parser().parse(text.encode("utf-8", "surrogatepass")).root_node
    if root.has_error:
        an.unparseable.append(f"the shell text does not parse ({_error_location(root, text)})")
    _Walker(an, depth).visit(root)
    return an
