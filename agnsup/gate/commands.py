"""From a call to the programs it would run: unwrap wrappers, find nested code.

A process tool gives an argv; a shell tool gives text. Both end as an
`Analysis`: a flat list of `Exec` (one per program that would run, with its
words, redirections and where it sits) plus script-level findings (fork bomb,
infinite loops, text that did not parse).

Words are judged by position: only argv[0] after unwrapping is a program.
Wrappers (`sudo`, `env`, `timeout`, `xargs`, ...) are peeled off and kept in
`Exec.via`; `sh -c STRING`, `eval`, `find -exec`, heredocs fed to a shell and
`python -c` strings are analysed as the code they are.

Pure Python: the shell parser (shell.py, tree-sitter) is imported only when
there is shell text to parse, so `run_process(["true"])` never loads it.
"""

from __future__ import annotations

import functools
import re

from .model import MAX_DEPTH, Analysis, Exec, operands, prog_name, split_words
from .paths import LazyRe

SHELLS = frozenset({"sh", "bash", "zsh", "dash", "ksh", "mksh", "ash", "fish", "yash", "rbash"})

# wrapper -> options that take a separate value. The wrapper's own options are
# skipped, then the rest of the words are the wrapped command.
WRAPPERS: dict[str, frozenset[str]] = {
    "sudo": frozenset({"-u", "-g", "-h", "-p", "-C", "-D", "-r", "-t", "-U", "-T", "--user", "--group",
                       "--host", "--prompt", "--chdir", "--role", "--type", "--other-user",
                       "--close-from", "--command-timeout"}),
    "doas": frozenset({"-u", "-C"}),
    "pkexec": frozenset({"--user"}),
    "run0": frozenset({"-u", "--user", "-D", "--chdir", "--setenv"}),
    "runuser": frozenset({"-u", "-g", "-G", "--user", "--group"}),
    "env": frozenset({"-u", "--unset", "-C", "--chdir"}),
    "nice": frozenset({"-n", "--adjustment"}),
    "ionice": frozenset({"-c", "-n", "--class", "--classdata"}),
    "timeout": frozenset({"-s", "--signal", "-k", "--kill-after"}),
    "nohup": frozenset(),
    "command": frozenset(),
    "builtin": frozenset(),
    "exec": frozenset({"-a"}),
    "time": frozenset({"-f", "--format", "-o", "--output"}),
    "stdbuf": frozenset({"-i", "-o", "-e"}),
    "setsid": frozenset(),
    "unbuffer": frozenset(),
    "chroot": frozenset({"--userspec", "--groups"}),
    "flock": frozenset({"-w", "--timeout", "-E", "--conflict-exit-code"}),
    "taskset": frozenset(),
    "chrt": frozenset(),
    "faketime": frozenset({"-f"}),
    "torsocks": frozenset({"-a", "-P", "-u", "-p"}),
    "proxychains": frozenset({"-f"}),
    "proxychains4": frozenset({"-f"}),
    "strace": frozenset({"-o", "-e", "-p", "-s", "-u", "-E", "-a", "-b", "-I", "-O", "-S", "-X"}),
    "ltrace": frozenset({"-o", "-e", "-p", "-s", "-u", "-a", "-n"}),
    "unshare": frozenset({"-S", "-G", "--setuid", "--setgid", "-R", "--root", "-w", "--wd"}),
    "nsenter": frozenset({"-t", "--target", "-S", "-G", "-R", "-w"}),
    "systemd-run": frozenset({"-p", "--property", "-u", "--unit", "-E", "--setenv", "--uid", "--gid",
                              "--slice", "-M", "--machine", "--description", "--working-directory"}),
    "busybox": frozenset(),
    "catchsegv": frozenset(),
    "xargs": frozenset({"-I", "-n", "-P", "-L", "-s", "-d", "-E", "-a", "--arg-file", "--delimiter",
                        "--max-args", "--max-procs", "--max-lines", "--eof",
                        "--max-chars", "--process-slot-var"}),
    "watch": frozenset({"-n", "--interval", "-d", "-q", "--equexit"}),
    "doppler": frozenset(),  # "doppler run -- cmd" handled below
    # zsh precommand modifiers, moreutils, sandboxes and session helpers that run their arguments
    "noglob": frozenset(),
    "nocorrect": frozenset(),
    "chronic": frozenset(),
    "firejail": frozenset(),  # its options are --name or --name=value
    "systemd-inhibit": frozenset({"--what", "--who", "--why", "--mode"}),
    "caffeinate": frozenset({"-t", "-w"}),
    "xvfb-run": frozenset({"-n", "--server-num", "-s", "--server-args", "-f", "--auth-file", "-e", "--error-file",
                           "-p", "--xauth-protocol"}),
    "dbus-run-session": frozenset({"--config-file", "--dbus-daemon"}),
    "numactl": frozenset({"-N", "--cpunodebind", "-m", "--membind", "-C", "--physcpubind", "-i", "--interleave",
                          "-p", "--preferred"}),
    "prlimit": frozenset({"-p", "--pid"}),
    "setpriv": frozenset({"--reuid", "--regid", "--ruid", "--euid", "--rgid", "--egid", "--groups", "--inh-caps",
                          "--ambient-caps", "--bounding-set", "--securebits", "--selinux-label",
                          "--apparmor-profile"}),
    "cgexec": frozenset({"-g"}),
    "trickle": frozenset({"-d", "-u", "-w", "-t", "-l", "-n"}),
    "fakeroot": frozenset({"-l", "--lib", "--faked", "-i", "-s"}),
    "ssh-agent": frozenset({"-a", "-t", "-E", "-P", "-O"}),
    "eatmydata": frozenset(),
    "nocache": frozenset(),
    "valgrind": frozenset(),
    "chpst": frozenset({"-u", "-U", "-e", "-n", "-l", "-L", "-m", "-d", "-o", "-p", "-f", "-c", "-r", "-t"}),
    "runcon": frozenset({"-u", "-r", "-t", "-l", "--user", "--role", "--type", "--range"}),
}
# Project runners: `<runner> [global opts] run [opts] CMD...` runs CMD; the options that take a value.
RUNNERS: dict[str, frozenset[str]] = {
    "uv": frozenset({"--with", "--with-editable", "--with-requirements", "-w", "--python", "-p", "--project",
                     "--directory", "--env-file", "--extra", "--group", "--only-group", "--no-group", "--package",
                     "--index", "--index-url", "--default-index", "--extra-index-url", "-i", "--find-links", "-f",
                     "--config-file", "--cache-dir", "--python-preference", "--color", "--no-extra"}),
    "poetry": frozenset({"-C", "--directory", "-P", "--project"}),
    "pipenv": frozenset(), "pdm": frozenset({"-p", "--project"}), "rye": frozenset(),
    "conda": frozenset({"-n", "--name", "-p", "--prefix", "--cwd"}),
    "mamba": frozenset({"-n", "--name", "-p", "--prefix", "--cwd"}),
    "micromamba": frozenset({"-n", "--name", "-p", "--prefix", "--cwd"}),
    "pixi": frozenset({"-e", "--environment", "--manifest-path"}),
}
# Wrappers followed by a fixed number of positional words before the command.
WRAPPER_POSITIONALS = {"timeout": 1, "chroot": 1, "flock": 1, "taskset": 1, "chrt": 1, "faketime": 1}
# GNU parallel (and its `sem`): options that take a separate value.
PARALLEL_OPTS = frozenset({"-j", "--jobs", "-P", "--max-procs", "-S", "--sshlogin", "-a", "--arg-file", "-d",
                           "--delimiter", "-n", "--max-args", "-N", "-I", "--colsep", "-C", "--joblog", "--results",
                           "--res", "--tmpdir", "--timeout", "--delay", "--retries", "-L", "--max-lines", "-E",
                           "--workdir", "--wd", "--basefile", "--bf", "--return", "--transfer", "--sshloginfile",
                           "--slf", "--halt", "--memfree", "--load", "--nice", "--id", "--tag-string"})
