"""The IR consults the op table that ``apollo_py.ops`` registers (ir/optable.py): builder
methods come from it, and the IR works with any table that answers the same questions."""
import pytest

import apollo_py as ap
from apollo_py.errors import GraphError, ShapeError, UnsupportedOpError
from apollo_py.ir import optable
from apollo_py.ir.types import TensorType


def test_builder_methods_come_from_the_registered_table():
    b = ap.GraphBuilder("g")
    assert "reduce_sum" in dir(b) and "logical_and" in dir(b)
    x = b.input("x", (2, 3))
    y = b.logical_not(b.gt(x, 0.0))            # alias of "not"
    assert y.type == TensorType((2, 3), "bool")
    assert ap.GraphBuilder.gt.__doc__           # kept on the class, with the op's doc
    with pytest.raises(AttributeError):
        b.no_such_op
    with pytest.raises(UnsupportedOpError, match="frobnicate"):
        b.op("frobnicate", x)


class _OneOp:
    """A table with a single op, ``twice``: the IR needs nothing else."""

    def has(self, op):
        return op == "twice"

    def names(self):
        return ["twice"]

    def doc(self, op):
        return "x + x"

    def normalize_attrs(self, op, attrs, node=""):
        if op != "twice":
            raise UnsupportedOpError(op, node, "not in this table")
        if attrs:
            raise ShapeError(f"node {node!r}: no attributes")
        return {}

    def infer_types(self, op, in_types, attrs, node=""):
        return [in_types[0]]


def test_the_ir_works_with_another_table(monkeypatch):
    monkeypatch.setattr(optable, "_table", _OneOp())
    b = ap.GraphBuilder("g")
    x = b.input("x", (4,))
    try:
        g = b.build([b.twice(x)])                 # built and verified through the table
    finally:
        del ap.GraphBuilder.twice                 # the method was kept on the class
    assert [n.op for n in g.nodes] == ["twice"]
    monkeypatch.setattr(optable, "_table", None)
    with pytest.raises(GraphError, match="no op table"):
        ap.ir.verify(g)
