"""The offline resolver's files (compiler._offline_resolver), bound read-only over /etc/resolv.conf and
/etc/nsswitch.conf of a cell without network, come from one copy under <state>/offline named by its content,
written once for every cell that binds the same text (issue 29, third round: not two directories and two files
made and removed on the state root's disk per cell). Shared, so no cell may change it.

Three things keep a cell from writing the copy: the bind is read-only, the file's mode is 0444 (the cell has no
CAP_DAC_OVERRIDE) and Landlock allows no write under /etc. Checked to fail: with the offline clones made writable
(the fourth field of the "clone" op False) the mount-options assertion fails; with that and the mode 0666 the write
is still refused (Landlock: Permission denied), so the write assertions alone do not see one layer go."""
import os

from agnsup.supervisor import Supervisor


def test_cells_share_one_read_only_copy_of_the_offline_resolver_and_cannot_change_it(state, worktree):
    with Supervisor(state) as sup:
        r1 = sup.run(["sh", "-c", "echo nameserver 1.1.1.1 > /etc/resolv.conf; echo wrote=$?"], run_id="off",
                     workdir=worktree, capture=True)
        r2 = sup.run(["sh", "-c", "cat /etc/resolv.conf; grep ' /etc/resolv.conf ' /proc/self/mountinfo"],
                     run_id="off", workdir=worktree, capture=True)
    assert r1["exit_code"] == 0 and "wrote=0" not in r1["stdout"], r1
    assert "nameserver 192.0.2.1" in r2["stdout"] and "1.1.1.1" not in r2["stdout"], r2
    mount = [line.split() for line in r2["stdout"].splitlines() if " /etc/resolv.conf " in line]
    assert mount and mount[0][5].split(",")[0] == "ro", r2["stdout"]  # mountinfo's field 6: the mount's options
    shared = os.listdir(os.path.join(state, "offline"))
    resolv = [n for n in shared if n.endswith("-resolv.conf")]
    assert len(resolv) == 1 and not any(n.endswith(".tmp") for n in shared), shared  # one copy for both cells
    with open(os.path.join(state, "offline", resolv[0])) as f:
        text = f.read()
    assert "nameserver 192.0.2.1" in text and "1.1.1.1" not in text, text
