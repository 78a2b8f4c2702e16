"""Algorithm 1 on known patterns: pinned micro-graphs (ops, kinds, rules), after Table 1."""
import numpy as np
import pytest
from partition_graphs import (bert_encoder, log_softmax_graph, matmul_bias_relu, residual_layernorm_gelu,
                    seed_example2, shuffle_graph, softmax_graph)

import apollo_py as ap
from apollo_py import GraphBuilder, Options
from apollo_py.partition import (canonical_order, classify_node, find_clusters, load_rules, partition,
                                 preprocess)
from apollo_py.partition.aggregate import aggregate
from apollo_py.partition.execute import run_micro_graphs
from apollo_py.runtime.reference import evaluate


def summary(graph, options=Options()):
    return [(m.kind, list(m.rules), list(m.ops)) for m in partition(graph, options)]


def test_seed_example2():
    assert summary(seed_example2()) == [
        ("reduction", ["1", "4"], ["exp", "neg", "reduce_sum"]),
        ("elementwise", [], ["sqrt"]),
    ]


def test_softmax():
    assert summary(softmax_graph()) == [
        ("reduction", [], ["reduce_max"]),
        ("reduction", ["3", "5"], ["sub", "exp", "reduce_sum"]),
        ("broadcast", [], ["div"]),
    ]


def test_log_softmax():
    assert summary(log_softmax_graph()) == [
        ("reduction", [], ["reduce_max"]),
        ("reduction", ["3", "5"], ["sub", "exp", "reduce_sum"]),
        ("broadcast", ["2"], ["log", "sub"]),
    ]


def test_scaled_softmax_reduction_takes_outside_elementwise():
    b = GraphBuilder()
    x = b.input("x", (4, 8))
    s = x * 0.125
    m = b.reduce_max(s, axes=(1,), keepdims=True)
    e = b.exp(s - m)
    g = b.build([e / b.reduce_sum(e, axes=(1,), keepdims=True)])
    assert summary(g) == [
        ("reduction", ["4"], ["mul", "reduce_max"]),
        ("reduction", ["3", "5"], ["sub", "exp", "reduce_sum"]),
        ("broadcast", [], ["div"]),
    ]


def test_residual_layernorm_gelu():
    assert summary(residual_layernorm_gelu()) == [
        ("reduction", ["4"], ["add", "reduce_sum"]),
        ("reduction", ["2", "3", "5"], ["mul", "sub", "mul", "reduce_sum"]),
        ("broadcast", ["1", "1", "1", "1", "1", "1", "2", "3", "3b", "3b"],
         ["mul", "add", "rsqrt", "mul", "mul", "add", "div", "mul", "erf", "add", "mul"]),
    ]


def test_matmul_bias_relu_is_one_opaque_micro_graph():
    assert summary(matmul_bias_relu()) == [("opaque", ["3", "6"], ["matmul", "add", "relu"])]


def test_transpose_takes_no_epilogue():
    b = GraphBuilder()
    x = b.input("x", (4, 8))
    g = b.build([b.relu(b.transpose(x, perm=(1, 0)))])
    assert summary(g) == [("opaque", [], ["transpose"]), ("elementwise", [], ["relu"])]


def test_reshape_then_elementwise_stays_apart():
    b = GraphBuilder()
    x = b.input("x", (4, 8))
    g = b.build([b.exp(b.reshape(x, shape=(32,))) + 1.0])
    assert summary(g) == [("opaque", [], ["reshape"]), ("elementwise", ["1"], ["exp", "add"])]


def test_merge_that_would_make_a_cycle_is_refused():
    # a -> reduce -> c and a -> c: rule 2 may not merge a into c (path through the reduction)
    b = GraphBuilder()
    x = b.input("x", (4, 8))
    a = b.exp(x)
    r = b.reduce_sum(a, axes=(1,), keepdims=True)
    g = b.build([a - r])
    assert summary(g) == [("reduction", ["4"], ["exp", "reduce_sum"]), ("broadcast", [], ["sub"])]


def test_classes_of_primitives():
    b = GraphBuilder()
    x, y = b.input("x", (4, 8)), b.input("y", (4, 1))
    nodes = [b.exp(x), b.add(x, y), b.mul(x, 2.0), b.reduce_sum(x, axes=(1,)), b.reshape(x, shape=(32,)),
             b.matmul(x, b.transpose(x, perm=(1, 0)))]
    g = b.build(nodes)
    cls = {n.outputs[0]: classify_node(g, n) for n in g.nodes}
    assert [cls[v.name] for v in nodes] == ["elementwise", "broadcast", "elementwise", "reduction", "opaque",
                                             "opaque"]


def test_multi_output_micro_graph():
    b = GraphBuilder()
    x = b.input("x", (4, 8))
    a = b.exp(x)
    c = b.neg(a)
    g = b.build([a, b.reshape(c, shape=(32,))])
    ms = partition(g, Options())
    assert [m.ops for m in ms] == [("exp", "neg"), ("reshape",)]
    assert ms[0].outputs == (a.name, c.name) and ms[0].inputs == ("x",)


def test_constants_are_data_not_members():
    g = matmul_bias_relu()
    (m,) = partition(g, Options())
    const = next(n.outputs[0] for n in g.nodes if n.op == "constant")
    assert const in m.inputs and "constant" not in m.ops
    assert len(find_clusters(g)) == 1


def _fallback_node(b, x):
    import onnx
    node = onnx.helper.make_node("Sin", ["a"], ["b"])
    return b.onnx_op(x, node=node.SerializeToString().hex(), opset=17, op_type="Sin",
                     out_types=((x.shape, "float32"),))


