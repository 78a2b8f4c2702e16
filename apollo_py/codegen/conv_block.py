"""Direct conv over blocks of output rows and channels: stems (few input channels, dense).

A network's stem (MobileNetV3's 3 -> 16, EfficientNet's and RegNetY's 3 -> 32 channels, 3x3 at
stride 2 over a 224x224 image: 11-22 MFLOP) ran as the implicit GEMM: ``K = 27`` im2col rows
packed per call for a 16- or 32-row weight, 6-11% of the machine's peak (0.24-0.42 ms on the
quiet box).  The plane kernel of ``conv_direct.py`` would copy the whole padded input once per
output channel.  Here one parallel iteration is a block of ``R`` output rows of one image and
group:

* the rows of the group's input planes the block's taps read are copied once into a
  zero-padded, phase-split stack scratch (stride ``s``: padded row ``r``, column ``c`` in
  sub-plane ``(r % s, c % s)`` at ``(r // s, c // s)``, as the flat form of ``conv_direct``),
  so that every tap reads its sub-plane at unit stride;
* for each block of ``CB`` output channels and each output row, one ``vector`` loop over output
  columns computes all ``CB`` channels: the input vectors of the ``Cin/group x kh x kw`` taps
  are loaded once and multiplied into ``CB`` accumulators (tap weights are loop-invariant
  broadcasts), then each channel's epilogue chain runs and its outputs are stored.

Chosen (``layers/gemm_lowering._direct_conv``) for dense convs of at most ``MAX_CIN`` input
channels whose per-output sum has at most ``MAX_TAPS`` terms and whose kernel is larger than 1x1.
"""
from __future__ import annotations

from math import prod

from apollo_py.codegen import loopir as L

#: output rows per parallel iteration (fewer when the output has fewer rows)
ROWS = 8
#: output channels computed together in one vector loop: their accumulators stay in registers
#: (16 of the 32 zmm registers) while the tap input vectors are loaded once for all of them
CHANNELS = 16
#: output columns per vector loop (one 16-lane vector; see block_kernel)
COLS = 16
#: dense convs with at most this many input channels per group take this kernel
MAX_CIN = 4
#: terms of one output's unrolled sum, and the block's padded rows on the stack: the bounds of
#: conv_direct's plane kernels (this module does not import conv_direct, which dispatches here)
MAX_TAPS = 64
SCRATCH_BYTES = 256 * 1024


def channel_block(cgo: int) -> int:
    """Output channels per vector loop: the largest divisor of ``cgo`` up to :data:`CHANNELS`."""
    return max(b for b in range(1, min(cgo, CHANNELS) + 1) if cgo % b == 0)


def rows_per_block(oh: int) -> int:
    return min(ROWS, oh)


