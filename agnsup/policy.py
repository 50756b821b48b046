"""Finding, validating and caching role policies.

Policy files ship inside the package (`agnsup.policies`, read with
importlib.resources); `AGNSUP_POLICY_DIR` names a directory searched first.
A file is validated by the pydantic models once; the validated form is cached
as JSON under `<state>/cache/`, keyed by the file's sha256, so the spawn path
neither parses TOML nor imports pydantic when nothing changed.
"""
from __future__ import annotations

import hashlib
import json
import os

from .errors import PolicyError

CACHE_VERSION = "2"  # 2: isolation and process sections


def _packaged_dir() -> str:
    # importlib.resources.files() returns the package directory for an
    # installed wheel; importing it costs ~10 ms on every start, so the
    # package's own __path__ is used when it is a real directory (zip imports
    # fall back to importlib.resources).
    from . import policies
    d = list(policies.__path__)[0]
    if os.path.isdir(d):
        return d
    from importlib.resources import files
    return str(files("agnsup.policies"))


def policy_dirs() -> list[str]:
    dirs = []
    extra = os.environ.get("AGNSUP_POLICY_DIR")
    if extra:
        dirs.append(extra)
    dirs.append(_packaged_dir())
    return dirs


def known_roles() -> list[str]:
    roles = set()
    for d in policy_dirs():
        try:
            roles.update(f[:-5] for f in os.listdir(d) if f.endswith(".toml"))
        except OSError:
            continue
    return sorted(roles)


def find(role: str) -> str:
    if not role or "/" in role or role.startswith("."):
        raise PolicyError(f"invalid role name {role!r}")
    for d in policy_dirs():
        p = os.path.join(d, role + ".toml")
        if os.path.isfile(p):
            return p
    raise PolicyError(f"unknown role {role!r} (known: {', '.join(known_roles())})")


def load(role: str, state_root: str | None = None) -> dict:
    """The validated policy for `role` as a plain dict, plus "_file" and "_digest"."""
    path = find(role)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise PolicyError(f"{path}: cannot read: {e.strerror}") from None
    digest = hashlib.sha256(raw).hexdigest()
    cache = os.path.join(state_root, "cache", f"policy-{role}-{digest[:24]}-v{CACHE_VERSION}.json") if state_root else None
    if cache:
        try:
            with open(cache) as f:
                return json.load(f)
        except (OSError, ValueError):
            pass
    data = validate(raw, path, role)
    data["_file"], data["_digest"] = path, "sha256:" + digest
    if cache:
        _write_cache(cache, data)
    return data


def validate(raw: bytes, path: str, role: str | None = None) -> dict:
    import tomllib
    try:
        doc = tomllib.loads(raw.decode())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise PolicyError(f"{path}: not valid TOML: {e}") from None
    from pydantic import ValidationError

    from .models import Policy
    try:
        pol = Policy.model_validate(doc)
    except ValidationError as e:
        err = e.errors()[0]
        key = ".".join(str(x) for x in err["loc"]) or "(top level)"
        msg = err["msg"].removeprefix("Value error, ")
        more = f" (and {len(e.errors()) - 1} more)" if len(e.errors()) > 1 else ""
        raise PolicyError(f"{path}: key {key}: {msg}{more}") from None
    if role is not None and pol.role.name != role:
        raise PolicyError(f"{path}: key role.name: is {pol.role.name!r} but the file is for role {role!r}")
    return pol.model_dump(by_alias=True)


def _write_cache(cache: str, data: dict) -> None:
    try:
        os.makedirs(os.path.dirname(cache), mode=0o700, exist_ok=True)
        tmp = f"{cache}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(data, f)
        os.replace(tmp, cache)
    except OSError:
        pass  # a read-only state root only costs the validation next time
