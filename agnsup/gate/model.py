"""Plain values the gate takes and returns.

`GateContext` says what the role may do; `Decision` is what the gate decided.
Both are frozen records (agnsup/util/record.py: no pydantic, no dataclasses) so
importing the gate stays cheap, and a decision can be written to a receipt
as-is with `to_dict()`.
"""

from __future__ import annotations

import functools
import shlex

from ..util.record import Factory, Record

MODES = ("open", "locked", "readonly")
# Tools whose command agnsup runs in a cell (where `Kernel` applies). An agent
# runtime's own file and fetch tools run in no cell: nothing is kernel-backed there.
CELL_TOOLS = frozenset({"run_process", "run_shell"})

# Secrets and host state no tool call may read or write. `~` is expanded with
# GateContext.home; the state root is added when GateContext.state_root is set.
DEFAULT_DENY_PATHS = (
    "~/.ssh",
    "~/.aws",
    "~/.config/gcloud",
    "~/.docker",
    "~/.netrc",
    "~/.kube",
    "~/.gnupg",
    "/etc/shadow",
    "/etc/gshadow",
)


# Command-line clients that can send what they read (gate/inline.py shell_uploads); the checker loads
# inline.py only for a call with one of them or with an inline program (Analysis.exfil).
UPLOADERS = frozenset({"curl", "wget", "http", "https", "xh", "xhs", "nc", "ncat", "netcat", "socat", "telnet"})

class Kernel(Record, frozen=True):
    """What the kernel refuses inside a cell of the role, whatever the text says.

    Mirrors compiler.compile_plan and linux/mounts.py: governance.context
    derives it from the same policy keys (tested against a compiled plan).
    """

    # The cell has its own network namespace with only `lo` up (network deny/loopback,
    # and allowlist/internal, whose only way out is the controller's proxy): no
    # connection leaves the cell except through that proxy.
    netns: bool = False
    # Everything outside the worktree, the private /tmp and /dev/shm is mounted
    # read-only, recursively (filesystem.root = "ro"): writes there fail with EROFS.
    root_ro: bool = False
    # The worktree is re-attached read-only (filesystem.worktree = "ro"): writes into it fail with EROFS.
    worktree_ro: bool = False
    # Paths the mount namespace hides (filesystem.deny and the state root, as written;
    # `~` is GateContext.home): an empty read-only tmpfs or /dev/null in their place.
    masked: tuple[str, ...] = ()


