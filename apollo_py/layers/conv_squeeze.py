"""The squeeze of a squeeze-excitation block fused into the direct conv that produces its input.

MobileNetV3 / EfficientNet blocks compute ``a = act(dwconv(x) + b)`` and then the global
average pool ``s = reduce_sum(a, axes=(2, 3)) / (H * W)`` of the same ``a``.  The partitioner
puts the bias add and the activation into the reduction's micro-graph (rules 1, 3, 5), so
without this pass the depthwise conv stores its raw output, and a layer-1 reduction kernel
reads it back, applies the activation, stores ``a`` and sums each plane (0.1-0.55 ms per block
in EfficientNet-B0, 2.7 GB/s: the activation's ``exp`` ran scalar inside the reduction loop).

:func:`fuse_squeeze` folds the reduction group into the conv step instead: the elementwise
chain becomes the direct kernel's epilogue (vectorised with the conv), and after each output
plane is written the kernel sums the plane's stored ``a`` (still in cache) into one value per
(image, channel), applies the row-space tail (the ``div`` of the mean) and stores it.  One
kernel and one pass over ``a`` fewer per block.

Expects the head of a lone conv micro-graph group with its epilogue nodes, and the next group's
nodes; returns a StepSpec or None (then the groups lower as before).
"""
from __future__ import annotations

from dataclasses import replace
from math import prod

from ..ir.graph import Graph, Node
from ..options import Options

#: switch for A/B runs in one process (benchmarks): :func:`excite_in_place`
EXCITE_IN_PLACE = True


def _split(nodes: list, conv_shape: tuple, types):
    """``(chain, reduce node, tail)`` of a reduction group ``chain -> reduce_sum over H, W ->
    tail``, or None when the group has another form."""
    reds = [k for k, n in enumerate(nodes) if n.op.startswith("reduce_")]
    if len(reds) != 1 or nodes[reds[0]].op != "reduce_sum":
        return None
    r = nodes[reds[0]]
    if tuple(r.attrs["axes"]) != (2, 3) or tuple(types[r.inputs[0]].shape) != conv_shape:
        return None
    if types[r.inputs[0]].dtype != "float32":
        return None
    return nodes[:reds[0]], r, nodes[reds[0] + 1:]


def _tail_ok(tail: list, r: Node, graph: Graph, consts: dict) -> bool:
    """Every tail node is an elementwise op with a scalar lowering on row-space values (the
    reduction's or an earlier tail node's, same element count) and scalar constants."""
    from ..ops.registry import get_op
    from ..errors import UnsupportedOpError
    types = graph.types
    rows = prod(types[r.outputs[0]].shape)
    known = {r.outputs[0]}
    for n in tail:
        try:
            op = get_op(n.op)
        except UnsupportedOpError:
            return False
        if op.scalar is None or len(n.outputs) != 1 or prod(types[n.outputs[0]].shape) != rows:
            return False
        for v in n.inputs:
            c = consts.get(v)
            if v not in known and (c is None or c.attrs["value"].array.size != 1):
                return False
        known.add(n.outputs[0])
    return True


def _conv_head_parts(head: Node, nxt: list, types):
    """``(output shape, _split of the next group)`` when ``head`` is a conv with a 4-d output and
    a next group; ``(None, None)`` otherwise."""
    if head.op != "conv" or not nxt:
        return None, None
    shape = tuple(types[head.outputs[0]].shape)
    if len(shape) != 4:
        return None, None
    return shape, _split(list(nxt), shape, types)


