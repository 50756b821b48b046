"""sha256 without loading OpenSSL.

`import hashlib` loads _hashlib (libcrypto), ~4 ms on every `agnsup run`;
CPython's own _sha256 module computes the same digests at a tenth of the
import cost. hashlib stays the fallback where the built-in is absent.
"""
try:
    from _sha256 import sha256  # CPython 3.11
except ImportError:  # pragma: no cover - other builds, or 3.12+ (_sha2)
    try:
        from _sha2 import sha256
    except ImportError:
        from hashlib import sha256

__all__ = ["sha256"]
