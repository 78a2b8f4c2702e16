"""Resize (nearest / linear / cubic, ONNX coordinate modes) as separable per-axis primitives.

Interpolation is separable and, for fixed shapes, linear in the data: each resized axis is one
constant (out x in) weight matrix computed here with numpy, applied as a ``matmul`` with the
axis moved last (linear, cubic) or as a ``gather`` of constant indices (nearest, exact).  The
weights follow the ONNX reference (edge-replicated neighbours, ``exclude_outside``,
``tf_crop_and_resize`` extrapolation).  Antialiasing is not implemented.
"""
from __future__ import annotations

import math

import numpy as np

from ..errors import ShapeError
from ..ir.types import FLOAT_DTYPES


def _source_coords(mode: str, out_len: int, in_len: int, scale: float, roi=None):
    """Source coordinate of every output index, and a mask of extrapolated positions."""
    y = np.arange(out_len, dtype=np.float64)
    out_w = scale * in_len
    extra = np.zeros(out_len, bool)
    if mode == "align_corners":
        x = np.zeros(out_len) if out_w == 1 else y * (in_len - 1) / (out_w - 1)
    elif mode == "asymmetric":
        x = y / scale
    elif mode == "tf_crop_and_resize":
        lo, hi = roi
        x = (np.full(out_len, (hi - lo) * (in_len - 1) / 2) if out_w == 1
             else y * (hi - lo) * (in_len - 1) / (out_w - 1))
        x = x + lo * (in_len - 1)
        extra = (x < 0) | (x > in_len - 1)
    elif mode == "pytorch_half_pixel":
        x = np.full(out_len, -0.5) if out_w == 1 else (y + 0.5) / scale - 0.5
    elif mode == "tf_half_pixel_for_nn":     # opset 11 only
        x = (y + 0.5) / scale
    elif mode == "half_pixel":
        x = (y + 0.5) / scale - 0.5
    elif mode == "half_pixel_symmetric":
        offset = in_len / 2 * (1 - out_len / out_w)
        x = offset + (y + 0.5) / scale - 0.5
    else:
        raise ShapeError(f"unknown coordinate_transformation_mode {mode!r}")
    return x, extra


def _coeffs(kind: str, ratio: float, nearest_mode: str, a: float) -> np.ndarray:
    if kind == "nearest":
        if float(ratio).is_integer():
            return np.array([0.0, 1.0])
        pick = {"round_prefer_floor": ratio > 0.5, "round_prefer_ceil": ratio >= 0.5,
                "floor": False, "ceil": True}
        if nearest_mode not in pick:
            raise ShapeError(f"unknown nearest_mode {nearest_mode!r}")
        return np.array([0.0, 1.0]) if pick[nearest_mode] else np.array([1.0, 0.0])
    if kind == "linear":
        return np.array([1 - ratio, ratio])
    if kind == "cubic":
        r, s = ratio, 1 - ratio
        return np.array([((a * (r + 1) - 5 * a) * (r + 1) + 8 * a) * (r + 1) - 4 * a,
                         ((a + 2) * r - (a + 3)) * r * r + 1,
                         ((a + 2) * s - (a + 3)) * s * s + 1,
                         ((a * (s + 1) - 5 * a) * (s + 1) + 8 * a) * (s + 1) - 4 * a])
    raise ShapeError(f"unknown resize mode {kind!r}")


