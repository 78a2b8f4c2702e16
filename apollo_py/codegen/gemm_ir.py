"""LLVM IR text of the generated GEMM (codegen/gemm.py): the micro-kernels and the main
kernel's tile loops, written as text because their register blocking is the point (24 named
accumulators, constant displacements) and loop IR would leave it to the vectoriser.

No import of gemm.py: it imports this module.
"""
from __future__ import annotations

from dataclasses import replace

# Blocking, GemmDesc, GemmLayout in the annotations are codegen/gemm.py's: not imported, not even
# under TYPE_CHECKING (tests/test_layering.py counts that as a module-level import cycle)


def splat_ir(name: str, ptr: str, vt: str, vl: int) -> list[str]:
    """IR lines that load the float at ``ptr`` and broadcast it into ``%name``, a ``vt`` of ``vl``
    lanes: a micro-kernel's scalar operand (``%name.s`` and ``%name.x`` are its temporaries)."""
    return [f"  %{name}.s = load float, ptr {ptr}, align 4",
            f"  %{name}.x = insertelement {vt} poison, float %{name}.s, i64 0",
            f"  %{name} = shufflevector {vt} %{name}.x, {vt} poison, <{vl} x i32> zeroinitializer"]


def _micro_ir(bl: Blocking, name: str = "gemm.micro", a_rs: int = 1, a_ks: int = 0, c_rs: int = 0,
              pf: bool = False) -> str:
    """``@<name>(a, b, c, kc, first)``: ``C[MR][NR] (= 0 if first) += sum_{k<kc}
    A[r][k] (x) b[k][NR]`` with ``A[r][k] = a[r * a_rs + k * a_ks]`` -- a packed panel
    ``a[k][MR]`` (``a_rs = 1, a_ks = MR``, the default) or rows of a row-major source
    (``a_rs = K, a_ks = 1``: constant displacements, one pointer) -- and ``C[r][j] =
    c[r * c_rs + j]``: the 64-byte aligned tile scratch (``c_rs = NR``, the default) or the
    output itself (``c_rs`` its row length; any alignment).  The accumulators start at zero
    and live in registers for the whole k loop; C is written once at the end (stored on the
    first K block, loaded and added on the others)."""
    a_ks = a_ks or bl.mr
    # packed B rows and the scratch tile's rows are NR floats apart and vector v starts VL
    # floats into one: 64-byte aligned with 16-wide vectors, only 4 * VL bytes with narrower
    # ones (an 8-wide blocking claiming 64 would be undefined behaviour)
    valign = min(64, 4 * bl.vl)
    calign = valign if not c_rs else 4
    c_rs = c_rs or bl.nr
    vt = f"<{bl.vl} x float>"
    nv = bl.nr // bl.vl
    accs = [(r, v) for r in range(bl.mr) for v in range(nv)]
    lines = [f"define internal void @{name}(ptr noalias nocapture readonly %a, "
             "ptr noalias nocapture readonly %b, ptr noalias nocapture %c, i64 %kc, i1 %first"
             + (", ptr %pf, i64 %pfstep" if pf else "") + ") #1 {",
             "entry:"]
    lines += ["  br label %loop", "loop:", "  %k = phi i64 [0, %entry], [%k1, %loop]"]
    for r, v in accs:
        lines.append(f"  %acc{r}_{v} = phi {vt} [zeroinitializer, %entry], [%n{r}_{v}, %loop]")
    if pf:      # line (k * pfstep) >> 16 of this call's share of the next B block (_prefetch_ir)
        lines += ["  %pfl0 = mul i64 %k, %pfstep", "  %pfl = lshr i64 %pfl0, 16", "  %pfo = shl i64 %pfl, 4",
                  "  %pfa = getelementptr float, ptr %pf, i64 %pfo",
                  "  call void @llvm.prefetch.p0(ptr %pfa, i32 0, i32 2, i32 1)"]
    lines.append(f"  %bo = mul nuw nsw i64 %k, {bl.nr}")
    for v in range(nv):
        lines.append(f"  %bp{v} = getelementptr inbounds float, ptr %b, i64 %bo")
        if v:
            lines[-1] = f"  %bp{v} = getelementptr inbounds float, ptr %bp0, i64 {v * bl.vl}"
        lines.append(f"  %bv{v} = load {vt}, ptr %bp{v}, align {valign}")
    lines += micro_fma_tail_ir(bl, a_ks, a_rs, c_rs, calign)
    return "\n".join(lines)


