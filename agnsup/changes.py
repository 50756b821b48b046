"""Reversible cells: what a cell changed in its worktree, kept so it can be seen and undone (issue 26).

A cell that writes its worktree runs over an overlayfs whose upper layer is
`<state>/changes/<run>/<cell>/upper`; when the cell's tree is dead, `commit`
moves the upper into the real worktree and each changed path's pre-cell
version into the record's `before/`. `undo` is the same operation the other
way round (a record of kind "undo": undo of an undo is a redo).

    <state>/changes/<run_id>/<record_id>/
        upper/ work/      while the cell runs (removed after commit)
        meta.json         the worktree, agent and id shift prepare() was told (for the janitor)
        plan.json         while committing (fsynced before the first step; removed after)
        before/<rel>      the pre-image of every changed path that existed before
        record.json       written atomically, last: the record (the truth; the journal indexes it)
    <state>/changes/pending/<run_id>+<record_id>
                          a layer or undo in flight whose journal row may be missing:
                          finish_all (the janitor) finishes it, inserts the row, drops the marker

Crash safety: apply(plan) is idempotent step by step (each step decided from what
is on disk), so the next commit attempt or the janitor finishes a plan a crash
interrupted: the worktree ends as the cell left it, never half-merged.
"""
from __future__ import annotations

from typing import NamedTuple

from .errors import ChangeConflict, NotReversible, UnknownId  # noqa: F401 - the errors this module raises

__all__ = ["Layer", "layer_dir", "prepare", "unsupported", "commit", "finish_all", "diff", "undo", "select",
           "prune", "drop_paths", "ChangeConflict", "NotReversible"]


class Layer(NamedTuple):
    dir: str     # <state>/changes/<run>/<cell>
    upper: str   # the overlay's upperdir
    work: str    # the overlay's workdir


def layer_dir(state_root: str, run_id: str, record_id: str) -> str:
    """<state>/changes/<run_id>/<record_id>."""
    raise NotImplementedError


def prepare(state_root: str, run_id: str, cell_id: str, owner: tuple[int, int] | None = None, *,
            worktree: str | None = None, agent_id: str | None = None, id_shift: int | None = None) -> Layer:
    """Make the cell's layer dirs (0700; owned by `owner` = (uid, gid) for a normal user's
    state root) before the child starts. `worktree`, `agent_id`, `id_shift` (optional) are
    noted in meta.json so that a janitor can commit what a dead controller's cell left."""
    raise NotImplementedError


def unsupported(state_root: str, worktree: str) -> str | None:
    """One line saying why this state root cannot hold an overlay upper layer for this
    worktree (overlayfs, NFS, FUSE, 9p, ... or no trusted.*/user.* xattrs), or None.
    No helper process: statfs f_type plus an xattr probe, cached per state root."""
    raise NotImplementedError


def commit(state_root: str, run_id: str, cell_id: str, worktree: str, *, agent_id: str,
           id_shift: int | None = None) -> dict:
    """The cell's tree is dead: its upper layer into the worktree, pre-images into before/,
    record.json last. Idempotent and resumable (a second call after a crash finishes the job).
    `id_shift` = BASE: owners BASE+n in the upper become n (a mapped cell whose upper could
    not be id-mapped). Returns the receipt's `changes` section:
    {"mode": "at_exit", "record": "<run>/<cell>", "worktree", "created", "modified", "deleted",
    "files", "bytes", "paths": [<=50], "more": n}; with files 0 and no "record" when nothing
    changed (no record kept, the layer dirs removed)."""
    raise NotImplementedError


def finish_all(state_root: str, journal) -> list[dict]:
    """The janitor: every layer, plan or record left in flight (pending/ markers) finished:
    a dead cell's upper committed, an interrupted commit or undo completed, a missing journal
    row inserted. A cell the journal says still runs is left alone. Returns one dict per item:
    {"run_id", "record_id", "cell_id", "action": "committed"|"finished"|"indexed"|"empty", "changes"}."""
    raise NotImplementedError


def diff(state, journal, record_id: str, run_id: str | None = None, stat: bool = False) -> dict:
    """What a record changed: {"record", "kind", "state", "counts", "entries": [...]}; each entry
    gets "diff" (unified text) for text files, "sizes" for binary ones; with `stat`, "added" and
    "removed" line counts instead of the text."""
    raise NotImplementedError


def undo(state, journal, record_ids, force: bool = False) -> dict:
    """Undo records (ids "run/record", or (run, record) pairs), newest first. Refuses, with nothing
    changed on disk: ChangeConflict (exit 75) when a later record touched the same paths or the
    worktree changed outside agnsup since (unless `force`); NotReversible for a record already
    undone or dropped, a live cell's, a worktree that moved. Returns {"undone": [...], "records": [...]}
    (the new undo records; undo of an undo record is a redo)."""
    raise NotImplementedError


def select(journal, run_id: str | None = None, agent_id: str | None = None, cell_id: str | None = None) -> list:
    """The journal rows of records in force (committed) for --run / --agent / a cell, newest first."""
    raise NotImplementedError


def prune(state, journal, keep: int, keep_bytes: int) -> list[str]:
    """Drop records past `keep` records or `keep_bytes` bytes of pre-images, oldest first:
    the directory freed, the journal row's state 'dropped'. Returns the dropped "run/record" ids."""
    raise NotImplementedError


def drop_paths(state_root: str, run_id: str, record_id: str, paths: list[str]) -> None:
    """protect.settle moved these worktree paths to quarantine after the commit: the record's
    entries for them now say what the worktree holds (absent), or go when nothing is left to undo."""
    raise NotImplementedError
