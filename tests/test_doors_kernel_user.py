"""Issue 25's kernel doors for a normal user running agnsup (its cells live in a user namespace of their own).

The same probes as tests/test_doors_kernel.py, with the bait the user's own: SysV objects and a POSIX
queue the user made (0600, so only its own cells could reach them), and a key in a fresh session keyring
the user's agnsup inherits (on 215dff3 the cell read it through the inherited session keyring). The
user, its delegated cgroup2 subtree and its venv come from tests/test_unprivileged.py.
"""
import os

import pytest

from agnsup.selftest import doors_kernel as dk
from test_doors_kernel import refused
from test_unprivileged import User, _venv

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="ENV_BLOCKED: root (the test makes a user)")

# Joins a fresh anonymous session keyring, puts a key holding a marker in it, and execs agnsup with
# @KEYID@ in its argv replaced by the key's serial (what a hostile cell would have to guess)
KEYRING_LAUNCHER = r'''
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
keyctl, add_key = {"x86_64": (250, 248), "aarch64": (219, 217)}[os.uname().machine]
desc, marker = sys.argv[1].encode(), sys.argv[2].encode()
if libc.syscall(keyctl, 1, None) < 0:  # KEYCTL_JOIN_SESSION_KEYRING, anonymous
    sys.exit("join_session_keyring: " + os.strerror(ctypes.get_errno()))
key = libc.syscall(add_key, b"user", desc, marker, len(marker), -3)  # KEY_SPEC_SESSION_KEYRING
if key < 0:
    sys.exit("add_key: " + os.strerror(ctypes.get_errno()))
argv = [a.replace("@KEYID@", str(key)) for a in sys.argv[3:]]
os.execv(argv[0], argv)
'''


@pytest.fixture(scope="module")
def user():
    with User(_venv()) as u:
        u.wt = u.own_dir("wt")
        yield u


def run(user, probe: str, *args, role: str = "executor", launcher=()):
    return user("run", "--role", role, "--workdir", user.wt, "--", "python3", "-c", probe, *args, launcher=launcher)


@pytest.mark.parametrize("role", ("readonly", "executor"))
def test_a_normal_users_cell_cannot_reach_the_users_own_sysv_ipc_or_posix_queues(user, role):
    ipc = dk.HostIpc(uid=user.uid)
    try:
        cp = run(user, dk.P_HOST_IPC, *ipc.probe_args(), role=role)
        after = ipc.segment()
    finally:
        ipc.close()
    refused(cp)
    assert after == ipc.marker.encode()


@pytest.mark.parametrize("role", ("readonly", "executor"))
def test_a_normal_users_cell_cannot_read_the_inherited_session_keyring_nor_add_keys(user, role):
    desc, marker = "agnsup-door-user-" + os.urandom(4).hex(), "agnsup-key-" + os.urandom(4).hex()
    launcher = (user.python, "-c", KEYRING_LAUNCHER, desc, marker)
    cp = run(user, dk.P_KEYRING, "@KEYID@", desc, desc + "-planted", marker, role=role, launcher=launcher)
    refused(cp)


def test_a_normal_users_cell_gets_no_vsock_and_no_userfaultfd_perf_or_personality(user):
    refused(run(user, dk.P_SOCKET_FAMILIES))
    refused(run(user, dk.P_SYSCALLS))


def test_a_normal_users_cell_sees_pid_1_by_its_own_name_only(user):
    state = os.path.join(user.home, ".local", "state", "agnsup")
    leaks = [state, user.agnsup, os.path.dirname(user.agnsup)]
    args = [p for s in leaks for p in (s[:len(s) // 2], s[len(s) // 2:])]
    refused(run(user, dk.P_PID1_ARGV, *args))


@pytest.mark.skipif(dk.host_address() is None, reason="ENV_BLOCKED: this host has no address beyond loopback")
def test_a_normal_users_proxy_refuses_the_hosts_own_address_even_with_allow_private(user):
    from conftest import write_role
    policies = os.path.join(user.home, "policies")  # readable by the user (pytest's tmp_path is not)
    os.makedirs(policies, exist_ok=True)
    write_role(policies, "anyprivate", network__mode='"allowlist"', network__allow='["*:*"]',
               network__allow_private="true")
    addr = dk.host_address()
    own = dk.Listener(addr)
    try:
        env = {**user.env, "AGNSUP_POLICY_DIR": str(policies)}
        cp = user("run", "--role", "anyprivate", "--workdir", user.wt, "--", "python3", "-c", dk.P_PROXY_HOST,
                  addr, str(own.port), env=env)
    finally:
        own.close()
    refused(cp)
    assert own.accepted == [], f"the host's own {addr} was reached from a normal user's cell: {own.accepted}"
    receipts = user.json("receipts", "--json")
    [c] = max(receipts, key=lambda r: r["ended_at"] or "")["network"]["connections"]
    assert (c["decision"], c["rule"]) == ("refused", "address:host"), c
