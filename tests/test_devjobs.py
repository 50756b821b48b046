"""Everyday developer jobs in a cell (issue 13), on real projects made here:
venvs and interpreters, the project root as worktree, the home's tool
configuration, failing fast without network, persistent caches."""
from __future__ import annotations

import json
import os
import shutil
import sys

import pytest

from devproject import make_project, make_venv

AGNSUP_VENV_BIN = os.path.dirname(sys.executable)


@pytest.fixture
def project(tmp_path):
    return make_project(str(tmp_path / "proj"))


@pytest.fixture
def outside_tmp():
    """A directory outside /tmp (a cell's /tmp is its own): for a home the cell must not see."""
    import tempfile
    d = tempfile.mkdtemp(prefix="agnsup-test-", dir="/var/tmp")
    os.chmod(d, 0o755)  # what lies in it (a local package index) is for any uid, as on a real host: a root
    yield d             # controller's cell is not host root (tests/test_doors_identity.py), mkdtemp's 0700 shuts it out
    shutil.rmtree(d, ignore_errors=True)


# -- interpreters and venvs ------------------------------------------------

def test_the_worktree_venv_is_on_path_and_runs_pytest(agnsup, project):
    cp = agnsup("run", "--", "pytest", "-q", cwd=project, check=0)
    assert "1 passed" in cp.out
    cp = agnsup("run", "--", "python", "-c", "import os, sys; print(sys.prefix); print(os.environ['VIRTUAL_ENV'])",
                cwd=project, check=0)
    assert cp.out.split() == [os.path.join(project, ".venv")] * 2


def test_agnsup_never_lends_the_cell_its_interpreter(agnsup, worktree):
    """No venv in the worktree: `python` is not agnsup's, and @runtime holds agnsup alone."""
    probe = ('p=$(command -v python); echo "python=$p"; echo "PATH=$PATH"; '
             'for d in $(echo "$PATH" | tr : " "); do ls "$d" 2>/dev/null | sed "s|^|$d/|"; done | '
             'grep -c "^/tmp/.agnsup/bin/"; command -v agnsup')
    cp = agnsup("run", "--workdir", worktree, "--", "sh", "-c", probe, check=0)
    lines = cp.out.splitlines()
    assert not lines[0].startswith(f"python={AGNSUP_VENV_BIN}"), lines[0]
    assert AGNSUP_VENV_BIN not in lines[1]
    assert lines[2] == "1" and lines[3] == "/tmp/.agnsup/bin/agnsup"
    # pip resolves to the system's, and agnsup's venv cannot be written through python -m pip either
    cp = agnsup("run", "--workdir", worktree, "--", "sh", "-c", f"touch {sys.prefix}/x 2>&1; echo $?", check=0)
    assert cp.out.strip().splitlines()[-1] != "0"


def test_the_host_virtual_env_and_path_never_reach_the_cell(agnsup, project, tmp_path):
    other = str(tmp_path / "other-venv")
    make_venv(other)
    env = {"VIRTUAL_ENV": other, "PATH": os.path.join(other, "bin") + ":" + os.environ["PATH"]}
    cp = agnsup("run", "--", "python", "-c", "import os, sys; print(sys.prefix, os.environ['VIRTUAL_ENV'])",
                cwd=project, env=env, check=0)
    assert cp.out.split() == [os.path.join(project, ".venv")] * 2
    os.makedirs(tmp_path / "plain")
    cp = agnsup("run", "--workdir", str(tmp_path / "plain"), "--", "sh", "-c", "echo ${VIRTUAL_ENV-unset}",
                env=env, check=0)
    assert cp.out.strip() == "unset"


def test_a_venv_whose_interpreter_is_in_the_hidden_home_runs(agnsup, outside_tmp):
    """pyenv/uv/conda: the venv's python links into the home; pyvenv.cfg names that prefix,
    which comes back read-only, and nothing else of the home does."""
    home = os.path.join(outside_tmp, "home")
    os.makedirs(home)
    prefix = os.path.join(home, ".pyenv-like", "3.x")
    os.makedirs(os.path.dirname(prefix))
    os.symlink(os.path.realpath(sys.base_prefix), prefix)
    with open(os.path.join(home, ".secret-token"), "w") as f:
        f.write("must-stay-hidden\n")
    ver = f"python{sys.version_info.major}.{sys.version_info.minor}"
    proj = make_project(os.path.join(outside_tmp, "work", "proj"), venv=False)
    make_venv(os.path.join(proj, ".venv"), python=os.path.join(prefix, "bin", ver))
    with open(os.path.join(proj, ".venv", "pyvenv.cfg")) as f:
        assert f"home = {prefix}/bin" in f.read()  # what the venv itself recorded
    probe = ("import os, sys; print(sys.version_info[0]); "
             f"print(os.path.exists({os.path.join(home, '.secret-token')!r})); "
             f"open({os.path.join(prefix, 'probe-write')!r}, 'w')")
    cp = agnsup("run", "--", "python", "-c", probe, cwd=os.path.join(proj, "tests"), env={"HOME": home})
    assert cp.out.splitlines()[:2] == ["3", "False"], cp.err
    assert "Read-only file system" in cp.err
    receipt = agnsup.json("receipts", "--json")[-1]
    assert prefix in receipt["isolation"]["home_exposed"]