PARALLEL_SOURCES = (":::", "::::", ":::+", "::::+")
# Destroyers that take their operands as arguments only: known stdin given to them is judged as operands.
_STDIN_BLIND = frozenset({"rm", "shred", "rmdir", "unlink"})
MAX_EXPANDED = 16  # items of xargs -I / parallel ::: judged one by one (beyond: the first ones)

INTERPRETERS = {
    # program prefix -> flags that introduce inline code
    "python": ("-c",), "pypy": ("-c",),
    "node": ("-e", "--eval", "-p", "--print"), "nodejs": ("-e", "--eval", "-p", "--print"),
    "bun": ("-e", "--eval"), "deno": ("eval",),
    "ruby": ("-e",), "perl": ("-e", "-E"), "php": ("-r",), "lua": ("-e",),
}
AWKS = frozenset({"awk", "gawk", "mawk", "nawk"})
# Programs that run a script operand, a `<` redirect or a -c/-e word as code (gate/unreadable.py code_words).
_CODE_READERS = SHELLS | {"busybox", "source", "."}
_CODE_PREFIXES = ("python", "pypy", "node", "perl", "ruby", "php", "lua", "deno", "bun", "pwsh", "powershell",
                  "tclsh", "Rscript")


def analyze_argv(argv: list[str], depth: int = 0) -> Analysis:
    """Analyse a process tool's argv (no shell involved unless argv runs one)."""
    an = Analysis()
    if argv:
        unwrap(list(argv), [True] * len(argv), an, depth=depth)
    return an


