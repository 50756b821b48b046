"""Finding, validating and caching role policies.

Policy files ship inside the package (`agnsup.policies`, read with
importlib.resources); `AGNSUP_POLICY_DIR` names a directory searched first.
A file is validated by the pydantic models once; the validated form is cached
as JSON under `<state>/cache/`, keyed by the file's sha256, so the spawn path
neither parses TOML nor imports pydantic when nothing changed.

`load` returns a `Frozen` view of the validated policy: every key the models
define is present (pydantic filled in the defaults once, at validation), so no
reader re-states a default, and a misspelt key fails loudly. Read it as
`pol.limits.grace` or `pol["limits"]["grace"]`; `pol._digest`, `pol._file` and
`pol._preset` say where it came from.

A role may name a preset (`[governance] preset = "regulated"`): a file
`presets/<name>.toml` next to the roles whose sections the role inherits.
Keys the role sets win; list keys that deny (`governance.deny_commands`,
`filesystem.deny`) are joined; keys in the preset's `fixed` list are floors a
role may tighten but never loosen. docs/policy.md describes the format.
"""
from __future__ import annotations

import json
import os
import time
from contextlib import suppress

from .util import filememo
from .util.digest import sha256
from .errors import PolicyError

CACHE_VERSION = "15"  # 3: isolation, process; 4: filesystem.home(_allow); 5: env.passthrough by name;
#                     6: network lists; 7: git, redaction, destinations; 8: process.on_controller_death;
#                     9: limits ranges (pids_max/memory_max >= 1, timeout > 0);
#                     10: env.path @venv, filesystem.home_config, filesystem.cache(_tools);
#                     11: isolation.require "limits"; 12: filesystem.devices, limits.shm_max,
#                     filesystem.writable_protected, filesystem.unix_sockets; 13: isolation.host_root,
#                     require "mapped_uid", limits.tmp_max; 14: filesystem.changes(_keep, _keep_bytes),
#                     require "reversible"; 15: isolation.reduced
PRESET_SECTIONS = ("governance", "network", "filesystem", "limits", "quota")
# Lists a preset and a role join (both deny or protect): a role adds entries, never drops one.
JOINED_LISTS = ("governance.deny_commands", "filesystem.deny", "network.deny", "governance.redact")
# Lists that allow: when a preset fixes one, a role may keep or drop entries, never add one.
ALLOW_LISTS = ("governance.git_allow", "network.allow_internal")
# Values from loosest to strictest, for the keys a preset may fix.
STRICTNESS = {
    "governance.mode": ("open", "locked", "readonly"),
    "governance.unparseable": (None, "flag", "deny"),
    "governance.kernel_enforced": ("flag", "deny"),
    "governance.unknown_operands": ("flag", "deny"),
    "governance.unreadable": (None, "flag", "deny"),
    "network.download_exec": ("allow", "deny"),
    "network.tunnels": ("allow", "deny"),
    # internal opens the private network (databases, admin consoles) to listed names;
    # allowlist opens listed names on the public internet, private addresses only with allow_private
    "network.mode": ("host", "internal", "allowlist", "loopback", "deny"),
    "filesystem.root": ("rw", "ro"),
    "filesystem.worktree": ("rw", "ro"),
    "filesystem.home": ("ro", "hidden"),
    "filesystem.changes": ("live", "auto", "at_exit"),
}


_PACKAGED: list = []  # [the packaged roles' directory], once per process: the controller's own package


def _packaged_dir() -> str:
    # importlib.resources.files() returns the package directory for an
    # installed wheel; importing it costs ~10 ms on every start, so the
    # package's own __path__ is used when it is a real directory (zip imports
    # fall back to importlib.resources). Where the running package lives does not change under it: asked once
    # (issue 29, sixth round: three stats a cell's policy.load).
    if _PACKAGED:
        return _PACKAGED[0]
    from . import policies
    d = list(policies.__path__)[0]
    if not os.path.isdir(d):
        from importlib.resources import files
        d = str(files("agnsup.policies"))
    _PACKAGED.append(d)
    return d


