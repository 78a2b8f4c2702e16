"""Attention as one fused kernel (codegen/attention.py): the step-level pattern.

After lowering and BLAS folding (so after ``fold_operand_transposes`` has made the exporters'
``K^T`` / ``V`` transposes views of the generated GEMMs), attention is three steps whatever
the exporter wrote:

1. a generated batched GEMM ``s = Q @ K^T`` whose epilogue may hold part of the score
   transform (a scale, a mask add);
2. one stitched kernel (layer 2; or up to ``MAX_SOFTMAX_STEPS`` kernels where layer 2 split
   the softmax, as in T5's exports): optional elementwise prefix on ``s`` (``* scale``,
   ``/ sqrt(d)``, ``+ mask``, ``+ position bias``, ``where(mask, s, -inf)``), then the softmax
   over the last axis ``reduce_max -> sub -> exp -> reduce_sum -> div``, optionally followed
   by dynamo's ``where(p != p, 0, p)``;
3. a generated batched GEMM ``o = p @ V`` without epilogue (its result possibly stored
   transposed).

:func:`fold_attention` replaces each such triple, where the scores and probabilities are read
by nothing else, with one step running a :class:`~apollo_py.codegen.attention.AttentionDesc`.
Anything else -- another op in the softmax kernel, a consumer of the scores, an epilogue on
``p @ V``, a softmax over another axis, float64 -- keeps the three steps (the fallback).
``Options.attention`` = ``"unfused"`` keeps them always; ``"auto"`` (default) and ``"fused"``
fuse every match: the fused kernel measured faster than the three steps on every zoo shape
(docs/design/attention.md).
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..ir.graph import Graph

def _producers_and_readers(specs: list) -> tuple[dict, dict]:
    """``(producer, readers)``: value -> index of the step writing it, value -> indices of the
    steps reading it."""
    producer = {v: i for i, s in enumerate(specs) for v in s.outputs}
    readers: dict = {}
    for q, s in enumerate(specs):
        for v in s.inputs:
            readers.setdefault(v, set()).add(q)
    return producer, readers


def _absorb(specs: list, k: int, d2, dropped: list, extra: tuple, why: str, readers: dict, gone: set) -> None:
    """Replace attention step ``k`` by one computing ``d2`` that also does the work of steps
    ``dropped`` (their nodes ``extra`` and micro-graphs join it); the dropped steps go to
    ``gone`` and ``d2``'s inputs are recorded as read by step ``k``."""
    from .steps import StepSpec
    spec = specs[k]
    ins = tuple(dict.fromkeys([d2.q_value, d2.k_value, d2.v_value, *(o.value for o in d2.operands)]))
    mgs = tuple(sorted(set(spec.micro_graphs).union(*(specs[j].micro_graphs for j in dropped))))
    specs[k] = StepSpec(ins, spec.outputs, nodes=(*extra, *spec.nodes), reason=why, micro_graphs=mgs, gemm=d2)
    for v in ins:
        readers.setdefault(v, set()).add(k)
    gone.update(dropped)


def _nodes(spec) -> list:
    return list(spec.fused.nodes) if spec.fused is not None else list(spec.nodes)


def _softmax_steps(s: str, specs: list, readers: dict, graph: Graph):
    """The kernel steps (indices, in order) that compute from the scores ``s`` up to the value
    a GEMM reads: one stitched kernel, or -- where layer 2 split the softmax -- up to
    ``MAX_SOFTMAX_STEPS`` consecutive kernels whose values are read only among themselves and
    by that GEMM.  None when another kind of step reads them."""
    js, frontier = set(), [s]
    while frontier:
        v = frontier.pop()
        for q in readers.get(v, ()):
            if q in js:
                continue
            if specs[q].fused is None:
                if specs[q].gemm is None:
                    return None
                continue            # the P @ V GEMM (checked by the caller)
            js.add(q)
            if len(js) > MAX_SOFTMAX_STEPS:
                return None
            frontier.extend(specs[q].outputs)
    return sorted(js) or None


