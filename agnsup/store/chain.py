"""Receipts nobody can rewrite (issue 32): a hash chain over the journal's events and receipts.

Every row a write transaction inserts into `events` or `receipts` gets a `chain`
row in that same transaction (journal.Journal.tx):

    hash = sha256(prev || canonical(row)),  prev = the hash before it (ZERO for the first)

`canonical` is the row's whole content (its table, its id, every column, and the
`anchor` the writer had seen) as compact JSON: one byte changed in a row, a row
deleted, a row added behind the journal's back, and the chain no longer holds.

An attacker who can write journal.db could rebuild the whole chain, so the chain
is anchored outside it: after COMMIT the writer writes the head (seq, hash, time,
an optional Ed25519 signature over "seq:hash") to `<state>/journal.head`, a file
in the state root, which no cell ever sees (tests/test_verify.py proves it). A
head that points past the journal's end or at another hash is broken; records
past the head are "not yet anchored" (a controller died between COMMIT and the
head write: crash point `chain.head`) until the next writer re-anchors them. The
head only moves forward (a flock around read-compare-write), and each record
carries the head seq its writer had seen (`anchor`): a head older than an anchor
was rolled back. What the chain cannot stop: root rewriting the tail after an old
head and the head with it; ship the head (or `agnsup receipts --export jsonl`)
off the host, or sign it, for that (docs/architecture.md, "The journal").

No fsync of the head: the journal itself commits with synchronous=NORMAL (a power
cut may lose its last commits), and a head that lags is only "not yet anchored"
and re-anchored by the next writer. After a power cut the head may instead be
*ahead* of what survived of the journal: verify then says broken, naming the
missing seq (it cannot tell that from a deleted tail), and the message says so.

Pure: json, os and the built-in sha256; `cryptography` only when a key is set.
SQL stays in journal.py (test_architecture).
"""
from __future__ import annotations

import json
import os
import time

from ..util.digest import sha256

ZERO = "0" * 64
HEAD = "journal.head"
KEY_ENV = "AGNSUP_SIGNING_KEY"  # the operator's Ed25519 private key (PEM file) in the controller's env

# the columns hashed, per table, in this order (journal.py inserts and selects them so)
COLUMNS = {"events": ("id", "t", "run_id", "cell_id", "kind", "data"),
           "receipts": ("id", "kind", "run_id", "cell_id", "t", "data")}


# json.dumps(x, separators=(",", ":")) builds this very encoder at every call; the same one, made once
_COMPACT = json.JSONEncoder(separators=(",", ":")).encode
_HEAD = json.JSONEncoder(sort_keys=True).encode  # json.dumps(head, sort_keys=True)'s


def canonical(tbl: str, anchor: int, content: tuple) -> str:
    """The row as hashed: [table, anchor, id, columns...] in compact JSON (floats as repr: exact)."""
    return _COMPACT([tbl, anchor, *content])


def link(prev: str, tbl: str, anchor: int, content: tuple, sha=sha256) -> str:
    """`sha`: a SHA-256 constructor (the same digest from either: journal.Journal.checkpoint_behind gives a
    controller of many cells OpenSSL's, ~5x faster on a cell receipt's ~16 KB row)."""
    return sha((prev + canonical(tbl, anchor, content)).encode()).hexdigest()


# -- the head file ---------------------------------------------------------------
def head_path(state_dir: str) -> str:
    return os.path.join(state_dir, HEAD)


def read_head(path: str) -> dict | None:
    """The head, None when there is none; ValueError when it is not a head. Under a shared flock: a writer's
    pwrite is never seen half done."""
    import fcntl
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        raw = os.pread(fd, 4096, 0)
    finally:
        os.close(fd)
    return _parse(raw)


def _parse(raw: bytes) -> dict | None:
    if not raw:
        return None  # created, never written (a writer died between open and pwrite)
    h = json.loads(raw)
    if not isinstance(h, dict) or not isinstance(h.get("seq"), int) or not isinstance(h.get("hash"), str):
        raise ValueError("not a head (seq, hash)")
    return h


_SIGNER: list = []  # [key or None, error or None], loaded once per process


def _signer():
    if not _SIGNER:
        where = os.environ.get(KEY_ENV)
        key, err = None, None
        if where:
            try:
                from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
                from cryptography.hazmat.primitives.serialization import load_pem_private_key
                with open(where, "rb") as f:
                    key = load_pem_private_key(f.read(), None)
                if not isinstance(key, Ed25519PrivateKey):
                    key, err = None, f"{KEY_ENV}: not an Ed25519 private key"
            except (OSError, ValueError, TypeError, ImportError) as e:
                key, err = None, f"{KEY_ENV}: cannot load the key: {type(e).__name__}"
        _SIGNER[:] = [key, err]
    return _SIGNER


def signing_problem() -> str | None:
    """Why the operator's key (AGNSUP_SIGNING_KEY) cannot sign, None when it can or none is set. A controller
    refuses to start with it (broker.Controller): heads the operator asked to be signed are never written
    unsigned by a cell's controller. Other writers (cancel, cleanup) still write, unsigned, naming why."""
    return _signer()[1]


