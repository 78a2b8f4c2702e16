"""Hand-built loop-IR kernels and their numpy references, shared by the codegen tests."""
from __future__ import annotations

import math

import numpy as np

from apollo_py.codegen import loopir as L
from apollo_py.codegen.loopir import (Cast, Kernel, Local, Param, Select, Store, Un, Var,
                                      for_, gt, land, lt, maximum)
from apollo_py.codegen.templates import lane_reduce, reduce_kernel


def broadcast_add_mul(m: int, n: int) -> Kernel:
    """o[i, j] = (a[i, j] + b[j]) * c[i] -- a row and a column broadcast."""
    a, b, c = Param("a", "float32", m * n), Param("b", "float32", n), Param("c", "float32", m)
    o = Param("o", "float32", m * n)
    i, j = Var("i"), Var("j")
    body = for_("i", 0, m, for_("j", 0, n, Store(o, i * n + j, (a[i * n + j] + b[j]) * c[i]),
                                "vector"), "parallel")
    return Kernel("bcast_add_mul", (a, b, c, o), body, "i", m)


def ref_broadcast_add_mul(a, b, c, m, n):
    return ((a.reshape(m, n) + b[None, :]) * c[:, None]).ravel()


def gelu_tanh(x: L.Expr) -> L.Expr:
    """GELU, tanh approximation, as loop IR."""
    k = math.sqrt(2.0 / math.pi)
    inner = (x + x * x * x * 0.044715) * k
    return x * 0.5 * (Un("tanh", inner) + 1.0)


def ref_gelu_tanh(x):
    x = x.astype(np.float64)
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def bias_gelu(m: int, n: int, dtype: str = "float32") -> Kernel:
    """o[i, j] = gelu(x[i, j] + b[j])."""
    x, b, o = Param("x", dtype, m * n), Param("b", dtype, n), Param("o", dtype, m * n)
    i, j = Var("i"), Var("j")
    body = for_("i", 0, m, for_("j", 0, n, Store(o, i * n + j, gelu_tanh(x[i * n + j] + b[j])),
                                "vector"), "parallel")
    return Kernel("bias_gelu", (x, b, o), body, "i", m)


def softmax_rows(rows: int, cols: int) -> Kernel:
    """Row softmax as ONE kernel: max pass, exp pass, sum pass, scale pass per row."""
    x, o = Param("x", "float32", rows * cols), Param("o", "float32", rows * cols)
    r, c = Var("r"), Var("c")
    row = r * cols
    mx_stmts, mx = lane_reduce("m", "max", "float32", 0, cols, lambda k: x[row + k])
    sm_stmts, sm = lane_reduce("s", "sum", "float32", 0, cols, lambda k: o[row + k])
    body = L.block(
        mx_stmts,
        for_("c", 0, cols, Store(o, row + c, Un("exp", x[row + c] - mx)), "vector"),
        sm_stmts,
        Local("inv", "float32", Un("reciprocal", sm)),
        for_("c", 0, cols, Store(o, row + c, o[row + c] * Var("inv", "float32")), "vector"),
    )
    return Kernel("softmax", (x, o), for_("r", 0, rows, body, "parallel"), "r", rows)


def ref_softmax(x, rows, cols):
    x = x.reshape(rows, cols).astype(np.float64)
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return (e / e.sum(axis=1, keepdims=True)).ravel()


def reduce_form(form: str, op: str, p: int, r: int, dtype: str = "float32") -> Kernel:
    """A reduce-template kernel reading x laid out for ``form``."""
    x = Param("x", dtype, p * r)
    o = Param("o", dtype, 1 if form == "all" else p)
    if form == "x":
        def el(pi, ri): return x[pi * r + ri]
        shape = (p, r)
    elif form == "y":
        def el(pi, ri): return x[ri * p + pi]
        shape = (r, p)
    else:
        def el(pi, ri): return x[ri]
        shape = (p * r,)
    return reduce_kernel(f"reduce_{form}_{op}", form, op, (x, o), o, shape, el)


def ref_reduce(form, op, x, p, r):
    fn = {"sum": np.sum, "max": np.max, "min": np.min, "prod": np.prod}[op]
    if form == "x":
        return fn(x.reshape(p, r).astype(np.float64), axis=1)
    if form == "y":
        return fn(x.reshape(r, p).astype(np.float64), axis=0)
    return np.array([fn(x.astype(np.float64))])