#: layer 2 may split a softmax into this many kernels (T5's torchscript export: two)
MAX_SOFTMAX_STEPS = 3


def _softmax_parts(nodes: list, s: str, s_shape: tuple, graph: Graph):
    """``(prefix nodes, x, nan_to_zero, result)`` when ``nodes`` (the softmax kernels' nodes,
    in order) compute ``softmax(prefix(s), axis=-1)`` (``x`` = the softmax input), or a string
    saying why not."""
    types = graph.types
    nodes = [n for n in nodes if n.op != "constant"]
    rank = len(s_shape)
    last = (rank - 1,)
    rmax = [k for k, n in enumerate(nodes) if n.op == "reduce_max"]
    if len(rmax) != 1:
        return "no single reduce_max"
    k0 = rmax[0]
    prefix, core = nodes[:k0], nodes[k0:]
    if len(core) < 5:
        return "softmax chain too short"
    mx, sub, ex, rs, dv = core[:5]
    x = mx.inputs[0]
    ok = (tuple(mx.attrs.get("axes", ())) == last and mx.attrs.get("keepdims")
          and sub.op == "sub" and sub.inputs == (x, mx.outputs[0])
          and ex.op == "exp" and ex.inputs == sub.outputs
          and rs.op == "reduce_sum" and rs.inputs == ex.outputs and tuple(rs.attrs.get("axes", ())) == last
          and rs.attrs.get("keepdims")
          and dv.op == "div" and dv.inputs == (ex.outputs[0], rs.outputs[0]))
    if not ok:
        return "not a softmax over the last axis"
    result, nan_to_zero = dv.outputs[0], False
    rest = core[5:]
    if rest:
        # dynamo: where(p != p, 0, p) -- rows whose every score is -inf give 0, not NaN
        if not (len(rest) == 2 and rest[0].op == "ne" and rest[0].inputs == (result, result)
                and rest[1].op == "where" and rest[1].inputs[0] == rest[0].outputs[0]
                and rest[1].inputs[2] == result and _scalar(graph, rest[1].inputs[1]) == 0.0):
            return "ops after the softmax: " + " ".join(n.op for n in rest)
        result, nan_to_zero = rest[1].outputs[0], True
    known = {s}
    for n in prefix:
        if not _elementwise(n, types, s_shape, known):
            return f"{n.op} before the softmax is not an elementwise op on the scores"
        known.add(n.outputs[0])
    if x not in known:
        return "the softmax does not read the scores"
    return prefix, x, nan_to_zero, result


def _scalar(graph: Graph, v: str):
    for n in graph.nodes:
        if n.op == "constant" and n.outputs[0] == v:
            a = n.attrs["value"].array
            return float(a.reshape(-1)[0]) if a.size == 1 else None
    return None


def _elementwise(n, types, shape: tuple, known: set) -> bool:
    from .gemm_lowering import _fusable
    if not _fusable(n, types, shape, known):
        return False
    for v in n.inputs:      # operands must broadcast to the scores (the kernel indexes them so)
        if v not in known and tuple(np.broadcast_shapes(tuple(types[v].shape), shape)) != shape:
            return False
    return True


def _source_size(view, batches: int, rows: int, cols: int) -> int:
    return view.size if view is not None else batches * rows * cols


