"""Only the process supervisor creates processes: proven by reading the source."""
import ast
import os

PKG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "agnsup")
ALLOWED = {os.path.join(PKG, "supervisor.py")}
FORBIDDEN_CALLS = {"fork", "forkpty", "posix_spawn", "posix_spawnp", "system", "popen", "spawnv", "spawnve",
                   "spawnl", "spawnle", "spawnlp", "spawnvp", "execv", "execve", "execvp", "execvpe", "execl",
                   "execle", "execlp", "execlpe"}


def _sources():
    for root, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                yield os.path.join(root, f)


def _violations(path):
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [f"import {a.name}" for a in node.names if a.name.split(".")[0] in ("subprocess", "multiprocessing", "pty")]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ("subprocess", "multiprocessing", "pty"):
            out.append(f"from {node.module} import")
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            out += [f"from os import {a.name}" for a in node.names if a.name in FORBIDDEN_CALLS]
        elif isinstance(node, ast.Attribute) and node.attr in FORBIDDEN_CALLS and isinstance(node.value, ast.Name) \
                and node.value.id == "os":
            out.append(f"os.{node.attr}")
        elif isinstance(node, ast.Attribute) and node.attr == "clone3_into_cgroup":  # linux/sys.py's raw clone3
            out.append(f"{getattr(node.value, 'id', '?')}.clone3_into_cgroup")
        elif isinstance(node, ast.Attribute) and node.attr in ("Popen", "run", "call", "check_output", "check_call") \
                and isinstance(node.value, ast.Name) and node.value.id == "subprocess":
            out.append(f"subprocess.{node.attr}")
    return out


def test_no_module_but_the_supervisor_creates_processes():
    bad = {}
    for path in _sources():
        if path in ALLOWED:
            continue
        v = _violations(path)
        if v:
            bad[os.path.relpath(path, PKG)] = v
    assert not bad, f"process creation outside agnsup/supervisor.py: {bad}"


def test_the_source_check_would_catch_a_fork(tmp_path):
    p = tmp_path / "x.py"
    p.write_text("import os\nimport subprocess\nos.fork()\nos.execve('/bin/true', [], {})\nlsys.clone3_into_cgroup(3)\n")
    assert set(_violations(str(p))) == {"import subprocess", "os.fork", "os.execve", "lsys.clone3_into_cgroup"}


def test_the_supervisor_is_where_fork_and_exec_live():
    assert {"os.fork", "os.execve", "lsys.clone3_into_cgroup"} <= set(_violations(os.path.join(PKG, "supervisor.py")))
