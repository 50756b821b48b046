"""Hardline: commands no mode and no role may run.

Each rule looks at one `Exec` (a program after unwrapping) or at the script
(fork bombs, loops). Rules are small functions returning a `Finding` or None;
the first denial wins. Rule ids are `hardline.<name>`; the table is in
docs/governance.md.
"""

from __future__ import annotations

import os
import re

from .model import Analysis, Exec, Finding, deny, ok, ok_flagged, operands as _operands
from .paths import LazyRe
from .paths import (BLOCK_DEVICE, HARMLESS_DEVICES, UNKNOWN_CWD, catastrophic_target, expand, home_of,
                    permission_target, real, system_file, system_write_target)

HINT = ("Hardline rules cannot be lifted by a role or a mode; if this is really intended, "
        "run it yourself outside agnsup.")
HINT_UNKNOWN = ("Write the operand literally (or pass an argv list), so the gate can see what it names; or set "
                "governance.unknown_operands = 'flag' in the role to run such commands with a flag (the regulated "
                "preset fixes 'deny').")

NET_TOOLS_FOR_LOOPS = frozenset({"curl", "wget", "http", "https", "xh", "nc", "ncat", "netcat", "socat"})
LLM_CLIS = frozenset({"claude", "llm", "mods", "aider", "openai", "gemini", "sgpt", "ollama", "codex", "chatgpt"})
POWER = frozenset({"shutdown", "reboot", "halt", "poweroff"})
POWER_VERBS = frozenset({"poweroff", "halt", "reboot", "kexec", "suspend", "hibernate", "hybrid-sleep",
                         "suspend-then-hibernate", "rescue", "emergency", "soft-reboot", "default"})
DB_CLIENTS = frozenset({"mysql", "mariadb", "psql", "sqlite3", "mongosh", "mongo", "cqlsh", "clickhouse-client",
                        "clickhouse", "sqlcmd", "duckdb"})
DB_DROP = LazyRe(r"\bdrop\s+(database|schema|table)\b|\btruncate\b|\bdropDatabase\s*\(|\.drop\s*\(\s*\)", re.I)
SIZE = LazyRe(r"^\+?(\d+(?:\.\d+)?)([KMGTPE]?)(i?B)?$", re.I)
HUGE = 10 * 1024 ** 3  # bytes; fallocate at or above this fills a disk
# truncate makes a sparse file (no blocks until written): a 10G image is routine; one larger than any
# disk fills the disk of whatever copies it without --sparse (cp, tar, a backup).
HUGE_SPARSE = 1024 ** 4
# aws operations named delete-* that remove one item of data or metadata, not infrastructure.
AWS_ITEM_DELETES = frozenset({"delete-message", "delete-message-batch", "delete-item", "delete-tags",
                              "delete-attributes", "delete-object", "delete-object-tagging", "delete-bucket-tagging",
                              "delete-alarms", "change-message-visibility"})
# az command groups whose delete removes a tag, a lock, a local cache entry, a message or one blob.
AZ_ITEM_GROUPS = (("tag",), ("lock",), ("cache",), ("config",), ("storage", "message"), ("storage", "entity"),
                  ("storage", "blob"), ("storage", "file"), ("role", "assignment"))
# gh <x> delete of these removes a cache entry, label, alias or variable, not repositories or history.
GH_ITEM_GROUPS = frozenset({"cache", "label", "alias", "variable"})
# Signals that leave a process running (kill -0 only checks that it exists).
HARMLESS_SIGNALS = frozenset({"0", "HUP", "SIGHUP", "1", "USR1", "SIGUSR1", "USR2", "SIGUSR2", "WINCH", "SIGWINCH",
                              "CONT", "SIGCONT", "10", "12", "18", "28"})


class _Ctx:
    def __init__(self, home: str, worktree: str):
        self.home = home
        self.worktree = worktree
        self.unknown: list[dict] = []  # operands of destructive commands known only at run time

    def unknown_operand(self, ex: Exec, word: str, verb: str) -> None:
        if len(self.unknown) < 8:
            self.unknown.append({"rule": "hardline.unknown_operand", "evidence": ex.text or " ".join(ex.argv),
                                 "reason": f"the operand {word} of {verb} is known only at run time (a variable, a "
                                           "substitution or input read at run time), so the gate cannot tell "
                                           "whether it names /, a home, a system directory or the worktree"})

    def path(self, ex: Exec, word: str) -> tuple[str | None, bool]:
        base = self.worktree if ex.cwd is None else ex.cwd
        if base.startswith("~"):
            base = self.home + base[1:]
        if base != UNKNOWN_CWD and not base.startswith("/"):
            base = self.worktree.rstrip("/") + "/" + base
        return expand(word, home=self.home, base=base)


