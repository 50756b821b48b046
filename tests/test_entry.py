"""The fast `run` and `cancel` parsers agree with the click CLI, or step aside."""
import click
import pytest

from agnsup.doors import cli
from agnsup.doors.entry import parse_cancel, parse_run

CASES = [
    ["run", "--", "true"],
    ["run", "true"],
    ["run", "--role", "readonly", "--", "ls", "-la"],
    ["run", "--role=networked", "--timeout", "2.5", "--env", "A=1", "--env", "B", "--", "env"],
    ["--state-dir", "/x", "run", "--cell", "c1", "--run-id", "r", "--agent", "a", "--", "--help"],
    ["run", "--lock-timeout", "0", "--receipt", "/tmp/r.json", "--workdir", "/w", "sh", "-c", "echo --role"],
    ["run", "--", "--", "x"],
    ["--state-dir", "/x", "run", "--state-dir=/y", "--cell", "c1", "--", "true"],
]
FALLBACK = [
    ["run", "--help"], ["run"], ["run", "--timeout", "0", "--", "x"], ["run", "--timeout", "abc", "--", "x"],
    ["run", "--bogus", "x"], ["run", "--agent-idd", "x", "--", "true"], ["ps"], ["--state-dir"], ["run", "--role"], ["run", "--timeout", "nan", "--", "x"],
]


def _click_parse(argv, command="run"):
    """The keyword arguments click's `command` gets for argv (its body replaced), and the group's state_dir."""
    captured = {}
    cmd = cli.main.commands[command]
    orig = cmd.callback
    cmd.callback = click.pass_obj(lambda obj, **kw: captured.update(kw, state_dir=obj["state_dir"]))
    try:
        cli.main.main(argv, standalone_mode=False, auto_envvar_prefix=None)
    finally:
        cmd.callback = orig
    return captured


@pytest.mark.parametrize("argv", CASES, ids=" ".join)
def test_the_fast_parser_reads_run_exactly_as_click_does(argv, monkeypatch):
    monkeypatch.delenv("AGNSUP_STATE_DIR", raising=False)
    state_dir, opts, command = parse_run(argv)
    c = _click_parse(argv)
    assert state_dir == c["state_dir"]
    assert command == list(c["command"])
    for key, value in opts.items():
        want = c[key]
        assert (list(want) if key == "env" else want) == value, key


@pytest.mark.parametrize("argv", FALLBACK, ids=" ".join)
def test_anything_unusual_goes_to_click(argv):
    assert parse_run(argv) is None


# -- cancel ---------------------------------------------------------------------
CANCEL_CASES = [
    ["cancel", "--cell", "c1"],
    ["cancel", "--cell=c1", "--run", "R", "--grace", "0", "--json"],
    ["--state-dir", "/x", "cancel", "--run-id", "R", "--agent-id", "A", "--grace=2.5"],
    ["--state-dir=/x", "cancel", "--all", "--grace", "0.", "--state-dir", "/y"],
    ["cancel", "--json", "--all"],
    ["cancel", "--cell-id", "c1", "--grace", "10"],
    ["cancel"],
    ["--state-dir", "--x", "cancel", "--all"],
]
CANCEL_FALLBACK = [
    ["cancel", "--help"], ["cancel", "-h"], ["cancel", "--cell"], ["cancel", "--grace", "-1", "--all"],
    ["cancel", "--grace", "nan", "--all"], ["cancel", "--grace", "1e3", "--all"], ["cancel", "--grace", "abc"],
    ["cancel", "--json=1"], ["cancel", "--bogus"], ["cancel", "extra"], ["cancel", "--cell", "a", "--cell", "b"],
    ["cancel", "--cell", "a", "--cell-id", "b"], ["cancel", "--cell", "--json"], ["cancel", "--cell="],
    ["cancel", "--", "x"], ["--state-dir", "", "cancel"], ["--version", "cancel"], ["ps"], ["run", "--", "true"],
]


@pytest.mark.parametrize("argv", CANCEL_CASES, ids=" ".join)
def test_the_fast_parser_reads_cancel_exactly_as_click_does(argv, monkeypatch):
    monkeypatch.delenv("AGNSUP_STATE_DIR", raising=False)
    state_dir, opts = parse_cancel(argv)
    assert {**opts, "state_dir": state_dir} == _click_parse(argv, "cancel")


