"""Row-blocked direct kernel of a depthwise conv (3x3 and larger, strides 1 and 2), epilogue fused.

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

Stride 2 (MobileNet / EfficientNet's downsampling convs): each scratch row holds the padded
row's two column phases one after the other (even columns, then odd), so tap ``kw`` of output
column ``ow`` reads phase ``kw % 2`` at ``ow + kw // 2`` -- unit stride -- and the copy reads
each input row once (one loop storing both phases: LLVM's interleaved loads, two vectors and
two permutes per 16 columns).  Rows need no split: input row ``r`` of a block feeds output row
``u`` through tap row ``r - 2u``.  The scratch is zeroed once per call; each plane copies only
the input's rows and columns.

Used for depthwise convs (one input and one output channel per group) of at least
:data:`MIN_TAPS` taps at strides 1 and 2 (equal), dilation 1, output rows at most a quarter
short of a multiple of 16 (:func:`applies`); 7-wide rows keep conv_direct.py's flat form.
"""
from __future__ import annotations

from apollo_py.codegen import loopir as L

#: switch for A/B runs in one process (benchmarks); part of the direct conv's cache key
ENABLED = True
#: 3x3 and larger.  First 7x7 only (ConvNeXt); one thread, kernel calls, min of 9 rounds against
#: conv_direct.py's row / flat forms (load ~2): 3x3 16ch 112^2 0.78, 32ch 112^2 0.76, 72ch 56^2
#: 0.66, 144ch 56^2 0.65, 672ch 14^2 0.81; 5x5 120ch 28^2 0.59
MIN_TAPS = 9
ROWS = 4            # output rows per vector loop
LANES = 16          # row pitch rounded up to this many floats (one AVX-512 vector)
SCRATCH_BYTES = 256 * 1024
MAX_STRIDE = 2      # equal strides up to this (column phases in the scratch row above 1)


