"""Tracing: record numpy-style Python code into a primitive graph.

A :class:`Tracer` stands for an array whose value is not known while a function is traced.  It
implements numpy's array protocols (``__array_ufunc__``, ``__array_function__``), the operators
and the common ndarray methods, and every operation appends primitives to the
:class:`~apollo_py.ir.builder.GraphBuilder` of the innermost active :class:`TraceContext`
(:mod:`.trace_numpy` holds the numpy rules).  Dtypes follow numpy 2 (NEP 50): a Python scalar
takes the array's dtype, numpy arrays and numpy scalars are strong; result dtypes of ufuncs come
from numpy's own ``ufunc.resolve_dtypes``.

Contexts nest (``ap.cond`` branches, ``ap.grad``, ``ap.fori_loop`` bodies trace into a child
context): a tracer of an enclosing context used in a child is *lifted* into an input of the
child's graph (a capture), and the child's owner passes the outer value in.

Converting a tracer to a Python value (``bool``, ``int``, ``float``, ``np.asarray``) is a
:class:`~apollo_py.errors.TraceError` naming the user's file and line: its value depends on the
function's inputs, which tracing does not know.
"""
from __future__ import annotations

import os
import threading
import traceback
from typing import Any

import numpy as np

from ..errors import ShapeError, TraceError
from ..ir.builder import GraphBuilder, Value
from ..ir.types import DTYPES

_LOCAL = threading.local()
#: the numpy rules (``ufunc``, ``function``, ``getitem``, ``stack``), filled in by
#: :mod:`.trace_numpy` when it is imported (the modules that start traces import it), so this
#: module does not import the rules that are built on it
RULES: dict = {}
_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_NP_DIR = os.path.dirname(os.path.abspath(np.__file__))


def user_frame() -> str:
    """``file:line`` of the innermost stack frame outside apollo_py and numpy (the user's code)."""
    for fr in reversed(traceback.extract_stack()):
        f = os.path.abspath(fr.filename)
        if not f.startswith(_PKG_DIR) and not f.startswith(_NP_DIR) and "<frozen" not in f:
            return f"{fr.filename}:{fr.lineno}"
    return "<unknown>"


class TraceContext:
    """One trace: a builder, its parent context (None at the top) and the captured outer values.

    Use as a context manager; ops on tracers record into the innermost active context.
    """

    def __init__(self, name: str, options=None, parent: "TraceContext | None" = None):
        self.b = GraphBuilder(name)
        self.name = name
        self.options = options if options is not None or parent is None else parent.options
        self.parent = parent
        self.captures: dict[int, tuple[Any, Value]] = {}  # id(outer tracer) -> (tracer, input here)
        self.closed = False

    def __enter__(self):
        stack = getattr(_LOCAL, "stack", None)
        if stack is None:
            stack = _LOCAL.stack = []
        stack.append(self)
        return self

    def __exit__(self, *exc):
        _LOCAL.stack.pop()
        self.closed = True
        return False

    def input(self, name: str, shape, dtype) -> "Tracer":
        return Tracer(self, self.b.input(name, tuple(shape), np.dtype(dtype).name))

    def value_of(self, t: "Tracer") -> Value:
        """``t``'s value in this context, lifting it (and through every context in between) if
        it belongs to an enclosing trace."""
        if t._ctx is self:
            return t._v
        hit = self.captures.get(id(t))
        if hit is not None:
            return hit[1]
        if self.parent is None or t._ctx.closed and not self._encloses(t._ctx):
            raise TraceError(f"{user_frame()}: an array traced by another call (a tracer that "
                             "escaped its jit/grad/cond trace, e.g. stored in a global) was used "
                             "here; pass it in as an argument instead")
        if not self._encloses(t._ctx):
            raise TraceError(f"{user_frame()}: a tracer from an unrelated trace was used here")
        self.parent.value_of(t)          # the parent must have it too (it passes it in)
        v = self.b.input(f"capture{len(self.captures)}", t.shape, t.dtype.name)
        self.captures[id(t)] = (t, v)
        return v

    def _encloses(self, other: "TraceContext") -> bool:
        c = self.parent
        while c is not None:
            if c is other:
                return True
            c = c.parent
        return False

    def wrap(self, v: Value) -> "Tracer":
        return Tracer(self, v)


def current() -> TraceContext | None:
    """The innermost active trace context, or None outside any trace."""
    stack = getattr(_LOCAL, "stack", None)
    return stack[-1] if stack else None


def _ctx_for(operands) -> TraceContext:
    ctx = current()
    if ctx is None:
        t = next(o for o in operands if isinstance(o, Tracer))
        raise TraceError(f"{user_frame()}: a tracer was used after its trace ended (a traced value "
                         f"kept from a jit/grad call, shape {t.shape}); return it from the traced "
                         "function instead")
    return ctx


def is_weak(x) -> bool:
    """A Python scalar, which adopts the other operand's dtype (NEP 50)."""
    return isinstance(x, (bool, int, float)) and not isinstance(x, np.generic)


