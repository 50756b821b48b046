"""process.v1.ProcessService over agnsup.supervisor.Supervisor: every process is a cell.

A process id (int32, the standard's) names one cell of this server: process id
N is cell `proc-N` of the run the call came with (`--run-id`, default
"sandboxd"; gRPC metadata `agnsup-run-id` may name another). N counts up for
the state root's life: a restarted server goes on after the highest `proc-N`
the journal has, so an id from before a restart never names a new process.
Execute and ExecuteWithLimits take a number too (its cell is `proc-N`) but never hand it out; WriteStdin,
SendSignal and ResizeTTY find the processes of this server's running Start calls.

A client's deadline bounds the cell, less reply_reserve: a command that runs into it ends (exit 124)
while its answer, with the output it wrote, can still reach the client (docs/sandboxd.md "Timeouts").
start_detached and the calls after it serve rest.py's /v1/agnsup/processes: a process that outlives
the call that started it, for clients whose public API has no Start (the k8s-agent-sandbox client).

The role is the server's (`--role`), never the client's. agnsup's answers
beyond the standard messages travel as metadata: trailing `agnsup-run-id`,
`agnsup-cell-id`, `agnsup-state`, `agnsup-reason`, `agnsup-receipt`, and when they apply
`agnsup-network-hint` and `agnsup-network-refused` (JSON) (and on
Start, the same ids as initial metadata); on a refusal `agnsup-error-type`,
`agnsup-exit-code` (agnsup's CLI exit code) and `agnsup-rule`.
"""
from __future__ import annotations

import json
import os
import re
import threading
import time
from contextlib import suppress

from ...errors import (AgnsupError, CancelledBeforeStart, Denied, LockTimeout, NotExecutable, NotFound, PolicyError,
                       RunNotActive, UnknownId, UsageError, exit_code)
from . import proto

CELL_PREFIX = "proc-"
_CELL_RE = re.compile(r"^proc-(\d+)$")
MAX_PROCESS_ID = 2**31 - 1  # int32 on the wire
NO_DEADLINE = 10 * 365 * 86400.0
REPLY_RESERVE = 1.0  # at most this long before the client's deadline the cell ends, for its answer to get back
STREAM_POLL = 5.0  # seconds a Start stream waits for output before it checks the client is still there
LIMIT_CAP = 1 << 20  # bytes of each stream ExecuteWithLimits returns at most (gRPC's default message max is 4 MiB)


def status_of(e: AgnsupError):
    """The gRPC status code an agnsup refusal maps to (docs/sandboxd.md "Errors")."""
    import grpc
    for cls, code in ((Denied, grpc.StatusCode.PERMISSION_DENIED), (NotExecutable, grpc.StatusCode.PERMISSION_DENIED),
                      (NotFound, grpc.StatusCode.NOT_FOUND), (UnknownId, grpc.StatusCode.NOT_FOUND),
                      (LockTimeout, grpc.StatusCode.UNAVAILABLE), (CancelledBeforeStart, grpc.StatusCode.CANCELLED),
                      (RunNotActive, grpc.StatusCode.FAILED_PRECONDITION),
                      (UsageError, grpc.StatusCode.INVALID_ARGUMENT),
                      (PolicyError, grpc.StatusCode.FAILED_PRECONDITION)):
        if isinstance(e, cls):
            return code
    return grpc.StatusCode.INTERNAL


class Process:
    """What this server knows of one started process: its cell, and whether it is done."""

    def __init__(self, process_id: int, run_id: str, cell_id: str):
        self.process_id, self.run_id, self.cell_id = process_id, run_id, cell_id
        self.done = threading.Event()
        self.queued = False


