"""Primitive op definitions: shape rules, numpy references and access relations.

Importing this module registers every primitive.  References are the oracle every compiled
target is compared with, so they follow ONNX semantics where ONNX and numpy differ (integer
division truncates; reductions over empty sets return the identity).
"""
from __future__ import annotations

import math

import numpy as np

from ..errors import ShapeError
from ..ir.types import FLOAT_DTYPES, TensorType
from . import access as A
from .registry import (COMPUTE_BOUND, COMPUTED, DATA_DEPENDENT, REORGANIZE, REQUIRED, SOURCE,
                       OpDef, register)


def broadcast_shapes(*shapes) -> tuple[int, ...]:
    """numpy broadcasting of shapes; ShapeError listing them if incompatible."""
    try:
        return tuple(np.broadcast_shapes(*shapes))
    except ValueError:
        raise ShapeError(f"shapes {' and '.join(str(tuple(s)) for s in shapes)} do not broadcast") from None


def _same_dtype(ts):
    if len({t.dtype for t in ts}) > 1:
        raise ShapeError(f"operand dtypes differ: {[t.dtype for t in ts]}")
    return ts[0].dtype


def _bcast_access(ins, outs, attrs):
    return A.broadcast_access([t.shape for t in ins], outs[0].shape)


# --- elementwise binary ---------------------------------------------------------------

def _trunc_div(a, b):
    if np.issubdtype(a.dtype, np.integer):
        q = np.floor_divide(a, b)
        fix = (np.remainder(a, b) != 0) & ((a < 0) != (b < 0))
        return (q + fix).astype(a.dtype)
    return np.divide(a, b)


def _pow(a, b):
    if np.issubdtype(a.dtype, np.integer):
        return np.power(a.astype(np.float64), b).astype(a.dtype)
    return np.power(a, b)


_BINARY = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "div": _trunc_div, "pow": _pow,
    "max": np.maximum, "min": np.minimum,
}
_COMPARE = {"eq": np.equal, "ne": np.not_equal, "lt": np.less, "le": np.less_equal,
            "gt": np.greater, "ge": np.greater_equal}
_LOGIC = {"and": np.logical_and, "or": np.logical_or, "xor": np.logical_xor}


def _binary_infer(result_dtype=None, need_bool=False):
    def infer(ins, attrs):
        dt = _same_dtype(ins)
        if need_bool and dt != "bool":
            raise ShapeError(f"needs bool operands, got {dt}")
        return [TensorType(broadcast_shapes(*(t.shape for t in ins)), result_dtype or dt)]
    return infer


def _np_ref(fn):
    def ref(xs, attrs):
        with np.errstate(all="ignore"):
            return [fn(*xs)]
    return ref


for _name, _fn in _BINARY.items():
    register(OpDef(_name, COMPUTED, _binary_infer(), _np_ref(_fn), _bcast_access, (2, 2),
                   scalar=_name, doc=f"elementwise {_name} with numpy broadcasting"))
for _name, _fn in _COMPARE.items():
    register(OpDef(_name, COMPUTED, _binary_infer("bool"), _np_ref(_fn), _bcast_access, (2, 2),
                   scalar=_name, doc=f"comparison {_name} -> bool"))
for _name, _fn in _LOGIC.items():
    register(OpDef(_name, COMPUTED, _binary_infer("bool", need_bool=True), _np_ref(_fn),
                   _bcast_access, (2, 2), scalar=_name, doc=f"logical {_name} of bools"))


# --- elementwise unary -------------------------------------------------------------------

_erf = np.frompyfunc(math.erf, 1, 1)


def _erf_ref(x):
    return np.asarray(_erf(x.astype(np.float64)), dtype=np.float64).astype(x.dtype)


def _sigmoid(x):
    # stable for large |x|: exp of a non-positive number only
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1 / (1 + e), e / (1 + e)).astype(x.dtype)


_UNARY = {
    "neg": np.negative, "abs": np.abs, "exp": np.exp, "log": np.log, "sqrt": np.sqrt,
    "rsqrt": lambda x: (1 / np.sqrt(x)).astype(x.dtype),
    "reciprocal": lambda x: (1 / x).astype(x.dtype) if x.dtype.kind == "f" else 1 // x,
    "tanh": np.tanh, "erf": _erf_ref, "sigmoid": _sigmoid,
    "relu": lambda x: np.maximum(x, np.zeros((), x.dtype)),
    "floor": np.floor, "ceil": np.ceil,
}
_FLOAT_ONLY = {"exp", "log", "sqrt", "rsqrt", "tanh", "erf", "sigmoid", "floor", "ceil"}


