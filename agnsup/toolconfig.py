"""What a cell's HOME gets of the user's tool configuration (filesystem.home_config).

The invoking user's home stays hidden; the cell's HOME is its private
/tmp/home. Into it go files written here, holding only what a tool needs to
behave as the user expects, never what could be a credential:

    git  ~/.gitconfig, ~/.config/git/config: [user] name and email only; plus
         safe.directory = the worktree and * (a repository owned by another
         uid is the one the user asked to work in, or one the cell reads:
         whatever git runs from its config runs confined in the cell)
    pip  ~/.config/pip/pip.conf, ~/.pip/pip.conf: the index and install keys
         of PIP_KEYS, in their sections; a URL holding a user or password is
         dropped
    npm  ~/.npmrc: `registry` and `@scope:registry` lines whose URL holds no
         user or password; `//host/:_authToken` lines and the like never

and from the host environment the PIP_* / NPM_CONFIG_* variables of ENV_KEYS
whose value holds no credentials. A name the env secret rule flags
(secretkeys.looks_secret) never crosses, whatever the list says. What was
dropped is named (never its value) in the receipt's isolation.home_config.
Pure: reads files, returns text; compiler.py and spec.py place it.
"""
from __future__ import annotations

import os

from .util.secretkeys import looks_secret

TOOLS = ("git", "pip", "npm")
PIP_KEYS = ("index-url", "extra-index-url", "trusted-host", "find-links", "no-index", "timeout", "default-timeout",
            "retries", "prefer-binary", "only-binary", "no-binary", "disable-pip-version-check", "no-cache-dir", "cert")
ENV_KEYS = ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_TRUSTED_HOST", "PIP_FIND_LINKS", "PIP_NO_INDEX",
            "PIP_TIMEOUT", "PIP_RETRIES", "PIP_PREFER_BINARY", "PIP_ONLY_BINARY", "PIP_NO_BINARY",
            "PIP_DISABLE_PIP_VERSION_CHECK", "PIP_DEFAULT_TIMEOUT", "PIP_CERT", "NPM_CONFIG_REGISTRY")
ENV_TOOL = {"PIP": "pip", "NPM": "npm"}


def holds_credentials(value: str) -> bool:
    """A URL (or a list of them) with a user or password in it: https://user:token@host/..."""
    for word in value.replace(",", " ").split():
        scheme, sep, rest = word.partition("://")
        if sep and "@" in rest.split("/", 1)[0]:
            return True
    return False


def _read(path: str) -> str | None:
    """The file's text, or None; one stat a cell while it keeps its identity (util/filememo.py)."""
    from .util.filememo import read_text
    return read_text(path)


def _ini(text: str) -> list[tuple[str, str, str]]:
    """(section, key, value) of a git/pip style file; continuation lines are joined."""
    out, section = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1].strip().lower()
            continue
        if raw[:1] in " \t" and out and "=" not in line:  # pip: a value continued on the next line
            s, k, v = out[-1]
            out[-1] = (s, k, f"{v} {line}".strip())
            continue
        k, eq, v = line.partition("=")
        if eq:
            out.append((section, k.strip().lower(), v.strip().strip('"')))
    return out


def git_file(home: str, worktree: str, include: str | None) -> tuple[str, list[str], list[str]]:
    """(the cell's ~/.gitconfig, keys taken, what was left out)."""
    user = {}
    for path in (os.path.join(home, ".config", "git", "config"), os.path.join(home, ".gitconfig")):
        for section, key, value in _ini(_read(path) or ""):
            if section == "user" and key in ("name", "email"):
                user[key] = value
    lines, taken = [], []
    if include:  # filesystem.home_allow shows the whole file: the user chose it
        lines += ["[include]", f"\tpath = {include}"]
        taken.append("include")
    if any(user.values()):
        lines.append("[user]")
        for k in ("name", "email"):
            if user.get(k):
                lines.append(f"\t{k} = {user[k]}")
                taken.append(f"user.{k}")
    # every other repository too: a mapped cell sees the host's repositories as owned by nobody (a bare
    # repository it fetches from), and what their config runs, runs in the cell
    lines += ["[safe]", f"\tdirectory = {worktree}", "\tdirectory = *"]
    taken.append("safe.directory")
    return "\n".join(lines) + "\n", taken, []


def _hidden_paths(value: str, home: str, shown) -> bool:
    """A value naming a file in the hidden home (find-links = ~/wheels, cert = ~/ca.pem):
    the cell could not read it, so the key would only break the tool."""
    for word in value.split():
        path = os.path.expanduser(word) if word.startswith("~") else word.removeprefix("file://")
        if path.startswith(home.rstrip("/") + "/") and not shown(path):
            return True
    return False


