"""Folding of the steps around a BLAS matmul into one ``?gemm`` call (runtime/blas.py).

Expects the StepSpec list of :func:`apollo_py.layers.lowering.lower_micro_graphs` and returns
an equivalent list in which every matmul that runs through numpy (``Options.gemm`` picked BLAS)
is a :class:`BlasDesc` step, with these neighbours folded into it:

* a 2-d ``transpose`` (perm (1, 0)) producing an operand that nothing else reads becomes the
  operand's ``trans`` flag (no copy);
* a 2-d ``transpose`` of the result that is the result's only reader swaps the operands,
  ``(A @ B)ᵀ = Bᵀ @ Aᵀ`` (no copy);
* a kernel that is exactly ``P - c * R`` or ``P + c * R`` (``c`` a scalar constant, ``R`` the
  result, read by nothing else, ``P`` of the result's shape and dtype) becomes ``alpha = ∓c``
  and ``beta = 1`` accumulating into the output initialised from ``P`` -- the SGD update
  ``W - lr * (Xᵀ @ dH)`` of a training step is one sgemm;
* a kernel that is exactly ``R + b`` with ``b`` broadcasting to ``R`` (a Linear layer's bias)
  becomes ``beta = 1`` into an output initialised with ``b`` broadcast.

A folded call runs at the position of the last step it absorbed (its operands are still live
there; its result was read by nothing in between).  Matmuls whose operands are not float32 or
float64, or whose ranks are not (N-d or 1-d) @ (2-d or 1-d), stay numpy steps, as does every
matmul when the runtime finds no cblas next to numpy (``blas_available``; the compiler asks
:func:`apollo_py.runtime.blas.cblas`).  The descriptor is defined here, the ctypes binding that
runs it (:class:`~apollo_py.runtime.blas.BlasStep`) in the runtime: a compile-time pass does
not load a shared library.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from ..ir.graph import Graph

_DTYPES = ("float32", "float64")


@dataclass(frozen=True)
class BlasDesc:
    """One folded BLAS call: ``out = alpha * op(a) @ op(b) (+ acc)``.

    ``a`` is stored ``[k, m]`` if ``trans_a`` else ``[m, k]`` (an N-d ``a`` without ``trans_a``
    is read as its flattened rows), ``b`` likewise ``[n, k]`` / ``[k, n]``; ``acc`` (a value broadcasting to
    the output's shape, or None) is added (``beta = 1``).  ``nodes`` are the graph nodes the
    call computes (the matmul plus any folded transposes and update ops).
    """

    a: str
    b: str
    trans_a: bool
    trans_b: bool
    m: int
    n: int
    k: int
    alpha: float
    acc: str | None
    out: str
    dtype: str
    nodes: tuple

    @property
    def inputs(self) -> tuple:
        return tuple(dict.fromkeys(v for v in (self.a, self.b, self.acc) if v is not None))

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k

    def formula(self) -> str:
        ta, tb = ("ᵀ" if self.trans_a else ""), ("ᵀ" if self.trans_b else "")
        core = f"{self.a}{ta} @ {self.b}{tb}"
        scale = abs(self.alpha) if self.acc else self.alpha
        if scale != 1.0:
            core = f"{scale:g} * {core}"
        if self.acc is None:
            return f"{self.out} = {core}"
        return f"{self.out} = {self.acc} {'-' if self.alpha < 0 else '+'} {core}"


def _nodes(spec) -> tuple:
    return spec.fused.nodes if spec.fused is not None else spec.nodes


def _transpose_of(spec, graph: Graph):
    """``(source, output)`` when ``spec`` is one 2-d transpose with perm (1, 0), else None."""
    if spec.gemm is not None or getattr(spec, "blas", None) is not None:
        return None
    nodes = [n for n in _nodes(spec) if n.op != "constant"]
    if len(nodes) != 1 or nodes[0].op != "transpose":
        return None
    n = nodes[0]
    if tuple(n.attrs["perm"]) != (1, 0) or len(graph.types[n.inputs[0]].shape) != 2:
        return None
    return n.inputs[0], n.outputs[0]


def _initial(spec, graph: Graph) -> BlasDesc | None:
    """The BlasDesc of a numpy matmul step, or None when it stays numpy."""
    if spec.fused is not None or spec.gemm is not None or len(spec.nodes) != 1:
        return None
    node = spec.nodes[0]
    if node.op != "matmul" or not spec.reason.startswith("matmul via numpy"):
        return None
    ta, tb, to = (graph.types[v] for v in (*node.inputs, node.outputs[0]))
    if not (ta.dtype == tb.dtype == to.dtype and to.dtype in _DTYPES):
        return None
    if len(tb.shape) > 2 or len(ta.shape) < 1:
        return None
    k = ta.shape[-1]
    m = int(np.prod(ta.shape[:-1], dtype=np.int64)) if len(ta.shape) > 1 else 1
    n = tb.shape[-1] if len(tb.shape) == 2 else 1
    if (tb.shape[0] if tb.shape else 0) != k:
        return None
    return BlasDesc(a=node.inputs[0], b=node.inputs[1], trans_a=False, trans_b=False, m=m, n=n, k=k,
                    alpha=1.0, acc=None, out=node.outputs[0], dtype=to.dtype, nodes=(node,))


def _update_of(spec, result: str, graph: Graph, consts: dict):
    """``(acc, sign * c, out)`` when kernel ``spec`` is exactly ``acc ∓ c * result``, else None.
    ``consts``: the graph's constant nodes by output value (layer 1 inlines scalar ones)."""
    if spec.fused is None:
        return None
    ops = [n for n in spec.fused.nodes if n.op != "constant"]
    if len(ops) == 1 and ops[0].op == "add" and result in ops[0].inputs:
        return _bias_of(spec, ops[0], result, graph)
    if len(ops) != 2 or ops[0].op != "mul" or ops[1].op not in ("sub", "add"):
        return None
    mul, upd = ops
    scale = [v for v in mul.inputs if v != result]
    if len(scale) != 1 or result not in mul.inputs or scale[0] not in consts:
        return None
    c = consts[scale[0]].attrs["value"].array
    if c.size != 1:
        return None
    if upd.op == "sub":
        if upd.inputs != (upd.inputs[0], mul.outputs[0]) or upd.inputs[0] == mul.outputs[0]:
            return None
        acc, sign = upd.inputs[0], -1.0
    else:
        others = [v for v in upd.inputs if v != mul.outputs[0]]
        if len(others) != 1:
            return None
        acc, sign = others[0], 1.0
    t_acc, t_out, t_res = (graph.types[v] for v in (acc, upd.outputs[0], result))
    if not (t_acc.shape == t_out.shape == t_res.shape and t_acc.dtype == t_out.dtype == t_res.dtype):
        return None
    if tuple(spec.outputs) != (upd.outputs[0],):
        return None
    return acc, sign * float(c.reshape(())), upd.outputs[0]


def _bias_of(spec, add, result: str, graph: Graph):
    """``(bias, 1.0, out)`` when kernel ``spec`` is exactly ``result + bias`` with ``bias``
    broadcasting to the result (a Linear layer's bias row), else None."""
    others = [v for v in add.inputs if v != result]
    if len(others) != 1 or tuple(spec.outputs) != (add.outputs[0],):
        return None
    bias = others[0]
    t_b, t_out, t_res = (graph.types[v] for v in (bias, add.outputs[0], result))
    if t_out.shape != t_res.shape or not (t_b.dtype == t_out.dtype == t_res.dtype):
        return None
    try:
        if np.broadcast_shapes(t_b.shape, t_res.shape) != tuple(t_res.shape):
            return None
    except ValueError:
        return None
    return bias, 1.0, add.outputs[0]


def fold_blas(specs: list, graph: Graph, blas_available: bool) -> list:
    """``specs`` with numpy matmuls turned into folded BLAS steps (see the module docs);
    ``specs`` unchanged when ``blas_available`` is false.  First, transposes feeding only a
    generated matmul GEMM are folded into it (gemm_lowering.fold_operand_transposes)."""
    from .gemm_lowering import fold_operand_transposes
    specs = fold_operand_transposes(specs, graph)
    if not blas_available:
        return list(specs)
    from .steps import StepSpec
    specs = list(specs)
    alive = [True] * len(specs)

    def readers(v: str) -> list[int]:
        return [i for i, s in enumerate(specs) if alive[i] and v in s.inputs]

    def only_reader(v: str, producer: int):
        """Index of the one live step reading ``v`` (after ``producer``), or None."""
        rs = readers(v)
        if v in graph.outputs or len(rs) != 1 or rs[0] <= producer:
            return None
        return rs[0]

    consts = {n.outputs[0]: n for n in graph.nodes if n.op == "constant"}
    producer = {}
    for i, s in enumerate(specs):
        for v in s.outputs:
            producer[v] = i
    for i, spec in enumerate(specs):
        d = _initial(spec, graph) if alive[i] and spec.blas is None else None
        if d is None:
            continue
        folded, mgs = list(d.nodes), list(spec.micro_graphs)
        # operand transposes -> trans flags (2-d operands only)
        for side in ("a", "b"):
            v = getattr(d, side)
            j = producer.get(v)
            if j is None or not alive[j] or len(graph.types[v].shape) != 2:
                continue
            t = _transpose_of(specs[j], graph)
            if t is None or only_reader(v, j) != i:
                continue
            flag = "trans_" + side
            d = replace(d, **{side: t[0], flag: not getattr(d, flag)})
            folded = [n for n in _nodes(specs[j]) if n.op == "transpose"] + folded
            mgs += specs[j].micro_graphs
            alive[j] = False
        at = i
        # a transpose of the result -> swapped operands
        j = only_reader(d.out, at)
        if j is not None and len(graph.types[d.out].shape) == 2:
            t = _transpose_of(specs[j], graph)
            if t is not None and t[0] == d.out:
                d = replace(d, a=d.b, b=d.a, trans_a=not d.trans_b, trans_b=not d.trans_a, m=d.n, n=d.m,
                            out=t[1])
                folded += [n for n in _nodes(specs[j]) if n.op == "transpose"]
                mgs += specs[j].micro_graphs
                alive[at] = False
                at = j
        # acc -/+ c * result, or result + bias -> alpha, beta = 1
        j = only_reader(d.out, at)
        if j is not None:
            u = _update_of(specs[j], d.out, graph, consts)
            if u is not None and u[0] not in (d.a, d.b):
                acc, alpha, out = u
                d = replace(d, acc=acc, alpha=d.alpha * alpha, out=out)
                folded += list(specs[j].fused.nodes)
                mgs += specs[j].micro_graphs
                alive[at] = False
                at = j
        reason = spec.reason.replace("matmul via numpy", "matmul via cblas", 1)
        specs[at] = StepSpec(d.inputs, (d.out,), nodes=tuple(folded), reason=reason,
                             micro_graphs=tuple(sorted(set(mgs))),
                             blas=replace(d, nodes=tuple(folded)))
        alive[at] = True
        producer[d.out] = at
    return [s for s, ok in zip(specs, alive) if ok]