def _unary_infer(name):
    def infer(ins, attrs):
        if name in _FLOAT_ONLY and ins[0].dtype not in FLOAT_DTYPES:
            raise ShapeError(f"{name} needs a float operand, got {ins[0].dtype}")
        if ins[0].dtype == "bool":
            raise ShapeError(f"{name} does not take bool operands")
        return [ins[0]]
    return infer


for _name, _fn in _UNARY.items():
    register(OpDef(_name, COMPUTED, _unary_infer(_name), _np_ref(_fn), _bcast_access, (1, 1),
                   scalar=_name, doc=f"elementwise {_name}"))


def _not_infer(ins, attrs):
    if ins[0].dtype != "bool":
        raise ShapeError(f"not needs a bool operand, got {ins[0].dtype}")
    return [ins[0]]


register(OpDef("not", COMPUTED, _not_infer, _np_ref(np.logical_not), _bcast_access, scalar="not",
               doc="logical not"))


def _where_infer(ins, attrs):
    c, a, b = ins
    if c.dtype != "bool":
        raise ShapeError(f"where's condition must be bool, got {c.dtype}")
    dt = _same_dtype([a, b])
    return [TensorType(broadcast_shapes(c.shape, a.shape, b.shape), dt)]


register(OpDef("where", COMPUTED, _where_infer, _np_ref(np.where), _bcast_access, (3, 3),
               scalar="select", doc="select(cond, a, b) with broadcasting"))


def _cast_ref(xs, attrs):
    x = xs[0]
    to = np.dtype(attrs["to"])
    if x.dtype.kind == "f" and to.kind in "iu":
        with np.errstate(invalid="ignore"):
            return [np.trunc(x).astype(to)]
    return [x.astype(to)]


register(OpDef("cast", COMPUTED, lambda ins, a: [ins[0].with_dtype(a["to"])], _cast_ref,
               _bcast_access, attrs={"to": REQUIRED}, scalar="cast", doc="dtype conversion"))


def _bto_infer(ins, attrs):
    shape = tuple(attrs["shape"])
    if broadcast_shapes(ins[0].shape, shape) != shape:
        raise ShapeError(f"cannot broadcast {ins[0].shape} to {shape}")
    return [ins[0].with_shape(shape)]


register(OpDef("broadcast_to", COMPUTED, _bto_infer,
               lambda xs, a: [np.broadcast_to(xs[0], tuple(a["shape"])).copy()], _bcast_access,
               attrs={"shape": REQUIRED}, scalar="copy", doc="numpy broadcast_to"))


register(OpDef("stop_gradient", COMPUTED, lambda ins, a: [ins[0]], lambda xs, a: [np.array(xs[0], copy=True)],
               _bcast_access, (1, 1), scalar="copy",
               doc="the identity; reverse-mode autodiff passes no gradient through it (train_step "
                   "drops it from the compiled step)"))


# --- reductions ----------------------------------------------------------------------------

def _norm_axes(axes, rank):
    out = []
    for a in axes:
        if not -rank <= a < max(rank, 1):
            raise ShapeError(f"axis {a} out of range for rank {rank}")
        out.append(a % rank if rank else 0)
    if len(set(out)) != len(out):
        raise ShapeError(f"repeated axis in {tuple(axes)}")
    return tuple(sorted(out))


def _reduce_infer(ins, attrs):
    t = ins[0]
    axes = _norm_axes(attrs["axes"], t.rank)
    if tuple(attrs["axes"]) != axes:
        raise ShapeError(f"axes must be sorted and non-negative, got {tuple(attrs['axes'])}")
    if attrs["keepdims"]:
        shape = tuple(1 if k in axes else d for k, d in enumerate(t.shape))
    else:
        shape = tuple(d for k, d in enumerate(t.shape) if k not in axes)
    return [t.with_shape(shape)]


def _identity(reducer, dtype):
    if reducer == "sum":
        return 0
    if reducer == "prod":
        return 1
    if dtype.kind == "f":
        return -np.inf if reducer == "max" else np.inf
    info = np.iinfo(dtype) if dtype.kind in "iu" else None
    if info is None:
        return reducer == "min"
    return info.min if reducer == "max" else info.max


_REDUCERS = {"sum": np.sum, "prod": np.prod, "max": np.max, "min": np.min}


def _reduce_ref(reducer):
    fn = _REDUCERS[reducer]

    def ref(xs, attrs):
        x = xs[0]
        axes = tuple(attrs["axes"])
        kw = {}
        if reducer in ("max", "min"):
            kw["initial"] = _identity(reducer, x.dtype)
        r = fn(x, axis=axes, keepdims=bool(attrs["keepdims"]), **kw)
        return [np.asarray(r, dtype=x.dtype)]
    return ref


