"""Compound (ONNX-level) ops as decompositions into primitives (DESIGN §4, "opening compound ops").

Every function takes a :class:`~apollo_py.ir.builder.GraphBuilder` ``b``, input
:class:`~apollo_py.ir.builder.Value` s and plain-Python attributes, appends primitives to ``b``
and returns the result Value(s).  Shapes are static: decisions that depend on shapes (pool
windows, reduction counts, split sizes) are taken here, at build time.  Semantics follow ONNX;
front ends translate their own attribute conventions (opset differences, defaults) before
calling in.  Shape problems raise :class:`~apollo_py.errors.ShapeError`.
"""
from __future__ import annotations

import math
from math import prod
from typing import Sequence

import numpy as np

from ..errors import ShapeError
from ..ir.types import FLOAT_DTYPES, np_dtype

# --- helpers -----------------------------------------------------------------------------------


def scalar(b, value, dtype: str):
    """A rank-0 constant ``value`` of apollo dtype ``dtype``."""
    return b.constant(np.asarray(value, dtype=np_dtype(dtype)))


def normalize_axis(axis: int, rank: int) -> int:
    """``axis`` in ``[-rank, rank)`` as a non-negative int; ShapeError otherwise."""
    axis = int(axis)
    if not -rank <= axis < max(rank, 1):
        raise ShapeError(f"axis {axis} is out of range for rank {rank}")
    return axis % rank if rank else 0


def normalize_axes(axes: Sequence[int], rank: int) -> tuple[int, ...]:
    """Sorted non-negative axes; ShapeError on out-of-range or repeated axes."""
    out = sorted(normalize_axis(a, rank) for a in axes)
    if len(set(out)) != len(out):
        raise ShapeError(f"repeated axis in {tuple(axes)}")
    return tuple(out)


def identity(b, x):
    """Identity: returns ``x`` itself (no node; the front end copies graph outputs if needed)."""
    return x


def dropout(b, x):
    """Dropout at inference: the identity."""
    return x


def copy(b, x):
    """An explicit copy of ``x`` (a broadcast to its own shape), for outputs that alias inputs."""
    return b.broadcast_to(x, shape=x.shape)


def reshape(b, x, shape: Sequence[int]):
    """Reshape to a static shape; returns ``x`` unchanged when the shape is the same."""
    shape = tuple(int(d) for d in shape)
    if shape == x.shape:
        return x
    return b.reshape(x, shape=shape)


def cast(b, x, dtype: str):
    """Cast to ``dtype``; returns ``x`` unchanged when it already has that dtype."""
    return x if x.dtype == dtype else b.cast(x, to=dtype)


# --- reductions --------------------------------------------------------------------------------


def reduce(b, kind: str, x, axes: Sequence[int] | None = None, keepdims: bool = True):
    """``reduce_<kind>`` (sum/prod/max/min) over ``axes`` (None = all) with ONNX axis rules."""
    axes = tuple(range(x.type.rank)) if axes is None else normalize_axes(axes, x.type.rank)
    return b.op(f"reduce_{kind}", x, axes=axes, keepdims=bool(keepdims))[0]


def _count(x, axes) -> int:
    axes = tuple(range(x.type.rank)) if axes is None else normalize_axes(axes, x.type.rank)
    return prod(x.shape[a] for a in axes)


def reduce_mean(b, x, axes=None, keepdims: bool = True):
    """Mean over ``axes``: reduce_sum then divide by the element count."""
    s = reduce(b, "sum", x, axes, keepdims)
    return b.div(s, scalar(b, _count(x, axes), x.dtype))


def reduce_sum_square(b, x, axes=None, keepdims: bool = True):
    """Sum of squares over ``axes``."""
    return reduce(b, "sum", b.mul(x, x), axes, keepdims)


def reduce_l1(b, x, axes=None, keepdims: bool = True):
    """Sum of absolute values over ``axes``."""
    return reduce(b, "sum", b.abs(x), axes, keepdims)


def reduce_l2(b, x, axes=None, keepdims: bool = True):
    """Euclidean norm over ``axes`` (integer inputs are computed in float64 and cast back)."""
    if x.dtype not in FLOAT_DTYPES:
        return cast(b, reduce_l2(b, cast(b, x, "float64"), axes, keepdims), x.dtype)
    return b.sqrt(reduce_sum_square(b, x, axes, keepdims))


