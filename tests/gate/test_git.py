"""The git zone: commands that destroy history or uncommitted work, named rules, through wrappers."""

import os
import shutil
import subprocess

import pytest

from agnsup import governance, policyfile, policy
from agnsup.util import record
from agnsup.errors import PolicyError
from agnsup.gate import GateContext, check, git, judge_shell
from agnsup.gate.commands import analyze_shell

CTX = GateContext(role="dev", mode="open", network="host", worktree="/workspace/project", writable=("/",),
                  home="/home/user")

DESTRUCTIVE = [
    ("git push --force", "force_push"), ("git push -f origin main", "force_push"),
    ("git push -uf origin feature", "force_push"), ("git push --force=true origin main", "force_push"),
    ("git push origin +main", "force_push"), ("git push origin +HEAD:refs/heads/main", "force_push"),
    ("git push --mirror backup", "force_push"), ("git push --force-with-lease origin main", "force_push"),
    ("git push --force-with-lease", "force_push"), ("git push --force-with-lease origin HEAD", "force_push"),
    ("git push --force-with-lease origin feature:master", "force_push"),
    ("git reset --hard", "reset_hard"), ("git reset --hard HEAD~5", "reset_hard"),
    ("git reset -q --hard origin/main", "reset_hard"),
    ("git clean -fdx", "clean"), ("git clean -f", "clean"), ("git clean --force -d", "clean"),
    ("git checkout -- .", "discard_worktree"), ("git checkout .", "discard_worktree"),
    ("git checkout HEAD -- src/", "discard_worktree"), ("git checkout -f main", "discard_worktree"),
    ("git checkout -- '*.py'", "discard_worktree"), ("git restore .", "discard_worktree"),
    ("git restore --worktree --staged .", "discard_worktree"), ("git restore --source=HEAD~3 :/", "discard_worktree"),
    ("git switch --discard-changes main", "discard_worktree"),
    ("git branch -D feature", "branch_force_delete"), ("git branch -d -f feature", "branch_force_delete"),
    ("git branch --delete --force feature", "branch_force_delete"),
    ("git stash drop", "stash_drop"), ("git stash drop stash@{2}", "stash_drop"), ("git stash clear", "stash_drop"),
    ("git filter-branch --tree-filter 'rm -f x' HEAD", "history_rewrite"),
    ("git filter-repo --path secrets --invert-paths", "history_rewrite"), ("git-filter-repo --force", "history_rewrite"),
    ("git reflog expire --expire=now --all", "reflog_expire"),
    ("git reflog expire --expire-unreachable=now --all", "reflog_expire"), ("git reflog delete HEAD@{1}", "reflog_expire"),
    ("git gc --prune=now", "gc_prune"), ("git gc --aggressive --prune=all", "gc_prune"), ("git prune", "gc_prune"),
    ("git update-ref -d refs/heads/main", "update_ref_delete"),
    # a branch or tag deleted on the remote, in every spelling git accepts
    ("git push origin :main", "remote_delete"), ("git push origin :refs/heads/x", "remote_delete"),
    ("git push origin :refs/tags/v1", "remote_delete"), ("git push origin +:x", "remote_delete"),
    ("git push origin main :old feature", "remote_delete"), ("git push origin -- :x", "remote_delete"),
    ("git push origin --delete main", "remote_delete"), ("git push -d origin main", "remote_delete"),
    ("git push origin x --delete", "remote_delete"), ("git push --delete origin tag v1", "remote_delete"),
    ("git push -fd origin x", "remote_delete"), ("git push -vd origin x", "remote_delete"),
    ("git push --del origin x", "remote_delete"), ("git push --de origin x", "remote_delete"),
    ("git push --no-delete --delete origin x", "remote_delete"), ("git push origin :\"$BRANCH\"", "remote_delete"),
    ("git push --force-with-lease origin :main", "remote_delete"),
    ("git push --prune origin", "remote_delete"), ("git push --all --prune origin", "remote_delete"),
    ("git push --tags --prune", "remote_delete"),
    ("git push --pru origin 'refs/heads/*:refs/heads/*'", "remote_delete"),
    ("git -c remote.origin.push=:refs/heads/main push", "remote_delete"),
    ("git -c remote.origin.push=:refs/heads/main push origin", "remote_delete"),
    ("git -c remote.origin.push=+refs/heads/*:refs/heads/* push", "force_push"),
    ("git -c remote.origin.push=refs/heads/a:refs/heads/a -c remote.origin.push=:refs/heads/b push", "remote_delete"),
    ("git -c remote.origin.mirror=true push origin", "force_push"), ("git push --mir backup", "force_push"),
    ("GIT_CONFIG_COUNT=1 GIT_CONFIG_KEY_0=remote.origin.push GIT_CONFIG_VALUE_0=:main git push", "remote_delete"),
    ("GIT_CONFIG_PARAMETERS=\"'remote.origin.push'=':refs/heads/z'\" git push", "remote_delete"),
    ("env GIT_CONFIG_PARAMETERS=\"'remote.origin.push=+main'\" git push origin", "force_push"),
    ("sudo GIT_CONFIG_COUNT=1 GIT_CONFIG_KEY_0=remote.origin.push GIT_CONFIG_VALUE_0=:x git push", "remote_delete"),
    ("git --config-env=remote.origin.push=REFSPEC push", "force_push"),
    ("git -c alias.del='push origin --delete' del x", "remote_delete"), ("git-push origin :x", "remote_delete"),
    ("git branch -r | xargs -n1 git push origin --delete", "remote_delete"),
    ("for b in a b; do git push origin :$b; done", "remote_delete"),
    ("git send-pack origin :refs/heads/main", "remote_delete"), ("git send-pack --mirror host:repo", "force_push"),
    ("git http-push -d https://host/repo.git x", "remote_delete"),
    # what sets up such a push: the later plain `git push` shows nothing of it
    ("git config remote.origin.push :refs/heads/main", "remote_delete"),
    ("git config set remote.origin.push :main", "remote_delete"),
    ("git config --add remote.origin.push '+refs/heads/*:refs/heads/*'", "force_push"),
    ("git config remote.backup.mirror true", "force_push"), ("git remote add --mirror=push backup url", "force_push"),
]

