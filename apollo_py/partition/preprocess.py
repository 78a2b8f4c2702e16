"""Preprocessing passes (DESIGN §3): pure Graph -> Graph rewrites run before partitioning.

Every pass expects a verified graph and returns a verified graph with the same inputs (names,
order, types) and the same output names in the same order.  When a rewrite makes a graph
output an alias of another value, that value is renamed to the output's name; where that is
impossible (the value is a graph input or another output) an identity copy is inserted —
``broadcast_to`` to the value's own shape, which is elementwise and never simplified away.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from ..errors import ApolloError
from ..ir.graph import Attrs, ConstArray, Graph, Node
from ..ir.verify import verify
from ..ops.registry import FALLBACK, get_op, has_op
from ..options import Options
from ..ops.evaluate import run_nodes

# Results of up to this many elements are always folded; larger ones only when they are no
# bigger than the constants they are computed from (a transpose of a weight folds, a
# broadcast_to or iota to a large shape stays a cheap op instead of becoming a big constant).
FOLD_MAX_ELEMENTS = 1 << 16


def _foldable(node: Node) -> bool:
    return node.op != "constant" and has_op(node.op) and get_op(node.op).kind != FALLBACK


def _rebuild(graph: Graph, nodes: list[Node], repl: dict[str, str]) -> Graph:
    """``graph`` with ``nodes``, every value in ``repl`` replaced by its (transitive) target and
    the graph's output names kept (by renaming the target or inserting an identity copy)."""
    def resolve(v: str) -> str:
        while v in repl:
            v = repl[v]
        return v

    nodes = [n if not any(v in repl for v in n.inputs) else n.replace(inputs=tuple(resolve(v) for v in n.inputs))
             for n in nodes]
    out_set = set(graph.outputs)
    produced = {o for n in nodes for o in n.outputs}
    rename: dict[str, str] = {}
    copies: list[tuple[str, str]] = []
    for o in dict.fromkeys(graph.outputs):
        r = resolve(o)
        if r == o:
            continue
        if r in rename:
            copies.append((o, rename[r]))
        elif r in out_set or r not in produced:      # another output, or a graph input
            copies.append((o, r))
        else:
            rename[r] = o
    if rename:
        nodes = [n.replace(inputs=tuple(rename.get(v, v) for v in n.inputs),
                           outputs=tuple(rename.get(v, v) for v in n.outputs))
                 if any(v in rename for v in n.inputs + n.outputs) else n for n in nodes]
    for o, src in copies:
        src = rename.get(src, src)
        nodes.append(Node("broadcast_to", (src,), (o,), Attrs({"shape": graph.types[o].shape}), name=f"{o}_copy"))
    live = set(graph.inputs) | {o for n in nodes for o in n.outputs}
    types = {v: t for v, t in graph.types.items() if v in live}
    return verify(graph.replace(nodes=tuple(nodes), types=types))


def fold_constants(graph: Graph) -> Graph:
    """Evaluate nodes whose inputs are all constants with the numpy references and replace them
    by constant nodes (same output names).  Results larger than ``FOLD_MAX_ELEMENTS`` that are
    bigger than their inputs stay unfolded; nodes whose reference fails stay as they are."""
    consts: dict[str, np.ndarray] = {}
    nodes = []
    for n in graph.nodes:
        if n.op == "constant":
            consts[n.outputs[0]] = n.attrs["value"].array
        elif _foldable(n) and all(v in consts for v in n.inputs):
            out_size = sum(graph.types[o].size for o in n.outputs)
            in_size = sum(consts[v].size for v in n.inputs)
            if out_size <= max(FOLD_MAX_ELEMENTS, in_size):
                env = {v: consts[v] for v in n.inputs}
                try:
                    run_nodes([n], env, graph.types)
                except ApolloError:
                    nodes.append(n)
                    continue
                for o in n.outputs:
                    consts[o] = env[o]
                    nodes.append(Node("constant", (), (o,), Attrs({"value": ConstArray(env[o])}),
                                      name=n.name, source=n.source))
                continue
        nodes.append(n)
    return _rebuild(graph, nodes, {})


def eliminate_common_subexpressions(graph: Graph) -> Graph:
    """Merge nodes with the same op, attributes, inputs and output types (constants by value).

    A duplicate whose output is a graph output is kept when the first copy's output is one too
    (both names must survive); FALLBACK ops are never merged."""
    seen: dict[tuple, Node] = {}
    repl: dict[str, str] = {}
    outs = set(graph.outputs)
    nodes = []
    for n in graph.nodes:
        if any(v in repl for v in n.inputs):
            n = n.replace(inputs=tuple(repl.get(v, v) for v in n.inputs))
        if not _foldable(n) and n.op != "constant":
            nodes.append(n)
            continue
        key = (n.op, n.attrs, n.inputs, tuple(graph.types[o] for o in n.outputs))
        first = seen.get(key)
        if first is not None and not (any(o in outs for o in n.outputs) and any(o in outs for o in first.outputs)):
            repl.update(zip(n.outputs, first.outputs))
            continue
        seen.setdefault(key, n)
        nodes.append(n)
    return _rebuild(graph, nodes, repl)


def eliminate_dead_code(graph: Graph) -> Graph:
    """Remove nodes none of whose outputs reaches a graph output (graph inputs always stay)."""
    live = set(graph.outputs)
    keep = []
    for n in reversed(graph.nodes):
        if any(o in live for o in n.outputs):
            keep.append(n)
            live.update(n.inputs)
    if len(keep) == len(graph.nodes):
        return graph
    return _rebuild(graph, keep[::-1], {})


