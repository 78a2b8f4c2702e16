"""Direct (no GEMM) kernel of a depthwise or narrow grouped 2-D conv, epilogue fused.

A depthwise conv as implicit GEMM is one ``1 x OH*OW x kh*kw`` product per channel: the
micro-tile (12 or 8 rows) is filled by one row, and packing dominates (MobileNetV3's 3x3 and
5x5 depthwise convs ran at 1-5 GFLOP/s).  Here each output plane is computed straight from the
NCHW input, vectorised over output columns:

* parallel over output planes ``t = image * Cout + co``;
* per output row ``oh``: every tap's weight is loaded once into a scalar, zeroed when the tap's
  input row ``oh*sh - ph + kh*dh`` lies in the padding (so the row address is clamped and the
  vector loop has no per-element test);
* the output columns split in three: the interior ``[lo, hi)`` where every ``kw`` tap reads
  inside the image (a ``vector`` loop of affine loads -- contiguous at stride 1, strided
  otherwise), and the left and right borders as scalar loops with clamped, selected loads;
* the sum over the ``Cin/group x kh x kw`` taps is unrolled into one expression, then the
  micro-graph's elementwise epilogue (the same scalar lowering as the GEMM's) runs on it and
  every output value the step must produce is stored.

:data:`MAX_TAPS` bounds the unrolled sum; wider groups stay on the implicit GEMM.

A 1x1 conv of a 1x1 image (the squeeze-excitation convs of MobileNetV3 / EfficientNet /
RegNetY) is a matrix-vector product; as implicit GEMM its one column filled a 32-column
micro-tile (1.5-2 GFLOP/s).  :func:`is_matvec` convs get a kernel parallel over output
channels, each a 16-lane dot product of a contiguous weight row with the input vector.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from math import prod

import numpy as np

from apollo_py.codegen import loopir as L
from apollo_py.codegen.gemm import ConvGeom, _operand_index, epilogue_locals
from apollo_py.errors import CompileError

MAX_TAPS = 64          # Cin/group * kh * kw unrolled per output element
SCRATCH_BYTES = 256 * 1024   # padded input planes of one group on the stack (else border loops)
#: output rows at least this wide keep the row form: LLVM vectorises them at 8-16 lanes.  With the
#: padding zeroed once per call (thread CPU time, one thread, load ~16), flat / row form: 56-wide
#: outputs 0.79 (dw7 96ch), 0.88 (dw3 s2 64ch from 112), 0.92 (dw3 s2 96ch), 0.93-1.0 (dw3 72 /
#: 144ch); 112-wide 1.11 (dw3 32ch).  (Before, with zero runs per plane, MobileNetV3's per-step
#: profile had the flat form at 1.1x for 56 and 112 wide rows and 3.9x at 64 channels 112x112 s2)
FLAT_MAX_OW = 64
#: the flat form's loop runs whole 16-lane vectors; its scratch has this many floats of slack
FLAT_SLACK = 16
MATVEC_CHUNK_MACS = 32768    # least multiply-adds per thread-pool chunk of a matrix-vector conv
#: a direct conv moving fewer bytes (input, weight, outputs, excitation) runs on the calling
#: thread: a pool dispatch costs ~35 us before any work (machine.py), and these kernels run near
#: the memory roof on one core
INLINE_BYTES = 2 << 20


@dataclass(frozen=True)
class Squeeze:
    """The global sum over H, W of the stored epilogue value ``value`` (one output plane per
    parallel iteration, summed right after it is written), named ``reduce``, then the
    row-space ``nodes`` (e.g. the ``div`` of a mean, scalar constants ``inline_consts``);
    ``outputs`` (``out_dtypes``, ``out_shapes``) are the row values stored, one element per
    (image, channel) in that order."""

    value: str
    reduce: str
    nodes: tuple = ()
    outputs: tuple = ()
    out_dtypes: tuple = ()
    out_shapes: tuple = ()
    node_dtypes: tuple = ()
    inline_consts: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Excite:
    """The excitation ``output = operand * value`` of a squeeze-excitation block fused into the
    matrix-vector conv computing the gate ``value`` (one per (image, channel)): each parallel
    iteration scales its channel's plane of ``hw`` elements of epilogue operand ``operand``."""

    value: str
    operand: str
    output: str
    shape: tuple
    dtype: str = "float32"
    #: the product is written over the operand's buffer (``output`` then lives in the operand's
    #: arena slot: runtime/cpu.py), not into a buffer of its own -- set by
    #: layers/conv_squeeze.excite_in_place where nothing reads the operand afterwards
    inplace: bool = False

    @property
    def hw(self) -> int:
        return prod(self.shape[2:])


