"""Lowering of a matmul/conv micro-graph to the generated GEMM (codegen/gemm.py) or BLAS.

:func:`gemm_spec` takes the head (``matmul`` or ``conv``) and the nodes after it in the
micro-graph, and returns either a StepSpec running the generated GEMM with the longest
fusable prefix of those nodes as its per-tile epilogue, or None with the reason BLAS (numpy)
runs the head instead.  The rest of the nodes go to layer 1 as before.

The dispatch rule for float32 matmul (``Options.gemm == "auto"``) comes from measurements on
the 2-core AVX-512 dev box (generated / numpy sgemm time ratio, median of 7 interleaved
samples of ~50 ms each).  Single thread: 64^3 0.23, 128^3 0.62, 256^3 0.76, 512^3 ~0.9,
1024^3 ~1.0, batched [8,128,64]@[8,64,128] 0.90.  Two threads on an idle machine (numpy's
OpenBLAS reaches 220-290 GFLOP/s there): 256^3 0.32, 512^3 0.48-0.65, [4096,64]@[64,64] 0.39,
[128,1024]@[1024,1024] 0.42-0.70, [2048,768]@[768,768] 0.45-0.62, 1024^3 0.55-0.93 (0.88 in
benchmarks/run.py).  Thin shapes lose badly ([1024,1024]@[1024,1] 0.06-0.12,
[4096,1024]@[1024,16] 0.21-0.41): the micro-tile is 12 x 32 and a thin side leaves most of it
empty.  So: the generated GEMM when every side of C is at least ``MIN_SIDE`` and the product
has at least ``MIN_FLOPS`` (2*1024^3) flops -- where it measured at 0.85-0.93 of sgemm, so the
fused epilogue (one memory pass saved) makes up the difference -- and BLAS plus a separate
epilogue kernel otherwise.  (Between 2*512^3 and 2*1024^3 it measured 0.45-0.7 of sgemm: the
MLP training step of issue #6 ran 10.1 ms with it against 5.7 ms with BLAS.)  On a loaded machine OpenBLAS's threads degrade far more than the pool's
dynamically claimed chunks (the generated GEMM then often wins), which the rule ignores.
A conv always runs as implicit GEMM (the only alternative is the float64 im2col oracle).
"""
from __future__ import annotations

from math import prod

from ..ir.graph import Graph, Node
from ..options import Options

MIN_SIDE = 32
MIN_FLOPS = 2 * 1024 ** 3

_NOT_EPILOGUE = {"iota", "broadcast_to"}


def _fusable(n: Node, types, shape: tuple, known: set) -> bool:
    from ..ops.registry import get_op
    if n.op == "constant":
        return False
    try:
        op = get_op(n.op)
    except Exception:   # noqa: BLE001 - unknown op: not an epilogue op
        return False
    if op.scalar is None or n.op in _NOT_EPILOGUE or len(n.outputs) != 1:
        return False
    if tuple(types[n.outputs[0]].shape) != shape:
        return False
    for v in n.inputs:
        if v in known:
            continue
        t = types[v]
        if len(t.shape) > len(shape):
            return False
    return True


def _reason_blas(head: Node, types, options: Options) -> str:
    """Why ``head`` runs through numpy ("" if the generated GEMM may run it)."""
    out = types[head.outputs[0]]
    if out.dtype != "float32" or any(types[v].dtype != "float32" for v in head.inputs):
        return f"{out.dtype} operands (the generated GEMM is float32 only)"
    if head.op == "conv":
        x, w = (types[v] for v in head.inputs)
        if len(x.shape) != 4:
            return f"{len(x.shape) - 2}-d conv (the implicit GEMM handles 2-d)"
        return ""
    if options.gemm == "blas":
        return "Options.gemm='blas'"
    if options.gemm == "generated":
        return ""
    xs, ys = (types[v].shape for v in head.inputs)
    n = 1 if len(ys) == 1 else ys[-1]
    k = xs[-1]
    rows = prod(out.shape) // max(1, n)
    if min(rows, n) < MIN_SIDE:
        return (f"C is {rows}x{n}: a side under {MIN_SIDE} leaves the 12x32 micro-tile mostly empty "
                "(measured 0.1-0.4x of sgemm)")
    if 2 * rows * n * k < MIN_FLOPS:
        return f"{2 * rows * n * k} flops < {MIN_FLOPS}: BLAS is faster on small products (measured)"
    return ""


def gemm_spec(head: Node, epilogue: list, graph: Graph, later: set, options: Options, group: tuple):
    """``(spec, rest, reason)``: the generated-GEMM StepSpec for ``head`` plus the fused prefix
    of ``epilogue`` (``rest`` = the nodes left for layer 1), or ``(None, epilogue, reason)``
    when BLAS runs the head, ``reason`` saying why."""
    from ..codegen.gemm import EpiOperand, conv_desc, matmul_desc
    from .lowering import StepSpec
    types = graph.types
    why = _reason_blas(head, types, options)
    if why:
        return None, list(epilogue), why
    shape = tuple(types[head.outputs[0]].shape)
    known = {head.outputs[0]}
    consts = {n.outputs[0]: n for n in graph.nodes if n.op == "constant"}
    fused = []
    for n in epilogue:
        if not _fusable(n, types, shape, known):
            break
        fused.append(n)
        known.add(n.outputs[0])
    rest = list(epilogue[len(fused):])
    from ..codegen import loopir as L
    inline, operands = {}, []
    for v in dict.fromkeys(v for n in fused for v in n.inputs if v not in known):
        c = consts.get(v)
        if c is not None and c.attrs["value"].array.size == 1:
            arr = c.attrs["value"].array
            inline[v] = L.Const(arr.reshape(()).item(), L.compute_dtype(str(arr.dtype)))
        else:
            operands.append(EpiOperand(v, types[v].dtype, tuple(types[v].shape)))
    reads = later | {v for n in rest for v in n.inputs}
    outs = tuple(v for v in [head.outputs[0], *(n.outputs[0] for n in fused)]
                 if v in reads or v in graph.outputs)
    name = "gemm_" + "".join(ch if ch.isalnum() else "_" for ch in head.outputs[0])[:40]
    epi = dict(nodes=tuple(fused), operands=tuple(operands), outputs=outs,
               out_dtypes=tuple(types[v].dtype for v in outs), inline_consts=inline,
               node_dtypes=tuple(types[n.outputs[0]].dtype for n in fused))
    x, w = head.inputs
    if head.op == "conv":
        desc = conv_desc(name, types[x].shape, types[w].shape, shape, head.attrs, head.outputs[0], **epi)
        what = "implicit-GEMM conv (generated)"
    else:
        desc = matmul_desc(name, types[x].shape, types[w].shape, shape, head.outputs[0], **epi)
        what = "generated GEMM"
        if options.gemm == "generated":
            what += " (Options.gemm='generated')"
        else:
            what += f" (C sides >= {MIN_SIDE} and >= {MIN_FLOPS} flops: measured >= 0.85x of sgemm, epilogue fused)"
    fused_ops = "+".join(n.op for n in fused) or "none"
    reason = f"{what}; batch {desc.batch}, {desc.m}x{desc.n}x{desc.k}; epilogue {fused_ops}"
    ins = tuple(dict.fromkeys([*head.inputs, *(o.value for o in operands)]))
    spec = StepSpec(ins, outs, nodes=(head, *fused), reason=reason, micro_graphs=tuple(group), gemm=desc)
    return spec, rest, ""
