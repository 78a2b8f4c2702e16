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
import os
import threading
from functools import lru_cache
from typing import Sequence

from cachetools import LRUCache

from ..cache import PieceCache, piece_key
from . import loopir as L

_CACHES: dict[str | None, PieceCache] = {}
_LOADED_CAPACITY = 2048
_LOADED: LRUCache = LRUCache(_LOADED_CAPACITY)   # key -> CompiledKernel, this process
#: key -> object code of what _LOADED / _ENGINES hold, so that a piece this process already has
#: is still written to a cache directory it has not been stored in (``_store_known``); at most
#: 64 MiB of it (a piece evicted here is only not copied to a second directory)
_OBJECTS: LRUCache = LRUCache(64 << 20, getsizeof=len)


def _store_known(cache: "PieceCache | None", key: str, meta: dict) -> None:
    """Write the object code of an in-process piece to ``cache``'s directory if that lacks it
    (a process that compiles one model into two cache directories leaves both complete)."""
    if cache is None or not cache.directory or cache.has(key):
        return
    with _LOCK:
        obj = _OBJECTS.get(key)
    if obj is not None:
        cache.put(key, obj, meta)
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
    from ..fsutil import files_digest
    here = os.path.dirname(__file__)     # by file: gemm imports this module
    # a GEMM module is keyed by its descriptor, not its text: every file its text comes from
    # counts (the main kernel's IR, the math functions an erf / exp epilogue inlines)
    return files_digest(os.path.join(here, name) for name in
                        ("llvm.py", "gemm.py", "gemm_ir.py", "cached.py", "llvm_math.py", "scalar_ops.py"))


def positional(k: L.Kernel) -> L.Kernel:
    """``k`` with its params named ``arg0, arg1, ...``: kernels are called with their buffers
    by position, so the same loops at two call sites (a transformer's layers, whose values
    have other names) render the same text and share one piece."""
    return L.rename_params(k, [f"arg{i}" for i in range(len(k.params))]) or k


def kernel_key(k: L.Kernel) -> tuple[str, str]:
    """(cache key, unoptimised LLVM text) of kernel ``k`` (its params named by position) for
    this host."""
    from .llvm import host, render_llvm
    text = render_llvm(positional(k), host().cpu_attrs)
    digest = hashlib.sha256(text.encode()).hexdigest()
    return piece_key(digest, "cpu", {"backend": _backend_digest()}), text


_TEXTS: LRUCache = LRUCache(_LOADED_CAPACITY)      # key -> rendered text, not yet compiled


def remember_text(key: str, text: str) -> None:
    """Keep ``text`` (rendered for ``kernel_key``) until the kernel of ``key`` is compiled, so
    that a caller who needed the key early does not make codegen render the kernel twice."""
    with _LOCK:
        _TEXTS[key] = text


def compile_cached(k: L.Kernel, cache: PieceCache | None, key: str = ""):
    """A CompiledKernel for ``k``: from this process, from ``cache``, or freshly compiled.

    ``key``: ``kernel_key(k)[0]`` when the caller knows it (then a hit renders nothing).
    A fresh compile's ``ir`` holds the optimised LLVM IR; a kernel loaded from the disk cache
    has ``ir == ""`` (its object code was made by an earlier process).
    """
    from .llvm import _compile_lock, host, load_object, optimize_ir
    text = None
    if not key:
        key, text = kernel_key(k)
    with _LOCK:
        done = _LOADED.get(key)
    if done is not None and done.name == k.name:
        _store_known(cache, key, {"kernel": k.name})
        return done
    hit = cache.get(key) if cache is not None else None
    if hit is not None:
        obj = hit[0]
        ck = load_object(k, obj)
    else:
        if text is None:
            with _LOCK:
                text = _TEXTS.pop(key, None)
            if text is None:        # evicted meanwhile, or a key made from a descriptor (conv_direct):
                text = kernel_key(k)[1]     # render; the caller's key stays the key
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
        _OBJECTS[key] = obj
    return ck


_ENGINES: LRUCache = LRUCache(_LOADED_CAPACITY)    # key -> (engine, ir) of whole modules