def fuse_squeeze(head: Node, epilogue: list, nxt: list, graph: Graph, later: set, options: Options,
                 group: tuple):
    """One direct-conv StepSpec computing ``head``, ``epilogue``, and the next group ``nxt``
    (``chain -> reduce_sum over axes (2, 3) -> tail``), or None.  ``later``: values read after
    the next group; ``group``: both groups' micro-graph indices."""
    from ..codegen.conv_block import block_form
    from ..codegen.conv_direct import DirectConvDesc, Squeeze, is_matvec
    from .gemm_lowering import gemm_spec
    types = graph.types
    shape, parts = _conv_head_parts(head, nxt, types)
    if parts is None:
        return None
    chain, r, tail = parts
    consts = {n.outputs[0]: n for n in graph.nodes if n.op == "constant"}
    if not _tail_ok(tail, r, graph, consts):
        return None
    # the reduced value is stored (the squeeze re-reads it) even when nothing later reads it
    spec, rest, _ = gemm_spec(head, [*epilogue, *chain], graph, later | {r.inputs[0]}, options, group)
    if spec is None or rest or not isinstance(spec.gemm, DirectConvDesc) or is_matvec(spec.gemm.conv) \
            or block_form(spec.gemm.conv, spec.gemm.cout):
        return None
    d = spec.gemm
    if r.inputs[0] not in d.outputs:
        return None
    row_vals = [r.outputs[0], *(n.outputs[0] for n in tail)]
    stored = tuple(v for v in row_vals if v in later or v in graph.outputs)
    if not stored:
        return None
    from ..codegen import loopir as L
    inline = {}
    for n in tail:
        for v in n.inputs:
            if v in consts:
                arr = consts[v].attrs["value"].array
                inline[v] = L.Const(arr.reshape(()).item(), L.compute_dtype(str(arr.dtype)))
    sq = Squeeze(value=r.inputs[0], reduce=r.outputs[0], nodes=tuple(tail), outputs=stored,
                 out_dtypes=tuple(types[v].dtype for v in stored),
                 out_shapes=tuple(tuple(types[v].shape) for v in stored),
                 node_dtypes=tuple(types[n.outputs[0]].dtype for n in tail), inline_consts=inline)
    d = replace(d, squeeze=sq)
    why = (f"{spec.reason}; squeeze {'+'.join(['reduce_sum', *(n.op for n in tail)])} over H*W fused "
           "(each output plane summed after it is written)")
    return replace(spec, outputs=(*spec.outputs, *stored), nodes=(*spec.nodes, r, *tail), reason=why,
                   micro_graphs=tuple(group), gemm=d)


def fuse_excite(head: Node, epilogue: list, nxt: list, graph: Graph, later: set, options: Options,
                group: tuple):
    """One matrix-vector conv StepSpec computing ``head``, ``epilogue`` (the gate: a Sigmoid or
    HardSigmoid) and the next group's lone ``mul`` of the gate (``(N, C, 1, 1)``) with a
    ``(N, C, H, W)`` value -- the excitation -- or None.  The excitation then runs in the
    product's parallel loop (each output channel scales its plane right after its dot product)
    instead of as a kernel of its own: one launch fewer per block."""
    from ..codegen.conv_direct import DirectConvDesc, Excite, is_matvec
    from ..codegen.gemm import EpiOperand
    from .gemm_lowering import gemm_spec
    types = graph.types
    if head.op != "conv" or len(nxt) != 1 or nxt[0].op != "mul":
        return None
    m = nxt[0]
    gate = (epilogue[-1] if epilogue else head).outputs[0]
    if list(m.inputs).count(gate) != 1:
        return None
    a = m.inputs[1] if m.inputs[0] == gate else m.inputs[0]
    if a in {head.outputs[0], *(n.outputs[0] for n in epilogue)}:      # a SiLU's own mul, not an excitation
        return None
    gt, at, ot = types[gate], types[a], types[m.outputs[0]]
    if (len(at.shape) != 4 or prod(at.shape[2:]) <= 1 or tuple(gt.shape) != (at.shape[0], at.shape[1], 1, 1)
            or tuple(ot.shape) != tuple(at.shape)):
        return None
    if {gt.dtype, at.dtype, ot.dtype} != {"float32"}:
        return None
    spec, rest, _ = gemm_spec(head, list(epilogue), graph, later, options, group)
    if spec is None or rest or not isinstance(spec.gemm, DirectConvDesc) or not is_matvec(spec.gemm.conv):
        return None
    d = spec.gemm
    if d.squeeze is not None or d.cout != at.shape[1] or d.conv.n != at.shape[0]:
        return None
    ops = d.operands if any(o.value == a for o in d.operands) else \
        (*d.operands, EpiOperand(a, at.dtype, tuple(at.shape)))
    d = replace(d, operands=tuple(ops), excite=Excite(gate, a, m.outputs[0], tuple(at.shape)))
    ins = tuple(dict.fromkeys([*spec.inputs, a]))
    why = f"{spec.reason}; excitation mul fused (each channel's plane scaled after its dot product)"
    return replace(spec, inputs=ins, outputs=(*spec.outputs, m.outputs[0]), nodes=(*spec.nodes, m), reason=why,
                   micro_graphs=tuple(group), gemm=d)