def reduce_log_sum(b, x, axes=None, keepdims: bool = True):
    """log of the sum over ``axes``."""
    return b.log(reduce(b, "sum", x, axes, keepdims))


def reduce_log_sum_exp(b, x, axes=None, keepdims: bool = True):
    """log(sum(exp(x))) over ``axes``, computed stably as m + log(sum(exp(x - m)))."""
    if _count(x, axes) == 0:  # empty set: log(0) = -inf, no maximum to subtract
        return b.log(reduce(b, "sum", b.exp(x), axes, keepdims))
    m = reduce(b, "max", x, axes, True)
    # rows that are all -inf would give nan in x - m: subtract 0 there instead
    m = b.where(b.eq(b.abs(m), scalar(b, np.inf, x.dtype)), scalar(b, 0, x.dtype), m)
    s = b.log(reduce(b, "sum", b.exp(b.sub(x, m)), axes, True))
    out = b.add(s, m)
    if not keepdims:
        axes_n = tuple(range(x.type.rank)) if axes is None else normalize_axes(axes, x.type.rank)
        out = reshape(b, out, [d for k, d in enumerate(x.shape) if k not in axes_n])
    return out


# --- normalisations -----------------------------------------------------------------------------


def softmax(b, x, axis: int = -1):
    """Softmax along one axis: reduce_max -> sub -> exp -> reduce_sum -> div."""
    ax = (normalize_axis(axis, x.type.rank),)
    m = b.reduce_max(x, axes=ax, keepdims=True)
    e = b.exp(b.sub(x, m))
    return b.div(e, b.reduce_sum(e, axes=ax, keepdims=True))


def log_softmax(b, x, axis: int = -1):
    """Log-softmax along one axis: reduce_max -> sub -> exp -> reduce_sum -> log -> sub."""
    ax = (normalize_axis(axis, x.type.rank),)
    m = b.reduce_max(x, axes=ax, keepdims=True)
    d = b.sub(x, m)
    return b.sub(d, b.log(b.reduce_sum(b.exp(d), axes=ax, keepdims=True)))


def coerced_2d(b, x, axis: int, fn):
    """Apply ``fn(b, x2d, 1)`` to ``x`` flattened to 2-D at ``axis`` (ONNX opset < 13 softmax)."""
    r = x.type.rank
    ax = r if axis == r else (normalize_axis(axis, r) if r else 0)
    shape2 = (prod(x.shape[:ax]), prod(x.shape[ax:]))
    return reshape(b, fn(b, reshape(b, x, shape2), 1), x.shape)


def layer_norm(b, x, scale, bias=None, axis: int = -1, eps: float = 1e-5,
               stash_dtype: str | None = "float32"):
    """LayerNormalization over dims ``axis..rank-1``; returns ``(y, mean, inv_std_dev)``.

    Statistics are computed in ``stash_dtype`` (ONNX ``stash_type``; None = x's dtype) and are
    returned in that dtype with the normalised dims kept as size 1; ``y`` has x's dtype.
    """
    rank = x.type.rank
    ax = normalize_axis(axis, rank)
    axes = tuple(range(ax, rank))
    xs = cast(b, x, stash_dtype or x.dtype)
    mean = reduce_mean(b, xs, axes, True)
    d = b.sub(xs, mean)
    var = reduce_mean(b, b.mul(d, d), axes, True)
    inv = b.reciprocal(b.sqrt(b.add(var, scalar(b, eps, xs.dtype))))
    y = cast(b, b.mul(d, inv), x.dtype)
    y = b.mul(y, scale)
    if bias is not None:
        y = b.add(y, bias)
    return y, mean, inv


def _channel_shape(x, v):
    """Reshape target that aligns a per-channel vector with axis 1 of ``x``."""
    return (1, v.shape[0]) + (1,) * (x.type.rank - 2) if x.type.rank >= 2 else v.shape


