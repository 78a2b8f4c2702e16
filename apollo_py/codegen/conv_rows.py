"""Dense conv as a GEMM whose micro-kernel reads the input rows in place (no im2col pack).

The implicit GEMM (codegen/gemm.py) packs the im2col matrix ``B[K = Cin*kh*kw][OH*OW]`` per
tile and call: the ResNet stem packs 7.4 MB per call, a 3x3 conv with 64 output rows at 56x56
amortises each packed element over only 64 rows, and every row group packs its own copy (so at
7x7 spatial the layout splits columns instead and re-reads the multi-megabyte weight per
column block).  Here the input is copied once per call into a zero-padded, phase-split buffer
(``pad`` kernel, one pass over the input) in which every im2col row is a contiguous run:

* padded sub-plane ``(pr, pc)`` (``pr < sh``, ``pc < sw``; only those some tap reads: one for
  a strided 1x1 conv) of channel ``c`` holds padded-image
  element ``(r * sh + pr, q * sw + pc)`` at ``(r, q)``, ``QH x Q`` of them (``Q = OW +
  (kw-1)*dw // sw``, ``QH = OH + (kh-1)*dh // sh``); for stride 1 that is the plain padded plane;
* output ``(oh, ow)`` is *grid column* ``j = oh * Q + ow`` of a GEMM over ``OH * Q`` columns (the
  ``Q - OW`` columns per row are computed and discarded: 3.5% at 56x56 3x3, 22% at 7x7);
* tap ``(ci, kh, kw)`` (row ``k`` of B) reads sub-plane ``(kh*dh % sh, kw*dw % sw)`` of channel
  ``ci`` at offset ``(kh*dh // sh) * Q + kw*dw // sw`` from ``j``: ``B[k][j] = xpad[tab[k] + j]``
  with the constant offset table ``tab`` (an LLVM global).

The micro-kernel (``rows.micro``, the generated GEMM's register blocking: ``MR x NR/VL`` vector
accumulators, one broadcast of the packed constant A per row and k) loads its ``NR`` B values
per k from ``xpad + tab[k] + j``, unaligned.  Tiles are ``(image*group, column block, row
group)``; since nothing is packed per tile, the rows are split among threads before the columns
(a small-spatial conv reads its weight once).  The ``MR x NR`` results of a row panel go to a
row-major ``MR x (NC + NR)`` scratch block, and after the last K block the GEMM's epilogue
kernel (``gemm._epilogue_kernel``, unchanged) runs once per grid-row segment of valid columns;
during that last K block the output lines the epilogue will store are prefetched.  The weight
is packed once (``gemm._pack_a_kernel``).  One call per thread does everything: chunks of the
padded copy, then tiles, both claimed from a counter (:func:`_main_ir`), as the generated GEMM.

A 1x1 conv at stride 1 without padding reads its input itself (no copy; its last partial
panel reads a small zero-padded side copy).  Chosen by :func:`rows_reason` for CPU convs with a
constant weight (docs/design/conv.md).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from functools import lru_cache
from math import ceil
from typing import Optional

import numpy as np

from apollo_py.codegen import loopir as L
from apollo_py.codegen.compiled import CompiledKernelBase, run_claiming
from apollo_py.errors import CompileError

#: switch for A/B measurements in one process (benchmarks); the plan says which path runs
ENABLED = True
#: the padded, phase-split input copied per call stays below this (larger: implicit GEMM)
MAX_PAD_BYTES = 64 << 20
#: grid columns per B block: ``KC x NC`` floats of input rows read from L2 by every row panel
NC_MAX = 256
#: the layout splits rows, then columns, until there are this many tiles per thread: the
#: threads claim tiles one at a time, so the last tile bounds the time one thread waits for the
#: other (a 28x28 conv: 16 tiles instead of 8; the generated GEMM's TILES_PER_THREAD is 8 too)
TILES_PER_THREAD = 8
#: prefetch the epilogue's output lines during the last K block (:func:`_prefetch_ir`)
PREFETCH = True
#: 1x1 convs (stride 1, no padding) read their input in place (no copy at all)
POINTWISE = True
#: a 1x1 conv read in place has at least this many pixels (one full NR panel; fewer: the side
#: copy would be the whole input, and the implicit GEMM's pack is as cheap)
NR_MIN = 32


@dataclass(frozen=True)
class RowsGeom:
    """Padded, phase-split layout of a conv's input (module docstring)."""

    sh: int
    sw: int
    qh: int            # rows per sub-plane
    q: int             # columns per sub-plane row (the grid's row pitch)
    ch: int            # floats per channel: len(phases) * qh * q
    grid: int          # grid columns: OH * Q
    tab: tuple         # offset of im2col row k inside its image's padded channels
    phases: tuple = ((0, 0),)   # the sub-planes (pr, pc) some tap reads, in storage order


