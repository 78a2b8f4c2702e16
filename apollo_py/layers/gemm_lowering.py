"""Lowering of a matmul/conv micro-graph to the generated GEMM (codegen/gemm.py) or BLAS.

:func:`gemm_spec` takes the head (``matmul`` or ``conv``) and the nodes after it in the
micro-graph, and returns either a StepSpec running the generated GEMM with the longest
fusable prefix of those nodes as its per-tile epilogue, or None with the reason BLAS (numpy)
runs the head instead.  The rest of the nodes go to layer 1 as before.

The dispatch rule for float32 matmul (``Options.gemm == "auto"``, :func:`auto_blas_reason`):

* a batched right operand (``[B, H, S, d] @ [B, H, d, S]``) runs on the generated GEMM: one
  kernel over batch x tiles, where BLAS would need a numpy loop of calls;
* a thin product (``N < THIN_N``) runs through BLAS: the micro-tile is 32 columns wide, and
  the generated GEMM measured 0.06-0.12x of sgemm at ``[1024,1024]@[1024,1]``;
* a constant right operand (a weight) with at least ``SMALL_MNK`` multiply-adds runs on the
  generated GEMM with B packed once (smaller ones stay on BLAS: one thread there, no compile): on the
  zoo's linear layers (benchmarks/gemm_shapes.py, shared 2-core box) it measured within
  0.7-1.35x of onnxruntime's time, while OpenBLAS's two threads, which spin and yield on a
  loaded machine, took 3-30x onnxruntime's;
* a right operand computed at run time (training, ``x @ xᵀ``) with at least ``RUNTIME_B_MNK``
  multiply-adds runs on the generated GEMM (B packed per tile) where its micro-kernel's vectors
  are wider than numpy's sgemm kernel's (:func:`generated_is_wider`: an AVX-512 host whose
  OpenBLAS runs an AVX2 core, as ``OPENBLAS_CORETYPE=Haswell`` pins it on the dev box);
* any other matmul runs through BLAS, where blas_fold.py folds transposes, bias rows and SGD
  updates into one sgemm.

:func:`fold_operand_transposes` (run by ``fold_blas``) then lets a generated matmul GEMM read a
transpose that only it reads in place.
A conv always runs as implicit GEMM (the only alternative is the float64 im2col oracle).
"""
from __future__ import annotations

from math import prod

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


def _reason_blas(head: Node, types, options: Options, consts=frozenset()) -> str:
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
        if len(x.shape) not in (3, 4):
            return f"{len(x.shape) - 2}-d conv (the implicit GEMM handles 1-d and 2-d)"
        return ""
    if options.gemm == "blas":
        return "Options.gemm='blas'"
    if options.gemm == "generated":
        return ""
    return auto_blas_reason(tuple(types[head.inputs[0]].shape), tuple(types[head.inputs[1]].shape),
                            head.inputs[1] in consts)


def _batched_b(ys: tuple) -> bool:
    return len(ys) > 2 and prod(ys[:-2]) > 1


#: right operands narrower than this run through BLAS: the micro-tile is 32 (AVX-512) or 16
#: columns wide, so a thinner product wastes most of every vector FMA
THIN_N = 16
#: constant-weight products with fewer multiply-adds stay on BLAS: OpenBLAS's own threshold for
#: using one thread (65536 * GEMM_MULTITHREAD_THRESHOLD), and below it a generated GEMM's
#: compile (~0.5 s) buys microseconds
SMALL_MNK = 1 << 18


