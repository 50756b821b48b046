"""The agnsup command line (click). The only place errors become exit codes.

Contract: ../shared/spec/cli.md (docs/cli.md in this repository).
"""
from __future__ import annotations

import json
import os
import sys

import click

from ..egress.summary import size as _size
from ..errors import AgnsupError, exit_code

DEFAULT_PS_LIMIT = 50   # store.cells.DEFAULT_LIMIT (not imported here: startup cost of every command)
CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


def _fail(e: AgnsupError):
    click.echo(f"agnsup: {e.message}", err=True)
    sys.exit(exit_code(e))


class _Group(click.Group):
    def main(self, *args, standalone_mode: bool = True, **kwargs):
        if not standalone_mode:  # a caller that handles click's exceptions itself (tests)
            return super().main(*args, standalone_mode=False, **kwargs)
        try:
            rv = super().main(*args, standalone_mode=False, **kwargs)
        except KeyboardInterrupt:
            click.echo("agnsup: interrupted", err=True)
            sys.exit(130)
        except click.exceptions.UsageError as e:
            # one line, as every refusal (click's own form is four)
            where = f" {e.ctx.info_name}" if e.ctx is not None and e.ctx.parent is not None else ""
            click.echo(f"agnsup{where}: {e.format_message()} (agnsup{where} --help)", err=True)
            sys.exit(125)
        except click.exceptions.Abort:
            click.echo("agnsup: aborted", err=True)
            sys.exit(130)
        except click.exceptions.Exit as e:
            sys.exit(e.exit_code)
        except click.exceptions.ClickException as e:
            click.echo(f"agnsup: {e.format_message()}", err=True)
            sys.exit(125)
        sys.exit(rv if isinstance(rv, int) else 0)  # standalone_mode=False hands back ctx.exit's code

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except AgnsupError as e:
            _fail(e)
        except OSError as e:  # a full disk, a read-only state root...: one line, not a traceback
            from ..errors import StateError
            _fail(StateError(f"{e.strerror or e}{': ' + str(e.filename) if e.filename else ''}"))


class _CommandLine(click.Command):
    """A command that ends in a command line (run, spawn, check): before the first
    word that is not an option, or before `--`, an option the command does not know
    is an error, not the command (`run --agent-idd x -- true` must not run
    `--agent-idd`); after it, everything is the command."""

    def parse_args(self, ctx, args):
        takes_value, known = set(), set()
        for p in self.params:
            if isinstance(p, click.Option):
                known.update(p.opts + p.secondary_opts)
                if not p.is_flag and not p.count:
                    takes_value.update(p.opts)
        known.update(ctx.help_option_names)
        i = 0
        while i < len(args):
            a = args[i]
            if a == "--" or not a.startswith("-") or a == "-":
                break
            name = a.partition("=")[0]
            if name not in known:
                import difflib
                close = difflib.get_close_matches(name, sorted(known), n=1)
                ctx.fail(f"no such option {name}" + (f" (did you mean {close[0]}?)" if close else "")
                         + "; a command that starts with '-' goes after --")
            i += 2 if name in takes_value and "=" not in a else 1
        return super().parse_args(ctx, args)


# run, spawn, check: the command line after the options is the command's own, unparsed
_COMMAND_LINE = {"cls": _CommandLine, "context_settings": {**CONTEXT, "ignore_unknown_options": True,
                                                           "allow_interspersed_args": False}}


@click.group(cls=_Group, context_settings=CONTEXT)
@click.option("--state-dir", envvar="AGNSUP_STATE_DIR", metavar="DIR",
              help="State root (journal, locks, receipts). Default /var/lib/agnsup for root, "
                   "$XDG_STATE_HOME/agnsup otherwise.")
@click.version_option(package_name="agnsup")
@click.pass_context
def main(ctx, state_dir):
    """agnsup: one execution authority for AI-agent tool calls.

    Every command runs as a cell: its own session, cgroup, mount namespace
    (and network namespace when the role denies network), an environment
    built from nothing, a journal record and a receipt.
    """
    ctx.obj = {"state_dir": state_dir}


_CLICK_TYPES = {"pos": click.FloatRange(min=0, min_open=True), "nonneg": click.FloatRange(min=0),
                "death": click.Choice(["kill", "keep"])}


def _cell_options(f):
    """The options `run` and `spawn` share, from request.CellRequest (cli.md: spawn takes run's options)."""
    from ..request import CellRequest
    opts = []
    for name, o in CellRequest.options().items():
        if not o.flags:
            continue
        kw = {"help": o.help, "metavar": o.metavar}
        if o.kind in ("env", "secrets"):
            kw.update(multiple=True)
        else:
            kw.update(default=o.default, show_default=o.default is not None, type=_CLICK_TYPES.get(o.kind))
        opts.append(click.option(*o.flags, name, **kw))
    opts.append(click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED))
    for o in reversed(opts):
        f = o(f)
    return f


@main.command(**_COMMAND_LINE)
@_cell_options
@click.pass_obj
def run(obj, command, **options):
    """Run CMD as one cell in the foreground and supervise it.

    stdin, stdout and stderr pass through; SIGINT or SIGTERM to agnsup cancel
    the cell. Exit status: the command's own; 128+N if it died of signal N;
    124 on --timeout; 125 if agnsup failed; 126 if denied or not executable;
    127 if not found on the cell's PATH; 75 if the worktree lock timed out.

    Example: agnsup run --role executor -- pytest -q
    """
    from ..tool import run_process
    result = run_process(list(command), **options, state_dir=obj["state_dir"], capture=False, entry="cli",
                         forward_signals=True)
    from ..tool import network_lines
    for line in network_lines(result):
        click.echo(line, err=True)
    sys.exit(result["exit_code"])


def _root(obj):
    """The state root the command was given (--state-dir, AGNSUP_STATE_DIR or the default)."""
    from ..store.state import StateRoot
    return StateRoot(obj["state_dir"])


def _echo_json(as_json: bool, value, sort_keys: bool = False) -> bool:
    """With --json, print `value` as JSON; whether it did (the text form is printed otherwise)."""
    if as_json:
        click.echo(json.dumps(value, indent=2, sort_keys=sort_keys))
    return as_json


def _journal(obj):
    """The journal of the state root; None when nothing was ever run with it (no receipts)."""
    from ..errors import UnknownId
    try:
        return _state(obj).journal()
    except UnknownId:
        return None


@main.command()
@click.option("--run", "--run-id", "run_id", default=None, help="Only this run.")
@click.option("--all", "show_all", is_flag=True, help="Include ended cells.")
@click.option("--since", metavar="WHEN", default=None,
              help="Cells alive at or after WHEN (ended ones too): an age (30m, 1h, 2d) or an ISO 8601 time.")
@click.option("--until", metavar="WHEN", default=None, help="Cells started by WHEN (ended ones too).")
@click.option("--state", "wanted", metavar="STATE", multiple=True,
              help="running (not ended yet), ended, or one cell state (exited, failed, ...); repeatable.")
