"""Hardline through plumbing: what the shell makes obvious is followed, what it does not is said.

Operands reach rm/find/chmod/dd through here-strings, pipes from echo/printf
into xargs, process substitutions, constant assignments and substitutions of
constants; an operand known only at run time is `hardline.unknown_operand`,
flagged or refused by governance.unknown_operands.
"""

import pytest

from agnsup.util import record
from agnsup.gate import GateContext, judge_shell

CTX = GateContext(mode="open", network="host", worktree="/workspace/project", writable=("/",), home="/home/user")
DENY_UNKNOWN = record.replace(CTX, role="strict", unknown_operands="deny")

PLUMBED = [
    # (command, rule): the six spellings first
    ("xargs rm -rf <<< /", "hardline.rm_root"),
    ("echo / | xargs rm -rf", "hardline.rm_root"),
    ("printf '/\\n' | xargs rm -rf", "hardline.rm_root"),
    ("xargs -a <(echo /) rm -rf", "hardline.rm_root"),
    ('rm -rf "$(echo /)"', "hardline.rm_root"),
    ("R=/; rm -rf $R", "hardline.rm_root"),
    # more of the same plumbing
    ("R=/ && rm -rf \"$R\"", "hardline.rm_root"),
    ("export R=/; rm -rf ${R}", "hardline.rm_root"),
    ("local D=/usr; rm -rf $D", "hardline.rm_system"),
    ("D=/usr; rm -rf ${D:-/tmp}", "hardline.rm_system"),
    ("D=; rm -rf ${D:-/}", "hardline.rm_root"),
    ("H=~; rm -rf $H", "hardline.rm_home"),
    ("P=/et; P+=c; rm -rf $P", "hardline.rm_system"),
    ("unset X; rm -rf \"$X/\"", "hardline.rm_root"),
    ("CMD=rm; $CMD -rf /", "hardline.rm_root"),
    ("F='-rf /'; rm $F", "hardline.rm_root"),
    ("rm -rf `echo /`", "hardline.rm_root"),
    ("rm -rf $(echo $(echo /))", "hardline.rm_root"),
    ('rm -rf "$(printf %s /)"', "hardline.rm_root"),
    ("rm -rf $(printf '%s' ~)", "hardline.rm_home"),
    ("echo -n / | xargs rm -rf", "hardline.rm_root"),
    ("echo /home/user | xargs -I{} rm -rf {}", "hardline.rm_home"),
    ("printf '/usr\\0' | xargs -0 rm -rf", "hardline.rm_system"),
    ("cat <<< / | xargs rm -rf", "hardline.rm_root"),
    ("xargs --arg-file=<(echo /) rm -rf", "hardline.rm_root"),
    ("echo / | sudo xargs -n1 rm -rf", "hardline.rm_root"),
    ("echo / | parallel rm -rf", "hardline.rm_root"),
    ("parallel rm -rf ::: /", "hardline.rm_root"),
    ("parallel ::: 'rm -rf /'", "hardline.rm_root"),
    ("for d in / /tmp; do rm -rf $d; done", "hardline.rm_root"),
    ("echo 'rm -rf /' | sh", "hardline.rm_root"),
    ("printf 'rm -rf ~\\n' | bash", "hardline.rm_home"),
    ("find $(echo /) -delete", "hardline.rm_root"),
    ("T=/; chmod -R 777 $T", "hardline.chmod_system"),
    ("D=/dev/sda; dd if=/dev/zero of=$D", "hardline.block_device_write"),
    ("rm -rf /proc/1/root/", "hardline.rm_root"),
    ("rm -rf /proc/self/root/etc", "hardline.rm_system"),
    ("bash -c \"R=/; rm -rf \\$R\"", "hardline.rm_root"),
]

UNKNOWN = [
    # operands known only at run time, of destructive commands
    "rm -rf $DIR", 'rm -rf "$BUILD_DIR/out"', "rm -rf $(cat dirs.txt)", "find . -name node_modules | xargs rm -rf",
    "xargs rm -rf < list.txt", "find $X -delete", "chmod -R 755 $D", "chown -R me \"$(pwd)/..\"", "dd if=x of=$DEV",
    "shred -u $F", "R=$(mktemp -d); rm -rf $R", "read D; rm -rf $D", "cat list | parallel rm -rf",
    "for d in $DIRS; do rm -rf $d; done", "rm -rf `cat f`",
]

