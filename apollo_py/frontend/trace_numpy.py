"""numpy rules for tracers: ufuncs, array functions and indexing, each as primitives.

:func:`apply_ufunc` serves ``Tracer.__array_ufunc__``: numpy's own type resolution
(``ufunc.resolve_dtypes``) picks the loop, operands are cast to its input dtypes, and one rule
per ufunc appends the primitives.  :func:`apply_function` serves ``__array_function__`` from
the :data:`FUNCTIONS` table.  Anything else raises :class:`~apollo_py.errors.UnsupportedOpError`
naming the numpy function (``numpy.sort``), so a user learns at once what has no rule.
Compound rules reuse the decompositions of the ONNX front end (:mod:`apollo_py.ops.compound`),
so a traced softmax is the same primitive graph as an imported ONNX Softmax.
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np

from ..errors import TraceError, UnsupportedOpError
from ..ops import compound as C
from ..ops.compound_einsum import einsum as _einsum
from ..ops.compound import trilu
from ..ops.compound_index import arg_reduce, cumsum as _cumsum, mod as _mod, round_half_even
from . import trace as _trace
from .trace import (Tracer, _ctx_for, check_dtype, check_static_shape, dtype_of, is_weak, shape_error,
                    to_value, user_frame)


def _unsupported(name: str, detail: str = "") -> UnsupportedOpError:
    return UnsupportedOpError(name, "", f"{user_frame()}: no tracing rule for it in apollo_py"
                              + (f" ({detail})" if detail else "")
                              + "; rewrite it with supported numpy functions or ap.nn")


def _c(b, value, like):
    return C.scalar(b, value, like.dtype)


def _as_bool(b, v):
    return v if v.dtype == "bool" else b.ne(v, _c(b, 0, v))


def _floor_divide(b, x, y):
    if x.dtype in ("float16", "float32", "float64"):
        return b.floor(b.div(x, y))
    q = b.div(x, y)  # truncates; step down where the remainder has the divisor's opposite sign
    r = b.sub(x, b.mul(q, y))
    zero = _c(b, 0, r)
    fix = b.logical_and(b.ne(r, zero), b.ne(b.lt(r, zero), b.lt(y, zero)))
    return b.sub(q, b.cast(fix, to=q.dtype))


def _power(b, x, y):
    c = next((n.attrs["value"].array for n in b._nodes[-2:]
              if n.op == "constant" and n.outputs[0] == y.name), None)  # just made by to_value
    if c is not None and np.ndim(c) == 0 and float(c) == 2.0:
        return b.mul(x, x)  # x**2 is the common case: no pow kernel for it
    return b.pow(x, y)


def _log_base(base):
    return lambda b, x: b.div(b.log(x), _c(b, math.log(base), x))


UFUNCS: dict[str, Callable] = {
    "add": lambda b, x, y: b.add(x, y),
    "subtract": lambda b, x, y: b.sub(x, y),
    "multiply": lambda b, x, y: b.mul(x, y),
    "divide": lambda b, x, y: b.div(x, y),
    "power": lambda b, x, y: _power(b, x, y),
    "maximum": lambda b, x, y: b.max(x, y),
    "minimum": lambda b, x, y: b.min(x, y),
    "fmax": lambda b, x, y: b.max(x, y),
    "fmin": lambda b, x, y: b.min(x, y),
    "floor_divide": _floor_divide,
    "remainder": lambda b, x, y: _mod(b, x, y),
    "fmod": lambda b, x, y: _mod(b, x, y, fmod=True),
    "matmul": lambda b, x, y: b.matmul(x, y),
    "equal": lambda b, x, y: b.eq(x, y),
    "not_equal": lambda b, x, y: b.ne(x, y),
    "less": lambda b, x, y: b.lt(x, y),
    "less_equal": lambda b, x, y: b.le(x, y),
    "greater": lambda b, x, y: b.gt(x, y),
    "greater_equal": lambda b, x, y: b.ge(x, y),
    "logical_and": lambda b, x, y: b.logical_and(_as_bool(b, x), _as_bool(b, y)),
    "logical_or": lambda b, x, y: b.logical_or(_as_bool(b, x), _as_bool(b, y)),
    "logical_xor": lambda b, x, y: b.logical_xor(_as_bool(b, x), _as_bool(b, y)),
    "logical_not": lambda b, x: b.logical_not(_as_bool(b, x)),
    "negative": lambda b, x: b.neg(x),
    "positive": lambda b, x: x,
    "absolute": lambda b, x: b.abs(x),
    "exp": lambda b, x: b.exp(x),
    "exp2": lambda b, x: b.exp(b.mul(x, _c(b, math.log(2.0), x))),
    "expm1": lambda b, x: b.sub(b.exp(x), _c(b, 1, x)),
    "log": lambda b, x: b.log(x),
    "log2": _log_base(2.0),
    "log10": _log_base(10.0),
    "log1p": lambda b, x: b.log(b.add(x, _c(b, 1, x))),
    "sqrt": lambda b, x: b.sqrt(x),
    "square": lambda b, x: b.mul(x, x),
    "reciprocal": lambda b, x: b.reciprocal(x),
    "tanh": lambda b, x: b.tanh(x),
    "sinh": lambda b, x: b.mul(b.sub(b.exp(x), b.exp(b.neg(x))), _c(b, 0.5, x)),
    "cosh": lambda b, x: b.mul(b.add(b.exp(x), b.exp(b.neg(x))), _c(b, 0.5, x)),
    "floor": lambda b, x: b.floor(x),
    "ceil": lambda b, x: b.ceil(x),
    "trunc": lambda b, x: b.where(b.lt(x, _c(b, 0, x)), b.ceil(x), b.floor(x)),
    "rint": round_half_even,
    "sign": C.sign,
    "isnan": lambda b, x: b.ne(x, x),
    "isinf": lambda b, x: b.eq(b.abs(x), _c(b, np.inf, x)),
    "isfinite": lambda b, x: b.logical_and(b.eq(x, x), b.ne(b.abs(x), _c(b, np.inf, x))),
}
#: bitwise ufuncs are traced for bool operands only (``mask & other``), as logical ops
_BOOL_ONLY = {"bitwise_and": "logical_and", "bitwise_or": "logical_or", "bitwise_xor": "logical_xor",
              "invert": "logical_not"}
_UFUNC_REDUCE = {"add": "sum", "multiply": "prod", "maximum": "max", "minimum": "min",
                 "logical_and": "all", "logical_or": "any"}


def apply_ufunc(ufunc, method, inputs, kwargs):
    """Record ``ufunc(*inputs)`` (or ``ufunc.reduce``) on the innermost trace."""
    name = ufunc.__name__
    if kwargs.get("out") is not None:
        raise TraceError(f"{user_frame()}: numpy.{name}(..., out=...) writes in place, which "
                         "tracing cannot record; use the returned value")
    if kwargs.get("where", True) is not True:
        raise _unsupported(f"numpy.{name}", "the where= argument")
    if method == "reduce" and name in _UFUNC_REDUCE:
        return reduction(_UFUNC_REDUCE[name], inputs[0], kwargs.get("axis", 0),
                         keepdims=kwargs.get("keepdims", False), dtype=kwargs.get("dtype"))
    if method != "__call__":
        raise _unsupported(f"numpy.{name}.{method}")
    dtype = kwargs.pop("dtype", None)
    kwargs.pop("out", None)
    kwargs.pop("where", None)
    if kwargs:
        raise _unsupported(f"numpy.{name}", f"arguments {sorted(kwargs)}")
    ctx = _ctx_for(inputs)
    if name in _BOOL_ONLY:
        if any(dtype_of(x) not in (bool, np.dtype(bool)) for x in inputs):
            raise _unsupported(f"numpy.{name}", "bitwise operations on integers; traced for bool operands")
        name = _BOOL_ONLY[name]
    rule = UFUNCS.get(name)
    if rule is None:
        raise _unsupported(f"numpy.{name}")
    try:
        dts = ufunc.resolve_dtypes(tuple(dtype_of(x) for x in inputs) + (None,) * ufunc.nout)
    except Exception as e:
        raise TraceError(f"{user_frame()}: numpy.{name} has no loop for operand dtypes "
                         f"{[str(dtype_of(x)) for x in inputs]}: {e}") from None
    vals = [to_value(ctx, x, check_dtype(dt, f"numpy.{name}'s operand")) for x, dt in zip(inputs, dts)]
    out = rule(ctx.b, *vals)
    want = np.dtype(dtype) if dtype is not None else dts[-1]
    if out.dtype != want.name:
        out = ctx.b.cast(out, to=check_dtype(want, f"numpy.{name}'s result").name)
    return ctx.wrap(out)


# -- array functions ----------------------------------------------------------------------------

FUNCTIONS: dict[Callable, Callable] = {}


def implements(*funcs):
    def deco(fn):
        for f in funcs:
            FUNCTIONS[f] = fn
        return fn
    return deco


def apply_function(func, args, kwargs):
    """Record numpy function ``func`` (``__array_function__``) on the innermost trace."""
    impl = FUNCTIONS.get(func)
    if impl is None:
        mod = getattr(func, "__module__", "numpy") or "numpy"
        mod = "numpy" if mod.startswith("numpy") and mod.count(".") <= 1 and "linalg" not in mod \
            and "fft" not in mod else mod
        raise _unsupported(f"{mod}.{func.__name__}")
    return impl(*args, **kwargs)


def _axes(axis, rank: int):
    if axis is None:
        return tuple(range(rank))
    if isinstance(axis, (tuple, list)):
        return C.normalize_axes(axis, rank)
    return (C.normalize_axis(axis, rank),)


def _tracer(x):
    """``x`` as a tracer of the current trace (constants are recorded as constant nodes)."""
    if isinstance(x, Tracer):
        return x
    ctx = _ctx_for([x]) if isinstance(x, Tracer) else _current_or_error()
    return ctx.wrap(to_value(ctx, x))


def _current_or_error():
    from .trace import current
    ctx = current()
    if ctx is None:
        raise TraceError(f"{user_frame()}: no active trace")
    return ctx


_SUM_UP = {"bool": "int64", "int8": "int64", "int16": "int64", "int32": "int64",
           "uint8": "uint64", "uint16": "uint64", "uint32": "uint64"}


def reduction(kind: str, a, axis=None, keepdims=False, dtype=None):
    """sum/prod/max/min/mean/any/all with numpy's axis, keepdims and result dtype rules."""
    x = _tracer(a)
    ctx = x._ctx if x._ctx is _current_or_error() else _current_or_error()
    b = ctx.b
    v = ctx.value_of(x)
    axes = _axes(axis, len(x.shape))
    if kind in ("any", "all"):
        v = b.cast(_as_bool(b, v), to="int32")
        r = C.reduce(b, "max" if kind == "any" else "min", v, axes, keepdims) if axes else v
        return ctx.wrap(b.cast(r, to="bool"))
    if dtype is not None:
        v = to_value(ctx, x, check_dtype(np.dtype(dtype), "the reduction dtype"))
    elif kind in ("sum", "prod") and v.dtype in _SUM_UP:
        v = b.cast(v, to=_SUM_UP[v.dtype])
    elif kind == "mean" and v.dtype not in ("float16", "float32", "float64"):
        v = b.cast(v, to="float64")
    if kind in ("max", "min") and any(x.shape[k] == 0 for k in axes):
        raise shape_error(f"numpy.{kind} of an empty axis has no identity")
    if not axes:
        return ctx.wrap(v)
    if kind == "mean":
        return ctx.wrap(C.reduce_mean(b, v, axes, keepdims))
    return ctx.wrap(C.reduce(b, kind, v, axes, keepdims))


