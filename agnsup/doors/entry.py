"""The console script's entry point: fast paths for `agnsup run` and `agnsup cancel`.

click costs ~40 ms to import, about ten times what bwrap needs to start a
whole sandbox, so the common `agnsup [--state-dir D] run [OPTIONS] -- CMD...`
and `agnsup [--state-dir D] cancel [--cell C] [--run R] [--agent A] [--all]
[--grace S] [--json]` (a kill switch: issue 29) are parsed here with no
imports. Anything these parsers do not fully understand (help, an unknown
option, a bad value, another command) goes to the click CLI in
agnsup/doors/cli.py, which stays the reference: parity tests
(tests/test_entry.py) run the same argv through both. `cancel` runs the same
function either way (cancel_cli.cancel_command), with click's output and exit codes.
"""
from __future__ import annotations

import os
import sys

def _run_options() -> tuple[dict, dict]:
    """{flag: (keyword, kind)} and {keyword: default} of `run`, from request.CellRequest."""
    from ..request import CellRequest
    flags, defaults = {}, {}
    for name, o in CellRequest.options().items():
        if o.flags:
            defaults[name] = o.default
            for flag in o.flags:
                flags[flag] = (name, o.kind)
    return flags, defaults


def _command_start(argv: list[str], command: str) -> tuple[int, str | None] | None:
    """(the index after `command`, the group's --state-dir or None) when argv is `[--state-dir D] COMMAND ...`,
    else None (any other group option, or another command: click's)."""
    i, state_dir = 0, None
    while i < len(argv) and argv[i] != command:
        a = argv[i]
        if a == "--state-dir" and i + 1 < len(argv):
            state_dir, i = argv[i + 1], i + 2
        elif a.startswith("--state-dir="):
            state_dir, i = a.split("=", 1)[1], i + 1
        else:
            return None
    return None if i >= len(argv) else (i + 1, state_dir)


def _value(argv: list[str], i: int, eq: str, value: str) -> tuple[str, int] | None:
    """(an option's value, the index after it): `--opt=value` carries it, `--opt value` takes the next
    argument; None when there is none."""
    if eq:
        return value, i + 1
    return None if i + 1 >= len(argv) else (argv[i + 1], i + 2)


def parse_run(argv: list[str]) -> tuple[str | None, dict, list[str]] | None:
    """(state_dir, run options, command) for a plain `run` invocation, else None."""
    start = _command_start(argv, "run")
    if start is None or start[1] == "":
        return None
    i, state_dir = start
    options, defaults = _run_options()
    opts = {**defaults, "env": [], "secrets": []}
    while i < len(argv):
        a = argv[i]
        if a == "--":
            i += 1
            break
        if not a.startswith("-") or a == "-":
            break
        name, eq, value = a.partition("=")
        if name not in options and name != "--state-dir":
            return None
        taken = _value(argv, i, eq, value)
        if taken is None:
            return None
        value, i = taken
        if name == "--state-dir":  # cli.md: also accepted after the command name
            if value == "":
                return None
            state_dir = value
            continue
        key, kind = options[name]
        if kind in ("pos", "nonneg"):
            try:
                v = float(value)
            except ValueError:
                return None
            if v != v or (kind == "pos" and v <= 0) or (kind == "nonneg" and v < 0):
                return None
            opts[key] = v
        elif kind in ("env", "secrets"):
            opts[key].append(value)
        elif kind == "death" and value not in ("kill", "keep"):
            return None
        else:
            opts[key] = value
    command = argv[i:]
    if not command:
        return None
    opts["secrets"] = tuple(opts["secrets"])  # as click's multiple option gives it
    if state_dir is None:
        state_dir = os.environ.get("AGNSUP_STATE_DIR") or None
    return state_dir, opts, command


# `cancel`'s options: {flag: (keyword, takes a value)} (agnsup/doors/cli.py's cancel command)
CANCEL_OPTIONS = {"--cell": ("cell_id", True), "--cell-id": ("cell_id", True), "--run": ("run_id", True),
                  "--run-id": ("run_id", True), "--agent": ("agent_id", True), "--agent-id": ("agent_id", True),
                  "--all": ("everything", False), "--grace": ("grace", True), "--json": ("as_json", False),
                  "--state-dir": ("state_dir", True)}


def parse_cancel(argv: list[str]) -> tuple[str | None, dict] | None:
    """(state_dir, cancel's keyword arguments) for a plain `cancel` invocation, else None
    (click then parses it: help, errors and anything unusual read as they always did)."""
    start = _command_start(argv, "cancel")
    if start is None:
        return None
    i, state_dir = start
    opts: dict = {"cell_id": None, "run_id": None, "agent_id": None, "everything": False, "grace": None,
                  "as_json": False}
    seen = set()
    while i < len(argv):
        name, eq, value = argv[i].partition("=")
        if name not in CANCEL_OPTIONS or name in seen:
            return None
        seen.add(name)
        key, takes_value = CANCEL_OPTIONS[name]
        if not takes_value:
            if eq:
                return None
            opts[key], i = True, i + 1
            continue
        taken = _value(argv, i, eq, value)
        if taken is None:
            return None
        value, i = taken
        if value == "" or value.startswith("-"):
            return None
        if key == "grace":
            digits = value.replace(".", "", 1)
            if not digits or any(c not in "0123456789" for c in digits):
                return None
            opts["grace"] = float(value)
        elif key == "state_dir":  # cli.md: also accepted after the command name
            state_dir = value
        else:
            opts[key] = value
    if len({k for k, _ in (CANCEL_OPTIONS[n] for n in seen)}) != len(seen):
        return None  # --cell and --cell-id both: click keeps the last one; let it say which
    if state_dir == "":
        return None
    if state_dir is None:
        state_dir = os.environ.get("AGNSUP_STATE_DIR") or None
    import codecs
    for stream in (sys.stdout, sys.stderr):  # click re-wraps an ASCII stream (its text would differ)
        try:
            if codecs.lookup(getattr(stream, "encoding", None) or "ascii").name == "ascii":
                return None
        except LookupError:
            pass
    return state_dir, opts


def main() -> None:
    parsed = parse_run(sys.argv[1:])
    if parsed is None:
        cancel_args = parse_cancel(sys.argv[1:])
        if cancel_args is not None:
            from .cancel_cli import main as cancel_main
            cancel_main(*cancel_args)
            return
        from .cli import main as cli_main
        cli_main()
        return
    state_dir, opts, command = parsed
    from . import handoff
    if handoff.wanted():  # a live serve of ours runs the cell (docs/cli.md "run"); returns when there is none
        handoff.run(state_dir, opts, command)
    from ..errors import AgnsupError, exit_code
    from ..tool import network_lines, run_process
    try:
        result = run_process(command, state_dir=state_dir, capture=False, entry="cli", forward_signals=True,
                             exit_after=True, **opts)
    except AgnsupError as e:
        sys.stderr.write(f"agnsup: {e.message}\n")
        sys.exit(exit_code(e))
    except OSError as e:  # a full disk, a read-only state root...: one line, not a traceback
        sys.stderr.write(f"agnsup: {e.strerror or e}{': ' + str(e.filename) if e.filename else ''}\n")
        sys.exit(125)
    for line in network_lines(result):
        sys.stderr.write(line + "\n")
    # Everything is recorded (journal committed, receipt written, locks
    # released). os._exit skips the interpreter's teardown and the journal's
    # close, whose WAL checkpoint costs two fsyncs (broker.Controller.close).
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(result["exit_code"])