def match(i: int, specs: list, readers: dict, graph: Graph):
    """``(js, k, desc, nodes)`` when GEMM step ``i`` starts an attention (softmax kernel steps
    ``js``, ``p @ V`` step ``k``), else a
    string saying why not (None when step ``i`` is not a candidate at all)."""
    from ..codegen.attention import AttentionDesc
    from ..codegen.gemm import EpiOperand, GemmDesc
    g1 = specs[i].gemm
    if not isinstance(g1, GemmDesc) or g1.conv is not None or g1.out_perm is not None:
        return None
    types = graph.types
    outs = tuple(specs[i].outputs)
    if len(outs) != 1 or outs[0] in graph.outputs or types[outs[0]].dtype != "float32":
        return None
    s_val = outs[0]
    js = _softmax_steps(s_val, specs, readers, graph)
    if js is None or not readers.get(s_val, set()) <= set(js):
        return None
    s_shape = tuple(g1.out_shape)
    if len(s_shape) < 2 or g1.row_dims != len(s_shape) - 1:
        return "scores not [.., M, N]"
    soft_nodes = [n for j in js for n in _nodes(specs[j])]
    parts = _softmax_parts(soft_nodes, s_val, s_shape, graph)
    if isinstance(parts, str):
        return parts
    prefix, x, nan_to_zero, p_val = parts
    leaving = {v for j in js for v in specs[j].outputs
               if v in graph.outputs or any(q not in js for q in readers.get(v, ()))}
    if leaving != {p_val} or p_val in graph.outputs:
        return "the softmax kernels store other values (or the probabilities are an output)"
    rk = readers.get(p_val, set())
    if len(rk) != 1:
        return "the probabilities are read twice"
    k = next(iter(rk))
    g2 = specs[k].gemm
    if (not isinstance(g2, GemmDesc) or g2.conv is not None or g2.a_value != p_val or g2.a_view is not None
            or g2.nodes or len(specs[k].outputs) != 1 or g2.batch != g1.batch or g2.m != g1.m
            or g2.k != g1.n or tuple(g2.a_index) != tuple(range(g2.batch)) or g2.b_value == p_val):
        return "p @ V is not a plain batched GEMM over the probabilities"
    out_val = specs[k].outputs[0]
    if types[out_val].dtype != "float32":
        return "result is not float32"
    # the score transform: the first GEMM's epilogue, then the softmax kernel's prefix
    nodes = (*g1.nodes, *prefix)
    inline = dict(g1.inline_consts)
    operands = list(g1.operands)
    have = {g1.head, *(n.outputs[0] for n in nodes), *inline, *(o.value for o in operands)}
    from ..codegen import loopir as L
    for v in dict.fromkeys(v for n in prefix for v in n.inputs):
        if v in have:
            continue
        c = _scalar(graph, v)
        if c is not None:
            inline[v] = L.Const(c, L.compute_dtype(types[v].dtype))
        else:
            operands.append(EpiOperand(v, types[v].dtype, tuple(types[v].shape)))
        have.add(v)
    q_val = g1.a_value or specs[i].nodes[0].inputs[0]
    k_val = g1.b_value or specs[i].nodes[0].inputs[1]
    desc = AttentionDesc(
        name="attn_" + "".join(ch if ch.isalnum() else "_" for ch in out_val)[:40],
        batch=g1.batch, m=g1.m, n=g1.n, dk=g1.k, dv=g2.n,
        q_index=tuple(g1.a_index), k_index=tuple(g1.b_index), v_index=tuple(g2.b_index),
        q_value=q_val, k_value=k_val, v_value=g2.b_value,
        q_size=_source_size(g1.a_view, g1.a_batches, g1.m, g1.k),
        k_size=_source_size(g1.b_view, max(g1.b_index) + 1, g1.k, g1.n),
        v_size=_source_size(g2.b_view, max(g2.b_index) + 1, g2.k, g2.n),
        head=g1.head, x=x, s_shape=s_shape, s_row_dims=len(s_shape) - 1,
        out_shape=tuple(g2.out_shape), out_row_dims=g2.row_dims, output=out_val,
        nodes=tuple(nodes), node_dtypes=tuple(types[n.outputs[0]].dtype for n in nodes),
        operands=tuple(operands), inline_consts=inline,
        q_view=g1.a_view, k_view=g1.b_view, v_view=g2.b_view, out_perm=g2.out_perm, nan_to_zero=nan_to_zero)
    if any(types[v].dtype != "float32" for v in (q_val, k_val, g2.b_value)):
        return "Q, K or V is not float32"
    all_nodes = (*specs[i].nodes, *soft_nodes, *specs[k].nodes)
    return js, k, desc, all_nodes