def policy_dirs() -> list[str]:
    dirs = []
    extra = os.environ.get("AGNSUP_POLICY_DIR")
    if extra:
        dirs.append(extra)
    dirs.append(_packaged_dir())
    return dirs


def _tomls(sub: str = "") -> list[tuple[str, str]]:
    """(directory, file name) of each *.toml in `sub` of every policy dir, in search order."""
    found = []
    for d in policy_dirs():
        sd = os.path.join(d, sub) if sub else d
        with suppress(OSError):
            found += [(sd, n) for n in sorted(os.listdir(sd)) if n.endswith(".toml")]
    return found


def _lookup(sub: str, name: str) -> str | None:
    """The first policy dir's `sub/name.toml`; None when there is none."""
    for d in policy_dirs():
        p = os.path.join(d, sub, name + ".toml")
        if os.path.isfile(p):
            return p
    return None


def _plain(name: str) -> bool:
    return bool(name) and "/" not in name and not name.startswith(".")


def known_roles() -> list[str]:
    return sorted({n[:-5] for _, n in _tomls()})


def known_presets() -> list[str]:
    return sorted({n[:-5] for _, n in _tomls("presets")})


def find_preset(name: str) -> str | None:
    return _lookup("presets", name) if _plain(name) else None


def _presets_digest() -> bytes:
    """Digest of every preset file, so editing a preset invalidates cached roles."""
    h = sha256()
    for pd, n in _tomls("presets"):
        with suppress(OSError):
            with open(os.path.join(pd, n), "rb") as f:
                h.update(pd.encode() + b"/" + n.encode() + b"\0" + f.read())
    return h.digest()


def find(role: str) -> str:
    if not _plain(role):
        raise PolicyError(f"invalid role name {role!r}")
    path = _lookup("", role)
    if path is None:
        raise PolicyError(f"unknown role {role!r} (known: {', '.join(known_roles())})")
    return path


class Frozen:
    """A validated policy, or one of its sections: read-only, by attribute or by key."""
    __slots__ = ("_d",)

    def __init__(self, data: dict):
        object.__setattr__(self, "_d", data)

    def __getattr__(self, key: str):
        try:
            return _frozen(self._d[key])
        except KeyError:
            raise AttributeError(f"policy has no key {key!r}") from None

    def __getitem__(self, key: str):
        return _frozen(self._d[key])

    def get(self, key: str, default=None):
        return _frozen(self._d[key]) if key in self._d else default

    def __contains__(self, key) -> bool:
        return key in self._d

    def __iter__(self):
        return iter(self._d)

    def keys(self):
        return self._d.keys()

    def items(self):
        return ((k, _frozen(v)) for k, v in self._d.items())

    def as_dict(self) -> dict:
        """A plain, mutable copy (for data that travels in a plan)."""
        return _thawed(self._d)

    def __setattr__(self, key, value):
        raise AttributeError("a policy is read-only")

    def __eq__(self, other) -> bool:
        return self._d == (other._d if isinstance(other, Frozen) else other)

    __hash__ = None

    def __repr__(self) -> str:
        return f"Frozen({self._d!r})"


def _thawed(v):
    return {k: _thawed(x) for k, x in v.items()} if isinstance(v, dict) else list(v) if isinstance(v, list) else v


def _frozen(v):
    return Frozen(v) if isinstance(v, dict) else tuple(v) if isinstance(v, list) else v


# A controller of many cells loads its roles once (issue 29, fifth round): (role, state root) -> (the files'
# identity, the policy). The identity is everything load reads: the policy directories searched (AGNSUP_POLICY_DIR),
# the role file found, each presets directory and the preset files in it, each as (device, inode, size, mtime,
# ctime). An edit in place moves the file's ctime, a replacement (rename) its inode and its directory's times, a
# new file in AGNSUP_POLICY_DIR changes which file `find` returns. Kept only when every one of them was last
# changed over MEMO_SETTLED ns before it was read: a write in the same clock tick as the read could otherwise
# leave all five numbers as they were (the registry listing in store/state.py keeps the same rule).
_MEMO: dict = {}
_PRESET_LISTS: dict = {}  # presets directory -> (its identity, the *.toml names in it)
MEMO_SETTLED = filememo.SETTLED


