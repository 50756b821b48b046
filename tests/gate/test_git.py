"""The git zone: commands that destroy history or uncommitted work, named rules, through wrappers."""

import pytest

from agnsup import governance, policy, record
from agnsup.errors import PolicyError
from agnsup.gate import GateContext, check, judge_shell

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
