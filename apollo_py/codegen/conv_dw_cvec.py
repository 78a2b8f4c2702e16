"""Channel-vector direct kernel of a depthwise conv on small planes (7x7 outputs), epilogue fused.

MobileNetV3-large and EfficientNet-B0 keep their widest layers (672-1152 channels) at 7x7, where
conv_direct.py's flat form computes 80 points (5 vectors) of the 11 x 11 padded plane per 49
outputs of a 5x5 conv, and copies 7-column rows in and out with scalar loops: 100-120 us for
EfficientNet's 1152-channel 5x5 convs on the quiet box (onnxruntime's NCHWc conv 37 us + 11 us
for the SiLU).  Here one parallel iteration is a block of :data:`CV` = 16 channels of one image
and the vector lanes are the channels:

* the block's input planes are copied pixel by pixel into a channel-interleaved zero-padded
  scratch ``xcv[row][col][16]`` (one 16-lane gather from the 16 planes per pixel; the padding is
  zeroed once per call);
* the ``kh * kw`` tap weights of the 16 channels are gathered once into ``wcv[tap][16]``;
* every output pixel is one 16-lane tap sum of contiguous scratch vectors (no padding columns
  computed, any stride), then the epilogue (per-channel operands) into ``ycv[pixel][16]``;
* a fused squeeze sums the block's pixels per lane (16 channels at once);
* each channel's plane is copied out of ``ycv`` (a gather at stride 16 per 16 pixels).

Used for depthwise convs at stride 1 with a multiple of 16 channels, at least :data:`MIN_TAPS`
taps and at most :data:`MAX_PIXELS` output pixels (:func:`applies`); the row-blocked kernel
(conv_dw_rows.py) keeps wider rows, the flat form 3x3 and strided convs on 7x7 planes.
"""
from __future__ import annotations

from math import prod

from apollo_py.codegen import loopir as L

#: switch for A/B runs in one process (benchmarks); part of the direct conv's cache key
ENABLED = True
CV = 16              # channels per block: the vector lanes
MAX_PIXELS = 49      # output pixels per plane (7x7)
#: 5x5 and larger at stride 1: the transposes in and out are LLVM gathers (the loop IR has no
#: shuffles), which the tap sum repays only there.  Per step, min of 7 profiles, this / the flat
#: form (shared box, load ~9), with SiLU or HardSwish and the squeeze: 5x5 1152ch 0.81, 960ch
#: 0.83; 3x3 1152ch 0.98; 5x5 stride 2 672ch 14 -> 7 1.09
MIN_TAPS = 25
SCRATCH_BYTES = 256 * 1024


def applies(d) -> bool:
    """Whether ``d`` (a DirectConvDesc) runs on this kernel: depthwise with a multiple of
    :data:`CV` channels, stride 1, at least :data:`MIN_TAPS` taps, at most :data:`MAX_PIXELS`
    output pixels, no excitation, no tuning
    decision for conv_direct.py's forms (``d.form``), epilogue operands constant along H and W,
    float epilogue values, the scratch within :data:`SCRATCH_BYTES`."""
    g = d.conv
    if not ENABLED or g.c // g.group != 1 or d.cout != g.c or g.c % CV or d.form or d.excite is not None:
        return False
    if g.oh * g.ow > MAX_PIXELS or g.kh * g.kw < MIN_TAPS or tuple(g.strides) != (1, 1):
        return False
    if any(any(s != 1 for s in o.shape[-2:]) for o in d.operands if len(o.shape) >= 2):
        return False
    if not all(L.is_float(L.compute_dtype(dt)) for dt in (*d.node_dtypes, *d.out_dtypes)):
        return False
    return (prod(_padded(g)) + g.kh * g.kw + g.oh * g.ow * len(d.out_dtypes)) * CV * 4 <= SCRATCH_BYTES


def _padded(g) -> tuple[int, int]:
    """Rows and columns of the zero-padded input plane the taps read (conv_direct.padded_plane)."""
    return ((g.oh - 1) * g.strides[0] + (g.kh - 1) * g.dilations[0] + 1,
            (g.ow - 1) * g.strides[1] + (g.kw - 1) * g.dilations[1] + 1)


