"""StateRoot.other_roots in a controller of many cells (issue 29): the registry's listing is kept while the
directory is unchanged, and what it kept never hides a root registered later or a root that moved."""
import os
import time

import pytest

from agnsup.store import state as statemod
from agnsup.store.state import StateRoot


def _root(path) -> str:
    os.makedirs(path)
    open(os.path.join(path, "journal.db"), "w").close()
    return str(path)


def _others(me) -> list[str]:
    """other_roots without the host's default roots (/var/lib/agnsup, where it exists)."""
    return [r for r in StateRoot(me).other_roots() if r not in statemod.DEFAULT_ROOTS]


def _age(reg) -> None:
    """The registry's last change two seconds ago: a listing of it now is kept."""
    old = time.time() - 2
    os.utime(reg, (old, old))


@pytest.fixture
def reg(tmp_path, monkeypatch):
    """An empty roots registry of the test's own, and no listing kept from another test."""
    reg = tmp_path / "reg"
    reg.mkdir()
    monkeypatch.setenv("AGNSUP_ROOTS_REGISTRY", str(reg))
    monkeypatch.setattr(statemod, "_LISTED", {})
    return reg


def test_a_root_registered_after_a_kept_listing_is_still_hidden(tmp_path, reg):
    me, a, b = _root(tmp_path / "me"), _root(tmp_path / "a"), _root(tmp_path / "b")
    os.symlink(a, reg / "a")
    _age(reg)
    assert _others(me) == [a]
    assert str(reg) in statemod._LISTED  # kept: the next cell reads no link and resolves no target
    assert _others(me) == [a]
    os.symlink(b, reg / "b")  # a new root: the directory changed
    assert _others(me) == [a, b]


def test_a_recent_listing_is_not_kept(tmp_path, reg):
    """A change in the same timestamp tick as the listing would not move the mtime: a listing made within a
    second of the registry's last change is used once, never kept."""
    me, a = _root(tmp_path / "me"), _root(tmp_path / "a")
    os.symlink(a, reg / "a")
    assert _others(me) == [a]
    assert str(reg) not in statemod._LISTED


def test_a_root_whose_path_now_leads_elsewhere_is_hidden_where_it_is(tmp_path, reg):
    """The kept real path of a root is used only while it is still the same directory: a root moved and
    left a symlink at its old path is hidden at its new real path."""
    me, a = _root(tmp_path / "me"), _root(tmp_path / "a")
    os.symlink(a, reg / "a")
    _age(reg)
    assert _others(me) == [a]
    moved = str(tmp_path / "moved")
    os.rename(a, moved)
    os.symlink(moved, a)
    assert _others(me) == [moved]
    os.unlink(a)  # gone: its entry is dropped
    assert _others(me) == []
    assert not os.path.lexists(reg / "a")
