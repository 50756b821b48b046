"""The shape of the package, proven by reading the source:

- only the process package (agnsup/process/) creates processes (the self-test harness, which
  plays the user and the bystanders, starts plain host processes in one place);
- imports flow one way: front doors -> tool/service -> stages (spec, governance,
  policy, compiler; cancel and janitor) -> broker -> reaper/process ->
  backend/journal -> linux and the shared modules. A module imports its own
  layer or below, never above (lazy imports inside functions count too);
- and no import cycle, lazy imports included: a module that needs a name from
  one that needs it back means something sits on the wrong side.
"""
import ast
import functools
import os

PKG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "agnsup")
PROCESS = os.path.join(PKG, "process")  # the package that alone creates processes
HARNESS = os.path.join(PKG, "selftest", "host.py")  # may use subprocess.Popen, nothing else
FORBIDDEN_CALLS = {"fork", "forkpty", "posix_spawn", "posix_spawnp", "system", "popen", "spawnv", "spawnve",
                   "spawnl", "spawnle", "spawnlp", "spawnvp", "execv", "execve", "execvp", "execvpe", "execl",
                   "execle", "execlp", "execlpe"}

LAYERS = [  # top to bottom
    ("front doors", ["agnsup", "agnsup.doors", "agnsup.doors.cli", "agnsup.doors.entry", "agnsup.doors.serve",
                     "agnsup.doors.mcp", "agnsup.doors.doctor", "agnsup.selftest", "agnsup.doors.sandboxd"]),
    ("tool and supervisor", ["agnsup.supervisor", "agnsup.tool"]),
    ("stages", ["agnsup.spec", "agnsup.governance", "agnsup.gate", "agnsup.policy", "agnsup.compiler", "agnsup.plan",
                "agnsup.request", "agnsup.policyfile", "agnsup.store.cells", "agnsup.cancel", "agnsup.janitor",
                "agnsup.toolconfig", "agnsup.netpolicy", "agnsup.store.repair", "agnsup.ports"]),
    ("broker", ["agnsup.broker", "agnsup.home"]),
    ("reaper and process", ["agnsup.reaper", "agnsup.process", "agnsup.pod", "agnsup.receipts", "agnsup.io", "agnsup.locks",
                            "agnsup.egress", "agnsup.protect"]),
    ("backend and store", ["agnsup.backend", "agnsup.store", "agnsup.changes"]),
    ("linux and shared", ["agnsup.linux", "agnsup.errors", "agnsup.util", "agnsup.policies", "agnsup.redact",
                          "agnsup.secrets"]),
]
DATA_PACKAGES = {"migrations", "policies"}  # package data shipped as agnsup.<name> (pyproject package-dir)


def _sources():
    for root, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                yield os.path.join(root, f)


def _module(path: str) -> str:
    rel = os.path.relpath(path, os.path.dirname(PKG))[:-3].replace(os.sep, ".")
    return rel[:-len(".__init__")] if rel.endswith(".__init__") else rel


def layer(module: str) -> int | None:
    best = None
    for i, (_, mods) in enumerate(LAYERS):
        for m in mods:
            if (module == m or module.startswith(m + ".")) and (best is None or len(m) > len(best[1])):
                best = (i, m)
    return best[0] if best else None


def _is_module(name: str) -> bool:
    p = os.path.join(os.path.dirname(PKG), *name.split("."))
    return os.path.isdir(p) or os.path.exists(p + ".py") or name.rpartition(".")[2] in DATA_PACKAGES


def imports(path: str, source: str | None = None) -> set[str]:
    """Every agnsup module `path` imports, at the top or inside a function."""
    mod = _module(path)
    pkg = mod if path.endswith("__init__.py") else mod.rpartition(".")[0]
    if source is None:
        with open(path) as f:
            source = f.read()
    out = set()
    for node in ast.walk(ast.parse(source, path)):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "agnsup")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = pkg.split(".")
                target = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "agnsup":
                continue
            for a in node.names:
                sub = f"{target}.{a.name}"
                out.add(sub if _is_module(sub) else target)
    return out


def upward(path: str, source: str | None = None) -> list[str]:
    here = layer(_module(path))
    return sorted(f"{t} ({LAYERS[layer(t)][0]})" for t in imports(path, source)
                  if layer(t) is None or layer(t) < here)


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


def _in_process_package(path: str) -> bool:
    return os.path.dirname(path) == PROCESS


def test_no_module_outside_the_process_package_creates_processes():
    bad = {}
    for path in _sources():
        if _in_process_package(path):
            continue
        v = _violations(path)
        if path == HARNESS:
            v = [x for x in v if x not in ("import subprocess", "subprocess.Popen")]
        if v:
            bad[os.path.relpath(path, PKG)] = v
    assert not bad, f"process creation outside agnsup/process/: {bad}"


def test_the_source_check_would_catch_a_fork(tmp_path):
    p = tmp_path / "x.py"
    p.write_text("import os\nimport subprocess\nos.fork()\nos.execve('/bin/true', [], {})\nlsys.clone3_into_cgroup(3)\n")
    assert set(_violations(str(p))) == {"import subprocess", "os.fork", "os.execve", "lsys.clone3_into_cgroup"}


def test_the_process_package_is_where_fork_and_exec_live():
    found = set().union(*(_violations(p) for p in _sources() if _in_process_package(p)))
    assert {"os.fork", "os.execve", "lsys.clone3_into_cgroup"} <= found


