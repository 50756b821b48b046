"""Git: commands that destroy history or uncommitted work, each a named rule.

Agents lose work this way more than any other: a force push over the
remote's history, `reset --hard` or `checkout -- .` over uncommitted
changes, `clean -fdx`, a dropped stash, an expired reflog. Each rule below
names one such operation (rule id `git.<name>`). A role allows a rule by
listing its name in `governance.git_allow` (`"*"`: all of them); the
standard preset lists none, the regulated preset fixes the list empty.

`git` is read through its own wrappers: global options (`-C dir`,
`--git-dir`, `-c key=value`, ...) are skipped, and aliases given on the
command line (`-c alias.x='reset --hard' x`) are expanded; an alias that
runs a shell (`-c alias.x='!rm -rf /'`) and config keys whose value git runs
as a command (`core.pager`, `core.sshCommand`, ...) are analysed as shell
code by commands.py, so hardline sees them too. `env`, `sudo`, `sh -c`,
`xargs` ... are peeled off before this module looks (commands.unwrap).

Pure Python, no I/O.
"""

from __future__ import annotations

from .commands import Analysis, Exec, operands
from .model import Finding, GateContext, deny, ok

# Global options of git(1) that take a separate value.
GLOBAL_WITH_VALUE = frozenset({"-C", "-c", "--git-dir", "--work-tree", "--namespace", "--exec-path",
                               "--super-prefix", "--config-env", "--list-cmds", "--attr-source"})
# Config keys whose value git runs through the shell (git-config(1)).
SHELL_CONFIG = frozenset({"core.pager", "core.editor", "core.sshcommand", "core.fsmonitor", "sequence.editor",
                          "diff.external", "pager.log", "pager.diff", "pager.show", "gpg.program"})
# Branches whose history a force push must never replace (a repository's default branch;
# the remote's own default cannot be known from the text, these are the usual names).
DEFAULT_BRANCHES = frozenset({"main", "master", "trunk", "develop", "default", "production", "prod", "release"})

RULES = {
    "force_push": "a force push replaces the remote branch's history; commits only the remote had are lost",
    "reset_hard": "git reset --hard throws away every uncommitted change in the worktree and the index",
    "clean": "git clean -f deletes untracked files (with -x also ignored ones, with -d directories); "
             "they are in no commit and cannot be recovered",
    "discard_worktree": "discarding the worktree's changes (checkout/restore of a whole directory, checkout -f, "
                        "switch --discard-changes) throws away uncommitted work",
    "branch_force_delete": "git branch -D deletes a branch even when its commits are merged nowhere",
    "stash_drop": "dropping or clearing stashes deletes work that exists nowhere else",
    "history_rewrite": "filter-branch / filter-repo rewrite every commit of the repository's history",
    "reflog_expire": "expiring or deleting reflog entries now removes the record that recovers lost commits",
    "gc_prune": "pruning unreachable objects now deletes commits only the reflog or a dangling ref still held",
    "update_ref_delete": "git update-ref -d deletes a ref directly, without the safety checks of branch -d",
}


class GitCall:
    """One git invocation read through its global options and command-line aliases."""

    __slots__ = ("sub", "args", "config", "shell_alias")

    def __init__(self, sub: str, args: list[str], config: dict[str, str], shell_alias: str | None):
        self.sub = sub                    # the subcommand ("" when only global options)
        self.args = args                  # its arguments
        self.config = config              # -c key=value (keys lower-cased)
        self.shell_alias = shell_alias    # `!cmd` alias text with its arguments, to analyse as shell


def invocation(argv: list[str]) -> GitCall:
    """`git -C d -c alias.x='reset --hard' x HEAD` -> sub "reset", args ["--hard", "HEAD"]."""
    from .commands import split_words

    prog = argv[0].rsplit("/", 1)[-1].lstrip("\\") if argv else ""
    config: dict[str, str] = {}
    i = 1
    if prog.startswith("git-") and len(prog) > 4:  # git-filter-repo, git-reset: the subcommand's own binary
        return GitCall(prog[4:], list(argv[1:]), config, None)
    while i < len(argv):
        a = argv[i]
        if a == "-c" and i + 1 < len(argv):
            k, _, v = argv[i + 1].partition("=")
            config[k.lower()] = v
            i += 2
            continue
        if a.startswith("-c") and len(a) > 2 and not a.startswith("--"):
            k, _, v = a[2:].partition("=")
            config[k.lower()] = v
        elif a in GLOBAL_WITH_VALUE:
            i += 2
            continue
        elif not a.startswith("-"):
            break
        i += 1
    if i >= len(argv):
        return GitCall("", [], config, None)
    sub, args = argv[i], list(argv[i + 1:])
    for _ in range(8):  # an alias may name another alias; git refuses loops, we stop
        alias = config.get(f"alias.{sub.lower()}")
        if alias is None:
            break
        if alias.startswith("!"):
            import shlex
            return GitCall(sub, args, config, " ".join([alias[1:]] + [shlex.quote(a) for a in args]))
        words = split_words(alias)
        if not words:
            break
        sub, args = words[0], words[1:] + args
    return GitCall(sub, args, config, None)


def _short(args: list[str], letters: str) -> bool:
    """A short option cluster holds one of `letters` (`-fdx` holds f), before `--`."""
    for a in args:
        if a == "--":
            return False
        if a.startswith("-") and not a.startswith("--") and len(a) > 1 and any(c in a[1:] for c in letters):
            return True
    return False


def _long(args: list[str], *names: str) -> bool:
    for a in args:
        if a == "--":
            return False
        if a in names or a.split("=", 1)[0] in names:
            return True
    return False