def micro_fma_tail_ir(bl: Blocking, a_ks: int, a_rs: int, c_rs: int, calign: int) -> list:
    """The rest of a micro-kernel once its B vectors ``%bv<v>`` of step ``%k`` are loaded: the
    ``MR`` broadcasts of A (``a[k * a_ks + r * a_rs]``) times B into the accumulators, the k loop's
    back edge, and C (``c[r * c_rs + j]``, alignment ``calign``) stored on the first K block or
    loaded and added on the others.  Shared by the GEMM's micro-kernel and the row-reading
    conv's (codegen/conv_rows.py), which differ only in where B comes from."""
    vt = f"<{bl.vl} x float>"
    nv = bl.nr // bl.vl
    accs = [(r, v) for r in range(bl.mr) for v in range(nv)]
    lines = [f"  %ao = mul nuw nsw i64 %k, {a_ks}"]
    for r in range(bl.mr):
        lines += [f"  %ai{r} = add nuw nsw i64 %ao, {r * a_rs}",
                  f"  %ap{r} = getelementptr inbounds float, ptr %a, i64 %ai{r}",
                  *splat_ir(f"av{r}", f"%ap{r}", vt, bl.vl)]
        for v in range(nv):
            lines.append(f"  %n{r}_{v} = call {vt} @llvm.fma.v{bl.vl}f32({vt} %av{r}, {vt} %bv{v}, "
                         f"{vt} %acc{r}_{v})")
    lines += ["  %k1 = add nuw nsw i64 %k, 1", "  %kcnd = icmp ult i64 %k1, %kc",
              "  br i1 %kcnd, label %loop, label %exit, !llvm.loop !0", "exit:"]
    # each K block sums from zero and is then added to C: error grows with KC + K/KC, not K
    lines.append("  br i1 %first, label %st, label %acc")
    lines.append("st:")
    for r, v in accs:
        lines += [f"  %sp{r}_{v} = getelementptr inbounds float, ptr %c, i64 {r * c_rs + v * bl.vl}",
                  f"  store {vt} %n{r}_{v}, ptr %sp{r}_{v}, align {calign}"]
    lines += ["  ret void", "acc:"]
    for r, v in accs:
        lines += [f"  %ip{r}_{v} = getelementptr inbounds float, ptr %c, i64 {r * c_rs + v * bl.vl}",
                  f"  %il{r}_{v} = load {vt}, ptr %ip{r}_{v}, align {calign}",
                  f"  %is{r}_{v} = fadd {vt} %n{r}_{v}, %il{r}_{v}",
                  f"  store {vt} %is{r}_{v}, ptr %ip{r}_{v}, align {calign}"]
    lines += ["  ret void", "}"]
    return lines


def index_table(name: str, values) -> str:
    """A private LLVM global ``@name``: the i64 constant array ``values`` (the batch index
    tables of a batched GEMM or fused attention)."""
    vals = ", ".join(f"i64 {int(v)}" for v in values)
    return f"@{name} = private unnamed_addr constant [{len(values)} x i64] [{vals}]"


def _packed_block_ir(lay: GemmLayout, nkc: int, kcb: int) -> list:
    """IR lines pointing ``%bblk`` at block ``(B batch, column block, k block)`` of the B
    packed once (:meth:`CompiledGemm.packed_b` lays the blocks out in that order)."""
    return [f"  %bs0 = mul i64 %bv, {lay.njc}", "  %bs1 = add i64 %bs0, %jc", f"  %bs2 = mul i64 %bs1, {nkc}",
            "  %bs3 = add i64 %bs2, %pc", f"  %bso = mul i64 %bs3, {lay.nc * kcb}",
            "  %bblk = getelementptr float, ptr %bsrc, i64 %bso"]


def _claim_next_ir(d: GemmDesc, lay: GemmLayout, per_t: int, b_tab: list) -> list:
    """pbody IR of a prefetched constant B: on the tile's last K block, claim the call's next
    tile (into ``%tslot``: claimed this late, a tile is held ahead for one K block, not a whole
    tile, so the threads' shares stay as even as before); then :func:`_prefetch_setup_ir`
    with ``%pftn``, that tile's first block (this tile's own block when there is none: lines
    cached already).  Ends in block ``pgo``."""
    return [f"  %pfk = getelementptr float, ptr %bblk, i64 {lay.nc * lay.kcb}",
            "  br i1 %last, label %pclaim, label %pgo",
            "pclaim:", "  %tn = atomicrmw add ptr %ctr, i64 1 monotonic", "  store i64 %tn, ptr %tslot",
            f"  %tnv = icmp slt i64 %tn, {lay.tiles}", "  %tns = select i1 %tnv, i64 %tn, i64 %t",
            f"  %nb = udiv i64 %tns, {per_t}", f"  %nrem = urem i64 %tns, {per_t}",
            f"  %njc = udiv i64 %nrem, {lay.mg}",
            f"  %nbtp = getelementptr [{len(b_tab)} x i64], ptr @gemm.btab, i64 0, i64 %nb",
            "  %nbv = load i64, ptr %nbtp",
            f"  %ns0 = mul i64 %nbv, {lay.njc}", "  %ns1 = add i64 %ns0, %njc", f"  %ns2 = mul i64 %ns1, {lay.nkc}",
            f"  %nso = mul i64 %ns2, {lay.nc * lay.kcb}", "  %pftn = getelementptr float, ptr %bsrc, i64 %nso",
            "  br label %pgo", "pgo:", *_prefetch_setup_ir(lay)]