@dataclass(frozen=True)
class DirectConvDesc:
    """One direct conv: ``geom`` (input, kernel, output geometry), ``cout`` output channels,
    then the epilogue fields of :class:`~apollo_py.codegen.gemm.GemmDesc` (same meaning)."""

    name: str
    conv: ConvGeom
    cout: int
    out_shape: tuple
    head: str
    nodes: tuple = ()
    operands: tuple = ()
    outputs: tuple = ()
    out_dtypes: tuple = ()
    node_dtypes: tuple = ()
    inline_consts: dict = field(default_factory=dict)
    squeeze: Squeeze | None = None     # a fused global-average-pool squeeze (layers/conv_squeeze.py)
    excite: Excite | None = None       # a fused excitation multiply (matrix-vector convs only)
    form: str = ""     # "flat" / "row": a tuning decision overriding FLAT_MAX_OW (tuning/convs.py)

    def extra_outputs(self) -> tuple:
        """``(name, shape, dtype)`` of the values stored besides ``outputs`` (squeeze rows, the
        excitation), in kernel parameter order after the outputs."""
        sq, ex = self.squeeze, self.excite
        rows = tuple(zip(sq.outputs, sq.out_shapes, sq.out_dtypes)) if sq is not None else ()
        return rows + (((ex.output, ex.shape, ex.dtype),) if ex is not None and not ex.inplace else ())

    # the GEMM view's sizes, for flop counts in profiles and plan text
    @property
    def batch(self) -> int:
        return self.conv.n * self.conv.group

    @property
    def m(self) -> int:
        return self.cout // self.conv.group

    @property
    def n(self) -> int:
        return self.conv.oh * self.conv.ow

    @property
    def k(self) -> int:
        return self.conv.c // self.conv.group * self.conv.kh * self.conv.kw


def taps(g: ConvGeom) -> int:
    """Terms of one output element's sum."""
    return g.c // g.group * g.kh * g.kw


