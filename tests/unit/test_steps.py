"""The leader's setup table (agnsup/process/steps.py), read without running it."""
from agnsup.process.steps import REFUSABLE, STEPS


def test_the_steps_run_from_the_dead_man_switch_to_execve_with_the_barrier_before_the_command():
    names = [name for name, _, _ in STEPS]
    assert names[0] == "pdeathsig" and names[-2:] == ["chdir", "exec"]
    assert names.count("barrier") == 1 and names.index("seccomp") == names.index("barrier") - 1  # confined, waits
    # a PID namespace's init takes the command's confinement and starts it at "exec": after a credential change
    # (cell_user, user) its parent-death signal and non-dumpable flag are set again, before it is confined further
    assert names.index("user") + 1 == names.index("after_credentials") < names.index("no_new_privs")
    assert "init" not in names  # no fork of the init: posix_spawn at "exec"


def test_a_host_refusing_namespaces_is_recognised_at_the_steps_that_make_them_and_the_controllers_two():
    assert REFUSABLE == {"unshare", "mounts", "proc", "confinement", "pid_namespace"}


def _report_of_a_failed_spawn(err: OSError) -> tuple[bytes, int]:
    """(the setup report, the exit code) of a PID namespace's init whose posix_spawn of the command raised `err`."""
    import os
    from types import SimpleNamespace
    from unittest import mock

    from agnsup.process import steps
    r, w = os.pipe()
    spec = SimpleNamespace(exe="/bin/true", argv=["true"], env={})
    s = SimpleNamespace(err_w=w, status_w=None, plan=SimpleNamespace(pid_namespace=True, spec=spec))
    pid = os.fork()
    if pid == 0:  # steps.child never returns: it reports and exits
        try:
            os.close(r)
            with mock.patch.object(steps, "STEPS", (("exec", steps._exec, False),)), \
                    mock.patch.object(os, "posix_spawn", side_effect=err), \
                    mock.patch.object(steps.pidinit, "block_signals", lambda: None):
                steps.child(s)
        finally:
            os._exit(99)
    os.close(w)
    try:
        report = os.read(r, 512)
    finally:
        os.close(r)
    return report, os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def test_an_init_that_cannot_make_the_commands_process_reports_step_init_not_the_commands_execve():
    import errno
    report, code = _report_of_a_failed_spawn(OSError(errno.EAGAIN, "Resource temporarily unavailable"))
    assert report.split(b"\0")[:2] == [b"init", str(errno.EAGAIN).encode()] and code == 125
    report, code = _report_of_a_failed_spawn(OSError(errno.ENOENT, "No such file or directory"))
    assert report.split(b"\0")[:2] == [b"exec", str(errno.ENOENT).encode()] and code == 127
