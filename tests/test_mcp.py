"""`agnsup mcp` driven by the official MCP SDK's own client over stdio: the tools
it lists, a command run, a denial, a timeout, a cancel from a second call, a
client that goes away mid-call, and bad arguments."""
import json
import os
import subprocess
import sys
from contextlib import asynccontextmanager

import pytest

anyio = pytest.importorskip("anyio")
mcp = pytest.importorskip("mcp")
jsonschema = pytest.importorskip("jsonschema")  # the SDK's own dependency (its client validates with it)
from mcp import ClientSession, StdioServerParameters, stdio_client  # noqa: E402
import mcp_types as types  # noqa: E402

from scenario import alive, stop_server, wait_for  # noqa: E402

BIN = os.path.join(os.path.dirname(sys.executable), "agnsup")


@asynccontextmanager
async def session(state, worktree, *args, client="Test Client", errlog=None, env=None):
    params = StdioServerParameters(command=BIN, args=["--state-dir", state, "mcp", "--workdir", worktree, *args],
                                   env={"AGNSUP_STATE_DIR": state, **(env or {})})
    with open(errlog or os.devnull, "w") as err:
        async with stdio_client(params, errlog=err) as (read, write):
            async with ClientSession(read, write, client_info=types.Implementation(name=client, version="1")) as s:
                await s.initialize()
                yield s


def value(res) -> dict:
    """A tool result's JSON (the text content; structured content says the same, a refusal has none)."""
    v = json.loads(res.content[0].text)
    assert res.structured_content == (None if res.is_error else v)
    return v


async def cells(s, all_=False) -> list[dict]:
    return value(await s.call_tool("ps", {"all": all_}))["cells"]


def test_tools_run_deny_time_out_and_refuse_bad_arguments_as_tool_errors(state, worktree):
    async def main():
        async with session(state, worktree, "--run-id", "r1") as s:
            tools = {t.name: t for t in (await s.list_tools()).tools}
            assert set(tools) == {"run_process", "run_shell", "spawn", "read_output", "write_stdin", "resize",
                                  "signal", "wait", "cancel", "ps", "receipt", "diff", "undo", "publish_port",
                                  "list_ports"}
            props = tools["run_process"].input_schema["properties"]
            assert "argv" in props and "timeout" in props and "role" not in props  # the role is the server's
            assert tools["ps"].annotations.read_only_hint and not tools["run_shell"].annotations.read_only_hint
            # every tool declares what it returns; the SDK client checks each result's structured content
            # against it (ClientSession.validate_tool_result), and so does this test, explicitly, below
            assert all(t.output_schema and t.output_schema["type"] == "object" for t in tools.values()), tools

            notes = []

            async def on_progress(progress, total, message):
                notes.append(message)
            res = await s.call_tool("run_process", {"argv": ["sh", "-c", "echo out; echo err >&2; exit 3"]},
                                    progress_callback=on_progress)
            v = value(res)
            assert not res.is_error and v["exit_code"] == 3 and v["state"] == "exited"
            jsonschema.validate(res.structured_content, tools["run_process"].output_schema)
            assert (v["stdout"], v["stderr"]) == ("out\n", "err\n")
            assert (v["run_id"], v["agent_id"]) == ("r1", "test-client")  # the session's run, the client's name
            assert any(v["cell_id"] in n and "started" in n for n in notes), notes
            assert value(await s.call_tool("receipt", {"cell_id": v["cell_id"]}))["exit_code"] == 3

            # The cell holds none of the server's descriptors: above all not the protocol's pipes.
            v = value(await s.call_tool("run_process", {"argv": ["ls", "/proc/self/fd"]}))
            assert v["stdout"].split() == ["0", "1", "2", "3"]  # 3: ls's own directory

            v = value(await s.call_tool("run_shell", {"command": "echo a | tr a b > f && cat f"}))
            assert v["stdout"] == "b\n"
            chain = value(await s.call_tool("receipt", {"cell_id": v["cell_id"]}))["chain"]
            assert (chain[0]["tool"], chain[0]["entry"]) == ("run_shell", "mcp")  # judged as the shell line
            with open(os.path.join(worktree, "f")) as f:
                assert f.read() == "b\n"

            res = await s.call_tool("run_shell", {"command": "rm -rf /"})
            v = value(res)
            assert res.is_error and v["error_type"] == "Denied" and v["exit_code"] == 126
            assert v["rule"].startswith("hardline.") and v["reason"] and "hint" in v

            notes.clear()
            v = value(await s.call_tool("run_process", {"argv": ["sleep", "30"], "timeout": 1.5},
                                        progress_callback=on_progress))
            assert (v["state"], v["exit_code"]) == ("timeout", 124)
            assert any("running for" in n for n in notes), notes  # a long call says it is still going

            for name, args, says in (
                    ("run_process", {"argv": "ls"}, "argv must be an array"),
                    ("run_process", {}, "argv is required"),
                    ("run_process", {"argv": ["ls"], "role": "networked"}, "unknown argument(s) role"),
                    ("run_process", {"argv": ["ls"], "timeout": -1}, "timeout: must be a number of seconds > 0"),
                    ("run_process", {"argv": ["ls"], "workdir": "/"}, "outside this server's workdir"),
                    ("run_process", {"argv": ["no-such-command-x"]}, "not found"),
                    ("wait", {"cell_id": "c-nothere"}, "no cell 'c-nothere'"),
                    ("cancel", {}, "exactly one of"),
                    ("teleport", {}, "unknown tool 'teleport'")):
                res = await s.call_tool(name, args)
                v = value(res)
                assert res.is_error and says in v["error"] and "Traceback" not in v["error"], (name, args, v)
                assert "\n" not in v["error"]
            assert await cells(s) == []
    anyio.run(main)