# -- the worktree is the project root ---------------------------------------

def test_from_a_subdirectory_the_worktree_is_the_repository_root(agnsup, project):
    sub = os.path.join(project, "tests")
    cp = agnsup("run", "--", "sh", "-c", "pwd; touch ../at-root && echo wrote; ../.venv/bin/python -m pytest -q",
                cwd=sub, check=0)
    assert cp.out.splitlines()[:2] == [sub, "wrote"] and "1 passed" in cp.out
    assert os.path.exists(os.path.join(project, "at-root"))
    r = agnsup.json("receipts", "--json")[-1]
    assert (r["workdir"], r["worktree"]) == (sub, project)


def test_the_root_is_never_climbed_to_a_home(agnsup, outside_tmp):
    """A dotfiles repository in the home does not make the whole home the worktree."""
    home = os.path.join(outside_tmp, "home")
    make_project(home, venv=False)  # ~/.git
    wt = os.path.join(home, "scratch")
    os.makedirs(wt)
    cp = agnsup("run", "--", "sh", "-c", "touch ../x 2>/dev/null && echo wrote-home; touch y && echo ok",
                cwd=wt, env={"HOME": home}, check=0)
    assert cp.out.split() == ["ok"]
    assert agnsup.json("receipts", "--json")[-1]["worktree"] == wt


def test_overlapping_worktrees_are_one_lock(agnsup, tmp_path):
    """No marker anywhere: top/ and top/sub are two worktrees, but they share files."""
    top = tmp_path / "top"
    (top / "sub").mkdir(parents=True)
    holder = agnsup.popen("run", "--workdir", str(top), "--", "sh", "-c", "echo held; read x",
                          stdin=-1, stdout=-1, stderr=-1)
    try:
        assert holder.stdout.readline() == b"held\n"
        cp = agnsup("run", "--agent", "other", "--workdir", str(top / "sub"), "--lock-timeout", "0.3", "--", "true")
        assert cp.returncode == 75, cp.err
        assert f"overlapping {top}" in cp.err
        cp = agnsup("run", "--agent", "other", "--role", "readonly", "--workdir", str(top / "sub"), "--lock-timeout", "0.3",
                    "--", "true")
        assert cp.returncode == 75, cp.err  # a reader waits for a writer of an enclosing tree too
        os.makedirs(tmp_path / "beside")
        agnsup("run", "--workdir", str(tmp_path / "beside"), "--lock-timeout", "0.3", "--", "true", check=0)
    finally:
        holder.communicate(b"\n", timeout=30)
    assert holder.returncode == 0
    agnsup("run", "--workdir", str(top / "sub"), "--lock-timeout", "5", "--", "true", check=0)


def test_two_readers_of_overlapping_trees_share(agnsup, tmp_path):
    top = tmp_path / "top"
    (top / "sub").mkdir(parents=True)
    reader = agnsup.popen("run", "--role", "readonly", "--workdir", str(top), "--", "sh", "-c", "echo held; read x",
                          stdin=-1, stdout=-1, stderr=-1)
    try:
        assert reader.stdout.readline() == b"held\n"
        agnsup("run", "--role", "readonly", "--workdir", str(top / "sub"), "--lock-timeout", "0.3", "--", "true",
               check=0)
        cp = agnsup("run", "--agent", "other", "--workdir", str(top / "sub"), "--lock-timeout", "0.3", "--", "true")
        assert cp.returncode == 75, cp.err
    finally:
        reader.communicate(b"\n", timeout=30)


# -- the home's tool configuration ------------------------------------------

@pytest.fixture
def dev_home(outside_tmp):
    """A home outside /tmp with a git identity, hidden from cells as any home is."""
    from devproject import write_identity
    home = os.path.join(outside_tmp, "home")
    write_identity(home)
    with open(os.path.join(home, ".gitconfig"), "a") as f:
        f.write("[alias]\n\tst = status\n[credential]\n\thelper = store\n")
    return home