def _no_extra(name, **kw):
    bad = [k for k, v in kw.items() if v is not None and v is not np._NoValue]
    if bad:
        raise _unsupported(f"numpy.{name}", f"arguments {bad}")


@implements(np.sum)
def _sum(a, axis=None, dtype=None, out=None, keepdims=False, initial=None, where=None):
    _no_extra("sum", out=out, initial=initial, where=where)
    return reduction("sum", a, axis, keepdims, dtype)


@implements(np.prod)
def _prod(a, axis=None, dtype=None, out=None, keepdims=False, initial=None, where=None):
    _no_extra("prod", out=out, initial=initial, where=where)
    return reduction("prod", a, axis, keepdims, dtype)


@implements(np.mean)
def _mean(a, axis=None, dtype=None, out=None, keepdims=False, where=None):
    _no_extra("mean", out=out, where=where)
    return reduction("mean", a, axis, keepdims, dtype)


@implements(np.max, np.amax)
def _max(a, axis=None, out=None, keepdims=False, initial=None, where=None):
    _no_extra("max", out=out, initial=initial, where=where)
    return reduction("max", a, axis, keepdims)


@implements(np.min, np.amin)
def _min(a, axis=None, out=None, keepdims=False, initial=None, where=None):
    _no_extra("min", out=out, initial=initial, where=where)
    return reduction("min", a, axis, keepdims)


