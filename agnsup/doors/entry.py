"""The console script's entry point: a fast path for `agnsup run`.

click costs ~40 ms to import, about ten times what bwrap needs to start a
whole sandbox, so the common `agnsup [--state-dir D] run [OPTIONS] -- CMD...`
is parsed here with no imports. Anything this parser does not fully
understand (help, an unknown option, a bad value, another command) goes to
the click CLI in agnsup/doors/cli.py, which stays the reference: a parity test
(tests/test_entry.py) runs the same argv through both.
"""
from __future__ import annotations

import os
import sys
from contextlib import suppress

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


def parse_run(argv: list[str]) -> tuple[str | None, dict, list[str]] | None:
    """(state_dir, run options, command) for a plain `run` invocation, else None."""
    i, state_dir = 0, None
    while i < len(argv) and argv[i] != "run":
        a = argv[i]
        if a == "--state-dir" and i + 1 < len(argv):
            state_dir, i = argv[i + 1], i + 2
        elif a.startswith("--state-dir="):
            state_dir, i = a.split("=", 1)[1], i + 1
        else:
            return None
    if i >= len(argv) or state_dir == "":
        return None
    i += 1
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
        if not eq:
            if i + 1 >= len(argv):
                return None
            value, i = argv[i + 1], i + 2
        else:
            i += 1
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


def main() -> None:
    parsed = parse_run(sys.argv[1:])
    if parsed is None:
        from .cli import main as cli_main
        cli_main()
        return
    state_dir, opts, command = parsed
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
        with suppress(OSError, ValueError):
            stream.flush()
    os._exit(result["exit_code"])
