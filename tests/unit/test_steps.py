"""The leader's setup table (agnsup/process/steps.py), read without running it."""
from agnsup.process.steps import REFUSABLE, STEPS


def test_the_steps_run_from_the_dead_man_switch_to_execve_with_the_barrier_before_the_command():
    names = [name for name, _, _ in STEPS]
    assert names[0] == "pdeathsig" and names[-2:] == ["chdir", "exec"]
    assert names.index("seccomp") == names.index("barrier", names.index("init")) - 1  # confined, then it waits
    assert names.index("barrier") < names.index("init")  # a PID namespace's init waits before forking the command


def test_a_host_refusing_namespaces_is_recognised_at_the_steps_that_make_them_and_the_controllers_two():
    assert REFUSABLE == {"unshare", "mounts", "proc", "confinement", "pid_namespace"}