def test_fallback_op_splits_clusters():
    b = GraphBuilder()
    x = b.input("x", (4, 8))
    a = b.exp(x)
    s = _fallback_node(b, a)
    g = b.build([b.neg(s) + a])
    assert len(find_clusters(g)) == 1       # exp -> add connects them; acyclicity keeps exp apart
    assert summary(g) == [("elementwise", [], ["exp"]), ("fallback", [], ["onnx_op"]),
                          ("elementwise", ["1"], ["neg", "add"])]
    feeds = {"x": np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)}
    np.testing.assert_allclose(ap.jit(g)(**feeds), evaluate(g, feeds)[0], rtol=1e-6, atol=1e-7)  # cpu exp: ~1 ulp


def test_fallback_op_in_a_chain_makes_two_clusters():
    b = GraphBuilder()
    x = b.input("x", (4, 8))
    g = b.build([b.neg(_fallback_node(b, b.exp(x))) * 2.0])
    assert len(find_clusters(g)) == 2
    ms = partition(g, Options())
    assert [m.kind for m in ms] == ["elementwise", "fallback", "elementwise"]
    assert ms[0].cluster != ms[2].cluster and ms[1].cluster == -1


def test_canonical_order_ignores_node_order_and_names():
    g = residual_layernorm_gelu()
    h = shuffle_graph(g, seed=3)
    assert [n.op for n in g.nodes] != [n.op for n in h.nodes]
    assert [g.nodes[k].op for k in canonical_order(g)] == [h.nodes[k].op for k in canonical_order(h)]


def test_signature_is_name_and_shape_independent():
    s1 = partition(softmax_graph((4, 8)), Options())
    s2 = partition(softmax_graph((2, 3, 16)), Options())
    assert [m.signature for m in s1] == [m.signature for m in s2]
    assert s1[1].signature == "sub:bc($0,$1) exp:ew(0) reduce_sum:red(1)"


def test_signature_separates_operand_roles():
    def graph(swap):
        b = GraphBuilder()
        x, y = b.input("x", (4,)), b.input("y", (4,))
        a, c = b.exp(x), b.neg(b.exp(y))
        return b.build([b.sub(c, a) if swap else b.sub(a, c)])
    s_a = partition(graph(False), Options())[0].signature
    s_b = partition(graph(True), Options())[0].signature
    assert s_a != s_b


def test_plan_table_and_json():
    plan = ap.explain(residual_layernorm_gelu())
    assert len(plan.micro_graphs) == 3
    text = str(plan)
    assert "3 micro-graphs" in text and "2,3,5" in text and "reduce_sum" in text
    import json
    doc = json.loads(plan.to_json())
    assert doc["micro_graphs"][0]["ops"] == ["add", "reduce_sum"]
    assert doc["micro_graphs"][0]["kind"] == "reduction"
    assert set(doc["micro_graphs"][0]) >= {"kind", "rules", "ops", "sources", "inputs", "outputs", "signature"}


def test_source_nodes_in_plan():
    g = bert_encoder(layers=1, batch=1, seq=4, hidden=8, heads=2, ffn=16)
    plan = ap.explain(g)
    ln = [m for m in plan.micro_graphs if m.rules == ("1", "1", "2", "3b", "3b")]
    assert ln and ln[0].source_nodes == ("l0_ln1",)
    assert "<- l0_ln1" in str(plan)


def test_compiled_graph_plan_and_execution_by_micro_graphs():
    g = residual_layernorm_gelu()
    f = ap.jit(g)
    rng = np.random.default_rng(1)
    feeds = {v: rng.standard_normal(g.types[v].shape).astype(np.float32) for v in g.inputs}
    np.testing.assert_allclose(f(**feeds), evaluate(g, feeds)[0], rtol=1e-5, atol=1e-6)
    assert [m.kind for m in f.plan.micro_graphs] == ["reduction", "reduction", "broadcast"]


def test_executor_detects_broken_partition():
    g = softmax_graph()
    ms = partition(g, Options())
    feeds = {"x": np.ones((4, 8), np.float32)}
    with pytest.raises(ap.CompileError, match="reads"):
        run_micro_graphs(g, list(reversed(ms)), feeds)


def test_bert_layer_plan():
    g = preprocess(bert_encoder(layers=2, batch=1, seq=8, hidden=16, heads=2, ffn=32), Options())
    ms = aggregate(g, load_rules())
    kinds = [m.kind for m in ms]
    assert kinds.count("fallback") == 0
    # per layer: q/k/v matmul+bias, the FFN matmul+bias+GELU are opaque with epilogues (rule 6)
    epilogues = [m for m in ms if m.kind == "opaque" and "6" in m.rules]
    assert len(epilogues) == 2 * 4
    sigs = [m.signature for m in ms]
    half = len(ms) // 2
    assert sigs[:half] == sigs[half:]      # the two layers partition identically


def test_explain_onnx_log_softmax_reduction_fuses_outside_op():
    from onnx import TensorProto, helper
    nodes = [helper.make_node("Mul", ["a", "a"], ["x"], name="sq"),
             helper.make_node("LogSoftmax", ["x"], ["y"], axis=-1, name="lsm")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("a", TensorProto.FLOAT, [4, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])])
    plan = ap.explain(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
    assert [(m.kind, list(m.rules), list(m.ops), list(m.source_nodes)) for m in plan.micro_graphs] == [
        ("reduction", ["4"], ["mul", "reduce_max"], ["lsm", "sq"]),
        ("reduction", ["3", "5"], ["sub", "exp", "reduce_sum"], ["lsm"]),
        ("broadcast", ["2"], ["log", "sub"], ["lsm"]),
    ]