def fold_attention(specs: list, graph: Graph, options) -> list:
    """``specs`` with every attention triple (see the module docstring) replaced by one fused
    attention step at the position of its ``p @ V`` step; the step's reason names the spelling
    it matched.  Other steps are returned unchanged."""
    if getattr(options, "attention", "auto") == "unfused":
        return list(specs)
    from .steps import StepSpec
    specs = list(specs)
    readers = _producers_and_readers(specs)[1]
    gone = set()
    for i in range(len(specs)):
        if i in gone or specs[i].gemm is None:
            continue
        m = match(i, specs, readers, graph)
        if m is None or isinstance(m, str):
            continue
        js, k, d, nodes = m
        if k in gone or any(j in gone or not i < j < k for j in js):
            continue
        ins = tuple(dict.fromkeys([d.q_value, d.k_value, d.v_value, *(o.value for o in d.operands)]))
        spelling = " ".join(n.op for n in d.nodes) or "no score transform"
        why = (f"fused attention (generated; scores never stored); batch {d.batch}, {d.m} queries x {d.n} keys, "
               f"head dims {d.dk}/{d.dv}; score transform: {spelling}"
               + ("; NaN rows -> 0" if d.nan_to_zero else "")
               + (f"; stores its result transposed {tuple(d.out_perm)}" if d.out_perm is not None else ""))
        mgs = tuple(sorted(set(specs[i].micro_graphs).union(specs[k].micro_graphs, *(specs[j].micro_graphs for j in js))))
        specs[k] = StepSpec(ins, (d.output,), nodes=nodes, reason=why, micro_graphs=mgs, gemm=d)
        for v in ins:
            readers.setdefault(v, set()).add(k)
        gone |= {i, *js}
    specs = fold_attention_prologues([s for q, s in enumerate(specs) if q not in gone], graph)
    return fold_attention_views(specs, graph)


def _scaled_view(spec, graph: Graph):
    """``(source value, perm or None, scale)`` when kernel step ``spec`` computes only
    ``transpose(src, perm) * c`` (either order; ``c`` a scalar constant, also ``/ c``) or
    ``src * c``: BERT's scaled query and key heads.  None otherwise."""
    if spec.fused is None or len(spec.outputs) != 1:
        return None
    nodes = [n for n in spec.fused.nodes if n.op != "constant"]
    if not 1 <= len(nodes) <= 2:
        return None
    perm, scale, cur = None, None, None
    src = nodes[0].inputs[0] if nodes[0].op == "transpose" else None
    for n in nodes:
        if cur is not None and cur not in n.inputs:
            return None
        if n.op == "transpose" and perm is None:
            perm, cur = tuple(int(p) for p in n.attrs["perm"]), n.outputs[0]
        elif n.op in ("mul", "div") and scale is None and len(n.inputs) == 2:
            x, c = n.inputs if n.op == "div" or cur is None or n.inputs[0] == cur else n.inputs[::-1]
            if cur is not None and x != cur:
                return None
            v = _scalar(graph, c)
            if v is None or (n.op == "div" and v == 0.0):
                return None
            scale = v if n.op == "mul" else 1.0 / v
            if cur is None:
                src = x
            cur = n.outputs[0]
        else:
            return None
    if cur != spec.outputs[0] or scale is None or src is None:
        return None
    if graph.types[src].dtype != "float32":
        return None
    return src, perm, float(np.float32(scale))


