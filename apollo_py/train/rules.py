"""Vector-Jacobian product rules of the elementwise, reduction and layout primitives.

A rule has the signature ``rule(b, node, xs, y, g, needs) -> [Value | None]``: ``xs`` are the
node's inputs and ``y`` its output (builder values in the gradient graph), ``g`` the cotangent of
``y`` and ``needs[k]`` whether input ``k`` wants a gradient.  It returns one cotangent per input,
already reduced to that input's shape, or ``None`` for no gradient (integer/bool inputs,
piecewise-constant ops, inputs that do not need one).  :data:`RULES` maps op name -> rule; ops in
:data:`NON_DIFFERENTIABLE` have zero derivative everywhere they are defined.

Conventions where the derivative is not unique: ``relu'(0) = 0``, ``abs'(0) = 0``; ``max``/``min``
(binary) split the cotangent evenly between tied operands; ``reduce_max``/``reduce_min`` split it
evenly among all tied extremal elements of a reduction (like ``torch.amax``).
"""
from __future__ import annotations

import math

import numpy as np

from ..ir.types import FLOAT_DTYPES
from .graphs import as_float, scalar, sum_to, zeros

NON_DIFFERENTIABLE = frozenset({
    "eq", "ne", "lt", "le", "gt", "ge", "and", "or", "xor", "not", "floor", "ceil", "iota",
    "stop_gradient",
    "constant",
})


def _binary(fn):
    """Wrap a rule computing full-shape cotangents so results are summed back to operand shapes."""
    def rule(b, node, xs, y, g, needs):
        outs = fn(b, xs, y, g, needs)
        return [sum_to(b, o, x.shape) if (o is not None and need) else None
                for o, x, need in zip(outs, xs, needs)]
    return rule


@_binary
def _add(b, xs, y, g, needs):
    return [g, g]


@_binary
def _sub(b, xs, y, g, needs):
    return [g, b.neg(g) if needs[1] else None]


@_binary
def _mul(b, xs, y, g, needs):
    a, c = xs
    return [b.mul(g, c) if needs[0] else None, b.mul(g, a) if needs[1] else None]


@_binary
def _div(b, xs, y, g, needs):
    a, c = xs
    ga = b.div(g, c)
    # d(a/c)/dc = -a/c^2 = -(1/c) * y
    return [ga, b.neg(b.mul(ga, y)) if needs[1] else None]


@_binary
def _pow(b, xs, y, g, needs):
    a, c = xs
    ga = gc = None
    if needs[0]:
        one = scalar(b, 1, c.dtype)
        ga = b.mul(g, b.mul(c, b.pow(a, b.sub(c, one))))
    if needs[1]:
        gc = b.mul(g, b.mul(y, b.log(a)))
    return [ga, gc]


def _minmax(first_wins):
    @_binary
    def rule(b, xs, y, g, needs):
        a, c = xs
        half = scalar(b, 0.5, g.dtype)
        tie = b.mul(as_float(b, b.eq(a, c), g.dtype), half)
        wa = b.add(as_float(b, first_wins(b, a, c), g.dtype), tie)
        ga = b.mul(g, wa)
        return [ga if needs[0] else None, b.sub(g, ga) if needs[1] else None]
    return rule


def _where(b, node, xs, y, g, needs):
    c, a, d = xs
    z = scalar(b, 0, g.dtype)
    ga = sum_to(b, b.where(c, g, z), a.shape) if needs[1] else None
    gd = sum_to(b, b.where(c, z, g), d.shape) if needs[2] else None
    return [None, ga, gd]


def _unary(fn):
    def rule(b, node, xs, y, g, needs):
        return [fn(b, xs[0], y, g)]
    return rule


def _sign(b, x, dtype):
    return b.sub(as_float(b, b.gt(x, scalar(b, 0, dtype)), dtype),
                 as_float(b, b.lt(x, scalar(b, 0, dtype)), dtype))


