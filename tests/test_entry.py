"""The fast `run` parser agrees with the click CLI, or steps aside."""
import click
import pytest

from agnsup.doors import cli
from agnsup.doors.entry import parse_run

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


def _click_parse(argv):
    captured = {}

    def fake(obj, **kw):
        captured.update(kw, state_dir=obj["state_dir"])

    run = cli.main.commands["run"]
    orig = run.callback
    run.callback = click.pass_obj(lambda obj, **kw: fake(obj, **kw))
    try:
        cli.main.main(argv, standalone_mode=False, auto_envvar_prefix=None)
    finally:
        run.callback = orig
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
