"""Index-producing and rearranging compound ops: argmax/argmin, hardmax, one-hot, cumulative sum,
depth/space rearrangement and rounding, as decompositions into primitives.

Same conventions as :mod:`apollo_py.ops.compound`: functions take a GraphBuilder ``b`` and
Values, shapes are static, ShapeError on inconsistent shapes.
"""
from __future__ import annotations

import numpy as np

from ..errors import ShapeError
from ..ir.types import FLOAT_DTYPES
from .compound import normalize_axis, reshape, scalar, slice_


def arg_reduce(b, x, axis: int = 0, keepdims: bool = True, select_last_index: bool = False,
               largest: bool = True):
    """Index (int64) of the max (``largest``) or min along ``axis``; first occurrence unless
    ``select_last_index``.  Built as: extremum -> equality mask -> iota -> min/max of masked iota.
    """
    ax = normalize_axis(axis, x.type.rank)
    n = x.shape[ax]
    if n == 0:
        raise ShapeError(f"arg{'max' if largest else 'min'} over an empty axis {ax} of {x.shape}")
    ext = b.op("reduce_max" if largest else "reduce_min", x, axes=(ax,), keepdims=True)[0]
    mask = b.eq(x, ext)
    idx = b.iota(shape=x.shape, axis=ax, dtype="int64")
    if select_last_index:
        out = b.reduce_max(b.where(mask, idx, scalar(b, -1, "int64")), axes=(ax,), keepdims=bool(keepdims))
    else:
        out = b.reduce_min(b.where(mask, idx, scalar(b, n, "int64")), axes=(ax,), keepdims=bool(keepdims))
    return out


def hardmax(b, x, axis: int = -1):
    """1 at the first maximum along ``axis``, 0 elsewhere (x's dtype)."""
    ax = normalize_axis(axis, x.type.rank)
    am = arg_reduce(b, x, ax, True)
    hit = b.eq(b.iota(shape=x.shape, axis=ax, dtype="int64"), am)
    return b.where(hit, scalar(b, 1, x.dtype), scalar(b, 0, x.dtype))


def one_hot(b, indices, depth: int, off, on, axis: int = -1):
    """One-hot along a new ``axis``: ``on`` where iota == index (negative indices wrap), else ``off``.

    ``off`` and ``on`` are rank-0 Values of the output dtype.  Out-of-range indices give a row
    of ``off``.
    """
    rank = indices.type.rank + 1
    ax = normalize_axis(axis, rank)
    idx = indices if indices.dtype == "int64" else b.cast(indices, to="int64")
    d = scalar(b, depth, "int64")
    idx = b.where(b.lt(idx, scalar(b, 0, "int64")), b.add(idx, d), idx)
    shape = list(indices.shape)
    shape.insert(ax, depth)
    expanded = reshape(b, idx, shape[:ax] + [1] + shape[ax + 1:])
    hit = b.eq(b.iota(shape=tuple(shape), axis=ax, dtype="int64"), expanded)
    return b.where(hit, on, off)


def cumsum(b, x, axis: int, exclusive: bool = False, reverse: bool = False):
    """Cumulative sum along ``axis`` as a matmul with a constant triangular 0/1 matrix.

    The axis is moved last, multiplied by T (T[i, j] = 1 where i contributes to j), moved back.
    """
    ax = normalize_axis(axis, x.type.rank)
    n = x.shape[ax]
    i = np.arange(n)[:, None]
    j = np.arange(n)[None, :]
    if reverse:
        tri = (i > j) if exclusive else (i >= j)
    else:
        tri = (i < j) if exclusive else (i <= j)
    dt = x.dtype
    y = x
    perm = None
    if ax != x.type.rank - 1:
        perm = tuple(k for k in range(x.type.rank) if k != ax) + (ax,)
        y = b.transpose(y, perm=perm)
    y = b.matmul(y, b.constant(tri.astype(np.dtype(dt))))
    if perm is not None:
        inv = tuple(int(p) for p in np.argsort(perm))
        y = b.transpose(y, perm=inv)
    return y


def depth_to_space(b, x, block: int, mode: str = "DCR"):
    """Rearrange (N, C, H, W) -> (N, C / block^2, H * block, W * block) in DCR or CRD order."""
    if x.type.rank != 4:
        raise ShapeError(f"depth_to_space needs a 4-D input, got {x.shape}")
    n, c, h, w = x.shape
    if c % (block * block):
        raise ShapeError(f"{c} channels are not divisible by blocksize^2 = {block * block}")
    oc = c // (block * block)
    if mode == "DCR":
        y = reshape(b, x, (n, block, block, oc, h, w))
        y = b.transpose(y, perm=(0, 3, 4, 1, 5, 2))
    elif mode == "CRD":
        y = reshape(b, x, (n, oc, block, block, h, w))
        y = b.transpose(y, perm=(0, 1, 4, 2, 5, 3))
    else:
        raise ShapeError(f"depth_to_space mode must be DCR or CRD, got {mode!r}")
    return reshape(b, y, (n, oc, h * block, w * block))


