"""run_process: the one public tool every entry point goes through.

`agnsup run`, the Python API and an LLM function call all end here, and here
the chain starts: spec builder -> governance -> policy compiler -> broker ->
backend -> process supervisor. Every front door turns its input into one
request.CellRequest first (checked before anything is created);
RUN_PROCESS_SCHEMA, the JSON schema an agent runtime hands to a model for
function calling, is generated from that type.
"""
from __future__ import annotations

import os
import sys
import signal
from contextlib import suppress

from .errors import AgnsupError, CancelledBeforeStart, NotExecutable, NotFound, UsageError, as_value, exit_code
from .receipts import MAX_RETURNED_OUTPUT  # what a caller gets back of captured output
from .request import CellRequest, tool_schema

RUN_PROCESS_SCHEMA = tool_schema(
    "run_process", "Run one command as a supervised, isolated cell and return its exit status and output. "
    "The command gets an environment built from nothing, a private /tmp, and the role's filesystem, network "
    "and resource limits.")



def run_process(argv: list[str], *, state_dir: str | None = None, forward_signals: bool = False,
                exit_after: bool = False, **options) -> dict:
    """Run `argv` as one cell and wait for it. `options` are CellRequest's (role,
    run_id, agent_id, cell_id, workdir, timeout, lock_timeout, env, receipt_file,
    capture, entry). Raises AgnsupError subclasses when agnsup refuses or fails;
    returns a result dict with exit_code, state, reason, receipt (and
    stdout/stderr when captured). `exit_after`: the caller ends the process with
    os._exit right after a result (the CLI): the journal connection is left to
    the exit (broker.Controller.close)."""
    from . import broker, janitor
    from .store import repair
    from .store.state import StateRoot

    options.setdefault("entry", "tool")
    request = CellRequest.make(argv, **options)  # every argument checked before anything exists
    if request.stdin:
        raise UsageError("stdin: run_process waits for the cell, so nobody could write its stdin; "
                         "use Supervisor.spawn (or serve's spawn) and write_stdin")
    state = StateRoot(state_dir).ensure()
    journal = state.journal()
    try:
        janitor.on_start(state, journal)  # crash recovery first: one query when nothing to do
        repair.maybe_prune(state, journal)  # the journal's default retention bound: one stat most days
        prepared = prepare(state, journal, request)
        ctl = broker.Controller(state, kind="run", journal=journal, one_cell=True)
    except BaseException:
        journal.close()
        raise
    result = None
    try:
        result = _supervise(ctl, prepared, request, forward_signals)
        return result
    finally:
        ctl.close(leave_journal_open=exit_after and result is not None)


def prepare(state, journal, request: CellRequest):
    """The stages before the broker: spec builder -> governance -> policy compiler.

    Returns a broker.Prepared; raises Denied (journaled first) when governance
    refuses. Shared by run_process and the serve controller."""
    from .linux import host

    with host.one_look():  # the invoking homes and the state root's real path: asked once in this cell
        return _prepare(state, journal, request)