def auto_blas_reason(xs: tuple, ys: tuple, b_const: bool) -> str:
    """``Options.gemm == "auto"`` for a float32 ``xs @ ys``: why BLAS runs it, or "" when the
    generated GEMM does (see the module docs for the measurements behind the rule)."""
    if _batched_b(ys):
        return ""
    n = ys[-1] if len(ys) > 1 else 1
    if n < THIN_N:
        return (f"thin product (N = {n} < {THIN_N}: BLAS measured faster, [1024,1024]@[1024,1] generated "
                "0.06-0.12x of sgemm); Options(gemm='generated') forces it")
    mnk = prod(xs[:-1]) * (ys[-2] if len(ys) > 1 else ys[0]) * n
    if b_const and mnk < SMALL_MNK:
        return (f"small product ({mnk} multiply-adds < {SMALL_MNK}: OpenBLAS runs it on one thread, and a "
                "generated GEMM would cost a compile for microseconds); Options(gemm='generated') forces it")
    if not b_const:
        if mnk >= RUNTIME_B_MNK and generated_is_wider():
            return ""
        return ("right operand not a constant, so the generated GEMM would pack it on every call: BLAS measured "
                "faster then (one sgemm with transposes and updates folded) unless the BLAS runs narrower "
                "vectors than the generated GEMM on a product of at least "
                f"{RUNTIME_B_MNK} multiply-adds; Options(gemm='generated') forces it")
    return ""


#: a right operand computed at run time goes to the generated GEMM (B packed per tile) from
#: this many multiply-adds on, where that GEMM's vectors are wider than numpy's BLAS's: with
#: OpenBLAS pinned to Haswell (AVX2) on the AVX-512 box, 2 threads, generated / sgemm time
#: 0.86x at 128x768x768, 0.37x at 1024^3, but 1.16x at 256^3 and 1.27x at 64x512x256
#: (docs/design/gemm.md, "Run-time right operands")
RUNTIME_B_MNK = 1 << 25


def generated_is_wider() -> bool:
    """Whether the generated GEMM's micro-kernel uses wider vectors than numpy's sgemm kernel
    (an AVX-512 host whose OpenBLAS runs an AVX2 core; an unknown BLAS counts as wide)."""
    from ..codegen.blas_info import blas_vector_floats
    from ..codegen.gemm import host_blocking
    blas = blas_vector_floats()
    return blas is not None and host_blocking().vl > blas


def auto_choice(desc) -> str:
    """Why ``Options.gemm == "auto"`` picked the generated GEMM for ``desc``."""
    if desc.batch > 1:
        return (f"auto: batched right operand ({desc.batch} products; one kernel over batch x tiles, where "
                "BLAS would need a numpy loop)")
    if not desc.b_const:
        return ("auto: right operand computed at run time, packed per tile: the generated GEMM's vectors are "
                "wider than numpy's BLAS kernel's here")
    return ("auto: constant right operand, packed once; measured at or below onnxruntime's time on the zoo's "
            "linear layers while OpenBLAS's threads lose 3-30x on the shared 2-core box")


def conv_shapes_2d(head: Node, types) -> tuple:
    """``(x shape, w shape, output shape, attrs)`` of conv ``head`` as a 2-d NCHW conv: a 1-d
    conv ``[N, C, L]`` is the 2-d conv of the ``[N, C, 1, L]`` image (same memory, a unit row
    with no padding), so Whisper's and other Conv1d stems take the generated paths too."""
    xs, ws, os_ = (tuple(types[v].shape) for v in (*head.inputs[:2], head.outputs[0]))
    if len(xs) != 3:
        return xs, ws, os_, head.attrs
    a = head.attrs
    pads = tuple(a["pads"])
    attrs = dict(a, strides=(1, *a["strides"]), dilations=(1, *a["dilations"]), pads=(0, pads[0], 0, pads[1]))
    lift = (lambda s: (*s[:2], 1, *s[2:]))
    return lift(xs), lift(ws), lift(os_), attrs


#: dense convs of few input channels (stems) on the block kernel (codegen/conv_block.py); off: the
#: implicit GEMM / row-reading conv as before (A/B runs in one process)
BLOCK_CONVS = True


