"""ConvNeXt's block (issue #14): the row-blocked 7x7 depthwise kernel (codegen/conv_dw_rows.py)
and the whole block -- depthwise conv, permute, LayerNorm, Linear + GELU (erf), Linear, permute
back, layer scale, residual -- against onnxruntime at rtol 1e-4, with the plan pinned."""
import sys
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import apollo_py
from apollo_py import Options

sys.path.insert(0, str(Path(__file__).parent))
from models import conv_model, ort_run  # noqa: E402


def convnext_block_model(n, c, h, w, blocks=2, seed=0):
    """``blocks`` ConvNeXt blocks as torch's dynamo exporter writes them (GELU as erf)."""
    rng = np.random.default_rng(seed)
    inits, nodes = [], []

    def const(name, arr):
        inits.append(numpy_helper.from_array(np.asarray(arr, np.float32), name))
        return name
    const("sqrt2", np.float32(np.sqrt(2.0)))
    const("one", np.float32(1.0))
    const("half", np.float32(0.5))
    x = "x"
    for b in range(blocks):
        p = f"b{b}_"
        mk = helper.make_node
        nodes += [
            mk("Conv", [x, const(p + "wdw", rng.standard_normal((c, 1, 7, 7)) * 0.1),
                        const(p + "bdw", rng.standard_normal(c) * 0.1)], [p + "dw"],
               group=c, pads=[3, 3, 3, 3], kernel_shape=[7, 7]),
            mk("Transpose", [p + "dw"], [p + "t1"], perm=[0, 2, 3, 1]),
            mk("LayerNormalization", [p + "t1", const(p + "g", 1 + 0.1 * rng.standard_normal(c)),
                                      const(p + "be", 0.1 * rng.standard_normal(c))], [p + "ln"], axis=-1, epsilon=1e-6),
            mk("MatMul", [p + "ln", const(p + "w1", rng.standard_normal((c, 4 * c)) / np.sqrt(c))], [p + "m1"]),
            mk("Add", [p + "m1", const(p + "b1", 0.1 * rng.standard_normal(4 * c))], [p + "h"]),
            mk("Div", [p + "h", "sqrt2"], [p + "hd"]),
            mk("Erf", [p + "hd"], [p + "he"]),
            mk("Add", [p + "he", "one"], [p + "ha"]),
            mk("Mul", ["half", p + "ha"], [p + "hm"]),
            mk("Mul", [p + "h", p + "hm"], [p + "g1"]),
            mk("MatMul", [p + "g1", const(p + "w2", rng.standard_normal((4 * c, c)) / np.sqrt(4 * c))], [p + "m2"]),
            mk("Add", [p + "m2", const(p + "b2", 0.1 * rng.standard_normal(c))], [p + "o"]),
            mk("Transpose", [p + "o"], [p + "t2"], perm=[0, 3, 1, 2]),
            mk("Mul", [p + "t2", const(p + "ls", 0.5 + 0.1 * rng.standard_normal((c, 1, 1)))], [p + "sc"]),
            mk("Add", [p + "sc", x], [p + "y"]),
        ]
        x = p + "y"
    g = helper.make_graph(nodes, "convnext_block", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n, c, h, w])],
                          [helper.make_tensor_value_info(x, TensorProto.FLOAT, [n, c, h, w])], initializer=inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])


def test_convnext_blocks_match_onnxruntime():
    """Two blocks, odd channel count (37, 148 hidden), batch 2, 11x13 planes (rows of 13 padded
    to 16 lanes, 11 rows = two 4-row blocks and three single rows)."""
    m = convnext_block_model(2, 37, 11, 13)
    x = np.random.default_rng(1).standard_normal((2, 37, 11, 13)).astype(np.float32)
    f = apollo_py.jit(m, options=Options(num_threads=2))
    got = f(x=x)
    want = ort_run(m, {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))
    ks = f.plan.kernels
    dw = [k for k in ks if k.gemm is not None and k.nodes[0].op == "conv"]
    assert len(dw) == 2 and all("4 output rows per vector loop" in k.reason for k in dw), f.plan
    # per block: depthwise conv (+ bias), permute copy, LayerNorm (statistics, normalise),
    # Linear + bias + GELU, Linear + bias stored permuted, layer scale + residual
    assert len(ks) == 14, f.plan
    gemms = [k for k in ks if k.gemm is not None and k.nodes[0].op == "matmul"]
    assert len(gemms) == 4 and "erf" in [n.op for n in gemms[0].nodes]


@pytest.mark.parametrize("x_shape,pads,act", [
    ((1, 24, 16, 16), (3, 3, 3, 3), None),          # one 16-lane vector per row, 4 row blocks
    ((2, 5, 9, 30), (3, 3, 3, 3), "Relu"),          # 30 columns in 32 lanes, 9 rows: 2 blocks + 1
    ((1, 3, 12, 14), (2, 4, 1, 3), "SiLU"),         # asymmetric pads: 10 x 13 output, a row of 13
])
def test_row_blocked_depthwise_matches_onnxruntime(x_shape, pads, act):
    c = x_shape[1]
    m = conv_model(x_shape, (c, 1, 7, 7), pads=pads, group=c, act=act)
    x = np.random.default_rng(2).standard_normal(x_shape).astype(np.float32)
    f = apollo_py.jit(m, options=Options(num_threads=2))
    got = f(x=x)
    want = ort_run(m, {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))
    assert "4 output rows per vector loop" in f.plan.kernels[0].reason, f.plan


@pytest.mark.parametrize("x_shape,kernel,strides,dilations", [
    ((1, 16, 7, 7), (7, 7), (1, 1), (1, 1)),        # 7 columns in 16 lanes: conv_direct's flat form instead
    ((1, 8, 20, 20), (7, 7), (3, 3), (1, 1)),       # stride 3 (row-blocked: strides 1 and 2)
    ((1, 8, 20, 20), (5, 5), (1, 1), (2, 2)),       # dilation 2
])
def test_other_depthwise_convs_keep_conv_direct(x_shape, kernel, strides, dilations):
    c = x_shape[1]
    m = conv_model(x_shape, (c, 1, *kernel), pads=(3, 3, 3, 3) if kernel == (7, 7) else (2, 2, 2, 2),
                   strides=strides, dilations=dilations, group=c)
    x = np.random.default_rng(3).standard_normal(x_shape).astype(np.float32)
    f = apollo_py.jit(m, options=Options(num_threads=2))
    np.testing.assert_allclose(f(x=x), ort_run(m, {"x": x})[0], rtol=1e-4, atol=1e-4)
    r = f.plan.kernels[0].reason
    assert "direct conv" in r and "output rows per vector loop" not in r, f.plan