for _r in _REDUCERS:
    register(OpDef(f"reduce_{_r}", COMPUTED, _reduce_infer, _reduce_ref(_r),
                   lambda ins, outs, a: A.reduce_access(ins[0].shape, a["axes"], a["keepdims"]),
                   attrs={"axes": REQUIRED, "keepdims": False}, reducer=_r,
                   doc=f"{_r} over sorted non-negative axes"))


def _window_out(in_shape, kernel, strides, pads, dilations):
    nsp = len(kernel)
    lead = list(in_shape[: len(in_shape) - nsp])
    out = []
    for s in range(nsp):
        size = in_shape[len(lead) + s] + pads[s] + pads[nsp + s]
        eff = dilations[s] * (kernel[s] - 1) + 1
        n = (size - eff) // strides[s] + 1
        if n < 0:
            raise ShapeError(f"window {kernel} larger than padded input {in_shape}")
        out.append(n)
    return tuple(lead + out)


def _window_infer(ins, attrs):
    k = tuple(attrs["kernel"])
    if len(attrs["strides"]) != len(k) or len(attrs["dilations"]) != len(k) or len(attrs["pads"]) != 2 * len(k):
        raise ShapeError("kernel, strides, dilations and pads (begin..., end...) must agree in length")
    if ins[0].rank < len(k):
        raise ShapeError(f"window of rank {len(k)} over a rank-{ins[0].rank} input")
    return [ins[0].with_shape(_window_out(ins[0].shape, k, attrs["strides"], attrs["pads"], attrs["dilations"]))]


def _window_ref(xs, attrs):
    x = xs[0]
    k, st, pd, dl = (tuple(attrs[n]) for n in ("kernel", "strides", "pads", "dilations"))
    nsp = len(k)
    reducer = attrs["reducer"]
    fill = _identity(reducer, x.dtype)
    pad = [(0, 0)] * (x.ndim - nsp) + [(pd[s], pd[nsp + s]) for s in range(nsp)]
    xp = np.pad(x, pad, constant_values=fill)
    eff = [dl[s] * (k[s] - 1) + 1 for s in range(nsp)]
    axes = tuple(range(x.ndim - nsp, x.ndim))
    win = np.lib.stride_tricks.sliding_window_view(xp, eff, axis=axes)
    sl = [slice(None)] * (x.ndim - nsp) + [slice(None, None, st[s]) for s in range(nsp)]
    sl += [slice(None, None, dl[s]) for s in range(nsp)]
    win = win[tuple(sl)]
    out_shape = _window_out(x.shape, k, st, pd, dl)
    win = win[tuple(slice(0, n) for n in out_shape)]
    red = tuple(range(x.ndim, x.ndim + nsp))
    r = np.max(win, axis=red) if reducer == "max" else np.sum(win, axis=red)
    return [np.asarray(r, dtype=x.dtype)]


register(OpDef("window_reduce", COMPUTED, _window_infer, _window_ref,
               lambda ins, outs, a: A.window_access(ins[0].shape, outs[0].shape, a["kernel"],
                                                    a["strides"], a["pads"], a["dilations"]),
               attrs={"reducer": REQUIRED, "kernel": REQUIRED, "strides": REQUIRED,
                      "pads": REQUIRED, "dilations": REQUIRED},
               doc="sliding-window max or sum over the trailing len(kernel) dims (pooling)"))


# --- sources -------------------------------------------------------------------------------

register(OpDef("constant", SOURCE, lambda ins, a: [a["value"].type],
               lambda xs, a: [a["value"].array], arity=(0, 0), attrs={"value": REQUIRED},
               doc="a constant tensor (attribute value: ConstArray)"))


def _iota_ref(xs, a):
    shape, axis = tuple(a["shape"]), a["axis"]
    r = np.arange(shape[axis], dtype=np.dtype(a["dtype"]))
    r = r.reshape([-1 if k == axis else 1 for k in range(len(shape))])
    return [np.broadcast_to(r, shape).copy()]


register(OpDef("iota", COMPUTED, lambda ins, a: [TensorType(tuple(a["shape"]), a["dtype"])], _iota_ref,
               lambda ins, outs, a: A.broadcast_access([], outs[0].shape), arity=(0, 0),
               attrs={"shape": REQUIRED, "axis": REQUIRED, "dtype": "int64"}, scalar="iota",
               doc="index along `axis`, broadcast to `shape`"))

from . import structural  # noqa: E402,F401  (registers the opaque ops)
