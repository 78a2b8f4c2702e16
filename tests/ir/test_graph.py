"""Graph IR: builder, structural hashing, verifier errors."""
import numpy as np
import pytest

import apollo_py as ap
from apollo_py.errors import GraphError, ShapeError
from apollo_py.ir import Graph, GraphBuilder, Node, TensorType, verify


def _mlp(prefix="", order=0):
    b = GraphBuilder("mlp")
    x = b.input(prefix + "x", (4, 8))
    w = b.constant(np.arange(8 * 3, dtype=np.float32).reshape(8, 3))
    bias = b.constant(np.ones(3, np.float32))
    if order:
        h = b.add(b.matmul(x, w, name=prefix + "mm"), bias, name=prefix + "ad")
    else:
        h = b.matmul(x, w) + bias
    return b.build([b.relu(h)])


def test_builder_types_and_operators():
    b = GraphBuilder()
    x = b.input("x", (2, 3))
    y = b.input("y", (3,))
    z = (x + y) * 2.0 - x / y
    assert z.type == TensorType((2, 3), "float32")
    s = b.reduce_sum(z, axes=(1,), keepdims=True)
    assert s.shape == (2, 1)
    c = b.lt(x, y)
    assert c.dtype == "bool"
    g = b.build([s, c])
    assert [n.op for n in g.nodes][:3] == ["add", "constant", "mul"]


def test_structural_hash_ignores_names():
    g1, g2 = _mlp(), _mlp(prefix="p_", order=1)
    assert g1.structural_key == g2.structural_key
    assert g1 == g2 and hash(g1) == hash(g2)


def test_structural_hash_sees_attrs_and_constants():
    b = GraphBuilder()
    x = b.input("x", (4, 8))
    g1 = b.build([b.reduce_sum(x, axes=(0,))])
    b = GraphBuilder()
    x = b.input("x", (4, 8))
    g2 = b.build([b.reduce_sum(x, axes=(1,))])
    assert g1 != g2
    b = GraphBuilder()
    x = b.input("x", (4, 8))
    g3 = b.build([x + 1.0])
    b = GraphBuilder()
    x = b.input("x", (4, 8))
    g4 = b.build([x + 2.0])
    assert g3 != g4


def test_shape_errors_name_the_node():
    b = GraphBuilder()
    x = b.input("x", (2, 3))
    y = b.input("y", (4,))
    with pytest.raises(ShapeError, match="my_add"):
        b.add(x, y, name="my_add")
    with pytest.raises(ShapeError, match="mm"):
        b.matmul(x, x, name="mm")
    with pytest.raises(ShapeError, match="unknown attribute"):
        b.reduce_sum(x, axes=(0,), bogus=1)


def test_verifier_rejects_bad_graphs():
    t = TensorType((2,), "float32")
    ok = Node("exp", ("x",), ("y",), name="e")
    with pytest.raises(GraphError, match="'e2'.*not defined"):
        verify(Graph(("x",), ("z",), (Node("exp", ("w",), ("z",), name="e2"),), {"x": t, "z": t}))
    with pytest.raises(GraphError, match="already assigned"):
        verify(Graph(("x",), ("y",), (ok, Node("neg", ("x",), ("y",), name="n")), {"x": t, "y": t}))
    # a cycle: two nodes reading each other's outputs cannot be topologically ordered
    cyc = (Node("exp", ("b",), ("a",), name="n1"), Node("exp", ("a",), ("b",), name="n2"))
    with pytest.raises(GraphError, match="cycle"):
        verify(Graph((), ("a",), cyc, {"a": t, "b": t}))
    with pytest.raises(ShapeError, match="declared output types"):
        verify(Graph(("x",), ("y",), (ok,), {"x": t, "y": TensorType((3,), "float32")}))


def test_dtypes():
    for dt in ["float32", "float16", "float64", "int32", "int64", "bool"]:
        assert TensorType((1,), dt).dtype == dt
    with pytest.raises(ShapeError):
        TensorType((1,), "complex64")


def test_reference_jit_on_builder_graph():
    g = _mlp()
    f = ap.jit(g, target="reference")
    x = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
    w = np.arange(24, dtype=np.float32).reshape(8, 3)
    np.testing.assert_allclose(f(x), np.maximum(x @ w + 1, 0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(f(x=x), f(x), rtol=0, atol=0)
