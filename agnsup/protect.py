"""Files that programs run on their own, kept read-only in cells that write their worktree.

A cell that may write its worktree could otherwise plant code that runs on the host
later, outside agnsup: `core.fsmonitor` in `.git/config` or a `.git/hooks/pre-commit`
runs at the next plain `git status` / `git commit` an agent runtime, a reviewer or CI
makes in the worktree; `.vscode/tasks.json`, `.mcp.json`, `.bashrc` run when an editor,
an agent or a shell opens it. The list is sandbox-runtime's (docs/isolation.md,
"Doors: files that run on their own").

Three parts, each cheap (a few dozen lstat calls per cell; docs/isolation.md, cost):

  scan      which protected paths exist, and each git directory (`.git`, its
            modules and linked worktrees): compile_plan turns the result into mount
            operations of kind "protect" (linux/mounts.py), run in the cell after
            the worktree is attached: each existing protected path is bound
            read-only onto itself, each git directory read-write onto itself (a
            mount point cannot be renamed or removed: EBUSY, so `.git` cannot be
            moved aside and replaced by a copy the cell controls).
  baseline  the identity (device, inode, type) of every path the scan found, taken
            by the controller just before the cell starts; for the paths a role
            lifts (filesystem.writable_protected), also their content digests.
  settle    after the cell's tree is dead: a protected path the cell created (or
            replaced, by renaming a parent aside) is moved out of the worktree into
            the cell's record directory; lifted paths are diffed for the receipt.

Paths that do not exist when the cell starts cannot be bind targets without creating
them on the host, so they are judged after the cell instead; while it runs, a host
program that reads them sees what the cell wrote (the documented window).
"""
from __future__ import annotations

import json
import os
import stat as stat_mod
from contextlib import suppress

from .linux import fs
from .linux.host import exists, realpath

# Worktree-relative paths sandbox-runtime refuses writes to (a worktree that is a home has
# the shell's start-up files in it; .gitconfig is read as ~/.gitconfig there).
TOP = (".gitconfig", ".gitmodules", ".bashrc", ".bash_profile", ".zshrc", ".zprofile", ".profile", ".ripgreprc",
       ".mcp.json", ".vscode", ".idea", ".claude/commands", ".claude/agents")
# Inside every git directory: what git reads to decide which programs to run (config,
# config.worktree, hooks) and what points git at another directory's config and hooks
# (commondir; gitdir in a linked worktree's directory). info/attributes is left writable:
# an attribute names a filter or diff driver, whose command only config can define.
IN_GITDIR = ("config", "config.worktree", "hooks", "commondir")
IN_WORKTREE_GITDIR = IN_GITDIR + ("gitdir",)
# What filesystem.writable_protected may name: ".git/config" lifts config and
# config.worktree in every git directory, ".git/hooks" every hooks directory.
LIFTABLE = TOP + (".git/config", ".git/hooks")
_LIFT_CLASS = {"config": ".git/config", "config.worktree": ".git/config", "hooks": ".git/hooks"}

# Keys a configuration file written by the cell in a git directory it created (git init,
# clone, submodule update) may hold and still stay: none of them makes git run a program.
# Anything else (core.fsmonitor, core.hooksPath, core.sshCommand, core.pager, core.editor,
# core.askPass, diff.external, filter.*, include.*, includeIf.*, alias.*, credential.*,
# gpg.program, sequence.editor, remote.*.uploadpack/receivepack, ...; git-config(1)) sends
# the whole file to quarantine: an allowlist, so a key added to git later is not missed.
SAFE_CONFIG_KEYS = (
    "core.repositoryformatversion", "core.filemode", "core.bare", "core.logallrefupdates", "core.ignorecase",
    "core.precomposeunicode", "core.symlinks", "core.worktree", "core.autocrlf", "core.eol", "core.safecrlf",
    "core.quotepath", "core.compression", "core.sharedrepository", "core.sparsecheckout",
    "extensions.objectformat", "extensions.worktreeconfig", "init.defaultbranch",
    "user.name", "user.email", "remote.*.url", "remote.*.pushurl", "remote.*.fetch", "remote.*.push",
    "remote.*.tagopt", "remote.*.mirror", "remote.*.prune", "branch.*.remote", "branch.*.merge",
    "branch.*.rebase", "submodule.*.url", "submodule.*.active", "submodule.*.update.none", "pull.rebase",
    "pull.ff", "merge.ff", "fetch.prune", "gc.auto", "advice.*", "color.*", "i18n.*")


class Entry(tuple):
    """(kind, identity): kind "gitdir" (bound read-write onto itself), "pointer" (a `.git`
    file: bound read-only), or "protected"; identity (st_dev, st_ino, file type)."""
    __slots__ = ()

    @property
    def kind(self) -> str:
        return self[0]

    @property
    def ident(self) -> tuple:
        return self[1]