class GateContext(Record, frozen=True):
    """Everything the gate needs to know about the role and the call."""

    # Role name, only used in messages.
    role: str = "executor"
    # "open": side effects (yellow zone) allowed; "locked": yellow only for the
    # tools in yellow_allow; "readonly": yellow and red denied.
    mode: str = "open"
    # "deny": no network tool may run; "loopback": only loopback URLs;
    # "host": the host's network, URLs still pass the SSRF guard;
    # "allowlist"/"internal": only what `egress` allows, through the controller's proxy.
    network: str = "deny"
    # allowlist/internal: the role's lists (netpolicy.Rules), judged by the same
    # matcher as the proxy's (gate/egress.py); None for the other modes.
    egress: object = None
    # Resolved worktree root: relative paths start here; writes are allowed inside it
    # unless worktree_writable is False (a role with filesystem.worktree = "ro").
    worktree: str = "."
    worktree_writable: bool = True
    # Extra writable roots (artifact dir, the cell's private /tmp => "/tmp").
    writable: tuple[str, ...] = ()
    # Extra deny paths on top of DEFAULT_DENY_PATHS (reads and writes refused).
    deny_paths: tuple[str, ...] = ()
    # agnsup's own state directory: always a deny path when set.
    state_root: str | None = None
    # Home of the invoking user, used to expand `~` and `$HOME`.
    home: str | None = None
    # Programs the role may run; empty (or containing "" or "*") means all.
    # An entry may hold several words ("git status"): see policy.py.
    allow_commands: tuple[str, ...] = ()
    # Programs (or "program subcommand --flag" prefixes) the role may not run.
    deny_commands: tuple[str, ...] = ()
    # Tool names a `locked` role explicitly allows in the yellow (and red) zone.
    yellow_allow: tuple[str, ...] = ()
    # What to do with shell text that does not parse: "deny" or "flag".
    # None => by mode: locked denies, open and readonly flag.
    unparseable: str | None = None
    # Run quotas as (key, limit) pairs (gate/quota.py KEYS); empty: none.
    quota: tuple[tuple[str, float], ...] = ()
    # What the run and agent hold now (quota.Usage), when the caller read the
    # journal; None: only limits of 0 can be judged.
    usage: object = None
    # For quota messages: the run and agent the call belongs to.
    run_id: str = ""
    agent_id: str = ""
    # What a cell of this role has the kernel refuse; None: the call runs in no
    # agnsup cell (an agent runtime's own gate), so nothing is kernel-backed.
    kernel: Kernel | None = None
    # A refusal the kernel makes anyway (network use under a network namespace,
    # a write under the read-only root, a read of a masked deny path), for a
    # cell tool under mode open: "flag" allows it with a flag (rule
    # *.kernel_enforced), "deny" refuses it early. Other modes always deny.
    kernel_enforced: str = "flag"
    # An operand of a destructive command (rm -r, find -delete, chmod -R, dd of=, shred) known only at
    # run time ($DIR, $(cmd), xargs input): "flag" allows it with the flag hardline.unknown_operand,
    # "deny" refuses it.
    unknown_operands: str = "flag"
    # git rules (gate/git.py RULES: "force_push", "reset_hard", ...) the role allows; "*": all.
    git_allow: tuple[str, ...] = ()
    # With the host network: destinations in shell commands and URL arguments that are not public
    # but may be reached anyway: categories ("loopback", "private", "link-local", "metadata", ...)
    # or addresses and networks ("10.1.0.0/16", "::1").
    allow_internal: tuple[str, ...] = ()
    # With the host network: "deny" refuses tunnels (ngrok, cloudflared, chisel, frpc, ssh -R/-D), "allow" runs them.
    tunnels: str = "deny"
    # Code decoded at run time and run (`base64 -d | sh`, `exec(bytes.fromhex(..))`; gate/unreadable.py):
    # "deny" refuses it (gate.unreadable_code), "flag" allows it with that flag; None: locked and readonly
    # deny, open flags.
    unreadable: str | None = None
    # Code downloaded and run (`curl ... | sh`) is flagged in every role (network.download_exec); with the
    # host network "deny" refuses it, "allow" runs it with the flag.
    download_exec: str = "deny"

    def flags_kernel_enforced(self, tool: str) -> bool:
        """Whether this call may turn a kernel-backed refusal into a flag."""
        return (self.kernel is not None and tool in CELL_TOOLS and self.mode == "open"
                and self.kernel_enforced == "flag")


class Decision(Record, frozen=True):
    """One verdict of the gate, carried to the receipt."""

    allowed: bool
    # Namespaced by the check that decided: "hardline.rm_root", "allow.yellow_open".
    rule: str
    # "green" | "yellow" | "red"
    zone: str
    # One sentence a user understands: which rule, why.
    reason: str
    # The check that decided: "hardline", "policy", "sandbox", "network", "zone", "quota".
    check: str
    # What to change in the role if the refusal was wrong.
    hint: str = ""
    # Advisory findings that did not deny ("unparseable", "audited", ...).
    flags: tuple[str, ...] = ()
    # For URL calls: the address the SSRF guard checked; connect to this one,
    # never re-resolve the name (a second answer may point inside).
    pinned: str = ""
    # The text that triggered the rule (a command, a path), for the receipt.
    evidence: str = ""
    # Refusals the kernel makes in the cell, allowed with a flag: dicts with
    # rule ("network.kernel_enforced", ...), reason and evidence.
    flagged: tuple[dict, ...] = ()

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in ("allowed", "rule", "zone", "reason", "check", "hint")}
        d["flags"] = list(self.flags)
        d.update((k, getattr(self, k)) for k in ("pinned", "evidence") if getattr(self, k))  # only when set
        if self.flagged:
            d["flagged"] = [dict(x) for x in self.flagged]
        return d


class Finding(Record, frozen=True):
    """What one check says: a denial (allowed=False) or a pass with flags."""

    allowed: bool
    rule: str
    reason: str
    hint: str = ""
    flags: tuple[str, ...] = ()
    pinned: str = ""
    evidence: str = ""
    extra: dict = Factory(dict)
    # Kernel-backed refusals this check turned into flags (see Decision.flagged).
    flagged: tuple[dict, ...] = ()


_PASSES: dict[str, Finding] = {}


def ok(rule: str, reason: str = "", flags: tuple[str, ...] = (), pinned: str = "") -> Finding:
    if not (flags or pinned):  # a plain pass is the same frozen value every time: build it once
        f = _PASSES.get(rule + "\0" + reason)
        if f is None:
            f = _PASSES[rule + "\0" + reason] = Finding(True, rule, reason)
        return f
    return Finding(True, rule, reason, flags=flags, pinned=pinned)