def _is_all(arr: np.ndarray | None, value: int) -> bool:
    return arr is not None and arr.size > 0 and bool(np.all(arr == value))


# op -> (operand position of the kept value, identity constant) pairs
_IDENTITIES = {"mul": ((0, 1), (1, 1)), "add": ((0, 0), (1, 0)), "sub": ((0, 0),), "div": ((0, 1),)}


def simplify_algebra(graph: Graph) -> Graph:
    """Algebraic identities, applied only where the result has the same shape and dtype as the
    value it is replaced by (so broadcasting and promotion are never lost):
    x*1, 1*x, x+0, 0+x, x-0, x/1 -> x; cast to the value's own dtype -> x; transpose of a
    transpose -> one transpose with the composed perm (none if the perm is the identity);
    reshape of a reshape -> one reshape (none if it restores the shape); a pad of all-zero
    widths and a unit-step slice of the whole tensor -> x."""
    repl: dict[str, str] = {}
    producer: dict[str, Node] = {}
    nodes: list[Node] = []
    types = graph.types

    def const(v: str):
        p = producer.get(v)
        return p.attrs["value"].array if p is not None and p.op == "constant" else None

    for n in graph.nodes:
        if any(v in repl for v in n.inputs):
            n = n.replace(inputs=tuple(repl.get(v, v) for v in n.inputs))
        alias = None
        out_t = types[n.outputs[0]] if len(n.outputs) == 1 else None
        if n.op in _IDENTITIES and out_t is not None:
            for keep, ident in _IDENTITIES[n.op]:
                x, c = n.inputs[keep], n.inputs[1 - keep]
                if types[x] == out_t and _is_all(const(c), ident):
                    alias = x
                    break
        elif n.op == "cast" and types[n.inputs[0]] == out_t:
            alias = n.inputs[0]
        elif n.op == "transpose":
            perm = tuple(n.attrs["perm"])
            inner = producer.get(n.inputs[0])
            src = n.inputs[0]
            if inner is not None and inner.op == "transpose":
                p1 = tuple(inner.attrs["perm"])
                perm = tuple(p1[i] for i in perm)
                src = inner.inputs[0]
            if perm == tuple(range(len(perm))):
                alias = src
            elif src != n.inputs[0]:
                n = n.replace(inputs=(src,), attrs=n.attrs.with_(perm=perm),
                              source=tuple(dict.fromkeys(inner.source + n.source)))
        elif n.op == "pad" and types[n.inputs[0]] == out_t and not any(int(p) for p in n.attrs["pads"]):
            alias = n.inputs[0]     # Swin's window padding of a size already a window multiple
        elif n.op == "slice" and types[n.inputs[0]] == out_t and all(int(s) == 1 for s in n.attrs["steps"]):
            alias = n.inputs[0]     # the whole tensor (same shape, unit steps: starts are 0)
        elif n.op == "reshape":
            inner = producer.get(n.inputs[0])
            src = n.inputs[0]
            if inner is not None and inner.op == "reshape":
                src = inner.inputs[0]
            if types[src] == out_t:
                alias = src
            elif src != n.inputs[0]:
                n = n.replace(inputs=(src,), source=tuple(dict.fromkeys(inner.source + n.source)))
        if alias is not None:
            repl[n.outputs[0]] = alias
            continue
        for o in n.outputs:
            producer[o] = n
        nodes.append(n)
    if not repl and all(a is b for a, b in zip(nodes, graph.nodes)):
        return graph
    return _rebuild(graph, nodes, repl)


def fold_conv_affine(graph: Graph) -> Graph:
    """BatchNorm / per-channel affine chains after a conv folded into its constant weight and
    one bias add (partition/conv_fold.py)."""
    from .conv_fold import fold_conv_affine as fold
    return fold(graph, _rebuild)


def refine_reshapes(graph: Graph) -> Graph:
    """Regions split by a reshape (GroupNorm's channel groups) rewritten to one refined shape,
    so that layer 2 stitches across the reshapes (partition/refine_reshape.py)."""
    from .refine_reshape import refine_reshapes as refine
    return refine(graph, _rebuild)


PASSES: tuple[Callable[[Graph], Graph], ...] = (fold_constants, fold_conv_affine, simplify_algebra, refine_reshapes,
                                                 eliminate_common_subexpressions, eliminate_dead_code)


def _same_nodes(a: Graph, b: Graph) -> bool:
    """True when ``a`` and ``b`` have the same nodes by name and op with the very same attribute
    objects (a round that rebuilt the graph without changing it): no content hashing."""
    if a is b:
        return True
    if len(a.nodes) != len(b.nodes) or tuple(a.inputs) != tuple(b.inputs) or tuple(a.outputs) != tuple(b.outputs):
        return False
    return all(x is y or (x.op == y.op and x.inputs == y.inputs and x.outputs == y.outputs and x.attrs is y.attrs)
               for x, y in zip(a.nodes, b.nodes))


def preprocess(graph: Graph, options: Options) -> Graph:
    """Run the preprocessing passes in order until nothing changes (at most 4 rounds); the
    graph unchanged when ``options.preprocess`` is False."""
    if not options.preprocess:
        return graph
    for _ in range(4):
        before = graph
        for p in PASSES:
            graph = p(graph)
        # identity first: a round that changed nothing returns the very graph, and comparing
        # graphs hashes every constant's content (0.7 s of a 500 MB GPT-2 export's compile)
        if _same_nodes(graph, before) or (len(graph.nodes) == len(before.nodes) and graph == before):
            break
    return graph
