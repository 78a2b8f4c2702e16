"""Direct pooling kernels (layers/pool_kernel.py) and 1-d convs on the generated conv paths
(layers/gemm_lowering.conv_shapes_2d), against onnxruntime."""
import sys
from pathlib import Path

import numpy as np
import pytest

import apollo_py
from apollo_py import Options

sys.path.insert(0, str(Path(__file__).parent))
from models import conv_model, convt_model, ort_run, pool_model  # noqa: E402


POOLS = {
    # ResNet stem: bias + relu + 3x3 s2 max pool, pads 1
    "stem_max": ((1, 8, 22, 23), "MaxPool", True, False, dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])),
    "max_asym_dil": ((2, 3, 13, 11), "MaxPool", False, True, dict(kernel_shape=[3, 2], strides=[1, 2],
                                                                  pads=[2, 0, 1, 1], dilations=[2, 1])),
    "max_ceil": ((1, 4, 9, 10), "MaxPool", True, False, dict(kernel_shape=[2, 2], strides=[2, 2], ceil_mode=1)),
    "avg_pad_excl": ((1, 5, 10, 9), "AveragePool", False, False, dict(kernel_shape=[3, 3], strides=[2, 2],
                                                                      pads=[1, 1, 1, 1])),
    "avg_pad_incl": ((1, 5, 10, 9), "AveragePool", True, True, dict(kernel_shape=[3, 3], strides=[1, 1],
                                                                    pads=[1, 1, 1, 1], count_include_pad=1)),
    "max1d": ((2, 6, 31), "MaxPool", True, False, dict(kernel_shape=[3], strides=[2], pads=[1, 1])),
    "avg1d": ((1, 4, 20), "AveragePool", False, True, dict(kernel_shape=[4], strides=[3], pads=[0, 2])),
    # column phases (pool_kernel.PHASE_SPLIT): stride 3 with a dilated window (taps in phases 0, 2, 1),
    # pads wider than one phase, a window narrower than its stride, odd planes
    "max_s3_dil2": ((1, 3, 14, 29), "MaxPool", True, False, dict(kernel_shape=[2, 3], strides=[2, 3],
                                                                 pads=[1, 2, 0, 1], dilations=[1, 2])),
    "max_k1_s2": ((1, 4, 9, 12), "MaxPool", False, False, dict(kernel_shape=[1, 1], strides=[2, 2])),
    "avg_s2_odd": ((2, 3, 15, 17), "AveragePool", True, True, dict(kernel_shape=[3, 3], strides=[2, 2],
                                                                   pads=[1, 1, 1, 1], count_include_pad=1)),
}