def _prepare(state, journal, request: CellRequest):
    from . import broker, compiler, governance, policy, spec as specmod
    from .linux import host

    # A shell request (request.shell: argv is ["sh", "-c", LINE]) is judged as the shell line it is.
    tool, call = ("run_shell", {"command": request.argv[2]}) if request.shell else ("run_process", {})
    trace = [broker.stage("public_tool", tool=tool, entry=request.entry)]
    pol = policy.load(request.role, state.path)
    try:
        spec = specmod.build(request, pol)
    except (NotFound, NotExecutable) as e:
        # nothing starts, but the journal remembers it was asked (as for a denial)
        journal.record_refused(request.run_id, request.cell_id, argv=request.argv, error=e.message,
                               error_type=type(e).__name__, exit_code=exit_code(e), role=request.role,
                               entry=request.entry)
        raise
    other_roots = tuple(state.other_roots())

    def refuse(e: AgnsupError) -> None:  # nothing starts; the journal remembers it was asked
        journal.record_refused(spec.run_id, spec.cell_id, argv=spec.argv, error=e.message,
                               error_type=type(e).__name__, exit_code=exit_code(e), role=request.role,
                               entry=request.entry)
        raise e
    # A worktree the cell may write is never the system, a home or a state root; a read-only
    # one may be a system directory (a look at /etc), never "/" (its attach would show again
    # what the cell's mounts hide).
    why = compiler.worktree_refusal(spec.worktree, state.path, other_roots) \
        if pol.filesystem.worktree == "rw" else "is the root of the file system" if spec.worktree == "/" else None
    if why is not None:
        refuse(UsageError(f"worktree {spec.worktree} {why}: a cell never gets it as its worktree; run in a "
                          "project directory (--workdir)"))
    trace.append(broker.stage("spec_builder", exe=spec.exe, env_keys=sorted(spec.env), role=request.role))
    decision, trail = governance.decide(tool, {**(call or {"argv": spec.argv}), "cwd": spec.workdir}, pol,
                                        spec.worktree, state.path)
    trace.append(broker.stage("governance", allowed=decision.allowed, rule=decision.rule))
    if not decision.allowed:
        journal.record_denied(spec.run_id, spec.cell_id, argv=spec.argv, decision=decision.to_dict(), trail=trail,
                              chain=[s["stage"] for s in trace])
        governance.enforce(decision)
    held = None
    if list(pol.get("secrets") or ()) or request.secrets:  # after the gate: the secrets' references, then values
        try:
            held = _secrets(state, pol, request, spec)
        except AgnsupError as e:
            refuse(e)
    from .process import namespaces  # the id-mapped mount probe, once per device (a root controller's cells)

    def reversible(state_root: str, worktree: str) -> str | None:  # asked only of a cell that would capture
        from .changes import unsupported
        return unsupported(state_root, worktree)
    try:
        plan = compiler.compile_plan(spec, pol, state.path, {**host.protections(), "_idmap": namespaces.idmap_refused,
                                                             "_reversible": reversible,
                                                             "_namespaces": namespaces.namespaces_refused}, other_roots)
    except AgnsupError as e:  # a role this host cannot honour (filesystem.unix_sockets, require...)
        refuse(e)
    if held is not None and not plan.mount_namespace:
        refuse(UsageError(f"role {request.role}: secrets need the cell's own mount namespace (its CA bundle), which "
                          "this cell runs without (isolation.reduced)"))
    trace.append(broker.stage("policy_compiler", policy_digest=plan.policy_digest, mounts=len(plan.mount_ops),
                              netns=plan.new_netns))
    return broker.Prepared(plan=plan, decision=decision.to_dict(), trail=trail, trace=trace,
                           admit=governance.admission(spec, pol, decision.zone), secrets=held)


def _secrets(state, pol, request: CellRequest, spec) -> list:
    """The cell's secrets (agnsup/secrets.py), checked before anything starts: their references (the role's and
    the call's), where they may go against the role's lists, the CA directory, then each value from its source
    (env: the caller's environment: serve's client's). A UsageError names what is wrong, never a value."""
    from . import secrets
    from .netpolicy import Rules, destination
    from .process.helpers import run_helper
    from .spec import CELL_TMP
    refs = secrets.refs_of(pol.get("secrets"), request.secrets, request.role)
    if not refs:
        return None
    rules = Rules.of(pol.network) if pol.network.mode in ("allowlist", "internal") else None
    secrets.check(refs, pol.network.mode, lambda host, port: rules.match(destination(host), port))
    ca_dir = state.ca_dir
    try:
        os.makedirs(ca_dir, mode=0o755, exist_ok=True)
        writable = os.access(ca_dir, os.W_OK | os.X_OK)
    except OSError as e:
        raise UsageError(f"the CA directory {ca_dir} cannot be made: {e.strerror or e}") from None
    if not writable:
        raise UsageError(f"the CA directory {ca_dir} is not writable")
    values = secrets.resolve(refs, os.environ if request.host_env is None else request.host_env, run_helper)
    secrets.apply(spec, refs, CELL_TMP)
    return values