def _value(args: list[str], name: str) -> str | None:
    for i, a in enumerate(args):
        if a == "--":
            break
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
        if a == name and i + 1 < len(args):
            return args[i + 1]
    return None


def _after_dashdash(args: list[str]) -> list[str] | None:
    return args[args.index("--") + 1:] if "--" in args else None


def _broad(pathspec: str) -> bool:
    """A pathspec that covers a whole tree: `.`, `:/`, `*`, a directory (`src/`)."""
    p = pathspec
    return (p in (".", "./", "..", "../", ":", ":/", "/", "*", "**", ":(top)", ":/*") or p.endswith("/")
            or any(c in p for c in "*?["))


_PUSH_VALUE = frozenset({"-o", "--push-option", "--receive-pack", "--exec", "--repo"})


def _push(args: list[str]) -> str:
    """Why this push is a force push, or ""."""
    if _short(args, "n") or _long(args, "--dry-run"):
        return ""  # nothing is sent
    if _short(args, "f") or _long(args, "--force", "--mirror"):
        return "force_push"
    pos = operands(args, _PUSH_VALUE)
    refspecs = pos[1:]
    if any(r.startswith("+") for r in refspecs):
        return "force_push"
    if _long(args, "--force-with-lease", "--force-if-includes"):
        # Safer (it refuses when the remote moved), and fine on a branch of one's own: only a
        # named non-default branch passes; without a refspec the current branch may be the default.
        if not refspecs:
            return "force_push"
        for r in refspecs:
            dst = r.rsplit(":", 1)[-1].removeprefix("refs/heads/")
            if not dst or dst in DEFAULT_BRANCHES or dst == "HEAD" or "$" in dst or "`" in dst:
                return "force_push"
    return ""


def rule_of(call: GitCall) -> str:
    """The RULES name this git call falls under, or ""."""
    sub, args = call.sub, call.args
    if sub == "push":
        return _push(args)
    if sub == "reset":
        return "reset_hard" if _long(args, "--hard") else ""
    if sub == "clean":
        dry = _short(args, "n") or _long(args, "--dry-run")
        return "clean" if (_short(args, "f") or _long(args, "--force")) and not dry else ""
    if sub == "checkout":
        if _short(args, "f") or _long(args, "--force"):
            return "discard_worktree"
        paths = _after_dashdash(args)
        if paths is None:
            pos = operands(args, frozenset({"-b", "-B", "--orphan", "--conflict", "--pathspec-from-file"}))
            paths = [p for p in pos if p in (".", "./", ":/", "*")]  # `git checkout .` without --
        return "discard_worktree" if any(_broad(p) for p in paths) else ""
    if sub == "restore":
        staged_only = (_short(args, "S") or _long(args, "--staged")) and not (
            _short(args, "W") or _long(args, "--worktree"))
        if staged_only:
            return ""  # only the index: the worktree keeps its changes
        pos = operands(args, frozenset({"-s", "--source", "--conflict", "--pathspec-from-file"}))
        return "discard_worktree" if any(_broad(p) for p in pos) else ""
    if sub == "switch":
        return "discard_worktree" if _short(args, "f") or _long(args, "--discard-changes", "--force") else ""
    if sub == "branch":
        if _short(args, "D"):
            return "branch_force_delete"
        if (_short(args, "d") or _long(args, "--delete")) and (_short(args, "f") or _long(args, "--force")):
            return "branch_force_delete"
        return ""
    if sub == "stash":
        pos = operands(args)
        return "stash_drop" if pos[:1] in (["drop"], ["clear"]) else ""
    if sub in ("filter-branch", "filter-repo"):
        return "history_rewrite"
    if sub == "reflog":
        pos = operands(args)
        if pos[:1] == ["delete"]:
            return "reflog_expire"
        if pos[:1] == ["expire"]:
            for key in ("--expire", "--expire-unreachable"):
                v = _value(args, key)
                if v is not None and v.lower() in ("now", "all", "0", "0.seconds.ago"):
                    return "reflog_expire"
        return ""
    if sub == "gc":
        v = _value(args, "--prune")
        return "gc_prune" if v is not None and v.lower() in ("now", "all", "0.seconds.ago") else ""
    if sub == "prune":
        dry = _short(args, "n") or _long(args, "--dry-run")
        v = _value(args, "--expire")
        return "gc_prune" if not dry and (v is None or v.lower() in ("now", "all")) else ""
    if sub == "update-ref":
        return "update_ref_delete" if _short(args, "d") else ""
    return ""


def hint(rule: str, ctx: GateContext) -> str:
    return (f"If role '{ctx.role}' should be able to do this, add {rule!r} to its governance.git_allow "
            f"(\"*\" allows every git rule; a role on the regulated preset cannot).")


def check(an: Analysis | None, ctx: GateContext) -> Finding:
    if an is None:
        return ok("git.pass")
    allowed = set(ctx.git_allow)
    for ex in an.execs:
        if ex.prog != "git" and not ex.prog.startswith("git-"):
            continue
        rule = rule_of(invocation(ex.argv))
        if rule and rule not in allowed and "*" not in allowed:
            return deny(f"git.{rule}", RULES[rule] + ".", hint(rule, ctx), ex.text or " ".join(ex.argv))
    return ok("git.pass")


def shell_code(ex: Exec) -> list[tuple[str, str]]:
    """(code, where) for what this git call runs through the shell: a `!` alias, or a config
    value git runs as a command (core.pager, core.sshCommand, ...)."""
    call = invocation(ex.argv)
    out = [(call.shell_alias, "git alias")] if call.shell_alias is not None else []
    return out + [(v, f"git -c {k}") for k, v in call.config.items() if k in SHELL_CONFIG and v]
