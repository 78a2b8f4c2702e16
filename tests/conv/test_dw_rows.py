"""The row-blocked depthwise kernel (codegen/conv_dw_rows.py) for MobileNet / EfficientNet's
3x3 and 5x5 convs: strides 1 and 2 (column phases in the scratch row), odd sizes, batch 2, with
the squeeze of a squeeze-excitation block summed per plane; the channel-vector kernel
(codegen/conv_dw_cvec.py) for 5x5 convs on 7x7 planes -- numbers against onnxruntime, plan pins
(one direct kernel, the form)."""
import sys
from pathlib import Path

import numpy as np
import pytest

import apollo_py
from apollo_py import Options

sys.path.insert(0, str(Path(__file__).parent))
from models import conv_model, ort_run, se_block_model  # noqa: E402

ROWS = "output rows per vector loop"


@pytest.mark.parametrize("x_shape,k,s,pads,act", [
    ((1, 16, 32, 32), 3, 1, (1, 1, 1, 1), "Relu"),           # whole 16-lane vectors, 8 row blocks
    ((2, 5, 19, 30), 3, 1, (1, 1, 1, 1), "HardSwish"),       # batch 2, 30 columns in 32 lanes, 19 rows
    ((1, 7, 17, 29), 5, 1, (2, 2, 2, 2), "SiLU"),            # 5x5, 29 columns
    ((1, 6, 33, 61), 3, 2, (1, 1, 1, 1), "Clip6"),           # stride 2, odd input: 17 x 31 output
    ((2, 3, 36, 60), 3, 2, (0, 0, 1, 1), None),              # stride 2, pads only bottom / right (TF 'SAME')
    ((1, 9, 31, 27), 5, 2, (2, 2, 2, 2), "Relu"),            # 5x5 stride 2: 16 x 14 output
    ((1, 4, 13, 29), 5, 2, (1, 2, 3, 0), "SiLU"),            # asymmetric pads, 5x5 stride 2: 7 x 14
])
def test_row_blocked_depthwise_3x3_5x5_matches_onnxruntime(x_shape, k, s, pads, act):
    c = x_shape[1]
    m = conv_model(x_shape, (c, 1, k, k), strides=(s, s), pads=pads, group=c, act=act)
    x = np.random.default_rng(4).standard_normal(x_shape).astype(np.float32)
    f = apollo_py.jit(m, options=Options(num_threads=2))
    want = ort_run(m, {"x": x})[0]
    np.testing.assert_allclose(f(x=x), want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))
    assert len(f.plan.kernels) == 1 and ROWS in f.plan.kernels[0].reason, f.plan


@pytest.mark.parametrize("kw", [
    dict(x_shape=(2, 20, 13, 14), k=5, act="Relu", gate="HardSigmoid", mean="GlobalAveragePool"),
    dict(x_shape=(1, 24, 28, 28), k=3, stride=2, mean="SumDiv"),          # EfficientNet's form, stride 2
    dict(x_shape=(2, 12, 30, 29), k=5, stride=2, act="HardSwish", gate="HardSigmoid", mean="ReduceMean"),
])
def test_row_blocked_depthwise_with_squeeze_in_three_steps(kw):
    """dwconv + act + squeeze on the row-blocked kernel (the squeeze sums each plane after its
    rows are copied out), FC1, FC2 + gate + excitation: three steps, numbers as onnxruntime's."""
    m = se_block_model(**kw)
    x = np.random.default_rng(5).standard_normal(kw["x_shape"]).astype(np.float32)
    f = apollo_py.jit(m, options=Options(num_threads=2))
    got = f(x=x)
    for a, b in zip(got if isinstance(got, (list, tuple)) else [got], ort_run(m, {"x": x})):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * float(np.abs(b).max()))
    ks = f.plan.kernels
    assert len(ks) == 3 and ks[0].gemm.squeeze is not None and ROWS in ks[0].reason, f.plan
    assert ks[2].gemm.excite is not None


def test_row_blocked_kernel_applies_where_it_measured_faster():
    """3x3 / 5x5 depthwise at strides 1 and 2 with rows of 14 and more; not 7-wide rows (16 lanes
    for 7 columns), stride 3, dilation, grouped convs of several channels, a tuning decision."""
    from dataclasses import replace
    from apollo_py.codegen.conv_direct import direct_conv_desc
    from apollo_py.codegen.conv_dw_rows import applies

    def desc(c, h, k, s, group=None, dil=1, cin=None):
        o = (h + 2 * (k // 2) - dil * (k - 1) - 1) // s + 1
        attrs = dict(strides=(s, s), pads=(k // 2,) * 4, dilations=(dil, dil), group=group or c)
        return direct_conv_desc("d", (1, cin or c, h, h), (c, (cin or c) // (group or c), k, k), (1, c, o, o),
                                attrs, "y", outputs=("y",), out_dtypes=("float32",))
    assert applies(desc(16, 112, 3, 1)) and applies(desc(64, 112, 3, 2)) and applies(desc(72, 56, 5, 2))
    assert applies(desc(672, 14, 3, 1)) and applies(desc(240, 28, 3, 2))
    assert not applies(desc(960, 7, 5, 1)) and not applies(desc(672, 14, 5, 2))     # 7-wide output rows
    assert not applies(desc(8, 30, 3, 3)) and not applies(desc(8, 30, 3, 1, dil=2))
    assert not applies(desc(16, 28, 3, 1, group=8))
    assert not applies(replace(desc(16, 112, 3, 1), form="flat"))


CV = "16 channels per vector"


@pytest.mark.parametrize("x_shape,pads,act", [
    ((1, 32, 7, 7), (2, 2, 2, 2), "SiLU"),           # EfficientNet's 7x7 5x5 form, two channel blocks
    ((2, 16, 6, 5), (1, 2, 3, 2), "HardSwish"),      # batch 2, asymmetric pads: 6 x 5 output, odd plane
])
def test_channel_vector_depthwise_matches_onnxruntime(x_shape, pads, act):
    c = x_shape[1]
    m = conv_model(x_shape, (c, 1, 5, 5), pads=pads, group=c, act=act)
    x = np.random.default_rng(6).standard_normal(x_shape).astype(np.float32)
    f = apollo_py.jit(m, options=Options(num_threads=2))
    want = ort_run(m, {"x": x})[0]
    np.testing.assert_allclose(f(x=x), want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))
    assert len(f.plan.kernels) == 1 and CV in f.plan.kernels[0].reason, f.plan


@pytest.mark.parametrize("kw", [
    dict(x_shape=(2, 48, 7, 7), k=5, mean="SumDiv"),                                  # EfficientNet
    dict(x_shape=(1, 32, 7, 7), k=5, act="HardSwish", gate="HardSigmoid", mean="GlobalAveragePool",
         expose_pool=True),                                                          # MobileNetV3, pool stored
])
def test_channel_vector_depthwise_with_squeeze_in_three_steps(kw):
    """The squeeze sums 16 channels' pixels per lane; FC1, FC2 + gate + excitation follow."""
    m = se_block_model(**kw)
    x = np.random.default_rng(7).standard_normal(kw["x_shape"]).astype(np.float32)
    f = apollo_py.jit(m, options=Options(num_threads=2))
    got = f(x=x)
    want = ort_run(m, {"x": x})
    got = got if isinstance(got, (list, tuple)) else [got]
    assert len(got) == len(want)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * float(np.abs(b).max()))
    ks = f.plan.kernels
    assert len(ks) == 3 and ks[0].gemm.squeeze is not None and CV in ks[0].reason, f.plan
