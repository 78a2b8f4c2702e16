"""BatchNorm / per-channel affine folding into conv weights (partition/conv_fold.py) and the
direct depthwise / grouped conv kernel (codegen/conv_direct.py), against onnxruntime."""
import sys
from pathlib import Path

import numpy as np
import pytest

import apollo_py
from apollo_py import Options

sys.path.insert(0, str(Path(__file__).parent))
from models import conv_model, ort_run  # noqa: E402

CASES = {
    # dense conv + BatchNormalization (the exporter spelling) + activations
    "bn_relu": ((1, 8, 13, 11), (16, 8, 3, 3), dict(pads=(1, 1, 1, 1), bn=True, act="Relu")),
    "bn_nobias_hswish": ((2, 5, 9, 7), (7, 5, 3, 3), dict(strides=(2, 2), pads=(1, 1, 1, 1), bias=False, bn=True,
                                                          act="HardSwish")),
    # torch-decomposition spelling: sub / mul / add / div by (C,1,1) and (1,C,1,1) constants
    "decomposed_bn_silu": ((1, 6, 9, 10), (6, 3, 3, 3), dict(group=2, bias=False, act="SiLU", post=[
        ("Sub", (6, 1, 1)), ("Mul", (6, 1, 1)), ("Add", (1, 6, 1, 1)), ("Div", (6, 1, 1))])),
    # depthwise: odd sizes, strides, asymmetric pads, dilation, 3x3 / 5x5 / 7x7
    "dw3_pad_relu6": ((1, 8, 13, 11), (8, 1, 3, 3), dict(pads=(1, 1, 1, 1), group=8, bn=True, act="Clip6")),
    "dw5_s2": ((2, 6, 9, 10), (6, 1, 5, 5), dict(strides=(2, 2), pads=(2, 2, 2, 2), group=6, act="HardSwish")),
    "dw3_dil2_asym": ((1, 5, 11, 13), (5, 1, 3, 3), dict(pads=(2, 1, 2, 3), dilations=(2, 2), group=5,
                                                         act="Sigmoid")),
    "dw7_convnext": ((1, 16, 7, 7), (16, 1, 7, 7), dict(pads=(3, 3, 3, 3), group=16)),
    "dw3_nopad_narrow": ((1, 4, 3, 20), (4, 1, 3, 3), dict(group=4, bias=False)),
    # strided flat form (phase sub-planes): stride 2 with dilation and asymmetric pads, stride 3
    "dw3_s2_dil2_asym": ((1, 6, 17, 14), (6, 1, 3, 3), dict(strides=(2, 2), pads=(1, 2, 0, 1), dilations=(2, 2),
                                                            group=6, act="SiLU")),
    "dw4_s3": ((2, 5, 16, 19), (5, 1, 4, 4), dict(strides=(3, 3), pads=(1, 1, 2, 2), group=5, act="HardSwish")),
    "grouped_s2": ((1, 8, 11, 11), (8, 2, 3, 3), dict(strides=(2, 2), pads=(1, 1, 1, 1), group=4, bn=True)),
    # rows of FLAT_MAX_OW and more keep the row form
    "dw3_wide_rows": ((1, 4, 5, 70), (4, 1, 3, 3), dict(pads=(1, 1, 1, 1), group=4, act="Relu")),
    "dw3_s2_wide_rows": ((1, 3, 6, 130), (3, 1, 3, 3), dict(strides=(2, 2), pads=(1, 1, 1, 1), group=3, act="SiLU")),
    # below FLAT_MAX_OW: the flat form (a 56-wide stride-2 row, ConvNeXt's 7x7)
    "dw3_s2_56": ((1, 3, 9, 112), (3, 1, 3, 3), dict(strides=(2, 2), pads=(1, 1, 1, 1), group=3, act="HardSwish")),
    "dw7_56": ((1, 2, 9, 56), (2, 1, 7, 7), dict(pads=(3, 3, 3, 3), group=2)),
    # channel multiplier 2 (Cout = 2 * Cin), grouped with 3 channels per group, strided + dilated
    "dw_mult2": ((1, 4, 9, 9), (8, 1, 3, 3), dict(pads=(1, 1, 1, 1), group=4, act="Relu")),
    "grouped": ((1, 12, 15, 17), (24, 3, 3, 3), dict(strides=(2, 1), pads=(1, 0, 2, 1), dilations=(2, 1), group=4,
                                                     act="SiLU")),
    # squeeze-excitation 1x1 convs of a 1x1 image: matrix-vector kernels (K = 40, 200: lane tails)
    "se_matvec": ((2, 40, 1, 1), (24, 40, 1, 1), dict(act="Relu")),
    "se_matvec_hsig": ((1, 200, 1, 1), (37, 200, 1, 1), dict(bn=True, act="Sigmoid")),
    "se_matvec_grouped": ((1, 8, 1, 1), (12, 2, 1, 1), dict(group=4)),
}


def _run(case):
    xs, ws, kw = CASES[case]
    m = conv_model(xs, ws, **kw)
    x = np.random.default_rng(1).standard_normal(xs).astype(np.float32)
    f = apollo_py.jit(m, options=Options(num_threads=2))
    return f, f(x=x), ort_run(m, {"x": x})[0]


