"""Small ONNX models built with ``onnx.helper``, for the demo and the tests.

Each ``make_*`` function returns an ``onnx.ModelProto`` with deterministic weights (seeded) and,
where noted, symbolic batch / sequence dims.  ``MODELS`` maps a short name to the builder, and
``example_inputs(model, shapes)`` makes random inputs for a model.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

IR_VERSION = 10  # understood by onnxruntime releases from 1.20 on


def _model(nodes, name, inputs, outputs, inits, opset=17):
    graph = helper.make_graph(nodes, name, inputs, outputs,
                              [numpy_helper.from_array(a, n) for n, a in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)],
                              producer_name="apollo_py.examples")
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model)
    return model


def _w(rng, *shape, scale=0.3):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def make_mlp(d_in: int = 16, d_hidden: int = 32, d_out: int = 10, seed: int = 0) -> onnx.ModelProto:
    """x[N, d_in] -> Gemm(transB) -> Relu -> MatMul -> Add -> Softmax; N is symbolic."""
    rng = np.random.default_rng(seed)
    inits = {"w1": _w(rng, d_hidden, d_in), "b1": _w(rng, d_hidden), "w2": _w(rng, d_hidden, d_out),
             "b2": _w(rng, d_out)}
    nodes = [
        helper.make_node("Gemm", ["x", "w1", "b1"], ["h"], name="fc1", transB=1),
        helper.make_node("Relu", ["h"], ["hr"], name="relu1"),
        helper.make_node("MatMul", ["hr", "w2"], ["o"], name="fc2"),
        helper.make_node("Add", ["o", "b2"], ["logits"], name="bias2"),
        helper.make_node("Softmax", ["logits"], ["probs"], name="softmax", axis=-1),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", d_in])
    y = helper.make_tensor_value_info("probs", TensorProto.FLOAT, ["N", d_out])
    return _model(nodes, "mlp", [x], [y], inits)


def make_conv_block(c_in: int = 3, c_mid: int = 8, n_cls: int = 5, seed: int = 1) -> onnx.ModelProto:
    """x[N, c_in, 16, 16] -> Conv+bias -> BatchNorm -> Relu -> MaxPool -> AveragePool ->
    GlobalAveragePool -> Flatten -> Gemm; N is symbolic."""
    rng = np.random.default_rng(seed)
    inits = {
        "cw": _w(rng, c_mid, c_in, 3, 3), "cb": _w(rng, c_mid),
        "bn_s": (1 + _w(rng, c_mid, scale=0.1)), "bn_b": _w(rng, c_mid, scale=0.1),
        "bn_m": _w(rng, c_mid, scale=0.1), "bn_v": (1 + np.abs(_w(rng, c_mid, scale=0.2))),
        "fw": _w(rng, c_mid, n_cls), "fb": _w(rng, n_cls),
    }
    nodes = [
        helper.make_node("Conv", ["x", "cw", "cb"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c", "bn_s", "bn_b", "bn_m", "bn_v"], ["bn"], name="bn",
                         epsilon=1e-5),
        helper.make_node("Relu", ["bn"], ["r"], name="relu"),
        helper.make_node("MaxPool", ["r"], ["mp"], name="maxpool", kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("AveragePool", ["mp"], ["ap"], name="avgpool", kernel_shape=[3, 3],
                         pads=[1, 1, 1, 1], count_include_pad=0),
        helper.make_node("GlobalAveragePool", ["ap"], ["gap"], name="gap"),
        helper.make_node("Flatten", ["gap"], ["flat"], name="flatten", axis=1),
        helper.make_node("Gemm", ["flat", "fw", "fb"], ["y"], name="classifier"),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", c_in, 16, 16])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", n_cls])
    return _model(nodes, "conv_block", [x], [y], inits)


def make_attention(d_model: int = 32, heads: int = 4, seed: int = 2) -> onnx.ModelProto:
    """Self-attention block over x[B, S, d_model] (B and S symbolic): Q/K/V projections, heads
    split with a Shape-computed Reshape, scaled softmax(QK^T)V, output projection, residual
    Add and LayerNormalization."""
    rng = np.random.default_rng(seed)
    dh = d_model // heads
    inits = {"wq": _w(rng, d_model, d_model), "wk": _w(rng, d_model, d_model),
             "wv": _w(rng, d_model, d_model), "wo": _w(rng, d_model, d_model),
             "ln_s": 1 + _w(rng, d_model, scale=0.1), "ln_b": _w(rng, d_model, scale=0.1),
             "heads_dh": np.array([heads, dh], np.int64), "idx01": np.array([0, 1], np.int64),
             "dmodel": np.array([d_model], np.int64), "scale": np.array(1 / np.sqrt(dh), np.float32)}
    nodes = [
        helper.make_node("Shape", ["x"], ["xs"], name="shape"),
        helper.make_node("Gather", ["xs", "idx01"], ["bs"], name="take_bs", axis=0),
        helper.make_node("Concat", ["bs", "heads_dh"], ["split_shape"], name="split_shape", axis=0),
        helper.make_node("Concat", ["bs", "dmodel"], ["merge_shape"], name="merge_shape", axis=0),
    ]
    for t in "qkv":
        nodes += [
            helper.make_node("MatMul", ["x", f"w{t}"], [f"{t}0"], name=f"proj_{t}"),
            helper.make_node("Reshape", [f"{t}0", "split_shape"], [f"{t}1"], name=f"split_{t}"),
            helper.make_node("Transpose", [f"{t}1"], [f"{t}h"], name=f"heads_{t}",
                             perm=[0, 2, 3, 1] if t == "k" else [0, 2, 1, 3]),
        ]
    nodes += [
        helper.make_node("MatMul", ["qh", "kh"], ["scores0"], name="qk"),
        helper.make_node("Mul", ["scores0", "scale"], ["scores"], name="scale"),
        helper.make_node("Softmax", ["scores"], ["attn"], name="softmax", axis=-1),
        helper.make_node("MatMul", ["attn", "vh"], ["ctx_h"], name="av"),
        helper.make_node("Transpose", ["ctx_h"], ["ctx_t"], name="merge_t", perm=[0, 2, 1, 3]),
        helper.make_node("Reshape", ["ctx_t", "merge_shape"], ["ctx"], name="merge"),
        helper.make_node("MatMul", ["ctx", "wo"], ["proj"], name="proj_o"),
        helper.make_node("Add", ["proj", "x"], ["res"], name="residual"),
        helper.make_node("LayerNormalization", ["res", "ln_s", "ln_b"], ["y"], name="ln", axis=-1,
                         epsilon=1e-5),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "S", d_model])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", "S", d_model])
    return _model(nodes, "attention", [x], [y], inits)


def make_layernorm_gelu(d: int = 24, seed: int = 3, approximate: str = "none") -> onnx.ModelProto:
    """x[N, S, d] -> LayerNormalization -> Gelu (opset 20) -> MatMul -> Gelu; N and S symbolic."""
    rng = np.random.default_rng(seed)
    inits = {"s": 1 + _w(rng, d, scale=0.1), "b": _w(rng, d, scale=0.1), "w": _w(rng, d, d)}
    nodes = [
        helper.make_node("LayerNormalization", ["x", "s", "b"], ["n"], name="ln", axis=-1, epsilon=1e-5),
        helper.make_node("Gelu", ["n"], ["g"], name="gelu1", approximate=approximate),
        helper.make_node("MatMul", ["g", "w"], ["m"], name="fc"),
        helper.make_node("Gelu", ["m"], ["y"], name="gelu2", approximate=approximate),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", "S", d])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", "S", d])
    return _model(nodes, "layernorm_gelu", [x], [y], inits, opset=20)


def make_softmax_chain(d: int = 12) -> onnx.ModelProto:
    """x[N, d] -> Softmax -> Log -> ReduceSum(axes input) -> Sub -> LogSoftmax, two outputs."""
    inits = {"axes": np.array([1], np.int64)}
    nodes = [
        helper.make_node("Softmax", ["x"], ["p"], name="softmax", axis=1),
        helper.make_node("Log", ["p"], ["lp"], name="log"),
        helper.make_node("ReduceSum", ["lp", "axes"], ["s"], name="rsum", keepdims=1),
        helper.make_node("Sub", ["x", "s"], ["z"], name="center"),
        helper.make_node("LogSoftmax", ["z"], ["y"], name="logsoftmax", axis=-1),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", d])
    ys = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", d]),
          helper.make_tensor_value_info("p", TensorProto.FLOAT, ["N", d])]
    return _model(nodes, "softmax_chain", [x], ys, inits, opset=18)


MODELS = {
    "mlp": make_mlp,
    "conv_block": make_conv_block,
    "attention": make_attention,
    "layernorm_gelu": make_layernorm_gelu,
    "softmax_chain": make_softmax_chain,
}


def example_inputs(model: onnx.ModelProto, dims: dict[str, int] | None = None, seed: int = 0) -> dict:
    """Random float32 inputs for ``model``; symbolic dims take values from ``dims`` (default 2)."""
    rng = np.random.default_rng(seed)
    dims = dims or {}
    init = {t.name for t in model.graph.initializer}
    feeds = {}
    for vi in model.graph.input:
        if vi.name in init:
            continue
        shape = [d.dim_value if d.HasField("dim_value") else dims.get(d.dim_param, 2)
                 for d in vi.type.tensor_type.shape.dim]
        feeds[vi.name] = rng.standard_normal(shape).astype(np.float32)
    return feeds
