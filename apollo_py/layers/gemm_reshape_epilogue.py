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
from math import prod

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


# ------------------------------------------------------------------ depth-to-space stores

#: switch for A/B measurements in one process (benchmarks): off, a GEMM's result goes through
#: its reshape -> transpose -> reshape steps (a copy kernel) as before.  The lowered step list
#: is cached per model file: compare with two cache directories.
SUBPIXEL_STORES = True


def _refine(o: tuple, coarse: tuple, fine: tuple):
    """Operand shape ``o`` (right-aligned to ``coarse``) in the dims of ``fine``, a reshape of
    ``coarse`` that only splits its dims (unit dims anywhere): each dim of ``o`` must be 1 or the
    whole dim.  None when ``fine`` does not refine ``coarse`` or ``o`` is cut inside a dim."""
    o = (1,) * (len(coarse) - len(o)) + tuple(o)
    if len(o) != len(coarse):
        return None
    big = [j for j, f in enumerate(fine) if f > 1]
    out, j = [1] * len(fine), 0
    for i, c in enumerate(coarse):
        if c == 1:
            continue
        grp, p = [], 1
        while p < c and j < len(big):
            p *= fine[big[j]]
            grp.append(big[j])
            j += 1
        if p != c or o[i] not in (1, c):
            return None
        for f in grp:
            out[f] = fine[f] if o[i] == c else 1
    return tuple(out) if j == len(big) else None


def _unpermute(o: tuple, perm: tuple):
    """Operand shape ``o`` of ``transpose(S, perm)``'s dims as a shape of S's dims, when its
    memory (C order) is also that shape's: the dims it does not broadcast keep their order."""
    big = [t for t, s in enumerate(o) if s > 1]
    if any(perm[a] > perm[b] for a, b in zip(big, big[1:])):
        return None
    out = [1] * len(o)
    for t in big:
        out[perm[t]] = o[t]
    return tuple(out)


def fold_subpixel_stores(specs: list, graph: Graph) -> list:
    """``specs`` with every generated GEMM (a matmul or a conv, e.g. ConvTranspose's 1x1 conv
    with kernel == stride, ops/compound_conv.py, or the product before a DepthToSpace) whose one
    result only a lone reshape step reads, whose result only a lone transpose step reads
    (optionally followed by a lone reshape step only it feeds), where the reshape splits C's rows
    and columns at the same boundary and the transpose has the depth-to-space form of
    codegen/gemm_subpixel.py (:func:`~apollo_py.codegen.gemm_subpixel.subpixel_form`): the GEMM
    stores straight into the transposed (and reshaped) layout, and those steps -- two numpy
    reshapes and a copy kernel -- are gone.  Its epilogue operands (a bias) must be expressible
    in the split shape.  A layer-1 kernel of elementwise ops that alone reads the stored value
    (a ReLU after the ConvTranspose) then becomes part of the epilogue when its operands are
    constants, scalars or broadcasts whose memory order the transpose keeps (a per-channel
    scale).  Other layouts, and everything on CUDA, stay as they were."""
    if not SUBPIXEL_STORES:
        return list(specs)
    from ..codegen.gemm import GemmDesc
    from ..codegen.gemm_subpixel import subpixel_form
    from .gemm_lowering import _lone_transpose
    types = graph.types
    readers: dict = {}
    for i, sp in enumerate(specs):
        for v in dict.fromkeys(sp.inputs):
            readers.setdefault(v, []).append(i)
    outs = set(graph.outputs)

    def only(v, after):
        """The step reading ``v`` alone (after step ``after``), or None."""
        rd = readers.get(v, [])
        return rd[0] if len(rd) == 1 and rd[0] > after and v not in outs else None

    specs, gone = list(specs), set()
    for i, sp in enumerate(specs):
        d = sp.gemm
        if (type(d) is not GemmDesc or d.parts or d.out_perm is not None or d.stored_as or len(d.outputs) != 1
                or tuple(sp.outputs) != d.outputs or i in gone):
            continue
        chain, j = [], i
        for op in ("reshape", "transpose", "reshape"):
            k = only((chain[-1].outputs[0] if chain else d.outputs[0]), j)
            n = _lone_transpose(specs[k], op) if k is not None and k not in gone else None
            if n is None or n.inputs[0] != (chain[-1].outputs[0] if chain else d.outputs[0]):
                break
            chain.append(n)
            j = k
        if len(chain) < 2 or chain[1].op != "transpose":
            continue
        split = tuple(types[chain[0].outputs[0]].shape)
        perm = tuple(int(p) for p in chain[1].attrs["perm"])
        rows, cols = prod(d.out_shape[:d.row_dims]), prod(d.out_shape[d.row_dims:])
        rd = next((q for q in range(len(split) + 1) if prod(split[:q]) == rows and prod(split[q:]) == cols), None)
        form = subpixel_form(split, rd, perm) if rd is not None else None
        # G == 1 (no interleave) only after a conv: a matmul's head split (BERT's reshape ->
        # transpose read by one kernel or the attention) is fold_operand_transposes' business
        if form is None or (form[0] == 1 and d.conv is None):
            continue
        opshapes = [_refine(o.shape, d.out_shape, split) for o in d.operands]
        if any(s is None for s in opshapes):
            continue
        final = chain[-1].outputs[0]
        new = replace(d, out_shape=split, row_dims=rd, out_perm=perm, stored_as=(final,),
                      operands=tuple(replace(o, shape=s) for o, s in zip(d.operands, opshapes)),
                      stored_reshape=tuple(types[final].shape) if len(chain) == 3 else None)
        steps = [readers[v][0] for v in (d.outputs[0], *(n.outputs[0] for n in chain[:-1]))]
        nodes, mgs, ins = (*sp.nodes, *chain), {*sp.micro_graphs}, tuple(sp.inputs)
        for k in steps:
            mgs.update(specs[k].micro_graphs)
        gone.update(steps)
        why = f"; stores its result depth-to-space (transpose {perm} of {list(split)})"
        e = only(final, j)
        ep = _epilogue_after(new, specs[e], chain, graph, i, specs) if e is not None and e not in gone else None
        if ep is not None:
            new, more = ep
            nodes += tuple(specs[e].fused.nodes)
            mgs.update(specs[e].micro_graphs)
            ins = tuple(dict.fromkeys([*ins, *more]))
            why += f", then {'+'.join(n.op for n in specs[e].fused.nodes)}"
            gone.add(e)
        specs[i] = replace(sp, inputs=ins, outputs=new.stored_as or new.outputs, nodes=nodes, gemm=new,
                           reason=sp.reason + why, micro_graphs=tuple(sorted(mgs)))
        for v in ins:
            readers.setdefault(v, []).append(i)
    return [sp for i, sp in enumerate(specs) if i not in gone]


