"""Lowering of a matmul/conv micro-graph to the generated GEMM (codegen/gemm.py) or BLAS.

:func:`gemm_spec` takes the head (``matmul`` or ``conv``) and the nodes after it in the
micro-graph, and returns either a StepSpec running the generated GEMM with the longest
fusable prefix of those nodes as its per-tile epilogue, or None with the reason BLAS (numpy)
runs the head instead.  The rest of the nodes go to layer 1 as before.

The dispatch rule for float32 matmul (``Options.gemm == "auto"``) comes from measurements on
the 2-core AVX-512 dev box (generated / numpy sgemm time ratio, median of 7-9 interleaved
samples).  Single thread: 64^3 0.23, 128^3 0.62, 256^3 0.76, 512^3 ~0.9, 1024^3 ~1.0, batched
[8,128,64]@[8,64,128] 0.90.  Two threads on an idle machine (OpenBLAS at 220-300 GFLOP/s):
256^3 0.32, 512^3 0.48-0.65, [2048,768]@[768,768] 0.45-0.62, 1024^3 0.85-0.93, and the BERT
feed-forward products [1024,768]@[768,3072] and [1024,3072]@[3072,768] about 0.35 (40-48 ms
against 15-17 ms).  Thin shapes lose badly ([1024,1024]@[1024,1] 0.06-0.12): the micro-tile is
12 x 32.  BLAS was faster at every shape measured with the default two threads, so "auto"
runs every matmul through BLAS, with its epilogue as a separate layer-1 kernel, and says so in
the plan; ``Options(gemm="generated")`` forces the generated GEMM (epilogue fused per tile),
``benchmarks/bench_gemm.py`` measures both.
A conv always runs as implicit GEMM (the only alternative is the float64 im2col oracle).
"""
from __future__ import annotations


from ..errors import UnsupportedOpError
from ..ir.graph import Graph, Node
from ..options import Options

_NOT_EPILOGUE = {"iota", "broadcast_to"}


def _fusable(n: Node, types, shape: tuple, known: set) -> bool:
    from ..ops.registry import get_op
    if n.op == "constant":
        return False
    try:
        op = get_op(n.op)
    except UnsupportedOpError:      # not a primitive (a fallback op): not an epilogue op
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
    if options.target in ("cuda", "cuda-emu"):    # codegen/cuda_gemm.py: float32 / float16 storage
        dts = {out.dtype, *(types[v].dtype for v in head.inputs)}
        if len(dts) != 1 or not dts <= {"float32", "float16"}:
            return f"{'/'.join(sorted(dts))} operands (the CUDA GEMM takes float32 or float16)"
        if head.op == "conv" and len(types[head.inputs[0]].shape) != 4:
            return f"{len(types[head.inputs[0]].shape) - 2}-d conv (the implicit GEMM handles 2-d)"
        return ""
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
    return ("BLAS measured faster than the generated GEMM on every matmul shape at two threads "
            "(1024^3: generated 0.85-0.93x of sgemm; BERT FFN 0.35x); Options(gemm='generated') forces it")


def _direct_conv(head: Node, types, options: Options) -> str:
    """Why the direct kernel (codegen/conv_direct.py) runs conv ``head`` ("" = implicit GEMM):
    a grouped conv on the CPU whose per-output sum is at most ``MAX_TAPS`` terms, or a 1x1 conv
    of a 1x1 image (a matrix-vector product)."""
    from ..codegen.conv_direct import MAX_TAPS
    if head.op != "conv" or options.target in ("cuda", "cuda-emu"):
        return ""
    group = int(head.attrs["group"])
    cg, kh, kw = types[head.inputs[1]].shape[1:]
    if types[head.inputs[0]].shape[2:] == (1, 1) and (kh, kw) == (1, 1) \
            and types[head.outputs[0]].shape[2:] == (1, 1):
        return f"1x1 conv of a 1x1 image: matrix-vector product of {cg} terms per output"
    cgo = types[head.inputs[1]].shape[0] // max(group, 1)
    # measured (interleaved, shared box at load ~20, direct / implicit-GEMM time): 3x3 convs
    # with 1, 2, 4 channels per group in and out 0.03, 0.03, 0.65; 8 in and out 1.22 -- the
    # GEMM's micro-tile fills once a group has 8 output rows sharing its packed input
    if group == 1 or cg * kh * kw > MAX_TAPS or cg * cgo >= 64:
        return ""
    kind = "depthwise" if cg == 1 else f"{group} groups of {cg} channels"
    return f"{kind}, {cg * kh * kw} taps: an implicit GEMM per group would fill its micro-tile with {types[head.inputs[1]].shape[0] // group} row(s)"


def gemm_spec(head: Node, epilogue: list, graph: Graph, later: set, options: Options, group: tuple):
    """``(spec, rest, reason)``: the generated-GEMM StepSpec for ``head`` plus the fused prefix
    of ``epilogue`` (``rest`` = the nodes left for layer 1), or ``(None, epilogue, reason)``
    when BLAS runs the head, ``reason`` saying why."""
    from ..codegen.gemm import EpiOperand, conv_desc, matmul_desc
    from .steps import StepSpec
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
    direct = _direct_conv(head, types, options)
    if direct:
        from ..codegen.conv_direct import direct_conv_desc
        desc = direct_conv_desc(name.replace("gemm_", "dconv_", 1), types[x].shape, types[w].shape, shape,
                                head.attrs, head.outputs[0], **epi)
        what = f"direct conv (generated; {direct})"
    elif head.op == "conv":
        desc = conv_desc(name, types[x].shape, types[w].shape, shape, head.attrs, head.outputs[0], **epi)
        what = "implicit-GEMM conv (generated)"
    else:
        desc = matmul_desc(name, types[x].shape, types[w].shape, shape, head.outputs[0], **epi)
        what = "generated GEMM (Options.gemm='generated')"
    fused_ops = "+".join(n.op for n in fused) or "none"
    reason = f"{what}; batch {desc.batch}, {desc.m}x{desc.n}x{desc.k}; epilogue {fused_ops}"
    ins = tuple(dict.fromkeys([*head.inputs, *(o.value for o in operands)]))
    spec = StepSpec(ins, outs, nodes=(head, *fused), reason=reason, micro_graphs=tuple(group), gemm=desc,
                    const_inputs=tuple(v for v in head.inputs if v in consts))
    return spec, rest, ""
