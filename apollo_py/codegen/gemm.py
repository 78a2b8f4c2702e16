"""Generated single-precision GEMM for the CPU target: packed panels, a register-blocked
micro-kernel, and the micro-graph's elementwise epilogue applied per C tile (rule 6).

One :class:`GemmDesc` describes ``C[b] = A[b] @ B[b]`` for ``b`` in a flattened batch, plus
where A and B come from (a matmul's operands, or a conv's weights and implicit im2col of its
input) and the epilogue.  :func:`compile_gemm` turns it into machine code through llvmlite:

* A: a contiguous, not constant A is read in place -- the micro-kernel broadcasts
  ``A[i0 + r][k]`` from its row-major rows (constant displacements ``r * K``), and a partial
  last panel of ``m % MR`` rows runs the same micro-kernel with fewer rows (``direct_a``);
  a constant A (a conv's weight) is packed once (:meth:`CompiledGemm.packed_a`); an A read
  through a view is packed per tile by ``pack_a`` (loop IR, ``[panel][k][MR]``, zero padded);
* ``pack_b`` (loop IR): one column block of B (``NC`` columns) into panels of ``NR`` columns,
  ``[panel][k][NR]`` (a bounded copy plus a zero fill per panel row); for a conv the im2col
  (implicit GEMM).  A constant B (``b_const``: a weight) is packed once, on the first call,
  into every block (:meth:`CompiledGemm.packed_b`) and the main kernel reads them in place;
* operands may be read through an :class:`OperandView` (a transpose of another buffer,
  e.g. attention's ``K^T``), so the exporters' Transpose nodes cost no copy;
* ``epi`` (loop IR): reads one ``MR x NR`` accumulator tile, computes the epilogue chain
  (layer-1 scalar ops, broadcast operands indexed from the output coordinates) and stores
  every output value the step must produce;
* the main kernel (LLVM IR text written here): parallel over tiles ``(b, column block,
  row group)``; per tile and K block it packs B into a 64-byte-aligned scratch, then for every
  MR-row panel and NR-column panel runs the micro-kernel -- ``MR x NR/VL`` vector accumulators
  in registers for the whole K block, one broadcast of A and ``NR/VL`` aligned vector loads
  of B per k, ``llvm.fma``.  A plain product (no epilogue, one row-major output,
  :func:`plain_output`) has its full tiles written by the micro-kernel into the output itself
  (stored on the first K block, added on the others); other tiles go to a scratch tile and,
  after the last K block, to ``epi``.  Products below ``SMALL_FLOPS`` run on the calling thread.

Every size is a field of :class:`Blocking` (``vl, mr, nr, kc, b_block_bytes, max_panels,
direct_a``), passed to :func:`compile_gemm` and part of the compiled key, so a tuner can pick
them.  The defaults (docs/design/gemm.md, measured on a Zen-5 EPYC: two 512-bit FMA pipes,
48 KiB L1, 1 MiB L2 per core): ``VL=16, MR=12, NR=32`` (24 accumulators + 2 B vectors + 1
broadcast of 32 zmm registers; ``MR=8`` where it pads fewer rows, ``NR=16`` where N fits one
vector), ``KC=256`` (an MR x KC A panel, 12 KiB, stays in L1 while B panels stream from L2;
384 and 512 measured no better), a B column block of at most 512 KiB in L2.  Without
AVX-512: ``VL=8, MR=6, NR=16`` (AVX2, 16 ymm).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from math import prod
from typing import Optional

import numpy as np

from apollo_py.codegen import loopir as L
from apollo_py.codegen.compiled import CompiledKernelBase, run_claiming
from apollo_py.codegen.gemm_ir import main_ir, plain_output  # noqa: F401 - plain_output: API
from apollo_py.codegen.gemm_views import OperandView, permuted_index, view_address
from apollo_py.errors import CompileError

B_BLOCK_BYTES = 512 * 1024
KC_MAX = 256          # k per block: an NR-column B micro-panel (KC x NR floats, 32 KiB) stays in L1
MAX_PANELS = 24       # MR-row panels per row group: A block and C block stay in L2
#: ... but a B packed per tile with A read in place: 64 (1024^3 on 2 threads: 2 row groups, B
#: packed twice instead of 6 times, 0.955x the CPU time; see _max_panels)
RUNTIME_B_MAX_PANELS = 64
DIRECT_MR8_K = 768  # see blocking_for
SMALL_FLOPS = 2 * 128 ** 3  # products below this run on the calling thread (no pool wake-up)
TILES_PER_THREAD = 8  # on several threads, split until there are this many tiles per thread ...
TILE_FLOPS = 1 << 20  # ... or tiles of this many flops (~4 us), whichever gives fewer tiles
#: the same for an implicit-GEMM conv: MobileNetV3's 1x1 convs at 14x14 and 7x7 (4.5-15 MFLOP)
#: took 75-110 us on the pool on the quiet box and 45-110 us on one thread (a profile at load 5);
#: 2 threads pay off from ~16 MFLOP (30 MFLOP: 136 us on the pool, 197 on one thread at load 5)
SMALL_CONV_FLOPS = 2 * 200 ** 3


@dataclass(frozen=True)
class Blocking:
    """Register and cache blocking -- every size the kernel's speed depends on, explicit so
    that a tuner can pick them: vector width ``vl`` (floats), micro-tile ``mr x nr``, ``kc``
    (k per block: at most this many, K split into near-equal blocks), ``b_block_bytes`` (a
    packed ``KC x NC`` B block, kept in L2), ``max_panels`` (MR-row panels per row group),
    ``direct_a`` (the micro-kernel broadcasts A from its row-major source instead of a packed
    copy; None: :func:`direct_a_rule`), and the parallel split: on ``T > 1`` threads the
    tiles are made smaller until there are ``tiles_per_thread * T`` of them or each is down
    to ``tile_flops`` (:func:`layout`); ``nc_max``: the row-reading conv's column block
    (codegen/conv_rows.py; unused here); ``prefetch_b``: a constant B's next block is
    prefetched into L2 by the micro-kernels of the current one (codegen/gemm_ir.py)."""

    vl: int
    mr: int
    nr: int
    kc: int = KC_MAX
    b_block_bytes: int = B_BLOCK_BYTES
    max_panels: int = MAX_PANELS
    direct_a: Optional[bool] = None
    tiles_per_thread: int = TILES_PER_THREAD
    tile_flops: int = TILE_FLOPS
    nc_max: int = 0     # grid columns per B block of the row-reading conv (0: conv_rows.NC_MAX)
    prefetch_b: bool = True     # a constant B's next block prefetched by the micro-kernels

    def nc(self, kc: int, n: int) -> int:
        """Columns per B block: at most ``b_block_bytes`` of packed B, a multiple of ``nr``,
        the blocks as even as that allows (768 columns: 2 x 384, not 512 + 256, so two
        threads get equal work)."""
        cap = max(self.nr, (self.b_block_bytes // (4 * max(1, kc))) // self.nr * self.nr)
        panels = -(-n // self.nr)
        blocks = -(-panels * self.nr // cap)
        return -(-panels // blocks) * self.nr


def k_blocks(k: int, kc: int = KC_MAX) -> tuple[int, int]:
    """``(block count, block size)``: K split into near-equal blocks of at most ``kc``."""
    nk = -(-k // kc)
    return nk, -(-k // nk)


def host_blocking() -> Blocking:
    """The blocking for this process's CPU (AVX-512 if present, else AVX2-sized)."""
    from apollo_py.codegen.llvm import host
    feats = host().features.split(",")
    if "+avx512f" in feats:
        return Blocking(16, 12, 32)
    return Blocking(8, 6, 16)