def compile_module(text: str, build, cache_dir: str | None, name: str):
    """(MCJIT engine, optimised IR or "") of a hand-assembled LLVM module (the generated GEMM),
    behind the piecewise cache: ``text`` determines the module (its source, or what the source
    is rendered from), ``build()`` renders and parses it into a module.  A hit loads the stored
    object code; a miss optimises (O3), emits and stores it.  Engines are shared within the process by key (keep them alive as long as their code runs)."""
    from ..deadline import check as check_deadline
    from .llvm import _compile_lock, host, run_o3
    check_deadline("GEMM codegen", f"module {name!r}")
    key = piece_key(hashlib.sha256(text.encode()).hexdigest(), "cpu-module", {"backend": _backend_digest()})
    with _LOCK:
        done = _ENGINES.get(key)
    if done is not None:
        _store_known(piece_cache(cache_dir), key, {"module": name})
        return done
    cache = piece_cache(cache_dir)
    hit = cache.get(key)
    h = host()
    ir = ""
    with _compile_lock:
        if hit is None:
            mod = build()
            mod.triple = h.triple
            run_o3(mod)
            ir = str(mod)
            obj = h.target_machine().emit_object(mod)
        else:
            obj = hit[0]
        empty = h.llvm.parse_assembly("")
        empty.triple = h.triple
        engine = h.llvm.create_mcjit_compiler(empty, h.target_machine())
        engine.add_object_file(h.llvm.ObjectFileRef.from_data(obj))
        engine.finalize_object()
    if hit is None:
        cache.put(key, obj, {"module": name})
    with _LOCK:
        _ENGINES[key] = (engine, ir)
        _OBJECTS[key] = obj
    return engine, ir


#: fewer object-code misses than this compile in-process (a fork costs a few ms plus the
#: child's copy-on-write faults; one kernel's O3 + codegen costs 20-300 ms)
PARALLEL_MIN = 4


def compile_all(kernels: Sequence[L.Kernel], cache_dir: str | None, progress=None,
                keys: Sequence[str] | None = None) -> list:
    """Compile ``kernels`` through the cache in ``cache_dir``; one CompiledKernel each, in order.

    ``keys``: their cache keys where known ("" where not); ``progress`` (a
    :class:`apollo_py.progress.Progress` or None) counts kernels done.  Kernels missing from the
    process and from the cache (at least :data:`PARALLEL_MIN` of them, on a POSIX machine with
    more than one core) are optimised and emitted by a forked child and this process at once:
    llvmlite serialises every LLVM call of a process under one lock, so threads cannot share
    the work (:func:`_emit_in_parallel`).
    """
    from ..deadline import check as check_deadline
    cache = piece_cache(cache_dir)
    keys = list(keys or [""] * len(kernels))
    emitted: dict[str, tuple[bytes, str]] = {}
    if len(kernels) >= PARALLEL_MIN and hasattr(os, "fork") and _cores() > 1:
        misses, seen = [], set()
        for i, k in enumerate(kernels):
            text = None
            if not keys[i]:
                keys[i], text = kernel_key(k)
                remember_text(keys[i], text)
            with _LOCK:
                loaded = keys[i] in _LOADED
            if keys[i] in seen or loaded or cache.has(keys[i]):
                continue
            seen.add(keys[i])
            misses.append((keys[i], k))
        if len(misses) >= PARALLEL_MIN:
            emitted = _emit_in_parallel(misses)
    out = []
    for k, key in zip(kernels, keys):
        check_deadline("LLVM codegen", f"kernel {k.name!r}")
        got = emitted.pop(key, None)
        if got is not None:     # emitted by the parallel step: store and load it
            from .llvm import load_object
            cache.put(key, got[0], {"kernel": k.name})
            ck = load_object(k, got[0])
            ck.ir = got[1]
            with _LOCK:
                _LOADED[key] = ck
                _OBJECTS[key] = got[0]
                _TEXTS.pop(key, None)
        out.append(compile_cached(k, cache, key))
        if progress is not None:
            progress.step()
    return out


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _emit(key: str, k: L.Kernel) -> tuple[bytes, str]:
    """(object code, optimised IR) of kernel ``k`` whose piece key is ``key``."""
    from .llvm import _compile_lock, host, optimize_ir
    with _LOCK:
        text = _TEXTS.get(key)
    if text is None:
        text = kernel_key(k)[1]
    h = host()
    with _compile_lock:
        mod = optimize_ir(text)
        mod.triple = h.triple
        return h.target_machine().emit_object(mod), str(mod)


