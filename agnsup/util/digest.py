"""sha256 without loading OpenSSL.

`import hashlib` loads _hashlib (libcrypto), ~4 ms on every `agnsup run`;
CPython's own _sha256 module computes the same digests at a tenth of the
import cost. hashlib stays the fallback where the built-in is absent.
"""
import os

try:
    from _sha256 import sha256  # type: ignore[import-not-found]  # CPython 3.11 (no stub: a private module)
except ImportError:  # pragma: no cover - other builds, or 3.12+ (_sha2)
    try:
        from _sha2 import sha256  # type: ignore[import-not-found]
    except ImportError:
        from hashlib import sha256

__all__ = ["sha256", "file_sha256"]

BIG = 4 << 20  # past this, OpenSSL's sha256 (~5x faster here) repays its import


def file_sha256(f) -> tuple[int, str]:
    """(size, hex sha256) of an open binary file, read in 1 MiB blocks (never whole in memory)."""
    size = os.fstat(f.fileno()).st_size
    if size > BIG:
        from hashlib import sha256 as fast
        h = fast()
    else:
        h = sha256()
    n = 0
    while True:
        block = f.read(1 << 20)
        if not block:
            return n, h.hexdigest()
        n += len(block)
        h.update(block)
