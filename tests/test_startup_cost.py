"""`agnsup run -- true` imports nothing heavy (issue 2, Speed).

A real `agnsup run` (real cell: cgroups, namespaces, journal, receipt) in a
fresh interpreter, through the console script's own entry point; at exit the
interpreter writes which modules it imported. Each module named here costs
more than bwrap needs to start a whole sandbox (or pulls in such a module),
and the run path needs none of them when the policy cache is warm.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HEAVY = ("click", "pydantic", "pydantic_core", "dataclasses", "inspect", "ast", "dis", "shutil", "tree_sitter",
         "tree_sitter_bash", "pyroute2", "psutil", "secrets", "random", "hmac", "typing", "tomllib",
         "importlib.resources", "importlib.metadata", "socket", "tempfile", "bz2", "lzma", "datetime",
         "sqlite3.dbapi2", "mcp", "mcp_types", "anyio", "starlette", "uvicorn",
         # issue 29: what an argv call of a role without network lists never needs: URL, address and Unicode host
         # parsing (netpolicy loads them on first use: util/lazy.py), git's rules, the inline-program scan, the
         # proxy's matcher (gate/checker.py loads each for a call that has something for it)
         "ipaddress", "urllib.parse", "unicodedata", "agnsup.gate.git", "agnsup.gate.inline", "agnsup.gate.egress",
         # hashlib loads libcrypto (~4 ms): the run path's digests come from util/digest.py (CPython's _sha256)
         "hashlib", "_hashlib")

# The console script's own entry point, under -X importtime: every module the
# interpreter imports is listed on stderr as it happens (the CLI leaves with
# os._exit, so no exit hook could list them).
RUN = "import sys; sys.argv = ['agnsup', *sys.argv[1:]]; from agnsup.doors.entry import main; main()"


def _at_start() -> set[str]:
    """What the interpreter itself imports before any agnsup code (site, an editable install's finder: pathlib,
    urllib.parse...): not the run path's doing."""
    cp = subprocess.run([sys.executable, "-X", "importtime", "-c", "pass"], capture_output=True, timeout=60)
    return {line.rpartition("|")[2].strip() for line in cp.stderr.decode(errors="replace").splitlines()
            if line.startswith("import time:")}


def _heavy(mods: set[str]) -> list[str]:
    start = _at_start()
    return sorted(m for m in mods - start
                  if m in HEAVY or m.split(".")[0] in ("click", "pydantic", "tree_sitter", "mcp", "anyio"))


def _run_and_list_modules(state, worktree, tmp_path, *args, entry=("-c", RUN)):
    env = {**os.environ, "AGNSUP_STATE_DIR": state}
    cp = subprocess.run([sys.executable, "-X", "importtime", *entry, *args], cwd=worktree, env=env,
                        capture_output=True, timeout=120, stdin=subprocess.DEVNULL)
    err = cp.stderr.decode(errors="replace")
    assert cp.returncode == 0, err
    mods = {line.rpartition("|")[2].strip() for line in err.splitlines() if line.startswith("import time:")}
    assert "agnsup.doors.entry" in mods, err
    return mods


@pytest.mark.parametrize("role", ["executor", "networked", "readonly"])
def test_run_true_imports_nothing_heavy(state, worktree, tmp_path, role):
    _run_and_list_modules(state, worktree, tmp_path, "run", "--role", role, "--", "true")  # warms the policy cache
    mods = _run_and_list_modules(state, worktree, tmp_path, "run", "--role", role, "--", "true")
    assert "agnsup.process.leader" in mods and "agnsup.store.journal" in mods  # it did run the cell path
    heavy = _heavy(mods)
    assert heavy == [], f"the run path imported {heavy}"


def test_python_m_agnsup_takes_the_same_fast_path(state, worktree, tmp_path):
    """`python -m agnsup` (agnsup/__main__.py: what an MCP client's config may name) is the console script."""
    _run_and_list_modules(state, worktree, tmp_path, "run", "--", "true", entry=("-m", "agnsup"))
    mods = _run_and_list_modules(state, worktree, tmp_path, "run", "--", "true", entry=("-m", "agnsup"))
    assert "agnsup.process.leader" in mods
    heavy = _heavy(mods)
    assert heavy == [], f"python -m agnsup run imported {heavy}"


def test_the_check_sees_a_heavy_import(state, worktree, tmp_path):
    """The same harness on a path that does import click (`agnsup ps`): the list is real."""
    mods = _run_and_list_modules(state, worktree, tmp_path, "ps", "--json")
    assert "click" in mods