def _ident(path: str) -> tuple | None:
    try:
        return filememo.identity(os.stat(path))
    except OSError:
        return None


def _identity(path: str) -> tuple | None:
    """The identity of what load(role) reads when `path` is the role's file; None when some of it changed within
    the last MEMO_SETTLED ns (or could not be looked at): then nothing is kept."""
    idents = [_ident(path)]
    for d in policy_dirs():
        pd = os.path.join(d, "presets")
        ident = _ident(pd)
        idents.append(ident)
        if ident is None:
            continue
        listed = _PRESET_LISTS.get(pd)
        if listed is None or listed[0] != ident:
            try:
                listed = _PRESET_LISTS[pd] = (ident, tuple(sorted(n for n in os.listdir(pd) if n.endswith(".toml"))))
            except OSError:
                return None
        idents += [(n, _ident(os.path.join(pd, n))) for n in listed[1]]
    now = time.time_ns()
    for i in idents:
        st = i[1] if i is not None and isinstance(i[0], str) else i
        if st is not None and not filememo.settled(st, now, MEMO_SETTLED):
            return None
    return (tuple(policy_dirs()), path, *idents)


def load(role: str, state_root: str | None = None) -> Frozen:
    """The validated policy for `role`, with "_file" and "_digest" (and "_preset"). Remembered per process while
    the files it came from are unchanged (_MEMO above)."""
    path = find(role)
    ident = _identity(path)
    kept = _MEMO.get((role, state_root))
    if ident is not None and kept is not None and kept[0] == ident:
        return kept[1]
    pol = _load(role, path, state_root)
    if ident is not None:
        _MEMO[(role, state_root)] = (ident, pol)
    return pol


def _load(role: str, path: str, state_root: str | None) -> Frozen:
    raw = _read(path)
    digest = sha256(raw).hexdigest()
    key = sha256(raw + _presets_digest()).hexdigest()
    cache = os.path.join(state_root, "cache", f"policy-{role}-{key[:24]}-v{CACHE_VERSION}.json") if state_root else None
    if cache:
        with suppress(OSError, ValueError), open(cache) as f:
            return Frozen(json.load(f))
    data = validate(raw, path, role)
    data["_file"], data["_digest"] = path, "sha256:" + digest
    if data.get("_preset"):
        # the effective policy is the role and its preset: the receipt's digest covers both
        with open(data["_preset"]["file"], "rb") as f:
            data["_digest"] = "sha256:" + sha256(raw + b"\0" + f.read()).hexdigest()
    if cache:
        _write_cache(cache, data)
    return Frozen(data)


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise PolicyError(f"{path}: cannot read: {e.strerror}") from None


def _read_toml(raw: bytes, path: str) -> dict:
    import tomllib
    try:
        return tomllib.loads(raw.decode())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise PolicyError(f"{path}: not valid TOML: {e}") from None


def load_preset(name: str, role_path: str = "") -> tuple[dict, str]:
    """(the preset's document, its file). Errors name the file and key."""
    path = find_preset(name)
    if path is None:
        raise PolicyError(f"{role_path}: key governance.preset: unknown preset {name!r} "
                          f"(known: {', '.join(known_presets()) or 'none'})")
    doc = _read_toml(_read(path), path)
    meta = doc.get("preset")
    if not isinstance(meta, dict):
        raise PolicyError(f"{path}: key preset: missing (a preset file starts with [preset] name = ...)")
    if meta.get("name") != name:
        raise PolicyError(f"{path}: key preset.name: is {meta.get('name')!r} but the file is for preset {name!r}")
    for k in meta:
        if k not in ("name", "description", "fixed"):
            raise PolicyError(f"{path}: key preset.{k}: unknown key (known: name, description, fixed)")
    for section in doc:
        if section != "preset" and section not in PRESET_SECTIONS:
            raise PolicyError(f"{path}: key {section}: a preset may set only {', '.join(PRESET_SECTIONS)}")
        if section != "preset" and not isinstance(doc[section], dict):
            raise PolicyError(f"{path}: key {section}: not a table")
    if "preset" in doc.get("governance", {}):
        raise PolicyError(f"{path}: key governance.preset: a preset cannot name another preset")
    fixed = meta.get("fixed", [])
    if not isinstance(fixed, list):
        raise PolicyError(f"{path}: key preset.fixed: not a list of keys")
    for key in fixed:
        section, _, field = str(key).partition(".")
        if key not in STRICTNESS and key not in ALLOW_LISTS:
            raise PolicyError(f"{path}: key preset.fixed: {key!r} cannot be fixed (only "
                              f"{', '.join(list(STRICTNESS) + list(ALLOW_LISTS))})")
        if field not in doc.get(section, {}):
            raise PolicyError(f"{path}: key preset.fixed: {key!r} is fixed but the preset does not set it")
    return doc, path