def fold_attention_prologues(specs: list, graph: Graph) -> list:
    """``specs`` with the kernel that scales (and transposes) a fused attention's Q or K^T
    folded into its packing: the attention reads the unscaled source through a view and
    multiplies while packing (the same float32 product the kernel computed), and the kernel
    step is gone.  Only where the scaled value is read by that attention alone."""
    from ..codegen.attention import AttentionDesc
    from ..codegen.gemm_views import OperandView
    specs = list(specs)
    producer, readers = _producers_and_readers(specs)
    gone = set()
    for k, spec in enumerate(specs):
        d = spec.gemm
        if not isinstance(d, AttentionDesc):
            continue
        changed, dropped = {}, []
        for side in ("q", "k"):
            v = getattr(d, side + "_value")
            j = producer.get(v)
            if (j is None or j in gone or readers.get(v) != {k} or v in graph.outputs
                    or getattr(d, side + "_view") is not None or v in (d.v_value, *(o.value for o in d.operands))
                    or (side == "q" and d.k_value == v) or (side == "k" and d.q_value == v)):
                continue
            got = _scaled_view(specs[j], graph)
            if got is None:
                continue
            src, perm, scale = got
            shape = tuple(graph.types[src].shape)
            if perm is None:
                perm = tuple(range(len(shape)))
            view = OperandView.transposed(shape, perm)
            if view.shape != tuple(graph.types[v].shape):
                continue
            changed.update({side + "_value": src, side + "_view": view, side + "_scale": scale,
                            side + "_size": view.size})
            dropped.append(j)
        if not changed:
            continue
        d2 = replace(d, **changed)
        why = spec.reason + "; scales " + ", ".join(
            f"{side.upper()} by {getattr(d2, side + '_scale'):.6g} while packing" for side in ("q", "k")
            if side + "_value" in changed)
        _absorb(specs, k, d2, dropped, tuple(n for j in dropped for n in specs[j].fused.nodes), why,
                readers, gone)
    return [s for q, s in enumerate(specs) if q not in gone]


#: ops that only move elements (the exporters' head split / merge, GQA's ``repeat_kv``)
_MOVES = ("reshape", "transpose", "broadcast_to", "stop_gradient")
#: index maps are worked out on an int64 array of the source's size: bigger sources keep their steps
_MAX_VIEW_ELEMENTS = 1 << 24


def _moves_of(spec):
    """The nodes of step ``spec`` when it only moves the elements of its one input (reshape,
    transpose, broadcast, identity; numpy step or copy kernel), in order; else None."""
    if spec.gemm is not None or spec.blas is not None or len(spec.outputs) != 1:
        return None
    nodes = [n for n in _nodes(spec) if n.op != "constant"]
    if not nodes or len(spec.inputs) != 1:
        return None
    cur = spec.inputs[0]
    for n in nodes:
        if n.op not in _MOVES or len(n.inputs) != 1 or n.inputs[0] != cur or len(n.outputs) != 1:
            return None
        cur = n.outputs[0]
    return nodes if cur == spec.outputs[0] else None


def _moved_index(src_shape: tuple, nodes: list, graph: Graph):
    """For each element of the last node's result, its C-order index in the source (an int64
    array of the result's shape), or None when a node's shape disagrees."""
    x = np.arange(int(np.prod(src_shape, dtype=np.int64)), dtype=np.int64).reshape(src_shape)
    for n in nodes:
        shape = tuple(graph.types[n.outputs[0]].shape)
        if int(np.prod(shape, dtype=np.int64)) > _MAX_VIEW_ELEMENTS:    # a broadcast's result
            return None
        if n.op == "transpose":
            perm = n.attrs.get("perm")
            x = np.transpose(x, tuple(int(p) for p in perm) if perm is not None else None)
        elif n.op == "reshape":
            if int(np.prod(shape, dtype=np.int64)) != x.size:
                return None
            x = x.reshape(shape)
        elif n.op == "broadcast_to":
            try:
                x = np.broadcast_to(x, shape)
            except ValueError:
                return None
        if x.shape != shape:
            return None
    return x