HEAD_SIZE = 512  # the head is rewritten in place, padded to this size (a signed one takes ~230 bytes)
_WROTE: dict[str, tuple[bytes, int]] = {}  # head path -> (the bytes this process last wrote there, their seq)


def write_head(state_dir: str, seq: int, hash_: str, force: bool = False) -> int:
    """Anchor the chain at (seq, hash_) unless the head is already at or past seq (`force`: a new chain,
    journal repair). Returns the head seq now on disk.

    In place, under an exclusive flock on the file itself, so that it only moves forward and readers (who
    take a shared one) never see half of it: one pwrite of HEAD_SIZE bytes at offset 0 is not torn by a
    process's death. Not a rename: ext4 flushes a file replaced by rename (auto_da_alloc), ~0.5 ms a
    transaction here."""
    import fcntl  # on the run path already (locks.py)
    path = head_path(state_dir)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        raw = os.pread(fd, 4096, 0)  # also its size, up to 4096: what is past HEAD_SIZE is cut below
        if not force:
            now: int | None
            wrote = _WROTE.get(path)
            if wrote is not None and raw == wrote[0]:
                now = wrote[1]  # the very bytes this process wrote last: no need to parse them again
            else:
                try:
                    cur = _parse(raw)
                except ValueError:
                    cur = None  # garbage: verify says so until a writer replaces it
                now = cur["seq"] if cur is not None else None
            if now is not None and now >= seq:
                return now
        head = {"seq": seq, "hash": hash_, "t": time.time()}
        key, err = _signer()
        if key is not None:
            import base64
            head["sig"] = base64.b64encode(key.sign(f"{seq}:{hash_}".encode())).decode()
        elif err:
            head["unsigned"] = err
        data = _HEAD(head).encode()
        data = data.ljust(HEAD_SIZE - 1) + b"\n"
        os.pwrite(fd, data, 0)
        if len(raw) > len(data):  # a longer file (garbage, or another version's head): cut to this one
            os.ftruncate(fd, len(data))
        _WROTE[path] = (data, seq)
        return seq
    finally:
        os.close(fd)


def load_public_key(path: str):
    """An Ed25519 public key from a PEM file; UsageError (125) otherwise."""
    from ..errors import UsageError
    try:
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
        from cryptography.hazmat.primitives.serialization import load_pem_public_key
        with open(path, "rb") as f:
            key = load_pem_public_key(f.read())
    except ImportError:
        raise UsageError("--public-key needs the `cryptography` package") from None
    except (OSError, ValueError) as e:
        raise UsageError(f"--public-key {path}: not a PEM public key ({getattr(e, 'strerror', None) or e})") from None
    if not isinstance(key, Ed25519PublicKey):
        raise UsageError(f"--public-key {path}: not an Ed25519 public key")
    return key


def _signature_ok(key, head: dict) -> bool:
    import base64
    from cryptography.exceptions import InvalidSignature
    try:
        key.verify(base64.b64decode(head.get("sig") or "", validate=True), f"{head['seq']}:{head['hash']}".encode())
        return True
    except (InvalidSignature, ValueError):
        return False


# -- verification ---------------------------------------------------------------
def pruned_seqs(events: dict) -> set[int]:
    """The seqs `journal prune` removed rows of, from its own (chained) `journal.pruned` events."""
    out: set[int] = set()
    for row in events.values():
        if row[4] == "journal.pruned" and row[5]:
            with_ranges = json.loads(row[5]).get("chain") or []
            for lo, hi in with_ranges:
                out.update(range(lo, hi + 1))
    return out


def ranges(seqs) -> list[list[int]]:
    """Sorted seqs as [[lo, hi], ...] (what a `journal.pruned` event records)."""
    out: list[list[int]] = []
    for s in sorted(seqs):
        if out and out[-1][1] == s - 1:
            out[-1][1] = s
        else:
            out.append([s, s])
    return out


