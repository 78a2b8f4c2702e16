"""Piecewise JIT cache (DESIGN §10): memory LRU in front of an on-disk store.

A piece is one kernel after the fusion layers.  Its key is a sha256 over the piece's structural
key, the target, the Options fields that change code, and the data-model version (versions of
apollo_py, islpy, llvmlite and the host CPU features), so upgrading any of them invalidates old
entries.  Each disk entry is ``<key>.bin`` (object code) + ``<key>.json`` (metadata with the
payload's sha256), both written atomically (temp file + rename); an entry whose checksum does
not match is discarded and recompiled.  No pickle.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading
from collections import OrderedDict
from functools import lru_cache
from importlib import metadata
from typing import Any


@lru_cache(maxsize=None)
def data_model_version(target: str = "cpu") -> str:
    """Versions that generated code depends on, as one string."""
    parts = []
    for dist in ("apollo-py", "islpy", "llvmlite"):
        try:
            parts.append(f"{dist}={metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            parts.append(f"{dist}=?")
    if target in ("cpu", "llvm"):
        import llvmlite.binding as llvm
        parts.append(f"cpu={llvm.get_host_cpu_name()}:{llvm.get_host_cpu_features().flatten()}")
    return ";".join(parts)


def piece_key(structural_key: str, target: str, option_fields: dict[str, Any]) -> str:
    """The cache key of one piece."""
    doc = json.dumps({"piece": structural_key, "target": target, "options": option_fields,
                      "dm": data_model_version(target)}, sort_keys=True, default=str)
    return hashlib.sha256(doc.encode()).hexdigest()


class PieceCache:
    """Memory LRU (``capacity`` entries) over a directory of checksummed entries."""

    def __init__(self, directory: str | None, capacity: int = 512):
        self.directory = directory
        self.capacity = capacity
        self._mem: OrderedDict[str, tuple[bytes, dict]] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = self.disk_hits = 0

    def _paths(self, key: str) -> tuple[str, str]:
        sub = os.path.join(self.directory, "pieces", key[:2])
        return os.path.join(sub, key + ".bin"), os.path.join(sub, key + ".json")

    def get(self, key: str) -> tuple[bytes, dict] | None:
        """Payload and metadata for ``key``, or None (a corrupt disk entry is deleted)."""
        with self._lock:
            if key in self._mem:
                self._mem.move_to_end(key)
                self.hits += 1
                return self._mem[key]
        entry = self._read_disk(key) if self.directory else None
        with self._lock:
            if entry is None:
                self.misses += 1
                return None
            self.disk_hits += 1
            self._remember(key, entry)
        return entry

    def put(self, key: str, payload: bytes, meta: dict) -> None:
        meta = dict(meta, sha256=hashlib.sha256(payload).hexdigest(), size=len(payload))
        with self._lock:
            self._remember(key, (payload, meta))
        if self.directory:
            self._write_disk(key, payload, meta)

    def _remember(self, key, entry):
        self._mem[key] = entry
        self._mem.move_to_end(key)
        while len(self._mem) > self.capacity:
            self._mem.popitem(last=False)

    def _read_disk(self, key):
        bin_path, json_path = self._paths(key)
        try:
            with open(json_path, encoding="utf-8") as f:
                meta = json.load(f)
            with open(bin_path, "rb") as f:
                payload = f.read()
        except (OSError, ValueError):
            return None
        if hashlib.sha256(payload).hexdigest() != meta.get("sha256"):
            for p in (bin_path, json_path):
                try:
                    os.unlink(p)
                except OSError:
                    pass
            return None
        return payload, meta

    def _write_disk(self, key, payload, meta):
        bin_path, json_path = self._paths(key)
        try:
            os.makedirs(os.path.dirname(bin_path), exist_ok=True)
            _atomic_write(bin_path, payload)
            _atomic_write(json_path, json.dumps(meta, sort_keys=True).encode())
        except OSError:
            pass  # a read-only or full cache dir only costs recompilation

    def info(self) -> dict:
        """Entry count and bytes on disk, and this process's hit/miss counters."""
        n = size = 0
        root = os.path.join(self.directory, "pieces") if self.directory else None
        if root and os.path.isdir(root):
            for dirpath, _, files in os.walk(root):
                for f in files:
                    if f.endswith(".bin"):
                        n += 1
                        size += os.path.getsize(os.path.join(dirpath, f))
        return {"directory": self.directory, "entries": n, "bytes": size, "memory_entries": len(self._mem),
                "hits": self.hits, "disk_hits": self.disk_hits, "misses": self.misses}

    def clear(self) -> int:
        """Delete every disk entry and the memory LRU; returns the number of entries removed."""
        import shutil
        n = self.info()["entries"]
        with self._lock:
            self._mem.clear()
        if self.directory:
            shutil.rmtree(os.path.join(self.directory, "pieces"), ignore_errors=True)
        return n


def _atomic_write(path: str, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
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
