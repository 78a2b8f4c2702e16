"""Model-level compile cache: a new process compiles an unchanged model file without any pass.

The piecewise cache (``cache.py``) and the layer-1 store (``layers/fuse_store.py``) skip isl and
LLVM, but a warm compile would still read, parse and decode the ONNX file, lower it, preprocess,
partition and rename kernel parameters per call site.  This cache keeps, per model file and
input shapes, what those passes produced -- the primitive graph, the micro-graphs and the
lowered step list (``compiler.build_cpu_executable``'s inputs) -- so a warm compile only loads
object code from the piecewise cache and builds the executable.

**Identity.**  A model file is named by its real path, inode, size and modification time and a
sha256 over every byte of the file except the initializers' ``raw_data`` payloads (the graph,
attributes and small tensors: a few MB for a 500 MB export, found by walking the protobuf wire
format without parsing it).  An entry's key adds the input shapes, every Options field that can
change the result, the resolved machine figures (layer 3 plans with them), the rule overlay's
content, the digest of apollo_py's sources and the versions of apollo_py, islpy, llvmlite and the
CPU (``cache.data_model_version``).  Any change is a different key, i.e. a miss.

**Weights are mapped, not copied.**  Arrays that lie inside an initializer's ``raw_data`` are
stored as (file offset, dtype, shape, strides) and rebuilt as read-only views of an ``mmap`` of
the model file: nothing is read until a kernel touches it.  Other arrays of 1 KiB or more
(constants folded at compile time, and weights that protobuf misaligned in the file) go to a side
file next to the entry, 64-byte aligned, also mapped.  The
constant operands of generated GEMMs are stored packed (``packed_store.py``, ``<key>.packed``):
a warm compile maps those buffers, and a weight that only they read is mapped as it lies in the
file (not copied to an aligned array): it is never read.

**Format.**  ``<cache_dir>/models/<key>.pkl``: a sha256 of the rest, then a pickle of
``(graph, micro_graphs, specs)`` whose arrays are persistent ids; ``<key>.arrays``: the side file.
A pickle is as trusted as the object code the piecewise cache loads and runs from the same
directory.  An entry that fails its checksum or does not load is deleted and is a miss; the
directory keeps the :data:`MAX_ENTRIES` most recently used entries, at most :data:`MAX_BYTES` of
entry files.

**Programs.**  For a model path :func:`model_program` returns a :class:`ModelFileProgram`: its
``name``, ``inputs`` and ``outputs`` come from a small header entry keyed by the file identity,
and the ONNX file is only parsed when something needs the nodes (a cache miss, ``to_onnx``).
"""
from __future__ import annotations

import hashlib
import io
import json
import mmap
import os
import pickle
import threading
from dataclasses import fields
from functools import lru_cache
from typing import Mapping

import numpy as np

from .program import Program

FORMAT = 1
#: model entries kept per cache directory (least recently used deleted first)
MAX_ENTRIES = 32
#: bytes of entry files kept per cache directory (packed GEMM weights: ~0.4 GB per BERT-size model)
MAX_BYTES = 4 << 30
#: age (s) after which a file that belongs to no entry is deleted by eviction
ORPHAN_AGE_S = 600
#: arrays below this size are pickled inline
INLINE_BYTES = 1024
#: folded constants above this total are not stored (such a model compiles without the cache)
MAX_SIDE_BYTES = 1 << 30
#: Options fields that do not change what a compile produces
_IGNORED = ("cache_dir", "progress", "feedback_path", "model_name", "tune_budget")

#: what this process's model cache did (tests pin a warm compile by these)
STATS = {"hits": 0, "misses": 0, "saves": 0, "parses": 0}
#: the files of an entry
_EXTS = (".pkl", ".arrays", ".packed")


# --- the model file's identity -------------------------------------------------------------------