def test_a_second_call_cancels_a_running_cell_and_spawn_wait_ps_agree(state, worktree):
    async def main():
        async with session(state, worktree, "--run-id", "r2") as s:
            results = []

            async def long_call():
                results.append(value(await s.call_tool("run_process", {"argv": ["sleep", "300"]})))
            async with anyio.create_task_group() as tg:
                tg.start_soon(long_call)
                with anyio.fail_after(60):
                    while not (running := [c for c in await cells(s) if c["state"] == "running"]):
                        await anyio.sleep(0.05)
                v = value(await s.call_tool("cancel", {"cell_id": running[0]["cell_id"]}))
                assert v["cancelled"] == 1
            assert results[0]["state"] == "cancelled" and results[0]["cell_id"] == running[0]["cell_id"]

            # A request the client gives up on (notifications/cancelled) at any moment, before,
            # during or after its cell's spawn, leaves no cell running.
            for delay in (0, 0.01, 0.02, 0.04, 0.08, 0.16):
                with anyio.move_on_after(delay):
                    await s.call_tool("run_process", {"argv": ["sleep", "300"]})
            with anyio.fail_after(60):
                while await cells(s):
                    await anyio.sleep(0.05)

            h = value(await s.call_tool("spawn", {"argv": ["sh", "-c", "sleep 0.2; echo done"],
                                                  "agent_id": "helper"}))
            assert h["agent_id"] == "helper" and h["pid"] > 0
            v = value(await s.call_tool("wait", {"cell_id": h["cell_id"]}))
            assert v["exit_code"] == 0 and v["stdout"] == "done\n"
            assert {running[0]["cell_id"], h["cell_id"]} <= {c["cell_id"] for c in await cells(s, all_=True)}

            h = value(await s.call_tool("spawn", {"argv": ["sleep", "300"]}))
            assert value(await s.call_tool("wait", {"cell_id": h["cell_id"], "timeout": 0.1}))["pending"] is True
            with anyio.move_on_after(0.2):  # giving up on a wait leaves the spawned cell alone
                await s.call_tool("wait", {"cell_id": h["cell_id"]})
            assert value(await s.call_tool("wait", {"cell_id": h["cell_id"], "timeout": 0.3}))["pending"] is True
            assert value(await s.call_tool("cancel", {"run": True}))["cancelled"] == 1
            res = await s.call_tool("run_process", {"argv": ["true"]})
            assert res.is_error and value(res)["error_type"] == "RunNotActive"
    anyio.run(main)


async def read_all(s, cell_id) -> tuple[dict, list[dict]]:
    """read_output until ended: (the last answer, every chunk in order)."""
    chunks, since = [], 0
    with anyio.fail_after(60):
        while True:
            v = value(await s.call_tool("read_output", {"cell_id": cell_id, "since": since}))
            chunks += v["chunks"]
            assert [c["seq"] for c in chunks] == list(range(len(chunks)))  # incremental, nothing twice
            since = v["next"]
            if v["ended"]:
                return v, chunks