WRAPPERS = [
    "git -C /workspace/other reset --hard", "git --git-dir=.git --work-tree=. reset --hard",
    "git -c core.autocrlf=false reset --hard", "git --no-pager -p reset --hard", "env GIT_DIR=.git git reset --hard",
    "sudo -u dev git reset --hard", "sh -c 'git reset --hard'", "bash -lc \"cd repo && git reset --hard\"",
    "git -c alias.nuke='reset --hard' nuke", "git -c alias.wipe='clean -fdx' wipe",
    "git -c alias.a='reset' -c alias.b='a --hard' b", "/usr/bin/git reset --hard", "\\git reset --hard",
    "timeout 10 git reset --hard", "echo y | git reset --hard", "git status && git reset --hard",
    "echo $(git reset --hard)", "xargs git reset --hard < /dev/null", "nohup git reset --hard &",
    "G=git; $G reset --hard", "find . -name .git -execdir git reset --hard \\;",
    "sudo GIT_DIR=.git git reset --hard", "sudo -E -u dev GIT_DIR=.git git reset --hard",
]

SAFE = [
    "git status", "git log --oneline -10", "git diff HEAD~1", "git push", "git push origin main",
    "git push -u origin feature", "git push --force-with-lease origin feature/x",
    "git push --force-with-lease=feature:abc123 origin feature", "git push --force-if-includes --force-with-lease origin topic",
    "git push --dry-run --force origin main", "git push -nf origin main", "git reset --soft HEAD~1", "git reset HEAD~1",
    "git reset --keep HEAD~1", "git clean -n -fd", "git clean --dry-run -fdx", "git clean -fdn",
    "git checkout main", "git checkout -b new-feature", "git checkout -- file.txt", "git checkout HEAD -- README.md",
    "git restore file.txt", "git restore --staged .", "git restore -S src/", "git switch main",
    "git branch -d merged", "git branch -a", "git stash", "git stash pop", "git stash apply", "git stash list",
    "git gc", "git gc --prune=2.weeks.ago", "git prune --dry-run", "git prune -n", "git remote prune origin",
    "git worktree prune", "git reflog", "git reflog expire --expire=90.days.ago --all", "git update-ref HEAD abc",
    'git commit -m "git reset --hard fixed"', "echo 'git push --force'", "grep -r 'reset --hard' docs",
    "git -c alias.st=status st", "git --version", "git help reset",
    # remote-tracking refs and tags are local: the next fetch restores them
    "git remote prune origin", "git fetch --prune", "git pull --prune", "git branch -dr origin/x",
    "git branch -Dr origin/x", "git branch --delete --remotes origin/x", "git tag -d v1", "git tag --delete v1",
    "git remote remove origin", "git remote add origin git@github.com:a/b.git", "git remote add --mirror=fetch b url",
    # pushes that delete nothing
    "git push origin :", "git push --tags", "git push --all origin", "git push --follow-tags", "git push origin tag v1",
    "git push -o ci.skip origin main", "git push -uo ci.skip origin main", "git push --no-prune origin",
    "git push --prune --no-prune origin", "git push -d --no-delete origin x", "git push origin main:",
    "git push origin ^refs/heads/x", "git push origin \"$BRANCH\"", "git push --recurse-submodules check origin main",
    "git push -n --delete origin x", "git push --dry-run --mirror backup", "git push --dry --prune origin",
    "git push -d origin",  # git refuses: --delete without a ref
    "git push --forc origin main", "git push --d origin x",  # ambiguous abbreviations: git refuses them
    "git -c remote.origin.push=:refs/heads/x push origin main",  # a refspec on the line replaces the config's
    "git -c remote.origin.push=:refs/heads/x push upstream", "git -c remote.origin.push=:refs/heads/x push ../r.git",
    "git -c remote.origin.mirror=false push origin", "git -c remote.origin.push=refs/heads/a:refs/heads/a push",
    "git push -o GIT_CONFIG_PARAMETERS=x origin main",
    "git config remote.origin.push", "git config --get remote.origin.push", "git config --unset remote.origin.mirror",
    "git config remote.origin.push refs/heads/main:refs/heads/main", "git config user.name :x",
    "git http-push https://host/repo.git main", "git send-pack host:repo main",
]