def dw_cvec_kernel(d, w, x, ops, outs, sq_outs, epilogue, tree_sum) -> L.Kernel:
    """The loop-IR kernel of ``d`` (``applies(d)`` holds): params ``(w, x, operands...,
    outputs..., squeeze rows...)`` as conv_direct.direct_conv_kernel's; ``epilogue`` and
    ``tree_sum`` are conv_direct's (passed in: conv_direct imports this module)."""
    from apollo_py.codegen.scalar_ops import scalar_op
    g = d.conv
    sh, sw = g.strides
    ph, pw = g.pads
    dh, dw = g.dilations
    prow, pcol = _padded(g)
    hw, ohw, kk = g.h * g.w, g.oh * g.ow, g.kh * g.kw
    nb = g.c // CV
    V = L.Var
    f32 = "float32"
    zero = L.Const(0.0, f32)
    t, ci = V("t"), V("ci")
    xs = L.Alloc("xcv", f32, prow * pcol * CV)
    ws = L.Alloc("wcv", f32, kk * CV)
    ys = [L.Alloc(f"ycv{q}", dt, ohw * CV) for q, dt in enumerate(d.out_dtypes)]
    r_lo, r_hi = min(g.h, max(0, -ph)), max(min(g.h, max(0, -ph)), min(g.h, prow - ph))
    c_lo, c_hi = min(g.w, max(0, -pw)), max(min(g.w, max(0, -pw)), min(g.w, pcol - pw))
    copy = L.for_("ih", r_lo, r_hi, L.for_("iw", c_lo, c_hi, L.for_(
        "ci", 0, CV, L.Store(xs, ((V("ih") + ph) * pcol + V("iw") + pw) * CV + ci,
                             L.Load(x, V("xbase") + ci * hw + V("ih") * g.w + V("iw"))), "vector")))
    wcopy = L.for_("k", 0, kk, L.for_("ci", 0, CV, L.Store(ws, V("k") * CV + ci,
                                                           L.Load(w, (V("c0") + ci) * kk + V("k"))), "vector"))
    oh, ow = V("oh"), V("ow")
    acc = tree_sum([L.Load(xs, ((oh * sh + kh * dh) * pcol + ow * sw + kw * dw) * CV + ci)
                     * L.Load(ws, L.Const((kh * g.kw + kw) * CV) + ci)
                     for kh in range(g.kh) for kw in range(g.kw)])
    row = V("img") * g.c + V("c0") + ci
    pix = (oh * g.ow + ow) * CV + ci
    compute = L.for_("oh", 0, g.oh, L.for_("ow", 0, g.ow, L.for_(
        "ci", 0, CV, L.block(*epilogue(d, acc, ops, ys, row, L.Const(0), at=pix)), "vector")))
    tail = []
    if d.squeeze is not None:
        sq = d.squeeze
        src = ys[d.outputs.index(sq.value)]
        lanes = L.Alloc("sqcv", f32, CV)
        env: dict = {sq.reduce: L.Load(lanes, ci), **sq.inline_consts}
        stmts = []
        for q, n in enumerate(sq.nodes):
            e = scalar_op(n, [env[v] for v in n.inputs], [], sq.node_dtypes[q])
            stmts.append(L.Local(f"sq{q}", e.dtype, e))
            env[n.outputs[0]] = L.Var(f"sq{q}", e.dtype)
        stmts += [L.Store(o, row, env[v]) for o, v in zip(sq_outs, sq.outputs)]
        tail = [lanes, L.for_("ci", 0, CV, L.Store(lanes, ci, zero), "vector"),
                L.for_("p", 0, ohw, L.for_("ci", 0, CV, L.Store(lanes, ci, L.Load(lanes, ci)
                                                                + L.Load(src, V("p") * CV + ci)), "vector")),
                L.for_("ci", 0, CV, L.block(*stmts), "vector")]
    out_copy = [L.for_("ci", 0, CV, L.for_("p", 0, ohw, L.Store(o, (V("img") * g.c + V("c0") + ci) * ohw + V("p"),
                                                                L.Load(y, V("p") * CV + ci)), "vector"))
                for o, y in zip(outs, ys)]
    block = L.block(
        L.Local("img", "int64", t // nb),
        L.Local("c0", "int64", (t % nb) * CV),
        L.Local("xbase", "int64", (V("img") * g.c + V("c0")) * hw),
        copy, wcopy, compute, *tail, *out_copy)
    zero_fill = L.for_("z", 0, xs.size, L.Store(xs, V("z"), zero), "vector")
    loops = L.block(xs, ws, *ys, zero_fill, L.for_("t", 0, g.n * nb, block, "parallel"))
    return L.Kernel(d.name, (w, x, *ops, *outs, *sq_outs), loops, "t", g.n * nb)
