"""Piecewise JIT cache (DESIGN §10): memory LRU in front of an on-disk store with a size cap.

A piece is one kernel after the fusion layers.  Its key is a sha256 over the piece's structural
key, the target, the Options fields that change code, and the data-model version (versions of
apollo_py, islpy, llvmlite and the host CPU features), so upgrading any of them invalidates old
entries.  Each disk entry is one file, ``<key>.piece``: a line of JSON metadata (with the
payload's sha256 and size), then the object code, written atomically (temp file + rename), so
a reader sees a whole entry of one writer or none, however many processes write the same key
at once; an entry whose checksum does not match is discarded and recompiled.  No pickle.
(``head -1 <key>.piece`` shows the metadata.)

The disk store holds at most ``max_bytes`` (default :data:`DISK_MAX_BYTES`) of object code:
when a write takes it over the cap, the least recently used entries (by the metadata file's
modification time, touched on every disk hit) are deleted until it is under 90% of the cap.
Other processes sharing the directory are seen at the next eviction scan.
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
from functools import lru_cache
from importlib import metadata
from typing import Any

from cachetools import LRUCache

from .fsutil import atomic_write

#: default cap on the object code kept on disk per cache directory
DISK_MAX_BYTES = 1 << 30
#: a temp file this old is left over from a killed process (a live writer renames
#: its temp file within milliseconds), so the sweep may delete it
STALE_S = 600.0
#: the file name ending of a piece entry (metadata line + object code)
PIECE_SUFFIX = ".piece"


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
    """Memory LRU (``capacity`` entries) over a directory of checksummed entries holding at
    most ``max_bytes`` of payload (least recently used entries evicted first)."""

    def __init__(self, directory: str | None, capacity: int = 512, max_bytes: int = DISK_MAX_BYTES):
        self.directory = directory
        self.capacity = capacity
        self.max_bytes = max_bytes
        self._mem: LRUCache = LRUCache(capacity)
        self._lock = threading.Lock()
        self._disk_bytes: int | None = None   # entry bytes on disk as last counted (+ writes since)
        self.hits = self.misses = self.disk_hits = self.evictions = 0
        self.write_error: str | None = None   # why the directory could not be written (once)

    def _path(self, key: str) -> str:
        return os.path.join(self.directory, "pieces", key[:2], key + PIECE_SUFFIX)

    def get(self, key: str) -> tuple[bytes, dict] | None:
        """Payload and metadata for ``key``, or None (a corrupt disk entry is deleted)."""
        with self._lock:
            entry = self._mem.get(key)
            if entry is not None:
                self.hits += 1
                return entry
        entry = self._read_disk(key) if self.directory else None
        with self._lock:
            if entry is None:
                self.misses += 1
                return None
            self.disk_hits += 1
            self._remember(key, entry)
        return entry

    def has(self, key: str) -> bool:
        """Whether ``key`` is in memory or on disk (not read, not verified, not counted)."""
        with self._lock:
            if key in self._mem:
                return True
        return bool(self.directory) and os.path.exists(self._path(key))

    def put(self, key: str, payload: bytes, meta: dict) -> None:
        meta = dict(meta, sha256=hashlib.sha256(payload).hexdigest(), size=len(payload))
        with self._lock:
            self._remember(key, (payload, meta))
        if self.directory:
            self._write_disk(key, payload, meta)

    def _remember(self, key, entry):
        self._mem[key] = entry

    def _read_disk(self, key):
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                head = f.readline()
                payload = f.read()
                ident = os.fstat(f.fileno()).st_ino
            meta = json.loads(head)
        except (OSError, ValueError):
            meta = None
            try:
                ident = os.stat(path).st_ino
            except OSError:
                return None         # no entry
        if not isinstance(meta, dict) or hashlib.sha256(payload).hexdigest() != meta.get("sha256"):
            # corrupt (a whole file is renamed into place, so this is not a writer in progress);
            # remove it unless another writer has replaced it since it was read
            try:
                if os.stat(path).st_ino == ident:
                    os.unlink(path)
            except OSError:
                pass
            return None
        try:
            os.utime(path)          # recently used: evicted last
        except OSError:
            pass
        return payload, meta

    def _write_disk(self, key, payload, meta):
        path = self._path(key)
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            data = json.dumps(meta, sort_keys=True).encode() + b"\n" + payload
            atomic_write(path, data)
        except OSError as e:
            # a read-only or full cache dir only costs recompilation, but say so once: silently,
            # every new process would compile (and time) everything again without a hint why
            with self._lock:
                first, self.write_error = self.write_error is None, f"{e.strerror or e}"
            if first:
                import warnings
                warnings.warn(f"apollo_py: cannot write the compile cache in {self.directory!r} "
                              f"({self.write_error}); compiled code is kept in memory only, for this "
                              "process (set Options.cache_dir or $APOLLO_PY_CACHE_DIR to a writable "
                              "directory)", RuntimeWarning, stacklevel=2)
            return
        with self._lock:
            if self._disk_bytes is not None:
                self._disk_bytes += len(data)
            over = self._disk_bytes is None or self._disk_bytes > self.max_bytes
        if over:
            self._evict()

    def _entries(self) -> list[tuple[float, int, str]]:
        """``(last use, file bytes, key)`` of every entry on disk."""
        out = []
        root = os.path.join(self.directory, "pieces")
        if not os.path.isdir(root):
            return out
        for sub in os.scandir(root):
            if not sub.is_dir():
                continue
            for f in os.scandir(sub.path):
                if not f.name.endswith(PIECE_SUFFIX):
                    continue
                try:
                    st = f.stat()
                except OSError:
                    continue    # removed by another process
                out.append((st.st_mtime, st.st_size, f.name[:-len(PIECE_SUFFIX)]))
        return out

    def _evict(self) -> None:
        """Count the payload on disk; over ``max_bytes``, delete least recently used entries
        until it is under 90% of the cap.  (Runs at a process's first write, so stale files
        of killed processes are swept then too.)"""
        if self._disk_bytes is None:
            sweep_stale(self.directory)
        entries = self._entries()
        total = sum(size for _, size, _ in entries)
        if total > self.max_bytes:
            for _, size, key in sorted(entries):
                if total <= 0.9 * self.max_bytes:
                    break
                try:
                    os.unlink(self._path(key))
                except OSError:
                    pass
                total -= size
                with self._lock:
                    self.evictions += 1
        with self._lock:
            self._disk_bytes = total

    def info(self) -> dict:
        """Entry count and bytes on disk, and this process's hit/miss counters."""
        n = size = 0
        root = os.path.join(self.directory, "pieces") if self.directory else None
        if root and os.path.isdir(root):
            for dirpath, _, files in os.walk(root):
                for f in files:
                    if f.endswith(PIECE_SUFFIX):
                        n += 1
                        size += os.path.getsize(os.path.join(dirpath, f))
        return {"directory": self.directory, "entries": n, "bytes": size, "max_bytes": self.max_bytes,
                "memory_entries": len(self._mem), "hits": self.hits, "disk_hits": self.disk_hits,
                "misses": self.misses, "evictions": self.evictions}

    def clear(self) -> int:
        """Delete every disk entry and the memory LRU; returns the number of entries removed."""
        import shutil
        n = self.info()["entries"]
        with self._lock:
            self._mem.clear()
            self._disk_bytes = None
        if self.directory:
            shutil.rmtree(os.path.join(self.directory, "pieces"), ignore_errors=True)
        return n


def sweep_stale(directory: str | None, older_than: float = STALE_S) -> list[str]:
    """Delete what a process killed mid-write (SIGKILL, power loss) leaves in a cache directory,
    once it is ``older_than`` seconds old: ``fsutil.atomic_write`` temp files (``.tmp-*``,
    anywhere under ``directory``), and the ``.bin`` / ``.json`` pairs of the two-file piece
    format of earlier versions (never read now).  Readers ignore both; this only reclaims the
    space.  Returns the paths deleted."""
    import time
    gone: list[str] = []
    if not directory or not os.path.isdir(directory):
        return gone
    cutoff = time.time() - older_than
    for dirpath, _, files in os.walk(directory):
        in_pieces = os.path.basename(os.path.dirname(dirpath)) == "pieces"
        for f in files:
            legacy = in_pieces and f.endswith((".bin", ".json"))
            if not (f.startswith(".tmp-") or legacy):
                continue
            path = os.path.join(dirpath, f)
            try:
                if os.stat(path).st_mtime <= cutoff:
                    os.unlink(path)
                    gone.append(path)
            except OSError:
                continue        # renamed or removed by its writer meanwhile
    return gone