def test_the_cell_was_recorded(state, worktree, tmp_path):
    """The fast path still journals the cell and writes its receipt."""
    _run_and_list_modules(state, worktree, tmp_path, "run", "--cell", "fast", "--", "true")
    with open(os.path.join(state, "cells", "default", "fast", "receipt.json")) as f:
        receipt = json.load(f)
    assert receipt["state"] == "exited" and receipt["exit_code"] == 0
    assert [s["stage"] for s in receipt["chain"]][:3] == ["public_tool", "spec_builder", "governance"]


def test_cancel_imports_only_the_backend_the_host_needs(state, worktree, tmp_path):
    """`agnsup cancel` (issue 29: every module before its kill is on the kill switch's path) imports the
    systemd backend only where it may be chosen (root on pure cgroup v2, a normal user without a writable
    hierarchy), the delegated one only for a normal user with AGNSUP_CGROUP_BASE."""
    from agnsup.linux import cgroup
    _run_and_list_modules(state, worktree, tmp_path, "run", "--", "true")  # a journal to cancel in
    mods = _run_and_list_modules(state, worktree, tmp_path, "cancel", "--all", "--grace", "0")
    assert "agnsup.backend.cgroups" in mods and "agnsup.reaper" in mods  # it did take the cancel path
    if os.geteuid() == 0 and cgroup.detect_layout().kind != "v2":  # (a normal user may ask its systemd manager)
        assert "agnsup.backend.systemd" not in mods
    if os.geteuid() == 0 or not os.environ.get("AGNSUP_CGROUP_BASE"):
        assert "agnsup.backend.delegated" not in mods


def _nest(top, depth: int) -> None:
    """`depth` directories named d below `top`, made through two fds at a time."""
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(depth):
        os.mkdir("d", dir_fd=fd)
        fd2 = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = fd2
    os.close(os.open("f", os.O_WRONLY | os.O_CREAT, dir_fd=fd))
    os.close(fd)


def test_rmtree_removes_a_deep_tree_and_never_follows_symlinks(tmp_path):
    """reap.rmtree replaces shutil.rmtree on the cell's /tmp, which the cell wrote."""
    from agnsup.linux.fs import rmtree
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("x")
    top = tmp_path / "cell-tmp"
    top.mkdir()
    _nest(top, 1500)  # deeper than Python's recursion limit
    (top / "link-dir").symlink_to(outside)
    (top / "d" / "link-file").symlink_to(outside / "keep")
    os.mkfifo(top / "fifo")
    os.chmod(top / "d", 0o000)  # root removes it anyway, as shutil.rmtree does
    rmtree(str(top))
    assert not os.path.lexists(top)
    assert (outside / "keep").read_text() == "x"
    rmtree(str(top))  # already gone: not an error
    f = tmp_path / "file"
    f.write_text("x")
    rmtree(str(f))
    assert not f.exists()



def test_rmtree_removes_a_tree_deeper_than_the_open_file_limit(tmp_path):
    """systemd services and the kernel's PID 1 start with a soft RLIMIT_NOFILE of 1024: a cell that nests
    its /tmp deeper than that must still be removed, so the walk holds a bounded number of fds."""
    top = tmp_path / "cell-tmp"
    top.mkdir()
    _nest(top, 1500)
    prog = ("import resource, sys\n"
            "resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))\n"
            "from agnsup.linux.fs import rmtree\n"
            "rmtree(sys.argv[1])\n")
    subprocess.run([sys.executable, "-c", prog, str(top)], check=True, timeout=120)
    assert not os.path.lexists(top), "a tree deeper than RLIMIT_NOFILE was left behind"


def test_rmtree_lists_through_proc_and_falls_back_to_the_descriptor_without_it(tmp_path, monkeypatch):
    """The walk lists a directory through /proc/self/fd/N (os.scandir(fd) would duplicate the descriptor:
    three system calls more a directory); where /proc is missing, through the descriptor."""
    from agnsup.linux import fs
    real, seen = os.scandir, []

    def by_path_only(arg):
        seen.append(arg)
        if isinstance(arg, int):
            raise AssertionError("listed through a duplicated descriptor")
        return real(arg)
    for no_proc in (False, True):
        top = tmp_path / f"cell-tmp{int(no_proc)}"
        (top / ".agnsup" / "etc").mkdir(parents=True)
        (top / ".agnsup" / "etc" / "resolv.conf").write_text("x")
        (top / "link").symlink_to(tmp_path)
        if no_proc:
            def no_proc_scandir(arg):
                seen.append(arg)
                if isinstance(arg, str) and arg.startswith("/proc/"):
                    raise FileNotFoundError(2, "no /proc here", arg)
                return real(arg)
            monkeypatch.setattr(fs.os, "scandir", no_proc_scandir)
        else:
            monkeypatch.setattr(fs.os, "scandir", by_path_only)
        fs.rmtree(str(top))
        assert not os.path.lexists(top) and tmp_path.is_dir()
    assert any(isinstance(a, int) for a in seen)  # the fallback ran


