"""The channel-vector dense conv (codegen/conv_cvec.py) against onnxruntime (rtol 1e-4): 1x1 and
k x k, strides 1 / 2, symmetric and one-sided pads, dilations, groups, channel counts that are no
multiple of 16, batch 2, more than one K block, fused epilogues; on one thread (the calling
thread's call, inside the native driver) and on the pool (tiles split into bands of rows); and
which convs take it (plan pins)."""
import sys
from pathlib import Path

import numpy as np
import pytest

import apollo_py
from apollo_py import Options
from apollo_py.codegen import conv_cvec as CV

sys.path.insert(0, str(Path(__file__).parent))
from models import conv_model, ort_run, residual_conv1d_model  # noqa: E402

@pytest.fixture
def always_cvec(monkeypatch):
    """The policy (:func:`~apollo_py.codegen.conv_cvec.cvec_reason`: channel padding against the
    row kernel's panels, ``test_channel_padding_policy``) lifted: the numbers of these odd sizes."""
    monkeypatch.setattr(CV, "MIN_EFFICIENCY", 0.0)
    monkeypatch.setattr(CV, "_rows_fill", lambda d: 0.0)


# name -> (x shape, w shape, strides, pads, dilations, group, activation, BatchNorm)
CASES = {
    "1x1_odd_7x7": ((1, 23, 7, 7), (37, 23, 1, 1), (1, 1), (0, 0, 0, 0), (1, 1), 1, "Relu", True),
    "1x1_s2_in_place": ((1, 24, 14, 13), (40, 24, 1, 1), (2, 2), (0, 0, 0, 0), (1, 1), 1, "HardSwish", False),
    "1x1_bottom_pad": ((2, 8, 9, 10), (12, 8, 1, 1), (2, 1), (0, 0, 2, 1), (1, 1), 1, None, False),
    "3x3_odd": ((1, 8, 13, 11), (19, 8, 3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 1, "SiLU", True),
    "3x3_s2_n2": ((2, 5, 17, 19), (20, 5, 3, 3), (2, 2), (1, 1, 1, 1), (1, 1), 1, "Clip6", True),
    "asym_dil": ((1, 6, 12, 14), (13, 6, 3, 2), (1, 2), (2, 0, 1, 1), (2, 1), 1, "SiLU", False),
    "grouped_n2": ((2, 16, 9, 9), (40, 8, 3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 2, "Relu", True),
    "stem7_s2": ((1, 3, 23, 21), (9, 3, 7, 7), (2, 2), (3, 3, 3, 3), (1, 1), 1, "Relu", False),
    # K = 1200 (five K blocks of 240), 37 channels (two panels, the second partial)
    "deep_k": ((1, 48, 11, 10), (37, 48, 5, 5), (1, 1), (2, 2, 2, 2), (1, 1), 1, "Relu", False),
    # 80 channels (3 panels): on the pool the 14 rows are split into bands; 196 pixels
    "bands_14x14": ((1, 32, 14, 14), (80, 32, 1, 1), (1, 1), (0, 0, 0, 0), (1, 1), 1, "HardSwish", True),
}


@pytest.mark.parametrize("pool", [False, True], ids=["one_thread", "pool"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_cvec_conv_matches_onnxruntime(case, pool, monkeypatch, always_cvec):
    if pool:        # past SMALL_CONV_FLOPS: tiles (and bands) claimed by the pool's threads
        from apollo_py.codegen import gemm
        monkeypatch.setattr(gemm, "SMALL_CONV_FLOPS", 0)
    xs, ws, st, pd, dl, g, act, bn = CASES[case]
    m = conv_model(xs, ws, strides=st, pads=pd, dilations=dl, group=g, act=act, bn=bn)
    x = np.random.default_rng(3).standard_normal(xs).astype(np.float32)
    f = apollo_py.jit(m, options=Options(num_threads=2))
    want = ort_run(m, {"x": x})[0]
    got = f(x=x)
    assert got.shape == want.shape and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))
    convs = [k for k in f.plan.kernels if "conv" in k.reason]
    assert len(convs) == 1 and "channel-vector conv" in convs[0].reason, str(f.plan)
    assert ("in place" in convs[0].reason) == (case in ("1x1_odd_7x7", "1x1_s2_in_place", "bands_14x14"))
    np.testing.assert_allclose(f(x=x + 1), ort_run(m, {"x": x + 1})[0], rtol=1e-4,
                               atol=1e-4 * float(np.abs(want).max()))


def test_layout_splits_rows_into_bands_for_few_panels():
    from dataclasses import replace

    from apollo_py.codegen.gemm import conv_desc
    d = conv_desc("gemm_c", (1, 32, 14, 14), (80, 32, 1, 1), (1, 80, 14, 14),
                  dict(group=1, strides=(1, 1), pads=(0, 0, 0, 0), dilations=(1, 1)), "y")
    d = replace(d, a_const=True)
    bl = CV.cvec_blocking(d.conv, d.m)
    assert (bl.nr, bl.rb * bl.cb) == (16, 14)       # 80 channels: 5 panels of 16, no padding
    one, two = CV.cvec_layout(d, bl, 1), CV.cvec_layout(d, bl, 2)
    assert one.bands == ((0, 14),) and one.tiles == 5
    assert len(two.bands) == 2 and two.tiles == 10 and two.bands[-1][1] == 14
    assert all(b[0] % bl.rb == 0 for b in two.bands)


def test_residual_epilogue_and_1d_conv(always_cvec):
    """An epilogue operand indexed by output pixel (the residual add) and a Conv1d (one row)."""
    m, x = residual_conv1d_model()
    f = apollo_py.jit(m, options=Options(num_threads=2))
    np.testing.assert_allclose(f(x=x), ort_run(m, {"x": x})[0], rtol=1e-4, atol=1e-4)
    convs = [k for k in f.plan.kernels if "channel-vector conv" in k.reason]
    assert len(convs) == 2 and "epilogue add+relu" in convs[0].reason, str(f.plan)


def test_small_in_place_conv_runs_inside_the_driver():
    """Below SMALL_CONV_FLOPS a conv that reads its input in place is one native driver step (no
    Python between steps); one that needs a padded copy runs from Python on the calling thread --
    unless the driver shares it with its helper (runtime/drive.py, a 2-thread pool): then it is a
    driver step too, its pad kernel a kernel step before it (GemmStep.copy_call)."""
    from apollo_py.runtime.gemm_step import GemmStep
    from onnx import helper, numpy_helper
    import onnx
    rng = np.random.default_rng(7)
    w1 = (rng.standard_normal((48, 16, 1, 1)) * 0.3).astype(np.float32)
    w2 = (rng.standard_normal((24, 48, 3, 3)) * 0.3).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "W1"], ["a"]), helper.make_node("Relu", ["a"], ["b"]),
             helper.make_node("Conv", ["b", "W2"], ["y"], pads=[1, 1, 1, 1])]
    g = helper.make_graph(nodes, "two", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, (1, 16, 7, 7))],
                          [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
                          [numpy_helper.from_array(w1, "W1"), numpy_helper.from_array(w2, "W2")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    x = rng.standard_normal((1, 16, 7, 7)).astype(np.float32)
    f = apollo_py.jit(m, options=Options(num_threads=2))
    want = ort_run(m, {"x": x})[0]
    np.testing.assert_allclose(f(x=x), want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))
    exe = f.specialization({"x": x.shape})
    gemms = [s for s in exe.steps if isinstance(s, GemmStep)]
    assert [type(s.compiled).__name__ for s in gemms] == ["CompiledConvCvec"] * 2
    assert [s.compiled.inline for s in gemms] == [True, False]
    driven = [s for seg in exe._program.segments for s in seg.steps if isinstance(s, GemmStep)]
    assert driven == gemms
    np.testing.assert_allclose(f(x=x), want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))
    from apollo_py.runtime import drive
    saved = drive.HELPER
    try:
        drive.HELPER = False        # no helper: the padded conv runs from Python as before
        exe._program = None
        for a in exe._arenas._free:
            a.driver = None
        np.testing.assert_allclose(f(x=x), want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))
        driven = [s for seg in exe._program.segments for s in seg.steps if isinstance(s, GemmStep)]
        assert driven == gemms[:1]
    finally:
        drive.HELPER = saved
        exe._program = None
        for a in exe._arenas._free:
            a.driver = None