def analyze_shell(text: str, depth: int = 0) -> Analysis:
    """Analyse shell text with the real parser (imported here, lazily)."""
    from . import shell  # tree-sitter: only paid for when shell text exists

    return shell.analyze(text, depth, unwrap)  # the walker hands each command back to unwrap


def unwrap(words: list[str], literal: list[bool], an: Analysis, depth: int, *,
           redirects=None, background=False, loop=None, cwd=None, text="",
           stdin_code: str | None = None, files: dict[str, str] | None = None, via: tuple[str, ...] = ()) -> None:
    """Peel wrappers off `words` and add the resulting Exec(s) to `an`.

    `stdin_code`: what the command reads on stdin, when the line makes it
    obvious (a heredoc, a here-string, `echo ... |`); `files`: the output of
    process substitutions by their text (`<(echo /)`), for `xargs -a`."""
    via = list(via)
    from_stdin = False
    common = dict(redirects=redirects, background=background, loop=loop, cwd=cwd, text=text)
    while words:
        prog = prog_name(words[0])
        if not literal[0]:
            an.dynamic.append(words[0])
            if "$(" in words[0] or "`" in words[0]:  # `$(echo cm0g.. | base64 -d)` runs the decoded words
                from . import unreadable  # lazy, like inline and shell: a plain line never pays for it
                kind = unreadable.classify_text(words[0], depth, analyze_shell)
                if kind:
                    unreadable.record(an, kind, "a command word made at run time", text or words[0])
            break
        if prog == "command" and len(words) > 1 and words[1] in ("-v", "-V"):
            return  # `command -v git` looks a name up, runs nothing
        if prog == "coproc" and len(words) > 1:
            # coproc [NAME] { list; } / coproc cmd: tree-sitter-bash reads it as words
            k = 2 if words[1] == "{" else (3 if len(words) > 2 and words[2] == "{" else 1)
            via.append("coproc")
            words, literal = words[k:], literal[k:]
            continue
        if prog == "ip" and words[1:3] == ["netns", "exec"] and len(words) > 4:
            via.append("ip netns exec")
            words, literal = words[4:], literal[4:]
            continue
        if prog in ("parallel", "sem"):
            _parallel(words, literal, an, depth, via, stdin_code, common)
            return
        if prog == "sg" and len(words) > 2:
            code = words[3] if words[2] == "-c" and len(words) > 3 else " ".join(words[2:])
            _nested_shell_word(code, all(literal[2:]), an, depth, "sg")
            return
        k = next((i for i, w in enumerate(words[:-1]) if i and (w in ("-c", "--command") or (
            w[:1] == "-" and w[1:2] != "-" and w.endswith("c")))), 0) if prog == "script" else 0
        if k:  # script(1) -c CMD (also -qc CMD) runs CMD through the shell
            _nested_shell_word(words[k + 1], literal[k + 1], an, depth, "script -c")
            return
        if prog == "env" and len(words) > 1:
            # `env -S "a b"` splits its string into words (coreutils env(1)).
            for i, w in enumerate(words[1:], 1):
                if w in ("-S", "--split-string") and i + 1 < len(words):
                    spec, rest = words[i + 1], words[i + 2:]
                elif w.startswith("-S") and len(w) > 2:
                    spec, rest = w[2:], words[i + 1:]
                elif w.startswith("--split-string="):
                    spec, rest = w.split("=", 1)[1], words[i + 1:]
                else:
                    continue
                words = words[:1] + split_words(spec) + rest
                literal = [True] * len(words)
                break
        if prog in RUNNERS and "run" in words[1:4]:
            # `uv run python -c ...`, `poetry run pytest`: the project's environment runs the rest
            k = words.index("run", 1) + 1
            while k < len(words) and words[k].startswith("-"):
                if words[k] == "--":
                    k += 1
                    break
                k += 2 if words[k] in RUNNERS[prog] else 1
            if k < len(words):
                via.append(prog)
                words, literal = words[k:], literal[k:]
                continue
        if prog == "doppler" and len(words) > 2 and words[1] == "run" and "--" in words:
            k = words.index("--")
            via.append("doppler")
            words, literal = words[k + 1:], literal[k + 1:]
            continue
        if prog in WRAPPERS and prog != "doppler":
            k = _skip_wrapper(prog, words)
            via.append(prog)
            if prog == "xargs":
                items, replace = _xargs_items(words[1:k], stdin_code, files or {})
                stdin_code = None  # xargs gives the command /dev/null as stdin
                words, literal = (words[k:], literal[k:]) if k < len(words) else (["echo"], [True])
                if items is None:
                    from_stdin = True  # more operands arrive at run time
                elif replace:
                    for item in items[:MAX_EXPANDED]:
                        unwrap([w.replace(replace, item) for w in words], literal, an, depth, via=tuple(via),
                               **common)
                    return
                else:
                    words, literal = words + items, literal + [True] * len(items)
                continue
            if prog == "watch":
                # watch(1) runs its arguments through `sh -c`.
                rest = words[k:]
                if rest and all(literal[k:]):
                    _nested_shell(" ".join(rest), an, depth, "watch")
                return
            words, literal = words[k:], literal[k:]
            continue
        if prog in ("su", "runuser") and "-c" in words:
            k = words.index("-c")
            if k + 1 < len(words):
                _nested_shell_word(words[k + 1], literal[k + 1], an, depth, prog)
            return
        break
    if not words:
        # Only wrappers (`sudo`, `time`) or only redirections: keep redirections.
        if redirects:
            an.execs.append(Exec([":"], [True], tuple(via), list(redirects), background, loop, cwd, text))
        return
    ex = Exec(words, literal, tuple(via), list(redirects or []), background, loop, cwd, text, from_stdin)
    an.execs.append(ex)
    prog = ex.prog
    if prog in _STDIN_BLIND and stdin_code and not operands(words[1:]):
        # `rm -rf < <(echo /)`: rm reads no operands on stdin, so this deletes nothing; but the line asks for
        # `rm -rf /`, and no benign line feeds a destroyer's stdin: judge what it asks for.
        items = split_words(stdin_code)[:MAX_EXPANDED]
        if items:
            an.execs.append(Exec(words + items, literal + [True] * len(items), tuple(via), list(redirects or []),
                                 background, loop, cwd, text))
    _nested(ex, an, depth, stdin_code)
    if prog == "find":
        _find_exec(ex, an, depth)


