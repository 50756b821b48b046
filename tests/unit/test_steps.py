"""The leader's setup table (agnsup/process/steps.py), read without running it."""
from agnsup.process.steps import REFUSABLE, STEPS


def test_the_steps_run_from_the_dead_man_switch_to_execve_with_the_barrier_before_the_command():
    names = [name for name, _, _ in STEPS]
    assert names[0] == "pdeathsig" and names[-2:] == ["chdir", "exec"]
    assert names.count("barrier") == 1 and names.index("seccomp") == names.index("barrier") - 1  # confined, waits
    # a PID namespace's init takes the command's confinement and starts it at "exec": after a credential change
    # (cell_user, user) its parent-death signal and non-dumpable flag are set again, before it is confined further
    assert names.index("user") + 1 == names.index("init_guard") < names.index("no_new_privs")
    assert "init" not in names  # no fork of the init: posix_spawn at "exec"


def test_a_host_refusing_namespaces_is_recognised_at_the_steps_that_make_them_and_the_controllers_two():
    assert REFUSABLE == {"unshare", "mounts", "proc", "confinement", "pid_namespace"}
