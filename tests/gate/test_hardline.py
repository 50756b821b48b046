"""Hardline: catastrophic commands are denied in every spelling, near misses pass."""

import pytest

from agnsup.gate import GateContext, check, judge_shell

CTX = GateContext(mode="open", network="host", worktree="/workspace/project", writable=("/",), home="/home/user")

DENIED = [
    # (command, rule)
    ("rm -rf /", "hardline.rm_root"),
    ("rm -fr /", "hardline.rm_root"),
    ("rm -r -f /", "hardline.rm_root"),
    ("rm -f -r /", "hardline.rm_root"),
    ("rm --recursive --force /", "hardline.rm_root"),
    ("rm   -rf   /", "hardline.rm_root"),
    ("rm -rf /*", "hardline.rm_root"),
    ("rm -rf -- /", "hardline.rm_root"),
    ("sudo rm -rf / --no-preserve-root", "hardline.rm_root"),
    ("rm -rf ~", "hardline.rm_home"),
    ("rm -rf ~/", "hardline.rm_home"),
    ("rm -rf $HOME", "hardline.rm_home"),
    ('rm -rf "${HOME}"', "hardline.rm_home"),
    ("rm -rf '/home/user'", "hardline.rm_home"),
    ("rm -rf /usr", "hardline.rm_system"),
    ("rm -rf /etc/nginx", "hardline.rm_system"),
    ("rm -rf /var/log", "hardline.rm_system"),
    ("find /etc -delete", "hardline.rm_system"),
    ("rm -rf *", "hardline.rm_worktree"),
    ("rm -rf .", "hardline.rm_worktree"),
    ("rm -rf ..", "hardline.rm_worktree"),
    ("mkfs.ext4 /dev/sda1", "hardline.mkfs"),
    ("sudo mkfs -t xfs /dev/nvme0n1p1", "hardline.mkfs"),
    ("dd if=/dev/zero of=/dev/sda bs=1M", "hardline.block_device_write"),
    ("cat /dev/zero > /dev/sda", "hardline.block_device_write"),
    ("echo x | tee /dev/nvme0n1", "hardline.block_device_write"),
    ("wipefs -a /dev/sda", "hardline.disk_wipe"),
    ("sgdisk --zap-all /dev/sda", "hardline.disk_wipe"),
    ("echo -e 'o\\nw' | fdisk /dev/sda", "hardline.disk_wipe"),
    (":(){ :|:& };:", "hardline.fork_bomb"),
    ("bomb() { bomb | bomb & }; bomb", "hardline.fork_bomb"),
    ("while true; do bash & done", "hardline.fork_bomb"),
    ("perl -e 'fork while 1'", "hardline.fork_bomb"),
    ("shutdown -h now", "hardline.power"),
    ("reboot", "hardline.power"),
    ("init 0", "hardline.power"),
    ("systemctl poweroff", "hardline.power"),
    ("chmod -R 777 /", "hardline.chmod_system"),
    ("chown -R nobody /etc", "hardline.chmod_system"),
    ("chmod 777 /", "hardline.chmod_system"),
    ("echo 'x:0:0::/:/bin/sh' > /etc/passwd", "hardline.system_file_write"),
    ("cp evil /etc/shadow", "hardline.system_file_write"),
    ("echo b > /proc/sysrq-trigger", "hardline.sysrq"),
    ("terraform destroy -auto-approve", "hardline.cloud_destroy"),
    ("gh repo delete owner/repo --yes", "hardline.repo_delete"),
    ('psql -c "DROP DATABASE prod"', "hardline.database_drop"),
    ("fallocate -l 100G /tmp/fill", "hardline.resource_exhaustion"),
    ("while true; do curl https://api.example.com; done", "hardline.unbounded_loop"),
]

