"""Small convs on the calling thread inside the native driver (runtime/drive.py,
``GemmStep.driver_call``): an inverted residual block's 1x1 convs (implicit GEMM) and depthwise
conv (direct kernel) run as driver steps writing arena slots -- numbers against onnxruntime
(rtol 1e-4) and against every step run from Python, odd sizes and strides; a conv too large for
one thread stays a thread-pool entry."""
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import apollo_py
from apollo_py import Options
from apollo_py.runtime.gemm_step import GemmStep

from .models import ort_run


def _block(x_shape, expand, cout, k, stride, act="HardSwish", seed=0):
    """``x -> 1x1 conv (expand) + act -> depthwise k x k / stride + ReLU -> 1x1 conv (cout)
    [+ x when the shapes allow]``, random constant weights."""
    rng = np.random.default_rng(seed)
    cin = x_shape[1]

    def const(name, shape):
        return numpy_helper.from_array((rng.standard_normal(shape) * 0.3).astype(np.float32), name)

    inits = [const("w1", (expand, cin, 1, 1)), const("b1", (expand,)),
             const("w2", (expand, 1, k, k)), const("b2", (expand,)),
             const("w3", (cout, expand, 1, 1)), const("b3", (cout,))]
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["e"]),
             helper.make_node(act, ["e"], ["ea"]),
             helper.make_node("Conv", ["ea", "w2", "b2"], ["d"], group=expand, strides=[stride, stride],
                              pads=[k // 2] * 4),
             helper.make_node("Relu", ["d"], ["da"]),
             helper.make_node("Conv", ["da", "w3", "b3"], ["p"])]
    out = "p"
    if stride == 1 and cout == cin:
        nodes.append(helper.make_node("Add", ["p", "x"], ["y"]))
        out = "y"
    g = helper.make_graph(nodes, "block", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape))],
                          [helper.make_tensor_value_info(out, TensorProto.FLOAT, None)], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


CASES = {
    "mnv3_14x14": dict(x_shape=(1, 40, 14, 14), expand=120, cout=40, k=3, stride=1),
    "odd_13x11_s2_k5": dict(x_shape=(1, 24, 13, 11), expand=72, cout=40, k=5, stride=2, act="Sigmoid"),
    "batch2_7x7": dict(x_shape=(2, 16, 7, 7), expand=48, cout=16, k=3, stride=1, act="Relu"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_small_block_runs_in_driver_and_matches_onnxruntime(case):
    kw = CASES[case]
    m = _block(**kw)
    x = np.random.default_rng(1).standard_normal(kw["x_shape"]).astype(np.float32)
    f = apollo_py.jit(m, options=Options(num_threads=2))
    want = ort_run(m, {"x": x})[0]
    got = f(x=x)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    exe = f.specialization({"x": x.shape})
    gemms = [s for s in exe.steps if isinstance(s, GemmStep)]
    assert len(gemms) == 3, [type(s).__name__ for s in exe.steps]
    # every conv is small: all three run inside driver segments, none from Python
    driven = [s for seg in exe._program.segments for s in seg.steps if isinstance(s, GemmStep)]
    assert len(driven) == 3
    assert not any(isinstance(item, GemmStep) for kind, item in exe._program.entries if kind != "drive")
    # their outputs are arena slots (graph outputs excepted), not a fresh array per call
    for s in gemms:
        for v in s.outputs:
            assert v in exe.memory.slots or v in exe.graph.outputs, v
    again = f(x=x)           # the second call reuses the arena and the packed weights
    np.testing.assert_allclose(again, want, rtol=1e-4, atol=1e-5)
    exe.use_driver = False      # every step from Python: the same numbers
    try:
        np.testing.assert_allclose(f(x=x), got, rtol=1e-6, atol=1e-6)
    finally:
        exe.use_driver = True


def test_out_argument_receives_a_driven_conv_output():
    kw = CASES["odd_13x11_s2_k5"]
    m = _block(**kw)
    x = np.random.default_rng(2).standard_normal(kw["x_shape"]).astype(np.float32)
    f = apollo_py.jit(m, options=Options(num_threads=2))
    want = ort_run(m, {"x": x})[0]
    buf = np.full(want.shape, np.nan, np.float32)
    f(x=x, out=[buf])
    np.testing.assert_allclose(buf, want, rtol=1e-4, atol=1e-5)


def test_large_conv_stays_on_the_pool():
    """A 1x1 conv of 64 -> 256 channels at 56x56 (103 MFLOP, over ``SMALL_CONV_FLOPS``) and its
    depthwise conv (over ``INLINE_BYTES``) run on the thread pool from Python."""
    from apollo_py.codegen.conv_direct import INLINE_BYTES
    from apollo_py.codegen.gemm import SMALL_CONV_FLOPS
    assert 2 * 256 * 64 * 56 * 56 > SMALL_CONV_FLOPS and 4 * 2 * 256 * 56 * 56 > INLINE_BYTES
    m = _block((1, 64, 56, 56), expand=256, cout=64, k=3, stride=1)
    x = np.random.default_rng(3).standard_normal((1, 64, 56, 56)).astype(np.float32)
    f = apollo_py.jit(m, options=Options(num_threads=2))
    np.testing.assert_allclose(f(x=x), ort_run(m, {"x": x})[0], rtol=1e-4, atol=1e-4)
    exe = f.specialization({"x": x.shape})
    python = [item for kind, item in exe._program.entries if kind != "drive" and isinstance(item, GemmStep)]
    assert len(python) == 3 and all(not getattr(s.compiled, "inline", False) for s in python)
