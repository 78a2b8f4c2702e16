"""Primitives that only training needs: ``scatter_add``, the transpose of ``gather``.

Importing this module registers them (once).  ``scatter_add(data, indices, updates; axis)``
returns a copy of ``data`` where, for every index position ``j`` of ``indices``, the slab
``updates[..., j..., ...]`` is added at ``data[..., indices[j], ...]`` along ``axis``; repeated
indices accumulate (``np.add.at``) and negative indices wrap, as in ``gather``.  So
``scatter_add(zeros, idx, g)`` is the vector-Jacobian product of ``gather(x, idx)``.
"""
from __future__ import annotations

import numpy as np

from ..errors import ShapeError
from ..ir.types import INT_DTYPES
from ..ops.registry import DATA_DEPENDENT, REQUIRED, OpDef, has_op, register


def _scatter_add_infer(ins, a):
    data, idx, upd = ins
    if idx.dtype not in INT_DTYPES:
        raise ShapeError(f"scatter_add indices must be int32/int64, got {idx.dtype}")
    if upd.dtype != data.dtype:
        raise ShapeError(f"updates dtype {upd.dtype} differs from data dtype {data.dtype}")
    ax = a["axis"]
    if not 0 <= ax < data.rank:
        raise ShapeError(f"axis {ax} out of range for rank {data.rank}")
    want = data.shape[:ax] + idx.shape + data.shape[ax + 1:]
    if upd.shape != want:
        raise ShapeError(f"updates have shape {upd.shape}; data {data.shape} with indices "
                         f"{idx.shape} on axis {ax} needs {want}")
    return [data]


def _scatter_add_ref(xs, a):
    data, idx, upd = xs
    ax = a["axis"]
    n = data.shape[ax]
    if np.any((idx < -n) | (idx >= n)):
        raise ShapeError(f"scatter_add index out of range [-{n}, {n})")
    flat = np.where(idx < 0, idx + n, idx).reshape(-1)
    pre = int(np.prod(data.shape[:ax], dtype=np.int64))
    post = int(np.prod(data.shape[ax + 1:], dtype=np.int64))
    out = np.array(data, copy=True).reshape(pre, n, post)
    np.add.at(out, (slice(None), flat), upd.reshape(pre, flat.size, post))
    return [out.reshape(data.shape)]


if not has_op("scatter_add"):
    register(OpDef("scatter_add", DATA_DEPENDENT, _scatter_add_infer, _scatter_add_ref, arity=(3, 3),
                   attrs={"axis": REQUIRED},
                   doc="data + updates added at gather positions along `axis` (transpose of gather)"))
