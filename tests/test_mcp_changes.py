"""The MCP tools `diff` and `undo` (issue 26), driven by the official MCP SDK's own client over
stdio: what a cell of the session changed, put back; a redo; the refusals as tool errors a model
can act on (a later cell named, nothing to undo, a spawned cell that ran live)."""
import os

import pytest

anyio = pytest.importorskip("anyio")
mcp = pytest.importorskip("mcp")
from test_mcp import session, value  # noqa: E402  (one MCP client session, one result reader)


def tree(root: str) -> dict:
    out = {}
    for d, dirs, files in os.walk(root):
        for n in dirs + files:
            p = os.path.join(d, n)
            st = os.lstat(p)
            body = None
            if os.path.islink(p):
                body = os.readlink(p)
            elif os.path.isfile(p):
                with open(p, "rb") as f:
                    body = f.read()
            out[os.path.relpath(p, root)] = (st.st_mode, body)
    return out


def test_diff_and_undo_tools_show_and_put_back_what_a_cell_changed(state, worktree):
    os.makedirs(os.path.join(worktree, "src"))
    for rel, text in (("src/a.py", "A = 1\n"), ("notes.txt", "keep me\n")):
        with open(os.path.join(worktree, rel), "w") as f:
            f.write(text)
    before = tree(worktree)

    async def main():
        async with session(state, worktree, "--run-id", "m1") as s:
            tools = {t.name: t for t in (await s.list_tools()).tools}
            assert {"diff", "undo"} <= set(tools)
            assert tools["diff"].annotations.read_only_hint and not tools["undo"].annotations.read_only_hint
            assert set(tools["undo"].input_schema["properties"]) == {"cell_id", "agent_id", "run", "force"}
            assert "redo" in tools["undo"].description and "ChangeConflict" in tools["undo"].description

            v = value(await s.call_tool("run_shell", {"command": "rm -rf src; echo more >> notes.txt; echo n > new"}))
            cell = v["cell_id"]
            assert v["exit_code"] == 0 and not os.path.exists(os.path.join(worktree, "src"))
            assert v["changes"]["record"] == f"m1/{cell}" and v["changes"]["deleted"] == 2  # the model sees it
            assert "not recorded" in tools["spawn"].description and "undo" in tools["run_shell"].description
            after = tree(worktree)

            d = value(await s.call_tool("diff", {"cell_id": cell}))
            changes = {e["path"]: e["change"] for e in d["entries"]}
            assert changes == {"src": "deleted", "src/a.py": "deleted", "notes.txt": "modified", "new": "created"}
            notes = next(e for e in d["entries"] if e["path"] == "notes.txt")
            assert "+more" in notes["diff"] and d["record"] == f"m1/{cell}"
            st = value(await s.call_tool("diff", {"cell_id": cell, "stat": True}))
            assert all("diff" not in e for e in st["entries"]) and notes["added"] == 1

            u = value(await s.call_tool("undo", {"cell_id": cell}))
            assert u["undone"] == [f"m1/{cell}"] and tree(worktree) == before
            undo_id = u["records"][0]["record"].split("/")[1]
            assert undo_id.startswith("undo-")

            res = await s.call_tool("undo", {"cell_id": cell})  # twice: a refusal as a value, naming the redo
            v = value(res)
            assert res.is_error and v["error_type"] == "NotReversible" and undo_id in v["error"]

            value(await s.call_tool("undo", {"cell_id": undo_id}))  # redo
            assert tree(worktree) == after

            # a later cell changed the same file: refused with its name, nothing touched; force overrides
            later = value(await s.call_tool("run_shell", {"command": "echo later >> notes.txt"}))["cell_id"]
            now = tree(worktree)
            res = await s.call_tool("undo", {"cell_id": cell})
            v = value(res)
            assert res.is_error and v["error_type"] == "ChangeConflict" and v["exit_code"] == 75
            assert later in v["error"] and "\n" not in v["error"] and tree(worktree) == now
            value(await s.call_tool("undo", {"run": True}))  # the whole session, newest first
            assert tree(worktree) == before

            idle = value(await s.call_tool("run_process", {"argv": ["true"]}))["cell_id"]
            for args, kind, says in (
                    ({"cell_id": idle}, "NotReversible", "changed nothing"),
                    ({"cell_id": "c-nothere"}, "UnknownId", "c-nothere"),
                    ({}, "UsageError", "exactly one of"),
                    ({"cell_id": idle, "run": True}, "UsageError", "exactly one of"),
                    ({"run": True}, "NotReversible", "nothing to undo"),
                    ({"agent_id": "nobody"}, "UnknownId", "no agent 'nobody'")):
                res = await s.call_tool("undo", args)
                v = value(res)
                assert res.is_error and v["error_type"] == kind and says in v["error"], (args, v)
            res = await s.call_tool("diff", {"cell_id": idle})
            assert res.is_error and value(res)["error_type"] == "NotReversible"
            assert tree(worktree) == before
    anyio.run(main)


def test_a_spawned_cell_runs_live_and_undo_says_so_while_an_agents_cells_undo_together(state, worktree):
    from conftest import Agnsup
    Agnsup(state)("run", "--workdir", worktree, "--run-id", "other", "--cell", "theirs", "--", "sh", "-c",
                  "echo theirs > theirs", check=0)

    async def main():
        async with session(state, worktree, "--run-id", "m2") as s:
            h = value(await s.call_tool("spawn", {"argv": ["sh", "-c", "echo served > live.txt"]}))
            w = value(await s.call_tool("wait", {"cell_id": h["cell_id"]}))
            assert w["exit_code"] == 0 and os.path.exists(os.path.join(worktree, "live.txt"))
            res = await s.call_tool("undo", {"cell_id": h["cell_id"]})
            v = value(res)
            assert res.is_error and v["error_type"] == "NotReversible" and "ran live" in v["error"]
            assert os.path.exists(os.path.join(worktree, "live.txt"))  # a long-lived cell's writes stay

            # another run's cell (the user's, another session's) is not this session's to see or undo
            for tool in ("diff", "undo"):
                res = await s.call_tool(tool, {"cell_id": "theirs"})
                assert res.is_error and value(res)["error_type"] == "UnknownId", value(res)
            assert os.path.exists(os.path.join(worktree, "theirs"))
            os.unlink(os.path.join(worktree, "theirs"))

            for agent, name in (("builder", "b1"), ("tester", "t1"), ("builder", "b2")):
                value(await s.call_tool("run_shell", {"command": f"echo {name} > {name}", "agent_id": agent}))
            u = value(await s.call_tool("undo", {"agent_id": "builder"}))
            assert len(u["undone"]) == 2 and u["undone"][0].endswith(u["records"][0]["undoes"])
            assert sorted(os.listdir(worktree)) == ["live.txt", "t1"]
    anyio.run(main)


def test_the_diff_tool_bounds_the_text_it_returns():
    """A cell that rewrote a large text file must not flood the model's context: 64 KiB of diff text
    in all, the entries cut marked."""
    from agnsup.doors.mcp.session import DIFF_TEXT_MAX, Session

    class Sup:
        def diff(self, cell_id, run_id, stat):
            return {"record": f"{run_id}/{cell_id}", "entries": [
                {"path": f"f{i}", "change": "modified", "diff": "+" + "x" * 40000 + "\n"} for i in range(3)]}
    d = Session(Sup(), "r", "executor", "/nonexistent").diff("c")
    texts = [e["diff"] for e in d["entries"]]
    assert sum(map(len, texts)) == DIFF_TEXT_MAX and d["truncated"]
    assert [bool(e.get("diff_truncated")) for e in d["entries"]] == [False, True, True]
