"""A module imported on first use: for a name only some calls need.

`agnsup run -- true` of a role without network lists never parses a URL, an IP
address or a Unicode host name, so the modules that do (urllib.parse,
ipaddress, unicodedata: ~3-5 ms of a per-call CLI's start) load the first time
one of their attributes is read, not when agnsup.netpolicy is imported.
"""
from __future__ import annotations

import sys


class LazyModule:
    """Stands for the module `name`; the first attribute read imports it."""

    def __init__(self, name: str) -> None:
        object.__setattr__(self, "_name", name)

    def __getattr__(self, attr: str):  # called only for what the instance itself lacks: the module's names
        mod = sys.modules.get(self._name)
        if mod is None:
            __import__(self._name)
            mod = sys.modules[self._name]
        return getattr(mod, attr)

    def __repr__(self) -> str:
        return f"<lazy module {self._name!r}>"
