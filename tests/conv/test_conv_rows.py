"""The row-reading dense conv (codegen/conv_rows.py) against onnxruntime: odd sizes, pads,
strides 1/2, dilations, groups, batch 2, fused epilogues, and which convs take it (plan pins)."""
import sys
from pathlib import Path

import numpy as np
import pytest

import apollo_py
from apollo_py import Options

sys.path.insert(0, str(Path(__file__).parent))
from models import conv_model, ort_run  # noqa: E402


@pytest.fixture(autouse=True)
def _rows_for_small_convs(monkeypatch):
    """The cases here are small (fast to test): below ``SMALL_CONV_FLOPS`` they would run on the
    calling thread's implicit GEMM, so the threshold is lifted for them; dense convs of few input
    channels (``no_pad_k2``) would take the block kernel (codegen/conv_block.py), switched off."""
    from apollo_py.codegen import gemm
    from apollo_py.layers import gemm_lowering
    monkeypatch.setattr(gemm, "SMALL_CONV_FLOPS", 0)
    monkeypatch.setattr(gemm_lowering, "BLOCK_CONVS", False)

# name -> (x shape, w shape, strides, pads, dilations, group, activation, BatchNorm)
CASES = {
    "3x3_odd": ((1, 8, 13, 11), (16, 8, 3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 1, "Relu", True),
    "3x3_s2_n2": ((2, 5, 17, 19), (20, 5, 3, 3), (2, 2), (1, 1, 1, 1), (1, 1), 1, None, True),
    "stem7_s2": ((1, 3, 23, 21), (9, 3, 7, 7), (2, 2), (3, 3, 3, 3), (1, 1), 1, "Relu", False),
    "asym_dil": ((1, 6, 12, 14), (13, 6, 3, 2), (1, 2), (2, 0, 1, 1), (2, 1), 1, "SiLU", False),
    "grouped_n2": ((2, 16, 9, 9), (24, 8, 3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 2, "Relu", True),
    "7x7_spatial": ((1, 16, 7, 7), (40, 16, 3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 1, "Relu", True),
    "s2_dil2_k5": ((1, 4, 19, 18), (7, 4, 5, 5), (2, 2), (4, 3, 2, 4), (2, 2), 1, None, False),
    "no_pad_k2": ((2, 3, 10, 33), (70, 3, 2, 2), (1, 1), (0, 0, 0, 0), (1, 1), 1, "Clip6", False),
    # K = 1200: more than one K block (KC 256), M not a multiple of the micro-tile's rows
    "deep_k": ((1, 48, 11, 10), (37, 48, 5, 5), (1, 1), (2, 2, 2, 2), (1, 1), 1, "Relu", False),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_row_conv_matches_onnxruntime(case):
    xs, ws, st, pd, dl, g, act, bn = CASES[case]
    m = conv_model(xs, ws, strides=st, pads=pd, dilations=dl, group=g, act=act, bn=bn)
    x = np.random.default_rng(3).standard_normal(xs).astype(np.float32)
    f = apollo_py.jit(m, options=Options(num_threads=2))
    want = ort_run(m, {"x": x})[0]
    np.testing.assert_allclose(f(x=x), want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))
    gemms = [k for k in f.plan.kernels if "conv" in k.reason]
    assert len(gemms) == 1 and "row-reading conv" in gemms[0].reason, str(f.plan)
    np.testing.assert_allclose(f(x=x + 1), ort_run(m, {"x": x + 1})[0], rtol=1e-4,
                               atol=1e-4 * float(np.abs(want).max()))


def test_row_conv_residual_epilogue_and_1d():
    """A residual add (an epilogue operand indexed by output column) and a Conv1d."""
    import onnx
    from onnx import helper, numpy_helper
    rng = np.random.default_rng(5)
    w = (rng.standard_normal((6, 6, 3, 3)) * 0.3).astype(np.float32)
    w1 = (rng.standard_normal((5, 6, 3)) * 0.3).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "W"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Add", ["c", "x"], ["r"]), helper.make_node("Relu", ["r"], ["y"]),
             helper.make_node("Reshape", ["y", "s"], ["y1"]),
             helper.make_node("Conv", ["y1", "W1"], ["z"], pads=[2, 0], strides=[2])]
    g = helper.make_graph(nodes, "res", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, (2, 6, 9, 7))],
                          [helper.make_tensor_value_info("z", onnx.TensorProto.FLOAT, None)],
                          [numpy_helper.from_array(w, "W"), numpy_helper.from_array(w1, "W1"),
                           numpy_helper.from_array(np.array([2, 6, 63], np.int64), "s")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    x = rng.standard_normal((2, 6, 9, 7)).astype(np.float32)
    f = apollo_py.jit(m, options=Options(num_threads=2))
    np.testing.assert_allclose(f(x=x), ort_run(m, {"x": x})[0], rtol=1e-4, atol=1e-4)
    rows = [k for k in f.plan.kernels if "row-reading conv" in k.reason]
    assert len(rows) == 2 and "epilogue add+relu" in rows[0].reason, str(f.plan)


# 1x1 convs read in place: a partial last panel (its side copy), none, batch 2 with groups
POINTWISE = {
    "tail": ((1, 40, 7, 7), (24, 40, 1, 1), 1),
    "no_tail": ((1, 300, 8, 8), (20, 300, 1, 1), 1),
    "n2_groups": ((2, 32, 5, 9), (40, 16, 1, 1), 2),
}
# 1x1 convs with a stride or padding: a copy of the one sub-plane they read
POINTWISE_COPY = {
    "s2": ((1, 24, 14, 13), (40, 24, 1, 1), (2, 2), (0, 0, 0, 0)),
    "s2_pad": ((2, 8, 9, 10), (12, 8, 1, 1), (2, 1), (1, 0, 2, 1)),
}


@pytest.mark.parametrize("case", sorted(POINTWISE_COPY))
def test_pointwise_conv_strided_or_padded(case):
    xs, ws, st, pd = POINTWISE_COPY[case]
    m = conv_model(xs, ws, strides=st, pads=pd, act="Relu")
    x = np.random.default_rng(6).standard_normal(xs).astype(np.float32)
    f = apollo_py.jit(m, options=Options(num_threads=2))
    want = ort_run(m, {"x": x})[0]
    np.testing.assert_allclose(f(x=x), want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))
    assert "row-reading conv" in str(f.plan) and "padded copy" in str(f.plan), str(f.plan)


@pytest.mark.parametrize("case", sorted(POINTWISE))
def test_pointwise_conv_reads_input_in_place(case):
    xs, ws, g = POINTWISE[case]
    m = conv_model(xs, ws, group=g, act="Relu", bn=True)
    x = np.random.default_rng(4).standard_normal(xs).astype(np.float32)
    f = apollo_py.jit(m, options=Options(num_threads=2))
    want = ort_run(m, {"x": x})[0]
    np.testing.assert_allclose(f(x=x), want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))
    assert "1x1 conv: input rows read in place" in str(f.plan), str(f.plan)