def test_git_commit_uses_the_identity_of_the_home(agnsup, dev_home, outside_tmp):
    proj = make_project(os.path.join(outside_tmp, "proj"), venv=False)
    cp = agnsup("run", "--", "sh", "-c", "git add -A && git commit -qm first && git log --format='%an <%ae>' && "
                "git config --get alias.st; git config --get credential.helper; echo end",
                cwd=os.path.join(proj, "tests"), env={"HOME": dev_home}, check=0)
    # identity only: the alias and the credential helper stay in the hidden home
    assert cp.out.split("\n")[:2] == ["Dev Eloper <dev@example.org>", "end"], cp.out + cp.err
    r = agnsup.json("receipts", "--json")[-1]
    assert r["isolation"]["home_config"]["git"]["taken"] == ["user.name", "user.email", "safe.directory"]


def test_home_allow_gitconfig_is_where_git_looks(agnsup, dev_home, outside_tmp, policy_dir):
    from conftest import write_role
    write_role(policy_dir, "gitall", filesystem__home_allow='["~/.gitconfig"]')
    proj = make_project(os.path.join(outside_tmp, "proj"), venv=False)
    cp = agnsup("run", "--role", "gitall", "--", "git", "config", "--get", "alias.st", cwd=proj,
                env={"HOME": dev_home, "AGNSUP_POLICY_DIR": str(policy_dir)}, check=0)
    assert cp.out.strip() == "status"


def test_a_repository_owned_by_another_uid_is_not_dubious_in_its_cell(agnsup, dev_home, outside_tmp):
    proj = make_project(os.path.join(outside_tmp, "proj"), venv=False)
    for d, dirs, files in os.walk(proj):
        for n in [d] + [os.path.join(d, x) for x in dirs + files]:
            os.lchown(n, 65534, 65534)
    from devproject import GIT
    import subprocess
    bare = subprocess.run([GIT, "status", "--short"], cwd=proj, capture_output=True, text=True,
                          env={"HOME": dev_home, "PATH": "/usr/bin:/bin"})
    assert "dubious ownership" in bare.stderr  # the control: git refuses it outside a cell
    cp = agnsup("run", "--", "git", "status", "--short", cwd=proj, env={"HOME": dev_home})
    assert cp.returncode == 0 and "dubious" not in cp.err, cp.err


def test_pip_uses_the_users_index_and_never_its_credentials(agnsup, dev_home, outside_tmp, project):
    from devproject import make_wheel_index
    index = make_wheel_index(os.path.join(outside_tmp, "index"))
    os.makedirs(os.path.join(dev_home, ".config", "pip"))
    with open(os.path.join(dev_home, ".config", "pip", "pip.conf"), "w") as f:
        f.write(f"[global]\nindex-url = {index}\nextra-index-url = https://bob:s3cr3t-pip@pypi.corp.example/simple\n"
                "client-cert = /home/bob/cert.pem\n")
    with open(os.path.join(dev_home, ".npmrc"), "w") as f:
        f.write("registry=https://npm.corp.example/\n//npm.corp.example/:_authToken=s3cr3t-npm\n")
    env = {"HOME": dev_home, "PIP_TRUSTED_HOST": "pypi.corp.example",
           "PIP_EXTRA_INDEX_URL": "https://bob:s3cr3t-env@pypi.corp.example/simple"}
    cp = agnsup("run", "--", "sh", "-c", "cat ~/.config/pip/pip.conf ~/.npmrc; env | grep -E '^(PIP|NPM)' | sort; "
                "python3 -m pip download -q --no-deps --no-cache-dir -d /tmp/dl agnsupdemo && ls /tmp/dl",
                cwd=project, env=env)
    assert cp.returncode == 0, cp.err
    assert "s3cr3t" not in cp.out + cp.err
    assert f"index-url = {index}" in cp.out and "registry=https://npm.corp.example/" in cp.out
    assert "PIP_TRUSTED_HOST=pypi.corp.example" in cp.out
    assert cp.out.rstrip().endswith("agnsupdemo-1.0-py3-none-any.whl")
    conf = agnsup.json("receipts", "--json")[-1]["isolation"]["home_config"]
    assert "global.extra-index-url (holds credentials)" in conf["pip"]["dropped"]
    assert "global.client-cert" in conf["pip"]["dropped"]
    assert conf["npm"] == {"taken": ["registry"], "dropped": ["//npm.corp.example/:..."]}
    assert conf["env"]["dropped"] == ["PIP_EXTRA_INDEX_URL (holds credentials)"]
    assert "s3cr3t" not in json.dumps(agnsup.json("receipts", "--json"))


