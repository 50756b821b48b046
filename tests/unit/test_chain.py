"""The journal's hash chain (issue 32) on a real SQLite file: every events/receipts row chained in its own
transaction, the head written after COMMIT, and chain.verify naming what a hostile host process changed."""
import json
import os
import sqlite3
import time

import pytest

from agnsup.store import chain
from agnsup.store.journal import Journal

from test_store import begin, journal_of, receipt


@pytest.fixture
def j(tmp_path):
    journal = journal_of(tmp_path)
    yield journal
    journal.close()


def cells(j, n=3, first=0):
    for i in range(first, first + n):
        begin(j, cell=f"c{i}")
        j.mark_running("R", f"c{i}")
        j.conclude_cell(receipt(cell=f"c{i}"), None)


def check(j, key=None):
    return chain.verify(j.chain_snapshot(), os.path.dirname(j.path), key)


def sql(j, stmt, args=()):
    db = sqlite3.connect(j.path)
    try:
        db.execute(stmt, args)
        db.commit()
    finally:
        db.close()


def head(j):
    return chain.read_head(chain.head_path(os.path.dirname(j.path)))


def first_broken(r):
    assert not r["ok"], r
    return r["broken"][0]


def test_every_event_and_receipt_is_chained_in_its_own_transaction_and_anchored(j):
    cells(j)
    snap = j.chain_snapshot()
    rows = snap["chain"]
    assert len(rows) == len(snap["events"]) + len(snap["receipts"]) > 0
    assert rows[0][3] == chain.ZERO and all(b[3] == a[4] for a, b in zip(rows, rows[1:]))
    assert {(r[1], r[2]) for r in rows} == {("events", i) for i in snap["events"]} | \
        {("receipts", i) for i in snap["receipts"]}
    r = check(j)
    assert r["ok"] and r["records"] == len(rows) and r["anchored"] == len(rows) and r["not_anchored"] == 0
    assert head(j)["seq"] == len(rows) and head(j)["hash"] == rows[-1][4]
    assert os.stat(chain.head_path(os.path.dirname(j.path))).st_mode & 0o777 == 0o600


def test_a_transaction_that_writes_no_event_adds_no_chain_record(j):
    cells(j, 1)
    before = len(j.chain_snapshot()["chain"])
    j.set_change_state([("R", "x")], "dropped")
    j.end_controller("ctl-1")
    assert len(j.chain_snapshot()["chain"]) == before


def test_an_edited_event_is_named_by_its_seq(j):
    cells(j)
    seq, _, row = next(r for r in j.chain_snapshot()["chain"] if r[1] == "events" and r[0] > 3)[:3]
    sql(j, "UPDATE events SET data='{\"reason\":\"nothing to see\"}' WHERE id=?", (row,))
    b = first_broken(check(j))
    assert b["seq"] == seq and "changed" in b["what"]


def test_a_deleted_receipt_row_is_named_by_its_seq(j):
    cells(j)
    seq, _, row = next(r for r in j.chain_snapshot()["chain"] if r[1] == "receipts")[:3]
    sql(j, "DELETE FROM receipts WHERE id=?", (row,))
    b = first_broken(check(j))
    assert b["seq"] == seq and "missing" in b["what"]


def test_a_deleted_last_record_with_its_chain_row_leaves_the_head_past_the_end(j):
    cells(j)
    last = j.chain_snapshot()["chain"][-1]
    sql(j, f"DELETE FROM {last[1]} WHERE id=?", (last[2],))
    sql(j, "DELETE FROM chain WHERE seq=?", (last[0],))
    b = first_broken(check(j))
    assert b["seq"] == last[0] and "ends at" in b["what"]


def test_a_row_added_behind_the_journal_is_not_in_the_chain(j):
    cells(j)
    sql(j, "INSERT INTO events(t, run_id, cell_id, kind, data) VALUES (1, 'R', 'c0', 'state.exited', NULL)")
    assert any("not in the chain" in b["what"] for b in check(j)["broken"])


def test_a_rewritten_chain_does_not_match_its_head(j):
    """A naive forger recomputes every hash after an edit: the head (outside journal.db) still names the old one."""
    cells(j)
    snap = j.chain_snapshot()
    sql(j, "UPDATE events SET kind='state.forged' WHERE id=?", (snap["chain"][0][2],))
    snap = j.chain_snapshot()
    prev = chain.ZERO
    for seq, tbl, row, _, _, anchor in snap["chain"]:
        h = chain.link(prev, tbl, anchor, snap[tbl][row])
        sql(j, "UPDATE chain SET prev=?, hash=? WHERE seq=?", (prev, h, seq))
        prev = h
    b = first_broken(check(j))
    assert "head's hash" in b["what"]


