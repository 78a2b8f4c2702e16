"""The direct resize kernel (ops/resize2d.py, codegen/resize.py) against onnxruntime.

Every coordinate mode x scales / sizes x odd shapes (non-square, non-integer scales, downsampling),
linear and nearest, opset 10-19 spellings and Upsample; the plan must show the direct kernel, and
what it does not cover (cubic, extrapolation, a resized channel axis) the per-axis form."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import apollo_py as ap
from apollo_py.ops import resize2d

RTOL = ATOL = 1e-5
MODES = ["half_pixel", "pytorch_half_pixel", "align_corners", "asymmetric", "half_pixel_symmetric"]


def _model(shape, op="Resize", opset=19, scales=None, sizes=None, **attrs):
    inits, ins = [], ["x"]
    if op == "Upsample" or opset == 10:
        inits.append(numpy_helper.from_array(np.asarray(scales, np.float32), "scales"))
        ins.append("scales")
    else:
        ins.append("roi" if opset == 11 else "")    # opset 11: roi is not optional (onnxruntime)
        if opset == 11:
            inits.append(numpy_helper.from_array(np.zeros(0, np.float32), "roi"))
        if scales is not None:
            inits.append(numpy_helper.from_array(np.asarray(scales, np.float32), "scales"))
            ins.append("scales")
        else:
            inits.append(numpy_helper.from_array(np.asarray(sizes, np.int64), "sizes"))
            if opset == 11:     # an empty scales tensor, not a missing input (onnxruntime)
                inits.append(numpy_helper.from_array(np.zeros(0, np.float32), "no_scales"))
            ins += ["no_scales" if opset == 11 else "", "sizes"]
    g = helper.make_graph([helper.make_node(op, ins, ["y"], **attrs)], "resize",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def _check(model, shape, tmp_path, direct=True, oracle="ort"):
    import onnxruntime as ort
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    data = model.SerializeToString()
    f = ap.jit(data, options=ap.Options(target="cpu", cache_dir=str(tmp_path)))
    if oracle == "ort":
        want = ort.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    else:
        from onnx.reference import ReferenceEvaluator
        want = ReferenceEvaluator(model).run(None, {"x": x})[0]
    got = np.asarray(f(x=x))
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
    kinds = [getattr(k.fused, "strategy", None) for k in f.plan.kernels]
    assert ("resize2d" in kinds) == direct, (kinds, f.plan)
    return f


CASES = [((1, 3, 5, 7), [1, 1, 2, 2], None), ((2, 2, 6, 9), [1, 1, 1.7, 0.6], None),
         ((1, 4, 8, 5), None, [1, 4, 3, 11]), ((1, 2, 7, 7), None, [1, 2, 14, 5])]

#: scales exact in binary: with 1.7 / 0.6 a source coordinate on a rounding tie (5.0, 4.5) in
#: float32 (onnxruntime) is off it in float64 (compound_resize.py, before and after this kernel)
NEAREST_CASES = [CASES[0], ((2, 2, 6, 9), [1, 1, 1.75, 0.75], None), *CASES[2:]]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape, scales, sizes", CASES)
def test_linear_modes(tmp_path, mode, shape, scales, sizes):
    _check(_model(shape, scales=scales, sizes=sizes, mode="linear", coordinate_transformation_mode=mode),
           shape, tmp_path, oracle=_oracle(mode, shape, scales))


def _oracle(mode, shape, scales):
    """align_corners with ``scale * length`` not whole: onnxruntime divides by the output length,
    the ONNX reference (and compound_resize.py, before and after this kernel) by ``scale * length``
    -- compare against the ONNX reference there."""
    if mode == "align_corners" and scales is not None and any(
            not float(s * d).is_integer() for s, d in zip(scales, shape)):
        return "onnx"
    return "ort"


@pytest.mark.parametrize("mode, nearest", [("half_pixel", "round_prefer_floor"), ("asymmetric", "floor"),
                                           ("align_corners", "round_prefer_ceil"),
                                           ("tf_half_pixel_for_nn", "ceil"), ("pytorch_half_pixel", "floor")])
@pytest.mark.parametrize("shape, scales, sizes", NEAREST_CASES)
def test_nearest_modes(tmp_path, mode, nearest, shape, scales, sizes):
    opset = 11 if mode == "tf_half_pixel_for_nn" else 19     # a mode of opset 11 only
    _check(_model(shape, opset=opset, scales=scales, sizes=sizes, mode="nearest", coordinate_transformation_mode=mode,
                  nearest_mode=nearest), shape, tmp_path, oracle=_oracle(mode, shape, scales))


@pytest.mark.parametrize("opset", [10, 11, 13, 18])
@pytest.mark.parametrize("mode", ["linear", "nearest"])
def test_opsets(tmp_path, opset, mode):
    attrs = {"mode": mode} if opset == 10 else {"mode": mode, "coordinate_transformation_mode": "asymmetric"}
    _check(_model((1, 2, 5, 6), opset=opset, scales=[1, 1, 2.5, 1.5], **attrs), (1, 2, 5, 6), tmp_path)


def test_upsample(tmp_path):
    _check(_model((1, 3, 4, 5), op="Upsample", opset=9, scales=[1, 1, 2, 3], mode="linear"), (1, 3, 4, 5), tmp_path)


def test_not_covered_keeps_the_per_axis_form(tmp_path):
    # cubic, a resized channel axis, and the A/B switch off: the matmul / gather form, same numbers
    _check(_model((1, 2, 5, 6), scales=[1, 1, 2, 2], mode="cubic"), (1, 2, 5, 6), tmp_path, direct=False)
    _check(_model((1, 2, 5, 6), scales=[1, 2, 2, 2], mode="nearest"), (1, 2, 5, 6), tmp_path, direct=False)
    old = resize2d.ENABLED
    resize2d.ENABLED = False
    try:
        _check(_model((1, 2, 5, 6), scales=[1, 1, 2, 2], mode="linear"), (1, 2, 5, 6), tmp_path / "off",
               direct=False)
    finally:
        resize2d.ENABLED = old


def test_tap_tables_refuse_cubic():
    from apollo_py.ops.compound_resize import resize_weights
    w, _ = resize_weights("cubic", 5, 10, 2.0, "half_pixel")
    assert resize2d.tap_tables(w, 2, "float32") is None
    w, _ = resize_weights("linear", 5, 10, 2.0, "half_pixel")
    idx, wt = resize2d.tap_tables(w, 2, "float32")
    np.testing.assert_allclose((wt[:, :, None] * np.eye(5)[idx]).sum(0), w, rtol=1e-6)


def test_phase_form_chosen_for_periodic_columns():
    from apollo_py.codegen.resize import find_phases
    from apollo_py.ops.compound_resize import resize_weights

    def phases(n_in, n_out, mode):
        w, _ = resize_weights("linear", n_in, n_out, n_out / n_in, mode)
        return find_phases(*resize2d.tap_tables(w, 2, "float32"))
    ph = phases(64, 128, "half_pixel")         # U-Net's 2x: period 2, one edge column each side
    assert (ph.s, ph.p, ph.k_lo, ph.k_hi) == (2, 1, 1, 63)
    assert ph.cols == ((-1, 0), (0, 1)) and ph.weights == ((0.25, 0.75), (0.75, 0.25))
    assert phases(20, 30, "asymmetric").s == 3          # 1.5x: 3 outputs per 2 inputs
    assert phases(40, 20, "half_pixel").p == 2          # 0.5x: stride-2 reads
    assert phases(6, 5, "align_corners") is None        # no period with 4 whole periods


@pytest.mark.parametrize("phases", [True, False])
def test_phase_and_table_forms_agree(tmp_path, phases):
    from apollo_py.codegen import resize as R
    old = R.PHASES
    R.PHASES = phases
    try:
        for scales in ([1, 1, 2, 2], [1, 1, 1.5, 0.5]):
            for mode in ("linear", "nearest"):
                _check(_model((1, 3, 10, 24), scales=scales, mode=mode), (1, 3, 10, 24), tmp_path / f"{phases}")
    finally:
        R.PHASES = old


@pytest.mark.parametrize("mode", ["linear", "nearest"])
def test_export_writes_standard_onnx(tmp_path, mode):
    import onnxruntime as ort
    f = _check(_model((1, 2, 5, 6), scales=[1, 1, 2, 1.5], mode=mode), (1, 2, 5, 6), tmp_path)
    x = np.random.default_rng(3).standard_normal((1, 2, 5, 6)).astype(np.float32)
    exported = ap.export(f)
    got = ort.InferenceSession(exported.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, np.asarray(f(x=x)), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("mode", ["linear", "nearest"])
@pytest.mark.parametrize("shape, scales, sizes", [CASES[0], NEAREST_CASES[1], CASES[2]])
def test_cuda_targets_get_the_separable_form(tmp_path, mode, shape, scales, sizes):
    """cuda-emu has no resize2d kernel: the node is written back as transposes and matmuls
    (nearest: gathers) before partitioning (partition/resize_unfuse.py), never a numpy step,
    with the same numbers as onnxruntime."""
    import onnxruntime as ort
    model = _model(shape, scales=scales, sizes=sizes, mode=mode)
    data = model.SerializeToString()
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    f = ap.jit(data, options=ap.Options(target="cuda-emu", cache_dir=str(tmp_path)))
    got = np.asarray(f(x=x))
    want = ort.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
    ops = {n.op for n in f.plan.graph.nodes}
    assert "resize2d" not in ops and ("matmul" in ops) == (mode == "linear"), ops
