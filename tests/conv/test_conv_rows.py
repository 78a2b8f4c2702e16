"""The row-reading dense conv (codegen/conv_rows.py) against onnxruntime: odd sizes, pads,
strides 1/2, dilations, groups, batch 2, fused epilogues, and which convs take it (plan pins)."""
import sys
from pathlib import Path

import numpy as np
import pytest

import apollo_py
from apollo_py import Options

sys.path.insert(0, str(Path(__file__).parent))
from models import conv_model, ort_run, residual_conv1d_model  # noqa: E402


@pytest.fixture(autouse=True)
def _rows_for_small_convs(monkeypatch):
    """The cases here are small (fast to test): below ``SMALL_CONV_FLOPS`` they would run on the
    calling thread's implicit GEMM, so the threshold is lifted for them; their small output planes
    would take the channel-vector kernel (tests/conv/test_conv_cvec.py), and dense convs of few
    input channels (``no_pad_k2``) the block kernel (codegen/conv_block.py): both switched off."""
    from apollo_py.codegen import conv_cvec, gemm
    from apollo_py.layers import gemm_lowering
    monkeypatch.setattr(gemm, "SMALL_CONV_FLOPS", 0)
    monkeypatch.setattr(conv_cvec, "ENABLED", False)
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
    m, x = residual_conv1d_model()
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


def _rows_step(f, xs):
    from apollo_py.runtime.gemm_step import GemmStep
    exe = f.specialization({"x": xs})
    steps = [s for s in exe.steps if isinstance(s, GemmStep) and type(s.compiled).__name__ == "CompiledConvRows"]
    assert len(steps) == 1, str(f.plan)
    return steps[0], exe


@pytest.mark.parametrize("threads", [1, 2])
def test_row_conv_pad_chunks_and_counter(threads):
    """38 channel planes (2 images x 19) are copied in 13 chunks of 3 planes claimed from the
    counter (one crosses the image boundary, the last has 2), then the tiles are claimed; one
    thread (no pool) and two give onnxruntime's numbers, call after call."""
    from apollo_py.codegen import conv_rows as CR
    xs = (2, 19, 15, 13)
    m = conv_model(xs, (24, 19, 3, 3), pads=(1, 1, 1, 1), act="Relu", bn=True)
    rng = np.random.default_rng(8)
    f = apollo_py.jit(m, options=Options(num_threads=threads))
    step, _ = _rows_step(f, xs)
    d = step.compiled.desc
    assert CR.pad_chunks(d) == 13
    for _ in range(5):
        x = rng.standard_normal(xs).astype(np.float32)
        want = ort_run(m, {"x": x})[0]
        np.testing.assert_allclose(f(x=x), want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))


def test_row_conv_late_helper_finds_no_work():
    """A pool helper whose call starts after the caller's returned (a late wake-up) finds every
    pad chunk and tile claimed and returns without touching the output."""
    from apollo_py.codegen.conv_rows import pad_chunks
    xs = (1, 8, 12, 12)
    m = conv_model(xs, (16, 8, 3, 3), pads=(1, 1, 1, 1), act="Relu")
    x = np.random.default_rng(9).standard_normal(xs).astype(np.float32)
    f = apollo_py.jit(m, options=Options(num_threads=2))
    want = ort_run(m, {"x": x})[0]
    cr = _rows_step(f, xs)[0].compiled
    seen = {}
    run = cr.run
    cr.run = lambda pool, a, b, ops, outs: seen.update(a=a, ops=ops)
    f(x=x)
    cr.run = run
    out = np.empty(want.shape, np.float32)
    xp = np.empty(cr.pad_size + cr.slack, np.float32)
    xp[cr.pad_size:] = 0.0
    counter = np.zeros(4, np.int64)
    ptrs = cr.main.pack_args([cr.packed_a(seen["a"]), xp, cr._no_side, x, *seen["ops"], out, counter])
    cr.main.cfunc(ptrs, 0, 1)           # the caller alone: every chunk and tile
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))
    assert counter[1] == pad_chunks(cr.desc) == 8 and counter[3] == cr.layout.tiles
    out[...] = np.nan
    cr.main.cfunc(ptrs, 1, 2)           # a helper arriving late
    assert np.isnan(out).all()