def _varint(buf, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos
        shift += 7


def _fields(buf, start: int, end: int):
    """``(field number, wire type, value or (start, end))`` of the protobuf message in
    ``buf[start:end]``; length-delimited fields give their span, not their bytes."""
    pos = start
    while pos < end:
        tag, pos = _varint(buf, pos)
        num, wt = tag >> 3, tag & 7
        if wt == 0:
            v, pos = _varint(buf, pos)
            yield num, wt, v
        elif wt == 2:
            n, pos = _varint(buf, pos)
            if pos + n > end:
                raise ValueError("truncated protobuf message")
            yield num, wt, (pos, pos + n)
            pos += n
        elif wt == 1:
            yield num, wt, None
            pos += 8
        elif wt == 5:
            yield num, wt, None
            pos += 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wt}")
    if pos != end:
        raise ValueError("truncated protobuf message")


def scan_onnx(buf) -> tuple[str, dict[str, tuple[int, int]]]:
    """``(digest, raw)`` of a serialised ModelProto: sha256 over every byte except the main
    graph's initializers' raw_data payloads, and initializer name -> (file offset, bytes) of
    those payloads.  ValueError on bytes that are not a well-formed message."""
    try:
        return _scan(buf)
    except IndexError:
        raise ValueError("truncated protobuf message") from None


def _scan(buf):
    raw: dict[str, tuple[int, int]] = {}
    spans = []
    for num, wt, v in _fields(buf, 0, len(buf)):
        if num != 7 or wt != 2:          # ModelProto.graph
            continue
        for gnum, gwt, gv in _fields(buf, *v):
            if gnum != 5 or gwt != 2:    # GraphProto.initializer
                continue
            name, data = None, None
            for tnum, twt, tv in _fields(buf, *gv):
                if tnum == 8 and twt == 2:       # TensorProto.name
                    name = bytes(buf[tv[0]:tv[1]]).decode("utf-8", "replace")
                elif tnum == 9 and twt == 2:     # TensorProto.raw_data
                    data = tv
            if name is not None and data is not None and data[1] > data[0]:
                raw[name] = (data[0], data[1] - data[0])
                spans.append(data)
    h = hashlib.sha256()
    pos = 0
    for s, e in sorted(spans):
        h.update(buf[pos:s])
        pos = e
    h.update(buf[pos:])
    return h.hexdigest(), raw


class ModelFile:
    """A model file's identity (``key``), its mapping and its initializers' raw_data offsets."""

    def __init__(self, path: str):
        self.path = os.path.realpath(path)
        with open(self.path, "rb") as f:
            st = os.fstat(f.fileno())
            self.mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if st.st_size else b""
        digest, self.raw = scan_onnx(memoryview(self.mm))
        self.key = hashlib.sha256(f"{self.path}|{st.st_ino}|{st.st_size}|{st.st_mtime_ns}|{digest}"
                                  .encode()).hexdigest()

    def view(self, offset: int, dtype: str, shape, strides) -> np.ndarray:
        """A read-only array over the file's bytes; a copy where ``offset`` is not a multiple of
        the dtype's alignment (protobuf puts raw_data anywhere): numpy runs misaligned arrays
        through its slow buffered paths (a 64-row ``take`` from a [100000, 64] float32 table:
        1.4 ms misaligned, 1.2 us aligned) and the compiled path gives kernels aligned arrays."""
        dt = np.dtype(dtype)
        a = np.ndarray(tuple(shape), dt, buffer=self.mm, offset=offset, strides=tuple(strides))
        if offset % dt.alignment:
            a = np.array(a)
            a.flags.writeable = False
        return a


def model_file(path) -> ModelFile | None:
    """The identity of the model file at ``path``, or None when it cannot be read or scanned."""
    try:
        return ModelFile(os.fspath(path))
    except (OSError, ValueError, IndexError):
        return None


# --- keys ------------------------------------------------------------------------------------