def test_live_io_stdin_then_incremental_output_a_pty_and_a_signal(state, worktree):
    async def main():
        async with session(state, worktree) as s:
            h = value(await s.call_tool("spawn", {"argv": ["sh", "-c", "echo ready; read x; echo got $x; "
                                                          "echo oops >&2; exit 4"], "stdin": True}))
            first = value(await s.call_tool("read_output", {"cell_id": h["cell_id"], "timeout": 30}))
            assert first["chunks"][0] == {"seq": 0, "stream": "stdout", "text": "ready\n"}
            v = value(await s.call_tool("write_stdin", {"cell_id": h["cell_id"], "text": "hi\n", "eof": True}))
            assert v["written"] == 3
            last, chunks = await read_all(s, h["cell_id"])
            assert "".join(c["text"] for c in chunks if c["stream"] == "stdout") == "ready\ngot hi\n"
            assert [c["text"] for c in chunks if c["stream"] == "stderr"] == ["oops\n"]
            assert (last["exit_code"], last["state"]) == (4, "exited")
            res = await s.call_tool("write_stdin", {"cell_id": h["cell_id"], "text": "late"})
            assert res.is_error and value(res)["error_type"] == "UsageError"

            h = value(await s.call_tool("spawn", {"argv": ["sh", "-c", "stty size; read x; stty size"],
                                                  "pty": {"cols": 91, "rows": 7}, "stdin": True}))
            assert value(await s.call_tool("read_output", {"cell_id": h["cell_id"], "timeout": 30}))["chunks"]
            assert value(await s.call_tool("resize", {"cell_id": h["cell_id"], "cols": 100, "rows": 30}))
            await s.call_tool("write_stdin", {"cell_id": h["cell_id"], "text": "\n"})
            _, chunks = await read_all(s, h["cell_id"])
            assert {c["stream"] for c in chunks} == {"tty"}
            assert "".join(c["text"] for c in chunks) == "7 91\r\n\r\n30 100\r\n"  # the middle: the echoed line

            h = value(await s.call_tool("spawn", {"argv": ["sleep", "300"]}))
            assert value(await s.call_tool("signal", {"cell_id": h["cell_id"], "sig": "INT"}))["sent"] == "INT"
            v = value(await s.call_tool("wait", {"cell_id": h["cell_id"]}))
            assert (v["state"], v["exit_code"]) == ("killed", 130)
            res = await s.call_tool("signal", {"cell_id": h["cell_id"], "sig": "HUP"})
            assert res.is_error and "HUP" in value(res)["error"]
    anyio.run(main)


def test_a_redacting_role_redacts_live_output_as_it_redacts_results(state, worktree, policy_dir):
    from conftest import write_role
    write_role(policy_dir, "redacting", governance__redact='["key_formats"]')
    token = "ghp_" + "a1B2c3D4e5F6g7H8i9J0k1L2m3N4o5P6q7R8"

    async def main():
        async with session(state, worktree, "--role", "redacting", env={"AGNSUP_POLICY_DIR": str(policy_dir)}) as s:
            assert token not in value(await s.call_tool("run_process", {"argv": ["echo", token]}))["stdout"]
            h = value(await s.call_tool("spawn", {"argv": ["echo", "token", token]}))
            _, chunks = await read_all(s, h["cell_id"])
            assert "".join(c["text"] for c in chunks) == "token [REDACTED:redact.github_token]\n"
    anyio.run(main)


def test_a_client_that_goes_away_mid_call_leaves_nothing_running(agnsup, state, worktree, tmp_path):
    errlog = str(tmp_path / "mcp.err")
    seen = {}

    async def main():
        async with session(state, worktree, "--run-id", "r3", errlog=errlog) as s:
            async with anyio.create_task_group() as tg:
                tg.start_soon(s.call_tool, "run_shell", {"command": "sleep 300 & sleep 300; wait"})
                with anyio.fail_after(60):
                    while not (running := [c for c in await cells(s) if c["state"] == "running"]):
                        await anyio.sleep(0.05)
                seen.update(running[0])
                tg.cancel_scope.cancel()  # leave the call pending, then the session: stdin closes
    anyio.run(main)
    with open(errlog) as f:
        ready = json.loads(f.readline())
    wait_for(lambda: not os.path.exists(f"/proc/{ready['pid']}"), what="the mcp server to exit")
    assert not alive(seen["pid"], seen["starttime"])
    [receipt] = agnsup.json("receipts", "--run", "r3", "--json")  # written by the server itself
    assert receipt["state"] == "cancelled" and receipt["cell_id"] == seen["cell_id"]
    assert agnsup.json("ps", "--json") == []  # and the state fixture checks no cgroup or process is left


def test_an_unknown_role_or_a_missing_workdir_fails_before_serving(agnsup, worktree):
    assert "unknown role 'nope'" in agnsup("mcp", "--role", "nope", "--workdir", worktree, check=125).err
    assert "not a directory" in agnsup("mcp", "--workdir", os.path.join(worktree, "nope"), check=125).err
    assert "invalid run id" in agnsup("mcp", "--run-id", "../x", "--workdir", worktree, check=125).err
    assert "only a loopback address" in agnsup("mcp", "--http", "0.0.0.0:8765", "--workdir", worktree,
                                               check=125).err


VANISHING_CLIENT = """
import sys, anyio, httpx2
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client
async def main():
    async with httpx2.AsyncClient(transport=httpx2.AsyncHTTPTransport(uds=sys.argv[1])) as client:
        async with streamable_http_client(sys.argv[2], http_client=client) as rw:
            async with ClientSession(*rw) as s:
                await s.initialize()
                await s.call_tool("run_process", {"argv": ["sleep", "301"]})
anyio.run(main)
"""


