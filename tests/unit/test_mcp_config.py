"""`agnsup mcp config CLIENT`'s pure part: the command that starts this agnsup from anywhere, and each
client's line (tests/e2e/test_mcp_clients.py runs them with the real clients)."""
import json
import os
import shlex
import subprocess
import sys

import pytest

from agnsup.doors.mcp.config import CLIENTS, own_command, registration, server_args
from agnsup.errors import UsageError

CMD = ["/venv/bin/agnsup"]
ARGS = server_args("executor", "/src/app", "/var/lib/st", None)


def test_the_command_is_the_running_scripts_absolute_path_or_python_m_agnsup(tmp_path, monkeypatch):
    script = tmp_path / "bin" / "agnsup"
    script.parent.mkdir()
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    monkeypatch.chdir(tmp_path)
    assert own_command("bin/agnsup", "/venv/bin/python") == [str(script)]  # made absolute
    assert own_command("/site/agnsup/__main__.py", "/venv/bin/python") == ["/venv/bin/python", "-m", "agnsup"]
    # not a file one can start (an embedding, `-c`): the interpreter's -m form
    assert own_command("-c", "/venv/bin/python") == ["/venv/bin/python", "-m", "agnsup"]


def test_server_args_are_absolute_and_name_the_options_given(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert server_args("readonly", "wt", "st", "bob") == ["--state-dir", str(tmp_path / "st"), "mcp", "--role",
                                                          "readonly", "--workdir", str(tmp_path / "wt"),
                                                          "--agent", "bob"]


@pytest.mark.parametrize("client, line", [
    ("claude", "claude mcp add agnsup -- /venv/bin/agnsup --state-dir /var/lib/st mcp --role executor "
               "--workdir /src/app"),
    ("codex", "codex mcp add agnsup -- /venv/bin/agnsup --state-dir /var/lib/st mcp --role executor "
              "--workdir /src/app"),
    ("gemini", "gemini mcp add agnsup /venv/bin/agnsup -- --state-dir /var/lib/st mcp --role executor "
               "--workdir /src/app"),
])
def test_each_clients_one_line(client, line):
    reg = registration(client, CMD, ARGS)
    assert reg["lines"] == [line] and shlex.split(line) == reg["argv"]
    assert (reg["command"], reg["args"]) == ("/venv/bin/agnsup", ARGS)


def test_json_and_cursor_are_the_mcpservers_snippet():
    for client, file in (("json", ".mcp.json"), ("cursor", "~/.cursor/mcp.json")):
        reg = registration(client, CMD, ARGS, name="sup")
        assert reg["file"] == file and json.loads("\n".join(reg["lines"])) == reg["snippet"]
        assert reg["snippet"] == {"mcpServers": {"sup": {"command": "/venv/bin/agnsup", "args": ARGS}}}


def test_http_gives_the_server_line_the_header_form_and_the_url_with_the_token():
    reg = registration("http", CMD, ARGS, token="t0k", http="127.0.0.1:9000")
    assert reg["args"] == ["--state-dir", "/var/lib/st", "mcp", "--http", "127.0.0.1:9000", "--role", "executor",
                           "--workdir", "/src/app"]
    assert reg["lines"][0] == "AGNSUP_MCP_TOKEN=t0k /venv/bin/agnsup " + shlex.join(reg["args"])
    assert reg["argv"][-2:] == ["--header", "Authorization: Bearer t0k"]
    assert reg["url_with_token"] == "http://127.0.0.1:9000/mcp?token=t0k" == reg["lines"][2]
    made = registration("http", CMD, ARGS)["token"]  # none given: a new one, long enough to guess never
    assert len(made) >= 32 and made != registration("http", CMD, ARGS)["token"]


@pytest.mark.parametrize("client, name, says", [
    ("vscode", "agnsup", "unknown client 'vscode' (known: " + ", ".join(CLIENTS) + ")"),
    ("claude", "two words", "one word"),
])
def test_bad_input_is_one_usage_error(client, name, says):
    with pytest.raises(UsageError) as e:
        registration(client, CMD, ARGS, name=name)
    assert says in e.value.message and "\n" not in e.value.message


def test_the_cli_prints_the_line_and_refuses_an_unknown_client_in_one_line(tmp_path):
    agnsup = os.path.join(os.path.dirname(sys.executable), "agnsup")
    env = {**os.environ, "AGNSUP_STATE_DIR": str(tmp_path / "st")}
    cp = subprocess.run([agnsup, "mcp", "config", "codex", "--workdir", str(tmp_path)], env=env,
                        capture_output=True, text=True, timeout=60)
    assert cp.returncode == 0 and cp.stdout == shlex.join(
        ["codex", "mcp", "add", "agnsup", "--", agnsup, "--state-dir", str(tmp_path / "st"), "mcp", "--role",
         "executor", "--workdir", str(tmp_path)]) + "\n"
    cp = subprocess.run([sys.executable, "-m", "agnsup", "mcp", "config", "json", "--json"], env=env,
                        capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert cp.returncode == 0 and json.loads(cp.stdout)["command"] == sys.executable
    assert json.loads(cp.stdout)["args"][:2] == ["-m", "agnsup"]
    for argv, says in ((["mcp", "config", "vscode"], "agnsup: mcp config: unknown client 'vscode' (known: "),
                       (["mcp", "config", "claude", "--role", "nosuch"], "unknown role 'nosuch'"),
                       (["mcp", "config", "claude", "--workdir", str(tmp_path / "no")], "not a directory"),
                       (["mcp", "config", "http", "--http", "0.0.0.0:80"], "only a loopback address"),
                       (["mcp", "config", "http", "--http", "127.0.0.1:0"], "with a fixed port"),
                       (["mcp", "config", "http", "--http", "unix:/tmp/s"], "with a fixed port"),
                       (["mcp", "--role", "readonly", "config", "claude"], "--role: give it after `config`")):
        cp = subprocess.run([agnsup, *argv], env=env, capture_output=True, text=True, timeout=60)
        assert cp.returncode == 125 and says in cp.stderr and cp.stderr.count("\n") == 1, (argv, cp.stderr)
        assert cp.stdout == ""
    assert not os.path.exists(tmp_path / "st")  # nothing left behind
