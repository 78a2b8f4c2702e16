"""Row-blocked direct kernel of a large depthwise conv (ConvNeXt's 7x7), epilogue fused.

The direct kernel of codegen/conv_direct.py computes one output row per vector loop: every
output vector costs ``kh * kw`` input loads and as many weight broadcasts -- 49 + 49 loads for
49 FMAs at 7x7, whose 49 weights do not fit in the 32 vector registers -- and LLVM vectorises a
56-wide row at 8 lanes.  ConvNeXt-T's 18 depthwise 7x7 convs ran at 7-17% of the FMA peak
(3.1 ms of 30.5 on the quiet box).  Here, per output plane (parallel over ``image * C``):

* the input plane is copied into a zero-padded scratch whose row pitch is the output width
  rounded up to 16 lanes plus ``kw - 1`` (``OWr + kw - 1``), so every row loop runs full
  vectors (the ``OWr - OW`` extra columns are computed and dropped);
* output rows go in blocks of ``ROWS``: one vector loop computes ``ROWS`` output rows at
  once, so an input row loaded for tap row ``kh`` of output row ``u`` is the same load for
  tap row ``kh - 1`` of row ``u + 1`` (one ``Local`` per distinct input vector: ``(ROWS + kh
  - 1) * kw`` loads for ``ROWS * kh * kw`` FMAs, 70 for 196 at 7x7), and each weight
  broadcast feeds ``ROWS`` FMAs;
* the epilogue (per-channel operands only) runs on each row's sum into a row scratch, whose
  valid columns are then copied to the output.

Used for depthwise convs (one input and one output channel per group) of at least
:data:`MIN_TAPS` taps at stride 1, dilation 1, output rows at most a quarter short of a
multiple of 16 (:func:`applies`); 3x3 and 5x5 keep conv_direct.py's kernels, and so do 7-wide
rows (its flat form).
"""
from __future__ import annotations

from apollo_py.codegen import loopir as L

#: switch for A/B runs in one process (benchmarks); part of the direct conv's cache key
ENABLED = True
MIN_TAPS = 49       # 7x7 and larger: where the per-row kernel is furthest below the FMA peak
ROWS = 4            # output rows per vector loop
LANES = 16          # row pitch rounded up to this many floats (one AVX-512 vector)
SCRATCH_BYTES = 256 * 1024


