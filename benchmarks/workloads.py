"""Benchmark workloads: each one an ONNX model (opset 17) plus a plain-numpy twin.

Every builder returns a :class:`Workload`, which unpacks as the 6-tuple
``(name, model, inputs, numpy_fn, compulsory_bytes, flops)``:

* ``model`` -- an ``onnx.ModelProto`` built with ``onnx.helper`` (opset 17), so onnxruntime
  and apollo_py run exactly the same graph;
* ``inputs`` -- ``dict[str, np.ndarray]`` of the run-time inputs (activations, indices);
  parameters (weights, biases, tables) are initializers of the model, and ``numpy_fn``
  closes over the very same arrays;
* ``numpy_fn(**inputs)`` -- a plain-numpy implementation returning the output (or a list of
  outputs, in the model's output order);
* ``compulsory_bytes`` -- bytes of all inputs, initializers and outputs: what must cross memory
  at least once per call;
* ``flops`` -- arithmetic operations per call (2*M*N*K for a matmul; about one per element per
  primitive elementwise/reduce step, transcendental functions counted as one).

``quick=True`` gives small sizes for a smoke run.
"""
from __future__ import annotations

import math
from typing import Callable, NamedTuple

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
F32 = TensorProto.FLOAT
I64 = TensorProto.INT64


class Workload(NamedTuple):
    name: str
    model: onnx.ModelProto
    inputs: dict
    numpy_fn: Callable
    compulsory_bytes: int
    flops: float


# --------------------------------------------------------------------------------------------
# helpers

