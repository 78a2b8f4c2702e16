"""File helpers shared by the caches: atomic writes (temp file in the same directory + rename).

A reader never sees a half-written file: it finds the old content, the new one, or nothing.
Used by the piece cache (``cache.py``) and the stored machine figures (``machine.py``).
"""
from __future__ import annotations

import hashlib
import os
import tempfile


def atomic_write(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically; OSError (and no stray temp file) on failure.  The
    temporary file is named ``.tmp-<pid>-*`` so that a parent that had to kill a writing child
    can remove what it left (:func:`remove_temps_of`)."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".", prefix=f".tmp-{os.getpid()}-")
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


def remove_temps_of(directory: str, pid: int) -> list[str]:
    """Delete the ``atomic_write`` temporaries that process ``pid`` left anywhere under
    ``directory`` (call it only once ``pid`` is dead: a killed child's half-written files);
    returns the paths deleted."""
    prefix, gone = f".tmp-{pid}-", []
    for dirpath, _, files in os.walk(directory):
        for f in files:
            if f.startswith(prefix):
                try:
                    os.unlink(os.path.join(dirpath, f))
                    gone.append(os.path.join(dirpath, f))
                except OSError:
                    pass
    return gone


def files_digest(paths) -> str:
    """First 16 hex digits of the sha256 over the contents of ``paths``, in order (a cache key
    part that changes whenever the source files that shape a cached result change)."""
    h = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:16]