@click.option("--limit", type=click.IntRange(min=0), default=None, metavar="N",
              help=f"The newest N cells (text: {DEFAULT_PS_LIMIT} unless given; 0: all).")
@click.option("--json", "as_json", is_flag=True, help="A JSON list of cells.")
@click.pass_obj
def ps(obj, run_id, show_all, since, until, wanted, limit, as_json):
    """Cells and their states, as a run -> agent -> cell tree. A run whose cells all
    ended shows as ended (idle while its server, MCP or serve, is still up)."""
    import time

    from ..store.cells import check_states, listing, newest, parse_when, select, tree_text
    now = time.time()
    window = [None if w is None else parse_when(w, opt, now) for w, opt in ((since, "--since"), (until, "--until"))]
    check_states(wanted)
    filtered = since is not None or until is not None or bool(wanted)
    cells = select(listing(_root(obj), run_id, show_all or filtered), *window, tuple(wanted))
    cells, left_out = newest(cells, DEFAULT_PS_LIMIT if limit is None and not as_json else limit)
    if any(c["state"] in ("waiting", "starting", "running") for c in cells):
        from ..store.cells import reduced_of
        j = _journal(obj)
        try:
            if j is not None:
                reduced_of(j, cells)  # what a reduced cell runs without (isolation.reduced)
        finally:
            if j is not None:
                j.close()
    if any(c["state"] not in ("waiting", "starting", "running") for c in cells):
        j = _journal(obj)  # a cell that ended may have changes kept: kept, undone or dropped now
        try:
            states = _change_states(j, run_id)
        finally:
            if j is not None:
                j.close()
        for c in cells:
            row = states.get((c["run_id"], c["cell_id"]))
            if row is not None:
                st, by = _record_state(row, states)
                c["changes"] = {"record": f"{row['run_id']}/{row['record_id']}", "files": row["files"],
                                "state": st, **({"undone_by": by} if st == "undone" else {})}
    more = (f"{left_out} older cell(s) not shown: --limit 0 shows all, --since/--until/--state/--run narrow"
            if left_out else None)
    if as_json:
        click.echo(json.dumps(cells, indent=2))
        if more:
            click.echo(f"agnsup ps: {more}", err=True)
    elif not cells:
        click.echo("no cells" if show_all or filtered else "no live cells (--all shows ended ones)")
    else:
        click.echo("\n".join(tree_text(cells, _run_labels(obj))))
        if more:
            click.echo(f"({more})")


def _run_labels(obj) -> dict:
    """{run_id: what ps calls it} for the journal's active runs (store.cells.run_label)."""
    from ..store.cells import run_label
    j = _journal(obj)
    if j is None:
        return {}
    try:
        return {run: run_label("active", act) for run, act in j.run_activity().items()}
    finally:
        j.close()




@main.command()
@click.option("--run", "--run-id", "run_id", default=None, help="Only this run.")
@click.option("--cell", "--cell-id", "cell_id", default=None, help="Only this cell.")
@click.option("--recovery", is_flag=True, help="Recovery receipts (written by the janitor).")
@click.option("--refused", is_flag=True, help="Calls that started nothing: denied by governance, or the "
                                             "command not found / not executable.")
@click.option("--json", "as_json", is_flag=True, help="A JSON list of receipts.")
@click.option("--export", "export", type=click.Choice(["jsonl"]), default=None,
              help="Stream one JSON line per receipt with its chain record: seq, hash, prev, kind, run_id, cell_id, "
                   "receipt (agnsup verify checks the chain; ship these lines off the host to keep it).")
@click.pass_obj
def receipts(obj, run_id, cell_id, recovery, refused, as_json, export):
    """Receipts of ended cells (or of recoveries) as JSON objects."""
    j = _journal(obj)
    if export:
        if refused or as_json:
            raise click.UsageError("--export takes no --refused or --json")
        kind = "recovery" if recovery else "cell"
        out = sys.stdout
        for seq, h, prev, _anchor, _id, k, r, c, _t, data in (j.chained_receipts(kind, run_id, cell_id) if j else ()):
            out.write(f'{{"seq": {seq}, "hash": "{h}", "prev": "{prev}", "kind": {json.dumps(k)}, '
                      f'"run_id": {json.dumps(r)}, "cell_id": {json.dumps(c)}, "receipt": {data}}}\n')
        out.flush()
        return
    if refused:
        items = [r for r in (j.refusals(run_id) if j else []) if cell_id is None or r["cell_id"] == cell_id]
        click.echo(json.dumps(items, indent=2, sort_keys=True) if as_json else
                   "\n".join(f"{r['run_id']}: {r['kind']}: {' '.join(r.get('argv') or [])[:60]}: "
                             f"{r.get('error') or (r.get('decision') or {}).get('rule')}" for r in items)
                   or "no refused calls")
        return
    items = j.receipts("recovery" if recovery else "cell", run_id, cell_id) if j else []
    states = _change_states(j, run_id) if any(isinstance(r.get("changes"), dict) for r in items) else {}
    for r in items:
        if states and isinstance(r.get("changes"), dict):
            r["changes"] = _with_state(r["changes"], states)
    if _echo_json(as_json, items, sort_keys=True):
        return
    for r in items:
        if r.get("kind") == "cell":
            why = f" ({r['reason']})" if r["reason"] != r["state"] else ""  # not "exited (exited)"
            click.echo(f"{r['run_id']}/{r['agent_id']}/{r['cell_id']}: {r['state']}{why} "
                       f"exit={r['exit_code']} {' '.join(r['argv'])[:60]}")
            if r.get("network"):
                from ..egress.summary import lines
                for line in lines(r["network"]):
                    click.echo("  " + line)
            if r.get("reduced"):  # isolation.reduced: what this cell ran without (docs/isolation.md)
                click.echo("  reduced: " + ", ".join(r["reduced"]) + " (isolation.not_in_force says what each "
                           "takes away)")
            line = changes_line(r)
            if line:
                click.echo("  " + line)
            for k in r.get("kernel_stopped") or []:  # the kernel stopped what the gate let run
                click.echo(f"  kernel stopped {k['class']}: {k['what']} x{k['count']} "
                           f"(gate: {k['gate_rule'] or 'no rule'}; agnsup check --explain)")
        else:
            click.echo(json.dumps(r, sort_keys=True))
    if not items:
        click.echo("no receipts")


def _undo_cmd(record: str) -> str:
    """The command that undoes record "run/id" (--run only when the run is not the default one)."""
    run, _, rid = record.rpartition("/")
    return f"agnsup undo {rid}" + ("" if run in ("", "default") else f" --run {run}")