def _has_flag(args: list[str], short: str, long: tuple[str, ...] = ()) -> bool:
    for a in args:
        if a == "--":
            return False
        if a.startswith("--"):
            if a in long or a.split("=", 1)[0] in long:
                return True
        elif a.startswith("-") and len(a) > 1 and any(c in a[1:] for c in short):
            return True
    return False


def _size(s: str) -> int:
    m = SIZE.match(s)
    if not m:
        return 0
    mult = {"": 1, "K": 1024, "M": 1024 ** 2, "G": 1024 ** 3, "T": 1024 ** 4, "P": 1024 ** 5, "E": 1024 ** 6}
    return int(float(m.group(1)) * mult[m.group(2).upper()])


_FIND_NEUTRAL = frozenset({"-depth", "-xdev", "-mount", "-print", "-print0", "-ignore_readdir_race", "-noleaf",
                           "-follow", "-L", "-P", "-H", "-d", "-delete"})
_FIND_VALUE = frozenset({"-mindepth", "-maxdepth"})


def _find_deletes_everything(args: list[str]) -> bool:
    """find -delete / -exec rm with no test that narrows what is matched."""
    deletes = "-delete" in args
    i = 0
    while i < len(args):
        a = args[i]
        if a in ("-exec", "-execdir", "-ok", "-okdir"):
            if i + 1 < len(args) and args[i + 1] in ("rm", "shred", "srm"):
                deletes = True
            while i < len(args) and args[i] not in (";", "+", "\\;"):
                i += 1
        elif a in _FIND_VALUE:
            i += 1
        elif a in ("-name", "-iname", "-path", "-wholename") and i + 1 < len(args) and args[i + 1] in ("*", "*.*"):
            i += 1
        elif a.startswith("-") and a not in _FIND_NEUTRAL and len(a) > 1:
            return False  # a test (-name, -type, -mtime, ...) narrows the match
        i += 1
    return deletes


# Glob components that match every entry of a directory (`.*` also `..` in older shells).
_BROAD_GLOBS = frozenset({"*", ".*", "*.*", "**", "*/", ".??*", ".[!.]*", "..?*", "[!.]*", "?*"})


def _broad_glob(word: str) -> bool:
    """Whether the first glob component of `word` matches everything in its directory."""
    for part in word.split("/"):
        if any(ch in part for ch in "*?["):
            return part in _BROAD_GLOBS
    return True


def _what(rule: str) -> str:
    return {"rm_root": "the root filesystem", "rm_home": "a home directory", "rm_system": "a system directory",
            "rm_worktree": "the whole worktree (or a directory containing it)"}[rule]


# --- rules over one Exec ------------------------------------------------------

def _recursive_delete(ex: Exec, c: _Ctx) -> Finding | None:
    prog, args = ex.prog, ex.args
    targets: list[str] = []
    verb = ""
    if prog in ("rm", "srm") and _has_flag(args, "rR", ("--recursive",)):
        targets, verb = _operands(args), "recursive deletion"
    elif prog == "find" and _find_deletes_everything(args):
        for a in args:
            if a.startswith(("-", "(", "!")) and a != "-":
                break
            targets.append(a)
        targets = targets or ["."]
        verb = "find -delete"
    elif prog == "mv":
        ops = _operands(args, frozenset({"-t", "--target-directory", "-S", "--suffix"}))
        targets, verb = ops[:-1], "moving away"
    elif prog in ("rmdir",):
        return None
    if ex.from_stdin and verb in ("recursive deletion",):
        c.unknown_operand(ex, "(read from stdin by xargs)", f"`{prog} -r`")
    if not targets:
        return None
    for t in targets:
        p, glob = c.path(ex, t)
        if p is None:
            if verb != "moving away":
                c.unknown_operand(ex, repr(t), f"`{prog}` ({verb})")
            continue
        if glob and not _broad_glob(t):
            p = p.rstrip("/") + "/\0some"  # `*.txt`, `build-*`: some entries of p, not all of it
        why = catastrophic_target(p, home=c.home, worktree=c.worktree)
        if why:
            return deny(f"hardline.{why}", f"{verb} of {_what(why)} ({t}) is never allowed.", HINT, ex.text)
    return None


