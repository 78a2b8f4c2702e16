"""ONNX op converters: one function per ONNX op type (opsets 9-22), from a node to primitives.

A converter takes a :class:`~apollo_py.frontend.onnx.NodeContext` and returns the node's output
Values in order (None for outputs it does not produce).  Opset differences (attribute vs input
forms, changed defaults) are resolved here; the arithmetic lives in
:mod:`apollo_py.ops.compound`.
"""
from __future__ import annotations

from math import prod

import numpy as np

from ..errors import ShapeError, UnsupportedOpError
from ..ir.types import FLOAT_DTYPES
from ..options import check_memory
from ..ops import compound as C
from .converters import CONVERTERS, converter  # noqa: F401  (CONVERTERS: re-exported, filled below)
from .onnx import NodeContext, onnx_dtype


def convert_node(cx: NodeContext) -> list:
    """Lower ``cx.node``; UnsupportedOpError naming the node when no converter exists."""
    fn = CONVERTERS.get(cx.node.op_type)
    if fn is None:
        raise UnsupportedOpError(cx.node.op_type, cx.node.name, "no ONNX converter for this op type")
    outs = fn(cx)
    return outs if isinstance(outs, (list, tuple)) else [outs]


def supported_op_types() -> list[str]:
    """Sorted ONNX op types this front end converts."""
    return sorted(CONVERTERS)


# --- elementwise ---------------------------------------------------------------------------------

_BINARY = {"Add": "add", "Sub": "sub", "Mul": "mul", "Div": "div", "Equal": "eq", "Less": "lt",
           "LessOrEqual": "le", "Greater": "gt", "GreaterOrEqual": "ge", "And": "and", "Or": "or",
           "Xor": "xor"}
_UNARY = {"Neg": "neg", "Abs": "abs", "Exp": "exp", "Log": "log", "Sqrt": "sqrt",
          "Reciprocal": "reciprocal", "Tanh": "tanh", "Erf": "erf", "Sigmoid": "sigmoid",
          "Relu": "relu", "Floor": "floor", "Ceil": "ceil", "Not": "not"}


@converter(*_BINARY)
def _binary(cx):
    return cx.b.op(_BINARY[cx.node.op_type], cx.need(0), cx.need(1))[0]


@converter(*_UNARY)
def _unary(cx):
    return cx.b.op(_UNARY[cx.node.op_type], cx.need(0))[0]


# one-input ops without attributes that open into several primitives (ops/compound*.py)
_COMPOUND_UNARY = {"Identity": C.identity, "Sign": C.sign, "Softplus": C.softplus,
                   "Softsign": C.softsign, "Mish": C.mish, "GlobalAveragePool": C.global_average_pool,
                   "GlobalMaxPool": C.global_max_pool}


@converter(*_COMPOUND_UNARY)
def _compound_unary(cx):
    return _COMPOUND_UNARY[cx.node.op_type](cx.b, cx.need(0))


@converter("Pow")
def _pow(cx):
    x, y = cx.need(0), cx.need(1)
    return cx.b.pow(x, C.cast(cx.b, y, x.dtype))


@converter("Sum", "Max", "Min")
def _variadic(cx):
    return C.variadic(cx.b, {"Sum": "add", "Max": "max", "Min": "min"}[cx.node.op_type], cx.inputs())


@converter("Mean")
def _mean(cx):
    return C.mean(cx.b, cx.inputs())


@converter("Where")
def _where(cx):
    return cx.b.where(cx.need(0), cx.need(1), cx.need(2))


def _to_dtype(cx, code) -> str:
    """apollo dtype for ONNX element type ``code``; UnsupportedOpError naming the node if none."""
    try:
        return onnx_dtype(code, "the target type")
    except ShapeError as e:
        raise cx.unsupported(str(e)) from None


@converter("Cast")
def _cast(cx):
    return C.cast(cx.b, cx.need(0), _to_dtype(cx, cx.attr("to")))


@converter("CastLike")
def _cast_like(cx):
    return C.cast(cx.b, cx.need(0), cx.need(1).dtype)


@converter("Dropout")
def _dropout(cx):
    x = cx.need(0)
    training = cx.attr("is_test", 1) == 0 if cx.opset < 7 else False
    if cx.has(2):
        training = bool(np.asarray(cx.const(2)).reshape(-1)[0])
    ratio = float(np.asarray(cx.const(1)).reshape(-1)[0]) if cx.has(1) else cx.attr("ratio", 0.5)
    if training and ratio != 0.0:
        raise cx.unsupported("training-mode dropout (random masks) is not supported")
    outs = [C.dropout(cx.b, x), None]
    if cx.wants(1):
        outs[1] = cx.b.constant(np.ones(x.shape, dtype=bool))
    return outs