class ProcessService:
    def __init__(self, sup, *, role: str, workdir: str, run_id: str, agent_id: str):
        self.sup, self.role, self.workdir = sup, role, workdir
        self.run_id, self.agent_id = run_id, agent_id
        self.pb = proto.messages()
        self._guard = threading.Lock()
        self._next = 1 + max((int(m.group(1)) for c in sup.list(include_ended=True)
                              if (m := _CELL_RE.match(c["cell_id"]))), default=0)
        self.procs: dict[int, Process] = {}  # the running processes WriteStdin, SendSignal, ResizeTTY find
        self.detached: dict[int, Process] = {}  # those POST /v1/agnsup/processes started, running or ended
        self.listening: tuple[str | None, int] | None = None  # (address or None for a wildcard, port): set once bound

    # -- the gRPC plumbing ---------------------------------------------------
    def handler(self):
        """One generic handler for process.v1.ProcessService (no generated code)."""
        import grpc
        pb = self.pb

        def unary(fn, req, resp):
            return grpc.unary_unary_rpc_method_handler(fn, request_deserializer=req.FromString,
                                                       response_serializer=resp.SerializeToString)
        def checked(fn):  # every call's peer first (linux/peer.py check_tcp): a cell's socket is refused
            def call(request, context):
                self._check_peer(context)
                return fn(request, context)
            return call

        def checked_stream(fn):
            def call(request, context):
                self._check_peer(context)
                yield from fn(request, context)
            return call
        methods = {
            "Execute": unary(checked(self.Execute), pb.ExecuteRequest, pb.ExecuteResponse),
            "ExecuteWithLimits": unary(checked(self.ExecuteWithLimits), pb.ExecuteWithLimitsRequest,
                                       pb.ExecuteWithLimitsResponse),
            "WriteStdin": unary(checked(self.WriteStdin), pb.WriteStdinRequest, pb.WriteStdinResponse),
            "SendSignal": unary(checked(self.SendSignal), pb.SendSignalRequest, pb.SendSignalResponse),
            "ResizeTTY": unary(checked(self.ResizeTTY), pb.ResizeTTYRequest, pb.ResizeTTYResponse),
            "Start": grpc.unary_stream_rpc_method_handler(checked_stream(self.Start),
                                                          request_deserializer=pb.StartRequest.FromString,
                                                          response_serializer=pb.StartResponse.SerializeToString),
        }
        return grpc.method_handlers_generic_handler(proto.SERVICE, methods)

    def _check_peer(self, context) -> None:
        """PERMISSION_DENIED, journaled, for a client that is a process of an agnsup cell (a `networked` cell
        shares the host's loopback); a client elsewhere on the pod's network is not this check's to judge."""
        import grpc
        from ..serve import tcp_peer_refusal
        client = grpc_peer_address(context.peer())
        if client is None:
            line = f"sandboxd: refused: the peer {context.peer()!r} is not a TCP address this server can check"
        else:
            line = tcp_peer_refusal(client, self.listening or (None, 0), self.sup.ctl.journal, "sandboxd")
        if line is not None:
            context.set_trailing_metadata([("agnsup-error-type", "Denied"), ("agnsup-exit-code", "126")])
            context.abort(grpc.StatusCode.PERMISSION_DENIED, line)

    def _abort(self, context, e: AgnsupError):
        md = [("agnsup-error-type", type(e).__name__), ("agnsup-exit-code", str(exit_code(e)))]
        decision = e.details.get("decision") or {}
        if decision.get("rule"):
            md.append(("agnsup-rule", str(decision["rule"])))
        context.set_trailing_metadata(md)
        context.abort(status_of(e), e.message)

    def _invalid(self, context, message: str):
        self._abort(context, UsageError(message))

    # -- requests -> cells ---------------------------------------------------
    def _ids(self, context) -> tuple[str, str]:
        md = dict(context.invocation_metadata() or ())
        return md.get("agnsup-run-id") or self.run_id, md.get("agnsup-agent-id") or self.agent_id

    def _cwd(self, cwd: str, argv: list[str], run_id: str, cell_id: str) -> str:
        """The cell's worktree: the server's, or `cwd` inside it (relative to it, or absolute under it).
        A cwd outside is refused like a gate denial: journaled (event `denied`), nothing started."""
        if cwd in ("", "."):
            return self.workdir
        p = cwd
        if os.path.isabs(p) and (p == self.workdir or p.startswith(self.workdir.rstrip("/") + "/")):
            p = os.path.relpath(p, self.workdir)
        resolved = os.path.realpath(os.path.join(self.workdir, p.lstrip("/")))
        if resolved != self.workdir and not resolved.startswith(self.workdir.rstrip("/") + "/"):
            reason = f"cwd {cwd!r} resolves to {resolved}, outside the sandbox's worktree {self.workdir}"
            decision = {"allowed": False, "rule": "sandboxd.cwd_escape", "reason": reason, "check": "sandboxd"}
            self.sup.ctl.journal.record_denied(run_id, cell_id, argv=argv, decision=decision,
                                               trail=[], chain=["sandboxd"])
            raise Denied(f"denied by sandboxd.cwd_escape: {reason}", decision=decision)
        return resolved

    def _number(self) -> int:
        with self._guard:
            n = self._next
            if n > MAX_PROCESS_ID:
                raise AgnsupError("process ids are exhausted (int32); use a new state root or --run-id")
            self._next += 1
            return n

    def start(self, argv: list[str], *, env: dict, cwd: str, run_id: str, agent_id: str,
              deadline: float | None = None, time_limit: float | None = None, **extra) -> Process:
        """A cell for the command (checked by CellRequest like every front door's); AgnsupError on a refusal.
        `deadline`: the seconds the caller waits for the answer. The cell gets them less reply_reserve, so a
        command that runs into it ends (124) while its output and exit can still reach the caller.
        `time_limit`: seconds the cell may run at most (the sooner of the two bounds it; agnsup's timeout
        ends it: TERM to the cell, the role's grace, the kill of its whole cgroup)."""
        if not argv:
            raise UsageError("config.command is required (the argv: program and arguments; no shell)")
        n = self._number()
        cell_id = f"{CELL_PREFIX}{n}"
        # the agent's next cell is made ahead under the id its request will name (Supervisor.name_next_cells)
        self.sup.name_next_cells(run_id, agent_id, lambda: f"{CELL_PREFIX}{self._next}")
        workdir = self._cwd(cwd, argv, run_id, cell_id)
        options = dict(role=self.role, run_id=run_id, agent_id=agent_id, cell_id=cell_id,
                       workdir=workdir, env=dict(env), entry="sandboxd", notify=lambda _line: None)
        if deadline is not None:
            bound = max(deadline - reply_reserve(deadline), 0.001)
            options.update(timeout=bound, lock_timeout=bound)
        if time_limit is not None:
            options["timeout"] = min(time_limit, options.get("timeout", time_limit))
        h = self.sup.spawn(argv, **options, **extra)
        p = Process(n, h["run_id"], h["cell_id"])
        p.queued = h["state"] == "waiting"  # behind the worktree lock: its own timeout starts when it does
        return p

    def _spawn(self, config, context, **extra) -> Process:
        """A cell for `config`, or the call aborted; the client going away takes the cell with it."""
        if config is None:
            self._invalid(context, "config is required (config.command: the argv, program and arguments)")
        run_id, agent_id = self._ids(context)
        remaining = context.time_remaining()  # the client's deadline, if it set one, bounds the cell
        if remaining is not None and remaining > NO_DEADLINE:
            remaining = None  # grpc reports "no deadline" as a remaining time of about 2**63 ns
        try:
            p = self.start(list(config.command), env=dict(config.env_vars),
                           cwd=config.cwd if config.HasField("cwd") else "", run_id=run_id, agent_id=agent_id,
                           deadline=None if remaining is None else max(remaining, 0.0), **extra)
        except AgnsupError as e:
            self._abort(context, e)

        def gone():  # the client went away (cancel, deadline, disconnect): so does its process
            if not p.done.is_set():
                with suppress(AgnsupError):
                    self.sup.cancel(cell_id=p.cell_id, run_id=p.run_id)
        if not context.add_callback(gone):
            gone()  # it went away while the cell was starting: the callback would never come
        return p

    def _ended(self, p: Process, context, output: bool = False) -> dict:
        res = self.sup.wait(p.run_id, p.cell_id)
        p.done.set()
        md = [("agnsup-run-id", p.run_id), ("agnsup-cell-id", p.cell_id), ("agnsup-state", str(res["state"])),
              ("agnsup-reason", str(res["reason"])), ("agnsup-receipt", str(res["receipt"]))]
        if output:  # Execute's output is what run_process returns: say when it was cut
            md += [(f"agnsup-{k}-truncated", "true") for k in ("stdout", "stderr") if res.get(f"{k}_truncated")]
        if res.get("network_hint"):  # only when the cell tried to reach out (tool.network_hint)
            md.append(("agnsup-network-hint", res["network_hint"]))
        if res.get("network_refused"):  # what the proxy refused and the key that allows it (JSON, ASCII)
            md.append(("agnsup-network-refused", json.dumps(res["network_refused"])))
        context.set_trailing_metadata(md)
        return res

    # -- the rpcs ------------------------------------------------------------
    def Execute(self, request, context):
        """Run to completion. stdout/stderr: what run_process returns (redacted as the role says, at most
        receipts.MAX_RETURNED_OUTPUT each); the whole capture stays under the cell's directory."""
        p = self._spawn(request.config, context)
        remaining = context.time_remaining()
        if remaining is not None and remaining <= NO_DEADLINE:
            # The cell ends reply_reserve before the deadline; one still being stopped (in its grace: it
            # ignores TERM) when a quarter of that is left is answered with the output it wrote so far: after
            # the deadline the client would drop any answer (and its own "timed out" result has no output).
            if self.sup.wait(p.run_id, p.cell_id, timeout=max(remaining - reply_reserve(remaining) / 4, 0)) is None:
                partial = self._so_far(p, context)
                if partial is not None:
                    return partial
        res = self._ended(p, context, output=True)
        return self.pb.ExecuteResponse(exit_code=_exit_code(res),
                                       stdout=res.get("stdout", "").encode(), stderr=res.get("stderr", "").encode())

    def ExecuteWithLimits(self, request, context):
        """Execute with bounds the client sets: stdout/stderr at most *_limit_bytes each (unset: LIMIT_CAP;
        more is clamped to it), the truncated flags saying the command wrote more; time_limit ends the cell
        through agnsup's timeout (TERM to the cell, the role's grace, the kill of its whole cgroup):
        TIME_LIMIT_EXCEEDED. elapsed_duration: the command's run time (its receipt's duration)."""
        pb = self.pb
        try:
            time_limit = time_limit_of(request.time_limit) if request.HasField("time_limit") else None
        except UsageError as e:
            self._abort(context, e)
        limits = {name: min(getattr(request, f"{name}_limit_bytes"), LIMIT_CAP)
                  if request.HasField(f"{name}_limit_bytes") else LIMIT_CAP for name in ("stdout", "stderr")}
        begun = time.monotonic()
        p = self._spawn(request.config if request.HasField("config") else None, context, time_limit=time_limit)
        res = self._ended(p, context)
        elapsed = time.monotonic() - begun
        from ...redact import for_receipt
        receipt = self.sup.receipt(p.run_id, p.cell_id) or {}
        if isinstance(receipt.get("duration"), (int, float)):
            elapsed = receipt["duration"]
        out = bounded_output(self.sup.state.cell_dir(p.run_id, p.cell_id), limits, for_receipt(receipt))
        reason = pb.ExecuteTerminationReason["EXECUTE_TERMINATION_REASON_TIME_LIMIT_EXCEEDED"
                                             if res["state"] == "timeout" else "EXECUTE_TERMINATION_REASON_EXITED"]
        resp = pb.ExecuteWithLimitsResponse(exit_code=_exit_code(res), termination_reason=reason, **out)
        resp.elapsed_duration.FromNanoseconds(int(elapsed * 1e9))
        return resp

    def _so_far(self, p: Process, context):
        """The answer for a cell still being stopped at its deadline: exit 124 and what its captured files
        hold so far (redacted, at most MAX_RETURNED_OUTPUT each); its stop goes on (TERM, grace, kill) and
        its receipt follows. None if it ended meanwhile (the usual answer then)."""
        from ...tool import captured
        try:
            redact = self.sup.redactor(p.run_id, p.cell_id)
        except (UnknownId, AttributeError):  # it ended in between (its running record is being dropped):
            return None                      # its result is in the journal
        if not p.queued:  # it started at once, so its timeout has come: it is being stopped for that, and the
            p.done.set()  # call's end must not make it a cancel (a queued one started late: the end cancels it)
        cell_dir = self.sup.state.cell_dir(p.run_id, p.cell_id)
        out, md = {}, [("agnsup-run-id", p.run_id), ("agnsup-cell-id", p.cell_id), ("agnsup-state", "timeout"),
                       ("agnsup-reason", "timeout"), ("agnsup-receipt", os.path.join(cell_dir, "receipt.json"))]
        for name, (text, truncated) in captured(cell_dir, redact).items():
            out[name] = text.encode()
            if truncated:
                md.append((f"agnsup-{name}-truncated", "true"))
        context.set_trailing_metadata(md)
        return self.pb.ExecuteResponse(exit_code=124, **out)

    def Start(self, request, context):
        """Run with live output: init{process_id}, stdout/stderr chunks in the order the cell wrote
        them (a pty's stream "tty" comes as stdout), exit{exit_code}. fd 0 is a pipe for WriteStdin,
        or the pty. The client ending the stream (cancel, deadline, disconnect) cancels the cell."""
        pb = self.pb
        if request.HasField("pty"):
            # The standard's server keeps its default size for a zero; the cell's pty needs one.
            live = {"stdin": True, "pty": {"cols": request.pty.cols or 80, "rows": request.pty.rows or 24}}
        else:
            live = {"stdin": True, "stream": True}
        p = self._spawn(request.config, context, long_lived=True, **live)  # a background process: live writes
        with self._guard:
            self.procs[p.process_id] = p  # before the init event: a WriteStdin right after it finds the process
        try:
            context.send_initial_metadata([("agnsup-run-id", p.run_id), ("agnsup-cell-id", p.cell_id)])
            yield pb.StartResponse(init=pb.InitEvent(process_id=p.process_id))
            since = 0
            while True:
                out = self.sup.read_output(p.run_id, p.cell_id, since, timeout=STREAM_POLL)
                for c in out["chunks"]:
                    yield pb.StartResponse(stderr=c["data"]) if c["stream"] == "stderr" \
                        else pb.StartResponse(stdout=c["data"])
                since = out["next"]
                if out["ended"] or not context.is_active():
                    break
            res = self._ended(p, context)
            yield pb.StartResponse(exit=pb.ExitEvent(exit_code=_exit_code(res)))
        finally:
            with self._guard:
                self.procs.pop(p.process_id, None)

    def _process(self, process_id: int, context) -> Process:
        with self._guard:
            p = self.procs.get(process_id)
        if p is None:
            self._abort(context, UnknownId(f"process {process_id} not found (not started by this server's Start, "
                                           "or it has ended)"))
        return p

    def _live(self, context, fn, *args) -> None:
        """A call on a running cell; the Supervisor's UsageError (no stdin, no pty, already ended) is the
        standard's FAILED_PRECONDITION."""
        import grpc
        try:
            fn(*args)
        except UsageError as e:
            context.set_trailing_metadata([("agnsup-error-type", "UsageError"), ("agnsup-exit-code", "125")])
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, e.message)
        except AgnsupError as e:
            self._abort(context, e)

    def WriteStdin(self, request, context):
        p = self._process(request.process_id, context)
        if request.WhichOneof("payload") == "eof":
            self._live(context, self.sup.write_stdin, p.run_id, p.cell_id, b"", True)
        elif request.input:
            self._live(context, self.sup.write_stdin, p.run_id, p.cell_id, request.input)
        return self.pb.WriteStdinResponse()

    def SendSignal(self, request, context):
        """SIGINT and SIGTERM reach the cell's process group, as the standard says; SIGKILL kills the
        cell's whole tree through its cgroup (setsid daemons too). When the command's leader ends, by
        a signal or not, whatever it left in its cgroup is killed with it: no daemon outlives it."""
        sig = {2: "INT", 15: "TERM", 9: "KILL"}.get(request.signal)
        if sig is None:
            self._invalid(context, f"signal {request.signal}: must be SIGNAL_SIGINT, SIGNAL_SIGTERM or SIGNAL_SIGKILL")
        p = self._process(request.process_id, context)
        self._live(context, self.sup.signal, p.run_id, p.cell_id, sig)
        return self.pb.SendSignalResponse()

    def ResizeTTY(self, request, context):
        p = self._process(request.process_id, context)
        self._live(context, self.sup.resize, p.run_id, p.cell_id, request.cols, request.rows)
        return self.pb.ResizeTTYResponse()


    # -- agnsup's REST extension (rest.py /v1/agnsup/processes): a process that outlives its call -----
    def start_detached(self, body: dict) -> Process:
        """POST /v1/agnsup/processes {"command": [argv], "env_vars": {}, "cwd": ""}: a cell that runs until
        it ends or is signalled (or the server stops), not until a call ends. It takes the next process id,
        so gRPC's SendSignal and the REST calls below both find it while it runs; its output stays
        readable (from its first byte) after it ended."""
        if not isinstance(body, dict):
            raise UsageError("the body must be a JSON object: {\"command\": [\"program\", \"arg\", ...]}")
        unknown = sorted(set(body) - {"command", "env_vars", "cwd"})
        argv, env, cwd = body.get("command"), body.get("env_vars") or {}, body.get("cwd") or ""
        if unknown:
            raise UsageError(f"unknown field(s) {', '.join(unknown)} (known: command, env_vars, cwd)")
        if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
            raise UsageError("command: must be a list of strings (the argv: program and arguments; no shell)")
        if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise UsageError("env_vars: must be an object of strings")
        if not isinstance(cwd, str):
            raise UsageError("cwd: must be a string")
        p = self.start(argv, env=env, cwd=cwd, run_id=self.run_id, agent_id=self.agent_id, long_lived=True,
                       stream=True)
        with self._guard:
            self.procs[p.process_id] = p
            self.detached[p.process_id] = p

        def reap():
            try:
                self.sup.wait(p.run_id, p.cell_id)
            except BaseException:  # noqa: BLE001 - its status call reports it; here it only ended
                pass
            finally:
                p.done.set()
                with self._guard:
                    self.procs.pop(p.process_id, None)
        threading.Thread(target=reap, name=f"sandboxd-{p.cell_id}", daemon=True).start()
        return p

    def detached_process(self, process_id: int) -> Process:
        with self._guard:
            p = self.detached.get(process_id)
        if p is None:
            raise UnknownId(f"process {process_id} not found (not started by POST /v1/agnsup/processes of this "
                            "server)")
        return p

    def status(self, p: Process) -> dict:
        out = {"process_id": p.process_id, "run_id": p.run_id, "cell_id": p.cell_id, "running": not p.done.is_set()}
        res = self.sup.wait(p.run_id, p.cell_id, timeout=0)
        if res is not None:
            out.update(exit_code=_exit_code(res), state=res["state"], reason=res["reason"], receipt=res["receipt"])
        return out

    def events(self, p: Process):
        """Its output as it comes, in the order it was written, from its first byte: {"stdout": text} and
        {"stderr": text}, then the status (with exit_code) once it ended. None after each STREAM_POLL
        without output: the writer's turn to see whether its reader is still there."""
        import codecs
        decoders = {name: codecs.getincrementaldecoder("utf-8")("replace") for name in ("stdout", "stderr")}
        since = 0
        while True:
            out = self.sup.read_output(p.run_id, p.cell_id, since, timeout=STREAM_POLL)
            for c in out["chunks"]:
                name = "stderr" if c["stream"] == "stderr" else "stdout"
                text = decoders[name].decode(c["data"])
                if text:
                    yield {name: text}
            if not out["chunks"] and not out["ended"]:
                yield None
            since = out["next"]
            if out["ended"]:
                break
        for name, d in decoders.items():
            if (text := d.decode(b"", final=True)):
                yield {name: text}
        self.sup.wait(p.run_id, p.cell_id)
        p.done.set()
        yield self.status(p)

    def signal_detached(self, p: Process, name: str) -> None:
        sig = {"SIGINT": "INT", "SIGTERM": "TERM", "SIGKILL": "KILL", "SIGNAL_SIGINT": "INT",
               "SIGNAL_SIGTERM": "TERM", "SIGNAL_SIGKILL": "KILL"}.get(name)
        if sig is None:
            raise UsageError(f"signal {name!r}: must be SIGINT, SIGTERM or SIGKILL")
        self.sup.signal(p.run_id, p.cell_id, sig)


