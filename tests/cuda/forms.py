"""Graphs covering every kernel form the CUDA back end emits, with their inputs.

Each entry: name -> (graph builder function, expected CUDA kernel forms).  Shapes are small
and odd-sized (partial tiles, rows that are not a multiple of the block) so that the
emulation build stays fast and boundary code runs.
"""
from __future__ import annotations

import numpy as np

import apollo_py as ap


def elementwise():
    b = ap.GraphBuilder("ew")
    x, y = b.input("x", (37, 53)), b.input("y", (37, 53))
    return b.build([b.tanh(x) * y + 1.5]), {"x": (37, 53), "y": (37, 53)}


def broadcast():
    b = ap.GraphBuilder("bcast")
    x, bias = b.input("x", (3, 29, 41)), b.input("bias", (41,))
    col = b.input("col", (3, 29, 1))
    return b.build([b.relu(x + bias) * col]), {"x": (3, 29, 41), "bias": (41,), "col": (3, 29, 1)}


def x_reduce():
    b = ap.GraphBuilder("xred")
    x, w = b.input("x", (45, 333)), b.input("w", (333,))
    return b.build([b.reduce_sum(b.exp(x) * w, axes=(1,), keepdims=False)]), {"x": (45, 333), "w": (333,)}


def y_reduce():
    b = ap.GraphBuilder("yred")
    x, c = b.input("x", (301, 67)), b.input("c", (67,))
    return b.build([b.reduce_max(x * c, axes=(0,), keepdims=False)]), {"x": (301, 67), "c": (67,)}


def all_reduce():
    b = ap.GraphBuilder("allred")
    x = b.input("x", (23, 71))
    return b.build([b.reduce_sum(x * x, axes=(0, 1), keepdims=False)]), {"x": (23, 71)}


def softmax():
    b = ap.GraphBuilder("softmax")
    x = b.input("x", (19, 130))
    e = b.exp(x - b.reduce_max(x, axes=(1,), keepdims=True))
    return b.build([e / b.reduce_sum(e, axes=(1,), keepdims=True)]), {"x": (19, 130)}


def layer_norm():
    b = ap.GraphBuilder("layernorm")
    x, g, beta = b.input("x", (21, 96)), b.input("g", (96,)), b.input("beta", (96,))
    mean = b.reduce_sum(x, axes=(1,), keepdims=True) / 96.0
    d = x - mean
    var = b.reduce_sum(d * d, axes=(1,), keepdims=True) / 96.0
    return b.build([d / b.sqrt(var + 1e-5) * g + beta]), {"x": (21, 96), "g": (96,), "beta": (96,)}


def parallel_branches():
    b = ap.GraphBuilder("branches")
    xs = [b.input(f"x{i}", (17, 33)) for i in range(4)]
    return b.build([b.sigmoid(x) * float(i + 1) for i, x in enumerate(xs)]), {f"x{i}": (17, 33) for i in range(4)}


def matmul_epilogue():
    b = ap.GraphBuilder("mm")
    x, w, bias = b.input("x", (2, 45, 70)), b.input("w", (70, 66)), b.input("bias", (66,))
    return b.build([b.relu(x @ w + bias)]), {"x": (2, 45, 70), "w": (70, 66), "bias": (66,)}


def conv_epilogue():
    b = ap.GraphBuilder("conv")
    x, w, bias = b.input("x", (2, 4, 11, 10)), b.input("w", (6, 2, 3, 3)), b.input("bias", (1, 6, 1, 1))
    y = b.conv(x, w, strides=(2, 1), pads=(1, 1, 1, 1), dilations=(1, 1), group=2)
    return b.build([b.relu(y + bias)]), {"x": (2, 4, 11, 10), "w": (6, 2, 3, 3), "bias": (1, 6, 1, 1)}


def fp16_softmax_matmul(dtype="float16"):
    b = ap.GraphBuilder("fp16")
    x, w = b.input("x", (24, 40), dtype), b.input("w", (40, 72), dtype)
    h = x @ w
    e = b.exp(h - b.reduce_max(h, axes=(1,), keepdims=True))
    return b.build([e / b.reduce_sum(e, axes=(1,), keepdims=True)]), {"x": (24, 40), "w": (40, 72)}


FORMS = {
    "elementwise": (elementwise, {"elementwise"}),
    "broadcast": (broadcast, {"elementwise"}),
    "x-reduce": (x_reduce, {"x-reduce"}),
    "y-reduce": (y_reduce, {"y-reduce"}),
    "all-reduce": (all_reduce, {"all-reduce"}),
    "stitched-softmax": (softmax, {"stitched x-reduce"}),
    "stitched-layernorm": (layer_norm, {"stitched x-reduce"}),
    "parallel-stitched": (parallel_branches, {"parallel-stitched"}),
    "matmul-epilogue": (matmul_epilogue, {"GEMM + epilogue add+relu"}),
    "conv-epilogue": (conv_epilogue, {"implicit-GEMM conv + epilogue add+relu"}),
    "fp16": (fp16_softmax_matmul, {"GEMM", "stitched x-reduce"}),
}


def feeds_for(graph, shapes, seed=0):
    rng = np.random.default_rng(seed)
    out = {}
    for name in graph.inputs:
        dt = graph.types[name].np_dtype
        out[name] = rng.standard_normal(shapes[name]).astype(dt)
    return out
