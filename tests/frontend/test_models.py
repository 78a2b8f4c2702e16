"""The example models (examples/make_models.py) through apollo_py vs onnxruntime."""
from __future__ import annotations

import numpy as np
import pytest

import apollo_py
from make_models import MODELS, example_inputs, make_layernorm_gelu

ort = pytest.importorskip("onnxruntime")

DIMS = {"N": 3, "B": 2, "S": 5}


def ort_run(model, feeds):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def assert_close(got, want, rtol=1e-5, atol=1e-6):
    """Shape, then dtype, then values (with relative l2 / l-inf error in the message)."""
    assert got.shape == want.shape
    assert got.dtype == want.dtype
    err = np.abs(got.astype(np.float64) - want)
    rel_l2 = np.linalg.norm(err) / max(np.linalg.norm(want), 1e-30)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol,
                               err_msg=f"relative l2 error {rel_l2:.3g}, l-inf error {err.max():.3g}")


@pytest.mark.parametrize("name", sorted(MODELS))
def test_model_matches_onnxruntime(name):
    model = MODELS[name]()
    feeds = example_inputs(model, DIMS, seed=1)
    want = ort_run(model, feeds)
    got = apollo_py.jit(model, target="reference").run(**feeds)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert_close(g, w)


def test_gelu_tanh_matches_onnxruntime():
    model = make_layernorm_gelu(approximate="tanh")
    feeds = example_inputs(model, DIMS, seed=2)
    assert_close(apollo_py.jit(model, target="reference")(**feeds), ort_run(model, feeds)[0])


def test_model_from_path_and_bytes(tmp_path):
    model = MODELS["mlp"]()
    path = tmp_path / "mlp.onnx"
    path.write_bytes(model.SerializeToString())
    feeds = example_inputs(model, DIMS)
    want = ort_run(model, feeds)[0]
    for source in (str(path), path, model.SerializeToString()):
        assert_close(apollo_py.jit(source, target="reference")(feeds["x"]), want)


def test_provenance_and_names():
    """Every primitive names the ONNX node it came from; graph inputs/outputs keep ONNX names."""
    model = MODELS["attention"]()
    f = apollo_py.jit(model, target="reference")
    f(**example_inputs(model, DIMS))
    graph = f.plan.graph
    onnx_names = {n.name for n in model.graph.node}
    assert graph.inputs == ("x",) and graph.outputs == ("y",)
    for node in graph.nodes:
        if node.op != "constant":
            assert node.source and set(node.source) <= onnx_names, node
    # the shape arithmetic (Shape -> Gather -> Concat) is folded away
    assert not any(set(n.source) & {"shape", "take_bs", "split_shape", "merge_shape"} for n in graph.nodes)
    # LayerNormalization and Softmax were opened into primitives
    ln_ops = [n.op for n in graph.nodes if n.source == ("ln",)]
    assert "reduce_sum" in ln_ops and "sqrt" in ln_ops
    sm_ops = [n.op for n in graph.nodes if n.source == ("softmax",)]
    assert [o for o in sm_ops if o != "constant"] == ["reduce_max", "sub", "exp", "reduce_sum", "div"]


def test_identity_outputs_get_copies_with_provenance():
    from onnx import TensorProto, helper
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [3]) for n in ("a", "b", "c")]
    nodes = [helper.make_node("Identity", ["x"], ["a"], name="id_a"),
             helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("Identity", ["r"], ["b"], name="id_b"),
             helper.make_node("Identity", ["r"], ["c"], name="id_c")]
    m = helper.make_model(helper.make_graph(nodes, "ids", [x], outs),
                          opset_imports=[helper.make_opsetid("", 17)])
    f = apollo_py.jit(m, target="reference")
    v = np.array([-1, 0, 2], np.float32)
    a, b, c = f(v)
    np.testing.assert_array_equal(a, v)
    np.testing.assert_array_equal(b, np.maximum(v, 0))
    np.testing.assert_array_equal(c, np.maximum(v, 0))
    g = f.plan.graph
    assert g.outputs == ("a", "b", "c")
    assert all(n.source for n in g.nodes)
    assert {n.source for n in g.nodes} <= {("id_a",), ("relu",), ("id_b",), ("id_c",)}


def test_demo_runs(capsys):
    import demo
    demo.main("softmax_chain")
    out = capsys.readouterr().out
    assert "y: shape (4, 12) float32" in out and "plan for 'softmax_chain'" in out