def _geometry(d) -> tuple[int, int, int]:
    """``(padded rows, padded row pitch, rounded output width)`` of ``d``'s scratch."""
    g = d.conv
    owr = -(-g.ow // LANES) * LANES
    return g.oh + g.kh - 1, owr + g.kw - 1, owr


def applies(d) -> bool:
    """Whether ``d`` (a DirectConvDesc) runs on this kernel: depthwise, stride and dilation 1,
    at least :data:`MIN_TAPS` taps, no fused squeeze / excitation, epilogue operands constant
    along H and W, float epilogue values, the scratch within :data:`SCRATCH_BYTES`."""
    g = d.conv
    if not ENABLED or g.c // g.group != 1 or d.cout // g.group != 1 or g.kh * g.kw < MIN_TAPS:
        return False
    if tuple(g.strides) != (1, 1) or tuple(g.dilations) != (1, 1) or d.squeeze is not None or d.excite is not None:
        return False
    if any(any(s != 1 for s in o.shape[-2:]) for o in d.operands if len(o.shape) >= 2):
        return False
    if not all(L.is_float(L.compute_dtype(dt)) for dt in (*d.node_dtypes, *d.out_dtypes)):
        return False
    prow, pitch, owr = _geometry(d)
    if 4 * owr > 5 * g.ow:
        # more than a quarter of every row computed for nothing (7 wide: 16 lanes for 7
        # columns measured 1.07x conv_direct's flat form; 14 wide 0.63x)
        return False
    return (prow * pitch + ROWS * owr * len(d.out_dtypes)) * 4 <= SCRATCH_BYTES


def _epilogue(d, acc: L.Expr, ops, tmps, at: L.Expr, t: L.Expr, tag: str) -> list:
    """The epilogue chain on ``acc`` (the conv's value of plane ``t``; operands are per
    channel, so any column indexes them), stored into the row scratches at ``at``; locals
    named with ``tag`` so that the ``ROWS`` copies in one loop body do not collide."""
    from apollo_py.codegen.gemm import _operand_index
    from apollo_py.codegen.scalar_ops import scalar_op
    f32 = "float32"
    stmts = [L.Local(f"{tag}h", f32, acc)]
    env: dict = {d.head: L.Var(f"{tag}h", f32)}
    for q, o in enumerate(d.operands):
        env[o.value] = L.Load(ops[q], _operand_index(o, d.out_shape, 2, t, L.Const(0)))
    env.update(d.inline_consts)
    for q, n in enumerate(d.nodes):
        e = scalar_op(n, [env[v] for v in n.inputs], [], d.node_dtypes[q])
        stmts.append(L.Local(f"{tag}v{q}", e.dtype, e))
        env[n.outputs[0]] = L.Var(f"{tag}v{q}", e.dtype)
    return stmts + [L.Store(tmps[q], at, env[v]) for q, v in enumerate(d.outputs)]


def dw_rows_kernel(d, w, x, ops, outs) -> L.Kernel:
    """The loop-IR kernel of ``d`` (``applies(d)`` holds): params ``(w, x, operands...,
    outputs...)`` as conv_direct.direct_conv_kernel's."""
    g = d.conv
    ph, pw = g.pads
    prow, pitch, owr = _geometry(d)
    V = L.Var
    f32 = "float32"
    zero = L.Const(0.0, f32)
    t = V("t")
    pad = L.Alloc("xpad", f32, prow * pitch)
    tmps = [L.Alloc(f"yrow{q}", dt, ROWS * owr) for q, dt in enumerate(d.out_dtypes)]
    lz, mid_hi = min(pw, pitch), min(pw + g.w, pitch)
    ihc = L.minimum(L.maximum(V("ih"), 0), g.h - 1)
    dst = V("r") * pitch
    copy = L.for_("r", 0, prow, L.block(
        L.Local("ih", "int64", V("r") - ph),
        L.Local("rowok", "bool", L.land(L.ge(V("ih"), 0), L.lt(V("ih"), g.h))),
        L.Local("src", "int64", V("xbase") + ihc * g.w - pw),
        L.for_("c", 0, lz, L.Store(pad, dst + V("c"), zero), "vector"),
        L.for_("c", lz, mid_hi, L.Store(pad, dst + V("c"),
                                        L.Select(V("rowok", "bool"), L.Load(x, V("src") + V("c")), zero)), "vector"),
        L.for_("c", mid_hi, pitch, L.Store(pad, dst + V("c"), zero), "vector")))
    weights = [L.Local(f"w{kh}_{kw}", f32, L.Load(w, V("wbase") + kh * g.kw + kw))
               for kh in range(g.kh) for kw in range(g.kw)]
    ohw = g.oh * g.ow

    def block(rows: int, oh0: L.Expr, tag: str) -> L.Block:
        """``rows`` output rows from ``oh0``: one vector loop over the rounded width, then the
        copies of the valid columns."""
        ow = V(f"{tag}ow")
        bases = [L.Local(f"{tag}rb{s}", "int64", (oh0 + s) * pitch) for s in range(rows + g.kh - 1)]
        # input row s feeds output row u through tap row s - u: each input vector is loaded
        # once and added into every row it feeds right away, two accumulator chains per row
        # (kw parity) -- loading them all first kept ~70 vectors live and spilled them
        accs = [f"{tag}a{u}_{c}" for u in range(rows) for c in range(2)]
        body: list = [L.Local(a, f32, zero) for a in accs]
        for s in range(rows + g.kh - 1):
            for kw in range(g.kw):
                xv = f"{tag}x{s}_{kw}"
                body.append(L.Local(xv, f32, L.Load(pad, V(f"{tag}rb{s}") + ow + kw)))
                for u in range(max(0, s - g.kh + 1), min(rows, s + 1)):
                    a = f"{tag}a{u}_{kw % 2}"
                    body.append(L.Assign(a, V(a, f32) + V(xv, f32) * V(f"w{s - u}_{kw}", f32)))
        for u in range(rows):
            acc = V(f"{tag}a{u}_0", f32) + V(f"{tag}a{u}_1", f32)
            body += _epilogue(d, acc, ops, tmps, ow + u * owr, t, f"{tag}e{u}_")
        cw = V(f"{tag}cw")
        copies = [L.for_(f"{tag}cw", 0, g.ow, L.Store(o, t * ohw + (oh0 + u) * g.ow + cw, L.Load(y, u * owr + cw)),
                         "vector") for u in range(rows) for o, y in zip(outs, tmps)]
        return L.block(*bases, L.for_(f"{tag}ow", 0, owr, L.block(*body), "vector"), *copies)

    nb = g.oh // ROWS
    rows = [L.for_("ob", 0, nb, block(ROWS, V("ob") * ROWS, "b"), "serial")] if nb else []
    rows += [block(1, L.Const(nb * ROWS + r), f"r{r}") for r in range(g.oh - nb * ROWS)]
    plane = L.block(
        L.Local("img", "int64", t // d.cout),
        L.Local("co", "int64", t % d.cout),
        L.Local("xbase", "int64", (V("img") * g.c + V("co")) * (g.h * g.w)),
        L.Local("wbase", "int64", V("co") * (g.kh * g.kw)),
        copy, *weights, *rows)
    loops = L.block(pad, *tmps, L.for_("t", 0, g.n * d.cout, plane, "parallel"))
    return L.Kernel(d.name, (w, x, *ops, *outs), loops, "t", g.n * d.cout)

