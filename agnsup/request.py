"""The cell request: the one carrier of a cell's options, from every front door to the broker.

Each option is declared once, below, with its default, its kind (how a value
is checked), the command-line flags that spell it and, for the options a model
may set, its JSON schema. From this one declaration come the `run`/`spawn`
options of the CLI (cli.py) and of its fast parser (entry.py), the keyword
arguments of `run_process` and `Supervisor.spawn`, the keys of a serve
`spawn` request and RUN_PROCESS_SCHEMA for LLM function calling
(tests/unit/test_request.py checks that they agree).

`CellRequest.make(argv, **options)` checks every value before anything is
created (a bad value is a UsageError naming the option), so a refusal never
leaves a lock or a half-made cell behind.
"""
from __future__ import annotations

from .errors import UsageError
from .util.record import Factory, Record


class Opt(Factory):
    """A cell option: its default (copied per request), kind, CLI flags, help and JSON schema."""
    __slots__ = ("default", "kind", "flags", "help", "schema", "metavar")

    def __init__(self, default, kind: str, *flags: str, help: str = "", schema: dict | None = None,
                 metavar: str | None = None):
        super().__init__(lambda: list(default) if isinstance(default, list) else default)
        self.default, self.kind, self.flags, self.help = default, kind, flags, help
        self.schema, self.metavar = schema, metavar


TYPE_CHECKING = False  # `import typing` would cost every `agnsup run` (tests/test_startup_cost.py)
if TYPE_CHECKING:
    from typing import TypeVar
    T = TypeVar("T")

    def opt(default: T, kind: str, *flags: str, help: str = "", schema: dict | None = None,
            metavar: str | None = None) -> T:
        """A field's Opt typed as its default, as dataclasses.field is: the class holds the Opt, a request the value."""
        ...
else:
    opt = Opt


# kind -> (accepts, what it should be): checked by CellRequest.make
def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and v not in (float("inf"),)


KINDS = {
    "str": (lambda v: isinstance(v, str) and v != "", "a non-empty string"),
    "optstr": (lambda v: v is None or (isinstance(v, str) and v != ""), "a non-empty string"),
    "pos": (lambda v: v is None or (_number(v) and v > 0), "a number of seconds > 0"),
    "nonneg": (lambda v: v is None or (_number(v) and v >= 0), "a number of seconds >= 0"),
    "env": (lambda v: v is None or _strings(v) or (isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v)),
            'an object of strings ({"KEY": "VALUE"}) or a list of "KEY=VALUE" / "KEY" strings'),
    "dict": (lambda v: v is None or _strings(v), "an object of strings"),
    "secrets": (lambda v: v is None or (isinstance(v, dict) and all(isinstance(k, str) and isinstance(t, dict)
                                                                    for k, t in v.items()))
                or (isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v)),
                'an object of secret tables ({"NAME": {"source": ..., "hosts": [...], ...}}) or a list of '
                '"NAME:source=...,hosts=HOST+HOST,inject=...,env=VAR" strings'),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "death": (lambda v: v is None or v in ("kill", "keep"), '"kill" or "keep"'),
    "changes": (lambda v: v is None or v in ("at_exit", "live"), '"at_exit" or "live"'),
    "pty": (lambda v: v is None or (isinstance(v, dict) and set(v) == {"cols", "rows"}
                                    and all(_size(x) for x in v.values())),
            'null or {"cols": N, "rows": N} with N from 1 to 65535'),
}


def _strings(v) -> bool:
    return isinstance(v, dict) and all(isinstance(k, str) and isinstance(x, str) for k, x in v.items())