def rows_geom(g) -> RowsGeom:
    """The padded layout of :class:`~apollo_py.codegen.gemm.ConvGeom` ``g``."""
    sh, sw = g.strides
    dh, dw = g.dilations
    qh = g.oh + ((g.kh - 1) * dh) // sh
    q = g.ow + ((g.kw - 1) * dw) // sw
    # only the sub-planes a tap reads are stored (a 1x1 stride-2 conv: one of four)
    phases = tuple(sorted({(kh * dh % sh, kw * dw % sw) for kh in range(g.kh) for kw in range(g.kw)}))
    ch = len(phases) * qh * q
    taps = []
    for kh in range(g.kh):
        for kw in range(g.kw):
            rr, cc = kh * dh, kw * dw
            taps.append(phases.index((rr % sh, cc % sw)) * qh * q + (rr // sh) * q + cc // sw)
    cg = g.c // g.group
    tab = tuple(ci * ch + t for ci in range(cg) for t in taps)
    return RowsGeom(sh, sw, qh, q, ch, g.oh * q, tab, phases)


def in_place(g) -> bool:
    """Whether conv ``g``'s im2col rows are runs of the input itself (a 1x1 conv, stride 1, no
    padding, at least :data:`NR_MIN` pixels): the kernel reads the input without a padded copy."""
    return ((g.kh, g.kw) == (1, 1) and tuple(g.strides) == (1, 1) and tuple(g.pads) == (0, 0)
            and (g.oh, g.ow) == (g.h, g.w) and g.oh * g.ow >= NR_MIN)


def side_tail(g, nr: int) -> int:
    """Columns of the last, partial NR-column panel of a conv read in place (0: none).  That
    panel reads a zero-padded copy of those columns (``[image*group][k][NR]``, made per call)
    instead of reading past the input's end."""
    if not in_place(g):
        return 0
    return (g.oh * g.ow) % nr


#: kernel taps per channel (kh * kw) above which a conv stays on the implicit GEMM (7x7 stems fit)
MAX_TAPS = 49


def rows_reason(d, target: str = "cpu") -> str:
    """Why conv GEMM ``d`` (a :class:`~apollo_py.codegen.gemm.GemmDesc` with ``conv``) runs on
    the row-reading kernel ("" = the implicit GEMM): a CPU conv whose padded copy fits
    ``MAX_PAD_BYTES`` -- a 1x1 conv at stride 1 without padding only with at least
    ``NR_MIN`` pixels (read in place, no copy); not a conv under ``SMALL_CONV_FLOPS``."""
    g = d.conv
    if not ENABLED or g is None or target in ("cuda", "cuda-emu"):
        return ""
    if g.kh * g.kw > MAX_TAPS:
        # a patch embedding (ViT's 16x16 stride 16): its 768-row offset table made LLVM's O3
        # run for minutes; its im2col has no overlap to save anyway
        return ""
    from .gemm import SMALL_CONV_FLOPS
    if 2 * d.batch * d.m * d.n * d.k < SMALL_CONV_FLOPS:
        # small enough for the calling thread: the implicit GEMM, which the native driver runs
        # inline (CompiledGemm.inline); this kernel has a pad step and scratch of its own and
        # runs from Python on the pool
        return ""
    if (g.kh, g.kw) == (1, 1):
        if not POINTWISE:
            return ""
        if in_place(g):
            return "1x1 conv: input rows read in place"
        if tuple(g.strides) == (1, 1) and tuple(g.pads) == (0, 0):
            return ""   # fewer than NR_MIN pixels: a copy would cost more than the pack
        # strided or padded: a copy of the one sub-plane its taps read
    if min(g.n, g.c, g.h, g.w, g.oh, g.ow, d.m) <= 0:
        return ""
    r = rows_geom(g)
    if 4 * (g.n * g.c * r.ch) > MAX_PAD_BYTES:
        return ""
    waste = r.grid / (g.oh * g.ow) - 1
    return f"input rows read in place from a padded copy, {100 * waste:.0f}% grid columns discarded"


@dataclass(frozen=True)
class RowsLayout:
    """Tiles of the row-reading conv: ``batch * njc * mg``."""

    nc: int            # grid columns per block (a multiple of NR)
    njc: int
    mg: int            # row groups
    ppg: int           # MR-row panels per row group
    npan_a: int        # MR-row panels of one A batch
    tiles: int
    nkc: int
    kcb: int


def rows_layout(d, bl, threads: int) -> RowsLayout:
    """Row groups of at most ``max_panels`` panels and column blocks of at most ``NC_MAX``
    columns, as equal as the panels allow; while there are fewer than ``TILES_PER_THREAD *
    threads`` tiles, rows are split first (down to 2 panels a group: each row group re-reads
    only the B block, from cache), then columns.  The threads claim tiles one at a time
    (:func:`_main_ir`), so many equal tiles bound the wait for the last one."""
    from .gemm import k_blocks
    grid = rows_geom(d.conv).grid
    npc = -(-grid // bl.nr)
    nc_max = getattr(bl, "nc_max", 0) or NC_MAX        # nc_max: a tuning decision
    njc = -(-npc // min(npc, max(1, nc_max // bl.nr)))
    npan = -(-d.m // bl.mr)
    mg = -(-npan // bl.max_panels)
    want = TILES_PER_THREAD * max(1, threads)
    if d.batch * njc * mg < want:
        mg = max(mg, min(-(-want // (d.batch * njc)), max(1, npan // 2)))
    if d.batch * njc * mg < want:
        njc = max(njc, min(npc, -(-want // (d.batch * mg))))
    nc_p = -(-npc // njc)
    njc = -(-npc // nc_p)
    ppg = -(-npan // mg)
    mg = -(-npan // ppg)
    nkc, kcb = k_blocks(d.k, bl.kc)
    return RowsLayout(nc_p * bl.nr, njc, mg, ppg, npan, d.batch * njc * mg, nkc, kcb)


# ------------------------------------------------------------------ kernels


def _pad_kernel(d, r: RowsGeom) -> L.Kernel:
    """``xpad`` (``[N*C][sh*sw][QH][Q]``) from the NCHW input, parallel over channel planes;
    per sub-plane the rows and columns inside the image are constant ranges, so every row is a
    zero run, a copy (stride ``sw``) and a zero run.  The sub-planes ``(pr, pc)`` of one padded
    row ``pr`` are written by one loop over their common interior columns: its ``sw`` strided
    loads are one interleave group, which LLVM vectorises as contiguous loads and shuffles
    (one loop per sub-plane made each a gather or scalar loads: the stride-2 copy of RegNetY's
    336-channel 28x28 input took 64-75 us against 29 us this way, one thread)."""
    g = d.conv
    ph, pw = g.pads
    xp = L.Param("xpad", "float32", g.n * g.c * r.ch)
    x = L.Param("x", "float32", g.n * g.c * g.h * g.w)
    V = L.Var
    zero = L.Const(0.0, "float32")
    t = V("t")
    parts = []
    for pr in sorted({pr for pr, _ in r.phases}):
        subs = [(sub, pc) for sub, (p, pc) in enumerate(r.phases) if p == pr]
        rlo = max(0, ceil((ph - pr) / r.sh))
        rhi = max(rlo, min(r.qh, ceil((g.h + ph - pr) / r.sh)))
        cols = {sub: (max(0, min(r.q, ceil((pw - pc) / r.sw))), 0) for sub, pc in subs}
        cols = {sub: (lo, max(lo, min(r.q, ceil((g.w + pw - pc) / r.sw)))) for (sub, pc), (lo, _) in
                zip(subs, cols.values())}
        lo, hi = max(c[0] for c in cols.values()), min(c[1] for c in cols.values())
        src = t * (g.h * g.w) + (V("rr") * r.sh + (pr - ph)) * g.w

        def dst(sub):
            return t * r.ch + sub * r.qh * r.q + V("rr") * r.q + V("cc")

        def copy(sub, pc):
            return L.Store(xp, dst(sub), L.Load(x, src + V("cc") * r.sw + (pc - pw)))
        inner = []
        for sub, pc in subs:
            clo, chi = cols[sub]
            # the columns of this sub-plane outside the common range [lo, hi)
            e0, e1 = (min(max(lo, clo), chi), max(min(hi, chi), clo)) if hi > lo else (chi, chi)
            inner += [L.for_("cc", 0, clo, L.Store(xp, dst(sub), zero), "vector"),
                      L.for_("cc", clo, e0, copy(sub, pc), "vector"),
                      L.for_("cc", e1, chi, copy(sub, pc), "vector"),
                      L.for_("cc", chi, r.q, L.Store(xp, dst(sub), zero), "vector")]
        if hi > lo:
            inner.append(L.for_("cc", lo, hi, L.block(*(copy(sub, pc) for sub, pc in subs)), "vector"))
        zrow = L.block(*(L.for_("cc", 0, r.q, L.Store(xp, dst(sub), zero), "vector") for sub, _ in subs))
        parts += [L.for_("rr", 0, rlo, zrow), L.for_("rr", rlo, rhi, L.block(*inner)), L.for_("rr", rhi, r.qh, zrow)]
    loops = L.for_("t", 0, g.n * g.c, L.block(*parts), "parallel")
    return L.Kernel(f"{d.name}_pad", (xp, x), loops, "t", g.n * g.c)


def _micro_ir(bl, c_rs: int) -> str:
    """``@rows.micro(a, b, tab, c, kc, first)``: ``C[MR][NR] (= 0 if first) += sum_{k<kc}
    a[k][MR] (x) b[tab[k] .. + NR]`` -- the generated GEMM's micro-kernel (gemm_ir._micro_ir)
    with B rows found through the offset table instead of a packed panel; ``C[r][j]`` is
    ``c[r * c_rs + j]`` (any alignment: the panel clamped to the grid's end starts anywhere)."""
    vt = f"<{bl.vl} x float>"
    nv = bl.nr // bl.vl
    accs = [(r, v) for r in range(bl.mr) for v in range(nv)]
    s = ["define internal void @rows.micro(ptr noalias nocapture readonly %a, ptr noalias nocapture readonly %b, "
         "ptr noalias nocapture readonly %tab, ptr noalias nocapture %c, i64 %kc, i1 %first) #1 {",
         "entry:", "  br label %loop", "loop:", "  %k = phi i64 [0, %entry], [%k1, %loop]"]
    for r, v in accs:
        s.append(f"  %acc{r}_{v} = phi {vt} [zeroinitializer, %entry], [%n{r}_{v}, %loop]")
    s += ["  %tp = getelementptr inbounds i64, ptr %tab, i64 %k", "  %to = load i64, ptr %tp, align 8",
          "  %bp0 = getelementptr inbounds float, ptr %b, i64 %to"]
    for v in range(nv):
        if v:
            s.append(f"  %bp{v} = getelementptr inbounds float, ptr %bp0, i64 {v * bl.vl}")
        s.append(f"  %bv{v} = load {vt}, ptr %bp{v}, align 4")
    from .gemm_ir import micro_fma_tail_ir
    s += micro_fma_tail_ir(bl, bl.mr, 1, c_rs, 4)
    return "\n".join(s)


def pad_chunks(d) -> int:
    """Chunks of channel planes the ``pad`` kernel's work is claimed in (0: read in place)."""
    if in_place(d.conv):
        return 0
    planes = d.conv.n * d.conv.c
    per = -(-planes // min(planes, PAD_CHUNKS))     # planes per chunk (the last one may be short)
    return -(-planes // per)


#: the padded copy is claimed in at most this many chunks of channel planes
PAD_CHUNKS = 16


def _spin_ir(tag: str, ctr: str, target: int, after: str) -> list:
    """Wait (pause loops, then ``sched_yield`` after ``gemm_ir.SPINS`` rounds: a preempted
    thread on a loaded machine) until the int64 at ``ctr`` reaches ``target``; then branch to
    ``after``.  Entered by a branch to ``%<tag>``."""
    from .gemm_ir import SPINS, _x86
    return [f"{tag}:", f"  %{tag}_n = phi i64 [0, %{tag}_from], [%{tag}_n1, %{tag}_p], [0, %{tag}_y]",
            f"  %{tag}_v = load atomic i64, ptr {ctr} acquire, align 8",
            f"  %{tag}_ok = icmp sge i64 %{tag}_v, {target}", f"  br i1 %{tag}_ok, label %{after}, label %{tag}_m",
            f"{tag}_m:", f"  %{tag}_n1 = add i64 %{tag}_n, 1", f"  %{tag}_many = icmp ugt i64 %{tag}_n1, {SPINS}",
            f"  br i1 %{tag}_many, label %{tag}_y, label %{tag}_p",
            f"{tag}_p:", *(["  call void @llvm.x86.sse2.pause()"] if _x86() else []), f"  br label %{tag}",
            f"{tag}_y:", f"  %{tag}_yr = call i32 @sched_yield()", f"  br label %{tag}"]


def _side_ir(d, bl, r: RowsGeom) -> list:
    """``%bp`` / ``%tp``: the B rows and offset table of column panel ``%jb`` (a 1x1 conv read
    in place: its last, partial panel reads the side copy)."""
    if side_tail(d.conv, bl.nr):
        return ["  %gj = add i64 %j0, %jb", f"  %gje = add i64 %gj, {bl.nr}", f"  %part = icmp sgt i64 %gje, {r.grid}",
                f"  %sdo = mul i64 %b, {d.k * bl.nr}", "  %bps = getelementptr float, ptr %side, i64 %sdo",
                "  %bp = select i1 %part, ptr %bps, ptr %bpn",
                f"  %tps = getelementptr [{d.k} x i64], ptr @rows.stab, i64 0, i64 %k0",
                "  %tp = select i1 %part, ptr %tps, ptr %tpk"]
    return ["  %bp = getelementptr float, ptr %bpn, i64 0", "  %tp = getelementptr i64, ptr %tpk, i64 0"]


def _segments_ir(d, bl, lay: RowsLayout, r: RowsGeom, epi: str, cpr: str, mr: str, entry: str, after: str) -> list:
    """The epilogue of one row panel (scratch rows at ``cpr``, ``mr`` valid rows, ``%ei1`` set):
    its grid columns ``[j0, j0 + ncols)`` cut at grid rows, one epilogue call per run of valid
    columns (``ow < OW``; the rest are dropped); entered from ``%<entry>``, then ``%<after>``."""
    g = d.conv
    if r.q == g.ow:
        # no dropped columns (kw == 1): grid column j is output column j, one call for all
        return ["  store i64 %j0, ptr %ei2", "  store i64 %ncols, ptr %ei3", f"  store ptr {cpr}, ptr %eargs",
                f"  call void @{epi}(ptr %eargs, i64 0, i64 {mr})", f"  br label %{after}"]
    return ["  %ge = add i64 %j0, %ncols", "  br label %scond",
            "scond:", f"  %js = phi i64 [%j0, %{entry}], [%rend, %snext]",
            "  %sc = icmp slt i64 %js, %ge", f"  br i1 %sc, label %sbody, label %{after}",
            "sbody:", f"  %oh = udiv i64 %js, {r.q}", f"  %ohq = mul i64 %oh, {r.q}", "  %ow = sub i64 %js, %ohq",
            f"  %rowe = add i64 %ohq, {r.q}", "  %rend = call i64 @llvm.smin.i64(i64 %rowe, i64 %ge)",
            f"  %owok = icmp slt i64 %ow, {g.ow}", "  br i1 %owok, label %scall, label %snext",
            "scall:", f"  %vre = add i64 %ohq, {g.ow}", "  %vend = call i64 @llvm.smin.i64(i64 %vre, i64 %rend)",
            "  %slen = sub i64 %vend, %js", f"  %ohw = mul i64 %oh, {g.ow}", "  %col = add i64 %ohw, %ow",
            "  store i64 %col, ptr %ei2", "  store i64 %slen, ptr %ei3",
            "  %toff = sub i64 %js, %j0", f"  %tptr = getelementptr float, ptr {cpr}, i64 %toff",
            "  store ptr %tptr, ptr %eargs",
            f"  call void @{epi}(ptr %eargs, i64 0, i64 {mr})", "  br label %snext",
            "snext:", "  br label %scond"]


def _prefetched(d) -> list:
    """``(argument index among the epilogue's buffers, write)`` of the buffers the epilogue
    reads or writes at the output's own index (outputs, full-size operands such as a residual
    input): what :func:`_prefetch_ir` prefetches."""
    if not PREFETCH or d.out_perm is not None:
        return []
    full = [(q, False) for q, o in enumerate(d.operands) if tuple(o.shape) == tuple(d.out_shape)]
    return full + [(len(d.operands) + q, True) for q in range(len(d.outputs))]


def _prefetch_ir(d, bl, r: RowsGeom) -> list:
    """On the last K block, before column panel ``%jb``'s micro-kernel: prefetch the output
    (and full-size operand) lines that the row panel's epilogue will touch for these NR grid
    columns.  The output is written once per call, a few MB at 56x56 (3.2 MB for 256 channels),
    and its lines are not in cache: without this the epilogue's stores wait for one line after
    another (store misses are not prefetched by the hardware the way a load stream is); the
    micro-kernel's time covers the prefetches' latency."""
    bufs = _prefetched(d)
    if not bufs:
        return []
    g = d.conv
    ohw = g.oh * g.ow
    lines = -(-bl.nr // 16) + 1         # NR floats from any alignment
    s = ["  br i1 %last, label %pfb, label %pfe", "pfb:",
         "  %pgj = add i64 %j0, %jb", f"  %poh = udiv i64 %pgj, {r.q}", f"  %pohq = mul i64 %poh, {r.q}",
         "  %pow0 = sub i64 %pgj, %pohq", f"  %pow = call i64 @llvm.smin.i64(i64 %pow0, i64 {g.ow})",
         f"  %pc0 = mul i64 %poh, {g.ow}", "  %pcol = add i64 %pc0, %pow",
         f"  %pr0 = mul i64 %b, {d.m}", "  %pr1 = add i64 %pr0, %i0", f"  %pr2 = mul i64 %pr1, {ohw}",
         "  %pbase = add i64 %pr2, %pcol"]
    for q, write in bufs:
        for row in range(bl.mr):
            for ln in range(lines):
                s += [f"  %pf{q}_{row}_{ln} = getelementptr float, ptr %x{q}, i64 %pbase",
                      f"  %pg{q}_{row}_{ln} = getelementptr float, ptr %pf{q}_{row}_{ln}, i64 {row * ohw + 16 * ln}",
                      f"  call void @llvm.prefetch.p0(ptr %pg{q}_{row}_{ln}, i32 {int(write)}, i32 3, i32 1)"]
    return s + ["  br label %pfe", "pfe:"]


def _panels_ir(d, bl, lay: RowsLayout, r: RowsGeom, epi: str) -> list:
    """One K block of a tile: per MR-row panel (its packed weight in L1) every NR-column panel,
    then on the last K block that row panel's epilogue.  (Column panels outer, each gathered
    ``KC x NR`` input panel in L1 while the weight panels stream from L2, measured the same on
    one thread: 0.98-1.00x at 1x1 and 3x3 shapes.)"""
    return ["  br label %icond",
            "icond:", "  %ip = phi i64 [%ip0, %pbody], [%ipn, %inext]",
            "  %ic = icmp slt i64 %ip, %ip1", "  br i1 %ic, label %ibody, label %inext_p",
            "ibody:",
            f"  %i0 = mul i64 %ip, {bl.mr}", f"  %mleft = sub i64 {d.m}, %i0",
            f"  %mr = call i64 @llvm.smin.i64(i64 %mleft, i64 {bl.mr})", "  store i64 %i0, ptr %ei1",
            "  %apn = add i64 %apb, %ip", f"  %ao0 = mul i64 %apn, {d.k * bl.mr}", f"  %ak = mul i64 %k0, {bl.mr}",
            "  %ao = add i64 %ao0, %ak", "  %ap = getelementptr float, ptr %apk, i64 %ao",
            "  %ipl = sub i64 %ip, %ip0", f"  %crow0 = mul i64 %ipl, {bl.mr * (lay.nc + bl.nr)}",
            f"  %crow = add i64 %crow0, {bl.nr}",
            "  %cpr = getelementptr float, ptr %cscr, i64 %crow",
            "  br label %jcond",
            "jcond:", f"  %jp = phi i64 [0, %ibody], [%jpn, %{'pfe' if _prefetched(d) else 'jbody'}]",
            "  %jcnd = icmp slt i64 %jp, %npan", "  br i1 %jcnd, label %jbody, label %jdone",
            "jbody:",
            f"  %jb = mul i64 %jp, {bl.nr}",
            "  %bpn = getelementptr float, ptr %xb, i64 %jb",
            "  %cp = getelementptr float, ptr %cpr, i64 %jb",
            *_side_ir(d, bl, r),
            *_prefetch_ir(d, bl, r),
            "  call void @rows.micro(ptr %ap, ptr %bp, ptr %tp, ptr %cp, i64 %kc, i1 %first)",
            "  %jpn = add i64 %jp, 1", "  br label %jcond",
            "jdone:", "  br i1 %last, label %epib, label %inext",
            "epib:", *_segments_ir(d, bl, lay, r, epi, "%cpr", "%mr", "epib", "inext"),
            "inext:", "  %ipn = add i64 %ip, 1", "  br label %icond"]


def _main_ir(d, bl, lay: RowsLayout, r: RowsGeom, epi: str, pad: str, npad: int) -> str:
    """The main kernel ``@<name>(args, lo, hi)``: args are the packed weight, the padded copy,
    the side copy, the input, the epilogue operands, the outputs and a counter (int64 ``[pad
    claimed, pad finished, tiles claimed, tiles finished]``, zero before the call).  Every call
    with ``lo < hi`` (the caller's ``[0, 1)``, each pool helper's ``[1, 2)``) first claims chunks
    of the padded copy until none are left, waits until all are finished, then claims tiles;
    the caller's returns when every tile is finished (as the generated GEMM's, gemm_ir.main_ir):
    one dispatch per conv, no Python between the copy and the product, and a helper that wakes
    late takes fewer chunks instead of holding a statically assigned share.

    Per tile and K block, every MR-row panel of the row group times every NR-column panel of
    the column block; on the last K block the scratch tile goes to the epilogue one grid-row
    segment of valid columns at a time."""
    g = d.conv
    cg = g.c // g.group
    n_extra = len(d.operands) + len(d.outputs)
    # per row panel an MR x (NR + NC) row-major block; the panel clamped to end at the grid's
    # end may start up to NR columns left of the block (module docstring)
    cbytes = lay.ppg * bl.mr * (lay.nc + bl.nr) * 4
    per_t = lay.njc * lay.mg
    a_tab = list(d.a_index)
    planes = g.n * g.c
    pcs = -(-planes // npad) if npad else 1       # channel planes per pad chunk
    s = [f"define void @{d.name}(ptr %args, i64 %lo, i64 %hi) #0 {{", "entry:",
         "  %apk = load ptr, ptr %args",
         "  %g1 = getelementptr ptr, ptr %args, i64 1", "  %xp = load ptr, ptr %g1",
         "  %g2 = getelementptr ptr, ptr %args, i64 2", "  %side = load ptr, ptr %g2",
         "  %g3 = getelementptr ptr, ptr %args, i64 3", "  %xin = load ptr, ptr %g3",
         f"  %gc = getelementptr ptr, ptr %args, i64 {4 + n_extra}", "  %ctr = load ptr, ptr %gc",
         "  %ctr1 = getelementptr i64, ptr %ctr, i64 1", "  %ctr2 = getelementptr i64, ptr %ctr, i64 2",
         "  %ctr3 = getelementptr i64, ptr %ctr, i64 3",
         "  %live = icmp slt i64 %lo, %hi", "  %waits0 = icmp eq i64 %lo, 0", "  %waits = and i1 %live, %waits0",
         "  br i1 %live, label %start, label %fin",
         "start:",
         "  %pargs = alloca [2 x ptr], align 8", "  store ptr %xp, ptr %pargs",
         "  %pa1 = getelementptr ptr, ptr %pargs, i64 1", "  store ptr %xin, ptr %pa1",
         f"  %cscr = call ptr @aligned_alloc(i64 64, i64 {cbytes})",
         "  %einfo = alloca [4 x i64], align 8", f"  %eargs = alloca [{2 + n_extra} x ptr], align 8",
         "  %ea1 = getelementptr ptr, ptr %eargs, i64 1", "  store ptr %einfo, ptr %ea1",
         "  %ei1 = getelementptr i64, ptr %einfo, i64 1", "  %ei2 = getelementptr i64, ptr %einfo, i64 2",
         "  %ei3 = getelementptr i64, ptr %einfo, i64 3"]
    for q in range(n_extra):
        s += [f"  %xg{q} = getelementptr ptr, ptr %args, i64 {4 + q}", f"  %x{q} = load ptr, ptr %xg{q}",
              f"  %eg{q} = getelementptr ptr, ptr %eargs, i64 {2 + q}", f"  store ptr %x{q}, ptr %eg{q}"]
    s += ["  br label %padc",
          # the padded copy: chunks of channel planes, claimed; then wait for all of them
          "padc:", "  %pq = atomicrmw add ptr %ctr, i64 1 monotonic",
          f"  %pqc = icmp slt i64 %pq, {npad}", "  br i1 %pqc, label %padb, label %padw_from",
          "padb:", f"  %plo = mul i64 %pq, {pcs}", f"  %phe = add i64 %plo, {pcs}",
          f"  %phi = call i64 @llvm.smin.i64(i64 %phe, i64 {planes})",
          *([f"  call void @{pad}(ptr %pargs, i64 %plo, i64 %phi)"] if npad else []),
          "  %pf = atomicrmw add ptr %ctr1, i64 1 release", "  br label %padc",
          "padw_from:", "  br label %padw",
          *_spin_ir("padw", "%ctr1", npad, "tcond"),
          "tcond:", "  %t = atomicrmw add ptr %ctr2, i64 1 monotonic",
          f"  %tc = icmp slt i64 %t, {lay.tiles}", "  br i1 %tc, label %tbody, label %done",
          "tbody:",
          f"  %b = udiv i64 %t, {per_t}", f"  %rem = urem i64 %t, {per_t}",
          f"  %jc = udiv i64 %rem, {lay.mg}", f"  %ig = urem i64 %rem, {lay.mg}",
          f"  %j0 = mul i64 %jc, {lay.nc}", f"  %nleft = sub i64 {r.grid}, %j0",
          f"  %ncols = call i64 @llvm.smin.i64(i64 %nleft, i64 {lay.nc})",
          f"  %ncr = add i64 %ncols, {bl.nr - 1}", f"  %npan = udiv i64 %ncr, {bl.nr}",
          f"  %atp = getelementptr [{len(a_tab)} x i64], ptr @rows.atab, i64 0, i64 %b",
          "  %abv = load i64, ptr %atp", "  store i64 %b, ptr %einfo",
          f"  %xo0 = mul i64 %b, {cg * r.ch}", "  %xo = add i64 %xo0, %j0",
          "  %xb = getelementptr float, ptr %xp, i64 %xo",
          f"  %ip0 = mul i64 %ig, {lay.ppg}", f"  %ipe = add i64 %ip0, {lay.ppg}",
          f"  %ip1 = call i64 @llvm.smin.i64(i64 %ipe, i64 {lay.npan_a})",
          f"  %apb = mul i64 %abv, {lay.npan_a}",
          "  br label %pcond",
          "pcond:", "  %pc = phi i64 [0, %tbody], [%pcn, %inext_p]",
          f"  %pcc = icmp slt i64 %pc, {lay.nkc}", "  br i1 %pcc, label %pbody, label %tnext",
          "pbody:",
          f"  %k0 = mul i64 %pc, {lay.kcb}", f"  %kleft = sub i64 {d.k}, %k0",
          f"  %kc = call i64 @llvm.smin.i64(i64 %kleft, i64 {lay.kcb})",
          "  %first = icmp eq i64 %pc, 0", f"  %last = icmp eq i64 %pc, {lay.nkc - 1}",
          f"  %tpk = getelementptr [{d.k} x i64], ptr @rows.tab, i64 0, i64 %k0",
          *_panels_ir(d, bl, lay, r, epi),
          "inext_p:", "  %pcn = add i64 %pc, 1", "  br label %pcond",
          "tnext:", "  %tf = atomicrmw add ptr %ctr3, i64 1 release", "  br label %tcond",
          "done:", "  call void @free(ptr %cscr)", "  br i1 %waits, label %endw_from, label %fin",
          "endw_from:", "  br label %endw",
          *_spin_ir("endw", "%ctr3", lay.tiles, "fin"),
          "fin:", "  ret void", "}"]
    from .gemm_ir import _x86, index_table
    head = [f"; row-reading conv {d.name}: batch {d.batch}, {d.m}x{r.grid}x{d.k}, micro-tile {bl.mr}x{bl.nr}, "
            f"KC {lay.kcb}, NC {lay.nc}, {npad} pad chunks",
            index_table("rows.atab", a_tab), index_table("rows.tab", r.tab),
            *([index_table("rows.stab", [k * bl.nr for k in range(d.k)])] if side_tail(g, bl.nr) else []),
            "declare ptr @aligned_alloc(i64, i64)", "declare void @free(ptr)",
            "declare i64 @llvm.smin.i64(i64, i64)", "declare i32 @sched_yield()",
            "declare void @llvm.prefetch.p0(ptr, i32, i32, i32)",
            *(["declare void @llvm.x86.sse2.pause()"] if _x86() else []),
            f"declare <{bl.vl} x float> @llvm.fma.v{bl.vl}f32(<{bl.vl} x float>, <{bl.vl} x float>, "
            f"<{bl.vl} x float>)",
            f"declare void @{epi}(ptr, i64, i64)", *([f"declare void @{pad}(ptr, i64, i64)"] if npad else [])]
    return "\n".join(head) + "\n" + _micro_ir(bl, lay.nc + bl.nr) + "\n" + "\n".join(s)


# ------------------------------------------------------------------ compile


def rows_blocking(d):
    """The default blocking of the row-reading conv ``d``: the GEMM's (:func:`~apollo_py.codegen.
    gemm.default_blocking`), but with AVX-512 always ``MR = 8`` (16 accumulators): its B values
    are unaligned loads through the offset table, and 8x32 measured 0.95-0.98x the time of
    12x32 on one thread at every ResNet-50 / U-Net shape tried with 128 or more output channels
    (3x3 at 28x28 and 32x32, strided, 1x1 64->256 / 128->512 / 512->128)."""
    from .gemm import default_blocking
    bl = default_blocking(replace(d, a_const=True))
    return replace(bl, mr=8) if bl.vl == 16 else bl


class CompiledConvRows:
    """Machine code of one row-reading conv: ``run(pool, w, x, operands, outputs)`` like
    :class:`~apollo_py.codegen.gemm.CompiledGemm` (the weight is A, packed once).  Never
    ``inline``: its padded copy is allocated per call from Python, and it runs on the pool
    (convs small enough for the calling thread stay on the implicit GEMM, :func:`rows_reason`).
    The main kernel makes the padded copy itself and claims its work from a counter
    (:func:`_main_ir`): one call per thread, never in chunks."""

    inline = False
    claims_tiles = True

    def __init__(self, desc, bl, lay: RowsLayout, geom: RowsGeom, engine, ir: str, main_params, pad, pack_a):
        self.desc, self.blocking, self.layout, self.geom = desc, bl, lay, geom
        self.engine, self.ir = engine, ir
        self.main = CompiledKernelBase(L.Kernel(desc.name, main_params, L.Block(), "t", lay.tiles),
                                       engine.get_function_address(desc.name))
        # called by the main kernel; bound here for measurements of the copy alone
        self.pad = CompiledKernelBase(pad, engine.get_function_address(pad.name)) if pad is not None else None
        self.pack_a = CompiledKernelBase(pack_a, engine.get_function_address(pack_a.name))
        self._packed_a: tuple = (None, None)
        self._packed: tuple = (None, None)
        g = desc.conv
        self.pad_size = g.n * g.c * geom.ch
        # columns past the grid's end are read (and dropped) from the last channel's slack
        self.slack = geom.q + lay.njc * lay.nc + bl.nr
        self.in_place = in_place(g)
        self.tail = side_tail(g, bl.nr)
        self._no_side = np.zeros(1, np.float32)

    def packed_a(self, a: np.ndarray) -> np.ndarray:
        """``a`` (the constant weight) packed once into ``[A batch][panel][k][MR]``."""
        from .gemm import _aligned_zeros
        src, packed = self._packed_a
        if src is a:
            return packed
        d, lay, bl = self.desc, self.layout, self.blocking
        pan = d.k * bl.mr
        packed = _aligned_zeros(d.a_batches * lay.npan_a * pan)
        for ab in range(d.a_batches):
            at = ab * lay.npan_a * pan
            self.pack_a([packed[at:at + lay.npan_a * pan], a, np.array([ab, 0], np.int64)], 0, lay.npan_a)
        self._packed_a = (a, packed)
        return packed

    def packed_b(self, b):   # the packed store's interface: B is never constant here
        raise CompileError(f"{self.desc.name}: row-reading conv has no constant B")

    def run(self, pool, a: np.ndarray, x: np.ndarray, operands, outputs) -> None:
        apk = self.packed_a(a)
        side = self._no_side
        if self.in_place:
            xp = x
            if self.tail:
                d, g, bl = self.desc, self.desc.conv, self.blocking
                hw = g.h * g.w
                side = np.zeros((d.batch, d.k, bl.nr), np.float32)
                side[:, :, :self.tail] = x.reshape(d.batch, d.k, hw)[:, :, hw - self.tail:]
        else:
            xp = pad_buffer(self.pad_size + self.slack)
            xp[self.pad_size:] = 0.0    # the pad kernel writes the rest
        arrays = [apk, xp, side, x, *operands, *outputs, np.zeros(4, np.int64)]   # the counter
        run_claiming(self.main, pool, arrays)


#: the padded copies are made in one buffer per calling thread, reused by every row-reading
#: conv the thread runs (:func:`pad_buffer`); False: a fresh array per call (A/B measurements)
REUSE_PAD = True
_LOCAL = threading.local()


def pad_buffer(size: int) -> np.ndarray:
    """A float32 buffer of ``size`` elements (64-byte aligned, contents undefined) for a conv's
    padded copy: the calling thread's own, grown when a conv needs more, so that a model's convs
    reuse memory that is mapped and recently touched.  A fresh array per call (``np.empty`` of
    2-4 MB) came from ``mmap`` whenever glibc's dynamic threshold had not risen to it: U-Net's
    11 row-reading convs took 100-600 minor page faults per model call, all in these copies.
    One buffer per thread is safe: the caller's call returns only when every tile is finished,
    and a pool helper that joins later touches only its call's counter."""
    if not REUSE_PAD:
        return np.empty(size, np.float32)
    buf = getattr(_LOCAL, "pad", None)
    if buf is None or buf.size < size:
        raw = np.empty(size + 16, np.float32)
        skip = (-raw.ctypes.data % 64) // 4
        buf = _LOCAL.pad = raw[skip:skip + size]
    return buf[:size]


@lru_cache(maxsize=None)
def _source_digest() -> str:
    import os
    from ..fsutil import files_digest
    here = os.path.dirname(__file__)
    return files_digest(os.path.join(here, f) for f in
                        ("conv_rows.py", "gemm.py", "gemm_ir.py", "loopir.py", "printer.py", "scalar_ops.py"))


def compile_conv_rows(d, threads: int, bl=None, cache_dir: Optional[str] = None) -> CompiledConvRows:
    """Generate, optimise (O3) and JIT the row-reading conv of conv GEMM ``d`` (``a_const``:
    the weight is a constant) through the piecewise cache.  Raises CompileError for sizes it
    cannot run or an epilogue op without a scalar lowering."""
    from .cached import compile_module
    from .gemm import _epilogue_kernel, _pack_a_kernel, canonical, link_ir
    from .llvm import LLVMPrinter, host
    if d.conv is None or not d.a_const or min(d.m, d.n, d.k, d.batch) <= 0:
        raise CompileError(f"{d.name}: row-reading conv needs a conv with a constant weight and positive sizes")
    named, d = d, canonical(d)
    d = replace(d, name="rows" + d.name[4:])
    bl = bl or rows_blocking(d)
    geom = rows_geom(d.conv)
    if in_place(d.conv) and geom.grid < bl.nr:
        raise CompileError(f"{d.name}: a 1x1 conv read in place needs at least {bl.nr} pixels, got {geom.grid}")
    lay = rows_layout(d, bl, threads)
    pad = None if in_place(d.conv) else _pad_kernel(d, geom)   # read in place: no copy
    npad = pad_chunks(d)
    pack_a = _pack_a_kernel(replace(d, a_const=False), bl, lay.npan_a)
    epi = _epilogue_kernel(d, replace(bl, nr=lay.nc + bl.nr))   # the scratch rows' length

    def build():
        h = host()
        texts = [LLVMPrinter().render(k, h.cpu_attrs) for k in (pad, pack_a, epi) if k is not None]
        main = _main_ir(d, bl, lay, geom, epi.name, pad.name if pad is not None else "", npad)
        main += (f"\nattributes #0 = {{ nounwind {h.cpu_attrs} }}\n"
                 f"attributes #1 = {{ noinline nounwind {h.cpu_attrs} }}\n"
                 "!0 = distinct !{!0, !1}\n!1 = !{!\"llvm.loop.unroll.count\", i32 4}\n")
        return link_ir(d.name, main, texts)
    engine, ir = compile_module(repr(("conv_rows", d, bl, lay, PREFETCH, _source_digest())), build, cache_dir, d.name)
    apk = L.Param("apk_all", "float32", d.a_batches * lay.npan_a * d.k * bl.mr)
    xpp = L.Param("xpad", "float32", d.conv.n * d.conv.c * geom.ch
                  + (0 if in_place(d.conv) else geom.q + lay.njc * lay.nc + bl.nr))
    side = L.Param("side", "float32", 1)
    g = d.conv
    xin = L.Param("x", "float32", g.n * g.c * g.h * g.w)
    ctr = L.Param("counter", "int64", 4)
    cr = CompiledConvRows(d, bl, lay, geom, engine, ir, (apk, xpp, side, xin, *epi.params[2:], ctr), pad, pack_a)
    cr.desc = named
    return cr

