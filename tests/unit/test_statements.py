"""What the project says about itself is true: pyproject declares every library the
package imports (for the door that imports it), and every repository path the docs
name exists."""
import ast
import glob
import importlib.metadata
import os
import re
import sys
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PKG = os.path.join(ROOT, "agnsup")

# The front door a source file belongs to -> the extra its imports may come from (besides the
# dependencies every install has). Matched on the path, so it holds wherever the layout puts the doors.
DOOR_EXTRAS = [(re.compile(r"(^|/)mcp(/|\.py$)"), "mcp"), (re.compile(r"(^|/)sandboxd/"), "k8s")]
# Imported by a developer's tool only, never by a door: scripts/gen_sandboxd_descriptor regenerates
# sandboxd's descriptor with grpcio-tools' protoc (sandboxd/proto.py compile_proto).
DEV_ONLY = {"grpc_tools": "test"}


def _name(requirement: str) -> str:
    return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9._-]+", requirement).group()).lower()


def declared() -> dict[str, set[str]]:
    """pyproject: extra ("" for the dependencies) -> distribution names, self-references expanded."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    raw = {"": project["dependencies"], **project["optional-dependencies"]}

    def names(extra: str) -> set[str]:
        out = set()
        for req in raw[extra]:
            if _name(req) == project["name"]:
                for inner in re.search(r"\[([^]]*)\]", req).group(1).split(","):
                    out |= names(inner.strip())
            else:
                out.add(_name(req))
        return out
    return {extra: names(extra) for extra in raw}


def third_party_imports() -> dict[str, set[str]]:
    """Top-level name of every non-stdlib, non-agnsup import (module level or inside a
    function) -> the source files (relative to the repository) that import it."""
    out: dict[str, set[str]] = {}
    for path in glob.glob(os.path.join(PKG, "**", "*.py"), recursive=True):
        rel = os.path.relpath(path, ROOT)
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                tops = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                tops = [node.module.split(".")[0]]
            else:
                continue
            for top in tops:
                # a leading underscore: CPython's C modules, which differ between versions (_sha256 before
                # 3.12, _sha2 after) and so are not all in this interpreter's stdlib_module_names
                if top != "agnsup" and top not in sys.stdlib_module_names and not top.startswith("_"):
                    out.setdefault(top, set()).add(rel)
    return out


def undeclared(extras: dict[str, set[str]], imports: dict[str, set[str]]) -> list[str]:
    dists = importlib.metadata.packages_distributions()
    wrong = []
    for top, files in sorted(imports.items()):
        provided = {_name(d) for d in dists.get(top, [])}
        if not provided:
            wrong.append(f"{top}: imported by {sorted(files)} but not installed (no distribution provides it)")
            continue
        for rel in sorted(files):
            allowed = set(extras[""])
            for pattern, extra in DOOR_EXTRAS:
                if pattern.search(rel):
                    allowed |= extras[extra]
            if top in DEV_ONLY:
                allowed |= extras[DEV_ONLY[top]]
            if not provided & allowed:
                wrong.append(f"{rel} imports {top} ({', '.join(sorted(provided))}): not declared where it may")
    return wrong


def test_every_third_party_import_is_declared_for_its_door():
    wrong = undeclared(declared(), third_party_imports())
    assert not wrong, "pyproject.toml does not declare:\n" + "\n".join(wrong)


def test_the_import_check_would_catch_an_undeclared_library():
    """The mcp extra as it was (mcp alone): the door's direct imports of anyio and uvicorn are named."""
    extras = declared()
    extras["mcp"] = {"mcp", "mcp-types"}
    wrong = undeclared(extras, third_party_imports())
    assert any(" imports anyio " in w for w in wrong) and any(" imports uvicorn " in w for w in wrong), wrong


# A repository path in prose: agnsup/..., scripts/..., tests/..., policies/..., deploy/..., not the tail
# of a longer path (/etc/agnsup/policies/ci.toml, /src/agnsup/.venv/bin/agnsup are a host's paths).
NAMED_PATH = re.compile(r"(?<![\w./~$-])((?:agnsup|scripts|tests|policies|deploy)/[\w./*-]*)")


def named_paths() -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    docs = sorted(glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True))
    for doc in [os.path.join(ROOT, "README.md")] + docs:
        with open(doc) as f:
            for lineno, line in enumerate(f, 1):
                for m in NAMED_PATH.finditer(line):
                    out.setdefault(m.group(1).rstrip(".,:;"), set()).add(f"{os.path.relpath(doc, ROOT)}:{lineno}")
    return out


def test_every_path_the_docs_name_exists():
    missing = [f"{path} (named in {', '.join(sorted(where))})" for path, where in sorted(named_paths().items())
               if not glob.glob(os.path.join(ROOT, path))]
    assert not missing, "paths named in docs/ and README.md that do not exist:\n" + "\n".join(missing)


def test_the_path_check_reads_the_docs_paths():
    paths = named_paths()
    assert "scripts/test.sh" in paths and not any(p.startswith("agnsup/.venv") for p in paths)
