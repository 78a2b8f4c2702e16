"""File helpers shared by the caches: atomic writes (temp file in the same directory + rename).

A reader never sees a half-written file: it finds the old content, the new one, or nothing.
Used by the piece cache (``cache.py``) and the stored machine figures (``machine.py``).
"""
from __future__ import annotations

import hashlib
import os
import tempfile


def atomic_write(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically; OSError (and no stray temp file) on failure."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".", prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def files_digest(paths) -> str:
    """First 16 hex digits of the sha256 over the contents of ``paths``, in order (a cache key
    part that changes whenever the source files that shape a cached result change)."""
    h = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:16]
