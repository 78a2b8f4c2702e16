"""Canonical reduce forms (poly.reduce_forms)."""
import pytest

import graphs
from apollo_py.poly.reduce_forms import ALL, X, Y, classify_reduce, micro_graph_reduce_form


@pytest.mark.parametrize("shape,axes,kind,P,R,transposed", [
    ((8, 16), (1,), X, 8, 16, False),
    ((8, 16), (0,), Y, 16, 8, False),
    ((8, 16), (0, 1), ALL, 1, 128, False),
    ((2, 3, 4), (1, 2), X, 2, 12, False),
    ((2, 3, 4), (0, 1), Y, 4, 6, False),
    ((3, 4, 5, 6), (1, 3), X, 15, 24, True),      # seed listing 3 -> 4
    ((3, 4, 5, 6), (0, 2), Y, 24, 15, True),
    ((1, 16, 1), (1,), ALL, 1, 16, False),          # unit dims do not count
    ((4, 1, 16), (2,), X, 4, 16, False),
])
def test_classify(shape, axes, kind, P, R, transposed):
    f = classify_reduce(shape, axes)
    assert (f.kind, f.P, f.R, f.transposed) == (kind, P, R, transposed)


def test_listing3_permutation_and_shape():
    f = classify_reduce((3, 4, 5, 6), (1, 3))
    assert f.perm == (0, 2, 1, 3) and f.shape == (15, 24)


def test_micro_graph_form():
    g = graphs.softmax(4, 16)
    assert micro_graph_reduce_form(g.nodes, g.types).kind == X
    g = graphs.bias_maxpool()
    assert micro_graph_reduce_form(g.nodes, g.types) is None
