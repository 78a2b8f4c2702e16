"""Recompute lower-rank values at their consumers' shape (DESIGN §5, issue "Real models I").

A micro-graph whose elementwise statements live on a lower-rank domain than the rest -- a
causal mask ``[1,1,S,S]`` combined into scores ``[B,H,S,S]``, LayerNorm's per-row scale
``[1,H,W,1]`` applied to ``[1,H,W,C]`` and then pooled over H and W -- has no shared parallel
band in which every statement instance feeds one band point: the direct fused schedule refuses
it, and isl's own scheduler was seen to run for minutes on such graphs (a Swin-T export's
final LayerNorm + global pool; a GPT-2 export's masked softmax).

:func:`expand_lower_rank` rewrites such a micro-graph so those values are computed at the shape
they are consumed at: each internal value made by an elementwise / broadcast op and read only
by ops of one larger output shape is computed at that shape (its inputs broadcast with a
``broadcast_to`` where none already has it).  That is recomputation per outer iteration: the
mask is recomputed per head, the row scale per channel -- a few cheap scalar ops per element
of data the kernel streams anyway -- and in exchange every statement shares the band.  Layer 1
uses it only when the micro-graph as written has no direct fused schedule.
"""
from __future__ import annotations

from math import prod
from typing import Mapping, Sequence

from ..ir.graph import Node
from ..ir.types import TensorType
from ..ops.registry import COMPUTED, get_op
from ..ops.primitives import broadcast_shapes


def _expandable(n: Node) -> bool:
    """An op whose output is numpy broadcasting of its inputs (elementwise / broadcast)."""
    if len(n.outputs) != 1 or not n.inputs or n.op in ("window_reduce", "iota"):
        return False
    opdef = get_op(n.op, n.label)
    return opdef.kind == COMPUTED and opdef.reducer is None and n.op.split("_")[0] != "reduce"


def expand_lower_rank(nodes: Sequence[Node], types: Mapping[str, TensorType],
                      outputs: Sequence[str]) -> tuple[list[Node], dict] | None:
    """``(nodes, types)`` with lower-rank internal values computed at their consumers' shape,
    or None when the micro-graph has none (see the module docstring).

    Expects ``nodes`` in topological order with one output each; values in ``outputs`` keep
    their shapes.  New ``broadcast_to`` values are named ``<input>__at_<output>``.
    """
    outs = set(outputs)
    readers: dict[str, list[Node]] = {}
    for n in nodes:
        for v in n.inputs:
            readers.setdefault(v, []).append(n)
    target: dict[str, tuple] = {}        # internal value -> the shape it is computed at

    def shape_of(v):
        return target.get(v, types[v].shape)
    for n in reversed(nodes):
        v = n.outputs[0] if len(n.outputs) == 1 else None
        if v is None or v in outs or not _expandable(n):
            continue
        users = readers.get(v, [])
        if not users or not all(_expandable(u) for u in users):
            continue
        shapes = {shape_of(u.outputs[0]) for u in users}
        if len(shapes) != 1:
            continue
        (s,) = shapes
        if prod(s) <= prod(types[v].shape) or broadcast_shapes(types[v].shape, s) != tuple(s):
            continue
        target[v] = tuple(s)
    if not target:
        return None
    new_types = dict(types)
    new_nodes: list[Node] = []
    for n in nodes:
        v = n.outputs[0] if len(n.outputs) == 1 else None
        s = target.get(v)
        if s is None:
            new_nodes.append(n)
            continue
        new_types[v] = types[v].with_shape(s)
        if n.op == "broadcast_to":
            new_nodes.append(n.replace(attrs=n.attrs.with_(shape=s)))
            continue
        ins = list(n.inputs)
        if not any(shape_of(u) == s for u in ins):
            u = ins[0]
            b = f"{u}__at_{v}"
            new_types[b] = types[u].with_shape(s)
            new_nodes.append(Node("broadcast_to", (u,), (b,), {"shape": s}, name=b, source=n.source))
            ins[0] = b
        new_nodes.append(n.replace(inputs=tuple(ins)))
    return new_nodes, new_types