@converter("IsNaN")
def _isnan(cx):
    x = cx.need(0)
    return cx.b.ne(x, x)


@converter("IsInf")
def _isinf(cx):
    x = cx.need(0)
    inf = C.scalar(cx.b, np.inf, x.dtype)
    pos, neg = cx.attr("detect_positive", 1), cx.attr("detect_negative", 1)
    if pos and neg:
        return cx.b.eq(cx.b.abs(x), inf)
    if pos:
        return cx.b.eq(x, inf)
    if neg:
        return cx.b.eq(x, cx.b.neg(inf))
    return cx.b.constant(np.zeros(x.shape, dtype=bool))


# --- activations ----------------------------------------------------------------------------------


@converter("Clip")
def _clip(cx):
    x = cx.need(0)
    if cx.opset < 11:
        info = np.finfo(np.float32)
        lo = C.scalar(cx.b, cx.attr("min", float(info.min)), x.dtype)
        hi = C.scalar(cx.b, cx.attr("max", float(info.max)), x.dtype)
        return C.clip(cx.b, x, lo, hi)
    return C.clip(cx.b, x, cx.x(1), cx.x(2))


@converter("HardSigmoid")
def _hard_sigmoid(cx):
    return C.hard_sigmoid(cx.b, cx.need(0), cx.attr("alpha", 0.2), cx.attr("beta", 0.5))


@converter("HardSwish")
def _hard_swish(cx):
    return C.hard_swish(cx.b, cx.need(0))


@converter("LeakyRelu")
def _leaky_relu(cx):
    return C.leaky_relu(cx.b, cx.need(0), cx.attr("alpha", 0.01))


@converter("PRelu")
def _prelu(cx):
    return C.prelu(cx.b, cx.need(0), cx.need(1))


@converter("ThresholdedRelu")
def _thresholded_relu(cx):
    return C.thresholded_relu(cx.b, cx.need(0), cx.attr("alpha", 1.0))


@converter("Elu")
def _elu(cx):
    return C.elu(cx.b, cx.need(0), cx.attr("alpha", 1.0))


@converter("Selu")
def _selu(cx):
    return C.selu(cx.b, cx.need(0), cx.attr("alpha", 1.67326319217681884765625),
                  cx.attr("gamma", 1.05070102214813232421875))


@converter("Celu")
def _celu(cx):
    return C.celu(cx.b, cx.need(0), cx.attr("alpha", 1.0))


@converter("Gelu")
def _gelu(cx):
    return C.gelu(cx.b, cx.need(0), cx.attr("approximate", "none"))


@converter("Softmax", "LogSoftmax")
def _softmax(cx):
    fn = C.softmax if cx.node.op_type == "Softmax" else C.log_softmax
    x = cx.need(0)
    if cx.opset < 13:
        return C.coerced_2d(cx.b, x, cx.attr("axis", 1), fn)
    return fn(cx.b, x, cx.attr("axis", -1))


@converter("Shrink")
def _shrink(cx):
    return C.shrink(cx.b, cx.need(0), cx.attr("lambd", 0.5), cx.attr("bias", 0.0))


# --- normalisation --------------------------------------------------------------------------------


@converter("LayerNormalization")
def _layer_norm(cx):
    x = cx.need(0)
    stash = cx.attr("stash_type", 1)
    y, mean, inv = C.layer_norm(cx.b, x, cx.need(1), cx.x(2), cx.attr("axis", -1),
                                cx.attr("epsilon", 1e-5), _to_dtype(cx, stash))
    return [y, mean, inv]


@converter("BatchNormalization")
def _batch_norm(cx):
    training = cx.attr("training_mode", 0) if cx.opset >= 14 else any(cx.wants(k) for k in range(1, cx.n_out))
    if training:
        raise cx.unsupported("training-mode batch normalization (batch statistics) is not supported")
    x, scale, bias, mean, var = (cx.need(k) for k in range(5))
    return C.batch_norm_inference(cx.b, x, scale, bias, mean, var, cx.attr("epsilon", 1e-5))


@converter("InstanceNormalization")
def _instance_norm(cx):
    return C.instance_norm(cx.b, cx.need(0), cx.need(1), cx.need(2), cx.attr("epsilon", 1e-5))


@converter("MeanVarianceNormalization")
def _mvn(cx):
    return C.mean_variance_norm(cx.b, cx.need(0), cx.attr("axes", [0, 2, 3]))