def _prefetch_setup_ir(lay: GemmLayout) -> list:
    """pgo IR of a prefetched constant B (after ``%bblk``): ``%pfb``, the block to prefetch
    during this K block -- the tile's next K block, or on the last one the first of the call's
    next tile -- ``%pfper``, its cache lines per micro-kernel call (spread evenly over the K
    block's ``row panels x column panels`` calls), and ``%pfstep``, ``pfper / kc`` in 16.16
    fixed point: the micro-kernel prefetches line ``(k * pfstep) >> 16`` of its share at step
    ``k``, so the block's lines arrive at the pace of the FMAs (``Blocking.prefetch_b``)."""
    lines = lay.nc * lay.kcb // 16
    return ["  %pfb = phi ptr [%pftn, %pclaim], [%pfk, %pbody]",
            "  %pfr = sub i64 %ip1, %ip0", "  %pfc0 = mul i64 %pfr, %npan",
            "  %pfc = call i64 @llvm.smax.i64(i64 %pfc0, i64 1)",
            f"  %pfl = add i64 %pfc, {lines - 1}", "  %pfper = udiv i64 %pfl, %pfc",
            "  %pfsh = shl i64 %pfper, 16", "  %pfstep = udiv i64 %pfsh, %kc"]


def _prefetch_ir() -> list:
    """jbody IR of a prefetched constant B: ``%pfa0``, the first line of this micro-kernel
    call's share of ``%pfb`` (call ``(row panel, column panel)`` of the K block)."""
    return ["  %pfi0 = sub i64 %ip, %ip0", "  %pfi1 = mul i64 %pfi0, %npan", "  %pfi = add i64 %pfi1, %jp",
            "  %pfs = mul i64 %pfi, %pfper", "  %pfs16 = mul i64 %pfs, 16",
            "  %pfa0 = getelementptr float, ptr %pfb, i64 %pfs16"]


