"""Real developer projects for the tests of everyday jobs (issue 13): a git
repository with a venv that has pytest, a Makefile, a home with a git identity.

The venv is made without pip (fast: no download, no network) and gets pytest
from the environment running these tests through a .pth file; its `pytest`
script is an ordinary console script of that venv's python.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig

GIT = shutil.which("git", path="/usr/bin:/bin")


def make_venv(where: str, python: str | None = None) -> str:
    """A venv at `where` whose python imports pytest; returns its bin/python."""
    subprocess.run([python or sys.executable, "-m", "venv", "--without-pip", where], check=True)
    ver = f"python{sys.version_info.major}.{sys.version_info.minor}"
    with open(os.path.join(where, "lib", ver, "site-packages", "tests-host.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")
    py = os.path.join(where, "bin", "python")
    script = os.path.join(where, "bin", "pytest")
    with open(script, "w") as f:
        f.write(f"#!{py}\nimport sys\nimport pytest\nsys.exit(pytest.main())\n")
    os.chmod(script, 0o755)
    return py


def git(*args, cwd, env=None):
    return subprocess.run([GIT, *args], cwd=cwd, check=True, capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "HOME": env.get("HOME", "/nonexistent") if env else
                               "/nonexistent", **(env or {})})


def make_project(root: str, venv: bool = True) -> str:
    """root/: a git repository (no identity of its own) with src, tests/ and a Makefile."""
    os.makedirs(os.path.join(root, "tests"))
    with open(os.path.join(root, "calc.py"), "w") as f:
        f.write("def add(a, b):\n    return a + b\n")
    with open(os.path.join(root, "tests", "test_calc.py"), "w") as f:
        f.write("import os, sys\nsys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))\n"
                "from calc import add\n\ndef test_add():\n    assert add(2, 3) == 5\n")
    with open(os.path.join(root, "Makefile"), "w") as f:
        f.write("build/out.txt: calc.py\n\tmkdir -p build\n\tcat calc.py > $@\n\techo built\n")
    with open(os.path.join(root, ".gitignore"), "w") as f:
        f.write(".venv/\nbuild/\n__pycache__/\n.pytest_cache/\n")
    if venv:
        make_venv(os.path.join(root, ".venv"))
    git("init", "-q", "-b", "main", ".", cwd=root)
    return root


def write_identity(home: str, name="Dev Eloper", email="dev@example.org") -> str:
    os.makedirs(home, exist_ok=True)
    path = os.path.join(home, ".gitconfig")
    with open(path, "w") as f:
        f.write(f"[user]\n\tname = {name}\n\temail = {email}\n")
    return path


def make_wheel_index(root: str, name="agnsupdemo", version="1.0") -> str:
    """A local directory index (root/simple/NAME/ holding one pure wheel, PEP 503 pages);
    returns its file:// URL for pip's index-url."""
    import zipfile
    pkg = os.path.join(root, "simple", name)
    os.makedirs(pkg)
    whl = f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(os.path.join(pkg, whl), "w") as z:
        z.writestr(f"{name}/__init__.py", "VALUE = 42\n")
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    with open(os.path.join(pkg, "index.html"), "w") as f:
        f.write(f'<html><body><a href="{whl}">{whl}</a></body></html>\n')
    with open(os.path.join(root, "simple", "index.html"), "w") as f:
        f.write(f'<html><body><a href="{name}/">{name}</a></body></html>\n')
    return "file://" + os.path.join(root, "simple")
