"""Elementwise kernels behind a reshape of a generated GEMM's result, fused as its epilogue.

The dynamo exporter writes a linear layer as ``Gemm`` on the flattened ``[S, N]`` activation
followed by a ``Reshape`` back to ``[1, S, N]``; GPT-2's GELU (``0.5 x (1 + tanh(...))``) then
reads the reshaped value.  The reshape is an opaque micro-graph, so the partition cannot put
the GELU into the GEMM's micro-graph (rule 6): the GEMM stored its ``S x 4N`` result, a numpy
reshape made a view, and a layer-1 kernel on one thread read it back and wrote the GELU (12
such kernels in GPT-2, 2 ms of its 92 on one thread).

:func:`fold_reshaped_epilogues` rewrites the step list: a generated matmul GEMM without an
epilogue whose result is read only by a lone reshape (keeping the last dim), whose result is
read only by one layer-1 kernel of elementwise ops on that shape, becomes one GEMM step whose
epilogue is that kernel's chain, stored in the reshaped shape (``out_shape``: row-major
reshapes keep the flat order, so only the row split changes).  Epilogue operands broadcast
against the reshaped shape, as they did in the kernel.
"""
from __future__ import annotations

from dataclasses import replace

from ..ir.graph import Graph


def _lone_reshape(spec):
    if spec.fused is not None or spec.gemm is not None or spec.blas is not None or len(spec.nodes) != 1:
        return None
    n = spec.nodes[0]
    return n if n.op == "reshape" and len(n.outputs) == 1 else None


def fold_reshaped_epilogues(specs: list, graph: Graph) -> list:
    """``specs`` with every ``GEMM -> reshape -> elementwise kernel`` chain described in the
    module docstring replaced by one GEMM step (at the GEMM's position, so every operand of the
    chain must be computed before it)."""
    from ..codegen import loopir as L
    from ..codegen.gemm import EpiOperand, GemmDesc, _row_dims, plain_output
    from .gemm_lowering import _fusable
    from .steps import StepSpec
    types = graph.types
    consts = {n.outputs[0]: n for n in graph.nodes if n.op == "constant"}
    readers: dict = {}
    producer: dict = {}
    for i, sp in enumerate(specs):
        for v in dict.fromkeys(sp.inputs):
            readers.setdefault(v, []).append(i)
        for v in sp.outputs:
            producer[v] = i
    outs = set(graph.outputs)
    specs, gone = list(specs), set()
    for i, sp in enumerate(specs):
        d = sp.gemm
        if (type(d) is not GemmDesc or d.conv is not None or d.parts or not plain_output(d)
                or d.outputs[0] in outs or i in gone):
            continue
        rd = readers.get(d.outputs[0], [])
        if len(rd) != 1 or _lone_reshape(specs[rd[0]]) is None:
            continue
        ri = rd[0]
        r = specs[ri].outputs[0]
        shape = tuple(types[r].shape)
        if r in outs or shape[-1:] != (d.n,) or len(readers.get(r, [])) != 1:
            continue
        ei = readers[r][0]
        e = specs[ei]
        fk = e.fused
        if fk is None or getattr(fk, "phases", 0) or ei in gone:
            continue
        known, ok = {r}, True
        for n in fk.nodes:
            if not _fusable(n, types, shape, known):
                ok = False
                break
            known.add(n.outputs[0])
        if not ok or not fk.nodes or any(v not in known for v in e.outputs):
            continue
        inline, operands = {}, []
        for v in dict.fromkeys(v for n in fk.nodes for v in n.inputs if v not in known):
            c = consts.get(v)
            if c is not None and c.attrs["value"].array.size == 1:
                arr = c.attrs["value"].array
                inline[v] = L.Const(arr.reshape(()).item(), L.compute_dtype(str(arr.dtype)))
            elif c is not None or producer.get(v, -1) < i:
                operands.append(EpiOperand(v, types[v].dtype, tuple(types[v].shape)))
            else:
                ok = False      # computed after the GEMM's position
        if not ok:
            continue
        nodes = tuple(n.replace(inputs=tuple(d.head if x == r else x for x in n.inputs)) for n in fk.nodes)
        new = replace(d, nodes=nodes, operands=tuple(operands), outputs=tuple(e.outputs),
                      out_dtypes=tuple(types[v].dtype for v in e.outputs), inline_consts=inline,
                      node_dtypes=tuple(types[n.outputs[0]].dtype for n in nodes),
                      out_shape=shape, row_dims=_row_dims(shape, d.n))
        ins = tuple(dict.fromkeys([*sp.inputs, *(o.value for o in operands)]))
        ops = "+".join(n.op for n in nodes)
        specs[i] = StepSpec(ins, tuple(e.outputs), nodes=(*sp.nodes, *specs[ri].nodes, *fk.nodes),
                            reason=f"{sp.reason[:sp.reason.rfind('; epilogue')]}; epilogue {ops} "
                                   f"(through the reshape to {list(shape)})",
                            micro_graphs=tuple(sorted({*sp.micro_graphs, *specs[ri].micro_graphs, *e.micro_graphs})),
                            gemm=new, const_inputs=sp.const_inputs)
        gone.update((ri, ei))
    return [sp for i, sp in enumerate(specs) if i not in gone]
