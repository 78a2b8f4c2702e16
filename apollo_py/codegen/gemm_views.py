"""Strided operand and result layouts of the generated GEMM (codegen/gemm.py).

An operand read in place through a transpose (:class:`OperandView`, folded by
``layers/gemm_lowering.fold_operand_transposes``) and a result stored transposed
(``GemmDesc.out_perm``): the index expressions the pack and epilogue kernels use.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod

from apollo_py.codegen import loopir as L


@dataclass(frozen=True)
class OperandView:
    """A matmul operand read in place from another buffer: the operand's logical ``shape``
    (numpy matmul's, rank >= 2) and each logical dim's element ``stride`` into a source buffer
    of ``size`` elements -- e.g. ``transpose(src, perm)`` without the copy (the exporters'
    ``[B, S, H, d] -> [B, H, d, S]`` key transpose)."""

    shape: tuple
    strides: tuple
    size: int

    @staticmethod
    def transposed(src_shape: tuple, perm: tuple) -> "OperandView":
        """The view of ``numpy.transpose(src, perm)`` on a C-contiguous ``src``."""
        st, s = [0] * len(src_shape), 1
        for d in range(len(src_shape) - 1, -1, -1):
            st[d] = s
            s *= src_shape[d]
        return OperandView(tuple(src_shape[p] for p in perm), tuple(st[p] for p in perm), s)


def view_address(v: OperandView, flat: L.Expr, last: L.Expr) -> L.Expr:
    """Address in ``v``'s source of the element whose leading logical dims, flattened in C
    order, are ``flat`` and whose last dim is ``last``."""
    dims = v.shape[:-1]
    acc: L.Expr = last * v.strides[-1]
    rem = flat
    for q in range(len(dims) - 1, -1, -1):
        if dims[q] == 1:
            continue
        idx = rem % dims[q] if prod(dims[:q]) > 1 else rem    # the outermost needs no wrap
        acc = acc + idx * v.strides[q]
        rem = rem // dims[q]
    return acc


def permuted_index(shape: tuple, perm: tuple, rd: int, row: L.Expr, col: L.Expr) -> L.Expr:
    """Where element ``(row, col)`` of C -- ``shape``, rows the flattened first ``rd`` dims,
    columns the rest -- lives in ``transpose(C, perm)`` (C order)."""
    ystr, acc = [0] * len(perm), 1
    for q in range(len(perm) - 1, -1, -1):
        ystr[q] = acc
        acc *= shape[perm[q]]
    strides = [0] * len(shape)
    for pos, q in enumerate(perm):
        strides[q] = ystr[pos]

    def part(flat: L.Expr, lo: int, hi: int) -> L.Expr:
        e: L.Expr = L.Const(0)
        rem = flat
        for q in range(hi - 1, lo - 1, -1):
            if shape[q] == 1:
                continue
            idx = rem % shape[q] if prod(shape[lo:q]) > 1 else rem
            e = e + idx * strides[q]
            rem = rem // shape[q]
        return e
    return part(row, 0, rd) + part(col, rd, len(shape))