def changes_line(r: dict) -> str | None:
    """A receipt's `changes` section in one line (receipts): what the cell changed and the
    command that undoes it; None when the receipt has none (a read-only or older cell)."""
    ch = r.get("changes")
    if not isinstance(ch, dict) or ch.get("mode") == "none":  # none: a read-only worktree, nothing to say
        return None
    if ch.get("mode") == "live":
        why = ch.get("why") or ch.get("reason")
        return "changes: live, not recorded" + (f" ({why})" if why else "") + ": no diff or undo"
    if ch.get("error"):  # the commit did not finish: the janitor finishes it
        return f"changes: {ch['error']}"
    if not ch.get("files"):
        return "changes: none"
    parts = [f"{ch[k]} {k}" for k in ("created", "modified", "deleted") if ch.get(k)]
    other = ch["files"] - sum(ch.get(k) or 0 for k in ("created", "modified", "deleted"))
    if other > 0:
        parts.append(f"{other} other")
    record = ch.get("record") or f"{r.get('run_id')}/{r.get('cell_id')}"
    state = ch.get("state")  # the journal's word now (receipts adds it): kept, undone, redone, dropped
    if state == "undone" and ch.get("undone_by"):
        redo = _undo_cmd(record.rpartition("/")[0] + "/" + ch["undone_by"])
        return f"changes: {', '.join(parts)}: undone by {ch['undone_by']} (redo: {redo})"
    if state == "dropped":
        return f"changes: {', '.join(parts)}: record dropped (retention), no longer undoable"
    return f"changes: {', '.join(parts)}, {_size(ch.get('bytes') or 0)} (undo: {_undo_cmd(record)})"


_CHANGE_MARK = {"created": "A", "modified": "M", "deleted": "D", "replaced": "R", "mode": "m"}
_COUNT_ORDER = ("created", "modified", "deleted", "replaced", "mode")


def _sizes(e: dict) -> str:
    b, a = (list(e.get("sizes") or []) + [None, None])[:2]
    if (e.get("before") or {}).get("type") in (None, "absent"):
        return _size(a or 0)
    if (e.get("after") or {}).get("type") in (None, "absent"):
        return f"was {_size(b or 0)}"
    return f"{_size(b or 0)} -> {_size(a or 0)}"


def _entry_line(e: dict) -> str:
    """One changed path: its mark, its path, and what changed beyond the content."""
    before, after = e.get("before") or {}, e.get("after") or {}
    types = [t for t in (before.get("type"), after.get("type")) if t not in (None, "absent", "file")]
    path = e["path"] + ("/" if "dir" in types else "")
    notes = []
    if types:
        notes.append(" -> ".join(dict.fromkeys(types)) if e.get("change") != "replaced" else
                     f"{before.get('type')} -> {after.get('type')}")
    if after.get("type") == "symlink" and after.get("target") is not None:
        notes.append(f"-> {after['target']}")
    if before.get("mode") is not None and after.get("mode") is not None and before["mode"] != after["mode"]:
        notes.append(f"mode {before['mode'] & 0o7777:o} -> {after['mode'] & 0o7777:o}")
    if before.get("uid") is not None and after.get("uid") is not None and \
            (before["uid"], before.get("gid")) != (after["uid"], after.get("gid")):
        notes.append(f"owner {before['uid']}:{before.get('gid')} -> {after['uid']}:{after.get('gid')}")
    if e.get("note"):
        notes.append(f"{_sizes(e)}; {e['note']}")
    elif e.get("binary"):
        notes.append(f"binary, {_sizes(e)}")
    elif "added" in e or "removed" in e:
        notes.append(f"+{e.get('added', 0)} -{e.get('removed', 0)}")
    return f"{_CHANGE_MARK.get(e.get('change'), '?')} {path}" + (f"  ({', '.join(notes)})" if notes else "")


def diff_text(d: dict, stat: bool) -> list[str]:
    """`agnsup diff` for a terminal: a header, the file list (A created, M modified, D deleted,
    R replaced by another kind, m mode or owner only; --stat: +/- lines or sizes), then
    (without --stat) the unified diff of every text file and one line per binary one."""
    entries = d.get("entries") or []
    counts = d.get("counts") or {}
    said = ", ".join(f"{counts[k]} {k}" for k in _COUNT_ORDER if counts.get(k)) or f"{len(entries)} path(s)"
    extra = ", ".join(f"{counts[k]} {k}{'s' if counts[k] > 1 else ''}" for k in ("dir", "symlink") if counts.get(k))
    now = d.get("now") or {"state": d.get("state"), "by": d.get("undone_by")}
    state = {"committed": "in force", "kept": "in force", "redone": "redone, in force"}.get(now["state"], now["state"])
    kind = "undo record" if d.get("kind") == "undo" else "cell"
    head = f"{kind} {d.get('record')}" + (f", undoes {d['undoes']}" if d.get("undoes") else "") + \
        (f" ({state}" + (f" by {now['by']}" if now.get("by") and now["state"] == "undone" else "") + ")"
         if state else "")
    out = [f"{head}: {said}" + (f" ({extra})" if extra else "") + (f" in {d['worktree']}" if d.get("worktree") else "")]
    out += ["  " + _entry_line(e) for e in entries]
    if stat:
        return out
    for e in entries:
        if e.get("diff"):
            out.append(e["diff"].rstrip("\n"))
        elif e.get("note"):
            out.append(f"{e['path']}: {e['note']} ({_sizes(e)})")
        elif e.get("binary"):
            b = "/dev/null" if (e.get("before") or {}).get("type") in (None, "absent") else f"a/{e['path']}"
            a = "/dev/null" if (e.get("after") or {}).get("type") in (None, "absent") else f"b/{e['path']}"
            out.append(f"Binary files {b} and {a} differ ({_sizes(e)})")
    return out


def _cell_arg(cell_id: str | None, cell_opt: str | None, required: bool) -> str | None:
    """CELL as the argument or as --cell/--cell-id (cli.md: both spellings of every id)."""
    if cell_id is not None and cell_opt is not None and cell_id != cell_opt:
        raise click.UsageError(f"two cells given: {cell_id} and --cell {cell_opt}")
    cell = cell_id if cell_id is not None else cell_opt
    if cell is None and required:
        raise click.UsageError("Missing argument 'CELL'.")
    return cell


@main.command()
@click.argument("cell_id", metavar="CELL", required=False)
@click.option("--cell", "--cell-id", "cell_opt", default=None, metavar="C", hidden=True)
@click.option("--run", "--run-id", "run_id", default=None, metavar="R",
              help="The cell's run (only needed when the id names cells in several runs).")
@click.option("--stat", is_flag=True, help="The file list with +/- lines per text file and sizes for binary "
                                           "ones, without the text.")
@click.option("--json", "as_json", is_flag=True, help="The record's entries as JSON (keys: docs/cli.md).")
@click.pass_obj
def diff(obj, cell_id, cell_opt, run_id, stat, as_json):
    """What CELL changed in its worktree: each path created (A), modified (M),
    deleted (D), replaced by another kind (R) or whose mode changed (m), then a
    unified diff of every text file (sizes for binary ones). CELL may be an undo
    record's id (undo-...), which shows what that undo restored.

    Exit 0; 1 for an id the journal never saw, a cell that changed nothing,
    ran live (not captured) or whose record was dropped.

    \b
    Examples:
      agnsup diff c-1a2b3c4d
      agnsup diff c-1a2b3c4d --stat
      agnsup diff c-1a2b3c4d --run R --json
    """
    from ..supervisor import diff_changes
    cell_id = _cell_arg(cell_id, cell_opt, True)
    state = _state(obj)
    j = state.journal()
    try:
        d = diff_changes(state, j, cell_id, run_id, stat)
    finally:
        j.close()
    if not _echo_json(as_json, d):
        click.echo("\n".join(diff_text(d, stat)))


