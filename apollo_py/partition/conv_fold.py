"""Folding per-channel affine chains after a conv into its constant weight and one bias add.

BatchNormalization with running statistics lowers (ops/compound.py) to ``(y - mean) * (inv *
scale) + bias``; after constant folding every operand is a ``(1, C, 1, 1)`` constant.  torch
dynamo's decompositions spell the same chain with ``(C, 1, 1)`` constants, and a conv's own
bias is one more ``add``.  Any such chain -- ``add`` / ``sub`` / ``mul`` / ``div`` by constants
that vary only along the channel axis -- is an affine map ``y * a + b`` per output channel, so

    conv(x, W) * a + b == conv(x, W * a[:, None, None, None]) + b

:func:`fold_conv_affine` rewrites it that way at compile time: the conv gets a new constant
weight, the chain becomes one ``add`` of a ``(1, C, 1, 1)`` constant (none if ``b`` is zero)
that the conv's GEMM epilogue absorbs.  The constants are combined in float64 and rounded once.
"""
from __future__ import annotations

import numpy as np

from ..ir.graph import Attrs, ConstArray, Graph, Node
from ..ir.types import TensorType

_AFFINE = ("add", "sub", "mul", "div")


def _channel_vector(arr: np.ndarray, rank: int, channels: int):
    """``arr`` as a float64 ``(channels,)`` vector when, right-aligned to ``rank`` dims, it
    varies only along axis 1 (size 1 or ``channels`` there); None otherwise."""
    if arr.ndim > rank or not np.issubdtype(arr.dtype, np.floating):
        return None
    shape = (1,) * (rank - arr.ndim) + arr.shape
    if any(d != 1 for i, d in enumerate(shape) if i != 1) or shape[1] not in (1, channels):
        return None
    return np.broadcast_to(arr.reshape(shape[1]).astype(np.float64), (channels,))


def fold_conv_affine(graph: Graph) -> Graph:
    """Fold every per-channel ``add``/``sub``/``mul``/``div``-by-constant chain that follows a
    conv with a constant weight (each link the only consumer of the previous value, not a graph
    output, same type as the conv output) into the weight and one bias ``add``.

    Expects a verified graph with constants already folded; returns a verified graph with the
    same inputs and outputs (the graph itself when there is nothing to fold).  A chain that is a
    single ``add`` (already the bias form) is left alone."""
    from .preprocess import _rebuild
    consts = {n.outputs[0]: n.attrs["value"].array for n in graph.nodes if n.op == "constant"}
    users: dict[str, list] = {}
    for n in graph.nodes:
        for v in dict.fromkeys(n.inputs):
            users.setdefault(v, []).append(n)
    outs = set(graph.outputs)
    types = dict(graph.types)
    drop: set = set()
    replace: dict[int, list] = {}       # id(conv node) -> nodes that take its place
    for n in graph.nodes:
        if n.op != "conv" or len(n.inputs) != 2 or n.inputs[1] not in consts:
            continue
        out_t = types[n.outputs[0]]
        if out_t.dtype not in ("float32", "float64") or len(out_t.shape) < 3:
            continue
        c = out_t.shape[1]
        scale, shift = np.ones(c), np.zeros(c)
        chain, cur = [], n.outputs[0]
        while cur not in outs and len(users.get(cur, ())) == 1:
            u = users[cur][0]
            if u.op not in _AFFINE or len(u.inputs) != 2 or types[u.outputs[0]] != out_t:
                break
            pos = u.inputs.index(cur)
            other = u.inputs[1 - pos]
            vec = _channel_vector(consts[other], len(out_t.shape), c) if other in consts else None
            if vec is None or u.inputs[0] == u.inputs[1]:
                break
            if u.op == "add":
                shift = shift + vec
            elif u.op == "sub" and pos == 0:
                shift = shift - vec
            elif u.op == "sub":                      # k - y
                scale, shift = -scale, vec - shift
            elif u.op == "mul":
                scale, shift = scale * vec, shift * vec
            elif pos == 0 and np.all(vec != 0):      # y / k
                scale, shift = scale / vec, shift / vec
            else:
                break
            chain.append(u)
            cur = u.outputs[0]
        if not chain or (len(chain) == 1 and chain[0].op == "add"):
            continue
        w_name, x_name = n.inputs[1], n.inputs[0]
        w = consts[w_name]
        w_new = (w.astype(np.float64) * scale.reshape((c,) + (1,) * (w.ndim - 1))).astype(w.dtype)
        base = n.outputs[0]
        w_val = f"{base}_wfold"
        types[w_val] = TensorType(w.shape, str(w.dtype))
        src = tuple(dict.fromkeys(s for m in (n, *chain) for s in m.source))
        new = [Node("constant", (), (w_val,), Attrs({"value": ConstArray(w_new)}), name=w_val, source=src)]
        if np.any(shift != 0):
            b_val = f"{base}_bfold"
            b_shape = (1, c) + (1,) * (len(out_t.shape) - 2)
            types[b_val] = TensorType(b_shape, out_t.dtype)
            new += [Node("constant", (), (b_val,), Attrs({"value": ConstArray(shift.astype(out_t.dtype).reshape(b_shape))}),
                         name=b_val, source=src),
                    n.replace(inputs=(x_name, w_val), source=src),
                    Node("add", (base, b_val), (cur,), name=f"{cur}_bias", source=src)]
        else:
            new.append(n.replace(inputs=(x_name, w_val), outputs=(cur,), source=src))
        replace[id(n)] = new
        drop.update(id(u) for u in chain)
    if not replace:
        return graph
    nodes = []
    for n in graph.nodes:
        if id(n) in drop:
            continue
        nodes.extend(replace.get(id(n), [n]))
    return _rebuild(graph.replace(types=types), nodes, {})
