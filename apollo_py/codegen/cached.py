"""LLVM compilation behind the piecewise JIT cache (DESIGN §10).

A piece is one loop-IR kernel.  Its cache key is :func:`apollo_py.cache.piece_key` over a
sha256 of the kernel's unoptimised LLVM text (which already contains the kernel's name,
parameters, dtypes, extents and the host's target attributes) plus the data-model version
(apollo_py, islpy, llvmlite versions and host CPU features) and a digest of the LLVM back
end's source.  A hit loads host object code without running the optimiser or the code
generator; a miss optimises once, emits the object, stores it, and loads it.

Kernels compiled within one process are also kept by key, so the same piece in two graphs
(e.g. one per layer of a transformer, or one per specialised shape that gives the same loops)
is compiled once.  A cache directory of None keeps the cache in memory only.
"""
from __future__ import annotations

import hashlib
import sys
import threading
from functools import lru_cache
from typing import Sequence

from cachetools import LRUCache

from ..cache import PieceCache, piece_key
from . import loopir as L

_CACHES: dict[str | None, PieceCache] = {}
_LOADED_CAPACITY = 2048
_LOADED: LRUCache = LRUCache(_LOADED_CAPACITY)   # key -> CompiledKernel, this process
_LOCK = threading.Lock()


def piece_cache(directory: str | None) -> PieceCache:
    """The process-wide :class:`PieceCache` for ``directory`` (None = memory only)."""
    with _LOCK:
        c = _CACHES.get(directory)
        if c is None:
            c = _CACHES[directory] = PieceCache(directory)
        return c


@lru_cache(maxsize=None)
def _backend_digest() -> str:
    """sha256 of the LLVM back end's own source (optimiser pipeline, object emission), so that
    a change there invalidates pieces even when the rendered text stays the same."""
    from . import llvm
    h = hashlib.sha256()
    for mod in (llvm, sys.modules[__name__]):
        with open(mod.__file__, "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:16]


def kernel_key(k: L.Kernel) -> tuple[str, str]:
    """(cache key, unoptimised LLVM text) of kernel ``k`` for this host."""
    from .llvm import host, render_llvm
    text = render_llvm(k, host().cpu_attrs)
    digest = hashlib.sha256(text.encode()).hexdigest()
    return piece_key(digest, "cpu", {"backend": _backend_digest()}), text


def compile_cached(k: L.Kernel, cache: PieceCache | None):
    """A CompiledKernel for ``k``: from this process, from ``cache``, or freshly compiled.

    A fresh compile's ``ir`` holds the optimised LLVM IR; a kernel loaded from the disk cache
    has ``ir == ""`` (its object code was made by an earlier process).
    """
    from .llvm import _compile_lock, host, load_object, optimize_ir
    key, text = kernel_key(k)
    with _LOCK:
        done = _LOADED.get(key)
    if done is not None and done.name == k.name:
        return done
    hit = cache.get(key) if cache is not None else None
    if hit is not None:
        ck = load_object(k, hit[0])
    else:
        h = host()
        with _compile_lock:
            mod = optimize_ir(text)
            mod.triple = h.triple
            ir_text = str(mod)
            obj = h.target_machine().emit_object(mod)
        ck = load_object(k, obj)
        ck.ir = ir_text
        if cache is not None:
            cache.put(key, obj, {"kernel": k.name})
    with _LOCK:
        _LOADED[key] = ck
    return ck


def compile_all(kernels: Sequence[L.Kernel], cache_dir: str | None, progress=None) -> list:
    """Compile ``kernels`` through the cache in ``cache_dir``; one CompiledKernel each, in order.

    ``progress`` (a :class:`apollo_py.progress.Progress` or None) counts kernels done.
    """
    cache = piece_cache(cache_dir)
    out = []
    for k in kernels:
        out.append(compile_cached(k, cache))
        if progress is not None:
            progress.step()
    return out
