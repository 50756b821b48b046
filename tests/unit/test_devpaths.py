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


def test_a_venv_names_its_interpreter_prefixes(tmp_path):
    venv = tmp_path / ".venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "pyvenv.cfg").write_text("home = /home/u/.pyenv/versions/3.12.1/bin\ninclude-system-site-packages = "
                                     "false\nexecutable = /home/u/.pyenv/versions/3.12.1/bin/python3.12\n"
                                     "base-executable = /opt/uv/python/bin/python3\nprompt = x\n")
    assert spec.find_venv(str(tmp_path)) == str(venv)
    assert spec.venv_interpreter(str(venv)) == ["/home/u/.pyenv/versions/3.12.1", "/opt/uv/python"]
    assert spec.expand_path(["@venv", "/usr/bin", "@runtime"], str(venv)) == \
        [str(venv / "bin"), "/usr/bin", spec.RUNTIME_BIN]
    assert spec.expand_path(["@venv", "/usr/bin"], None) == ["/usr/bin"]
    os.remove(venv / "pyvenv.cfg")
    assert spec.find_venv(str(tmp_path)) is None


def test_trees_overlap_when_one_holds_the_other():
    assert locks.overlaps("/r", "/r/sub") and locks.overlaps("/r/sub/", "/r") and locks.overlaps("/r", "/r")
    assert not locks.overlaps("/r", "/rx") and not locks.overlaps("/r/a", "/r/b")
