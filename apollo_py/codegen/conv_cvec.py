"""Dense conv with vectors along output channels: the kernel for small output planes.

The row-reading conv (codegen/conv_rows.py) and the implicit GEMM vectorise along output
pixels (grid columns ``OH * Q``): at 7x7 a 32-column panel pair carries 49 valid pixels of 64
and each broadcast weight feeds 2 vector FMAs.  Here the GEMM's roles are swapped, as
onnxruntime's NCHWc convs do it:

* the constant weight is packed once into ``[group][panel][K][NR]`` (``NR = nv * VL`` output
  channels per panel, zero padded): ``nv`` aligned vector loads per k;
* the input is read as broadcasts: pixel ``(oh, ow)`` of im2col row ``k`` (channel, tap) is
  ``src[tab[k] + oh * sh * pw + ow * sw]`` (:class:`CvecGeom`) -- the input itself where no
  tap reaches into padding (1x1 convs without padding, strided ones too), else a plain
  zero-padded copy (conv_rows' ``pad`` kernel with a one-phase geometry): strides and
  dilations are displacements, no phase split;
* a *pixel tile* of ``rb x cb`` output pixels (``rb`` rows of ``cb`` columns; constant
  displacements, so no grid column is computed and dropped) times one panel is the register
  block: ``rb * cb * nv`` accumulators, per k ``nv`` vector loads and ``rb * cb`` broadcasts;
* parallel tiles are ``(image * group, panel, pixel band)``: all of a panel's pixels in one
  tile (its weight panel read once per call) unless there are too few panels for the
  threads, then bands of output rows;
* per tile and K block (``kc``) every pixel tile of the band runs the micro-kernel into a
  pixel-major scratch ``[pixel][NR]`` (stored on the first K block, added on the others);
  after the last, ``VL x VL`` in-register transposes turn it into ``[NR][pixels]`` and the GEMM's
  epilogue kernel (``gemm._epilogue_kernel``, unchanged: bias, activations, residual
  operands) stores the band's rows of NCHW output.

Chosen by :func:`cvec_reason` (docs/design/conv.md, "Channel-vector convs").
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Optional

import numpy as np

from apollo_py.codegen import loopir as L
from apollo_py.codegen.compiled import CompiledKernelBase, run_claiming
from apollo_py.errors import CompileError

#: switch for A/B measurements in one process (benchmarks); the plan says which path runs
ENABLED = True
#: small convs (below ``SMALL_CONV_FLOPS``) get the parallel split too, so that the driver's
#: helper thread can share them (False: one tile per panel, the one-thread layout)
SMALL_SPLIT = True
#: output planes of at most this many pixels take this kernel (larger: conv_rows / implicit GEMM)
MAX_PIXELS = 196
#: ... and so do strided 1x1 convs below ``SMALL_CONV_FLOPS`` that read their input in place,
#: whatever their plane (the implicit GEMM they had packs a strided im2col per call: RegNetY's
#: 32 -> 48 and 48 -> 120 stride-2 convs at 56x56 / 28x28 outputs, ResNet-like 64 -> 128 s2,
#: 0.76-0.82x the time on one thread); False: MAX_PIXELS only (A/B measurements)
STRIDED_SMALL = True
#: (in one band: bands of 392 pixels measured 1.1-1.25x the time of one band of a 56x56 plane
#: on one thread)


def _registers(vl: int) -> int:
    """Vector registers of the host's ISA for ``vl``-float vectors (AVX-512: 32, AVX2: 16)."""
    return 32 if vl >= 16 else 16
#: a padded copy of at most this many bytes is made on the calling thread (a pool dispatch
#: costs more than copying it)
PAD_INLINE_BYTES = 1 << 20


#: see CvecBlocking.prefetch
PREFETCH_BYTES = 4096


@dataclass(frozen=True)
class CvecBlocking:
    """Every size the kernel's speed depends on (a tuner may pick them): ``vl`` floats per
    vector, ``nv`` channel vectors per panel (``nr = nv * vl`` output channels), pixel tiles of
    ``rb`` output rows x ``cb`` output columns (``rb * cb * nv`` accumulators), ``kc`` k per
    block, and the parallel split: at least ``tiles_per_thread * threads`` tiles (panels
    first, then bands of output rows)."""

    vl: int
    nv: int
    rb: int
    cb: int
    kc: int = 256
    tiles_per_thread: int = 4
    #: software prefetch of the weight panel this many bytes ahead, by the first pixel tile of
    #: each band (the one that reads it from memory; the others find it in cache); 0: none
    prefetch: int = PREFETCH_BYTES

    @property
    def nr(self) -> int:
        return self.nv * self.vl


@dataclass(frozen=True)
class CvecLayout:
    """Tiles ``(image*group, panel, band)`` of the main kernel's parallel loop."""

    npan: int           # NR-channel panels per group
    bands: tuple        # ((first output row, end row), ...)
    tiles: int          # batch * npan * len(bands)
    nkc: int            # K blocks
    kcb: int            # k per block (the last may be shorter)
    ps: int             # pixels per transposed scratch row (a band's pixels, rounded up to 16)