# -- without network: fail fast and say why -------------------------------------

RESOLVE = ("import socket, sys\n"
           "for name in sys.argv[1:]:\n"
           "    try:\n"
           "        print(name, socket.getaddrinfo(name, 80)[0][4][0])\n"
           "    except socket.gaierror as e:\n"
           "        print(name, 'error', e.errno == socket.EAI_NONAME)\n")


def test_a_cell_without_network_finds_no_name_at_once(agnsup, worktree):
    """"Not found", not "try again" (what pip and npm retry for 10-70 s); /etc/hosts still works."""
    cp = agnsup("run", "--workdir", worktree, "--", "python3", "-c", RESOLVE, "pypi.org", "localhost", check=0)
    assert cp.out.splitlines() == ["pypi.org error True", "localhost 127.0.0.1"]
    cp = agnsup("run", "--workdir", worktree, "--", "sh", "-c",
                "head -1 /etc/resolv.conf; grep -c nameserver /etc/resolv.conf; grep '^hosts:' /etc/nsswitch.conf; "
                "echo $PIP_RETRIES $npm_config_fetch_retries $CARGO_NET_RETRY")
    # one server, which no cell can reach (a lookup fails at once and the kernel counts it: the network hint);
    # `files` again after `dns` makes the answer "not found"
    assert cp.out.splitlines() == ['# agnsup: role executor has no network (network.mode = "deny")', "1",
                                   "hosts: files dns files", "0 0 0"]


def test_a_failed_cell_without_network_says_which_role_allows_it(agnsup, worktree):
    cp = agnsup("run", "--workdir", worktree, "--", "python3", "-m", "pip", "download", "--no-cache-dir",
                "--no-deps", "-d", "/tmp/dl", "--index-url", "https://pypi.invalid.example/simple",
                "--find-links", "/nonexistent", "no-such-package-agnsup")
    assert cp.returncode != 0
    last = cp.err.strip().splitlines()[-1]
    assert last.startswith("agnsup: the cell ran without network: role executor has network.mode = \"deny\"")
    assert "--role networked" in last
    ok = agnsup("run", "--workdir", worktree, "--", "true", check=0)
    assert "without network" not in ok.err
    networked = agnsup("run", "--role", "networked", "--workdir", worktree, "--", "sh", "-c", "exit 3")
    assert networked.returncode == 3 and "without network" not in networked.err


# -- persistent package caches ---------------------------------------------------

def test_package_caches_persist_per_worktree_and_are_writable_only_there(agnsup, project, tmp_path):
    put = ("python3 -m pip cache dir; npm config get cache; "
           "echo one > ~/.cache/pip/marker; echo two > ~/.npm/marker; echo three > ~/.cargo/registry/marker")
    cp = agnsup("run", "--", "sh", "-c", put, cwd=project, check=0)
    assert cp.out.splitlines() == ["/tmp/home/.cache/pip", "/tmp/home/.npm"]
    caches = agnsup.json("receipts", "--json")[-1]["isolation"]["caches"]
    host = {c["cell"]: c["host"] for c in caches}
    assert set(host) == {"/tmp/home/.cache/pip", "/tmp/home/.npm", "/tmp/home/.cargo/registry",
                         "/tmp/home/.cargo/git"}
    assert all(h.startswith(os.path.join(agnsup.state, "caches", "worktree-")) for h in host.values())
    with open(os.path.join(host["/tmp/home/.cache/pip"], "marker")) as f:
        assert f.read() == "one\n"
    # the next cell of the project (from a subdirectory) finds them; the state root itself stays masked
    escape = os.path.join(agnsup.state, "caches", "escape")
    cp = agnsup("run", "--env", f"ESCAPE={escape}", "--", "sh", "-c",  # $ESCAPE: the kernel judges, not the gate
                'cat ~/.cache/pip/marker ~/.npm/marker ~/.cargo/registry/marker; touch "$ESCAPE" 2>/dev/null || '
                'echo masked', cwd=os.path.join(project, "tests"), check=0)
    assert cp.out.split() == ["one", "two", "three", "masked"] and not os.path.exists(escape)
    # another worktree has caches of its own; the readonly role keeps none
    other = tmp_path / "other"
    other.mkdir()
    cp = agnsup("run", "--workdir", str(other), "--", "sh", "-c", "cat ~/.cache/pip/marker 2>&1 || echo none",
                check=0)
    assert cp.out.strip().endswith("none")
    cp = agnsup("run", "--role", "readonly", "--", "sh", "-c", "cat ~/.cache/pip/marker 2>&1 || echo none",
                cwd=project, check=0)
    assert cp.out.strip().endswith("none")