def test_rmtree_stops_where_the_tree_was_moved_under_it(tmp_path):
    """Coming back up through '..' (past the fds it keeps open) is checked by inode: a directory moved
    out of the tree mid-walk leads elsewhere, and nothing there is removed by name."""
    from agnsup.linux import fs
    (tmp_path / "tree" / "a").mkdir(parents=True)
    (tmp_path / "elsewhere" / "a").mkdir(parents=True)
    tree = os.stat(tmp_path / "tree")
    fd = os.open(tmp_path / "elsewhere" / "a", os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert fs._reopen_parent(fd, (tree.st_dev, tree.st_ino)) is None
    finally:
        os.close(fd)
    fd = os.open(tmp_path / "tree" / "a", os.O_RDONLY | os.O_DIRECTORY)
    try:
        up = fs._reopen_parent(fd, (tree.st_dev, tree.st_ino))
        assert up is not None and os.fstat(up).st_ino == tree.st_ino
        os.close(up)
    finally:
        os.close(fd)


# ---------------------------------------------------------------- clone3(CLONE_INTO_CGROUP)

CGROUPS = "import sys; sys.stdout.write(open('/proc/self/cgroup').read())"
CLONE3 = "clone3(CLONE_INTO_CGROUP) for v2, tasks by the child for v1"
FORK = "fork, cgroup.procs (v1: tasks) by the child"


def _receipt(state, cell):
    with open(os.path.join(state, "cells", "default", cell, "receipt.json")) as f:
        return json.load(f)


def _in_every_hierarchy(cgroup_text: str, receipt: dict) -> None:
    """The command ran inside each of its cell's directories (v2 and the v1 ones)."""
    from agnsup.linux import cgroup
    lines = cgroup_text.splitlines()
    assert receipt["cgroup"], "no cgroup on this host: ENV_BLOCKED: cgroup"
    for h, path in receipt["cgroup"].items():
        assert cgroup.in_tree(lines, h, path, cgroup.detect_layout()), (h, path, lines)


def test_a_cell_is_born_in_its_cgroup(agnsup, worktree, state):
    cp = agnsup("run", "--cell", "born", "--workdir", worktree, "--", "python3", "-c", CGROUPS, check=0)
    r = _receipt(state, "born")
    if "v2" not in r["cgroup"]:
        pytest.skip("ENV_BLOCKED: cgroup2 (clone3 into a cgroup needs a writable cgroup2 hierarchy)")
    assert r["isolation"]["cgroup_join"] == CLONE3
    _in_every_hierarchy(cp.out, r)


def test_a_pid_namespace_cell_is_born_in_its_cgroup_too(state, worktree, policy_dir):
    from conftest import Agnsup, write_role
    path = write_role(policy_dir, "pidns", isolation__pid_namespace="true")
    with open(path) as f:
        assert "pid_namespace = true" in f.read()
    a = Agnsup(state, env={"AGNSUP_POLICY_DIR": str(policy_dir)})
    cp = a("run", "--role", "pidns", "--cell", "ns", "--workdir", worktree, "--", "python3", "-c",
           "import os, sys; print(os.getpid()); sys.stdout.write(open('/proc/self/cgroup').read())", check=0)
    pid, _, text = cp.out.partition("\n")
    assert pid == "2"  # the command, under the namespace's init
    r = _receipt(state, "ns")
    assert r["isolation"]["pid_namespace"] is True
    assert r["isolation"]["cgroup_join"] == (CLONE3 if "v2" in r["cgroup"] else FORK)
    _in_every_hierarchy(text, r)


def test_a_threaded_controller_forks_instead(state, worktree):
    """The raw clone3 skips glibc's fork handlers, so a controller with a second
    thread (serve) forks and the child writes cgroup.procs: same cell, same cgroups."""
    import threading
    from agnsup.tool import run_process
    stop = threading.Event()
    t = threading.Thread(target=stop.wait)
    t.start()
    try:
        res = run_process(["python3", "-c", CGROUPS], state_dir=state, workdir=worktree, cell_id="forked")
    finally:
        stop.set()
        t.join()
    assert res["exit_code"] == 0, res
    r = _receipt(state, "forked")
    assert r["isolation"]["cgroup_join"] == FORK
    _in_every_hierarchy(res["stdout"], r)


def test_records_behave_like_the_dataclasses_they_replace():
    from agnsup.gate.model import Decision, Finding
    from agnsup.util.record import FrozenError, replace
    d = Decision(True, "allow.x", "green", "ok", "policy")
    assert d == Decision(allowed=True, rule="allow.x", zone="green", reason="ok", check="policy")
    assert hash(d) == hash(Decision(True, "allow.x", "green", "ok", "policy")) and d.flags == ()
    assert replace(d, rule="allow.y").rule == "allow.y" and d.rule == "allow.x"
    with pytest.raises(FrozenError):
        d.rule = "changed"
    with pytest.raises(TypeError):
        Decision(True, "r")  # missing fields
    with pytest.raises(TypeError):
        Decision(True, "r", "green", "ok", "policy", bogus=1)
    a, b = Finding(True, "r", "x"), Finding(True, "r", "x")
    assert a.extra == {} and a.extra is not b.extra  # a fresh default each time
    assert "rule='r'" in repr(a)


def test_the_string_tests_agree_with_the_regexes_they_replace():
    import re
    from agnsup.util.secretkeys import looks_secret
    from agnsup.store.state import check_id
    from agnsup.errors import UsageError
    secret = re.compile(r"(^AWS_|_TOKEN$|_SECRET$|_KEY$|_PASSWORD$|_PASSWD$|_CREDENTIALS?$|^SECRET|PASSWORD)",
                        re.IGNORECASE)
    ident = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}\Z")
    keys = ["AWS_X", "aws_x", "X_AWS_", "GH_TOKEN", "gh_token", "TOKEN", "X_SECRET", "SECRETS_DIR", "secret",
            "A_KEY", "KEYS", "MY_KEY\n", "DB_PASSWORD", "PASSWORDLESS", "x_passwd", "X_CREDENTIAL", "X_CREDENTIALS",
            "X_CREDENTIALSS", "PATH", "HOME", "LANG", "_KEY", "\u212aEY", "X_\u212aEY", "ı_TOKEN", "X_TOKEN\n\n", ""]
    for k in keys:
        assert looks_secret(k) == bool(secret.search(k)), k
    ids = ["a", "A9", "9", "a.b_c-d", "x" * 64, "x" * 65, "", ".a", "_a", "-a", "a/b", "a b", "é", "a\n", "ab\u212a"]
    for v in ids:
        try:
            check_id("cell", v)
            ok = True
        except UsageError:
            ok = False
        assert ok == bool(ident.match(v)), v


