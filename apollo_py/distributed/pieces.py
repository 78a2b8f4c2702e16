"""Cache directories as data: pack one into a dict of files, write it into another.

A predictor's driver compiles a model into a fresh cache directory and ships its files (the
piecewise cache's ``pieces/`` entries, the ONNX checker's marks, the measured machine figures)
through Ray's object store; each actor writes them into its own cache directory, so its compile
finds every piece there.  The cache's own checksums still guard what is read back.
"""
from __future__ import annotations

import os

from ..fsutil import atomic_write

#: files that belong to one process or run, not to the compiled model
_SKIP = {"feedback.jsonl"}


def pack(directory: str) -> dict[str, bytes]:
    """Every file under ``directory`` (but the feedback log), by its relative POSIX path."""
    files = {}
    for root, _, names in os.walk(directory):
        for name in names:
            if name in _SKIP or name.endswith(".tmp"):
                continue
            path = os.path.join(root, name)
            rel = os.path.relpath(path, directory).replace(os.sep, "/")
            with open(path, "rb") as f:
                files[rel] = f.read()
    return files


def unpack(files: dict[str, bytes], directory: str) -> int:
    """Write ``files`` (from :func:`pack`) under ``directory``, each atomically and only where
    absent (what is there is this machine's own, e.g. its measured figures); returns how many
    were written."""
    written = 0
    root = os.path.abspath(directory)
    for rel, data in files.items():
        path = os.path.abspath(os.path.join(root, *rel.split("/")))
        if not path.startswith(root + os.sep):   # a packed name never leaves the directory
            continue
        if os.path.exists(path):
            continue
        os.makedirs(os.path.dirname(path), exist_ok=True)
        atomic_write(path, data)
        written += 1
    return written