def blocking_for(m: int, n: int = 0, k_direct: int = 0) -> Blocking:
    """The host blocking, with ``mr`` 8 instead of 12 (AVX-512) or 4 instead of 6 (AVX2) when
    that pads the ``m`` rows by 5% less (conv with 64 output channels: 72 -> 64 rows), and one
    vector of columns (``nr = vl``) when ``n`` fits in one: DLRM's 64 products of 9x9x64 padded
    to 32 columns did 3.5x the useful FMAs (nr 16: 0.84x the time).  ``k_direct``: K of an A
    the micro-kernel reads in place; from ``DIRECT_MR8_K`` on, AVX-512 uses ``mr`` 8 (fewer
    A rows in L1 beside the streaming B panel: 0.80-0.96x the time at K 768-3072, rows 4 KiB
    apart the most; 1.02x at K 64 and 384)."""
    bl = host_blocking()
    alt = Blocking(bl.vl, 8 if bl.vl == 16 else 4, bl.nr)

    def waste(mr):
        return (-(-m // mr) * mr) / m - 1
    if waste(bl.mr) - waste(alt.mr) > 0.05 or (bl.vl == 16 and k_direct >= DIRECT_MR8_K):
        bl = alt
    return replace(bl, nr=bl.vl) if 0 < n <= bl.vl else bl


def default_blocking(d: "GemmDesc") -> Blocking:
    """:func:`blocking_for` the sizes of ``d`` (K counts when A will be read in place)."""
    return blocking_for(d.m, d.n, d.k if d.a_view is None and not d.a_const else 0)


@dataclass(frozen=True)
class ConvGeom:
    """Implicit-GEMM view of a 2-D conv: input ``[n, c, h, w]``, kernel ``kh x kw``."""

    n: int
    c: int
    h: int
    w: int
    group: int
    kh: int
    kw: int
    oh: int
    ow: int
    strides: tuple
    pads: tuple        # (top, left)
    dilations: tuple


@dataclass(frozen=True)
class EpiOperand:
    """An epilogue input read from memory: ``shape`` right-aligned to the output shape."""

    value: str
    dtype: str
    shape: tuple


@dataclass(frozen=True)
class GemmDesc:
    """``C[b] (Mk x N) = A[ab(b)] (Mk x K) @ B[bb(b)] (K x N)`` for ``b < batch``.

    ``a_batches``: number of distinct A matrices (``a_index[b]`` picks one); for a matmul
    ``b_index[b]`` picks B's batch, for a conv ``conv`` describes the implicit im2col and
    ``b = image * group + g``.  ``out_shape`` is the head's output shape; rows of C are the
    flattened leading ``row_dims`` dims of it, columns the rest.  ``nodes`` are the epilogue
    primitives (may be empty), ``operands`` their memory inputs, ``outputs`` the values (head
    or epilogue outputs, all of ``out_shape``) the step stores, ``head`` the head's value.
    """

    name: str
    batch: int
    m: int
    n: int
    k: int
    a_batches: int
    a_index: tuple
    b_index: tuple
    out_shape: tuple
    row_dims: int
    head: str
    nodes: tuple = ()
    operands: tuple = ()
    outputs: tuple = ()
    out_dtypes: tuple = ()
    node_dtypes: tuple = ()     # output dtype of each epilogue node
    conv: Optional[ConvGeom] = None
    inline_consts: dict = field(default_factory=dict)
    a_view: Optional[OperandView] = None   # A read in place (transposed source); None: contiguous
    b_view: Optional[OperandView] = None
    a_value: str = ""       # the values the step reads as A and B ("" : the head's inputs)
    b_value: str = ""
    b_const: bool = False   # B is a constant: packed once (CompiledGemm.packed_b), not per tile
    a_const: bool = False   # A is a constant (a conv's weight): packed once (CompiledGemm.packed_a)
    out_perm: Optional[tuple] = None   # outputs stored as transpose(C, out_perm) (a folded Transpose)
    stored_as: tuple = ()   # the values the stored outputs are bound to ("": ``outputs``)
    #: the output buffers' shape when a reshape of ``transpose(C, out_perm)`` follows (a
    #: depth-to-space store, codegen/gemm_subpixel.py); None: ``out_shape`` permuted
    stored_reshape: Optional[tuple] = None
    #: a joint product (layers/joint_gemm.py): column segments of C, each a GemmDesc of its
    #: width ``n`` with its own epilogue, outputs and layout, in column order; this desc's
    #: ``operands`` / ``outputs`` / ``out_dtypes`` / ``stored_as`` are then theirs concatenated
    parts: tuple = ()

    @property
    def stored_shape(self) -> tuple:
        """The shape of each output buffer: ``out_shape``, permuted by ``out_perm`` (then
        reshaped to ``stored_reshape`` when set)."""
        if self.stored_reshape is not None:
            return tuple(self.stored_reshape)
        if self.out_perm is None:
            return self.out_shape
        return tuple(self.out_shape[p] for p in self.out_perm)


# ------------------------------------------------------------------ loop-IR parts


def _pack_a_params(d: GemmDesc, bl: Blocking, ppg: int) -> tuple:
    """The parameters of :func:`_pack_a_kernel` (a cache hit needs them, not the loops)."""
    return (L.Param("ascr", "float32", ppg * d.k * bl.mr),
            L.Param("a", "float32", d.a_view.size if d.a_view is not None else d.a_batches * d.m * d.k),
            L.Param("info", "int64", 2))


def _pack_b_params(d: GemmDesc, bl: Blocking, nc: int) -> tuple:
    """The parameters of :func:`_pack_b_kernel` and :func:`_pack_b_conv_rows`."""
    return (L.Param("bpk", "float32", nc * k_blocks(d.k, bl.kc)[1]), L.Param("bsrc", "float32", b_source_size(d)),
            L.Param("info", "int64", 4))


def _epilogue_params(d: GemmDesc, bl: Blocking) -> tuple:
    """The parameters of :func:`_epilogue_kernel`."""
    return (L.Param("tile", "float32", bl.mr * bl.nr), L.Param("info", "int64", 4),
            *(L.Param(f"in{q}", o.dtype, max(1, prod(o.shape))) for q, o in enumerate(d.operands)),
            *(L.Param(f"out{q}", dt, prod(d.out_shape)) for q, dt in enumerate(d.out_dtypes)))


def segments(d: GemmDesc) -> tuple:
    """``((desc, first column), ...)``: the column segments of C and the descs whose epilogues
    finish them -- ``d`` itself, or each part of a joint product (``d.parts``), named after
    ``d`` so that its epilogue kernel is ``<d.name>_p<q>_epi``."""
    if not d.parts:
        return ((d, 0),)
    out, col = [], 0
    for q, p in enumerate(d.parts):
        out.append((replace(p, name=f"{d.name}_p{q}"), col))
        col += p.n
    return tuple(out)


def _main_epilogue_params(d: GemmDesc, epis) -> tuple:
    """The main kernel's epilogue arguments: every segment's operands, then every segment's
    outputs (the order of ``d.operands`` and ``d.outputs``)."""
    if not d.parts:
        return tuple(epis[0].params[2:])
    ops, outs = [], []
    for q, (e, (seg, _)) in enumerate(zip(epis, segments(d))):
        ps = [replace(p, name=f"s{q}_{p.name}") for p in e.params[2:]]
        ops += ps[:len(seg.operands)]
        outs += ps[len(seg.operands):]
    return (*ops, *outs)


def _signatures(d: GemmDesc, bl: Blocking, lay) -> tuple:
    """Kernels with the names, parameters and parallel extents of the pack-A, pack-B and
    epilogue kernels of ``d`` (one epilogue per segment) and empty bodies: what
    :class:`CompiledGemm` binds and calls by, on a piece-cache hit that renders no loop
    (building the three kernels cost ~1.5 ms per GEMM, 0.14 s of a warm BERT-base compile)."""
    nc = lay.nc
    return (L.Kernel(f"{d.name}_pack_a", _pack_a_params(d, bl, lay.pan_per_group), L.Block(), "p",
                     lay.pan_per_group),
            L.Kernel(f"{d.name}_pack_b", _pack_b_params(d, bl, nc), L.Block(), "jp", nc // bl.nr),
            tuple(L.Kernel(f"{seg.name}_epi", _epilogue_params(seg, bl), L.Block(), "ii", bl.mr)
                  for seg, _ in segments(d)))


def _pack_a_kernel(d: GemmDesc, bl: Blocking, ppg: int) -> L.Kernel:
    """Packs the ``MR``-row panels ``[p0, p0 + hi)`` of A batch ``ab`` (``info = [ab, p0]``)
    into ``ascr[p - p0][k][MR]``, zero padded: the main kernel calls it per tile, so every
    tile packs only its own rows, into its own scratch, just before using them."""
    ascr, a, info = _pack_a_params(d, bl, ppg)
    p, k, r = L.Var("p"), L.Var("k"), L.Var("r")
    ab, p0 = L.Load(info, L.Const(0)), L.Load(info, L.Const(1))
    i = (p0 + p) * bl.mr + r
    if d.a_view is not None:    # rows of all A batches, flattened, are the view's leading dims
        src = L.Load(a, view_address(d.a_view, ab * d.m + L.minimum(i, d.m - 1), k))
    else:
        src = L.Load(a, ab * (d.m * d.k) + L.minimum(i, d.m - 1) * d.k + k)
    body = L.Store(ascr, (p * d.k + k) * bl.mr + r, L.Select(L.lt(i, d.m), src, L.Const(0.0, "float32")))
    loops = L.for_("p", 0, ppg, L.for_("r", 0, bl.mr, L.for_("k", 0, d.k, body, "vector"), "serial"), "parallel")
    return L.Kernel(f"{d.name}_pack_a", (ascr, a, info), loops, "p", ppg)


def b_source_size(d: GemmDesc) -> int:
    """Elements of the B source buffer (matmul right operand, or the conv input)."""
    if d.conv is not None:
        g = d.conv
        return g.n * g.c * g.h * g.w
    if d.b_view is not None:
        return d.b_view.size
    return (max(d.b_index) + 1) * d.k * d.n


def _pack_b_kernel(d: GemmDesc, bl: Blocking, nc: int) -> L.Kernel:
    """Packs ``kc`` rows from ``k0`` of the ``nc`` columns from ``j0`` of B batch ``b``
    (``info = [b, j0, k0, kc]``) into NR-column panels ``[panel][k][NR]``, zero padded.  Per
    panel the valid columns are a copy loop with a bound (contiguous rows: plain vector loads)
    and a zero-fill loop: a clamped index with a select per element would be a gather."""
    if d.conv is not None:
        return _pack_b_conv_rows(d, bl, nc)
    kcmax = k_blocks(d.k, bl.kc)[1]
    bpk, src, info = _pack_b_params(d, bl, nc)
    V = L.Var
    b, j0 = L.Load(info, L.Const(0)), L.Load(info, L.Const(1))
    k0, kc = L.Load(info, L.Const(2)), L.Load(info, L.Const(3))
    k = k0 + V("kk")
    j = V("p0") + V("jj")
    if d.b_view is not None:    # B's batches and rows: the view's leading dims
        val = L.Load(src, view_address(d.b_view, b * d.k + k, j))
    else:
        val = L.Load(src, b * (d.k * d.n) + k * d.n + j)
    dst = (V("jp") * kc + V("kk")) * bl.nr
    per_k = L.block(
        L.for_("jj", 0, V("jend"), L.Store(bpk, dst + V("jj"), val), "vector"),
        L.for_("jj", V("jend"), bl.nr, L.Store(bpk, dst + V("jj"), L.Const(0.0, "float32")), "vector"))
    per_panel = L.block(
        L.Local("p0", "int64", j0 + V("jp") * bl.nr),
        L.Local("jend", "int64", L.maximum(L.minimum(L.Const(bl.nr), d.n - V("p0")), 0)),
        L.for_("kk", 0, kc, per_k))
    loops = L.for_("jp", 0, nc // bl.nr, per_panel, "parallel")
    return L.Kernel(f"{d.name}_pack_b", (bpk, src, info), loops, "jp", nc // bl.nr)


def im2col_source(g: ConvGeom, b, k, j, clamp_channel: bool = False):
    """Where element ``(k, j)`` of batch ``b``'s implicit im2col matrix lives in the NCHW input
    of conv ``g``: ``(row inside the image, column inside the image, flat address)``, the address
    made of coordinates clamped into the image (and, with ``clamp_channel``, the channel into
    the group) so that it is always readable; the caller selects zero where outside."""
    cg = g.c // g.group
    img, grp = b // g.group, b % g.group
    ci, kh, kw = k // (g.kh * g.kw), (k // g.kw) % g.kh, k % g.kw
    oh, ow = j // g.ow, j % g.ow
    ih = oh * g.strides[0] - g.pads[0] + kh * g.dilations[0]
    iw = ow * g.strides[1] - g.pads[1] + kw * g.dilations[1]
    ihc = L.minimum(L.maximum(ih, 0), g.h - 1)
    iwc = L.minimum(L.maximum(iw, 0), g.w - 1)
    if clamp_channel:
        ci = L.minimum(ci, cg - 1)
    addr = ((img * g.c + grp * cg + ci) * g.h + ihc) * g.w + iwc
    return L.land(L.ge(ih, 0), L.lt(ih, g.h)), L.land(L.ge(iw, 0), L.lt(iw, g.w)), addr


def _pack_b_conv_rows(d: GemmDesc, bl: Blocking, nc: int) -> L.Kernel:
    """Implicit im2col without gathers: an NR-pixel panel meets at most ``nseg`` output rows;
    within one row the input pixels are an affine run (contiguous at stride 1), so each run is
    a zero-fill / copy / zero-fill triple of vector loops whose bounds come from the per-kw
    valid output-column range (computed here) and the row's padding test."""
    from math import ceil
    g = d.conv
    kcmax = k_blocks(d.k, bl.kc)[1]
    bpk, src, info = _pack_b_params(d, bl, nc)
    V = L.Var
    sh, sw = g.strides
    dh, dw = g.dilations
    ph, pw = g.pads
    cg = g.c // g.group

    def ow_range(kwv):
        off = kwv * dw - pw
        lo = max(0, ceil(-off / sw))
        hi = min(g.ow, ceil((g.w - off) / sw))
        return lo, max(lo, hi)

    def by_kw(vals, kw):
        e: L.Expr = L.Const(vals[-1])
        for kwv in range(len(vals) - 2, -1, -1):
            e = L.Select(L.eq(kw, kwv), L.Const(vals[kwv]), e)
        return e

    rng = [ow_range(kwv) for kwv in range(g.kw)]
    b, j0 = L.Load(info, L.Const(0)), L.Load(info, L.Const(1))
    k0, kc = L.Load(info, L.Const(2)), L.Load(info, L.Const(3))
    nseg = min(g.oh, (bl.nr - 1) // g.ow + 2)
    zero = L.Const(0.0, "float32")
    dst = (V("jp") * kc + V("kk")) * bl.nr
    seg = L.block(
        L.Local("c", "int64", V("ow0") - V("s") * g.ow),
        L.Local("js", "int64", L.minimum(L.maximum(L.Const(0) - V("c"), 0), V("jend"))),
        L.Local("je", "int64", L.maximum(L.minimum(g.ow - V("c"), V("jend")), V("js"))),
        L.Local("ih", "int64", (V("oh0") + V("s")) * sh - ph + V("kh") * dh),
        L.Local("rowok", "bool", L.land(L.ge(V("ih"), 0), L.lt(V("ih"), g.h))),
        L.Local("vlo", "int64", L.Select(V("rowok", "bool"),
                                         L.minimum(L.maximum(V("owlo") - V("c"), V("js")), V("je")), V("js"))),
        L.Local("vhi", "int64", L.Select(V("rowok", "bool"),
                                         L.minimum(L.maximum(V("owhi") - V("c"), V("vlo")), V("je")), V("js"))),
        L.Local("rowbase", "int64", ((V("img") * g.c + V("grp") * cg + V("ci")) * g.h + V("ih")) * g.w
                + V("kw") * dw - pw + V("c") * sw),
        L.for_("jj", V("js"), V("vlo"), L.Store(bpk, dst + V("jj"), zero), "vector"),
        L.for_("jj", V("vlo"), V("vhi"),
               L.Store(bpk, dst + V("jj"), L.Load(src, V("rowbase") + V("jj") * sw)), "vector"),
        L.for_("jj", V("vhi"), V("je"), L.Store(bpk, dst + V("jj"), zero), "vector"))
    per_k = L.block(
        L.Local("k", "int64", k0 + V("kk")),
        L.Local("ci", "int64", V("k") // (g.kh * g.kw)),
        L.Local("kh", "int64", (V("k") // g.kw) % g.kh),
        L.Local("kw", "int64", V("k") % g.kw),
        L.Local("owlo", "int64", by_kw([r[0] for r in rng], V("kw"))),
        L.Local("owhi", "int64", by_kw([r[1] for r in rng], V("kw"))),
        L.for_("s", 0, nseg, seg),
        L.for_("jj", V("jend"), bl.nr, L.Store(bpk, dst + V("jj"), zero), "vector"))
    per_panel = L.block(
        L.Local("p0", "int64", j0 + V("jp") * bl.nr),
        L.Local("oh0", "int64", V("p0") // g.ow),
        L.Local("ow0", "int64", V("p0") % g.ow),
        L.Local("jend", "int64", L.minimum(L.Const(bl.nr), d.n - V("p0"))),
        L.Local("img", "int64", b // g.group),
        L.Local("grp", "int64", b % g.group),
        L.for_("kk", 0, kc, per_k))
    loops = L.for_("jp", 0, nc // bl.nr, per_panel, "parallel")
    return L.Kernel(f"{d.name}_pack_b", (bpk, src, info), loops, "jp", nc // bl.nr)


def _operand_index(op: EpiOperand, out_shape: tuple, row_dims: int, row: L.Expr, col: L.Expr) -> L.Expr:
    """Flat index into a broadcast operand for output row ``row`` and column ``col``."""
    rank = len(out_shape)
    shape = (1,) * (rank - len(op.shape)) + tuple(op.shape)
    strides, s = [0] * rank, 1
    for d in range(rank - 1, -1, -1):
        strides[d] = s if shape[d] != 1 else 0
        s *= shape[d]
    idx: L.Expr = L.Const(0)

    def unravel(flat: L.Expr, dims: range) -> L.Expr:
        acc: L.Expr = L.Const(0)
        rem = flat
        for d in reversed(dims):
            if strides[d]:
                acc = acc + (rem % out_shape[d]) * strides[d]
            rem = rem // out_shape[d]
        return acc

    row_range, col_range = range(0, row_dims), range(row_dims, rank)
    if any(strides[d] for d in row_range):
        idx = idx + unravel(row, row_range)
    if any(strides[d] for d in col_range):
        if all(shape[d] == out_shape[d] for d in col_range):
            idx = idx + col      # trailing block is contiguous in the operand
        else:
            idx = idx + unravel(col, col_range)
    return idx


def _row_run(d: GemmDesc) -> int:
    """Rows of C that lie one after another in ``transpose(C, out_perm)``: the product of the
    trailing row dims that are, in order, the innermost stored dims (ConvNeXt's ``[N, H, W, C]
    -> [N, C, H, W]``: H * W); 1 when the innermost stored dim is not a row dim."""
    if d.out_perm is None:
        return 0
    run, q = 1, d.row_dims - 1
    for p in reversed(d.out_perm):
        if p != q or q < 0:
            break
        run *= d.out_shape[q]
        q -= 1
    return run


def _col_run(d: GemmDesc) -> int:
    """Columns of C that lie one after another in ``transpose(C, out_perm)``: the product of
    the trailing column dims that are, in order, the innermost stored dims (ViT's and Swin's
    QKV ``[S, 3, H, d]`` stored as ``[3, H, S, d]``: d); 1 when the innermost stored dim is a
    row dim."""
    run, q = 1, len(d.out_shape) - 1
    for p in reversed(d.out_perm or ()):
        if p != q or q < d.row_dims:
            break
        run *= d.out_shape[q]
        q -= 1
    return run


def epilogue_locals(d, head: L.Expr, ops, index, prefix: str = "") -> tuple[list, dict]:
    """Loop-IR statements that evaluate the epilogue chain ``d.nodes`` on ``head`` (the
    product's value at one output element), and the values by name afterwards.  ``ops`` are the
    buffers of ``d.operands``; ``index(o)`` is the element's index into operand ``o``;
    ``d.inline_consts`` stand for themselves.  The locals are ``{prefix}v_head`` and
    ``{prefix}v{q}`` (a prefix keeps several chains in one loop body apart).  Used by the GEMM,
    attention and direct-conv epilogues (``d`` has ``head``, ``operands``, ``inline_consts``,
    ``nodes``, ``node_dtypes``)."""
    from apollo_py.codegen.scalar_ops import scalar_op
    stmts = [L.Local(prefix + "v_head", "float32", head)]
    env: dict = {d.head: L.Var(prefix + "v_head", "float32")}
    for q, o in enumerate(d.operands):
        env[o.value] = L.Load(ops[q], index(o))
    env.update(d.inline_consts)
    for q, n in enumerate(d.nodes):
        e = scalar_op(n, [env[v] for v in n.inputs], [], d.node_dtypes[q])
        stmts.append(L.Local(f"{prefix}v{q}", e.dtype, e))
        env[n.outputs[0]] = L.Var(f"{prefix}v{q}", e.dtype)
    return stmts, env


def _col_only(o: EpiOperand, d: GemmDesc) -> bool:
    """Whether epilogue operand ``o`` is constant along C's rows (a bias, a per-column scale)."""
    shape = (1,) * (len(d.out_shape) - len(o.shape)) + tuple(o.shape)
    return all(s == 1 for s in shape[:d.row_dims])


def _epilogue_kernel(d: GemmDesc, bl: Blocking) -> L.Kernel:
    if _row_run(d) >= bl.mr and all(_col_only(o, d) for o in d.operands):
        return _epilogue_kernel_rows(d, bl)
    from apollo_py.codegen import gemm_subpixel as SP
    form = SP.subpixel_form(d.out_shape, d.row_dims, d.out_perm) if SP.ENABLED else None
    # G == 1 only for a conv (a (k, 1) ConvTranspose): matmuls' transposed stores keep their paths
    if form is not None and (form[0] > 1 or (d.conv is not None and _col_run(d) % bl.nr)):
        return SP.subpixel_epilogue_kernel(d, bl, _epilogue_params(d, bl), _operand_index, epilogue_locals)
    tile, info, *params = _epilogue_params(d, bl)
    ops, outs = params[:len(d.operands)], params[len(d.operands):]
    ii, jj = L.Var("ii"), L.Var("jj")
    row = L.Load(info, L.Const(0)) * d.m + L.Load(info, L.Const(1)) + ii
    col = L.Load(info, L.Const(2)) + jj
    ncols = prod(d.out_shape[d.row_dims:])
    if d.out_perm is None:
        lin = row * ncols + col
    elif _col_run(d) % bl.nr == 0:
        # the tile's NR columns (from a multiple of NR) lie in one run of consecutive stored
        # columns: one address per row, then contiguous stores.  Through permuted_index per
        # column they were a scatter: ViT's QKV stored as (2, 0, 3, 1, 4) ran at 200 GFLOP/s
        # on one thread against 241-245 for its FFN products
        lin = permuted_index(d.out_shape, d.out_perm, d.row_dims, row, L.Load(info, L.Const(2))) + jj
    else:
        lin = permuted_index(d.out_shape, d.out_perm, d.row_dims, row, col)
    stmts, env = epilogue_locals(d, L.Load(tile, ii * bl.nr + jj), ops,
                                 lambda o: _operand_index(o, d.out_shape, d.row_dims, row, col))
    for q, v in enumerate(d.outputs):
        stmts.append(L.Store(outs[q], lin, env[v]))
    inner = L.for_("jj", 0, L.Load(info, L.Const(3)), L.block(*stmts), "vector")
    loops = L.for_("ii", 0, bl.mr, inner, "parallel")
    return L.Kernel(f"{d.name}_epi", (tile, info, *ops, *outs), loops, "ii", bl.mr)


def _epilogue_kernel_rows(d: GemmDesc, bl: Blocking) -> L.Kernel:
    """The epilogue of a result stored transposed so that consecutive rows of C are consecutive
    in memory (:func:`_row_run`): per tile column, one vector loop over the ``MR`` rows whose
    stores are contiguous -- the row-major loop (vectorised over columns) stored every element
    at a stride of the plane size, a scatter.  Runs once per tile (the first of the call's row
    range); a tile straddling the end of a run of rows, or with fewer than ``MR`` rows, takes a
    scalar loop.  Operands must be constant along rows (:func:`_col_only`)."""
    tile, info, *params = _epilogue_params(d, bl)
    ops, outs = params[:len(d.operands)], params[len(d.operands):]
    V = L.Var
    r, jj = V("r"), V("jj")
    run = _row_run(d)
    row0 = L.Load(info, L.Const(0)) * d.m + L.Load(info, L.Const(1))
    col = L.Load(info, L.Const(2)) + jj

    def body(lin: L.Expr, row: L.Expr) -> L.Block:
        stmts, env = epilogue_locals(d, L.Load(tile, r * bl.nr + jj), ops,
                                     lambda o: _operand_index(o, d.out_shape, d.row_dims, row, col))
        return L.block(*stmts, *(L.Store(outs[q], lin, env[v]) for q, v in enumerate(d.outputs)))

    zero = L.Const(0)
    fast = L.for_("jj", 0, L.Load(info, L.Const(3)), L.block(
        L.Local("cpart", "int64", permuted_index(d.out_shape, d.out_perm, d.row_dims, zero, col)),
        L.for_("r", 0, bl.mr, body(V("base") + V("cpart") + r, row0 + r), "vector")))
    slow = L.for_("jj", 0, L.Load(info, L.Const(3)), L.for_(
        "r", 0, V("nrows"), body(permuted_index(d.out_shape, d.out_perm, d.row_dims, row0 + r, col), row0 + r)))
    once = L.block(
        L.Local("nrows", "int64", L.minimum(L.Const(bl.mr), d.m - L.Load(info, L.Const(1)))),
        L.Local("base", "int64", permuted_index(d.out_shape, d.out_perm, d.row_dims, row0, zero)),
        L.If(L.land(L.eq(V("nrows"), bl.mr), L.le(row0 % run + bl.mr, run)), fast, slow))
    loops = L.for_("ii", 0, bl.mr, L.If(L.eq(V("ii"), 0), once), "parallel")
    return L.Kernel(f"{d.name}_epi", (tile, info, *ops, *outs), loops, "ii", bl.mr)


@dataclass(frozen=True)
class GemmLayout:
    """The tile decomposition of the main kernel's parallel loop."""

    nc: int            # columns per B block
    njc: int           # column blocks
    mg: int            # row groups
    pan_per_group: int  # MR-row panels per row group
    npan_a: int        # MR-row panels per A matrix
    tiles: int         # batch * njc * mg: the parallel extent
    nkc: int = 1       # k blocks
    kcb: int = 1       # k per block (the last may be shorter)
    direct_a: bool = False  # micro-kernel reads A from its source rows (no packed copy)


def direct_a_rule(d: GemmDesc, bl: Blocking) -> bool:
    """Whether the micro-kernel broadcasts A straight from its contiguous row-major source
    (row stride K) instead of a per-tile packed copy: only for a contiguous, not constant A
    (a view is packed because it is strided; a constant A is packed once anyway)."""
    if d.a_view is not None or d.a_const:
        return False
    # rows a multiple of 4 KiB apart share L1 sets, yet direct still measured 0.94-1.03x the
    # packed path's time there (1024^3, 128x2048x512, 128x3072x768; 0.74-0.97x elsewhere)
    return True if bl.direct_a is None else bl.direct_a


def _max_panels(d: GemmDesc, bl: Blocking) -> int:
    """MR-row panels per row group at most: ``bl.max_panels``, or at least
    ``RUNTIME_B_MAX_PANELS`` for a matmul whose B is packed per tile and whose A is read in
    place.  Every row group packs its own copy of B, and there is no packed A block to keep in
    L2 (the group's C block, ``rows x NC`` floats, is what stays there)."""
    if d.conv is None and not d.b_const and d.a_view is None and not d.a_const and direct_a_rule(d, bl):
        return max(bl.max_panels, RUNTIME_B_MAX_PANELS)
    return bl.max_panels


def layout(d: GemmDesc, bl: Blocking, threads: int) -> GemmLayout:
    """Blocks of ``nc`` columns (``KC x nc`` packed B within ``B_BLOCK_BYTES``); rows in groups
    of at most ``MAX_PANELS`` panels.  On several threads a matmul's tiles are then made
    smaller (:func:`_parallel_split`); a conv splits columns first, then row groups of at
    least 4 panels, until there are ``4 * threads`` tiles."""
    nc = bl.nc(k_blocks(d.k, bl.kc)[1], d.n)
    njc = -(-d.n // nc)
    npan = -(-d.m // bl.mr)
    want = 4 * max(1, threads)
    mg = -(-npan // _max_panels(d, bl))
    if d.conv is not None:
        if d.batch * njc * mg < want:
            # a conv's B block is an im2col gather that every row group repeats: split the
            # columns first (narrower blocks, the constant A panels re-read from cache instead)
            npc = -(-d.n // bl.nr)
            nc = min(nc, -(-npc // min(npc, -(-want // (d.batch * mg)))) * bl.nr)
            njc = -(-d.n // nc)
        if d.batch * njc * mg < want:
            mg = max(mg, min(-(-want // (d.batch * njc)), npan // 4))
    elif threads > 1:
        mg, nc = _parallel_split(d, bl, threads, mg, nc, npan)
        njc = -(-d.n // nc)
    ppg = -(-npan // mg)
    mg = -(-npan // ppg)
    nkc, kcb = k_blocks(d.k, bl.kc)
    return GemmLayout(nc, njc, mg, ppg, npan, d.batch * njc * mg, nkc, kcb, direct_a_rule(d, bl))


def _parallel_split(d: GemmDesc, bl: Blocking, threads: int, mg0: int, nc0: int, npan: int) -> tuple:
    """``(row groups, columns per block)`` of a matmul on ``threads`` threads: the fewest
    tiles that reach ``min(tiles_per_thread * threads, flops / tile_flops)`` (at least
    ``threads``), as square as the sizes allow.  The main kernel's threads claim tiles one
    at a time, so many small tiles balance a late pool wake-up or a preempted thread within
    one tile; what a smaller tile costs is traffic: every row group re-reads (or, B not
    constant, re-packs) its B block, every column block re-reads its A rows.  Among the
    splits that reach the count: least of ``njc * M + mg * N * w`` (``w`` 3 where B is
    packed per tile), a tile count that divides evenly among the threads first."""
    flops = 2 * d.batch * d.m * d.n * d.k
    target = max(threads, min(bl.tiles_per_thread * threads, flops // max(1, bl.tile_flops)))
    if d.batch * mg0 * (-(-d.n // nc0)) >= target:
        return mg0, nc0
    npc = -(-d.n // bl.nr)                  # NR-column panels of C
    w = 1 if d.b_const else 3
    best = None
    for mg in sorted({-(-npan // -(-npan // g)) for g in range(mg0, npan + 1)}):
        for cb in range(-(-d.n // nc0), npc + 1):
            nc = -(-npc // cb) * bl.nr
            njc = -(-d.n // nc)
            tiles = d.batch * mg * njc
            key = (tiles < target, tiles % threads != 0 if tiles >= target else 0,
                   njc * d.m + mg * d.n * w if tiles >= target else -tiles, tiles)
            if best is None or key < best[0]:
                best = (key, mg, nc)
    return best[1], best[2]


def packed_b_size(d: GemmDesc, lay: GemmLayout) -> int:
    """Floats of a B packed once: every (B batch, column block, k block) block at full size."""
    return (max(d.b_index) + 1) * lay.njc * lay.nkc * lay.nc * lay.kcb


# ------------------------------------------------------------------ compile


def _aligned_zeros(size: int, align: int = 64) -> np.ndarray:
    """float32 zeros whose data starts on an ``align``-byte boundary."""
    raw = np.zeros(size + align // 4, np.float32)
    skip = (-raw.ctypes.data % align) // 4
    return raw[skip:skip + size]


class CompiledGemm:
    """Machine code of one GEMM: ``main`` follows the pool's kernel ABI (it packs A and B
    itself, per tile; ``pack_b`` is kept for packing a constant B once).

    ``run(pool, a, bsrc, operands, outputs)`` packs A into a fresh buffer and runs the main
    kernel over its tiles; ``ir`` is the optimised module text.
    """

    #: the main kernel's last argument is the tile counter its calls claim tiles from
    #: (codegen/gemm_ir.py): a caller runs it as one call of the whole tile range, never in chunks
    claims_tiles = True

    def __init__(self, desc: GemmDesc, bl: Blocking, lay: GemmLayout, engine, ir: str,
                 main_params: tuple, pack_b: Optional[L.Kernel] = None, pack_a: Optional[L.Kernel] = None):
        self.desc, self.blocking, self.layout = desc, bl, lay
        self.engine = engine   # owns the machine code
        self.ir = ir
        # the last param is the tile counter the calls claim tiles from (codegen/gemm_ir.py)
        main = L.Kernel(desc.name, (*main_params, L.Param("tile_counter", "int64", 2)), L.Block(), "t", lay.tiles)
        self.main = CompiledKernelBase(main, engine.get_function_address(desc.name))
        self.pack_b = (CompiledKernelBase(pack_b, engine.get_function_address(pack_b.name))
                       if pack_b is not None else None)
        self.pack_a = (CompiledKernelBase(pack_a, engine.get_function_address(pack_a.name))
                       if pack_a is not None else None)
        self._packed_a: tuple = (None, None)
        # one thread below this many flops: a pool wake-up costs more than the second core gives
        self.inline = 2 * desc.batch * desc.m * desc.n * desc.k < (SMALL_FLOPS if desc.conv is None
                                                                   else SMALL_CONV_FLOPS)
        self._packed: tuple = (None, None)

    def packed_b(self, bsrc: np.ndarray) -> np.ndarray:
        """``bsrc`` (a constant B) packed once into every (B batch, column block, k block)
        block the main kernel reads; kept for the next call with the same array."""
        src, packed = self._packed
        if src is bsrc:
            return packed
        d, lay = self.desc, self.layout
        nkc, kcb = lay.nkc, lay.kcb
        blk = lay.nc * kcb
        packed = _aligned_zeros(packed_b_size(d, lay))  # the micro-kernel's B loads are aligned
        info = np.zeros(4, np.int64)
        slot = 0
        for b in range(max(d.b_index) + 1):
            for jc in range(lay.njc):
                for pc in range(nkc):
                    info[:] = (b, jc * lay.nc, pc * kcb, min(kcb, d.k - pc * kcb))
                    self.pack_b([packed[slot * blk:(slot + 1) * blk], bsrc, info])
                    slot += 1
        self._packed = (bsrc, packed)
        return packed

    def packed_a(self, a: np.ndarray) -> np.ndarray:
        """``a`` (a constant A) packed once into ``[A batch][panel][k][MR]``; kept for the next
        call with the same array."""
        src, packed = self._packed_a
        if src is a:
            return packed
        d, lay, bl = self.desc, self.layout, self.blocking
        pan = d.k * bl.mr
        ppg = lay.pan_per_group     # the kernel packs at most one row group per call
        # (a row group's worth of slack at the end: the kernel's buffer is a full group)
        packed = _aligned_zeros((d.a_batches * lay.npan_a + ppg) * pan)
        for ab in range(d.a_batches):
            for p0 in range(0, lay.npan_a, ppg):
                at = (ab * lay.npan_a + p0) * pan
                self.pack_a([packed[at:at + ppg * pan], a, np.array([ab, p0], np.int64)], 0,
                            min(ppg, lay.npan_a - p0))
        self._packed_a = (a, packed)
        return packed

    def run(self, pool, a: np.ndarray, bsrc: np.ndarray, operands, outputs) -> None:
        if self.desc.a_const:
            a = self.packed_a(a)
        if self.desc.b_const:
            bsrc = self.packed_b(bsrc)
        arrays = [a, bsrc, *operands, *outputs, np.zeros(2, np.int64)]   # the tile counter
        run_claiming(self.main, pool, arrays, self.inline or self.layout.tiles == 1)


def _render(d: GemmDesc, bl: Blocking, lay: GemmLayout):
    from apollo_py.codegen.llvm import LLVMPrinter, host
    h = host()
    pack_a = _pack_a_kernel(d, bl, lay.pan_per_group)
    pack_b = (_pack_b_conv_rows if d.conv is not None else _pack_b_kernel)(d, bl, lay.nc)
    segs = segments(d)
    epis = tuple(_epilogue_kernel(seg, bl) for seg, _ in segs)
    texts = [LLVMPrinter().render(k, h.cpu_attrs) for k in (pack_a, pack_b, *epis)]
    main = main_ir(d, bl, lay, pack_a.name, pack_b.name, tuple(e.name for e in epis), segs)
    main += (f"\nattributes #0 = {{ nounwind {h.cpu_attrs} }}\n"
             f"attributes #1 = {{ noinline nounwind {h.cpu_attrs} }}\n"
             "attributes #2 = { noinline }\n"
             "!0 = distinct !{!0, !1}\n!1 = !{!\"llvm.loop.unroll.count\", i32 4}\n")
    return main, texts, (pack_a, pack_b, epis)


def render_gemm(d: GemmDesc, threads: int = 2) -> str:
    """Unoptimised LLVM IR of ``d``: the main kernel and micro-kernel, then the loop-IR parts."""
    bl = default_blocking(d)
    main, texts, _ = _render(d, bl, layout(d, bl, threads))
    return "\n".join([main, *texts])


def link_ir(name: str, main: str, texts) -> object:
    """One verified LLVM module from the main kernel's IR text and its callees' (pack, epilogue
    and micro-kernels), for :func:`apollo_py.codegen.cached.compile_module`; ``CompileError``
    names ``name`` when the generated IR does not parse or verify."""
    from .llvm import host
    llvm = host().llvm
    try:
        mod = llvm.parse_assembly(main)
        for t in texts:
            mod.link_in(llvm.parse_assembly(t))
        mod.verify()
    except RuntimeError as exc:
        raise CompileError(f"{name}: invalid generated LLVM IR: {exc}") from exc
    return mod


def compile_gemm(d: GemmDesc, threads: int, bl: Optional[Blocking] = None,
                 cache_dir: str | None = None) -> CompiledGemm:
    """Generate, optimise (O3) and JIT the kernels of ``d``; ``threads`` shapes the tile
    decomposition.  Goes through the piecewise cache (``codegen/cached.py``; ``cache_dir``
    None = this process only): a GEMM with the same rendered text, back end and host is
    loaded as object code without running LLVM.  Raises CompileError when LLVM rejects the
    generated text (a bug) or an epilogue op has no scalar lowering."""
    from .cached import compile_module
    if d.m <= 0 or d.n <= 0 or d.k <= 0 or d.batch <= 0:
        raise CompileError(f"{d.name}: generated GEMM needs positive sizes, got batch {d.batch}, "
                           f"{d.m}x{d.n}x{d.k}")
    named, d = d, canonical(d)
    bl = bl or default_blocking(d)
    if any(off % bl.nr for _, off in segments(d)):
        raise CompileError(f"{d.name}: a joint product's segments must start at multiples of NR = {bl.nr} "
                           f"columns, got widths {[p.n for p in d.parts]}")
    lay = layout(d, bl, threads)
    pack_a, pack_b, epis = _signatures(d, bl, lay)      # the loops are rendered on a miss only

    def build():
        main, texts, _ = _render(d, bl, lay)
        return link_ir(d.name, main, texts)
    # keyed by what the text is rendered from (descriptor, blocking, layout; the host and this
    # module's source are in the key too), so a cache hit renders nothing
    engine, ir = compile_module(repr((d, bl, lay)), build, cache_dir, d.name)
    bparam = L.Param("bpk_all", "float32", packed_b_size(d, lay)) if d.b_const else pack_b.params[1]
    aparam = L.Param("apk_all", "float32", d.a_batches * lay.npan_a * d.k * bl.mr) if d.a_const else pack_a.params[1]
    main_params = (aparam, bparam, *_main_epilogue_params(d, epis))
    cg = CompiledGemm(d, bl, lay, engine, ir, main_params, pack_b if d.b_const else None,
                      pack_a if d.a_const else None)
    cg.desc = named     # the step reads and binds values by the graph's names
    return cg


def canonical(d: GemmDesc) -> GemmDesc:
    """``d`` with its values renamed ``v0, v1, ...`` in order of use and named by a digest of
    that structure: the same product and epilogue in every layer of a model is one piece
    (one LLVM compile, one engine), whatever the graph calls its values."""
    import hashlib
    from dataclasses import replace
    names: dict = {}

    def nm(v: str) -> str:
        return names.setdefault(v, f"v{len(names)}") if v else v

    def renamed(d: GemmDesc) -> GemmDesc:
        nm(d.head)
        nm(d.a_value)
        nm(d.b_value)
        parts = tuple(replace(renamed(p), name="") for p in d.parts)
        nodes = tuple(n.replace(inputs=tuple(nm(v) for v in n.inputs), outputs=tuple(nm(v) for v in n.outputs),
                                name="", source=()) for n in d.nodes)
        return replace(d, name="g", head=nm(d.head), a_value=nm(d.a_value), b_value=nm(d.b_value), nodes=nodes,
                       operands=tuple(replace(o, value=nm(o.value)) for o in d.operands),
                       outputs=tuple(nm(v) for v in d.outputs), stored_as=tuple(nm(v) for v in d.stored_as),
                       inline_consts={nm(k): v for k, v in d.inline_consts.items()}, parts=parts)
    c = renamed(d)
    return replace(c, name="gemm_" + hashlib.sha1(repr(c).encode()).hexdigest()[:12])


def matmul_desc(name: str, xs: tuple, ys: tuple, out_shape: tuple, head: str, **epi) -> GemmDesc:
    """The GEMM of numpy ``matmul`` for operand shapes ``xs @ ys`` (1-D operands promoted);
    a batch that only A has is folded into its rows."""
    x2 = (1,) + tuple(xs) if len(xs) == 1 else tuple(xs)
    y2 = tuple(ys) + (1,) if len(ys) == 1 else tuple(ys)
    m, k, n = x2[-2], x2[-1], y2[-1]
    xb, yb = x2[:-2], y2[:-2]
    batch = tuple(np.broadcast_shapes(xb, yb))
    nb = prod(batch)
    rows = prod(out_shape) // n if n else 0
    row_dims = _row_dims(out_shape, n)
    if prod(yb) == 1:   # B not batched: fold A's batch into M
        return GemmDesc(name, 1, nb * m, n, k, 1, (0,), (0,), tuple(out_shape), row_dims, head, **epi)
    ai = np.broadcast_to(np.arange(prod(xb)).reshape(xb), batch).ravel()
    bi = np.broadcast_to(np.arange(prod(yb)).reshape(yb), batch).ravel()
    return GemmDesc(name, nb, m, n, k, prod(xb), tuple(int(v) for v in ai), tuple(int(v) for v in bi),
                    tuple(out_shape), row_dims, head, **epi)


def _row_dims(out_shape: tuple, ncols: int) -> int:
    """The split of ``out_shape`` whose trailing dims multiply to ``ncols``."""
    for r in range(len(out_shape), -1, -1):
        if prod(out_shape[r:]) == ncols:
            return r
    raise CompileError(f"no trailing dims of {out_shape} hold {ncols} columns")


def conv_desc(name: str, x_shape: tuple, w_shape: tuple, out_shape: tuple, attrs, head: str, **epi) -> GemmDesc:
    """The implicit GEMM of a 2-D conv (NCHW): per image and group, ``C[Cout/g, OH*OW] =
    W_g[Cout/g, Cin/g*kh*kw] @ im2col(x)``."""
    n, c, h, w = x_shape
    cout, cg, kh, kw = w_shape
    g = int(attrs["group"])
    st, pd, dl = tuple(attrs["strides"]), tuple(attrs["pads"]), tuple(attrs["dilations"])
    oh, ow = out_shape[2], out_shape[3]
    geom = ConvGeom(n, c, h, w, g, kh, kw, oh, ow, st, (pd[0], pd[1]), dl)
    mg = cout // g
    batch = n * g
    return GemmDesc(name, batch, mg, oh * ow, cg * kh * kw, g, tuple(b % g for b in range(batch)),
                    tuple(range(batch)), tuple(out_shape), 2, head, conv=geom, **epi)
