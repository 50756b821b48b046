"""The MCP front door's pure parts: tool schemas from the one cell request type,
argument checks that name the argument, agent ids from client names."""
import pytest

from agnsup.errors import UsageError
from agnsup.doors.mcp.session import agent_name
from agnsup.doors.mcp.tools import SCHEMAS, check_arguments
from agnsup.doors.mcp.command import parse_listen
from agnsup.request import CellRequest


def test_cell_tools_take_the_cell_requests_model_options_but_never_the_role():
    model_options = {k for k, o in CellRequest.options().items() if o.schema is not None} - {"role"}
    for name in ("run_process", "spawn"):
        props = SCHEMAS[name]["parameters"]["properties"]
        assert {"argv", "agent_id"} | model_options <= set(props) and "role" not in props
    shell = SCHEMAS["run_shell"]["parameters"]
    assert shell["required"] == ["command"] and "argv" not in shell["properties"]
    assert all(s["parameters"]["additionalProperties"] is False for s in SCHEMAS.values())


@pytest.mark.parametrize("name, args, says", [
    ("run_process", {"argv": ["ls"], "role": "networked"}, "unknown argument(s) role"),
    ("run_process", None, "argv is required"),
    ("run_process", [], "arguments must be an object"),
    ("run_process", {"argv": ["ls"], "timeout": True}, "timeout must be a number, not True"),
    ("wait", {"cell_id": 7}, "cell_id must be a string, not 7"),
    ("nope", {}, "unknown tool 'nope'"),
])
def test_bad_arguments_are_one_usage_error_naming_them(name, args, says):
    with pytest.raises(UsageError) as e:
        check_arguments(name, args)
    assert says in e.value.message and "\n" not in e.value.message


def test_a_shell_request_must_be_a_shell_line():
    assert CellRequest.make(["sh", "-c", "echo hi"], shell=True).shell is True
    with pytest.raises(UsageError, match="shell: argv must be"):
        CellRequest.make(["echo", "hi"], shell=True)


@pytest.mark.parametrize("client, agent", [("Claude Code", "claude-code"), ("codex-mcp-client", "codex-mcp-client"),
                                           ("", "mcp-client"), ("../..", "mcp-client"), ("é" * 80, "mcp-client")])
def test_agent_ids_come_from_client_names_in_the_id_alphabet(client, agent):
    assert agent_name(client) == agent


def test_http_listens_on_loopback_or_a_unix_socket_only():
    assert parse_listen("127.0.0.1:0") == ("127.0.0.1", 0)
    assert parse_listen("[::1]:8765") == ("::1", 8765)
    assert parse_listen("unix:/run/a.sock") == ("unix", "/run/a.sock")
    for bad, says in (("0.0.0.0:80", "only a loopback"), ("10.0.0.1:80", "only a loopback"),
                      ("localhost", "HOST:PORT"), ("127.0.0.1:99999", "HOST:PORT"), ("unix:", "path is missing")):
        with pytest.raises(UsageError, match=says):
            parse_listen(bad)


def test_every_tool_declares_an_object_output_schema_its_results_validate_against():
    jsonschema = pytest.importorskip("jsonschema")
    from agnsup.doors.mcp.tools import OUTPUT_SCHEMAS
    assert set(OUTPUT_SCHEMAS) == set(SCHEMAS)  # a new tool needs its outputSchema too
    for name, schema in OUTPUT_SCHEMAS.items():
        jsonschema.Draft202012Validator.check_schema(schema)
        assert schema["type"] == "object", name  # MCP: an outputSchema's root is an object
    ran = {"run_id": "r", "agent_id": "a", "cell_id": "c-1", "exit_code": 0, "state": "exited", "reason": "exited",
           "receipt": "/s/receipt.json", "stdout": "hi\n", "stdout_truncated": False, "stderr": "",
           "stderr_truncated": False, "changes": {"mode": "none"}, "network_refused": [{"host": "pypi.org", "port": 443, "rule": "address:private",
                                                           "allow_key": "network.allow_private"}], "later": 1}
    for name, value in (("run_process", ran), ("wait", {"run_id": "r", "cell_id": "c-1", "pending": True}),
                        ("spawn", {"cell_id": "c-1", "run_id": "r", "agent_id": "a", "pid": None, "cgroup": None,
                                   "controller": "k", "state": "waiting"}),
                        ("read_output", {"chunks": [{"seq": 0, "stream": "tty", "text": "$ "}], "next": 1,
                                         "ended": False}),
                        ("receipt", {"cell_id": "c-1", "pending": True}),
                        ("cancel", {"cancelled": 0, "cells": []}), ("undo", {"undone": [], "records": []})):
        jsonschema.validate(value, OUTPUT_SCHEMAS[name])
    for name, value in (("run_process", {"exit_code": 0}), ("run_process", {**ran, "exit_code": "0"}),
                        ("spawn", {**ran, "state": "exited"}), ("run_process", {**ran, "network_refused": [{}]}),
                        ("signal", {"cell_id": "c-1", "sent": "HUP"})):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(value, OUTPUT_SCHEMAS[name])