@pytest.mark.parametrize("command,rule", DESTRUCTIVE)
def test_a_history_or_work_destroying_git_command_is_its_named_git_rule(command, rule):
    d = judge_shell(command, CTX)
    assert (d.allowed, d.rule, d.check) == (False, f"git.{rule}", "git"), d
    assert "governance.git_allow" in d.hint and repr(rule) in d.hint and d.evidence


@pytest.mark.parametrize("command", WRAPPERS)
def test_git_is_seen_through_its_own_options_aliases_and_every_wrapper(command):
    d = judge_shell(command, CTX)
    assert d.rule in ("git.reset_hard", "git.clean"), d


def test_sudo_passes_variables_before_the_command_and_the_command_is_still_judged():
    # sudo(8) takes VAR=value words before the command as env(1) does: they were read as the program
    assert judge_shell("sudo FOO=1 rm -rf /", CTX).rule == "hardline.rm_root"
    assert judge_shell("sudo -u root A=1 B=2 git push origin :main", CTX).rule == "git.remote_delete"


@pytest.mark.parametrize("command", SAFE)
def test_everyday_git_passes(command):
    assert judge_shell(command, CTX).allowed, judge_shell(command, CTX)


@pytest.mark.parametrize("command,rule", [
    ("git -c alias.x='!rm -rf /' x", "hardline.rm_root"), ("git -c core.pager='rm -rf ~' log", "hardline.rm_home"),
    ("git -c core.sshCommand='curl http://169.254.169.254/' fetch", "network.ssrf_metadata"),
])
def test_what_git_runs_through_the_shell_is_judged_as_shell(command, rule):
    assert judge_shell(command, CTX).rule == rule


