"""Joint projections (layers/joint_gemm.py): generated GEMMs with constant weights that read one
activation run as one GEMM over the concatenated weights, each product keeping its epilogue,
outputs and output layout -- against onnxruntime, with the plan pinned (one GEMM step where
there were three) and the cases that must stay apart."""
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import apollo_py as ap

ort = pytest.importorskip("onnxruntime")
N_ = helper.make_node
RTOL = 1e-5


def _model(nodes, inputs, outputs, inits):
    g = helper.make_graph(nodes, "joint", [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs],
                          [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs],
                          initializer=[numpy_helper.from_array(a, n) for n, a in inits.items()])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])


def _projections(s, d, heads, odd):
    """Four products of ``x`` in four spellings: ``Relu(x @ Wq + bq)``, ``(x @ Wk) * 0.5``
    split into heads and transposed (the exporters' head split), ``Gemm(x, Wv, bv, transB=1)``
    of width ``odd``, ``Transpose(x @ Wt)`` (stored transposed); ``x + 1`` reads ``x`` too."""
    rng = np.random.default_rng(0)
    w = {k: (rng.standard_normal(shape) / np.sqrt(d)).astype(np.float32) for k, shape in
         (("wq", (d, d)), ("wk", (d, d)), ("wv", (odd, d)), ("wt", (d, 32)), ("bq", (d,)), ("bv", (odd,)))}
    w["half"] = np.array(0.5, np.float32)
    w["heads"] = np.array([s, heads, d // heads], np.int64)
    nodes = [N_("MatMul", ["x", "wq"], ["q0"]), N_("Add", ["q0", "bq"], ["q1"]), N_("Relu", ["q1"], ["q"]),
             N_("MatMul", ["x", "wk"], ["k0"]), N_("Mul", ["k0", "half"], ["k1"]),
             N_("Reshape", ["k1", "heads"], ["k2"]), N_("Transpose", ["k2"], ["k"], perm=[1, 0, 2]),
             N_("Gemm", ["x", "wv", "bv"], ["v"], transB=1), N_("Add", ["x", "one"], ["r"]),
             N_("MatMul", ["x", "wt"], ["t0"]), N_("Transpose", ["t0"], ["t"], perm=[1, 0])]
    w["one"] = np.array(1.0, np.float32)
    return _model(nodes, [("x", [s, d])], ["q", "k", "v", "r", "t"], w)


def _gemm_steps(plan):
    return [k for k in plan.kernels if k.gemm is not None]


def _check(model, feeds, options, rtol=RTOL):
    f = ap.jit(model.SerializeToString(), options=options)
    got = f(**feeds)
    got = list(got.values()) if isinstance(got, dict) else list(got) if isinstance(got, (list, tuple)) else [got]
    want = ort.InferenceSession(model.SerializeToString()).run(None, feeds)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        g = np.asarray(g)
        assert g.shape == w.shape and g.dtype == w.dtype
        err = float(np.max(np.abs(g - w))) / max(float(np.max(np.abs(w))), 1e-30)
        assert err <= rtol, err
    return f.plan


@pytest.mark.parametrize("s, d, odd", [(40, 64, 24), (256, 256, 48)])   # on the calling thread; on the pool
def test_four_spellings_one_gemm(s, d, odd, tmp_path):
    model = _projections(s, d, 4, odd)
    x = np.random.default_rng(1).standard_normal((s, d)).astype(np.float32)
    opts = ap.Options(gemm="generated", cache_dir=str(tmp_path))
    plan = _check(model, {"x": x}, opts)
    gemms = _gemm_steps(plan)
    assert len(gemms) == 1, [k.reason for k in gemms]
    g = gemms[0].gemm
    assert sorted(p.n for p in g.parts[:-1]) == [32, d, d] and g.parts[-1].n == odd and g.n == 2 * d + 32 + odd
    assert [p.out_perm for p in g.parts].count((1, 0)) == 1     # Transpose(x @ Wt) stored transposed
    assert "joint projections: 4 products" in gemms[0].reason
    alone = _check(model, {"x": x}, opts.replace(joint_gemm=False))
    assert len(_gemm_steps(alone)) == 4


def test_later_operand_stays_apart(tmp_path):
    """``x @ W2 + relu(x @ W1)``: the second product's epilogue reads the first's result, which
    the joint GEMM could not have before it runs -- two GEMMs, as before."""
    rng = np.random.default_rng(2)
    w = {"w1": rng.standard_normal((64, 64)).astype(np.float32), "w2": rng.standard_normal((64, 64)).astype(np.float32)}
    nodes = [N_("MatMul", ["x", "w1"], ["a"]), N_("Relu", ["a"], ["ra"]), N_("MatMul", ["x", "w2"], ["b0"]),
             N_("Add", ["b0", "ra"], ["y"])]
    model = _model(nodes, [("x", [32, 64])], ["y"], w)
    x = rng.standard_normal((32, 64)).astype(np.float32)
    plan = _check(model, {"x": x}, ap.Options(gemm="generated", cache_dir=str(tmp_path)))
    assert len(_gemm_steps(plan)) == 2


def test_segments_must_align(tmp_path):
    """Two products of widths that are not multiples of the micro-tile's columns: only one may
    be a segment (the last), so they stay apart."""
    rng = np.random.default_rng(3)
    w = {"w1": rng.standard_normal((64, 40)).astype(np.float32), "w2": rng.standard_normal((64, 24)).astype(np.float32)}
    nodes = [N_("MatMul", ["x", "w1"], ["a"]), N_("MatMul", ["x", "w2"], ["b"])]
    model = _model(nodes, [("x", [32, 64])], ["a", "b"], w)
    x = rng.standard_normal((32, 64)).astype(np.float32)
    plan = _check(model, {"x": x}, ap.Options(gemm="generated", cache_dir=str(tmp_path)))
    assert len(_gemm_steps(plan)) == 2


def test_options_joint_gemm_checked():
    with pytest.raises(ap.OptionsError):
        ap.Options(joint_gemm="yes")


@pytest.mark.parametrize("readers", [1, 2])
def test_head_split_stored_by_the_gemm(readers, tmp_path):
    """Llama's Q / K: ``reshape(x @ W, [S, H, d]) -> transpose(1, 0, 2)`` read by two kernels (the
    RoPE halves): the GEMM stores the heads transposed and both steps go.  With one reader the
    steps stay (that reader, e.g. a fused attention, may fold them itself)."""
    rng = np.random.default_rng(4)
    s, h, d = 24, 4, 32
    w = {"w": rng.standard_normal((64, h * d)).astype(np.float32), "shape": np.array([s, h, d], np.int64)}
    nodes = [N_("MatMul", ["x", "w"], ["y0"]), N_("Reshape", ["y0", "shape"], ["y1"]),
             N_("Transpose", ["y1"], ["y"], perm=[1, 0, 2]), N_("Neg", ["y"], ["a"])]
    outs = ["a"]
    if readers == 2:
        nodes.append(N_("Exp", ["y"], ["b"]))
        outs.append("b")
    model = _model(nodes, [("x", [s, 64])], outs, w)
    x = rng.standard_normal((s, 64)).astype(np.float32)
    plan = _check(model, {"x": x}, ap.Options(gemm="generated", cache_dir=str(tmp_path)))
    (g,) = _gemm_steps(plan)
    moves = [k for k in plan.kernels if k.gemm is None and {n.op for n in (k.fused.nodes if k.fused else k.nodes)}
             & {"reshape", "transpose"}]
    if readers == 2:
        assert g.gemm.out_perm == (1, 0, 2) and g.gemm.out_shape == (s, h, d) and not moves
    else:
        assert g.gemm.out_perm is None and moves
