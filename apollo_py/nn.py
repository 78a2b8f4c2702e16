"""Neural-network helpers for traced functions: ``ap.nn.softmax(x)`` and friends.

Each helper appends the same primitive decomposition the ONNX front end uses for the matching
ONNX op (:mod:`apollo_py.ops.compound`): a model written with ``ap.nn`` traces to the graph its
ONNX export imports to, and fuses the same way.  Called with numpy arrays outside a trace, a
helper runs its primitive graph through the numpy references and returns an array.

Layouts follow ONNX / PyTorch: ``conv2d`` and ``max_pool2d`` take NCHW inputs and OIHW weights.
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np

from .errors import ShapeError
from .frontend import trace_numpy  # noqa: F401  (fills trace.RULES)
from .frontend.trace import TraceContext, Tracer, current, to_value
from .ops import compound as C

__all__ = ["attention", "conv2d", "embedding", "gelu", "layer_norm", "log_softmax", "max_pool2d",
           "relu", "sigmoid", "softmax", "tanh"]


def _apply(name: str, build: Callable, *operands, like: int = 0):
    """Run ``build(b, *values)`` on the active trace, or eagerly on numpy operands.

    Float operands are cast to the dtype of operand ``like`` (numpy would promote a float64
    weight; ONNX requires one dtype, and so does the traced graph).  None passes through.
    """
    ctx = current()
    if ctx is None:
        from .runtime.reference import evaluate
        arrays = [None if a is None else np.asarray(a) for a in operands]
        with TraceContext(name) as sub:
            ins = [None if a is None else sub.input(f"x{k}", a.shape, a.dtype)
                   for k, a in enumerate(arrays)]
            out = _apply(name, build, *ins, like=like)
            g = sub.b.build([sub.value_of(out)], name=name)
        feeds = {f"x{k}": a for k, a in enumerate(arrays) if a is not None}
        return evaluate(g, feeds)[0]
    first = operands[like]
    dt = first.dtype if isinstance(first, Tracer) else np.asarray(first).dtype
    vals = []
    for k, a in enumerate(operands):
        if a is None:
            vals.append(None)
            continue
        adt = a.dtype if isinstance(a, Tracer) else np.asarray(a).dtype
        vals.append(to_value(ctx, a, dt if adt.kind == "f" and dt.kind == "f" else None))
    return ctx.wrap(build(ctx.b, *vals))


def softmax(x, axis: int = -1):
    """Softmax along ``axis`` (ONNX Softmax, opset >= 13)."""
    return _apply("softmax", lambda b, v: C.softmax(b, v, axis), x)


def log_softmax(x, axis: int = -1):
    """Log-softmax along ``axis`` (ONNX LogSoftmax, opset >= 13)."""
    return _apply("log_softmax", lambda b, v: C.log_softmax(b, v, axis), x)


def layer_norm(x, scale=None, bias=None, axis: int = -1, eps: float = 1e-5):
    """Layer normalisation over dims ``axis..`` (ONNX LayerNormalization; statistics in float32
    for float16 inputs, as ONNX's default stash_type).  ``scale`` defaults to ones."""
    if scale is None:
        shape = np.shape(x)[C.normalize_axis(axis, len(np.shape(x))):]
        scale = np.ones(shape, np.dtype(x.dtype))

    def build(b, v, s, bi):
        stash = "float32" if v.dtype == "float16" else v.dtype
        return C.layer_norm(b, v, s, bi, axis, eps, stash)[0]
    return _apply("layer_norm", build, x, scale, bias)


def gelu(x, approximate: bool | str = False):
    """GELU, exact (erf) or the tanh approximation (``approximate=True`` or ``"tanh"``)."""
    mode = "tanh" if approximate in (True, "tanh") else "none"
    return _apply("gelu", lambda b, v: C.gelu(b, v, mode), x)


def relu(x):
    """max(x, 0)."""
    return _apply("relu", lambda b, v: b.relu(v), x)


def sigmoid(x):
    """1 / (1 + exp(-x)), computed stably."""
    return _apply("sigmoid", lambda b, v: b.sigmoid(v), x)


def tanh(x):
    return _apply("tanh", lambda b, v: b.tanh(v), x)


def _pair(v, what: str) -> tuple[int, int]:
    t = (v, v) if isinstance(v, int) else tuple(int(e) for e in v)
    if len(t) != 2:
        raise ShapeError(f"{what} must be an int or a pair, got {v!r}")
    return t


def conv2d(x, weight, bias=None, stride=1, padding=0, dilation=1, groups: int = 1):
    """2-d convolution of an NCHW input with OIHW weights (ONNX Conv, PyTorch conv2d);
    ``padding``: int, (h, w), or (top, left, bottom, right)."""
    st, dl = _pair(stride, "stride"), _pair(dilation, "dilation")
    pads = (padding,) * 4 if isinstance(padding, int) else tuple(padding)
    if len(pads) == 2:
        pads = pads + pads
    if len(pads) != 4:
        raise ShapeError(f"padding must be an int, (h, w) or (top, left, bottom, right); got {padding!r}")

    def build(b, v, w, bi):
        if len(v.shape) != 4 or len(w.shape) != 4:
            raise ShapeError(f"conv2d needs NCHW input and OIHW weight, got {v.shape} and {w.shape}")
        y = b.conv(v, w, strides=st, pads=pads, dilations=dl, group=int(groups))
        if bi is not None:
            y = b.add(y, C.reshape(b, bi, (1, bi.shape[0], 1, 1)))
        return y
    return _apply("conv2d", build, x, weight, bias)


def max_pool2d(x, kernel_size, stride=None, padding=0, ceil_mode: bool = False):
    """Max pooling over the last two dims (ONNX MaxPool); stride defaults to the kernel size."""
    k = _pair(kernel_size, "kernel_size")
    st = _pair(stride if stride is not None else k, "stride")
    p = _pair(padding, "padding")
    return _apply("max_pool2d", lambda b, v: C.max_pool(b, v, k, st, (p[0], p[1], p[0], p[1]),
                                                        (1, 1), ceil_mode), x)


def embedding(ids, table):
    """Rows of ``table`` picked by integer ``ids`` (ONNX Gather on axis 0)."""
    return _apply("embedding", lambda b, i, t: b.gather(t, i, axis=0), ids, table, like=1)


def attention(q, k, v, mask=None, scale: float | None = None, causal: bool = False):
    """Scaled dot-product attention ``softmax(q k^T * scale [+ mask]) v`` over the last two dims.

    ``mask``: a bool array (True = attend) or an additive float array, broadcast against the
    scores; ``causal`` masks keys after each query.  ``scale`` defaults to 1/sqrt(head dim).
    """
    d = np.shape(q)[-1]
    s = np.asarray(1.0 / math.sqrt(d) if scale is None else scale, dtype=np.dtype(q.dtype))
    scores = np.matmul(q, np.swapaxes(k, -1, -2)) * s
    if causal:
        nq, nk = scores.shape[-2], scores.shape[-1]
        keep = np.tril(np.ones((nq, nk), bool), nk - nq)
        scores = np.where(keep, scores, np.asarray(-np.inf, scores.dtype))
    if mask is not None:
        if np.dtype(mask.dtype) == np.bool_:
            scores = np.where(mask, scores, np.asarray(-np.inf, scores.dtype))
        else:
            scores = scores + mask
    return np.matmul(softmax(scores, -1), v)
