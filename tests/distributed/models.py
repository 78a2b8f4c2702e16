"""A small MLP as an ONNX model (batch dimension symbolic) for the distributed tests."""
from __future__ import annotations

import numpy as np


def mlp_weights(sizes=(32, 24, 10), seed=0):
    rng = np.random.default_rng(seed)
    d, h, c = sizes
    return {"W1": (rng.standard_normal((d, h)) / np.sqrt(d)).astype(np.float32),
            "b1": (0.01 * rng.standard_normal(h)).astype(np.float32),
            "W2": (rng.standard_normal((h, c)) / np.sqrt(h)).astype(np.float32),
            "b2": (0.01 * rng.standard_normal(c)).astype(np.float32)}


def mlp_onnx(weights):
    """x (B, d) -> relu(x W1 + b1) W2 + b2 = logits (B, c)."""
    from onnx import TensorProto, helper, numpy_helper
    d, c = weights["W1"].shape[0], weights["W2"].shape[1]
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["m1"]),
             helper.make_node("Add", ["m1", "b1"], ["h"]),
             helper.make_node("Relu", ["h"], ["a"]),
             helper.make_node("MatMul", ["a", "W2"], ["m2"]),
             helper.make_node("Add", ["m2", "b2"], ["logits"])]
    g = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", d])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["B", c])],
                          [numpy_helper.from_array(v, k) for k, v in weights.items()])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
