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

A push is read as git-push(1) reads it: options anywhere among the operands,
unique prefixes of long options (`--del` is `--delete`, as parse-options
accepts them), the last of `--x`/`--no-x` winning, then each refspec: `+src:dst`
forces, an empty source (`:dst`, `+:dst`) deletes, `--delete` deletes every ref
named. With no refspec on the command line, the push refspecs and mirror
setting given on that same line (`-c remote.<name>.push=...`, the environment's
`GIT_CONFIG_PARAMETERS` / `GIT_CONFIG_KEY_n`) are what git pushes, so they are
read the same way. A call may fall under two rules (`--mirror` force-updates
and deletes): it runs only if the role allows both. Writing such a refspec or
a push mirror into the repository's config (`git config remote.x.push :main`,
`git remote add --mirror=push`) is judged as the push it sets up, because the
later `git push` that performs it shows nothing on its line. What a push
refspec holds when it is known only at run time (`git push origin "$REF"`),
or what a config file outside the line says, is not read.

Pure Python, no I/O.
"""

from __future__ import annotations

from .model import Analysis, Exec, operands, split_words
from .model import Finding, GateContext, deny, ok
from .paths import LazyRe

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
    "remote_delete": "deleting a branch or tag on a remote removes it for everyone who uses that remote, and the "
                     "remote keeps no reflog to recover it from",
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

    __slots__ = ("sub", "args", "config", "shell_alias", "settings")

    def __init__(self, sub: str, args: list[str], config: dict[str, str], shell_alias: str | None,
                 settings: list[tuple[str, str | None]] | None = None):
        self.sub = sub                    # the subcommand ("" when only global options)
        self.args = args                  # its arguments
        self.config = config              # -c key=value (keys lower-cased; the last value of a key)
        self.shell_alias = shell_alias    # `!cmd` alias text with its arguments, to analyse as shell
        # every config setting on the line in order, multi-valued keys (remote.x.push) included;
        # value None: known only at run time (--config-env=key=ENVVAR)
        self.settings = settings if settings is not None else list(config.items())


def invocation(argv: list[str]) -> GitCall:
    """`git -C d -c alias.x='reset --hard' x HEAD` -> sub "reset", args ["--hard", "HEAD"]."""

    prog = argv[0].rsplit("/", 1)[-1].lstrip("\\") if argv else ""
    config: dict[str, str] = {}
    settings: list[tuple[str, str | None]] = []
    i = 1
    if prog.startswith("git-") and len(prog) > 4:  # git-filter-repo, git-reset: the subcommand's own binary
        return GitCall(prog[4:], list(argv[1:]), config, None, settings)
    while i < len(argv):
        a = argv[i]
        if a == "-c" and i + 1 < len(argv):
            k, _, v = argv[i + 1].partition("=")
            config[k.lower()] = v
            settings.append((k.lower(), v))
            i += 2
            continue
        if a.startswith("-c") and len(a) > 2 and not a.startswith("--"):
            k, _, v = a[2:].partition("=")
            config[k.lower()] = v
            settings.append((k.lower(), v))
        elif a.startswith("--config-env=") or (a == "--config-env" and i + 1 < len(argv)):
            # git(1): --config-env=<name>=<envvar>: the value is read from the environment at run time
            spec = a[len("--config-env="):] if a != "--config-env" else argv[i + 1]
            settings.append((spec.rpartition("=")[0].lower(), None))
            i += 2 if a == "--config-env" else 1
            continue
        elif a in GLOBAL_WITH_VALUE:
            i += 2
            continue
        elif not a.startswith("-"):
            break
        i += 1
    if i >= len(argv):
        return GitCall("", [], config, None, settings)
    sub, args = argv[i], list(argv[i + 1:])
    for _ in range(8):  # an alias may name another alias; git refuses loops, we stop
        alias = config.get(f"alias.{sub.lower()}")
        if alias is None:
            break
        if alias.startswith("!"):
            import shlex
            return GitCall(sub, args, config, " ".join([alias[1:]] + [shlex.quote(a) for a in args]), settings)
        words = split_words(alias)
        if not words:
            break
        sub, args = words[0], words[1:] + args
    return GitCall(sub, args, config, None, settings)


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


# git-push(1) / git-send-pack(1) long options (builtin/push.c, builtin/send-pack.c): git takes any unique
# prefix of one (`--del`, `--mir`, `--pru`); `--no-<name>` turns one off. Those that take a separate value.
_PUSH_LONG = ("verbose", "quiet", "repo", "all", "branches", "mirror", "delete", "tags", "dry-run", "porcelain",
              "force", "force-with-lease", "force-if-includes", "recurse-submodules", "thin", "receive-pack", "exec",
              "set-upstream", "progress", "prune", "no-verify", "follow-tags", "signed", "atomic", "push-option",
              "ipv4", "ipv6")
_SEND_PACK_LONG = ("verbose", "quiet", "receive-pack", "exec", "remote", "all", "dry-run", "mirror", "force",
                   "signed", "push-option", "progress", "thin", "atomic", "stateless-rpc", "stdin", "helper-status",
                   "force-with-lease", "force-if-includes")
_PUSH_LONG_VALUE = frozenset({"repo", "recurse-submodules", "receive-pack", "exec", "push-option", "remote"})
# short options: what each letter sets (`-o` takes a value: the rest of the cluster, else the next word)
_PUSH_SHORT = {"n": "dry-run", "f": "force", "d": "delete", "u": "set-upstream", "v": "verbose", "q": "quiet",
               "4": "ipv4", "6": "ipv6"}
# git-http-push(1) parses its own few options, without abbreviations
_HTTP_PUSH = {"-d": "delete", "-D": "delete", "--force": "force", "--dry-run": "dry-run", "--all": "all"}


def _long_name(word: str, names: tuple[str, ...]) -> tuple[str, bool] | None:
    """`--del` -> ("delete", True), `--no-prune` -> ("prune", False): an exact name or a unique prefix of
    one, as parse-options resolves it; None when git would refuse the word (unknown or ambiguous)."""
    name = word[2:].split("=", 1)[0]
    tries = [(name, True)] + ([(name[3:], False)] if name.startswith("no-") and len(name) > 3 else [])
    for want, on in tries:
        if want in names:
            return want, on
        hits = [n for n in names if n.startswith(want)]
        if len(hits) == 1:
            return hits[0], on
    return None


def _parse_push(args: list[str], names: tuple[str, ...], http: bool) -> tuple[set[str], list[str]]:
    """The switches in effect (the last of `--x`/`--no-x` wins) and the operands of a push."""
    on: set[str] = set()
    pos: list[str] = []
    i, dash = 0, False
    while i < len(args):
        a = args[i]
        i += 1
        if dash or a == "-" or not a.startswith("-"):
            pos.append(a)
        elif a == "--":
            dash = True
        elif http:
            if a in _HTTP_PUSH:
                on.add(_HTTP_PUSH[a])
        elif a.startswith("--"):
            hit = _long_name(a, names)
            if hit is None:
                continue
            name, yes = hit
            if yes and name in _PUSH_LONG_VALUE and "=" not in a:
                i += 1
            (on.add if yes else on.discard)(name)
        else:
            for k, c in enumerate(a[1:], 1):
                if c == "o":  # -o <option>: the rest of the cluster, else the next word, is its value
                    i += 0 if k < len(a) - 1 else 1
                    break
                if c in _PUSH_SHORT:
                    on.add(_PUSH_SHORT[c])
    return on, pos


def _refspec(r: str) -> tuple[bool, str | None, str]:
    """`+src:dst` -> (forced, src, dst); src None for a refspec without a colon (`main`, `HEAD`)."""
    forced = r.startswith("+")
    body = r[1:] if forced else r
    if ":" not in body:
        return forced, None, body
    src, _, dst = body.partition(":")
    return forced, src, dst


def _deletes(refspec: str) -> bool:
    """`:dst` and `+:dst` delete dst on the remote; `:` alone pushes the matching branches."""
    _, src, dst = _refspec(refspec)
    return src == "" and dst != ""


def _dst_default(dst: str) -> bool:
    d = dst.removeprefix("refs/heads/")
    return not d or d in DEFAULT_BRANCHES or d == "HEAD" or "$" in d or "`" in d


def _config_refspecs(call: GitCall, env: list[tuple[str, str | None]], remote: str | None
                     ) -> tuple[list[str], bool, bool]:
    """The push refspecs and mirror setting the line configures for `remote` (None: any remote, the
    one git picks is not on the line): (refspecs, mirror, unreadable: a value known only at run time)."""
    refspecs, mirror, unreadable = [], False, False
    for key, value in env + call.settings:
        parts = key.split(".")
        if len(parts) < 3 or parts[0] != "remote" or parts[-1] not in ("push", "mirror"):
            continue
        name = ".".join(parts[1:-1])
        if remote is not None and name != remote.lower():
            continue
        if value is None:
            unreadable = True
        elif parts[-1] == "push":
            refspecs.append(value)
        else:
            mirror = value.lower() in ("", "true", "yes", "on", "1")
    return refspecs, mirror, unreadable


def _push_rules(call: GitCall, env: list[tuple[str, str | None]], more: bool) -> list[tuple[str, str]]:
    """(rule, what shows it) for each rule this push (or send-pack / http-push) falls under;
    `more`: further operands arrive at run time (xargs)."""
    on, pos = _parse_push(call.args, _SEND_PACK_LONG if call.sub == "send-pack" else _PUSH_LONG,
                          call.sub == "http-push")
    if "dry-run" in on:
        return []  # nothing is sent
    remote, refspecs = (pos[0], pos[1:]) if pos else (None, [])
    out: list[tuple[str, str]] = []
    from_config = ""
    if not refspecs and on.isdisjoint({"all", "branches", "tags", "mirror", "stdin"}):
        # git pushes what remote.<name>.push says; a URL as the remote has no such config
        named = remote if remote is None or not any(c in remote for c in "/:") else "\0url"
        refspecs, mirror, unreadable = _config_refspecs(call, env, named)
        if unreadable:
            why = "a push refspec or mirror setting read from the environment at run time (--config-env)"
            return [("force_push", why), ("remote_delete", why)]
        if mirror:
            on.add("mirror")
        from_config = " (from remote.<name>.push on the line)" if refspecs else ""
    if "mirror" in on:
        why = "--mirror makes the remote a copy: refs only the remote has are deleted, the others force-updated"
        out += [("force_push", why), ("remote_delete", why)]
    if "stdin" in on:
        why = "send-pack --stdin reads the refs to update from its input"
        out += [("force_push", why), ("remote_delete", why)]
    if "delete" in on and (refspecs or more):  # every ref named is deleted; --force adds nothing to that
        named = ", ".join([r for r in refspecs if r != "tag"][:3]) or "the refs xargs reads from its input"
        out.append(("remote_delete", f"--delete deletes {named} on the remote"))
        if "prune" in on:
            out.append(("remote_delete", "--prune deletes the remote's refs that have no local counterpart"))
        return list(dict.fromkeys(out))
    deleted = [r for r in refspecs if _deletes(r)]
    if deleted:
        dst = _refspec(deleted[0])[2]
        out.append(("remote_delete", f"the refspec {deleted[0]!r} has an empty source: it deletes {dst!r} on the "
                                     f"remote{from_config}"))
    if "prune" in on:
        out.append(("remote_delete", "--prune deletes the remote's refs that have no local counterpart"))
    updates = [r for r in refspecs if r not in deleted and r != "tag"]
    forced = [r for r in updates if r.startswith("+")]
    if forced:
        out.append(("force_push", f"the refspec {forced[0]!r} forces the update{from_config}"))
    elif "force" in on and (updates or not deleted):
        out.append(("force_push", "--force replaces the remote's history"))
    elif not on.isdisjoint({"force-with-lease", "force-if-includes"}):
        # Safer (it refuses when the remote moved), and fine on a branch of one's own: only a named
        # non-default branch passes; without a refspec the current branch may be the default.
        if not updates and not deleted:
            out.append(("force_push", "--force-with-lease without a refspec may force the default branch"))
        elif any(_dst_default(_refspec(r)[2]) for r in updates):
            out.append(("force_push", "--force-with-lease to a default branch"))
    return list(dict.fromkeys(out))


def _config_write_rules(call: GitCall) -> list[tuple[str, str]]:
    """`git config remote.x.push :main`, `git config remote.x.mirror true`, `git remote add --mirror=push`:
    the later plain `git push` performs what they set, with nothing on its own line to judge."""
    args = call.args
    if call.sub == "remote":
        pos = operands(args, frozenset({"-t", "-m", "--track", "--master"}))
        if pos[:1] == ["add"] and any(a in ("--mirror", "--mirror=push") for a in args):
            why = "a push mirror: every later `git push` to it deletes and force-updates the remote's refs"
            return [("force_push", why), ("remote_delete", why)]
        return []
    if call.sub != "config":
        return []
    if any(a.startswith(("--get", "--unset", "--list", "--remove", "--rename", "--edit")) or a in ("-l", "-e")
           for a in args):
        return []
    pos = operands(args, frozenset({"-f", "--file", "--blob", "--type", "--default", "--comment", "--value"}))
    if pos[:1] in (["set"], ["--append"]):  # git config set [--append] key value (git 2.46)
        pos = pos[1:]
    if pos[:1] in (["get"], ["unset"], ["list"], ["edit"], ["rename-section"], ["remove-section"]):
        return []
    if len(pos) < 2:
        return []
    key, value = pos[0].lower(), pos[1]
    parts = key.split(".")
    if len(parts) < 3 or parts[0] != "remote":
        return []
    if parts[-1] == "mirror" and value.lower() in ("true", "yes", "on", "1"):
        why = f"`{key} = {value}` makes every later `git push` a mirror push"
        return [("force_push", why), ("remote_delete", why)]
    if parts[-1] == "push":
        forced, src, dst = _refspec(value)
        if src == "" and dst:
            return [("remote_delete", f"`{key} = {value}` makes every later `git push` delete {dst!r} on the remote")]
        if forced:
            return [("force_push", f"`{key} = {value}` makes every later `git push` a force push")]
    return []


def rules_of(call: GitCall, env: list[tuple[str, str | None]] | None = None, more: bool = False
             ) -> list[tuple[str, str]]:
    """(RULES name, what shows it) for each rule this git call falls under, most specific first.
    `env`: config settings from the environment the call runs with (GIT_CONFIG_PARAMETERS, ...);
    `more`: further operands arrive at run time (xargs)."""
    sub = call.sub
    if sub in ("push", "send-pack", "http-push"):
        return _push_rules(call, env or [], more)
    if sub in ("config", "remote"):
        return _config_write_rules(call)
    rule = _rule_of(call)
    return [(rule, "")] if rule else []


def _rule_of(call: GitCall) -> str:
    """The RULES name of a git call that is not a push, or ""."""
    sub, args = call.sub, call.args
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
        if _short(args, "r") or _long(args, "--remotes"):
            # -d/-D -r deletes remote-tracking refs: local copies of what the remote has, which the next
            # fetch restores (as `git fetch --prune` and `git remote prune` delete them every day)
            return ""
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


def findings(an: Analysis) -> list[tuple[str, str, Exec]]:
    """(rule, what shows it, the git call) for every rule each git call of `an` falls under, in order."""
    out = []
    for ex in an.execs:
        if ex.prog == "git" or ex.prog.startswith("git-"):
            out += [(rule, why, ex) for rule, why in rules_of(invocation(ex.argv), env_settings(ex.text),
                                                             ex.from_stdin)]
    return out


def check(an: Analysis | None, ctx: GateContext) -> Finding:
    allowed = set(ctx.git_allow)
    if an is None or "*" in allowed:
        return ok("git.pass")
    for rule, why, ex in findings(an):
        if rule not in allowed:
            reason = RULES[rule] + (f" ({why})." if why else ".")
            return deny(f"git.{rule}", reason, hint(rule, ctx), ex.text or " ".join(ex.argv))
    return ok("git.pass")


_ENV_CONFIG = LazyRe(r"(?<![\w$])GIT_CONFIG_(PARAMETERS|KEY_\d+|VALUE_\d+)=")


def env_settings(text: str) -> list[tuple[str, str | None]]:
    """Config settings a command line gives git through its environment (git-config(1) ENVIRONMENT:
    GIT_CONFIG_COUNT with GIT_CONFIG_KEY_<n> / GIT_CONFIG_VALUE_<n>, and GIT_CONFIG_PARAMETERS, the
    form `git -c` itself passes on): `GIT_CONFIG_KEY_0=remote.origin.push GIT_CONFIG_VALUE_0=:main git push`."""
    if "GIT_CONFIG_" not in text or not _ENV_CONFIG.search(text):
        return []

    keys: dict[str, str] = {}
    values: dict[str, str] = {}
    out: list[tuple[str, str | None]] = []
    for w in split_words(text):
        prog = w.rsplit("/", 1)[-1].lstrip("\\")
        if prog == "git" or prog.startswith("git-"):
            break  # only what comes before git: its own arguments are not its environment
        name, eq, value = w.partition("=")
        if not eq or not name.startswith("GIT_CONFIG_"):
            continue
        if name == "GIT_CONFIG_PARAMETERS":
            # 'key'='value' or 'key=value', space-separated, shell-quoted (git's sq_quote)
            for item in split_words(value):
                k, _, v = item.partition("=")
                out.append((k.lower(), v))
        elif name.startswith("GIT_CONFIG_KEY_"):
            keys[name[len("GIT_CONFIG_KEY_"):]] = value.lower()
        elif name.startswith("GIT_CONFIG_VALUE_"):
            values[name[len("GIT_CONFIG_VALUE_"):]] = value
    out += [(k, values.get(n, "")) for n, k in sorted(keys.items())]
    return out


# Config keys by pattern whose value git runs as a command (git-config(1), gitattributes(5)): a driver,
# a tool, a helper. `*` is one subsection name.
_SHELL_CONFIG_PATTERNS = LazyRe(
    r"(?:pager|alias)\.[^.]+|filter\..+\.(?:clean|smudge|process)|diff\..+\.(?:textconv|command)|merge\..+\.driver"
    r"|(?:difftool|mergetool|browser|man)\..+\.(?:cmd|path)|gpg\..+\.program|credential(?:\..+)?\.helper"
    r"|remote\..+\.(?:receivepack|uploadpack)|core\.(?:alternaterefscommand|gitproxy|askpass)"
    r"|uploadpack\.packobjectshook|sendemail\.(?:sendmailcmd|tocmd|cccmd)|interactive\.difffilter")
# subcommand -> its options whose value git runs as a command (through the shell, or as a program on
# the local side of a local transport)
_CODE_OPTIONS = {
    "rebase": ("-x", "--exec"), "push": ("--receive-pack", "--exec"), "send-pack": ("--receive-pack", "--exec"),
    "fetch": ("--upload-pack",), "pull": ("--upload-pack",), "clone": ("-u", "--upload-pack"),
    "ls-remote": ("--upload-pack",), "archive": ("--exec",), "difftool": ("-x", "--extcmd"),
    "grep": ("-O", "--open-files-in-pager"),
}


def _runs_config(key: str, value: str) -> bool:
    if key in SHELL_CONFIG:
        return True
    if key.startswith("alias.") and not value.startswith("!"):
        return False  # an alias without `!` is git words (expanded by invocation)
    if key.startswith("credential") and not value.startswith(("!", "/")):
        return False  # gitcredentials(7): a bare name runs git-credential-<name>; `!code` and a path run as given
    return bool(_SHELL_CONFIG_PATTERNS.fullmatch(key))


def _option_values(args: list[str], names: tuple[str, ...]) -> list[str]:
    out = []
    for i, a in enumerate(args):
        if a == "--":
            break
        for n in names:
            if a == n and i + 1 < len(args):
                out.append(args[i + 1])
            elif n.startswith("--") and a.startswith(n + "="):
                out.append(a[len(n) + 1:])
            elif not n.startswith("--") and a.startswith(n) and len(a) > len(n):
                out.append(a[len(n):])  # -xCMD
    return out


def _joined(words: list[str]) -> str:
    """What git runs for a command given as words: one word is shell text, several are an argv."""
    import shlex
    return words[0] if len(words) == 1 else " ".join(shlex.quote(w) for w in words)


def _subcommand_code(call: GitCall) -> list[tuple[str, str]]:
    sub, args = call.sub, call.args
    out = [(v, f"git {sub} option") for v in _option_values(args, _CODE_OPTIONS.get(sub, ()))]
    pos = operands(args)
    if sub == "submodule" and "foreach" in args:  # git submodule [--quiet] foreach [--recursive] <command>
        rest = args[args.index("foreach") + 1:]
        while rest and rest[0] in ("--recursive", "-q", "--quiet", "--"):
            rest = rest[1:]
        if rest:
            out.append((_joined(rest), "git submodule foreach"))
    elif sub == "bisect" and pos[:1] == ["run"] and len(args) > args.index("run") + 1:
        import shlex  # git bisect run quotes its words into one command line (sq_quote_argv): an argv
        out.append((" ".join(shlex.quote(w) for w in args[args.index("run") + 1:]), "git bisect run"))
    elif sub == "config" and not any(a.startswith(("--get", "--unset", "--list", "--remove", "--rename"))
                                     for a in args):
        # a value written now that git runs later: `git config core.fsmonitor CMD`, `alias.x '!CMD'`
        kv = operands(args, frozenset({"-f", "--file", "--blob", "--type", "--default", "--comment", "--value"}))
        kv = kv[1:] if kv[:1] in (["set"], ["--append"]) else kv
        if len(kv) >= 2 and _runs_config(kv[0].lower(), kv[1]):
            out.append((kv[1].removeprefix("!"), f"git config {kv[0]}"))
    out += [(_joined(_ext_argv(w[5:])), "git ext:: URL") for w in pos if w.startswith("ext::")]
    return out


def _ext_argv(spec: str) -> list[str]:
    """git-remote-ext(1): `ext::sh -c rm% -rf% /` runs ["sh", "-c", "rm -rf /"]: a space separates
    arguments, `% ` is a space inside one, `%%` a percent (`%s`, `%S`, `%G` are left as written)."""
    words, cur, i = [], "", 0
    while i < len(spec):
        c = spec[i]
        if c == "%" and i + 1 < len(spec) and spec[i + 1] in " %":
            cur, i = cur + spec[i + 1], i + 2
            continue
        if c == " ":
            if cur:
                words.append(cur)
            cur = ""
        else:
            cur += c
        i += 1
    return words + ([cur] if cur else [])


def shell_code(ex: Exec) -> list[tuple[str, str]]:
    """(code, where) for what this git call runs as a command: a `!` alias, a config value git runs
    (core.pager, core.sshCommand, filter drivers, ...) given with -c or written with `git config`,
    `submodule foreach`, `rebase --exec`, `bisect run`, `--upload-pack`/`--receive-pack`, ext:: URLs."""
    call = invocation(ex.argv)
    out = [(call.shell_alias, "git alias")] if call.shell_alias is not None else []
    out += [(v.removeprefix("!"), f"git -c {k}") for k, v in call.settings
            if v and k and _runs_config(k, v) and not k.startswith("alias.")]
    return out + _subcommand_code(call)
