"""Policy: the role's own allow and deny lists of programs, and text we cannot judge.

An entry is a program name ("curl") or a program with words that must all
appear among its arguments ("git push", "git reset --hard"). Wrappers count:
deny_commands=("sudo",) refuses `sudo ls`. With an allow list, every program
(and wrapper) must be on it, except shell builtins that run nothing.
"""

from __future__ import annotations

from .model import Analysis, Exec
from .model import Finding, GateContext, deny, ok

# A deny list presets may give executor-like roles: git operations that destroy
# work which exists nowhere else (uncommitted changes, stashes, remote history).
RECOMMENDED_DENY_COMMANDS = ("git reset --hard", "git clean -f", "git push --force", "git push -f",
                             "git stash drop", "git stash clear", "git branch -D", "git checkout --",
                             "git restore --worktree")

BUILTINS = frozenset({":", "cd", "pushd", "popd", "echo", "printf", "test", "[", "true", "false", "pwd", "export",
                      "set", "unset", "read", "shift", "local", "declare", "typeset", "return", "exit", "break",
                      "continue", "wait", "command", "builtin", "time", "exec", "type", "hash", "alias", "umask",
                      "readonly", "let", "getopts", "trap"})


def _matches(entry: str, ex: Exec) -> bool:
    words = entry.split()
    if not words or words[0] not in (ex.prog, *ex.via):
        return False
    # a program alone matches it as a wrapper too; the words after it, only among its own arguments
    return len(words) == 1 or (words[0] == ex.prog and all(any(_word_matches(w, a) for a in ex.args)
                                                           for w in words[1:]))


def _word_matches(w: str, a: str) -> bool:
    """"-f" matches "-fd"; "--force" matches "--force=true"."""
    if a == w:
        return True
    if len(w) == 2 and w[0] == "-" and w[1] != "-":
        return a.startswith("-") and not a.startswith("--") and w[1] in a[1:]
    return w.startswith("--") and a.startswith(w + "=")


def check(an: Analysis | None, ctx: GateContext) -> Finding:
    if an is None:
        return ok("policy.pass")
    allow = tuple(a for a in ctx.allow_commands if a)
    allow_all = not allow or "*" in allow
    for ex in an.execs:
        for entry in ctx.deny_commands:
            if entry and _matches(entry, ex):
                return deny("policy.deny_command", f"`{entry}` is on role '{ctx.role}''s deny_commands.",
                            f"Remove {entry!r} from the role's deny_commands if this role should run it.", ex.text)
        if not allow_all:
            for name in (ex.prog,) + ex.via:
                if name in BUILTINS:
                    continue
                if not any(_matches(a, ex) for a in allow if a.split()[0] == name):
                    return deny("policy.not_allowed",
                                f"`{name}` is not on role '{ctx.role}''s allow_commands.",
                                f"Add {name!r} to the role's allow_commands if this role should run it.", ex.text)
    flags: list[str] = []
    mode = ctx.unparseable or ("deny" if ctx.mode == "locked" else "flag")
    if an.unparseable:
        if mode == "deny":
            return deny("policy.unparseable",
                        f"{an.unparseable[0]}, so it cannot be judged, and role '{ctx.role}' refuses what it "
                        "cannot judge.",
                        "Fix the quoting or pass an argv list to run_process; or set governance.unparseable = "
                        "'flag' in the role (a regulated preset fixes it).")
        flags.append("unparseable")
    if an.dynamic:
        if mode == "deny" or not allow_all:
            return deny("policy.dynamic_command",
                        f"the program or code {an.dynamic[0]!r} is only known at run time, so it cannot be judged.",
                        "Write the program name literally; or set governance.unparseable = 'flag' in an open "
                        "role without allow_commands.")
        flags.append("dynamic_command")
    return ok("policy.pass", flags=tuple(flags))