def test_the_check_covers_every_module_outside_the_process_package():
    """A fork in another module, even one beside the package (broker) or named like it, is caught."""
    assert not _in_process_package(os.path.join(PKG, "broker.py"))
    assert not _in_process_package(os.path.join(PKG, "linux", "process.py"))
    assert _in_process_package(os.path.join(PROCESS, "leader.py"))


def test_imports_flow_one_way_down_the_path():
    bad = {}
    for path in _sources():
        if layer(_module(path)) is None:
            bad[os.path.relpath(path, PKG)] = ["module has no layer: add it to LAYERS"]
        elif upward(path):
            bad[os.path.relpath(path, PKG)] = upward(path)
    assert not bad, f"imports against the direction of the path: {bad}"


def test_the_direction_check_would_catch_an_upward_import():
    """The broker asking governance, the gate running the journal's SQL, the backend
    reaching for the broker: each is caught, at the top or inside a function."""
    def up(rel: str, src: str) -> list[str]:
        return upward(os.path.join(PKG, rel), src)
    assert up("broker.py", "def f():\n    from . import governance\n") == ["agnsup.governance (stages)"]
    assert up("gate/quota.py", "from ..store.journal import Journal\n") == []  # down is fine
    assert up("backend/cgroups.py", "import agnsup.broker\n") == ["agnsup.broker (broker)"]
    assert up("linux/cgroup.py", "from .. import reaper\n") == ["agnsup.reaper (reaper and process)"]
    assert up("store/journal.py", "from . import migrations\n") == []



def _graph(sources: dict[str, str] | None = None) -> dict[str, set[str]]:
    """module -> the agnsup modules it imports (at the top or inside a function); `sources`
    ({path relative to the package: text}) stands in for files, to prove the check."""
    graph = dict(_read_graph())
    for rel, text in (sources or {}).items():
        path = os.path.join(PKG, rel)
        graph[_module(path)] = _edges(path, text, graph)
    return graph


@functools.cache
def _read_graph() -> dict[str, set[str]]:
    paths = {_module(p): p for p in _sources()}
    return {mod: _edges(path, None, paths) for mod, path in paths.items()}


def _edges(path: str, source: str | None, modules) -> set[str]:
    mod, out = _module(path), set()
    for t in imports(path, source):
        if t.rpartition(".")[2] in DATA_PACKAGES:
            continue  # package data (migrations, policies): no code
        while t not in modules and "." in t:
            t = t.rpartition(".")[0]  # a name imported from a module is that module
        if t != mod:
            out.add(t)
    return out


def import_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of `graph` as [a, b, ..., a], or [] when there is none (depth-first, colours)."""
    state, path = {}, []

    def visit(m: str) -> list[str]:
        state[m] = "open"
        path.append(m)
        for t in sorted(graph.get(m, ())):
            if state.get(t) == "open":
                return path[path.index(t):] + [t]
            if t not in state and (found := visit(t)):
                return found
        state[m] = "done"
        path.pop()
        return []

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return []


def test_no_import_cycle():
    """Lazy imports count: an import inside a function that dodges a cycle at load time still ties
    the two modules together (the 17-module knot of issue 30 was held that way)."""
    cycle = import_cycle(_graph())
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_check_would_catch_one():
    """The store asking the service back (inside a function), the gate's values asking the walker, two
    backends naming each other: each is a cycle, named."""
    assert import_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert import_cycle({"a": {"b"}, "b": set()}) == []
    lazy = import_cycle(_graph({"store/journal.py": "def f():\n    from .. import supervisor\n"}))
    assert lazy[0] == lazy[-1] and {"agnsup.store.journal", "agnsup.supervisor"} <= set(lazy), lazy
    assert "agnsup.gate.commands" in import_cycle(_graph({"gate/model.py": "from .commands import unwrap\n"}))
    pair = import_cycle(_graph({"backend/cgroups.py": "from .systemd import SystemdScope\n"}))
    assert pair == ["agnsup.backend.cgroups", "agnsup.backend.systemd", "agnsup.backend.cgroups"], pair


STORE = os.path.join(PKG, "store", "journal.py")
OBSERVER = os.path.join(PKG, "selftest", "host.py")  # reads the journal read-only, as evidence from outside


def _sql(path: str) -> list[str]:
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            out += [f"import {n}" for n in names if n.split(".")[0] in ("sqlite3", "_sqlite3")]
        elif isinstance(node, ast.Attribute) and node.attr in ("execute", "executemany", "executescript"):
            out.append(f".{node.attr}()")
    return out


def test_only_the_store_speaks_sql():
    bad = {os.path.relpath(p, PKG): v for p in _sources() if p not in (STORE, OBSERVER) and (v := _sql(p))}
    assert not bad, f"SQL outside agnsup/store/journal.py: {bad}"
    assert _sql(STORE)  # the check sees SQL where it is


def test_the_wheel_ships_every_package():
    """pyproject names its packages one by one: a new folder left out installs a wheel that fails on import."""
    import tomllib
    with open(os.path.join(os.path.dirname(PKG), "pyproject.toml"), "rb") as f:
        listed = set(tomllib.load(f)["tool"]["setuptools"]["packages"])
    found = {_module(os.path.join(root, "__init__.py")) for root, _, files in os.walk(PKG) if "__init__.py" in files}
    assert found <= listed, f"packages missing from pyproject.toml: {sorted(found - listed)}"
