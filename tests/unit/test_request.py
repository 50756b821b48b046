"""One cell request type: every front door spells the options from it, and it checks them first."""
import pytest

from agnsup.doors import entry
from agnsup import tool
from agnsup.errors import UsageError
from agnsup.request import CellRequest


def test_the_tool_schema_is_generated_from_the_request_type():
    props = tool.RUN_PROCESS_SCHEMA["parameters"]["properties"]
    exposed = {k for k, o in CellRequest.options().items() if o.schema is not None}
    assert set(props) == {"argv"} | exposed
    assert set(props) <= {"argv"} | set(CellRequest.options())


def test_the_cli_and_its_fast_parser_take_exactly_the_request_options():
    from agnsup.doors import cli
    flagged = {k for k, o in CellRequest.options().items() if o.flags}
    for command in ("run", "spawn"):
        params = {p.name for p in cli.main.commands[command].params} - {"command", "socket_path", "follow", "state_dir"}
        assert params == flagged, command
    flags, defaults = entry._run_options()
    assert set(defaults) == flagged and {k for k, _ in flags.values()} == flagged
    assert flags["--run"] == flags["--run-id"] and flags["--agent-id"] == flags["--agent"]


def test_the_serve_protocol_takes_the_request_options():
    req = {"argv": ["true"], **{k: o.default for k, o in CellRequest.options().items()}}
    assert CellRequest.make(req.pop("argv"), **req).role == "executor"


@pytest.mark.parametrize("argv, options, fragment", [
    ("sh", {}, "argv: must be a non-empty list of strings"),
    ([], {}, "argv: must be a non-empty list"),
    (["ls", 3], {}, "argv: must be a non-empty list of strings"),
    (["true"], {"timeout": "5"}, "timeout: must be a number of seconds > 0, not '5'"),
    (["true"], {"timeout": -1}, "timeout: must be a number of seconds > 0"),
    (["true"], {"timeout": True}, "timeout: must be a number"),
    (["true"], {"lock_timeout": -0.5}, "lock_timeout: must be a number of seconds >= 0"),
    (["true"], {"env": ["A=1", 2]}, "env: must be an object of strings"),
    (["true"], {"env": {"A": 1}}, "env: must be an object of strings"),
    (["true"], {"role": ""}, "role: must be a non-empty string"),
    (["true"], {"color": "red"}, "unknown option(s): color"),
    (["true"], {"pty": {"cols": 80}}, 'pty: must be null or {"cols": N, "rows": N}'),
    (["true"], {"pty": {"cols": 80, "rows": 0}}, "pty: must be"),
    (["true"], {"pty": {"cols": True, "rows": 24}}, "pty: must be"),
    (["true"], {"stdin": "yes"}, "stdin: must be true or false"),
])
def test_a_bad_option_is_one_clear_error_naming_it(argv, options, fragment):
    with pytest.raises(UsageError) as e:
        CellRequest.make(argv, **options)
    assert fragment in e.value.message


def test_stream_and_pty_imply_capture():
    assert CellRequest.make(["true"], capture=False, stream=True).capture is True
    r = CellRequest.make(["true"], capture=False, pty={"cols": 80, "rows": 24})
    assert r.capture is True and r.live
    assert not CellRequest.make(["true"], capture=False, stdin=True).capture


def test_none_means_the_default_and_an_env_object_becomes_key_value_items():
    r = CellRequest.make(["true"], role=None, env={"A": "1", "B": "x=y"}, timeout=2)
    assert r.role == "executor" and r.env == ["A=1", "B=x=y"] and r.timeout == 2


@pytest.mark.parametrize("arguments, fragment", [
    ('{"argv": ["true"], "timeout": "5"}', "timeout: must be a number"),
    ("not json", "arguments are not valid JSON"),
    (None, "arguments must be a JSON object, not NoneType"),
    ({"argv": "sh"}, "argv: must be a non-empty list"),
    ({"cmd": ["ls"]}, "unknown argument(s): cmd"),
    ({}, "argv: required"),
])
def test_a_tool_call_with_bad_arguments_is_an_error_value_before_anything_starts(arguments, fragment, tmp_path):
    state = tmp_path / "state"
    out = tool.handle_tool_call("run_process", arguments, state_dir=str(state))
    assert fragment in out["error"] and out["exit_code"] == 125 and out["error_type"] == "UsageError"
    assert not state.exists()  # refused before a state root, a journal or a lock existed
