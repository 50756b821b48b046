"""Which environment variable names look like secrets (shared by the policy
models, the spec builder and receipts; kept apart so the spawn path does not
import pydantic)."""
from __future__ import annotations

# The rule: (^AWS_|_TOKEN$|_SECRET$|_KEY$|_PASSWORD$|_PASSWD$|_CREDENTIALS?$|^SECRET|PASSWORD),
# case-insensitive. An ASCII name (every real one) is judged with string
# tests: compiling the regex costs ~0.5 ms on every `agnsup run`.
_SUFFIXES = ("_TOKEN", "_SECRET", "_KEY", "_PASSWORD", "_PASSWD", "_CREDENTIAL", "_CREDENTIALS")
_pattern = None


def looks_secret(key: str) -> bool:
    if key.isascii():
        u = key.upper()
        end = u[:-1] if u.endswith("\n") else u  # the regex's `$` also matches before a final newline
        return u.startswith(("AWS_", "SECRET")) or end.endswith(_SUFFIXES) or "PASSWORD" in u
    global _pattern
    if _pattern is None:  # non-ASCII: the regex's own Unicode case folding decides
        import re
        _pattern = re.compile(r"(^AWS_|_TOKEN$|_SECRET$|_KEY$|_PASSWORD$|_PASSWD$|_CREDENTIALS?$|^SECRET|PASSWORD)",
                              re.IGNORECASE)
    return bool(_pattern.search(key))
