"""The wheel carries the role files (agnsup/policies/) and the migrations (agnsup/store/migrations/) and works outside the source tree."""
import os
import subprocess
import sys

from conftest import REPO


def test_the_installed_wheel_runs_doctor_and_a_cell_outside_the_source_tree(tmp_path):
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist), REPO],
                   check=True, timeout=600, capture_output=True)
    (wheel,) = dist.glob("agnsup-*.whl")
    import zipfile
    names = zipfile.ZipFile(wheel).namelist()
    assert "agnsup/policies/executor.toml" in names and "agnsup/store/migrations/0001_init.sql" in names
    assert "agnsup/selftest/stubborn-tree" in names  # `agnsup selftest` runs it in cells
    assert "agnsup/doors/sandboxd/process.proto" in names and "agnsup/doors/sandboxd/_descriptor.py" in names
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", str(wheel)], check=True, timeout=600,
                   capture_output=True)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    env = {"PATH": "/usr/bin:/bin", "AGNSUP_STATE_DIR": str(tmp_path / "state"), "LANG": "C.UTF-8",
           "AGNSUP_ROOTS_REGISTRY": os.environ["AGNSUP_ROOTS_REGISTRY"]}  # the tests' registry, not the host's
    agnsup = str(venv / "bin" / "agnsup")
    doc = subprocess.run([agnsup, "doctor", "--json"], cwd=outside, env=env, capture_output=True, timeout=120)
    assert doc.returncode == 0, doc.stderr
    run = subprocess.run([agnsup, "run", "--", "true"], cwd=outside, env=env, capture_output=True, timeout=120)
    assert run.returncode == 0, run.stderr
    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import agnsup; print(agnsup.__file__)"],
                           cwd=outside, env=env, capture_output=True, text=True, check=True)
    assert where.stdout.startswith(str(venv)), "imported the source tree instead of the wheel"
    assert not os.path.exists(os.path.join(str(outside), "agnsup"))