_UNARY = {
    "neg": lambda b, x, y, g: b.neg(g),
    "abs": lambda b, x, y, g: b.mul(g, _sign(b, x, g.dtype)),
    "exp": lambda b, x, y, g: b.mul(g, y),
    "log": lambda b, x, y, g: b.div(g, x),
    "sqrt": lambda b, x, y, g: b.div(b.mul(g, scalar(b, 0.5, g.dtype)), y),
    # d x^-1/2 = -1/2 x^-3/2 = -1/2 * y / x
    "rsqrt": lambda b, x, y, g: b.mul(b.mul(g, scalar(b, -0.5, g.dtype)), b.div(y, x)),
    "reciprocal": lambda b, x, y, g: b.neg(b.mul(g, b.mul(y, y))),
    "tanh": lambda b, x, y, g: b.mul(g, b.sub(scalar(b, 1, g.dtype), b.mul(y, y))),
    "erf": lambda b, x, y, g: b.mul(b.mul(g, scalar(b, 2 / math.sqrt(math.pi), g.dtype)),
                                    b.exp(b.neg(b.mul(x, x)))),
    "sigmoid": lambda b, x, y, g: b.mul(g, b.mul(y, b.sub(scalar(b, 1, g.dtype), y))),
    # mask from the output (y > 0 exactly where x > 0): the forward kernel then need not keep x
    "relu": lambda b, x, y, g: b.mul(g, as_float(b, b.gt(y, scalar(b, 0, g.dtype)), g.dtype)),
}


def _cast(b, node, xs, y, g, needs):
    x = xs[0]
    if x.dtype not in FLOAT_DTYPES or y.dtype not in FLOAT_DTYPES:
        return [None]
    return [b.cast(g, to=x.dtype) if x.dtype != g.dtype else g]


def _broadcast_to(b, node, xs, y, g, needs):
    return [sum_to(b, g, xs[0].shape)]


def _keep_shape(x, axes):
    return tuple(1 if k in axes else d for k, d in enumerate(x.shape))


def _expand(b, v, x, axes):
    """Broadcast a reduction result ``v`` (keepdims or not) back to ``x``'s shape."""
    keep = _keep_shape(x, axes)
    if v.shape != keep:
        v = b.reshape(v, shape=keep)
    return b.broadcast_to(v, shape=x.shape) if keep != x.shape else v


def _reduce_sum(b, node, xs, y, g, needs):
    return [_expand(b, g, xs[0], tuple(node.attrs["axes"]))]


def _reduce_prod(b, node, xs, y, g, needs):
    # d prod / dx_i = prod / x_i: exact where no element of the reduction is zero (documented
    # restriction; a zero element gives a non-finite gradient).
    x = xs[0]
    axes = tuple(node.attrs["axes"])
    return [b.div(b.mul(_expand(b, g, x, axes), _expand(b, y, x, axes)), x)]


def _reduce_extremum(b, node, xs, y, g, needs):
    x = xs[0]
    axes = tuple(node.attrs["axes"])
    mask = as_float(b, b.eq(x, _expand(b, y, x, axes)), g.dtype)
    count = b.reduce_sum(mask, axes=axes, keepdims=True)
    gk = b.div(_expand(b, g, x, axes), count)  # ties share the cotangent evenly
    return [b.mul(gk, mask)]


def _reshape(b, node, xs, y, g, needs):
    return [b.reshape(g, shape=xs[0].shape)]


def _transpose(b, node, xs, y, g, needs):
    perm = tuple(node.attrs["perm"])
    inv = tuple(int(i) for i in np.argsort(perm))
    return [b.transpose(g, perm=inv)]


def _concat(b, node, xs, y, g, needs):
    ax = node.attrs["axis"]
    out, at = [], 0
    r = len(g.shape)
    for x, need in zip(xs, needs):
        n = x.shape[ax]
        if need:
            starts = tuple(at if k == ax else 0 for k in range(r))
            ends = tuple(at + n if k == ax else g.shape[k] for k in range(r))
            out.append(b.slice(g, starts=starts, ends=ends, steps=(1,) * r))
        else:
            out.append(None)
        at += n
    return out


def _swap_last(b, v):
    r = len(v.shape)
    return b.transpose(v, perm=tuple(range(r - 2)) + (r - 1, r - 2))


