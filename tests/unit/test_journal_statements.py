"""What a cell's journal transactions send to SQLite, and that each shortcut writes the same records: the intent's
events in one INSERT (their ids and chain rows as one INSERT per event made them), one statement for the run's
state and the cell id's use, the chain's digests by OpenSSL in a controller of many cells (the same SHA-256 the
built-in verifies), the head rewritten in place without a stat."""
import hashlib
import json
import os
import time

import pytest

from agnsup.store import chain
from agnsup.store import journal as store

from test_store import begin, journal_of, receipt


@pytest.fixture
def j(tmp_path):
    journal = journal_of(tmp_path, "serve")
    yield journal
    journal.close()


def statements(j, fn):
    seen = []
    j.db.set_trace_callback(seen.append)
    try:
        fn()
    finally:
        j.db.set_trace_callback(None)
    return seen


def intent(j, cell="c1", stages=5):
    j.begin_cell({"run_id": "R", "cell_id": cell, "agent_id": "A", "role": "executor", "token": "t",
                  "controller_id": "ctl-1", "boot_id": "b", "cgroup": "{}", "tmpdir": None, "worktree": "/w",
                  "lock_path": None, "argv": '["true"]', "exe": "/bin/true", "created_at": time.time(), "grace": 1.0},
                 [{"stage": f"s{i}", "t": i, "data": {"n": i, "text": "x" * i}} for i in range(stages)])


def chained(j):
    """[(tbl, kind or receipt kind, data)] in chain order, each chain row's own row looked up by its id."""
    snap = j.chain_snapshot()
    out = []
    for _seq, tbl, row, *_ in snap["chain"]:
        content = snap[tbl][row]
        out.append((tbl, content[4] if tbl == "events" else content[1], content[5]))
    return out


def verified(j):
    r = chain.verify(j.chain_snapshot(), os.path.dirname(j.path))
    assert r["ok"], r["broken"]
    return r


def test_the_intent_inserts_its_events_and_their_chain_rows_with_one_statement_each(j):
    sent = statements(j, lambda: intent(j))
    inserts = [s.split("(")[0].strip() for s in sent if s.startswith("INSERT")]
    assert inserts == ["INSERT INTO runs", "INSERT INTO cells", "INSERT INTO events", "INSERT INTO chain"]
    assert len([s for s in sent if s.startswith("SELECT")]) == 2  # the run and the id's use; the chain's end
    kinds = [k for tbl, k, _ in chained(j)]
    assert kinds == [f"stage.s{i}" for i in range(5)] + ["state.starting"]
    assert [json.loads(d)["data"]["n"] for _, k, d in chained(j) if k.startswith("stage.")] == list(range(5))
    verified(j)


def test_batched_events_get_the_ids_sqlite_gave_them_after_the_newest_rows_were_deleted(j):
    """An INTEGER PRIMARY KEY's new rowid is one past the largest: after the newest events are gone (a prune), a
    batch reuses their ids, and each chain row must still name its own event."""
    intent(j, "c1")
    top = j.db.execute("SELECT MAX(id) FROM events").fetchone()[0]
    j.db.execute("DELETE FROM events WHERE id > ?", (top - 3,))  # as a prune of the newest rows
    intent(j, "c2", stages=3)
    tail = [(k, d) for tbl, k, d in chained(j)][-4:]
    assert [k for k, _ in tail] == ["stage.s0", "stage.s1", "stage.s2", "state.starting"]
    assert [json.loads(d)["data"]["n"] for k, d in tail[:3]] == [0, 1, 2]


def test_a_reused_cell_id_and_a_cancelled_run_are_refused_by_the_one_select(j):
    intent(j, "c1")
    with pytest.raises(store.RunNotActive, match="never reused"):
        intent(j, "c1")
    j.db.execute("INSERT INTO pruned(run_id, cell_id, ended_at, receipt_path, pruned_at) VALUES ('R2','p1',0,'',0)")
    with pytest.raises(store.RunNotActive, match="never reused"):
        j.begin_cell({"run_id": "R2", "cell_id": "p1", "agent_id": "A", "role": "executor", "token": "t",
                      "controller_id": "ctl-1", "boot_id": "b", "cgroup": "{}", "tmpdir": None, "worktree": "/w",
                      "lock_path": None, "argv": "[]", "exe": "/bin/true", "created_at": time.time(), "grace": 1.0},
                     [])
    assert j.run("R2") is None  # refused before its run was made (rolled back either way)
    j.record_cancel("run", "R", None, None, "cancelled (test)")
    with pytest.raises(store.RunNotActive, match="was cancelled"):
        intent(j, "c2")


def test_a_controller_of_many_cells_hashes_the_chain_with_openssl_and_the_builtin_verifies_it(j):
    j.checkpoint_behind()
    assert j._sha is hashlib.sha256 and chain.sha256 is not hashlib.sha256
    intent(j, "c1")
    j.mark_running("R", "c1")
    big = receipt()
    big["pad"] = '"quoted" ' * 3000  # a receipt's size, with what its canonical JSON escapes
    j.conclude_cell(big, None, text=json.dumps(big, sort_keys=True))
    r = verified(j)  # chain.verify hashes with the built-in sha256
    assert r["records"] == 9 and r["anchored"] == 9


def test_a_head_file_longer_than_a_head_is_cut_to_it_at_the_next_write(j):
    path = chain.head_path(os.path.dirname(j.path))
    begin(j)
    with open(path, "wb") as f:
        f.write(b"x" * 3000)  # garbage: verify says so until a writer replaces it
    j.mark_running("R", "c1")
    assert os.path.getsize(path) == chain.HEAD_SIZE
    assert chain.read_head(path)["seq"] == 3
    with open(path, "wb") as f:
        f.write(b"x" * 9000)  # longer than the writer's read of it
    j.conclude_cell(receipt(), None)
    assert os.path.getsize(path) == chain.HEAD_SIZE and chain.read_head(path)["seq"] == 5
    with open(path, "r+b") as f:
        f.truncate(100)
    j.add_event("test.short")
    assert os.path.getsize(path) == chain.HEAD_SIZE and chain.read_head(path)["seq"] == 6
    verified(j)


def test_the_head_this_process_wrote_is_not_parsed_again_and_another_writers_is(j, monkeypatch):
    """chain.write_head compares the file with the bytes it wrote last: the same bytes, the same seq; any other
    bytes (another writer's head) are parsed, and a head past this writer's seq is never moved back."""
    path = chain.head_path(os.path.dirname(j.path))
    begin(j)
    parsed, real = [], chain._parse
    monkeypatch.setattr(chain, "_parse", lambda raw: (parsed.append(raw), real(raw))[1])
    j.mark_running("R", "c1")
    j.conclude_cell(receipt(), None)
    assert parsed == [] and json.loads(_bytes(path))["seq"] == 5
    other = json.dumps({"seq": 100, "hash": "f" * 64, "t": 1.0}).encode().ljust(chain.HEAD_SIZE - 1) + b"\n"
    with open(path, "r+b") as f:
        f.write(other)  # another writer's (a cancel's) head, ahead of this one
    j.add_event("test.after")
    assert len(parsed) == 1 and _bytes(path) == other  # parsed, and not moved back to seq 6


def _bytes(path):
    with open(path, "rb") as f:
        return f.read()
