"""process.v1.ProcessService over agnsup.service.Supervisor: every process is a cell.

A process id (int32, the standard's) names one cell of this server: process id
N is cell `proc-N` of the run the call came with (`--run-id`, default
"sandboxd"; gRPC metadata `agnsup-run-id` may name another). N counts up for
the state root's life: a restarted server goes on after the highest `proc-N`
the journal has, so an id from before a restart never names a new process.
Execute takes a number too (its cell is `proc-N`) but never hands it out.

The role is the server's (`--role`), never the client's. agnsup's answers
beyond the standard messages travel as metadata: trailing `agnsup-run-id`,
`agnsup-cell-id`, `agnsup-state`, `agnsup-reason`, `agnsup-receipt` (and on
Start, the same ids as initial metadata); on a refusal `agnsup-error-type`,
`agnsup-exit-code` (agnsup's CLI exit code) and `agnsup-rule`.
"""
from __future__ import annotations

import os
import re
import threading

from ..errors import (AgnsupError, CancelledBeforeStart, Denied, LockTimeout, NotExecutable, NotFound, PolicyError,
                      RunNotActive, UnknownId, UsageError, exit_code)
from . import proto

CELL_PREFIX = "proc-"
_CELL_RE = re.compile(r"^proc-(\d+)$")
MAX_PROCESS_ID = 2**31 - 1  # int32 on the wire
NO_DEADLINE = 10 * 365 * 86400.0


def status_of(e: AgnsupError):
    """The gRPC status code an agnsup refusal maps to (docs/sandboxd.md "Errors")."""
    import grpc
    for cls, code in ((Denied, grpc.StatusCode.PERMISSION_DENIED), (NotExecutable, grpc.StatusCode.PERMISSION_DENIED),
                      (NotFound, grpc.StatusCode.NOT_FOUND), (UnknownId, grpc.StatusCode.NOT_FOUND),
                      (LockTimeout, grpc.StatusCode.UNAVAILABLE), (CancelledBeforeStart, grpc.StatusCode.CANCELLED),
                      (RunNotActive, grpc.StatusCode.FAILED_PRECONDITION),
                      (UsageError, grpc.StatusCode.INVALID_ARGUMENT), (PolicyError, grpc.StatusCode.FAILED_PRECONDITION)):
        if isinstance(e, cls):
            return code
    return grpc.StatusCode.INTERNAL


class Process:
    """What this server knows of one started process: its cell, and whether it is done."""

    def __init__(self, process_id: int, run_id: str, cell_id: str):
        self.process_id, self.run_id, self.cell_id = process_id, run_id, cell_id
        self.done = threading.Event()