def undo_text(result: dict) -> list[str]:
    """`agnsup undo` for a terminal: one line per record undone, then the undo's own record
    id and the command that redoes it."""
    out = []
    for rec in result.get("records") or []:
        rid = rec.get("record") or ""
        run = rid.rpartition("/")[0]
        what = f"{run}/{rec['undoes']}" if rec.get("undoes") else "?"
        out.append(f"undid {what}: {rec.get('files', 0)} path(s) put back as they were in {rec.get('worktree')}")
        out.append(f"  this undo is record {rid.rpartition('/')[2]} (undo it to redo: {_undo_cmd(rid)})")
    return out or ["nothing undone"]


@main.command()
@click.argument("cell_id", metavar="[CELL]", required=False)
@click.option("--cell", "--cell-id", "cell_opt", default=None, metavar="C", hidden=True)
@click.option("--run", "--run-id", "run_id", default=None, metavar="R",
              help="Undo every cell of run R that has changes kept, newest first (with CELL: the cell's run).")
@click.option("--agent", "--agent-id", "agent_id", default=None, metavar="A",
              help="Undo every cell of agent A (of run R with --run), newest first.")
@click.option("--force", is_flag=True,
              help="Undo even when a later cell, or something outside agnsup, changed the same paths since "
                   "(their change is overwritten; it stays in their own record).")
@click.option("--lock-timeout", type=click.FloatRange(min=0), default=30.0, show_default=True, metavar="SECONDS",
              help="How long to wait for the worktree lock a running cell holds (then exit 75).")
@click.option("--json", "as_json", is_flag=True, help='Print {"undone", "records"} (keys: docs/cli.md).')
@click.pass_obj
def undo(obj, cell_id, cell_opt, run_id, agent_id, force, lock_timeout, as_json):
    """Put back what CELL changed in its worktree, exactly as it was before
    the cell ran (the files it created go, the ones it deleted or changed come
    back, modes and symlinks too, .git included). With --run or --agent: every
    cell of that run or agent with changes kept, newest first.

    The undo is itself a record: its id (undo-...) is printed, and undoing it
    redoes the cell's changes.

    The undo takes the worktree's lock as a writing cell does: it waits for a
    cell still running there (up to --lock-timeout).

    Exit 0; 75 when a later cell (named) or something outside agnsup changed
    the same paths since (nothing is touched; --force overrides), or the
    worktree lock stayed held past --lock-timeout; 1 for an id
    the journal never saw, a cell that changed nothing, ran live, was already
    undone or whose record was dropped, or a worktree that moved.

    \b
    Examples:
      agnsup undo c-1a2b3c4d
      agnsup undo --run R                # the whole run, newest first
      agnsup undo --agent A --run R
      agnsup undo undo-0123456789ab      # redo
    """
    from ..supervisor import undo_changes
    cell_id = _cell_arg(cell_id, cell_opt, False)
    state = _state(obj)
    j = state.journal()
    try:
        result = undo_changes(state, j, cell_id, run_id, agent_id, force, lock_timeout)
    finally:
        j.close()
    if not _echo_json(as_json, result):
        click.echo("\n".join(undo_text(result)))


def _change_states(j, run_id: str | None = None) -> dict:
    """{(run_id, record_id): journal row} of the change records (one query): their state now
    (kept, undone, dropped). A receipt is written when its cell ended and never rewritten."""
    if j is None:
        return {}
    return {(r["run_id"], r["record_id"]): r for r in j.change_rows(run_id=run_id)}


def _record_state(row, states: dict) -> tuple[str, str | None]:
    from ..changes import record_state
    return record_state(row, lambda run, rid: states.get((run, rid)))


def _with_state(ch, states: dict):
    """A receipt's `changes` section plus `state` (kept, undone, redone, dropped) and
    `undone_by` (the undo record in force) from the journal now."""
    if not isinstance(ch, dict) or not ch.get("record"):
        return ch
    row = states.get(tuple(ch["record"].rsplit("/", 1)))
    if row is None:
        return ch
    state, by = _record_state(row, states)
    return {**ch, "state": state, **({"undone_by": by} if state == "undone" else {})}


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable report.")
@click.option("--no-probe", is_flag=True, help="Start no cell (status then says \"not probed\").")
@click.option("--role", "roles", multiple=True, metavar="ROLE",
              help="Probe only this role (repeatable; default: every role --role accepts here), e.g. "
                   "--role reduced where only the reduced role is used.")
@click.pass_obj
def doctor(obj, as_json, no_probe, roles):
    """What this host offers (cgroups, namespaces, pidfs, seccomp, Landlock)
    and which isolation agnsup will use or must do without; then a trivial
    cell per role, started as `agnsup run` starts it and removed after:
    status ok only when each ran. Exit 1 when a cell cannot run here."""
    import time
    from .doctor import format_text, report
    t0 = time.monotonic()

    def progress(role, res):  # on stderr once it takes more than a second
        if time.monotonic() - t0 > 1.0:
            click.echo(f"agnsup doctor: cell of role {role}: {'ran' if res['ran'] else 'FAILED at ' + res['step']}",
                       err=True)
    for role in roles:  # an unknown or broken role: one line, exit 125, as `run --role` says it
        from ..policy import load
        load(role)
    r = report(_root(obj).path, probe=not no_probe, progress=progress, roles=list(roles) or None)
    click.echo(json.dumps(r, indent=2) if as_json else format_text(r))
    sys.exit(0 if r["ok"] else 1)


@main.command(**_COMMAND_LINE)
@click.option("--role", default="executor", show_default=True, help="Role policy to judge under.")
@click.option("--workdir", type=click.Path(file_okay=False), default=None, help="Worktree (default: cwd).")
@click.option("--batch", "batch", type=click.File("rb"), default=None,
              help="One shell command per line from FILE ('-' for stdin); one JSON decision per line out; "
                   "exit 126 if any line was denied.")
@click.option("--json", "as_json", is_flag=True, help="The decision as JSON.")
@click.option("--explain", is_flag=True,
              help="Also what the kernel refuses in a cell of the role, class by class (network, writes, pids, "
                   "memory), the gate rule that bears on CMD in each, and the setting that would refuse it.")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
