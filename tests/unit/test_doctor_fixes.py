"""doctor's fixes: which fix for which evidence (issue 27: in a container the fix is the container's flags,
never "a kernel with the new mount API" on a new kernel, never "single-threaded or root" to root, never
"unset AGNSUP_CGROUP_LAYOUT" where that changes nothing). Pure logic, no root."""
import errno

from agnsup.doors import doctor


def ev(**kw) -> dict:
    base = {"root": True, "container": [], "seccomp_filter": False, "caps_missing": [], "cgroup_off": False,
            "cgroup_writable": True, "kernel": "6.18.0"}
    return {**base, **kw}


DEFAULT_DOCKER = ev(container=["docker"], seccomp_filter=True, caps_missing=["SYS_ADMIN", "NET_ADMIN"],
                    cgroup_off=True, cgroup_writable=False)
RECIPE_DOCKER = ev(container=["docker", "cgroup namespace"], seccomp_filter=False, caps_missing=["NET_ADMIN"])


def test_a_default_docker_container_is_told_the_container_flag_and_the_reduced_key():
    for step in ("pid_namespace", "confinement", "unshare", "mount"):
        fix = doctor.fix_for(step, DEFAULT_DOCKER, errno.EPERM)
        assert "--cap-add SYS_ADMIN" in fix and "isolation.reduced" in fix, (step, fix)
        assert "kernel" not in fix and "single-threaded" not in fix, fix
    assert 'isolation.reduced = ["pid_namespace"]' in doctor.fix_for("pid_namespace", DEFAULT_DOCKER)
    assert 'isolation.reduced = ["mount_namespace"]' in doctor.fix_for("confinement", DEFAULT_DOCKER)


def test_the_recipe_container_without_net_admin_is_told_net_admin_for_the_loopback():
    fix = doctor.fix_for("loopback", RECIPE_DOCKER, errno.EPERM)
    assert "--cap-add NET_ADMIN" in fix and 'isolation.reduced = ["network_namespace"]' in fix, fix
    assert "CAP_NET_ADMIN" in fix


def test_sys_admin_given_but_the_seccomp_profile_still_refuses_names_seccomp_unconfined():
    fix = doctor.fix_for("pid_namespace", ev(container=["podman"], seccomp_filter=True), errno.EPERM)
    assert "--security-opt seccomp=unconfined" in fix and "--cap-add" not in fix, fix


def test_kubernetes_gets_the_pod_spec_equivalents():
    k8s = ev(container=["kubernetes"], seccomp_filter=True, caps_missing=["SYS_ADMIN"])
    assert 'capabilities.add: ["SYS_ADMIN"]' in doctor.fix_for("mount", k8s)
    assert "seccompProfile.type: Unconfined" in doctor.fix_for("mount", {**k8s, "caps_missing": []})
    assert "cgroup v2" in doctor.cgroup_fix({**k8s, "cgroup_writable": False})


def test_outside_a_container_a_seccomp_filter_is_named_not_the_kernel():
    fix = doctor.fix_for("mount", ev(seccomp_filter=True), errno.EPERM)
    assert "seccomp filter on this process" in fix and "kernel" not in fix and "--cap-add" not in fix, fix


def test_a_root_process_without_cap_sys_admin_outside_a_container():
    fix = doctor.fix_for("pid_namespace", ev(caps_missing=["SYS_ADMIN"]), errno.EPERM)
    assert "CAP_SYS_ADMIN" in fix and "single-threaded" not in fix and "--cap-add" not in fix, fix


def test_a_normal_user_keeps_runs_user_namespace_fix_outside_a_container():
    assert doctor.fix_for("user_namespace", ev(root=False)) is None
    assert doctor.fix_for("mount", ev(root=False)) is None
    # in a container under a seccomp profile: the container's flag
    assert "seccomp=unconfined" in doctor.fix_for("mount", ev(root=False, container=["docker"], seccomp_filter=True))


def test_an_error_that_is_no_refusal_gets_no_invented_fix():
    assert doctor.fix_for("pid_namespace", DEFAULT_DOCKER, errno.ENOMEM) is None
    assert doctor.fix_for("exec", DEFAULT_DOCKER, errno.EPERM) is None