def ok_flagged(notes: list[dict], flags: tuple[str, ...] = (), pinned: str = "") -> Finding:
    """A pass that carries kernel-backed refusals as flags: the trail shows the first one's rule."""
    rules = tuple(dict.fromkeys(n["rule"] for n in notes))
    return Finding(True, notes[0]["rule"], notes[0]["reason"], flags=rules + tuple(f for f in flags if f not in rules),
                   pinned=pinned, evidence=notes[0].get("evidence", ""), flagged=tuple(notes))


def deny(rule: str, reason: str, hint: str = "", evidence: str = "") -> Finding:
    return Finding(False, rule, reason, hint=hint, evidence=evidence)


# --- what a call would run: commands.py and shell.py build it, every check reads it ---

MAX_DEPTH = 8  # nested sh -c / eval levels before we give up (and say so)


class Exec(Record):
    """One program that would run."""

    argv: list[str]                 # words after unwrapping; argv[0] is the program as written
    literal: list[bool]             # per word: True when it has no expansion
    via: tuple[str, ...] = ()       # wrappers peeled off, outermost first
    redirects: list[tuple[str, str, bool]] = Factory(list)  # (op, target, literal)
    background: bool = False        # ends with `&`
    loop: int | None = None         # id of the enclosing `while true` loop without break
    cwd: str | None = None          # directory from a literal `cd` earlier in the script
    text: str = ""                  # source excerpt, for messages
    from_stdin: bool = False        # xargs: more operands arrive on stdin

    @functools.cached_property
    def prog(self) -> str:
        return prog_name(self.argv[0]) if self.argv else ""

    @property
    def args(self) -> list[str]:
        return self.argv[1:]


class Analysis(Record):
    execs: list[Exec] = Factory(list)
    unparseable: list[str] = Factory(list)   # why the text could not be judged
    fork_bomb: str = ""                                     # excerpt, when one was seen
    loops: dict[int, bool] = Factory(dict)    # infinite loop id -> has background job
    flags: set[str] = Factory(set)            # advisory findings
    dynamic: list[str] = Factory(list)        # program words we cannot know statically
    parsed_shell: bool = False                              # the shell parser was used
    unjudgeable: list[str] = Factory(list)    # why part of the text was not judged (nesting too deep)
    exfil: list[dict] = Factory(list)         # inline programs that read a credential and send (gate/inline.py)
    # Code run from text the gate cannot read (gate/unreadable.py): (why, evidence) pairs. Tuples, not
    # Factory lists: almost every line has none, and an Analysis is built several times per judged line.
    unreadable_code: tuple[tuple[str, str], ...] = ()   # decoded at run time (`base64 -d | sh`)
    downloads: tuple[tuple[str, str], ...] = ()         # downloaded and run (`curl ... | sh`)

    def merge(self, other: "Analysis") -> None:
        self.execs.extend(other.execs)
        self.unparseable.extend(other.unparseable)
        self.unjudgeable.extend(other.unjudgeable)
        self.exfil.extend(other.exfil)
        if other.unreadable_code or other.downloads:
            self.unreadable_code += tuple(x for x in other.unreadable_code if x not in self.unreadable_code)
            self.downloads += tuple(x for x in other.downloads if x not in self.downloads)
        self.fork_bomb = self.fork_bomb or other.fork_bomb
        self.loops.update(other.loops)
        self.flags |= other.flags
        self.dynamic.extend(other.dynamic)
        self.parsed_shell = self.parsed_shell or other.parsed_shell


def operands(args: list[str], with_value: frozenset[str] = frozenset()) -> list[str]:
    """The words of `args` that are not options (nor values of the options in `with_value`);
    everything after `--` is an operand."""
    out, i, dash = [], 0, False
    while i < len(args):
        a = args[i]
        if dash or a == "-" or not a.startswith("-"):
            out.append(a)
        elif a == "--":
            dash = True
        elif a in with_value:
            i += 1
        i += 1
    return out


def prog_name(word: str) -> str:
    """`/usr/bin/git` -> `git`; `\\rm` -> `rm`."""
    w = word.lstrip("\\")
    return w.rsplit("/", 1)[-1] if "/" in w else w


def split_words(s: str) -> list[str]:
    try:
        return shlex.split(s)
    except ValueError:
        return s.split()