def dtype_of(x):
    """numpy dtype of an operand, or the Python type of a weak scalar (for resolve_dtypes)."""
    if isinstance(x, Tracer):
        return x.dtype
    if is_weak(x):
        return type(x)
    return np.asarray(x).dtype


def check_dtype(dt: np.dtype, what: str) -> np.dtype:
    if dt.name not in DTYPES:
        raise TraceError(f"{user_frame()}: {what} has dtype {dt.name}, which apollo_py does not "
                         f"support (supported: {', '.join(DTYPES)})")
    return dt


def output_values(ctx: TraceContext, leaves, copy_constants: bool = True) -> list:
    """Graph output values for a trace's output ``leaves``: a value returned twice, an input
    returned as it is, or (with ``copy_constants``) a non-tracer leaf gets a copy, so that every
    graph output is a value of its own."""
    from ..ops.compound import copy
    vals, seen = [], set()
    inputs = set(ctx.b._inputs)
    for o in leaves:
        v = to_value(ctx, o)
        if v.name in seen or v.name in inputs or (copy_constants and not isinstance(o, Tracer)):
            v = copy(ctx.b, v)
        seen.add(v.name)
        vals.append(v)
    return vals


def to_value(ctx: TraceContext, x, dtype=None) -> Value:
    """``x`` (tracer, array, scalar) as a Value of ``ctx``, cast to ``dtype`` when given."""
    if isinstance(x, Tracer):
        v = ctx.value_of(x)
    else:
        if isinstance(x, (list, tuple)) and any(isinstance(e, Tracer) for e in _leaves(x)):
            return to_value(ctx, RULES["stack"](list(x)), dtype)
        arr = np.asarray(x, dtype=dtype) if is_weak(x) and dtype is not None else np.asarray(x)
        if arr.dtype == object:
            raise TraceError(f"{user_frame()}: cannot use a {type(x).__name__} as an array operand")
        if arr.dtype.kind == "U" or arr.dtype.kind == "c":
            raise TraceError(f"{user_frame()}: arrays of dtype {arr.dtype} are not supported")
        if arr.dtype.name not in DTYPES:  # e.g. float128, datetime
            check_dtype(arr.dtype, "a constant")
        v = ctx.b.constant(arr)
    if dtype is not None and v.dtype != np.dtype(dtype).name:
        v = ctx.b.cast(v, to=np.dtype(dtype).name)
    return v


def _leaves(x):
    if isinstance(x, (list, tuple)):
        for e in x:
            yield from _leaves(e)
    else:
        yield x