@click.pass_obj
def check(obj, role, workdir, batch, as_json, explain, command):
    """The governance decision for CMD without running anything.

    Exit 0 when allowed, 126 when denied. With --batch, every non-empty line is
    judged as shell text and printed as {"command", "allowed", "rule", "zone",
    "reason", ...}, one decision per line whatever the line holds; the exit
    status is 0 when no line was denied, 126 when at least one was.
    """
    from .. import governance, policy
    from ..gate.paths import resolve
    st = _root(obj)
    pol = policy.load(role, st.path if os.path.isdir(st.path) else None)
    wt = resolve(os.path.abspath(workdir or os.getcwd()))
    ctx = governance.context(pol, wt, st.path)
    from ..gate import check as gate_check, judge_shell
    if batch is not None:
        out = click.get_text_stream("stdout")
        denied = False
        for raw in batch:
            line = raw.decode("utf-8", "replace").rstrip("\r\n")  # a bad byte is judged, not fatal
            if not line.strip():
                continue
            d = judge_shell(line, ctx)
            denied = denied or not d.allowed
            out.write(json.dumps({"command": line, **d.to_dict()}) + "\n")
        out.flush()
        sys.exit(126 if denied else 0)
    if not command:
        raise click.UsageError("give a command after -- or --batch FILE")
    d, trail = gate_check("run_process", {"argv": list(command), "cwd": wt}, ctx)
    out = {"command": list(command), **d.to_dict(), "trail": trail}
    if explain:  # the same call under the settings that turn kernel-backed flags into refusals
        from ..receipts import kernel_explain
        from ..util.record import replace
        strict, _ = gate_check("run_process", {"argv": list(command), "cwd": wt},
                               replace(ctx, kernel_enforced="deny", unknown_operands="deny", unreadable="deny"))
        out["kernel"] = kernel_explain(pol, d.to_dict(), strict.to_dict())
    if not _echo_json(as_json, out):
        verdict = "allowed" if d.allowed else "DENIED"
        click.echo(f"{verdict}: {d.rule} (zone {d.zone}): {d.reason}")
        for n in d.flagged:
            click.echo(f"  flagged {n['rule']}: {n['reason']}")
        if not d.allowed and d.hint:
            click.echo(f"  if this is wrong: {d.hint}")
        for cls, e in out.get("kernel", {}).items():
            gate = ", ".join(e["gate_rules"]) or "no rule"
            more = (f"; refused with {e['refused_with']}" + (f" ({e['would_deny']})" if e.get("would_deny") else "")
                    if e.get("refused_with") else "")
            click.echo(f"  kernel, {cls}: {e['kernel']}; gate: {gate}{more}")
    sys.exit(0 if d.allowed else 126)


@main.command("tool-schema")
def tool_schema():
    """Print the run_process JSON schema for LLM function calling."""
    from ..tool import RUN_PROCESS_SCHEMA
    click.echo(json.dumps(RUN_PROCESS_SCHEMA, indent=2))


@main.command()
@click.option("--cell", "--cell-id", "cell_id", default=None, metavar="C",
              help="Cancel this cell (with --run R if ambiguous).")
@click.option("--run", "--run-id", "run_id", default=None, metavar="R",
              help="Cancel this run (with --agent: that agent).")
@click.option("--agent", "--agent-id", "agent_id", default=None, metavar="A", help="Cancel this agent of --run R.")
@click.option("--all", "everything", is_flag=True, help="Kill switch: every live cell under the state root.")
@click.option("--grace", type=click.FloatRange(min=0), default=None, metavar="S",
              help="Seconds between SIGTERM and the kill (default: the role's limits.grace).")
@click.option("--json", "as_json", is_flag=True, help='Print {"cancelled": N, "cells": [...]}.')
@click.pass_obj
def cancel(obj, cell_id, run_id, agent_id, everything, grace, as_json):
    """Stop a cell, an agent's cells, a run, or everything: SIGTERM, the grace
    period, then a kill through the scope's cgroup; returns once every cell is
    empty and concluded. Works from any process, whichever controller started
    the cells. Repeating it is safe: what already ended counts 0. A cancelled
    run accepts no new cells.

    Examples: agnsup cancel --run R --agent A; agnsup cancel --all --grace 0
    """
    from .cancel_cli import cancel_command  # the console script's fast path runs the same function
    cancel_command(obj["state_dir"], cell_id, run_id, agent_id, everything, grace, as_json, click.echo, _fail)


@main.command()
@click.argument("cell_id", metavar="CELL")
@click.option("--run", "--run-id", "run_id", default=None, metavar="R", help="The cell's run (if the id is ambiguous).")
@click.option("--timeout", type=click.FloatRange(min=0), default=None, metavar="SECONDS",
              help="Give up after SECONDS (exit 75); default: wait as long as the cell runs.")
@click.option("--json", "as_json", is_flag=True, help="Print the result (exit_code, state, reason, receipt) as JSON.")
@click.pass_obj
def wait(obj, cell_id, run_id, timeout, as_json):
    """Wait until CELL ended (a spawned cell, queued or running, or any other) and
    exit with its exit status (for a cell that never ran, the code of why: 75 lock
    timeout, 143 cancelled before it started; 125 when none was recorded). Works
    from any process that can open the state root.

    Example: agnsup wait c-1a2b3c4d --json
    """
    from ..supervisor import wait_cell
    result = wait_cell(obj["state_dir"], cell_id, run_id, timeout)
    _echo_json(as_json, result)
    code = result.get("exit_code")
    sys.exit(125 if code is None else code)


@main.command()
@click.option("--run", "--run-id", "run_id", default=None, metavar="R", help="The run to clean up.")
@click.option("--older-than", "older_than", default=None, metavar="AGE",
              help="Every run whose cells all ended before AGE ago (30m, 12h, 2d) or an ISO 8601 time.")
@click.option("--json", "as_json", is_flag=True, help='Print {"cleaned": N, "items": [...]}.')
@click.pass_obj
def cleanup(obj, run_id, older_than, as_json):
    """Reclaim what the run's ended cells left (cgroup directories, temp dirs,
    worktree locks, and once none runs, the run's change records: its cells
    can no longer be undone). Cells still running are not touched (exit 1;
    cancel them first). A second call reports cleaned: 0. --older-than: the
    same for every old run; a run with a live cell is skipped (exit 0)."""
    from .. import cancel as cancelmod
    from ..errors import CellsStillRunning, UsageError
    if (run_id is None) == (older_than is None):
        raise UsageError("cleanup: give --run R or --older-than AGE (one of them)")
    if older_than is not None:
        import time

        from ..store.cells import parse_when
        result = cancelmod.cleanup_older_than(_state(obj), parse_when(older_than, "--older-than", time.time()))
        if not _echo_json(as_json, result):
            click.echo(f"cleaned {result['cleaned']} item(s) of {len(result['runs'])} run(s) older than "
                       f"{older_than}" + (f"; {len(result['skipped'])} old run(s) with live cells not touched"
                                          if result["skipped"] else ""))
            for it in result["items"]:
                click.echo(f"  {it['run_id']}: {it['kind']}: {it.get('path') or it.get('method')}")
        return
    try:
        result, err = cancelmod.cleanup(_state(obj), run_id), None
    except CellsStillRunning as e:
        from ..errors import as_value
        result, err = {**e.details["result"], **as_value(e)}, e
    if not _echo_json(as_json, result):
        click.echo(f"cleaned {result['cleaned']} item(s) of run {run_id} (run {result['run_state']})")
        for it in result["items"]:
            click.echo(f"  {it['kind']}: {it.get('path') or it.get('method')}")
    if err is not None:
        _fail(err)


