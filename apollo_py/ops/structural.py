"""Opaque primitives: reorganising ops, gather, and the compute-bound matmul and conv.

Their class is opaque by declaration (DESIGN §4): reorganising ops change layout, gather reads
data-dependent addresses, and matmul/conv are compute-bound (they may take an elementwise
epilogue by rule 6).
"""
from __future__ import annotations

from math import prod

import numpy as np

from ..errors import ShapeError
from ..ir.types import INT_DTYPES, TensorType
from .registry import COMPUTE_BOUND, DATA_DEPENDENT, REORGANIZE, REQUIRED, OpDef, register


def _reshape_infer(ins, a):
    shape = tuple(a["shape"])
    if any(d < 0 for d in shape) or prod(shape) != ins[0].size:
        raise ShapeError(f"cannot reshape {ins[0].shape} ({ins[0].size} elements) to {shape}")
    return [ins[0].with_shape(shape)]


register(OpDef("reshape", REORGANIZE, _reshape_infer,
               lambda xs, a: [np.reshape(xs[0], tuple(a["shape"]))], attrs={"shape": REQUIRED},
               doc="reshape to a static shape (row-major)"))


def _transpose_infer(ins, a):
    perm = tuple(a["perm"])
    if sorted(perm) != list(range(ins[0].rank)):
        raise ShapeError(f"perm {perm} is not a permutation of rank {ins[0].rank}")
    return [ins[0].with_shape(tuple(ins[0].shape[p] for p in perm))]


register(OpDef("transpose", REORGANIZE, _transpose_infer,
               lambda xs, a: [np.array(np.transpose(xs[0], tuple(a["perm"])), order="C")],
               attrs={"perm": REQUIRED}, doc="permute dimensions"))


def _slices(a):
    out = []
    for s, e, st in zip(a["starts"], a["ends"], a["steps"]):
        out.append(slice(s, None if e is not None and e < 0 else e, st))
    return tuple(out)


def _slice_infer(ins, a):
    t = ins[0]
    if not len(a["starts"]) == len(a["ends"]) == len(a["steps"]) == t.rank:
        raise ShapeError(f"slice needs starts/ends/steps for all {t.rank} dims")
    if any(st == 0 for st in a["steps"]):
        raise ShapeError("slice step 0")
    shape = tuple(len(range(*sl.indices(d))) for sl, d in zip(_slices(a), t.shape))
    return [t.with_shape(shape)]


register(OpDef("slice", REORGANIZE, _slice_infer, lambda xs, a: [xs[0][_slices(a)].copy()],
               attrs={"starts": REQUIRED, "ends": REQUIRED, "steps": REQUIRED},
               doc="strided slice; starts/ends/steps given for every dim, already clamped "
                   "(an end of -1 with a negative step means 'past index 0')"))


def _concat_infer(ins, a):
    r = ins[0].rank
    ax = a["axis"]
    if not 0 <= ax < r:
        raise ShapeError(f"axis {ax} out of range for rank {r}")
    if len({t.dtype for t in ins}) > 1:
        raise ShapeError(f"operand dtypes differ: {[t.dtype for t in ins]}")
    for t in ins:
        if t.rank != r or any(t.shape[k] != ins[0].shape[k] for k in range(r) if k != ax):
            raise ShapeError(f"shapes {[t.shape for t in ins]} do not concatenate on axis {ax}")
    shape = list(ins[0].shape)
    shape[ax] = sum(t.shape[ax] for t in ins)
    return [ins[0].with_shape(shape)]


register(OpDef("concat", REORGANIZE, _concat_infer,
               lambda xs, a: [np.concatenate(xs, axis=a["axis"])], arity=(1, None),
               attrs={"axis": REQUIRED}, doc="concatenate along a non-negative axis"))


def _pad_infer(ins, a):
    t = ins[0]
    p = tuple(a["pads"])
    if len(p) != 2 * t.rank:
        raise ShapeError(f"pads needs {2 * t.rank} values (begins then ends), got {len(p)}")
    if a["mode"] not in ("constant", "reflect", "edge", "wrap"):
        raise ShapeError(f"unknown pad mode {a['mode']!r}")
    shape = tuple(d + p[k] + p[t.rank + k] for k, d in enumerate(t.shape))
    if any(d < 0 for d in shape):
        raise ShapeError(f"pads {p} crop more than the shape {t.shape}")
    return [t.with_shape(shape)]


def _pad_ref(xs, a):
    x = xs[0]
    p = tuple(a["pads"])
    r = x.ndim
    crop = tuple(slice(max(-p[k], 0), x.shape[k] - max(-p[r + k], 0)) for k in range(r))
    x = x[crop]
    widths = [(max(p[k], 0), max(p[r + k], 0)) for k in range(r)]
    if a["mode"] == "constant":
        return [np.pad(x, widths, mode="constant", constant_values=np.array(a["value"]).astype(x.dtype))]
    return [np.pad(x, widths, mode=a["mode"])]


register(OpDef("pad", REORGANIZE, _pad_infer, _pad_ref,
               attrs={"pads": REQUIRED, "mode": "constant", "value": 0.0},
               doc="pad (begins..., ends...); negative pads crop"))


def _gather_infer(ins, a):
    data, idx = ins
    if idx.dtype not in INT_DTYPES:
        raise ShapeError(f"gather indices must be int32/int64, got {idx.dtype}")
    ax = a["axis"]
    if not 0 <= ax < data.rank:
        raise ShapeError(f"axis {ax} out of range for rank {data.rank}")
    return [data.with_shape(data.shape[:ax] + idx.shape + data.shape[ax + 1:])]


