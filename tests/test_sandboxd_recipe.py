"""docs/sandboxd.md's client recipe, run as written against a real `agnsup sandboxd` (only its two
port numbers changed), so the doc cannot rot; and what the recipe promises of sandboxd itself:
a command that runs into the client's deadline comes back with the output it wrote (exit 124),
and agnsup's REST process extension (start, status, output, signal) answers as documented."""
from __future__ import annotations

import json
import os
import re
import subprocess

import pytest

from conftest import REPO
from scenario import stop_server, wait_for

grpc = pytest.importorskip("grpc", reason="ENV_BLOCKED: grpcio is not installed (the k8s extra)")
pytest.importorskip("k8s_agent_sandbox", reason="ENV_BLOCKED: k8s-agent-sandbox is not installed (the test extra)")

RECIPE = re.compile(r"^```python\n# recipe: ([\w-]+)\n(.*?)^```$", re.S | re.M)
RECIPES = ["connect", "run", "timeout", "stream", "start-stop"]


def recipes() -> list[tuple[str, str]]:
    with open(os.path.join(REPO, "docs", "sandboxd.md")) as f:
        return RECIPE.findall(f.read())


@pytest.fixture
def server(agnsup, tmp_path, worktree):
    err_path = tmp_path / "sandboxd.err"
    with open(err_path, "wb") as err:
        proc = agnsup.popen("sandboxd", "--grpc", "127.0.0.1:0", "--rest", "127.0.0.1:0", "--workdir", worktree,
                            stdout=subprocess.PIPE, stderr=err)
    line = proc.stdout.readline()
    assert line, err_path.read_text()
    ready = json.loads(line)
    ready["grpc_port"] = int(ready["grpc"].rpartition(":")[2])
    ready["rest_port"] = int(ready["rest"].rpartition(":")[2])
    ready["url"] = "http://" + ready["rest"]
    yield ready
    stop_server(proc)
    proc.stdout.close()
    assert proc.returncode == 0, err_path.read_text()


def _messages():
    from agnsup.doors.sandboxd import proto
    return proto.messages()


def _execute(server, argv, deadline):
    """The standard's Execute with a deadline, through a stub built from agnsup's own descriptor."""
    pb = _messages()
    with grpc.insecure_channel(server["grpc"]) as ch:
        call = ch.unary_unary("/process.v1.ProcessService/Execute", request_serializer=pb.ExecuteRequest.SerializeToString,
                              response_deserializer=pb.ExecuteResponse.FromString)
        resp, c = call.with_call(pb.ExecuteRequest(config=pb.ProcessConfig(command=argv)), timeout=deadline)
        return resp, dict(c.trailing_metadata())


def test_the_docs_client_recipe_runs_as_written_with_the_client_packages_public_api(server, agnsup, worktree):
    found = recipes()
    assert [name for name, _ in found] == RECIPES, "docs/sandboxd.md's recipe blocks changed: update RECIPES"
    for name, code in found:
        assert not re.search(r"\b_\w*(stubs|proto)|k8s_agent_sandbox\.\w*\._|\._[a-z]", code), \
            f"recipe {name} uses a private name of the client package"
    ns: dict = {}
    for name, code in found:
        if name == "connect":
            assert "grpc_port=9090" in code and "rest_port=8080" in code
            code = code.replace("grpc_port=9090", f"grpc_port={server['grpc_port']}").replace(
                "rest_port=8080", f"rest_port={server['rest_port']}")
        exec(compile(code, f"docs/sandboxd.md recipe {name}", "exec"), ns)  # noqa: S102 - the doc's own code
    with open(os.path.join(worktree, "src", "greeting.txt")) as f:
        assert f.read() == "hello from a file\n"
    rows = {c["cell_id"]: c for c in agnsup.json("ps", "--all", "--run", "sandboxd", "--json")}
    assert [rows[c]["state"] for c in sorted(rows, key=lambda c: int(c[5:]))] == \
        ["exited", "timeout", "timeout", "exited", "killed"], rows  # the denial started nothing