def test_rows_layout_tiles_and_equal_column_blocks():
    """Column blocks as equal as the NR panels allow (a 28x28 3x3 conv's 840 grid columns: 4
    blocks of 224, not 3 of 256 and one of 72), and at least TILES_PER_THREAD tiles a thread."""
    from apollo_py.codegen import conv_rows as CR
    from apollo_py.codegen.gemm import Blocking, conv_desc
    d = conv_desc("c", (1, 128, 28, 28), (128, 128, 3, 3), (1, 128, 28, 28),
                  {"group": 1, "strides": (1, 1), "pads": (1, 1, 1, 1), "dilations": (1, 1)}, "c")
    bl = Blocking(16, 12, 32)
    lay = CR.rows_layout(d, bl, 2)
    assert lay.nc == 224 and lay.njc == 4 and lay.tiles >= CR.TILES_PER_THREAD * 2
    d56 = conv_desc("c", (1, 64, 56, 56), (64, 64, 3, 3), (1, 64, 56, 56),
                    {"group": 1, "strides": (1, 1), "pads": (1, 1, 1, 1), "dilations": (1, 1)}, "c")
    lay = CR.rows_layout(d56, Blocking(16, 8, 32), 2)
    grid = 56 * 58
    assert lay.njc * lay.nc >= grid > (lay.njc - 1) * lay.nc and lay.nc <= CR.NC_MAX
    assert lay.njc * lay.nc - grid < 32 * lay.njc      # no block more than a panel short


def test_row_conv_concurrent_callers():
    """Two Python threads calling one compiled row-reading conv at once: each call has its own
    counter and padded copy, and the pool's helper calls of one never take the other's work."""
    import threading
    xs = (1, 16, 20, 20)
    m = conv_model(xs, (24, 16, 3, 3), pads=(1, 1, 1, 1), act="Relu", bn=True)
    f = apollo_py.jit(m, options=Options(num_threads=2))
    rng = np.random.default_rng(10)
    xs_ = [rng.standard_normal(xs).astype(np.float32) for _ in range(2)]
    wants = [ort_run(m, {"x": x})[0] for x in xs_]
    f(x=xs_[0])
    errors = []

    def worker(i):
        try:
            for _ in range(15):
                np.testing.assert_allclose(f(x=xs_[i]), wants[i], rtol=1e-4, atol=1e-4 * float(np.abs(wants[i]).max()))
        except AssertionError as exc:      # re-raised on the test's thread
            errors.append(exc)
    ts = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors[0]
    assert "row-reading conv" in str(f.plan)


def _two_conv_model():
    """``x -> conv A (16 -> 24, 3x3, pad 1, 20x18) -> ReLU -> conv B (24 -> 8, 3x3, stride 2)``: two
    row-reading convs whose padded copies differ in size (B's is the 4-phase split of A's output),
    so B's copy lands in the buffer A's filled."""
    import onnx
    from onnx import helper, numpy_helper
    rng = np.random.default_rng(12)
    wa = (rng.standard_normal((24, 16, 3, 3)) * 0.2).astype(np.float32)
    wb = (rng.standard_normal((8, 24, 3, 3)) * 0.2).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "WA"], ["a"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["a"], ["r"]),
             helper.make_node("Conv", ["r", "WB"], ["y"], pads=[1, 1, 1, 1], strides=[2, 2])]
    g = helper.make_graph(nodes, "two", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, (1, 16, 20, 18))],
                          [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
                          [numpy_helper.from_array(wa, "WA"), numpy_helper.from_array(wb, "WB")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_row_convs_share_the_thread_pad_buffer():
    """Every row-reading conv a thread runs makes its padded copy in that thread's one buffer
    (``pad_buffer``): the second conv's copy overwrites the first's, and the slack past it (read
    by dropped grid columns) is zeroed again -- results equal onnxruntime's and, bit for bit,
    those with a fresh array per call (``REUSE_PAD`` off)."""
    from apollo_py.codegen import conv_rows as CR
    m = _two_conv_model()
    f = apollo_py.jit(m, options=Options(num_threads=2))
    assert str(f.plan).count("row-reading conv") == 2, str(f.plan)
    rng = np.random.default_rng(13)
    for _ in range(3):
        x = (rng.standard_normal((1, 16, 20, 18)) * 4).astype(np.float32)
        want = ort_run(m, {"x": x})[0]
        got = f(x=x)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))
        buf = CR._LOCAL.pad
        CR.REUSE_PAD = False
        try:
            fresh = f(x=x)
        finally:
            CR.REUSE_PAD = True
        np.testing.assert_array_equal(got, fresh)
        assert CR._LOCAL.pad is buf       # the buffer was kept, not reallocated
    assert CR.pad_buffer(10).ctypes.data % 64 == 0


def test_row_convs_pad_buffers_per_thread():
    """Two Python threads calling the same model at once each make their padded copies in their
    own buffer: every result equals onnxruntime's."""
    import threading
    m = _two_conv_model()
    f = apollo_py.jit(m, options=Options(num_threads=2))
    rng = np.random.default_rng(14)
    xs = [(rng.standard_normal((1, 16, 20, 18)) * 4).astype(np.float32) for _ in range(4)]
    wants = [ort_run(m, {"x": x})[0] for x in xs]
    f(x=xs[0])
    bad = []

    def worker(k):
        for _ in range(20):
            got = f(x=xs[k])
            if not np.allclose(got, wants[k], rtol=1e-4, atol=1e-4 * float(np.abs(wants[k]).max())):
                bad.append(k)
    ts = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not bad