def resize_weights(kind: str, in_len: int, out_len: int, scale: float, coord_mode: str,
                   nearest_mode: str = "round_prefer_floor", cubic_a: float = -0.75,
                   exclude_outside: bool = False, roi=None) -> tuple[np.ndarray, np.ndarray]:
    """(W, extrapolated): W[j, i] is the weight of input i in output j (float64)."""
    xs, extra = _source_coords(coord_mode, out_len, in_len, scale, roi)
    w = np.zeros((out_len, in_len))
    for j, x in enumerate(xs):
        if extra[j]:
            continue
        base = math.floor(x) if not float(x).is_integer() else int(x) - 1
        ratio = 1.0 if float(x).is_integer() else x - math.floor(x)
        c = _coeffs(kind, ratio, nearest_mode, cubic_a)
        n = len(c)
        idx = np.arange(n) + base - (n // 2 - 1)
        if exclude_outside:
            c = np.where((idx < 0) | (idx >= in_len), 0.0, c)
            c = c / c.sum()
        for k, i in enumerate(np.clip(idx, 0, in_len - 1)):
            w[j, i] += c[k]
    return w, extra


def resize(b, x, out_shape, scales, kind: str = "nearest", coord_mode: str = "half_pixel",
           nearest_mode: str = "round_prefer_floor", cubic_a: float = -0.75,
           exclude_outside: bool = False, roi=None, extrapolation_value: float = 0.0):
    """Resize ``x`` to ``out_shape`` (one scale per dim; ``roi`` = starts + ends per dim or None).

    ``nearest_mode`` is an ONNX nearest mode, or "simple" (opset < 11: floor when upsampling,
    ceil when downsampling, per axis).
    """
    if len(out_shape) != x.type.rank or len(scales) != x.type.rank:
        raise ShapeError(f"resize needs one size and scale per dim of {x.shape}")
    if kind != "nearest" and x.dtype not in FLOAT_DTYPES:
        raise ShapeError(f"{kind} resize needs a float input, got {x.dtype}")
    r = x.type.rank
    direct = _direct(b, x, out_shape, scales, kind, coord_mode, nearest_mode, cubic_a, exclude_outside, roi)
    if direct is not None:
        return direct
    y = x
    for ax in range(r):
        n_in, n_out = x.shape[ax], int(out_shape[ax])
        if _identity(x, out_shape, scales, roi, ax):
            continue
        if n_in == 0 or n_out == 0:
            raise ShapeError(f"cannot resize dim {ax} from {n_in} to {n_out}")
        w, extra = _axis_weights(kind, x, out_shape, scales, roi, ax, coord_mode, nearest_mode, cubic_a,
                                 exclude_outside)
        if kind == "nearest" and not extra.any():
            y = b.gather(y, b.constant(w.argmax(axis=1).astype(np.int64)), axis=ax)
            continue
        perm = None
        if ax != r - 1:
            perm = tuple(k for k in range(r) if k != ax) + (ax,)
            y = b.transpose(y, perm=perm)
        y = b.matmul(y, b.constant(w.T.astype(np.dtype(x.dtype))))
        if extra.any():
            e = np.where(extra, extrapolation_value, 0.0).astype(np.dtype(x.dtype))
            y = b.add(y, b.constant(e))
        if perm is not None:
            y = b.transpose(y, perm=tuple(int(p) for p in np.argsort(perm)))
    return y


def _direct(b, x, out_shape, scales, kind, coord_mode, nearest_mode, cubic_a, exclude_outside, roi):
    """The ``resize2d`` node (ops/resize2d.py: one direct kernel) of a linear or nearest resize
    of the two trailing axes of a float NCHW tensor with nothing extrapolated, or None (the
    per-axis matmul / gather form below then runs it)."""
    from . import resize2d
    if not resize2d.ENABLED or x.type.rank != 4 or kind not in ("linear", "nearest") \
            or x.dtype not in resize2d.DTYPES:
        return None
    if not (_identity(x, out_shape, scales, roi, 0) and _identity(x, out_shape, scales, roi, 1)):
        return None
    taps = 2 if kind == "linear" else 1
    tables = []
    for ax in (2, 3):
        n_in, n_out = x.shape[ax], int(out_shape[ax])
        if n_in == 0 or n_out == 0:
            return None
        if _identity(x, out_shape, scales, roi, ax):
            w, extra = np.eye(n_in), np.zeros(n_in, bool)
        else:
            w, extra = _axis_weights(kind, x, out_shape, scales, roi, ax, coord_mode, nearest_mode, cubic_a,
                                     exclude_outside)
        tab = None if extra.any() else resize2d.tap_tables(w, taps, x.dtype)
        if tab is None:
            return None
        tables += [b.constant(tab[0]), b.constant(tab[1])]
    return b.op("resize2d", x, *tables, taps=taps)[0]


def _axis_roi(roi, r: int, ax: int):
    return None if roi is None else (float(roi[ax]), float(roi[r + ax]))


def _identity(x, out_shape, scales, roi, ax: int) -> bool:
    """Whether axis ``ax`` keeps its length at scale 1 over the whole roi (nothing to resize)."""
    return (int(out_shape[ax]) == x.shape[ax] and math.isclose(float(scales[ax]), 1.0)
            and _axis_roi(roi, x.type.rank, ax) in (None, (0.0, 1.0)))


def _axis_weights(kind, x, out_shape, scales, roi, ax: int, coord_mode, nearest_mode, cubic_a, exclude_outside):
    """:func:`resize_weights` of axis ``ax`` (``[out, in]`` weights, extrapolated rows)."""
    s = float(scales[ax])
    nm = nearest_mode
    if nm == "simple":  # opset < 11: truncate when upsampling, ceil when downsampling
        nm = "ceil" if s < 1 else "floor"
    return resize_weights(kind, x.shape[ax], int(out_shape[ax]), s, coord_mode, nm, cubic_a, exclude_outside,
                          _axis_roi(roi, x.type.rank, ax))
