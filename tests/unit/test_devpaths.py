"""The project root, the worktree venv's interpreter, overlapping lock trees (pure)."""
import os

from agnsup import locks, spec


def test_the_project_root_is_the_nearest_marker_and_never_a_home(tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    (repo / "a" / "b").mkdir(parents=True)
    (repo / ".git").write_text("gitdir: elsewhere\n")  # a linked worktree's .git is a file
    assert spec.project_root(str(repo / "a" / "b")) == str(repo)
    (repo / "a" / ".agnsup-worktree").write_text("")
    assert spec.project_root(str(repo / "a" / "b")) == str(repo / "a")
    bare = tmp_path / "plain" / "sub"
    bare.mkdir(parents=True)
    assert spec.project_root(str(bare)) == str(bare)
    monkeypatch.setenv("HOME", str(repo))  # a dotfiles repository in the home: no climb to it
    assert spec.project_root(str(repo / "a" / "b")) == str(repo / "a")
    (repo / "a" / ".agnsup-worktree").unlink()
    assert spec.project_root(str(repo / "a" / "b")) == str(repo / "a" / "b")
    assert spec.project_root(str(repo)) == str(repo)  # started in the home itself: the user chose it


def _prefix(root, *parts):
    """A directory that looks like a Python installation: lib/python3.X/os.py."""
    p = root.joinpath(*parts)
    (p / "lib" / "python3.12").mkdir(parents=True)
    (p / "lib" / "python3.12" / "os.py").write_text("")
    return str(p)


def test_a_venv_names_its_interpreter_prefixes_and_nothing_else(tmp_path):
    pyenv = _prefix(tmp_path, "home", ".pyenv", "versions", "3.12.1")
    uv = _prefix(tmp_path, "opt", "uv", "python")
    secrets = tmp_path / "home" / ".config" / "gh"
    (secrets / "bin").mkdir(parents=True)
    wt = tmp_path / "wt"
    venv = wt / ".venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "pyvenv.cfg").write_text(f"home = {pyenv}/bin\ninclude-system-site-packages = false\n"
                                     f"executable = {pyenv}/bin/python3.12\nbase-executable = {uv}/bin/python3\n"
                                     "prompt = x\n")
    assert spec.find_venv(str(wt)) == str(venv)
    assert spec.venv_interpreter(str(venv)) == [pyenv, uv]
    # a pyvenv.cfg an earlier cell wrote cannot name a home directory that is no Python
    (venv / "pyvenv.cfg").write_text(f"home = {secrets}/bin\n")
    assert spec.venv_interpreter(str(venv)) == []
    venv = str(venv)
    assert spec.expand_path(["@venv", "/usr/bin", "@runtime"], venv) == \
        [os.path.join(venv, "bin"), "/usr/bin", spec.RUNTIME_BIN]
    assert spec.expand_path(["@venv", "/usr/bin"], None) == ["/usr/bin"]
    os.remove(os.path.join(venv, "pyvenv.cfg"))
    assert spec.find_venv(str(wt)) is None


def test_trees_overlap_when_one_holds_the_other():
    assert locks.overlaps("/r", "/r/sub") and locks.overlaps("/r/sub/", "/r") and locks.overlaps("/r", "/r")
    assert not locks.overlaps("/r", "/rx") and not locks.overlaps("/r/a", "/r/b")
