"""`agnsup sandboxd`: the agent-sandbox runtime API (KEP-539.2) as a front door of agnsup.

    gRPC process.v1.ProcessService (process.py)   default 127.0.0.1:9090
    REST /v1/health, /v1/metadata, /v1/files (rest.py)   default 127.0.0.1:8080

One Supervisor (one controller instance, kind "sandboxd") serves both: every
process is a cell of the server's role under its run id, started through
Supervisor.spawn like any other front door's (no spawn path of its own).
A SIGKILLed sandboxd is a dead controller: the janitor of the next controller
on the same state root, this server restarted included, recovers its cells.
Needs the `k8s` extra (grpcio, protobuf); never imported by `agnsup run`.
docs/sandboxd.md has the mapping and what the standard leaves open.
"""
from __future__ import annotations

import faulthandler
import json
import os
import signal
import threading

from ...errors import UsageError

DEFAULT_GRPC = "127.0.0.1:9090"
DEFAULT_REST = "127.0.0.1:8080"
SHUTDOWN_GRACE = 30.0  # seconds in-flight calls get to end after SIGTERM (their cells are cancelled meanwhile)


def parse_address(text: str, what: str) -> tuple[str, int]:
    """HOST:PORT, [V6]:PORT, :PORT or PORT (loopback) -> (host, port); port 0 picks a free one."""
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = "", text
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        n = int(port)
    except ValueError:
        n = -1
    if not 0 <= n <= 65535:
        raise UsageError(f"{what} {text!r}: expected HOST:PORT with a port 0-65535")
    return host or "127.0.0.1", n


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _enable_reflection(server) -> bool:
    """gRPC server reflection, as the standard's server registers it (so `grpcurl` needs no .proto),
    answered from agnsup's own descriptor pool. grpcio-reflection is in the k8s extra; without it
    the service is simply not offered."""
    try:
        from grpc_reflection.v1alpha import reflection
    except ImportError:
        return False
    from . import proto
    reflection.enable_server_reflection((proto.SERVICE, reflection.SERVICE_NAME), server, pool=proto.messages().pool)
    return True


class Sandboxd:
    def __init__(self, state_dir: str | None, *, grpc_addr: str = DEFAULT_GRPC, rest_addr: str = DEFAULT_REST,
                 role: str = "executor", workdir: str | None = None, run_id: str = "sandboxd",
                 agent_id: str = "sandboxd"):
        # gRPC's fork handlers (pthread_atfork) would run in every cell's child between fork and exec
        # and start threads there; the child only execs, so it needs none (seen: a child aborting in
        # them took the server down). Read by grpc's core when it loads: set before the import.
        os.environ["GRPC_ENABLE_FORK_SUPPORT"] = "false"
        try:
            import grpc
        except ImportError:
            raise UsageError("agnsup sandboxd needs the k8s extra: pip install 'agnsup[k8s]'") from None
        from ...request import KINDS
        for name, value in (("--run-id", run_id), ("--agent", agent_id), ("--role", role)):
            if not KINDS["str"][0](value):
                raise UsageError(f"{name}: must be a non-empty string")
        self.workdir = os.path.realpath(workdir or os.getcwd())
        if not os.path.isdir(self.workdir):
            raise UsageError(f"--workdir {self.workdir} is not a directory")
        grpc_at, rest_at = parse_address(grpc_addr, "--grpc"), parse_address(rest_addr, "--rest")
        from ...supervisor import Supervisor
        from .process import ProcessService
        from .rest import Files, RestApp, server
        self.sup = Supervisor(state_dir, kind="sandboxd")
        self.stop = threading.Event()
        self.grpc = self.rest = self.files = None
        try:
            self.files = Files(self.sup, role=role, workdir=self.workdir, run_id=run_id)  # the role checked here
            self.process = ProcessService(self.sup, role=role, workdir=self.workdir, run_id=run_id, agent_id=agent_id)
            from concurrent.futures import ThreadPoolExecutor
            # A Start stream holds its worker for the process's life: room for many at once.
            self.grpc = grpc.server(ThreadPoolExecutor(max_workers=64, thread_name_prefix="sandboxd-grpc"),
                                    handlers=[self.process.handler()])
            self.reflection = _enable_reflection(self.grpc)
            try:
                port = self.grpc.add_insecure_port(_join(*grpc_at))
            except RuntimeError:
                port = 0
            if port == 0:
                raise UsageError(f"--grpc {_join(*grpc_at)}: cannot listen there (in use, or not an address of "
                                 "this host)")
            self.grpc_addr = _join(grpc_at[0], port)
            # gRPC names only the peer: the check looks the client up by this end's address and port
            self.process.listening = (grpc_at[0], port)
            try:
                self.rest = server(rest_at, None)
            except OSError as e:
                raise UsageError(f"--rest {_join(*rest_at)}: cannot listen there ({e.strerror or e})") from None
            self.rest_addr = _join(rest_at[0], self.rest.server_address[1])
            self.app = RestApp(self.files, self.about(role, run_id, agent_id), self.process)
            self.rest.RequestHandlerClass.app = self.app
        except BaseException:
            self._close_listeners()
            self.sup.close()
            raise

    def about(self, role: str, run_id: str, agent_id: str) -> dict:
        from ... import __version__
        return {"agnsup": __version__, "role": role, "run_id": run_id, "agent_id": agent_id, "worktree": self.workdir,
                "controller": self.sup.controller_id, "pid": os.getpid(), "grpc": self.grpc_addr,
                "rest": self.rest_addr}

    def _close_listeners(self) -> None:
        if self.rest is not None:
            self.rest.server_close()
        if self.grpc is not None:
            self.grpc.stop(None)
        if self.files is not None:
            self.files.close()
            self.files = None

    def serve_forever(self) -> int:
        handlers = {sig: signal.signal(sig, lambda *_: self.stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
        self.grpc.start()
        rest_thread = threading.Thread(target=self.rest.serve_forever, kwargs={"poll_interval": 0.2},
                                       name="sandboxd-rest", daemon=True)
        rest_thread.start()
        print(json.dumps({"ready": True, **self.app.about()}), flush=True)
        try:
            # In slices: a SIGTERM the kernel hands to one of gRPC's threads runs its Python handler only when
            # this (main) thread next runs bytecode; a wait of an hour would hold the stop that long.
            while not self.stop.wait(1.0):
                pass
        finally:
            for sig, h in handlers.items():
                signal.signal(sig, h)
            # a shutdown still going after its first grace prints every thread's stack: the evidence of what held it
            faulthandler.dump_traceback_later(SHUTDOWN_GRACE + 15, exit=False)
            self.shutdown()
            faulthandler.cancel_dump_traceback_later()
            rest_thread.join(5)
        return 0

    def shutdown(self) -> None:
        """Health says 503 and the listeners take no new calls; this server's cells are cancelled
        (TERM, the role's grace, the kill), so each Start stream still gets its exit event; then it ends."""
        self.app.stopping = True
        self.rest.shutdown()
        streams_done = self.grpc.stop(SHUTDOWN_GRACE)  # in-flight calls get this long to finish
        try:
            self.sup.close()
        finally:
            streams_done.wait(SHUTDOWN_GRACE)
            self._close_listeners()


def main(state_dir: str | None, **options) -> int:
    return Sandboxd(state_dir, **options).serve_forever()
