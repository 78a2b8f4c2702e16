"""ap.export / CompiledGraph.to_onnx: standard ONNX ops, onnx.checker-clean, run by
onnxruntime against the compiled function; train_step's trained weights written back."""
from functools import partial

import numpy as np
import onnx
import pytest

import apollo_py as ap

from . import models as M

ort = pytest.importorskip("onnxruntime")
P = M.init(0)


def run_ort(model, feeds):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def op_types(model):
    return [n.op_type for n in model.graph.node]


def test_export_refolds_softmax_and_log_softmax_and_runs_in_onnxruntime():
    x = P["x_attn"]

    g, b = P["transformer"]["lnf_g"], P["transformer"]["lnf_b"]

    def f(x):
        return (ap.nn.softmax(x * 2.0), ap.nn.log_softmax(x, axis=1),
                np.exp(x - x.max(-1, keepdims=True)).sum(-1), ap.nn.layer_norm(x, g, b, eps=1e-3))
    m = ap.export(f, x)
    onnx.checker.check_model(m, full_check=True)
    ops = op_types(m)
    assert ops.count("Softmax") == 1 and ops.count("LogSoftmax") == 1 and ops.count("LayerNormalization") == 1
    assert "Exp" in ops      # the third output's exp is shared: not a softmax pattern
    ln = next(n for n in m.graph.node if n.op_type == "LayerNormalization")
    assert onnx.helper.get_attribute_value(ln.attribute[1] if ln.attribute[0].name == "axis" else ln.attribute[0]) \
        == pytest.approx(1e-3)
    used = {i for n in m.graph.node for i in n.input}
    assert all(t.name in used for t in m.graph.initializer)   # the folded chains' constants are gone
    assert [i.name for i in m.graph.input] == ["x"]
    assert [o.name for o in m.graph.output] == ["out[0]", "out[1]", "out[2]", "out[3]"]
    for got, want in zip(run_ort(m, {"x": x}), ap.jit(f)(x)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["mlp", "conv_block", "attention_block", "transformer"])
def test_exported_models_match_the_compiled_function(name):
    model, pk, xk = {"mlp": (M.mlp, "mlp", "x_mlp"), "conv_block": (M.conv_block, "conv", "x_conv"),
                     "attention_block": (M.attention_block, "attn", "x_attn"),
                     "transformer": (M.transformer, "transformer", "ids")}[name]
    f = ap.jit(partial(model, ap.nn))
    m = ap.export(f, P[pk], P[xk])
    onnx.checker.check_model(m, full_check=True)
    # inputs are named after the argument paths (``p.layers[0].wq``, ``ids``)
    from apollo_py.frontend.jit import flatten
    xname = "ids" if name == "transformer" else "x"
    arrays, paths, _ = flatten(P[pk], "p")
    feeds = dict(zip(paths, arrays))
    feeds[xname] = P[xk]
    assert [i.name for i in m.graph.input] == paths + [xname]
    got = run_ort(m, feeds)[0]
    np.testing.assert_allclose(got, f(P[pk], P[xk]), rtol=1e-4, atol=1e-5)


def test_export_of_control_flow_runs_in_onnxruntime():
    def f(x, y):
        r = ap.cond(x.sum() > 0, lambda a: a * 2 + y, lambda a: a - y, x)
        return ap.fori_loop(0, 3, lambda i, v: v * 0.5 + y, r)
    x, y = P["x_mlp"], P["x_mlp"][::-1].copy()
    m = ap.export(f, x, y)
    assert {"If", "Loop"} <= set(op_types(m))
    for xx in (x, -x):
        np.testing.assert_allclose(run_ort(m, {"x": xx, "y": y})[0], ap.jit(f)(xx, y), rtol=1e-5, atol=1e-6)


def test_compiled_graph_to_onnx_round_trips_an_imported_model():
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import workloads
    wl = workloads.build("bert_layer", quick=True)
    cg = ap.jit(wl.model)
    want = cg(**wl.inputs)
    m = cg.to_onnx()
    onnx.checker.check_model(m)
    assert "Softmax" in op_types(m)   # the imported Softmax came back as one node
    assert op_types(m).count("LayerNormalization") == 2
    np.testing.assert_allclose(run_ort(m, wl.inputs)[0], want, rtol=1e-4, atol=1e-4)


def test_train_step_export_onnx_writes_trained_weights(tmp_path):
    from onnx import TensorProto, helper, numpy_helper
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((4, 3)) * 0.1).astype(np.float32)
    b = np.zeros(3, np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Add", ["h", "b"], ["y"])]
    g = helper.make_graph(nodes, "lin", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8, 3])],
                          initializer=[numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    step = ap.train_step(model, loss="cross_entropy", optimizer=ap.optim.Adam(0.05))
    assert step.target is None  # the same compiled target as jit (Options.target, "cpu")
    x = rng.standard_normal((8, 4)).astype(np.float32)
    labels = rng.integers(0, 3, 8)
    losses = [step(x=x, labels=labels) for _ in range(20)]
    assert losses[-1] < losses[0]
    path = tmp_path / "trained.onnx"
    step.export_onnx(path)
    trained = onnx.load(path)
    onnx.checker.check_model(trained)
    inits = {t.name: numpy_helper.to_array(t) for t in trained.graph.initializer}
    np.testing.assert_array_equal(inits["w"], step.params["w"])
    assert not np.allclose(inits["w"], w)
    np.testing.assert_allclose(run_ort(trained, {"x": x})[0], x @ step.params["w"] + step.params["b"],
                               rtol=1e-5, atol=1e-6)
