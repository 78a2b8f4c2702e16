"""Canonical node order, compilability, primitive classes and clusters (DESIGN §4).

* :func:`canonical_order` — a topological order of a graph's nodes that depends only on its
  structure (not on node order or value names), used wherever the partitioner iterates.
* :func:`is_compilable` — constants are data, not computation; FALLBACK ops (run through an
  external reference) are not compiled; everything else in the registry is.
* :func:`classify_node` — the class of one primitive, computed from its isl relations.
* :func:`find_clusters` — the largest connected sets of compilable primitives; non-compilable
  ops split clusters and constants do not connect them.
"""
from __future__ import annotations

import hashlib

from ..errors import UnsupportedOpError
from ..ir.graph import Graph, Node
from ..ops.classify import classify
from ..ops.registry import FALLBACK, SOURCE, get_op, has_op

FALLBACK_CLASS = "fallback"


def canonical_order(graph: Graph) -> list[int]:
    """Indices of ``graph.nodes`` sorted by (depth, structural key of the first output, key of
    its uses).

    Depth is the longest path from graph inputs and constants, so the order is topological.
    Node order and value names do not influence it; nodes still tied compute the same thing
    from the same values for the same uses, and are interchangeable.
    """
    keys = graph.value_keys
    depth = node_levels(graph)
    fkey = [keys[n.outputs[0]] if n.outputs else n.op for n in graph.nodes]
    # Equal forward keys (the same computation twice, before CSE) are told apart by how the
    # values are used: a backward key over consumers' keys and operand positions.
    index = {id(n): k for k, n in enumerate(graph.nodes)}
    out_pos: dict[str, list[int]] = {}
    for p, v in enumerate(graph.outputs):
        out_pos.setdefault(v, []).append(p)
    cons = graph.consumers
    bkey = [""] * len(graph.nodes)
    for k in range(len(graph.nodes) - 1, -1, -1):
        uses = []
        for j, o in enumerate(graph.nodes[k].outputs):
            uses.extend(f"out{p}.{j}" for p in out_pos.get(o, ()))
            for c in cons.get(o, ()):
                kc = index[id(c)]
                uses.extend(f"{fkey[kc]}{bkey[kc]}@{p}.{j}" for p, v in enumerate(c.inputs) if v == o)
        bkey[k] = _sha("|".join(sorted(uses)))
    return sorted(range(len(graph.nodes)), key=lambda k: (depth[k], fkey[k], bkey[k], k))


def node_levels(graph: Graph) -> list[int]:
    """Per node, 1 + the longest path to it from graph inputs and constants (networkx's
    topological generations of the node DAG, counted from 1)."""
    index = {o: k for k, n in enumerate(graph.nodes) for o in n.outputs}
    import networkx as nx     # here, not at the top: ~0.2 s of imports
    dag = nx.DiGraph()
    dag.add_nodes_from(range(len(graph.nodes)))
    dag.add_edges_from((index[v], k) for k, n in enumerate(graph.nodes) for v in n.inputs if v in index)
    level = [0] * len(graph.nodes)
    for d, generation in enumerate(nx.topological_generations(dag), start=1):
        for k in generation:
            level[k] = d
    return level


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def is_compilable(node: Node) -> bool:
    """Whether ``node`` can belong to a cluster: a registered primitive that is neither a
    constant (data) nor a FALLBACK op.  UnsupportedOpError for ops the registry lacks."""
    if not has_op(node.op):
        raise UnsupportedOpError(node.op, node.label, "no primitive lowering and no reference implementation")
    return get_op(node.op).kind not in (SOURCE, FALLBACK)


def classify_node(graph: Graph, node: Node) -> str:
    """Class of a primitive node (elementwise/broadcast/reduction/opaque), or ``"fallback"``
    for an op that is not compiled."""
    if not is_compilable(node):
        return FALLBACK_CLASS
    return classify(node.op, tuple(graph.types[v] for v in node.inputs),
                    tuple(graph.types[o] for o in node.outputs), node.attrs)


def find_clusters(graph: Graph, order: list[int] | None = None) -> list[list[int]]:
    """Clusters of ``graph`` as lists of node indices (each in canonical order; clusters ordered
    by their first node).  Expects a verified graph; constants belong to no cluster, each
    non-compilable op is left out (it runs on its own)."""
    order = canonical_order(graph) if order is None else order
    index = {o: k for k, n in enumerate(graph.nodes) for o in n.outputs}
    ok = [is_compilable(n) for n in graph.nodes]
    import networkx as nx
    parts = nx.utils.UnionFind(k for k in range(len(graph.nodes)) if ok[k])
    for k, n in enumerate(graph.nodes):
        if not ok[k]:
            continue
        for v in n.inputs:
            j = index.get(v)
            if j is not None and ok[j]:
                parts.union(j, k)
    groups: dict[int, list[int]] = {}
    for k in order:
        if ok[k]:
            groups.setdefault(parts[k], []).append(k)
    return list(groups.values())
