"""run_process: the one public tool every entry point goes through.

`agnsup run`, the Python API and an LLM function call all end here, and here
the chain starts: spec builder -> governance -> policy compiler -> broker ->
backend -> process supervisor. RUN_PROCESS_SCHEMA is the JSON schema an agent
runtime hands to a model for function calling.
"""
from __future__ import annotations

import os
import signal

from .errors import AgnsupError

RUN_PROCESS_SCHEMA = {
    "name": "run_process",
    "description": "Run one command as a supervised, isolated cell and return its exit status and output. "
                   "The command gets an environment built from nothing, a private /tmp, and the role's "
                   "filesystem, network and resource limits.",
    "parameters": {
        "type": "object",
        "properties": {
            "argv": {"type": "array", "items": {"type": "string"}, "minItems": 1,
                     "description": "The command and its arguments; no shell is involved."},
            "role": {"type": "string", "description": "Role policy to apply (executor, readonly, networked).",
                     "default": "executor"},
            "workdir": {"type": "string", "description": "Worktree directory the command runs in."},
            "timeout": {"type": "number", "description": "Seconds before the cell is stopped (exit 124)."},
            "env": {"type": "object", "additionalProperties": {"type": "string"},
                    "description": "Extra environment variables for this call."},
        },
        "required": ["argv"],
        "additionalProperties": False,
    },
}

MAX_RETURNED_OUTPUT = 64 * 1024


def run_process(argv: list[str], *, role: str = "executor", run_id: str = "default", agent_id: str = "default",
                cell_id: str | None = None, workdir: str | None = None, timeout: float | None = None,
                lock_timeout: float | None = None, env: list[str] | dict | None = None,
                state_dir: str | None = None, capture: bool = True, entry: str = "tool",
                forward_signals: bool = False, receipt_file: str | None = None, exit_after: bool = False) -> dict:
    """Run `argv` as one cell and wait for it. Raises AgnsupError subclasses when
    agnsup refuses or fails (each carries its exit code); returns a result dict
    with exit_code, state, reason, receipt (and stdout/stderr when captured).
    `exit_after`: the caller ends the process with os._exit right after a
    result (the CLI): the journal connection is left to the exit (broker.Controller.close)."""
    from . import broker, janitor
    from .state import StateRoot

    state = StateRoot(state_dir)
    state.ensure()
    journal = state.journal()
    try:
        janitor.on_start(state, journal)  # crash recovery first: one query when nothing to do
        plan, decision, trail, trace = prepare(state, argv, role=role, run_id=run_id, agent_id=agent_id,
                                               cell_id=cell_id, workdir=workdir, timeout=timeout,
                                               lock_timeout=lock_timeout, env=env, entry=entry)
        ctl = broker.Controller(state, kind="run", journal=journal, one_cell=True)
    except BaseException:
        journal.close()
        raise
    result = None
    try:
        result = _supervise(ctl, plan, decision, trail, trace, capture, forward_signals, receipt_file)
        return result
    finally:
        ctl.close(leave_journal_open=exit_after and result is not None)


def prepare(state, argv: list[str], *, role: str = "executor", run_id: str = "default", agent_id: str = "default",
            cell_id: str | None = None, workdir: str | None = None, timeout: float | None = None,
            lock_timeout: float | None = None, env: list[str] | dict | None = None, entry: str = "tool",
            host_env: dict | None = None):
    """The stages before the broker: spec builder -> governance -> policy compiler.

    Returns (plan, decision, trail, trace); raises Denied (journaled first)
    when governance refuses. Shared by run_process and the serve controller."""
    from . import broker, compiler, governance, policy, spec as specmod

    trace = [broker.stage("public_tool", tool="run_process", entry=entry)]
    if isinstance(env, dict):
        env = [f"{k}={v}" for k, v in env.items()]
    call = specmod.ToolCall(argv=list(argv), role=role, run_id=run_id, agent_id=agent_id, cell_id=cell_id,
                            workdir=workdir, timeout=timeout, lock_timeout=lock_timeout, env=list(env or []),
                            entry=entry)
    pol = policy.load(role, state.path)
    spec = specmod.build(call, pol, host_env)
    trace.append(broker.stage("spec_builder", exe=spec.exe, env_keys=sorted(spec.env), role=role))
    decision, trail = governance.decide("run_process", {"argv": spec.argv, "cwd": spec.workdir}, pol,
                                        spec.workdir, state.path)
    trace.append(broker.stage("governance", allowed=decision.allowed, rule=decision.rule))
    if not decision.allowed:
        broker.record_denied(state, spec, decision.to_dict(), trail, trace)
        governance.enforce(decision)
    plan = compiler.compile_plan(spec, pol, state.path)
    trace.append(broker.stage("policy_compiler", policy_digest=plan.policy_digest, mounts=len(plan.mount_ops),
                              netns=plan.new_netns))
    return plan, decision.to_dict(), trail, trace