def _gather_ref(xs, a):
    data, idx = xs
    ax = a["axis"]
    # np.take's default mode checks the range and wraps negative indices itself: one call,
    # ~1 us for DLRM's lookups, where a separate range check and np.where cost several
    try:
        return [np.take(data, idx, axis=ax)]
    except IndexError:
        n = data.shape[ax]
        raise ShapeError(f"gather index out of range [-{n}, {n})") from None


register(OpDef("gather", DATA_DEPENDENT, _gather_infer, _gather_ref, arity=(2, 2),
               attrs={"axis": REQUIRED}, doc="numpy take along a non-negative axis (negative indices wrap)"))


def _matmul_infer(ins, a):
    x, y = ins
    if x.dtype != y.dtype:
        raise ShapeError(f"operand dtypes differ: {x.dtype} and {y.dtype}")
    if x.rank == 0 or y.rank == 0:
        raise ShapeError("matmul operands must have rank >= 1")
    xs = (1,) + x.shape if x.rank == 1 else x.shape
    ys = y.shape + (1,) if y.rank == 1 else y.shape
    if xs[-1] != ys[-2]:
        raise ShapeError(f"contracted dims differ: {x.shape} @ {y.shape}")
    batch = tuple(np.broadcast_shapes(xs[:-2], ys[:-2]))
    shape = batch + (xs[-2], ys[-1])
    if x.rank == 1:
        shape = shape[:-2] + shape[-1:]
    if y.rank == 1:
        shape = shape[:-1]
    return [TensorType(shape, x.dtype)]


def _matmul(xs, a):
    x, y = xs
    if x.ndim > 2 and y.ndim == 2 and x.flags.c_contiguous:
        # numpy's matmul calls sgemm once per leading index ([8,128,768]@[768,768]: 8 calls of
        # 128 rows, 28% slower); the rows of a contiguous x are one matrix, so one call
        return [np.matmul(x.reshape(-1, x.shape[-1]), y).reshape(*x.shape[:-1], y.shape[-1])]
    return [np.matmul(x, y)]


register(OpDef("matmul", COMPUTE_BOUND, _matmul_infer, _matmul,
               arity=(2, 2), doc="numpy matmul semantics (batched, broadcasting, 1-D promotion)"))


def _conv_infer(ins, a):
    x, w = ins
    nsp = x.rank - 2
    if nsp < 1 or w.rank != x.rank:
        raise ShapeError(f"conv needs input and weight of equal rank >= 3, got {x.shape} and {w.shape}")
    if x.dtype != w.dtype:
        raise ShapeError(f"operand dtypes differ: {x.dtype} and {w.dtype}")
    g = a["group"]
    st, pd, dl = tuple(a["strides"]), tuple(a["pads"]), tuple(a["dilations"])
    if len(st) != nsp or len(dl) != nsp or len(pd) != 2 * nsp:
        raise ShapeError(f"strides/dilations need {nsp} values and pads {2 * nsp}")
    if x.shape[1] != w.shape[1] * g or w.shape[0] % g:
        raise ShapeError(f"channels do not match: input {x.shape}, weight {w.shape}, group {g}")
    sp = []
    for s in range(nsp):
        eff = dl[s] * (w.shape[2 + s] - 1) + 1
        n = (x.shape[2 + s] + pd[s] + pd[nsp + s] - eff) // st[s] + 1
        if n <= 0:
            raise ShapeError(f"kernel {w.shape[2:]} larger than padded input {x.shape[2:]}")
        sp.append(n)
    return [TensorType((x.shape[0], w.shape[0], *sp), x.dtype)]


def conv_reference(x: np.ndarray, w: np.ndarray, strides, pads, dilations, group) -> np.ndarray:
    """N-d convolution (NC...) by im2col + matmul per group; float64 accumulation for floats."""
    nsp = x.ndim - 2
    pad = [(0, 0), (0, 0)] + [(pads[s], pads[nsp + s]) for s in range(nsp)]
    xp = np.pad(x, pad)
    ks = w.shape[2:]
    eff = [dilations[s] * (ks[s] - 1) + 1 for s in range(nsp)]
    win = np.lib.stride_tricks.sliding_window_view(xp, eff, axis=tuple(range(2, 2 + nsp)))
    sl = (slice(None), slice(None)) + tuple(slice(None, None, strides[s]) for s in range(nsp))
    sl += tuple(slice(None, None, dilations[s]) for s in range(nsp))
    win = win[sl]  # N, C, out..., k...
    n, c = x.shape[:2]
    out_sp = win.shape[2:2 + nsp]
    cg = c // group
    mg = w.shape[0] // group
    acc = np.float64 if x.dtype.kind == "f" else x.dtype
    outs = []
    for gi in range(group):
        wi = win[:, gi * cg:(gi + 1) * cg]
        # N, out..., C, k...
        wi = np.moveaxis(wi, 1, 1 + nsp).reshape(n * prod(out_sp), -1)
        wg = w[gi * mg:(gi + 1) * mg].reshape(mg, -1)
        o = wi.astype(acc) @ wg.T.astype(acc)
        outs.append(o.reshape(n, *out_sp, mg))
    out = np.concatenate(outs, axis=-1)
    return np.moveaxis(out, -1, 1).astype(x.dtype)


register(OpDef("conv", COMPUTE_BOUND, _conv_infer,
               lambda xs, a: [conv_reference(xs[0], xs[1], a["strides"], a["pads"], a["dilations"], a["group"])],
               arity=(2, 2),
               attrs={"strides": REQUIRED, "pads": REQUIRED, "dilations": REQUIRED, "group": 1},
               doc="N-d convolution, layout NC... (conv2d is NCHW); pads = begins then ends; no bias"))