@converter("GroupNormalization")
def _group_norm(cx):
    x = cx.need(0)
    per_channel = cx.opset >= 21
    stash = _to_dtype(cx, cx.attr("stash_type", 1)) if per_channel else None
    return C.group_norm(cx.b, x, cx.need(1), cx.need(2), int(cx.attr("num_groups")),
                        cx.attr("epsilon", 1e-5), per_channel, stash)


@converter("LpNormalization")
def _lp_norm(cx):
    return C.lp_normalize(cx.b, cx.need(0), cx.attr("axis", -1), cx.attr("p", 2))


@converter("LRN")
def _lrn(cx):
    return C.lrn(cx.b, cx.need(0), int(cx.attr("size")), cx.attr("alpha", 1e-4), cx.attr("beta", 0.75),
                 cx.attr("bias", 1.0))


# --- reductions -----------------------------------------------------------------------------------

_REDUCE = {
    "ReduceSum": lambda b, x, a, k: C.reduce(b, "sum", x, a, k),
    "ReduceMax": lambda b, x, a, k: C.reduce(b, "max", x, a, k),
    "ReduceMin": lambda b, x, a, k: C.reduce(b, "min", x, a, k),
    "ReduceProd": lambda b, x, a, k: C.reduce(b, "prod", x, a, k),
    "ReduceMean": C.reduce_mean,
    "ReduceSumSquare": C.reduce_sum_square,
    "ReduceL1": C.reduce_l1,
    "ReduceL2": C.reduce_l2,
    "ReduceLogSum": C.reduce_log_sum,
    "ReduceLogSumExp": C.reduce_log_sum_exp,
}


@converter(*_REDUCE)
def _reduce(cx):
    x = cx.need(0)
    keep = bool(cx.attr("keepdims", 1))
    axes = cx.ints(1) if cx.has(1) else cx.attr("axes")
    if not axes:
        if cx.attr("noop_with_empty_axes", 0):
            return x
        axes = None
    return _REDUCE[cx.node.op_type](cx.b, x, axes, keep)


# --- pooling and convolution ---------------------------------------------------------------------


