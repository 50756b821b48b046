"""The cgroup lock's primer (issue 29, process/primer.py): what it writes, and that it leaves no process behind."""
import os

import pytest

from agnsup.process import primer
from agnsup.supervisor import _Forker


class _Base:
    def __init__(self, paths):
        self.paths = paths


class _Backend:
    def __init__(self, paths):
        self.base = _Base(paths)


def _gone(pid: int) -> bool:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True
    return False


def test_a_prime_writes_an_exited_child_of_ours_and_reaps_it_after_the_fork(tmp_path):
    """The pid written is a zombie of ours (exited, not reaped: the kernel moves nothing and its number cannot
    be reused meanwhile); touched again before the fork, reaped after it: no child is left."""
    procs = tmp_path / "cgroup.procs"
    procs.write_text("")
    p = primer.Primer(_Backend({"v2": str(tmp_path)}))
    assert p.prime()
    pid = int(procs.read_text())
    info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT | os.WNOHANG)
    assert info is not None and info.si_pid == pid  # exited, still ours
    assert p.touch()
    p.reap()
    assert p.pid is None and _gone(pid)


def test_a_second_prime_reaps_the_zombie_a_request_that_never_forked_left(tmp_path):
    (tmp_path / "cgroup.procs").write_text("")
    p = primer.Primer(_Backend({"v2": str(tmp_path)}))
    p.prime()
    first = p.pid
    p.prime()
    assert _gone(first) and p.pid != first
    p.reap()


@pytest.mark.parametrize("backend", [object(), _Backend({}), _Backend({"v2": "/nonexistent/agnsup-x"})])
def test_no_base_directory_no_prime_and_no_child(backend):
    p = primer.Primer(backend)
    assert not p.prime() and p.pid is None
    assert not p.touch()


def test_the_forker_touches_before_the_fork_and_reaps_after_it():
    calls = []

    class Fake:
        def prime(self):
            calls.append("prime")

        def touch(self):
            calls.append("touch")

        def reap(self):
            calls.append("reap")

    f = _Forker(Fake())
    try:
        f.prime()
        assert f(lambda: calls.append("fork") or 7) == 7
        with pytest.raises(OSError):
            f(lambda: (_ for _ in ()).throw(OSError("no fork")))
    finally:
        f.close()
    assert calls == ["prime", "touch", "fork", "reap", "touch", "reap", "reap"]
