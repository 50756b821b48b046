"""Sandbox: path scope for every path a call names.

Writes must land inside the worktree or a writable root (after `..` and
symlinks are resolved); reads and writes of deny paths are refused. For shell
commands the paths are redirection targets and the operands of commands
whose meaning we know (cp/mv/tee/rm/touch/mkdir/dd/...); any other operand
that looks like a path is checked as a read against the deny paths only.
The mount namespace is the guarantee; this check refuses early and explains.

For a command that runs in a cell (run_process, run_shell) under mode open
with governance.kernel_enforced = "flag", two refusals the mount namespace
makes anyway become the flag `sandbox.kernel_enforced`: a write outside the
writable paths under the read-only root (EROFS; not for device nodes, FIFOs
and sockets, which a read-only mount does not protect), and a read of a deny
path the cell's mount namespace hides (filesystem.deny, the state root).
A deny path only the gate knows (a default the role's filesystem.deny
leaves out) stays a denial, and so do writes to deny paths.
"""

from __future__ import annotations

import functools
import os
import stat

from .model import (CELL_TOOLS, DEFAULT_DENY_PATHS, Analysis, Exec, Finding, GateContext, deny, ok, ok_flagged,
                    operands as _operands)
from .paths import HARMLESS_DEVICES, UNKNOWN_CWD, expand, home_of, real, resolve, within

# Argument names that carry paths, in any tool.
PATH_KEYS = frozenset({"path", "file", "file_path", "filepath", "filename", "paths", "files", "cwd", "dest",
                       "destination", "src", "source", "target", "dir", "directory", "output", "output_path",
                       "out", "root", "workdir", "working_dir", "new_path", "old_path", "target_file"})
READ_KEYS = frozenset({"src", "source", "old_path"})  # read even in a writing tool (unless it moves)
MOVING_TOOLS = ("move", "rename", "mv")

# Commands that only look at names/metadata: their operands are not content reads.
METADATA_ONLY = frozenset({"ls", "stat", "file", "test", "[", "[[", "du", "df", "find", "which", "type", "lsattr",
                           "realpath", "readlink", "dirname", "basename", "echo", "printf", "cd", "pushd", "tree",
                           "namei", "exa", "eza", "command", "hash", "whereis", "man"})

HINT_WRITE = ("Work inside the worktree, or add the directory to the role's writable paths if this role "
              "must write there.")
HINT_KERNEL = (" The cell's mount namespace refuses it anyway: under mode open, governance.kernel_enforced = "
               "'flag' lets it run with a flag.")
HINT_DENY = ("Deny paths hold credentials and agnsup's state; remove the path from the role's deny_paths if it "
             "was added there (the defaults cannot be lifted).")


class Scope:
    def __init__(self, ctx: GateContext):
        self.home = home_of(ctx.home)
        self.role = ctx.role
        self.worktree = real(os.path.abspath(ctx.worktree or "."))
        # The cell attaches the worktree over /tmp's private copy: read-only wins even under /tmp.
        self.worktree_writable = ctx.worktree_writable
        self.writable = ([self.worktree] if ctx.worktree_writable else []) + \
            [real(os.path.abspath(os.path.expanduser(w))) for w in ctx.writable]
        denies = list(DEFAULT_DENY_PATHS) + list(ctx.deny_paths) + ([ctx.state_root] if ctx.state_root else [])
        self.deny = self._roots(denies)
        kernel = ctx.kernel
        self.root_ro = bool(kernel and kernel.root_ro)
        self.worktree_ro = bool(kernel and kernel.worktree_ro)
        self.masked = self._roots(kernel.masked) if kernel else []

    def _roots(self, paths) -> list[str]:
        out: list[str] = []
        for d in paths:
            p, _ = expand(d, home=self.home, base=self.worktree)
            if p:
                out.append(p)
                if real(p) != p:
                    out.append(real(p))
        return out

    def base(self, cwd: str | None) -> str:
        if cwd is None:
            return self.worktree
        if cwd == UNKNOWN_CWD:
            return cwd
        p, _ = expand(cwd, home=self.home, base=self.worktree)
        return p or UNKNOWN_CWD

    def judge(self, word: str, mode: str, base: str, what: str, evidence: str = "", *,
              in_cell: bool = False, flag: bool = False) -> Finding | None:
        """A denial, None, or an allowed Finding `sandbox.kernel_enforced`.

        in_cell: the call runs in an agnsup cell, whose mount namespace `self`
        knows; flag: a refusal that namespace makes anyway becomes a flag."""
        p, _glob = expand(word, home=self.home, base=base)
        if p is None:
            return None
        if HARMLESS_DEVICES.match(p) or p.startswith(("/dev/tcp/", "/dev/udp/")):
            return None
        r = resolve(p)  # not cached: a symlink may change between calls
        for d in self.deny:
            if within(p, d) or within(r, d):
                if mode == "r" and p.endswith(".pub"):
                    return None  # public keys are public
                verb = "reading" if mode == "r" else "writing"
                # Through /proc/PID/root another process's root is read, where the cell's masks do not apply.
                hidden = in_cell and mode == "r" and "/proc/" not in word and any(
                    within(p, m) or within(r, m) for m in self.masked)
                if hidden and flag:
                    return Finding(True, "sandbox.kernel_enforced",
                                   f"{verb} {word} ({what}) touches the deny path {d}; allowed with a flag because "
                                   f"the cell's mount namespace hides {d} (it reads as empty there) "
                                   "(governance.kernel_enforced = 'flag').", evidence=evidence or word)
                return deny("sandbox.deny_path", f"{verb} {word} ({what}) touches the deny path {d}.",
                            HINT_DENY + (HINT_KERNEL if hidden else ""), evidence or word)
        in_ro_worktree = not self.worktree_writable and within(r, self.worktree)
        if mode == "w" and (in_ro_worktree or not any(within(r, w) for w in self.writable)):
            # The worktree is its own mount (read-only for filesystem.worktree = "ro"); the rest is the root's.
            ro = self.worktree_ro if within(r, self.worktree) else self.root_ro
            erofs = in_cell and ro and _refused_by_read_only_mount(r)
            if erofs and flag:
                return Finding(True, "sandbox.kernel_enforced",
                               f"{what} writes {word}, which resolves to {r}, outside the cell's writable paths; "
                               "allowed with a flag because the cell's read-only mount there refuses the write "
                               "(EROFS) (governance.kernel_enforced = 'flag').", evidence=evidence or word)
            if in_ro_worktree:
                where = f"inside the worktree {self.worktree}, which is read-only for role '{self.role}'"
                hint = "Set filesystem.worktree = 'rw' in the role if it should write its worktree."
            else:
                roots = [w for w in self.writable if w != self.worktree]
                where = f"outside the worktree {self.worktree}" + (
                    f" and the writable roots {', '.join(roots)}" if roots else "")
                hint = HINT_WRITE
            return deny("sandbox.path_escape", f"{what} writes {word}, which resolves to {r}, {where}.",
                        hint + (HINT_KERNEL if erofs else ""), evidence or word)
        return None