@dataclass(frozen=True)
class CvecGeom:
    """The planes the broadcasts read: the input itself (``in_place``: no top / left padding and
    every tap inside the image) or a zero-padded copy ``[N*C][ph][pw]`` of what the taps
    reach.  Output pixel ``(oh, ow)`` of im2col row ``k`` is ``src[tab[k] + oh*sh*pw + ow*sw]``."""

    in_place: bool
    ph: int            # rows per channel plane
    pw: int            # row pitch
    sh: int
    sw: int
    tab: tuple         # offset of im2col row k (channel, tap) inside its image's group channels

    @property
    def ch(self) -> int:
        return self.ph * self.pw


def cvec_geom(g) -> CvecGeom:
    """The :class:`CvecGeom` of :class:`~apollo_py.codegen.gemm.ConvGeom` ``g``: strides and
    dilations are displacements, so no phase split (conv_rows needs one for unit-stride panels)."""
    sh, sw = g.strides
    dh, dw = g.dilations
    rows = (g.oh - 1) * sh + (g.kh - 1) * dh + 1       # plane rows / columns the taps reach
    cols = (g.ow - 1) * sw + (g.kw - 1) * dw + 1
    in_place = tuple(g.pads) == (0, 0) and rows <= g.h and cols <= g.w
    ph, pw = (g.h, g.w) if in_place else (rows, cols)
    taps = [kh * dh * pw + kw * dw for kh in range(g.kh) for kw in range(g.kw)]
    tab = tuple(ci * ph * pw + t for ci in range(g.c // g.group) for t in taps)
    return CvecGeom(in_place, ph, pw, sh, sw, tab)


def _pad_kernel(d, geom: CvecGeom) -> L.Kernel:
    """conv_rows' copy kernel for a plain (stride-1 layout) zero-padded plane of ``ph x pw``."""
    from .conv_rows import RowsGeom, _pad_kernel as rows_pad
    return rows_pad(d, RowsGeom(1, 1, geom.ph, geom.pw, geom.ch, 0, (), ((0, 0),)))


#: work per useful FMA of a one-vector panel relative to a two-vector one (1 thread, 14-pixel
#: tiles: 672 -> 112 channels at 14x14 ran 223 GFLOP/s with two vectors and 14% padded channels,
#: 202 with one and none; grouped 24-channel 3x3 convs 0.85-0.90x)
ONE_VECTOR_EFFICIENCY = 0.85
#: useful fraction of the FMAs below which a small conv (under ``SMALL_CONV_FLOPS``, whose other
#: path is the implicit GEMM) stays off this kernel
MIN_EFFICIENCY = 0.5
#: pixels per tile: with AVX-512, 2 vectors x 14 broadcasts per k fill 28 of the 32 registers
#: with accumulators; one-vector panels with 28 pixels measured slower (load-bound), so 14 there too
MAX_TILE_PIXELS = 14


def _panel_choice(m: int, vl: int) -> tuple:
    """``(useful fraction, nv)`` of the better panel width (two vectors or one) for ``m`` channels."""
    best = (0.0, 2)
    for nv, eff in ((2, 1.0), (1, ONE_VECTOR_EFFICIENCY)):
        nr = nv * vl
        e = eff * m / (-(-m // nr) * nr)
        if e > best[0]:
            best = (e, nv)
    return best


def _rows_fill(d) -> float:
    """Useful fraction of the row-reading conv's FMAs for conv GEMM ``d`` (its ``MR``-row panels
    times its ``NR``-column panels over the grid, whose ``Q - OW`` columns a row are dropped),
    0 where that kernel does not run ``d``: this kernel takes a conv unless its own fraction
    is lower (at equal fractions its micro-kernel measured 1.1-1.3x faster on one thread; RegNetY's
    24-channel groups, 0.75 here, ran 0.87x the row kernel's speed at 14x14, where that fills 0.875)."""
    from .conv_rows import rows_geom, rows_reason
    from .gemm import blocking_for
    if not rows_reason(d):
        return 0.0
    bl = blocking_for(d.m)
    g = d.conv
    grid = rows_geom(g).grid
    return d.m / (-(-d.m // bl.mr) * bl.mr) * (g.oh * g.ow) / (-(-grid // bl.nr) * bl.nr)


def cvec_blocking(g, m: int, vl: int = 16) -> CvecBlocking:
    """The default blocking of a conv with ``m`` output channels per group: panels of two
    vectors (32 channels on AVX-512) unless one-vector panels waste enough less padding
    (:data:`ONE_VECTOR_EFFICIENCY`), and pixel tiles of up to :data:`MAX_TILE_PIXELS` pixels:
    ``cb`` columns (``OW`` split evenly) by as many rows as fit."""
    nv = _panel_choice(m, vl)[1]
    # accumulators: all registers but the weight vectors, a broadcast and one spare
    mr = min((_registers(vl) - nv - 2) // nv, MAX_TILE_PIXELS)
    cb = -(-g.ow // -(-g.ow // mr))
    rb = max(1, min(g.oh, mr // cb))
    return CvecBlocking(vl, nv, rb, cb, prefetch=PREFETCH_BYTES)


#: split output rows into more bands until the tiles divide among the threads within
#: ``BALANCE_SLACK`` (a tile count that is not a multiple of the thread count leaves one thread
#: idle for the last tile); False: bands only for too few panels (A/B measurements)
BALANCE = False
BALANCE_SLACK = 1 / 16


def _imbalance(tiles: int, threads: int) -> float:
    """The busiest thread's tiles over the mean, equal tiles claimed one at a time."""
    return -(-tiles // threads) * threads / tiles


def cvec_layout(d, bl: CvecBlocking, threads: int) -> CvecLayout:
    """One tile per (image*group, panel); while that is fewer than ``tiles_per_thread *
    threads`` tiles, the output rows are split into bands (whole pixel tiles, at least one
    tile row each); and (:data:`BALANCE`) into more while the tiles do not divide among the
    threads within :data:`BALANCE_SLACK`."""
    from .gemm import k_blocks
    g = d.conv
    npan = -(-d.m // bl.nr)
    rows = -(-g.oh // bl.rb)            # pixel-tile rows
    want = bl.tiles_per_thread * max(1, threads)
    nb = 1
    if threads > 1 and d.batch * npan < want:
        nb = min(rows, -(-want // (d.batch * npan)))

    def split(nb):
        per = -(-rows // nb)
        return tuple((i * per * bl.rb, min(g.oh, (i + 1) * per * bl.rb)) for i in range(-(-rows // per)))
    bands = split(nb)
    if BALANCE and threads > 1:
        # more bands while the last round of tiles leaves a thread idle for more than
        # BALANCE_SLACK of the call (RegNetY's 336 channels: 11 panels, 6 tiles against 5)
        while nb < rows and _imbalance(d.batch * npan * len(bands), threads) > 1 + BALANCE_SLACK:
            nb += 1
            bands = split(nb)
    nkc, kcb = k_blocks(d.k, bl.kc)
    ps = max(-(-((r1 - r0) * g.ow) // 16) * 16 for r0, r1 in bands)
    return CvecLayout(npan, bands, d.batch * npan * len(bands), nkc, kcb, ps)


def cvec_reason(d, target: str = "cpu") -> str:
    """Why conv GEMM ``d`` (a :class:`~apollo_py.codegen.gemm.GemmDesc` with ``conv``) runs on
    the channel-vector kernel ("" = not): a CPU conv with a constant weight (the caller
    checks) whose output plane has at most ``MAX_PIXELS`` pixels (or a strided 1x1 conv read in
    place below ``SMALL_CONV_FLOPS``, :data:`STRIDED_SMALL`), at most ``MAX_TAPS`` taps a
    channel, whose padded copy (if it needs one) fits ``conv_rows.MAX_PAD_BYTES``, and whose
    padded output channels waste no more FMAs than the row-reading kernel's panels would
    (:func:`_rows_fill`; at least :data:`MIN_EFFICIENCY` useful where that kernel is not used)."""
    from .conv_rows import MAX_PAD_BYTES, MAX_TAPS
    g = d.conv
    if not ENABLED or g is None or target in ("cuda", "cuda-emu"):
        return ""
    if min(g.n, g.c, g.h, g.w, g.oh, g.ow, d.m, d.k) <= 0 or g.kh * g.kw > MAX_TAPS:
        return ""
    from .gemm import SMALL_CONV_FLOPS, host_blocking
    strided_small = (STRIDED_SMALL and (g.kh, g.kw) == (1, 1) and tuple(g.strides) != (1, 1)
                     and cvec_geom(g).in_place and 2 * d.batch * d.m * d.n * d.k < SMALL_CONV_FLOPS)
    if g.oh * g.ow > MAX_PIXELS and not strided_small:
        return ""
    eff = _panel_choice(d.m, host_blocking().vl)[0]
    if eff < MIN_EFFICIENCY:
        return ""
    rows = _rows_fill(d)
    if eff < rows:
        return ""
    geom = cvec_geom(g)
    if not geom.in_place and 4 * g.n * g.c * geom.ch > MAX_PAD_BYTES:
        return ""
    src = "the input in place" if geom.in_place else "a padded copy"
    return (f"vectors along output channels, {g.oh}x{g.ow} pixels broadcast from {src}; "
            f"{100 * eff:.0f}% of FMAs useful" + (f" (row kernel {100 * rows:.0f}%)" if rows else ""))


# ------------------------------------------------------------------ IR


def _pixel_tiles(g, bl: CvecBlocking, r0: int, r1: int) -> list:
    """``(oh0, ow0, rows, cols)`` of the pixel tiles covering output rows ``[r0, r1)``."""
    out = []
    for oh in range(r0, r1, bl.rb):
        for ow in range(0, g.ow, bl.cb):
            out.append((oh, ow, min(bl.rb, r1 - oh), min(bl.cb, g.ow - ow)))
    return out


def _micro_ir(bl: CvecBlocking, rows: int, cols: int, geom: CvecGeom, ow: int, pf: bool = False) -> str:
    """``@cvec.m<rows>x<cols>(a, b, tab, c, kc, first)``: for the ``rows x cols`` pixels at
    ``b + dr * sh * pw + dc * sw`` and the ``NR`` channels of the packed panel ``a[k][NR]``,
    ``C[pixel][NR] (= 0 if first) += sum_{k < kc} b[tab[k] + disp] * a[k]``; pixel ``(dr, dc)``
    of C is row ``dr * ow + dc`` (row length NR, 64-byte aligned)."""
    from .gemm_ir import splat_ir
    vt = f"<{bl.vl} x float>"
    nr, nv = bl.nr, bl.nv
    pix = [(dr, dc) for dr in range(rows) for dc in range(cols)]
    accs = [(p, v) for p in range(len(pix)) for v in range(nv)]
    s = [f"define internal void @cvec.m{rows}x{cols}{'p' if pf else ''}(ptr noalias nocapture readonly %a, "
         "ptr noalias nocapture readonly %b, ptr noalias nocapture readonly %tab, ptr noalias nocapture %c, "
         "i64 %kc, i1 %first) #1 {", "entry:", "  br label %loop", "loop:",
         "  %k = phi i64 [0, %entry], [%k1, %loop]"]
    for p, v in accs:
        s.append(f"  %acc{p}_{v} = phi {vt} [zeroinitializer, %entry], [%n{p}_{v}, %loop]")
    s += ["  %tp = getelementptr inbounds i64, ptr %tab, i64 %k", "  %to = load i64, ptr %tp, align 8",
          "  %bp = getelementptr inbounds float, ptr %b, i64 %to", f"  %ao = mul nuw nsw i64 %k, {nr}"]
    if pf:      # the panel is contiguous over all of K (and the next panel follows it)
        for ln in range(max(1, nr * 4 // 64)):
            s += [f"  %pfo{ln} = add nuw nsw i64 %ao, {bl.prefetch // 4 + 16 * ln}",
                  f"  %pfp{ln} = getelementptr float, ptr %a, i64 %pfo{ln}",
                  f"  call void @llvm.prefetch.p0(ptr %pfp{ln}, i32 0, i32 3, i32 1)"]
    for v in range(nv):
        s += [f"  %ai{v} = add nuw nsw i64 %ao, {v * bl.vl}",
              f"  %ap{v} = getelementptr inbounds float, ptr %a, i64 %ai{v}",
              f"  %w{v} = load {vt}, ptr %ap{v}, align 64"]
    for p, (dr, dc) in enumerate(pix):
        s += [f"  %sp{p} = getelementptr inbounds float, ptr %bp, i64 {dr * geom.sh * geom.pw + dc * geom.sw}",
              *splat_ir(f"sv{p}", f"%sp{p}", vt, bl.vl)]
        for v in range(nv):
            s.append(f"  %n{p}_{v} = call {vt} @llvm.fma.v{bl.vl}f32({vt} %sv{p}, {vt} %w{v}, {vt} %acc{p}_{v})")
    s += ["  %k1 = add nuw nsw i64 %k, 1", "  %kcnd = icmp ult i64 %k1, %kc",
          "  br i1 %kcnd, label %loop, label %exit", "exit:", "  br i1 %first, label %st, label %ad", "st:"]
    for p, v in accs:
        dr, dc = pix[p]
        s += [f"  %cp{p}_{v} = getelementptr inbounds float, ptr %c, i64 {(dr * ow + dc) * nr + v * bl.vl}",
              f"  store {vt} %n{p}_{v}, ptr %cp{p}_{v}, align 64"]
    s += ["  ret void", "ad:"]
    for p, v in accs:
        dr, dc = pix[p]
        s += [f"  %dp{p}_{v} = getelementptr inbounds float, ptr %c, i64 {(dr * ow + dc) * nr + v * bl.vl}",
              f"  %dl{p}_{v} = load {vt}, ptr %dp{p}_{v}, align 64",
              f"  %ds{p}_{v} = fadd {vt} %n{p}_{v}, %dl{p}_{v}",
              f"  store {vt} %ds{p}_{v}, ptr %dp{p}_{v}, align 64"]
    s += ["  ret void", "}"]
    return "\n".join(s)


def _band_ir(i: int, tiles: list, geom: CvecGeom, ow: int, nr: int, r0: int, pf: bool = False) -> str:
    """``@cvec.band<i>(a, b, tab, c, kc, first)``: the micro-kernel of every pixel tile of band
    ``i`` (its first output row ``r0``), C rows relative to the band's first pixel."""
    s = [f"define internal void @cvec.band{i}(ptr %a, ptr %b, ptr %tab, ptr %c, i64 %kc, i1 %first) #1 {{",
         "entry:"]
    for n, (oh, owo, rows, cols) in enumerate(tiles):
        s += [f"  %b{n} = getelementptr inbounds float, ptr %b, i64 {oh * geom.sh * geom.pw + owo * geom.sw}",
              f"  %c{n} = getelementptr inbounds float, ptr %c, i64 {((oh - r0) * ow + owo) * nr}",
              f"  call void @cvec.m{rows}x{cols}{'p' if pf and n == 0 else ''}(ptr %a, ptr %b{n}, ptr %tab, "
              f"ptr %c{n}, i64 %kc, i1 %first)"]
    s += ["  ret void", "}"]
    return "\n".join(s)


def _transpose_ir(vl: int, src_rs: int, dst_rs: int) -> str:
    """``@cvec.tr(s, d)``: the ``vl x vl`` block at ``s`` (row stride ``src_rs`` floats) stored
    transposed at ``d`` (row stride ``dst_rs``), both 64-byte aligned: ``log2(vl)`` rounds of
    two-source shuffles, round ``t`` swapping bit ``t`` of the row number with bit ``t`` of the
    lane (``vl * log2(vl)`` shuffles: 64 for 16 x 16)."""
    vt = f"<{vl} x float>"
    s = ["define internal void @cvec.tr(ptr noalias nocapture readonly %s, ptr noalias nocapture %d) #1 {", "entry:"]
    cur = []
    for r in range(vl):
        s += [f"  %sp{r} = getelementptr inbounds float, ptr %s, i64 {r * src_rs}",
              f"  %r0_{r} = load {vt}, ptr %sp{r}, align 64"]
        cur.append(f"%r0_{r}")
    bit, rnd = 1, 0
    while bit < vl:
        nxt = [""] * vl
        lo_mask = ", ".join(f"i32 {c if not c & bit else vl + (c ^ bit)}" for c in range(vl))
        hi_mask = ", ".join(f"i32 {(c | bit) if not c & bit else vl + c}" for c in range(vl))
        for r in range(vl):
            if r & bit:
                continue
            a, b = cur[r], cur[r | bit]
            s += [f"  %r{rnd + 1}_{r} = shufflevector {vt} {a}, {vt} {b}, <{vl} x i32> <{lo_mask}>",
                  f"  %r{rnd + 1}_{r | bit} = shufflevector {vt} {a}, {vt} {b}, <{vl} x i32> <{hi_mask}>"]
            nxt[r], nxt[r | bit] = f"%r{rnd + 1}_{r}", f"%r{rnd + 1}_{r | bit}"
        cur, bit, rnd = nxt, bit * 2, rnd + 1
    for r in range(vl):
        s += [f"  %dp{r} = getelementptr inbounds float, ptr %d, i64 {r * dst_rs}",
              f"  store {vt} {cur[r]}, ptr %dp{r}, align 64"]
    s += ["  ret void", "}"]
    return "\n".join(s)


def _main_ir(d, bl: CvecBlocking, lay: CvecLayout, geom: CvecGeom, epi: str) -> str:
    """The tile loop (tiles claimed from a counter, as the generated GEMM's: codegen/gemm_ir.py):
    per tile the K blocks of every pixel tile of its band into the pixel-major scratch, then
    the transposes and one epilogue call for the band's rows of output."""
    from .gemm_ir import index_table, wait_all_ir, x86_decls
    g = d.conv
    cg = g.c // g.group
    nr, vl = bl.nr, bl.vl
    n_extra = len(d.operands) + len(d.outputs)
    nb = len(lay.bands)
    per_b = lay.npan * nb
    cbytes = lay.ps * nr * 4
    tbytes = nr * lay.ps * 4
    plo = [r0 * g.ow for r0, _ in lay.bands]
    npix = [(r1 - r0) * g.ow for r0, r1 in lay.bands]
    s = [f"define void @{d.name}(ptr %args, i64 %lo, i64 %hi) #0 {{", "entry:",
         "  %wp = load ptr, ptr %args",
         "  %g1 = getelementptr ptr, ptr %args, i64 1", "  %xs = load ptr, ptr %g1",
         f"  %cscr = call ptr @aligned_alloc(i64 64, i64 {cbytes})",
         f"  %trs = call ptr @aligned_alloc(i64 64, i64 {tbytes})",
         "  %einfo = alloca [4 x i64], align 8", f"  %eargs = alloca [{2 + n_extra} x ptr], align 8",
         "  store ptr %trs, ptr %eargs",
         "  %ea1 = getelementptr ptr, ptr %eargs, i64 1", "  store ptr %einfo, ptr %ea1",
         "  %ei1 = getelementptr i64, ptr %einfo, i64 1", "  %ei2 = getelementptr i64, ptr %einfo, i64 2",
         "  %ei3 = getelementptr i64, ptr %einfo, i64 3"]
    for x in range(n_extra):
        s += [f"  %xg{x} = getelementptr ptr, ptr %args, i64 {2 + x}", f"  %x{x} = load ptr, ptr %xg{x}",
              f"  %eg{x} = getelementptr ptr, ptr %eargs, i64 {2 + x}", f"  store ptr %x{x}, ptr %eg{x}"]
    # the tile counter protocol of codegen/gemm_ir.py main_ir: a call of the whole range is alone
    # (its own counter on the stack); the pool's caller passes [0, 1), its helpers [1, 2)
    s += ["  %live = icmp slt i64 %lo, %hi", "  %lo0 = icmp eq i64 %lo, 0", "  %waits = and i1 %live, %lo0",
          f"  %hiall = icmp eq i64 %hi, {lay.tiles}", "  %solo = and i1 %lo0, %hiall",
          "  %lctr = alloca [2 x i64], align 8", "  store i64 0, ptr %lctr, align 8",
          "  %lctr1 = getelementptr i64, ptr %lctr, i64 1", "  store i64 0, ptr %lctr1, align 8",
          f"  %ctg = getelementptr ptr, ptr %args, i64 {2 + n_extra}", "  %actr = load ptr, ptr %ctg",
          "  %ctr = select i1 %solo, ptr %lctr, ptr %actr",
          "  %ctr1 = getelementptr i64, ptr %ctr, i64 1",
          "  br i1 %live, label %tcond, label %done",
          "tcond:", "  %t = atomicrmw add ptr %ctr, i64 1 monotonic",
          f"  %tc = icmp slt i64 %t, {lay.tiles}", "  br i1 %tc, label %tbody, label %done",
          "tbody:",
          f"  %b = udiv i64 %t, {per_b}", f"  %rem = urem i64 %t, {per_b}",
          f"  %cp = udiv i64 %rem, {nb}", f"  %bd = urem i64 %rem, {nb}",
          f"  %atp = getelementptr [{len(d.a_index)} x i64], ptr @cvec.atab, i64 0, i64 %b",
          "  %abv = load i64, ptr %atp",
          f"  %apn0 = mul i64 %abv, {lay.npan}", "  %apn = add i64 %apn0, %cp",
          f"  %apo = mul i64 %apn, {d.k * nr}", "  %ap = getelementptr float, ptr %wp, i64 %apo",
          f"  %xo = mul i64 %b, {cg * geom.ch}", "  %xb = getelementptr float, ptr %xs, i64 %xo",
          f"  %fnp = getelementptr [{nb} x ptr], ptr @cvec.bands, i64 0, i64 %bd", "  %fn = load ptr, ptr %fnp",
          f"  %plp = getelementptr [{nb} x i64], ptr @cvec.plo, i64 0, i64 %bd", "  %plo = load i64, ptr %plp",
          f"  %npp = getelementptr [{nb} x i64], ptr @cvec.npix, i64 0, i64 %bd", "  %np = load i64, ptr %npp",
          f"  %co0 = mul i64 %cp, {nr}", f"  %mleft = sub i64 {d.m}, %co0",
          f"  %mrow = call i64 @llvm.smin.i64(i64 %mleft, i64 {nr})",
          "  br label %kcond",
          "kcond:", "  %pc = phi i64 [0, %tbody], [%pcn, %kbody]",
          f"  %pcc = icmp slt i64 %pc, {lay.nkc}", "  br i1 %pcc, label %kbody, label %trpre",
          "kbody:",
          f"  %k0 = mul i64 %pc, {lay.kcb}", f"  %kleft = sub i64 {d.k}, %k0",
          f"  %kc = call i64 @llvm.smin.i64(i64 %kleft, i64 {lay.kcb})", "  %first = icmp eq i64 %pc, 0",
          f"  %ako = mul i64 %k0, {nr}", "  %apk = getelementptr float, ptr %ap, i64 %ako",
          f"  %tpk = getelementptr [{d.k} x i64], ptr @cvec.tab, i64 0, i64 %k0",
          "  call void %fn(ptr %apk, ptr %xb, ptr %tpk, ptr %cscr, i64 %kc, i1 %first)",
          "  %pcn = add i64 %pc, 1", "  br label %kcond",
          # [pixel][NR] -> [NR][pixel] in vl x vl blocks (pixels past the band: garbage, never stored)
          "trpre:", f"  %npr = add i64 %np, {vl - 1}", f"  %nblk = udiv i64 %npr, {vl}", "  br label %trcond",
          "trcond:", "  %pb = phi i64 [0, %trpre], [%pbn, %trbody]",
          "  %trc = icmp slt i64 %pb, %nblk", "  br i1 %trc, label %trbody, label %epi",
          "trbody:", f"  %tso = mul i64 %pb, {vl * nr}", f"  %tdo = mul i64 %pb, {vl}"]
    for v in range(bl.nv):
        s += [f"  %tso{v} = add i64 %tso, {v * vl}", f"  %tsp{v} = getelementptr float, ptr %cscr, i64 %tso{v}",
              f"  %tdo{v} = add i64 %tdo, {v * vl * lay.ps}", f"  %tdp{v} = getelementptr float, ptr %trs, i64 %tdo{v}",
              f"  call void @cvec.tr(ptr %tsp{v}, ptr %tdp{v})"]
    s += ["  %pbn = add i64 %pb, 1", "  br label %trcond",
          "epi:", "  store i64 %b, ptr %einfo", "  store i64 %co0, ptr %ei1", "  store i64 %plo, ptr %ei2",
          "  store i64 %np, ptr %ei3", f"  call void @{epi}(ptr %eargs, i64 0, i64 %mrow)",
          "  %fin0 = atomicrmw add ptr %ctr1, i64 1 release", "  br label %tcond",
          "done:", "  call void @free(ptr %cscr)", "  call void @free(ptr %trs)",
          *wait_all_ir(lay.tiles), "}"]
    head = [f"; channel-vector conv {d.name}: batch {d.batch}, {d.m}x{g.oh * g.ow}x{d.k}, panel {nr} channels, "
            f"pixel tile {bl.rb}x{bl.cb}, KC {lay.kcb}, bands {lay.bands}",
            index_table("cvec.atab", d.a_index), index_table("cvec.tab", geom.tab),
            index_table("cvec.plo", plo), index_table("cvec.npix", npix),
            f"@cvec.bands = private unnamed_addr constant [{nb} x ptr] ["
            + ", ".join(f"ptr @cvec.band{i}" for i in range(nb)) + "]",
            "declare ptr @aligned_alloc(i64, i64)", "declare void @free(ptr)",
            "declare i64 @llvm.smin.i64(i64, i64)", "declare void @llvm.prefetch.p0(ptr, i32, i32, i32)",
            *x86_decls(),
            f"declare <{vl} x float> @llvm.fma.v{vl}f32(<{vl} x float>, <{vl} x float>, <{vl} x float>)",
            f"declare void @{epi}(ptr, i64, i64)"]
    micro, bands = {}, []
    for i, (r0, r1) in enumerate(lay.bands):
        tiles = _pixel_tiles(g, bl, r0, r1)
        for n, (_, _, rows, cols) in enumerate(tiles):
            pf = bool(bl.prefetch) and n == 0
            if (rows, cols, pf) not in micro:
                micro[rows, cols, pf] = _micro_ir(bl, rows, cols, geom, g.ow, pf)
        bands.append(_band_ir(i, tiles, geom, g.ow, nr, r0, bool(bl.prefetch)))
    return "\n".join([*head, *micro.values(), *bands, _transpose_ir(vl, nr, lay.ps), "\n".join(s)])


# ------------------------------------------------------------------ compile


class CompiledConvCvec:
    """Machine code of one channel-vector conv: ``run(pool, w, x, operands, outputs)`` like
    :class:`~apollo_py.codegen.gemm.CompiledGemm` (the weight is A, packed once by
    :meth:`packed_a`).  A conv that reads its input in place is one call of ``main`` (the
    native driver runs it on the calling thread when ``inline``); one with a padded copy runs
    the ``pad`` kernel first, from Python."""

    #: the main kernel claims its tiles from a counter (its last argument), as the GEMM's
    claims_tiles = True

    def __init__(self, desc, bl: CvecBlocking, lay: CvecLayout, engine, ir: str, main_params, pad, small: bool):
        import threading
        self.desc, self.blocking, self.layout = desc, bl, lay
        self.engine, self.ir = engine, ir
        main = L.Kernel(desc.name, (*main_params, L.Param("tile_counter", "int64", 2)), L.Block(), "t", lay.tiles)
        self.main = CompiledKernelBase(main, engine.get_function_address(desc.name))
        self.pad = CompiledKernelBase(pad, engine.get_function_address(pad.name)) if pad is not None else None
        #: one call on the calling thread (below SMALL_CONV_FLOPS); the native driver runs it
        #: (``inline``) when there is no copy to make first
        self.small = small
        self.inline = small and pad is None
        self._packed_a: tuple = (None, None)
        self._packed: tuple = (None, None)
        self.pad_size = main_params[1].size
        # the padded copy, one per calling thread: a fresh array of a few hundred KB per call is
        # an mmap, page faults and an munmap
        self._local = threading.local()

    def packed_a(self, a: np.ndarray) -> np.ndarray:
        """``a`` (the constant weight ``[Cout, Cin/g, kh, kw]``) packed once into
        ``[group][panel][K][NR]``, zero padded to whole panels; kept for the next call."""
        from .gemm import _aligned_zeros
        src, packed = self._packed_a
        if src is a:
            return packed
        d, lay, nr = self.desc, self.layout, self.blocking.nr
        groups = d.a_batches
        w = np.zeros((groups, lay.npan * nr, d.k), np.float32)
        w[:, :d.m] = np.asarray(a, np.float32).reshape(groups, d.m, d.k)
        packed = _aligned_zeros(w.size)
        packed.reshape(groups, lay.npan, d.k, nr)[...] = w.reshape(groups, lay.npan, nr, d.k).transpose(0, 1, 3, 2)
        self._packed_a = (a, packed)
        return packed

    def packed_b(self, b):   # the packed store's interface: B is never constant here
        raise CompileError(f"{self.desc.name}: channel-vector conv has no constant B")

    def run(self, pool, a: np.ndarray, x: np.ndarray, operands, outputs) -> None:
        src = x
        if self.pad is not None:
            src = getattr(self._local, "xpad", None)
            if src is None:
                src = self._local.xpad = np.empty(self.pad_size, np.float32)
            if pool is None or self.small or 4 * self.pad_size <= PAD_INLINE_BYTES:
                self.pad([src, x])
            else:
                pool.run(self.pad, [src, x])
        arrays = [self.packed_a(a), src, *operands, *outputs, np.zeros(2, np.int64)]
        run_claiming(self.main, pool, arrays, self.small or self.layout.tiles == 1)


@lru_cache(maxsize=None)
def _source_digest() -> str:
    import os
    from ..fsutil import files_digest
    here = os.path.dirname(__file__)
    return files_digest(os.path.join(here, f) for f in
                        ("conv_cvec.py", "conv_rows.py", "gemm.py", "gemm_ir.py", "loopir.py", "printer.py",
                         "scalar_ops.py"))


def compile_conv_cvec(d, threads: int, bl: Optional[CvecBlocking] = None,
                      cache_dir: Optional[str] = None) -> CompiledConvCvec:
    """Generate, optimise (O3) and JIT the channel-vector conv of conv GEMM ``d`` (``a_const``:
    the weight is a constant) through the piecewise cache; convs below ``SMALL_CONV_FLOPS``
    that read their input in place run on the calling thread.  Raises CompileError for sizes
    it cannot run or an epilogue op without a scalar lowering."""
    from .cached import compile_module
    from .gemm import SMALL_CONV_FLOPS, Blocking, _epilogue_kernel, canonical, host_blocking, link_ir
    from .llvm import LLVMPrinter, host
    if d.conv is None or not d.a_const or min(d.m, d.n, d.k, d.batch) <= 0:
        raise CompileError(f"{d.name}: channel-vector conv needs a conv with a constant weight and positive sizes")
    named, d = d, canonical(d)
    d = replace(d, name="cvec" + d.name[4:])
    g = d.conv
    flops = 2 * d.batch * d.m * d.n * d.k
    small = flops < SMALL_CONV_FLOPS
    bl = bl or cvec_blocking(g, d.m, host_blocking().vl)
    if bl.nr % bl.vl or bl.vl & (bl.vl - 1) or bl.rb * bl.cb * bl.nv > _registers(bl.vl) - bl.nv:
        raise CompileError(f"{d.name}: channel-vector blocking {bl} does not fit the registers")
    # a small conv runs on the calling thread, or shared with the native driver's helper
    # (runtime/gemm_step.py, shares_tiles): split for that many threads (SMALL_SPLIT)
    lay = cvec_layout(d, bl, threads if SMALL_SPLIT or not small else 1)
    geom = cvec_geom(g)
    pad = None if geom.in_place else _pad_kernel(d, geom)
    epi = _epilogue_kernel(d, Blocking(bl.vl, bl.nr, lay.ps))     # tile rows: NR channels of ps pixels

    def build():
        h = host()
        texts = [LLVMPrinter().render(k, h.cpu_attrs) for k in (pad, epi) if k is not None]
        main = _main_ir(d, bl, lay, geom, epi.name)
        main += (f"\nattributes #0 = {{ nounwind {h.cpu_attrs} }}\n"
                 f"attributes #1 = {{ noinline nounwind {h.cpu_attrs} }}\n")
        return link_ir(d.name, main, texts)
    engine, ir = compile_module(repr(("conv_cvec", d, bl, lay, _source_digest())), build, cache_dir, d.name)
    size = g.n * g.c * geom.ch
    wparam = L.Param("wpk", "float32", d.a_batches * lay.npan * d.k * bl.nr)
    xparam = L.Param("x" if pad is None else "xpad", "float32", size)
    cc = CompiledConvCvec(d, bl, lay, engine, ir, (wparam, xparam, *epi.params[2:]), pad, small)
    cc.desc = named
    return cc
