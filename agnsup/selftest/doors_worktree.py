"""Selftest door for issue 26: a cell destroys its worktree in a spelling no text gate reads.

WORKTREE_DESTROYED: in a scratch git worktree of its own (made by hand, as for AUTOEXEC_FILES),
a cell of the selftest role removes the sources and `.git`'s history (its config and hooks are read-only
mount points), empties a file and plants a symlink, through Python's shutil.rmtree: the gate lets it
through, and it really destroys. HELD when `agnsup undo` of
that cell (supervisor.undo_changes, what the CLI, the API and MCP call) gives back the tree exactly:
every path's type, mode, owner, size, content and symlink target. ENV_BLOCKED when the cell could
not be captured on this host (the receipt's changes.why: a state root on overlayfs, NFS...).
"""
from __future__ import annotations

import hashlib
import os
import stat

from .doors_autoexec import _scratch_repo
from .isolation import _gate

P_DESTROY = r'''
import os, shutil
shutil.rmtree("src")
shutil.rmtree(".git", ignore_errors=True)  # its config and hooks are read-only mount points: the rest goes
open("README", "w").close()
os.symlink("/nowhere", "link")
'''


def _listing(root: str) -> dict:
    out = {}
    for d, dirs, files in os.walk(root):
        for p in [d] + [os.path.join(d, n) for n in dirs + files]:
            st = os.lstat(p)
            what = os.readlink(p) if stat.S_ISLNK(st.st_mode) else None
            if stat.S_ISREG(st.st_mode):
                with open(p, "rb") as f:
                    what = hashlib.sha256(f.read()).hexdigest()
            out[os.path.relpath(p, root)] = (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode), st.st_uid,
                                             st.st_gid, 0 if stat.S_ISDIR(st.st_mode) else st.st_size, what)
    return out


def gate_worktree_destroyed(h) -> dict:
    name = "WORKTREE_DESTROYED"
    wt = _scratch_repo(os.path.join(h.root, "reversible"), None)
    os.makedirs(os.path.join(wt, "src", "pkg"))
    for rel, text in (("src/app.py", "print('app')\n"), ("src/pkg/mod.py", "X = 1\n"),
                      (".git/objects/ab", "an object\n")):
        with open(os.path.join(wt, rel), "w") as f:
            f.write(text)
    if h.user is not None:  # the cell's worktree must be its own to destroy
        for d, dirs, files in os.walk(wt):
            for p in [d] + [os.path.join(d, n) for n in dirs + files]:
                os.lchown(p, h.user, h.user)
    before = _listing(wt)
    res = h.run(["python3", "-c", P_DESTROY], workdir=wt)
    if "error" in res:
        why = "the governance gate refused the probe (not counted: the door is about what it cannot read)" \
            if res.get("denied") else "the probe could not run"
        return _gate(name, "FAIL", f"{why}: {res['error']}")
    ch = res["receipt_data"].get("changes") or {}
    gaps = [g for g in (res["receipt_data"].get("isolation") or {}).get("not_in_force") or []
            if str(g).startswith("reversible")]
    if gaps:  # the host could not capture (a role or a call asking for live is not that: the door is open)
        return _gate(name, "ENV_BLOCKED: the cell was not captured here",
                     f"the receipt names it: {gaps[0]}")
    if os.path.exists(os.path.join(wt, "src")) or os.path.exists(os.path.join(wt, ".git", "HEAD")):
        return _gate(name, "FAIL", f"the probe did not destroy the worktree (exit {res.get('exit_code')}): "
                     f"{(res.get('stderr') or '').strip()[-300:]}")
    from ..errors import AgnsupError
    from ..supervisor import undo_changes
    from ..store.state import StateRoot
    state = StateRoot(h.state)
    j = state.journal()
    try:
        undone = undo_changes(state, j, res["cell_id"], "selftest")
    except AgnsupError as e:
        return _gate(name, "FAIL", f"the cell deleted src/ and .git's history; undo refused: {e.message}")
    finally:
        j.close()
    after = _listing(wt)
    if after != before:
        diff = sorted(set(before.items()) ^ set(after.items()))[:5]
        return _gate(name, "FAIL", f"the cell deleted src/ and .git's history; undo left the tree different: {diff}")
    return _gate(name, "PASS", "the cell deleted src/ and .git's history through shutil.rmtree (the gate let it "
                 f"through); agnsup undo put back all {len(before)} paths exactly ({ch.get('files')} changed, "
                 f"record {undone['records'][0]['record'] if undone.get('records') else '?'})")


RUNNERS = {"WORKTREE_DESTROYED": gate_worktree_destroyed}