def test_other_convs_stay_on_implicit_gemm():
    """1x1 convs of fewer than 32 pixels at stride 1 (a copy would cost more than the pack), convs
    of more than ``MAX_TAPS`` taps and convs whose weight is not a constant keep the implicit GEMM; with
    ``conv_rows.ENABLED`` off every conv does."""
    import apollo_py.codegen.conv_rows as CR
    # and a patch embedding (ViT's 16x16 stride 16 has 256 taps per channel, over MAX_TAPS: its
    # offset table made LLVM's O3 run for minutes)
    for xs, ws, kw in (((1, 8, 5, 5), (4, 8, 1, 1), {}), ((1, 3, 32, 32), (8, 3, 16, 16), {"strides": (16, 16)})):
        m = conv_model(xs, ws, act="Relu", **kw)
        f = apollo_py.jit(m, options=Options(num_threads=2))
        assert "implicit-GEMM conv" in str(f.plan) and "row-reading" not in str(f.plan), str(f.plan)
        x = np.random.default_rng(2).standard_normal(xs).astype(np.float32)
        np.testing.assert_allclose(f(x=x), ort_run(m, {"x": x})[0], rtol=1e-4, atol=1e-4)
    b = apollo_py.GraphBuilder("c")
    x, w = b.input("x", (1, 3, 8, 8)), b.input("w", (4, 3, 3, 3))
    f2 = apollo_py.jit(b.build([b.op("conv", x, w, strides=(1, 1), pads=(1, 1, 1, 1), dilations=(1, 1),
                                     group=1)[0]]), target="cpu")
    assert "implicit-GEMM conv" in str(f2.plan)
    m3 = conv_model((1, 8, 6, 6), (4, 8, 3, 3), pads=(1, 1, 1, 1))
    xv = np.random.default_rng(2).standard_normal((1, 8, 6, 6)).astype(np.float32)
    CR.ENABLED = False
    try:
        f3 = apollo_py.jit(m3, options=Options(num_threads=2))
        assert "implicit-GEMM conv" in str(f3.plan)
        got = f3(x=xv)
    finally:
        CR.ENABLED = True
    np.testing.assert_allclose(got, ort_run(m3, {"x": xv})[0], rtol=1e-4, atol=1e-4)


def test_tuner_plan_steps_reads_a_row_reading_conv():
    """The tuner's plan record (tuning/tuner.py ``plan_steps``) reads every generated GEMM's
    blocking, layout and thread choice; a row-reading conv has them too (it never runs inline)."""
    from apollo_py.tuning.tuner import plan_steps
    m = conv_model((1, 8, 12, 12), (16, 8, 3, 3), pads=(1, 1, 1, 1), act="Relu")
    x = np.random.default_rng(6).standard_normal((1, 8, 12, 12)).astype(np.float32)
    f = apollo_py.jit(m, options=Options(num_threads=2))
    f(x=x)
    assert "row-reading conv" in str(f.plan)
    rows = plan_steps(f.specialization({"x": x.shape}))
    assert any(r[-1] is False and len(r) >= 5 for r in rows if r[0] == "gemm"), rows