def test_other_convs_stay_off_the_channel_vector_kernel(monkeypatch):
    """Output planes over ``MAX_PIXELS``, convs whose weight is not a constant, and every conv with
    ``ENABLED`` off take the other paths."""
    m = conv_model((1, 8, 15, 15), (16, 8, 3, 3), pads=(1, 1, 1, 1), act="Relu")       # 225 pixels
    f = apollo_py.jit(m, options=Options(num_threads=2))
    assert "channel-vector" not in str(f.plan), str(f.plan)
    import apollo_py as ap
    b = ap.GraphBuilder("wconv")
    x, w = b.input("x", (1, 8, 7, 7)), b.input("w", (16, 8, 3, 3))
    fw = ap.jit(b.build([b.op("conv", x, w, strides=(1, 1), pads=(1, 1, 1, 1), dilations=(1, 1), group=1)[0]]),
                target="cpu")
    assert "channel-vector" not in str(fw.plan) and "implicit-GEMM conv" in str(fw.plan), str(fw.plan)
    monkeypatch.setattr(CV, "ENABLED", False)
    m = conv_model((1, 8, 7, 7), (16, 8, 1, 1), act="Relu")
    f = apollo_py.jit(m, options=Options(num_threads=2))
    assert "channel-vector" not in str(f.plan), str(f.plan)


