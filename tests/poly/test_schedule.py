"""One-group schedules under a budget (poly.schedule)."""
import time

import islpy as isl
import pytest

import graphs
from apollo_py.poly.schedule import (BudgetExceeded, budget, build_fused_schedule, check_legal,
                                     isl_schedule, schedule_program, tile_outer_band)
from apollo_py.poly.statements import build_program, compute_dependences


def _prog(g):
    return build_program(list(g.nodes), g.types, list(g.inputs), list(g.outputs))


def _ast(prog, sched):
    return isl.AstBuild.from_context(prog.context).node_from_schedule(sched)


def _loops(node):
    """Nested structure of for loops: list of (iterator, children) — user nodes dropped."""
    t = node.get_type()
    if t == isl.ast_node_type.for_:
        return [("for", _loops(node.for_get_body()))]
    if t == isl.ast_node_type.block:
        lst = node.block_get_children()
        return [x for k in range(lst.n_ast_node()) for x in _loops(lst.get_at(k))]
    if t == isl.ast_node_type.if_:
        return _loops(node.if_get_then_node())
    return []


def test_softmax_one_row_loop_with_three_inner_loops():
    p = _prog(graphs.softmax(64, 128))
    fs, deps = schedule_program(p, compute_dependences, 200_000)
    assert fs.strategy == "direct" and fs.band == 1 and fs.band_extents == (64,)
    assert _loops(_ast(p, fs.schedule)) == [("for", [("for", []), ("for", []), ("for", [])])]
    assert check_legal(fs.schedule, deps, p)


def test_layernorm_one_row_loop_with_three_inner_loops():
    p = _prog(graphs.layernorm(8, 32))
    fs, _ = schedule_program(p, compute_dependences, 200_000)
    assert _loops(_ast(p, fs.schedule)) == [("for", [("for", []), ("for", []), ("for", [])])]


def test_listing1_bias_maxpool_one_nest():
    p = _prog(graphs.bias_maxpool(1, 4, 8, 8))
    fs, deps = schedule_program(p, compute_dependences, 200_000)
    assert fs.band == 3 and fs.band_extents == (4, 4, 4)      # (c, h/2, w/2); n = 1 dropped
    ast = _loops(_ast(p, fs.schedule))
    assert len(ast) == 1                                       # one nest
    text = _ast(p, fs.schedule).to_C_str()
    assert "2 * c1" in text                                    # loop scaling: h in [2*oh, 2*oh+1]


def test_listing3_bias_reduce_fused_inside_kept_dims():
    p = _prog(graphs.bias_reduce13(3, 4, 5, 6))
    fs, _ = schedule_program(p, compute_dependences, 200_000)
    assert fs.band == 2 and fs.band_extents == (3, 5)
    assert _loops(_ast(p, fs.schedule)) == [("for", [("for", [("for", [("for", [])])])])]
    text = _ast(p, fs.schedule).to_C_str()
    # bias and the update share the innermost loop body
    body = text[text.index("S0("):]
    assert "S1(" in body and "for" not in body.split("S1(")[0]


def test_isl_scheduler_fallback_gives_one_group_for_softmax():
    p = _prog(graphs.softmax(16, 32))
    deps = compute_dependences(p)
    with budget(p.ctx, 200_000):
        sched, band, ext = isl_schedule(p, deps)
    assert band >= 1 and ext[0] == 16
    assert check_legal(sched, deps, p)


def test_illegal_tree_is_rejected():
    p = _prog(graphs.softmax(4, 8))
    deps = compute_dependences(p)
    good, _, _ = build_fused_schedule(p, deps)
    # divide first, then everything else: the divide would read sums not yet computed
    bad = isl.Schedule(
        '{ domain: "%s", child: { sequence: [ { filter: "{ S4[i0, i1] }" }, '
        '{ filter: "{ I0[i0, i1]; S0[i0, i1]; S1[i0, i1]; S2[i0, i1]; I3[i0, i1]; S3[i0, i1] }" } ] } }'
        % str(p.domain()), context=p.ctx)
    assert check_legal(good, deps, p) and not check_legal(bad, deps, p)


def test_budget_exceeded_raises_quickly():
    p = _prog(graphs.layernorm(8, 32))
    t0 = time.perf_counter()
    with pytest.raises(BudgetExceeded):
        schedule_program(p, compute_dependences, 50)
    assert time.perf_counter() - t0 < 2.0
    assert p.ctx.get_max_operations() == 0          # budget lifted afterwards


def test_tiling_outer_band():
    p = _prog(graphs.bias_reduce13(8, 2, 8, 2))
    fs, _ = schedule_program(p, compute_dependences, 200_000)
    tiled = tile_outer_band(fs.schedule, fs.band, (4, 4))
    assert tiled.get_root().child(0).band_n_member() == 2
    assert tiled.get_root().child(0).child(0).band_n_member() == 2    # point band


def test_any_budget_either_schedules_or_raises_budget_exceeded():
    """Running out mid-way (e.g. inside the schedule-tree parser) is still BudgetExceeded; the
    smallest budget runs out, the largest schedules, and once one schedules so do all larger."""
    p = _prog(graphs.layernorm(8, 32))
    outcomes = []
    for ops in (2_000, 20_000, 45_000, 70_000, 95_000, 120_000, 1_000_000):
        try:
            fs, deps = schedule_program(p, compute_dependences, ops)
        except BudgetExceeded:
            outcomes.append(False)
            continue
        assert check_legal(fs.schedule, deps, p)
        outcomes.append(True)
    assert outcomes[0] is False and outcomes[-1] is True, outcomes
    assert outcomes == sorted(outcomes), outcomes       # monotone in the budget
