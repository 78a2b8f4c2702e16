"""Graph verifier: acyclic, single assignment, every value defined and typed consistently."""
from __future__ import annotations

from ..errors import GraphError, ShapeError
from .graph import Graph
from .optable import op_table


def verify(graph: Graph) -> Graph:
    """Check IR invariants of ``graph`` and return it; GraphError/ShapeError naming the node.

    Checks: each value assigned once; every node input is defined before use (which also
    rules out cycles, since ``nodes`` must be topologically ordered); outputs are defined;
    every value has a type; each node's declared output types match its op's shape rule.
    """
    table = op_table()
    defined: set[str] = set()
    for v in graph.inputs:
        if v in defined:
            raise GraphError(f"graph input {v!r} is declared twice")
        if v not in graph.types:
            raise GraphError(f"graph input {v!r} has no type")
        defined.add(v)
    for n in graph.nodes:
        for v in n.inputs:
            if v not in defined:
                raise GraphError(f"node {n.label!r} ({n.op}) reads {v!r}, which is not defined before it "
                                 "(undefined value or a cycle)")
        for o in n.outputs:
            if o in defined:
                raise GraphError(f"node {n.label!r} ({n.op}) assigns {o!r}, which is already assigned")
            if o not in graph.types:
                raise GraphError(f"node {n.label!r} ({n.op}) output {o!r} has no type")
            defined.add(o)
        if table.has(n.op):
            want = table.infer_types(n.op, [graph.types[v] for v in n.inputs], n.attrs, n.label)
            got = [graph.types[o] for o in n.outputs]
            if want != got:
                raise ShapeError(f"node {n.label!r} ({n.op}): declared output types "
                                 f"{[str(t) for t in got]} but the op gives {[str(t) for t in want]}")
    for v in graph.outputs:
        if v not in defined:
            raise GraphError(f"graph output {v!r} is not defined")
    return graph
