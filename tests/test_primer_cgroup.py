"""The cgroup lock's primer against the kernel (process/primer.py): a Supervisor's writes of its zombie into
agnsup's own base cgroup.procs reach the kernel (taken on a hybrid host; refused after the kernel's lock on a
pure-v2 one, whose base has controllers: the no-internal-process rule) and move nothing. Its unit tests (tests/unit/test_primer.py)
check the order and the exited check over a plain file; here the file is the kernel's.

Checked to fail: with Primer._exited answering True and a live `sleep` as the primer's child, the write moves
that sleep into the base directory and the first assertion on its cgroup.procs fails."""
import os

from agnsup.process import primer
from agnsup.supervisor import Supervisor


def test_a_supervisor_primes_through_the_kernel_and_moves_nothing(state, worktree, monkeypatch):
    taken, touch = [], primer.Primer.touch

    def recorded(self):
        ok = touch(self)
        taken.append((ok, self.procs_file, self.refused))
        return ok
    monkeypatch.setattr(primer.Primer, "touch", recorded)
    with Supervisor(state) as sup:
        for _ in range(3):  # a named run: its pod lingers, so the base directory stays between the cells
            assert sup.run(["true"], workdir=worktree, run_id="primed")["exit_code"] == 0
            zombie = sup._forker.primer.pid
        written = [f for ok, f, _ in taken if ok]
        assert written, f"no prime reached the kernel: {taken}"
        procs = written[0]
        assert os.path.basename(procs) == "cgroup.procs" and procs.startswith("/sys/fs/cgroup/"), procs
        with open(procs) as f:
            assert f.read().split() == [], "a process was moved into agnsup's base directory"
        # the zombie written is still ours and exited: nothing else could have been given its number
        if zombie is not None:
            info = os.waitid(os.P_PID, zombie, os.WEXITED | os.WNOWAIT | os.WNOHANG)
            assert info is None or info.si_pid == zombie