def _size(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 < v < 65536


class CellRequest(Record):
    """What a front door asks for: one command and how to run it."""
    argv: list[str]
    role: str = opt("executor", "str", "--role", help="Role policy (agnsup/policies/ROLE.toml).",
                    schema={"type": "string", "description": "Role policy to apply (executor, readonly, networked).",
                            "default": "executor"})
    run_id: str = opt("default", "str", "--run-id", "--run", help="Run this cell belongs to.")
    agent_id: str = opt("default", "str", "--agent", "--agent-id", help="Agent this cell belongs to.")
    cell_id: str | None = opt(None, "optstr", "--cell", "--cell-id", help="Cell id (default: generated, c-XXXXXXXX).")
    workdir: str | None = opt(None, "optstr", "--workdir", help="Directory the command runs in (default: the "
                              "current directory); the worktree is its enclosing project root (.git, .hg or "
                              ".agnsup-worktree), else the directory itself.", schema={"type": "string",
                                                             "description": "Worktree directory the command runs in."})
    timeout: float | None = opt(None, "pos", "--timeout", metavar="SECONDS", help="Stop the cell after SECONDS "
                                "(SIGTERM, grace, SIGKILL); exit 124.",
                                schema={"type": "number", "exclusiveMinimum": 0,
                                        "description": "Seconds before the cell is stopped (exit 124)."})
    lock_timeout: float | None = opt(None, "nonneg", "--lock-timeout", metavar="SECONDS",
                                     help="Give up after SECONDS waiting for the worktree lock (exit 75).")
    env: list[str] | dict = opt([], "env", "--env", metavar="KEY=VALUE", help="Set a variable in the cell "
                                "(repeatable). KEY alone passes the host's value.",
                                schema={"type": "object", "additionalProperties": {"type": "string"},
                                        "description": "Extra environment variables for this call."})
    # Credentials the cell uses but never sees (agnsup/secrets.py): the runtime's to give, never the model's
    # (no schema: no tool input takes it; sandboxd neither). The cell gets the placeholder agnsup-secret:NAME.
    secrets: dict | None = opt(None, "secrets", "--secret", metavar="NAME:KEY=VAL,...",
                               help="A secret the cell uses but never sees (repeatable): NAME:source=env:VAR|"
                                    "file:/PATH|command:/PROG ARGS,hosts=HOST[:PORT]+HOST...,inject=bearer|"
                                    "basic:USER|header:NAME|placeholder,env=VAR (the cell's VAR holds "
                                    "agnsup-secret:NAME; the proxy puts the value on HTTPS requests to HOSTs). "
                                    "Needs an allowlist role listing the hosts.")
    receipt_file: str | None = opt(None, "optstr", "--receipt", metavar="FILE",
                                   help="Also write the cell's receipt to FILE.")
    on_controller_death: str | None = opt(None, "death", "--on-controller-death", metavar="kill|keep",
                                          help="kill: the cell dies with its controller at once; keep: it "
                                               "outlives it until the janitor runs (default: the role's "
                                               "process.on_controller_death).")
    changes: str | None = opt(None, "changes", "--changes", metavar="at_exit|live",
                              help="at_exit: the cell works on an overlay of its worktree whose changes land "
                                   "when it ends (agnsup diff/undo); live: its writes land as they happen, "
                                   "uncaptured (default: the role's filesystem.changes).")
    # Not spelled on the command line: the caller's environment (serve gets its
    # client's), whether output is captured, and which front door asked.
    host_env: dict | None = opt(None, "dict")
    capture: bool = opt(True, "bool")
    # Live I/O (Supervisor.read_output/write_stdin/resize, serve's output/stdin/resize ops).
    # stream and pty imply capture: the captured files stay the record.
    stdin: bool = opt(False, "bool", help="The cell's fd 0 is a pipe the supervisor writes (write_stdin) "
                      "instead of /dev/null.")
    pty: dict | None = opt(None, "pty", help='{"cols": N, "rows": N}: the cell\'s fds 0-2 and controlling '
                           'terminal are a pty; its output is the stream "tty".')
    stream: bool = opt(False, "bool", help="Keep the ordered output chunks for read_output (besides the "
                       "captured files).")
    entry: str = opt("api", "str")
    # argv is ["sh", "-c", LINE] made by a front door from one shell command line
    # (MCP run_shell): the gate judges LINE as shell text, as tool run_shell.
    shell: bool = opt(False, "bool")
    # A long-lived cell (a server, a watcher: CLI/MCP spawn, sandboxd's background processes, the API's
    # spawn when asked): under the role's `[filesystem] changes = "auto"` its worktree writes land as they
    # happen (live), not when it ends; waited-for calls capture them (docs/architecture.md "Reversible cells").
    long_lived: bool = opt(False, "bool")

    @classmethod
    def options(cls) -> dict[str, Opt]:
        return {k: v for k, v in cls._defaults.items() if isinstance(v, Opt)}

    @classmethod
    def make(cls, argv, **options) -> "CellRequest":
        """A checked request; UsageError names the first bad option."""
        known = cls.options()
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise UsageError(f"unknown option(s): {', '.join(unknown)} (known: argv, {', '.join(known)})")
        if isinstance(argv, (str, bytes)) or not isinstance(argv, (list, tuple)) or not argv \
                or not all(isinstance(a, str) for a in argv):
            raise UsageError("argv: must be a non-empty list of strings (the command and its arguments; "
                             "no shell is involved)")
        for name, value in options.items():
            accepts, what = KINDS[known[name].kind]
            if value is None and known[name].default is not None:
                options[name] = known[name].make()  # None means "the default" for every option
                continue
            if not accepts(value):
                raise UsageError(f"{name}: must be {what}, not {value!r}")
        if options.get("shell") and (len(argv) != 3 or argv[1] != "-c"):
            raise UsageError("shell: argv must be [SHELL, \"-c\", LINE]")
        env = options.get("env")
        if isinstance(env, dict):
            options["env"] = [f"{k}={v}" for k, v in env.items()]
        elif isinstance(env, tuple):
            options["env"] = list(env)
        sec = options.get("secrets")
        if sec is not None and not isinstance(sec, dict):  # the CLI's --secret strings: parsed, checked here
            if not sec:
                options["secrets"] = None
            else:
                from .secrets import parse_flag
                tables: dict = {}
                for text in sec:
                    ref = parse_flag(text)
                    if ref.name in tables:
                        raise UsageError(f"--secret {ref.name}: given twice")
                    tables[ref.name] = {k: v for k, v in ref.table().items() if k != "name" and v is not None}
                options["secrets"] = tables
        elif sec == {}:
            options["secrets"] = None
        if options.get("stream") or options.get("pty") is not None:
            options["capture"] = True  # a live cell's output is always captured: the files are the record
        return cls(argv=list(argv), **options)

    @property
    def live(self) -> bool:
        """Its output is streamed (read_output)."""
        return self.stream or self.pty is not None


def tool_schema(name: str, description: str, exclude: tuple[str, ...] = ()) -> dict:
    """The JSON schema of a tool that takes a cell request: argv plus every option a model may set
    (but those in `exclude`: options the front door fixes itself, e.g. the MCP server's role)."""
    props = {"argv": {"type": "array", "items": {"type": "string"}, "minItems": 1,
                      "description": "The command and its arguments; no shell is involved."}}
    props.update({k: o.schema for k, o in CellRequest.options().items()
                  if o.schema is not None and k not in exclude})
    return {"name": name, "description": description,
            "parameters": {"type": "object", "properties": props, "required": ["argv"],
                           "additionalProperties": False}}
