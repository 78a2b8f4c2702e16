"""Models and plain-numpy training steps shared by the train_step tests and the benchmark."""
from __future__ import annotations

import numpy as np

from apollo_py.ir import GraphBuilder


def mlp_weights(sizes=(784, 1024, 10), seed=0):
    rng = np.random.default_rng(seed)
    d, h, c = sizes
    return {"W1": (rng.standard_normal((d, h)) / np.sqrt(d)).astype(np.float32),
            "b1": (0.01 * rng.standard_normal(h)).astype(np.float32),
            "W2": (rng.standard_normal((h, c)) / np.sqrt(h)).astype(np.float32),
            "b2": (0.01 * rng.standard_normal(c)).astype(np.float32)}


def mlp_graph(weights, batch):
    """The MLP built with the GraphBuilder; constants are named after the weights."""
    b = GraphBuilder("mlp")
    x = b.input("x", (batch, weights["W1"].shape[0]))
    w = {k: b.constant(v, name=k) for k, v in weights.items()}
    h = b.relu(b.matmul(x, w["W1"]) + w["b1"])
    return b.build([b.matmul(h, w["W2"]) + w["b2"]])


def mlp_onnx(weights, gemm=False):
    """The same MLP as an ONNX model (MatMul + Add, or Gemm), batch dimension symbolic."""
    from onnx import TensorProto, helper, numpy_helper
    d = weights["W1"].shape[0]
    c = weights["W2"].shape[1]
    if gemm:
        nodes = [helper.make_node("Gemm", ["x", "W1", "b1"], ["h"]),
                 helper.make_node("Relu", ["h"], ["a"]),
                 helper.make_node("Gemm", ["a", "W2", "b2"], ["logits"])]
    else:
        nodes = [helper.make_node("MatMul", ["x", "W1"], ["m1"]),
                 helper.make_node("Add", ["m1", "b1"], ["h"]),
                 helper.make_node("Relu", ["h"], ["a"]),
                 helper.make_node("MatMul", ["a", "W2"], ["m2"]),
                 helper.make_node("Add", ["m2", "b2"], ["logits"])]
    g = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", d])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["B", c])],
                          [numpy_helper.from_array(v, k) for k, v in weights.items()])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def mlp_loss_and_grads(p, x, y):
    """Forward, cross-entropy loss and gradients of the MLP in plain numpy (float32)."""
    h = x @ p["W1"] + p["b1"]
    a = np.maximum(h, 0)
    logits = a @ p["W2"] + p["b2"]
    z = logits - logits.max(axis=1, keepdims=True)
    e = np.exp(z)
    s = e.sum(axis=1, keepdims=True)
    n = x.shape[0]
    loss = -np.mean(z[np.arange(n), y] - np.log(s[:, 0]))
    d = e / s
    d[np.arange(n), y] -= 1
    d /= n
    da = d @ p["W2"].T
    dh = da * (h > 0)
    return float(loss), {"W1": x.T @ dh, "b1": dh.sum(0), "W2": a.T @ d, "b2": d.sum(0)}


class NumpySGD:
    def __init__(self, lr, momentum=0.0, weight_decay=0.0):
        self.lr, self.mom, self.wd, self.buf = lr, momentum, weight_decay, {}

    def step(self, p, g):
        for k in p:
            gk = g[k] + self.wd * p[k] if self.wd else g[k]
            if self.mom:
                self.buf[k] = gk.copy() if k not in self.buf else self.mom * self.buf[k] + gk
                gk = self.buf[k]
            p[k] -= np.float32(self.lr) * gk


class NumpyAdam:
    def __init__(self, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, decoupled=False):
        self.lr, self.betas, self.eps, self.wd, self.dec = lr, betas, eps, weight_decay, decoupled
        self.m, self.v, self.t = {}, {}, 0

    def step(self, p, g):
        self.t += 1
        b1, b2 = self.betas
        for k in p:
            gk = g[k]
            if self.wd and self.dec:
                p[k] *= np.float32(1 - self.lr * self.wd)
            elif self.wd:
                gk = gk + np.float32(self.wd) * p[k]
            m = self.m.get(k, np.zeros_like(gk))
            v = self.v.get(k, np.zeros_like(gk))
            m = m + (gk - m) * np.float32(1 - b1)  # torch: exp_avg.lerp_(grad, 1 - beta1)
            v = np.float32(b2) * v + np.float32(1 - b2) * gk * gk
            self.m[k], self.v[k] = m, v
            step_size = self.lr / (1 - b1 ** self.t)
            denom = np.sqrt(v) / np.float32(np.sqrt(1 - b2 ** self.t)) + np.float32(self.eps)
            p[k] -= np.float32(step_size) * (m / denom)