def _xargs_items(opts: list[str], stdin: str | None, files: dict[str, str]) -> tuple[list[str] | None, str]:
    """What xargs(1) appends to its command: (items, replace string of -I), items None when unknown.

    Input is stdin, or the file of -a/--arg-file when the line shows its content
    (a process substitution of a constant). Split as xargs does: blanks and
    newlines with quotes (default), lines (-I), NUL (-0) or a delimiter (-d)."""
    src, delim, replace, i = stdin, None, "", 0
    while i < len(opts):
        o = opts[i]
        val = opts[i + 1] if i + 1 < len(opts) else ""
        if o in ("-a", "--arg-file", "--arg-file="):
            src, i = files.get(val), i + 1
        elif o.startswith("--arg-file="):
            src = files.get(o.split("=", 1)[1])
        elif o.startswith("-a") and not o.startswith("--"):
            src = files.get(o[2:])
        elif o in ("-0", "--null"):
            delim = "\0"
        elif o in ("-d", "--delimiter"):
            delim, i = _unescape_delim(val), i + 1
        elif o.startswith("--delimiter="):
            delim = _unescape_delim(o.split("=", 1)[1])
        elif o.startswith("-d") and not o.startswith("--"):
            delim = _unescape_delim(o[2:])
        elif o == "-I":
            replace, i = val, i + 1
        elif o.startswith("-I"):
            replace = o[2:]
        elif o in ("-i", "--replace"):
            replace = "{}"
        elif o.startswith(("-i", "--replace=")):
            replace = o.split("=", 1)[1] if "=" in o else o[2:]
        elif o in WRAPPERS["xargs"]:
            i += 1
        i += 1
    if src is None:
        return None, replace
    if delim:
        items = src.split(delim)
        if items and items[-1] in ("", "\n"):
            items.pop()
    elif replace:
        items = [line.lstrip() for line in src.split("\n") if line.strip()]
    else:
        items = split_words(src)
    return [x for x in items if x != ""], replace


