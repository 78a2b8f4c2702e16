"""Dense 1x1 (pointwise) convs, batch 1, NCHW: every kernel class a 1x1 conv can take against
onnxruntime (rtol / atol 1e-5 of the output's scale) -- odd channel counts, 7x7 / 14x14 / 28x28 /
56x56 planes, strided, with a bias and ReLU / SiLU epilogues -- and which kernel each shape
class gets (plan pins): the channel-vector conv for planes of at most ``conv_cvec.MAX_PIXELS``
pixels, the row-reading conv (input read in place) for larger planes past
``gemm.SMALL_CONV_FLOPS``, the implicit GEMM below it except strided convs read in place (the
channel-vector conv, ``conv_cvec.STRIDED_SMALL``); and the channel-vector conv's balanced
split of tiles between threads (``conv_cvec.BALANCE``)."""
import sys
from pathlib import Path

import numpy as np
import pytest

import apollo_py
from apollo_py import Options
from apollo_py.codegen import conv_cvec as CV

sys.path.insert(0, str(Path(__file__).parent))
from models import conv_model, ort_run  # noqa: E402

# name -> (x shape, Cout, stride, activation, kernel the plan must name)
CASES = {
    # RegNetY-016 / ResNet-50 / MobileNetV3 classes at their plane sizes
    "7x7_odd": ((1, 229, 7, 7), 173, 1, "Relu", "channel-vector conv"),
    "7x7_888_silu": ((1, 888, 7, 7), 888, 1, "SiLU", "channel-vector conv"),
    "14x14_336": ((1, 336, 14, 14), 336, 1, None, "channel-vector conv"),
    "14x14_odd_relu": ((1, 301, 14, 14), 211, 1, "Relu", "channel-vector conv"),
    "28x28_s2_to_14": ((1, 120, 28, 28), 336, 2, None, "channel-vector conv"),
    "28x28_120": ((1, 120, 28, 28), 120, 1, "Relu", "row-reading conv"),
    "28x28_odd_silu": ((1, 131, 28, 28), 157, 1, "SiLU", "row-reading conv"),
    "56x56_64to256": ((1, 64, 56, 56), 256, 1, None, "row-reading conv"),
    "56x56_s2_to_28": ((1, 256, 56, 56), 136, 2, "Relu", "row-reading conv"),
    # under SMALL_CONV_FLOPS (14.5 MFLOP): the implicit GEMM, run inline by the native driver
    "56x56_48_small": ((1, 48, 56, 56), 48, 1, "Relu", "implicit-GEMM conv"),
    "28x28_odd_small": ((1, 37, 28, 28), 61, 1, "SiLU", "implicit-GEMM conv"),
    # strided, under SMALL_CONV_FLOPS, any plane (conv_cvec.STRIDED_SMALL): the channel-vector conv
    "112_s2_to_56_small": ((1, 32, 112, 112), 48, 2, "Relu", "channel-vector conv"),
    "56_s2_odd_small": ((1, 37, 56, 57), 45, 2, "SiLU", "channel-vector conv"),
}


@pytest.mark.parametrize("balance", [True, False], ids=["balanced", "unbalanced"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_pointwise_matches_onnxruntime(case, balance, monkeypatch, tmp_path):
    monkeypatch.setattr(CV, "BALANCE", balance)
    xs, cout, s, act, kernel = CASES[case]
    m = conv_model(xs, (cout, xs[1], 1, 1), strides=(s, s), act=act)
    x = np.random.default_rng(5).standard_normal(xs).astype(np.float32)
    f = apollo_py.jit(m, options=Options(num_threads=2, cache_dir=str(tmp_path)))
    want = ort_run(m, {"x": x})[0]
    got = f(x=x)
    assert got.shape == want.shape and got.dtype == np.float32
    scale = float(np.abs(want).max())
    np.testing.assert_allclose(got / scale, want / scale, rtol=1e-5, atol=1e-5)
    convs = [k for k in f.plan.kernels if "conv" in k.reason]
    assert len(convs) == 1 and kernel in convs[0].reason, str(f.plan)


@pytest.mark.parametrize("case", ["112_s2_to_56_small", "56_s2_odd_small"])
def test_strided_small_switch(case, monkeypatch, tmp_path):
    """``STRIDED_SMALL`` off: the strided small 1x1 convs past MAX_PIXELS are the implicit GEMM's
    again; the same numbers either way."""
    xs, cout, s, act, _ = CASES[case]
    m = conv_model(xs, (cout, xs[1], 1, 1), strides=(s, s), act=act)
    x = np.random.default_rng(6).standard_normal(xs).astype(np.float32)
    got = {}
    for flag in (True, False):
        monkeypatch.setattr(CV, "STRIDED_SMALL", flag)
        f = apollo_py.jit(m, options=Options(num_threads=2, cache_dir=str(tmp_path / str(flag))))
        got[flag] = f(x=x)
        convs = [k for k in f.plan.kernels if "conv" in k.reason]
        assert ("channel-vector conv" if flag else "implicit-GEMM conv") in convs[0].reason, str(f.plan)
    np.testing.assert_allclose(got[True], got[False], rtol=1e-5, atol=1e-5 * float(np.abs(got[False]).max()))


def _cvec_desc(x_shape, cout):
    """The conv GEMM of a 1x1 conv as the lowering builds it (GemmStep of a one-conv model)."""
    from apollo_py.runtime.gemm_step import GemmStep
    f = apollo_py.jit(conv_model(x_shape, (cout, x_shape[1], 1, 1)), options=Options(num_threads=2))
    f(x=np.zeros(x_shape, np.float32))
    steps = [s for s in f._last.steps if isinstance(s, GemmStep)]
    return steps[0].compiled.desc


@pytest.mark.parametrize("x_shape,cout,tiles_off,tiles_on", [
    ((1, 336, 14, 14), 336, 11, 22),      # RegNetY's 336 channels: 11 panels -> 2 bands
    ((1, 888, 7, 7), 888, 28, 28),        # 28 panels divide already
    ((1, 112, 14, 14), 672, 21, 21),      # 21 panels: within BALANCE_SLACK
    ((1, 2048, 7, 7), 512, 16, 16),
])
def test_balanced_tiles(x_shape, cout, tiles_off, tiles_on, monkeypatch):
    """Two threads: the tile count divides among them within BALANCE_SLACK, by more bands of
    output rows where the panels alone do not."""
    from apollo_py.codegen.gemm import canonical, host_blocking
    d = canonical(_cvec_desc(x_shape, cout))
    bl = CV.cvec_blocking(d.conv, d.m, host_blocking().vl)
    if bl.nv != 2 or bl.vl != 16:
        pytest.skip("tile counts pinned for AVX-512's 32-channel panels")
    monkeypatch.setattr(CV, "BALANCE", False)
    assert CV.cvec_layout(d, bl, 2).tiles == tiles_off
    monkeypatch.setattr(CV, "BALANCE", True)
    lay = CV.cvec_layout(d, bl, 2)
    assert lay.tiles == tiles_on
    assert CV._imbalance(lay.tiles, 2) <= 1 + CV.BALANCE_SLACK
    assert CV.cvec_layout(d, bl, 1).tiles == tiles_off      # one thread: nothing to balance