def test_channel_padding_policy():
    """24 output channels a group (RegNetY) pad to 32 (75% of the FMAs useful): at 14x14 the row
    kernel fills 87.5% of its panels and keeps the conv; at 7x7 (77% for it) too; 160 channels
    at 7x7 fill whole panels and take this kernel."""
    from dataclasses import replace

    from apollo_py.codegen.gemm import conv_desc

    def reason(xs, ws, group, pads=(1, 1, 1, 1)):
        k = ws[2]
        ys = (xs[0], ws[0], xs[2] - k + 1 + pads[0] + pads[2], xs[3] - k + 1 + pads[1] + pads[3])
        d = conv_desc("gemm_c", xs, ws, ys, dict(group=group, strides=(1, 1), pads=pads, dilations=(1, 1)), "y")
        return CV.cvec_reason(replace(d, a_const=True))
    assert reason((1, 336, 14, 14), (336, 24, 3, 3), 14) == ""
    assert reason((1, 888, 7, 7), (888, 24, 3, 3), 37) == ""
    assert "100% of FMAs useful (row kernel 76%)" in reason((1, 2048, 7, 7), (512, 2048, 1, 1), 1, (0, 0, 0, 0))


def test_weight_prefetch_in_the_first_pixel_tile_of_each_band():
    """The first pixel tile of a band (the one that reads the weight panel from memory) runs a
    micro-kernel that prefetches the panel ``prefetch`` bytes ahead; the others, and every tile
    with ``prefetch`` 0, do not.  Results are the same either way (a hint, no data change)."""
    from dataclasses import replace

    from apollo_py.codegen.gemm import conv_desc
    d = conv_desc("gemm_c", (1, 96, 7, 7), (64, 96, 1, 1), (1, 64, 7, 7),
                  dict(group=1, strides=(1, 1), pads=(0, 0, 0, 0), dilations=(1, 1)), "y")
    d = replace(d, a_const=True)
    bl = CV.cvec_blocking(d.conv, d.m)
    assert bl.prefetch == CV.PREFETCH_BYTES > 0
    lay = CV.cvec_layout(d, bl, 1)
    geom = CV.cvec_geom(d.conv)
    ir = CV._main_ir(d, bl, lay, geom, "epi")
    assert ir.count("define internal void @cvec.m2x7p(") == 1 and ir.count("define internal void @cvec.m2x7(") == 1
    assert f"i64 %ao, {bl.prefetch // 4}" in ir and "@llvm.prefetch.p0" in ir
    band = ir[ir.index("define internal void @cvec.band0"):]
    band = band[:band.index("}")]
    assert band.count("@cvec.m2x7p(") == 1 and band.count("@cvec.m2x7(") + band.count("@cvec.m1x7(") == 3
    off = CV._main_ir(d, replace(bl, prefetch=0), lay, geom, "epi")
    assert "llvm.prefetch" not in off.replace("declare void @llvm.prefetch.p0", "")

    m = conv_model((1, 96, 7, 7), (64, 96, 1, 1), act="Relu")
    x = np.random.default_rng(9).standard_normal((1, 96, 7, 7)).astype(np.float32)
    f = apollo_py.jit(m, options=Options(num_threads=2))
    assert "channel-vector conv" in str(f.plan)
    want = ort_run(m, {"x": x})[0]
    np.testing.assert_allclose(f(x=x), want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))
