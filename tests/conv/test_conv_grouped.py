"""Grouped convs (RegNetY / ResNeXt style, 8-64 channels per group) and the row-reading conv's
padded, phase-split copy (codegen/conv_rows.py ``_pad_kernel``): the copy bit for bit against a
numpy construction of the same layout (strides 1-3, asymmetric pads, dilations, a strided 1x1
conv's single sub-plane), grouped convs against onnxruntime (rtol 1e-4: groups of 8, 16, 24, 64
channels, 2-37 groups, strides 1 / 2, odd sizes, batch 2, BatchNorm + activation epilogues), and
which kernel RegNetY's grouped shapes get (plan pins)."""
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

import apollo_py
from apollo_py import Options
from apollo_py.codegen import conv_rows as CR
from apollo_py.codegen.gemm import conv_desc

sys.path.insert(0, str(Path(__file__).parent))
from models import conv_model, ort_run  # noqa: E402


def _desc(xs, ws, strides, pads, dilations, group):
    n, c, h, w = xs
    kh, kw = ws[2:]
    oh = (h + pads[0] + pads[2] - dilations[0] * (kh - 1) - 1) // strides[0] + 1
    ow = (w + pads[1] + pads[3] - dilations[1] * (kw - 1) - 1) // strides[1] + 1
    return conv_desc("gemm_t", xs, ws, (n, ws[0], oh, ow),
                     dict(group=group, strides=strides, pads=pads, dilations=dilations), "y")


def _pad_reference(d, r, x):
    """``xpad[N*C][phase][QH][Q]`` built with numpy: sub-plane ``(pr, pc)`` holds padded-image
    element ``(q_r * sh + pr, q_c * sw + pc)`` at ``(q_r, q_c)``, zero outside the image."""
    g = d.conv
    ph, pw = g.pads
    planes = x.reshape(g.n * g.c, g.h, g.w)
    out = np.zeros((g.n * g.c, len(r.phases), r.qh, r.q), np.float32)
    for s, (pr, pc) in enumerate(r.phases):
        for qr in range(r.qh):
            ih = qr * r.sh + pr - ph
            if not 0 <= ih < g.h:
                continue
            for qc in range(r.q):
                iw = qc * r.sw + pc - pw
                if 0 <= iw < g.w:
                    out[:, s, qr, qc] = planes[:, ih, iw]
    return out.reshape(-1)


# name -> (x shape, w shape, strides, pads (t, l, b, r), dilations, group)
PAD_CASES = {
    "s1_3x3": ((1, 5, 9, 11), (5, 1, 3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 5),
    "s2_3x3_odd": ((2, 4, 13, 11), (8, 2, 3, 3), (2, 2), (1, 1, 1, 1), (1, 1), 2),
    "s2_7x7_stem": ((1, 3, 29, 30), (8, 3, 7, 7), (2, 2), (3, 3, 3, 3), (1, 1), 1),
    "s3_5x5_asym": ((1, 2, 17, 19), (4, 2, 5, 5), (3, 3), (2, 0, 1, 2), (1, 1), 1),
    "s2_dil2": ((1, 3, 15, 16), (6, 3, 3, 3), (2, 2), (2, 1, 2, 1), (2, 2), 1),
    "s2_1x1_one_phase": ((1, 6, 14, 13), (6, 6, 1, 1), (2, 2), (0, 0, 0, 0), (1, 1), 1),
    "s12_mixed": ((1, 2, 12, 20), (4, 2, 3, 3), (1, 2), (1, 1, 1, 1), (1, 1), 1),
}


@pytest.mark.parametrize("case", sorted(PAD_CASES))
def test_pad_copy_matches_numpy_layout(case):
    from apollo_py.codegen.llvm import compile_llvm
    d = _desc(*PAD_CASES[case])
    r = CR.rows_geom(d.conv)
    x = np.random.default_rng(1).standard_normal(PAD_CASES[case][0]).astype(np.float32)
    k = compile_llvm(CR._pad_kernel(d, r))
    got = np.full(d.conv.n * d.conv.c * r.ch, np.nan, np.float32)    # every element is written
    k([got, x])
    np.testing.assert_array_equal(got, _pad_reference(d, r, x))


# name -> (x shape, w shape, strides, pads, group, activation, BatchNorm)
GROUPED = {
    "g24_s1_odd": ((1, 48, 13, 11), (48, 24, 3, 3), (1, 1), (1, 1, 1, 1), 2, "Relu", True),
    "g24_s2_n2": ((2, 72, 15, 14), (72, 24, 3, 3), (2, 2), (1, 1, 1, 1), 3, "SiLU", True),
    "g8_s1_many": ((1, 64, 10, 10), (64, 8, 3, 3), (1, 1), (1, 1, 1, 1), 8, None, False),
    "g16_s2": ((1, 64, 17, 17), (64, 16, 3, 3), (2, 2), (1, 1, 1, 1), 4, "Clip6", True),
    "g64_s1": ((1, 128, 9, 9), (128, 64, 3, 3), (1, 1), (1, 1, 1, 1), 2, "HardSwish", False),
    "g24_cout_ne_cin": ((1, 48, 11, 12), (96, 24, 3, 3), (1, 1), (1, 1, 1, 1), 2, "Relu", False),
}


@pytest.fixture
def rows_everywhere(monkeypatch):
    """Small test sizes would take the implicit GEMM (below ``SMALL_CONV_FLOPS``) or the
    channel-vector kernel (small planes): both lifted, so the row-reading conv runs them."""
    from apollo_py.codegen import conv_cvec, gemm
    monkeypatch.setattr(gemm, "SMALL_CONV_FLOPS", 0)
    monkeypatch.setattr(conv_cvec, "ENABLED", False)


@pytest.mark.parametrize("case", sorted(GROUPED))
def test_grouped_conv_matches_onnxruntime(case, rows_everywhere):
    xs, ws, st, pd, g, act, bn = GROUPED[case]
    m = conv_model(xs, ws, strides=st, pads=pd, group=g, act=act, bn=bn)
    x = np.random.default_rng(5).standard_normal(xs).astype(np.float32)
    f = apollo_py.jit(m, options=Options(num_threads=2))
    want = ort_run(m, {"x": x})[0]
    np.testing.assert_allclose(f(x=x), want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))
    convs = [k for k in f.plan.kernels if "conv" in k.reason]
    assert len(convs) == 1 and "row-reading conv" in convs[0].reason, str(f.plan)