def _emit_in_parallel(misses: list, timeout_s: float = 600.0) -> dict[str, tuple[bytes, str]]:
    """key -> (object, IR) for ``misses`` ([(key, kernel)]): a forked child emits every other
    one into a temporary directory while this process emits the rest.  Whatever the child did
    not deliver (it failed, or did not end within ``timeout_s`` of this process finishing its
    share) is left out: the caller compiles those in-process as before."""
    import shutil
    import tempfile
    import time

    host_ = None
    try:
        from .llvm import host
        host_ = host()      # initialised before the fork: the child inherits the target
    except Exception:       # noqa: BLE001 - no LLVM: the caller's path raises the real error
        return {}
    del host_
    tmp = tempfile.mkdtemp(prefix="apollo-llvm-")
    theirs, mine = misses[1::2], misses[0::2]
    pid = os.fork()
    if pid == 0:                                    # the child: its share into files, then exit
        try:
            for i, (key, k) in enumerate(theirs):
                obj, ir = _emit(key, k)
                part = os.path.join(tmp, f"{i}")
                with open(part + ".tmp", "wb") as f:
                    f.write(len(obj).to_bytes(8, "little") + obj + ir.encode())
                os.replace(part + ".tmp", part)
        finally:
            os._exit(0)
    out: dict[str, tuple[bytes, str]] = {}
    started = time.monotonic()
    try:
        for key, k in mine:
            try:
                out[key] = _emit(key, k)
            except Exception:   # noqa: BLE001 - compiled again in-process, where it raises
                pass
        # the child has as much to do: waiting much longer means it is stuck (an LLVM lock
        # another thread held at the fork) and this process compiles its share instead
        _reap(pid, time.monotonic() + min(timeout_s, 2 * (time.monotonic() - started) + 5))
        for i, (key, _) in enumerate(theirs):
            try:
                with open(os.path.join(tmp, f"{i}"), "rb") as f:
                    data = f.read()
            except OSError:
                continue
            n = int.from_bytes(data[:8], "little")
            out[key] = (data[8:8 + n], data[8 + n:].decode())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def share_with_child(items: Sequence, fn, cache_dir: str | None) -> dict:
    """``{index: fn(item)}`` for the items this process computed, after a forked child has run
    ``fn`` on every other item so that their pieces are in the disk cache ``cache_dir`` when
    the caller computes them (then a hit).  ``fn`` compiles through the piecewise cache (e.g.
    a generated GEMM): llvmlite runs one LLVM call at a time per process, so a second process
    is the only way to use a second core.  In-process only (an empty dict, the caller computes
    everything) without a cache dir, fork or a second core, or for fewer than
    :data:`PARALLEL_MIN` items.  A child that fails or does not finish in time only costs
    the caller those compiles."""
    import time
    if not cache_dir or len(items) < PARALLEL_MIN or not hasattr(os, "fork") or _cores() < 2:
        return {}
    try:
        from .llvm import host
        host()              # initialised before the fork: the child inherits the target
    except Exception:       # noqa: BLE001 - the caller's path raises the real error
        return {}
    pid = os.fork()
    if pid == 0:
        try:
            for item in items[1::2]:
                fn(item)
        finally:
            os._exit(0)
    out, started = {}, time.monotonic()
    try:
        for i in range(0, len(items), 2):
            out[i] = fn(items[i])
    finally:
        if not _reap(pid, time.monotonic() + 2 * (time.monotonic() - started) + 5):
            from ..fsutil import remove_temps_of
            remove_temps_of(cache_dir, pid)     # a piece it was writing when it was killed
    return out


def _reap(pid: int, deadline: float) -> bool:
    """Wait for forked child ``pid`` until ``deadline`` (time.monotonic), then kill it: a
    child still working then is stuck (an LLVM lock another thread held at the fork), and its
    share is compiled by the caller instead.  False when it had to be killed."""
    import signal
    import time
    while True:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done or time.monotonic() > deadline:
            break
        time.sleep(0.005)
    if not done:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    return bool(done)