FAILING_SETUP = r"""
import errno, json, os, sys
from agnsup.errors import AgnsupError
from agnsup.tool import run_process

def broken():
    raise OSError(errno.EPERM, "refused for the test")
os.setsid = broken  # only the forked child calls it: its setup fails at once, at step "setsid"
try:
    run_process(["true"], state_dir=sys.argv[1], workdir=sys.argv[2], cell_id="broken")
except AgnsupError as e:
    print(json.dumps({"type": type(e).__name__, "message": e.message, "exit_code": e.exit_code}))
"""


def test_a_child_that_fails_its_setup_says_why_while_the_controller_joins_it(state, worktree):
    """The controller's v1 joins can take a grace period, longer than a failing
    child lives: the child's own report still is the error, not ESRCH/EPIPE."""
    cp = subprocess.run([sys.executable, "-c", FAILING_SETUP, state, worktree], capture_output=True, timeout=120)
    assert cp.returncode == 0, cp.stderr.decode(errors="replace")
    err = json.loads(cp.stdout)
    assert err["type"] == "SetupError" and "step 'setsid'" in err["message"], err
    with open(os.path.join(state, "cells", "default", "broken", "receipt.json")) as f:
        r = json.load(f)
    assert r["state"] == "failed" and "step 'setsid'" in r["error"]


def test_cancel_imports_nothing_heavy(state, worktree, tmp_path):
    """`agnsup cancel` (a kill switch, issue 29) takes the console script's fast path too: no click."""
    _run_and_list_modules(state, worktree, tmp_path, "run", "--cell", "c", "--", "true")
    mods = _run_and_list_modules(state, worktree, tmp_path, "cancel", "--all", "--grace", "0", "--json")
    assert "agnsup.cancel" in mods and "agnsup.doors.cancel_cli" in mods  # it did run the cancel path
    heavy = _heavy(mods)
    assert heavy == [], f"the cancel path imported {heavy}"
