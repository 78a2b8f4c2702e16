"""Statements, symbolic sizes and dependences of a micro-graph (poly.statements)."""
import islpy as isl

import graphs
from apollo_py.poly.statements import COMPUTE, INIT, UPDATE, build_program, compute_dependences


def _prog(g):
    return build_program(list(g.nodes), g.types, list(g.inputs), list(g.outputs))


def test_softmax_statements_are_symbolic_with_init_and_update():
    p = _prog(graphs.softmax(4, 16))
    assert [(s.name, s.role) for s in p.statements] == [
        ("I0", INIT), ("S0", UPDATE), ("S1", COMPUTE), ("S2", COMPUTE),
        ("I3", INIT), ("S3", UPDATE), ("S4", COMPUTE)]
    assert p.params == {"N4": 4, "N16": 16}
    s0 = p.stmt("S0")
    # sizes are parameters, fixed only by the context
    assert "N16" in str(s0.domain) and "16" not in str(s0.domain).replace("N16", "")
    assert p.context.is_equal(isl.Set("[N4, N16] -> { : N4 = 4 and N16 = 16 }", context=p.ctx))
    assert s0.acc_read is not None and s0.reducer == "max"
    assert all(s.domain.get_ctx() == p.ctx for s in p.statements)


def test_softmax_dependences_flow_and_accumulator_waw():
    p = _prog(graphs.softmax(4, 16))
    d = compute_dependences(p)
    flow = d.flow.intersect_params(p.context)

    def has(umap, text):
        m = isl.UnionMap(text, context=p.ctx).intersect_params(p.context)
        return m.is_subset(umap.intersect_params(p.context))

    # the last max update feeds every sub of the row
    assert has(flow, "[N4, N16] -> { S0[i, 15] -> S1[i, j] : 0 <= i < 4 and 0 <= j < 16 }")
    # accumulator chain and init -> first update
    assert has(flow, "[N4, N16] -> { S0[i, j] -> S0[i, j + 1] : 0 <= i < 4 and 0 <= j < 15 }")
    assert has(d.output, "[N4, N16] -> { I0[i, 0] -> S0[i, 0] : 0 <= i < 4 }")
    # exp feeds both the sum update and the divide
    assert has(flow, "[N4, N16] -> { S2[i, j] -> S3[i, j] : 0 <= i < 4 and 0 <= j < 16 }")
    assert has(flow, "[N4, N16] -> { S2[i, j] -> S4[i, j] : 0 <= i < 4 and 0 <= j < 16 }")


def test_window_reduce_and_scalar_input_accesses():
    p = _prog(graphs.bias_maxpool(1, 4, 8, 8))
    s0 = p.stmt("S0")
    bias = p.tensors["bias"]
    assert s0.reads[1].get_tuple_name(isl.dim_type.out) == bias
    assert s0.reads[1].dim(isl.dim_type.out) == 0          # scalar input: T[]
    upd = p.stmt("S1")
    assert upd.reducer == "max" and upd.domain.dim(isl.dim_type.set) == 6
