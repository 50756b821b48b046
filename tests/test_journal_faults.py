"""A journal that lost its history or is damaged: agnsup notices, writes nothing into it,
overwrites no receipt, keeps the kill switch and the janitor working, and
`agnsup journal check|repair` rebuild it from the receipts on disk (issue 12 items 2, 3)."""
import hashlib
import os
import signal

from scenario import wait_for


def _one_line(cp):
    lines = cp.err.strip().splitlines()
    assert len(lines) == 1, cp.err
    return lines[0]


def _digest(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def test_a_journal_that_lost_its_history_is_refused_and_rebuilt_from_the_receipts(agnsup, worktree):
    """Issue 12 item 2: an emptied journal (WAL gone) no longer starts a new history that
    reuses ids and overwrites cells/<run>/<cell>/receipt.json."""
    agnsup("run", "--workdir", worktree, "--cell", "pre1", "--", "true", check=0)
    agnsup("run", "--workdir", worktree, "--cell", "pre2", "--", "sh", "-c", "exit 3", check=3)
    before = agnsup.json("receipts", "--json")
    receipt = os.path.join(agnsup.state, "cells", "default", "pre1", "receipt.json")
    kept = _digest(receipt)
    db = os.path.join(agnsup.state, "journal.db")
    for suffix in ("-wal", "-shm"):
        if os.path.exists(db + suffix):
            os.unlink(db + suffix)
    open(db, "w").close()
    for argv in (["run", "--workdir", worktree, "--cell", "pre1", "--", "true"], ["receipts"], ["ps"],
                 ["cancel", "--run", "default"]):
        line = _one_line(agnsup(*argv, check=125))
        assert "lost its history" in line and "2 cell(s) are on disk" in line and "agnsup journal repair" in line
    assert os.path.getsize(db) == 0 and _digest(receipt) == kept
    cp = agnsup("journal", "check", check=1)
    assert "NOT OK" in cp.out and "lost its history" in cp.out
    out = agnsup.json("journal", "repair", "--json")
    assert sorted(out["imported"]) == ["default/pre1", "default/pre2"] and len(out["quarantined"]) == 1
    assert os.path.getsize(out["quarantined"][0]) == 0  # the old file is kept aside, never deleted
    after = agnsup.json("receipts", "--json")
    assert after == before and _digest(receipt) == kept
    assert agnsup("journal", "check", check=0).out.startswith(f"journal {db}: ok")
    line = _one_line(agnsup("run", "--workdir", worktree, "--cell", "pre1", "--", "true", check=125))
    assert "cell 'pre1' already exists" in line and _digest(receipt) == kept
    agnsup("run", "--workdir", worktree, "--cell", "pre3", "--", "true", check=0)
    assert [r["cell_id"] for r in agnsup.json("receipts", "--json")] == ["pre1", "pre2", "pre3"]


def test_a_damaged_journal_is_refused_kept_and_the_kill_switch_still_kills(agnsup, worktree):
    """Issue 12 item 3: a corrupt journal is one line and exit 125 for every command
    (no traceback), nothing is written into it, `cancel --all` kills from the kernel's
    evidence, and repair keeps the damaged file and rebuilds from the receipts."""
    agnsup("run", "--workdir", worktree, "--cell", "before", "--", "true", check=0)
    p = agnsup.popen("run", "--workdir", worktree, "--cell", "live", "--", "sh", "-c", "echo up; exec sleep 1000",
                     stdout=-1, stderr=-1)
    assert p.stdout.readline().strip() == b"up"
    db = os.path.join(agnsup.state, "journal.db")
    with open(db, "r+b") as f:  # the header gone: SQLite would call it "file is not a database"
        f.write(os.urandom(100))
    damaged = _digest(db)
    for argv in (["run", "--workdir", worktree, "--", "true"], ["receipts"], ["ps", "--all"],
                 ["cancel", "--cell", "live"], ["cleanup", "--run", "default"]):
        line = _one_line(agnsup(*argv, check=125))
        assert "is unusable: damaged (not an SQLite database" in line and "agnsup journal repair" in line, argv
    assert _digest(db) == damaged
    cp = agnsup("cancel", "--all", "--grace", "0", "--json", check=125)
    out = __import__("json").loads(cp.out)
    assert out["root"]["processes"] >= 1 and out["root"]["empty"] is True and out["journaled"] is False
    assert "could not journal it" in _one_line(cp)
    p.wait(30)
    assert p.returncode != 0
    p.stdout.close()
    p.stderr.close()
    assert _digest(db) == damaged
    janitor = agnsup("janitor", check=125)
    assert "killed 0 process(es)" in janitor.out and "could not journal it" in _one_line(janitor)
    rep = agnsup.json("journal", "repair", "--json")
    assert "default/before" in rep["imported"]
    assert [_digest(q) for q in rep["quarantined"] if q.endswith(".db")] == [damaged]
    assert "before" in [r["cell_id"] for r in agnsup.json("receipts", "--json")]
    agnsup("run", "--workdir", worktree, "--cell", "after", "--", "true", check=0)


def test_corruption_sqlite_meets_is_marked_so_nothing_writes_into_the_file_later(agnsup, worktree):
    """Issue 12 item 3: garbage in the middle of the file (the header intact) shows when SQLite
    reads the page; from then on the journal is marked damaged and no command writes into it."""
    for i in range(4):
        agnsup("run", "--workdir", worktree, "--cell", f"c{i}", "--", "true", check=0)
    import sqlite3
    con = sqlite3.connect(os.path.join(agnsup.state, "journal.db"))
    con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    con.close()
    db = os.path.join(agnsup.state, "journal.db")
    size = os.path.getsize(db)
    with open(db, "r+b") as f:  # every page but the first (the header and the schema)
        f.seek(4096)
        f.write(b"\xff" * (size - 4096))
    line = _one_line(agnsup("receipts", check=125))
    assert "is unusable: damaged (" in line, line
    assert os.path.exists(db + ".damaged")
    damaged = _digest(db)
    assert "damaged" in _one_line(agnsup("run", "--workdir", worktree, "--", "true", check=125))
    assert _digest(db) == damaged
    assert agnsup("journal", "check", check=1).out.count("damaged") >= 1


def test_a_read_only_state_root_still_lets_the_kill_switch_kill(agnsup, worktree):
    """Issue 12 item 5: with the state root read-only, `cancel --all` kills first and then
    says in one line what it could not journal (was: exit 1, "attempt to write a readonly
    database", nothing killed); cleanup and run are one line and 125; nothing is lost."""
    import subprocess
    agnsup("run", "--workdir", worktree, "--cell", "before", "--", "true", check=0)
    p = agnsup.popen("run", "--workdir", worktree, "--cell", "live", "--", "sh", "-c", "echo up; exec sleep 1000",
                     stdout=-1, stderr=-1)
    assert p.stdout.readline().strip() == b"up"
    before = agnsup.json("receipts", "--json")
    subprocess.run(["mount", "--bind", agnsup.state, agnsup.state], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", agnsup.state], check=True)
        cp = agnsup("cancel", "--all", "--grace", "0", check=125)
        line = _one_line(cp)
        assert "cancel killed" in line and "could not journal it" in line and "readonly" in line, line
        assert cp.out.startswith("cancelled ") and not cp.out.startswith("cancelled 0 "), cp.out
        assert p.wait(30) in (128 + signal.SIGTERM, 128 + signal.SIGKILL)  # TERM, or the kill after grace 0
        # its controller had the journal open before the remount: its end is journaled through that
        # descriptor (the receipt file could not be made); no traceback either way
        assert "Traceback" not in p.stderr.read().decode()
        for argv, fragment in ((["cleanup", "--run", "default"], "read"),
                               (["run", "--workdir", worktree, "--", "true"], "not writable")):
            assert fragment in _one_line(agnsup(*argv, check=125))
    finally:
        subprocess.run(["umount", agnsup.state], check=True)
        p.stdout.close()
        p.stderr.close()
    after = agnsup.json("receipts", "--json")
    assert after[:1] == before and [r["cell_id"] for r in after[1:]] == ["live"] and after[1]["state"] != "running"
    agnsup("janitor", check=0)
    assert not [c for c in agnsup.json("ps", "--json")]  # nothing left live


def test_a_full_disk_is_one_line_and_the_kill_switch_still_answers(tmp_path, worktree):
    """Issue 12 item 5: a state root on a full file system gives one line and 125 (was:
    exit 1 with Errno 28 / "database or disk is full"), and the kill switch still kills
    the cell that lives there, then says what it could not journal."""
    import subprocess
    from agnsup import backend
    from conftest import Agnsup
    mnt = tmp_path / "full"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mnt)], check=True)
    state = str(mnt / "state")
    a = Agnsup(state)
    live = None
    try:
        a("run", "--workdir", worktree, "--", "true", check=0)
        live = a.popen("run", "--workdir", worktree, "--lock-timeout", "0", "--", "sleep", "600",
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(lambda: "sleep" in a("ps", "--json").out, what="the live cell")
        # the rest of the file system goes: a full disk
        fd = os.open(mnt / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            while os.write(fd, b"\0" * 4096):
                pass
        except OSError:
            pass
        finally:
            os.close(fd)
        cp = a("run", "--workdir", str(tmp_path), "--", "true")
        assert cp.returncode == 125, cp.err
        line = _one_line(cp)
        assert "full" in line or "No space left" in line, line
        cp = a("cancel", "--all", "--grace", "0")
        assert cp.returncode in (0, 125) and "Traceback" not in cp.err, cp.err
        if cp.returncode == 125:  # (a line before it may say the janitor could not run: the same full disk)
            assert "could not journal it" in cp.err.strip().splitlines()[-1], cp.err
        assert live.wait(30) is not None  # killed, journaled or not
    finally:
        if live is not None and live.poll() is None:
            live.kill()
            live.wait()
        leaked = backend.choose(state).purge()
        subprocess.run(["umount", str(mnt)], check=True)
    assert not leaked, leaked
