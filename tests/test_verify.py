"""Receipts nobody can rewrite (issue 32): real cells, then a hostile host process edits what they left
(journal rows, receipt files, the head) and `agnsup verify` names each change, exit 1; intact -> 0.

The head lives in the state root, which no cell sees: a cell cannot read or replace it (below), as
tests/test_isolation_basics.py::test_the_state_root_cannot_be_read_from_a_cell proves for journal.db.
"""
import json
import os
import sqlite3

import pytest

from agnsup.store import chain


def cells(agnsup, worktree, n=2, prefix="v"):
    for i in range(n):
        agnsup("run", "--workdir", worktree, "--cell", f"{prefix}{i}", "--", "sh", "-c", f"echo {prefix}{i}", check=0)


def verify(agnsup, *args, rc):
    cp = agnsup("verify", "--json", *args, check=rc)
    return json.loads(cp.out)


def sql(agnsup, stmt, args=()):
    db = sqlite3.connect(os.path.join(agnsup.state, "journal.db"))
    try:
        rows = db.execute(stmt, args).fetchall()
        db.commit()
        return rows
    finally:
        db.close()


def head_file(agnsup):
    return chain.head_path(agnsup.state)


@pytest.fixture
def ran(agnsup, worktree):
    cells(agnsup, worktree)
    r = verify(agnsup, rc=0)
    assert r["ok"] and r["records"] > 0 and r["anchored"] == r["records"] and r["receipt_files"]["checked"] == 2
    return r


def test_an_intact_journal_verifies_and_says_so_in_one_line(agnsup, ran):
    cp = agnsup("verify", check=0)
    assert cp.out.startswith(f"journal chain: intact: {ran['records']} record(s), head seq {ran['records']}")
    assert os.stat(head_file(agnsup)).st_mode & 0o777 == 0o600


def test_an_edited_event_is_named(agnsup, ran):
    seq, row = sql(agnsup, "SELECT seq, row FROM chain WHERE tbl='events' ORDER BY seq LIMIT 1 OFFSET 3")[0]
    sql(agnsup, "UPDATE events SET data=? WHERE id=?", ('{"reason": "innocent"}', row))
    r = verify(agnsup, rc=1)
    assert r["broken"][0]["seq"] == seq and "changed" in r["broken"][0]["what"]
    assert f"seq {seq}:" in agnsup("verify", check=1).out


def test_a_deleted_receipt_row_is_named(agnsup, ran):
    seq, row = sql(agnsup, "SELECT seq, row FROM chain WHERE tbl='receipts' ORDER BY seq LIMIT 1")[0]
    sql(agnsup, "DELETE FROM receipts WHERE id=?", (row,))
    r = verify(agnsup, rc=1)
    assert r["broken"][0]["seq"] == seq and "missing" in r["broken"][0]["what"]


def test_a_deleted_last_record_is_named(agnsup, ran):
    seq, tbl, row = sql(agnsup, "SELECT seq, tbl, row FROM chain ORDER BY seq DESC LIMIT 1")[0]
    sql(agnsup, f"DELETE FROM {tbl} WHERE id=?", (row,))
    assert verify(agnsup, rc=1)["broken"][0]["seq"] == seq
    sql(agnsup, "DELETE FROM chain WHERE seq=?", (seq,))  # and its chain row: the head names it still
    b = verify(agnsup, rc=1)["broken"][0]
    assert b["seq"] == seq and "ends at" in b["what"]


def test_a_receipt_file_edited_on_disk_is_named(agnsup, ran):
    path = os.path.join(agnsup.state, "cells", "default", "v1", "receipt.json")
    with open(path) as f:
        r = json.load(f)
    r["exit_code"] = 0 if r["exit_code"] else 1
    with open(path, "w") as f:
        json.dump(r, f)
    out = verify(agnsup, rc=1)
    assert any(path in b["what"] for b in out["broken"]) and out["receipt_files"]["changed"] == 1


def test_a_receipt_file_deleted_on_disk_is_named(agnsup, ran):
    path = os.path.join(agnsup.state, "cells", "default", "v0", "receipt.json")
    os.unlink(path)
    out = verify(agnsup, rc=1)
    assert any(path in b["what"] and "gone" in b["what"] for b in out["broken"]) and out["receipt_files"]["gone"] == 1


def test_a_head_replaced_by_an_older_one_is_named(agnsup, worktree):
    cells(agnsup, worktree, 1)
    with open(head_file(agnsup)) as f:
        old = f.read()
    cells(agnsup, worktree, 2, prefix="w")
    with open(head_file(agnsup), "w") as f:
        f.write(old)
    assert any("rolled back" in b["what"] for b in verify(agnsup, rc=1)["broken"])


def test_a_head_forged_without_the_key_is_named(agnsup, worktree, tmp_path):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    key = Ed25519PrivateKey.generate()
    (tmp_path / "op.key").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                        serialization.NoEncryption()))
    pub = tmp_path / "op.pub"
    pub.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                  serialization.PublicFormat.SubjectPublicKeyInfo))
    agnsup.env[chain.KEY_ENV] = str(tmp_path / "op.key")
    cells(agnsup, worktree, 2)
    r = verify(agnsup, "--public-key", str(pub), rc=0)
    assert r["signature"] is True
    # the hostile process edits the last receipt, rebuilds the chain after it and writes a head: it has no key
    with open(head_file(agnsup)) as f:
        h = json.load(f)
    h["hash"] = "f" * 64
    with open(head_file(agnsup), "w") as f:
        json.dump(h, f)
    broken = verify(agnsup, "--public-key", str(pub), rc=1)["broken"]
    assert any("signature does not verify" in b["what"] for b in broken)
    del h["sig"]
    with open(head_file(agnsup), "w") as f:
        json.dump(h, f)
    assert any("not signed" in b["what"] for b in verify(agnsup, "--public-key", str(pub), rc=1)["broken"])