class Tracer:
    """A traced array: shape and dtype known, value not.  Behaves like a read-only ndarray."""

    __slots__ = ("_ctx", "_v")
    __array_priority__ = 1000

    def __init__(self, ctx: TraceContext, value: Value):
        self._ctx, self._v = ctx, value

    # -- metadata ------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._v.type.shape)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(DTYPES[self._v.type.dtype])

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d array")
        return self.shape[0]

    def __repr__(self) -> str:
        return f"Tracer({self.dtype.name}{list(self.shape)}, {self._v.name})"

    __hash__ = object.__hash__

    # -- numpy protocols -----------------------------------------------------------------
    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        return RULES["ufunc"](ufunc, method, inputs, kwargs)

    def __array_function__(self, func, types, args, kwargs):
        return RULES["function"](func, args, kwargs)

    def __array__(self, dtype=None, copy=None):
        raise self._concrete("a numpy array (np.asarray / np.array)")

    def _concrete(self, what: str) -> TraceError:
        return TraceError(
            f"{user_frame()}: the traced function converts an array that depends on its inputs "
            f"(shape {self.shape}, {self.dtype.name}) to {what}; its value is unknown while "
            "tracing.  Python `if`/`while`/`and`/`or` on such a value cannot be recorded: use "
            "np.where(cond, a, b) (ap.where) to select elementwise, ap.cond(pred, true_fn, "
            "false_fn, *operands) for a branch, ap.fori_loop for a loop, or pass the value as a "
            "static argument (jit(fn, static_argnames=...))")

    def __bool__(self):
        raise self._concrete("a Python bool")

    def __int__(self):
        raise self._concrete("a Python int")

    def __float__(self):
        raise self._concrete("a Python float")

    def __complex__(self):
        raise self._concrete("a Python complex")

    def __index__(self):
        raise self._concrete("a Python index")

    def tolist(self):
        raise self._concrete("a Python list")

    def item(self, *a):
        raise self._concrete("a Python scalar (.item())")

    def __setitem__(self, key, value):
        raise TraceError(f"{user_frame()}: traced arrays are immutable (x[...] = v cannot be "
                         "recorded); build the result with np.where, np.concatenate or np.pad")

    def __iter__(self):
        for k in range(len(self)):
            yield self[k]

    # -- operators -----------------------------------------------------------------------
    def __add__(self, o): return np.add(self, o)
    def __radd__(self, o): return np.add(o, self)
    def __sub__(self, o): return np.subtract(self, o)
    def __rsub__(self, o): return np.subtract(o, self)
    def __mul__(self, o): return np.multiply(self, o)
    def __rmul__(self, o): return np.multiply(o, self)
    def __truediv__(self, o): return np.true_divide(self, o)
    def __rtruediv__(self, o): return np.true_divide(o, self)
    def __floordiv__(self, o): return np.floor_divide(self, o)
    def __rfloordiv__(self, o): return np.floor_divide(o, self)
    def __mod__(self, o): return np.remainder(self, o)
    def __rmod__(self, o): return np.remainder(o, self)
    def __pow__(self, o): return np.power(self, o)
    def __rpow__(self, o): return np.power(o, self)
    def __matmul__(self, o): return np.matmul(self, o)
    def __rmatmul__(self, o): return np.matmul(o, self)
    def __neg__(self): return np.negative(self)
    def __pos__(self): return self
    def __abs__(self): return np.absolute(self)
    def __invert__(self): return np.invert(self)
    def __and__(self, o): return np.bitwise_and(self, o)
    def __rand__(self, o): return np.bitwise_and(o, self)
    def __or__(self, o): return np.bitwise_or(self, o)
    def __ror__(self, o): return np.bitwise_or(o, self)
    def __xor__(self, o): return np.bitwise_xor(self, o)
    def __rxor__(self, o): return np.bitwise_xor(o, self)
    def __eq__(self, o): return np.equal(self, o)
    def __ne__(self, o): return np.not_equal(self, o)
    def __lt__(self, o): return np.less(self, o)
    def __le__(self, o): return np.less_equal(self, o)
    def __gt__(self, o): return np.greater(self, o)
    def __ge__(self, o): return np.greater_equal(self, o)

    def __iadd__(self, o): return self + o
    def __isub__(self, o): return self - o
    def __imul__(self, o): return self * o
    def __itruediv__(self, o): return self / o

    def __getitem__(self, key):
        return RULES["getitem"](self, key)

    # -- ndarray methods -----------------------------------------------------------------
    @property
    def T(self):
        return np.transpose(self)

    @property
    def mT(self):
        return np.swapaxes(self, -1, -2)

    def reshape(self, *shape, order="C"):
        if len(shape) == 1 and not isinstance(shape[0], int):
            shape = tuple(shape[0])
        return np.reshape(self, shape, order=order)

    def transpose(self, *axes):
        if len(axes) == 1 and not isinstance(axes[0], int):
            axes = tuple(axes[0]) if axes[0] is not None else ()
        return np.transpose(self, axes or None)

    def astype(self, dtype, copy=True):
        ctx = _ctx_for([self])
        dt = check_dtype(np.dtype(dtype), "astype's target")
        if dt == self.dtype:
            return self
        return ctx.wrap(ctx.b.cast(ctx.value_of(self), to=dt.name))

    def flatten(self, order="C"):
        return np.reshape(self, (-1,), order=order)

    ravel = flatten

    def squeeze(self, axis=None): return np.squeeze(self, axis)
    def swapaxes(self, a, b): return np.swapaxes(self, a, b)
    def sum(self, axis=None, dtype=None, keepdims=False): return np.sum(self, axis, dtype=dtype, keepdims=keepdims)
    def prod(self, axis=None, dtype=None, keepdims=False): return np.prod(self, axis, dtype=dtype, keepdims=keepdims)
    def mean(self, axis=None, dtype=None, keepdims=False): return np.mean(self, axis, dtype=dtype, keepdims=keepdims)
    def max(self, axis=None, keepdims=False): return np.max(self, axis, keepdims=keepdims)
    def min(self, axis=None, keepdims=False): return np.min(self, axis, keepdims=keepdims)
    def var(self, axis=None, ddof=0, keepdims=False): return np.var(self, axis, ddof=ddof, keepdims=keepdims)
    def std(self, axis=None, ddof=0, keepdims=False): return np.std(self, axis, ddof=ddof, keepdims=keepdims)
    def argmax(self, axis=None, keepdims=False): return np.argmax(self, axis, keepdims=keepdims)
    def argmin(self, axis=None, keepdims=False): return np.argmin(self, axis, keepdims=keepdims)
    def any(self, axis=None, keepdims=False): return np.any(self, axis, keepdims=keepdims)
    def all(self, axis=None, keepdims=False): return np.all(self, axis, keepdims=keepdims)
    def clip(self, min=None, max=None): return np.clip(self, min, max)
    def dot(self, o): return np.dot(self, o)
    def cumsum(self, axis=None): return np.cumsum(self, axis)
    def copy(self): return self


def check_static_shape(shape, what: str) -> tuple[int, ...]:
    out = []
    for d in shape:
        if isinstance(d, Tracer):
            raise d._concrete(f"a dimension of {what}")
        out.append(int(d))
    return tuple(out)


def shape_error(msg: str) -> ShapeError:
    return ShapeError(f"{user_frame()}: {msg}")