def _unescape_delim(d: str) -> str:
    return {"\\n": "\n", "\\t": "\t", "\\0": "\0", "\\\\": "\\"}.get(d, d[:1])


def _parallel(words: list[str], literal: list[bool], an: Analysis, depth: int, via: list[str],
              stdin: str | None, common: dict) -> None:
    """GNU parallel / sem: `parallel [opts] cmd ::: args` runs `cmd arg` through the shell for each
    arg; with no command the args are the command lines; without ::: the args come from stdin (as xargs)."""
    i = 1
    while i < len(words) and words[i].startswith("-") and words[i] not in PARALLEL_SOURCES:
        if words[i] == "--":
            i += 1
            break
        i += 2 if words[i] in PARALLEL_OPTS else 1
    j = next((k for k in range(i, len(words)) if words[k] in PARALLEL_SOURCES), len(words))
    cmd, cmd_lit = words[i:j], literal[i:j]
    args = [w for w in words[j + 1:] if w not in PARALLEL_SOURCES] if j < len(words) else []
    if j == len(words):
        if cmd:  # arguments from stdin, like xargs
            unwrap(["xargs"] + cmd, [True] + cmd_lit, an, depth, via=tuple(via + ["parallel"]),
                   stdin_code=stdin, **common)
        return
    if not all(cmd_lit) or not all(literal[j + 1:]):
        an.dynamic.append(" ".join(words[i:]))
        an.flags.add("dynamic_code")
        return
    for a in args[:MAX_EXPANDED] or [""]:
        line = " ".join(cmd) if cmd else a
        if cmd and a:
            line = line.replace("{}", a) if "{}" in line else line + " " + a
        if line:
            _nested_shell(line, an, depth, "parallel")


def _skip_wrapper(prog: str, words: list[str]) -> int:
    opts = WRAPPERS[prog]
    positionals = WRAPPER_POSITIONALS.get(prog, 0)
    i = 1
    while i < len(words):
        w = words[i]
        if w == "--":
            return i + 1
        if w.startswith("-") and len(w) > 1:
            numeric = prog == "nice" and w[1:].lstrip("-").isdigit()  # `nice -5`: no value follows
            # an option that takes a value; `--opt=<(...)` is two words in the tree
            i += 2 if not numeric and (w in opts or (w.startswith("--") and w.endswith("="))) else 1
        elif prog in ("env", "sudo") and "=" in w:  # sudo(8) also takes VAR=value before the command
            i += 1
        elif positionals:
            positionals -= 1
            i += 1
        else:
            break
    return i


def _nested_shell(code: str, an: Analysis, depth: int, where: str, strict: bool = True) -> None:
    """Analyse `code` as shell. strict=False: the string was only guessed to be
    shell (a literal in interpreter code), so a parse error there is not ours."""
    if depth + 1 > MAX_DEPTH:
        an.unjudgeable.append(f"shell code nested more than {MAX_DEPTH} levels deep ({where}), deeper than the "
                              "gate follows")
        return
    sub = analyze_shell(code, depth + 1)
    if not strict:
        sub.unparseable = []
    an.merge(sub)


def _nested_shell_word(word: str, lit: bool, an: Analysis, depth: int, where: str) -> None:
    if lit:
        _nested_shell(word, an, depth, where)
    else:
        an.dynamic.append(word)
        an.flags.add("dynamic_code")
        from . import unreadable  # `sh -c "$(... | base64 -d)"`, `eval "$(curl ...)"`: what makes the code?
        kind = unreadable.classify_text(word, depth, analyze_shell)
        if kind:
            unreadable.record(an, kind, f"`{where}`", word)