def verify(snap: dict, state_dir: str, public_key=None) -> dict:
    """Check the chain rows, each row's content, the head, and each cell's receipt file on disk against its
    journaled content. `snap`: Journal.chain_snapshot(). `ok`: nothing is broken (records not yet anchored
    are not broken)."""
    broken: list[dict] = []
    chain, tables = snap["chain"], {"events": snap["events"], "receipts": snap["receipts"]}
    pruned = pruned_seqs(snap["events"])
    chained: dict[str, set] = {"events": set(), "receipts": set()}
    seq_of: dict[tuple[str, int], int] = {}
    prev, expect, max_anchor, n_pruned = ZERO, 1, 0, 0
    hashes: dict[int, str] = {}
    for seq, tbl, row, rprev, rhash, anchor in chain:
        if seq != expect:
            broken.append({"seq": expect, "what": f"records {expect}..{seq - 1} are missing from the chain"})
        elif rprev != prev:
            broken.append({"seq": seq, "what": "its prev is not the hash of the record before"})
        expect, prev, hashes[seq] = seq + 1, rhash, rhash
        max_anchor = max(max_anchor, anchor)
        if seq in pruned:
            n_pruned += 1
            continue
        content = tables.get(tbl, {}).get(row)
        if content is None:
            broken.append({"seq": seq, "what": f"{tbl} row {row} is missing (deleted, not pruned)"})
            continue
        chained[tbl].add(row)
        seq_of[(tbl, row)] = seq
        if tbl == "events" and content[4] == "chain.restarted":
            max_anchor = anchor  # journal repair: heads seen before it belong to the old chain
        if link(rprev, tbl, anchor, content) != rhash:
            broken.append({"seq": seq, "what": f"{tbl} row {row} was changed ({content[4 if tbl == 'events' else 1]})"})
    last = expect - 1
    for tbl, rows in tables.items():
        for rid in sorted(set(rows) - chained[tbl]):
            broken.append({"seq": None, "what": f"{tbl} row {rid} is not in the chain (added behind the journal)"})
    # the head
    head, anchored, signed = None, last, None
    try:
        head = read_head(head_path(state_dir))
    except (OSError, ValueError) as e:
        broken.append({"seq": None, "what": f"the head file {HEAD} is unreadable: {e}"})
    if head is None:
        anchored = 0
        if max_anchor:
            broken.append({"seq": None, "what": f"the head file {HEAD} is missing (a writer had anchored seq "
                                                f"{max_anchor})"})
    else:
        anchored = min(head["seq"], last)
        if head["seq"] > last:
            broken.append({"seq": last + 1, "what": f"the head names seq {head['seq']} but the journal ends at "
                                                    f"{last}: records deleted (or lost in a power cut)"})
        elif head["seq"] and hashes.get(head["seq"]) != head["hash"]:
            broken.append({"seq": head["seq"], "what": "the head's hash is not this record's: the chain was "
                                                      "rewritten, or the head forged"})
        if head["seq"] < max_anchor:
            broken.append({"seq": head["seq"] + 1, "what": f"the head (seq {head['seq']}) is older than seq "
                                                          f"{max_anchor}, which a writer saw anchored: rolled back"})
        if public_key is not None:
            signed = bool(head.get("sig")) and _signature_ok(public_key, head)
            if not signed:
                broken.append({"seq": head["seq"], "what": "the head's signature does not verify with this key" if
                               head.get("sig") else f"the head is not signed ({head.get('unsigned') or 'no key'})"})
    files = _receipt_files(snap, state_dir, seq_of, broken)
    broken.sort(key=lambda b: (b["seq"] is None, b["seq"] or 0))
    out: dict = {"ok": not broken, "records": len(chain), "head": head, "anchored": anchored,
                 "not_anchored": max(0, last - anchored), "pruned": n_pruned,
                 "receipt_files": files, "signature": signed, "broken": broken}
    if out["not_anchored"]:
        out["note"] = (f"{out['not_anchored']} record(s) past the head are not yet anchored (a controller died "
                       "before writing the head); the next writer anchors them")
    return out


def _receipt_files(snap: dict, state_dir: str, seq_of: dict, broken: list) -> dict:
    """Each cell's receipt.json on disk against its journaled receipt rows (any of them: the janitor never
    overwrites one on disk)."""
    journaled: dict[tuple, list] = {}
    for rid, (_, kind, run_id, cell_id, _t, data) in snap["receipts"].items():
        if kind == "cell":
            journaled.setdefault((run_id, cell_id), []).append((rid, data))
    out = {"checked": 0, "changed": 0, "not_journaled": 0, "gone": 0}
    paths = snap.get("receipt_paths") or {}
    for run_id, cell_id in sorted(set(snap.get("cells_on_disk") or []) | set(paths)):
        path = os.path.join(state_dir, "cells", run_id, cell_id, "receipt.json")
        rows = journaled.get((run_id, cell_id))
        # the journal names this very file as the cell's receipt (the state root may be spelled otherwise)
        named = (run_id, cell_id) in paths and os.path.realpath(paths[(run_id, cell_id)]) == os.path.realpath(path)
        try:
            with open(path) as f:
                text = f.read()
        except FileNotFoundError:
            # the controller writes a cell's receipt file before it journals its path (broker._conclude);
            # receipt files are never removed (not by cleanup, not by prune)
            if named:
                out["gone"] += 1
                rid = rows[-1][0] if rows else None
                broken.append({"seq": seq_of.get(("receipts", rid)),
                               "what": f"receipt file {path} is gone (the journal names it)"})
            continue
        except OSError as e:
            broken.append({"seq": None, "what": f"receipt file {path} is unreadable: {e.strerror}"})
            continue
        try:
            on_disk = json.loads(text)
        except ValueError:
            on_disk = None
        same = any(on_disk == json.loads(d) for _, d in rows or ())
        if not same and not named:
            # pruned from the journal, or a file the journal never took as the cell's receipt (its controller
            # died after writing it, before journaling it: the janitor journaled its own): nothing to hold it to
            out["not_journaled"] += 1
            continue
        out["checked"] += 1
        if not same:
            out["changed"] += 1
            rid = rows[-1][0] if rows else None
            broken.append({"seq": seq_of.get(("receipts", rid)),
                           "what": f"receipt file {path} differs from its journaled content (receipts row {rid})"})
    return out
