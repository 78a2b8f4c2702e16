"""ONNX ops without a lowering run through onnx.reference: as ``onnx_op`` steps when their output
types are static, folded when their inputs are constant, staged when their output shape depends
on data.  Every result is checked against onnxruntime."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto as T
from onnx import helper

import apollo_py
from apollo_py import UnsupportedOpError

ort = pytest.importorskip("onnxruntime")
TARGETS = ["reference", "cpu"]


def _model(nodes, inputs, outputs, inits=(), opset=17):
    g = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info(o, e, None) for o, e in outputs],
                          initializer=list(inits))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def _ort(model, feeds):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


def _check(f, model, feeds, rtol=1e-5, atol=1e-6):
    got = f.run(**feeds)
    want = _ort(model, feeds)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol)


def _topk_model():
    x = helper.make_tensor_value_info("x", T.FLOAT, ["B", 10])
    k = helper.make_tensor("k", T.INT64, [1], [3])
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("TopK", ["r", "k"], ["v", "i"], name="topk"),
             helper.make_node("Mul", ["v", "v"], ["y"], name="sq")]
    return _model(nodes, [x], [("y", T.FLOAT), ("i", T.INT64)], [k])


@pytest.mark.parametrize("target", TARGETS)
def test_topk_static_k_is_a_fallback_step(target):
    model = _topk_model()
    f = apollo_py.jit(model, target=target)
    for b in (2, 5):  # symbolic batch: two specialisations
        _check(f, model, {"x": np.random.default_rng(b).standard_normal((b, 10)).astype(np.float32)})
    assert len(f._cache) == 2
    text = str(f.plan)
    assert "fallback TopK 'topk': no apollo_py lowering for TopK" in text
    cov = f.plan.coverage
    assert (cov.compiled, cov.fallback_count, cov.primitives_compiled, cov.primitives_fallback) == (2, 1, 2, 1)
    assert cov.fallback == (("topk", "TopK", "no apollo_py lowering for TopK"),)
    assert "coverage: 2 ops compiled, 1 in fallback" in text
    assert f.plan.micro_graphs[1].kind == "fallback"


def test_coverage_in_json():
    import json
    doc = json.loads(apollo_py.jit(_topk_model(), target="reference", input_shapes={"x": (2, 10)}).plan.to_json())
    assert doc["coverage"]["ops_compiled"] == 2 and doc["coverage"]["ops_fallback"] == 1
    assert doc["coverage"]["fallback"][0]["op_type"] == "TopK"


@pytest.mark.parametrize("target", TARGETS)
def test_topk_runtime_k_is_staged(target):
    x = helper.make_tensor_value_info("x", T.FLOAT, [4, 10])
    k = helper.make_tensor_value_info("k", T.INT64, [1])
    nodes = [helper.make_node("Exp", ["x"], ["e"], name="exp"),
             helper.make_node("TopK", ["e", "k"], ["v", "i"], name="topk", largest=0),
             helper.make_node("Neg", ["v"], ["y"], name="neg")]
    model = _model(nodes, [x, k], [("y", T.FLOAT), ("i", T.INT64)])
    f = apollo_py.jit(model, target=target)
    a = np.random.default_rng(0).standard_normal((4, 10)).astype(np.float32)
    for kk in (2, 5, 2):
        _check(f, model, {"x": a, "k": np.array([kk], np.int64)})
    plan = f.plan
    assert plan.n_tails == 2  # k=2 and k=5 specialised the rest once each
    text = str(plan)
    assert "fallback TopK 'topk': the output shape of TopK depends on input data" in text
    assert (plan.coverage.compiled, plan.coverage.fallback_count) == (2, 1)


@pytest.mark.parametrize("target", TARGETS)
def test_nonzero_then_compiled_rest(target):
    x = helper.make_tensor_value_info("x", T.FLOAT, [3, 4])
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("NonZero", ["r"], ["nz"], name="nonzero"),
             helper.make_node("Transpose", ["nz"], ["t"], name="tr"),
             helper.make_node("Add", ["t", "t"], ["y"], name="add")]
    model = _model(nodes, [x], [("y", T.INT64)])
    f = apollo_py.jit(model, target=target)
    for s in range(4):
        _check(f, model, {"x": np.random.default_rng(s).standard_normal((3, 4)).astype(np.float32)})
    assert "fallback NonZero 'nonzero'" in str(f.plan)


def test_nonzero_of_constant_is_folded():
    c = helper.make_tensor("c", T.FLOAT, [2, 3], [0, 1, 0, 2, 0, 3])
    x = helper.make_tensor_value_info("x", T.INT64, [2, 3])
    nodes = [helper.make_node("NonZero", ["c"], ["nz"], name="nonzero"),
             helper.make_node("Add", ["nz", "x"], ["y"], name="add")]
    model = _model(nodes, [x], [("y", T.INT64)], [c])
    f = apollo_py.jit(model, target="reference")
    _check(f, model, {"x": np.arange(6, dtype=np.int64).reshape(2, 3)})
    assert all(n.op != "onnx_op" for n in f.plan.graph.nodes)
    assert f.plan.coverage.fallback_count == 0


@pytest.mark.parametrize("target", TARGETS)
def test_runtime_reshape_and_range(target):
    """Converters that need a static operand hand the node to the fallback; its shape then
    depends on data, so the model is staged."""
    x = helper.make_tensor_value_info("x", T.FLOAT, [6])
    s = helper.make_tensor_value_info("s", T.INT64, [2])
    n = helper.make_tensor_value_info("n", T.FLOAT, [])
    zero, one = helper.make_tensor("zero", T.FLOAT, [], [0.0]), helper.make_tensor("one", T.FLOAT, [], [1.0])
    nodes = [helper.make_node("Reshape", ["x", "s"], ["r"], name="dyn_reshape"),
             helper.make_node("Range", ["zero", "n", "one"], ["rg"], name="dyn_range"),
             helper.make_node("ReduceSum", ["r", "axes"], ["rs"], name="rsum", keepdims=0),
             helper.make_node("Sigmoid", ["rg"], ["y2"], name="sig")]
    axes = helper.make_tensor("axes", T.INT64, [1], [1])
    model = _model(nodes, [x, s, n], [("rs", T.FLOAT), ("y2", T.FLOAT)], [zero, one, axes])
    f = apollo_py.jit(model, target=target)
    a = np.arange(6, dtype=np.float32)
    for shape, count in (((2, 3), 4.0), ((3, 2), 7.0)):
        _check(f, model, {"x": a, "s": np.array(shape, np.int64), "n": np.array(count, np.float32)})
    assert "Reshape 'dyn_reshape'" in str(f.plan)


def test_specialize_refuses_data_dependent_shapes():
    x = helper.make_tensor_value_info("x", T.FLOAT, [3])
    model = _model([helper.make_node("NonZero", ["x"], ["y"], name="nz")], [x], [("y", T.INT64)])
    prog = apollo_py.jit(model).program
    with pytest.raises(UnsupportedOpError, match="'nz'.*depends on input data"):
        prog.specialize({"x": (3,)})


@pytest.mark.parametrize("target", TARGETS)
def test_lstm_with_unnamed_optional_output(target):
    """An LSTM whose Y output is skipped: the node is lowered (the recurrent kernel, or its numpy
    reference on the reference target) and only Y_h is used.  (Recurrent ops with attributes the
    lowering lacks still run through onnx.reference: tests/frontend/test_recurrent.py.)"""
    rng = np.random.default_rng(1)
    hid, inp = 8, 5
    w = helper.make_tensor("W", T.FLOAT, [1, 4 * hid, inp], (rng.standard_normal(4 * hid * inp) * 0.3).tolist())
    r = helper.make_tensor("R", T.FLOAT, [1, 4 * hid, hid], (rng.standard_normal(4 * hid * hid) * 0.3).tolist())
    x = helper.make_tensor_value_info("x", T.FLOAT, ["S", 2, inp])
    nodes = [helper.make_node("LSTM", ["x", "W", "R"], ["", "h"], name="lstm", hidden_size=hid),
             helper.make_node("Tanh", ["h"], ["y"], name="tanh")]
    model = _model(nodes, [x], [("y", T.FLOAT)], [w, r])
    f = apollo_py.jit(model, target=target)
    for s in (3, 6):
        # onnxruntime's LSTM uses approximate activations (about 2e-4 relative from float64)
        _check(f, model, {"x": rng.standard_normal((s, 2, inp)).astype(np.float32)}, rtol=1e-4, atol=1e-4)
    assert "fallback" not in str(f.plan).split("coverage")[0] and "recurrent" in str(f.plan)


def test_op_without_lowering_or_reference_is_refused():
    x = helper.make_tensor_value_info("x", T.FLOAT, [2])
    model = _model([helper.make_node("FrobnicateTensor", ["x"], ["y"], name="frob")], [x], [("y", T.FLOAT)])
    with pytest.raises(UnsupportedOpError, match="'frob'.*FrobnicateTensor.*no onnx.reference"):
        apollo_py.jit(model)


@pytest.mark.parametrize("target", TARGETS)
def test_constant_of_shape_runtime_shape_unique_and_sin(target):
    x = helper.make_tensor_value_info("x", T.INT64, [2])
    v = helper.make_tensor_value_info("v", T.FLOAT, [6])
    nodes = [helper.make_node("ConstantOfShape", ["x"], ["c"], name="cos",
                              value=helper.make_tensor("val", T.FLOAT, [1], [2.5])),
             helper.make_node("Sin", ["v"], ["s"], name="sin"),
             helper.make_node("Unique", ["v"], ["u"], name="uniq", sorted=1),
             helper.make_node("Exp", ["c"], ["y"], name="exp")]
    model = _model(nodes, [x, v], [("y", T.FLOAT), ("s", T.FLOAT), ("u", T.FLOAT)])
    f = apollo_py.jit(model, target=target)
    for shape in ([2, 3], [4, 1]):
        _check(f, model, {"x": np.array(shape, np.int64), "v": np.array([3, 1, 3, 2, 1, 0.5], np.float32)})
    cov = f.plan.coverage
    assert (cov.compiled, cov.fallback_count) == (1, 3)
    assert {op for _, op, _ in cov.fallback} == {"ConstantOfShape", "Sin", "Unique"}


def test_sequence_values_are_refused_clearly():
    a = helper.make_tensor_value_info("a", T.FLOAT, [2])
    nodes = [helper.make_node("SequenceConstruct", ["a", "a"], ["sq"], name="seq"),
             helper.make_node("ConcatFromSequence", ["sq"], ["y"], name="cat", axis=0)]
    f = apollo_py.jit(_model(nodes, [a], [("y", T.FLOAT)]))
    with pytest.raises(UnsupportedOpError, match="'seq'.*sequence"):
        f(np.ones(2, np.float32))


def test_staged_plan_json_and_tail_cache_bound(monkeypatch):
    import json

    from apollo_py.frontend import staged
    monkeypatch.setattr(staged, "MAX_TAILS", 2)
    x = helper.make_tensor_value_info("x", T.FLOAT, [6])
    nodes = [helper.make_node("NonZero", ["x"], ["nz"], name="nonzero"),
             helper.make_node("Neg", ["nz"], ["y"], name="neg")]
    model = _model(nodes, [x], [("y", T.INT64)])
    f = apollo_py.jit(model, target="reference")
    for count in (1, 2, 3, 4):
        a = np.zeros(6, np.float32)
        a[:count] = 1
        _check(f, model, {"x": a})
    exe = next(iter(f._cache.values()))
    assert len(exe._tails) == 2 and f.plan.n_tails == 4
    doc = json.loads(f.plan.to_json())
    assert doc["split"] == {"node": "nonzero", "op_type": "NonZero",
                            "reason": "the output shape of NonZero depends on input data"}
    assert doc["coverage"]["ops_compiled"] == 1 and doc["coverage"]["ops_fallback"] == 1