def _write_targets(ex: Exec, c: _Ctx) -> list[tuple[str, str]]:
    """(word, kind) for files this Exec writes: redirections, tee/cp/dd... operands."""
    out = [(t, op) for op, t, _lit in ex.redirects if op in (">", ">>", ">|", "&>", "&>>", "<>")]
    prog, args = ex.prog, ex.args
    if prog == "tee":
        out += [(a, "tee") for a in _operands(args)]
    elif prog in ("cp", "mv", "install", "ln", "rsync", "scp"):
        ops = _operands(args, frozenset({"-t", "--target-directory", "-S", "--suffix", "-m", "--mode", "-o", "-g",
                                         "-e", "--rsh"}))
        if prog == "rsync" and (_has_flag(args, "n", ("--dry-run", "--list-only"))):
            ops = []  # a dry run or a listing writes nothing
        if len(ops) >= 2:
            out.append((ops[-1], prog))
    elif prog == "dd":
        out += [(a[3:], "dd") for a in args if a.startswith("of=")]
    elif prog in ("truncate", "shred", "fallocate", "touch"):
        out += [(a, prog) for a in _operands(args, frozenset({"-s", "--size", "-l", "--length", "-o", "--offset",
                                                              "-n", "--iterations", "-r", "--reference"}))]
    elif prog == "rm":
        out += [(a, "rm") for a in _operands(args)]
    elif prog in ("sed", "perl") and any(a.startswith("-i") or a == "--in-place" for a in args):
        out += [(a, prog) for a in _operands(args, frozenset({"-e", "-f"}))[1:]]
    return out


def _device_and_system_writes(ex: Exec, c: _Ctx) -> Finding | None:
    for word, kind in _write_targets(ex, c):
        p, _ = c.path(ex, word)
        if p is None and kind in ("dd", "shred"):
            c.unknown_operand(ex, repr(word), f"`{kind}`")
        if p is None or HARMLESS_DEVICES.match(p):
            continue
        if BLOCK_DEVICE.match(p):
            return deny("hardline.block_device_write",
                        f"writing to the block device {p} ({kind}) destroys the disk's data.", HINT, ex.text)
        if p == "/proc/sysrq-trigger":
            return deny("hardline.sysrq", "writing to /proc/sysrq-trigger crashes or reboots the host.", HINT, ex.text)
        if system_file(p) or (kind in ("dd", "truncate", "shred") and system_write_target(p)):
            return deny("hardline.system_file_write",
                        f"overwriting or removing {p} ({kind}) can lock everyone out of the host.", HINT, ex.text)
    return None


def _permissions(ex: Exec, c: _Ctx) -> Finding | None:
    prog, args = ex.prog, ex.args
    if prog not in ("chmod", "chown", "chgrp", "setfacl", "chattr"):
        return None
    recursive = _has_flag(args, "R", ("--recursive",))
    with_value = frozenset({"-m", "-x", "-M", "-X", "--modify", "--remove", "--set", "--set-file",
                            "--reference"}) if prog == "setfacl" else frozenset({"--reference"})
    ops = _operands(args, with_value)
    if prog in ("chmod", "chown", "chgrp", "chattr") and not any(a.startswith("--reference") for a in args):
        ops = ops[1:]  # mode / owner
    for t in ops:
        p, _ = c.path(ex, t)
        if p is None:
            if recursive:
                c.unknown_operand(ex, repr(t), f"`{prog} -R`")
            continue
        why = permission_target(p, home=c.home) if recursive else ("rm_root" if p == "/" else "")
        if why:
            return deny("hardline.chmod_system",
                        f"{prog}{' -R' if recursive else ''} on {t} changes permissions of {_what(why)}.",
                        HINT, ex.text)
        if system_file(p):
            return deny("hardline.chmod_system", f"{prog} on {p} weakens a file that guards the host.", HINT, ex.text)
    return None


def _mkfs_target(ex: Exec, c: _Ctx) -> str:
    """The word that makes mkfs/mkswap destructive ("" when every non-option word is a regular file
    path: `mkfs.erofs image.erofs root/`, `mkswap ./swapfile` only write a file). Option values
    (`-L data`, `-t ext4`) count as words too: which options take one differs per mkfs."""
    words = [a for a in ex.args if not a.startswith("-")]
    if not words:
        return "(no operand)"
    for t in words:
        p, _ = c.path(ex, t)
        if p is None or p == "/dev" or p.startswith("/dev/") or BLOCK_DEVICE.match(p):
            return t
    return ""