@implements(np.any)
def _any(a, axis=None, out=None, keepdims=False, where=None):
    _no_extra("any", out=out, where=where)
    return reduction("any", a, axis, keepdims)


@implements(np.all)
def _all(a, axis=None, out=None, keepdims=False, where=None):
    _no_extra("all", out=out, where=where)
    return reduction("all", a, axis, keepdims)


@implements(np.var)
def _var(a, axis=None, dtype=None, out=None, ddof=0, keepdims=False, where=None, mean=None,
         correction=None):
    _no_extra("var", out=out, where=where, mean=mean, correction=correction)
    x = _tracer(a)
    if x.dtype.kind != "f":
        x = x.astype(np.float64)
    m = np.mean(x, axis=axis, keepdims=True)
    d = x - m
    n = math.prod(x.shape[k] for k in _axes(axis, x.ndim))
    return np.sum(d * d, axis=axis, keepdims=keepdims) / np.asarray(max(n - ddof, 0), x.dtype)


@implements(np.std)
def _std(a, axis=None, dtype=None, out=None, ddof=0, keepdims=False, where=None, mean=None,
         correction=None):
    return np.sqrt(_var(a, axis, dtype, out, ddof, keepdims, where, mean, correction))


def _arg(kind, a, axis, keepdims):
    x = _tracer(a)
    ctx = _current_or_error()
    v = ctx.value_of(x)
    if axis is None:
        v, axis = ctx.b.reshape(v, shape=(x.size,)), 0
    return ctx.wrap(arg_reduce(ctx.b, v, axis, bool(keepdims), False, kind == "max"))