def _ident(path: str):
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, stat_mod.S_IFMT(st.st_mode))


def _under(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


def lift_class(rel: str) -> str:
    """The filesystem.writable_protected name that lifts the protection of `rel`."""
    base = os.path.basename(rel)
    if rel in TOP:
        return rel
    return _LIFT_CLASS.get(base, "")


def scan(wt: str) -> dict[str, Entry]:
    """Every protected path that exists in the worktree `wt` now, by worktree-relative path."""
    found: dict[str, Entry] = {}

    def note(rel: str, kind: str) -> None:  # (f-strings, not os.path.join: this runs ~20 times, 3 times a cell)
        ident = _ident(f"{wt}/{rel}")
        if ident is not None:
            found[rel] = Entry((kind, ident))

    for rel in TOP:
        note(rel, "protected")
    gitdirs = []
    for rel in [".git"] + [os.path.join(sub, ".git") for sub in _submodule_paths(wt)]:
        ident = _ident(os.path.join(wt, rel))
        if ident is None:
            continue  # none (a project without git, an uninitialised submodule): judged after the cell
        if ident[2] == stat_mod.S_IFDIR:
            gitdirs.append(rel)
            continue
        note(rel, "pointer")
        pointed = _pointed_gitdir(wt, rel)
        if pointed and pointed not in gitdirs:
            gitdirs.append(pointed)
    # each git directory's submodules and linked worktrees, two levels of nesting
    level = list(gitdirs)
    for _ in range(2):
        nested = []
        for gd in level:
            for group in ("modules", "worktrees"):
                with suppress(OSError):
                    with os.scandir(f"{wt}/{gd}/{group}") as it:
                        nested += sorted(f"{gd}/{group}/{e.name}" for e in it if e.is_dir(follow_symlinks=False))
        gitdirs += nested
        level = nested
    for gd in gitdirs:
        note(gd, "gitdir")
        for name in (IN_WORKTREE_GITDIR if gd.rsplit("/", 2)[-2:-1] == ["worktrees"] else IN_GITDIR):
            note(f"{gd}/{name}", "protected")
    for rel in _config_includes(wt, [gd for gd in gitdirs if f"{gd}/config" in found or
                                     f"{gd}/config.worktree" in found]):
        note(rel, "protected")
    return found


def _read_small(path: str, limit: int = 65536) -> str:
    try:
        with open(path, "rb") as f:
            return f.read(limit).decode(errors="replace")
    except OSError:
        return ""


def _pointed_gitdir(wt: str, rel: str) -> str | None:
    """A `.git` file's "gitdir: X", when X lies inside the worktree (worktree-relative)."""
    text = _read_small(os.path.join(wt, rel), 4096).strip()
    if not text.startswith("gitdir:"):
        return None
    target = os.path.normpath(os.path.join(wt, os.path.dirname(rel), text[7:].strip()))
    if _under(target, wt) and target != wt and os.path.isdir(target):
        return os.path.relpath(target, wt)
    return None


def _submodule_paths(wt: str) -> list[str]:
    """The `path = ...` values of .gitmodules that stay inside the worktree."""
    out = []
    for line in _read_small(os.path.join(wt, ".gitmodules")).splitlines():
        key, eq, value = line.strip().partition("=")
        if eq and key.strip().lower() == "path":
            p = os.path.normpath(value.strip().strip('"'))
            if p and not p.startswith("..") and not os.path.isabs(p):
                out.append(p)
    return out


def _config_includes(wt: str, gitdirs: list[str]) -> list[str]:
    """Files inside the worktree that a git directory's config includes (include.path,
    includeIf.*.path): git reads them as config, so they are protected like it."""
    out = []
    for gd in gitdirs:
        for name in ("config", "config.worktree"):
            section = ""
            for line in _read_small(os.path.join(wt, gd, name)).splitlines():
                s = line.strip()
                if s.startswith("["):
                    section = s[1:].split("]", 1)[0].split()[0].lower() if s[1:].split("]", 1)[0].split() else ""
                    continue
                key, eq, value = s.partition("=")
                if eq and section in ("include", "includeif") and key.strip().lower() == "path":
                    v = value.strip().strip('"')
                    if v.startswith("~"):
                        continue  # the home: outside the worktree, read-only or hidden already
                    target = os.path.normpath(os.path.join(wt, gd, v))
                    if _under(target, wt) and target != wt:
                        out.append(os.path.relpath(target, wt))
    return out


def mount_ops(wt: str, found: dict, lifted) -> tuple[list[tuple], list[str]]:
    """("protect", path, "", readonly) for linux/mounts.py, outermost first, and the
    worktree-relative paths bound read-only. Lifted paths stay as they are; a symlink is
    not a mount target (its target inside the worktree is bound instead)."""
    ops, shown = [], []
    for rel in sorted(found, key=lambda r: (r.count("/"), r)):
        entry = found[rel]
        if lift_class(rel) in lifted:
            continue
        path = os.path.join(wt, rel)
        if entry.ident[2] == stat_mod.S_IFLNK:
            real = realpath(path)
            if not _under(real, wt) or real == wt or not exists(real):
                continue  # outside the worktree: read-only (or hidden) like the rest of the host
            path = real
        ops.append(("protect", path, "", entry.kind != "gitdir"))
        if entry.kind != "gitdir":
            shown.append(rel)
    return ops, shown


# -- after the cell ---------------------------------------------------------------

def digests(wt: str, found: dict, lifted) -> dict[str, str]:
    """Content of the lifted paths: {worktree-relative file: sha256 | "dir" | "link:<target>"}."""
    from .util.digest import file_sha256
    out: dict[str, str] = {}
    roots = [rel for rel in found if lift_class(rel) in lifted]
    roots += [rel for rel in TOP if rel in lifted and rel not in found]
    for rel in roots:
        if _symlinked_parent(wt, rel) is not None:
            continue  # outside the worktree: not the cell's to change, not ours to read
        top = os.path.join(wt, rel)
        for path in _walk(top):
            r = os.path.relpath(path, wt)
            with suppress(OSError):
                st = os.lstat(path)
                if stat_mod.S_ISLNK(st.st_mode):
                    out[r] = "link:" + os.readlink(path)
                elif stat_mod.S_ISDIR(st.st_mode):
                    out[r] = "dir"
                elif stat_mod.S_ISREG(st.st_mode):
                    with open(path, "rb") as f:
                        out[r] = "sha256:" + file_sha256(f)[1]
    return out


def _walk(top: str, limit: int = 10000):
    """top and what lies beneath it, never following a symlink; at most `limit` entries."""
    if not os.path.lexists(top):
        return
    yield top
    if os.path.islink(top) or not os.path.isdir(top):
        return
    n = 0
    for d, dirs, files in os.walk(top):
        for name in dirs + files:
            n += 1
            if n > limit:
                return
            yield os.path.join(d, name)


def config_is_safe(text: str) -> bool:
    """A git config file whose every key is in SAFE_CONFIG_KEYS. Conservative: a line this
    reader does not understand (a continuation, a key after a section header) is unsafe."""
    section = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            head, close, rest = line[1:].partition("]")
            if not close or rest.strip() and rest.strip()[0] not in "#;":
                return False
            name, _, sub = head.strip().partition(" ")
            section = name.lower() + (".*" if sub.strip() else "")
            if "." in name:  # the old [section.subsection] form
                section = name.split(".", 1)[0].lower() + ".*"
            continue
        if line.endswith("\\") or not section:
            return False
        key = line.split("=", 1)[0].strip().lower()
        if not key or not all(c.isalnum() or c == "-" for c in key):
            return False
        full = f"{section}.{key}"
        from fnmatch import fnmatchcase  # only for a git directory a cell created: off the start path
        if not any(fnmatchcase(full, pat) for pat in SAFE_CONFIG_KEYS):
            return False
    return True


def _fresh_gitdir(rel: str, fresh: set) -> str | None:
    return next((g for g in fresh if _under(rel, g) and rel != g), None)


def settle(wt: str, baseline: dict, lifted, before_digests: dict, quarantine: str) -> dict:
    """After the cell's tree is dead: move what the cell planted out of the worktree into
    `quarantine` (the cell's record directory), and diff the lifted paths. The receipt's
    `protected` section: {"quarantined": [{"path", "to", "why"}], "changed": [...]}."""
    now = scan(wt)
    moved: list[dict] = []

    def move(rel: str, why: str) -> None:
        if any(_under(rel, m["path"]) for m in moved):
            return
        # never move what lies outside the worktree: a parent the cell turned into a symlink
        # (.claude -> ~/.claude) goes itself, instead of what it points at
        link = _symlinked_parent(wt, rel)
        if link is not None:
            rel, why = link, f"a symlink that leads a protected path out of the worktree ({why})"
            if any(_under(rel, m["path"]) for m in moved):
                return
        dst = os.path.join(quarantine, rel)
        try:
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            import shutil
            shutil.move(os.path.join(wt, rel), dst)
            moved.append({"path": rel, "to": dst, "why": why})
        except OSError as e:
            moved.append({"path": rel, "to": None, "why": why, "error": str(e)})

    def same(rel: str) -> bool:
        return baseline.get(rel) is not None and tuple(baseline[rel][1]) == now[rel].ident

    fresh = {rel for rel, e in now.items() if e.kind == "gitdir" and not same(rel)}
    for rel in sorted(now, key=lambda r: (r.count("/"), r)):
        entry = now[rel]
        if entry.kind == "gitdir" or same(rel) or lift_class(rel) in lifted:
            continue
        if any(_under(rel, m["path"]) for m in moved):
            continue
        gd = _fresh_gitdir(rel, fresh)
        name = os.path.basename(rel)
        why = "replaced" if baseline.get(rel) is not None else "created"
        if gd is not None and name == "hooks":
            # a new repository's hooks directory holds git's *.sample files: only the rest goes
            for n in sorted(os.listdir(os.path.join(wt, rel)) if os.path.isdir(os.path.join(wt, rel)) else []):
                if not (n.endswith(".sample") and os.path.isfile(os.path.join(wt, rel, n))
                        and not os.path.islink(os.path.join(wt, rel, n))):
                    move(os.path.join(rel, n), "created in a new git directory's hooks")
            continue
        if gd is not None and name in ("config", "config.worktree") and entry.ident[2] == stat_mod.S_IFREG:
            if config_is_safe(_read_small(os.path.join(wt, rel), 1 << 20)):
                continue
            why = "created with keys that run programs"
        if gd is not None and name in ("commondir", "gitdir") and _pointer_stays(wt, rel, gd):
            continue
        if entry.kind == "pointer" and now.get(_pointed_gitdir(wt, rel) or "") is not None:
            continue  # a .git file naming a git directory inside the worktree, judged above (submodule init)
        move(rel, why)
    changed = _changes(before_digests, digests(wt, now, lifted)) if lifted else []
    return {"quarantined": moved, "changed": changed}


def _symlinked_parent(wt: str, rel: str) -> str | None:
    """The outermost parent of `rel` that is a symlink, if any (worktree-relative)."""
    parts = rel.split("/")
    for i in range(1, len(parts)):
        if os.path.islink(os.path.join(wt, *parts[:i])):
            return "/".join(parts[:i])
    return None


def _pointer_stays(wt: str, rel: str, gitdir: str) -> bool:
    """A new linked worktree's commondir naming the top git directory, or its gitdir naming a
    `.git` file inside the worktree: what `git worktree add` writes."""
    text = _read_small(os.path.join(wt, rel), 4096).strip()
    target = os.path.normpath(os.path.join(wt, gitdir, text))
    if os.path.basename(rel) == "commondir":
        return target == os.path.join(wt, ".git")
    return _under(target, wt) and os.path.basename(target) == ".git"


def _changes(before: dict, after: dict) -> list[dict]:
    out = []
    for rel in sorted(before.keys() | after.keys()):
        b, a = before.get(rel), after.get(rel)
        if b == a:
            continue
        change = "added" if b is None else "removed" if a is None else "modified"
        item = {"path": rel, "change": change}
        if b is not None and b != "dir":
            item["before"] = b
        if a is not None and a != "dir":
            item["after"] = a
        out.append(item)
    return out


def as_plan(found: dict) -> dict:
    """The baseline in a form a plan (and JSON) carries: {rel: [kind, [dev, ino, type]]}."""
    return {rel: [e.kind, list(e.ident)] for rel, e in found.items()}


def start(plan) -> dict:
    """The baseline, just before a worktree-writing cell starts; kept in its record directory too: the
    janitor that concludes the cell of a dead controller settles from it (settle_cell)."""
    wt, lifted = plan.spec.worktree, plan.protected_lifted
    found = scan(wt)
    snap = {"worktree": wt, "baseline": as_plan(found), "digests": digests(wt, found, lifted) if lifted else {},
            "lifted": list(lifted)}
    # the same bytes json.dump wrote, through the C encoder (json.dump is the pure-Python one) and one write
    fd = fs.open_empty(os.path.join(plan.cell_dir, "protect-start.json"), 0o666)  # no flush at its close
    try:
        data = json.dumps(snap).encode()
        while data:
            data = data[os.write(fd, data):]
    finally:
        os.close(fd)
    return snap


def settle_cell(journal, run_id: str, cell_id: str, cell_dir: str, snap: dict | None = None, **event) -> dict | None:
    """The tree is dead: settle from the start snapshot (`snap`, else start()'s file; None without one: a
    read-only role's cell, or one that ended before its start was noted); journaled when anything moved."""
    if snap is None:
        try:
            with open(os.path.join(cell_dir, "protect-start.json")) as f:
                snap = json.load(f)
        except (OSError, ValueError):
            return None
    out = settle(snap["worktree"], snap["baseline"], snap["lifted"], snap["digests"],
                 os.path.join(cell_dir, "quarantine"))
    if out["quarantined"]:
        journal.add_event("protected.quarantined", run_id, cell_id, paths=out["quarantined"], **event)
    return out
