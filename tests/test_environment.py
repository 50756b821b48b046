"""The environment is built from nothing: no host PATH, no host secrets."""
import json
import os
import stat

CANARIES = ["python3", "sh", "bash", "env", "sleep", "kill", "ip", "mount", "unshare", "setsid", "cat", "true",
            "ls", "id", "sudo", "nsenter"]


def make_canary_bin(d, marker):
    os.makedirs(d, exist_ok=True)
    for name in CANARIES:
        p = os.path.join(d, name)
        with open(p, "w") as f:
            f.write(f"#!/bin/sh\necho DIRECT_BYPASS_DETECTED {name} >> {marker}\necho '{{\"bypass\":true}}'\nexit 127\n")
        os.chmod(p, 0o755)


def test_a_canary_path_first_on_the_host_path_never_runs(agnsup, worktree, tmp_path):
    canary, marker = str(tmp_path / "canary-bin"), str(tmp_path / "marker")
    make_canary_bin(canary, marker)
    host_path = canary + ":" + os.environ["PATH"]
    cp = agnsup("run", "--workdir", worktree, "--", "sh", "-c", "env; python3 -c 'print(42)'; true; id -u",
                env={"PATH": host_path}, check=0)
    assert "42" in cp.out
    assert "bypass" not in cp.out
    assert not os.path.exists(marker), "canary ran"
    path_line = [line for line in cp.out.splitlines() if line.startswith("PATH=")][0]
    assert canary not in path_line


def test_the_cells_environ_is_exactly_the_declared_set(agnsup, worktree, tmp_path):
    host = {"AGNSUP_CANARY_SECRET": "must-never-reach-cell", "OPENAI_API_KEY": "sk-canary-marker",
            "AWS_SECRET_ACCESS_KEY": "aws-canary-marker", "LANG": "C.UTF-8", "TERM": "xterm"}
    out = tmp_path / "environ"
    cp = agnsup("run", "--workdir", worktree, "--cell", "envcheck", "--env", "EXTRA=1", "--",
                "sh", "-c", f"cat /proc/$$/environ > /tmp/e; cp /tmp/e {worktree}/environ", env=host, check=0)
    del cp
    with open(os.path.join(worktree, "environ"), "rb") as f:
        raw = f.read()
    env = dict(item.split(b"=", 1) for item in raw.split(b"\0") if item)
    env = {k.decode(): v.decode() for k, v in env.items()}
    receipt = json.loads(agnsup("receipts", "--cell", "envcheck", "--json", check=0).out)[0]
    # /proc/self/environ is what sh was given, exactly the receipt's declared keys
    assert sorted(env) == receipt["env_keys"]
    # plus the pip/npm index settings of the host's environment (toolconfig.ENV_KEYS, without credentials)
    from agnsup import toolconfig
    # and, without network, the package managers' no-retry settings (spec.OFFLINE_ENV)
    from agnsup.spec import OFFLINE_ENV
    tool_keys = toolconfig.host_env(toolconfig.TOOLS, os.environ)[0]
    assert set(env) == {"PATH", "HOME", "TMPDIR", "LANG", "TERM", "AGNSUP_RUN_ID", "AGNSUP_AGENT_ID",
                        "AGNSUP_CELL_ID", "AGNSUP_CELL_TOKEN", "EXTRA", *tool_keys, *OFFLINE_ENV}
    assert all(env[k] == v for k, v in tool_keys.items())
    for value in host.values():
        if value not in ("C.UTF-8", "xterm"):
            assert value not in raw.decode()
    assert env["HOME"].startswith("/tmp") and env["TMPDIR"] == "/tmp"
    assert receipt["env"]["AGNSUP_CELL_TOKEN"] == "<redacted>"
    out.write_text("")


def test_a_secret_arrives_only_by_an_explicit_env_option(agnsup, worktree):
    cp = agnsup("run", "--workdir", worktree, "--env", "OPENAI_API_KEY", "--", "sh", "-c", "echo $OPENAI_API_KEY",
                env={"OPENAI_API_KEY": "sk-explicit"}, check=0)
    assert cp.out.strip() == "sk-explicit"


def test_a_role_may_never_pass_path(agnsup, worktree, policy_dir):
    from conftest import write_role
    write_role(policy_dir, "leaky", env__pass='["PATH"]')
    cp = agnsup("run", "--role", "leaky", "--workdir", worktree, "--", "true",
                env={"AGNSUP_POLICY_DIR": str(policy_dir)}, check=125)
    assert "leaky.toml" in cp.err and "env.pass" in cp.err and "PATH" in cp.err
    assert len(cp.err.strip().splitlines()) == 1


def test_the_command_is_resolved_on_the_cells_path_not_the_hosts(agnsup, worktree, tmp_path):
    d = tmp_path / "hostonly"
    d.mkdir()
    tool = d / "only-on-host-path"
    tool.write_text("#!/bin/sh\necho ran\n")
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    cp = agnsup("run", "--workdir", worktree, "--", "only-on-host-path",
                env={"PATH": f"{d}:{os.environ['PATH']}"}, check=127)
    assert "not found on the cell's PATH" in cp.err