KNOWN_HARMLESS = [
    # followed, and harmless
    "R=build; rm -rf $R", "echo build | xargs rm -rf", "rm -rf \"$(echo dist)\"", "xargs rm -f <<< stale.lock",
    "D=/tmp/x; rm -rf $D/*", "R=/; echo $R", "echo / | xargs ls", "printf '%s\\n' a b | xargs rm -rf",
    "rm $FILE", "mv $A $B", "echo $(echo /)", "R=/ ls $R", "for f in a b; do rm -rf $f; done",
    "find . -name '*.pyc' -delete", "xargs -a files.txt echo",
]


@pytest.mark.parametrize("command,rule", PLUMBED)
def test_an_operand_the_shell_makes_obvious_is_followed_into_the_hardline(command, rule):
    d = judge_shell(command, CTX)
    assert (d.allowed, d.rule, d.check) == (False, rule, "hardline"), d
    assert d.evidence


@pytest.mark.parametrize("command", UNKNOWN)
def test_an_unknown_operand_of_a_destructive_command_is_flagged_and_said_in_the_decision(command):
    d = judge_shell(command, CTX)
    assert d.allowed and "hardline.unknown_operand" in d.flags, d
    note = next(n for n in d.flagged if n["rule"] == "hardline.unknown_operand")
    assert "known only at run time" in note["reason"] and "governance.unknown_operands = 'flag'" in note["reason"]
    assert note["evidence"]


@pytest.mark.parametrize("command", UNKNOWN)
def test_an_unknown_operand_is_refused_when_the_role_says_deny(command):
    d = judge_shell(command, DENY_UNKNOWN)
    assert (d.allowed, d.rule) == (False, "hardline.unknown_operand"), d
    assert "governance.unknown_operands" in d.hint and d.evidence


@pytest.mark.parametrize("command", KNOWN_HARMLESS)
def test_plumbing_that_ends_in_something_harmless_passes_without_a_flag(command):
    d = judge_shell(command, DENY_UNKNOWN)
    assert d.allowed and "hardline.unknown_operand" not in d.flags, d


@pytest.mark.parametrize("command,allowed", [
    ("kill -9 -1", False), ("kill -KILL -1", False), ("kill -s KILL -1", False), ("kill -SIGKILL -- -1", False),
    ("kill -- -1", False), ("/bin/kill -9 -1", False), ("sudo kill -TERM -1", False), ("kill 1", False),
    ("killall5 -9", False),
    ("kill -0 1", True), ("kill -1", True), ("kill -HUP 1", True), ("kill -9 1234", True), ("kill -l", True),
    ("kill -9 %1", True), ("kill -0 -1", True),
])
def test_kill_of_every_process_is_power_and_a_probe_is_not(command, allowed):
    d = judge_shell(command, CTX)
    assert d.allowed is allowed and (allowed or d.rule == "hardline.power"), d


@pytest.mark.parametrize("worktree", ["/tmp/ci/project", "/var/tmp/build/src", "/tmp/w", "/dev/shm/job"])
@pytest.mark.parametrize("command,rule", [
    ("rm -rf .", "hardline.rm_worktree"), ("rm -rf *", "hardline.rm_worktree"), ("rm -rf ./", "hardline.rm_worktree"),
    ("rm -rf ..", "hardline.rm_worktree"), ("find . -delete", "hardline.rm_worktree"),
    ("rm -rf build", None), ("rm -rf ./node_modules", None), ("rm -rf /tmp/elsewhere-x", None),
])
def test_a_worktree_under_a_scratch_root_keeps_the_worktree_wipe_rule(worktree, command, rule):
    d = judge_shell(command, record.replace(CTX, worktree=worktree))
    if rule is None:
        assert d.allowed, d
    else:
        assert (d.allowed, d.rule) == (False, rule), d
