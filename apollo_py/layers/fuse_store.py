"""Layer-1 results on disk, keyed before scheduling (DESIGN §10).

The piecewise cache of codegen skips LLVM; this store lets a warm compile skip isl as well.
Its key is the micro-graph's canonical structure (ops, attributes with constants by content,
wiring in canonical names, value types), the Options fields layer 1 reads, and a digest of the
source of layer 1 and everything below it (poly/, codegen/loopir.py, ops/); its value is the
FusedKernels layer 1 made (loop IR as JSON, in canonical names) with the piece key of each
kernel's object code, so a warm compile neither schedules nor renders LLVM text.  Entries go
through the same :class:`~apollo_py.cache.PieceCache` as object code (checksummed, atomic,
no pickle).  A failure to read or decode an entry is a miss.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import fields, is_dataclass
from functools import lru_cache
from typing import Sequence

from ..codegen import loopir as L
from ..poly.reduce_forms import ReduceForm

FORMAT = 1
_CLASSES = {c.__name__: c for c in (L.Var, L.Const, L.Bin, L.Un, L.Select, L.Cast, L.Param, L.Load, L.Block,
                                    L.For, L.If, L.Local, L.Assign, L.Store, L.Alloc, L.Kernel, ReduceForm)}
#: the FusedKernel fields stored (nodes are stored as indices; micro_graphs are the caller's)
_FIELDS = ("loop", "inputs", "outputs", "param_values", "signature", "parallel_dims", "band_extents",
           "tile_sizes", "flops", "bytes", "reduce_form", "strategy", "schedule_ms", "total_ms", "consts")


def encode(x):
    """JSON-able form of loop IR, ReduceForm and plain values (tuples become lists)."""
    if is_dataclass(x) and not isinstance(x, type):
        name = type(x).__name__
        if name not in _CLASSES:
            raise TypeError(f"cannot store {name}")
        return {"$": name, **{f.name: encode(getattr(x, f.name)) for f in fields(x)}}
    if isinstance(x, (list, tuple)):
        return [encode(v) for v in x]
    if isinstance(x, dict):
        return {"$d": [[k, encode(v)] for k, v in x.items()]}
    return x


def decode(x):
    """Inverse of :func:`encode` (lists become tuples, as loop IR holds them)."""
    if isinstance(x, list):
        return tuple(decode(v) for v in x)
    if isinstance(x, dict):
        if "$d" in x:
            return {k: decode(v) for k, v in x["$d"]}
        cls = _CLASSES[x["$"]]
        return cls(**{k: decode(v) for k, v in x.items() if k != "$"})
    return x


@lru_cache(maxsize=None)
def _source_digest() -> str:
    """sha256 over the source of layer 1 and the modules it builds on."""
    from ..fsutil import files_digest
    here = os.path.dirname(os.path.dirname(__file__))
    paths = [os.path.join(here, sub, name) for sub in ("poly", "ops")
             for name in sorted(os.listdir(os.path.join(here, sub))) if name.endswith(".py")]
    # llvm_math.py: a stored kernel keeps the object key of its text, and that text holds the
    # math functions' bodies (exp, erf, ...), so a change there must miss here too
    paths += [os.path.join(here, rel) for rel in ("codegen/loopir.py", "codegen/llvm_math.py", "layers/layer1.py",
                                                  "layers/expand.py",
                                                  "layers/fuse_store.py", "layers/fuse_memo.py",
                                                  "layers/pool_kernel.py")]
    return files_digest(paths)


def store_key(cnodes: Sequence, cinputs: Sequence[str], coutputs: Sequence[str], ctypes, options) -> str:
    """The piece key of a canonically named micro-graph for ``options``."""
    from ..cache import piece_key
    from ..partition.rules import relevant_splits
    text = json.dumps({
        "nodes": [[n.op, n.attrs.canonical(), list(n.inputs), list(n.outputs)] for n in cnodes],
        "inputs": list(cinputs), "outputs": list(coutputs),
        "types": sorted((v, str(t)) for v, t in ctypes.items()),
        "options": [options.schedule_budget, options.schedule_timeout, list(options.tile_sizes or ()),
                    options.target in ("cuda", "cuda-emu")],     # layer 1's pool kernel is CPU only
        "splits": list(relevant_splits([n.op for n in cnodes], options.rules_overlay)),
        "format": FORMAT, "source": _source_digest()})
    return piece_key(hashlib.sha256(text.encode()).hexdigest(), "layer1", {})


def save(cache, key: str, fused: Sequence, cnodes: Sequence) -> None:
    """Store layer 1's kernels for ``key`` (``fused[i].nodes`` are among ``cnodes``)."""
    index = {id(n): i for i, n in enumerate(cnodes)}
    doc = {"kernels": [{"nodes": [index[id(n)] for n in f.nodes], "object_key": f.object_key,
                        **{k: encode(getattr(f, k)) for k in _FIELDS}} for f in fused]}
    cache.put(key, json.dumps(doc).encode(), {"kind": "layer1"})


def load(cache, key: str, cnodes: Sequence) -> tuple | None:
    """The FusedKernels stored for ``key`` (nodes taken from ``cnodes``), or None."""
    from .layer1 import FusedKernel
    hit = cache.get(key)
    if hit is None:
        return None
    try:
        doc = json.loads(hit[0])
        return tuple(FusedKernel(nodes=tuple(cnodes[i] for i in k["nodes"]), object_key=k["object_key"],
                                 **{f: decode(k[f]) for f in _FIELDS}) for k in doc["kernels"])
    except (ValueError, KeyError, TypeError, IndexError):
        return None