@lru_cache(maxsize=None)
def source_digest() -> str:
    """Digest of apollo_py's sources and data files (rules, schemas): any edit is a new key."""
    from ..fsutil import files_digest
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    paths = []
    for dirpath, dirnames, files in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        paths += [os.path.join(dirpath, f) for f in sorted(files) if f.endswith((".py", ".toml", ".json"))]
    return files_digest(paths)


def options_doc(options) -> dict:
    """The Options fields that shape a compile's result, with the rule overlay's content and the
    resolved machine figures."""
    from ..machine import load_machine, resolve_machine
    doc = {f.name: repr(getattr(options, f.name)) for f in fields(options) if f.name not in _IGNORED}
    if options.rules_overlay:
        try:
            with open(options.rules_overlay, "rb") as f:
                doc["overlay_content"] = hashlib.sha256(f.read()).hexdigest()
        except OSError:
            doc["overlay_content"] = "unreadable"
    from ..tuning.db import corrections, digest
    tuned = digest(options)     # the tuning database's decisions for this machine (tuning/db.py)
    if tuned:
        doc["tuning"] = tuned
    if corrections(options):
        doc["cost_corrections"] = repr(sorted(corrections(options).items()))
    if options.machine is not None:
        doc["machine_figures"] = repr(sorted(resolve_machine(options).figures().items()))
    else:
        # the figures stored in the cache dir (re-measured: a new key); figures a busy machine
        # made implausible are not stored and differ per process, so they cannot be a key part
        stored = load_machine(options.cache_dir)
        doc["machine_figures"] = repr(sorted(stored.figures().items())) if stored else "not stored"
    return doc


def entry_key(mf: ModelFile, shapes: Mapping[str, tuple], options) -> str:
    from ..cache import data_model_version
    doc = {"file": mf.key, "shapes": sorted((k, list(v)) for k, v in shapes.items()),
           "options": options_doc(options), "source": source_digest(), "format": FORMAT,
           "dm": data_model_version(options.target)}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def _header_key(mf: ModelFile) -> str:
    return hashlib.sha256(f"header|{mf.key}|{source_digest()}|{FORMAT}".encode()).hexdigest()


def _dir(cache_dir: str) -> str:
    return os.path.join(cache_dir, "models")


# --- programs --------------------------------------------------------------------------------


class ModelFileProgram(Program):
    """An ONNX model file whose nodes are parsed on first need (see the module docstring).

    ``name``, ``inputs`` and ``outputs`` are known without parsing; every other attribute is the
    parsed :class:`~apollo_py.frontend.onnx.OnnxProgram`'s."""

    def __init__(self, mf: ModelFile, cache_dir: str, name: str, inputs: tuple, outputs: tuple, real=None):
        self.model_file = mf
        self.cache_dir = cache_dir
        self.name, self.inputs, self.outputs = name, inputs, outputs
        self._real = real
        self._lock = threading.Lock()

    @property
    def real(self):
        """The parsed program (parsed now if it was not)."""
        with self._lock:
            if self._real is None:
                from .onnx import load_onnx
                STATS["parses"] += 1
                self._real = load_onnx(self.model_file.path, self.cache_dir, self.model_file.mm or None)
            return self._real

    def __getattr__(self, attr):
        if attr.startswith("__") or attr in ("_real", "_lock", "model_file", "cache_dir"):
            raise AttributeError(attr)
        return getattr(self.real, attr)

    def specialize(self, shapes, options=None):
        return self.real.specialize(shapes, options)

    def lower(self, shapes, options=None):
        return self.real.lower(shapes, options)