def test_streamable_http_on_a_loopback_port_wants_the_token_and_on_a_unix_socket_is_private(agnsup, state,
                                                                                          worktree, tmp_path):
    import httpx2
    from mcp.client.streamable_http import streamable_http_client
    sock = str(tmp_path / "mcp.sock")

    async def call(url, client, tool, args):
        async with client, streamable_http_client(url, http_client=client) as (read, write):
            async with ClientSession(read, write) as s:
                await s.initialize()
                return value(await s.call_tool(tool, args))  # then the client DELETEs its session

    servers = [agnsup.popen("mcp", "--workdir", worktree, "--http", "127.0.0.1:0", stdout=-1),
               agnsup.popen("mcp", "--workdir", worktree, "--run-id", "web", "--http", f"unix:{sock}", stdout=-1)]
    try:
        tcp, unix = (json.loads(p.stdout.readline()) for p in servers)
        assert unix["socket"] == sock and oct(os.stat(sock).st_mode & 0o777) == "0o600"
        assert (tcp["run_id"], unix["run_id"]) == (None, "web")

        async def main():
            authorized = {"Authorization": f"Bearer {tcp['token']}"}
            runs = {(await call(tcp["url"], httpx2.AsyncClient(headers=authorized), "run_process",
                                {"argv": ["echo", "over tcp"]}))["run_id"] for _ in range(2)}
            assert len(runs) == 2 and all(r.startswith("mcp-") for r in runs)  # a run per HTTP session
            async with httpx2.AsyncClient() as anonymous:
                assert (await anonymous.post(tcp["url"], json={})).status_code == 401
                for wrong in ("x", tcp["token"][:-1], f"{tcp['token']}&token=x"):  # a near miss, a second token
                    assert (await anonymous.post(f"{tcp['url']}?token={wrong}", json={})).status_code == 401
            # a client that cannot send headers: the ready line's URL carries the token in its query
            assert tcp["url_with_token"] == f"{tcp['url']}?token={tcp['token']}"
            v = await call(tcp["url_with_token"], httpx2.AsyncClient(), "run_process", {"argv": ["echo", "by url"]})
            assert v["stdout"] == "by url\n"
            over_unix = lambda: httpx2.AsyncClient(transport=httpx2.AsyncHTTPTransport(uds=sock))  # noqa: E731
            ended = await call(unix["url"], over_unix(), "spawn", {"argv": ["sleep", "300"]})
            kept = None
            async with over_unix() as client:
                async with streamable_http_client(unix["url"], http_client=client, terminate_on_close=False) as rw:
                    async with ClientSession(*rw) as s:
                        await s.initialize()
                        kept = value(await s.call_tool("spawn", {"argv": ["sleep", "300"]}))
            return ended, kept
        ended, kept = anyio.run(main)
        # The session that ended (DELETE) took its cell with it; the one still open keeps its own.
        wait_for(lambda: [c["cell_id"] for c in agnsup.json("ps", "--run", "web", "--json")] == [kept["cell_id"]],
                 what="the ended session's cell to be cancelled")
    finally:
        codes = [stop_server(p) for p in servers]  # SIGTERM: the server cancels its live cells, then exits 0
        for p in servers:
            p.stdout.close()
    assert codes == [0, 0] and not os.path.exists(sock)
    receipts = {r["cell_id"]: r for r in agnsup.json("receipts", "--run", "web", "--json")}
    assert receipts[ended["cell_id"]]["state"] == receipts[kept["cell_id"]]["state"] == "cancelled"


def test_an_http_client_that_dies_mid_call_has_its_cell_cancelled(agnsup, worktree, tmp_path):
    """No DELETE, no cancel notification: the server hears the call's response stream hang up."""
    sock = str(tmp_path / "mcp.sock")
    server = agnsup.popen("mcp", "--workdir", worktree, "--run-id", "gone", "--http", f"unix:{sock}", stdout=-1)
    try:
        ready = json.loads(server.stdout.readline())
        client = subprocess.Popen([sys.executable, "-c", VANISHING_CLIENT, sock, ready["url"]])
        try:
            wait_for(lambda: agnsup.json("ps", "--run", "gone", "--json"), what="the dying client's cell to run")
        finally:
            client.kill()
            client.wait()
        wait_for(lambda: agnsup.json("receipts", "--run", "gone", "--json"), what="the cell to be cancelled")
        [receipt] = agnsup.json("receipts", "--run", "gone", "--json")
        assert receipt["state"] == "cancelled" and agnsup.json("ps", "--run", "gone", "--json") == []
    finally:
        assert stop_server(server) == 0
        server.stdout.close()
