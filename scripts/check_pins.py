#!/usr/bin/env python3
"""scripts/check --pins: the floors in pyproject.toml are true. Two scratch venvs, each
installing agnsup with its requirements' lowest allowed versions (`>=X` read as `==X`),
then importing every front door and running their --help:

- core: the dependencies at their floors (no extra): cli, entry, serve, doctor, selftest,
  and the gate's parser and the models through `agnsup check` and `agnsup tool-schema`;
- extras: the mcp and k8s extras at their floors (the dependencies as those extras'
  own floors need them: mcp 2.0 needs a newer pydantic than agnsup's floor, which
  the core venv proves), the MCP server built and its HTTP app made, sandboxd's
  gRPC descriptor loaded.

Needs the package index (PyPI); one line per failure, exit 1 on any. WORK=DIR keeps the
venvs there (default: a temporary directory, removed)."""
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLOOR = re.compile(r"^([A-Za-z0-9._-]+(?:\[[^]]*\])?)\s*>=\s*([^,;\s]+)")

CORE_PROBE = """
import agnsup.doors.cli, agnsup.doors.entry, agnsup.doors.serve, agnsup.doors.doctor, agnsup.selftest, agnsup.gate.shell
"""
EXTRAS_PROBE = """
import types
import agnsup.doors.mcp.server, agnsup.doors.sandboxd, agnsup.doors.sandboxd.proto
from mcp.server.transport_security import TransportSecuritySettings
sessions = types.SimpleNamespace(role="executor", workdir="/", run_id=None)
server = agnsup.doors.mcp.server.build_server(sessions)
server.streamable_http_app(host="127.0.0.1",
                           transport_security=TransportSecuritySettings(enable_dns_rebinding_protection=False))
agnsup.doors.sandboxd.proto.messages()
import mcp_types  # every tool's outputSchema goes on the wire as the floor's Tool has it
from agnsup.doors.mcp.tools import OUTPUT_SCHEMAS
tool = mcp_types.Tool(name="run_process", input_schema={"type": "object"}, output_schema=OUTPUT_SCHEMAS["run_process"])
assert tool.model_dump(by_alias=True)["outputSchema"] == OUTPUT_SCHEMAS["run_process"]
"""


def floors(reqs: list[str]) -> list[str]:
    """Each requirement at its lowest allowed version; one without a floor is a finding."""
    out = []
    for req in reqs:
        m = FLOOR.match(req)
        if not m:
            sys.exit(f"check --pins: {req!r} has no floor (>=X) to test")
        out.append(f"{m.group(1)}=={m.group(2)}")
    return out


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


def venv(where: str, reqs: list[str]) -> str | None:
    """A venv at `where` with agnsup and exactly `reqs`; its python, or None (the failure printed)."""
    py = os.path.join(where, "bin", "python")
    pip = [py, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    for cmd in ([sys.executable, "-m", "venv", where], [*pip, *reqs], [*pip, "--no-deps", ROOT]):
        r = run(cmd)
        if r.returncode != 0:
            lines = [ln for ln in (r.stderr + r.stdout).splitlines() if ln and not ln.startswith("WARNING: Location")]
            print(f"check --pins: {os.path.basename(where)}: install of {' '.join(reqs)} failed: "
                  + " | ".join(lines[-4:]))
            return None
    return py


def probe(name: str, py: str, code: str, commands: list[list[str]], work: str) -> int:
    """Run `code`, then each agnsup command (its own state root; a workdir outside it, which is a deny path)."""
    failed = 0
    agnsup = os.path.join(os.path.dirname(py), "agnsup")
    state, tree = os.path.join(work, "state"), os.path.join(work, "tree")
    os.makedirs(tree, exist_ok=True)
    for cmd in [[py, "-c", code]] + [[agnsup, "--state-dir", state, *c] for c in commands]:
        r = run(cmd, cwd=tree)
        if r.returncode != 0:
            last = ((r.stderr + r.stdout).strip().splitlines() or ["(no output)"])[-1]
            what = "the import probe" if cmd[0] == py else "agnsup " + " ".join(cmd[3:])
            print(f"check --pins: {name}: {what}: exit {r.returncode}: {last}")
            failed += 1
    return failed


def main() -> int:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    extras = project["optional-dependencies"]
    core = floors(project["dependencies"])
    pinned_extras = floors(extras["mcp"] + extras["k8s"])
    keep = os.environ.get("WORK")
    work = keep or tempfile.mkdtemp(prefix="agnsup-pins-")
    start = time.monotonic()
    failed = 0
    try:
        for name, reqs, code, commands in (
                ("core", core, CORE_PROBE, [["--help"], ["mcp", "--help"], ["sandboxd", "--help"], ["tool-schema"],
                                            ["check", "--", "bash", "-c", "echo hi | tee out.txt"]]),
                ("extras", pinned_extras + project["dependencies"], EXTRAS_PROBE,
                 [["mcp", "--help"], ["sandboxd", "--help"]])):
            py = venv(os.path.join(work, name), reqs)
            failed += 1 if py is None else probe(name, py, code, commands, work)
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
    took = time.monotonic() - start
    print(f"check --pins: {'FAIL' if failed else 'ok'}: core {' '.join(core)}; extras {' '.join(pinned_extras)} "
          f"({took:.0f} s)", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