def fuse_squeeze_chain(head: Node, epilogue: list, nxt: list, graph: Graph, later: set, options: Options,
                       group: tuple):
    """``(spec, rest)`` for a conv that is not a direct conv (implicit GEMM or row-reading conv)
    followed by a squeeze group ``chain -> reduce_sum over axes (2, 3) -> tail``: the GEMM step
    with the elementwise ``chain`` (the bias add and activation the partitioner put into the
    reduction's micro-graph) as its epilogue, storing the activation, and the nodes left for
    layer 1 (``reduce_sum`` and the tail), or None.

    Without it the GEMM stored its raw output and the reduction kernel applied the activation
    element by element inside its reduction loop (scalar ``exp``), stored it and summed it:
    EfficientNet-B0's last 1x1 conv + SiLU + global pool ran at 2.3 GB/s (0.12 ms), RegNetY's 18
    SE squeezes ``add relu reduce_sum div`` took 0.02-0.05 ms each."""
    from ..codegen.conv_direct import DirectConvDesc
    from .gemm_lowering import gemm_spec
    types = graph.types
    shape, parts = _conv_head_parts(head, nxt, types)
    if parts is None or not parts[0]:
        return None
    chain, r, tail = parts
    rest = [r, *tail]
    reads = later | {v for n in rest for v in n.inputs}
    spec, left, _ = gemm_spec(head, [*epilogue, *chain], graph, reads, options, group)
    if spec is None or left or isinstance(spec.gemm, DirectConvDesc) or r.inputs[0] not in spec.outputs:
        return None
    return spec, rest


def excite_in_place(steps: list, graph: Graph) -> list:
    """``steps`` with each fused excitation (:func:`fuse_excite`) whose operand nothing reads
    afterwards written over the operand's buffer (``Excite.inplace``; the runtime places the
    product in the operand's arena slot).  The operand must be an intermediate written by one
    earlier GEMM / direct-conv step (an arena value) and read by no step but that writer and
    the excitation's -- not a graph input, output or constant, not read by a concat or a
    reshape view.  Writing the product into a fresh buffer cost a second stream of stores
    that missed the cache: the excitation pass over 32x112x112 .. 240x28x28 activations took
    0.6-0.7x the time in place (kernel calls, repeated, shared box)."""
    from ..codegen.conv_direct import DirectConvDesc
    if not EXCITE_IN_PLACE:
        return steps
    consts = {n.outputs[0] for n in graph.nodes if n.op == "constant"}
    fixed = set(graph.inputs) | set(graph.outputs) | consts
    out = list(steps)
    for k, spec in enumerate(out):
        d = spec.gemm
        if not isinstance(d, DirectConvDesc) or d.excite is None or d.excite.inplace:
            continue
        a = d.excite.operand
        writers = [j for j, s in enumerate(out) if a in s.outputs]
        readers = {j for j, s in enumerate(out) if a in s.inputs}
        if a in fixed or d.excite.output in fixed or len(writers) != 1 or writers[0] >= k \
                or out[writers[0]].gemm is None or readers - {writers[0], k}:
            continue
        d = replace(d, excite=replace(d.excite, inplace=True))
        out[k] = replace(spec, gemm=d, reason=f"{spec.reason} (in place over {a!r}: nothing reads it later)")
    return out
