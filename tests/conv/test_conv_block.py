"""Dense convs of few input channels (network stems) on the block kernel (codegen/conv_block.py),
against onnxruntime, and which convs take it."""
import sys
from pathlib import Path

import numpy as np
import pytest

import apollo_py
from apollo_py import Options

sys.path.insert(0, str(Path(__file__).parent))
from models import conv_model, ort_run  # noqa: E402

CASES = {
    # MobileNetV3's stem form (3 -> 16, 3x3 s2, BatchNorm, HardSwish), a row of 2 column groups + 1
    "stem_s2_hswish": ((1, 3, 66, 70), (16, 3, 3, 3), dict(strides=(2, 2), pads=(1, 1, 1, 1), bn=True,
                                                           act="HardSwish")),
    # EfficientNet / RegNetY form: 32 outputs = two blocks of 16 channels, SiLU
    "stem_s2_32_silu": ((1, 3, 40, 36), (32, 3, 3, 3), dict(strides=(2, 2), pads=(1, 1, 1, 1), bn=True, act="SiLU")),
    # odd sizes, asymmetric pads, 5 outputs (a channel block of 5), N = 2, last row block short
    "odd_n2_asym": ((2, 3, 17, 13), (5, 3, 3, 3), dict(strides=(2, 2), pads=(1, 0, 1, 2), act="Relu")),
    # stride 1, 5x5, 2 input channels, ReLU6; 40 outputs (blocks of 10)
    "s1_k5_cin2": ((2, 2, 9, 21), (40, 2, 5, 5), dict(pads=(2, 2, 2, 2), act="Clip6")),
    # unequal strides and dilation, 4 input channels (36 taps), no bias
    "dil_strides_cin4": ((1, 4, 12, 11), (24, 4, 3, 3), dict(strides=(1, 2), pads=(2, 1, 0, 1), dilations=(2, 1),
                                                             bias=False, act="SiLU")),
    # a Conv1d of one input channel (a 2-d conv of one row), stride 2, asymmetric pads, N = 2
    "conv1d_cin1_s2": ((2, 1, 101), (8, 1, 5), dict(strides=(2,), pads=(2, 1), dilations=(1,), act="Relu")),
    # stride 3 (nine phase sub-planes), 7 outputs, 1 input channel, 4x4 kernel
    "s3_k4_cin1": ((1, 1, 31, 29), (7, 1, 4, 4), dict(strides=(3, 3), pads=(1, 2, 2, 1), act="Sigmoid")),
}


def _run(case):
    xs, ws, kw = CASES[case]
    m = conv_model(xs, ws, **kw)
    x = np.random.default_rng(1).standard_normal(xs).astype(np.float32)
    f = apollo_py.jit(m, options=Options(num_threads=2))
    return f, f(x=x), ort_run(m, {"x": x})[0]


@pytest.mark.parametrize("case", sorted(CASES))
def test_block_conv_matches_onnxruntime(case):
    f, got, want = _run(case)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))
    ks = f.plan.kernels
    assert len(ks) == 1 and "dense conv of" in ks[0].reason and "direct conv" in ks[0].reason, f.plan
    assert ks[0].gemm.name.startswith("dconv_")


def test_which_convs_take_the_block_kernel():
    from apollo_py.codegen.conv_block import block_form
    from apollo_py.codegen.conv_direct import direct_conv_desc

    def geom(xs, ws, os_, s=1, p=1, group=1):
        attrs = dict(strides=(s, s), pads=(p, p, p, p), dilations=(1, 1), group=group)
        return direct_conv_desc("c", xs, ws, os_, attrs, "c").conv

    assert block_form(geom((1, 3, 224, 224), (16, 3, 3, 3), (1, 16, 112, 112), s=2), 16)
    assert not block_form(geom((1, 5, 32, 32), (16, 5, 3, 3), (1, 16, 32, 32)), 16)        # 5 input channels
    assert not block_form(geom((1, 3, 224, 224), (64, 3, 7, 7), (1, 64, 112, 112), s=2), 64)   # 147 taps
    assert not block_form(geom((1, 4, 8, 8), (8, 4, 1, 1), (1, 8, 8, 8), p=0), 8)           # 1x1
    assert not block_form(geom((1, 4, 8, 8), (8, 2, 3, 3), (1, 8, 8, 8), group=2), 8)       # grouped
    # a block's padded rows over the stack scratch: 4 channels x 4 phases x 9 rows x 1001 columns
    assert not block_form(geom((1, 4, 16, 2000), (8, 4, 3, 3), (1, 8, 8, 1000), s=2), 8)


def test_block_conv_switch_keeps_the_gemm_paths(monkeypatch):
    """``BLOCK_CONVS`` off: the stem runs on the implicit GEMM as before (A/B runs)."""
    import apollo_py.layers.gemm_lowering as GL
    monkeypatch.setattr(GL, "BLOCK_CONVS", False)
    f, got, want = _run("odd_n2_asym")
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))
    assert "dense conv of" not in f.plan.kernels[0].reason
