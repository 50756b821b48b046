"""Selftest gate for issue 25, door 6: code a cell plants in its worktree runs on the host.

AUTOEXEC_FILES: in a scratch git worktree of its own (made by hand: no git runs on the
host), a cell of the selftest role tries what a hostile cell would: core.fsmonitor in
.git/config, a pre-commit hook, .vscode/tasks.json, `.git` moved aside for a copy, a new
.mcp.json. The gate is judged from the host by reading the files, never by running git:
if the door were open, a host `git status` would run the planted program, and the
selftest must not do that on a user's machine.
"""
from __future__ import annotations

import os

from .isolation import _gate

# The start of every planting probe (tests/test_doors_autoexec.py's too). argv[1]: the marker a planted
# program would create (it lies outside the worktree). attempt(name, fn, done) notes in `out` `done` when
# fn worked, else why it was refused; the probe prints `out` as its last line.
P_ATTEMPT = r'''
import json, os, shutil, subprocess, sys
marker = sys.argv[1] if len(sys.argv) > 1 else ""
out = {}
def attempt(name, fn, done="written"):
    try:
        fn()
        out[name] = done
    except OSError as e:
        out[name] = e.strerror
def append(path, text, mode="a"):
    with open(path, mode) as f:
        f.write(text)
'''

P_PLANT = P_ATTEMPT + r'''
attempt(".git/config", lambda: append(".git/config", "[core]\n\tfsmonitor = touch %s\n" % marker))
attempt(".git/hooks/pre-commit", lambda: append(".git/hooks/pre-commit", "#!/bin/sh\ntouch %s\n" % marker))
attempt(".vscode/tasks.json", lambda: append(".vscode/tasks.json", "touch %s\n" % marker))
attempt("rename .git", lambda: os.rename(".git", ".git-aside"), "moved")
attempt(".mcp.json", lambda: append(".mcp.json", '{"mcpServers": {"x": {"command": "touch %s"}}}' % marker))
git = shutil.which("git")
if git:
    r = subprocess.run([git, "config", "core.hooksPath", "planted"], capture_output=True, text=True)
    out["git config core.hooksPath"] = "written" if r.returncode == 0 else (r.stderr.strip() or "refused")
print(json.dumps(out))
'''

CONFIG = "[core]\n\trepositoryformatversion = 0\n\tfilemode = true\n\tbare = false\n"
TASKS = '{"version": "2.0.0", "tasks": []}\n'


def _scratch_repo(top: str, uid: int | None) -> str:
    """A minimal git worktree written file by file (HEAD, config, objects, refs, hooks) and a
    .vscode/tasks.json: what git and an editor would find in a real project."""
    wt = os.path.join(top, "autoexec-worktree")
    for d in (".git/objects", ".git/refs/heads", ".git/hooks", ".vscode"):
        os.makedirs(os.path.join(wt, d), exist_ok=True)
    for rel, text in ((".git/HEAD", "ref: refs/heads/main\n"), (".git/config", CONFIG), (".vscode/tasks.json", TASKS),
                      ("README", "scratch worktree of agnsup selftest\n")):
        with open(os.path.join(wt, rel), "w") as f:
            f.write(text)
    if uid is not None:  # the cell's worktree must be its own to write: only the protection may stop it
        for d, dirs, files in os.walk(wt):
            for p in [d] + [os.path.join(d, n) for n in dirs + files]:
                os.lchown(p, uid, uid)
    return wt


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def gate_autoexec_files(h) -> dict:
    name = "AUTOEXEC_FILES"
    wt = _scratch_repo(h.root, h.user)
    marker = os.path.join(h.outside, f"autoexec-{h.token}")
    git_ino = os.lstat(os.path.join(wt, ".git")).st_ino
    res = h.run(["python3", "-c", P_PLANT, marker], workdir=wt)
    if "error" in res:
        why = "the governance gate refused the probe before it ran (not counted)" if res.get("denied") else \
            "the probe could not run"
        return _gate(name, "FAIL", f"{why}: {res['error']}")
    tried = (res.get("stdout") or "").strip()
    # judged from the host, by the files alone: what a later host `git status` / editor would find
    found = []
    for gitdir in (".git", ".git-aside"):  # where the cell wrote, had it moved .git aside
        config = (_read(os.path.join(wt, gitdir, "config")) or "").lower()
        if "fsmonitor" in config or "hookspath" in config:
            found.append(f"{gitdir}/config holds a planted key (a host git would run it)")
        if os.path.lexists(os.path.join(wt, gitdir, "hooks", "pre-commit")):
            found.append(f"{gitdir}/hooks/pre-commit exists (a host git commit would run it)")
    if _read(os.path.join(wt, ".vscode", "tasks.json")) != TASKS:
        found.append(".vscode/tasks.json changed")
    if not os.path.isdir(os.path.join(wt, ".git")) or os.lstat(os.path.join(wt, ".git")).st_ino != git_ino:
        found.append(".git was moved aside or replaced")
    if os.path.lexists(os.path.join(wt, ".mcp.json")):
        found.append(".mcp.json the cell created is still in the worktree")
    if os.path.exists(marker):
        found.append("the planted program ran")
    quarantined = [m["path"] for m in (res["receipt_data"].get("protected") or {}).get("quarantined", [])]
    if found:
        return _gate(name, "FAIL", f"{'; '.join(found)}. The cell's attempts: {tried}")
    return _gate(name, "PASS", f"nothing a host git or editor would run was planted; quarantined after the cell: "
                 f"{quarantined}. The cell's attempts: {tried}")


RUNNERS = {"AUTOEXEC_FILES": gate_autoexec_files}