def test_grouped_kernel_choice_regnety_shapes():
    """Which kernel RegNetY-1.6GF's grouped 3x3 convs (24 channels per group) get by default:
    the row-reading conv (the channel-vector kernel pads 24 channels to 32, the row kernel's
    panels fill better: conv_cvec.cvec_reason), never the direct (depthwise) kernel."""
    from apollo_py.codegen.conv_cvec import cvec_reason
    for xs, c, s in (((1, 336, 14, 14), 336, 1), ((1, 120, 28, 28), 120, 1), ((1, 336, 28, 28), 336, 2),
                     ((1, 48, 56, 56), 48, 1)):
        d = replace(_desc(xs, (c, 24, 3, 3), (s, s), (1, 1, 1, 1), (1, 1), c // 24), a_const=True)
        assert CR.rows_reason(d) and not cvec_reason(d), xs


# name -> (x shape, w shape, strides, group, activation, the kernel the default policy picks)
DEFAULT_FORMS = {
    # 4 channels a group in and out (16 < 64 multiply-adds per tap pair): the direct kernel
    "g4_direct": ((1, 32, 12, 12), (32, 4, 3, 3), (1, 1), 8, "Relu", "direct conv"),
    # 64 channels a group on a 7x7 plane: 4 full channel vectors beat the row kernel's 49 of 64
    # grid columns (codegen/conv_cvec.py)
    "g64_7x7_cvec": ((1, 256, 7, 7), (256, 64, 3, 3), (1, 1), 4, "Relu", "channel-vector conv"),
    # RegNetY's stage-2 form, small: 24-channel groups at 28x28 -> 14x14, stride 2
    "g24_s2_rows": ((1, 96, 28, 28), (96, 24, 3, 3), (2, 2), 4, "Relu", "row-reading conv"),
}


@pytest.mark.parametrize("case", sorted(DEFAULT_FORMS))
def test_grouped_conv_default_kernel_matches_onnxruntime(case, monkeypatch):
    """Each grouped form on the kernel the default policy gives it (only the implicit-GEMM size
    threshold lifted, so that the small row-reading case is not run as an inline implicit GEMM)."""
    from apollo_py.codegen import gemm
    monkeypatch.setattr(gemm, "SMALL_CONV_FLOPS", 0)
    xs, ws, st, g, act, kind = DEFAULT_FORMS[case]
    m = conv_model(xs, ws, strides=st, pads=(1, 1, 1, 1), group=g, act=act, bn=True)
    x = np.random.default_rng(7).standard_normal(xs).astype(np.float32)
    f = apollo_py.jit(m, options=Options(num_threads=2))
    want = ort_run(m, {"x": x})[0]
    np.testing.assert_allclose(f(x=x), want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))
    convs = [k for k in f.plan.kernels if "conv" in k.reason]
    assert len(convs) == 1 and kind in convs[0].reason, str(f.plan)
