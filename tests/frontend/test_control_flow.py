"""If / Loop / Scan: onnx.reference's op classes drive the control flow, apollo_py compiles the
bodies (outer-scope captures included).  Checked against onnxruntime on both targets."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto as T
from onnx import helper

import apollo_py

ort = pytest.importorskip("onnxruntime")
TARGETS = ["reference", "cpu"]


def _ort(model, feeds):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


def _check(f, model, feeds, rtol=1e-5, atol=1e-6):
    got, want = f.run(**feeds), _ort(model, feeds)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape, (g.shape, w.shape)
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol)


def _vi(name, elem=T.FLOAT, shape=None):
    return helper.make_tensor_value_info(name, elem, shape)


def _if_model(same_shapes: bool):
    """y = If(sum(x) > 0): then tanh(x) * w (w captured), else x - w  [or x[:1] - w: other shape]."""
    then = helper.make_graph([helper.make_node("Tanh", ["x"], ["t"], name="then_tanh"),
                              helper.make_node("Mul", ["t", "w"], ["then_out"], name="then_mul")],
                             "then", [], [_vi("then_out")])
    if same_shapes:
        else_nodes = [helper.make_node("Sub", ["x", "w"], ["else_out"], name="else_sub")]
    else:
        else_nodes = [helper.make_node("Slice", ["x", "s0", "s1", "s0"], ["xs"], name="else_slice"),
                      helper.make_node("Sub", ["xs", "w"], ["else_out"], name="else_sub")]
    other = helper.make_graph(else_nodes, "else", [], [_vi("else_out")])
    nodes = [helper.make_node("ReduceSum", ["x"], ["s"], name="sum", keepdims=0),
             helper.make_node("Greater", ["s", "zero"], ["c"], name="gt"),
             helper.make_node("If", ["c"], ["y"], name="if", then_branch=then, else_branch=other),
             helper.make_node("Relu", ["y"], ["z"], name="relu")]
    inits = [helper.make_tensor("zero", T.FLOAT, [], [0.0]),
             helper.make_tensor("s0", T.INT64, [1], [0]), helper.make_tensor("s1", T.INT64, [1], [1])]
    g = helper.make_graph(nodes, "g", [_vi("x", shape=["N", 3]), _vi("w", shape=[3])], [_vi("z")],
                          initializer=inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("target", TARGETS)
def test_if_runtime_condition_with_captures(target):
    model = _if_model(same_shapes=True)
    f = apollo_py.jit(model, target=target)
    w = np.array([0.5, -1.0, 2.0], np.float32)
    for n, sign in ((4, 1), (4, -1), (2, 1)):
        x = (np.abs(np.random.default_rng(n).standard_normal((n, 3))) * sign).astype(np.float32)
        _check(f, model, {"x": x, "w": w})
    text = str(f.plan)
    assert "fallback If 'if'" in text and "body then_branch" in text
    cov = f.plan.coverage
    # top level: sum, gt, relu compiled, the If in fallback; plus the branch bodies that ran
    assert cov.fallback == (("if", "If", "no apollo_py lowering for If"),)
    assert cov.compiled >= 3


@pytest.mark.parametrize("target", TARGETS)
def test_if_branches_with_different_shapes_is_staged(target):
    model = _if_model(same_shapes=False)
    f = apollo_py.jit(model, target=target)
    w = np.array([0.5, -1.0, 2.0], np.float32)
    for sign in (1, -1, 1):
        x = (np.abs(np.random.default_rng(3).standard_normal((4, 3))) * sign).astype(np.float32)
        _check(f, model, {"x": x, "w": w})
    assert f.plan.n_tails == 2
    assert "depends on input data" in str(f.plan)


def test_if_constant_condition_is_inlined():
    then = helper.make_graph([helper.make_node("Exp", ["x"], ["a"], name="then_exp")], "then", [], [_vi("a")])
    other = helper.make_graph([helper.make_node("Neg", ["x"], ["b"], name="else_neg")], "else", [], [_vi("b")])
    nodes = [helper.make_node("Shape", ["x"], ["sh"], name="shape"),
             helper.make_node("Gather", ["sh", "one"], ["d"], name="dim1", axis=0),
             helper.make_node("Equal", ["d", "three"], ["c"], name="eq"),
             helper.make_node("If", ["c"], ["y"], name="if", then_branch=then, else_branch=other)]
    inits = [helper.make_tensor("one", T.INT64, [], [1]), helper.make_tensor("three", T.INT64, [], [3])]
    g = helper.make_graph(nodes, "g", [_vi("x", shape=[2, "K"])], [_vi("y")], initializer=inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    f = apollo_py.jit(model, target="reference")
    for k in (3, 4):  # K=3 takes then (exp), K=4 else (neg): both folded to one branch
        _check(f, model, {"x": np.random.default_rng(k).standard_normal((2, k)).astype(np.float32)})
        assert [n.op for n in f.plan.graph.nodes] == ["exp" if k == 3 else "neg"]
        assert f.plan.coverage.fallback_count == 0


def _loop_model():
    """Loop M times: acc = acc * a + x (a captured), scan output acc; carried state and scans."""
    body = helper.make_graph(
        [helper.make_node("Mul", ["acc_in", "a"], ["m"], name="body_mul"),
         helper.make_node("Add", ["m", "x"], ["acc_out"], name="body_add"),
         helper.make_node("Identity", ["cond_in"], ["cond_out"], name="body_cond"),
         helper.make_node("Sigmoid", ["acc_out"], ["scan_out"], name="body_sig")],
        "body", [_vi("i", T.INT64, []), _vi("cond_in", T.BOOL, []), _vi("acc_in", shape=[2, 3])],
        [_vi("cond_out", T.BOOL, []), _vi("acc_out", shape=[2, 3]), _vi("scan_out", shape=[2, 3])])
    nodes = [helper.make_node("Neg", ["x0"], ["x"], name="neg"),
             helper.make_node("Loop", ["M", "", "init"], ["acc", "scans"], name="loop", body=body),
             helper.make_node("Abs", ["acc"], ["y"], name="abs")]
    g = helper.make_graph(nodes, "g", [_vi("x0", shape=[2, 3]), _vi("a", shape=[3]), _vi("init", shape=[2, 3]),
                                       _vi("M", T.INT64, [])], [_vi("y"), _vi("scans")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("target", TARGETS)
def test_loop_with_state_scan_output_and_capture(target):
    model = _loop_model()
    f = apollo_py.jit(model, target=target)
    rng = np.random.default_rng(0)
    feeds = {"x0": rng.standard_normal((2, 3)).astype(np.float32),
             "a": np.array([0.5, 0.9, -0.7], np.float32),
             "init": rng.standard_normal((2, 3)).astype(np.float32)}
    for m in (3, 5):
        _check(f, model, {**feeds, "M": np.array(m, np.int64)})
    text = str(f.plan)
    assert "fallback Loop 'loop'" in text and "body body" in text


def _scan_model():
    """Scan over rows of xs: state = state * decay + row, out = state * scale (scale captured)."""
    body = helper.make_graph(
        [helper.make_node("Mul", ["s_in", "decay"], ["m"], name="body_mul"),
         helper.make_node("Add", ["m", "row"], ["s_out"], name="body_add"),
         helper.make_node("Mul", ["s_out", "scale"], ["out"], name="body_scale")],
        "body", [_vi("s_in", shape=[4]), _vi("row", shape=[4])], [_vi("s_out", shape=[4]), _vi("out", shape=[4])])
    nodes = [helper.make_node("Exp", ["xs0"], ["xs"], name="exp"),
             helper.make_node("Scan", ["s0", "xs"], ["s", "ys"], name="scan", body=body, num_scan_inputs=1),
             helper.make_node("Tanh", ["ys"], ["y"], name="tanh")]
    decay = helper.make_tensor("decay", T.FLOAT, [], [0.8])
    g = helper.make_graph(nodes, "g", [_vi("s0", shape=[4]), _vi("xs0", shape=["T", 4]), _vi("scale", shape=[4])],
                          [_vi("s"), _vi("y")], initializer=[decay])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("target", TARGETS)
def test_scan_with_state_and_capture(target):
    model = _scan_model()
    f = apollo_py.jit(model, target=target)
    rng = np.random.default_rng(1)
    for t in (3, 6):  # symbolic sequence length: two specialisations
        feeds = {"s0": rng.standard_normal(4).astype(np.float32),
                 "xs0": rng.standard_normal((t, 4)).astype(np.float32) * 0.3,
                 "scale": np.array([1.0, -0.5, 0.25, 2.0], np.float32)}
        _check(f, model, feeds)
    assert "fallback Scan 'scan'" in str(f.plan)
    assert len(f._cache) == 2


@pytest.mark.parametrize("target", TARGETS)
def test_loop_containing_if(target):
    """Nested control flow: a Loop body holding an If on the iteration number."""
    then = helper.make_graph([helper.make_node("Add", ["v_in", "x"], ["t"], name="then_add")], "then", [],
                             [_vi("t", shape=[3])])
    other = helper.make_graph([helper.make_node("Sub", ["v_in", "x"], ["e"], name="else_sub")], "else", [],
                              [_vi("e", shape=[3])])
    body = helper.make_graph(
        [helper.make_node("Mod", ["i", "two"], ["r"], name="mod"),
         helper.make_node("Equal", ["r", "zero"], ["even"], name="even"),
         helper.make_node("If", ["even"], ["v_out"], name="inner_if", then_branch=then, else_branch=other),
         helper.make_node("Identity", ["c_in"], ["c_out"], name="cond")],
        "body", [_vi("i", T.INT64, []), _vi("c_in", T.BOOL, []), _vi("v_in", shape=[3])],
        [_vi("c_out", T.BOOL, []), _vi("v_out", shape=[3])],
        initializer=[helper.make_tensor("two", T.INT64, [], [2]), helper.make_tensor("zero", T.INT64, [], [0])])
    nodes = [helper.make_node("Loop", ["M", "", "v0"], ["v"], name="loop", body=body)]
    g = helper.make_graph(nodes, "g", [_vi("x", shape=[3]), _vi("v0", shape=[3]), _vi("M", T.INT64, [])], [_vi("v")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    f = apollo_py.jit(model, target=target)
    feeds = {"x": np.array([1.0, 2.0, 3.0], np.float32), "v0": np.array([0.5, 0.0, -1.0], np.float32)}
    for m in (0, 1, 4, 5):
        _check(f, model, {**feeds, "M": np.array(m, np.int64)})


@pytest.mark.parametrize("target", TARGETS)
def test_if_typed_by_lowering_both_branches(target):
    """ONNX shape inference cannot type this If (its branches reshape by computed shapes); both
    branches lowered for the concrete shapes agree, so the If is one static fallback step."""
    then = helper.make_graph([helper.make_node("Shape", ["x"], ["sh"], name="t_shape"),
                              helper.make_node("ReduceProd", ["sh"], ["n"], name="t_prod", keepdims=1),
                              helper.make_node("Reshape", ["x", "n"], ["t_out"], name="t_reshape")],
                             "then", [], [_vi("t_out")])
    other = helper.make_graph([helper.make_node("Flatten", ["x"], ["fl"], name="e_flat", axis=0),
                               helper.make_node("Squeeze", ["fl", "zero"], ["e_out"], name="e_sq")],
                              "else", [], [_vi("e_out")])
    nodes = [helper.make_node("ReduceSum", ["x"], ["s"], name="sum", keepdims=0),
             helper.make_node("Greater", ["s", "fz"], ["c"], name="gt"),
             helper.make_node("If", ["c"], ["y"], name="if", then_branch=then, else_branch=other),
             helper.make_node("Neg", ["y"], ["z"], name="neg")]
    inits = [helper.make_tensor("zero", T.INT64, [1], [0]), helper.make_tensor("fz", T.FLOAT, [], [0.0])]
    g = helper.make_graph(nodes, "g", [_vi("x", shape=["N", 3])], [_vi("z")], initializer=inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    f = apollo_py.jit(model, target=target)
    for sign in (1, -1):
        x = (np.abs(np.random.default_rng(0).standard_normal((4, 3))) * sign).astype(np.float32)
        _check(f, model, {"x": x})
    plan = f.plan
    assert not hasattr(plan, "n_tails")  # one static graph, not staged
    assert [n.op for n in plan.graph.nodes if n.op == "onnx_op"] == ["onnx_op"]
    # the outer constant 'zero' was copied into the else branch, so its Squeeze compiled
    assert plan.coverage.fallback == (("if", "If", "no apollo_py lowering for If"),)


@pytest.mark.parametrize("target", TARGETS)
def test_scan_body_folds_captured_outer_constants(target):
    """A Scan body reshapes by an outer initializer: the constant is embedded in the body, so
    the body compiles without a fallback of its own."""
    body = helper.make_graph(
        [helper.make_node("Reshape", ["row", "shape"], ["r2"], name="body_reshape"),
         helper.make_node("ReduceSum", ["r2", "axes"], ["rs"], name="body_sum", keepdims=0),
         helper.make_node("Add", ["s_in", "rs"], ["s_out"], name="body_add"),
         helper.make_node("Identity", ["s_out"], ["out"], name="body_id")],
        "body", [_vi("s_in", shape=[2]), _vi("row", shape=[6])], [_vi("s_out", shape=[2]), _vi("out", shape=[2])])
    nodes = [helper.make_node("Scan", ["s0", "xs"], ["s", "ys"], name="scan", body=body, num_scan_inputs=1)]
    inits = [helper.make_tensor("shape", T.INT64, [2], [2, 3]), helper.make_tensor("axes", T.INT64, [1], [1])]
    g = helper.make_graph(nodes, "g", [_vi("s0", shape=[2]), _vi("xs", shape=[5, 6])], [_vi("s"), _vi("ys")],
                          initializer=inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    f = apollo_py.jit(model, target=target)
    rng = np.random.default_rng(4)
    _check(f, model, {"s0": rng.standard_normal(2).astype(np.float32),
                      "xs": rng.standard_normal((5, 6)).astype(np.float32)})
    assert f.plan.coverage.fallback == (("scan", "Scan", "no apollo_py lowering for Scan"),)
    assert f.plan.coverage.compiled >= 3  # the body's reshape, sum and add


def _scan8_model(with_lens: bool):
    """Opset-8 Scan: batch axis 0, scan axis 1, a reversed second scan input, optional lengths."""
    body = helper.make_graph(
        [helper.make_node("Add", ["s_in", "a"], ["t"], name="body_add"),
         helper.make_node("Mul", ["t", "b"], ["s_out"], name="body_mul"),
         helper.make_node("Sub", ["s_out", "a"], ["out"], name="body_sub")],
        "body8", [_vi("s_in", shape=[3]), _vi("a", shape=[3]), _vi("b", shape=[3])],
        [_vi("s_out", shape=[3]), _vi("out", shape=[3])])
    inputs = [_vi("s0", shape=[2, 3]), _vi("xa", shape=[2, 5, 3]), _vi("xb", shape=[2, 5, 3])]
    first = "lens" if with_lens else ""
    if with_lens:
        inputs.insert(0, _vi("lens", T.INT64, [2]))
    node = helper.make_node("Scan", [first, "s0", "xa", "xb"], ["s", "ys"], name="scan8", body=body,
                            num_scan_inputs=2, directions=[0, 1])
    g = helper.make_graph([node], "g8", inputs, [_vi("s"), _vi("ys")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 8)])


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("with_lens", [False, True])
def test_opset8_scan_batched_with_directions_and_lengths(target, with_lens):
    model = _scan8_model(with_lens)
    rng = np.random.default_rng(4)
    feeds = {"s0": rng.standard_normal((2, 3)).astype(np.float32),
             "xa": rng.standard_normal((2, 5, 3)).astype(np.float32),
             "xb": (rng.standard_normal((2, 5, 3)) * 0.5).astype(np.float32)}
    if with_lens:
        feeds["lens"] = np.array([5, 3], np.int64)
    _check(apollo_py.jit(model, target=target), model, feeds)
