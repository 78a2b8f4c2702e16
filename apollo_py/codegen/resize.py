"""Loop-IR kernel of the ``resize2d`` primitive (ops/resize2d.py): bilinear / nearest NCHW resize.

Params ``x [P*H*W], ty [taps*OH], wy [taps*OH], tx [taps*OW], wx [taps*OW], out [P*OH*OW]``
(``P`` = N*C planes).  The parallel loop runs over ``P * OH`` output rows: per row the two input
rows and their weights are read once from the row tables, then one vector loop along the output
row loads the column taps (contiguous table loads, indexed data loads) and blends them.  Both
tables are constant per shape (compile time), so nothing is recomputed per element.
"""
from __future__ import annotations

from dataclasses import dataclass

from apollo_py.codegen import loopir as L
from apollo_py.errors import CompileError


#: longest output period searched for the phase form (U-Net's 2x: 2; a 1.5x resize: 3)
MAX_PERIOD = 8
#: the phase form needs this many periods of interior columns (else the table form runs)
MIN_PERIODS = 4
#: switch for A/B runs in one process (read by layers/lowering.py ``_resize_step``): off, every
#: column goes through the tables (gathers)
PHASES = True


@dataclass(frozen=True)
class Phases:
    """Output columns ``s * k + ph`` for ``k`` in ``[k_lo, k_hi)`` read input columns
    ``p * k + cols[t][ph]`` with weights ``weights[t][ph]`` (tap ``t``): the column tables are
    periodic there, so the interior loop needs no table loads and no gathers."""

    s: int
    p: int
    k_lo: int
    k_hi: int
    cols: tuple
    weights: tuple


def find_phases(idx, wt) -> "Phases | None":
    """The widest periodic interior of column tables ``idx, wt`` (``[taps, OW]``) over periods
    up to :data:`MAX_PERIOD`, or None when none spans :data:`MIN_PERIODS` periods."""
    taps, ow = idx.shape
    best = None
    for s in range(1, MAX_PERIOD + 1):
        nk = ow // s
        if nk < MIN_PERIODS:
            break
        k0 = nk // 2
        if k0 + 1 >= nk:
            continue
        p = int(idx[0, s * (k0 + 1)] - idx[0, s * k0])
        if p < 0:
            continue
        cols = tuple(tuple(int(idx[t, s * k0 + ph]) - p * k0 for ph in range(s)) for t in range(taps))
        wts = tuple(tuple(float(wt[t, s * k0 + ph]) for ph in range(s)) for t in range(taps))

        def fits(k):
            return all(idx[t, s * k + ph] == p * k + cols[t][ph] and float(wt[t, s * k + ph]) == wts[t][ph]
                       for t in range(taps) for ph in range(s))
        lo, hi = k0, k0
        while lo > 0 and fits(lo - 1):
            lo -= 1
        while hi < nk and fits(hi):
            hi += 1
        if hi - lo >= MIN_PERIODS and (best is None or s * (hi - lo) > best.s * (best.k_hi - best.k_lo)):
            best = Phases(s, p, lo, hi, cols, wts)
        if best is not None and best.s * (best.k_hi - best.k_lo) >= ow - 2 * s:
            break
    return best


def resize2d_kernel(name: str, planes: int, h: int, w: int, oh: int, ow: int, taps: int, dtype: str,
                    phases: "Phases | None" = None) -> L.Kernel:
    """The Kernel of a ``taps``-tap (1: nearest, 2: linear) resize of ``planes`` ``h x w`` planes
    to ``oh x ow``; params ``x, ty, wy, tx, wx, out``.  With ``phases`` (:func:`find_phases` of
    the column tables) the interior columns run the phase form: per period, the vertical blend of
    each distinct input column once, then every phase's blend of two of them, constant weights,
    interleaved stores; the edge columns go through the tables."""
    if taps not in (1, 2) or dtype not in ("float32", "float64"):
        raise CompileError(f"resize2d kernel: {taps} taps, {dtype} (1 or 2 taps, float32 / float64)")
    if min(planes, h, w, oh, ow) < 1:
        raise CompileError(f"resize2d kernel: empty extent ({planes}, {h}, {w}, {oh}, {ow})")
    x = L.Param("x", dtype, planes * h * w)
    ty, wy = L.Param("ty", "int64", taps * oh), L.Param("wy", dtype, taps * oh)
    tx, wx = L.Param("tx", "int64", taps * ow), L.Param("wx", dtype, taps * ow)
    out = L.Param("out", dtype, planes * oh * ow)
    V = L.Var
    t = V("t")
    head = [L.Local("p", "int64", t // oh), L.Local("oy", "int64", t % oh)]
    for a in range(taps):       # input row a of this output row, and its weight
        head.append(L.Local(f"r{a}", "int64", V("p") * (h * w) + ty[V("oy") + a * oh] * w))
        if taps == 2:
            head.append(L.Local(f"a{a}", dtype, wy[V("oy") + a * oh]))

    def vblend(col):
        """The vertical blend of input column ``col`` (the two rows' weights of this output row)."""
        if taps == 1:
            return x[V("r0") + col]
        return V("a0", dtype) * x[V("r0") + col] + V("a1", dtype) * x[V("r1") + col]

    def table_loop(lo: int, hi: int, kind: str):
        ox = V("ox")
        cols = [L.Local(f"i{b}", "int64", tx[ox + b * ow]) for b in range(taps)]
        if taps == 1:
            val = vblend(V("i0"))
        else:
            cols += [L.Local(f"b{b}", dtype, wx[ox + b * ow]) for b in range(2)]
            val = vblend(V("i0")) * V("b0", dtype) + vblend(V("i1")) * V("b1", dtype)
        return L.for_("ox", lo, hi, L.block(*cols, L.Store(out, t * ow + ox, val)), kind)

    if phases is None:
        rows = [table_loop(0, ow, "vector")]
    else:
        ph = phases
        k = V("k")
        offs = sorted({c for tc in ph.cols for c in tc})
        blends = [L.Local(f"v{q}", dtype, vblend(ph.p * k + c)) for q, c in enumerate(offs)]
        at = {c: V(f"v{q}", dtype) for q, c in enumerate(offs)}
        stores = []
        for j in range(ph.s):
            if taps == 1:
                val = at[ph.cols[0][j]]
            else:
                val = (L.Const(ph.weights[0][j], dtype) * at[ph.cols[0][j]]
                       + L.Const(ph.weights[1][j], dtype) * at[ph.cols[1][j]])
            stores.append(L.Store(out, t * ow + k * ph.s + j, val))
        rows = [table_loop(0, ph.s * ph.k_lo, "serial"),
                L.for_("k", ph.k_lo, ph.k_hi, L.block(*blends, *stores), "vector"),
                table_loop(ph.s * ph.k_hi, ow, "serial")]
    loop = L.for_("t", 0, planes * oh, L.block(*head, *rows), "parallel")
    k = L.Kernel(name, (x, ty, wy, tx, wx, out), L.block(loop), "t", planes * oh)
    L.verify_kernel(k)
    return k