def interior(g: ConvGeom) -> tuple[int, int]:
    """Output columns ``[lo, hi)`` whose every ``kw`` tap reads a column inside the image."""
    sw, pw, dw = g.strides[1], g.pads[1], g.dilations[1]
    lo, hi = 0, g.ow
    for kw in range(g.kw):
        off = kw * dw - pw
        lo = max(lo, -(-(-off) // sw))                  # ow*sw + off >= 0
        hi = min(hi, -(-(g.w - off) // sw))             # ow*sw + off < W
    lo = min(lo, g.ow)
    return lo, max(lo, hi)


def moved_bytes(d: "DirectConvDesc") -> int:
    """Bytes a direct conv reads and writes at least: input, weight, each stored output (and
    the excitation's operand and product), float32."""
    g = d.conv
    out = g.n * d.cout * g.oh * g.ow * max(1, len(d.outputs))
    ex = 2 * g.n * d.cout * d.excite.hw if d.excite is not None else 0
    return 4 * (g.n * g.c * g.h * g.w + d.cout * taps(g) + out + ex)


def is_matvec(g: ConvGeom) -> bool:
    """A 1x1 conv of a 1x1 image (squeeze-excitation blocks): per image a matrix-vector
    product, one output element per weight row."""
    return g.h == g.w == g.kh == g.kw == g.oh == g.ow == 1


def _epilogue(d: DirectConvDesc, acc: L.Expr, ops, outs, row: L.Expr, col: L.Expr, at: L.Expr | None = None,
              env_out: dict | None = None, prefix: str = "") -> list:
    """Statements computing the epilogue chain on ``acc`` (the conv's value at output row
    ``row`` = image * Cout + channel, column ``col`` = oh * OW + ow) and storing the outputs
    (at ``at`` instead of the output element's index when given: the flat form's scratch);
    ``prefix`` keeps the locals of several channels' chains in one loop body apart."""
    stmts, env = epilogue_locals(d, acc, ops, lambda o: _operand_index(o, d.out_shape, 2, row, col), prefix)
    if env_out is not None:
        env_out.update(env)
    lin = row * (d.conv.oh * d.conv.ow) + col if at is None else at
    return stmts + [L.Store(outs[q], lin, env[v]) for q, v in enumerate(d.outputs)]


def _squeeze(d: DirectConvDesc, outs, sq_outs, t: L.Expr) -> list:
    """Statements summing output plane ``t`` of the squeezed value (just stored into its output
    buffer, so the reads hit cache) in 16 lanes, applying the squeeze's row-space nodes and
    storing its row values at index ``t``; none without a squeeze."""
    sq = d.squeeze
    if sq is None:
        return []
    from apollo_py.codegen.scalar_ops import scalar_op
    from apollo_py.codegen.templates import lane_reduce
    ohw = d.conv.oh * d.conv.ow
    src = outs[d.outputs.index(sq.value)]
    stmts, acc = lane_reduce("sq", "sum", "float32", 0, ohw, lambda r: L.Load(src, t * ohw + r))
    env: dict = {sq.reduce: acc, **sq.inline_consts}
    for q, n in enumerate(sq.nodes):
        e = scalar_op(n, [env[v] for v in n.inputs], [], sq.node_dtypes[q])
        stmts.append(L.Local(f"sq{q}", e.dtype, e))
        env[n.outputs[0]] = L.Var(f"sq{q}", e.dtype)
    return stmts + [L.Store(sq_outs[q], t, env[v]) for q, v in enumerate(sq.outputs)]


def _matvec_kernel(d: DirectConvDesc, w, x, ops, outs) -> L.Kernel:
    """Parallel over output elements ``t = image * Cout + co``: a 16-lane dot product of weight
    row ``co`` (contiguous) with the image's group channels (contiguous), then the epilogue."""
    from apollo_py.codegen.templates import lane_reduce
    g = d.conv
    cgi, cgo = g.c // g.group, d.cout // g.group
    t = L.Var("t")
    head = [L.Local("img", "int64", t // d.cout), L.Local("co", "int64", t % d.cout)]
    xb = L.Var("img") * g.c + (L.Var("co") // cgo) * cgi
    stmts, acc = lane_reduce("acc", "sum", "float32", 0, cgi,
                             lambda r: L.Load(w, L.Var("co") * cgi + r) * L.Load(x, xb + r))
    env: dict = {}
    body = [*head, *stmts, *_epilogue(d, acc, ops, outs, t, L.Const(0), env_out=env)]
    extra = []
    if d.excite is not None:
        ex = d.excite
        src = ops[[o.value for o in d.operands].index(ex.operand)]
        # in place: each element is read and then written at the same index by one iteration
        # (no second parameter aliasing the operand: the impl's pointers are noalias)
        extra = [] if ex.inplace else [L.Param("excite", ex.dtype, prod(ex.shape))]
        dst = src if ex.inplace else extra[0]
        jv = L.Var("j")
        body.append(L.for_("j", 0, ex.hw, L.Store(dst, t * ex.hw + jv,
                                                  L.Load(src, t * ex.hw + jv) * env[ex.value]), "vector"))
    return L.Kernel(d.name, (w, x, *ops, *outs, *extra), L.for_("t", 0, g.n * d.cout, L.block(*body), "parallel"),
                    "t", g.n * d.cout)


def direct_conv_kernel(d: DirectConvDesc) -> L.Kernel:
    """The loop-IR kernel of ``d``: params ``(w, x, operands..., outputs...)``."""
    g = d.conv
    cgi, cgo = g.c // g.group, d.cout // g.group
    sh, sw = g.strides
    ph, pw = g.pads
    dh, dw = g.dilations
    hw, ohw = g.h * g.w, g.oh * g.ow
    w = L.Param("w", "float32", d.cout * cgi * g.kh * g.kw)
    x = L.Param("x", "float32", g.n * g.c * hw)
    ops = [L.Param(f"in{q}", o.dtype, max(1, prod(o.shape))) for q, o in enumerate(d.operands)]
    outs = [L.Param(f"out{q}", dt, prod(d.out_shape)) for q, dt in enumerate(d.out_dtypes)]
    if is_matvec(g):
        return _matvec_kernel(d, w, x, ops, outs)
    sq_outs = [L.Param(f"row{q}", dt, g.n * d.cout) for q, dt in
               enumerate(d.squeeze.out_dtypes if d.squeeze is not None else ())]
    from apollo_py.codegen import conv_dw_cvec, conv_dw_rows
    if conv_dw_cvec.applies(d):     # depthwise on 7x7 planes: 16 channels per vector (conv_dw_cvec.py)
        return conv_dw_cvec.dw_cvec_kernel(d, w, x, ops, outs, sq_outs, _epilogue, _tree_sum)
    if conv_dw_rows.applies(d):     # depthwise at strides 1 and 2: row-blocked (conv_dw_rows.py)
        return conv_dw_rows.dw_rows_kernel(d, w, x, ops, outs, sq_outs, _squeeze(d, outs, sq_outs, L.Var("t")))
    from apollo_py.codegen.conv_block import block_form, block_kernel
    if block_form(g, d.cout) and d.squeeze is None:
        return block_kernel(d, w, x, ops, outs, _epilogue, _tree_sum)
    if cgi * prod(padded_plane(g)) * 4 <= SCRATCH_BYTES:
        return _padded_kernel(d, w, x, ops, outs, sq_outs)
    V = L.Var
    f32 = "float32"
    zero = L.Const(0.0, f32)
    t, oh, ow = V("t"), V("oh"), V("ow")

    per_row = [L.Local(f"ih{kh}", "int64", oh * sh - ph + kh * dh) for kh in range(g.kh)]
    for kh in range(g.kh):
        ih = V(f"ih{kh}")
        per_row += [L.Local(f"ok{kh}", "bool", L.land(L.ge(ih, 0), L.lt(ih, g.h))),
                    L.Local(f"r{kh}", "int64", V("xbase") + L.minimum(L.maximum(ih, 0), g.h - 1) * g.w)]
    for ci in range(cgi):
        for kh in range(g.kh):
            for kw in range(g.kw):
                widx = V("wbase") + ((ci * g.kh + kh) * g.kw + kw)
                per_row.append(L.Local(f"w{ci}_{kh}_{kw}", f32,
                                       L.Select(V(f"ok{kh}", "bool"), L.Load(w, widx), zero)))

    def body(border: bool) -> L.Block:
        acc = None
        for ci in range(cgi):
            for kh in range(g.kh):
                for kw in range(g.kw):
                    iw = ow * sw + (kw * dw - pw)
                    row = V(f"r{kh}") + ci * hw
                    if border:
                        v = L.Select(L.land(L.ge(iw, 0), L.lt(iw, g.w)),
                                     L.Load(x, row + L.minimum(L.maximum(iw, 0), g.w - 1)), zero)
                    else:
                        v = L.Load(x, row + iw)
                    term = v * V(f"w{ci}_{kh}_{kw}", f32)
                    acc = term if acc is None else acc + term
        stmts = _epilogue(d, acc, ops, outs, t, oh * g.ow + ow)
        return L.block(*stmts)

    lo, hi = interior(g)
    row_loop = L.block(*per_row,
                       L.for_("ow", 0, lo, body(True), "serial"),
                       L.for_("ow", lo, hi, body(False), "vector"),
                       L.for_("ow", hi, g.ow, body(True), "serial"))
    plane = L.block(
        L.Local("img", "int64", t // d.cout),
        L.Local("co", "int64", t % d.cout),
        L.Local("xbase", "int64", (V("img") * g.c + (V("co") // cgo) * cgi) * hw),
        L.Local("wbase", "int64", V("co") * (cgi * g.kh * g.kw)),
        L.for_("oh", 0, g.oh, row_loop, "serial"),
        *_squeeze(d, outs, sq_outs, t))
    loops = L.for_("t", 0, g.n * d.cout, plane, "parallel")
    return L.Kernel(d.name, (w, x, *ops, *outs, *sq_outs), loops, "t", g.n * d.cout)


def _tree_sum(terms: list, chains: int = 4) -> L.Expr:
    """``sum(terms)`` as ``chains`` interleaved FMA chains added at the end: one chain of 49
    dependent FMAs (a 7x7 tap sum) is latency-bound at a few iterations per row."""
    parts: list = [None] * min(chains, len(terms))
    for q, term in enumerate(terms):
        c = q % len(parts)
        parts[c] = term if parts[c] is None else parts[c] + term
    while len(parts) > 1:
        parts = [parts[i] + parts[i + 1] if i + 1 < len(parts) else parts[i] for i in range(0, len(parts), 2)]
    return parts[0]


def padded_plane(g: ConvGeom) -> tuple[int, int]:
    """Rows and columns of the zero-padded input plane the taps read: ``(OH-1)*sh + (kh-1)*dh + 1``
    by the same for columns."""
    return ((g.oh - 1) * g.strides[0] + (g.kh - 1) * g.dilations[0] + 1,
            (g.ow - 1) * g.strides[1] + (g.kw - 1) * g.dilations[1] + 1)


def flat_form(d: DirectConvDesc) -> bool:
    """Whether the padded kernel runs its tap sum as one vector loop over the flattened padded
    plane (output rows narrower than :data:`FLAT_MAX_OW`; equal strides -- above 1 split into
    phase sub-planes, :func:`_phase_split`;
    epilogue operands constant along H, W; float epilogue values).

    A row loop of OW iterations is vectorised by LLVM at the widest factor dividing into it:
    4 lanes at OW = 28, 2 or none at 14 and 7 -- where MobileNet / EfficientNet keep most of
    their channels.  Flattened, output ``(oh, ow)`` is element ``oh * PW + ow`` of a loop
    over ``(OH - 1) * PW + OW`` points (``PW`` the padded row pitch) whose loads stay affine
    (``x_pad[j * s + kh * dh * PW + kw * dw]``): full vectors whatever OW is, at the cost of
    computing ``PW - OW`` padding columns per row, which the row copies after it skip.  The
    input scratch and one flat scratch per output must fit :data:`SCRATCH_BYTES` together."""
    g = d.conv
    s = g.strides[0]
    plane = s * s * prod(phase_plane(g)) if s > 1 else prod(padded_plane(g))
    if d.form == "row" or (g.ow >= FLAT_MAX_OW and d.form != "flat"):    # form: a tuning decision
        return False
    if s != g.strides[1] or (g.c // g.group + len(d.out_dtypes)) * plane * 4 > SCRATCH_BYTES:
        return False
    if any(any(s != 1 for s in o.shape[-2:]) for o in d.operands if len(o.shape) >= 2):
        return False
    return all(L.is_float(L.compute_dtype(dt)) for dt in (*d.node_dtypes, *d.out_dtypes))


def phase_plane(g: ConvGeom) -> tuple[int, int]:
    """Rows and columns of one phase sub-plane of a stride-``s`` conv's padded input plane:
    ``ceil(rows / s)`` by ``ceil(columns / s)``; there are ``s * s`` of them per channel."""
    prow, pcol = padded_plane(g)
    s = g.strides[0]
    return -(-prow // s), -(-pcol // s)


def _phase_split(d: DirectConvDesc, x):
    """``(scratch, copy, tap sum, row pitch)`` of the flat form at stride ``s > 1``.

    Padded row ``r``, column ``c`` of channel ``ci`` is stored in phase sub-plane
    ``(ci, r % s, c % s)`` at ``(r // s, c // s)``: a tap ``(kh, kw)`` of output ``(oh, ow)``
    reads row ``oh*s + kh*dh`` and column ``ow*s + kw*dw``, i.e. sub-plane
    ``(kh*dh % s, kw*dw % s)`` at ``(oh + kh*dh // s, ow + kw*dw // s)`` -- unit stride in the
    flat index ``oh * Q + ow`` (``Q`` the sub-plane's width).  The copy reads each input element
    once with stride ``s``; without the split every tap read with stride ``s`` (shuffles).
    The copy writes only the elements that hold input (the rest of the scratch is zeroed once
    per call, :func:`_padded_kernel`); the scratch has :data:`FLAT_SLACK` floats past its
    planes for the flat loop's last vector."""
    g = d.conv
    cgi = g.c // g.group
    s = g.strides[0]
    ph, pw = g.pads
    dh, dw = g.dilations
    rq, q = phase_plane(g)
    V = L.Var
    f32 = "float32"
    pad = L.Alloc("xpad", f32, cgi * s * s * rq * q + FLAT_SLACK)
    per_phase = []
    for pr in range(s):
        # sub-plane rows i whose input row i*s + pr - ph lies in [0, H)
        i_lo = min(rq, max(0, -(-(ph - pr) // s)))
        i_hi = min(rq, max(i_lo, -(-(g.h + ph - pr) // s)))
        src = V("xbase") + (V("ci") * g.h + V("i") * s + (pr - ph)) * g.w
        body = []
        for pc in range(s):
            dst = (((V("ci") * s + pr) * s + pc) * rq + V("i")) * q
            # sub-plane columns jc whose input column jc*s + pc - pw lies in [0, W)
            lo = min(q, max(0, -(-(pw - pc) // s)))
            hi = min(q, max(lo, -(-(g.w + pw - pc) // s)))
            body.append(L.for_("jc", lo, hi, L.Store(pad, dst + V("jc"), L.Load(x, src + V("jc") * s + (pc - pw))),
                               "vector"))
        per_phase.append(L.for_("i", i_lo, i_hi, L.block(*body)))
    copy = L.for_("ci", 0, cgi, L.block(*per_phase))
    j = V("j")
    acc = _tree_sum([L.Load(pad, (((ci * s + kh * dh % s) * s + kw * dw % s) * rq + kh * dh // s) * q
                            + kw * dw // s + j) * V(f"w{ci}_{kh}_{kw}", f32)
                     for ci in range(cgi) for kh in range(g.kh) for kw in range(g.kw)])
    return pad, copy, acc, q


def _padded_kernel(d: DirectConvDesc, w, x, ops, outs, sq_outs=()) -> L.Kernel:
    """Per output plane: copy the group's input planes into a zero-padded scratch (the padding is
    zeroed once per call, each plane copies only its input rows), then every output row is one
    vector loop of affine scratch loads -- no border cases, no per-element tests; the tap
    weights are scalars hoisted out of the plane."""
    g = d.conv
    cgi, cgo = g.c // g.group, d.cout // g.group
    sh, sw = g.strides
    ph, pw = g.pads
    dh, dw = g.dilations
    prow, pcol = padded_plane(g)
    V = L.Var
    f32 = "float32"
    zero = L.Const(0.0, f32)
    t, oh, ow = V("t"), V("oh"), V("ow")
    flat = flat_form(d)
    pad = L.Alloc("xpad", f32, cgi * prow * pcol + (FLAT_SLACK if flat else 0))
    # only the input's rows and columns are copied per plane: the padding is zeroed once per
    # call (each thread's scratch; nothing else writes there)
    r_lo, r_hi = min(g.h, max(0, -ph)), max(min(g.h, max(0, -ph)), min(g.h, prow - ph))
    c_lo, c_hi = min(g.w, max(0, -pw)), max(min(g.w, max(0, -pw)), min(g.w, pcol - pw))
    copy = L.for_("ci", 0, cgi, L.for_("ih", r_lo, r_hi, L.for_(
        "c", c_lo, c_hi, L.Store(pad, (V("ci") * prow + V("ih") + ph) * pcol + pw + V("c"),
                                 L.Load(x, V("xbase") + (V("ci") * g.h + V("ih")) * g.w + V("c"))), "vector")))
    weights = [L.Local(f"w{ci}_{kh}_{kw}", f32, L.Load(w, V("wbase") + ((ci * g.kh + kh) * g.kw + kw)))
               for ci in range(cgi) for kh in range(g.kh) for kw in range(g.kw)]
    allocs = [pad]
    if flat:
        j = V("j")
        if sw == 1:
            nflat = (g.oh - 1) * pcol + g.ow
            acc = _tree_sum([L.Load(pad, (ci * prow + kh * dh) * pcol + kw * dw + j) * V(f"w{ci}_{kh}_{kw}", f32)
                             for ci in range(cgi) for kh in range(g.kh) for kw in range(g.kw)])
        else:
            pad, copy, acc, pcol = _phase_split(d, x)
            allocs = [pad]
            nflat = (g.oh - 1) * pcol + g.ow
        # whole vectors: the points past the last output read the scratch's zeroed slack and are
        # dropped like the padding columns; a remainder of up to 15 points ran scalar (7x7 5x5:
        # 73 points, 4 vectors + 9 scalar tap sums and epilogues)
        nflat = -(-nflat // FLAT_SLACK) * FLAT_SLACK
        tmps = [L.Alloc(f"yflat{q}", dt, nflat) for q, dt in enumerate(d.out_dtypes)]
        allocs += tmps
        copies = [L.Store(o, t * (g.oh * g.ow) + oh * g.ow + ow, L.Load(y, oh * pcol + ow)) for o, y in zip(outs, tmps)]
        rows = L.block(L.for_("j", 0, nflat, L.block(*_epilogue(d, acc, ops, tmps, t, L.Const(0), at=j)), "vector"),
                       L.for_("oh", 0, g.oh, L.for_("ow", 0, g.ow, L.block(*copies), "vector")))
    else:
        acc = _tree_sum([L.Load(pad, (ci * prow + oh * sh + kh * dh) * pcol + ow * sw + kw * dw)
                         * V(f"w{ci}_{kh}_{kw}", f32)
                         for ci in range(cgi) for kh in range(g.kh) for kw in range(g.kw)])
        rows = L.for_("oh", 0, g.oh, L.for_("ow", 0, g.ow, L.block(*_epilogue(d, acc, ops, outs, t, oh * g.ow + ow)),
                                            "vector"))
    plane = L.block(
        L.Local("img", "int64", t // d.cout),
        L.Local("co", "int64", t % d.cout),
        L.Local("xbase", "int64", (V("img") * g.c + (V("co") // cgo) * cgi) * (g.h * g.w)),
        L.Local("wbase", "int64", V("co") * (cgi * g.kh * g.kw)),
        copy, *weights, rows, *_squeeze(d, outs, sq_outs, t))
    zero_fill = L.for_("z", 0, pad.size, L.Store(pad, V("z"), zero), "vector")
    loops = L.block(*allocs, zero_fill, L.for_("t", 0, g.n * d.cout, plane, "parallel"))
    return L.Kernel(d.name, (w, x, *ops, *outs, *sq_outs), loops, "t", g.n * d.cout)


#: a block-form conv (codegen/conv_block.py: stems) below this many flops runs on the calling
#: thread whatever it moves: EfficientNet's / RegNetY's 32-channel stems (21.7 MFLOP, 2.2 MB)
#: took 0.86 / 0.82 of the pool's time there (interleaved, load ~0.7)
BLOCK_INLINE_FLOPS = 32 << 20


def _small_block(d: DirectConvDesc) -> bool:
    from apollo_py.codegen.conv_block import block_form
    g = d.conv
    return (not is_matvec(g) and block_form(g, d.cout) and d.squeeze is None
            and 2 * g.n * d.cout * g.oh * g.ow * taps(g) < BLOCK_INLINE_FLOPS)


class CompiledDirectConv:
    """Machine code of a direct conv; ``run(pool, w, x, operands, outputs)`` like
    :class:`~apollo_py.codegen.gemm.CompiledGemm` (weight first, then the input)."""

    def __init__(self, desc: DirectConvDesc, compiled):
        self.desc = desc
        self.kernel = compiled
        self.ir = getattr(compiled, "ir", "")
        self.inline = moved_bytes(desc) < INLINE_BYTES or _small_block(desc)

    def run(self, pool, w: np.ndarray, x: np.ndarray, operands, outputs) -> None:
        g = self.desc.conv
        if self.inline or pool is None:
            self.kernel([w, x, *operands, *outputs])
            return
        # a matrix-vector product runs on the calling thread up to MATVEC_CHUNK_MACS per chunk:
        # the squeeze-excitation products (10-60K multiply-adds, a few microseconds) cost more
        # to hand to the pool's threads than to compute
        work = g.c // g.group + (2 * self.desc.excite.hw if self.desc.excite is not None else 0)
        chunk = -(-MATVEC_CHUNK_MACS // work) if is_matvec(g) else 1
        pool.run(self.kernel, [w, x, *operands, *outputs], min_chunk=chunk)


def compile_direct_conv(d: DirectConvDesc, cache_dir: str | None = None) -> CompiledDirectConv:
    """Generate, optimise and JIT ``d`` through the piecewise cache (``cache_dir`` None = this
    process only).  Raises CompileError for sizes it cannot run or an epilogue op without a
    scalar lowering."""
    from .cached import compile_cached, piece_cache
    g = d.conv
    if min(g.n, g.c, g.h, g.w, g.oh, g.ow, d.cout) <= 0 or (taps(g) > MAX_TAPS and not is_matvec(g)):
        raise CompileError(f"{d.name}: direct conv needs positive sizes and at most {MAX_TAPS} taps, got "
                           f"{g} with {d.cout} outputs")
    k = direct_conv_kernel(d)
    return CompiledDirectConv(d, compile_cached(k, piece_cache(cache_dir), direct_conv_key(d)))


def direct_conv_key(d: DirectConvDesc) -> str:
    """Piece-cache key of ``d``'s kernel, from what the kernel is built from (the descriptor,
    and the source of the modules that build and render it), so that a hit -- a warm compile --
    renders no LLVM text."""
    import hashlib
    from ..cache import piece_key
    from .cached import _backend_digest
    from . import conv_dw_cvec, conv_dw_rows
    digest = hashlib.sha256(f"{d!r}|{_source_digest()}|{conv_dw_rows.applies(d)}|{conv_dw_cvec.applies(d)}"
                            .encode()).hexdigest()
    return piece_key(digest, "cpu-direct-conv", {"backend": _backend_digest()})


@lru_cache(maxsize=None)
def _source_digest() -> str:
    """sha256 of the modules that build and render a direct conv's kernel (read once)."""
    import os
    from ..fsutil import files_digest
    here = os.path.dirname(__file__)
    return files_digest(os.path.join(here, f) for f in
                        ("conv_direct.py", "conv_dw_rows.py", "conv_dw_cvec.py", "conv_block.py", "loopir.py", "printer.py",
                         "llvm_math.py", "scalar_ops.py"))


def render_direct_conv(d: DirectConvDesc) -> str:
    """Unoptimised LLVM IR of ``d``."""
    from .llvm import host, render_llvm
    return render_llvm(direct_conv_kernel(d), host().cpu_attrs)


def direct_conv_desc(name: str, x_shape: tuple, w_shape: tuple, out_shape: tuple, attrs, head: str,
                     **epi) -> DirectConvDesc:
    """The direct kernel of a 2-D NCHW conv (any group; callers use it for narrow groups)."""
    n, c, h, w = x_shape
    cout, _, kh, kw = w_shape
    st, pd, dl = tuple(attrs["strides"]), tuple(attrs["pads"]), tuple(attrs["dilations"])
    geom = ConvGeom(n, c, h, w, int(attrs["group"]), kh, kw, out_shape[2], out_shape[3], st,
                    (pd[0], pd[1]), dl)
    return DirectConvDesc(name, geom, cout, tuple(out_shape), head, **epi)