def model_program(path, cache_dir: str | None):
    """A :class:`ModelFileProgram` for the ONNX file at ``path`` (parsed only when its header is
    not stored yet), or None when the file cannot be identified (the caller loads it as usual)."""
    from .program import InputSpec
    if not cache_dir:
        return None
    mf = model_file(path)
    if mf is None:
        return None
    hpath = os.path.join(_dir(cache_dir), _header_key(mf) + ".json")
    try:
        with open(hpath, encoding="utf-8") as f:
            h = json.load(f)
        inputs = tuple(InputSpec(i["name"], tuple(i["dims"]), i["dtype"]) for i in h["inputs"])
        prog = ModelFileProgram(mf, cache_dir, h["name"], inputs, tuple(h["outputs"]))
    except (OSError, ValueError, KeyError, TypeError):
        from .onnx import load_onnx
        STATS["parses"] += 1
        real = load_onnx(mf.path, cache_dir, mf.mm or None)
        prog = ModelFileProgram(mf, cache_dir, real.name, tuple(real.inputs), tuple(real.outputs), real)
        doc = {"name": real.name, "outputs": list(real.outputs),
               "inputs": [{"name": s.name, "dims": list(s.dims), "dtype": s.dtype} for s in real.inputs]}
        _write(hpath, json.dumps(doc).encode())
    return prog


def _write(path: str, data: bytes) -> bool:
    from ..fsutil import atomic_write
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        atomic_write(path, data)
        return True
    except OSError:         # a cache dir that cannot be written only costs the warm path
        return False


# --- executables -----------------------------------------------------------------------------


def _byte_bounds(a: np.ndarray) -> tuple[int, int]:
    utils = getattr(np.lib, "array_utils", None)        # numpy >= 2; np.byte_bounds before
    return (utils.byte_bounds if utils is not None else np.byte_bounds)(a)


class _Saver(pickle.Pickler):
    """Pickles arrays as references: into the model file, or into the side file ``side``."""

    def __init__(self, f, mf: ModelFile, real, unread_ids=frozenset()):
        super().__init__(f, protocol=pickle.HIGHEST_PROTOCOL)
        self.mf = mf
        self.unread_ids = unread_ids    # ids of arrays only packed GEMM operands read
        self.side = io.BytesIO()
        self.seen: dict[int, tuple] = {}
        self.keep: list = []       # arrays whose ids are in ``seen`` stay alive while pickling
        # address ranges of the initializers whose bytes are the file's raw_data
        self.ranges = []
        for name, arr in real.initializers.items():
            hit = mf.raw.get(name)
            if isinstance(arr, np.ndarray) and hit is not None and arr.nbytes == hit[1] and arr.nbytes:
                lo, hi = _byte_bounds(arr)
                if hi - lo == arr.nbytes and arr.flags.c_contiguous:
                    self.ranges.append((lo, hi, hit[0]))

    def persistent_id(self, obj):
        if not isinstance(obj, np.ndarray) or obj.dtype.hasobject or obj.nbytes < INLINE_BYTES:
            return None
        pid = self.seen.get(id(obj))
        if pid is None:
            pid = self._file_ref(obj) or self._side_ref(obj)
            self.seen[id(obj)] = pid
            self.keep.append(obj)
        return pid

    def _file_ref(self, a):
        lo, hi = _byte_bounds(a)
        start = a.__array_interface__["data"][0]
        for rlo, rhi, off in self.ranges:
            if rlo <= lo and hi <= rhi:
                unread = id(a) in self.unread_ids
                if (not unread and (off + (start - rlo)) % a.dtype.alignment
                        and self.side.tell() + a.nbytes + 64 <= MAX_SIDE_BYTES):
                    # misaligned in the file: an aligned copy in the side file, mapped, instead
                    # of a copy made by every warm compile (BERT's word embeddings: 94 MB)
                    return None
                pid = ("F" if unread else "f", off + (start - rlo), a.dtype.str, a.shape, a.strides)
                view = self.mf.view(*pid[1:])
                # the mapping must hold these very values (the file is what the key names)
                if view.size and not (np.array_equal(view.flat[:8], a.flat[:8], equal_nan=a.dtype.kind == "f")
                                      and np.array_equal(view.flat[-8:], a.flat[-8:],
                                                         equal_nan=a.dtype.kind == "f")):
                    return None
                return pid
        return None

    def _side_ref(self, a):
        pos = -self.side.tell() % 64 + self.side.tell()      # 64-byte aligned
        if pos + a.nbytes > MAX_SIDE_BYTES:
            raise pickle.PicklingError("folded constants too large for the model cache")
        self.side.seek(pos)
        self.side.write(np.ascontiguousarray(a).tobytes())
        return ("s", pos, a.dtype.str, a.shape)