def _disks(ex: Exec, c: _Ctx) -> Finding | None:
    prog, args = ex.prog, ex.args
    if args and all(a in ("--help", "-h", "-V", "--version") for a in args):
        return None
    if prog.startswith("mkfs") or prog in ("mke2fs", "mkswap", "mkdosfs", "mkntfs", "mkexfatfs", "newfs"):
        target = _mkfs_target(ex, c)
        if not target:
            return None  # a filesystem image or swap file: only a file is written
        return deny("hardline.mkfs", f"{prog} creates a filesystem on {target} and erases what was on the device "
                    "(only a regular file path as target is allowed).", HINT, ex.text)
    wipe = ""
    if prog in ("wipefs", "sfdisk") and _has_flag(args, "n", ("--no-act",)):
        return None  # a dry run: nothing is written
    if prog == "sgdisk" and _has_flag(args, "P", ("--pretend",)):
        return None
    if prog == "wipefs" and _has_flag(args, "ao", ("--all", "--offset")):
        wipe = "wipefs erases filesystem and partition signatures"
    elif prog in ("sgdisk",) and _has_flag(args, "Zzo", ("--zap", "--zap-all", "--clear")):
        wipe = "sgdisk --zap/--clear destroys the partition table"
    elif prog == "sfdisk" and not _has_flag(args, "ldsV", ("--list", "--dump", "--show-size", "--verify", "--json")):
        wipe = "sfdisk rewrites the partition table"
    elif prog in ("fdisk", "gdisk", "cfdisk") and not _has_flag(args, "l", ("--list",)):
        wipe = f"{prog} rewrites the partition table"
    elif prog == "parted" and any(a in ("mklabel", "mktable", "rm", "mkpart", "resizepart") for a in args):
        wipe = "parted rewrites the partition table"
    elif prog == "blkdiscard":
        wipe = "blkdiscard discards every block of the device"
    elif prog == "shred" and any(BLOCK_DEVICE.match(c.path(ex, a)[0] or "") for a in _operands(args)):
        wipe = "shred overwrites a whole device"
    if wipe:
        return deny("hardline.disk_wipe", wipe + ".", HINT, ex.text)
    return None


def _kill_targets(args: list[str]) -> tuple[str, list[str]] | None:
    """(signal, pids) of kill(1) / bash's kill: the first `-SIG`, `-s SIG`, `-n N` is the signal,
    every later word a pid (`kill -9 -1`: signal 9 to pid -1, every process); None for a listing."""
    sig, given, pids, i = "TERM", False, [], 0
    while i < len(args):
        a = args[i]
        if a == "--":
            pids += args[i + 1:]
            break
        if pids or given or not a.startswith("-") or len(a) == 1:
            pids.append(a)
        elif a in ("-l", "-L", "--list", "--table"):
            return None
        elif a in ("-s", "-n", "--signal") and i + 1 < len(args):
            sig, given, i = args[i + 1], True, i + 1
        elif a.startswith("--signal="):
            sig, given = a.split("=", 1)[1], True
        elif a not in ("-q", "--queue", "-p", "--pid", "-a", "--all"):
            sig, given = a[1:], True
        i += 1
    return sig.upper(), pids


def _power(ex: Exec, c: _Ctx) -> Finding | None:
    prog, args = ex.prog, ex.args
    if args and all(a in ("--help", "-h", "--version") for a in args):
        return None
    if prog in POWER:
        if prog == "shutdown" and _has_flag(args, "ck", ("--cancel", "--show")):
            return None  # cancels a scheduled shutdown / only sends the warning
        if prog in ("halt", "reboot", "poweroff") and _has_flag(args, "w", ("--wtmp-only",)):
            return None  # only writes the wtmp record
        return deny("hardline.power", f"{prog} stops or restarts the host.", HINT, ex.text)
    if prog in ("init", "telinit") and args and args[0] in ("0", "6", "1", "s", "S"):
        return deny("hardline.power", f"{prog} {args[0]} changes the host's runlevel (halt/reboot).", HINT, ex.text)
    if prog in ("systemctl", "loginctl") and any(a in POWER_VERBS for a in _operands(args, frozenset(
            {"--when", "-H", "--host", "-M", "--machine", "-t", "--type", "-p", "--property"}))[:1]):
        when = next((args[i + 1] if a == "--when" and i + 1 < len(args) else a.split("=", 1)[1]
                     for i, a in enumerate(args) if a == "--when" or a.startswith("--when=")), "")
        if when in ("cancel", "show") or "--dry-run" in args:
            return None  # cancels / shows a scheduled shutdown, or prints what would be done
        return deny("hardline.power", f"{prog} {_operands(args)[0]} stops or restarts the host.", HINT, ex.text)
    if prog == "kill":
        t = _kill_targets(args)
        if t and t[0] not in HARMLESS_SIGNALS and ("-1" in t[1] or "1" in t[1]):
            return deny("hardline.power", f"kill -{t[0]} {' '.join(t[1])}: signalling every process (-1) or init (1) "
                        "takes the host down.", HINT, ex.text)
    if prog == "killall5" and not (args and args[0] in ("-0", "-HUP", "-1")):
        return deny("hardline.power", "killall5 signals every process on the host.", HINT, ex.text)
    return None