@pytest.mark.parametrize("case", sorted(POOLS))
def test_pool_kernel_matches_onnxruntime(case):
    xs, op, pre, post, attrs = POOLS[case]
    m = pool_model(xs, op, pre, post, **attrs)
    x = np.random.default_rng(1).standard_normal(xs).astype(np.float32)
    f = apollo_py.jit(m, options=Options(num_threads=2))
    got, want = f(x=x), ort_run(m, {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    pools = [k for k in f.plan.kernels if k.fused is not None and k.fused.strategy == "pool"]
    assert len(pools) == 1, str(f.plan)


@pytest.mark.parametrize("case", ["stem_max", "max_s3_dil2", "avg_s2_odd", "max1d"])
def test_pool_kernel_column_phases_same_numbers(case, tmp_path):
    """A strided window reads a column-phase-split scratch (``PHASE_SPLIT``); with the switch off
    the same model (the plain padded plane) gives the same numbers bit for bit: the taps are the
    same values, reduced in the same order."""
    from apollo_py.layers import pool_kernel as PK
    xs, op, pre, post, attrs = POOLS[case]
    m = pool_model(xs, op, pre, post, **attrs)
    x = np.random.default_rng(2).standard_normal(xs).astype(np.float32)
    # separate cache directories: the two kernels differ in their scratch layout only
    f = apollo_py.jit(m, options=Options(num_threads=2, cache_dir=str(tmp_path / "split")))
    got = f(x=x)
    PK.PHASE_SPLIT = False
    try:
        f2 = apollo_py.jit(m, options=Options(num_threads=2, cache_dir=str(tmp_path / "plain")))
        plain = f2(x=x)
    finally:
        PK.PHASE_SPLIT = True
    np.testing.assert_array_equal(got, plain)
    scratch = [k.fused.loop for k in (f.plan.kernels[0], f2.plan.kernels[0])]
    assert repr(scratch[0]) != repr(scratch[1])     # the column phases were used


CONV1D = {
    # Whisper's encoder stem: k3 pad 1, then k3 stride 2 (smaller length here)
    "whisper1": ((1, 16, 60), (24, 16, 3), dict(pads=(1, 1), strides=(1,), dilations=(1,))),
    "whisper2_s2": ((1, 24, 60), (24, 24, 3), dict(pads=(1, 1), strides=(2,), dilations=(1,))),
    "dil_asym_relu": ((2, 5, 37), (7, 5, 4), dict(pads=(3, 1), strides=(1,), dilations=(2,), act="Relu")),
    "grouped_depthwise": ((1, 8, 29), (8, 1, 5), dict(pads=(2, 2), strides=(1,), dilations=(1,), group=8)),
    "k1": ((1, 12, 17), (10, 12, 1), dict(pads=(0, 0), strides=(1,), dilations=(1,), act="Sigmoid")),
}


@pytest.mark.parametrize("case", sorted(CONV1D))
def test_conv1d_generated(case):
    xs, ws, kw = CONV1D[case]
    m = conv_model(xs, ws, **kw)
    x = np.random.default_rng(1).standard_normal(xs).astype(np.float32)
    f = apollo_py.jit(m, options=Options(num_threads=2))
    got, want = f(x=x), ort_run(m, {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))
    assert not any(k.gemm is None and k.fused is None and k.blas is None for k in f.plan.kernels), str(f.plan)
    assert sum(k.gemm is not None for k in f.plan.kernels) == 1, str(f.plan)


CONVT = {
    # kernel == stride, no pads: one 1x1 conv + reshape / transpose (ops/compound_conv.py)
    "unet_2x2_s2": ((1, 16, 9, 7), (16, 8, 2, 2), dict(strides=[2, 2]), True),
    "k3_s3_nobias": ((2, 5, 4, 6), (5, 3, 3, 3), dict(strides=[3, 3]), True),
    "k2x3_s2x3": ((1, 4, 5, 5), (4, 6, 2, 3), dict(strides=[2, 3]), True),
    "1d_k4_s4": ((1, 6, 11), (6, 5, 4), dict(strides=[4]), True),
    # the general decomposition (zero interleave)
    "k3_s2_pad": ((1, 6, 7, 8), (6, 4, 3, 3), dict(strides=[2, 2], pads=[1, 1, 1, 1], output_padding=[1, 1]), False),
    "k2_s2_grouped": ((1, 8, 5, 5), (8, 3, 2, 2), dict(strides=[2, 2], group=2), False),
}


@pytest.mark.parametrize("case", sorted(CONVT))
def test_conv_transpose_matches_onnxruntime(case):
    xs, ws, attrs, unpool = CONVT[case]
    m = convt_model(xs, ws, bias=case != "k3_s3_nobias", **attrs)
    x = np.random.default_rng(1).standard_normal(xs).astype(np.float32)
    f = apollo_py.jit(m, options=Options(num_threads=2))
    got, want = f(x=x), ort_run(m, {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))
    gemms = [k for k in f.plan.kernels if k.gemm is not None]
    assert len(gemms) == 1, str(f.plan)
    # the kernel == stride form multiplies no zeros: a 1x1 conv of the input itself
    assert (gemms[0].gemm.k == xs[1] // attrs.get("group", 1)) == unpool, gemms[0].reason


def test_pool_kernel_is_cpu_only():
    """The CUDA targets keep layer 1's loop nest (a plane-sized scratch per thread would not fit)."""
    xs, op, pre, post, attrs = POOLS["stem_max"]
    m = pool_model(xs, op, pre, post, **attrs)
    x = np.random.default_rng(1).standard_normal(xs).astype(np.float32)
    f = apollo_py.jit(m, options=Options(target="cuda-emu"))
    np.testing.assert_allclose(f(x=x), ort_run(m, {"x": x})[0], rtol=1e-4, atol=1e-5)
    assert [k.fused.strategy for k in f.plan.kernels if k.fused is not None] == ["direct"]
