"""Models written in Python with ap.nn, traced and compiled, against plain numpy (rtol 1e-5),
the memory-bound benchmark workloads' own numpy functions traced as they are, and plans of
ap.nn models against the plans of the same models imported from ONNX."""
import sys
from functools import partial
from pathlib import Path

import numpy as np
import pytest

import apollo_py as ap

from . import models as M

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import workloads  # noqa: E402

P = M.init(0)


def close(got, want, rtol=1e-5, atol=1e-5):
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype, want.shape, want.dtype)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)


CASES = M.CASES


@pytest.mark.parametrize("name", sorted(CASES))
def test_model_matches_numpy(name):
    model, pk, xk = CASES[name]
    f = ap.jit(partial(model, ap.nn))
    got = f(P[pk], P[xk])
    close(got, model(M.NumpyNN, P[pk], P[xk]))
    assert f.trace_count == 1


def test_softmax_layernorm_chain_matches_numpy():
    g, b = P["transformer"]["lnf_g"], P["transformer"]["lnf_b"]

    def chain(nn, x):
        y = nn.layer_norm(nn.softmax(x * 2.0, axis=-1), g, b)
        return nn.log_softmax(nn.layer_norm(y + x, g, b), axis=-1)
    x = P["x_attn"]
    close(ap.jit(partial(chain, ap.nn))(x), chain(M.NumpyNN, x))


MEMORY_BOUND = ["layernorm", "softmax", "logsoftmax", "bias_gelu", "bias_maxpool", "bias_reducesum",
                "four_branches"]


@pytest.mark.parametrize("name", MEMORY_BOUND)
def test_memory_bound_workload_numpy_code_traces_as_is(name):
    wl = workloads.build(name, quick=True)
    f = ap.jit(wl.numpy_fn)
    close(f(**wl.inputs), wl.numpy_fn(**wl.inputs), rtol=1e-5, atol=2e-5)


def _kernel_shape(plan):
    """Micro-graph kinds and ops, and the kernel sequence, without value names."""
    mgs = sorted((m.kind, tuple(m.ops)) for m in plan.micro_graphs)
    steps = [s.describe().split(":")[-1].split("[")[0].split("(")[0].strip() for s in plan.kernels]
    return mgs, sorted(steps)


def _onnx_chain():
    from onnx import TensorProto, helper, numpy_helper
    g, b = P["transformer"]["lnf_g"], P["transformer"]["lnf_b"]
    nodes = [helper.make_node("LayerNormalization", ["x", "g", "b"], ["ln"], axis=-1, epsilon=1e-5),
             helper.make_node("Softmax", ["ln"], ["sm"], axis=-1),
             helper.make_node("Gelu", ["sm"], ["y"])]
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 6, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 6, 16])],
                              initializer=[numpy_helper.from_array(g, "g"), numpy_helper.from_array(b, "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    model.ir_version = 9
    return model, lambda x: ap.nn.gelu(ap.nn.softmax(ap.nn.layer_norm(x, g, b)))


def _onnx_conv():
    from onnx import TensorProto, helper, numpy_helper
    p = P["conv"]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("MaxPool", ["r"], ["y"], kernel_shape=[2, 2], strides=[2, 2])]
    graph = helper.make_graph(nodes, "conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 6, 4, 4])],
                              initializer=[numpy_helper.from_array(p["w"], "w"), numpy_helper.from_array(p["b"], "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model, partial(M.conv_block, ap.nn, p)


def _onnx_attention():
    from onnx import TensorProto, helper, numpy_helper
    rng = np.random.default_rng(3)
    q = rng.standard_normal((2, 2, 6, 8)).astype(np.float32)
    k = rng.standard_normal((2, 2, 6, 8)).astype(np.float32)
    scale = np.asarray(1 / np.sqrt(8), np.float32)
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
             helper.make_node("MatMul", ["q", "kt"], ["s"]),
             helper.make_node("Mul", ["s", "scale"], ["ss"]),
             helper.make_node("Softmax", ["ss"], ["p"], axis=-1),
             helper.make_node("MatMul", ["p", "v"], ["y"])]
    graph = helper.make_graph(nodes, "attn", [helper.make_tensor_value_info("v", TensorProto.FLOAT, [2, 2, 6, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 2, 6, 8])],
                              initializer=[numpy_helper.from_array(q, "q"), numpy_helper.from_array(k, "k"),
                                           numpy_helper.from_array(scale, "scale")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model, lambda v: ap.nn.attention(q, k, v)


@pytest.mark.parametrize("build", [_onnx_chain, _onnx_conv, _onnx_attention], ids=["ln_softmax_gelu", "conv_block", "attention"])
def test_ap_nn_model_fuses_like_its_onnx_import(build):
    model, fn = build()
    onnx_f = ap.jit(model)
    x = np.random.default_rng(1).standard_normal(onnx_f.program.inputs[0].dims).astype(np.float32)
    traced = ap.jit(fn)
    close(traced(x), onnx_f(x), rtol=1e-5, atol=1e-6)
    assert _kernel_shape(traced.plan) == _kernel_shape(onnx_f.plan)
    assert len(traced.plan.kernels) == len(onnx_f.plan.kernels)
