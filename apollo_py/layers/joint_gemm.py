"""Joint projections: generated GEMMs with constant weights that read one activation run as one
GEMM over the weights concatenated along N (codegen/gemm.py, ``GemmDesc.parts``).

Attention's Q, K and V projections read the same activation through three products with
constant weights of the same K, and a gated MLP's gate and up projections through two.  Every
exporter spells them differently (``MatMul`` + ``Add``, ``Gemm`` with ``transB``, a scale folded
into Q, GQA's narrower K / V), but after lowering, BLAS folding and
``fold_operand_transposes`` each is one generated-GEMM step whose desc says all that matters:
the A value (and the view it is read through), ``m x k``, a constant B, an epilogue.
:func:`join_projections` replaces every set of such steps that share A by one step: a GEMM of
width ``sum(n)`` over a new constant ``concat(B_1, ..., B_p, axis=-1)`` whose ``parts`` keep
each product's epilogue, outputs and output layout for its column segment.  One dispatch
instead of ``p`` (each a pool wake-up and a tail where one thread waits for the other's last
tile), and a wider product that the parallel split cuts into squarer tiles (BERT-base: three
128 x 768 x 768 products at 355 GFLOP/s against 430 for the 128 x 3072 x 768 one on the same
box, docs/design/gemm.md).

Legality: the joint step runs at the position of the first member, so every other member's
epilogue operands must be computed before it (or be constants / graph inputs); a member whose
operand is computed later stays alone.  Segments must start at a multiple of the micro-tile's
``NR`` columns (a tile then belongs to one segment): a member of another width goes last, and a
second such member stays alone.  Matched by structure (the descs), never by value names.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..ir.graph import Graph, Node


def _candidate(spec, consts: dict):
    """The GemmDesc of ``spec`` when it may join others: a plain generated matmul GEMM (no
    conv, no batch, not already joint) with a constant float32 right operand."""
    from ..codegen.gemm import GemmDesc
    d = spec.gemm
    if type(d) is not GemmDesc or d.conv is not None or d.parts or d.batch != 1 or not d.b_const:
        return None
    if not d.a_value or d.a_value == d.b_value or d.b_value not in consts:
        return None
    if consts[d.b_value].dtype != np.float32:
        return None
    return d


def _logical_b(d, arr: np.ndarray) -> np.ndarray:
    """The ``[k, n]`` matrix the GEMM reads as B from constant ``arr`` (through its view)."""
    flat = np.ascontiguousarray(arr).reshape(-1)
    if d.b_view is None:
        return flat[:d.k * d.n].reshape(d.k, d.n)
    v = d.b_view
    m = np.lib.stride_tricks.as_strided(flat, v.shape, tuple(s * flat.itemsize for s in v.strides))
    return np.ascontiguousarray(m).reshape(d.k, d.n)


def _groups(specs: list, consts: dict, nr: int, producer: dict) -> list:
    """Lists of step indices (in step order) that may run as one joint GEMM."""
    by_a: dict = {}
    for i, s in enumerate(specs):
        d = _candidate(s, consts)
        if d is not None:
            key = (d.a_value, d.a_view, d.m, d.k, tuple(d.a_index))
            by_a.setdefault(key, []).append(i)
    out = []
    for members in by_a.values():
        if len(members) < 2:
            continue
        first = members[0]
        # every member's epilogue operands must be ready where the joint step runs (the first
        # member's position); the first member's own are
        ok = [i for i in members
              if all(producer.get(o.value, -1) < first for o in specs[i].gemm.operands)]
        wide = [i for i in ok if specs[i].gemm.n % nr == 0]
        odd = [i for i in ok if specs[i].gemm.n % nr]
        group = wide + odd[:1]       # one segment of another width, last
        if len(group) >= 2 and first in group:
            out.append(group)
    return out


def join_projections(specs: list, graph: Graph, options) -> tuple[list, Graph]:
    """``(specs, graph)`` with every set of generated GEMM steps that read one activation
    through constant weights (see the module docstring) replaced by one joint GEMM step at the
    position of the first; ``graph`` gains the concatenated weights as constants.  Returns the
    inputs unchanged when ``options.joint_gemm`` is False or nothing joins."""
    if not getattr(options, "joint_gemm", True):
        return list(specs), graph
    from ..codegen.gemm import blocking_for
    specs = split_projections(list(specs), graph, blocking_for(1 << 20, 1 << 20).nr)
    from ..ir.graph import ConstArray
    from ..ir.types import TensorType
    from .steps import StepSpec
    consts = {n.outputs[0]: n.attrs["value"].array for n in graph.nodes if n.op == "constant"}
    specs = list(specs)
    producer = {v: i for i, s in enumerate(specs) for v in s.outputs}
    groups = _groups(specs, consts, blocking_for(1 << 20, 1 << 20).nr, producer)
    if not groups:
        return specs, graph
    new_nodes, types, gone = [], dict(graph.types), set()
    for group in groups:
        ds = [specs[i].gemm for i in group]
        d0 = ds[0]
        name = _fresh(f"{d0.b_value}_joint", types)
        w = np.concatenate([_logical_b(d, consts[d.b_value]) for d in ds], axis=1)
        new_nodes.append(Node("constant", (), (name,), {"value": ConstArray(w)}, name=name))
        types[name] = TensorType(w.shape, "float32")
        parts = tuple(replace(d, a_value="", b_value="", a_view=None, b_view=None, b_const=False) for d in ds)
        n = sum(d.n for d in ds)
        joint = replace(
            d0, name="gemm_joint_" + d0.name[len("gemm_"):], n=n, out_shape=(d0.m, n), row_dims=1, head="",
            nodes=(), operands=tuple(o for d in ds for o in d.operands),
            outputs=tuple(v for d in ds for v in d.outputs), out_dtypes=tuple(t for d in ds for t in d.out_dtypes),
            node_dtypes=(), inline_consts={}, b_value=name, b_view=None, out_perm=None,
            stored_as=tuple(v for d in ds for v in (d.stored_as or d.outputs)), parts=parts)
        members = [specs[i] for i in group]
        ins = tuple(dict.fromkeys([joint.a_value, name, *(o.value for o in joint.operands)]))
        widths = " + ".join(str(d.n) for d in ds)
        epis = " | ".join("+".join(nd.op for nd in d.nodes) or "none" for d in ds)
        why = (f"generated GEMM, joint projections: {len(ds)} products with constant weights read "
               f"{joint.a_value} (one GEMM over the weights concatenated, N = {widths}); batch 1, "
               f"{joint.m}x{n}x{joint.k}; epilogues {epis}")
        mgs = tuple(sorted(set().union(*(s.micro_graphs for s in members))))
        specs[group[0]] = StepSpec(ins, joint.stored_as, nodes=tuple(nd for s in members for nd in s.nodes),
                                   reason=why, micro_graphs=mgs, gemm=joint, const_inputs=(name,))
        gone.update(group[1:])
    graph = graph.replace(nodes=(*graph.nodes, *new_nodes), types=types)
    return [s for i, s in enumerate(specs) if i not in gone], graph


def _fresh(base: str, taken) -> str:
    name, q = base, 0
    while name in taken:
        q += 1
        name = f"{base}{q}"
    return name


def _lone(spec, op: str):
    """The node of ``spec`` when it is a numpy step of one ``op`` node, else None."""
    if spec.fused is not None or spec.gemm is not None or spec.blas is not None or len(spec.nodes) != 1:
        return None
    n = spec.nodes[0]
    return n if n.op == op and len(n.inputs) == 1 and len(n.outputs) == 1 else None


def _column_slice(spec, src: str, shape: tuple):
    """``(first column, end column)`` when ``spec`` is a numpy step slicing ``src`` (of
    ``shape``) along its last axis only, with step 1; else None."""
    n = _lone(spec, "slice")
    if n is None or n.inputs[0] != src:
        return None
    a = n.attrs
    starts, ends, steps = tuple(a["starts"]), tuple(a["ends"]), tuple(a["steps"])
    if len(starts) != len(shape) or any(st != 1 for st in steps):
        return None
    for d in range(len(shape) - 1):
        if starts[d] != 0 or ends[d] is None or ends[d] < shape[d]:
            return None
    lo, hi = starts[-1], min(shape[-1], ends[-1] if ends[-1] is not None else shape[-1])
    return (lo, hi) if 0 <= lo < hi else None


def split_projections(specs: list, graph: Graph, nr: int) -> list:
    """``specs`` with every plain generated GEMM whose result (or a lone reshape of it keeping
    the last dim) is read only by numpy steps that slice it along the last axis into pieces
    covering its columns -- GPT-2's ``Gemm -> Reshape -> Split`` of Q, K and V -- replaced by
    one joint GEMM (``GemmDesc.parts``) whose column segments are stored straight into the
    slices' results: the reshape and the slice copies (three 128 x 768 copies per layer)
    vanish, the product and its weight stay as they were.  Each piece must start at a
    multiple of the micro-tile's ``nr`` columns (a tile belongs to one segment)."""
    from ..codegen.gemm import GemmDesc, _row_dims, plain_output
    from .steps import StepSpec
    readers: dict = {}
    for i, sp in enumerate(specs):
        for v in dict.fromkeys(sp.inputs):
            readers.setdefault(v, []).append(i)
    outs = set(graph.outputs)
    gone: set = set()
    for i, sp in enumerate(specs):
        d = sp.gemm
        if (type(d) is not GemmDesc or d.conv is not None or d.parts or d.batch != 1 or not plain_output(d)
                or d.outputs[0] in outs):
            continue
        src, extra = d.outputs[0], []
        rd = readers.get(src, [])
        if len(rd) == 1 and _lone(specs[rd[0]], "reshape") is not None:
            r = specs[rd[0]].outputs[0]
            if r in outs or tuple(graph.types[r].shape)[-1:] != (d.n,):
                continue
            src, extra = r, [rd[0]]
            rd = readers.get(src, [])
        shape = tuple(graph.types[src].shape)
        cuts = [_column_slice(specs[j], src, shape) for j in rd]
        if len(rd) < 2 or any(c is None for c in cuts):
            continue
        order = sorted(zip(cuts, rd))
        col = 0
        for (lo, hi), _ in order:
            if lo != col or lo % nr:
                break
            col = hi
        else:
            col = -col
        if col != -d.n:
            continue
        parts, names = [], []
        for (lo, hi), j in order:
            o = specs[j].outputs[0]
            oshape = tuple(graph.types[o].shape)
            parts.append(replace(d, a_value="", b_value="", a_view=None, b_view=None, b_const=False, n=hi - lo,
                                 out_shape=oshape, row_dims=_row_dims(oshape, hi - lo), stored_as=(o,)))
            names.append(o)
        joint = replace(d, name="gemm_split_" + d.name[len("gemm_"):], outputs=tuple(p.outputs[0] for p in parts),
                        out_dtypes=tuple(p.out_dtypes[0] for p in parts), stored_as=tuple(names),
                        parts=tuple(parts))
        members = [sp, *(specs[j] for j in extra), *(specs[j] for _, j in order)]
        widths = " + ".join(str(p.n) for p in parts)
        specs[i] = StepSpec(sp.inputs, tuple(names), nodes=tuple(nd for m in members for nd in m.nodes),
                            reason=f"{sp.reason}; split into the column slices {', '.join(names)} "
                                   f"(N = {widths}), each stored in its own buffer",
                            micro_graphs=tuple(sorted(set().union(*(m.micro_graphs for m in members)))),
                            gemm=joint, const_inputs=sp.const_inputs)
        gone.update(extra)
        gone.update(j for _, j in order)
    return [sp for i, sp in enumerate(specs) if i not in gone]