def _direct_conv(head: Node, types, options: Options) -> str:
    """Why the direct kernel (codegen/conv_direct.py) runs conv ``head`` ("" = implicit GEMM):
    a grouped conv on the CPU whose per-output sum is at most ``MAX_TAPS`` terms, or a 1x1 conv
    of a 1x1 image (a matrix-vector product)."""
    from ..codegen.conv_direct import MAX_TAPS
    if head.op != "conv" or options.target in ("cuda", "cuda-emu"):
        return ""
    group = int(head.attrs["group"])
    xs, ws, os_, attrs = conv_shapes_2d(head, types)
    cg, kh, kw = ws[1:]
    if xs[2:] == (1, 1) and (kh, kw) == (1, 1) and os_[2:] == (1, 1):
        return f"1x1 conv of a 1x1 image: matrix-vector product of {cg} terms per output"
    cgo = ws[0] // max(group, 1)
    if group == 1 and BLOCK_CONVS:
        from ..codegen.conv_block import block_form
        from ..codegen.conv_direct import direct_conv_desc
        if block_form(direct_conv_desc("probe", xs, ws, os_, attrs, "").conv, ws[0]):
            return (f"dense conv of {cg} input channels, {cg * kh * kw} taps: blocks of output rows and "
                    "channels from one padded copy of the input rows (an implicit GEMM would pack K = "
                    f"{cg * kh * kw} im2col rows per call)")
    # measured (interleaved, shared box at load ~20, direct / implicit-GEMM time): 3x3 convs
    # with 1, 2, 4 channels per group in and out 0.03, 0.03, 0.65; 8 in and out 1.22 -- the
    # GEMM's micro-tile fills once a group has 8 output rows sharing its packed input
    if group == 1 or cg * kh * kw > MAX_TAPS or cg * cgo >= 64:
        return ""
    kind = "depthwise" if cg == 1 else f"{group} groups of {cg} channels"
    return f"{kind}, {cg * kh * kw} taps: an implicit GEMM per group would fill its micro-tile with {cgo} row(s)"


def gemm_spec(head: Node, epilogue: list, graph: Graph, later: set, options: Options, group: tuple):
    """``(spec, rest, reason)``: the generated-GEMM StepSpec for ``head`` plus the fused prefix
    of ``epilogue`` (``rest`` = the nodes left for layer 1), or ``(None, epilogue, reason)``
    when BLAS runs the head, ``reason`` saying why."""
    from ..codegen.gemm import EpiOperand, conv_desc, matmul_desc
    from .steps import StepSpec
    types = graph.types
    consts = {n.outputs[0]: n for n in graph.nodes if n.op == "constant"}
    why = _reason_blas(head, types, options, consts)
    if why:
        return None, list(epilogue), why
    shape = tuple(types[head.outputs[0]].shape)
    known = {head.outputs[0]}
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
        from dataclasses import replace
        xs, ws, os_, attrs = conv_shapes_2d(head, types)
        one_d = " (1-d conv as a 2-d conv of one row)" if len(shape) == 3 else ""
        direct = _direct_conv(head, types, options)
        if direct:
            from ..codegen.conv_direct import direct_conv_desc
            desc = direct_conv_desc(name.replace("gemm_", "dconv_", 1), xs, ws, os_, attrs, head.outputs[0], **epi)
            from ..codegen.conv_dw_rows import ROWS, applies as dw_rows
            from ..codegen.conv_dw_cvec import CV, applies as dw_cvec
            rows = (f"; {CV} channels per vector, codegen/conv_dw_cvec.py" if dw_cvec(desc) else
                    f"; {ROWS} output rows per vector loop, codegen/conv_dw_rows.py" if dw_rows(desc) else "")
            what = f"direct conv{one_d} (generated; {direct}{rows})"
        else:
            desc = conv_desc(name, xs, ws, os_, attrs, head.outputs[0], **epi)
            from ..codegen.conv_cvec import cvec_reason
            from ..codegen.conv_rows import rows_reason
            cvec = cvec_reason(desc, options.target) if w in consts else ""
            rows = "" if cvec else rows_reason(desc, options.target) if w in consts else ""
            what = (f"channel-vector conv{one_d} (generated; {cvec})" if cvec
                    else f"row-reading conv{one_d} (generated; {rows})" if rows
                    else f"implicit-GEMM conv{one_d} (generated)")
        desc = replace(desc, out_shape=shape)   # buffers and epilogue operands keep the graph's shape
    else:
        desc = matmul_desc(name, types[x].shape, types[w].shape, shape, head.outputs[0], a_value=x, b_value=w,
                           b_const=w in consts, **epi)
        from ..codegen.gemv import gemv_reason
        gemv = gemv_reason(desc, options.target)
        what = (f"matrix-vector product (generated; {gemv})" if gemv
                else "generated GEMM (Options.gemm='generated')" if options.gemm == "generated"
                else f"generated GEMM ({auto_choice(desc)})")
    fused_ops = "+".join(n.op for n in fused) or "none"
    reason = f"{what}; batch {desc.batch}, {desc.m}x{desc.n}x{desc.k}; epilogue {fused_ops}"
    ins = tuple(dict.fromkeys([*head.inputs, *(o.value for o in operands)]))
    spec = StepSpec(ins, outs, nodes=(head, *fused), reason=reason, micro_graphs=tuple(group), gemm=desc,
                    const_inputs=tuple(v for v in head.inputs if v in consts))
    return spec, rest, ""