@main.command()
@click.option("--socket", "socket_path", type=click.Path(dir_okay=False), default=None,
              help="Unix socket to listen on (default: <state>/agnsup.sock, mode 0600).")
@click.pass_obj
def serve(obj, socket_path):
    """A long-lived controller for many concurrent cells.

    Prints one JSON line {"ready": true, "socket": ..., "controller": ...} once
    it accepts requests (JSON lines over the socket: spawn, run, wait, cancel,
    cleanup, ps, publish_port, list_ports, close_port, shutdown; see docs/cli.md). SIGTERM or SIGINT: its running
    cells are cancelled, then it exits.
    """
    from .serve import serve as serve_main
    sys.exit(serve_main(obj["state_dir"], socket_path))


@main.group(invoke_without_command=True, context_settings=CONTEXT)
@click.option("--role", default="executor", show_default=True,
              help="Role policy of every cell of the session (the model cannot change it).")
@click.option("--workdir", type=click.Path(file_okay=False), default=None,
              help="Worktree the cells run in; a call's workdir must lie inside it (default: cwd).")
@click.option("--run-id", "--run", "run_id", default=None, metavar="R",
              help="Run id of the session's cells (default: mcp-XXXXXXXX, new each start; over HTTP, "
                   "new each session).")
@click.option("--agent", "--agent-id", "agent_id", default=None, metavar="A",
              help="Agent id of the cells (default: the MCP client's name).")
@click.option("--http", "http", default=None, metavar="HOST:PORT|unix:PATH",
              help="Streamable HTTP instead of stdio: a loopback port (a token guards it: a bearer header, or "
                   "?token= in the URL) or a Unix socket (mode 0600).")
@click.pass_context
def mcp(ctx, role, workdir, run_id, agent_id, http):
    """A Model Context Protocol server on stdio (needs the extra: pip install 'agnsup[mcp]').

    Tools: run_process, run_shell, spawn, read_output, write_stdin, resize,
    signal, wait, cancel, ps, receipt, diff, undo, publish_port, list_ports. Every call that runs something is a
    cell of this session's run under --role. Prints one JSON line {"ready": true, "run_id":
    ...} once it serves (stdio: on stderr; --http: on stdout, with the url).
    When the client ends the session (or on SIGTERM/SIGINT), its cells are
    cancelled. `agnsup mcp config CLIENT` prints how to register it.
    """
    if ctx.invoked_subcommand is not None:  # `mcp config`: the server's options are config's own
        given = [p.opts[0] for p in ctx.command.params if p.expose_value
                 and ctx.get_parameter_source(p.name) == click.core.ParameterSource.COMMANDLINE]
        if given:
            raise click.UsageError(f"{', '.join(given)}: give it after `{ctx.invoked_subcommand}`", ctx)
        return
    from .mcp.command import main as mcp_main
    sys.exit(mcp_main(ctx.obj["state_dir"], role, workdir, run_id, agent_id, http))


@mcp.command("config", context_settings=CONTEXT)
@click.argument("client")
@click.option("--role", default="executor", show_default=True, help="The server's --role.")
@click.option("--workdir", type=click.Path(file_okay=False), default=None,
              help="The server's --workdir (default: the current directory), made absolute.")
@click.option("--agent", "--agent-id", "agent_id", default=None, metavar="A", help="The server's --agent.")
@click.option("--name", default="agnsup", show_default=True, help="The server's name in the client.")
@click.option("--http", "http", default=None, metavar="HOST:PORT",
              help="http: where the server listens (a loopback port; default 127.0.0.1:8765).")
@click.option("--json", "as_json", is_flag=True, help="The registration as JSON (command, args, lines, ...).")
@click.pass_obj
def mcp_config(obj, client, role, workdir, agent_id, name, http, as_json):
    """Print the line (or file snippet) that registers this agnsup as an MCP server with CLIENT:
    claude, codex, gemini (their `mcp add` commands), cursor, json (a project's .mcp.json), http
    (the `mcp --http` server line, its URL with the token as a header and in the query).

    The command is this agnsup's absolute path (`/abs/python -m agnsup` when run that way), the
    worktree and --state-dir absolute: a client starts the server without your shell's PATH."""
    from .mcp.command import parse_listen
    from .mcp.config import CLIENTS, HTTP_ADDR, own_command, registration, server_args
    from ..errors import UsageError
    from ..store.state import check_id
    if client not in CLIENTS:
        raise UsageError(f"mcp config: unknown client {client!r} (known: {', '.join(CLIENTS)})")
    workdir = os.path.realpath(workdir or os.getcwd())
    if not os.path.isdir(workdir):
        raise UsageError(f"mcp config: --workdir {workdir}: not a directory")
    if agent_id:
        check_id("agent", agent_id)
    from .. import policy
    policy.load(role)  # an unknown role fails here, not in the client when it starts the server
    if http is not None and (parse_listen(http)[0] == "unix" or parse_listen(http)[1] == 0):
        raise UsageError(f"mcp config: --http {http}: a loopback HOST:PORT with a fixed port (a client needs "
                         "its URL)")
    out = registration(client, own_command(), server_args(role, workdir, obj["state_dir"], agent_id), name,
                       token=os.environ.get("AGNSUP_MCP_TOKEN") or None, http=http or HTTP_ADDR)
    if not _echo_json(as_json, out):
        click.echo("\n".join(out["lines"]))


@main.command()
@click.option("--grpc", "grpc_addr", default="127.0.0.1:9090", show_default=True, metavar="HOST:PORT",
              help="Where process.v1.ProcessService listens (port 0: a free one).")
@click.option("--rest", "rest_addr", default="127.0.0.1:8080", show_default=True, metavar="HOST:PORT",
              help="Where the REST API (/v1/health, /v1/metadata, /v1/files) listens.")
@click.option("--role", default="executor", show_default=True, help="Role policy of every process and file call.")
@click.option("--workdir", default=None, metavar="DIR", help="The sandbox's worktree: file paths and cwd are "
              "confined to it (default: the current directory).")
@click.option("--run-id", default="sandboxd", show_default=True, help="Run the cells belong to.")
@click.option("--agent", "agent_id", default="sandboxd", show_default=True, help="Agent the cells belong to.")
@click.pass_obj
def sandboxd(obj, **options):
    """The agent-sandbox runtime API (sandboxd, KEP-539.2) over agnsup cells.

    gRPC process.v1.ProcessService and the REST filesystem API; every process
    is a cell of --role. Prints one JSON line {"ready": true, "grpc": ...,
    "rest": ..., "controller": ...} once it accepts calls. SIGTERM or SIGINT:
    its cells are cancelled, then it exits. Needs `pip install 'agnsup[k8s]'`.
    See docs/sandboxd.md.
    """
    from .sandboxd import main as sandboxd_main
    sys.exit(sandboxd_main(obj["state_dir"], **options))