WRAPPED = [
    "sudo rm -rf /", "env rm -rf /", "env -i FOO=1 rm -rf /", "nice -n 19 rm -rf /", "timeout 5 rm -rf /",
    "echo / | xargs rm -rf /", "nohup rm -rf /", "command rm -rf /", "exec rm -rf /", "time rm -rf /",
    "bash -c 'rm -rf /'", "sh -c \"rm -rf /\"", "bash -lc 'rm -rf /'", "echo $(rm -rf /)", "echo `rm -rf /`",
    "eval 'rm -rf /'", "eval rm -rf /", "\\rm -rf /", '"rm" -rf /', "'r'm -rf /", "/bin/rm -rf /",
    "sudo -u root env A=1 nice timeout 9 rm -rf /", "bash <<<'rm -rf /'", "sh <<EOF\nrm -rf /\nEOF",
    "env -S 'rm -rf /'", "find / -exec rm -rf / \\;", "ls; rm -rf /", "true && rm -rf /", "false || rm -rf /",
    "ls | rm -rf /", "rm -rf / &", "(rm -rf /)", "{ rm -rf /; }", "if true; then rm -rf /; fi",
    "python3 -c \"import shutil; shutil.rmtree('/')\"", "node -e \"require('child_process').execSync('rm -rf /')\"",
    "python3 -c \"import subprocess; subprocess.run(['rm', '-rf', '/'])\"", "watch -n1 rm -rf /",
    "bash -c \"bash -c 'rm -rf /'\"", "rm -rf / (",
]

ALLOWED = [
    "rm -rf /tmp/build", "rm -fr /tmp/build", "rm -r -f /tmp/build", "rm --recursive --force /tmp/build",
    "rm -rf /tmp/*", "rm -rf /var/tmp/*", "rm -rf $TMPDIR/build", "rm -rf ${TMPDIR:-/tmp}/build",
    "rm -rf ./build", "rm -rf node_modules", "rm file.txt", "rm -rf", 'echo "rm -rf /"', "echo 'rm -rf /'",
    "grep 'rm -rf' Makefile", 'git commit -m "fix rm -rf detection"', "cat <<EOF\nrm -rf /\nEOF",
    "cat <<'EOF'\n$(rm -rf /)\nEOF", "wc -c <<<'rm -rf /'", "VAR='rm -rf /'; echo \"$VAR\"",
    "python -c \"print('rm -rf /')\"", "man mkfs", "dd if=/dev/zero of=./test.img bs=1M count=100",
    "find . -name '*.txt' -exec rm {} \\;", "find /tmp -name '*.tmp' -delete", "git log --oneline | grep fork",
    "echo hello > /dev/null", "command -v rm", "ls -la /etc", "chmod +x script.sh", "chmod -R u+w ./build",
    "echo 'fallocate -l 10G' > notes.txt", "yes | head -n 3", "kubectl delete pod web-1",
    "while true; do sleep 1; if test -f done; then break; fi; done", "systemctl status nginx",
]


@pytest.mark.parametrize("command,rule", DENIED)
def test_catastrophic_command_is_denied_by_its_hardline_rule(command, rule):
    d = judge_shell(command, CTX)
    assert (d.allowed, d.rule, d.check) == (False, rule, "hardline")
    assert d.reason and d.hint


@pytest.mark.parametrize("command", WRAPPED)
def test_rm_root_is_seen_through_wrappers_and_nesting(command):
    d = judge_shell(command, CTX)
    assert not d.allowed and d.check == "hardline", d


@pytest.mark.parametrize("command", ALLOWED)
def test_near_miss_passes_hardline(command):
    d = judge_shell(command, CTX)
    assert d.allowed, d


def test_rm_with_split_flags_on_root_is_denied():
    assert judge_shell("rm -r -f /", CTX).rule == "hardline.rm_root"


def test_hardline_ignores_mode_and_role_lists():
    lenient = GateContext(mode="open", network="host", writable=("/",), allow_commands=("rm",),
                          yellow_allow=("run_shell",))
    assert judge_shell("rm -rf /", lenient).rule == "hardline.rm_root"


def test_hardline_applies_to_command_fields_of_any_tool():
    d, trail = check("custom_tool", {"script": "mkfs.ext4 /dev/sdb"}, CTX)
    assert d.rule == "hardline.mkfs" and trail == [
        {"check": "hardline", "allowed": False, "rule": "hardline.mkfs", "reason": d.reason}]


def test_process_argv_is_judged_without_a_shell():
    d, _ = check("run_process", {"argv": ["sudo", "rm", "-rf", "/"]}, CTX)
    assert d.rule == "hardline.rm_root"
    d, _ = check("run_process", {"argv": ["bash", "-c", "rm -rf ~"]}, CTX)
    assert d.rule == "hardline.rm_home"


def test_argv_words_are_not_reparsed_as_shell():
    d, _ = check("run_process", {"argv": ["echo", "rm -rf /; shutdown now"]}, CTX)
    assert d.allowed