def apply_preset(doc: dict, path: str) -> tuple[dict, dict | None]:
    """The role document with its preset merged in, and what was inherited."""
    gov = doc.get("governance")
    name = gov.get("preset") if isinstance(gov, dict) else None
    if name is None:
        return doc, None
    if not isinstance(name, str):
        raise PolicyError(f"{path}: key governance.preset: not a preset name: {name!r}")
    pre, pre_path = load_preset(name, path)
    fixed = set(pre["preset"].get("fixed", []))
    merged = {k: (dict(v) if isinstance(v, dict) else v) for k, v in doc.items()}
    for section in PRESET_SECTIONS:
        theirs = pre.get(section)
        if not theirs:
            continue
        mine = merged.get(section, {})
        if not isinstance(mine, dict):
            continue  # the model reports the bad section
        out = dict(theirs)
        for field, value in mine.items():
            key = f"{section}.{field}"
            if key in JOINED_LISTS and isinstance(value, list) and isinstance(theirs.get(field), list):
                out[field] = list(theirs[field]) + [x for x in value if x not in theirs[field]]
            elif key in fixed and field in theirs and key in ALLOW_LISTS:
                extra = [x for x in (value if isinstance(value, list) else [value]) if x not in theirs[field]]
                if extra:
                    raise PolicyError(f"{path}: key {key}: {extra[0]!r} is looser than preset {name!r} allows "
                                      f"({pre_path} fixes it to {theirs[field]!r} or fewer entries)")
                out[field] = value
            elif key in fixed and field in theirs:
                order = STRICTNESS[key]
                if value not in order or order.index(value) < order.index(theirs[field]):
                    raise PolicyError(f"{path}: key {key}: {value!r} is looser than preset {name!r} allows "
                                      f"({pre_path} fixes it to {theirs[field]!r} or stricter)")
                out[field] = value
            else:
                out[field] = value
        merged[section] = out
    return merged, {"name": name, "file": pre_path, "fixed": sorted(fixed)}


def validate(raw: bytes, path: str, role: str | None = None) -> dict:
    own = _read_toml(raw, path)
    doc, preset = apply_preset(own, path)
    from pydantic import ValidationError

    from .policyfile import Policy
    try:
        pol = Policy.model_validate(doc)
    except ValidationError as e:
        err = e.errors()[0]
        key = ".".join(str(x) for x in err["loc"]) or "(top level)"
        msg = err["msg"].removeprefix("Value error, ")
        more = f" (and {len(e.errors()) - 1} more)" if len(e.errors()) > 1 else ""
        where = path
        loc = [str(x) for x in err["loc"]]
        if preset and len(loc) >= 2 and loc[1] not in (own.get(loc[0]) if isinstance(own.get(loc[0]), dict) else {}):
            where = preset["file"]  # the bad value came from the preset, not the role
        raise PolicyError(f"{where}: key {key}: {msg}{more}") from None
    if role is not None and pol.role.name != role:
        raise PolicyError(f"{path}: key role.name: is {pol.role.name!r} but the file is for role {role!r}")
    data = pol.model_dump()
    if preset:
        data["_preset"] = preset
    return data


def _write_cache(cache: str, data: dict) -> None:
    with suppress(OSError):  # a read-only state root only costs the validation next time
        os.makedirs(os.path.dirname(cache), mode=0o700, exist_ok=True)
        tmp = f"{cache}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(data, f)
        os.replace(tmp, cache)