class _Loader(pickle.Unpickler):
    def __init__(self, f, mf: ModelFile, side):
        super().__init__(f)
        self.mf, self.side = mf, side

    def persistent_load(self, pid):
        if pid[0] == "f":
            return self.mf.view(*pid[1:])
        if pid[0] == "F":       # read only through its packed form: a view, even if misaligned
            _, off, dtype, shape, strides = pid
            a = np.ndarray(tuple(shape), np.dtype(dtype), buffer=self.mf.mm, offset=off, strides=tuple(strides))
            a.flags.writeable = False
            return a
        if pid[0] == "s":
            _, off, dtype, shape = pid
            return np.ndarray(tuple(shape), np.dtype(dtype), buffer=self.side, offset=off)
        raise pickle.UnpicklingError(f"unknown array reference {pid[0]!r}")


def _cpu(options) -> bool:
    return options.target == "cpu"


def load_executable(program, shapes: Mapping[str, tuple], options):
    """The CPU executable stored for ``program`` (a :class:`ModelFileProgram`) at ``shapes``,
    built from the stored step list and the piecewise cache; None on a miss."""
    if not (_cpu(options) and options.cache_dir and isinstance(program, ModelFileProgram)):
        return None
    import time

    from ..progress import Progress
    t0 = time.perf_counter()
    mf = program.model_file
    key = entry_key(mf, shapes, options)
    base = os.path.join(_dir(options.cache_dir), key)
    try:
        with open(base + ".pkl", "rb") as f:
            data = f.read()
        if hashlib.sha256(data[32:]).digest() != data[:32]:
            raise ValueError("checksum")
        side = b""
        if os.path.exists(base + ".arrays"):
            with open(base + ".arrays", "rb") as f:
                side = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if os.fstat(f.fileno()).st_size else b""
        doc = _Loader(io.BytesIO(data[32:]), mf, side).load()
        if doc.get("format") != FORMAT:
            raise ValueError("format")
        graph, micro_graphs, specs = doc["value"]
        machine = doc["machine"]
    except FileNotFoundError:
        STATS["misses"] += 1
        return None
    except Exception:           # corrupt or stale entry: drop it, compile as usual
        for ext in _EXTS:
            try:
                os.unlink(base + ext)
            except OSError:
                pass
        STATS["misses"] += 1
        return None
    try:
        os.utime(base + ".pkl")     # recently used: evicted last
    except OSError:
        pass
    STATS["hits"] += 1
    from ..compiler import build_cpu_executable
    progress = Progress(graph.name, options.progress)
    progress.timings.append(("model cache", time.perf_counter() - t0))
    # the figures the steps were planned with: figures that were not stored (a busy machine)
    # would otherwise be measured again by every process (seconds)
    exe = build_cpu_executable(graph, micro_graphs, specs, options, progress, machine, fork=False)
    from . import packed_store
    if packed_store.load(exe, base + ".packed"):        # packed now; stored for the next process
        packed_store.store(exe, base + ".packed")
    return exe


