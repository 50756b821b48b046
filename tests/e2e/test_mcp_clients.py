"""`agnsup mcp` driven by MCP clients nobody on the team wrote (issue 28, "One line per client"): the MCP
Inspector's CLI (tools/list, a call whose output comes back, a refusal that comes back as one), and Claude Code,
Codex CLI and Gemini CLI registering it with the very line `agnsup mcp config CLIENT` prints: the file each
wrote parses and names our absolute command, and where the client checks a server's health (claude and gemini
`mcp list` start it and say Connected) it connects. Scratch homes, no login, no model calls.

The clients come from npm (tests/e2e/npm/package.json and its lockfile: the newest versions that run on node
20), installed once per machine by scripts/e2e_npm into a cached prefix. Where it cannot run (no node, no
registry) every test here is skipped as ENV_BLOCKED, naming why: never passed."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tomllib

import pytest

from conftest import REPO
from scenario import stop_server

BIN = os.path.join(os.path.dirname(sys.executable), "agnsup")  # the venv's console script, as a user has it


@pytest.fixture(scope="module")
def npm_bin() -> str:
    """node_modules/.bin of the cached client install (scripts/e2e_npm), else ENV_BLOCKED."""
    cp = subprocess.run(["bash", os.path.join(REPO, "scripts", "e2e_npm")], capture_output=True, text=True,
                        timeout=900, stdin=subprocess.DEVNULL)
    if cp.returncode == 77:
        pytest.skip(cp.stderr.strip().rpartition("e2e_npm: ")[2] or "ENV_BLOCKED: scripts/e2e_npm")
    assert cp.returncode == 0, cp.stderr
    print(cp.stderr.strip())  # cached, or installed in N ms
    return cp.stdout.strip()


@pytest.fixture
def home(tmp_path):
    """A scratch home for a client (its config files land here) and the project folder it runs in: nothing of
    the machine's own homes, no credentials, no updater or telemetry traffic."""
    h, project = tmp_path / "home", tmp_path / "project"
    for d in (h / ".config", h / ".codex", project):
        d.mkdir(parents=True)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(h), "XDG_CONFIG_HOME": str(h / ".config"),
           "CODEX_HOME": str(h / ".codex"), "LANG": "C.UTF-8", "NO_COLOR": "1", "CI": "1",
           "DISABLE_AUTOUPDATER": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
           "GEMINI_TELEMETRY_ENABLED": "false"}
    return {"home": str(h), "project": str(project), "env": env}


def client(npm_bin: str, home: dict, argv: list[str], timeout: float = 120, stdout_only: bool = False) -> str:
    """Run a client's command (argv[0] from the cached install) in the project folder; its output."""
    exe = os.path.join(npm_bin, argv[0])
    cp = subprocess.run([exe, *argv[1:]], cwd=home["project"], env=home["env"], capture_output=True, text=True,
                        timeout=timeout, stdin=subprocess.DEVNULL)
    assert cp.returncode == 0, (argv, cp.stdout, cp.stderr)
    return cp.stdout if stdout_only else cp.stdout + cp.stderr


def config(state: str, cwd: str, *args: str, exe: list[str] | None = None) -> dict:
    cp = subprocess.run([*(exe or [BIN]), "--state-dir", state, "mcp", "config", *args, "--json"], cwd=cwd,
                        capture_output=True, text=True, timeout=60, env={**os.environ, "AGNSUP_MCP_TOKEN": ""})
    assert cp.returncode == 0, cp.stderr
    return json.loads(cp.stdout)


def inspector(npm_bin: str, home: dict, state: str, *method: str) -> dict:
    out = client(npm_bin, home, ["mcp-inspector", "--cli", BIN, "--state-dir", state, "mcp", "--workdir",
                                 home["project"], *method])
    return json.loads(out[out.index("{"):out.rindex("}") + 1])


def test_the_inspector_cli_lists_the_tools_runs_a_command_and_gets_a_refusal(npm_bin, home, state):
    tools = {t["name"]: t for t in inspector(npm_bin, home, state, "--method", "tools/list")["tools"]}
    assert {"run_process", "run_shell", "spawn", "wait", "cancel"} <= set(tools)
    assert all(t.get("outputSchema", {}).get("type") == "object" for t in tools.values())  # every tool's result

    res = inspector(npm_bin, home, state, "--method", "tools/call", "--tool-name", "run_process",
                    "--tool-arg", 'argv=["sh","-c","echo from a cell; exit 3"]')
    v = res["structuredContent"]  # the Inspector's SDK checked it against run_process's outputSchema
    assert not res.get("isError") and (v["stdout"], v["exit_code"], v["state"]) == ("from a cell\n", 3, "exited")
    assert v["agent_id"] == "inspector-cli" and json.loads(res["content"][0]["text"]) == v

    res = inspector(npm_bin, home, state, "--method", "tools/call", "--tool-name", "run_shell",
                    "--tool-arg", "command=rm -rf /")
    v = json.loads(res["content"][0]["text"])
    assert res["isError"] is True and "structuredContent" not in res  # a refusal, not a result
    assert (v["error_type"], v["exit_code"]) == ("Denied", 126) and v["rule"].startswith("hardline.")


