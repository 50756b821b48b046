"""linux.fs.open_empty: the files a cell's controller fills are opened without O_TRUNC (ext4 allocates and starts
writing back a file truncated to size 0 at its close: auto_da_alloc), and a file that is not empty is emptied."""
import os

from agnsup import changes
from agnsup.linux import fs


def test_a_missing_file_is_made_and_a_full_one_emptied_without_o_trunc(tmp_path, monkeypatch):
    flags, real = [], os.open
    monkeypatch.setattr(os, "open", lambda p, f, *a, **k: (flags.append(f), real(p, f, *a, **k))[1])
    new, full = str(tmp_path / "new"), str(tmp_path / "full")
    with open(full, "w") as f:
        f.write("what an earlier writer left, longer than what comes")
    for path in (new, full):
        fd = fs.open_empty(path, 0o640)
        try:
            os.write(fd, b"short")
        finally:
            os.close(fd)
        with open(path, "rb") as f:
            assert f.read() == b"short"
    monkeypatch.setattr(os, "open", real)
    assert oct(os.stat(new).st_mode & 0o777) == oct(0o640 & ~_umask())
    assert flags and not [f for f in flags if f & os.O_TRUNC]


def test_the_pending_marker_is_written_without_o_trunc_and_rewritten_whole(tmp_path, monkeypatch):
    state = str(tmp_path)
    flags, real = [], os.open
    monkeypatch.setattr(os, "open", lambda p, f, *a, **k: (flags.append((str(p), f)), real(p, f, *a, **k))[1])
    changes._mark_pending(state, "R", "rec1", {"worktree": "/w", "pad": "x" * 100}, owner=(os.getuid(), os.getgid()))
    changes._mark_pending(state, "R", "rec1", {"worktree": "/w"}, owner=(os.getuid(), os.getgid()))
    monkeypatch.setattr(os, "open", real)
    assert changes._pending_meta(state, "R", "rec1") == {"worktree": "/w"}
    assert not [p for p, f in flags if "pending" in p and f & os.O_TRUNC]


def _umask() -> int:
    m = os.umask(0)
    os.umask(m)
    return m
