"""io.pump.Tape: the order of a live cell's output over its captured files (no processes)."""
from agnsup.io.pump import CHUNK_MAX, Tape


def _tape(tmp_path, out=b"", err=b""):
    (tmp_path / "out").write_bytes(out)
    (tmp_path / "err").write_bytes(err)
    return Tape({"stdout": str(tmp_path / "out"), "stderr": str(tmp_path / "err"), "tty": str(tmp_path / "out")})


def test_unread_entries_of_one_stream_merge_and_handed_ones_never_change(tmp_path):
    t = _tape(tmp_path, b"abcdef", b"XY")
    t.add("stdout", 0, 2)
    t.add("stdout", 2, 1)          # merged: nobody was handed seq 0 yet
    t.add("stderr", 0, 2)
    first = t.read(0, timeout=0)
    assert [(c["seq"], c["stream"], c["data"]) for c in first["chunks"]] == [(0, "stdout", b"abc"), (1, "stderr", b"XY")]
    t.add("stdout", 3, 3)
    assert t.read(0, timeout=0)["chunks"][0]["data"] == b"abc"  # handed: a new entry instead
    again = t.read(first["next"], timeout=0)
    assert [(c["seq"], c["data"]) for c in again["chunks"]] == [(2, b"def")] and not again["ended"]
    t.close()
    assert t.read(3, timeout=None) == {"chunks": [], "next": 3, "ended": True}


def test_max_bytes_returns_at_least_one_chunk_and_merging_stops_at_the_chunk_limit(tmp_path):
    t = _tape(tmp_path, b"x" * (CHUNK_MAX + 10))
    t.add("stdout", 0, CHUNK_MAX)
    t.add("stdout", CHUNK_MAX, 10)
    out = t.read(0, timeout=0, max_bytes=5)
    assert len(out["chunks"]) == 1 and len(out["chunks"][0]["data"]) == CHUNK_MAX and out["next"] == 1
    assert t.read(1, timeout=0, max_bytes=5)["chunks"][0]["data"] == b"x" * 10


def test_a_read_waits_only_as_long_as_asked(tmp_path):
    t = _tape(tmp_path)
    assert t.read(0, timeout=0.01) == {"chunks": [], "next": 0, "ended": False}


def test_a_large_write_becomes_chunks_of_at_most_the_chunk_limit(tmp_path):
    t = _tape(tmp_path, b"y" * (3 * CHUNK_MAX + 5))
    t.add("stdout", 0, 3 * CHUNK_MAX + 5)  # one splice of ~200 KiB
    out = t.read(0, timeout=0)
    assert [len(c["data"]) for c in out["chunks"]] == [CHUNK_MAX] * 3 + [5]
