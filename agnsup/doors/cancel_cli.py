"""`agnsup cancel`: the one function both the click CLI (cli.py's cancel command) and the
console script's fast path (entry.py: no click import, issue 29) run, and the fast path's
reporting, which prints what cli.py's _Group, _json_errors and _fail print, with their exit codes."""
from __future__ import annotations

import os
import sys
from contextlib import suppress


def existing_state(state_dir: str | None):
    """The state root of an existing journal (cancel/cleanup only act on what was recorded)."""
    from ..errors import UnknownId
    from ..store.state import StateRoot
    st = StateRoot(state_dir)
    if not st.exists():
        from ..store.journal import preflight
        preflight(os.path.join(st.path, "journal.db"))  # cells on disk: the journal lost them, not "never run"
        raise UnknownId(f"no journal at {st.path}: nothing was ever run with this state root")
    return st


def cancel_command(state_dir, cell_id, run_id, agent_id, everything, grace, as_json, echo, fail,
                   close_journal: bool = True) -> None:
    """`agnsup cancel`, for click and for the fast path alike: `echo(text, err=False)` prints a line,
    `fail(error)` prints its line and exits; an AgnsupError raised here is the caller's to report.
    `close_journal=False`: the caller ends the process with os._exit right after (the fast path), and the
    connection is left to the exit, as `agnsup run` leaves its own (broker.Controller.close): when the cell's
    controller has exited first, the last connection's close checkpoints the WAL (fdatasyncs, writes and an
    unlink: 10-15 ms seen, between the receipt and the result line of 1 cancel in 8, issue 29); every commit
    was made before, and a WAL left behind is what a crash after the last commit leaves."""
    import json
    from .. import cancel as cancelmod
    from ..errors import StateError
    try:
        state = existing_state(state_dir)
        j = state.journal()
    except StateError as e:
        from ..errors import NoPermission
        if not everything or isinstance(e, NoPermission):  # another user's root: nothing of ours to kill
            raise
        # the kill switch works from whatever evidence survives (a damaged or lost journal)
        from ..store.state import StateRoot
        result = cancelmod.cancel_unjournaled(StateRoot(state_dir), cancelmod.Scope("all"), grace, e)
    else:
        try:  # one connection for the lookup and the cancel
            result = cancelmod.cancel(state, cancelmod.resolve(j, cell_id, run_id, agent_id, everything), grace,
                                      journal=j)
        finally:
            if close_journal:
                j.close()
    if as_json:
        echo(json.dumps(result, indent=2))
    else:
        echo(f"cancelled {result['cancelled']} {'process(es)' if 'root' in result else 'cell(s)'} "
             f"of {result['scope']}")
        for c in result["cells"]:
            echo(f"  {c['run_id']}/{c['agent_id']}/{c['cell_id']}: {c['state']}"
                 + (f" (kill: {c['kill']})" if c["kill"] else "") + "".join(f"; {n}" for n in c["notes"]))
    if result.get("journaled") is False:
        what = result.get("note") or result.get("root", {}).get("note") or ""
        fail(StateError(f"cancel {'killed' if result['cancelled'] else 'found'} {result['cancelled']} "
                        f"{'process(es)' if 'root' in result else 'cell(s)'}"
                        f"{' (' + what + ')' if what else ''} but could not journal it: {result['not_journaled']}"))


def _echo(text: str, err: bool = False) -> None:
    """click.echo's line: ANSI sequences stripped when the stream is not a terminal, flushed."""
    stream = sys.stderr if err else sys.stdout
    if "\x1b" in text:
        try:
            tty = stream.isatty()
        except Exception:
            tty = False
        if not tty:
            import re
            text = re.sub(r"\033\[[0-?]*[ -/]*[@-~]", "", text)  # click._compat.strip_ansi
    stream.write(text + "\n")
    stream.flush()


def _exit(code: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        with suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)  # the journal is closed and every line is out: no interpreter teardown to wait for


def main(state_dir: str | None, opts: dict) -> None:
    """The fast path's `cancel`: the exit codes and lines of cli.py's _Group, _json_errors and _fail."""
    # No cyclic garbage collection in this short process (it ends with os._exit): the imports on the way to the
    # kill (~120 modules) trip a dozen collection passes, ~1 ms of a kill switch's start (issue 29); what one
    # cancel allocates is freed by reference counting, and a scope of many cells holds a list of dicts each.
    import gc
    gc.disable()
    from ..errors import AgnsupError, StateError, exit_code

    def fail(e: AgnsupError) -> None:
        _echo(f"agnsup: {e.message}", err=True)
        _exit(exit_code(e))

    try:
        try:
            cancel_command(state_dir, **opts, echo=_echo, fail=fail, close_journal=False)  # _exit ends us
        except AgnsupError as e:
            if opts["as_json"]:  # _json_errors: the refusal as JSON on stdout too
                import json
                from ..errors import as_value
                _echo(json.dumps(as_value(e), indent=2))
            fail(e)
        except OSError as e:  # a full disk, a read-only state root...: one line, not a traceback
            fail(StateError(f"{e.strerror or e}{': ' + str(e.filename) if e.filename else ''}"))
    except (EOFError, KeyboardInterrupt):  # click: a blank line closes the terminal's ^C echo, then Abort
        _echo("", err=True)
        _echo("agnsup: aborted", err=True)
        _exit(130)
    _exit(0)
