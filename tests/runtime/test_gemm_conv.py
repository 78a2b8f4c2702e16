"""target="cpu": matmul/conv micro-graphs on the generated GEMM (or BLAS), through ap.jit."""
import sys
from pathlib import Path

import numpy as np
import pytest

import apollo_py as ap
from apollo_py.runtime.blas import cblas

RTOL, ATOL = 1e-5, 1e-4


def _rand(rng, *shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


def _steps(f):
    return [k for k in f.plan.kernels]


def _mm_bias_relu(xs, ys, bias_shape, dtype="float32"):
    b = ap.GraphBuilder("mm")
    x, w, bias = b.input("x", xs, dtype), b.input("w", ys, dtype), b.input("bias", bias_shape, dtype)
    y = b.matmul(x, w)
    return b.build([b.relu(y + bias)])


@pytest.mark.parametrize("xs,ys,bias", [
    ((512, 512), (512, 512), (512,)),
    ((2, 512, 256), (256, 1024), (512, 1)),
    ((4, 1, 256, 256), (3, 256, 256), (3, 256, 256)),
])
def test_generated_gemm_fuses_the_epilogue(xs, ys, bias):
    f = ap.jit(_mm_bias_relu(xs, ys, bias), options=ap.Options(target="cpu", gemm="generated"))
    text = str(f.plan)
    assert "gemm" in text and "generated GEMM" in text and "epilogue add+relu" in text, text
    rng = np.random.default_rng(0)
    x, w, bv = _rand(rng, *xs), _rand(rng, *ys), _rand(rng, *bias)
    want = np.maximum(np.matmul(x.astype(np.float64), w) + bv, 0)
    np.testing.assert_allclose(f(x, w, bv), want, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("xs,ys,why", [
    ((64, 64), (64, 64), "BLAS measured faster"),
    ((512, 512), (512, 1), "BLAS measured faster"),
    ((1, 300), (300, 300), "Options(gemm='generated') forces it"),
])
def test_auto_picks_blas_and_says_why(xs, ys, why):
    b = ap.GraphBuilder("mm")
    x, w = b.input("x", xs), b.input("w", ys)
    f = ap.jit(b.build([b.tanh(b.matmul(x, w))]), target="cpu")
    text = str(f.plan)
    via = "cblas" if cblas() is not None else "numpy"
    assert f"matmul via {via}" in text and why in text, text
    rng = np.random.default_rng(1)
    xv, wv = _rand(rng, *xs), _rand(rng, *ys)
    np.testing.assert_allclose(f(xv, wv), np.tanh(xv.astype(np.float64) @ wv), rtol=RTOL, atol=ATOL)


def test_float64_matmul_stays_on_numpy():
    f = ap.jit(_mm_bias_relu((64, 64), (64, 64), (64,), "float64"), target="cpu")
    assert "float64 operands" in str(f.plan)
    rng = np.random.default_rng(2)
    x, w, bv = (_rand(rng, *s, dtype=np.float64) for s in ((64, 64), (64, 64), (64,)))
    np.testing.assert_allclose(f(x, w, bv), np.maximum(x @ w + bv, 0), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("xs,ys", [((37, 53), (53, 29)), ((17,), (17, 33)), ((3, 20, 17), (17,)),
                                   ((2, 1, 9, 17), (3, 17, 40))])
def test_forced_generated_odd_shapes(xs, ys):
    b = ap.GraphBuilder("mm")
    x, w = b.input("x", xs), b.input("w", ys)
    y = b.matmul(x, w)
    g = b.build([b.sigmoid(y) * y, y])
    f = ap.jit(g, target="cpu", options=ap.Options(gemm="generated"))
    assert "Options.gemm='generated'" in str(f.plan)
    rng = np.random.default_rng(3)
    xv, wv = _rand(rng, *xs), _rand(rng, *ys)
    mm = np.matmul(xv.astype(np.float64), wv)
    silu, raw = f(xv, wv)
    np.testing.assert_allclose(raw, mm, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(silu, mm / (1 + np.exp(-mm)), rtol=RTOL, atol=ATOL)


def test_forced_blas():
    f = ap.jit(_mm_bias_relu((512, 512), (512, 512), (512,)), target="cpu", options=ap.Options(gemm="blas"))
    assert "Options.gemm='blas'" in str(f.plan)
    rng = np.random.default_rng(7)
    x, w, bias = _rand(rng, 512, 512), _rand(rng, 512, 512), _rand(rng, 512)
    want = np.maximum(np.matmul(x.astype(np.float64), w) + bias, 0)
    np.testing.assert_allclose(f(x, w, bias), want, rtol=RTOL, atol=ATOL)


def _conv_graph(xs, ws, strides, pads, dil, group):
    b = ap.GraphBuilder("conv")
    x, w = b.input("x", xs), b.input("w", ws)
    scale, shift = b.input("scale", (ws[0], 1, 1)), b.input("shift", (ws[0], 1, 1))
    c = b.op("conv", x, w, strides=strides, pads=pads, dilations=dil, group=group)[0]
    bn = c * scale + shift
    return b.build([b.where(b.ge(bn, 0.0), bn, bn * 0.1)])


@pytest.mark.parametrize("xs,ws,strides,pads,dil,group", [
    ((2, 8, 14, 14), (16, 8, 3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 1),
    ((1, 6, 15, 13), (9, 2, 3, 3), (2, 2), (0, 1, 2, 0), (1, 1), 3),
    ((2, 4, 12, 10), (5, 4, 3, 2), (1, 2), (2, 2, 2, 2), (2, 3), 1),
])
def test_conv_epilogue_fused(xs, ws, strides, pads, dil, group):
    from apollo_py.ops.structural import conv_reference
    f = ap.jit(_conv_graph(xs, ws, strides, pads, dil, group), target="cpu")
    text = str(f.plan)
    # narrow groups (2 in, 3 out channels per group) run the direct kernel (codegen/conv_direct.py),
    # so do dense convs of at most 4 input channels (the block kernel, codegen/conv_block.py)
    kind = "direct conv" if group > 1 or xs[1] <= 4 else "implicit-GEMM conv"
    assert kind in text and "epilogue mul+add+" in text and "+where)" in text, text
    rng = np.random.default_rng(4)
    x, w = _rand(rng, *xs), _rand(rng, *ws)
    sc, sh = _rand(rng, ws[0], 1, 1), _rand(rng, ws[0], 1, 1)
    bn = conv_reference(x.astype(np.float64), w.astype(np.float64), strides, pads, dil, group) * sc + sh
    np.testing.assert_allclose(f(x, w, sc, sh), np.where(bn >= 0, bn, 0.1 * bn), rtol=RTOL, atol=ATOL)


def test_conv1d_falls_back_with_reason():
    b = ap.GraphBuilder("c1")
    x, w = b.input("x", (2, 3, 20)), b.input("w", (4, 3, 5))
    f = ap.jit(b.build([b.op("conv", x, w, strides=(1,), pads=(2, 2), dilations=(1,), group=1)[0]]),
               target="cpu")
    assert "1-d conv" in str(f.plan)
    from apollo_py.ops.structural import conv_reference
    rng = np.random.default_rng(8)
    xv, wv = _rand(rng, 2, 3, 20), _rand(rng, 4, 3, 5)
    want = conv_reference(xv.astype(np.float64), wv.astype(np.float64), (1,), (2, 2), (1,), 1)
    got = f(xv, wv)
    assert got.shape == want.shape == (2, 4, 20)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


def test_conv_bn_leakyrelu_residual_matches_onnxruntime(monkeypatch):
    ort = pytest.importorskip("onnxruntime")
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import workloads
    from apollo_py.codegen import gemm
    # the quick workload's conv is under SMALL_CONV_FLOPS (the calling thread's implicit GEMM);
    # lifted, its 3x3 conv with a constant weight takes the row-reading kernel (codegen/conv_rows.py)
    monkeypatch.setattr(gemm, "SMALL_CONV_FLOPS", 0)
    wl = workloads.conv_bn_lrelu_res(quick=True)
    f = ap.jit(wl.model, target="cpu")
    assert "row-reading conv" in str(f.plan)
    sess = ort.InferenceSession(wl.model.SerializeToString(), providers=["CPUExecutionProvider"])
    want = sess.run(None, wl.inputs)[0]
    got = f.run(**wl.inputs)[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_partial_epilogue_then_layer1_softmax():
    """The elementwise prefix is fused into the GEMM; the softmax reductions go to layer 1."""
    b = ap.GraphBuilder("mm_softmax")
    x, w, bias = b.input("x", (256, 96)), b.input("w", (96, 320)), b.input("bias", (320,))
    y = b.matmul(x, w) + bias
    e = b.exp(y - b.reduce_max(y, axes=(1,), keepdims=True))
    f = ap.jit(b.build([e / b.reduce_sum(e, axes=(1,), keepdims=True)]), target="cpu",
               options=ap.Options(gemm="generated"))
    kinds = [k.to_dict()["kind"] for k in f.plan.kernels]
    assert kinds[0] == "gemm" and "kernel" in kinds[1:], str(f.plan)
    rng = np.random.default_rng(6)
    xv, wv, bv = _rand(rng, 256, 96), _rand(rng, 96, 320), _rand(rng, 320)
    yv = xv.astype(np.float64) @ wv + bv
    ev = np.exp(yv - yv.max(1, keepdims=True))
    np.testing.assert_allclose(f(xv, wv, bv), ev / ev.sum(1, keepdims=True), rtol=1e-5, atol=1e-6)