def test_records_past_a_head_that_was_never_written_are_not_yet_anchored_and_the_next_writer_anchors_them(
        j, monkeypatch):
    cells(j, 1)
    anchored = head(j)["seq"]
    real = chain.write_head
    monkeypatch.setattr(chain, "write_head", lambda *a, **k: (_ for _ in ()).throw(OSError("died")))
    cells(j, 1, first=1)
    r = check(j)
    assert r["ok"] and r["anchored"] == anchored and r["not_anchored"] == r["records"] - anchored > 0
    assert "not yet anchored" in r["note"]
    monkeypatch.setattr(chain, "write_head", real)
    j.add_event("later")
    r = check(j)
    assert r["ok"] and r["not_anchored"] == 0 and head(j)["seq"] == r["records"]


def test_a_head_replaced_by_an_older_one_is_a_rollback(j):
    cells(j, 1)
    with open(chain.head_path(os.path.dirname(j.path))) as f:
        old = f.read()
    cells(j, 2, first=1)
    with open(chain.head_path(os.path.dirname(j.path)), "w") as f:
        f.write(old)
    assert any("rolled back" in b["what"] for b in check(j)["broken"])


def test_the_head_only_moves_forward(j, tmp_path):
    cells(j, 1)
    h = head(j)
    assert chain.write_head(str(tmp_path), 1, "x" * 64) == h["seq"]
    assert head(j) == h


def test_a_missing_head_file_after_anchoring_is_broken(j):
    cells(j, 2)
    os.unlink(chain.head_path(os.path.dirname(j.path)))
    assert any("head file" in b["what"] and "missing" in b["what"] for b in check(j)["broken"])


def test_prune_keeps_the_chain_rows_and_verify_says_pruned(j):
    cells(j, 3)
    before = check(j)["records"]
    j.prune([("R", "c0", time.time(), None), ("R", "c1", time.time(), None)], time.time())
    r = check(j)
    assert r["ok"], r["broken"]
    assert r["pruned"] > 0 and r["records"] > before
    # a row removed behind the journal's back is still broken next to pruned ones
    row = next(x for x in j.chain_snapshot()["chain"] if x[1] == "receipts" and x[0] not in chain.pruned_seqs(
        j.chain_snapshot()["events"]))
    sql(j, "DELETE FROM receipts WHERE id=?", (row[2],))
    assert first_broken(check(j))["seq"] == row[0]


def test_a_second_prune_keeps_the_first_prunes_record(j):
    cells(j, 3)
    j.prune([("R", "c0", time.time(), None)], time.time() + 10)
    j.prune([("R", "c1", time.time(), None)], time.time() + 10)
    assert check(j)["ok"]


def test_the_migration_chains_the_rows_already_there(tmp_path):
    path = str(tmp_path / "journal.db")
    j = Journal(path)
    j.add_event("old", "R", None, n=1)
    j.add_event("old", "R", None, n=2)
    j.close()
    sql(j, "DROP TABLE chain")
    sql(j, "PRAGMA user_version = 7")
    os.unlink(chain.head_path(str(tmp_path)))
    j = Journal(path)
    try:
        assert j.db.execute("SELECT COUNT(*) FROM chain").fetchone()[0] == 2
        j.add_event("new")
        r = check(j)
        assert r["ok"] and r["records"] == 3 and r["anchored"] == 3
    finally:
        j.close()


def test_restart_chain_names_the_old_head_and_anchors_at_the_new_end(tmp_path):
    chain.write_head(str(tmp_path), 99, "a" * 64)
    old = chain.read_head(chain.head_path(str(tmp_path)))
    j = Journal(str(tmp_path / "journal.db"))
    try:
        j.add_event("x")  # a head behind the old one is not written
        assert head(j) == old
        j.restart_chain(old)
        r = check(j)
        assert r["ok"] and head(j)["seq"] == 2
        ev = [json.loads(e[5]) for e in j.chain_snapshot()["events"].values() if e[4] == "chain.restarted"]
        assert ev == [{"old_head": old}]
    finally:
        j.close()


def test_the_export_passes_only_receipts_whose_chain_record_holds(j):
    cells(j, 2)
    rows = list(j.chained_receipts("cell"))
    assert [r[7] for r in rows] == ["c0", "c1"] and all(r[1] == chain.link(r[2], "receipts", r[3], r[4:]) for r in rows)
    sql(j, "UPDATE receipts SET data='{}' WHERE id=?", (rows[0][4],))
    assert [r[7] for r in j.chained_receipts("cell")] == ["c1"]


def test_canonical_form_and_ranges():
    assert chain.canonical("events", 3, (1, 0.1, "R", None, "k", None)) == '["events",3,1,0.1,"R",null,"k",null]'
    assert chain.link(chain.ZERO, "events", 0, (1,)) != chain.link(chain.ZERO, "events", 1, (1,))
    assert chain.ranges([5, 1, 2, 3, 7, 8]) == [[1, 3], [5, 5], [7, 8]]