def main_ir(d: GemmDesc, bl: Blocking, lay: GemmLayout, pack_a: str, pack_b: str, epis: tuple,
            segs: tuple = ()) -> str:
    """The main kernel ``@<d.name>(args, lo, hi)``: args are A, B, the epilogue operands, the
    outputs and the tile counter (int64 ``[claimed, finished]``, zero before the call); each
    call claims tiles ``(batch, column block, row group)`` until none are left.  ``segs``:
    ``((desc, first column), ...)``, the column segments of a joint product (``d.parts``), each
    finished by its epilogue kernel in ``epis`` (one segment, ``d`` itself, by default)."""
    n_extra = len(d.operands) + len(d.outputs)
    segs = tuple(segs) or ((d, 0),)
    # a weight's packed blocks are prefetched a block ahead (_prefetch_setup_ir): a model's
    # weights do not fit in the L3, and without it the first row panel's micro-kernels waited
    # for them (single thread, 16 weights in turn: 1.07-1.10x the time of one weight reused).
    # Not with one K block: its call would hold its next tile for a whole tile (K <= 256: a
    # small weight, and a tile's worth of imbalance at the end of every call)
    pf = bool(d.b_const and getattr(bl, "prefetch_b", True) and lay.nkc > 1)
    nkc, kcb = lay.nkc, lay.kcb
    a_tab = list(d.a_index)
    b_tab = list(range(d.batch)) if d.conv is not None else list(d.b_index)
    tile = bl.mr * bl.nr
    npb = lay.nc // bl.nr
    # scratch only where it is used: a B packed once and an A read in place or packed once
    # need none (a large unused block is still an mmap + munmap per call, and munmap stops
    # every other thread of the process for a TLB shootdown)
    bbytes = 64 if d.b_const else -(-(lay.nc * kcb * 4) // 64) * 64
    cbytes = lay.pan_per_group * npb * tile * 4
    abytes = 64 if lay.direct_a or d.a_const else lay.pan_per_group * d.k * bl.mr * 4
    per_t = lay.njc * lay.mg
    s = [f"define void @{d.name}(ptr %args, i64 %lo, i64 %hi) #0 {{", "entry:",
         "  %asrc = load ptr, ptr %args",
         f"  %ascr = call ptr @aligned_alloc(i64 64, i64 {abytes})",
         "  %ainfo = alloca [2 x i64], align 8", "  %aargs = alloca [3 x ptr], align 8",
         "  %tslot = alloca i64, align 8",
         "  store ptr %ascr, ptr %aargs",
         "  %aa1 = getelementptr ptr, ptr %aargs, i64 1", "  store ptr %asrc, ptr %aa1",
         "  %aa2 = getelementptr ptr, ptr %aargs, i64 2", "  store ptr %ainfo, ptr %aa2",
         "  %ai1 = getelementptr i64, ptr %ainfo, i64 1",
         "  %g1 = getelementptr ptr, ptr %args, i64 1", "  %bsrc = load ptr, ptr %g1",
         f"  %bscr = call ptr @aligned_alloc(i64 64, i64 {bbytes})",
         f"  %cscr = call ptr @aligned_alloc(i64 64, i64 {cbytes})",
         "  %pinfo = alloca [4 x i64], align 8", "  %einfo = alloca [4 x i64], align 8",
         "  %pargs = alloca [3 x ptr], align 8",
         "  store ptr %bscr, ptr %pargs",
         "  %pa1 = getelementptr ptr, ptr %pargs, i64 1", "  store ptr %bsrc, ptr %pa1",
         "  %pa2 = getelementptr ptr, ptr %pargs, i64 2", "  store ptr %pinfo, ptr %pa2",
         "  %pi1 = getelementptr i64, ptr %pinfo, i64 1",
         "  %pi2 = getelementptr i64, ptr %pinfo, i64 2",
         "  %pi3 = getelementptr i64, ptr %pinfo, i64 3",
         "  %ei1 = getelementptr i64, ptr %einfo, i64 1",
         "  %ei2 = getelementptr i64, ptr %einfo, i64 2",
         "  %ei3 = getelementptr i64, ptr %einfo, i64 3"]
    for q in range(n_extra):
        s += [f"  %xg{q} = getelementptr ptr, ptr %args, i64 {2 + q}", f"  %x{q} = load ptr, ptr %xg{q}"]
    s += _segment_args_ir(d, segs)
    # tiles are claimed from the shared counter (the last argument: [claimed, finished]) until
    # all are taken, so a thread that starts late (a pool wake-up) or is preempted takes
    # fewer: no chunk of tiles is bound to a thread, and no tile boundary goes back to Python.
    # [lo, hi) only says whether this call takes part (an empty range does nothing) and, with
    # lo == 0, that it is the caller's: it returns only when every tile is finished (a short
    # spin on `finished`, then sched_yield), so the caller need not sleep on the helpers.
    s += [*counter_ir(lay.tiles, 2 + n_extra),
          "  br i1 %live, label %tfirst, label %done",
          # with a prefetched B a call claims its next tile as the last K block of the current
          # one starts (_claim_next_ir), so that the next tile's first block is prefetched then
          "tfirst:", *(["  %tf = atomicrmw add ptr %ctr, i64 1 monotonic", "  store i64 %tf, ptr %tslot"]
                       if pf else []), "  br label %tcond",
          "tcond:", ("  %t = load i64, ptr %tslot" if pf else "  %t = atomicrmw add ptr %ctr, i64 1 monotonic"),
          f"  %tc = icmp slt i64 %t, {lay.tiles}", "  br i1 %tc, label %tbody, label %done",
          "tbody:",
          f"  %b = udiv i64 %t, {per_t}", f"  %rem = urem i64 %t, {per_t}",
          f"  %jc = udiv i64 %rem, {lay.mg}", f"  %ig = urem i64 %rem, {lay.mg}",
          f"  %j0 = mul i64 %jc, {lay.nc}", f"  %nleft = sub i64 {d.n}, %j0",
          f"  %ncols = call i64 @llvm.smin.i64(i64 %nleft, i64 {lay.nc})",
          f"  %ncr = add i64 %ncols, {bl.nr - 1}", f"  %npan = udiv i64 %ncr, {bl.nr}",
          f"  %btp = getelementptr [{len(b_tab)} x i64], ptr @gemm.btab, i64 0, i64 %b",
          "  %bv = load i64, ptr %btp",
          f"  %atp = getelementptr [{len(a_tab)} x i64], ptr @gemm.atab, i64 0, i64 %b",
          "  %abv = load i64, ptr %atp", "  store i64 %b, ptr %einfo",
          f"  %ip0 = mul i64 %ig, {lay.pan_per_group}", f"  %ipe = add i64 %ip0, {lay.pan_per_group}",
          f"  %ip1 = call i64 @llvm.smin.i64(i64 %ipe, i64 {lay.npan_a})",
          *([f"  %apo0 = mul i64 %abv, {lay.npan_a}", "  %apo1 = add i64 %apo0, %ip0",
             f"  %apo = mul i64 %apo1, {d.k * bl.mr}", "  %ablk = getelementptr float, ptr %asrc, i64 %apo"]
            if d.a_const else
            ["  store i64 %abv, ptr %ainfo", "  store i64 %ip0, ptr %ai1", "  %npa = sub i64 %ip1, %ip0",
             f"  call void @{pack_a}(ptr %aargs, i64 0, i64 %npa) #2",   # not inlined: compile time
             "  %ablk = getelementptr float, ptr %ascr, i64 0"] if not lay.direct_a else
            _direct_a_tile_ir(d, bl, pack_a)),
          "  br label %tpre", "tpre:",
          "  br label %pcond",
          "pcond:", "  %pc = phi i64 [0, %tpre], [%pcn, %inext_p]",
          f"  %pcc = icmp slt i64 %pc, {nkc}", "  br i1 %pcc, label %pbody, label %tnext",
          "pbody:",
          f"  %k0 = mul i64 %pc, {kcb}", f"  %kleft = sub i64 {d.k}, %k0",
          f"  %kc = call i64 @llvm.smin.i64(i64 %kleft, i64 {kcb})",
          "  %first = icmp eq i64 %pc, 0", f"  %last = icmp eq i64 %pc, {nkc - 1}",
          *(_packed_block_ir(lay, nkc, kcb) if d.b_const else
            ["  store i64 %bv, ptr %pinfo", "  store i64 %j0, ptr %pi1",
             "  store i64 %k0, ptr %pi2", "  store i64 %kc, ptr %pi3",
             f"  call void @{pack_b}(ptr %pargs, i64 0, i64 %npan)",
             "  %bblk = getelementptr float, ptr %bscr, i64 0"]),
          *(_claim_next_ir(d, lay, per_t, b_tab) if pf else []),
          f"  %ak0 = mul i64 %k0, {bl.mr}",
          f"  %bstride = mul i64 %kc, {bl.nr}",
          "  br label %icond",
          "icond:", f"  %ip = phi i64 [%ip0, %{'pgo' if pf else 'pbody'}], [%ipn, %inext]",
          "  %ic = icmp slt i64 %ip, %ip1", "  br i1 %ic, label %ibody, label %inext_p",
          "ibody:",
          f"  %i0 = mul i64 %ip, {bl.mr}", f"  %mleft = sub i64 {d.m}, %i0",
          f"  %mr = call i64 @llvm.smin.i64(i64 %mleft, i64 {bl.mr})",
          "  %ipl = sub i64 %ip, %ip0",
          f"  %aoff0 = mul i64 %ipl, {d.k * bl.mr}", "  %aoff = add i64 %aoff0, %ak0",
          "  %ap = getelementptr float, ptr %ablk, i64 %aoff", "  store i64 %i0, ptr %ei1",
          *([f"  %dr0 = add i64 %arow0, %i0", f"  %dr1 = mul i64 %dr0, {d.k}", "  %dr2 = add i64 %dr1, %k0",
             "  %apd = getelementptr float, ptr %asrc, i64 %dr2",
             f"  %isd = icmp slt i64 %ip, {d.m // bl.mr}"] if lay.direct_a else []),
          f"  %crow = mul i64 %ipl, {npb * tile}",
          "  br label %jcond",
          "jcond:", "  %jp = phi i64 [0, %ibody], [%jpn, %jlatch]",
          "  %jcnd = icmp slt i64 %jp, %npan", "  br i1 %jcnd, label %jbody, label %inext",
          "jbody:",
          *(_prefetch_ir() if pf else []),
          "  %boff = mul i64 %jp, %bstride", "  %bp = getelementptr float, ptr %bblk, i64 %boff",
          f"  %coff0 = mul i64 %jp, {tile}", "  %coff = add i64 %crow, %coff0",
          "  %cp = getelementptr float, ptr %cscr, i64 %coff",
          *_segment_select_ir(bl, segs),
          *(line for q, (seg, off) in enumerate(segs)
            for line in _segment_ir(d, bl, lay, seg, off, q, len(segs), epis[q])),
          "jlatch:", "  %jpn = add i64 %jp, 1", "  br label %jcond",
          "inext:", "  %ipn = add i64 %ip, 1", "  br label %icond",
          "inext_p:", "  %pcn = add i64 %pc, 1", "  br label %pcond",
          "tnext:", "  %fin0 = atomicrmw add ptr %ctr1, i64 1 release", "  br label %tcond",
          "done:", "  call void @free(ptr %ascr)", "  call void @free(ptr %bscr)", "  call void @free(ptr %cscr)",
          *wait_all_ir(lay.tiles), "}"]
    head = [f"; generated GEMM {d.name}: batch {d.batch}, {d.m}x{d.n}x{d.k}, micro-tile {bl.mr}x{bl.nr}, "
            f"KC {kcb}, NC {lay.nc}",
            index_table("gemm.atab", a_tab), index_table("gemm.btab", b_tab),
            "declare ptr @aligned_alloc(i64, i64)", "declare void @free(ptr)",
            "declare i64 @llvm.smin.i64(i64, i64)", "declare i64 @llvm.smax.i64(i64, i64)",
            f"declare <{bl.vl} x float> @llvm.fma.v{bl.vl}f32(<{bl.vl} x float>, <{bl.vl} x float>, "
            f"<{bl.vl} x float>)",
            f"declare void @{pack_a}(ptr, i64, i64)", f"declare void @{pack_b}(ptr, i64, i64)",
            *(f"declare void @{e}(ptr, i64, i64)" for e in epis), *x86_decls(),
            *(["declare void @llvm.prefetch.p0(ptr, i32, i32, i32)"] if pf else [])]
    micro = _micro_ir(bl, pf=pf)
    for n in dict.fromkeys(seg.n for seg, _ in segs if plain_output(seg)):
        name = _direct_c_micro(lay, n, len(segs))
        micro += "\n" + (_micro_ir(bl, name, d.k, 1, n, pf) if lay.direct_a else _micro_ir(bl, name, c_rs=n, pf=pf))
    if lay.direct_a:
        micro += "\n" + _micro_ir(bl, "gemm.micro_d", d.k, 1, pf=pf)
        if d.m % bl.mr:
            micro += "\n" + _micro_ir(replace(bl, mr=d.m % bl.mr), "gemm.micro_r", d.k, 1, pf=pf)
    if pf:      # every micro-kernel call prefetches its share of the next B block
        s = [x.replace("i1 %first)", "i1 %first, ptr %pfa0, i64 %pfstep)") for x in s]
    return "\n".join(head) + "\n" + micro + "\n" + "\n".join(s)


def _x86() -> bool:
    from .llvm import host
    return host().triple.split("-")[0] in ("x86_64", "i386", "i686")


SPINS = 4000    # pause loops (~0.1-0.2 ms) before the waiting caller yields its core instead


def x86_decls() -> list:
    """Declarations :func:`wait_all_ir` calls."""
    return ["declare i32 @sched_yield()", *(["declare void @llvm.x86.sse2.pause()"] if _x86() else [])]


def counter_ir(tiles: int, arg: int) -> list:
    """Entry IR of a kernel whose calls claim ``tiles`` tiles from a shared counter (argument
    ``arg``, int64 ``[claimed, finished]``): ``%live`` (the call takes part), ``%waits`` (it is
    the caller's and returns only when every tile is finished), ``%ctr`` / ``%ctr1`` (the
    counter's two words)."""
    # a call of the whole range [0, tiles) is alone (the native driver's inline step,
    # CompiledGemm.run on one thread): it counts on a counter of its own on the stack, so
    # the argument is not touched (a driver may pass one buffer for every call and
    # thread); the pool's caller passes [0, 1), its helpers [1, 2)
    return ["  %live = icmp slt i64 %lo, %hi", "  %lo0 = icmp eq i64 %lo, 0", "  %waits = and i1 %live, %lo0",
            f"  %hiall = icmp eq i64 %hi, {tiles}", "  %solo = and i1 %lo0, %hiall",
            "  %lctr = alloca [2 x i64], align 8", "  store i64 0, ptr %lctr, align 8",
            "  %lctr1 = getelementptr i64, ptr %lctr, i64 1", "  store i64 0, ptr %lctr1, align 8",
            f"  %ctg = getelementptr ptr, ptr %args, i64 {arg}", "  %actr = load ptr, ptr %ctg",
            "  %ctr = select i1 %solo, ptr %lctr, ptr %actr",
            "  %ctr1 = getelementptr i64, ptr %ctr, i64 1"]


def wait_all_ir(tiles: int) -> list:
    """The end of a call: the caller's (``%waits``) spins until ``tiles`` tiles are finished
    (the helpers' last tiles: at most one tile's time), yielding the core after ``SPINS``
    rounds (a preempted helper on a loaded machine); a helper's returns at once."""
    return ["  br i1 %waits, label %wait, label %fin",
            "wait:", "  %spin = phi i64 [0, %done], [%spin1, %wpause], [0, %wyield]",
            "  %nfin = load atomic i64, ptr %ctr1 acquire, align 8",
            f"  %alld = icmp sge i64 %nfin, {tiles}", "  br i1 %alld, label %fin, label %wmore",
            "wmore:", "  %spin1 = add i64 %spin, 1", f"  %many = icmp ugt i64 %spin1, {SPINS}",
            "  br i1 %many, label %wyield, label %wpause",
            "wpause:", *(["  call void @llvm.x86.sse2.pause()"] if _x86() else []), "  br label %wait",
            "wyield:", "  %yr = call i32 @sched_yield()", "  br label %wait",
            "fin:", "  ret void"]


def plain_output(d: GemmDesc) -> bool:
    """Whether C is stored as computed: no epilogue nodes, one float32 output, row-major (not
    transposed).  Then full ``MR x NR`` tiles skip the scratch and the epilogue call: the
    micro-kernel writes (and on later K blocks accumulates into) the output directly."""
    return (not d.nodes and len(d.outputs) == 1 and d.out_perm is None and tuple(d.out_dtypes) == ("float32",)
            and not d.parts)


def _direct_c_micro(lay: GemmLayout, n: int, nsegs: int) -> str:
    """The name of the micro-kernel writing full tiles into a plain output of ``n`` columns
    (one per distinct width among a joint product's segments)."""
    name = "gemm.micro_dc" if lay.direct_a else "gemm.micro_c"
    return name if nsegs == 1 else f"{name}.{n}"


def _segment_args_ir(d: GemmDesc, segs: tuple) -> list:
    """Entry IR: each segment's epilogue argument array ``%eargs<sfx>`` = (tile, info, its
    operands, its outputs), pointing into the main kernel's ``%x<q>`` arguments (all segments'
    operands, then all segments' outputs)."""
    lines, op0, out0 = [], 0, len(d.operands)
    for q, (seg, _) in enumerate(segs):
        sfx = _sfx(q, len(segs))
        xs = [*range(op0, op0 + len(seg.operands)), *range(out0, out0 + len(seg.outputs))]
        op0, out0 = op0 + len(seg.operands), out0 + len(seg.outputs)
        lines += [f"  %eargs{sfx} = alloca [{2 + len(xs)} x ptr], align 8",
                  f"  %ea1{sfx} = getelementptr ptr, ptr %eargs{sfx}, i64 1", f"  store ptr %einfo, ptr %ea1{sfx}"]
        for pos, x in enumerate(xs):
            lines += [f"  %eg{x}{sfx} = getelementptr ptr, ptr %eargs{sfx}, i64 {2 + pos}",
                      f"  store ptr %x{x}, ptr %eg{x}{sfx}"]
    return lines


def _sfx(q: int, nsegs: int) -> str:
    return "" if nsegs == 1 else f".s{q}"


def _segment_select_ir(bl: Blocking, segs: tuple) -> list:
    """jbody IR branching to the block of the segment that NR-column panel ``%jp`` lies in
    (segments start at multiples of NR: layers/joint_gemm.py joins only such widths)."""
    if len(segs) == 1:
        return []
    lines = [f"  %sgp = mul i64 %jp, {bl.nr}", "  %sgj = add i64 %j0, %sgp"]
    for q, (seg, off) in enumerate(segs[:-1]):
        lines += [f"  %sgc{q} = icmp slt i64 %sgj, {off + seg.n}",
                  f"  br i1 %sgc{q}, label %seg{q}, label %sgn{q}", f"sgn{q}:"]
    lines += [f"  br label %seg{len(segs) - 1}"]
    return lines


def _segment_ir(d: GemmDesc, bl: Blocking, lay: GemmLayout, seg: GemmDesc, off: int, q: int, nsegs: int,
                epi: str) -> list:
    """jbody IR of one column segment (the whole product when not joint): the micro-kernel on
    the panel, into the output itself for a full tile of a plain segment, else into the tile
    scratch that segment ``q``'s epilogue ``epi`` finishes after the last K block.  The
    epilogue sees the segment's own columns (``info[2]`` counts from ``off``)."""
    sfx = _sfx(q, nsegs)
    lines = [f"seg{q}:"] if nsegs > 1 else []
    if plain_output(seg):
        out_q = len(d.operands) + sum(len(s.outputs) for s in d.parts[:q])
        lines += _direct_c_ir(seg, bl, lay, off, f"%x{out_q}", _direct_c_micro(lay, seg.n, nsegs), sfx)
    lines += (["  call void @gemm.micro(ptr %ap, ptr %bp, ptr %cp, i64 %kc, i1 %first)"] if not lay.direct_a else
              ["  call void @gemm.micro_d(ptr %apd, ptr %bp, ptr %cp, i64 %kc, i1 %first)"] if d.m % bl.mr == 0 else
              [f"  br i1 %isd, label %mdir{sfx}, label %mpak{sfx}",
               f"mdir{sfx}:", "  call void @gemm.micro_d(ptr %apd, ptr %bp, ptr %cp, i64 %kc, i1 %first)",
               f"  br label %mdone{sfx}",
               f"mpak{sfx}:", "  call void @gemm.micro_r(ptr %apd, ptr %bp, ptr %cp, i64 %kc, i1 %first)",
               f"  br label %mdone{sfx}", f"mdone{sfx}:"])
    lines += [f"  br i1 %last, label %epib{sfx}, label %jlatch",
              f"epib{sfx}:",
              f"  %jpc{sfx} = mul i64 %jp, {bl.nr}", f"  %jj0{sfx} = add i64 %j0, %jpc{sfx}"]
    col = f"%jj0{sfx}"
    if off:
        lines.append(f"  %jjl{sfx} = sub i64 %jj0{sfx}, {off}")
        col = f"%jjl{sfx}"
    lines += [f"  store i64 {col}, ptr %ei2",
              f"  %nl{sfx} = sub i64 {seg.n}, {col}", f"  %nr{sfx} = call i64 @llvm.smin.i64(i64 %nl{sfx}, i64 {bl.nr})",
              f"  store i64 %nr{sfx}, ptr %ei3", f"  store ptr %cp, ptr %eargs{sfx}",
              f"  call void @{epi}(ptr %eargs{sfx}, i64 0, i64 %mr)",
              "  br label %jlatch"]
    return lines


def _direct_c_ir(d: GemmDesc, bl: Blocking, lay: GemmLayout, off: int = 0, out_arg: str = "", micro: str = "",
                 sfx: str = "") -> list:
    """jbody IR of a plain product (or a plain segment ``d`` from column ``off`` of a joint one,
    writing ``out_arg``): a full tile (all MR rows, all NR columns inside C) runs the
    micro-kernel on the output and goes to the next panel; the rest fall through to the
    scratch + epilogue path."""
    out_arg = out_arg or f"%x{len(d.operands)}"
    a_ptr = "%apd" if lay.direct_a else "%ap"
    micro = micro or ("gemm.micro_dc" if lay.direct_a else "gemm.micro_c")
    lines = [f"  %qpc{sfx} = mul i64 %jp, {bl.nr}", f"  %qj0{sfx} = add i64 %j0, %qpc{sfx}"]
    if off:
        lines.append(f"  %qjl{sfx} = sub i64 %qj0{sfx}, {off}")
    col = f"%qjl{sfx}" if off else f"%qj0{sfx}"
    lines += [f"  %qje{sfx} = add i64 {col}, {bl.nr}", f"  %qcf{sfx} = icmp sle i64 %qje{sfx}, {d.n}"]
    if d.m % bl.mr:
        lines += [f"  %qrf{sfx} = icmp slt i64 %ip, {d.m // bl.mr}", f"  %qfull{sfx} = and i1 %qcf{sfx}, %qrf{sfx}"]
    else:
        lines += [f"  %qfull{sfx} = or i1 %qcf{sfx}, false"]
    lines += [f"  %qr0{sfx} = mul i64 %b, {d.m}", f"  %qr1{sfx} = add i64 %qr0{sfx}, %i0",
              f"  %qo0{sfx} = mul i64 %qr1{sfx}, {d.n}",
              f"  %qo1{sfx} = add i64 %qo0{sfx}, {col}", f"  %qop{sfx} = getelementptr float, ptr {out_arg}, i64 %qo1{sfx}",
              f"  br i1 %qfull{sfx}, label %qdir{sfx}, label %qscr{sfx}",
              f"qdir{sfx}:", f"  call void @{micro}(ptr {a_ptr}, ptr %bp, ptr %qop{sfx}, i64 %kc, i1 %first)",
              "  br label %jlatch", f"qscr{sfx}:"]
    return lines


def _direct_a_tile_ir(d: GemmDesc, bl: Blocking, pack_a: str) -> list:
    """Per-tile IR of a direct A: ``%arow0`` is the A batch's first row (a partial last panel
    runs ``gemm.micro_r``, the same micro-kernel with ``m % MR`` rows: reading MR rows there
    would run past the matrix)."""
    return [f"  %arow0 = mul i64 %abv, {d.m}", "  %ablk = getelementptr float, ptr %ascr, i64 0"]
