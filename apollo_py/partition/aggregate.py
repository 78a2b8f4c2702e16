"""Aggregation of primitives into micro-graphs: Algorithm 1 of APOLLO (DESIGN §4).

Start with one micro-graph per primitive.  For each rule in priority order, repeat: find a
producer/consumer pair (G_p, G_c) of the same cluster whose classes match the rule and whose
merge keeps the micro-graph DAG acyclic, merge them into a micro-graph of the rule's result
class; until no pair matches.  Then the next rule.  Every merge removes a micro-graph, so it
terminates.

Determinism: micro-graphs are identified by the canonical position (see
:func:`~apollo_py.partition.clusters.canonical_order`) of their first primitive, and pairs are
searched producer by producer and consumer by consumer in that order — node order and value
names never matter.

Acyclicity: merging G_p and G_c creates a cycle iff there is a path from G_p to G_c other than
their direct edge; it is checked with networkx only when G_p has another successor and G_c
another predecessor (otherwise no such path can exist).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..ir.graph import Graph
from ..ops.classify import OPAQUE
from .clusters import canonical_order, classify_node, find_clusters
from .micrograph import MicroGraph
from .rules import Rule, RuleTable
from .signature import pattern_signature


@dataclass
class _Group:
    """Mutable working state of one micro-graph during aggregation (private)."""

    members: list[int]                 # canonical positions, sorted
    kind: str
    cluster: int
    rules: list[tuple[int, str]] = field(default_factory=list)   # (merge sequence no., rule id)
    opaque_ops: frozenset[str] = frozenset()


class _State:
    def __init__(self, graph: Graph, order: list[int]):
        self.graph = graph
        self.order = order                              # canonical position -> node index
        self.classes = [classify_node(graph, graph.nodes[k]) for k in order]
        import networkx as nx     # here, not at the top: ~0.2 s of imports
        self.dag = nx.DiGraph()
        self.groups: dict[int, _Group] = {}
        self.seq = 0
        pos_of = {k: p for p, k in enumerate(order)}
        producer = {o: pos_of[k] for k, n in enumerate(graph.nodes) for o in n.outputs}
        cluster_of = {}
        for c, members in enumerate(find_clusters(graph, order)):
            for k in members:
                cluster_of[pos_of[k]] = c
        for p, k in enumerate(order):
            n = graph.nodes[k]
            if n.op == "constant":
                continue
            cls = self.classes[p]
            self.groups[p] = _Group([p], cls, cluster_of.get(p, -1),
                                    opaque_ops=frozenset({n.op}) if cls == OPAQUE else frozenset())
            self.dag.add_node(p)
        for p, k in enumerate(order):
            if p not in self.groups:
                continue
            for v in graph.nodes[k].inputs:
                q = producer.get(v)
                if q is not None and q in self.groups and q != p:
                    self.dag.add_edge(q, p)

    def matches(self, rule: Rule, gp: int, gc: int) -> bool:
        p, c = self.groups[gp], self.groups[gc]
        if p.kind not in rule.producer or c.kind not in rule.consumer:
            return False
        if p.cluster != c.cluster or p.cluster < 0:
            return False
        if rule.producer_opaque_ops is not None and not (p.opaque_ops and p.opaque_ops <= rule.producer_opaque_ops):
            return False
        if rule.disabled_signatures and self.signature(p.members + c.members) in rule.disabled_signatures:
            return False
        return self.acyclic_merge(gp, gc)

    def acyclic_merge(self, gp: int, gc: int) -> bool:
        """True if contracting the edge gp -> gc leaves the DAG acyclic."""
        if self.dag.out_degree(gp) < 2 or self.dag.in_degree(gc) < 2:
            return True
        self.dag.remove_edge(gp, gc)
        try:
            import networkx as nx
            return not nx.has_path(self.dag, gp, gc)
        finally:
            self.dag.add_edge(gp, gc)

    def signature(self, members: list[int]) -> str:
        ms = sorted(members)
        return pattern_signature([self.graph.nodes[self.order[p]] for p in ms], [self.classes[p] for p in ms])

    def merge(self, rule: Rule, gp: int, gc: int) -> int:
        """Merge gc into gp (or gp into gc, keeping the smaller id); return the merged id."""
        keep, drop = min(gp, gc), max(gp, gc)
        p, c = self.groups[gp], self.groups[gc]
        self.seq += 1
        merged = _Group(sorted(p.members + c.members), rule.result, p.cluster,
                        sorted(p.rules + c.rules) + [(self.seq, rule.id)], p.opaque_ops | c.opaque_ops)
        for u in list(self.dag.predecessors(drop)):
            if u != keep:
                self.dag.add_edge(u, keep)
        for w in list(self.dag.successors(drop)):
            if w != keep:
                self.dag.add_edge(keep, w)
        self.dag.remove_node(drop)
        del self.groups[drop]
        self.groups[keep] = merged
        return keep

    def apply(self, rule: Rule) -> None:
        """Merge pairs matching ``rule`` until none is left."""
        changed = True
        while changed:
            changed = False
            for gid in sorted(self.groups):
                cur = gid
                while cur in self.groups and self.groups[cur].kind in rule.producer:
                    for succ in sorted(self.dag.successors(cur)):
                        if self.matches(rule, cur, succ):
                            cur = self.merge(rule, cur, succ)
                            changed = True
                            break
                    else:
                        break


def aggregate(graph: Graph, rules: RuleTable) -> tuple[MicroGraph, ...]:
    """Partition the primitives of ``graph`` into micro-graphs by ``rules`` (Algorithm 1).

    Expects a verified graph.  Returns the micro-graphs in a topological order of the
    micro-graph DAG (ties broken canonically); every non-constant node is in exactly one.
    Constants are data: they are inputs of the micro-graphs that read them.
    """
    order = canonical_order(graph)
    state = _State(graph, order)
    from ..deadline import check as check_deadline
    for rule in rules.rules:
        check_deadline("partition", f"rule {rule.id!r}")
        state.apply(rule)
    result = []
    import networkx as nx
    for gid in nx.lexicographical_topological_sort(state.dag):
        g = state.groups[gid]
        nodes = [graph.nodes[order[p]] for p in g.members]
        classes = [state.classes[p] for p in g.members]
        result.append(MicroGraph.build(graph, nodes, classes, g.kind, [r for _, r in g.rules], g.cluster))
    return tuple(result)
