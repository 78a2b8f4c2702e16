"""The ``resize2d`` primitive: a separable 1- or 2-tap resize of the two trailing axes of NCHW.

ops/compound_resize.py lowers a Resize to one constant (out x in) weight matrix per resized axis,
applied as a matmul with the axis moved last.  On U-Net's bilinear upsample that was 2 matmuls
and 4 transposes (0.38 ms against onnxruntime's 0.08).  Every row of a linear (or nearest)
weight matrix has at most 2 (1) non-zero weights, so the same resize is

    out[p, oy, ox] = sum_a sum_b wy[a, oy] * wx[b, ox] * x[p, ty[a, oy], tx[b, ox]]

with ``ty, wy`` ``[taps, OH]`` and ``tx, wx`` ``[taps, OW]`` constant tables (inputs 1-4, made at
compile time from the weight matrices by :func:`tap_tables`).  codegen/resize.py runs it as one
kernel (layers/lowering.py ``_resize_step``): parallel over (plane, output row), a vector loop
along the output row.  ``taps`` = 1 is a nearest resize (a copy, exact).
"""
from __future__ import annotations

import numpy as np

from ..errors import ShapeError
from ..ir.types import TensorType
from .registry import DATA_DEPENDENT, REQUIRED, OpDef, register

#: switch for A/B runs in one process: off, compound_resize.py lowers every Resize as before
ENABLED = True
#: input dtypes the resize2d kernel computes in (the tables' weights have the same dtype)
DTYPES = ("float32", "float64")


def tap_tables(w: np.ndarray, taps: int, dtype: str):
    """``(idx [taps, out] int64, weight [taps, out] dtype)`` of weight matrix ``w`` ([out, in],
    compound_resize.resize_weights), or None when a row has more than ``taps`` non-zero
    weights (cubic) or, for ``taps`` = 1, a weight other than 1 (then it is not nearest)."""
    out_len = w.shape[0]
    idx = np.zeros((taps, out_len), np.int64)
    wt = np.zeros((taps, out_len), np.float64)
    for j in range(out_len):
        nz = np.flatnonzero(w[j])
        if len(nz) > taps or (taps == 1 and (len(nz) != 1 or w[j, nz[0]] != 1.0)):
            return None
        for k, i in enumerate(nz):
            idx[k, j], wt[k, j] = i, w[j, i]
        for k in range(len(nz), taps):      # a missing tap reads the first one with weight 0
            idx[k, j] = nz[0] if len(nz) else 0
    return idx, wt.astype(np.dtype(dtype))


def _infer(ins, a):
    x, ty, wy, tx, wx = ins
    taps = int(a["taps"])
    if x.rank != 4 or taps not in (1, 2):
        raise ShapeError(f"resize2d: needs an NCHW input and 1 or 2 taps, got {x.shape}, {taps}")
    if ty.rank != 2 or ty.shape[0] != taps or tx.rank != 2 or tx.shape[0] != taps \
            or tuple(wy.shape) != tuple(ty.shape) or tuple(wx.shape) != tuple(tx.shape):
        raise ShapeError(f"resize2d: tap tables {ty.shape} {wy.shape} {tx.shape} {wx.shape} "
                         f"are not [{taps}, OH] / [{taps}, OW]")
    if ty.dtype != "int64" or tx.dtype != "int64" or wy.dtype != x.dtype or wx.dtype != x.dtype:
        raise ShapeError("resize2d: int64 indices and weights of the input's dtype")
    return [TensorType((*x.shape[:2], ty.shape[1], tx.shape[1]), x.dtype)]


def _reference(xs, a):
    x, ty, wy, tx, wx = (np.asarray(v) for v in xs)
    taps = int(a["taps"])
    if taps == 1:
        return [x[:, :, ty[0], :][:, :, :, tx[0]]]
    rows = x[:, :, ty[0], :] * wy[0][:, None] + x[:, :, ty[1], :] * wy[1][:, None]
    return [(rows[..., tx[0]] * wx[0] + rows[..., tx[1]] * wx[1]).astype(x.dtype)]


register(OpDef("resize2d", DATA_DEPENDENT, _infer, _reference, arity=(5, 5), attrs={"taps": REQUIRED},
               doc="separable 1-/2-tap resize of the trailing two axes of NCHW from constant tap tables "
                   "(ops/resize2d.py)"))
