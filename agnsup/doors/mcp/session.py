"""The sessions of `agnsup mcp`: each its run, role and workdir over the one Supervisor, the calls' blocking side."""
from __future__ import annotations

import os
import secrets
import threading

from ...errors import UsageError

DIFF_TEXT_MAX = 64 * 1024  # the diff text one tool result carries (run_process bounds stdout alike)


def agent_name(client_name: str | None) -> str:
    """An agent id (state.check_id's alphabet) from an MCP client's name: "Claude Code" -> claude-code."""
    allowed = set("abcdefghijklmnopqrstuvwxyz0123456789._-")
    name = "".join(c if c in allowed else "-" for c in (client_name or "").strip().lower())
    name = name.lstrip("._-")[:64].rstrip("-")
    return name or "mcp-client"


class Session:
    """One MCP session: its run, role and workdir, over one Supervisor."""

    def __init__(self, sup, run_id: str, role: str, workdir: str, agent_id: str | None = None):
        self.sup, self.run_id, self.role, self.workdir, self.agent_id = sup, run_id, role, workdir, agent_id
        self.started: list[str] = []  # the cells this session started: its end cancels the live ones

    def _workdir(self, given: str | None) -> str:
        if given is None:
            return self.workdir
        path = os.path.realpath(os.path.join(self.workdir, given))
        if path != self.workdir and not path.startswith(self.workdir.rstrip("/") + "/"):
            raise UsageError(f"workdir: {given!r} is outside this server's workdir {self.workdir}")
        return path

    def spawn(self, argv, args: dict, client: str | None, shell: bool = False, notify=None) -> dict:
        """A cell of this session (blocking: the caller runs it in a thread)."""
        opts = dict(args)
        opts["agent_id"] = opts.pop("agent_id", None) or self.agent_id or agent_name(client)
        opts["workdir"] = self._workdir(opts.get("workdir"))
        h = self.sup.spawn(argv, run_id=self.run_id, role=self.role, entry="mcp", capture=True, shell=shell,
                           notify=notify, **opts)
        self.started.append(h["cell_id"])
        return h

    def cancel(self, cell_id=None, agent_id=None, run: bool = False, grace=None) -> dict:
        if sum(x is not None for x in (cell_id, agent_id, run or None)) != 1:
            raise UsageError("cancel: give exactly one of cell_id, agent_id or run: true")
        if grace is not None and (isinstance(grace, bool) or grace < 0):
            raise UsageError(f"cancel: grace must be a number of seconds >= 0, not {grace!r}")
        if run and not self.sup.list(self.run_id, include_ended=True):
            return {"cancelled": 0, "cells": []}  # nothing ran yet: the run is not in the journal
        return self.sup.cancel(cell_id=cell_id, run_id=self.run_id, agent_id=agent_id, grace=grace)

    def receipt(self, cell_id: str) -> dict:
        rec = self.sup.receipt(self.run_id, cell_id)
        return rec if rec is not None else {"cell_id": cell_id, "pending": True}

    def diff(self, cell_id: str, stat: bool = False) -> dict:
        """What a cell of this session (or an undo record) changed, its diff text bounded."""
        d, room = self.sup.diff(cell_id, self.run_id, stat), DIFF_TEXT_MAX
        for e in d.get("entries") or []:
            text = e.get("diff")
            if isinstance(text, str) and len(text) > room:
                e["diff"], e["diff_truncated"], d["truncated"] = text[:room], True, True
            room = max(room - len(e.get("diff") or ""), 0)
        return d

    def undo(self, cell_id=None, agent_id=None, run: bool = False, force: bool = False) -> dict:
        if sum(x is not None for x in (cell_id, agent_id, run or None)) != 1:
            raise UsageError("undo: give exactly one of cell_id, agent_id or run: true")
        return self.sup.undo(cell_id=cell_id, run_id=self.run_id, agent_id=agent_id, force=bool(force))

    def end(self) -> None:
        """The session is over: cancel the cells it started that still run."""
        for cell_id in self.started:
            if self.sup.wait(self.run_id, cell_id, 0) is None:
                self.sup.cancel(cell_id=cell_id, run_id=self.run_id)


class Sessions:
    """The sessions of one server. stdio has one; streamable HTTP has one per
    Mcp-Session-Id, each with a run of its own unless --run-id names one for all."""

    def __init__(self, sup, role: str, workdir: str, run_id: str | None, agent_id: str | None):
        self.sup, self.role, self.workdir, self.agent_id = sup, role, workdir, agent_id
        self.run_id = run_id  # None: a new mcp-XXXXXXXX per session
        self._by_id: dict[str | None, Session] = {}
        self._lock = threading.Lock()

    def get(self, session_id: str | None) -> Session:
        with self._lock:
            s = self._by_id.get(session_id)
            if s is None:
                s = self._by_id[session_id] = Session(self.sup, self.run_id or new_run_id(), self.role,
                                                      self.workdir, self.agent_id)
            return s

    def end(self, session_id: str | None) -> None:
        with self._lock:
            s = self._by_id.pop(session_id, None)
        if s is not None:
            s.end()


def new_run_id() -> str:
    return f"mcp-{secrets.token_hex(4)}"