@implements(np.argmax)
def _argmax(a, axis=None, out=None, keepdims=False):
    _no_extra("argmax", out=out)
    return _arg("max", a, axis, keepdims)


@implements(np.argmin)
def _argmin(a, axis=None, out=None, keepdims=False):
    _no_extra("argmin", out=out)
    return _arg("min", a, axis, keepdims)


def _common(xs, what):
    try:
        dt = np.result_type(*[dtype_of(x) if not is_weak(x) else x for x in xs])
    except TypeError as e:
        raise TraceError(f"{user_frame()}: {what}: operand dtypes do not combine: {e}") from None
    return check_dtype(dt, what)


@implements(np.where)
def _where(condition, x=None, y=None):
    if x is None or y is None:
        raise _unsupported("numpy.where", "the one-argument form (np.nonzero) has a data-dependent "
                           "shape; pass x and y")
    ctx = _current_or_error()
    dt = _common([x, y], "numpy.where")
    c = to_value(ctx, condition)
    c = _as_bool(ctx.b, c)
    return ctx.wrap(ctx.b.where(c, to_value(ctx, x, dt), to_value(ctx, y, dt)))


@implements(np.clip)
def _clip(a, a_min=None, a_max=None, out=None, **kw):
    _no_extra("clip", out=out)
    a_min = kw.pop("min", a_min)
    a_max = kw.pop("max", a_max)
    x = _tracer(a)
    if a_min is not None:
        x = np.maximum(x, a_min)
    if a_max is not None:
        x = np.minimum(x, a_max)
    return x