@pytest.mark.parametrize("case", sorted(CASES))
def test_conv_matches_onnxruntime(case):
    f, got, want = _run(case)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))


@pytest.mark.parametrize("case", ["bn_relu", "decomposed_bn_silu", "dw3_pad_relu6"])
def test_batchnorm_folded_into_weights(case):
    """The affine chain is gone: one conv step whose nodes are conv, one bias add, the activation."""
    f, _, _ = _run(case)
    ks = f.plan.kernels
    assert len(ks) == 1
    ops = [n.op for n in ks[0].nodes]
    assert ops[:2] == ["conv", "add"] and ops.count("add") == 1, ops
    assert not {"sub", "div", "rsqrt", "sqrt"} & set(ops), ops
    assert "mul" not in ops or ops[-1] == "mul" and ks[0].nodes[-2].op == "sigmoid", ops   # SiLU's mul only


@pytest.mark.parametrize("case", ["dw3_pad_relu6", "dw5_s2", "dw_mult2", "grouped", "se_matvec"])
def test_depthwise_and_grouped_conv_is_one_direct_kernel(case):
    f, _, _ = _run(case)
    ks = f.plan.kernels
    assert len(ks) == 1 and "direct conv" in ks[0].reason, f.plan
    assert ks[0].gemm.name.startswith("dconv_")
    assert "define void @dconv_" in ks[0].source()


def test_fold_keeps_chains_it_must_not_fold():
    """A spatially varying constant, or an intermediate graph output, stops the chain."""
    from onnx import TensorProto, helper, numpy_helper
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "W")
    k_sp = numpy_helper.from_array(rng.standard_normal((1, 1, 5, 5)).astype(np.float32), "K")
    k_ch = numpy_helper.from_array(rng.standard_normal((1, 4, 1, 1)).astype(np.float32), "S")
    nodes = [helper.make_node("Conv", ["x", "W"], ["c"]),
             helper.make_node("Mul", ["c", "S"], ["m"]),        # 'c' is also an output: not folded
             helper.make_node("Mul", ["m", "K"], ["y"])]        # spatial constant: never folded
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 7, 7])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
                           helper.make_tensor_value_info("c", TensorProto.FLOAT, None)], [w, k_sp, k_ch])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    x = rng.standard_normal((1, 3, 7, 7)).astype(np.float32)
    f = apollo_py.jit(m, options=Options(num_threads=2))
    got = f(x=x)
    want = ort_run(m, {"x": x})
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    ops = [n.op for k in f.plan.kernels for n in (k.nodes or getattr(k.fused, "nodes", ()))]
    assert ops.count("mul") == 2 and ops.count("conv") == 1, ops


def test_constant_weight_packed_once_and_weight_as_input():
    """A conv's constant weight is packed on the first call and reused (results still match on
    new inputs); a weight that is a graph input is packed on every call."""
    from onnx import TensorProto, helper
    xs, ws, kw = CASES["bn_relu"]
    m = conv_model(xs, ws, **kw)
    f = apollo_py.jit(m, options=Options(num_threads=2))
    rng = np.random.default_rng(3)
    for _ in range(2):
        x = rng.standard_normal(xs).astype(np.float32)
        want = ort_run(m, {"x": x})[0]
        np.testing.assert_allclose(f(x=x), want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))
    step = f._last.steps[0]
    assert step.const_inputs and step.compiled.desc.a_const and step.compiled._packed_a[1] is not None
    g = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 5, 9, 9]),
                           helper.make_tensor_value_info("w", TensorProto.FLOAT, [12, 5, 3, 3])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    m2 = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    f2 = apollo_py.jit(m2, options=Options(num_threads=2))
    for _ in range(2):
        feeds = {"x": rng.standard_normal((1, 5, 9, 9)).astype(np.float32),
                 "w": rng.standard_normal((12, 5, 3, 3)).astype(np.float32)}
        np.testing.assert_allclose(f2(**feeds), ort_run(m2, feeds)[0], rtol=1e-4, atol=1e-4)
    assert not f2._last.steps[0].compiled.desc.a_const and f2._last.steps[0].compiled._packed_a[1] is None


@pytest.mark.parametrize("case", ["dw5_s2", "dw3_dil2_asym", "grouped"])
def test_direct_conv_border_form(case, monkeypatch, tmp_path):
    """Planes too large for the padded stack scratch use the border form (interior vector loop,
    clamped scalar borders): same numbers."""
    import apollo_py.codegen.conv_direct as CD
    monkeypatch.setattr(CD, "SCRATCH_BYTES", 0)
    xs, ws, kw = CASES[case]
    m = conv_model(xs, ws, **kw)
    x = np.random.default_rng(2).standard_normal(xs).astype(np.float32)
    f = apollo_py.jit(m, options=Options(num_threads=2, cache_dir=str(tmp_path)))
    got, want = f(x=x), ort_run(m, {"x": x})[0]
    assert "xpad" not in f.plan.kernels[0].source()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))
