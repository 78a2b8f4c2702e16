"""Loop-IR expressions of elementwise primitives: a graph node's ``scalar`` operation on
operand expressions.

Shared by the isl-AST lowering (:mod:`apollo_py.poly.ast_to_loopir`) and the generated GEMM's
fused epilogue (:mod:`apollo_py.codegen.gemm`); it sits in ``codegen``, below ``poly``, so the
GEMM generator does not reach up into the polyhedral layer.
"""
from __future__ import annotations

from ..errors import CompileError
from ..ops.registry import get_op
from . import loopir as L


def scalar_op(n, args, dom, odt) -> L.Expr:
    """The loop-IR expression of elementwise primitive ``n`` on operand expressions ``args``."""
    op = get_op(n.op).scalar
    if op in ("add", "sub", "mul", "max", "min", "pow", "lt", "le", "gt", "ge", "eq", "ne",
              "and", "or"):
        return L.Bin(op, args[0], args[1])
    if op == "div":
        a, b = args
        if L.is_float(a.dtype):
            return L.Bin("div", a, b)
        q = _floordiv_signed(a, b)
        return q
    if op == "xor":
        return L.ne(args[0], args[1])
    if op in L.UNARY_OPS:
        return L.Un(op, args[0])
    if op == "select":
        return L.Select(args[0], args[1], args[2])
    if op == "cast":
        return L.Cast(odt, args[0])
    if op == "copy":     # no operand: a pad's border fill (poly/statements.py _pad_pieces)
        return args[0] if args else L.as_expr(n.attrs["value"], odt)
    if op == "iota":
        return L.Cast(odt, dom[int(n.attrs["axis"])])
    raise CompileError(f"node {n.label!r} ({n.op}): no loop-IR lowering for scalar op {op!r}")


def _floordiv_signed(a: L.Expr, b: L.Expr) -> L.Expr:
    """Integer division truncating toward zero (ONNX), from non-negative floordiv/mod."""
    zero = L.as_expr(0, a.dtype)
    aa = L.Select(L.lt(a, zero), -a, a)
    bb = L.Select(L.lt(b, zero), -b, b)
    q = aa // bb
    return L.Select(L.ne(L.lt(a, zero), L.lt(b, zero)), -q, q)