@implements(np.dot)
def _dot(a, b, out=None):
    _no_extra("dot", out=out)
    if np.ndim(a) == 0 or np.ndim(b) == 0:
        return np.multiply(a, b)
    if np.ndim(a) <= 2 and np.ndim(b) <= 2:
        return np.matmul(a, b)
    raise _unsupported("numpy.dot", "operands of rank > 2; use np.matmul or np.einsum")


@implements(np.einsum)
def _einsum_fn(subscripts, *operands, out=None, dtype=None, optimize=False, **kw):
    _no_extra("einsum", out=out)
    if not isinstance(subscripts, str):
        raise _unsupported("numpy.einsum", "the interleaved (operand, sublist) form")
    ctx = _current_or_error()
    dt = _common(list(operands), "numpy.einsum") if dtype is None else np.dtype(dtype)
    vals = [to_value(ctx, o, dt) for o in operands]
    return ctx.wrap(_einsum(ctx.b, subscripts.replace(" ", ""), vals))


@implements(np.concatenate)
def _concatenate(arrays, axis=0, out=None, dtype=None, casting=None):
    _no_extra("concatenate", out=out)
    ctx = _current_or_error()
    arrays = list(arrays)
    if not arrays:
        raise shape_error("need at least one array to concatenate")
    dt = _common(arrays, "numpy.concatenate") if dtype is None else np.dtype(dtype)
    vals = [to_value(ctx, a, dt) for a in arrays]
    if axis is None:
        vals = [ctx.b.reshape(v, shape=(v.type.size,)) for v in vals]
        axis = 0
    if any(len(v.shape) == 0 for v in vals):
        raise shape_error("zero-dimensional arrays cannot be concatenated")
    ax = C.normalize_axis(axis, len(vals[0].shape))
    if len(vals) == 1:
        return ctx.wrap(vals[0])
    return ctx.wrap(ctx.b.concat(*vals, axis=ax))


@implements(np.stack)
def stack(arrays, axis=0, out=None, dtype=None, casting=None):
    _no_extra("stack", out=out)
    arrays = [_tracer(a) for a in arrays]
    if not arrays:
        raise shape_error("need at least one array to stack")
    ax = C.normalize_axis(axis, arrays[0].ndim + 1)
    return _concatenate([np.expand_dims(a, ax) for a in arrays], axis=ax, dtype=dtype)


@implements(np.hstack)
def _hstack(tup, dtype=None, casting=None):
    tup = [_tracer(a) for a in tup]
    return _concatenate(tup, axis=0 if tup[0].ndim == 1 else 1, dtype=dtype)


@implements(np.vstack)
def _vstack(tup, dtype=None, casting=None):
    tup = [_tracer(a) for a in tup]
    tup = [t.reshape(1, -1) if t.ndim == 1 else t for t in tup]
    return _concatenate(tup, axis=0, dtype=dtype)


@implements(np.pad)
def _pad(array, pad_width, mode="constant", **kw):
    x = _tracer(array)
    if mode not in ("constant", "reflect", "edge", "wrap"):
        raise _unsupported("numpy.pad", f"mode {mode!r}")
    cv = kw.pop("constant_values", 0)
    if kw:
        raise _unsupported("numpy.pad", f"arguments {sorted(kw)}")
    if isinstance(cv, Tracer) or np.ndim(cv) != 0 and len(set(np.asarray(cv).reshape(-1).tolist())) > 1:
        raise _unsupported("numpy.pad", "constant_values other than one constant scalar")
    widths = np.broadcast_to(np.asarray(pad_width, dtype=np.int64), (x.ndim, 2))
    pads = [int(w) for w in widths[:, 0]] + [int(w) for w in widths[:, 1]]
    if not any(pads):
        return x
    value = float(np.asarray(cv).reshape(-1)[0]) if np.size(cv) else 0.0
    ctx = _current_or_error()
    return ctx.wrap(ctx.b.pad(ctx.value_of(x), pads=tuple(pads), mode=mode, value=value))