def save_executable(program, shapes: Mapping[str, tuple], options, exe) -> bool:
    """Store what ``exe`` (a CpuExecutable compiled from ``program`` at ``shapes``) was built
    from; False when it cannot be stored (not a model file, unpicklable steps, no cache dir)."""
    from ..runtime.cpu import CpuExecutable
    if not (_cpu(options) and options.cache_dir and isinstance(program, ModelFileProgram)
            and isinstance(exe, CpuExecutable) and program._real is not None):
        return False
    mf = program.model_file
    plan = exe.plan
    buf = io.BytesIO()
    from . import packed_store
    unread = set()
    if len(plan.kernels) == len(exe.steps):
        names = packed_store.const_operand_names(plan.kernels, exe.steps) - set(plan.graph.outputs)
        unread = {id(exe.constants[v]) for v in names if v in exe.constants}
    saver = _Saver(buf, mf, program._real, unread)
    try:
        specs = _with_object_keys(plan.kernels, exe.steps)
        saver.dump({"format": FORMAT, "value": (plan.graph, plan.micro_graphs, specs), "machine": exe.machine})
    except Exception:           # a step that cannot be pickled (an onnx.reference op...): no entry
        return False
    key = entry_key(mf, shapes, options)
    base = os.path.join(_dir(options.cache_dir), key)
    payload = buf.getvalue()
    side = saver.side.getvalue()
    if side and not _write(base + ".arrays", side):
        return False
    if not _write(base + ".pkl", hashlib.sha256(payload).digest() + payload):
        return False
    # the packed operands after the entry (no packed file outlives a failed entry write); a
    # process that finds the entry before the packed file packs and stores them itself
    packed_store.store(exe, base + ".packed")
    STATS["saves"] += 1
    _evict(_dir(options.cache_dir))
    return True


def _with_object_keys(specs, steps) -> tuple:
    """``specs`` with every kernel's piecewise-cache key filled in (layers 2 and 3 make kernels
    that layer 1's store did not key): a warm compile then finds the object code without
    rendering LLVM text to compute the key."""
    from dataclasses import replace

    from ..codegen import cached
    with cached._LOCK:
        key_of = {id(ck): key for key, ck in cached._LOADED.items()}
    compiled = {id(st.fused): st.compiled for st in steps if getattr(st, "fused", None) is not None
                and hasattr(st, "compiled")}
    out = []
    for s in specs:
        f = s.fused
        if f is not None and not f.object_key:
            key = key_of.get(id(compiled.get(id(f))))
            if key is None:
                key = cached.kernel_key(f.loop)[0]
            s = replace(s, fused=replace(f, object_key=key))
        out.append(s)
    return tuple(out)


def _evict(directory: str, keep: int = MAX_ENTRIES, max_bytes: int = MAX_BYTES) -> None:
    """Keep the ``keep`` most recently used entries (by their ``.pkl``'s modification time) and
    at most ``max_bytes`` of entry files (``.pkl``, ``.arrays``, ``.packed``: a BERT entry's packed
    weights are 415 MB next to its 0.5 MB ``.pkl``; the newest entry stays whatever its size).
    Files of no entry -- a side or packed file whose ``.pkl`` is gone, a temporary file of a
    writer that died -- go once :data:`ORPHAN_AGE_S` old (younger ones may be another process's
    entry being written)."""
    import time
    try:
        files = [(e.name, e.path, e.stat()) for e in os.scandir(directory) if e.is_file()]
    except OSError:
        return
    now = time.time()
    by_base: dict[str, list] = {}
    for name, path, st in files:
        base, ext = os.path.splitext(path)
        if ext in _EXTS and not name.startswith(".tmp-"):
            by_base.setdefault(base, []).append((ext, st))
        elif name.startswith(".tmp-") and now - st.st_mtime > ORPHAN_AGE_S:
            _unlink(path)
    entries = []
    for base, parts in by_base.items():
        pkl = [st for ext, st in parts if ext == ".pkl"]
        if pkl:
            entries.append((pkl[0].st_mtime, base, sum(st.st_size for _, st in parts)))
        elif all(now - st.st_mtime > ORPHAN_AGE_S for _, st in parts):
            _remove_entry(base)
    entries.sort(reverse=True)          # most recently used first
    total = 0
    for i, (_, base, size) in enumerate(entries):
        total += size
        if i and (i >= keep or total > max_bytes):
            _remove_entry(base)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _remove_entry(base: str) -> None:
    for ext in _EXTS:
        _unlink(base + ext)
