"""Benchmark workloads: each one an ONNX model plus a plain-numpy twin and an array-library form.

Every builder returns a :class:`Workload` (a named tuple) whose first six fields are
``(name, model, inputs, numpy_fn, compulsory_bytes, flops)``:

* ``model`` -- an ``onnx.ModelProto`` built with ``onnx.helper``, so onnxruntime, OpenVINO and
  apollo_py run exactly the same graph;
* ``inputs`` -- ``dict[str, np.ndarray]`` of the run-time inputs (activations, indices);
  parameters (weights, biases, tables) are initializers of the model, and ``numpy_fn``
  closes over the very same arrays;
* ``numpy_fn(**inputs)`` -- a plain-numpy implementation returning the output (or a list of
  outputs, in the model's output order);
* ``compulsory_bytes`` -- bytes of all inputs, initializers and outputs: what must cross memory
  at least once per call;
* ``flops`` -- arithmetic operations per call (2*M*N*K for a matmul; about one per element per
  primitive elementwise/reduce step, transcendental functions counted as one).

and then ``form``, ``params`` and ``compute``:

* ``form`` -- which spelling of the normalisations the ONNX graph uses (:data:`FORMS`).
  ``"exporter"``: the standard ops as torch.onnx writes them at opsets 17-20 --
  ``LayerNormalization`` (axis -1), ``Softmax`` / ``LogSoftmax`` (axis -1), and at opset 20
  ``Gelu(approximate="tanh")`` (below 20 torch writes GELU as the eight primitives of the
  decomposed form, checked with torch 2.14's dynamo and TorchScript exporters);
  ``"decomposed"``: the same maths as primitives (ReduceMean/Sub/Mul/Sqrt/Div..., ReduceMax/Sub/
  Exp/ReduceSum/Div, Pow/Mul/Add/Tanh...), opset 17, what older exporters and hand-built graphs
  contain.  Workloads without such an op have one form, ``""`` (see :func:`forms`);
* ``params`` -- the model's float parameters by name (the arrays ``numpy_fn`` closes over);
* ``compute(F, params, **inputs)`` -- the workload written once against an array namespace
  ``F`` (benchmarks/contenders.py: numpy, jax.numpy under ``jax.jit``, torch under
  ``torch.compile``).  In the exporter form it calls ``F``'s library ops (``F.layer_norm``,
  ``F.softmax``, ``F.gelu_tanh``: ``torch.nn.functional``, ``jax.nn``), in the decomposed form
  the primitives, so each contender runs the same spelling as the ONNX graph it is compared with.

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


FORMS = ("exporter", "decomposed")
GELU_OPSET = 20  # the first opset with Gelu


class Workload(NamedTuple):
    name: str
    model: onnx.ModelProto
    inputs: dict
    numpy_fn: Callable
    compulsory_bytes: int
    flops: float
    form: str = ""
    params: dict = {}
    compute: Callable | None = None


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


def _model(name: str, nodes, inputs: dict, outputs: dict, inits: dict, opset: int = OPSET) -> onnx.ModelProto:
    """``inputs``/``outputs``: name -> array or shape (outputs are float32)."""
    in_vis = [_vi(k, v, I64 if isinstance(v, np.ndarray) and v.dtype == np.int64 else F32)
              for k, v in inputs.items()]
    out_vis = [_vi(k, v) for k, v in outputs.items()]
    graph = helper.make_graph(nodes, name, in_vis, out_vis,
                              initializer=[_init(k, v) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)],
                              producer_name="apollo_py-benchmarks")
    # opset 17 era (accepted by every onnxruntime >= 1.13); opset 20 needs IR 9
    model.ir_version = 8 if opset <= 18 else 9
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


def _check_form(form: str, name: str) -> None:
    if form not in FORMS:
        raise ValueError(f"{name}: form {form!r}, expected one of {FORMS}")


def _ln_nodes(x: str, scale: str, bias: str, out: str, eps: float, form: str, prefix: str) -> tuple[list, dict]:
    """LayerNormalization over the last axis: one op (exporter form) or nine primitives."""
    N, p = helper.make_node, prefix
    if form == "exporter":
        return [N("LayerNormalization", [x, scale, bias], [out], axis=-1, epsilon=eps)], {}
    nodes = [N("ReduceMean", [x], [f"{p}_mean"], axes=[-1], keepdims=1),
             N("Sub", [x, f"{p}_mean"], [f"{p}_d"]),
             N("Mul", [f"{p}_d", f"{p}_d"], [f"{p}_d2"]),
             N("ReduceMean", [f"{p}_d2"], [f"{p}_var"], axes=[-1], keepdims=1),
             N("Add", [f"{p}_var", f"{p}_eps"], [f"{p}_ve"]),
             N("Sqrt", [f"{p}_ve"], [f"{p}_sd"]),
             N("Div", [f"{p}_d", f"{p}_sd"], [f"{p}_nrm"]),
             N("Mul", [f"{p}_nrm", scale], [f"{p}_sc"]),
             N("Add", [f"{p}_sc", bias], [out])]
    return nodes, {f"{p}_eps": np.array(eps, np.float32)}


def _softmax_nodes(op: str, x: str, out: str, form: str, prefix: str) -> tuple[list, dict]:
    """Softmax / LogSoftmax over the last axis: one op (exporter form) or five / six primitives."""
    N, p = helper.make_node, prefix
    if form == "exporter":
        return [N(op, [x], [out], axis=-1)], {}
    nodes = [N("ReduceMax", [x], [f"{p}_max"], axes=[-1], keepdims=1),
             N("Sub", [x, f"{p}_max"], [f"{p}_s"]),
             N("Exp", [f"{p}_s"], [f"{p}_e"]),
             N("ReduceSum", [f"{p}_e", f"{p}_axes"], [f"{p}_sum"], keepdims=1)]  # opset 13+: axes input
    if op == "Softmax":
        nodes.append(N("Div", [f"{p}_e", f"{p}_sum"], [out]))
    else:
        nodes += [N("Log", [f"{p}_sum"], [f"{p}_lsum"]), N("Sub", [f"{p}_s", f"{p}_lsum"], [out])]
    return nodes, {f"{p}_axes": np.array([-1], np.int64)}


def _gelu_form_nodes(x: str, out: str, form: str, prefix: str) -> tuple[list, dict]:
    """tanh GELU: ``Gelu(approximate="tanh")`` (exporter form, opset 20) or eight primitives."""
    if form == "exporter":
        return [helper.make_node("Gelu", [x], [out], approximate="tanh")], {}
    return _gelu_nodes(x, out, prefix)


# the maths once, against an array namespace F (benchmarks/contenders.py), in either form

def _ln(F, x, g, b, eps, form):
    if form == "exporter":
        return F.layer_norm(x, g, b, eps)
    d = x - F.mean(x, -1, True)
    return d / F.sqrt(F.mean(d * d, -1, True) + eps) * g + b


def _softmax(F, x, form):
    if form == "exporter":
        return F.softmax(x)
    e = F.exp(x - F.max(x, -1, True))
    return e / F.sum(e, -1, True)


def _logsoftmax(F, x, form):
    if form == "exporter":
        return F.log_softmax(x)
    s = x - F.max(x, -1, True)
    return s - F.log(F.sum(F.exp(s), -1, True))


def _gelu(F, y, form):
    if form == "exporter":
        return F.gelu_tanh(y)
    return 0.5 * y * (1.0 + F.tanh(GELU_C * (y + 0.044715 * (y * y * y))))


# --------------------------------------------------------------------------------------------
# workloads

def layernorm(quick: bool = False, form: str = "exporter") -> Workload:
    _check_form(form, "layernorm")
    n, d = (512, 768) if quick else (8192, 768)
    rng = _rng(1)
    x = _randn(rng, n, d)
    scale = _randn(rng, d, scale=0.5) + np.float32(1.0)
    bias = _randn(rng, d, scale=0.1)
    nodes, cinits = _ln_nodes("x", "scale", "bias", "y", 1e-5, form, "ln")
    model = _model("layernorm", nodes, {"x": x}, {"y": (n, d)}, {"scale": scale, "bias": bias, **cinits})

    def numpy_fn(x):
        return _layernorm_np(x, scale, bias)

    def compute(F, p, x):
        return _ln(F, x, p["scale"], p["bias"], 1e-5, form)

    return Workload(f"layernorm[{n},{d}]", model, {"x": x}, numpy_fn,
                    _nbytes(x, scale, bias) + _out_bytes((n, d)), 8.0 * n * d,
                    form, {"scale": scale, "bias": bias}, compute)


def _softmax_like(op: str, quick: bool, form: str) -> Workload:
    _check_form(form, op.lower())
    shape = (48, 128, 128) if quick else (768, 128, 128)
    rng = _rng(2)
    x = _randn(rng, *shape, scale=2.0)
    nodes, cinits = _softmax_nodes(op, "x", "y", form, "sm")
    model = _model(op.lower(), nodes, {"x": x}, {"y": shape}, cinits)

    if op == "Softmax":
        def numpy_fn(x):
            return _softmax_np(x, -1)
    else:
        def numpy_fn(x):
            s = x - x.max(axis=-1, keepdims=True)
            return s - np.log(np.exp(s).sum(axis=-1, keepdims=True))

    def compute(F, p, x):
        return (_softmax if op == "Softmax" else _logsoftmax)(F, x, form)

    n = math.prod(shape)
    name = f"{op.lower()}[{','.join(map(str, shape))}]"
    return Workload(name, model, {"x": x}, numpy_fn, _nbytes(x) + _out_bytes(shape),
                    (5.0 if op == "Softmax" else 6.0) * n, form, {}, compute)


def softmax(quick: bool = False, form: str = "exporter") -> Workload:
    return _softmax_like("Softmax", quick, form)


def logsoftmax(quick: bool = False, form: str = "exporter") -> Workload:
    return _softmax_like("LogSoftmax", quick, form)


def bias_gelu(quick: bool = False, form: str = "exporter") -> Workload:
    _check_form(form, "bias_gelu")
    n, d = (512, 3072) if quick else (8192, 3072)
    rng = _rng(3)
    x = _randn(rng, n, d)
    bias = _randn(rng, d, scale=0.1)
    gnodes, ginits = _gelu_form_nodes("xb", "y", form, "g")
    nodes = [helper.make_node("Add", ["x", "bias"], ["xb"])] + gnodes
    model = _model("bias_gelu", nodes, {"x": x}, {"y": (n, d)}, {"bias": bias, **ginits},
                   opset=GELU_OPSET if form == "exporter" else OPSET)

    def numpy_fn(x):
        return _gelu_tanh_np(x + bias)

    def compute(F, p, x):
        return _gelu(F, x + p["bias"], form)

    return Workload(f"bias_gelu_tanh[{n},{d}]", model, {"x": x}, numpy_fn,
                    _nbytes(x, bias) + _out_bytes((n, d)), (1 + GELU_FLOPS_PER_ELEM) * n * d,
                    form, {"bias": bias}, compute)


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

    def compute(F, p, x):
        return F.maxpool2x2(x + p["bias"])

    return Workload(f"bias_maxpool2x2[{n},{c},{h},{w}]", model, {"x": x}, numpy_fn,
                    _nbytes(x, bias) + _out_bytes(oshape), 1.0 * x.size + 0.75 * x.size,
                    "", {"bias": bias}, compute)


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

    def compute(F, prm, x):
        return F.sum(x + prm["bias"], (1, 3), False)

    return Workload(f"bias_reducesum13[{','.join(map(str, shape))}]", model, {"x": x}, numpy_fn,
                    _nbytes(x, bias) + _out_bytes((m, p)), 2.0 * x.size, "", {"bias": bias}, compute)


def bert_layer(quick: bool = False, form: str = "exporter") -> Workload:
    """One post-LN BERT-base encoder layer with explicit softmax attention and tanh GELU."""
    _check_form(form, "bert_layer")
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
    sm_nodes, sm_inits = _softmax_nodes("Softmax", "scores_s", "probs", form, "sm")
    ln1_nodes, ln1_inits = _ln_nodes("res1", "ln1_g", "ln1_b", "h1", 1e-12, form, "ln1")
    ln2_nodes, ln2_inits = _ln_nodes("res2", "ln2_g", "ln2_b", "y", 1e-12, form, "ln2")
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
        *sm_nodes,
        N("MatMul", ["probs", "v_h"], ["ctx_h"]),
        N("Transpose", ["ctx_h"], ["ctx_t"], perm=[0, 2, 1, 3]),
        N("Reshape", ["ctx_t", "shape_merge"], ["ctx"]),
        N("MatMul", ["ctx", "wo"], ["o_mm"]),
        N("Add", ["o_mm", "bo"], ["o_lin"]),
        N("Add", ["o_lin", "x"], ["res1"]),
        *ln1_nodes,
        N("MatMul", ["h1", "w1"], ["f1_mm"]),
        N("Add", ["f1_mm", "b1"], ["f1"]),
    ]
    gnodes, ginits = _gelu_form_nodes("f1", "f1_act", form, "gelu")
    nodes += gnodes
    nodes += [
        N("MatMul", ["f1_act", "w2"], ["f2_mm"]),
        N("Add", ["f2_mm", "b2"], ["f2"]),
        N("Add", ["f2", "h1"], ["res2"]),
        *ln2_nodes,
    ]
    model = _model("bert_layer", nodes, {"x": x}, {"y": (b, s, h)},
                   {**p, **consts, **ginits, **sm_inits, **ln1_inits, **ln2_inits},
                   opset=GELU_OPSET if form == "exporter" else OPSET)

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

    def compute(F, p, x):
        def heads_of(t):
            return F.permute(F.reshape(t, (b, s, heads, dh)), (0, 2, 1, 3))
        q = heads_of(x @ p["wq"] + p["bq"])
        k = heads_of(x @ p["wk"] + p["bk"])
        v = heads_of(x @ p["wv"] + p["bv"])
        probs = _softmax(F, (q @ F.permute(k, (0, 1, 3, 2))) * (1.0 / math.sqrt(dh)), form)
        ctx = F.reshape(F.permute(probs @ v, (0, 2, 1, 3)), (b, s, h))
        h1 = _ln(F, ctx @ p["wo"] + p["bo"] + x, p["ln1_g"], p["ln1_b"], 1e-12, form)
        f = _gelu(F, h1 @ p["w1"] + p["b1"], form)
        return _ln(F, f @ p["w2"] + p["b2"] + h1, p["ln2_g"], p["ln2_b"], 1e-12, form)

    t = b * s
    flops = (2.0 * t * h * h * 4            # QKV + output projection
             + 2.0 * 2 * b * heads * s * s * dh  # scores + context
             + 2.0 * 2 * t * h * ffn          # FFN
             + 5.0 * b * heads * s * s        # scale + softmax
             + (GELU_FLOPS_PER_ELEM + 1) * t * ffn
             + 2 * 8.0 * t * h + 8.0 * t * h)  # two LNs, bias adds and residuals
    return Workload(f"bert_layer[B{b},S{s},H{h}]", model, {"x": x}, numpy_fn,
                    _nbytes(x, *p.values()) + _out_bytes((b, s, h)), flops, form, p, compute)


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

    def compute(F, prm, **kw):
        bags = [F.sum(F.take_rows(prm[f"table{i}"], kw[f"idx{i}"]), 1, False) for i in range(fields)]
        a = F.concat(bags + [kw["dense"]], 1)
        for layer in range(3):
            a = F.relu(a @ prm[f"w{layer}"] + prm[f"b{layer}"])
        return (a @ prm["w3"] + prm["b3"]) + (kw["dense"] @ prm["w_wide"] + prm["b_wide"])

    # compulsory: indices, dense features, the table rows actually touched (at most every
    # gathered row once), all MLP weights, the output
    touched = sum(len(np.unique(inputs[f"idx{i}"])) for i in range(fields)) * dim * 4
    cbytes = (_nbytes(*inputs.values(), *p.values()) + touched + _out_bytes((batch, 1)))
    flops = (fields * batch * bag * dim
             + 2.0 * batch * (d_in * hid + 2 * hid * hid + hid + ndense) + 4.0 * batch * hid * 3)
    return Workload(f"wide_deep[B{batch}]", model, inputs, numpy_fn, cbytes, flops, "", {**tables, **p},
                    compute)


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

    def compute(F, p, x):
        conv = F.conv3x3(x, p["w"], p["cb"])
        bn = (conv - p["mean"][:, None, None]) * p["bn_scale"][:, None, None] + p["beta"][:, None, None]
        return F.leaky_relu(bn, 0.1) + x

    flops = 2.0 * n * c * hh * ww * c * 9 + 6.0 * x.size
    return Workload(f"conv3x3_bn_lrelu_res[{n},{c},{hh},{ww}]", model, {"x": x}, numpy_fn,
                    _nbytes(x, *inits.values()) + _out_bytes(x.shape), flops, "",
                    {"w": w, "cb": cb, "mean": mean, "bn_scale": bn_scale, "beta": beta}, compute)


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

    def compute(F, p, x0, x1, x2, x3):
        return F.concat([F.sum(F.exp(x0), -1, True), F.max(F.tanh(x1), -1, True),
                         F.sum(x2 * x2, -1, True), F.mean(F.abs(x3), -1, True)], 1)

    return Workload(f"four_branches[4x{m},{k}]", model, inputs, numpy_fn,
                    _nbytes(*inputs.values()) + _out_bytes((m, 4)), 8.0 * m * k, "", {}, compute)


def matmul(quick: bool = False) -> Workload:
    n = 256 if quick else 1024
    rng = _rng(10)
    a = _randn(rng, n, n)
    b = _randn(rng, n, n)
    model = _model("matmul", [helper.make_node("MatMul", ["a", "b"], ["y"])],
                   {"a": a, "b": b}, {"y": (n, n)}, {})

    def numpy_fn(a, b):
        return a @ b

    def compute(F, p, a, b):
        return a @ b

    return Workload(f"matmul[{n}x{n}x{n}]", model, {"a": a, "b": b}, numpy_fn,
                    _nbytes(a, b) + _out_bytes((n, n)), 2.0 * n ** 3, "", {}, compute)


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


# workloads whose ONNX graph has an exporter and a decomposed form (the others have one, "")
TWO_FORMS = frozenset({"layernorm", "softmax", "logsoftmax", "bias_gelu", "bert_layer"})


def forms(name: str) -> tuple:
    """The forms :func:`build` accepts for ``name``: :data:`FORMS`, or ``("",)``."""
    return FORMS if name in TWO_FORMS else ("",)


def build(name: str, quick: bool = False, form: str = "") -> Workload:
    """``form``: "exporter" or "decomposed" for the :data:`TWO_FORMS` workloads ("" = exporter);
    "" for the others."""
    if name in TWO_FORMS:
        return WORKLOADS[name](quick=quick, form=form or "exporter")
    if form:
        raise ValueError(f"{name} has one form; got form={form!r}")
    return WORKLOADS[name](quick=quick)
