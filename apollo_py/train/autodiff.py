"""Reverse-mode automatic differentiation over primitive graphs.

:func:`grad` appends, to a copy of a graph, the reverse sweep of vector-Jacobian products (one
rule per primitive, :mod:`.rules` and :mod:`.window_rules`).  Only values that depend on a
``wrt`` input get cotangents, so constants and data inputs cost nothing in the backward graph.
"""
from __future__ import annotations

from typing import Sequence

from ..errors import GraphError, InputError, UnsupportedOpError
from ..ir.builder import GraphBuilder, Value
from ..ir.graph import Graph
from ..ir.types import FLOAT_DTYPES
from . import prims  # noqa: F401  (registers scatter_add, which gather's VJP emits)
from .graphs import ones, replay, zeros
from .rules import NON_DIFFERENTIABLE, RULES as _BASIC
from .window_rules import RULES as _WINDOW

RULES = {**_BASIC, **_WINDOW}


def differentiable_ops() -> frozenset[str]:
    """Names of the primitives that have a VJP rule."""
    return frozenset(RULES)


def append_gradients(b: GraphBuilder, graph: Graph, vals: dict[str, Value], loss: str,
                     wrt: Sequence[str], seed: Value | None = None) -> list[Value]:
    """Append to ``b`` the reverse sweep of ``graph`` (already replayed into ``b`` as ``vals``).

    ``loss`` is the value differentiated, seeded with ``seed`` (default: ones of its shape, i.e.
    the gradient of ``sum(loss)``).  Returns one gradient per name in ``wrt``, each with that
    input's type; an input the loss does not depend on gets zeros.
    """
    needs: set[str] = set()
    for w in wrt:
        if graph.types[w].dtype not in FLOAT_DTYPES:
            raise InputError(f"cannot differentiate with respect to {w!r}: dtype "
                             f"{graph.types[w].dtype} is not a float type")
        needs.add(w)
    for n in graph.nodes:
        if any(v in needs for v in n.inputs):
            needs.update(o for o in n.outputs if graph.types[o].dtype in FLOAT_DTYPES)

    ct: dict[str, Value] = {}
    if loss in needs:
        lt = graph.types[loss]
        ct[loss] = seed if seed is not None else ones(b, lt.shape, lt.dtype)
    for n in reversed(graph.nodes):
        cts = [ct.get(o) for o in n.outputs]
        if all(c is None for c in cts) or n.op in NON_DIFFERENTIABLE:
            continue
        want = [v in needs for v in n.inputs]
        if not any(want):
            continue
        if len(n.outputs) != 1:
            raise UnsupportedOpError(n.op, n.label, "gradient rules cover single-output primitives")
        rule = RULES.get(n.op)
        if rule is None:
            raise UnsupportedOpError(n.op, n.label, "has no gradient rule (needed because it "
                                     f"depends on {sorted(set(n.inputs) & needs)})")
        b.set_source(*(n.source or (n.name,)))
        outs = rule(b, n, [vals[v] for v in n.inputs], vals[n.outputs[0]], cts[0], want)
        for v, need, gv in zip(n.inputs, want, outs):
            if not need or gv is None:
                continue
            if gv.shape != graph.types[v].shape or gv.dtype != graph.types[v].dtype:
                raise GraphError(f"node {n.label!r} ({n.op}): gradient rule returned {gv.type} for "
                                 f"input {v!r} of type {graph.types[v]}")
            ct[v] = b.add(ct[v], gv) if v in ct else gv
    b.set_source()
    out = []
    for w in wrt:
        t = graph.types[w]
        out.append(ct[w] if w in ct else zeros(b, t.shape, t.dtype))
    return out


def grad(graph: Graph, wrt: Sequence[str], loss: str | int | None = None) -> Graph:
    """A graph with ``graph``'s inputs whose outputs are ``graph``'s outputs followed by
    d(loss)/d(w) for each input name ``w`` in ``wrt`` (same shapes and dtypes as the inputs).

    ``loss`` picks the differentiated output by name or position (default: the first output).
    A non-scalar loss is differentiated as the sum of its elements (cotangent all ones).
    Integer and bool values carry no gradient; an input the loss does not depend on gets zeros.
    Raises InputError for unknown names, UnsupportedOpError for an op without a VJP rule.
    """
    wrt = list(wrt)
    for w in wrt:
        if w not in graph.inputs:
            raise InputError(f"grad: {w!r} is not an input of graph {graph.name!r}; inputs are "
                             f"{list(graph.inputs)}")
    if loss is None:
        if not graph.outputs:
            raise InputError(f"grad: graph {graph.name!r} has no outputs")
        loss = graph.outputs[0]
    elif isinstance(loss, int):
        if not 0 <= loss < len(graph.outputs):
            raise InputError(f"grad: output index {loss} out of range ({len(graph.outputs)} outputs)")
        loss = graph.outputs[loss]
    elif loss not in graph.outputs:
        raise InputError(f"grad: {loss!r} is not an output of graph {graph.name!r}; outputs are "
                         f"{list(graph.outputs)}")
    b = GraphBuilder(graph.name + "_grad")
    env = {v: b.input(v, graph.types[v].shape, graph.types[v].dtype) for v in graph.inputs}
    vals = replay(b, graph, env)
    grads = append_gradients(b, graph, vals, loss, wrt)
    return b.build([vals[o] for o in graph.outputs] + grads)