def test_a_public_key_that_is_not_one_is_a_usage_error(agnsup, ran, tmp_path):
    (tmp_path / "x.pem").write_text("nope")
    cp = agnsup("verify", "--public-key", str(tmp_path / "x.pem"), check=125)
    assert len(cp.err.strip().splitlines()) == 1 and "not a PEM public key" in cp.err


def test_prune_and_repair_keep_verify_green(agnsup, worktree, ran):
    pruned = agnsup.json("journal", "prune", "--before", "2100-01-01", "--json")
    assert pruned["cells"] == 2
    r = verify(agnsup, rc=0)
    assert r["pruned"] > 0 and r["receipt_files"]["not_journaled"] == 2
    cells(agnsup, worktree, 1, prefix="after")
    assert verify(agnsup, rc=0)["ok"]
    # repair of a journal that lost its history: a new chain whose first record names the old head
    with open(head_file(agnsup)) as f:
        old = json.load(f)
    for suffix in ("", "-wal", "-shm"):
        if os.path.exists(os.path.join(agnsup.state, "journal.db" + suffix)):
            os.unlink(os.path.join(agnsup.state, "journal.db" + suffix))
    rep = agnsup.json("journal", "repair", "--json")
    assert rep["chain_restarted"] and len(rep["imported"]) == 3
    r = verify(agnsup, rc=0)
    assert r["ok"] and r["receipt_files"]["checked"] == 3
    (first,) = sql(agnsup, "SELECT e.kind, e.data FROM chain c JOIN events e ON e.id = c.row WHERE c.seq = 1")
    assert first[0] == "chain.restarted" and json.loads(first[1])["old_head"] == old


def test_the_export_streams_one_line_per_receipt_with_its_chain_record(agnsup, ran):
    lines = agnsup("receipts", "--export", "jsonl", check=0).out.splitlines()
    got = [json.loads(line) for line in lines]
    assert [g["cell_id"] for g in got] == ["v0", "v1"] and all(g["kind"] == "cell" for g in got)
    chained = dict(sql(agnsup, "SELECT seq, hash FROM chain"))
    assert all(chained[g["seq"]] == g["hash"] and g["receipt"]["cell_id"] == g["cell_id"] for g in got)
    one = agnsup("receipts", "--export", "jsonl", "--cell", "v1", check=0).out.splitlines()
    assert [json.loads(x)["cell_id"] for x in one] == ["v1"]
    agnsup("receipts", "--export", "csv", check=125)


def test_a_cell_cannot_read_or_replace_the_head(agnsup, worktree, ran):
    probe = ("import sys\np = sys.argv[1] + '/journal.head'\n"
             "try: print('READ', open(p).read())\nexcept OSError as e: print('no read', e.errno)\n"
             "try: open(p, 'w').write('{}'); print('WROTE')\nexcept OSError as e: print('no write', e.errno)")
    cp = agnsup("run", "--workdir", worktree, "--", "python3", "-c", probe, agnsup.state, check=None)
    assert "no read" in cp.out and "no write" in cp.out, cp.out + cp.err
    assert verify(agnsup, rc=0)["ok"]


def test_repair_of_a_journal_whose_tail_was_deleted_restarts_the_chain_and_keeps_the_break_visible(agnsup, ran):
    """The head past the end (the last record and its chain row deleted): repair re-anchors with a
    `chain.restarted` record naming the old head; a record edited inside the kept chain stays broken."""
    seq, tbl, row = sql(agnsup, "SELECT seq, tbl, row FROM chain ORDER BY seq DESC LIMIT 1")[0]
    sql(agnsup, f"DELETE FROM {tbl} WHERE id=?", (row,))
    sql(agnsup, "DELETE FROM chain WHERE seq=?", (seq,))
    edited = sql(agnsup, "SELECT seq, row FROM chain WHERE tbl='events' ORDER BY seq LIMIT 1")[0]
    sql(agnsup, "UPDATE events SET kind='state.forged' WHERE id=?", (edited[1],))
    assert agnsup.json("journal", "repair", "--json")["chain_restarted"]
    broken = verify(agnsup, rc=1)["broken"]
    assert [b["seq"] for b in broken] == [edited[0]], broken
    (ev,) = sql(agnsup, "SELECT data FROM events WHERE kind='chain.restarted'")
    assert json.loads(ev[0])["old_head"]["seq"] == seq


def test_a_signing_key_that_does_not_load_refuses_the_controller_before_anything_starts(agnsup, worktree, tmp_path):
    """The operator asked for signed heads: a controller never writes them unsigned (one line, 125, no cell)."""
    (tmp_path / "bad.key").write_text("not a key")
    agnsup.env[chain.KEY_ENV] = str(tmp_path / "bad.key")
    marker = tmp_path / "ran"
    cp = agnsup("run", "--workdir", worktree, "--cell", "k0", "--", "touch", str(marker), check=125)
    assert len(cp.err.strip().splitlines()) == 1 and chain.KEY_ENV in cp.err and "bad.key" not in cp.err
    assert not marker.exists()
    assert not any(c["cell_id"] == "k0" for c in agnsup.json("ps", "--all", "--json"))
