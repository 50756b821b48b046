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


def _zombie_of_ours(pid: int) -> bool:
    info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT | os.WNOHANG)
    return info is not None and info.si_pid == pid


def _wait_exited(pid: int) -> None:
    os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)


def test_a_prime_writes_an_exited_child_of_ours_and_renew_reaps_it(tmp_path):
    """The pid written is a zombie of ours (exited, not reaped: the kernel moves nothing and its number cannot
    be reused meanwhile), spawned ahead (renew, after the last fork); renew reaps it and spawns the next."""
    procs = tmp_path / "cgroup.procs"
    procs.write_text("")
    p = primer.Primer(_Backend({"v2": str(tmp_path)}))
    p.renew()
    first = p.pid
    _wait_exited(first)
    assert p.prime() and p.touch()
    assert int(procs.read_text()) == first and _zombie_of_ours(first)
    p.renew()
    assert _gone(first) and p.pid not in (None, first)
    p.reap()
    assert p.pid is None


def test_a_child_still_running_is_never_written(tmp_path):
    """A write of a live process's pid would move it: a prime whose child has not exited yet writes nothing
    (the first request of a controller, a burst); one reaped elsewhere is forgotten, never written."""
    procs = tmp_path / "cgroup.procs"
    procs.write_text("")
    p = primer.Primer(_Backend({"v2": str(tmp_path)}))
    p.pid = os.posix_spawn("/bin/sleep", ["sleep", "5"], {})
    try:
        assert not p.prime() and procs.read_text() == ""
    finally:
        os.kill(p.pid, 9)
    _wait_exited(p.pid)
    os.waitpid(p.pid, 0)  # reaped by someone else
    assert not p.touch() and p.pid is None and procs.read_text() == ""


@pytest.mark.parametrize("backend", [object(), _Backend({}), _Backend({"v2": "/nonexistent/agnsup-x"})])
def test_no_base_directory_no_prime(backend):
    p = primer.Primer(backend)
    assert not p.prime()
    assert not p.touch()
    p.reap()


def test_the_forker_touches_before_the_fork_and_renews_after_it_on_a_thread_of_its_own():
    """The primer's calls run in order on their own thread, never on the forker's: a touch that waits a grace
    period holds no fork up (issue 29, third round)."""
    import threading
    calls, threads = [], {}

    class Fake:
        def __getattr__(self, name):
            if name not in ("prime", "touch", "renew", "reap"):
                raise AttributeError(name)

            def call():
                calls.append(name)
                threads.setdefault(name, set()).add(threading.current_thread().name)
            return call

    def fork(value):
        def run():
            threads.setdefault("fork", set()).add(threading.current_thread().name)
            return value
        return run

    f = _Forker(Fake())
    try:
        f.prime()
        assert f(fork(7)) == 7
        with pytest.raises(OSError):
            f(lambda: (_ for _ in ()).throw(OSError("no fork")))
    finally:
        f.close()
    assert calls == ["prime", "touch", "renew", "touch", "renew", "reap"]
    assert threads["fork"] == {"agnsup-forker"}
    assert all(threads[n] == {"agnsup-primer"} for n in ("prime", "touch", "renew", "reap")), threads


def test_a_write_the_kernel_refuses_still_counts_as_reached_and_says_why(tmp_path):
    """A pure-v2 base refuses every process (EBUSY: it has controllers) after the kernel took its lock, so
    the grace period starts all the same: touch() says the write reached the kernel and keeps the errno."""
    import errno
    p = primer.Primer(_Backend({"v2": str(tmp_path)}))
    p.renew()
    _wait_exited(p.pid)
    p.procs_file = "/dev/full"  # every write: ENOSPC
    assert p.touch() and p.refused == errno.ENOSPC
    p.reap()