def _supervise(ctl, prepared, request: CellRequest, forward_signals: bool) -> dict:
    wake_r = wake_w = None
    old = {}
    caught: list[int] = []
    if forward_signals:
        # SIGINT/SIGTERM/SIGHUP to the controller cancel the cell (graceful, then kill).
        wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            old[sig] = signal.signal(sig, lambda n, _f: caught.append(n))
        old_wake = signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    cell = None

    def interrupted():  # a signal while it waits for another agent's worktree lock: it never starts
        if caught:
            raise CancelledBeforeStart(
                f"cell {prepared.plan.spec.cell_id} cancelled by signal {signal.Signals(caught[0]).name} to the "
                f"controller (pid {os.getpid()}) while it waited for the worktree lock; it never started")
    try:
        cell = ctl.start(prepared, capture=request.capture, pty=request.pty, stream=request.stream,
                         poll=interrupted if forward_signals else None)
        waiter = ctl.waiter(cell, wake_r)
        user_tty = cell.pump.terminal if cell.pump is not None else None
        if forward_signals and user_tty is not None:
            # the user's terminal changes size: so does the cell's pty (the kernel sends it SIGWINCH)
            old[signal.SIGWINCH] = signal.signal(signal.SIGWINCH, lambda n, _f: caught.append(n))
            user_tty.follow_size()  # a resize before the handler was in place

        def on_wake():
            with suppress(BlockingIOError):
                while os.read(wake_r, 64):
                    pass
            while caught:
                n = caught.pop(0)
                if n == signal.SIGWINCH:
                    user_tty.follow_size()
                    continue
                # the cell gets the signal the controller got (as timeout(1) does): Ctrl-C ends it 130
                waiter.request_stop("cancelled", f"signal {signal.Signals(n).name} to the controller "
                                    f"(pid {os.getpid()})", sig=n)

        if caught:
            on_wake()
        receipt = ctl.finish(cell, waiter.wait(on_wake))
        if request.entry == "cli":
            _say_why_stopped(receipt)
    finally:
        if cell is not None and cell.pump is not None and cell.pump.terminal is not None:
            cell.pump.terminal.restore()  # every exit path gives the user their terminal back
        if forward_signals:
            signal.set_wakeup_fd(old_wake)
            for sig, h in old.items():
                signal.signal(sig, h)
            os.close(wake_r)
            os.close(wake_w)
    return ended(receipt, cell.plan.cell_dir, request)


# A limit that stopped the cell: the key a user would look up, its value in the receipt, its unit.
_STOPPED_BY = {"output_limit": ("limits.output_max", "output_max", " bytes"),
               "oom": ("limits.memory_max", "memory_max", " bytes"),
               "timeout": ("timeout", "timeout", " s")}


def stopped_line(receipt: dict) -> str | None:
    """One line for the user when agnsup stopped the cell for a limit: reason, key, value
    (a killed cell must not look like a crash or an OOM of the command's own)."""
    why = _STOPPED_BY.get(receipt.get("reason"))
    if why is None:
        return None
    key, field, unit = why
    return (f"agnsup: cell {receipt['cell_id']} stopped: {receipt['reason']} "
            f"({key} = {(receipt.get('limits') or {}).get(field)}{unit})")


def quarantined_line(receipt: dict) -> str | None:
    """One line when files the cell planted where tools run them on their own were moved out
    of the worktree (agnsup/protect.py), with where they went and the key that lifts it."""
    moved = [m for m in (receipt.get("protected") or {}).get("quarantined", []) if m.get("to")]
    if not moved:
        return None
    where = os.path.commonpath([m["to"] for m in moved]) if len(moved) > 1 else os.path.dirname(moved[0]["to"])
    return (f"agnsup: cell {receipt['cell_id']} planted {len(moved)} protected path(s), moved out of the worktree "
            f"to {where}: {', '.join(m['path'] for m in moved)} (filesystem.writable_protected lifts this)")


def said_lines(receipt: dict) -> list[str]:
    """What `agnsup run` prints on stderr when its cell ended, before the network's lines: why a limit stopped it,
    what it planted that was moved out of the worktree."""
    return [line for line in (stopped_line(receipt), quarantined_line(receipt)) if line]


def _say_why_stopped(receipt: dict) -> None:
    for line in said_lines(receipt):
        sys.stderr.write(line + "\n")
        sys.stderr.flush()


def ended(receipt: dict, cell_dir: str, request: CellRequest | None = None, capture: bool | None = None) -> dict:
    """What a caller gets back for an ended cell (and the output, when captured);
    the receipt is also written to the request's receipt_file, if it names one."""
    if request is not None and request.receipt_file:
        from . import receipts
        receipts.write(request.receipt_file, receipt)
    capture = request.capture if capture is None else capture
    result = {"run_id": receipt["run_id"], "agent_id": receipt["agent_id"], "cell_id": receipt["cell_id"],
              "exit_code": receipt["exit_code"], "state": receipt["state"], "reason": receipt["reason"],
              "receipt": os.path.join(cell_dir, "receipt.json")}
    result.update(network_said(receipt))
    if receipt.get("changes") and receipt["changes"].get("mode") != "none":  # issue 26: what it changed, undoable
        result["changes"] = receipt["changes"]
    if capture:
        # Output redaction (governance.redact; docs/governance.md "Redaction"): the one place it applies.
        from .redact import for_receipt
        for name, (text, truncated) in captured(cell_dir, for_receipt(receipt)).items():
            result[name], result[name + "_truncated"] = text, truncated
    return result