def batch_norm_inference(b, x, scale, bias, mean, var, eps: float = 1e-5):
    """BatchNormalization with running statistics: (x - mean) / sqrt(var + eps) * scale + bias."""
    for name, v in (("scale", scale), ("bias", bias), ("mean", mean), ("var", var)):
        if v.type.rank != 1 or x.type.rank < 2 or v.shape[0] != x.shape[1]:
            raise ShapeError(f"batch norm {name} has shape {v.shape}, expected ({x.shape[1] if x.type.rank > 1 else '?'},)")
    cs = _channel_shape(x, scale)
    inv = b.rsqrt(b.add(reshape(b, var, cs), scalar(b, eps, var.dtype)))
    y = b.mul(b.sub(x, reshape(b, mean, cs)), b.mul(inv, reshape(b, scale, cs)))
    return b.add(y, reshape(b, bias, cs))


def instance_norm(b, x, scale, bias, eps: float = 1e-5):
    """InstanceNormalization: per (n, c) normalisation over spatial dims, then scale and bias."""
    axes = tuple(range(2, x.type.rank))
    mean = reduce_mean(b, x, axes, True)
    d = b.sub(x, mean)
    var = reduce_mean(b, b.mul(d, d), axes, True)
    y = b.mul(d, b.rsqrt(b.add(var, scalar(b, eps, x.dtype))))
    cs = _channel_shape(x, scale)
    return b.add(b.mul(y, reshape(b, scale, cs)), reshape(b, bias, cs))


def mean_variance_norm(b, x, axes=(0, 2, 3)):
    """MeanVarianceNormalization: (x - E[x]) / (sqrt(E[x^2] - E[x]^2) + 1e-9)."""
    mean = reduce_mean(b, x, axes, True)
    var = b.sub(reduce_mean(b, b.mul(x, x), axes, True), b.mul(mean, mean))
    std = b.add(b.sqrt(var), scalar(b, 1e-9, x.dtype))
    return b.div(b.sub(x, mean), std)