def _supervise(ctl, plan, decision, trail, trace, capture, forward_signals, receipt_file) -> dict:
    wake_r = wake_w = None
    old = {}
    caught: list[int] = []
    if forward_signals:
        # SIGINT/SIGTERM/SIGHUP to the controller cancel the cell (graceful, then kill).
        wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            old[sig] = signal.signal(sig, lambda n, _f: caught.append(n))
        old_wake = signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    try:
        cell = ctl.start(plan, decision, trail, trace, capture=capture)
        waiter = ctl.waiter(cell, wake_r)

        def on_wake():
            try:
                while os.read(wake_r, 64):
                    pass
            except BlockingIOError:
                pass
            while caught:
                n = caught.pop(0)
                waiter.request_stop("cancelled", f"signal {signal.Signals(n).name} to the controller (pid {os.getpid()})")

        if caught:
            on_wake()
        outcome = waiter.wait(on_wake)
        receipt = ctl.finish(cell, outcome)
    finally:
        if forward_signals:
            signal.set_wakeup_fd(old_wake)
            for sig, h in old.items():
                signal.signal(sig, h)
            os.close(wake_r)
            os.close(wake_w)
    if receipt_file:
        from . import receipts
        receipts.write(receipt_file, receipt)
    return cell_result(receipt, plan.cell_dir, capture)


def cell_result(receipt: dict, cell_dir: str, capture: bool) -> dict:
    """What a caller gets back for an ended cell (and the output, when captured)."""
    result = {"run_id": receipt["run_id"], "agent_id": receipt["agent_id"], "cell_id": receipt["cell_id"],
              "exit_code": receipt["exit_code"], "state": receipt["state"], "reason": receipt["reason"],
              "receipt": os.path.join(cell_dir, "receipt.json")}
    if capture:
        # Output redaction (governance.redact; docs/governance.md "Redaction"): the one place it applies.
        from .redact import for_receipt
        redact = for_receipt(receipt)
        for name in ("stdout", "stderr"):
            try:
                with open(os.path.join(cell_dir, name), "rb") as f:
                    data = f.read(MAX_RETURNED_OUTPUT + 1)
            except FileNotFoundError:
                data = b""
            result[name] = redact(data[:MAX_RETURNED_OUTPUT].decode(errors="replace"))
            result[name + "_truncated"] = len(data) > MAX_RETURNED_OUTPUT
    return result


def handle_tool_call(name: str, arguments: dict, **context) -> dict:
    """Dispatch an LLM function call; errors come back as values, never raised."""
    if name != "run_process":
        return {"error": f"unknown tool {name!r}", "exit_code": 125}
    args = dict(arguments)
    extra = set(args) - set(RUN_PROCESS_SCHEMA["parameters"]["properties"])
    if extra:
        return {"error": f"unknown argument(s): {', '.join(sorted(extra))}", "exit_code": 125}
    try:
        return run_process(args.pop("argv"), **args, **context)
    except AgnsupError as e:
        return {"error": e.message, "exit_code": e.exit_code, **({"decision": e.details["decision"]}
                                                                 if "decision" in e.details else {})}
    except (KeyError, TypeError) as e:
        return {"error": f"bad arguments: {e}", "exit_code": 125}