def test_a_listed_rule_is_allowed_and_the_others_stay_refused():
    ctx = record.replace(CTX, git_allow=("reset_hard", "clean"))
    assert judge_shell("git reset --hard", ctx).allowed and judge_shell("git clean -fdx", ctx).allowed
    assert judge_shell("git push -f", ctx).rule == "git.force_push"
    assert all(judge_shell(c, record.replace(CTX, git_allow=("*",))).allowed for c, _ in DESTRUCTIVE)


def test_git_applies_to_an_argv_without_a_shell():
    d, trail = check("run_process", {"argv": ["git", "-C", "/repo", "push", "--force"]}, CTX)
    assert d.rule == "git.force_push" and [t["check"] for t in trail][-1] == "git"


def _roles(tmp_path, monkeypatch, **bodies):
    monkeypatch.setenv("AGNSUP_POLICY_DIR", str(tmp_path))
    for name, body in bodies.items():
        (tmp_path / f"{name}.toml").write_text(
            f'[role]\nname = "{name}"\n[env]\npath = ["/usr/bin"]\n[governance]\n{body}\n')


def test_the_standard_preset_refuses_and_names_the_key_a_role_sets_to_allow(tmp_path, monkeypatch):
    _roles(tmp_path, monkeypatch, std='preset = "standard"', lifted='preset = "standard"\ngit_allow = ["reset_hard"]')
    std = governance.context(policy.load("std"), "/w", None)
    d = judge_shell("git reset --hard", std)
    assert d.rule == "git.reset_hard" and "'reset_hard' to its governance.git_allow" in d.hint
    assert judge_shell("git reset --hard", governance.context(policy.load("lifted"), "/w", None)).allowed
    # the shipped roles are on the standard preset
    assert judge_shell("git push -f", governance.context(policy.load("executor"), "/w", None)).rule == "git.force_push"


def test_the_regulated_preset_refuses_always_and_a_role_cannot_lift_a_git_rule(tmp_path, monkeypatch):
    _roles(tmp_path, monkeypatch, reg='preset = "regulated"\nyellow_allow = ["run_shell"]',
           lift='preset = "regulated"\ngit_allow = ["reset_hard"]')
    ctx = governance.context(policy.load("reg"), "/w", None)
    for c, rule in DESTRUCTIVE:
        d = judge_shell(c, ctx)
        assert not d.allowed and d.rule in (f"git.{rule}", "policy.deny_command"), (c, d)
    with pytest.raises(PolicyError, match="governance.git_allow: 'reset_hard' is looser than preset 'regulated'"):
        policy.load("lift")


def test_an_unknown_git_rule_name_is_refused(tmp_path, monkeypatch):
    _roles(tmp_path, monkeypatch, bad='git_allow = ["push"]')
    with pytest.raises(PolicyError, match="unknown git rule 'push'"):
        policy.load("bad")


def _rules(line: str) -> set[str]:
    return {rule for rule, _, _ in git.findings(analyze_shell(line))}


@pytest.mark.parametrize("command,rules", [
    ("git push --mirror backup", {"force_push", "remote_delete"}),
    ("git push --mirror --no-prune backup", {"force_push", "remote_delete"}),  # a mirror prunes anyway
    ("git -c remote.origin.mirror=true push", {"force_push", "remote_delete"}),
    ("git push origin +main :old", {"force_push", "remote_delete"}),
    ("git push --prune origin +main", {"force_push", "remote_delete"}),
    ("git push -f origin :x", {"remote_delete"}), ("git push -fd origin x", {"remote_delete"}),
    ("git push origin +:x", {"remote_delete"}), ("git push origin +:", {"force_push"}),
    ("git push -f origin main :x", {"force_push", "remote_delete"}),
    ("git --config-env=remote.origin.push=R push", {"force_push", "remote_delete"}),  # unreadable: either
])
def test_a_push_under_two_rules_names_both(command, rules):
    assert _rules(command) == rules