def _geometry(d) -> tuple[int, int, int, int]:
    """``(padded rows, padded row pitch, rounded output width, phase width)`` of ``d``'s
    scratch: at stride ``s`` each padded row holds its ``s`` column phases one after the other
    (column ``c`` at ``(c % s) * Q + c // s``, ``Q`` the phase width), so that every tap reads
    unit-stride vectors."""
    g = d.conv
    s = g.strides[1]
    owr = -(-g.ow // LANES) * LANES
    q = owr + (g.kw - 1) // s
    return (g.oh - 1) * g.strides[0] + g.kh, s * q, owr, q


def applies(d) -> bool:
    """Whether ``d`` (a DirectConvDesc) runs on this kernel: depthwise, stride and dilation 1,
    at least :data:`MIN_TAPS` taps, no excitation (a fused squeeze is summed per plane as in
    conv_direct.py), no tuning decision for conv_direct.py's forms (``d.form``), epilogue
    operands constant along H and W, float epilogue values, the scratch within
    :data:`SCRATCH_BYTES`."""
    g = d.conv
    if not ENABLED or g.c // g.group != 1 or d.cout // g.group != 1 or g.kh * g.kw < MIN_TAPS or d.form:
        return False
    if g.strides[0] != g.strides[1] or g.strides[0] > MAX_STRIDE or tuple(g.dilations) != (1, 1) \
            or d.excite is not None:
        return False
    if any(any(s != 1 for s in o.shape[-2:]) for o in d.operands if len(o.shape) >= 2):
        return False
    if not all(L.is_float(L.compute_dtype(dt)) for dt in (*d.node_dtypes, *d.out_dtypes)):
        return False
    prow, pitch, owr, _ = _geometry(d)
    if 4 * owr > 5 * g.ow:
        # more than a quarter of every row computed for nothing (7 wide: 16 lanes for 7
        # columns measured 1.07x conv_direct's flat form; 14 wide 0.63x)
        return False
    return (prow * pitch + ROWS * owr * len(d.out_dtypes)) * 4 <= SCRATCH_BYTES


def _epilogue(d, acc: L.Expr, ops, tmps, at: L.Expr, t: L.Expr, tag: str) -> list:
    """The epilogue chain on ``acc`` (the conv's value of plane ``t``; operands are per
    channel, so any column indexes them), stored into the row scratches at ``at``; locals
    named with ``tag`` so that the ``ROWS`` copies in one loop body do not collide."""
    from apollo_py.codegen.gemm import _operand_index, epilogue_locals
    stmts, env = epilogue_locals(d, acc, ops, lambda o: _operand_index(o, d.out_shape, 2, t, L.Const(0)), tag)
    return stmts + [L.Store(tmps[q], at, env[v]) for q, v in enumerate(d.outputs)]


def _whole_vectors(var: str, lo: int, hi: int, body) -> list:
    """Vector loops over ``[lo, hi)`` of the idempotent ``body(index)`` (a copy) without a
    scalar remainder: whole vectors, then one vector ending at ``hi`` that overlaps the last
    (a 55-column copy was 3 vectors, a 4-lane vector and 3 scalar iterations)."""
    n = hi - lo
    if n < LANES:
        return [L.for_(var, lo, hi, body(L.Var(var)), "vector")]
    whole = lo + n // LANES * LANES
    loops = [L.for_(var, lo, whole, body(L.Var(var)), "vector")]
    if whole < hi:
        loops.append(L.for_(var, hi - LANES, hi, body(L.Var(var)), "vector"))
    return loops


def dw_rows_kernel(d, w, x, ops, outs, sq_outs=(), squeeze=()) -> L.Kernel:
    """The loop-IR kernel of ``d`` (``applies(d)`` holds): params ``(w, x, operands...,
    outputs..., squeeze rows...)`` as conv_direct.direct_conv_kernel's; ``squeeze``: the
    statements summing plane ``t`` of a fused squeeze after it is stored (conv_direct's)."""
    g = d.conv
    ph, pw = g.pads
    st = g.strides[0]
    prow, pitch, owr, q = _geometry(d)
    V = L.Var
    f32 = "float32"
    zero = L.Const(0.0, f32)
    t = V("t")
    pad = L.Alloc("xpad", f32, prow * pitch)
    tmps = [L.Alloc(f"yrow{q}", dt, ROWS * owr) for q, dt in enumerate(d.out_dtypes)]
    # padded column c = jc * st + p of phase p reads input column c - pw: phase p's columns
    # [lo_p, hi_p) hold input; padded row r input row r - ph.  The scratch is zeroed once per
    # call and each plane writes only the input's rows and columns (nothing else writes there)
    spans = []
    for p in range(st):
        lo = min(q, max(0, -(-(pw - p) // st)))
        spans.append((lo, min(q, max(lo, -(-(g.w + pw - p) // st)))))
    clo, chi = max(a for a, _ in spans), min(b for _, b in spans)
    chi = max(clo, chi)
    r_lo, r_hi = min(prow, ph), min(prow, max(ph, g.h + ph))
    dst = V("r") * pitch
    src = V("xbase") + (V("r") - ph) * g.w

    def put(p, jc):
        return L.Store(pad, dst + p * q + jc, L.Load(x, src + jc * st + (p - pw)))
    row = []
    for p, (lo, hi) in enumerate(spans):       # the columns of each phase outside the common span
        row += [L.for_("c", lo, clo, put(p, V("c"))), L.for_("c", chi, hi, put(p, V("c")))]
    # the common span: all phases in one loop (one interleaved read of the input row)
    row += _whole_vectors("c", clo, chi, lambda c: L.block(*[put(p, c) for p in range(st)]))
    copy = L.for_("r", r_lo, r_hi, L.block(*row))
    weights = [L.Local(f"w{kh}_{kw}", f32, L.Load(w, V("wbase") + kh * g.kw + kw))
               for kh in range(g.kh) for kw in range(g.kw)]
    ohw = g.oh * g.ow

    def block(rows: int, oh0: L.Expr, tag: str) -> L.Block:
        """``rows`` output rows from ``oh0``: one vector loop over the rounded width, then the
        copies of the valid columns."""
        ow = V(f"{tag}ow")
        nin = (rows - 1) * st + g.kh
        bases = [L.Local(f"{tag}rb{r}", "int64", (oh0 * st + r) * pitch) for r in range(nin)]
        # input row r feeds output row u through tap row r - u*st: each input vector is loaded
        # once and added into every row it feeds right away, two accumulator chains per row
        # (kw parity) -- loading them all first kept ~70 vectors live and spilled them
        accs = [f"{tag}a{u}_{c}" for u in range(rows) for c in range(2)]
        body: list = [L.Local(a, f32, zero) for a in accs]
        for r in range(nin):
            for kw in range(g.kw):
                xv = f"{tag}x{r}_{kw}"
                body.append(L.Local(xv, f32, L.Load(pad, V(f"{tag}rb{r}") + ((kw % st) * q + kw // st) + ow)))
                for u in range(rows):
                    kh = r - u * st
                    if 0 <= kh < g.kh:
                        a = f"{tag}a{u}_{kw % 2}"
                        body.append(L.Assign(a, V(a, f32) + V(xv, f32) * V(f"w{kh}_{kw}", f32)))
        for u in range(rows):
            acc = V(f"{tag}a{u}_0", f32) + V(f"{tag}a{u}_1", f32)
            body += _epilogue(d, acc, ops, tmps, ow + u * owr, t, f"{tag}e{u}_")
        cw = V(f"{tag}cw")
        copies = [lp for u in range(rows) for o, y in zip(outs, tmps) for lp in _whole_vectors(
            f"{tag}cw", 0, g.ow, lambda cw, u=u, o=o, y=y: L.Store(o, t * ohw + (oh0 + u) * g.ow + cw,
                                                                   L.Load(y, u * owr + cw)))]
        return L.block(*bases, L.for_(f"{tag}ow", 0, owr, L.block(*body), "vector"), *copies)

    nb = g.oh // ROWS
    rows = [L.for_("ob", 0, nb, block(ROWS, V("ob") * ROWS, "b"), "serial")] if nb else []
    rows += [block(1, L.Const(nb * ROWS + r), f"r{r}") for r in range(g.oh - nb * ROWS)]
    plane = L.block(
        L.Local("img", "int64", t // d.cout),
        L.Local("co", "int64", t % d.cout),
        L.Local("xbase", "int64", (V("img") * g.c + V("co")) * (g.h * g.w)),
        L.Local("wbase", "int64", V("co") * (g.kh * g.kw)),
        copy, *weights, *rows, *squeeze)
    zero_fill = L.for_("z", 0, pad.size, L.Store(pad, V("z"), zero), "vector")
    loops = L.block(pad, *tmps, zero_fill, L.for_("t", 0, g.n * d.cout, plane, "parallel"))
    return L.Kernel(d.name, (w, x, *ops, *outs, *sq_outs), loops, "t", g.n * d.cout)