@main.command(**_COMMAND_LINE)
@click.option("--socket", "socket_path", type=click.Path(dir_okay=False), default=None,
              help="The serve controller's socket (default: <state>/agnsup.sock).")
@click.option("--follow", is_flag=True, default=False,
              help="Print the cell's output as it comes and exit with its exit status.")
@_cell_options
@click.pass_obj
def spawn(obj, socket_path, follow, command, **options):
    """Ask the serve controller to start CMD as a cell; return at once.

    Prints {"cell_id", "run_id", "agent_id", "pid", "cgroup", "state"} as JSON;
    state "waiting" (pid null) when another cell holds the worktree lock: the
    cell is queued and starts when the lock is free. The cell's output is
    captured under the state root; `agnsup wait CELL` waits for it and exits
    with its status. Exit status as for run when the cell cannot start.
    With --follow: the handle goes to stderr, the cell's output to stdout and
    stderr as it comes, ^C to the cell's process group; exit status the cell's.
    """
    from .serve import main_follow, main_spawn
    options["long_lived"] = True  # a server or watcher: under filesystem.changes "auto" its writes land live
    if follow:
        sys.exit(main_follow(obj["state_dir"], socket_path, list(command), options))
    click.echo(json.dumps(main_spawn(obj["state_dir"], socket_path, list(command), options)))


def _state(obj):
    """The state root of an existing journal (cancel/cleanup only act on what was recorded)."""
    from .cancel_cli import existing_state
    return existing_state(obj["state_dir"])


@main.command()
@click.option("--runs", default=1, show_default=True, type=click.IntRange(min=1), help="Seeded runs in a row.")
@click.option("--seed", type=int, default=None, help="Seed of the first run (default: random, printed).")
@click.option("--isolation", is_flag=True, help="Run the isolation probes instead of the blackout scenario.")
@click.option("--dead-man", "dead_man", is_flag=True,
              help="Prove that a SIGKILLed controller (run, serve, the Python API) takes its cells with it.")
@click.option("--user", "user", type=click.IntRange(min=0), default=None, metavar="UID",
              help="With --isolation: run the probe cells as this uid (agnsup as root; default: the caller).")
@click.option("--keep", is_flag=True, help="Keep the private state root of a failed run for inspection.")
@click.option("--json", "as_json", is_flag=True, help="The gate table as JSON.")
def selftest(runs, seed, isolation, dead_man, user, keep, as_json):
    """Certify this host: the authority-blackout test (or, with --isolation,
    the isolation probes) in a private state root and cgroup root.

    Prints a table of gates: PASS, FAIL with the evidence, or
    ENV_BLOCKED: <capability> when this host cannot offer what a gate needs
    (never counted as a pass). Exit 0 only when every gate passes in every run.
    """
    if dead_man:
        from ..selftest.deadman import main as deadman_main
        sys.exit(deadman_main(as_json=as_json, keep=keep))
    if isolation:
        from ..selftest.isolation import main as isolation_main
        sys.exit(isolation_main(as_json=as_json, keep=keep, user=user))
    from ..selftest.blackout import main as blackout_main
    sys.exit(blackout_main(runs=runs, seed=seed, as_json=as_json, keep=keep))


@main.command()
@click.option("--json", "as_json", is_flag=True, help="The report as JSON.")
@click.pass_obj
def janitor(obj, as_json):
    """Run crash recovery now: find the cells of dead controller instances,
    kill what is left of them on evidence, release their resources, write a
    recovery receipt. A second run finds nothing to do."""
    from ..janitor import format_text, run_janitor
    report = run_janitor(_root(obj))
    click.echo(json.dumps(report, indent=2, sort_keys=True) if as_json else format_text(report))
    if report.get("journaled") is False:
        from ..errors import StateError
        _fail(StateError(f"janitor worked from the kernel's evidence but could not journal it: {report['journal']}"))


@main.group(cls=_Group)
def journal():
    """Check or repair the journal (a damaged file, or one that lost its history)."""


@journal.command("check")
@click.option("--json", "as_json", is_flag=True, help="The report as JSON.")
@click.pass_obj
def journal_check(obj, as_json):
    """Say what is wrong with the journal and what the disk still holds: its file,
    SQLite's integrity check, cells on disk it does not know. Exit 0 when nothing
    is wrong, 1 when something is (then: agnsup journal repair)."""
    from ..store.repair import check
    r = check(_root(obj))
    if not _echo_json(as_json, r, sort_keys=True):
        click.echo(f"journal {r['journal']}: {'ok' if r['ok'] else 'NOT OK'} ({r['cells_on_disk']} cell(s) on disk)")
        for p in r["problems"]:
            click.echo(f"  {p}")
    sys.exit(0 if r["ok"] else 1)


@journal.command("repair")
@click.option("--json", "as_json", is_flag=True, help="The report as JSON.")
@click.pass_obj
def journal_repair(obj, as_json):
    """Move a damaged journal (or one that lost its history) aside into
    <state>/quarantine/, never deleting it, and rebuild the journal from the cell
    receipts on disk. Refused (exit 1) while processes still run under the state
    root's cgroups: agnsup cancel --all first."""
    from ..store.repair import repair
    r = repair(_root(obj).ensure())
    if _echo_json(as_json, r, sort_keys=True):
        return
    for q in r["quarantined"]:
        click.echo(f"kept aside: {q}")
    click.echo(f"imported {len(r['imported'])} cell receipt(s) from disk")
    for sk in r["skipped"]:
        click.echo(f"  {sk['cell']}: {sk['why']}")


@journal.command("prune")
@click.option("--before", "before", required=True, metavar="WHEN",
              help="Ended cells that ended before WHEN: an age (30d, 12h, 90m) or a UTC date (2026-11-01).")
@click.option("--json", "as_json", is_flag=True, help="The counts as JSON.")
@click.pass_obj
def journal_prune(obj, before, as_json):
    """Remove ended cells from the journal (rows, events, receipts; a small row per
    cell keeps its id taken) and give the space back. Their receipt files stay on
    disk under cells/ (written there first if missing). Live cells and cancelled
    runs are never pruned. Default bound without this command: ended cells older
    than AGNSUP_JOURNAL_RETENTION_DAYS (30; 0 keeps all), applied once a day at a
    controller's start."""
    from ..store.repair import parse_before, prune
    out = prune(_state(obj), parse_before(before), compact=True)
    if not _echo_json(as_json, out, sort_keys=True):
        click.echo(f"pruned {out['cells']} ended cell(s), {out['events']} event(s), {out['receipts']} receipt "
                   f"row(s); receipt files kept on disk ({len(out['archived'])} written there first)")


@main.command()
@click.option("--json", "as_json", is_flag=True, help="The report as JSON.")
@click.option("--public-key", "public_key", metavar="PEM", default=None,
              help="The operator's Ed25519 public key (PEM file): the head must carry its signature.")