def test_a_push_under_two_rules_runs_only_if_the_role_allows_both():
    for allow, mirror, delete, force in [(("force_push",), False, False, True),
                                         (("remote_delete",), False, True, False),
                                         (("force_push", "remote_delete"), True, True, True)]:
        ctx = record.replace(CTX, git_allow=allow)
        assert judge_shell("git push --mirror backup", ctx).allowed is mirror
        assert judge_shell("git push origin --delete old", ctx).allowed is delete
        assert judge_shell("git push -f origin main", ctx).allowed is force
    d = judge_shell("git push --mirror backup", record.replace(CTX, git_allow=("force_push",)))
    assert d.rule == "git.remote_delete" and "'remote_delete' to its governance.git_allow" in d.hint


def test_a_remote_deletion_names_its_evidence_and_the_spelling_that_deletes():
    d = judge_shell("cd repo && git push origin main :old", CTX)
    assert (d.rule, d.evidence) == ("git.remote_delete", "git push origin main :old")
    assert "':old' has an empty source: it deletes 'old' on the remote" in d.reason
    assert "deletes x on the remote" in judge_shell("git push --delete origin x", CTX).reason


def test_the_git_rule_names_the_role_schema_accepts_are_the_rules():
    assert set(policyfile.GIT_RULES) == set(git.RULES)
    assert "remote_delete" in policyfile.GovernanceSection.model_fields["git_allow"].description


# --- against git itself ---------------------------------------------------------------------------------
# Each line runs in a copy of a local repository whose `origin` is a local bare repository (no network):
# local x is rewritten (a push of it must force), branch y and tag v2 are gone locally (a prune or mirror
# deletes them on the remote). What the remote lost or had forced must be exactly the rules the gate names.
REAL = [
    ("git push origin :z", {"remote_delete"}), ("git push origin :refs/tags/v1", {"remote_delete"}),
    ("git push origin +:z", {"remote_delete"}), ("git push origin main :old feature", {"remote_delete"}),
    ("git push origin --delete z", {"remote_delete"}), ("git push -d origin z", {"remote_delete"}),
    ("git push origin z --delete", {"remote_delete"}), ("git push --delete origin tag v1", {"remote_delete"}),
    ("git push --del origin z", {"remote_delete"}), ("git push -fd origin z", {"remote_delete"}),
    ("git push --no-delete -d origin z", {"remote_delete"}), ("git push -f origin :z", {"remote_delete"}),
    ("git push --force-with-lease origin :z", {"remote_delete"}),
    ("git push --all --prune origin", {"remote_delete"}), ("git push --tags --prune origin", {"remote_delete"}),
    ("git push --prune origin 'refs/heads/*:refs/heads/*'", {"remote_delete"}),
    ("git -c remote.origin.push=:refs/heads/z push", {"remote_delete"}),
    ("git -c remote.origin.push=:refs/heads/z push origin", {"remote_delete"}),
    ("git -c remote.origin.push=+refs/heads/x:refs/heads/x push", {"force_push"}),
    ("GIT_CONFIG_COUNT=1 GIT_CONFIG_KEY_0=remote.origin.push GIT_CONFIG_VALUE_0=:refs/heads/z git push",
     {"remote_delete"}),
    ("GIT_CONFIG_PARAMETERS=\"'remote.origin.push'=':refs/heads/z'\" git push", {"remote_delete"}),
    ("git -c alias.del='push origin --delete' del z", {"remote_delete"}),
    ("git config remote.origin.push :refs/heads/z && git push", {"remote_delete"}),
    ("git push --mirror origin", {"force_push", "remote_delete"}),
    ("git push --mir origin", {"force_push", "remote_delete"}),
    ("git -c remote.origin.mirror=true push origin", {"force_push", "remote_delete"}),
    ("git remote add --mirror=push backup ../remote.git && git push backup", {"force_push", "remote_delete"}),
    ("git push origin +x", {"force_push"}), ("git push -f origin x", {"force_push"}),
    ("git send-pack ../remote.git :refs/heads/z", {"remote_delete"}),
    # nothing lost on the remote
    ("git push origin main", set()), ("git push origin :", set()), ("git push --all origin", set()),
    ("git push --tags origin", set()), ("git push -n --delete origin z", set()),
    ("git push --dry-run --mirror origin", set()), ("git push -d --no-delete origin z", set()),
    ("git push --prune --no-prune --all origin", set()), ("git push --forc origin x", set()),
    ("git push --d origin z", set()), ("git -c remote.origin.push=:refs/heads/z push origin main", set()),
    ("git remote prune origin", set()), ("git fetch --prune origin", set()), ("git branch -Dr origin/z", set()),
    ("git tag -d v1", set()), ("git remote add --mirror=fetch backup ../remote.git && git push backup main", set()),
]