@functools.lru_cache(maxsize=256)
def _interp_flags(prog: str) -> tuple[str, ...] | None:
    for name, flags in INTERPRETERS.items():
        if prog == name or (prog.startswith(name) and re.fullmatch(r"[\d.]*", prog[len(name):])):
            return flags
    return None


def _nested(ex: Exec, an: Analysis, depth: int, stdin_code: str | None) -> None:
    """Code inside this Exec's words: sh -c, eval, python -c, awk programs."""
    prog, argv, lit = ex.prog, ex.argv, ex.literal
    if (prog in _CODE_READERS or prog.startswith(_CODE_PREFIXES)) and (
            not all(lit) or prog.startswith(("pwsh", "powershell")) or any(not t for _o, _w, t in ex.redirects)):
        from . import unreadable  # `bash <(curl ..)`, `sh < <(.. | base64 -d)`, `python -c "$(curl ..)"`
        unreadable.expansion_words(ex, an, depth, analyze_shell)
        unreadable.powershell(ex, an)
    if prog == "git" or prog.startswith("git-"):
        # `-c alias.x='!cmd'`, `-c core.pager=cmd`: git runs these through sh
        if all(lit):
            from . import git  # only a line that runs git loads git's tables
            for code, where in git.shell_code(ex):
                _nested_shell(code, an, depth, where, strict=False)
        return
    if prog in SHELLS:
        for i in range(1, len(argv)):
            w = argv[i]
            if w == "--" or not w.startswith("-") or w.startswith("--"):
                if w.startswith("--") and w != "--":
                    continue
                break
            if "c" in w[1:] and not w.startswith("+"):
                # First operand after the option cluster is the command string.
                j = i + 1
                while j < len(argv) and argv[j].startswith("-") and argv[j] != "-":
                    j += 1
                if j < len(argv):
                    _nested_shell_word(argv[j], lit[j], an, depth, f"{prog} -c")
                return
        operands = [w for w in argv[1:] if not w.startswith("-")]
        if stdin_code is not None and (not operands or "-s" in argv):
            _nested_shell(stdin_code, an, depth, f"{prog} stdin")
        return
    if prog == "eval":
        _nested_shell_word(" ".join(argv[1:]), all(lit[1:]), an, depth, "eval")
        return
    flags = _interp_flags(prog)
    if flags is not None:
        for i in range(1, len(argv)):
            w = argv[i]
            code = None
            if w in flags and i + 1 < len(argv):
                code = argv[i + 1]
            elif any(w.startswith(f) and len(w) > len(f) and f.startswith("-") and not f.startswith("--")
                     for f in flags):
                code = w[2:]
            elif prog.startswith(("perl", "ruby")) and re.fullmatch(r"-[a-zA-Z]+[eE]", w) \
                    and w[1] not in "MmIrCdDx" and i + 1 < len(argv):
                code = argv[i + 1]  # perl -ne CODE, ruby -pe CODE: an option cluster ending in -e
            if code is not None:
                inline_code(code, an, depth, ex)
                return
            if not w.startswith("-"):
                break
        if stdin_code is not None and (len(argv) == 1 or "-" in argv[1:]):
            inline_code(stdin_code, an, depth, ex)
        return
    if prog in AWKS:
        for i in range(1, len(argv)):
            w = argv[i]
            if w in ("-f", "--file"):
                return
            if w in ("-v", "-F"):
                continue
            if not w.startswith("-") and (i == 1 or argv[i - 1] not in ("-v", "-F")):
                inline_code(w, an, depth, ex)
                return


def _find_exec(ex: Exec, an: Analysis, depth: int) -> None:
    argv = ex.argv
    i = 1
    while i < len(argv):
        if argv[i] in ("-exec", "-execdir", "-ok", "-okdir"):
            j = i + 1
            while j < len(argv) and argv[j] not in (";", "+", "\\;"):
                j += 1
            if j > i + 1:
                unwrap(argv[i + 1:j], ex.literal[i + 1:j], an, depth, cwd=ex.cwd, text=ex.text,
                       loop=ex.loop, background=ex.background)
            i = j
        i += 1