@click.pass_obj
def verify(obj, as_json, public_key):
    """Check that no receipt or event was rewritten: the journal's hash chain, each
    record's content, the head in <state>/journal.head, and each cell's receipt
    file on disk against its journaled content. Exit 0 intact (records past the
    head are "not yet anchored": a controller died before writing it), 1 broken
    (the first broken or missing seq is named), 125 usage."""
    from ..store import chain
    key = chain.load_public_key(public_key) if public_key else None
    j = _journal(obj)
    snap = j.chain_snapshot() if j else {"chain": [], "events": {}, "receipts": {}, "cells_on_disk": []}
    r = chain.verify(snap, _root(obj).path, key)
    if not _echo_json(as_json, r, sort_keys=True):
        head = r["head"]
        click.echo(f"journal chain: {'intact' if r['ok'] else 'BROKEN'}: {r['records']} record(s), head "
                   f"{'seq ' + str(head['seq']) if head else 'none'}, {r['anchored']} anchored"
                   + (f", {r['pruned']} pruned" if r["pruned"] else "")
                   + (", signature verified" if r["signature"] else "")
                   + f"; {r['receipt_files']['checked']} receipt file(s) checked")
        if r.get("note"):
            click.echo("  " + r["note"])
        for b in r["broken"]:
            click.echo(f"  {'seq ' + str(b['seq']) if b['seq'] is not None else 'journal'}: {b['what']}")
    sys.exit(0 if r["ok"] else 1)


@main.group("ports", cls=_Group, invoke_without_command=True)
@click.option("--run", "--run-id", "run_id", default=None, metavar="R", help="Only this run's pods.")
@click.option("--agent", "--agent-id", "agent_id", default=None, metavar="A", help="Only this agent's pod.")
@click.option("--json", "as_json", is_flag=True, help="A JSON list of published ports.")
@click.pass_context
def ports_group(ctx, run_id, agent_id, as_json):
    """Ports of agents' pods published on the host's loopback (127.0.0.1 only).

    Without a subcommand: the published ports (as `ports list`). A pod is an
    agent's private network while one of its cells lives; `ports publish` opens
    one way into it from the host, journaled; it closes with `ports close` or
    with the pod.

    Example: agnsup ports publish 8000 --run R --agent A
    """
    if ctx.invoked_subcommand is None:
        _ports_list(ctx.obj, run_id, agent_id, as_json)


def _port_line(p: dict) -> str:
    return (f"{p['run_id']}/{p['agent_id']}: pod port {p['pod_port']} -> {p['address']} "
            f"(forwarder pid {p['pid']})")


def _ports_list(obj, run_id, agent_id, as_json) -> None:
    from .. import ports
    found = ports.listing(_root(obj), run_id, agent_id)
    if not _echo_json(as_json, found):
        for p in found:
            click.echo(_port_line(p))
        if not found:
            click.echo("no published ports")


@ports_group.command("list")
@click.option("--run", "--run-id", "run_id", default=None, metavar="R", help="Only this run's pods.")
@click.option("--agent", "--agent-id", "agent_id", default=None, metavar="A", help="Only this agent's pod.")
@click.option("--json", "as_json", is_flag=True, help="A JSON list of published ports.")
@click.pass_obj
def ports_list(obj, run_id, agent_id, as_json):
    """The published ports whose forwarder lives."""
    _ports_list(obj, run_id, agent_id, as_json)


@ports_group.command("publish")
@click.argument("port", metavar="POD_PORT", type=click.IntRange(1, 65535))
@click.option("--host-port", "host_port", type=click.IntRange(0, 65535), default=0, show_default=True,
              metavar="N", help="The port on the host's loopback (0: a free one, printed).")
@click.option("--host", "host", default="127.0.0.1", show_default=True, metavar="ADDR",
              help="The host address: 127.0.0.1 only (any other is refused).")
@click.option("--run", "--run-id", "run_id", required=True, metavar="R", help="The agent's run.")
@click.option("--agent", "--agent-id", "agent_id", required=True, metavar="A", help="The agent whose pod it is.")
@click.option("--json", "as_json", is_flag=True, help="Print the record (keys: docs/cli.md).")
@click.pass_obj
def ports_publish(obj, port, host_port, host, run_id, agent_id, as_json):
    """Publish POD_PORT of the agent's pod on 127.0.0.1:N of the host.

    A forwarder relays each connection to 127.0.0.1:POD_PORT inside the pod; it
    ends with the pod (the agent's last cell) or with `ports close`. Exit 1: no
    live pod for the agent; 125: a bad port or address, the pod port already
    published, the host port taken.
    """
    from .. import ports
    rec = ports.publish(_root(obj), run_id, agent_id, port, host_port, host, by=f"agnsup ports publish (pid "
                                                                                 f"{os.getpid()})")
    if not _echo_json(as_json, rec):
        click.echo(f"published {_port_line(rec)}: {rec['url']}")


@ports_group.command("close")
@click.argument("port", metavar="POD_PORT", type=click.IntRange(1, 65535))
@click.option("--run", "--run-id", "run_id", required=True, metavar="R", help="The agent's run.")
@click.option("--agent", "--agent-id", "agent_id", required=True, metavar="A", help="The agent whose pod it is.")
@click.option("--json", "as_json", is_flag=True, help='Print {"closed": [records]}.')
@click.pass_obj
def ports_close(obj, port, run_id, agent_id, as_json):
    """Close a published port of the agent's pod (its forwarder ends). Exit 1 when it is not published."""
    from .. import ports
    out = ports.close(_root(obj), run_id, agent_id, port, by=f"agnsup ports close (pid {os.getpid()})")
    if not _echo_json(as_json, out):
        for p in out["closed"]:
            click.echo(f"closed {_port_line(p)}")


def _set_state_dir(ctx, _param, value):
    if value is not None:
        ctx.obj["state_dir"] = value


def _json_errors(callback):
    """With --json, a refusal is JSON on stdout too ({"error", "error_type", "exit_code"}),
    besides its one line on stderr: a script that parses stdout never gets nothing."""
    import functools

    @functools.wraps(callback)
    def wrapped(*args, **kwargs):
        try:
            return callback(*args, **kwargs)
        except AgnsupError as e:
            if kwargs.get("as_json"):
                from ..errors import as_value
                click.echo(json.dumps(as_value(e), indent=2))
            raise
    return wrapped


# cli.md: `--state-dir` is also accepted after the command name
for _cmd in main.commands.values():
    if any(p.name == "as_json" for p in _cmd.params):
        _cmd.callback = _json_errors(_cmd.callback)
    _cmd.params.insert(0, click.Option(["--state-dir"], metavar="DIR", expose_value=False, is_eager=True,
                                       callback=_set_state_dir, help="State root (as before the command)."))
for _cmd in (mcp_config, *ports_group.commands.values()):  # the groups' subcommands: not in main.commands
    _cmd.callback = _json_errors(_cmd.callback)
    _cmd.params.insert(0, click.Option(["--state-dir"], metavar="DIR", expose_value=False, is_eager=True,
                                       callback=_set_state_dir, help="State root (as before the command)."))