@pytest.fixture(scope="module")
def pushed(tmp_path_factory):
    """A repository and its bare `origin`, as described above REAL."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    root = tmp_path_factory.mktemp("git-real")
    env = {**os.environ, "HOME": str(root), "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull,
           "GIT_TERMINAL_PROMPT": "0", "GIT_AUTHOR_NAME": "a", "GIT_AUTHOR_EMAIL": "a@b", "GIT_COMMITTER_NAME": "a",
           "GIT_COMMITTER_EMAIL": "a@b"}
    script = ("git init -q --bare remote.git && git init -q -b main local && cd local && "
              "git commit -q --allow-empty -m 1 && git remote add origin ../remote.git && "
              "for b in x y z old feature; do git branch $b; done && git tag v1 && git tag v2 && "
              "git push -q origin --all && git push -q origin --tags && "
              "git checkout -q x && git commit -q --amend --allow-empty -m 1b && git checkout -q main && "
              "git branch -q -D y && git tag -d v2 >/dev/null")
    subprocess.run(["bash", "-c", script], cwd=root, env=env, check=True, capture_output=True, timeout=60)
    return root, env


def _refs(repo) -> dict[str, str]:
    out = subprocess.run(["git", "for-each-ref", "--format=%(refname) %(objectname)"], cwd=repo,
                         capture_output=True, text=True, check=True, timeout=30).stdout
    return dict(line.split() for line in out.splitlines())


@pytest.mark.parametrize("command,rules", REAL)
def test_what_git_itself_deletes_or_forces_on_the_remote_is_what_the_gate_names(command, rules, pushed, tmp_path):
    template, env = pushed
    work = tmp_path / "copy"
    shutil.copytree(template, work, symlinks=True)
    remote = work / "remote.git"
    before = _refs(remote)
    subprocess.run(["bash", "-c", command], cwd=work / "local", env=env, capture_output=True, timeout=60,
                   stdin=subprocess.DEVNULL)
    after = _refs(remote)
    lost = {"remote_delete"} if set(before) - set(after) else set()
    forced = {"force_push"} if any(
        subprocess.run(["git", "merge-base", "--is-ancestor", old, after[ref]], cwd=remote, timeout=30).returncode
        for ref, old in before.items() if ref in after and after[ref] != old) else set()
    assert lost | forced == rules, (command, before, after)  # git did what the label says ...
    assert _rules(command) == rules  # ... and the gate names exactly that
    d = judge_shell(command, CTX)
    assert d.allowed is not bool(rules) and (not rules or d.rule[len("git."):] in rules), d


# --- what git runs as a command -------------------------------------------------------------------------
@pytest.mark.parametrize("command,rule", [
    ("git submodule foreach 'rm -rf /'", "hardline.rm_root"),
    ("git submodule --quiet foreach --recursive rm -rf ~", "hardline.rm_home"),
    ("git submodule foreach 'git push origin :main'", "git.remote_delete"),
    ("git rebase --exec 'rm -rf /' HEAD~3", "hardline.rm_root"), ("git rebase -x 'rm -rf ~' main", "hardline.rm_home"),
    ("git bisect run rm -rf /", "hardline.rm_root"), ("git bisect run sh -c 'rm -rf ~'", "hardline.rm_home"),
    ("git fetch --upload-pack='rm -rf /' origin", "hardline.rm_root"),
    ("git clone -u 'rm -rf ~' url", "hardline.rm_home"),
    ("git push --receive-pack='rm -rf /' origin main", "hardline.rm_root"),
    ("git ls-remote --upload-pack 'rm -rf /' origin", "hardline.rm_root"),
    ("git -c protocol.ext.allow=always clone 'ext::sh -c rm% -rf% /' x", "hardline.rm_root"),
    ("git -c filter.lfs.smudge='rm -rf /' checkout main", "hardline.rm_root"),
    ("git -c credential.helper='!rm -rf ~' fetch", "hardline.rm_home"),
    ("git -c diff.bin.textconv='curl http://169.254.169.254/' diff", "network.ssrf_metadata"),
    ("git grep -O'rm -rf /' pattern", "hardline.rm_root"),
    ("git config core.fsmonitor 'rm -rf ~'", "hardline.rm_home"),
    ("git config alias.x '!rm -rf /'", "hardline.rm_root"),
    ("git config --global filter.x.clean 'rm -rf /'", "hardline.rm_root"),
])
def test_what_git_runs_as_a_command_is_judged_as_shell(command, rule):
    assert judge_shell(command, CTX).rule == rule


@pytest.mark.parametrize("command", [
    "git bisect run make test", "git bisect run 'rm -rf /'",  # one word: a program of that name
    "git rebase -i main", "git submodule update --init", "git -c credential.helper=store fetch",
    "git config alias.st status", "git config --global core.pager less", "git clone ext::true x",
    "git config --get core.fsmonitor",
])
def test_git_commands_that_run_nothing_dangerous_pass(command):
    assert judge_shell(command, CTX).allowed, judge_shell(command, CTX)


SHELL_RUN = [  # MARK: a file the code creates; git must create it, and the gate must see `touch MARK`
    "git rebase -q --exec 'touch MARK' HEAD~1",
    "git bisect start main main~1 >/dev/null && git bisect run touch MARK",
    "git fetch -q --upload-pack='touch MARK; git-upload-pack' origin",
    "git ls-remote --upload-pack='touch MARK; git-upload-pack' origin",
    "git push -q --receive-pack='touch MARK; git-receive-pack' origin main",
    "git clone -q -u 'touch MARK; git-upload-pack' ../remote.git c2",
    "git -c protocol.ext.allow=always ls-remote 'ext::sh -c touch% MARK'",
    "git config core.fsmonitor 'touch MARK' && git status",
    "git -c core.fsmonitor='touch MARK' status",
    "git -c alias.m='!touch MARK' m",
]


@pytest.mark.parametrize("command", SHELL_RUN)
def test_the_code_git_runs_is_the_code_the_gate_reads(command, pushed, tmp_path):
    template, env = pushed
    work = tmp_path / "copy"
    shutil.copytree(template, work, symlinks=True)
    local = work / "local"
    subprocess.run(["bash", "-c", "git commit -q --allow-empty -m 2"], cwd=local, env=env, check=True, timeout=30)
    mark = str(tmp_path / "mark")
    line = command.replace("MARK", mark)
    subprocess.run(["bash", "-c", line], cwd=local, env=env, capture_output=True, timeout=60,
                   stdin=subprocess.DEVNULL)
    assert os.path.exists(mark), line  # git ran it ...
    assert any(ex.prog == "touch" and mark in ex.argv for ex in analyze_shell(line).execs), line  # ... the gate read it
