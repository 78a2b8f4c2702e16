"""In-process memo of layer-1 results by structure (value names do not matter).

Layer 1 (isl scheduling, storage planning, loop-IR generation) costs tens of milliseconds per
micro-graph and dominates a cold ``target="cpu"`` compile once LLVM's output is in the piecewise
cache.  Models and test suites repeat the same micro-graph under other value names (an ONNX
op and its ``_expanded`` function body, the same block at every layer, the same shapes in every
dtype test): on the ONNX node suite 305 of 677 layer-1 calls were distinct.

:func:`fuse_nodes` renames a node list's values canonically (``v0, v1, ...`` in order of first
appearance, inputs first), looks the structure up — ops, attributes (constants compare by
content), canonical wiring, value types and the Options — and on a miss runs
:func:`~apollo_py.layers.layer1.fuse_micro_graph` on the renamed nodes.  Either way it returns
FusedKernels carrying the caller's nodes and value names, their loop IR with the kernel
params renamed after the caller's values (as layer 1 names them); scratch tiles and locals keep
their canonical names (``_c<k>``).  If a caller's name would collide with one of those, layer 1
runs on the caller's names instead.  Failures are not memoised.  A hit writes no layer-1
feedback events: the first occurrence did.
"""
from __future__ import annotations

import threading
from dataclasses import replace
from typing import Mapping, Sequence

from cachetools import LRUCache

from ..codegen import loopir as L
from ..ir.graph import Node
from ..options import Options
from ..partition.rules import relevant_splits
from .layer1 import fuse_micro_graph

MAX_ENTRIES = 4096
_MEMO: LRUCache = LRUCache(MAX_ENTRIES)   # structural key -> (canonical nodes, fused kernels)
_LOCK = threading.Lock()


def _canonical(nodes: Sequence[Node], inputs: Sequence[str], outputs: Sequence[str]) -> dict:
    names: dict[str, str] = {}

    def c(v):
        if v not in names:
            names[v] = f"_c{len(names)}"
        return names[v]
    for v in inputs:
        c(v)
    for n in nodes:
        for v in (*n.inputs, *n.outputs):
            c(v)
    for v in outputs:
        c(v)
    return names


def fuse_nodes(nodes: Sequence[Node], types: Mapping, inputs: Sequence[str], outputs: Sequence[str],
               options: Options) -> list:
    """``fuse_micro_graph(nodes, types, inputs, outputs, options)``, memoised by structure."""
    names = _canonical(nodes, inputs, outputs)
    key = (tuple((n.op, n.attrs, tuple(names[v] for v in n.inputs), tuple(names[v] for v in n.outputs))
                 for n in nodes),
           tuple(names[v] for v in inputs), tuple(names[v] for v in outputs),
           tuple((c, types[v]) for v, c in names.items()), options,
           relevant_splits([n.op for n in nodes], options.rules_overlay))   # the overlay file may change
    with _LOCK:
        hit = _MEMO.get(key)
    if hit is None:
        cnodes = [n.replace(inputs=tuple(names[v] for v in n.inputs),
                            outputs=tuple(names[v] for v in n.outputs)) for n in nodes]
        ctypes = {c: types[v] for v, c in names.items()}
        cin, cout = [names[v] for v in inputs], [names[v] for v in outputs]
        fused = _stored_or_fused(cnodes, ctypes, cin, cout, options)
        hit = (tuple(cnodes), tuple(fused))
        with _LOCK:
            _MEMO[key] = hit
    cnodes, fused = hit
    back = {c: v for v, c in names.items()}
    real = {id(cn): n for cn, n in zip(cnodes, nodes)}

    def vals(seq):
        return tuple(back[v] for v in seq)
    out = []
    for f in fused:
        loop = _rename_params(f.loop, vals(f.param_values))
        if loop is None:     # a caller's name collides with a scratch name: no sharing
            return fuse_micro_graph(list(nodes), types, list(inputs), list(outputs), options)
        out.append(replace(f, loop=loop, nodes=tuple(real[id(n)] for n in f.nodes), inputs=vals(f.inputs),
                           outputs=vals(f.outputs), param_values=vals(f.param_values),
                           consts={back[k]: x for k, x in f.consts.items()}))
    return out


def _stored_or_fused(cnodes, ctypes, cin, cout, options: Options) -> tuple:
    """Layer 1's kernels for a canonically named micro-graph: from the disk store in
    ``options.cache_dir`` (layers/fuse_store.py), else fused now, keyed for codegen and stored."""
    from ..codegen.cached import kernel_key, piece_cache, remember_text
    from . import fuse_store
    cache = piece_cache(options.cache_dir) if options.cache_dir else None
    skey = fuse_store.store_key(cnodes, cin, cout, ctypes, options) if cache is not None else ""
    if cache is not None:
        got = fuse_store.load(cache, skey, cnodes)
        if got is not None:
            return got
    fused = []
    for f in fuse_micro_graph(cnodes, ctypes, cin, cout, options):
        key, text = kernel_key(f.loop)
        remember_text(key, text)
        fused.append(replace(f, object_key=key))
    if cache is not None:
        fuse_store.save(cache, skey, fused, cnodes)
    return tuple(fused)


def _rename_params(k: L.Kernel, values: Sequence[str]):
    """``k`` with its params named after ``values`` (in order); None on a name collision."""
    from ..poly.ast_to_loopir import _ident
    taken: set = set()
    return L.rename_params(k, [_ident(v, taken) for v in values])