def _command_path(args: list[str]) -> list[str]:
    """`az storage blob delete --name x` -> [storage, blob, delete]: the words before the first option."""
    return args[:next((i for i, a in enumerate(args) if a.startswith("-")), len(args))]


def _dry_run(args: list[str]) -> bool:
    """Options with which a cloud or cluster CLI only prints what it would do."""
    return any(a in ("--dry-run", "--dryrun", "--generate-cli-skeleton", "--what-if") or (
        a.startswith(("--dry-run=", "--generate-cli-skeleton=")) and a != "--dry-run=none") for a in args)


def _cloud(ex: Exec, c: _Ctx) -> Finding | None:
    prog, args = ex.prog, ex.args
    ops = [a for a in args if not a.startswith("-")]
    why = ""
    if prog in ("aws", "gcloud", "az", "kubectl", "oc", "gsutil") and (_dry_run(args) or "help" in ops[:3]):
        return None
    if prog == "aws" and len(ops) >= 2:
        svc, op = ops[0], ops[1]
        if op in AWS_ITEM_DELETES:
            pass  # one message, item, tag or object: data, not infrastructure
        elif op.startswith(("delete-", "terminate-", "deregister-", "purge-")) or op == "rb" or (
                svc == "s3" and op == "rm" and "--recursive" in args):
            why = f"aws {svc} {op} destroys cloud resources"
    elif prog in ("gcloud",) and (("delete" in ops and ops[:1] != ["config"]) or ops[:2] == ["storage", "rm"]):
        why = "gcloud ... delete destroys cloud resources"
    elif prog == "gsutil" and ops[:1] in (["rb"], ["rm"]) and (ops[0] == "rb" or _has_flag(args, "r")):
        why = "gsutil rm -r/rb destroys a bucket"
    elif prog == "az":
        path = _command_path(args)
        if any(w.startswith(("delete", "purge")) for w in path):
            group = next((g for g in AZ_ITEM_GROUPS if tuple(path[:len(g)]) == g), None)
            storage = group in (("storage", "blob"), ("storage", "file"))
            if group is None or (storage and path[len(group):] != ["delete"]):
                why = "az ... delete destroys cloud resources"
    elif prog in ("terraform", "tofu", "terragrunt", "pulumi", "cdk", "cdktf") and (
            "destroy" in ops or ("apply" in ops and "-destroy" in args)):
        why = f"{prog} destroy tears down the infrastructure it manages"
    elif prog in ("kubectl", "oc") and ops[:1] == ["delete"] and (
            any(o in ("namespace", "namespaces", "ns", "pv", "node", "nodes", "crd") for o in ops[1:2])
            or _has_flag(args, "A", ("--all", "--all-namespaces"))):
        why = f"{prog} delete of namespaces, volumes or --all objects destroys a cluster's workloads"
    elif prog == "gh" and (ops[:2] in (["repo", "delete"], ["repo", "archive"])
                           or (len(ops) >= 2 and ops[1] == "delete" and ops[0] not in GH_ITEM_GROUPS)
                           or (ops[:1] == ["api"] and any(
                                a.upper() in ("-XDELETE", "--METHOD=DELETE") or (
                                    a in ("-X", "--method") and i + 1 < len(args) and args[i + 1].upper() == "DELETE")
                                for i, a in enumerate(args)))):
        why = "deleting GitHub repositories, releases, issues or keys cannot be undone"
    elif prog in ("bfg",):
        why = "bfg rewrites a repository's entire history"
    elif prog in ("dropdb",):
        why = "dropdb deletes a database"
    elif prog == "mysqladmin" and "drop" in ops:
        why = "mysqladmin drop deletes a database"
    elif prog == "redis-cli" and any(o.upper() in ("FLUSHALL", "FLUSHDB") for o in ops):
        why = "redis FLUSHALL/FLUSHDB deletes every key"
    elif prog in DB_CLIENTS and any(DB_DROP.search(a) for a in args):
        why = f"{prog} with DROP/TRUNCATE deletes a database's data"
    if why:
        rule = "hardline.database_drop" if prog in DB_CLIENTS or prog in ("dropdb", "mysqladmin", "redis-cli") else (
            "hardline.repo_delete" if prog in ("gh", "bfg") else "hardline.cloud_destroy")
        return deny(rule, why + ".", HINT, ex.text)
    return None