class ProcessService:
    def __init__(self, sup, *, role: str, workdir: str, run_id: str, agent_id: str):
        self.sup, self.role, self.workdir = sup, role, workdir
        self.run_id, self.agent_id = run_id, agent_id
        self.pb = proto.messages()
        self._guard = threading.Lock()
        self._next = 1 + max((int(m.group(1)) for c in sup.list(include_ended=True)
                              if (m := _CELL_RE.match(c["cell_id"]))), default=0)
        self.procs: dict[int, Process] = {}

    # -- the gRPC plumbing ---------------------------------------------------
    def handler(self):
        """One generic handler for process.v1.ProcessService (no generated code)."""
        import grpc
        pb = self.pb

        def unary(fn, req, resp):
            return grpc.unary_unary_rpc_method_handler(fn, request_deserializer=req.FromString,
                                                       response_serializer=resp.SerializeToString)
        methods = {
            "Execute": unary(self.Execute, pb.ExecuteRequest, pb.ExecuteResponse),
            "WriteStdin": unary(self.WriteStdin, pb.WriteStdinRequest, pb.WriteStdinResponse),
            "SendSignal": unary(self.SendSignal, pb.SendSignalRequest, pb.SendSignalResponse),
            "ResizeTTY": unary(self.ResizeTTY, pb.ResizeTTYRequest, pb.ResizeTTYResponse),
            "Start": grpc.unary_stream_rpc_method_handler(self.Start, request_deserializer=pb.StartRequest.FromString,
                                                          response_serializer=pb.StartResponse.SerializeToString),
        }
        return grpc.method_handlers_generic_handler(proto.SERVICE, methods)

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

    def _cwd(self, config, context) -> str:
        """The cell's worktree: the server's, or `cwd` inside it (relative to it, or absolute under it)."""
        if not config.HasField("cwd") or config.cwd in ("", "."):
            return self.workdir
        p = config.cwd
        if os.path.isabs(p) and (p == self.workdir or p.startswith(self.workdir.rstrip("/") + "/")):
            p = os.path.relpath(p, self.workdir)
        resolved = os.path.realpath(os.path.join(self.workdir, p.lstrip("/")))
        if resolved != self.workdir and not resolved.startswith(self.workdir.rstrip("/") + "/"):
            self._abort(context, Denied(f"cwd {config.cwd!r} resolves to {resolved}, outside the sandbox's worktree "
                                        f"{self.workdir}", decision={"rule": "sandboxd.cwd_escape"}))
        return resolved

    def _number(self) -> int:
        with self._guard:
            n = self._next
            if n > MAX_PROCESS_ID:
                raise AgnsupError("process ids are exhausted (int32); use a new state root or --run-id")
            self._next += 1
            return n

    def _spawn(self, config, context, **extra) -> Process:
        """A cell for `config` (checked by CellRequest like every front door's), or the call aborted."""
        argv = list(config.command)
        if not argv:
            self._invalid(context, "config.command is required (the argv: program and arguments; no shell)")
        run_id, agent_id = self._ids(context)
        workdir = self._cwd(config, context)
        n = self._number()
        remaining = context.time_remaining()  # the client's deadline, if it set one, bounds the cell
        if remaining is not None and remaining > NO_DEADLINE:
            remaining = None  # grpc reports "no deadline" as a remaining time of about 2**63 ns
        options = dict(role=self.role, run_id=run_id, agent_id=agent_id, cell_id=f"{CELL_PREFIX}{n}",
                       workdir=workdir, env=dict(config.env_vars), entry="sandboxd", notify=lambda _line: None)
        if remaining is not None:
            options.update(timeout=max(remaining, 0.001), lock_timeout=max(remaining, 0))
        try:
            h = self.sup.spawn(argv, **options, **extra)
        except AgnsupError as e:
            self._abort(context, e)
        p = Process(n, h["run_id"], h["cell_id"])

        def gone():  # the client went away (cancel, deadline, disconnect): so does its process
            if not p.done.is_set():
                try:
                    self.sup.cancel(cell_id=p.cell_id, run_id=p.run_id)
                except AgnsupError:
                    pass
        context.add_callback(gone)
        return p

    def _ended(self, p: Process, context) -> dict:
        res = self.sup.wait(p.run_id, p.cell_id)
        p.done.set()
        context.set_trailing_metadata([("agnsup-run-id", p.run_id), ("agnsup-cell-id", p.cell_id),
                                       ("agnsup-state", str(res["state"])), ("agnsup-reason", str(res["reason"])),
                                       ("agnsup-receipt", str(res["receipt"]))])
        return res

    # -- the rpcs ------------------------------------------------------------
    def Execute(self, request, context):
        """Run to completion. stdout/stderr: what run_process returns (redacted as the role says, at most
        receipts.MAX_RETURNED_OUTPUT each); the whole capture stays under the cell's directory."""
        p = self._spawn(request.config, context)
        res = self._ended(p, context)
        return self.pb.ExecuteResponse(exit_code=res["exit_code"] if res["exit_code"] is not None else -1,
                                       stdout=res.get("stdout", "").encode(), stderr=res.get("stderr", "").encode())

    def Start(self, request, context):
        self._abort(context, UsageError("Start needs the streaming core (not in this build)"))

    def WriteStdin(self, request, context):
        self._abort(context, UsageError("WriteStdin needs the streaming core (not in this build)"))

    def SendSignal(self, request, context):
        self._abort(context, UsageError("SendSignal needs the streaming core (not in this build)"))

    def ResizeTTY(self, request, context):
        self._abort(context, UsageError("ResizeTTY needs the streaming core (not in this build)"))
