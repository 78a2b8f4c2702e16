"""Fused attention for the CPU target: ``O = softmax(f(Q K^T)) V`` in one parallel launch,
flash-attention style -- the ``[M, N]`` score matrix is never stored.

One :class:`AttentionDesc` describes, for ``b`` in a flattened batch (``B * H``),
``O[b] = softmax_rows(f(Q[qi(b)] @ KT[ki(b)])) @ V[vi(b)]`` where ``f`` is the score
transform the exporters put between the two products (scale, additive mask, relative
position bias, ``where(mask, s, -inf)``: layer-1 scalar ops whose operands broadcast to the
score shape) and ``Q``, ``KT``, ``V`` and ``O`` may be read / written through transposes
(:class:`~apollo_py.codegen.gemm_views.OperandView`, ``out_perm``), as the generated GEMM
does.  Made by ``layers/attention.fold_attention`` from the three steps it replaces.

The main kernel (LLVM IR text written here) is parallel over tiles ``(b, query group)``; a
query group is ``qblocks`` blocks of ``MR`` rows.  Per tile:

* ``pack_q`` (loop IR): the running row max ``m = -inf``, row sum ``l = 0`` and output
  accumulator ``O = 0``; the Q rows of a partial last block into a ``[k][MR]`` panel (zero
  padded) -- full blocks are read in place by the micro-kernel (strided scalar broadcasts),
  unless Q carries a folded scale, which ``compile_attention`` moves onto K;
* for each block of ``bn`` keys: ``pack_k`` / ``pack_v`` (loop IR) pack that block of K^T
  (``[panel][k][NR]``) and V (``[d panel][key][NR]``) once for the whole group; per query
  block the ``MR x NR`` micro-kernel (``llvm.fma``, accumulators in registers) computes the
  scores ``S = Q K^T`` into an L1 scratch; ``upd`` (loop IR, vectorised) applies ``f``,
  masks keys past the end with ``-inf``, and does the online-softmax step: ``m' = max(m,
  rowmax S)``, ``P = exp(S - m')``, ``l = l exp(m - m') + rowsum P``, ``O *= exp(m - m')``;
  then the micro-kernel adds ``P V`` into ``O``;
* ``fin`` (loop IR): ``O / l`` stored (through ``out_perm``); a row whose every score is
  ``-inf`` gives NaN as the unfused softmax does, or 0 with ``nan_to_zero`` (the dynamo
  export's ``where(p != p, 0, p)`` after its softmax).

Block sizes ``qblocks`` and ``bn`` are fields of the descriptor (the tuner's knobs); the
micro-tile is the GEMM's (``codegen/gemm.blocking_for`` the query rows: 12 x 32 with AVX-512,
8 x 32 where that pads fewer rows).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace
from math import prod
from typing import Optional

import numpy as np

from apollo_py.codegen import loopir as L
from apollo_py.codegen.compiled import CompiledKernelBase, run_claiming
from apollo_py.codegen.gemm_ir import counter_ir, index_table, splat_ir, wait_all_ir, x86_decls
from apollo_py.codegen.gemm_views import OperandView, permuted_index, view_address
from apollo_py.errors import CompileError

NEG_INF = float("-inf")


@dataclass(frozen=True)
class AttentionDesc:
    """One fused attention (see the module docstring).

    ``m`` queries, ``n`` keys, ``dk`` the Q/K head dim, ``dv`` the V head dim; ``q_index`` /
    ``k_index`` / ``v_index`` pick the Q, K^T and V matrix of each of the ``batch`` products
    (contiguous ``[*, m, dk]``, ``[*, dk, n]``, ``[*, n, dv]`` or read through ``*_view``).
    ``nodes`` compute the softmax input ``x`` from the score value ``head`` (scores shape
    ``s_shape``, rows = its leading ``s_row_dims`` dims flattened); ``operands`` are their
    memory inputs (codegen.gemm.EpiOperand), ``inline_consts`` scalar constants.  The result
    ``output`` has shape ``out_shape`` (rows = leading ``out_row_dims`` dims), stored
    transposed by ``out_perm`` when set.
    """

    name: str
    batch: int
    m: int
    n: int
    dk: int
    dv: int
    q_index: tuple
    k_index: tuple
    v_index: tuple
    q_value: str
    k_value: str
    v_value: str
    q_size: int
    k_size: int
    v_size: int
    head: str
    x: str
    s_shape: tuple
    s_row_dims: int
    out_shape: tuple
    out_row_dims: int
    output: str
    nodes: tuple = ()
    node_dtypes: tuple = ()
    operands: tuple = ()
    inline_consts: dict = field(default_factory=dict)
    q_view: Optional[OperandView] = None
    k_view: Optional[OperandView] = None
    v_view: Optional[OperandView] = None
    out_perm: Optional[tuple] = None
    nan_to_zero: bool = False
    q_scale: float = 1.0    # Q and K^T are multiplied by these while packed (a folded scale)
    k_scale: float = 1.0
    qblocks: int = 8        # MR-row query blocks per tile (K/V blocks are packed once per tile)
    bn: int = 64            # keys per block (a multiple of the micro-tile's NR)

    @property
    def stored_shape(self) -> tuple:
        if self.out_perm is None:
            return self.out_shape
        return tuple(self.out_shape[p] for p in self.out_perm)

    @property
    def flops(self) -> int:
        return 2 * self.batch * self.m * self.n * (self.dk + self.dv)


@dataclass(frozen=True)
class AttnLayout:
    """Tile decomposition: ``nqb`` MR-row query blocks per product, ``groups`` tiles per product."""

    mr: int
    nr: int
    vl: int
    bn: int
    qb: int            # query blocks per tile
    nqb: int
    groups: int
    dp: int            # dv rounded up to NR
    tiles: int


#: a product of up to this many times ``qblocks`` query blocks is one tile
SINGLE_GROUP = 3


def attn_layout(d: AttentionDesc, threads: int) -> AttnLayout:
    """Host micro-tile; all of a product's query blocks in one tile when there are at most
    ``SINGLE_GROUP * d.qblocks`` of them, else even groups of at most ``d.qblocks``; fewer
    while there are under ``2 * threads`` tiles (a tile is at least one block)."""
    from apollo_py.codegen.gemm import blocking_for
    # the GEMM's rule for the rows: 8-row blocks where they pad 5% fewer query rows than 12
    # (Swin's 49-token windows: 56 rows instead of 60; 0.91x the time of its stage-1 attention
    # on one thread), the host's micro-tile otherwise
    bl = blocking_for(d.m)
    bn = max(bl.nr, -(-d.bn // bl.nr) * bl.nr)
    whole = -(-d.n // bl.nr) * bl.nr
    bn = min(bn, whole)
    if whole <= 4 * bn and -(-d.n // bn) * bn > whole:
        # one block of every key pads fewer: ViT's 197 keys were 4 blocks of 64 (256 keys'
        # worth of scores and P V, 30% of them padding), now one of 224 (ViT-B/16 on one
        # thread: 0.986x the time; BERT's 128 keys, which 64 divide, stay 2 blocks)
        bn = whole
    nqb = -(-d.m // bl.mr)
    if nqb <= SINGLE_GROUP * d.qblocks:
        # short rows (BERT's 128, ViT's 197 tokens): one tile per product, so each K / V block
        # is packed once per head, not once per group (9-12% of the kernel's time on one thread)
        qb = nqb
    else:   # long rows: groups of at most qblocks blocks, as even as possible (no 1-block tail)
        qb = -(-nqb // -(-nqb // max(1, d.qblocks)))
    while qb > 1 and d.batch * -(-nqb // qb) < 2 * max(1, threads):
        qb = -(-qb // 2)
    groups = -(-nqb // qb)
    dp = -(-d.dv // bl.nr) * bl.nr
    return AttnLayout(bl.mr, bl.nr, bl.vl, bn, qb, nqb, groups, dp, d.batch * groups)


# ------------------------------------------------------------------ loop-IR parts

INFO = 9    # info[]: b, q matrix, k matrix, v matrix, first row i0, first key j0, keys in block, rows,
#              Q's element offset of row i0 (the direct read of full query blocks)


def _info(k: int) -> L.Expr:
    return L.Load(_INFO_P, L.Const(k))


_INFO_P = L.Param("info", "int64", INFO)


def _q_addr(d: AttentionDesc, qi, i, k):
    if d.q_view is not None:
        return view_address(d.q_view, qi * d.m + i, k)
    return qi * (d.m * d.dk) + i * d.dk + k


def _k_addr(d: AttentionDesc, ki, k, j):
    if d.k_view is not None:
        return view_address(d.k_view, ki * d.dk + k, j)
    return ki * (d.dk * d.n) + k * d.n + j


def _v_addr(d: AttentionDesc, vi, j, c):
    if d.v_view is not None:
        return view_address(d.v_view, vi * d.n + j, c)
    return vi * (d.n * d.dv) + j * d.dv + c


def q_strides(d: AttentionDesc):
    """``(row stride, k stride)`` of Q when full query blocks are read in place by the
    micro-kernel (no packing: its scalar broadcasts need no contiguous panel); None when Q is
    scaled while packed (``compile_attention`` moves that scale to K first)."""
    if d.q_scale != 1.0:
        return None
    if d.q_view is None:
        return d.dk, 1
    return d.q_view.strides[-2], d.q_view.strides[-1]


def _pack_q(d: AttentionDesc, lay: AttnLayout) -> L.Kernel:
    gr = lay.qb * lay.mr
    qp = L.Param("qp", "float32", lay.qb * d.dk * lay.mr)
    q = L.Param("q", "float32", d.q_size)
    ob = L.Param("ob", "float32", gr * lay.dp)
    ml = L.Param("ml", "float32", 4 * gr)
    r, k, c = L.Var("r"), L.Var("k"), L.Var("c")
    i = _info(4) + r
    src = L.Load(q, _q_addr(d, _info(1), L.minimum(i, d.m - 1), k))
    if d.q_scale != 1.0:
        src = src * L.Const(d.q_scale, "float32")
    pack = L.for_("k", 0, d.dk, L.Store(qp, ((r // lay.mr) * d.dk + k) * lay.mr + r % lay.mr,
                                         L.Select(L.lt(i, d.m), src, L.Const(0.0, "float32"))))
    direct = q_strides(d) is not None
    if direct:      # only a partial last block is packed; full blocks are read in place
        pack = L.If(L.gt(_info(4) + (r // lay.mr + 1) * lay.mr, d.m), pack)
    # (O needs no zeroing: the first key block's P V is stored, not added)
    body = L.block(
        pack,
        L.Store(ml, r, L.Const(NEG_INF, "float32")),
        L.Store(ml, r + gr, L.Const(0.0, "float32")))
    if direct:      # where row i0 of the tile's Q matrix starts (the main kernel adds block offsets)
        body = L.block(body, L.If(L.eq(r, 0), L.Store(_INFO_P, L.Const(8), _q_addr(d, _info(1), _info(4), L.Const(0)))))
    return L.Kernel(f"{d.name}_pack_q", (qp, q, ob, ml, _INFO_P), L.for_("r", 0, gr, body, "parallel"), "r", gr)


def _pack_k(d: AttentionDesc, lay: AttnLayout) -> L.Kernel:
    npk = lay.bn // lay.nr
    kp = L.Param("kp", "float32", lay.bn * d.dk)
    kt = L.Param("kt", "float32", d.k_size)
    p, k, jj = L.Var("p"), L.Var("k"), L.Var("jj")
    j = _info(5) + p * lay.nr + jj
    src = L.Load(kt, _k_addr(d, _info(2), k, L.minimum(j, d.n - 1)))
    if d.k_scale != 1.0:
        src = src * L.Const(d.k_scale, "float32")
    val = L.Select(L.lt(j, d.n), src, L.Const(0.0, "float32"))
    body = L.for_("k", 0, d.dk, L.for_("jj", 0, lay.nr, L.Store(kp, (p * d.dk + k) * lay.nr + jj, val), "vector"))
    return L.Kernel(f"{d.name}_pack_k", (kp, kt, _INFO_P), L.for_("p", 0, npk, body, "parallel"), "p", npk)


def _pack_v(d: AttentionDesc, lay: AttnLayout) -> L.Kernel:
    vp = L.Param("vp", "float32", lay.dp * lay.bn)
    v = L.Param("v", "float32", d.v_size)
    jj, cp, cc = L.Var("jj"), L.Var("cp"), L.Var("cc")
    j = _info(5) + jj
    col = cp * lay.nr + cc
    if d.dv % lay.nr:       # padded columns: zeros
        ok = L.land(L.lt(j, d.n), L.lt(col, d.dv))
        val = L.Select(ok, L.Load(v, _v_addr(d, _info(3), L.minimum(j, d.n - 1), L.minimum(col, d.dv - 1))),
                       L.Const(0.0, "float32"))
    else:                   # (kept simple so that the copy vectorises)
        val = L.Select(L.lt(j, d.n), L.Load(v, _v_addr(d, _info(3), L.minimum(j, d.n - 1), col)),
                       L.Const(0.0, "float32"))
    body = L.for_("cp", 0, lay.dp // lay.nr,
                  L.for_("cc", 0, lay.nr, L.Store(vp, (cp * lay.bn + jj) * lay.nr + cc, val), "vector"))
    return L.Kernel(f"{d.name}_pack_v", (vp, v, _INFO_P), L.for_("jj", 0, lay.bn, body, "parallel"), "jj", lay.bn)


def _fmax(a: L.Expr, b: L.Expr) -> L.Expr:
    """``a > b ? a : b`` -- one vmaxps; a NaN score is not kept in the max, but it still
    reaches the output (exp(NaN) is NaN, so the row's sum and result are NaN)."""
    return L.Select(L.gt(a, b), a, b)


def _tree(vals: list, comb) -> L.Expr:
    """Pairwise fold: depth log2(len) instead of a serial chain (the row's latency)."""
    while len(vals) > 1:
        vals = [comb(vals[q], vals[q + 1]) if q + 1 < len(vals) else vals[q] for q in range(0, len(vals), 2)]
    return vals[0]


def _upd(d: AttentionDesc, lay: AttnLayout) -> L.Kernel:
    """One key block's online-softmax step for the query blocks ``[lo, hi)`` of the group, in
    phases over the block's ``MR`` rows (short per-row dependency chains, so rows overlap):
    score transform; row max (lane accumulators, tree fold); ``P = exp(S - m')`` with the row
    sum; rescale of the output accumulator."""
    from apollo_py.codegen.gemm import _operand_index, epilogue_locals
    gr, bn, vl, mr = lay.qb * lay.mr, lay.bn, lay.vl, lay.mr
    sb = L.Param("sb", "float32", gr * bn)
    pb = L.Param("pb", "float32", gr * bn)
    ob = L.Param("ob", "float32", gr * lay.dp)
    ml = L.Param("ml", "float32", 4 * gr)      # per row: m, l, the m used for P, alpha
    ops = [L.Param(f"in{q}", o.dtype, max(1, prod(o.shape))) for q, o in enumerate(d.operands)]
    blk, rr, j, c, ln = L.Var("blk"), L.Var("rr"), L.Var("j"), L.Var("c"), L.Var("l")
    r = blk * mr + rr
    f32 = "float32"
    ninf, zero = L.Const(NEG_INF, f32), L.Const(0.0, f32)
    # rows past the end (the last block's padding) read row m - 1's operands: in bounds
    row = _info(0) * d.m + L.minimum(_info(4) + r, d.m - 1)
    # every key block full: the operand columns need no clamp, so their loads are contiguous
    # vector loads (with the clamp LLVM gathers them: 13% of T5's 128 x 128 attention)
    col = _info(5) + j if d.n % bn == 0 else L.minimum(_info(5) + j, d.n - 1)
    stmts, env = epilogue_locals(d, L.Load(sb, r * bn + j), ops,
                                 lambda o: _operand_index(o, d.s_shape, d.s_row_dims, row, col))
    x = env[d.x]
    if x.dtype != f32:
        x = L.Cast(x, f32)
    stmts.append(L.Store(sb, r * bn + j, L.Select(L.lt(j, _info(6)), x, ninf)))
    nb = bn // vl
    at = (c * vl + ln)
    # without a score transform the scores need no pass of their own: keys past the end are
    # masked where the max and exp phases read them
    plain = not d.nodes and d.x == d.head

    def score(idx):
        v = L.Load(sb, r * bn + idx)
        return L.Select(L.lt(idx, _info(6)), v, ninf) if plain else v
    mx_acc, sm_acc = L.Alloc("mxl", f32, vl), L.Alloc("sml", f32, vl)
    mold, mnew, ms = L.Var("mold", f32), L.Var("mnew", f32), L.Var("ms", f32)
    max_row = L.block(
        mx_acc, L.for_("l", 0, vl, L.Store(mx_acc, ln, ninf), "unroll"),
        L.for_("c", 0, nb, L.for_("l", 0, vl, L.Store(mx_acc, ln, _fmax(mx_acc[ln], score(at))),
                                  "vector")),
        L.Local("mold", f32, L.Load(ml, r)),
        L.Local("mnew", f32, _fmax(mold, _tree([mx_acc[L.Const(q)] for q in range(vl)], _fmax))),
        # a row whose scores are all -inf so far: exp(x - 0) keeps P = 0 and alpha finite
        L.Local("ms", f32, L.Select(L.eq(mnew, ninf), zero, mnew)),
        L.Store(ml, r, mnew), L.Store(ml, r + 2 * gr, ms),
        L.Store(ml, r + 3 * gr, L.Un("exp", mold - ms, upper=0.0)))
    ms_r = L.Load(ml, r + 2 * gr)
    exp_row = L.block(
        sm_acc, L.for_("l", 0, vl, L.Store(sm_acc, ln, zero), "unroll"),
        L.Local("msr", f32, ms_r),
        L.for_("c", 0, nb, L.for_("l", 0, vl, L.block(
            # x - m' <= 0 (m' is the running max): exp without its upper clamp
            L.Local("e", f32, L.Un("exp", score(at) - L.Var("msr", f32), upper=0.0)),
            L.Store(pb, r * bn + at, L.Var("e", f32)),
            L.Store(sm_acc, ln, sm_acc[ln] + L.Var("e", f32))), "vector")),
        L.Store(ml, r + gr, L.Load(ml, r + gr) * L.Load(ml, r + 3 * gr)
                + _tree([sm_acc[L.Const(q)] for q in range(vl)], lambda a, b: a + b)))
    scale = L.for_("c", 0, lay.dp, L.Store(ob, r * lay.dp + c, L.Load(ob, r * lay.dp + c) * L.Load(ml, r + 3 * gr)),
                   "vector")
    body = L.block(
        *([] if plain else [L.for_("rr", 0, mr, L.for_("j", 0, bn, L.block(*stmts), "vector"))]),
        L.for_("rr", 0, mr, max_row),
        L.for_("rr", 0, mr, exp_row),
        # the first key block: O is still 0 (P V is stored, not added): no rescale
        L.If(L.gt(_info(5), 0), L.for_("rr", 0, mr, scale)))
    nblk = lay.qb
    return L.Kernel(f"{d.name}_upd", (sb, pb, ob, ml, _INFO_P, *ops), L.for_("blk", 0, nblk, body, "parallel"),
                    "blk", nblk)


def _fin(d: AttentionDesc, lay: AttnLayout) -> L.Kernel:
    gr = lay.qb * lay.mr
    ob = L.Param("ob", "float32", gr * lay.dp)
    ml = L.Param("ml", "float32", 4 * gr)
    out = L.Param("out", "float32", prod(d.out_shape))
    r, c = L.Var("r"), L.Var("c")
    f32 = "float32"
    row = _info(0) * d.m + _info(4) + r
    lin = (row * d.dv + c if d.out_perm is None
           else permuted_index(d.out_shape, d.out_perm, d.out_row_dims, row, c))
    dead = L.eq(L.Load(ml, r), L.Const(NEG_INF, f32))     # every score of the row was -inf
    fill = L.Const(0.0 if d.nan_to_zero else float("nan"), f32)
    val = L.Select(dead, fill, L.Load(ob, r * lay.dp + c) / L.Load(ml, r + gr))
    body = L.for_("c", 0, d.dv, L.Store(out, lin, val), "vector")
    return L.Kernel(f"{d.name}_fin", (ob, ml, _INFO_P, out), L.for_("r", 0, gr, body, "parallel"), "r", gr)


# ------------------------------------------------------------------ LLVM IR text


def _micro_ir(fn: str, lay: AttnLayout, ska: int, sra: int, ldc: int) -> str:
    """``@fn(a, b, c, kc, first)``: ``c[r*ldc + j] (= 0 if first) += sum_{k<kc} a[k*ska + r*sra]
    b[k*NR + j]`` for ``r < MR``, ``j < NR``; ``MR x NR/VL`` vector accumulators in registers."""
    vl, mr, nr = lay.vl, lay.mr, lay.nr
    vt = f"<{vl} x float>"
    nv = nr // vl
    accs = [(r, v) for r in range(mr) for v in range(nv)]
    s = [f"define internal void @{fn}(ptr noalias nocapture readonly %a, ptr noalias nocapture readonly %b, "
         "ptr noalias nocapture %c, i64 %kc, i1 %first) #1 {", "entry:", "  br label %loop", "loop:",
         "  %k = phi i64 [0, %entry], [%k1, %loop]"]
    for r, v in accs:
        s.append(f"  %acc{r}_{v} = phi {vt} [zeroinitializer, %entry], [%n{r}_{v}, %loop]")
    s.append(f"  %bo = mul nuw nsw i64 %k, {nr}")
    for v in range(nv):
        s += [f"  %bi{v} = add nuw nsw i64 %bo, {v * vl}", f"  %bp{v} = getelementptr inbounds float, ptr %b, i64 %bi{v}",
              f"  %bv{v} = load {vt}, ptr %bp{v}, align 64"]
    s.append(f"  %ao = mul nuw nsw i64 %k, {ska}")
    for r in range(mr):
        s += [f"  %ai{r} = add nuw nsw i64 %ao, {r * sra}",
              f"  %ap{r} = getelementptr inbounds float, ptr %a, i64 %ai{r}",
              *splat_ir(f"av{r}", f"%ap{r}", vt, vl)]
        for v in range(nv):
            s.append(f"  %n{r}_{v} = call {vt} @llvm.fma.v{vl}f32({vt} %av{r}, {vt} %bv{v}, {vt} %acc{r}_{v})")
    s += ["  %k1 = add nuw nsw i64 %k, 1", "  %kcnd = icmp ult i64 %k1, %kc",
          "  br i1 %kcnd, label %loop, label %exit", "exit:"]
    for r, v in accs:
        off = r * ldc + v * vl
        s += [f"  %ip{r}_{v} = getelementptr inbounds float, ptr %c, i64 {off}",
              f"  %il{r}_{v} = load {vt}, ptr %ip{r}_{v}, align 4",
              f"  %is{r}_{v} = fadd {vt} %n{r}_{v}, %il{r}_{v}",
              f"  %o{r}_{v} = select i1 %first, {vt} %n{r}_{v}, {vt} %is{r}_{v}",
              f"  store {vt} %o{r}_{v}, ptr %ip{r}_{v}, align 4"]
    s += ["  ret void", "}"]
    return "\n".join(s)


def _main_ir(d: AttentionDesc, lay: AttnLayout, names: dict) -> str:
    """The tile loop; ``names`` maps pack_q / pack_k / pack_v / upd / fin to kernel names."""
    mr, nr, bn, dk, dp = lay.mr, lay.nr, lay.bn, d.dk, lay.dp
    gr = lay.qb * mr
    nops = len(d.operands)
    nkb = -(-d.n // bn)
    npk, npv = bn // nr, dp // nr

    def alloc(var, floats):
        return f"  %{var} = call ptr @aligned_alloc(i64 64, i64 {-(-floats * 4 // 64) * 64})"

    def argv(var, ptrs):
        out = [f"  %{var} = alloca [{len(ptrs)} x ptr], align 8"]
        for q, p in enumerate(ptrs):
            out += [f"  %{var}.{q} = getelementptr ptr, ptr %{var}, i64 {q}", f"  store ptr {p}, ptr %{var}.{q}"]
        return out

    s = [f"define void @{d.name}(ptr %args, i64 %lo, i64 %hi) #0 {{", "entry:"]
    # args: q, kt, v, operands..., out, the tile counter (claimed as the GEMM's: codegen/gemm_ir.py)
    for q, nm in enumerate(["q", "kt", "v", *(f"op{o}" for o in range(nops)), "out"]):
        s += [f"  %g.{nm} = getelementptr ptr, ptr %args, i64 {q}", f"  %{nm} = load ptr, ptr %g.{nm}"]
    s += [alloc("qp", lay.qb * dk * mr), alloc("kp", bn * dk), alloc("vp", dp * bn), alloc("sb", gr * bn),
          alloc("pb", gr * bn), alloc("ob", gr * dp), alloc("ml", 4 * gr),
          f"  %info = alloca [{INFO} x i64], align 8"]
    s += [f"  %in{q} = getelementptr i64, ptr %info, i64 {q}" for q in range(1, INFO)]
    s += argv("aq", ["%qp", "%q", "%ob", "%ml", "%info"])
    s += argv("ak", ["%kp", "%kt", "%info"])
    s += argv("av", ["%vp", "%v", "%info"])
    s += argv("au", ["%sb", "%pb", "%ob", "%ml", "%info", *(f"%op{o}" for o in range(nops))])
    s += argv("af", ["%ob", "%ml", "%info", "%out"])
    s += counter_ir(lay.tiles, 4 + nops)
    s += ["  br i1 %live, label %tcond, label %done",
          "tcond:", "  %t = atomicrmw add ptr %ctr, i64 1 monotonic",
          f"  %tc = icmp slt i64 %t, {lay.tiles}", "  br i1 %tc, label %tbody, label %done",
          "tbody:",
          f"  %b = udiv i64 %t, {lay.groups}", f"  %grp = urem i64 %t, {lay.groups}",
          "  store i64 %b, ptr %info"]
    for q, tab in ((1, "qtab"), (2, "ktab"), (3, "vtab")):
        s += [f"  %tp{q} = getelementptr [{d.batch} x i64], ptr @attn.{tab}, i64 0, i64 %b",
              f"  %tv{q} = load i64, ptr %tp{q}", f"  store i64 %tv{q}, ptr %in{q}"]
    s += [f"  %qb0 = mul i64 %grp, {lay.qb}", f"  %i0 = mul i64 %qb0, {mr}", "  store i64 %i0, ptr %in4",
          f"  %rl = sub i64 {d.m}, %i0", f"  %rows = call i64 @llvm.smin.i64(i64 %rl, i64 {gr})",
          "  store i64 %rows, ptr %in7",
          f"  %nbl0 = add i64 %rows, {mr - 1}", f"  %nbl = udiv i64 %nbl0, {mr}",
          f"  %gra = mul i64 %nbl, {mr}",
          f"  call void @{names['pack_q']}(ptr %aq, i64 0, i64 %gra) #2",
          "  br label %kcond",
          "kcond:", "  %kb = phi i64 [0, %tbody], [%kb1, %knext]",
          f"  %kc = icmp slt i64 %kb, {nkb}", "  br i1 %kc, label %kbody, label %kdone",
          "kbody:",
          f"  %j0 = mul i64 %kb, {bn}", "  store i64 %j0, ptr %in5", "  %kfirst = icmp eq i64 %kb, 0",
          f"  %jl = sub i64 {d.n}, %j0", f"  %cols = call i64 @llvm.smin.i64(i64 %jl, i64 {bn})",
          "  store i64 %cols, ptr %in6",
          f"  call void @{names['pack_k']}(ptr %ak, i64 0, i64 {npk}) #2",
          f"  call void @{names['pack_v']}(ptr %av, i64 0, i64 {bn}) #2",
          "  br label %qcond",
          "qcond:", f"  %qi = phi i64 [0, %kbody], [%qi1, %{'qkdone' if q_strides(d) is not None else 'qbody'}]",
          "  %qc = icmp slt i64 %qi, %nbl", "  br i1 %qc, label %qbody, label %qdone",
          "qbody:",
          f"  %qo = mul i64 %qi, {dk * mr}", "  %qpp = getelementptr float, ptr %qp, i64 %qo",
          f"  %so = mul i64 %qi, {mr * bn}", "  %sbp = getelementptr float, ptr %sb, i64 %so"]
    qs = q_strides(d)
    if qs is not None:      # a full block reads Q in place, a partial one its packed panel
        s += [f"  %qend = mul i64 %qi, {mr}", f"  %qend1 = add i64 %qend, %i0", f"  %qend2 = add i64 %qend1, {mr}",
              f"  %qfull = icmp sle i64 %qend2, {d.m}",
              "  %qbase = load i64, ptr %in8", f"  %qoff0 = mul i64 %qend, {qs[0]}",
              "  %qoff = add i64 %qbase, %qoff0", "  %qdp = getelementptr float, ptr %q, i64 %qoff",
              "  br i1 %qfull, label %qkdirect, label %qkpacked", "qkdirect:"]
        for p in range(npk):
            s += [f"  %kppd{p} = getelementptr float, ptr %kp, i64 {p * dk * nr}",
                  f"  %sbqd{p} = getelementptr float, ptr %sbp, i64 {p * nr}",
                  f"  call void @attn.qkd(ptr %qdp, ptr %kppd{p}, ptr %sbqd{p}, i64 {dk}, i1 true)"]
        s += ["  br label %qkdone", "qkpacked:"]
    for p in range(npk):
        s += [f"  %kpp{p} = getelementptr float, ptr %kp, i64 {p * dk * nr}",
              f"  %sbq{p} = getelementptr float, ptr %sbp, i64 {p * nr}",
              f"  call void @attn.qk(ptr %qpp, ptr %kpp{p}, ptr %sbq{p}, i64 {dk}, i1 true)"]
    if qs is not None:
        s += ["  br label %qkdone", "qkdone:"]
    # per query block: its scores, softmax step and P V back to back (its S and P stay in L1)
    s += ["  %qi1 = add i64 %qi, 1",
          "  call void @" + names["upd"] + "(ptr %au, i64 %qi, i64 %qi1) #2",
          f"  %po = mul i64 %qi, {mr * bn}", "  %pbp = getelementptr float, ptr %pb, i64 %po",
          f"  %oo = mul i64 %qi, {mr * dp}", "  %obp = getelementptr float, ptr %ob, i64 %oo"]
    for p in range(npv):
        s += [f"  %vpp{p} = getelementptr float, ptr %vp, i64 {p * bn * nr}",
              f"  %obq{p} = getelementptr float, ptr %obp, i64 {p * nr}",
              f"  call void @attn.pv(ptr %pbp, ptr %vpp{p}, ptr %obq{p}, i64 {bn}, i1 %kfirst)"]
    s += ["  br label %qcond", "qdone:", "  br label %knext",
          "knext:", "  %kb1 = add i64 %kb, 1", "  br label %kcond",
          "kdone:",
          f"  call void @{names['fin']}(ptr %af, i64 0, i64 %rows) #2",
          "  br label %tnext",
          "tnext:", "  %fin0 = atomicrmw add ptr %ctr1, i64 1 release", "  br label %tcond",
          "done:"]
    s += [f"  call void @free(ptr %{v})" for v in ("qp", "kp", "vp", "sb", "pb", "ob", "ml")]
    s += [*wait_all_ir(lay.tiles), "}"]
    head = [f"; fused attention {d.name}: batch {d.batch}, {d.m} queries x {d.n} keys, dk {dk}, dv {d.dv}, "
            f"micro-tile {mr}x{nr}, {lay.qb} query blocks per tile, {bn} keys per block",
            index_table("attn.qtab", d.q_index), index_table("attn.ktab", d.k_index),
            index_table("attn.vtab", d.v_index),
            "declare ptr @aligned_alloc(i64, i64)", "declare void @free(ptr)",
            "declare i64 @llvm.smin.i64(i64, i64)",
            f"declare <{lay.vl} x float> @llvm.fma.v{lay.vl}f32(<{lay.vl} x float>, <{lay.vl} x float>, "
            f"<{lay.vl} x float>)",
            *(f"declare void @{k}(ptr, i64, i64)" for k in names.values()), *x86_decls()]
    micro = [_micro_ir("attn.qk", lay, mr, 1, bn), _micro_ir("attn.pv", lay, 1, bn, dp)]
    if q_strides(d) is not None:
        micro.append(_micro_ir("attn.qkd", lay, q_strides(d)[1], q_strides(d)[0], bn))
    return "\n".join(head) + "\n" + "\n".join(micro) + "\n" + "\n".join(s)


# ------------------------------------------------------------------ compile


class CompiledAttention:
    """Machine code of one fused attention; ``run(pool, q, kt, v, operands, out)``."""

    #: the main kernel's last argument is the tile counter its calls claim tiles from, as the
    #: generated GEMM's (codegen/gemm_ir.py): one call of the whole tile range, never chunks
    claims_tiles = True

    def __init__(self, desc: AttentionDesc, lay: AttnLayout, engine, ir: str, params: tuple):
        self.desc, self.layout, self.engine, self.ir = desc, lay, engine, ir
        params = (*params, L.Param("tile_counter", "int64", 2))
        main = L.Kernel(desc.name, params, L.Block(), "t", lay.tiles)
        self.main = CompiledKernelBase(main, engine.get_function_address(desc.name))
        # one thread below a pool wake-up's worth of work (as the GEMM's SMALL_FLOPS)
        from apollo_py.codegen.gemm import SMALL_FLOPS
        self.inline = desc.flops < SMALL_FLOPS or lay.tiles == 1

    def run(self, pool, q, kt, v, operands, out) -> None:
        arrays = [q, kt, v, *operands, out, np.zeros(2, np.int64)]     # the tile counter
        run_claiming(self.main, pool, arrays, self.inline)


def _parts(d: AttentionDesc, lay: AttnLayout):
    return _pack_q(d, lay), _pack_k(d, lay), _pack_v(d, lay), _upd(d, lay), _fin(d, lay)


def _render(d: AttentionDesc, lay: AttnLayout):
    from apollo_py.codegen.llvm import LLVMPrinter, host
    h = host()
    parts = _parts(d, lay)
    names = dict(zip(("pack_q", "pack_k", "pack_v", "upd", "fin"), (k.name for k in parts)))
    texts = [LLVMPrinter().render(k, h.cpu_attrs) for k in parts]
    main = _main_ir(d, lay, names)
    main += (f"\nattributes #0 = {{ nounwind {h.cpu_attrs} }}\n"
             f"attributes #1 = {{ noinline nounwind {h.cpu_attrs} }}\n"
             "attributes #2 = { noinline }\n")
    return main, texts, parts


def render_attention(d: AttentionDesc, threads: int = 2) -> str:
    """Unoptimised LLVM IR of ``d``: the main kernel and micro-kernels, then the loop-IR parts."""
    main, texts, _ = _render(d, attn_layout(d, threads))
    return "\n".join([main, *texts])


_SOURCE_DIGEST = None


def _source_digest() -> str:
    global _SOURCE_DIGEST
    if _SOURCE_DIGEST is None:
        with open(__file__, "rb") as f:
            _SOURCE_DIGEST = hashlib.sha1(f.read()).hexdigest()[:16]
    return _SOURCE_DIGEST


def compile_attention(d: AttentionDesc, threads: int, cache_dir: str | None = None) -> CompiledAttention:
    """Generate, optimise (O3) and JIT ``d`` through the piecewise cache; raises CompileError
    when LLVM rejects the text (a bug) or a score-transform op has no scalar lowering."""
    from .cached import compile_module
    if min(d.m, d.n, d.dk, d.dv, d.batch) <= 0:
        raise CompileError(f"{d.name}: fused attention needs positive sizes, got batch {d.batch}, "
                           f"{d.m} queries, {d.n} keys, head dims {d.dk}/{d.dv}")
    named, d = d, canonical(d)
    if d.q_scale != 1.0:
        # (q a) . (k b) as q . (k (a b)): Q is then read in place (the product differs in rounding only)
        d = replace(d, k_scale=float(np.float32(d.k_scale) * np.float32(d.q_scale)), q_scale=1.0)
    lay = attn_layout(d, threads)

    def build():
        from apollo_py.codegen.gemm import link_ir
        main, texts, _ = _render(d, lay)
        return link_ir(d.name, main, texts)
    engine, ir = compile_module(repr((d, lay, _source_digest())), build, cache_dir, d.name)
    parts = _parts(d, lay)
    upd, fin = parts[3], parts[4]
    params = (parts[0].params[1], parts[1].params[1], parts[2].params[1], *upd.params[5:], fin.params[3])
    ca = CompiledAttention(d, lay, engine, ir, params)
    ca.desc = named
    return ca


def canonical(d: AttentionDesc) -> AttentionDesc:
    """``d`` with values renamed ``v0, v1, ...`` and named by a digest of that structure: the
    same attention in every layer is one piece (one LLVM compile)."""
    names: dict = {}

    def nm(v: str) -> str:
        return names.setdefault(v, f"v{len(names)}") if v else v
    for v in (d.head, d.q_value, d.k_value, d.v_value):
        nm(v)
    nodes = tuple(n.replace(inputs=tuple(nm(v) for v in n.inputs), outputs=tuple(nm(v) for v in n.outputs),
                            name="", source=()) for n in d.nodes)
    c = replace(d, name="a", head=nm(d.head), q_value=nm(d.q_value), k_value=nm(d.k_value),
                v_value=nm(d.v_value), nodes=nodes, x=nm(d.x),
                operands=tuple(replace(o, value=nm(o.value)) for o in d.operands), output=nm(d.output),
                inline_consts={nm(k): v for k, v in d.inline_consts.items()})
    return replace(c, name="attn_" + hashlib.sha1(repr(c).encode()).hexdigest()[:12])


def reference(q: np.ndarray, kt: np.ndarray, v: np.ndarray, x_of_s=lambda s: s) -> np.ndarray:
    """numpy ``softmax(x_of_s(q @ kt)) @ v`` (for tests and the docs' examples)."""
    x = x_of_s(np.matmul(q, kt))
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return np.matmul(e / e.sum(axis=-1, keepdims=True), v)
