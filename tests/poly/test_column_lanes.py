"""Column lanes (poly/column_lanes.py): a fold over non-adjacent axes with the kept loop moved
inside the fold -- the same numbers as the per-row nest lanes, against numpy and bit for bit."""
import numpy as np
import pytest

import apollo_py as ap
from apollo_py.codegen import loopir as L
from apollo_py.poly.ast_to_loopir import lane_reductions, mark_loops

llvm = pytest.importorskip("apollo_py.codegen.llvm")


def _listing3_ir(N, J, K, W, op="add"):
    """y[n, k] = fold_{j, l} (x[n, j, k, l] + b[j]) as isl writes it: n, k kept; j, l folded."""
    x, b = L.Param("x", "float32", N * J * K * W), L.Param("b", "float32", J)
    y = L.Param("y", "float32", N * K)
    n, k, j, l = L.Var("n"), L.Var("k"), L.Var("j"), L.Var("l")
    s = L.Local("s", "float32", 0.0)
    init = {"add": 0.0, "max": float("-inf")}[op]
    fold = L.Store(y, n * K + k, L.Bin(op, y[n * K + k], s.var))
    body = L.for_("n", 0, N, L.for_("k", 0, K, L.block(
        L.Store(y, n * K + k, L.as_expr(init, "float32")),
        L.for_("j", 0, J, L.for_("l", 0, W, L.block(
            L.Assign("s", x[((n * J + j) * K + k) * W + l] + b[j]), fold))))))
    return (x, b, y), s, body


def _compile(N, J, K, W, op, column_lanes):
    params, s, body = _listing3_ir(N, J, K, W, op)
    body, allocs = lane_reductions(body, {"s"}, 16, column_lanes=column_lanes)
    body, pvar, pext = mark_loops(body, True)
    kernel = L.Kernel(f"cols_{column_lanes}", params, L.block(s, *allocs, body), pvar, pext)
    L.verify_kernel(kernel)
    return kernel, llvm.compile_llvm(kernel)


@pytest.mark.parametrize("N,J,K,W,op", [(2, 8, 3, 32, "add"), (3, 5, 7, 48, "add"), (2, 6, 5, 16, "max"),
                                        (1, 3, 64, 64, "add")])
def test_column_lanes_give_the_nest_lanes_numbers_bit_for_bit(N, J, K, W, op):
    rng = np.random.default_rng(N * J * K * W)
    x = rng.standard_normal(N * J * K * W).astype(np.float32)
    b = rng.standard_normal(J).astype(np.float32)
    k_new, new = _compile(N, J, K, W, op, 4096)
    k_old, old = _compile(N, J, K, W, op, 0)
    assert "cols_" in L.format_node(k_new.body) and "cols_" not in L.format_node(k_old.body)
    y_new, y_old = np.full(N * K, np.nan, np.float32), np.full(N * K, np.nan, np.float32)
    new([x, b, y_new])
    old([x, b, y_old])
    np.testing.assert_array_equal(y_new, y_old)
    a = x.reshape(N, J, K, W).astype(np.float64) + b.astype(np.float64)[None, :, None, None]
    want = a.sum(axis=(1, 3)) if op == "add" else a.max(axis=(1, 3))
    np.testing.assert_allclose(y_new.reshape(N, K), want, rtol=1e-5, atol=1e-5)
    # a chunk of the parallel loop writes only its rows
    part = np.full(N * K, -7.0, np.float32)
    new([x, b, part], 0, 1)
    np.testing.assert_array_equal(part[:K], y_new[:K])
    assert (part[K:] == -7.0).all()


def test_column_lanes_only_where_they_fit_and_read_contiguously():
    # W not a multiple of 16, K * W over the lane budget, or the outermost (parallel) loop: no rewrite
    for (N, J, K, W), budget in [((2, 4, 5, 20), 4096), ((2, 4, 64, 128), 4096), ((2, 4, 8, 32), 255)]:
        params, s, body = _listing3_ir(N, J, K, W)
        out, _ = lane_reductions(body, {"s"}, 16, column_lanes=budget)
        assert "cols_" not in L.format_node(out)
    params, s, body = _listing3_ir(1, 4, 8, 32)
    out, _ = lane_reductions(body.body, {"s"}, 16)          # k outermost: it becomes the parallel loop
    assert "cols_" not in L.format_node(out)
    # a fold over the trailing axes (reads already contiguous per k) keeps its order:
    # y[n, k] = sum_{j, l} x[n, k, j, l]
    x, y = L.Param("x", "float32", 2 * 4 * 8 * 32), L.Param("y", "float32", 2 * 4)
    n, k, j, l = L.Var("n"), L.Var("k"), L.Var("j"), L.Var("l")
    body = L.for_("n", 0, 2, L.for_("k", 0, 4, L.block(
        L.Store(y, n * 4 + k, L.as_expr(0.0, "float32")),
        L.for_("j", 0, 8, L.for_("l", 0, 32, L.Store(y, n * 4 + k, y[n * 4 + k] + x[((n * 4 + k) * 8 + j) * 32 + l]))))))
    out, _ = lane_reductions(body, set(), 16)
    assert "cols_" not in L.format_node(out)


@pytest.mark.parametrize("shape,axes,what", [((2, 8, 3, 32), (1, 3), "sum"), ((3, 5, 7, 48), (1, 3), "sum"),
                                              ((4, 6, 10, 20), (1, 3), "sum"), ((2, 16, 9, 64), (1, 3), "mean_sqrt"),
                                              ((3, 4, 6, 32), (1, 3), "max"), ((2, 3, 4, 5, 32), (1, 4), "sum")])
def test_graphs_with_middle_kept_axes_match_numpy(shape, axes, what):
    rng = np.random.default_rng(len(shape) * 7 + shape[-1])
    xv = rng.standard_normal(shape).astype(np.float32)
    bias_shape = tuple(d if i == axes[0] else 1 for i, d in enumerate(shape))
    bv = rng.standard_normal(bias_shape).astype(np.float32)
    b = ap.GraphBuilder("cols")
    x, bias = b.input("x", shape), b.input("bias", bias_shape)
    a = x + bias
    if what == "max":
        y = b.reduce_max(a, axes=axes, keepdims=False)
    elif what == "mean_sqrt":
        y = b.sqrt(b.abs(b.reduce_sum(a, axes=axes, keepdims=False)))
    else:
        y = b.reduce_sum(a, axes=axes, keepdims=False)
    f = ap.jit(b.build([y]), target="cpu")
    got = f(xv, bv)
    a64 = xv.astype(np.float64) + bv
    want = a64.max(axis=axes) if what == "max" else a64.sum(axis=axes)
    if what == "mean_sqrt":
        want = np.sqrt(np.abs(want))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert len(f.plan.kernels) == 1, f.plan
    # every case swaps its loops but the one whose rows (20) are not whole 16-lane vectors
    assert ("cols_" in f.plan.kernels[0].source("c")) == (shape[-1] % 16 == 0)