def _epilogue_after(d, e, chain: list, graph: Graph, at: int, specs: list):
    """``(desc, operand values)``: GEMM ``d`` (stored depth-to-space as ``chain`` says) with the
    elementwise layer-1 kernel ``e`` that reads its stored value appended to its epilogue, or
    None when ``e`` is not such a kernel or an operand cannot be read in C's coordinates."""
    from ..codegen import loopir as L
    from ..codegen.gemm import EpiOperand
    from .gemm_lowering import _fusable
    fk = e.fused
    if fk is None or getattr(fk, "phases", 0) or not fk.nodes:
        return None
    types = graph.types
    final = chain[-1].outputs[0]
    fshape = tuple(types[final].shape)
    tshape = tuple(types[chain[1].outputs[0]].shape)
    perm = tuple(int(p) for p in chain[1].attrs["perm"])
    known = {final}
    for n in fk.nodes:
        if not _fusable(n, types, fshape, known):
            return None
        known.add(n.outputs[0])
    if any(v not in known for v in e.outputs):
        return None
    consts = {n.outputs[0]: n for n in graph.nodes if n.op == "constant"}
    producer = {v: k for k, s in enumerate(specs) for v in s.outputs}
    inline, operands = dict(d.inline_consts), list(d.operands)
    for v in dict.fromkeys(v for n in fk.nodes for v in n.inputs if v not in known):
        c = consts.get(v)
        if c is not None and c.attrs["value"].array.size == 1:
            arr = c.attrs["value"].array
            inline[v] = L.Const(arr.reshape(()).item(), L.compute_dtype(str(arr.dtype)))
            continue
        if c is None and producer.get(v, -1) >= at:
            return None         # computed after the GEMM's position
        t = _refine(tuple(types[v].shape), fshape, tshape) if len(chain) == 3 else \
            (1,) * (len(tshape) - len(types[v].shape)) + tuple(types[v].shape)
        s = _unpermute(t, perm) if t is not None and len(t) == len(tshape) else None
        if s is None:
            return None
        operands.append(EpiOperand(v, types[v].dtype, s))
    last = d.outputs[0]
    nodes = tuple(n.replace(inputs=tuple(last if x == final else x for x in n.inputs)) for n in fk.nodes)
    new = replace(d, nodes=(*d.nodes, *nodes), operands=tuple(operands), outputs=tuple(e.outputs), stored_as=(),
                  out_dtypes=tuple(types[v].dtype for v in e.outputs), inline_consts=inline,
                  node_dtypes=(*d.node_dtypes, *(types[n.outputs[0]].dtype for n in nodes)))
    return new, tuple(o.value for o in operands[len(d.operands):])