def group_norm(b, x, scale, bias, num_groups: int, eps: float = 1e-5, per_channel: bool = True,
               stash_dtype: str | None = None):
    """GroupNormalization: normalise each of ``num_groups`` channel groups over (C/G, spatial...).

    ``per_channel`` scale/bias have shape (C,) (ONNX opset >= 21); otherwise (G,) (opset 18).
    Statistics are computed in ``stash_dtype`` (None = x's dtype).
    """
    n, c = x.shape[0], x.shape[1]
    if num_groups <= 0 or c % num_groups:
        raise ShapeError(f"{c} channels do not split into {num_groups} groups")
    rest = x.shape[2:]
    g = reshape(b, cast(b, x, stash_dtype or x.dtype), (n, num_groups, c // num_groups) + tuple(rest))
    axes = tuple(range(2, g.type.rank))
    mean = reduce_mean(b, g, axes, True)
    d = b.sub(g, mean)
    var = reduce_mean(b, b.mul(d, d), axes, True)
    y = b.mul(d, b.rsqrt(b.add(var, scalar(b, eps, g.dtype))))
    if per_channel:
        y = cast(b, reshape(b, y, x.shape), x.dtype)
        cs = (1, c) + (1,) * len(rest)
    else:
        y = cast(b, y, x.dtype)
        cs = (1, num_groups) + (1,) * (len(rest) + 1)
    y = b.add(b.mul(y, reshape(b, scale, cs)), reshape(b, bias, cs))
    return reshape(b, y, x.shape)


def lp_normalize(b, x, axis: int = -1, p: int = 2):
    """x / ||x||_p along ``axis`` (p = 1 or 2); 0 where the norm is 0."""
    ax = (normalize_axis(axis, x.type.rank),)
    if p == 1:
        norm = reduce_l1(b, x, ax, True)
    elif p == 2:
        norm = reduce_l2(b, x, ax, True)
    else:
        raise ShapeError(f"Lp normalisation supports p = 1 or 2, got {p}")
    zero = scalar(b, 0, x.dtype)
    is_zero = b.eq(norm, zero)
    safe = b.where(is_zero, scalar(b, 1, x.dtype), norm)
    return b.where(is_zero, zero, b.div(x, safe))


def lrn(b, x, size: int, alpha: float = 1e-4, beta: float = 0.75, bias: float = 1.0):
    """Local response normalisation across channels (axis 1): x / (bias + alpha/size * sum x^2)^beta.

    The channel window sum is a window_reduce over (C, spatial...) with a (size, 1, ...) kernel.
    """
    if x.type.rank < 3:
        raise ShapeError(f"LRN needs an input of rank >= 3 (N, C, ...), got {x.shape}")
    nsp = x.type.rank - 1
    lo, hi = (size - 1) // 2, -(-(size - 1) // 2)
    sq = b.mul(x, x)
    s = b.window_reduce(sq, reducer="sum", kernel=(size,) + (1,) * (nsp - 1), strides=(1,) * nsp,
                        pads=(lo,) + (0,) * (nsp - 1) + (hi,) + (0,) * (nsp - 1), dilations=(1,) * nsp)
    dt = x.dtype
    base = b.add(scalar(b, bias, dt), b.mul(s, scalar(b, alpha / size, dt)))
    return b.div(x, b.pow(base, scalar(b, beta, dt)))


# --- activations ---------------------------------------------------------------------------------


def gelu(b, x, approximate: str = "none"):
    """GELU: 0.5 x (1 + erf(x / sqrt 2)), or the tanh approximation when approximate='tanh'."""
    dt = x.dtype
    half = scalar(b, 0.5, dt)
    one = scalar(b, 1.0, dt)
    if approximate == "tanh":
        inner = b.add(x, b.mul(scalar(b, 0.044715, dt), b.mul(b.mul(x, x), x)))
        t = b.tanh(b.mul(scalar(b, math.sqrt(2.0 / math.pi), dt), inner))
    elif approximate == "none":
        t = b.erf(b.mul(x, scalar(b, 1.0 / math.sqrt(2.0), dt)))
    else:
        raise ShapeError(f"gelu approximate must be 'none' or 'tanh', got {approximate!r}")
    return b.mul(b.mul(half, x), b.add(one, t))


def clip(b, x, lo=None, hi=None):
    """Clip to [lo, hi] (either may be None): max with lo, then min with hi."""
    if lo is not None:
        x = b.max(x, lo)
    if hi is not None:
        x = b.min(x, hi)
    return x


def hard_sigmoid(b, x, alpha: float = 0.2, beta: float = 0.5):
    """max(0, min(1, alpha x + beta))."""
    dt = x.dtype
    y = b.add(b.mul(x, scalar(b, alpha, dt)), scalar(b, beta, dt))
    return clip(b, y, scalar(b, 0, dt), scalar(b, 1, dt))


def hard_swish(b, x):
    """x * hard_sigmoid(x, 1/6, 0.5)."""
    return b.mul(x, hard_sigmoid(b, x, 1.0 / 6.0, 0.5))


def leaky_relu(b, x, alpha: float = 0.01):
    """x where x >= 0, alpha x elsewhere."""
    zero = scalar(b, 0, x.dtype)
    return b.where(b.lt(x, zero), b.mul(x, scalar(b, alpha, x.dtype)), x)


def prelu(b, x, slope):
    """x where x >= 0, slope * x elsewhere (slope broadcasts to x)."""
    return b.where(b.lt(x, scalar(b, 0, x.dtype)), b.mul(x, slope), x)


def thresholded_relu(b, x, alpha: float = 1.0):
    """x where x > alpha, 0 elsewhere."""
    return b.where(b.gt(x, scalar(b, alpha, x.dtype)), x, scalar(b, 0, x.dtype))


def elu(b, x, alpha: float = 1.0):
    """x where x > 0, alpha (exp(x) - 1) elsewhere."""
    dt = x.dtype
    neg = b.mul(b.sub(b.exp(x), scalar(b, 1, dt)), scalar(b, alpha, dt))
    return b.where(b.gt(x, scalar(b, 0, dt)), x, neg)


def selu(b, x, alpha: float = 1.67326319217681884765625, gamma: float = 1.05070102214813232421875):
    """gamma * (x where x > 0, alpha (exp(x) - 1) elsewhere)."""
    return b.mul(elu(b, x, alpha), scalar(b, gamma, x.dtype))


def celu(b, x, alpha: float = 1.0):
    """max(0, x) + min(0, alpha (exp(x / alpha) - 1))."""
    dt = x.dtype
    zero = scalar(b, 0, dt)
    e = b.mul(b.sub(b.exp(b.div(x, scalar(b, alpha, dt))), scalar(b, 1, dt)), scalar(b, alpha, dt))
    return b.add(b.max(x, zero), b.min(e, zero))


def softplus(b, x):
    """log(1 + exp(x)), computed stably as relu(x) + log(1 + exp(-|x|))."""
    one = scalar(b, 1, x.dtype)
    return b.add(b.relu(x), b.log(b.add(one, b.exp(b.neg(b.abs(x))))))


def softsign(b, x):
    """x / (1 + |x|)."""
    return b.div(x, b.add(scalar(b, 1, x.dtype), b.abs(x)))


def mish(b, x):
    """x * tanh(softplus(x))."""
    return b.mul(x, b.tanh(softplus(b, x)))


def sign(b, x):
    """-1, 0 or 1 by the sign of x (0 for nan-free zero)."""
    dt = x.dtype
    zero = scalar(b, 0, dt)
    pos = b.where(b.gt(x, zero), scalar(b, 1, dt), zero)
    return b.where(b.lt(x, zero), scalar(b, -1, dt), pos)


def shrink(b, x, lambd: float = 0.5, bias: float = 0.0):
    """x + bias where x < -lambd, x - bias where x > lambd, 0 elsewhere."""
    dt = x.dtype
    lo = b.where(b.lt(x, scalar(b, -lambd, dt)), b.add(x, scalar(b, bias, dt)), scalar(b, 0, dt))
    return b.where(b.gt(x, scalar(b, lambd, dt)), b.sub(x, scalar(b, bias, dt)), lo)


# --- linear algebra -----------------------------------------------------------------------------


def gemm(b, a, b_, c=None, alpha: float = 1.0, beta: float = 1.0, trans_a: bool = False,
         trans_b: bool = False):
    """alpha * op(a) @ op(b_) + beta * c, op = optional transpose of a 2-D operand."""
    if a.type.rank != 2 or b_.type.rank != 2:
        raise ShapeError(f"gemm needs 2-D operands, got {a.shape} and {b_.shape}")
    if trans_a:
        a = b.transpose(a, perm=(1, 0))
    if trans_b:
        b_ = b.transpose(b_, perm=(1, 0))
    y = b.matmul(a, b_)
    if alpha != 1.0:
        y = b.mul(y, scalar(b, alpha, y.dtype))
    if c is not None and beta != 0.0:
        if beta != 1.0:
            c = b.mul(c, scalar(b, beta, c.dtype))
        y = b.add(y, c)
    return y


# --- pooling ------------------------------------------------------------------------------------


def pool_pads(in_spatial, kernel, strides, pads, dilations, ceil_mode: bool) -> tuple[int, ...]:
    """End-padded pads (begins..., ends...) such that floor-mode windows give ``ceil_mode``'s output.

    In ceil mode a last window that would start inside the end padding is dropped (ONNX and
    PyTorch semantics).
    """
    n = len(kernel)
    pads = list(pads)
    if not ceil_mode:
        return tuple(pads)
    for s in range(n):
        eff = dilations[s] * (kernel[s] - 1) + 1
        size = in_spatial[s] + pads[s] + pads[n + s]
        out = -(-(size - eff) // strides[s]) + 1
        if (out - 1) * strides[s] >= in_spatial[s] + pads[s]:
            out -= 1
        need = (out - 1) * strides[s] + eff - size
        pads[n + s] += max(need, 0)
    return tuple(pads)


def max_pool(b, x, kernel, strides=None, pads=None, dilations=None, ceil_mode: bool = False):
    """Max pooling over the trailing ``len(kernel)`` dims (window_reduce max; pads are -inf)."""
    n = len(kernel)
    strides = tuple(strides or (1,) * n)
    dilations = tuple(dilations or (1,) * n)
    pads = pool_pads(x.shape[-n:], kernel, strides, tuple(pads or (0,) * 2 * n), dilations, ceil_mode)
    return b.window_reduce(x, reducer="max", kernel=tuple(kernel), strides=strides, pads=pads,
                           dilations=dilations)


def avg_pool(b, x, kernel, strides=None, pads=None, dilations=None, ceil_mode: bool = False,
             count_include_pad: bool = False):
    """Average pooling: window_reduce sum times a constant tensor of reciprocal window counts.

    With ``count_include_pad`` the explicit pads count towards the divisor; the extra end
    padding that ``ceil_mode`` adds never does.
    """
    from .registry import get_op

    n = len(kernel)
    strides = tuple(strides or (1,) * n)
    dilations = tuple(dilations or (1,) * n)
    pads = tuple(pads or (0,) * 2 * n)
    full = pool_pads(x.shape[-n:], kernel, strides, pads, dilations, ceil_mode)
    attrs = dict(reducer="sum", kernel=tuple(kernel), strides=strides, dilations=dilations)
    s = b.window_reduce(x, pads=full, **attrs)
    spatial = tuple(x.shape[-n:])
    if count_include_pad:
        ones = np.ones(tuple(spatial[k] + pads[k] + pads[n + k] for k in range(n)), np.float64)
        extra = tuple(0 for _ in range(n)) + tuple(full[n + k] - pads[n + k] for k in range(n))
        counts = get_op("window_reduce").reference([ones], dict(attrs, pads=extra))[0]
    else:
        counts = get_op("window_reduce").reference([np.ones(spatial, np.float64)], dict(attrs, pads=full))[0]
    with np.errstate(divide="ignore"):
        recip = (1.0 / counts).astype(np_dtype(x.dtype))
    return b.mul(s, b.constant(recip))


def global_average_pool(b, x):
    """Mean over every dim after the first two, keeping them as size 1."""
    return reduce_mean(b, x, tuple(range(2, x.type.rank)), True)


def global_max_pool(b, x):
    """Max over every dim after the first two, keeping them as size 1."""
    return reduce(b, "max", x, tuple(range(2, x.type.rank)), True)


# --- shape manipulation -------------------------------------------------------------------------


def flatten(b, x, axis: int = 1):
    """Reshape to 2-D: (prod(shape[:axis]), prod(shape[axis:])); axis may equal the rank."""
    r = x.type.rank
    if not -r <= axis <= r:
        raise ShapeError(f"flatten axis {axis} out of range for rank {r}")
    axis = axis % r if axis < 0 else axis
    return reshape(b, x, (prod(x.shape[:axis]), prod(x.shape[axis:])))


def squeeze(b, x, axes=None):
    """Drop size-1 dims (``axes``, or every size-1 dim when None)."""
    if axes is None:
        axes = tuple(k for k, d in enumerate(x.shape) if d == 1)
    axes = normalize_axes(axes, x.type.rank)
    for a in axes:
        if x.shape[a] != 1:
            raise ShapeError(f"cannot squeeze axis {a} of size {x.shape[a]} (shape {x.shape})")
    return reshape(b, x, [d for k, d in enumerate(x.shape) if k not in axes])


def unsqueeze(b, x, axes):
    """Insert size-1 dims at ``axes`` (positions in the output, negative counted from its end)."""
    out_rank = x.type.rank + len(axes)
    axes = normalize_axes(axes, out_rank)
    it = iter(x.shape)
    return reshape(b, x, [1 if k in axes else next(it) for k in range(out_rank)])


def expand(b, x, shape):
    """Bidirectional broadcast of ``x`` with ``shape`` (ONNX Expand)."""
    try:
        out = tuple(np.broadcast_shapes(tuple(x.shape), tuple(int(d) for d in shape)))
    except ValueError:
        raise ShapeError(f"cannot expand shape {x.shape} to {tuple(shape)}") from None
    if out == x.shape:
        return x
    return b.broadcast_to(x, shape=out)


def split(b, x, sizes: Sequence[int], axis: int = 0):
    """Split along ``axis`` into pieces of ``sizes`` (which must sum to the dim)."""
    ax = normalize_axis(axis, x.type.rank)
    if sum(sizes) != x.shape[ax] or any(s < 0 for s in sizes):
        raise ShapeError(f"split sizes {list(sizes)} do not add up to dim {ax} of shape {x.shape}")
    outs, start = [], 0
    for s in sizes:
        outs.append(slice_(b, x, [start], [start + s], [ax]))
        start += s
    return outs


def even_split_sizes(dim: int, n: int) -> list[int]:
    """ONNX split sizes for ``n`` outputs: ceil(dim / n) each, the last one smaller if needed."""
    if n <= 0:
        raise ShapeError(f"cannot split into {n} outputs")
    chunk = -(-dim // n)
    sizes = [min(chunk, max(dim - k * chunk, 0)) for k in range(n)]
    return sizes


def slice_(b, x, starts, ends, axes=None, steps=None):
    """ONNX Slice semantics (negative indices, clamping, negative steps) on static values."""
    rank = x.type.rank
    axes = list(range(len(starts))) if axes is None else [normalize_axis(a, rank) for a in axes]
    steps = [1] * len(starts) if steps is None else list(steps)
    if not len(starts) == len(ends) == len(axes) == len(steps):
        raise ShapeError(f"slice starts/ends/axes/steps differ in length: {len(starts)}, {len(ends)}, "
                         f"{len(axes)}, {len(steps)}")
    if len(set(axes)) != len(axes):
        raise ShapeError(f"slice repeats an axis: {axes}")
    full_s = [0] * rank
    full_e = list(x.shape)
    full_st = [1] * rank
    for a, s, e, st in zip(axes, starts, ends, steps):
        d = x.shape[a]
        s, e, st = int(s), int(e), int(st)
        if st == 0:
            raise ShapeError("slice step must not be 0")
        s = s + d if s < 0 else s
        e = e + d if e < 0 else e
        if st > 0:
            s, e = min(max(s, 0), d), min(max(e, 0), d)
        else:
            s, e = min(max(s, 0), d - 1), min(max(e, -1), d - 1)
        full_s[a], full_e[a], full_st[a] = s, e, st
    if full_s == [0] * rank and full_e == list(x.shape) and full_st == [1] * rank:
        return x
    return b.slice(x, starts=tuple(full_s), ends=tuple(full_e), steps=tuple(full_st))


def tile(b, x, repeats: Sequence[int]):
    """Tile: reshape to interleave unit dims, broadcast them to ``repeats``, reshape back."""
    if len(repeats) != x.type.rank:
        raise ShapeError(f"tile needs {x.type.rank} repeats, got {len(repeats)}")
    reps = [int(r) for r in repeats]
    if any(r < 0 for r in reps):
        raise ShapeError(f"tile repeats must be non-negative, got {reps}")
    if all(r == 1 for r in reps):
        return x
    inter = [v for d in x.shape for v in (1, d)]
    big = [v for r, d in zip(reps, x.shape) for v in (r, d)]
    y = b.broadcast_to(reshape(b, x, inter), shape=tuple(big))
    return reshape(b, y, [r * d for r, d in zip(reps, x.shape)])


def trilu(b, x, k: int = 0, upper: bool = True):
    """Keep the upper (j - i >= k) or lower (j - i <= k) triangle of the last two dims, zero the rest."""
    if x.type.rank < 2:
        raise ShapeError(f"trilu needs rank >= 2, got {x.shape}")
    rows, cols = x.shape[-2:]
    i = b.iota(shape=(rows, cols), axis=0, dtype="int64")
    j = b.iota(shape=(rows, cols), axis=1, dtype="int64")
    diff = b.sub(j, i)
    keep = b.ge(diff, scalar(b, k, "int64")) if upper else b.le(diff, scalar(b, k, "int64"))
    zero = scalar(b, False if x.dtype == "bool" else 0, x.dtype)
    return b.where(keep, x, zero)


# --- variadic -----------------------------------------------------------------------------------


def variadic(b, op: str, xs):
    """Fold binary primitive ``op`` (add/max/min/...) over ``xs`` left to right, broadcasting."""
    if not xs:
        raise ShapeError(f"variadic {op} needs at least one input")
    y = xs[0]
    for x in xs[1:]:
        y = b.op(op, y, x)[0]
    return y


def mean(b, xs):
    """Elementwise mean of ``xs`` (broadcasting)."""
    s = variadic(b, "add", xs)
    return b.div(s, scalar(b, len(xs), s.dtype)) if len(xs) > 1 else s