def test_the_fast_cancel_parser_takes_the_state_root_from_the_environment_as_click_does(monkeypatch):
    monkeypatch.setenv("AGNSUP_STATE_DIR", "/from/env")
    assert parse_cancel(["cancel", "--all"])[0] == _click_parse(["cancel", "--all"], "cancel")["state_dir"] == "/from/env"
    assert parse_cancel(["--state-dir", "/x", "cancel"])[0] == "/x"


@pytest.mark.parametrize("argv", CANCEL_FALLBACK, ids=" ".join)
def test_anything_unusual_about_cancel_goes_to_click(argv):
    assert parse_cancel(argv) is None


def _both(state_dir, *args):
    """(exit code, stdout, stderr) of the console script (its fast path) and of the click CLI."""
    import subprocess
    import sys
    out = []
    for entry in ("from agnsup.doors.entry import main", "from agnsup.doors.cli import main"):
        cp = subprocess.run([sys.executable, "-c", f"import sys; sys.argv = ['agnsup', *sys.argv[1:]]; {entry}; main()",
                             *args], env={**__import__("os").environ, "AGNSUP_STATE_DIR": state_dir},
                            capture_output=True, text=True, timeout=60)
        out.append((cp.returncode, cp.stdout, cp.stderr))
    return out


def test_the_fast_cancel_prints_and_exits_exactly_as_click_does(tmp_path):
    """Refusals (one line, and JSON on stdout with --json), exit codes, the text and JSON results:
    byte for byte (a result's `duration` and the canceller's pid in `reason` aside)."""
    import json
    from agnsup.store.state import StateRoot
    missing = str(tmp_path / "none")
    fast, slow = _both(missing, "cancel", "--cell", "x", "--json")
    assert fast == slow and fast[0] == 1 and "no journal" in fast[2] and json.loads(fast[1])["exit_code"] == 1
    root = StateRoot(str(tmp_path / "state")).ensure()
    root.journal().close()
    for args, code in ((("cancel", "--cell", "nope"), 1), (("cancel", "--cell", "nope", "--json"), 1),
                       (("cancel", "--run", "nope", "--agent", "a", "--json"), 1), (("cancel", "--agent", "a"), 125),
                       (("cancel",), 125), (("cancel", "--all", "--cell", "x", "--json"), 125)):
        fast, slow = _both(root.path, *args)
        assert fast == slow and fast[0] == code and fast[2].count("\n") == 1, (args, fast, slow)
    fast, slow = _both(root.path, "cancel", "--all", "--grace", "0")
    assert fast == slow == (0, "cancelled 0 cell(s) of every live cell\n", "")
    (fc, fo, fe), (sc, so, se) = _both(root.path, "cancel", "--all", "--json")

    def same(text):
        v = json.loads(text)
        return {**v, "duration": 0, "reason": v["reason"].rsplit("(pid", 1)[0]}
    assert (fc, fe) == (sc, se) == (0, "") and same(fo) == same(so) and fo.count("\n") == so.count("\n")


def test_the_fast_cancel_leaves_its_journal_connection_to_the_exit(tmp_path):
    """As `agnsup run` does: the last connection's close would checkpoint the WAL (fdatasyncs and an unlink,
    10-15 ms between a cancel's receipt and its result line, issue 29); what it read and committed stays
    readable. The click path closes its connection, which (the last one) removes the WAL."""
    import os
    from agnsup.store.state import StateRoot
    root = StateRoot(str(tmp_path / "state")).ensure()
    root.journal().close()  # the last connection closed: checkpointed, no WAL
    wal = os.path.join(root.path, "journal.db-wal")
    assert not os.path.exists(wal)
    fast, slow = _both(root.path, "cancel", "--all", "--grace", "0")
    assert fast == slow == (0, "cancelled 0 cell(s) of every live cell\n", "")
    assert not os.path.exists(wal)  # click's close (the second run) removed it, as before
    import subprocess
    import sys
    cp = subprocess.run([sys.executable, "-c", "import sys; sys.argv = ['agnsup', *sys.argv[1:]]; "
                         "from agnsup.doors.entry import main; main()", "cancel", "--all", "--grace", "0"],
                        env={**os.environ, "AGNSUP_STATE_DIR": root.path}, capture_output=True, text=True, timeout=60)
    assert (cp.returncode, cp.stdout) == (0, "cancelled 0 cell(s) of every live cell\n")
    assert os.path.exists(wal)  # left to the exit: no checkpoint on the kill switch's path
    j = root.journal()
    try:
        assert j.open_controllers() == []  # the journal reads as it did
    finally:
        j.close()