def _lone_transpose(spec, op: str = "transpose"):
    """The transpose (``op``) node of a step that is one transpose (a numpy step or a copy kernel)."""
    if spec.gemm is not None or spec.blas is not None:
        return None
    nodes = [n for n in (spec.fused.nodes if spec.fused is not None else spec.nodes) if n.op != "constant"]
    if len(nodes) != 1 or nodes[0].op != op or len(spec.outputs) != 1:
        return None
    return nodes[0]


def fold_operand_transposes(specs: list, graph: Graph) -> list:
    """``specs`` (lowering order) with every transpose that feeds only a generated matmul GEMM
    folded into it: the GEMM's pack kernels read the transpose's input in place through an
    :class:`~apollo_py.codegen.gemm.OperandView` (strided reads while packing, which the
    packing pays anyway), and the transpose step -- a numpy copy or a copy kernel -- is gone.
    The exporters write attention's ``K^T`` and ``V`` this way (``Transpose`` with perm
    ``(0, 2, 3, 1)`` / ``(0, 2, 1, 3)`` of ``[B, S, H, d]``).  Conv GEMMs, epilogue operands
    and values read elsewhere (or graph outputs) are left alone."""
    from dataclasses import replace

    from ..codegen.gemm import OperandView
    specs = list(specs)
    alive = [True] * len(specs)
    producer = {v: i for i, s in enumerate(specs) for v in s.outputs}
    readers: dict = {}
    for i, s in enumerate(specs):
        for v in s.inputs:
            readers.setdefault(v, set()).add(i)
    for i, spec in enumerate(specs):
        d = spec.gemm
        if d is None or d.conv is not None or not d.a_value or d.a_value == d.b_value:
            continue
        epi_reads = {o.value for o in d.operands}
        extra, gone = [], []
        for side in ("a", "b"):
            v = getattr(d, side + "_value")
            j = producer.get(v)
            if (j is None or not alive[j] or readers.get(v) != {i} or v in graph.outputs or v in epi_reads
                    or getattr(d, side + "_view") is not None):
                continue
            t = _lone_transpose(specs[j])
            if t is None or len(graph.types[v].shape) < 2:
                continue
            src = t.inputs[0]
            view = OperandView.transposed(tuple(graph.types[src].shape), tuple(int(p) for p in t.attrs["perm"]))
            d = replace(d, **{side + "_value": src, side + "_view": view})
            if side == "b":
                d = replace(d, b_const=any(n.op == "constant" and n.outputs[0] == src for n in graph.nodes))
            extra.append(t)
            gone.append(j)
            alive[j] = False
        out = _fold_output_transpose(i, d, specs, alive, producer, readers, graph)
        if out is not None:
            d, ts, js = out
            extra.extend(ts)
            gone.extend(js)
        if not extra:
            continue
        ins = tuple(dict.fromkeys([d.a_value, d.b_value, *(v for v in spec.inputs if v not in
                                                           (spec.gemm.a_value, spec.gemm.b_value))]))
        mgs = tuple(sorted(set(spec.micro_graphs).union(*(specs[j].micro_graphs for j in gone))))
        reads = [t for t in extra if t.op == "transpose" and t.outputs[0] not in d.stored_as]
        why = spec.reason
        if reads:
            why += "; reads " + ", ".join(f"transpose{tuple(t.attrs['perm'])} of {t.inputs[0]}"
                                          for t in reads) + " in place"
        if d.out_perm is not None:
            why += f"; stores its result transposed {tuple(d.out_perm)}"
        from ..codegen.small_dot import dot_plan
        if (dp := dot_plan(d)[0]) is not None:      # GemmStep.build compiles it so
            why += f"; as dot products, {dp.vl} batches a vector (codegen/small_dot.py)"
        specs[i] = replace(spec, inputs=ins, outputs=d.stored_as or spec.outputs, nodes=(*spec.nodes, *extra), gemm=d,
                           reason=why, micro_graphs=mgs)
        for v in ins:
            readers.setdefault(v, set()).add(i)
    return [s for s, ok in zip(specs, alive) if ok]