def test_a_command_past_the_deadline_answers_with_its_output_and_124(server, agnsup):
    """Without the reply reserve the client's deadline strikes first: DEADLINE_EXCEEDED and no output."""
    resp, md = _execute(server, ["sh", "-c", "echo before; echo err >&2; sleep 60; echo after"], 4.0)
    assert (resp.exit_code, resp.stdout, resp.stderr) == (124, b"before\n", b"err\n")
    assert md["agnsup-state"] == "timeout" and md["agnsup-cell-id"] == "proc-1"
    with open(wait_for(lambda: os.path.exists(md["agnsup-receipt"]) and md["agnsup-receipt"], 60, "the receipt")) as f:
        assert json.load(f)["reason"] == "timeout"
    # a Start stream bound by a deadline gets its exit event too (its output came as it was written)
    pb = _messages()
    with grpc.insecure_channel(server["grpc"]) as ch:
        start = ch.unary_stream("/process.v1.ProcessService/Start", request_serializer=pb.StartRequest.SerializeToString,
                                response_deserializer=pb.StartResponse.FromString)
        events = list(start(pb.StartRequest(config=pb.ProcessConfig(command=["sh", "-c", "echo live; sleep 60"])),
                            timeout=4.0))
    assert [e.WhichOneof("event") for e in events] == ["init", "stdout", "exit"]
    assert events[1].stdout == b"live\n" and events[2].exit.exit_code == 124


def test_a_command_that_ignores_term_at_the_deadline_still_answers_with_its_output(server, agnsup):
    """It is in the role's grace (3 s) when the deadline comes: the answer carries what it wrote so far;
    the stop goes on and the cell ends `timeout`, not cancelled by the call's end."""
    resp, md = _execute(server, ["sh", "-c", "trap '' TERM; echo before; sleep 60"], 4.0)
    assert (resp.exit_code, resp.stdout) == (124, b"before\n")
    assert md["agnsup-state"] == "timeout"
    row = wait_for(lambda: [c for c in agnsup.json("ps", "--all", "--json")
                            if c["cell_id"] == md["agnsup-cell-id"] and c["state"] not in ("starting", "running")],
                   60, "the cell to end")[0]
    assert row["state"] == "timeout", row
    assert not os.path.exists(row["cgroup"].get("v2", "/nonexistent"))


def test_the_process_extension_refuses_bad_calls_in_one_answer_and_signals_through_grpc(server, agnsup):
    import requests
    url = server["url"] + "/v1/agnsup/processes"
    r = requests.post(url, json={"command": ["rm", "-rf", "/"]})
    assert r.status_code == 403 and r.json()["code"] == "PERMISSION_DENIED" and r.json()["rule"] == "hardline.rm_root"
    for body, words in (({"command": "echo hi"}, "command: must be a list"), ({"command": []}, "command is required"),
                        ({"command": ["true"], "shell": True}, "unknown field(s) shell"),
                        ({"command": ["true"], "cwd": "../.."}, "sandboxd.cwd_escape")):
        r = requests.post(url, json=body)
        assert r.status_code in (400, 403) and words in r.json()["message"], (body, r.text)
    assert requests.post(url, data=b"{not json").status_code == 400
    assert requests.get(url + "/4242").json()["code"] == "NOT_FOUND"
    assert requests.get(url + "/4242/output").status_code == 404
    assert requests.get(url).status_code == 405 and requests.post(url + "/1/output").status_code == 405
    assert requests.get(url + "/1/other").status_code == 404
    started = requests.post(url, json={"command": ["sh", "-c", "echo up; exec sleep 300"], "env_vars": {"A": "b"}})
    assert started.status_code == 201
    p = started.json()
    assert p["running"] is True and p["cell_id"] == f"proc-{p['process_id']}" and "exit_code" not in p
    assert requests.post(f"{url}/{p['process_id']}/signal", json={"signal": "SIGHUP"}).status_code == 400
    # the gRPC service finds it by the same process id while it runs
    pb = _messages()
    with grpc.insecure_channel(server["grpc"]) as ch:
        ch.unary_unary("/process.v1.ProcessService/SendSignal",
                       request_serializer=pb.SendSignalRequest.SerializeToString,
                       response_deserializer=pb.SendSignalResponse.FromString)(
            pb.SendSignalRequest(process_id=p["process_id"], signal=pb.Signal["SIGNAL_SIGKILL"]), timeout=30)
    with requests.get(f"{url}/{p['process_id']}/output", stream=True, timeout=60) as out:
        events = [json.loads(line) for line in out.iter_lines()]
    assert events[0] == {"stdout": "up\n"} and events[-1]["exit_code"] == 137 and events[-1]["state"] == "killed"
    # ended: its output is still there from its first byte, for a reader that comes late
    with requests.get(f"{url}/{p['process_id']}/output", stream=True, timeout=60) as out:
        assert [json.loads(line) for line in out.iter_lines()] == events
    assert requests.post(f"{url}/{p['process_id']}/signal", json={"signal": "SIGTERM"}).status_code == 204
