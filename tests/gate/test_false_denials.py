"""Benign lines the hardline used to refuse, next to the catastrophic lines it must keep refusing."""

import pytest

from agnsup.util import record
from agnsup.gate import GateContext, judge_shell

CTX = GateContext(mode="open", network="host", worktree="/workspace/project", writable=("/",), home="/home/user")
ROOT_HOME = record.replace(CTX, home="/root")
ROOT_WORKTREE = record.replace(CTX, home="/root", worktree="/root/src/app")

ALLOWED = [
    # hardline.chmod_system: a service's, a user's or an arbitrary top-level directory
    "chmod -R 755 /directory", "chown -R root:root /var/lib/jenkins", "chown -R www-data:www-data /var/www",
    "chmod -R 755 /var/www/html", "chown -R user:user /home/user2", "chown -R $(whoami) ~/.npm",
    "chown -R me ~", "chmod -R 700 ~/.config", "chown -R postgres /var/lib/postgresql/15", "chmod -R g+w /srv/data",
    "chown -R me /usr/local", "sudo chown -R $(whoami) /usr/local/lib/node_modules", "chmod -R 755 /opt/app",
    "chown -R nginx /var/log/nginx", "chmod -R 755 /usr/share/nginx/html", "chmod +x /usr/local/bin/tool",
    # hardline.cloud_destroy: one message, item, tag or lock; dry runs and skeletons
    "az tag delete --name env", "az lock delete --name nodelete --resource-group rg",
    "az storage blob delete --container-name c --name x.txt", "az storage message delete --queue-name q --id 1",
    "az role assignment delete --assignee x --role Reader", "az cache delete --name x",
    "aws sqs delete-message --queue-url https://sqs.us-east-1.amazonaws.com/1/q --receipt-handle AQEB",
    "aws sqs delete-message-batch --queue-url u --entries file://e.json",
    "aws dynamodb delete-item --table-name t --key '{\"id\":{\"S\":\"1\"}}'", "aws ec2 delete-tags --resources i-1",
    "aws s3api delete-object --bucket b --key k", "aws ec2 terminate-instances --instance-ids i-1 --dry-run",
    "aws rds delete-db-instance --generate-cli-skeleton", "aws ec2 delete-vpc --generate-cli-skeleton input",
    "aws s3 rm s3://b/path --recursive --dryrun", "kubectl delete ns staging --dry-run=client",
    "gcloud config configurations delete old", "aws ec2 help",
    # hardline.power: probes, cancellations, wtmp records, dry runs
    "kill -0 1", "shutdown -c", "shutdown --cancel", "shutdown -k now 'maintenance soon'", "halt --wtmp-only",
    "reboot -w", "poweroff --wtmp-only", "systemctl halt --when cancel", "systemctl reboot --when=cancel",
    "systemctl poweroff --dry-run", "systemctl status reboot.target",
    # hardline.mkfs: filesystem images and swap files are files
    "mkfs.erofs image.erofs root/", "mkswap path/to/file", "mkswap /swapfile", "mkfs.ext4 disk.img",
    "mkfs.ext4 -F -L data ./build/rootfs.img", "mkfs.vfat -C floppy.img 1440", "mksquashfs dir out.sqfs",
    # hardline.repo_delete: caches, labels, aliases, variables
    "gh cache delete 1234", "gh cache delete --all", "gh label delete bug --yes", "gh alias delete co",
    "gh variable delete FOO", "gh variable delete FOO --env prod",
    # dry runs and harmless forms
    "wipefs --all --no-act /dev/sda", "wipefs -n -a /dev/sdb", "sfdisk --no-act /dev/sda < layout",
    "sgdisk --pretend --zap-all /dev/sda", "truncate --size 10G file", "truncate -s 100G disk.qcow2",
    "fallocate -l 1G swapfile",
    # a narrow glob is some entries of a directory, not all of it
    "rm -rf *.txt", "for f in *.log; do rm -rf \"$f\"; done", "rm -rf ~/*.log", "rm -rf build-*", "mkfs.ext4 -F disk.img",
]

ROOT_ALLOWED = [
    # running as root, HOME=/root: inside the home is the user's, not the system's
    (ROOT_HOME, "chown -R $(whoami) ~/.npm"), (ROOT_HOME, "mv ~/a.png ~/b/"), (ROOT_HOME, "rm -rf ~/.cache/pip"),
    (ROOT_HOME, "chmod -R 700 /root/.config"),
    # and a worktree under /root is the agent's own
    (ROOT_WORKTREE, "rm -rf build"), (ROOT_WORKTREE, "rm -rf ./dist node_modules"), (ROOT_WORKTREE, "rm -rf /root/src/app/target"),
    (ROOT_WORKTREE, "find . -name '*.o' -delete"), (record.replace(CTX, worktree="/usr/src/app"), "rm -rf build"),
]