def test_no_cgroup_fallback_is_not_told_to_unset_the_override_when_that_changes_nothing():
    fix = doctor.cgroup_fix(DEFAULT_DOCKER)
    assert "--cgroupns=private" in fix and "AGNSUP_CGROUP_LAYOUT" not in fix, fix
    # where cgroups would be writable, the override is the cause: the backend's own fix stands
    assert doctor.cgroup_fix(ev(cgroup_off=True, cgroup_writable=True)) is None
    assert doctor.cgroup_fix(ev(cgroup_off=False, cgroup_writable=True)) is None
    assert doctor.fix_for("cgroup", DEFAULT_DOCKER) == fix


def test_container_kinds_from_each_marker():
    files = {"/.dockerenv": True, "/run/.containerenv": True}
    kinds = doctor.container_kinds({"KUBERNETES_SERVICE_HOST": "10.0.0.1"},
                                   read=lambda p: "PATH=/bin\0container=lxc\0" if p == "/proc/1/environ" else None,
                                   exists=lambda p: files.get(p, False))
    assert kinds == ["docker", "podman", "kubernetes", "container=lxc"]
    assert doctor.container_kinds({}, read=lambda p: None, exists=lambda p: False) == []


def test_capabilities_and_seccomp_mode_from_proc_status():
    status = "Name:\tx\nCapEff:\t00000000a80425fb\nSeccomp:\t2\nSeccomp_filters:\t1\n"
    cap, mode = doctor._caps(status)
    assert mode == 2 and not cap >> doctor.CAP_SYS_ADMIN & 1 and not cap >> doctor.CAP_NET_ADMIN & 1
    cap, mode = doctor._caps("CapEff:\t000001ffffffffff\nSeccomp:\t0\n")
    assert mode == 0 and cap >> doctor.CAP_SYS_ADMIN & 1


def test_a_refusal_line_and_its_own_fix_are_split():
    assert doctor._split_fix("cell setup failed at step 'x': EPERM; fix: do y") == (
        "cell setup failed at step 'x': EPERM", "do y")
    assert doctor._split_fix("cell setup failed at step 'x': EPERM") == ("cell setup failed at step 'x': EPERM", None)


def test_the_text_names_each_role_that_did_not_run_with_its_step_error_and_fix():
    r = {"probed": True, "cells": {
        "executor": {"ran": False, "step": "loopback", "error": "cell setup failed at step 'loopback': EPERM",
                     "fix": "run the container with --cap-add NET_ADMIN", "seconds": 0.1},
        "networked": {"ran": True, "seconds": 0.05}}}
    lines = doctor.cells_text(r)
    assert "  role executor: cell setup failed at step 'loopback': EPERM; fix: run the container with --cap-add " \
           "NET_ADMIN" in lines
    assert any(line.startswith("  role networked: ran") for line in lines)
    assert doctor.cells_text({"probed": False}) == ["cells:           not probed (--no-probe)"]


def test_a_network_namespace_refused_for_want_of_sys_admin_names_sys_admin_and_the_loopbacks_net_admin():
    fix = doctor.fix_for("network", DEFAULT_DOCKER, errno.EPERM)
    assert "--cap-add SYS_ADMIN --cap-add NET_ADMIN" in fix and 'isolation.reduced = ["network_namespace"]' in fix
    k8s = {**DEFAULT_DOCKER, "container": ["kubernetes"]}
    assert 'capabilities.add: ["SYS_ADMIN", "NET_ADMIN"]' in doctor.fix_for("network", k8s)


def test_the_reduced_key_in_a_fix_names_every_piece_the_host_refuses():
    refused = {**DEFAULT_DOCKER, "refused": ["mount_namespace", "network_namespace", "pid_namespace", "cgroup"]}
    fix = doctor.fix_for("confinement", refused, errno.EPERM)
    assert 'isolation.reduced = ["mount_namespace", "network_namespace", "pid_namespace", "cgroup"]' in fix, fix
    # a step whose piece the host does not refuse as a whole (a loopback): that piece alone
    assert 'isolation.reduced = ["network_namespace"]' in doctor.fix_for("loopback", {**RECIPE_DOCKER, "refused": []})