# -- signing -------------------------------------------------------------------------
@pytest.fixture
def keys(tmp_path, monkeypatch):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    out = {}
    for name in ("mine", "other"):
        k = Ed25519PrivateKey.generate()
        priv, pub = tmp_path / f"{name}.key", tmp_path / f"{name}.pub"
        priv.write_bytes(k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                         serialization.NoEncryption()))
        pub.write_bytes(k.public_key().public_bytes(serialization.Encoding.PEM,
                                                    serialization.PublicFormat.SubjectPublicKeyInfo))
        out[name] = (str(priv), chain.load_public_key(str(pub)))
    monkeypatch.setenv(chain.KEY_ENV, out["mine"][0])
    monkeypatch.setattr(chain, "_SIGNER", [])
    return out


def test_a_signed_head_verifies_with_its_key_and_not_with_another(j, keys):
    cells(j, 1)
    assert head(j)["sig"]
    r = check(j, keys["mine"][1])
    assert r["ok"] and r["signature"] is True
    assert "signature does not verify" in first_broken(check(j, keys["other"][1]))["what"]


def test_a_head_forged_without_the_key_is_broken(j, keys):
    cells(j, 2)
    snap = j.chain_snapshot()["chain"]
    h = head(j)
    forged = {"seq": snap[3][0], "hash": snap[3][4], "t": h["t"], "sig": h["sig"]}  # an older head, the newer sig
    with open(chain.head_path(os.path.dirname(j.path)), "w") as f:
        json.dump(forged, f)
    assert any("signature does not verify" in b["what"] for b in check(j, keys["mine"][1])["broken"])
    del forged["sig"]
    with open(chain.head_path(os.path.dirname(j.path)), "w") as f:
        json.dump(forged, f)
    assert any("not signed" in b["what"] for b in check(j, keys["mine"][1])["broken"])


def test_a_key_that_does_not_load_leaves_the_head_unsigned_and_says_why(j, tmp_path, monkeypatch):
    bad = tmp_path / "bad.key"
    bad.write_text("not a key")
    monkeypatch.setenv(chain.KEY_ENV, str(bad))
    monkeypatch.setattr(chain, "_SIGNER", [])
    cells(j, 1)
    assert "sig" not in head(j) and "cannot load" in head(j)["unsigned"] and str(bad) not in head(j)["unsigned"]


def test_a_writer_that_saw_the_old_chains_head_does_not_break_the_restarted_one(tmp_path):
    """A long-lived controller (serve) saw head 40 of the old chain; `journal repair` restarts the chain at 1:
    its next records' anchors stay within the new chain, so verify holds."""
    path = str(tmp_path / "journal.db")
    live = Journal(path)
    for i in range(40):
        live.add_event("old", n=i)
    assert live._anchor == 40
    repairer = Journal(path)
    try:
        repairer.db.execute("DELETE FROM chain")  # as a rebuilt journal's empty chain
        repairer.db.execute("DELETE FROM events")
        repairer.restart_chain(head(live))
        live.add_event("after the restart")
        r = check(live)
        assert r["ok"], r["broken"]
    finally:
        repairer.close()
        live.close()


def test_a_receipt_file_is_held_to_the_journal_only_where_the_journal_names_it(tmp_path):
    """A controller that died after writing its receipt file and before journaling it: the janitor journals a
    receipt of its own and leaves the file; verify does not call that file changed. The file the journal
    names, edited or removed, is broken."""
    d = tmp_path / "cells" / "R"
    for c in ("named", "orphan", "removed"):
        (d / c).mkdir(parents=True)
        (d / c / "receipt.json").write_text(json.dumps({"cell_id": c, "v": "on disk"}))
    os.unlink(d / "removed" / "receipt.json")
    rows = {i: (i, "cell", "R", c, 1.0, json.dumps({"cell_id": c, "v": "journaled"}))
            for i, c in enumerate(("named", "orphan", "removed"), 1)}
    snap = {"chain": [], "events": {}, "receipts": {}, "cells_on_disk": [("R", "named"), ("R", "orphan"),
                                                                          ("R", "removed")],
            "receipt_paths": {("R", c): str(d / c / "receipt.json") for c in ("named", "removed")}}
    snap["receipts"] = rows
    broken: list = []
    out = chain._receipt_files(snap, str(tmp_path), {}, broken)
    assert out == {"checked": 1, "changed": 1, "not_journaled": 1, "gone": 1}
    assert sorted(b["what"].split(" ")[2].split("/")[-2] for b in broken) == ["named", "removed"]


def test_writers_racing_on_one_journal_leave_an_intact_chain_and_a_head_at_its_end(tmp_path):
    """Two connections (two controllers) write at once: each transaction chains after the other's, the head only
    moves forward, and no record's anchor is past the head."""
    import threading
    path = str(tmp_path / "journal.db")
    Journal(path).close()
    journals = [Journal(path), Journal(path)]
    try:
        def write(j, n):
            for i in range(n):
                j.add_event("race", n=i)
        threads = [threading.Thread(target=write, args=(j, 60)) for j in journals]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        r = check(journals[0])
        assert r["ok"], r["broken"]
        assert r["records"] == 120 and head(journals[0])["seq"] == 120
    finally:
        for j in journals:
            j.close()