STILL_DENIED = [
    (CTX, "chmod -R 777 /", "hardline.chmod_system"), (CTX, "chown -R nobody /etc", "hardline.chmod_system"),
    (CTX, "chmod -R 777 /usr", "hardline.chmod_system"), (CTX, "chown -R me /usr/bin", "hardline.chmod_system"),
    (CTX, "chmod -R 755 /usr/lib", "hardline.chmod_system"), (CTX, "chown -R me /var", "hardline.chmod_system"),
    (CTX, "chown -R me /var/lib", "hardline.chmod_system"), (CTX, "chmod -R 777 /etc/ssh", "hardline.chmod_system"),
    (CTX, "chmod -R 777 /home", "hardline.chmod_system"), (CTX, "chown -R me /boot", "hardline.chmod_system"),
    (CTX, "chmod 777 /", "hardline.chmod_system"), (CTX, "chmod 666 /etc/shadow", "hardline.chmod_system"),
    (CTX, "chmod -R 777 /root", "hardline.chmod_system"),
    (CTX, "az group delete --name prod-rg --yes", "hardline.cloud_destroy"),
    (CTX, "az storage blob delete-batch --source c --account-name a", "hardline.cloud_destroy"),
    (CTX, "az vm delete -g rg -n vm --yes", "hardline.cloud_destroy"),
    (CTX, "aws sqs delete-queue --queue-url u", "hardline.cloud_destroy"),
    (CTX, "aws dynamodb delete-table --table-name t", "hardline.cloud_destroy"),
    (CTX, "aws ec2 terminate-instances --instance-ids i-1", "hardline.cloud_destroy"),
    (CTX, "aws s3 rm s3://b --recursive", "hardline.cloud_destroy"),
    (CTX, "kubectl delete ns prod --dry-run=none", "hardline.cloud_destroy"),
    (CTX, "shutdown -h now", "hardline.power"), (CTX, "halt -p", "hardline.power"),
    (CTX, "systemctl halt --when=+5min", "hardline.power"), (CTX, "systemctl reboot", "hardline.power"),
    (CTX, "mkfs.ext4 /dev/sda1", "hardline.mkfs"), (CTX, "mkswap /dev/sdb2", "hardline.mkfs"),
    (CTX, "mkfs -t xfs /dev/nvme0n1p1", "hardline.mkfs"), (CTX, "mkfs.ext4 $DEV", "hardline.mkfs"),
    (CTX, "cd /dev && mkfs.ext4 sda", "hardline.mkfs"),
    (CTX, "gh repo delete o/r --yes", "hardline.repo_delete"), (CTX, "gh release delete v1", "hardline.repo_delete"),
    (CTX, "gh secret delete TOKEN", "hardline.repo_delete"),
    (CTX, "wipefs -a /dev/sda", "hardline.disk_wipe"), (CTX, "truncate -s 500T /tmp/sparse", "hardline.resource_exhaustion"),
    (CTX, "fallocate -l 100G /tmp/fill", "hardline.resource_exhaustion"),
    (CTX, "rm -rf *", "hardline.rm_worktree"), (CTX, "rm -rf .*", "hardline.rm_worktree"),
    (CTX, "rm -rf ~/*", "hardline.rm_home"), (CTX, "rm -rf /usr/*.so", "hardline.rm_system"),
    (CTX, "rm -rf /home/*", "hardline.rm_home"),
    (ROOT_HOME, "rm -rf ~", "hardline.rm_home"), (ROOT_HOME, "rm -rf /root", "hardline.rm_home"),
    (ROOT_WORKTREE, "rm -rf .", "hardline.rm_worktree"), (ROOT_WORKTREE, "rm -rf /root/src", "hardline.rm_worktree"),
    (ROOT_WORKTREE, "rm -rf /etc/nginx", "hardline.rm_system"),
]


@pytest.mark.parametrize("command", ALLOWED)
def test_a_benign_line_the_hardline_used_to_refuse_passes(command):
    d = judge_shell(command, CTX)
    assert d.allowed, d


@pytest.mark.parametrize("ctx,command", ROOT_ALLOWED, ids=[c for _, c in ROOT_ALLOWED])
def test_root_with_its_home_and_a_worktree_under_root_is_not_the_system(ctx, command):
    d = judge_shell(command, ctx)
    assert d.allowed, d


@pytest.mark.parametrize("ctx,command,rule", STILL_DENIED, ids=[c for _, c, _ in STILL_DENIED])
def test_the_catastrophic_neighbours_stay_denied(ctx, command, rule):
    d = judge_shell(command, ctx)
    assert (d.allowed, d.rule) == (False, rule), d
