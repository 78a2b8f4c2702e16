"""Loss functions as primitive graphs (appended to a builder).

* :func:`cross_entropy`: logits ``(B, C)`` float and integer labels ``(B,)`` -> mean over the
  batch of ``-log softmax(logits)[label]``, with the max-shifted (stable) log-softmax.
* :func:`mse`: mean over all elements of ``(pred - target)**2``.

Both return a rank-0 value of the logits' dtype.
"""
from __future__ import annotations

from ..errors import ShapeError
from ..ir.builder import GraphBuilder, Value
from ..ir.types import FLOAT_DTYPES, INT_DTYPES
from .graphs import reduce_all, scalar


def log_softmax(b: GraphBuilder, logits: Value, axis: int = -1) -> Value:
    """``logits - max - log(sum(exp(logits - max)))`` along ``axis``.

    The max only keeps ``exp`` in range: the result does not depend on it, so its gradient
    is zero and it is a ``stop_gradient`` (as in jax.nn.log_softmax); the backward graph then
    has no terms for the max (the cross-entropy gradient becomes ``softmax - onehot``, up to
    the batch scale, with nothing for the ties of the max)."""
    ax = axis % len(logits.shape)
    m = b.op("stop_gradient", b.reduce_max(logits, axes=(ax,), keepdims=True))[0]
    z = b.sub(logits, m)
    lse = b.log(b.reduce_sum(b.exp(z), axes=(ax,), keepdims=True))
    return b.sub(z, lse)


def one_hot(b: GraphBuilder, labels: Value, classes: int, dtype: str) -> Value:
    """``(B,)`` integer labels -> ``(B, classes)`` one-hot of ``dtype`` (out-of-range rows are 0)."""
    n = labels.shape[0]
    cls = b.iota(shape=(n, classes), axis=1, dtype=labels.dtype)
    col = b.reshape(labels, shape=(n, 1))
    return b.cast(b.eq(col, cls), to=dtype)


def cross_entropy(b: GraphBuilder, logits: Value, labels: Value) -> Value:
    """Mean softmax cross-entropy of ``(B, C)`` logits against ``(B,)`` int labels."""
    if len(logits.shape) != 2 or logits.dtype not in FLOAT_DTYPES:
        raise ShapeError(f"cross_entropy needs float logits of shape (batch, classes), got "
                         f"{logits.name!r}: {logits.type}")
    if labels.dtype not in INT_DTYPES or labels.shape != logits.shape[:1]:
        raise ShapeError(f"cross_entropy labels must be int32/int64 of shape {logits.shape[:1]}, "
                         f"got {labels.type}")
    n, c = logits.shape
    logp = log_softmax(b, logits, axis=1)
    picked = reduce_all(b, b.mul(one_hot(b, labels, c, logits.dtype), logp))
    return b.mul(picked, scalar(b, -1.0 / n, logits.dtype), name="loss")


def mse(b: GraphBuilder, pred: Value, target: Value) -> Value:
    """Mean over all elements of ``(pred - target)**2`` (target broadcast to pred's shape)."""
    if pred.dtype not in FLOAT_DTYPES or target.dtype != pred.dtype:
        raise ShapeError(f"mse needs float predictions and a target of the same dtype, got "
                         f"{pred.type} and {target.type}")
    d = b.sub(pred, target)
    size = max(1, d.type.size)
    return b.mul(reduce_all(b, b.mul(d, d)), scalar(b, 1.0 / size, pred.dtype), name="loss")


LOSSES = {"cross_entropy": cross_entropy, "mse": mse}
