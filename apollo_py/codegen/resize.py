"""Loop-IR kernel of the ``resize2d`` primitive (ops/resize2d.py): bilinear / nearest NCHW resize.

Params ``x [P*H*W], ty [taps*OH], wy [taps*OH], tx [taps*OW], wx [taps*OW], out [P*OH*OW]``
(``P`` = N*C planes).  The parallel loop runs over ``P * OH`` output rows: per row the two input
rows and their weights are read once from the row tables, then one vector loop along the output
row loads the column taps (contiguous table loads, indexed data loads) and blends them.  Both
tables are constant per shape (compile time), so nothing is recomputed per element.
"""
from __future__ import annotations

from apollo_py.codegen import loopir as L
from apollo_py.errors import CompileError


def resize2d_kernel(name: str, planes: int, h: int, w: int, oh: int, ow: int, taps: int, dtype: str) -> L.Kernel:
    """The Kernel of a ``taps``-tap (1: nearest, 2: linear) resize of ``planes`` ``h x w`` planes
    to ``oh x ow``; params ``x, ty, wy, tx, wx, out``."""
    if taps not in (1, 2) or dtype not in ("float32", "float64"):
        raise CompileError(f"resize2d kernel: {taps} taps, {dtype} (1 or 2 taps, float32 / float64)")
    if min(planes, h, w, oh, ow) < 1:
        raise CompileError(f"resize2d kernel: empty extent ({planes}, {h}, {w}, {oh}, {ow})")
    x = L.Param("x", dtype, planes * h * w)
    ty, wy = L.Param("ty", "int64", taps * oh), L.Param("wy", dtype, taps * oh)
    tx, wx = L.Param("tx", "int64", taps * ow), L.Param("wx", dtype, taps * ow)
    out = L.Param("out", dtype, planes * oh * ow)
    V = L.Var
    t, ox = V("t"), V("ox")
    head = [L.Local("p", "int64", t // oh), L.Local("oy", "int64", t % oh)]
    for a in range(taps):       # input row a of this output row, and its weight
        head.append(L.Local(f"r{a}", "int64", V("p") * (h * w) + ty[V("oy") + a * oh] * w))
        if taps == 2:
            head.append(L.Local(f"a{a}", dtype, wy[V("oy") + a * oh]))
    cols = [L.Local(f"i{b}", "int64", tx[ox + b * ow]) for b in range(taps)]
    if taps == 1:
        val = x[V("r0") + V("i0")]
    else:
        cols += [L.Local(f"b{b}", dtype, wx[ox + b * ow]) for b in range(2)]

        def row(a):
            return x[V(f"r{a}") + V("i0")] * V("b0", dtype) + x[V(f"r{a}") + V("i1")] * V("b1", dtype)
        val = V("a0", dtype) * row(0) + V("a1", dtype) * row(1)
    body = L.block(*cols, L.Store(out, t * ow + ox, val))
    loop = L.for_("t", 0, planes * oh, L.block(*head, L.for_("ox", 0, ow, body, "vector")), "parallel")
    k = L.Kernel(name, (x, ty, wy, tx, wx, out), L.block(loop), "t", planes * oh)
    L.verify_kernel(k)
    return k