def bias_maxpool(ch: int, h: int, w: int) -> Kernel:
    """o[c, i, j] = max over the 2x2 window of (x[c, 2i+di, 2j+dj] + b[c])."""
    x, b = Param("x", "float32", ch * h * w), Param("b", "float32", ch)
    oh, ow = h // 2, w // 2
    o = Param("o", "float32", ch * oh * ow)
    q, j = Var("q"), Var("j")  # q = c * oh + i
    c, i = q // oh, q % oh
    base = c * (h * w) + i * 2 * w + j * 2
    bias = b[c]
    vals = [x[base] + bias, x[base + 1] + bias, x[base + w] + bias, x[base + w + 1] + bias]
    m = maximum(maximum(vals[0], vals[1]), maximum(vals[2], vals[3]))
    body = for_("q", 0, ch * oh, for_("j", 0, ow, Store(o, q * ow + j, m), "vector"),
                "parallel")
    return Kernel("bias_maxpool", (x, b, o), body, "q", ch * oh)


def ref_bias_maxpool(x, b, ch, h, w):
    y = x.reshape(ch, h, w) + b[:, None, None]
    return y.reshape(ch, h // 2, 2, w // 2, 2).max(axis=(2, 4)).ravel()


def int_kernel(n: int) -> Kernel:
    """int64 arithmetic, int32 casts, and a bool mask in and out."""
    a, b = Param("a", "int64", n), Param("b", "int64", n)
    m = Param("m", "bool", n)
    o, o32, ob = Param("o", "int64", n), Param("o32", "int32", n), Param("ob", "bool", n)
    i = Var("i")
    ai, bi = a[i], b[i]
    val = (ai * 3 + bi) // 4 % 7 + maximum(ai, bi) - Un("abs", bi)
    val = Select(m[i], val, -ai)
    mask = land(gt(ai, bi), Un("not", m[i]))
    body = for_("i", 0, n, [Store(o, i, val),
                            Store(o32, i, Cast("int32", ai) * 2 + 1),
                            Store(ob, i, L.lor(mask, lt(ai, L.Const(-50))))], "parallel")
    return Kernel("int_ops", (a, b, m, o, o32, ob), body, "i", n)


def ref_int_kernel(a, b, m):
    val = (a * 3 + b) // 4 % 7 + np.maximum(a, b) - np.abs(b)
    val = np.where(m, val, -a)
    ob = ((a > b) & ~m) | (a < -50)
    return val, (a.astype(np.int32) * 2 + 1), ob


def float64_kernel(n: int) -> Kernel:
    """Every float64 math op on one input."""
    x, o = Param("x", "float64", n), Param("o", "float64", 6 * n)
    i = Var("i")
    xi = x[i]
    outs = [Un("exp", xi), Un("log", Un("abs", xi) + 1.0), Un("tanh", xi), Un("erf", xi),
            Un("sigmoid", xi), L.power(Un("abs", xi), L.Const(1.7, "float64"))]
    body = for_("i", 0, n, [Store(o, i + k * n, v) for k, v in enumerate(outs)], "parallel")
    return Kernel("f64_ops", (x, o), body, "i", n)


def ref_float64(x):
    erf = np.vectorize(math.erf)
    return np.concatenate([np.exp(x), np.log(np.abs(x) + 1), np.tanh(x), erf(x),
                           1 / (1 + np.exp(-x)), np.abs(x) ** 1.7])


def unary_kernel(op: str, n: int, dtype: str = "float32") -> Kernel:
    """o[i] = op(x[i])."""
    x, o = Param("x", dtype, n), Param("o", dtype, n)
    i = Var("i")
    return Kernel(f"un_{op}", (x, o), for_("i", 0, n, Store(o, i, Un(op, x[i])), "vector"))


def pow_kernel(n: int, exponent=None) -> Kernel:
    """o[i] = a[i] ** e, with e a Const (fast paths) or the buffer b."""
    a, b, o = Param("a", "float32", n), Param("b", "float32", n), Param("o", "float32", n)
    i = Var("i")
    e = b[i] if exponent is None else L.Const(exponent, "float32")
    name = "pow_var" if exponent is None else f"pow_{str(exponent).replace('.', 'p').replace('-', 'm')}"
    return Kernel(name, (a, b, o), for_("i", 0, n, Store(o, i, L.power(a[i], e)), "vector"))