def _exhaustion(ex: Exec, c: _Ctx) -> Finding | None:
    prog, args = ex.prog, ex.args
    if prog in ("fallocate", "truncate"):
        for i, a in enumerate(args):
            val = args[i + 1] if a in ("-l", "--length", "-s", "--size") and i + 1 < len(args) else (
                a[2:] if a.startswith(("-l", "-s")) and len(a) > 2 else (a.split("=", 1)[1] if a.startswith(
                    ("--length=", "--size=")) else ""))
            if val and _size(val) >= (HUGE if prog == "fallocate" else HUGE_SPARSE):
                what = "fills the disk" if prog == "fallocate" else (
                    "makes a sparse file larger than any disk: whatever copies it fills its disk")
                return deny("hardline.resource_exhaustion", f"{prog} of {val} {what}.", HINT, ex.text)
    if prog in ("stress", "stress-ng") and _has_flag(args, "md", ("--vm", "--vm-bytes", "--vm-keep", "--hdd",
                                                                   "--bigheap", "--malloc", "--fork")):
        return deny("hardline.resource_exhaustion", f"{prog} memory/disk hogs starve the host.", HINT, ex.text)
    if prog == "yes" and any(op in (">", ">>", "&>") for op, _t, _l in ex.redirects):
        return deny("hardline.resource_exhaustion", "yes redirected to a file never ends (disk or CPU exhaustion).",
                    HINT, ex.text)
    if prog == "cat" and any(a in ("/dev/zero", "/dev/urandom", "/dev/random") for a in args) and any(
            op in (">", ">>") and not HARMLESS_DEVICES.match(t) for op, t, _l in ex.redirects):
        return deny("hardline.resource_exhaustion", "copying an endless device into a file fills the disk.",
                    HINT, ex.text)
    if ex.loop is not None and (prog in NET_TOOLS_FOR_LOOPS or prog in LLM_CLIS):
        return deny("hardline.unbounded_loop",
                    f"an endless `while true` loop without break runs {prog} forever (cost and rate runaway).",
                    HINT, ex.text)
    return None


_EXEC_RULES = (_recursive_delete, _device_and_system_writes, _permissions, _disks, _power, _cloud, _exhaustion)


def check(an: Analysis, *, home: str | None, worktree: str, unknown_operands: str = "flag",
          role: str = "") -> Finding:
    """The first hardline denial; else operands of destructive commands known only at run
    time, refused or flagged as `hardline.unknown_operand` by governance.unknown_operands."""
    c = _Ctx(home_of(home), real(os.path.abspath(worktree)) if worktree else "/")
    if an.fork_bomb:
        return deny("hardline.fork_bomb", "a fork bomb spawns processes until the host falls over.", HINT,
                    an.fork_bomb)
    for lid, background in an.loops.items():
        if background:
            return deny("hardline.fork_bomb", "an endless loop that starts background jobs is a fork bomb.", HINT,
                        next((e.text for e in an.execs if e.loop == lid), ""))
    for ex in an.execs:
        for rule in _EXEC_RULES:
            f = rule(ex, c)
            if f is not None:
                return f
    if c.unknown:
        if unknown_operands == "deny":
            n = c.unknown[0]
            return deny("hardline.unknown_operand", n["reason"][0].upper() + n["reason"][1:] +
                        f", and role '{role}' refuses that (governance.unknown_operands = 'deny').", HINT_UNKNOWN,
                        n["evidence"])
        notes = [dict(n, reason=n["reason"] + "; allowed with a flag (governance.unknown_operands = 'flag')")
                 for n in c.unknown]
        return ok_flagged(notes)
    return ok("hardline.pass")