@implements(np.reshape)
def _reshape(a, shape=None, order="C", *, newshape=None, copy=None):
    if order != "C":
        raise _unsupported("numpy.reshape", f"order={order!r}")
    shape = newshape if shape is None else shape
    x = _tracer(a)
    shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    shape = check_static_shape(shape, "the new shape")
    if shape.count(-1) > 1:
        raise shape_error(f"can only specify one unknown dimension in {shape}")
    if -1 in shape:
        known = math.prod(d for d in shape if d != -1)
        if known == 0 or x.size % known:
            raise shape_error(f"cannot reshape {x.shape} into {shape}")
        shape = tuple(x.size // known if d == -1 else d for d in shape)
    if math.prod(shape) != x.size:
        raise shape_error(f"cannot reshape {x.shape} ({x.size} elements) into {shape}")
    ctx = _current_or_error()
    return ctx.wrap(C.reshape(ctx.b, ctx.value_of(x), shape))


@implements(np.transpose)
def _transpose(a, axes=None):
    x = _tracer(a)
    perm = tuple(reversed(range(x.ndim))) if axes is None else tuple(C.normalize_axis(p, x.ndim) for p in axes)
    if sorted(perm) != list(range(x.ndim)):
        raise shape_error(f"axes {axes} are not a permutation of {x.ndim} dims")
    if perm == tuple(range(x.ndim)):
        return x
    ctx = _current_or_error()
    return ctx.wrap(ctx.b.transpose(ctx.value_of(x), perm=perm))


@implements(np.swapaxes)
def _swapaxes(a, axis1, axis2):
    x = _tracer(a)
    perm = list(range(x.ndim))
    i, j = C.normalize_axis(axis1, x.ndim), C.normalize_axis(axis2, x.ndim)
    perm[i], perm[j] = perm[j], perm[i]
    return _transpose(x, perm)


@implements(np.moveaxis)
def _moveaxis(a, source, destination):
    x = _tracer(a)
    src = _axes(source, x.ndim) if isinstance(source, (list, tuple)) else (C.normalize_axis(source, x.ndim),)
    dst = [C.normalize_axis(d, x.ndim) for d in (destination if isinstance(destination, (list, tuple))
                                                   else [destination])]
    order = [k for k in range(x.ndim) if k not in src]
    for d, s in sorted(zip(dst, src)):
        order.insert(d, s)
    return _transpose(x, order)


@implements(np.expand_dims)
def _expand_dims(a, axis):
    x = _tracer(a)
    axes = _axes(axis if isinstance(axis, (list, tuple)) else (axis,), x.ndim + len(
        axis if isinstance(axis, (list, tuple)) else (axis,)))
    shape = list(x.shape)
    for ax in axes:
        shape.insert(ax, 1)
    return _reshape(x, tuple(shape))


@implements(np.squeeze)
def _squeeze(a, axis=None):
    x = _tracer(a)
    axes = [k for k, d in enumerate(x.shape) if d == 1] if axis is None else _axes(axis, x.ndim)
    for k in axes:
        if x.shape[k] != 1:
            raise shape_error(f"cannot squeeze axis {k} of size {x.shape[k]}")
    return _reshape(x, tuple(d for k, d in enumerate(x.shape) if k not in axes))


@implements(np.broadcast_to)
def _broadcast_to(array, shape, subok=False):
    x = _tracer(array)
    shape = (shape,) if isinstance(shape, int) else check_static_shape(shape, "the target shape")
    if tuple(shape) == x.shape:
        return x
    ctx = _current_or_error()
    v = ctx.value_of(x)
    return ctx.wrap(ctx.b.broadcast_to(v, shape=tuple(shape)))


@implements(np.full_like)
def _like(a, *args, dtype=None, order=None, subok=None, shape=None, **kw):
    x = _tracer(a)
    fill = 0
    if args:
        fill = args[0]
    fill = kw.get("fill_value", fill)
    if isinstance(fill, Tracer):
        raise _unsupported("numpy.full_like", "a traced fill value")
    return np.full(shape if shape is not None else x.shape, fill, dtype=dtype or x.dtype)


FUNCTIONS[np.zeros_like] = lambda a, dtype=None, order=None, subok=None, shape=None: \
    np.zeros(shape if shape is not None else a.shape, dtype=dtype or a.dtype)
FUNCTIONS[np.ones_like] = lambda a, dtype=None, order=None, subok=None, shape=None: \
    np.ones(shape if shape is not None else a.shape, dtype=dtype or a.dtype)
FUNCTIONS[np.empty_like] = FUNCTIONS[np.zeros_like]


@implements(np.take)
def _take(a, indices, axis=None, out=None, mode=None):
    _no_extra("take", out=out, mode=mode)
    x = _tracer(a)
    if axis is None:
        x, axis = x.reshape(-1), 0
    ctx = _current_or_error()
    idx = to_value(ctx, indices)
    if idx.dtype not in ("int32", "int64"):
        idx = ctx.b.cast(idx, to="int64")
    return ctx.wrap(ctx.b.gather(ctx.value_of(x), idx, axis=C.normalize_axis(axis, x.ndim)))


@implements(np.tile)
def _tile(A, reps):
    x = _tracer(A)
    reps = (reps,) if isinstance(reps, int) else tuple(reps)
    if len(reps) > x.ndim:
        x = x.reshape((1,) * (len(reps) - x.ndim) + x.shape)
    reps = (1,) * (x.ndim - len(reps)) + reps
    ctx = _current_or_error()
    return ctx.wrap(C.tile(ctx.b, ctx.value_of(x), reps))


@implements(np.split, np.array_split)
def _split(ary, indices_or_sections, axis=0):
    x = _tracer(ary)
    ax = C.normalize_axis(axis, x.ndim)
    n = x.shape[ax]
    if isinstance(indices_or_sections, int):
        sizes = C.even_split_sizes(n, indices_or_sections)
        bounds = np.cumsum([0] + sizes).tolist()
    else:
        bounds = [0] + [min(int(i), n) for i in indices_or_sections] + [n]
    out = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        idx = [slice(None)] * x.ndim
        idx[ax] = slice(lo, hi)
        out.append(x[tuple(idx)])
    return out


FUNCTIONS[np.tril] = lambda m, k=0: _trilu(m, k, False)
FUNCTIONS[np.triu] = lambda m, k=0: _trilu(m, k, True)


def _trilu(m, k, upper):
    x = _tracer(m)
    ctx = _current_or_error()
    return ctx.wrap(trilu(ctx.b, ctx.value_of(x), int(k), upper))


@implements(np.cumsum)
def _cumsum_fn(a, axis=None, dtype=None, out=None):
    _no_extra("cumsum", out=out)
    x = _tracer(a)
    if axis is None:
        x, axis = x.reshape(-1), 0
    if dtype is not None:
        x = x.astype(dtype)
    elif x.dtype.name in _SUM_UP:
        x = x.astype(_SUM_UP[x.dtype.name])
    ctx = _current_or_error()
    return ctx.wrap(_cumsum(ctx.b, ctx.value_of(x), C.normalize_axis(axis, x.ndim)))


@implements(np.round, np.around)
def _round(a, decimals=0, out=None):
    _no_extra("round", out=out)
    x = _tracer(a)
    if x.dtype.kind != "f":
        return x
    if decimals:
        s = np.asarray(10.0 ** decimals, x.dtype)
        return np.rint(x * s) / s
    return np.rint(x)


@implements(np.outer)
def _outer(a, b, out=None):
    return np.multiply(np.reshape(a, (-1, 1)), np.reshape(b, (1, -1)))


@implements(np.shape)
def _shape(a):
    return _tracer(a).shape


@implements(np.ndim)
def _ndim(a):
    return _tracer(a).ndim


@implements(np.size)
def _size(a, axis=None):
    x = _tracer(a)
    return x.size if axis is None else x.shape[axis]


@implements(np.astype)
def _astype(x, dtype, copy=True, device=None):
    return _tracer(x).astype(dtype)


@implements(np.copy)
def _copy(a, order="K", subok=False):
    return _tracer(a)


@implements(np.atleast_2d)
def _atleast_2d(*arys):
    out = [_tracer(a) if _tracer(a).ndim >= 2 else _tracer(a).reshape((1,) * (2 - _tracer(a).ndim) + _tracer(a).shape)
           for a in arys]
    return out[0] if len(out) == 1 else out


# -- indexing -------------------------------------------------------------------------------------


def getitem(x: Tracer, key):
    """numpy basic indexing (ints, slices, None, Ellipsis) plus one integer-array index (gather)
    and constant boolean masks; a traced boolean mask has a data-dependent shape and is refused."""
    key = key if isinstance(key, tuple) else (key,)
    if any(isinstance(k, Tracer) and k.dtype == np.bool_ for k in key):
        raise TraceError(f"{user_frame()}: indexing with a traced boolean mask gives a shape that "
                         "depends on the data; use np.where(mask, x, 0) instead")
    key = tuple(np.nonzero(np.asarray(k))[0] if isinstance(k, np.ndarray) and k.dtype == np.bool_
                and k.ndim == 1 else k for k in key)
    n_real = sum(1 for k in key if k is not None and k is not Ellipsis)
    if n_real > x.ndim:
        raise shape_error(f"too many indices ({n_real}) for an array of rank {x.ndim}")
    if sum(1 for k in key if k is Ellipsis) > 1:
        raise shape_error("an index can only have a single ellipsis")
    if Ellipsis in [k for k in key if not isinstance(k, (Tracer, np.ndarray, list))]:
        e = next(i for i, k in enumerate(key) if k is Ellipsis and not isinstance(k, (Tracer, np.ndarray)))
        key = key[:e] + (slice(None),) * (x.ndim - n_real) + key[e + 1:]
    else:
        key = key + (slice(None),) * (x.ndim - n_real)
    starts, ends, steps, out_shape, drop, adv = [], [], [], [], [], None
    dim = 0
    for k in key:
        if k is None:
            out_shape.append(("new",))
            continue
        d = x.shape[dim]
        if isinstance(k, slice):
            s, e, st = k.indices(d)
            starts.append(s), ends.append(e), steps.append(st)
            out_shape.append(("dim", len(range(s, e, st))))
        elif isinstance(k, (Tracer, np.ndarray, list)):
            if adv is not None:
                raise _unsupported("numpy indexing", "more than one integer-array index")
            adv = (len(out_shape), k, dim)
            starts.append(0), ends.append(d), steps.append(1)
            out_shape.append(("adv",))
        else:
            try:
                i = int(k)
            except TypeError:
                raise shape_error(f"unsupported index {k!r}") from None
            if not -d <= i < d:
                raise shape_error(f"index {i} is out of bounds for axis {dim} with size {d}")
            i %= d
            starts.append(i), ends.append(i + 1), steps.append(1)
            drop.append(dim)
        dim += 1
    ctx = _current_or_error()
    b = ctx.b
    v = ctx.value_of(x)
    if (starts, ends, steps) != ([0] * x.ndim, list(x.shape), [1] * x.ndim):
        v = b.slice(v, starts=tuple(starts), ends=tuple(ends), steps=tuple(steps))
    # shape after dropping int-indexed dims and inserting new axes; the advanced dim kept as is
    sliced = list(v.shape)
    shape, src = [], 0
    adv_axis = None
    for entry in out_shape:
        while src in drop:
            src += 1
        if entry[0] == "new":
            shape.append(1)
            continue
        if entry[0] == "adv":
            adv_axis = len(shape)
        shape.append(sliced[src])
        src += 1
    v = C.reshape(b, v, tuple(shape))
    if adv is not None:
        idx = to_value(ctx, adv[1] if not isinstance(adv[1], list) else np.asarray(adv[1]))
        if idx.dtype not in ("int32", "int64"):
            if idx.dtype == "bool":
                raise shape_error("boolean masks must be 1-D numpy constants")
            idx = b.cast(idx, to="int64")
        v = b.gather(v, idx, axis=adv_axis)
    return ctx.wrap(v)


_trace.RULES.update(ufunc=apply_ufunc, function=apply_function, getitem=getitem, stack=stack)