# --- inline interpreter code -------------------------------------------------

_STR = r"""(?:"((?:[^"\\]|\\.)*)"|'((?:[^'\\]|\\.)*)')"""
_SHELL_CALL = LazyRe(
    r"(?:\bsystem|\bexec(?:Sync)?|\bspawnSync|\bpopen|\bcheck_output|\bcheck_call|\bcall|\brun|\bPopen"
    r"|\bgetoutput|\bgetstatusoutput|\bqx|%x)\s*[({]\s*" + _STR)
_ARGV_CALL = LazyRe(r"(?:\bcheck_output|\bcheck_call|\bcall|\brun|\bPopen|\bexecv?p?e?|\bspawn(?:Sync)?"
                        r"|\bexecFileSync|\bexecFile)\s*\(\s*\[([^\]]*)\]")
_BACKTICK = LazyRe(r"`([^`]+)`")
_RECURSIVE_DELETE = LazyRe(
    r"(?:\brmtree|\brm_rf|\brm_r|\bremove_dir|\bremove_entry_secure|\brmSync|\brimraf|\bremove_tree|\brmdirSync)"
    r"\s*\(\s*(?:\[\s*)?" + _STR)
_FILE_DELETE = LazyRe(r"(?:\bos\.remove|\bos\.unlink|\bunlinkSync|\bFile\.delete|\bunlink|\bremove)\s*\(\s*" + _STR)
_FILE_WRITE = LazyRe(r"\bopen\s*\(\s*" + _STR + r"\s*,\s*[\"'][wa]")
_FORK_LOOP = LazyRe(r"\bfork\b")
_LOOP_WORD = LazyRe(r"\b(?:while|for|until|loop|iter)\b")
_NET_CODE = LazyRe(r"\b(?:socket|urllib|http\.client|requests|httpx|aiohttp|IO::Socket|Net::HTTP|LWP|"
                       r"net\.connect|net\.Socket|http\.get|https\.get|fetch|TCPSocket|fsockopen|curl_exec)\b")


def inline_code(code: str, an: Analysis, depth: int, ex: Exec) -> None:
    """Look into `python -c` (and friends) code for shell strings and deletions.

    Interpreter code is not parsed: a heuristic looks for string literals given
    to shell-running calls and to delete calls, and judges those. The kernel,
    not this text, is the guarantee (see docs/governance.md).
    """
    def lit(m: re.Match) -> str:
        return m.group(1) if m.group(1) is not None else m.group(2)

    start = len(an.execs)
    from . import unreadable  # `exec(bytes.fromhex(..))`, `eval(atob(..))`: code the program decodes or fetches
    unreadable.inline(code, an, ex)

    for m in _ARGV_CALL.finditer(code):
        words = [a or b for a, b in re.findall(_STR, m.group(1))]
        if words:
            unwrap(words, [True] * len(words), an, depth + 1, cwd=ex.cwd, text=ex.text or code)
    for m in _SHELL_CALL.finditer(code):
        _nested_shell(lit(m), an, depth, f"{ex.prog} code", strict=False)
    for m in _BACKTICK.finditer(code):
        _nested_shell(m.group(1), an, depth, f"{ex.prog} backticks", strict=False)
    for m in _RECURSIVE_DELETE.finditer(code):
        an.execs.append(Exec(["rm", "-rf", lit(m)], [True] * 3, ex.via, [], ex.background, ex.loop, ex.cwd,
                             ex.text or code))
    for m in _FILE_DELETE.finditer(code):
        an.execs.append(Exec(["rm", lit(m)], [True] * 2, ex.via, [], ex.background, ex.loop, ex.cwd,
                             ex.text or code))
    for m in _FILE_WRITE.finditer(code):
        an.execs.append(Exec([":"], [True], ex.via, [(">", lit(m), True)], ex.background, ex.loop, ex.cwd,
                             ex.text or code))
    if _FORK_LOOP.search(code) and _LOOP_WORD.search(code):
        an.fork_bomb = an.fork_bomb or (ex.text or code)
    if _NET_CODE.search(code):
        an.flags.add("network_in_code")
    from . import inline  # the program as a program: a credential read and a send in one breath
    inline.note(code, an, ex, an.execs[start:])