def _product_t(b, p, q, transpose_left: bool):
    """``swap(p) @ q`` (``transpose_left``) or ``p @ swap(q)``, whichever materialises fewer
    transposed elements: ``swap(p) @ q == swap(swap(q) @ p)``, so the other form transposes
    ``q`` and the (batched) result instead of ``p``.  With a small class count the weight
    gradient ``swap(a) @ g`` of a (B, H) @ (H, C) product then transposes (B, C) and (H, C)
    arrays, not the (B, H) activation."""
    t, other = (p, q) if transpose_left else (q, p)
    out_shape = tuple(np.broadcast_shapes(p.shape[:-2], q.shape[:-2]))
    out_shape += (p.shape[-1], q.shape[-1]) if transpose_left else (p.shape[-2], q.shape[-2])
    if other.type.size + int(np.prod(out_shape, dtype=np.int64)) < t.type.size:
        flipped = b.matmul(_swap_last(b, q), p) if transpose_left else b.matmul(q, _swap_last(b, p))
        return _swap_last(b, flipped)
    return b.matmul(_swap_last(b, p), q) if transpose_left else b.matmul(p, _swap_last(b, q))


def _matmul(b, node, xs, y, g, needs):
    a, c = xs
    a2 = b.reshape(a, shape=(1,) + a.shape) if len(a.shape) == 1 else a
    c2 = b.reshape(c, shape=c.shape + (1,)) if len(c.shape) == 1 else c
    batch = tuple(np.broadcast_shapes(a2.shape[:-2], c2.shape[:-2]))
    g2 = g
    full = batch + (a2.shape[-2], c2.shape[-1])
    if g.shape != full:
        g2 = b.reshape(g, shape=full)
    ga = gc = None
    if needs[0]:
        ga = sum_to(b, _product_t(b, g2, c2, transpose_left=False), a2.shape)
        if ga.shape != a.shape:
            ga = b.reshape(ga, shape=a.shape)
    if needs[1]:
        gc = sum_to(b, _product_t(b, a2, g2, transpose_left=True), c2.shape)
        if gc.shape != c.shape:
            gc = b.reshape(gc, shape=c.shape)
    return [ga, gc]


def _gather(b, node, xs, y, g, needs):
    data, idx = xs
    from . import prims  # noqa: F401  (registers scatter_add)
    base = zeros(b, data.shape, g.dtype)
    return [b.op("scatter_add", base, idx, g, axis=node.attrs["axis"])[0], None]


def _resize2d(b, node, xs, y, g, needs):
    """``resize2d`` (ops/resize2d.py) is ``y = sum_t gather(rows, tx[t], 3) * wx[t]`` over
    ``rows = sum_t gather(x, ty[t], 2) * wy[t][:, None]``: its VJP scatters the cotangent back
    through the column taps, then the row taps.  The tap tables (constants) get none."""
    x, ty, wy, tx, wx = xs
    if not needs[0]:
        return [None] * 5
    from . import prims  # noqa: F401  (registers scatter_add)
    taps = int(node.attrs["taps"])
    n, c, h, w = x.shape
    oh, ow = ty.shape[1], tx.shape[1]

    def tap(table, t, shape):
        return b.reshape(b.gather(table, b.constant(np.array([t], np.int64)), axis=0), shape=shape)

    def back(grad, idx, wt, axis, shape, wshape):
        acc = None
        for t in range(taps):
            term = b.op("scatter_add", zeros(b, shape, g.dtype), tap(idx, t, (idx.shape[1],)),
                        b.mul(grad, tap(wt, t, wshape)), axis=axis)[0]
            acc = term if acc is None else b.add(acc, term)
        return acc

    g_rows = back(g, tx, wx, 3, (n, c, oh, w), (ow,))
    return [back(g_rows, ty, wy, 2, (n, c, h, w), (oh, 1)), None, None, None, None]


def _scatter_add(b, node, xs, y, g, needs):
    data, idx, upd = xs
    gu = b.gather(g, idx, axis=node.attrs["axis"]) if needs[2] else None
    return [g if needs[0] else None, None, gu]


RULES = {
    "add": _add, "sub": _sub, "mul": _mul, "div": _div, "pow": _pow,
    "max": _minmax(lambda b, a, c: b.gt(a, c)), "min": _minmax(lambda b, a, c: b.lt(a, c)),
    "where": _where, "cast": _cast, "broadcast_to": _broadcast_to,
    "reduce_sum": _reduce_sum, "reduce_prod": _reduce_prod,
    "reduce_max": _reduce_extremum, "reduce_min": _reduce_extremum,
    "reshape": _reshape, "transpose": _transpose, "concat": _concat, "matmul": _matmul,
    "gather": _gather, "scatter_add": _scatter_add, "resize2d": _resize2d,
}
RULES.update({name: _unary(fn) for name, fn in _UNARY.items()})