def captured(cell_dir: str, redact) -> dict[str, tuple[str, bool]]:
    """The cell's captured stdout and stderr as a caller gets them: redacted, at most MAX_RETURNED_OUTPUT bytes
    each: {name: (text, truncated)} (a cell still running: what it wrote so far)."""
    out = {}
    for name in ("stdout", "stderr"):
        try:
            with open(os.path.join(cell_dir, name), "rb") as f:
                data = f.read(MAX_RETURNED_OUTPUT + 1)
        except FileNotFoundError:
            data = b""
        out[name] = redact(data[:MAX_RETURNED_OUTPUT].decode(errors="replace")), len(data) > MAX_RETURNED_OUTPUT
    return out


def network_hint(receipt: dict) -> str:
    """One line for a cell that failed without network and tried to reach beyond it: which role or key would
    give it one. The evidence is the kernel's (kernel_record.network: connections and DNS queries that had no
    route out of the cell's namespace, read when it failed), never the exit code: a failing test suite that
    never reached out gets no hint. Where the counters could not be read (the record is not observable), the
    line follows any failure, as before."""
    mode = (receipt.get("isolation") or {}).get("network")
    if receipt.get("state") != "exited" or not receipt.get("exit_code") or mode not in ("deny", "loopback"):
        return ""
    net = (receipt.get("kernel_record") or {}).get("network") or {}
    tries = net.get("no_route") if net.get("observable") else None
    if tries == 0:
        return ""
    tried = f" (it tried: {tries} connection(s) or DNS queries had no route out)" if tries else ""
    # the packaged roles that reach out: networked (the host's network), proxied (through the proxy)
    return (f"agnsup: the cell ran without network: role {receipt.get('role')} has network.mode = \"{mode}\"; "
            "--role networked (the host's network) or --role proxied (public destinations through a proxy) "
            f"allows it, or network.mode in the role{tried}")


def network_said(receipt: dict) -> dict:
    """What a result says about the cell's network, only when it applies: `network_hint` (it tried to reach out
    without a network) and `network_refused` (allowlist/internal: what the proxy refused, and the key that
    would allow it)."""
    said = {}
    hint = network_hint(receipt)
    if hint:
        said["network_hint"] = hint
    if receipt.get("network"):
        from .egress.summary import refused
        if refused(receipt["network"]):
            said["network_refused"] = refused(receipt["network"])
    return said


def network_lines(result: dict) -> list[str]:
    """The stderr lines a terminal gets after a cell (`agnsup run`, `spawn --follow`): the network hint, and one
    line for the connections the proxy refused."""
    lines = [result["network_hint"]] if result.get("network_hint") else []
    if result.get("network_refused"):
        from .egress.summary import refused_line
        lines.append(refused_line(result["cell_id"], result["network_refused"]))
    return lines


def handle_tool_call(name: str, arguments, **context) -> dict:
    """Dispatch an LLM function call; errors come back as values, never raised.

    `arguments`: the model's arguments, as an object or as the JSON text models
    usually send; checked against RUN_PROCESS_SCHEMA's properties. `context`:
    run_process keywords the runtime (not the model) sets (state_dir, run_id, ...)."""
    try:
        if name != "run_process":  # as_value gives it error_type UsageError, exit_code 125
            raise UsageError(f"unknown tool {name!r} (known: run_process)")
        args = _tool_arguments(arguments)
        pinned = sorted(k for k in set(args) & set(context) if args[k] != context[k])
        if pinned:  # the runtime's keywords are its decisions, not defaults the model may change
            raise UsageError(f"{', '.join(pinned)}: set by the runtime for this call; the model may not change it")
        args.update(context)
        return run_process(args.pop("argv", None), **args)
    except AgnsupError as e:
        return as_value(e)


def _tool_arguments(arguments) -> dict:
    import json
    if isinstance(arguments, (str, bytes)):
        try:
            arguments = json.loads(arguments)
        except ValueError as e:
            raise UsageError(f"arguments are not valid JSON: {e}") from None
    if not isinstance(arguments, dict):
        raise UsageError(f"arguments must be a JSON object, not {type(arguments).__name__}")
    extra = set(arguments) - set(RUN_PROCESS_SCHEMA["parameters"]["properties"])
    if extra:
        raise UsageError(f"unknown argument(s): {', '.join(sorted(extra))} "
                         f"(known: {', '.join(RUN_PROCESS_SCHEMA['parameters']['properties'])})")
    if "argv" not in arguments:
        raise UsageError("argv: required (the command and its arguments, a list of strings)")
    return dict(arguments)