def geometry(g) -> tuple:
    """``(R, nblk, RQ, Q)``: output rows per block, blocks per plane, and the rows and columns of
    one phase sub-plane of a block's padded input copy."""
    sh, sw = g.strides
    dh, dw = g.dilations
    r = rows_per_block(g.oh)
    return r, -(-g.oh // r), r + ((g.kh - 1) * dh) // sh, g.ow + ((g.kw - 1) * dw) // sw


def scratch_floats(g) -> int:
    r, _, rq, q = geometry(g)
    return (g.c // g.group) * g.strides[0] * g.strides[1] * rq * q


def block_kernel(d, w, x, ops, outs, epilogue, tree_sum) -> L.Kernel:
    """The kernel of :class:`~apollo_py.codegen.conv_direct.DirectConvDesc` ``d`` in block form:
    params ``(w, x, operands..., outputs...)``, parallel over ``image * group * blocks``;
    ``epilogue`` and ``tree_sum`` are conv_direct's ``_epilogue`` and ``_tree_sum``."""
    _epilogue, _tree_sum = epilogue, tree_sum
    g = d.conv
    cgi, cgo = g.c // g.group, d.cout // g.group
    sh, sw = g.strides
    ph, pw = g.pads
    dh, dw = g.dilations
    R, nblk, RQ, Q = geometry(g)
    CB = channel_block(cgo)
    V = L.Var
    f32 = "float32"
    zero = L.Const(0.0, f32)
    t = V("t")
    pad = L.Alloc("xpad", f32, scratch_floats(g))

    # copy: sub-plane (ci, pr, pc) row i holds input row (oh0 + i) * sh + pr - ph, column
    # jc * sw + pc - pw (zero outside the image)
    per_row = []
    for pr in range(sh):
        body = [L.Local(f"ih{pr}", "int64", (V("oh0") + V("i")) * sh + (pr - ph)),
                L.Local(f"ok{pr}", "bool", L.land(L.ge(V(f"ih{pr}"), 0), L.lt(V(f"ih{pr}"), g.h))),
                L.Local(f"src{pr}", "int64", V("xbase") + (V("ci") * g.h + L.minimum(L.maximum(V(f"ih{pr}"), 0),
                                                                                     g.h - 1)) * g.w)]
        for pc in range(sw):
            dst = (((V("ci") * sh + pr) * sw + pc) * RQ + V("i")) * Q
            lo = min(Q, max(0, -(-(pw - pc) // sw)))          # jc*sw + pc - pw >= 0
            hi = min(Q, max(lo, -(-(g.w + pw - pc) // sw)))   # jc*sw + pc - pw < W
            body += [L.for_("jc", 0, lo, L.Store(pad, dst + V("jc"), zero), "vector"),
                     L.for_("jc", lo, hi, L.Store(pad, dst + V("jc"), L.Select(
                         V(f"ok{pr}", "bool"), L.Load(x, V(f"src{pr}") + V("jc") * sw + (pc - pw)), zero)), "vector"),
                     L.for_("jc", hi, Q, L.Store(pad, dst + V("jc"), zero), "vector")]
        per_row.append(L.block(*body))
    copy = L.for_("ci", 0, cgi, L.for_("i", 0, RQ, L.block(*per_row)))

    # compute: output (oh0 + r, ow) of channel co reads sub-plane (kh*dh % sh, kw*dw % sw) at
    # (r + kh*dh // sh, ow + kw*dw // sw)
    ntap = cgi * g.kh * g.kw
    taps = [(ci, kh, kw) for ci in range(cgi) for kh in range(g.kh) for kw in range(g.kw)]
    r = V("r")

    def cols_loop(ow0, n: int, var: str):
        """The vector loop over output columns ``ow0 + [0, n)`` computing the CB channels."""
        ow = ow0 + V(var)
        xv = {tp: L.Load(pad, (((tp[0] * sh + tp[1] * dh % sh) * sw + tp[2] * dw % sw) * RQ + r + tp[1] * dh // sh) * Q
                         + ow + tp[2] * dw // sw) for tp in taps}
        stmts = []
        for k in range(CB):
            co = V("cob") + k
            acc = _tree_sum([xv[tp] * L.Load(w, co * ntap + q) for q, tp in enumerate(taps)])
            stmts += _epilogue(d, acc, ops, outs, V("img") * d.cout + co, (V("oh0") + r) * g.ow + ow,
                               prefix=f"c{k}_")
        return L.for_(var, 0, n, L.block(*stmts), "vector")

    # columns in groups of COLS: a row as one loop of constant trip count 32-128 would be
    # interleaved by the printer (llvm.loop_metadata), multiplying the CB accumulators past the
    # registers; interleaving 2 vectors (COLS = 32, each weight broadcast feeding two FMAs) measured
    # 1.15-1.2x the time of one (3 -> 16 / 32 channels, 3x3 s2 at 224^2, one thread, load ~2.5):
    # the loop is bound by its FMAs, not by the broadcasts; the rest of a row in one loop
    nfull, rest = divmod(g.ow, COLS)
    row = [L.for_("ob", 0, nfull, cols_loop(V("ob") * COLS, COLS, "c"))] if nfull else []
    if rest:
        row.append(cols_loop(L.Const(nfull * COLS), rest, "c2"))
    rows = L.for_("r", 0, V("nrows"), L.block(*row))
    chans = L.for_("cb", 0, cgo // CB, L.block(L.Local("cob", "int64", V("grp") * cgo + V("cb") * CB), rows))
    plane = L.block(
        L.Local("img", "int64", t // (g.group * nblk)),
        L.Local("grp", "int64", t // nblk % g.group),
        L.Local("oh0", "int64", t % nblk * R),
        L.Local("nrows", "int64", L.minimum(g.oh - V("oh0"), R)),
        L.Local("xbase", "int64", (V("img") * g.c + V("grp") * cgi) * (g.h * g.w)),
        copy, chans)
    ext = g.n * g.group * nblk
    return L.Kernel(d.name, (w, x, *ops, *outs), L.block(pad, L.for_("t", 0, ext, plane, "parallel")), "t", ext)


def block_form(g, cout: int) -> bool:
    """Whether a conv of geometry ``g`` with ``cout`` outputs takes the block kernel: a dense conv
    (one group) of at most :data:`MAX_CIN` input channels, a kernel larger than 1x1, at most
    :data:`MAX_TAPS` terms per output and a block scratch within :data:`SCRATCH_BYTES`."""
    if g.group != 1 or g.c > MAX_CIN or g.kh * g.kw <= 1 or g.c * g.kh * g.kw > MAX_TAPS:
        return False
    return 4 * scratch_floats(g) <= SCRATCH_BYTES and prod((g.n, g.oh, g.ow, cout)) > 0
