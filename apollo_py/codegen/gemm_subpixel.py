"""The GEMM epilogue of a result stored depth-to-space: each tile row goes to every ``G``-th
element of the stored layout, ``G`` rows of the tile interleaved into contiguous runs.

A ConvTranspose whose kernel equals its stride (U-Net's 2x2 / stride 2 up-convolution,
ops/compound_conv.py) is a 1x1 conv to ``C_out * kh * kw`` channels followed by a reshape to
``[N, C_out, kh, kw, H, W]``, a transpose to ``[N, C_out, H, kh, W, kw]`` and a reshape to
``[N, C_out, H*kh, W*kw]`` (ONNX's DepthToSpace in CRD mode is the same chain).  With the GEMM's
``out_shape`` the split shape and ``out_perm`` the transpose (layers/gemm_reshape_epilogue.py,
:func:`~apollo_py.layers.gemm_reshape_epilogue.fold_subpixel_stores`), the rows ``(c, kh, kw)``
of C for ``kw < G`` are one group: for output pixel ``w`` of tile column ``(h, w)`` their
values lie next to each other at ``base(c, kh, h) + w * G + kw``.  The generic permuted
epilogue stored every element at a stride of ``G`` through a division chain per element, a
scatter (docs/design/stitching.md: 1.28x the conv's time).  Here one vector loop over a run of
``w`` evaluates the epilogue of the group's ``G`` rows and stores them at ``w * G + q``: LLVM's
loop vectoriser makes those ``G`` strided stores one interleave group (shuffles, then
contiguous vector stores), and the address is computed once per run.

:func:`subpixel_form` says when a layout has that form; :func:`subpixel_epilogue_kernel` is the
kernel (the parameters and calling convention of ``gemm._epilogue_kernel``, which dispatches
here): rows of a group split between two tiles (``MR % G != 0``) take the per-element path.
"""
from __future__ import annotations

from typing import Optional

from apollo_py.codegen import loopir as L
from apollo_py.codegen.gemm_views import permuted_index

#: switch for A/B measurements in one process: off, such layouts take gemm.py's per-element
#: permuted stores (the lowering, layers/gemm_reshape_epilogue.py, has its own switch)
ENABLED = True
#: groups wider than this take the per-element path (an interleave group of more stores than
#: this is not one LLVM shuffles efficiently)
MAX_GROUP = 8


def stored_strides(shape: tuple, perm: tuple) -> list:
    """Element stride of every dim of ``shape`` in ``transpose(C, perm)`` (C order)."""
    strides, acc = [0] * len(shape), 1
    for q in reversed(perm):
        strides[q] = acc
        acc *= shape[q]
    return strides


def subpixel_form(shape: tuple, rd: int, perm: Optional[tuple]) -> Optional[tuple]:
    """``(G, wq)`` when ``transpose(C, perm)`` of C (``shape``, rows the first ``rd`` dims) stores
    the innermost column dim ``wq`` (the last column dim of more than one element) at a stride
    ``G > 1`` and the last row dim of more than one element has ``G`` elements at stride 1 --
    the depth-to-space layout of the module docstring -- or ``G == 1`` when ``wq`` is stored at
    stride 1 but the layout is not the row-major one (a ConvTranspose of kernel ``(k, 1)``).
    None otherwise (another layout, a group wider than :data:`MAX_GROUP`)."""
    if perm is None or tuple(perm) == tuple(range(len(shape))):
        return None
    cols = [q for q in range(rd, len(shape)) if shape[q] > 1]
    rows = [q for q in range(rd) if shape[q] > 1]
    if not cols:
        return None
    st = stored_strides(shape, perm)
    wq = cols[-1]
    if st[wq] == 1:
        return 1, wq
    if not rows:
        return None
    kq = rows[-1]
    g = shape[kq]
    if st[kq] != 1 or st[wq] != g or g > MAX_GROUP:
        return None
    return g, wq


def subpixel_epilogue_kernel(d, bl, params: tuple, operand_index, epilogue_locals) -> L.Kernel:
    """The epilogue kernel of GEMM ``d`` whose layout has :func:`subpixel_form` ``(G, wq)``:
    ``params`` are ``gemm._epilogue_params(d, bl)`` (tile ``MR x NR``, info ``[batch, first
    row, first column, columns]``, operands, outputs), called for rows ``[0, rows)`` of the
    tile.  A tile row that starts a group of ``G`` rows all inside the tile stores the group
    (module docstring); a row whose group straddles the tile stores alone, element by element
    through ``permuted_index``.  ``operand_index`` / ``epilogue_locals`` are gemm.py's."""
    g, wq = subpixel_form(d.out_shape, d.row_dims, d.out_perm)
    tile, info, *rest = params
    ops, outs = rest[:len(d.operands)], rest[len(d.operands):]
    V, C = L.Var, L.Const
    shape, perm, rd = d.out_shape, d.out_perm, d.row_dims
    wd = shape[wq]      # the columns after wq are unit dims: column (.., w) is (..) * W + w
    ii = V("ii")
    row0 = L.Load(info, C(0)) * d.m + L.Load(info, C(1))
    col0, ncols = L.Load(info, C(2)), L.Load(info, C(3))
    row = row0 + ii

    def stores(q: int, col: L.Expr, lin: L.Expr, jj: L.Expr) -> list:
        stmts, env = epilogue_locals(d, L.Load(tile, (ii + q) * bl.nr + jj), ops,
                                     lambda o: operand_index(o, shape, rd, row + q, col), prefix=f"g{q}_")
        return [*stmts, *(L.Store(outs[k], lin, env[v]) for k, v in enumerate(d.outputs))]

    # one run of w per iteration of "wr": columns [wr * W, wr * W + W) of C cut to the tile's
    w, wr = V("w"), V("wr")
    col = wr * wd + w
    body = [s for q in range(g) for s in stores(q, col, V("base") + w * g + q, col - col0)]
    runs = L.for_("wr", col0 // wd, (col0 + ncols + (wd - 1)) // wd, L.block(
        L.Local("base", "int64", permuted_index(shape, perm, rd, row, wr * wd)),
        L.for_("w", L.maximum(col0 - wr * wd, C(0)), L.minimum(col0 + ncols - wr * wd, C(wd)),
               L.block(*body), "vector")))
    jj = V("jj")
    alone = L.for_("jj", 0, ncols, L.block(
        *stores(0, col0 + jj, permuted_index(shape, perm, rd, row, col0 + jj), jj)), "vector")
    if g == 1:
        loop = L.for_("ii", 0, bl.mr, runs, "parallel")
    else:
        nrows = L.minimum(C(bl.mr), d.m - L.Load(info, C(1)))
        first = V("gfirst")
        whole = L.land(L.ge(first, row0), L.le(first + g, row0 + nrows))
        loop = L.for_("ii", 0, bl.mr, L.block(
            L.Local("gfirst", "int64", row - row % g),
            L.If(whole, L.If(L.eq(row % g, 0), runs), alone)), "parallel")
    return L.Kernel(f"{d.name}_epi", (tile, info, *ops, *outs), loop, "ii", bl.mr)