def _refused_by_read_only_mount(r: str) -> bool:
    """Whether a read-only mount refuses writing r: not for device nodes, FIFOs and
    sockets (the kernel writes those whatever the mount says), so nothing under /dev."""
    if r == "/dev" or r.startswith("/dev/"):
        return False
    try:
        st = os.stat(r)
    except OSError:
        return True  # does not exist (yet): creating it needs a writable mount
    return stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)


def _words(v) -> list[str]:
    if isinstance(v, str):
        return [v]
    if isinstance(v, (list, tuple)):
        return [x for x in v if isinstance(x, str)]
    return []


def check_args(tool: str, args: dict, zone: str, scope: Scope) -> Finding | None:
    """Path-like arguments of any tool."""
    writer = zone != "green" and tool not in ("run_process", "run_shell")
    moving = any(m in tool for m in MOVING_TOOLS)
    for key, value in args.items():
        if key not in PATH_KEYS:
            continue
        mode = "w" if writer and key != "cwd" and (key not in READ_KEYS or moving) else "r"
        for w in _words(value):
            f = scope.judge(w, mode, scope.worktree, f"argument {key!r} of {tool}")
            if f:
                return f
    return None


def _looks_like_path(w: str) -> bool:
    return w.startswith(("/", "~", "./", "../", "$HOME", "${HOME}")) or ("/" in w and "://" not in w)


def shell_paths(ex: Exec) -> list[tuple[str, str]]:
    """(word, "r"|"w") for the paths one command touches."""
    from .hardline import _write_targets  # same notion of write targets as hardline

    out = [(t, "w") for t, _kind in _write_targets(ex, None)]
    prog, args = ex.prog, ex.args
    if prog in ("mkdir", "rmdir", "chmod", "chown", "chgrp"):
        ops = _operands(args, frozenset({"-m", "--mode", "--reference"}))
        out += [(a, "w") for a in (ops[1:] if prog in ("chmod", "chown", "chgrp") else ops)]
    elif prog == "mv":
        out += [(a, "w") for a in _operands(args, frozenset({"-t", "--target-directory", "-S", "--suffix"}))[:-1]]
    elif prog in ("curl", "wget"):
        for i, a in enumerate(args):
            if a in ("-o", "--output", "-O", "--output-document", "-P", "--directory-prefix") and i + 1 < len(args) \
                    and not (prog == "curl" and a == "-O"):
                out.append((args[i + 1], "w"))
    out += [(t, "r") for op, t, _l in ex.redirects if op == "<"]
    if prog not in METADATA_ONLY:
        written = {w for w, _m in out}
        for a in args:
            key, eq, val = a.partition("=")
            cand = val if eq and "/" not in key else a  # --opt=PATH, f=@PATH
            cand = cand.lstrip("@<")  # curl -d @file, -F f=@file / f=<file
            if cand not in written and _looks_like_path(cand):
                out.append((cand, "r"))
    return out


def check_shell(an: Analysis, scope: Scope, in_cell: bool = False,
                flag: bool = False) -> tuple[Finding | None, list[dict]]:
    """The first denial (or None), and the kernel-backed refusals flagged instead."""
    notes: list[dict] = []
    for ex in an.execs:
        base = scope.base(ex.cwd)
        for word, mode in shell_paths(ex):
            f = scope.judge(word, mode, base, f"`{ex.prog}`" if ex.prog != ":" else "a redirection", ex.text,
                            in_cell=in_cell, flag=flag)
            if f and not f.allowed:
                return f, notes
            if f:
                notes.append({"rule": f.rule, "reason": f.reason, "evidence": f.evidence})
    return None, notes


@functools.lru_cache(maxsize=32)
def scope_for(ctx: GateContext) -> Scope:
    """Roots of one context, resolved once (the batch path judges thousands of lines per context)."""
    return Scope(ctx)


def check(tool: str, args: dict, zone: str, an: Analysis | None, ctx: GateContext) -> Finding:
    scope = scope_for(ctx)
    # Tool arguments name paths the tool itself opens (never in a cell): not kernel-backed.
    f = check_args(tool, args, zone, scope)
    if f:
        return f
    notes: list[dict] = []
    if an is not None:
        f, notes = check_shell(an, scope, in_cell=ctx.kernel is not None and tool in CELL_TOOLS,
                               flag=ctx.flags_kernel_enforced(tool))
        if f:
            return f
    return ok_flagged(notes) if notes else ok("sandbox.pass")
