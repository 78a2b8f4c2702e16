"""Compound-op decompositions built directly with a GraphBuilder, against numpy."""
from __future__ import annotations

import numpy as np
import pytest

import apollo_py as ap
from apollo_py.ops import compound as C
from apollo_py.ops import compound_index as CI
from apollo_py.ops.compound_einsum import einsum

RNG = np.random.default_rng(0)


def run(build, *arrays):
    """Build a graph from inputs shaped like ``arrays`` with ``build(b, *values)`` and run it."""
    b = ap.GraphBuilder("t")
    ins = [b.input(f"x{k}", a.shape, a.dtype.name) for k, a in enumerate(arrays)]
    out = build(b, *ins)
    return ap.jit(b.build(out if isinstance(out, (list, tuple)) else [out]), target="reference").run(*arrays)


EINSUM = [("ij,jk->ik", [(2, 3), (3, 4)]), ("bij,bjk->bik", [(2, 2, 3), (2, 3, 4)]), ("i,i", [(5,), (5,)]),
          ("ij->ji", [(2, 3)]), ("ii->i", [(3, 3)]), ("...ii->...i", [(2, 3, 3)]), ("ij,kj", [(2, 3), (4, 3)]),
          ("bhqd,bhkd->bhqk", [(2, 3, 4, 5), (2, 3, 6, 5)]), ("i,j->ij", [(3,), (4,)]),
          ("ijk,jl,lm->ikm", [(2, 3, 4), (3, 5), (5, 2)]), ("...j,j->...", [(2, 3, 4), (4,)]),
          ("ab,ab->", [(2, 3), (2, 3)]), ("bij,bjk->bik", [(1, 2, 3), (5, 3, 4)])]


@pytest.mark.parametrize("eq,shapes", EINSUM)
def test_einsum(eq, shapes):
    arrs = [RNG.standard_normal(s).astype(np.float32) for s in shapes]
    got = run(lambda b, *xs: einsum(b, eq, xs), *arrs)[0]
    np.testing.assert_allclose(got, np.einsum(eq, *arrs), rtol=1e-5, atol=1e-5)


def test_einsum_bad_equation():
    with pytest.raises(ap.ShapeError, match="operands"):
        run(lambda b, x: einsum(b, "ij,jk->ik", [x]), np.zeros((2, 2), np.float32))


@pytest.mark.parametrize("last", [False, True])
def test_argmax_ties(last):
    x = np.array([[1, 3, 3, 0], [2, 2, 1, 2]], np.float32)
    got = run(lambda b, v: CI.arg_reduce(b, v, 1, False, last), x)[0]
    want = np.array([2, 3]) if last else np.array([1, 0])
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("exclusive,reverse", [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_cumsum(exclusive, reverse):
    x = RNG.standard_normal((3, 5)).astype(np.float32)
    want = np.flip(np.cumsum(np.flip(x, 0), 0), 0) if reverse else np.cumsum(x, 0)
    if exclusive:
        want = want - x
    got = run(lambda b, v: CI.cumsum(b, v, 0, bool(exclusive), bool(reverse)), x)[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_round_half_even():
    x = np.array([-2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 0.49, 1.51, -0.51], np.float32)
    np.testing.assert_array_equal(run(CI.round_half_even, x)[0], np.round(x))


def test_softmax_is_opened_into_the_paper_sequence():
    b = ap.GraphBuilder("sm")
    x = b.input("x", (2, 5))
    g = b.build([C.log_softmax(b, x, -1)])
    assert [n.op for n in g.nodes] == ["reduce_max", "sub", "exp", "reduce_sum", "log", "sub"]


@pytest.mark.parametrize("include_pad,ceil", [(False, False), (True, False), (False, True), (True, True)])
def test_avg_pool_counts(include_pad, ceil):
    x = RNG.standard_normal((1, 1, 6, 6)).astype(np.float32)
    got = run(lambda b, v: C.avg_pool(b, v, (2, 2), (2, 2), (1, 1, 0, 0), None, ceil, include_pad), x)[0]
    # padded size 7: floor mode gives 3 windows, ceil mode 4 (the last one half outside)
    n_out = 4 if ceil else 3
    xp = np.pad(x[0, 0], ((1, 1), (1, 1)), constant_values=np.nan)
    explicit = np.zeros((8, 8), bool)
    explicit[:7, :7] = True
    want = np.zeros((n_out, n_out), np.float32)
    for i in range(n_out):
        for j in range(n_out):
            win = xp[2 * i:2 * i + 2, 2 * j:2 * j + 2]
            if include_pad:
                # explicitly padded cells count, cells beyond the padding (ceil mode) do not
                want[i, j] = np.nansum(win) / explicit[2 * i:2 * i + 2, 2 * j:2 * j + 2].sum()
            else:
                want[i, j] = np.nanmean(win)
    np.testing.assert_allclose(got[0, 0], want, rtol=1e-6)