def space_to_depth(b, x, block: int, mode: str = "DCR"):
    """Rearrange (N, C, H, W) -> (N, C * block^2, H / block, W / block) (inverse of depth_to_space)."""
    if x.type.rank != 4:
        raise ShapeError(f"space_to_depth needs a 4-D input, got {x.shape}")
    n, c, h, w = x.shape
    if h % block or w % block:
        raise ShapeError(f"spatial dims {h}x{w} are not divisible by blocksize {block}")
    y = reshape(b, x, (n, c, h // block, block, w // block, block))
    if mode not in ("DCR", "CRD"):
        raise ShapeError(f"space_to_depth mode must be DCR or CRD, got {mode!r}")
    y = b.transpose(y, perm=(0, 3, 5, 1, 2, 4) if mode == "DCR" else (0, 1, 3, 5, 2, 4))
    return reshape(b, y, (n, c * block * block, h // block, w // block))


def round_half_even(b, x):
    """Round to the nearest integer, ties to even (numpy / ONNX Round)."""
    if x.dtype not in FLOAT_DTYPES:
        return x
    dt = x.dtype
    half = scalar(b, 0.5, dt)
    r = b.floor(b.add(x, half))
    tie = b.eq(b.sub(r, x), half)
    odd = b.ne(b.sub(r, b.mul(b.floor(b.mul(r, half)), scalar(b, 2, dt))), scalar(b, 0, dt))
    return b.where(b.logical_and(tie, odd), b.sub(r, scalar(b, 1, dt)), r)


def mod(b, x, y, fmod: bool = False):
    """ONNX Mod: remainder with the divisor's sign (Python %), or C fmod (dividend's sign).

    Integers use the truncating ``div``; floats compute x - trunc(x / y) * y.
    """
    if x.dtype in FLOAT_DTYPES:
        q = b.div(x, y)
        t = b.where(b.lt(q, scalar(b, 0, q.dtype)), b.ceil(q), b.floor(q))
        r = b.sub(x, b.mul(t, y))
    else:
        r = b.sub(x, b.mul(b.div(x, y), y))
    if fmod:
        return r
    zero = scalar(b, 0, r.dtype)
    wrong_sign = b.logical_and(b.ne(r, zero), b.ne(b.lt(r, zero), b.lt(y, zero)))
    return b.where(wrong_sign, b.add(r, y), r)


def _wrap(b, idx, n: int):
    """int64 indices with negative values wrapped by ``n``."""
    idx = idx if idx.dtype == "int64" else b.cast(idx, to="int64")
    return b.where(b.lt(idx, scalar(b, 0, "int64")), b.add(idx, scalar(b, n, "int64")), idx)


def _strides(shape) -> list[int]:
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= d
    return out[::-1]


def gather_elements(b, data, indices, axis: int = 0):
    """ONNX GatherElements: out[p] = data[p with p[axis] replaced by indices[p]].

    Built as a gather from the flattened data at linear offsets sum_k coord_k * stride_k, with
    coordinates from iota (and the indices on ``axis``).
    """
    r = data.type.rank
    ax = normalize_axis(axis, r)
    if indices.type.rank != r:
        raise ShapeError(f"indices of rank {indices.type.rank} for data of rank {r}")
    st = _strides(data.shape)
    lin = None
    for k in range(r):
        coord = _wrap(b, indices, data.shape[k]) if k == ax else b.iota(shape=indices.shape, axis=k, dtype="int64")
        term = b.mul(coord, scalar(b, st[k], "int64")) if st[k] != 1 else coord
        lin = term if lin is None else b.add(lin, term)
    flat = reshape(b, data, (data.type.size,))
    return b.gather(flat, lin, axis=0)


def gather_nd(b, data, indices, batch_dims: int = 0):
    """ONNX GatherND: index tuples in the last dim of ``indices`` select slices of ``data``."""
    q = indices.shape[-1] if indices.type.rank else 0
    bd = batch_dims
    if indices.type.rank < 1 or q > data.type.rank - bd or indices.shape[:bd] != data.shape[:bd]:
        raise ShapeError(f"GatherND indices {indices.shape} do not fit data {data.shape} with "
                         f"batch_dims={bd}")
    lead = indices.shape[:-1]
    rest = data.shape[bd + q:]
    st = _strides(data.shape[:bd + q])
    lin = scalar(b, 0, "int64")
    for k in range(bd):
        lin = b.add(lin, b.mul(b.iota(shape=lead, axis=k, dtype="int64"), scalar(b, st[k], "int64")))
    for j in range(q):
        col = slice_(b, indices, [j], [j + 1], [indices.type.rank - 1])
        col = reshape(b, _wrap(b, col, data.shape[bd + j]), lead)
        lin = b.add(lin, b.mul(col, scalar(b, st[bd + j], "int64")))
    lin = b.broadcast_to(lin, shape=lead) if lin.shape != tuple(lead) else lin
    flat = reshape(b, data, (int(np.prod(data.shape[:bd + q])),) + tuple(rest))
    return b.gather(flat, lin, axis=0)