def _fold_output_transpose(i: int, d, specs: list, alive: list, producer: dict, readers: dict, graph: Graph):
    """``(desc, (nodes), (steps))`` when the one value GEMM step ``i`` stores is read only by a
    lone transpose step (attention's context ``[B, H, S, d] -> [B, S, H, d]``), or by a lone
    reshape step whose result only a lone transpose step reads and the transposed value is read
    by several steps (Llama's head split of Q and K, ``[S, H*d] -> [S, H, d] -> [H, S, d]``, read
    by both RoPE kernels: no reader can fold it): the epilogue then stores straight into the
    transposed layout and those steps go.  None otherwise."""
    from dataclasses import replace
    if d.out_perm is not None or len(d.outputs) != 1 or tuple(specs[i].outputs) != d.outputs:
        return None
    v = d.outputs[0]
    rs = readers.get(v, set())
    if v in graph.outputs or len(rs) != 1:
        return None
    j = next(iter(rs))
    if not alive[j] or j <= i:
        return None
    t = _lone_transpose(specs[j])
    if t is not None and t.inputs[0] == v:
        alive[j] = False
        out = t.outputs[0]
        producer[out] = i
        return replace(d, stored_as=(out,), out_perm=tuple(int(p) for p in t.attrs["perm"])), (t,), (j,)
    r = _lone_transpose(specs[j], "reshape")
    if r is None or r.inputs[0] != v or d.operands:     # operands broadcast against the unreshaped shape
        return None
    rv = r.outputs[0]
    rs = readers.get(rv, set())
    if rv in graph.outputs or len(rs) != 1:
        return None
    j2 = next(iter(rs))
    t = _lone_transpose(specs[j2]) if alive[j2] and j2 > j else None
    if t is None or t.inputs[0] != rv or t.outputs[0] in graph.outputs or len(readers.get(t.outputs[0], ())) < 2:
        return None
    shape = tuple(graph.types[rv].shape)
    rows = prod(d.out_shape[:d.row_dims])
    rd = next((q for q in range(len(shape) + 1) if prod(shape[:q]) == rows and prod(shape[q:]) == d.n), None)
    if rd is None or d.batch != 1:
        return None
    alive[j] = alive[j2] = False
    out = t.outputs[0]
    producer[out] = i
    return (replace(d, out_shape=shape, row_dims=rd, stored_as=(out,), out_perm=tuple(int(p) for p in t.attrs["perm"])),
            (r, t), (j, j2))