def _geometry(cx, in_spatial, kernel):
    """strides, pads (begins..., ends...) and dilations of a conv/pool node, auto_pad resolved."""
    n = len(kernel)
    strides = list(cx.attr("strides", [1] * n))
    dil = list(cx.attr("dilations", [1] * n))
    pads = list(cx.attr("pads", [0] * 2 * n))
    if len(strides) != n or len(dil) != n or len(pads) != 2 * n:
        raise cx.error(f"strides {strides}, dilations {dil} and pads {pads} do not fit a {n}-d kernel")
    auto = cx.attr("auto_pad", "NOTSET")
    if auto in ("SAME_UPPER", "SAME_LOWER"):
        for s in range(n):
            eff = dil[s] * (kernel[s] - 1) + 1
            out = -(-in_spatial[s] // strides[s])
            total = max((out - 1) * strides[s] + eff - in_spatial[s], 0)
            lo = total // 2 if auto == "SAME_UPPER" else (total + 1) // 2
            pads[s], pads[n + s] = lo, total - lo
    elif auto == "VALID":
        pads = [0] * 2 * n
    elif auto != "NOTSET":
        raise cx.error(f"unknown auto_pad {auto!r}")
    return tuple(strides), tuple(pads), tuple(dil)


def _pool_input(cx):
    x = cx.need(0)
    kernel = [int(k) for k in cx.attr("kernel_shape", [])]
    if not kernel or x.type.rank != len(kernel) + 2:
        raise cx.error(f"kernel_shape {kernel} does not fit input shape {x.shape} (N, C, spatial...)")
    return x, kernel


@converter("MaxPool")
def _max_pool(cx):
    if cx.wants(1):
        raise cx.unsupported("the Indices output of MaxPool is not supported")
    x, kernel = _pool_input(cx)
    st, pads, dil = _geometry(cx, x.shape[2:], kernel)
    return [C.max_pool(cx.b, x, kernel, st, pads, dil, bool(cx.attr("ceil_mode", 0))), None]


@converter("AveragePool")
def _avg_pool(cx):
    x, kernel = _pool_input(cx)
    st, pads, dil = _geometry(cx, x.shape[2:], kernel)
    return C.avg_pool(cx.b, x, kernel, st, pads, dil, bool(cx.attr("ceil_mode", 0)),
                      bool(cx.attr("count_include_pad", 0)))


@converter("Conv")
def _conv(cx):
    x, w = cx.need(0), cx.need(1)
    if x.type.rank < 3 or w.type.rank != x.type.rank:
        raise cx.error(f"input {x.shape} and weight {w.shape} must have equal rank >= 3")
    kernel = [int(k) for k in cx.attr("kernel_shape", w.shape[2:])]
    if tuple(kernel) != tuple(w.shape[2:]):
        raise cx.error(f"kernel_shape {kernel} differs from the weight's spatial dims {w.shape[2:]}")
    st, pads, dil = _geometry(cx, x.shape[2:], kernel)
    y = cx.b.conv(x, w, strides=st, pads=pads, dilations=dil, group=int(cx.attr("group", 1)))
    bias = cx.x(2)
    if bias is not None:
        y = cx.b.add(y, C.reshape(cx.b, bias, (1, bias.shape[0]) + (1,) * (x.type.rank - 2)))
    return y


@converter("MatMul")
def _matmul(cx):
    return cx.b.matmul(cx.need(0), cx.need(1))


@converter("Gemm")
def _gemm(cx):
    return C.gemm(cx.b, cx.need(0), cx.need(1), cx.x(2), cx.attr("alpha", 1.0), cx.attr("beta", 1.0),
                  bool(cx.attr("transA", 0)), bool(cx.attr("transB", 0)))


# --- shapes and constants ---------------------------------------------------------------------------


@converter("Constant")
def _constant(cx):
    a = cx.node.attrs
    if "value" in a:
        arr = np.asarray(a["value"])
    elif "value_float" in a:
        arr = np.array(a["value_float"], np.float32)
    elif "value_floats" in a:
        arr = np.array(a["value_floats"], np.float32)
    elif "value_int" in a:
        arr = np.array(a["value_int"], np.int64)
    elif "value_ints" in a:
        arr = np.array(a["value_ints"], np.int64)
    else:
        raise cx.unsupported(f"Constant with attribute(s) {sorted(a)} (strings, sparse tensors) "
                             "is not supported")
    if arr.dtype.name not in {"float32", "float16", "float64", "int32", "int64", "bool"}:
        raise cx.unsupported(f"constant of dtype {arr.dtype.name} is not supported")
    return cx.b.constant(arr)


@converter("Shape")
def _shape(cx):
    shape = cx.need(0).shape
    r = len(shape)
    start, end = cx.attr("start", 0), cx.attr("end", r)
    start = min(max(start + r if start < 0 else start, 0), r)
    end = min(max(end + r if end < 0 else end, 0), r)
    return cx.b.constant(np.array(shape[start:end], np.int64))


@converter("Size")
def _size(cx):
    return cx.b.constant(np.array(prod(cx.need(0).shape), np.int64))


@converter("ConstantOfShape")
def _constant_of_shape(cx):
    shape = cx.ints(0)
    value = cx.attr("value")
    value = np.zeros(1, np.float32) if value is None else np.asarray(value).reshape(-1)
    if value.dtype.name not in {"float32", "float16", "float64", "int32", "int64", "bool"}:
        raise cx.unsupported(f"value of dtype {value.dtype.name} is not supported")
    if any(d < 0 for d in shape):
        raise cx.error(f"negative dimension in shape {shape}")
    check_memory(prod(shape) * value.dtype.itemsize, f"ConstantOfShape of shape {shape}",
                 cx.lowering.options)       # before np.full allocates it
    return cx.b.constant(np.full(shape, value[0], dtype=value.dtype))


@converter("Range")
def _range(cx):
    start, limit, delta = (np.asarray(cx.const(k)).reshape(()) for k in range(3))
    n = max(int(np.ceil((float(limit) - float(start)) / float(delta))), 0)
    check_memory(n * start.dtype.itemsize, f"Range of {n} elements", cx.lowering.options)
    out = (start + np.arange(n, dtype=start.dtype) * delta).astype(start.dtype)
    return cx.b.constant(out)


@converter("Reshape")
def _reshape(cx):
    x = cx.need(0)
    shape = cx.ints(1) if cx.opset >= 5 else list(cx.attr("shape"))
    allowzero = cx.attr("allowzero", 0)
    out = []
    for k, d in enumerate(shape):
        if d == 0 and not allowzero:
            if k >= x.type.rank:
                raise cx.error(f"shape {shape} copies dim {k} (0) but the input {x.shape} has rank {x.type.rank}")
            d = x.shape[k]
        out.append(d)
    if out.count(-1) > 1:
        raise cx.error(f"shape {shape} has more than one -1")
    if -1 in out:
        known = prod(d for d in out if d != -1)
        if known == 0 or x.type.size % known:
            raise cx.error(f"cannot reshape {x.shape} to {shape}")
        out[out.index(-1)] = x.type.size // known
    if any(d < 0 for d in out) or prod(out) != x.type.size:
        raise cx.error(f"cannot reshape {x.shape} ({x.type.size} elements) to {shape}")
    return C.reshape(cx.b, x, out)


@converter("Flatten")
def _flatten(cx):
    return C.flatten(cx.b, cx.need(0), cx.attr("axis", 1))


@converter("Squeeze")
def _squeeze(cx):
    axes = cx.ints(1) if cx.opset >= 13 else cx.attr("axes")
    return C.squeeze(cx.b, cx.need(0), axes if axes else None)


@converter("Unsqueeze")
def _unsqueeze(cx):
    axes = cx.ints(1) if cx.opset >= 13 else cx.attr("axes")
    if not axes:
        raise cx.error("Unsqueeze needs axes")
    return C.unsqueeze(cx.b, cx.need(0), axes)


@converter("Expand")
def _expand(cx):
    return C.expand(cx.b, cx.need(0), cx.ints(1))


@converter("Tile")
def _tile(cx):
    return C.tile(cx.b, cx.need(0), cx.ints(1))


@converter("Transpose")
def _transpose(cx):
    x = cx.need(0)
    perm = cx.attr("perm") or list(range(x.type.rank))[::-1]
    perm = tuple(int(p) for p in perm)
    if perm == tuple(range(x.type.rank)):
        return x
    return cx.b.transpose(x, perm=perm)


@converter("Concat")
def _concat(cx):
    xs = cx.inputs()
    axis = C.normalize_axis(cx.attr("axis"), xs[0].type.rank)
    return xs[0] if len(xs) == 1 else cx.b.concat(*xs, axis=axis)


@converter("Split")
def _split(cx):
    x = cx.need(0)
    axis = C.normalize_axis(cx.attr("axis", 0), x.type.rank)
    sizes = cx.ints(1) if (cx.opset >= 13 and cx.has(1)) else cx.attr("split")
    if not sizes:
        n = cx.attr("num_outputs", cx.n_out) if cx.opset >= 18 else cx.n_out
        if cx.opset < 18 and x.shape[axis] % n:
            raise cx.error(f"dim {axis} of {x.shape} does not split evenly into {n} outputs")
        sizes = C.even_split_sizes(x.shape[axis], n)
    if len(sizes) != cx.n_out:
        raise cx.error(f"{len(sizes)} split sizes for {cx.n_out} outputs")
    return C.split(cx.b, x, sizes, axis)


@converter("Slice")
def _slice(cx):
    x = cx.need(0)
    if cx.opset < 10:
        starts, ends, axes, steps = cx.attr("starts"), cx.attr("ends"), cx.attr("axes"), None
    else:
        starts, ends, axes, steps = cx.ints(1), cx.ints(2), cx.ints(3), cx.ints(4)
    return C.slice_(cx.b, x, starts, ends, axes, steps)


@converter("Gather")
def _gather(cx):
    x, idx = cx.need(0), cx.need(1)
    return cx.b.gather(x, idx, axis=C.normalize_axis(cx.attr("axis", 0), x.type.rank))


@converter("Pad")
def _pad(cx):
    x = cx.need(0)
    r = x.type.rank
    mode = cx.attr("mode", "constant")
    if cx.opset < 11:
        pads, value = list(cx.attr("pads")), cx.attr("value", 0.0)
    else:
        pads = cx.ints(1)
        cv = cx.const(2)
        value = np.asarray(cv).reshape(-1)[0].item() if cv is not None and np.asarray(cv).size else 0
        axes = cx.ints(3)
        if axes is not None:
            axes = [C.normalize_axis(a, r) for a in axes]
            if len(pads) != 2 * len(axes):
                raise cx.error(f"pads {pads} need 2 values per axis of {axes}")
            full = [0] * 2 * r
            for k, a in enumerate(axes):
                full[a], full[r + a] = pads[k], pads[len(axes) + k]
            pads = full
    if len(pads) != 2 * r:
        raise cx.error(f"pads {pads} need {2 * r} values for input shape {x.shape}")
    if mode not in ("constant", "reflect", "edge", "wrap"):
        raise cx.unsupported(f"pad mode {mode!r}")
    if x.dtype == "bool":
        value = bool(value)
    elif x.dtype not in FLOAT_DTYPES:
        value = int(value)
    else:
        value = float(value)
    if all(p == 0 for p in pads):
        return x
    return cx.b.pad(x, pads=tuple(int(p) for p in pads), mode=mode, value=value)


from . import onnx_ops_index  # noqa: E402,F401  (registers the index, einsum and resize converters)
from . import onnx_ops_rnn  # noqa: E402,F401  (registers the LSTM, GRU and RNN converters)