def _written(name: str, home: dict) -> dict:
    """The server entry each client wrote, from its own file: Claude's ~/.claude.json (scope local: under the
    project), Codex's $CODEX_HOME/config.toml, Gemini's project .gemini/settings.json."""
    if name == "claude":
        with open(os.path.join(home["home"], ".claude.json")) as f:
            return json.load(f)["projects"][home["project"]]["mcpServers"]["agnsup"]
    if name == "codex":
        with open(os.path.join(home["home"], ".codex", "config.toml"), "rb") as f:
            return tomllib.load(f)["mcp_servers"]["agnsup"]
    with open(os.path.join(home["project"], ".gemini", "settings.json")) as f:
        return json.load(f)["mcpServers"]["agnsup"]


def _trust(home: dict) -> None:
    """Gemini CLI starts no MCP server in an untrusted folder (mcp list: Disabled): the user trusts it."""
    os.makedirs(os.path.join(home["home"], ".gemini"), exist_ok=True)
    with open(os.path.join(home["home"], ".gemini", "trustedFolders.json"), "w") as f:
        json.dump({home["project"]: "TRUST_FOLDER"}, f)


@pytest.mark.parametrize("name", ["claude", "codex", "gemini"])
def test_each_clients_mcp_add_with_the_printed_line_names_our_absolute_command(npm_bin, home, state, name):
    reg = config(state, home["project"], name, "--role", "readonly")
    assert reg["argv"][:3] == [name, "mcp", "add"] and reg["command"] == BIN
    client(npm_bin, home, reg["argv"])
    entry = _written(name, home)
    assert entry["command"] == BIN and os.path.isabs(entry["command"])
    assert entry["args"] == ["--state-dir", state, "mcp", "--role", "readonly", "--workdir", home["project"]]
    if name == "claude":  # its health check starts the server and speaks MCP to it
        assert "agnsup: " + BIN in (out := client(npm_bin, home, ["claude", "mcp", "list"])) and "Connected" in out
    elif name == "gemini":
        assert "Disabled" in client(npm_bin, home, ["gemini", "mcp", "list"])  # an untrusted folder
        _trust(home)
        assert "Connected" in client(npm_bin, home, ["gemini", "mcp", "list"])
    else:
        got = json.loads(client(npm_bin, home, ["codex", "mcp", "get", "agnsup", "--json"], stdout_only=True))
        assert got["enabled"] and got["transport"]["command"] == BIN  # codex reads back what it wrote


def test_python_m_agnsup_is_what_gets_registered_when_run_that_way(npm_bin, home, state):
    reg = config(state, home["project"], "codex", exe=[sys.executable, "-m", "agnsup"])
    client(npm_bin, home, reg["argv"])
    entry = _written("codex", home)
    assert (entry["command"], entry["args"][:2]) == (sys.executable, ["-m", "agnsup"])
    cp = subprocess.run([entry["command"], *entry["args"][:2], "--version"], capture_output=True, text=True,
                        env={"PATH": "/usr/bin:/bin"}, timeout=60)  # it runs without the venv on PATH
    assert cp.returncode == 0 and "agnsup" in cp.stdout


def test_a_project_mcp_json_waits_for_claude_codes_approval_then_connects(npm_bin, home, state):
    reg = config(state, home["project"], "json")
    with open(os.path.join(home["project"], ".mcp.json"), "w") as f:
        json.dump(reg["snippet"], f)
    assert "Pending approval" in client(npm_bin, home, ["claude", "mcp", "list"])
    # the approval a person gives at claude's first start, as its settings keep it
    os.makedirs(os.path.join(home["project"], ".claude"))
    with open(os.path.join(home["project"], ".claude", "settings.local.json"), "w") as f:
        json.dump({"enabledMcpjsonServers": ["agnsup"]}, f)
    assert "Connected" in client(npm_bin, home, ["claude", "mcp", "list"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_http_registration_connects_with_the_header_and_with_the_token_in_the_url(npm_bin, home, state, agnsup):
    reg = config(state, home["project"], "http", "--http", f"127.0.0.1:{_free_port()}")
    server = agnsup.popen(*reg["args"], env={"AGNSUP_MCP_TOKEN": reg["token"]}, stdout=-1)
    try:
        ready = json.loads(server.stdout.readline())
        assert ready["url"] == reg["url"] and "token" not in ready  # the token was the user's, not printed
        client(npm_bin, home, reg["argv"])  # claude mcp add --transport http agnsup URL --header ...
        assert "Connected" in client(npm_bin, home, ["claude", "mcp", "list"])
        # a client that cannot send headers: the URL with the token
        _trust(home)
        client(npm_bin, home, ["gemini", "mcp", "add", "--transport", "http", "agnsup", reg["url_with_token"]])
        assert "Connected" in client(npm_bin, home, ["gemini", "mcp", "list"])
        with open(os.path.join(home["project"], ".gemini", "settings.json")) as f:
            entry = json.load(f)["mcpServers"]["agnsup"]
        entry["httpUrl"] = entry.get("httpUrl", entry.get("url")).split("?")[0]  # the same, without the token
        with open(os.path.join(home["project"], ".gemini", "settings.json"), "w") as f:
            json.dump({"mcpServers": {"agnsup": entry}}, f)
        assert "Connected" not in client(npm_bin, home, ["gemini", "mcp", "list"])
    finally:
        assert stop_server(server) == 0
        server.stdout.close()


def test_scripts_e2e_npm_is_cached(npm_bin):
    assert shutil.which("node") and os.path.isdir(npm_bin)
    cp = subprocess.run(["bash", os.path.join(REPO, "scripts", "e2e_npm")], capture_output=True, text=True,
                        timeout=60, stdin=subprocess.DEVNULL)
    assert cp.returncode == 0 and cp.stdout.strip() == npm_bin and "cached" in cp.stderr