def _rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def _randn(rng, *shape, scale=1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def _vi(name: str, arr_or_shape, elem=F32):
    shape = arr_or_shape.shape if isinstance(arr_or_shape, np.ndarray) else arr_or_shape
    return helper.make_tensor_value_info(name, elem, list(shape))


def _init(name: str, arr: np.ndarray):
    return numpy_helper.from_array(np.ascontiguousarray(arr), name=name)


def _model(name: str, nodes, inputs: dict, outputs: dict, inits: dict) -> onnx.ModelProto:
    """``inputs``/``outputs``: name -> array or shape (outputs are float32)."""
    in_vis = [_vi(k, v, I64 if isinstance(v, np.ndarray) and v.dtype == np.int64 else F32)
              for k, v in inputs.items()]
    out_vis = [_vi(k, v) for k, v in outputs.items()]
    graph = helper.make_graph(nodes, name, in_vis, out_vis,
                              initializer=[_init(k, v) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                              producer_name="apollo_py-benchmarks")
    model.ir_version = 8  # opset 17 era; accepted by every onnxruntime >= 1.13
    onnx.checker.check_model(model)
    return model


def _nbytes(*arrays) -> int:
    return int(sum(a.nbytes for a in arrays))


def _out_bytes(*shapes) -> int:
    return int(sum(4 * math.prod(s) for s in shapes))


def _layernorm_np(x, scale, bias, eps=1e-5):
    mean = x.mean(axis=-1, keepdims=True)
    d = x - mean
    var = np.mean(d * d, axis=-1, keepdims=True)
    return d / np.sqrt(var + eps) * scale + bias


def _softmax_np(x, axis=-1):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


GELU_C = math.sqrt(2.0 / math.pi)


def _gelu_tanh_np(y):
    return 0.5 * y * (1.0 + np.tanh(np.float32(GELU_C) * (y + np.float32(0.044715) * y * y * y)))


def _gelu_nodes(x: str, out: str, prefix: str) -> tuple[list, dict]:
    """GELU, tanh form, from opset-17 primitives: 0.5*x*(1+tanh(c*(x+0.044715*x^3)))."""
    p = prefix
    inits = {f"{p}_three": np.array(3.0, np.float32), f"{p}_k": np.array(0.044715, np.float32),
             f"{p}_c": np.array(GELU_C, np.float32), f"{p}_one": np.array(1.0, np.float32),
             f"{p}_half": np.array(0.5, np.float32)}
    nodes = [
        helper.make_node("Pow", [x, f"{p}_three"], [f"{p}_cube"]),
        helper.make_node("Mul", [f"{p}_cube", f"{p}_k"], [f"{p}_kc"]),
        helper.make_node("Add", [x, f"{p}_kc"], [f"{p}_inner"]),
        helper.make_node("Mul", [f"{p}_inner", f"{p}_c"], [f"{p}_scaled"]),
        helper.make_node("Tanh", [f"{p}_scaled"], [f"{p}_t"]),
        helper.make_node("Add", [f"{p}_t", f"{p}_one"], [f"{p}_t1"]),
        helper.make_node("Mul", [x, f"{p}_half"], [f"{p}_hx"]),
        helper.make_node("Mul", [f"{p}_hx", f"{p}_t1"], [out]),
    ]
    return nodes, inits


GELU_FLOPS_PER_ELEM = 9  # x^3 (2), *k, +x, *c, tanh, +1, *0.5, *


# --------------------------------------------------------------------------------------------
# workloads

def layernorm(quick: bool = False) -> Workload:
    n, d = (512, 768) if quick else (8192, 768)
    rng = _rng(1)
    x = _randn(rng, n, d)
    scale = _randn(rng, d, scale=0.5) + np.float32(1.0)
    bias = _randn(rng, d, scale=0.1)
    node = helper.make_node("LayerNormalization", ["x", "scale", "bias"], ["y"], axis=-1, epsilon=1e-5)
    model = _model("layernorm", [node], {"x": x}, {"y": (n, d)}, {"scale": scale, "bias": bias})

    def numpy_fn(x):
        return _layernorm_np(x, scale, bias)

    return Workload(f"layernorm[{n},{d}]", model, {"x": x}, numpy_fn,
                    _nbytes(x, scale, bias) + _out_bytes((n, d)), 8.0 * n * d)


def _softmax_like(op: str, quick: bool) -> Workload:
    shape = (48, 128, 128) if quick else (768, 128, 128)
    rng = _rng(2)
    x = _randn(rng, *shape, scale=2.0)
    node = helper.make_node(op, ["x"], ["y"], axis=-1)
    model = _model(op.lower(), [node], {"x": x}, {"y": shape}, {})

    if op == "Softmax":
        def numpy_fn(x):
            return _softmax_np(x, -1)
    else:
        def numpy_fn(x):
            s = x - x.max(axis=-1, keepdims=True)
            return s - np.log(np.exp(s).sum(axis=-1, keepdims=True))

    n = math.prod(shape)
    name = f"{op.lower()}[{','.join(map(str, shape))}]"
    return Workload(name, model, {"x": x}, numpy_fn, _nbytes(x) + _out_bytes(shape),
                    (5.0 if op == "Softmax" else 6.0) * n)


def softmax(quick: bool = False) -> Workload:
    return _softmax_like("Softmax", quick)


def logsoftmax(quick: bool = False) -> Workload:
    return _softmax_like("LogSoftmax", quick)


def bias_gelu(quick: bool = False) -> Workload:
    n, d = (512, 3072) if quick else (8192, 3072)
    rng = _rng(3)
    x = _randn(rng, n, d)
    bias = _randn(rng, d, scale=0.1)
    gnodes, ginits = _gelu_nodes("xb", "y", "g")
    nodes = [helper.make_node("Add", ["x", "bias"], ["xb"])] + gnodes
    model = _model("bias_gelu", nodes, {"x": x}, {"y": (n, d)}, {"bias": bias, **ginits})

    def numpy_fn(x):
        return _gelu_tanh_np(x + bias)

    return Workload(f"bias_gelu_tanh[{n},{d}]", model, {"x": x}, numpy_fn,
                    _nbytes(x, bias) + _out_bytes((n, d)), (1 + GELU_FLOPS_PER_ELEM) * n * d)


def bias_maxpool(quick: bool = False) -> Workload:
    """Seed listing 1: a = a + bias; pool = 2x2/stride-2 max pool (per-channel bias)."""
    n, c, h, w = (1, 16, 64, 64) if quick else (1, 64, 224, 224)
    rng = _rng(4)
    x = _randn(rng, n, c, h, w)
    bias = _randn(rng, 1, c, 1, 1, scale=0.1)
    nodes = [helper.make_node("Add", ["x", "bias"], ["xb"]),
             helper.make_node("MaxPool", ["xb"], ["y"], kernel_shape=[2, 2], strides=[2, 2])]
    oshape = (n, c, h // 2, w // 2)
    model = _model("bias_maxpool", nodes, {"x": x}, {"y": oshape}, {"bias": bias})

    def numpy_fn(x):
        a = x + bias
        return a.reshape(n, c, h // 2, 2, w // 2, 2).max(axis=(3, 5))

    return Workload(f"bias_maxpool2x2[{n},{c},{h},{w}]", model, {"x": x}, numpy_fn,
                    _nbytes(x, bias) + _out_bytes(oshape), 1.0 * x.size + 0.75 * x.size)


def bias_reducesum(quick: bool = False) -> Workload:
    """Seed listing 3: a = a + bias; b(i,k) = sum_{j,l} a(i,j,k,l) (per-channel bias)."""
    shape = (4, 16, 32, 32) if quick else (32, 64, 64, 64)
    m, nn, p, q = shape
    rng = _rng(5)
    x = _randn(rng, *shape)
    bias = _randn(rng, 1, nn, 1, 1, scale=0.1)
    axes = np.array([1, 3], np.int64)
    nodes = [helper.make_node("Add", ["x", "bias"], ["xb"]),
             helper.make_node("ReduceSum", ["xb", "axes"], ["y"], keepdims=0)]
    model = _model("bias_reducesum", nodes, {"x": x}, {"y": (m, p)}, {"bias": bias, "axes": axes})

    def numpy_fn(x):
        return (x + bias).sum(axis=(1, 3))

    return Workload(f"bias_reducesum13[{','.join(map(str, shape))}]", model, {"x": x}, numpy_fn,
                    _nbytes(x, bias) + _out_bytes((m, p)), 2.0 * x.size)


def bert_layer(quick: bool = False) -> Workload:
    """One post-LN BERT-base encoder layer with explicit softmax attention and tanh GELU."""
    if quick:
        b, s, h, heads, ffn = 2, 64, 256, 4, 1024
    else:
        b, s, h, heads, ffn = 8, 128, 768, 12, 3072
    dh = h // heads
    rng = _rng(6)
    x = _randn(rng, b, s, h)
    sc = 0.02
    p = {
        "wq": _randn(rng, h, h, scale=sc), "bq": _randn(rng, h, scale=sc),
        "wk": _randn(rng, h, h, scale=sc), "bk": _randn(rng, h, scale=sc),
        "wv": _randn(rng, h, h, scale=sc), "bv": _randn(rng, h, scale=sc),
        "wo": _randn(rng, h, h, scale=sc), "bo": _randn(rng, h, scale=sc),
        "ln1_g": _randn(rng, h, scale=0.1) + np.float32(1), "ln1_b": _randn(rng, h, scale=0.1),
        "w1": _randn(rng, h, ffn, scale=sc), "b1": _randn(rng, ffn, scale=sc),
        "w2": _randn(rng, ffn, h, scale=sc), "b2": _randn(rng, h, scale=sc),
        "ln2_g": _randn(rng, h, scale=0.1) + np.float32(1), "ln2_b": _randn(rng, h, scale=0.1),
    }
    consts = {
        "shape_heads": np.array([b, s, heads, dh], np.int64),
        "shape_merge": np.array([b, s, h], np.int64),
        "inv_sqrt_dh": np.array(1.0 / math.sqrt(dh), np.float32),
    }
    N = helper.make_node
    nodes = []
    for t in "qkv":
        nodes += [N("MatMul", ["x", f"w{t}"], [f"{t}_mm"]),
                  N("Add", [f"{t}_mm", f"b{t}"], [f"{t}_lin"]),
                  N("Reshape", [f"{t}_lin", "shape_heads"], [f"{t}_4d"])]
    nodes += [
        N("Transpose", ["q_4d"], ["q_h"], perm=[0, 2, 1, 3]),   # [b, heads, s, dh]
        N("Transpose", ["k_4d"], ["k_ht"], perm=[0, 2, 3, 1]),  # [b, heads, dh, s]
        N("Transpose", ["v_4d"], ["v_h"], perm=[0, 2, 1, 3]),   # [b, heads, s, dh]
        N("MatMul", ["q_h", "k_ht"], ["scores"]),
        N("Mul", ["scores", "inv_sqrt_dh"], ["scores_s"]),
        N("Softmax", ["scores_s"], ["probs"], axis=-1),
        N("MatMul", ["probs", "v_h"], ["ctx_h"]),
        N("Transpose", ["ctx_h"], ["ctx_t"], perm=[0, 2, 1, 3]),
        N("Reshape", ["ctx_t", "shape_merge"], ["ctx"]),
        N("MatMul", ["ctx", "wo"], ["o_mm"]),
        N("Add", ["o_mm", "bo"], ["o_lin"]),
        N("Add", ["o_lin", "x"], ["res1"]),
        N("LayerNormalization", ["res1", "ln1_g", "ln1_b"], ["h1"], axis=-1, epsilon=1e-12),
        N("MatMul", ["h1", "w1"], ["f1_mm"]),
        N("Add", ["f1_mm", "b1"], ["f1"]),
    ]
    gnodes, ginits = _gelu_nodes("f1", "f1_act", "gelu")
    nodes += gnodes
    nodes += [
        N("MatMul", ["f1_act", "w2"], ["f2_mm"]),
        N("Add", ["f2_mm", "b2"], ["f2"]),
        N("Add", ["f2", "h1"], ["res2"]),
        N("LayerNormalization", ["res2", "ln2_g", "ln2_b"], ["y"], axis=-1, epsilon=1e-12),
    ]
    model = _model("bert_layer", nodes, {"x": x}, {"y": (b, s, h)}, {**p, **consts, **ginits})

    def numpy_fn(x):
        def heads_of(t):
            return t.reshape(b, s, heads, dh).transpose(0, 2, 1, 3)
        q = heads_of(x @ p["wq"] + p["bq"])
        k = heads_of(x @ p["wk"] + p["bk"])
        v = heads_of(x @ p["wv"] + p["bv"])
        probs = _softmax_np((q @ k.transpose(0, 1, 3, 2)) * np.float32(1.0 / math.sqrt(dh)), -1)
        ctx = (probs @ v).transpose(0, 2, 1, 3).reshape(b, s, h)
        h1 = _layernorm_np(ctx @ p["wo"] + p["bo"] + x, p["ln1_g"], p["ln1_b"], 1e-12)
        f = _gelu_tanh_np(h1 @ p["w1"] + p["b1"])
        return _layernorm_np(f @ p["w2"] + p["b2"] + h1, p["ln2_g"], p["ln2_b"], 1e-12)

    t = b * s
    flops = (2.0 * t * h * h * 4            # QKV + output projection
             + 2.0 * 2 * b * heads * s * s * dh  # scores + context
             + 2.0 * 2 * t * h * ffn          # FFN
             + 5.0 * b * heads * s * s        # scale + softmax
             + (GELU_FLOPS_PER_ELEM + 1) * t * ffn
             + 2 * 8.0 * t * h + 8.0 * t * h)  # two LNs, bias adds and residuals
    return Workload(f"bert_layer[B{b},S{s},H{h}]", model, {"x": x}, numpy_fn,
                    _nbytes(x, *p.values()) + _out_bytes((b, s, h)), flops)


def wide_deep(quick: bool = False) -> Workload:
    """Wide&Deep: 8 embedding bags (Gather + ReduceSum over the bag) + 13 dense features,
    concat -> 3 x (Linear+ReLU) 256 -> Linear 1, plus a wide linear part on the dense features."""
    batch = 64 if quick else 512
    fields, rows, dim, bag, ndense, hid = 8, 1000, 16, 4, 13, 256
    rng = _rng(7)
    inputs = {f"idx{i}": rng.integers(0, rows, size=(batch, bag), dtype=np.int64) for i in range(fields)}
    inputs["dense"] = _randn(rng, batch, ndense)
    tables = {f"table{i}": _randn(rng, rows, dim, scale=0.1) for i in range(fields)}
    d_in = fields * dim + ndense
    p = {"w0": _randn(rng, d_in, hid, scale=1 / math.sqrt(d_in)), "b0": _randn(rng, hid, scale=0.01),
         "w1": _randn(rng, hid, hid, scale=1 / math.sqrt(hid)), "b1": _randn(rng, hid, scale=0.01),
         "w2": _randn(rng, hid, hid, scale=1 / math.sqrt(hid)), "b2": _randn(rng, hid, scale=0.01),
         "w3": _randn(rng, hid, 1, scale=1 / math.sqrt(hid)), "b3": _randn(rng, 1, scale=0.01),
         "w_wide": _randn(rng, ndense, 1, scale=0.1), "b_wide": _randn(rng, 1, scale=0.01)}
    consts = {"bag_axes": np.array([1], np.int64)}
    N = helper.make_node
    nodes = []
    for i in range(fields):
        nodes += [N("Gather", [f"table{i}", f"idx{i}"], [f"emb{i}"], axis=0),      # [batch, bag, dim]
                  N("ReduceSum", [f"emb{i}", "bag_axes"], [f"bag{i}"], keepdims=0)]  # [batch, dim]
    nodes.append(N("Concat", [f"bag{i}" for i in range(fields)] + ["dense"], ["feat"], axis=1))
    prev = "feat"
    for layer in range(3):
        nodes += [N("MatMul", [prev, f"w{layer}"], [f"l{layer}_mm"]),
                  N("Add", [f"l{layer}_mm", f"b{layer}"], [f"l{layer}_lin"]),
                  N("Relu", [f"l{layer}_lin"], [f"l{layer}"])]
        prev = f"l{layer}"
    nodes += [N("MatMul", [prev, "w3"], ["deep_mm"]), N("Add", ["deep_mm", "b3"], ["deep"]),
              N("MatMul", ["dense", "w_wide"], ["wide_mm"]), N("Add", ["wide_mm", "b_wide"], ["wide"]),
              N("Add", ["deep", "wide"], ["y"])]
    model = _model("wide_deep", nodes, inputs, {"y": (batch, 1)}, {**tables, **p, **consts})

    def numpy_fn(**kw):
        bags = [tables[f"table{i}"][kw[f"idx{i}"]].sum(axis=1) for i in range(fields)]
        a = np.concatenate(bags + [kw["dense"]], axis=1)
        for layer in range(3):
            a = np.maximum(a @ p[f"w{layer}"] + p[f"b{layer}"], np.float32(0))
        return (a @ p["w3"] + p["b3"]) + (kw["dense"] @ p["w_wide"] + p["b_wide"])

    # compulsory: indices, dense features, the table rows actually touched (at most every
    # gathered row once), all MLP weights, the output
    touched = sum(len(np.unique(inputs[f"idx{i}"])) for i in range(fields)) * dim * 4
    cbytes = (_nbytes(*inputs.values(), *p.values()) + touched + _out_bytes((batch, 1)))
    flops = (fields * batch * bag * dim
             + 2.0 * batch * (d_in * hid + 2 * hid * hid + hid + ndense) + 4.0 * batch * hid * 3)
    return Workload(f"wide_deep[B{batch}]", model, inputs, numpy_fn, cbytes, flops)


def conv_bn_lrelu_res(quick: bool = False) -> Workload:
    n, c, hh, ww = (2, 16, 28, 28) if quick else (8, 64, 56, 56)
    rng = _rng(8)
    x = _randn(rng, n, c, hh, ww)
    w = _randn(rng, c, c, 3, 3, scale=1 / math.sqrt(9 * c))
    cb = _randn(rng, c, scale=0.01)
    gamma = _randn(rng, c, scale=0.1) + np.float32(1)
    beta = _randn(rng, c, scale=0.1)
    mean = _randn(rng, c, scale=0.1)
    var = (rng.random(c) * 0.5 + 0.5).astype(np.float32)
    eps = 1e-5
    N = helper.make_node
    nodes = [N("Conv", ["x", "w", "cb"], ["conv"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
             N("BatchNormalization", ["conv", "gamma", "beta", "mean", "var"], ["bn"], epsilon=eps),
             N("LeakyRelu", ["bn"], ["act"], alpha=0.1),
             N("Add", ["act", "x"], ["y"])]
    inits = {"w": w, "cb": cb, "gamma": gamma, "beta": beta, "mean": mean, "var": var}
    model = _model("conv_bn_lrelu_res", nodes, {"x": x}, {"y": x.shape}, inits)
    wmat = w.reshape(c, c * 9)
    bn_scale = (gamma / np.sqrt(var + np.float32(eps))).astype(np.float32)

    def numpy_fn(x):
        xp = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
        cols = np.lib.stride_tricks.sliding_window_view(xp, (3, 3), axis=(2, 3))  # n,c,h,w,3,3
        cols = cols.transpose(0, 2, 3, 1, 4, 5).reshape(n * hh * ww, c * 9)
        conv = (cols @ wmat.T).reshape(n, hh, ww, c).transpose(0, 3, 1, 2) + cb[:, None, None]
        bn = (conv - mean[:, None, None]) * bn_scale[:, None, None] + beta[:, None, None]
        return np.where(bn >= 0, bn, np.float32(0.1) * bn) + x

    flops = 2.0 * n * c * hh * ww * c * 9 + 6.0 * x.size
    return Workload(f"conv3x3_bn_lrelu_res[{n},{c},{hh},{ww}]", model, {"x": x}, numpy_fn,
                    _nbytes(x, *inits.values()) + _out_bytes(x.shape), flops)


def four_branches(quick: bool = False) -> Workload:
    """Four independent elementwise+reduce branches (one input each), joined by Concat."""
    m, k = (64, 1024) if quick else (256, 1024)
    rng = _rng(9)
    inputs = {f"x{i}": _randn(rng, m, k) for i in range(4)}
    N = helper.make_node
    # opset 17: ReduceSum takes axes as an input, ReduceMax/ReduceMean as an attribute
    nodes = [N("Exp", ["x0"], ["e0"]), N("ReduceSum", ["e0", "last"], ["r0"], keepdims=1),
             N("Tanh", ["x1"], ["e1"]), N("ReduceMax", ["e1"], ["r1"], axes=[-1], keepdims=1),
             N("Mul", ["x2", "x2"], ["e2"]), N("ReduceSum", ["e2", "last"], ["r2"], keepdims=1),
             N("Abs", ["x3"], ["e3"]), N("ReduceMean", ["e3"], ["r3"], axes=[-1], keepdims=1),
             N("Concat", ["r0", "r1", "r2", "r3"], ["y"], axis=1)]
    model = _model("four_branches", nodes, inputs, {"y": (m, 4)}, {"last": np.array([-1], np.int64)})

    def numpy_fn(x0, x1, x2, x3):
        return np.concatenate([np.exp(x0).sum(-1, keepdims=True), np.tanh(x1).max(-1, keepdims=True),
                               (x2 * x2).sum(-1, keepdims=True), np.abs(x3).mean(-1, keepdims=True)],
                              axis=1)

    return Workload(f"four_branches[4x{m},{k}]", model, inputs, numpy_fn,
                    _nbytes(*inputs.values()) + _out_bytes((m, 4)), 8.0 * m * k)


def matmul(quick: bool = False) -> Workload:
    n = 256 if quick else 1024
    rng = _rng(10)
    a = _randn(rng, n, n)
    b = _randn(rng, n, n)
    model = _model("matmul", [helper.make_node("MatMul", ["a", "b"], ["y"])],
                   {"a": a, "b": b}, {"y": (n, n)}, {})

    def numpy_fn(a, b):
        return a @ b

    return Workload(f"matmul[{n}x{n}x{n}]", model, {"a": a, "b": b}, numpy_fn,
                    _nbytes(a, b) + _out_bytes((n, n)), 2.0 * n ** 3)


# name used by --only -> builder
WORKLOADS: dict[str, Callable[..., Workload]] = {
    "layernorm": layernorm,
    "softmax": softmax,
    "logsoftmax": logsoftmax,
    "bias_gelu": bias_gelu,
    "bias_maxpool": bias_maxpool,
    "bias_reducesum": bias_reducesum,
    "bert_layer": bert_layer,
    "wide_deep": wide_deep,
    "conv_bn": conv_bn_lrelu_res,
    "four_branches": four_branches,
    "matmul": matmul,
}


def build(name: str, quick: bool = False) -> Workload:
    return WORKLOADS[name](quick=quick)