def _batched_view(idx: np.ndarray, index: tuple, size: int):
    """``(OperandView, new index table)`` reading the ``[batch, rows, cols]`` matrices of
    ``idx`` (source positions) straight from the source: every matrix must be one strided
    block, and their offsets ``0, s, 2 s, ...`` (in any order, repeats allowed: GQA's repeated
    heads become index-table entries).  None when the positions are not of that form."""
    from ..codegen.gemm_views import OperandView
    nb, rows, cols = idx.shape
    sr = int(idx[0, 1, 0] - idx[0, 0, 0]) if rows > 1 else 0
    sc = int(idx[0, 0, 1] - idx[0, 0, 0]) if cols > 1 else 0
    offs = idx[:, 0, 0]
    if sr < 0 or sc < 0:
        return None
    want = offs[:, None, None] + np.arange(rows)[None, :, None] * sr + np.arange(cols)[None, None, :] * sc
    if not np.array_equal(idx, want):
        return None
    uniq = np.unique(offs)
    step = int(uniq[1] - uniq[0]) if len(uniq) > 1 else 0
    if uniq[0] != 0 or (len(uniq) > 1 and not np.array_equal(uniq, np.arange(len(uniq)) * step)):
        return None
    mat = offs // step if step else np.zeros_like(offs)
    view = OperandView((len(uniq), rows, cols), (step, sr, sc), size)
    return view, tuple(int(mat[b]) for b in index)


def fold_attention_views(specs: list, graph: Graph) -> list:
    """``specs`` with the steps that only move a fused attention's Q, K^T or V into place --
    the exporters' head split ``reshape -> transpose`` (copies where the transposed value is
    reshaped again, as the dynamo export's ``K^T``), GQA's ``repeat_kv`` (``broadcast_to`` of
    the key / value heads) -- folded into the attention: it reads their source through a
    strided view and an index table (repeated heads read the same matrix) instead.  A chain is
    folded only where its values are read by nothing else and the composed map is a strided
    view; anything else keeps its steps."""
    specs = list(specs)
    producer, readers = _producers_and_readers(specs)
    gone: set = set()
    from ..codegen.attention import AttentionDesc
    for k, spec in enumerate(specs):
        d = spec.gemm
        if not isinstance(d, AttentionDesc):
            continue
        changed, dropped = {}, []
        for side in ("q", "k", "v"):
            v = getattr(d, side + "_value")
            others = [getattr(d, o + "_value") for o in ("q", "k", "v") if o != side]
            if v in others or v in (o.value for o in d.operands):
                continue
            chain, nodes, cur, reader = [], [], v, k
            while True:
                j = producer.get(cur)
                if (j is None or j in gone or j in dropped or cur in graph.outputs
                        or readers.get(cur) != {reader}):
                    break
                moved = _moves_of(specs[j])
                if moved is None:
                    break
                chain.append(j)
                nodes = moved + nodes
                cur, reader = specs[j].inputs[0], j
            if not chain:
                continue
            src_shape = tuple(graph.types[cur].shape)
            if (graph.types[cur].dtype != "float32" or not src_shape
                    or int(np.prod(src_shape, dtype=np.int64)) > _MAX_VIEW_ELEMENTS):
                continue
            idx = _moved_index(src_shape, nodes, graph)
            if idx is None:
                continue
            old = getattr(d, side + "_view")
            if old is not None:     # the attention already reads the moved value through a view
                addr = sum(np.arange(n).reshape([-1 if q == a else 1 for q in range(len(old.shape))]) * st
                           for a, (n, st) in enumerate(zip(old.shape, old.strides)))
                idx = idx.reshape(-1)[addr]
            rows, cols = idx.shape[-2:]
            got = _batched_view(idx.reshape(-1, rows, cols), getattr(d, side + "_index"),
                                int(np.prod(src_shape, dtype=np.int64)))
            if got is None:
                continue
            view, index = got
            changed.update({side + "_value": cur, side + "_view": view, side + "_index": index,
                            side + "_size": view.size})
            dropped.extend(chain)
        if not changed:
            continue
        d2 = replace(d, **changed)
        why = spec.reason + f"; reads Q/K/V through views ({len(dropped)} moving steps folded)"
        _absorb(specs, k, d2, dropped, tuple(n for j in sorted(dropped) for n in _nodes(specs[j])), why,
                readers, gone)
    return [s for q, s in enumerate(specs) if q not in gone]