def pip_file(home: str, shown=lambda path: False) -> tuple[str | None, list[str], list[str]]:
    """`shown(path)`: whether the cell sees that path of the home (filesystem.home_allow)."""
    kept: dict[str, list[tuple[str, str]]] = {}
    taken, dropped = [], []
    for path in (os.path.join(home, ".pip", "pip.conf"), os.path.join(home, ".config", "pip", "pip.conf")):
        for section, key, value in _ini(_read(path) or ""):
            what = f"{section}.{key}"
            if key not in PIP_KEYS or looks_secret(key.replace("-", "_")):
                dropped.append(what)
            elif holds_credentials(value):
                dropped.append(f"{what} (holds credentials)")
            elif _hidden_paths(value, home, shown):
                dropped.append(f"{what} (names a path in the hidden home; list it in filesystem.home_allow)")
            else:
                kept.setdefault(section, [])
                kept[section] = [(k, v) for k, v in kept[section] if k != key] + [(key, value)]
                taken.append(what)
    if not kept:
        return None, [], dropped
    text = "".join(f"[{s}]\n" + "".join(f"{k} = {v}\n" for k, v in kv) for s, kv in kept.items())
    return text, sorted(set(taken)), dropped


def npm_file(home: str) -> tuple[str | None, list[str], list[str]]:
    taken, dropped, lines = [], [], []
    for key, value in ((k, v) for _, k, v in _ini(_read(os.path.join(home, ".npmrc")) or "")):
        if (key == "registry" or (key.startswith("@") and key.endswith(":registry"))) \
                and not holds_credentials(value):
            lines.append(f"{key}={value}")
            taken.append(key)
        else:  # //host/:_authToken, _auth, username, email, cafile, ...: left in the hidden home
            dropped.append(key if not key.startswith("//") else "//" + key[2:].split("/", 1)[0] + "/:...")
    return ("\n".join(lines) + "\n" if lines else None), taken, dropped


_MADE: dict = {}  # (tools, home, worktree, include, the sources' texts) -> home_files' answer (shown() not asked)


def _sources(home: str) -> tuple[str, ...]:
    """Every file home_files may read."""
    return (os.path.join(home, ".config", "git", "config"), os.path.join(home, ".gitconfig"),
            os.path.join(home, ".pip", "pip.conf"), os.path.join(home, ".config", "pip", "pip.conf"),
            os.path.join(home, ".npmrc"))


def home_files(tools, home: str, worktree: str, git_include: str | None = None, shown=lambda path: False):
    """([(path under the cell's HOME, text)], {tool: {"taken": [...], "dropped": [...]}}).

    The answer is a function of the arguments and the sources' texts (each one stat while unchanged, _read), and
    of what `shown` answers, which looks at the host at every cell: an answer is remembered only when `shown`
    was not asked (no value named a path in the home)."""
    key = (tuple(tools), home, worktree, git_include, tuple(_read(p) for p in _sources(home)))
    made = _MADE.get(key)
    if made is None:
        asked = []
        made = _home_files(key[0], home, worktree, git_include, lambda path: asked.append(path) or shown(path))
        if asked:
            return made
        if len(_MADE) >= 64:
            _MADE.clear()
        _MADE[key] = made
    files, report = made
    return list(files), {tool: {k: list(v) for k, v in r.items()} for tool, r in report.items()}


def _home_files(tools, home: str, worktree: str, git_include: str | None, shown):
    files, report = [], {}
    makers = {"git": (".gitconfig", lambda: git_file(home, worktree, git_include)),
              "pip": (os.path.join(".config", "pip", "pip.conf"), lambda: pip_file(home, shown)),
              "npm": (".npmrc", lambda: npm_file(home))}
    for tool in tools:
        rel, make = makers[tool]
        text, taken, dropped = make()
        if text is not None:
            files.append((rel, text))
        if taken or dropped:
            report[tool] = {"taken": taken, "dropped": dropped}
    return files, report


_ENV_KEYS: dict = {}  # the tools' tuple -> the ENV_KEYS that may pass for them (a pure function of the tuple)


def _env_keys(tools: tuple) -> tuple[str, ...]:
    keys = _ENV_KEYS.get(tools)
    if keys is None:
        keys = _ENV_KEYS[tools] = tuple(k for k in ENV_KEYS
                                        if ENV_TOOL[k.split("_", 1)[0]] in tools and not looks_secret(k))
    return keys


def host_env(tools, host_env) -> tuple[dict, list[str]]:
    """(the ENV_KEYS of the listed tools to pass, the names left out for holding credentials)."""
    out, dropped = {}, []
    for k in _env_keys(tuple(tools)):
        if k not in host_env:
            continue
        if holds_credentials(host_env[k]):
            dropped.append(k)
        else:
            out[k] = host_env[k]
    return out, dropped