def grpc_peer_address(peer: str) -> tuple[str, int] | None:
    """gRPC's peer string -> (address, port): "ipv4:127.0.0.1:5000", "ipv6:[::1]:5000" (a zone dropped);
    None for anything else."""
    kind, _, rest = peer.partition(":")
    host, _, port = rest.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    host = host.partition("%")[0]
    if kind not in ("ipv4", "ipv6") or not host or not port.isdigit():
        return None
    return host, int(port)


def reply_reserve(deadline: float) -> float:
    """What a cell bound by a client's deadline leaves of it for its answer: the stop (TERM; a command
    that ignores it gets the role's grace, and Execute answers with the output so far meanwhile), the
    receipt and the reply. A quarter of a short deadline, REPLY_RESERVE of a long one."""
    return min(REPLY_RESERVE, deadline / 4)


def time_limit_of(d) -> float:
    """ExecuteWithLimits' time_limit (a google.protobuf.Duration) -> seconds; UsageError (INVALID_ARGUMENT)
    unless it is a valid Duration, positive and at most NO_DEADLINE (ten years)."""
    if not (-315576000000 <= d.seconds <= 315576000000 and -999999999 <= d.nanos <= 999999999) \
            or (d.seconds > 0 > d.nanos) or (d.seconds < 0 < d.nanos):
        raise UsageError(f"time_limit: not a valid google.protobuf.Duration (seconds={d.seconds}, nanos={d.nanos}: "
                         "|seconds| <= 315576000000, |nanos| <= 999999999, both of one sign)")
    t = d.seconds + d.nanos / 1e9
    if t <= 0:
        raise UsageError(f"time_limit: must be positive, not {t:g} s (leave it unset for no limit)")
    if t > NO_DEADLINE:
        raise UsageError(f"time_limit: at most {NO_DEADLINE:g} s (ten years), not {t:g} s (leave it unset for no "
                         "limit)")
    return t


def bounded_output(cell_dir: str, limits: dict[str, int], redact) -> dict:
    """{stdout, stderr: bytes, at most limits[name] each; stdout_truncated, stderr_truncated} from the cell's
    capture files. Bytes exact when the role redacts nothing; else the cut text is redacted (as tool.captured
    does) and cut again to the limit."""
    out = {}
    for name, limit in limits.items():
        try:
            with open(os.path.join(cell_dir, name), "rb") as f:
                data = f.read(limit + 1)
        except FileNotFoundError:
            data = b""
        cut = data[:limit]
        text = cut.decode(errors="surrogateescape")
        redacted = redact(text)
        if redacted != text:
            cut = redacted.encode(errors="surrogateescape")[:limit]
        out[name], out[f"{name}_truncated"] = cut, len(data) > limit
    return out


def _exit_code(res: dict) -> int:
    return res["exit_code"] if res["exit_code"] is not None else -1
